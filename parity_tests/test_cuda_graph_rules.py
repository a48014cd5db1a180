"""The compiled torch decode step keeps the rules CUDA graphs need, checked without a GPU.

On a GPU, `torch.compile(mode="reduce-overhead")` replays the step as a CUDA graph, and inductor quietly falls back
to launching every kernel (a warning, no error) when the graph holds a CPU tensor, an op whose output size depends
on data or that reads a value back to the host, or an in-place write to an input whose address is not static. Such a
fallback would show up only as a slow GPU run. The step's own code takes its non-CPU branches on any device that is
not the CPU, so it runs here on the meta device (shapes, no data) with `torch.compiler.is_compiling()` true, as dynamo
traces it:
- a host read (`.item()`, `.tolist()`, a tensor's truth value) or a data-dependent op (`nonzero`, boolean indexing)
  raises on meta, so the step running at all rules them out;
- every tensor it makes must be on the model's device (a `torch.tensor(x)` without `device=` would be a CPU one);
- every tensor it writes in place must be one it made, or one of the cache's buffers, which are marked as static
  addresses (the graph is recorded on them).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_cache import generate as torch_generate
from torch_cache.cache import StaticCache, make_cache
from torch_cache.model import DecoderLayer, Mistral
from twincache.config import MistralConfig
from twincache.generation import SamplingParams

CONFIG = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
BATCH = 2
CACHE_LEN = 32
# A static cache's step reads a partial bucket (a prefix of its buffers); a ring's reads its W slots.
ATTEND = {"static": 16, "sliding_window": CONFIG.sliding_window}
SAMPLINGS = {"greedy": SamplingParams(), "temperature": SamplingParams(temperature=0.7, seed=3),
             "filtered": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)}


class _OpLog(TorchDispatchMode):
    """Every aten op the step runs: (op, tensors it wrote in place, tensors it returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[torch._ops.OpOverload, list[torch.Tensor], list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = []
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                written += [value] if isinstance(value, torch.Tensor) else []
        returned = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        self.ops.append((func, written, returned))
        return out


def run_step_on_meta(cache_kind: str, sampling_kind: str,
                     ) -> tuple[Mistral, StaticCache, tuple[torch.Tensor, ...], _OpLog, list[torch.Tensor]]:
    """One decode step of a meta-device model, with the arguments continue_generation gives it. Returns the model,
    the cache, the step's outputs, its op log and the step's tensor inputs."""
    with torch.device("meta"):
        model = Mistral(CONFIG).to(torch.bfloat16).eval().requires_grad_(False)
    device = model.device
    cache = make_cache(cache_kind, CONFIG, BATCH, CACHE_LEN, torch.bfloat16, device)
    sampling = SAMPLINGS[sampling_kind]
    kind = torch_generate._sampling_kind(sampling)
    assert kind == sampling_kind
    inputs = [
        torch.zeros(BATCH, 1, dtype=torch.long, device=device),  # input_ids [B, 1]
        torch.zeros(BATCH, 1, dtype=torch.long, device=device),  # positions [B, 1]
    ]
    flags = [
        torch.zeros(BATCH, dtype=torch.bool, device=device),  # finished [B]
        torch_generate._eos_tensor(CONFIG, CONFIG.eos_token_ids, device),  # eos [E]
        torch.zeros(BATCH, dtype=torch.long, device=device),  # forced [B]
        torch.tensor(False, device=device),  # forcing []
        torch_generate._StepKey(sampling.seed, device).tensor,  # step_key []
        torch_generate._sampling_bits(kind, BATCH, CONFIG.vocab_size, device),  # index_bits
        *torch_generate._knobs(sampling, device),  # temperature, top_k, top_p
    ]
    step = torch_generate._decode_one_fn(model, compile=False)
    log = _OpLog()
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(torch.compiler, "is_compiling", lambda: True)  # the branches dynamo traces
        # The layer's compiled region (nested_compile_region) would take torch's own compiling path; its body is
        # what dynamo traces
        patch.setattr(DecoderLayer, "forward_in_place", inspect.unwrap(DecoderLayer.forward_in_place))
        with log:
            outputs = step(*inputs, cache, ATTEND[cache_kind], *flags, kind)
    return model, cache, outputs, log, [*inputs, *flags]


def storage(tensor: torch.Tensor) -> int:
    """Its storage's identity: views share it (the op log keeps every tensor alive, so none is reused)."""
    return tensor.untyped_storage()._cdata


@pytest.mark.parametrize("sampling_kind", sorted(SAMPLINGS))
@pytest.mark.parametrize("cache_kind", ["static", "sliding_window"])
def test_the_decode_step_makes_every_tensor_on_its_device_and_writes_only_static_buffers(cache_kind, sampling_kind):
    model, cache, outputs, log, inputs = run_step_on_meta(cache_kind, sampling_kind)
    assert [tuple(t.shape) for t in outputs] == [(BATCH, CONFIG.vocab_size), (BATCH,), (BATCH,), (BATCH, 1),
                                                 (BATCH + 1,)], "logits, tokens, finished, positions, for_host"
    assert len(log.ops) > 50, "the op log saw the whole step"
    elsewhere = sorted({f"{op} -> {t.device}" for op, _, returned in log.ops for t in returned
                        if t.device != model.device})
    assert not elsewhere, f"tensors made off the model's device (a CPU tensor keeps the step out of CUDA graphs): " \
                          f"{elsewhere}"

    buffers = {storage(t): t for t in cache.arrays()}
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in buffers.values()), \
        "the cache's buffers are marked as static addresses"
    written = [(str(op), storage(t)) for op, targets, _ in log.ops for t in targets]
    assert {s for _, s in written} & set(buffers), "the step writes the cache in place"
    not_static = {storage(t) for t in [*inputs, *model.parameters(), *model.buffers()]} - set(buffers)
    unsafe = sorted({op for op, s in written if s in not_static})
    assert not unsafe, f"in-place writes to a step input or a weight, whose address is not static: {unsafe}"
