"""`twincache parity`: every implementation's distance to the float64 truth, beside transformers' own (the floor).

The reference is transformers' MistralForCausalLM (LlamaForCausalLM for a Llama directory) in float64: the float64 model
chooses the greedy continuation of each prompt itself, then one uncached forward per row over prompt + continuation
gives the reference logits of every step and the reference K/V of every position. Each implementation (torch eager and
compiled, JAX step and fused, with each cache) is teacher-forced with that continuation through its real decode path
(its backend's `generate(..., mode=..., forced_tokens=...)`, from the registry), and its step logits and final cache are
compared with the reference. The floor is transformers in the dtype under test, run the same uncached way. The verdict
rule lives in twincache/parity_metrics.py and is explained, with its calibration, in docs/design.md §4 and
docs/parity.md.

The reference shares no code with the product: each row runs alone and unpadded, so transformers builds its own
positions and mask, and its K/V come from hooks on its own projections and rotary embedding. Without transformers,
torch_cache in float64 stands in for the reference (and torch_cache in the dtype under test for the floor), and the
output says so. Backends and transformers are imported when a run needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from twincache import parity_metrics
from twincache.checkpoint import load_config, resolve_dtype
from twincache.default_model import default_model_dir
from twincache.errors import InputError, NonFiniteLogitsError
from twincache.generation import CACHE_KINDS, check_positions, validate_prompts
from twincache.mesh import MeshShape, split_mesh
from twincache.parity_metrics import Distance
from twincache_app.backends import BACKENDS
from twincache_app.generate_cmd import (
    add_model_arguments,
    model_config,
    notices_on_stderr,
    resolve_prompts,
    set_window,
    start_mesh,
)
from twincache_app.hf_loading import transformers_model

NOT_INSTALLED = "transformers is not installed"
# Every implementation: each mode of each backend, labelled backend:mode ("torch:compiled", ..., "jax:step").
IMPLEMENTATIONS = tuple(f"{name}:{mode}" for name, backend in BACKENDS.items() for mode in backend.modes)
DEFAULTS = tuple(f"{name}:{backend.default_mode}" for name, backend in BACKENDS.items())


def resolve_implementations(selection: Sequence[str]) -> list[str]:
    """`--modes` words to implementation labels: "all", "default" (each backend's default mode), or labels."""
    chosen: list[str] = []
    for word in selection:
        labels = IMPLEMENTATIONS if word == "all" else DEFAULTS if word == "default" else [word]
        for label in labels:
            if label not in IMPLEMENTATIONS:
                raise InputError(f"--modes {word} is not an implementation; give all, default or any of "
                                 f"{', '.join(IMPLEMENTATIONS)}")
            if label not in chosen:
                chosen.append(label)
    return chosen


def direct_pairs(implementations: Sequence[str]) -> list[tuple[str, str]]:
    """Every pair of implementations from different backends: torch vs JAX directly."""
    return [(first, second) for i, first in enumerate(implementations) for second in implementations[i + 1:]
            if first.split(":")[0] != second.split(":")[0]]


# --- the reference and the floor: per-row, unpadded forwards that share nothing with twincache ---------------------

@dataclasses.dataclass
class Oracle:
    """One model's outputs over prompt + continuation, per row (rows may differ in length).

    logits [B, N, V] float64: the logits that predict continuation token i, for i < N.
    keys, values: per row, [layers, kv_heads, L, head_dim] float64 at positions 0..L-1, where L = prompt + N - 1
    (every token that a decode of N steps feeds to the model).
    """

    source: str
    logits: np.ndarray
    keys: list[np.ndarray]
    values: list[np.ndarray]


@dataclasses.dataclass
class Reference(Oracle):
    """The float64 oracle plus the greedy continuation it chose: tokens [B, N]."""

    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    # steps whose uncached float64 argmax differs from the token the float64 greedy loop chose (an exact tie): 0
    self_disagreements: int = 0


def _is_transformers(model: Any) -> bool:
    return type(model).__module__.startswith("transformers.")


def _cache_keyword(hf_model: Any) -> str:
    """transformers renamed the forward's cache argument (past_key_values -> cache); take whichever it has."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def float64_rope(hf_model: Any) -> Iterator[None]:
    """A float64 transformers model computing RoPE in float64 while inside (any other dtype: as it is).

    transformers computes RoPE's inverse frequencies, angles, cos and sin in float32 in every dtype (a float32
    inv_freq buffer; its forward casts positions to float32) and only casts cos/sin to the model's dtype. In the float64
    truth that float32 rounding is an error of about position x 6e-8 radians (2e-3 in cos at 32k positions), shared
    with transformers' float32 floor, which computes the same float32 values: an implementation that rounds its angles
    any other way (JAX's XLA rewrites 1 / theta**e as theta**-e) was judged 17x past the floor at 5,000 positions
    though it is as close to exact RoPE as transformers. Computed in float64 here, the truth is float64 throughout."""
    import torch

    rotary = hf_model.model.rotary_emb
    if next(hf_model.parameters()).dtype != torch.float64:
        yield
        return
    config = hf_model.config
    rope = getattr(config, "rope_parameters", None)  # transformers 5; 4.x has rope_theta
    theta = float(rope["rope_theta"] if isinstance(rope, dict) and "rope_theta" in rope else config.rope_theta)
    dim = 2 * rotary.inv_freq.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # [D/2]
    scaling = float(getattr(rotary, "attention_scaling", 1.0))  # 1.0: only plain RoPE is read

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].double() * inv_freq.to(position_ids.device)  # [B, S, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
        return (angles.cos() * scaling).to(x.dtype), (angles.sin() * scaling).to(x.dtype)

    rotary.forward = forward  # an instance attribute: nn.Module's __call__ (and its hooks) run it
    try:
        yield
    finally:
        del rotary.forward


def transformers_greedy(hf_model: Any, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, from transformers' own cached decoding (EOS does not stop it)."""
    import torch
    from transformers import DynamicCache

    device = next(hf_model.parameters()).device
    cache, keyword = DynamicCache(), _cache_keyword(hf_model)
    ids = torch.tensor([prompt], device=device)  # [1, P]
    tokens: list[int] = []
    with torch.inference_mode(), float64_rope(hf_model):
        while len(tokens) < steps:
            logits = hf_model(input_ids=ids, use_cache=True, **{keyword: cache}).logits[0, -1]  # [V]
            tokens.append(int(logits.argmax()))
            ids = torch.tensor([[tokens[-1]]], device=device)
    return tokens


def transformers_oracle(hf_model: Any, prompts: list[list[int]], tokens: list[list[int]], source: str) -> Oracle:
    """Uncached forwards of `hf_model`, one per row over prompt + tokens; K/V captured from its own modules."""
    import torch

    # its own model's rotary function (modeling_mistral's or modeling_llama's)
    apply_rotary_pos_emb = sys.modules[type(hf_model).__module__].apply_rotary_pos_emb
    device = next(hf_model.parameters()).device
    layers = hf_model.model.layers
    captured: dict[str, Any] = {}

    def keep(name: str) -> Any:  # a forward hook that stores its module's output
        return lambda module, args, output: captured.__setitem__(name, output)

    hooks = [hf_model.model.rotary_emb.register_forward_hook(keep("rope"))]
    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.k_proj.register_forward_hook(keep(f"k{i}")))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(keep(f"v{i}")))
    logits, keys, values = [], [], []
    kv_heads, head_dim = hf_model.config.num_key_value_heads, layers[0].self_attn.head_dim
    try:
        with torch.inference_mode(), float64_rope(hf_model):
            for prompt, row_tokens in zip(prompts, tokens, strict=True):
                sequence = torch.tensor([prompt + row_tokens], device=device)  # [1, P + N]
                out = hf_model(input_ids=sequence, use_cache=False).logits[0]  # [P + N, V]
                logits.append(out[len(prompt) - 1:-1].double().cpu().numpy())  # [N, V]
                cos, sin = captured["rope"]
                row_keys, row_values = [], []
                for i in range(len(layers)):
                    k = captured[f"k{i}"].view(1, -1, kv_heads, head_dim).transpose(1, 2)  # [1, Hkv, P + N, D]
                    v = captured[f"v{i}"].view(1, -1, kv_heads, head_dim).transpose(1, 2)  # [1, Hkv, P + N, D]
                    _, k = apply_rotary_pos_emb(k, k, cos, sin)
                    row_keys.append(k[0, :, :-1].double().cpu().numpy())  # [Hkv, L, D]
                    row_values.append(v[0, :, :-1].double().cpu().numpy())
                keys.append(np.stack(row_keys))  # [layers, Hkv, L, D]
                values.append(np.stack(row_values))
    finally:
        for hook in hooks:
            hook.remove()
    return Oracle(source, np.stack(logits), keys, values)


def torch_cache_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """The fallback reference's continuation: torch_cache's own model, one token at a time (EOS does not stop it)."""
    import torch

    from torch_cache.cache import StaticCache

    weight = model.model.embed_tokens.weight
    cache = StaticCache(model.config, 1, len(prompt) + steps, weight.dtype, weight.device)
    ids = torch.tensor([prompt], device=weight.device)  # [1, P]
    positions = torch.arange(len(prompt), device=weight.device)[None]  # [1, P]
    tokens: list[int] = []
    with torch.inference_mode():
        while len(tokens) < steps:
            tokens.append(int(model(ids, positions, cache)[0, -1].argmax()))
            ids, positions = torch.tensor([[tokens[-1]]], device=weight.device), positions[:, -1:] + 1
    return tokens


def torch_cache_oracle(model: Any, prompts: list[list[int]], tokens: list[list[int]], source: str) -> Oracle:
    """The fallback: torch_cache's model, one forward per row over the whole sequence into a fresh static cache."""
    import torch

    from torch_cache.cache import StaticCache

    weight = model.model.embed_tokens.weight
    logits, keys, values = [], [], []
    with torch.inference_mode():
        for prompt, row_tokens in zip(prompts, tokens, strict=True):
            sequence = prompt + row_tokens
            cache = StaticCache(model.config, 1, len(sequence), weight.dtype, weight.device)
            out = model(torch.tensor([sequence], device=weight.device),
                        torch.arange(len(sequence), device=weight.device)[None], cache)[0]  # [P + N, V]
            logits.append(out[len(prompt) - 1:-1].double().cpu().numpy())
            keys.append(np.stack([k[0, :, :-1].double().cpu().numpy() for k in cache.keys]))  # [layers, Hkv, L, D]
            values.append(np.stack([v[0, :, :-1].double().cpu().numpy() for v in cache.values]))
    return Oracle(source, np.stack(logits), keys, values)


def float64_reference(model: Any, prompts: list[list[int]], steps: int,
                      why_not_transformers: str = NOT_INSTALLED) -> Reference:
    """The truth: the float64 model's own greedy continuation of each prompt, then its uncached outputs over it.
    `model` is transformers' MistralForCausalLM (or LlamaForCausalLM) in float64, or (fallback) torch_cache's Mistral
    in float64."""
    if _is_transformers(model):
        tokens = [transformers_greedy(model, prompt, steps) for prompt in prompts]
        oracle = transformers_oracle(model, prompts, tokens, f"transformers {type(model).__name__}, float64, uncached")
    else:
        tokens = [torch_cache_greedy(model, prompt, steps) for prompt in prompts]
        oracle = torch_cache_oracle(model, prompts, tokens,
                                    f"torch_cache Mistral, float64 ({why_not_transformers})")
    disagreements = int((oracle.logits.argmax(-1) != np.asarray(tokens)).sum())
    return Reference(**dataclasses.asdict(oracle), tokens=tokens, self_disagreements=disagreements)


def floor_oracle(model: Any, prompts: list[list[int]], tokens: list[list[int]], dtype: str,
                 why_not_transformers: str = NOT_INSTALLED) -> Oracle:
    """The floor's outputs: transformers (or, as the fallback, torch_cache) in the dtype under test, uncached."""
    if _is_transformers(model):
        return transformers_oracle(model, prompts, tokens, f"transformers {type(model).__name__}, {dtype}, uncached")
    return torch_cache_oracle(model, prompts, tokens,
                              f"torch_cache Mistral, {dtype}, uncached ({why_not_transformers})")


# --- the implementations under test: real decode paths, teacher-forced ----------------------------------------------

@dataclasses.dataclass
class Run:
    """One implementation's teacher-forced run: step logits [B, N, V] and its final cache as host arrays."""

    logits: np.ndarray
    keys: list[np.ndarray]  # per layer [B, Hkv, S, D]
    values: list[np.ndarray]
    slot_positions: np.ndarray  # [B, S]
    strayed: str | None = None  # where it emitted other tokens than the forced ones (a forced_tokens bug); None: none

    @classmethod
    def from_result(cls, result: Any, strayed: str | None = None) -> Run:
        """From a GenerationResult of either tower, made with return_logits."""
        cache = result.cache
        return cls(host(result.step_logits), [host(k) for k in cache.keys], [host(v) for v in cache.values],
                   host(cache.slot_positions), strayed)


def host(x: Any) -> np.ndarray:
    """A torch tensor or a JAX array as a numpy array; bfloat16 becomes float32 (exactly)."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        return (x.float() if x.is_floating_point() else x).numpy()
    array = np.asarray(x)
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def _first_difference(emitted: list[list[int]], forced: list[list[int]]) -> str:
    """Where two token lists first differ, in words."""
    if len(emitted) != len(forced):
        return f"{len(emitted)} rows, not {len(forced)}"
    for row, (got, want) in enumerate(zip(emitted, forced)):
        for step in range(max(len(got), len(want))):
            if step >= len(got) or step >= len(want) or got[step] != want[step]:
                seen = got[step] if step < len(got) else "nothing"
                wanted = want[step] if step < len(want) else "nothing"
                return f"row {row}, step {step}: {seen} where {wanted} was forced"
    return "the same tokens"


def run_implementation(impl: str, models: Models, prompts: list[list[int]], tokens: list[list[int]],
                       cache: str) -> Run:
    """The backend's `generate` in the implementation's mode, fed `tokens` (forced_tokens), every step's logits; a
    run that emitted other tokens says where in `strayed` (its row fails: every number assumes the forced tokens)."""
    if impl not in IMPLEMENTATIONS:
        raise InputError(f"implementation {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    name, mode = impl.split(":")
    result = BACKENDS[name].module().generate(models.towers[name], prompts, len(tokens[0]), mode=mode, cache=cache,
                                              return_logits=True, forced_tokens=tokens)
    strayed = None if result.token_ids == tokens else _first_difference(result.token_ids, tokens)
    return Run.from_result(result, strayed)


def kept_positions(sequence_len: int, cache: str, sliding_window: int | None) -> np.ndarray:
    """The positions a cache must hold after feeding `sequence_len` tokens: all of them, or a ring's last W."""
    first = max(0, sequence_len - sliding_window) if cache == "sliding_window" and sliding_window is not None else 0
    return np.arange(first, sequence_len)


RowKV = tuple[np.ndarray, np.ndarray] | None  # one row's K and V [layers, Hkv, n, D]; None: other positions held
PositionsOf = Callable[[int], np.ndarray]  # a row's length -> the positions its cache must hold


def _oracle_rows(oracle: Oracle, positions_of: PositionsOf) -> list[RowKV]:
    """An oracle's K/V per row at the positions `positions_of(row_length)` names: [layers, Hkv, n, D] each."""
    return [(k[:, :, positions_of(k.shape[2])], v[:, :, positions_of(k.shape[2])])
            for k, v in zip(oracle.keys, oracle.values, strict=True)]


def _run_rows(run: Run, lengths: list[int], positions_of: PositionsOf) -> list[RowKV]:
    """A run's final cache per row, read slot by slot through the positions its slots record (None for a row that
    does not hold exactly the positions `positions_of(length)` names)."""
    return [parity_metrics.kv_at_positions(run.keys, run.values, run.slot_positions[row], row, positions_of(length))
            for row, length in enumerate(lengths)]


def _max_kv_gap(first: list[RowKV],
                second: list[RowKV]) -> float:
    """Max |ΔK|, |ΔV| over rows; inf when a row of either side holds another set of positions, NaN when an entry is
    NaN (out of bounds: Python's max(worst, nan) would keep worst, and a NaN cache passed)."""
    worst = 0.0
    for a, b in zip(first, second, strict=True):
        if a is None or b is None:
            return float("inf")
        worst = float(np.max([worst, np.abs(a[0] - b[0]).max(), np.abs(a[1] - b[1]).max()]))  # NaN propagates
    return worst


def kv_distance(reference: Oracle, run: Run, cache: str, sliding_window: int | None) -> float:
    """Max |ΔK|, |ΔV| between a run's final cache and the reference's K/V at the positions that cache must hold;
    inf when a row's cache holds another set of positions (each slot is matched by the position it records)."""
    positions_of = functools.partial(kept_positions, cache=cache, sliding_window=sliding_window)
    lengths = [k.shape[2] for k in reference.keys]
    return _max_kv_gap(_run_rows(run, lengths, positions_of), _oracle_rows(reference, positions_of))


def oracle_kv_distance(reference: Oracle, other: Oracle, cache: str, sliding_window: int | None) -> float:
    """The floor's K/V distance, over the same positions the cache under test holds."""
    positions_of = functools.partial(kept_positions, cache=cache, sliding_window=sliding_window)
    return _max_kv_gap(_oracle_rows(other, positions_of), _oracle_rows(reference, positions_of))


def runs_kv_distance(first: Run, second: Run, lengths: list[int], cache: str, sliding_window: int | None) -> float:
    """torch vs JAX directly: their caches compared position by position."""
    positions_of = functools.partial(kept_positions, cache=cache, sliding_window=sliding_window)
    return _max_kv_gap(_run_rows(first, lengths, positions_of), _run_rows(second, lengths, positions_of))


# --- the table ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    cache: str
    name: str  # "transformers (floor)", an implementation, or "torch:eager vs jax:step"
    kind: str  # "floor", "implementation" or "direct"
    distance: Distance
    failed: list[str]  # metrics out of bounds; empty when the row passes (always, for the floor)
    ratios: dict[str, float]  # each metric over the floor's (1.0 for the floor itself)


@dataclasses.dataclass
class Models:
    """What a parity run compares: each backend's model in the dtype under test (by backend name; only the backends
    a run needs), the floor's model (same dtype) and the float64 reference model."""

    towers: dict[str, Any]
    floor: Any
    reference: Any
    why_not_transformers: str = NOT_INSTALLED  # said in the output when torch_cache is the reference and floor
    mesh: MeshShape | None = None  # the mesh the towers are split over (docs/design.md §10); None: one device each

    def label(self, impl: str) -> str:
        """An implementation's name in the table: "torch:eager", or "torch:eager@model=2,data=1" on a mesh."""
        return impl if self.mesh is None else f"{impl}@{self.mesh}"

    def holds_whole_cache(self, impl: str) -> bool:
        """Whether this process sees the implementation's whole cache: not so for torch on a mesh, whose ranks each
        hold their own KV-head (and batch) shard; its K/V distance is then left unmeasured (None)."""
        return self.mesh is None or not BACKENDS[impl.split(":")[0]].mesh_processes


@dataclasses.dataclass
class ParityReport:
    dtype: str
    reference_source: str
    floor_source: str
    prompt_lens: list[int]
    steps: int
    reference_self_disagreements: int
    decisive_steps: int  # steps (over all rows) where a greedy divergence is out of bounds
    rows: list[Row]

    @property
    def passed(self) -> bool:
        return all(not row.failed for row in self.rows)


def load_models(model_dir: Path, dtype: str, with_transformers: bool = True,
                impls: Sequence[str] = IMPLEMENTATIONS, sliding_window: int | None = None,
                with_reference: bool = True) -> Models:
    """Load every model a parity run needs from one checkpoint directory or GGUF file, on CUDA when torch sees one;
    each attending with `sliding_window` instead of the checkpoint's window when given (--sliding-window).
    with_reference=False leaves out the float64 model (None): for a caller that gives parity_report its reference,
    computed once (a float64 copy of a 135M model is ~1 GB and a second of loading)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = {impl.split(":")[0] for impl in impls}
    towers = {name: set_window(backend.module().load(model_dir, dtype), sliding_window)
              for name, backend in BACKENDS.items() if name in names}
    why_not = "--no-transformers"
    if with_transformers:
        try:  # the package itself: a submodule left in sys.modules would import without it
            import transformers  # noqa: F401
        except ImportError:  # fall back to torch_cache's own float64 and dtype forwards, and say so
            why_not = NOT_INSTALLED
        else:
            hf_config = None  # the checkpoint's own
            if sliding_window is not None:
                from transformers import MistralConfig as HFMistralConfig

                config = dataclasses.replace(load_config(model_dir), sliding_window=sliding_window)
                hf_config = HFMistralConfig(**config.to_hf_dict())

            def load(torch_dtype: torch.dtype) -> Any:
                # sdpa computes attention in the model's dtype; transformers' "eager" one would round float64
                # attention weights through fp32. No transformers bars (loading, a GGUF's dequantization) in the
                # parity table's output
                hf = transformers_model(model_dir, torch_dtype, hf_config, attn_implementation="sdpa",
                                        progress=False)
                return hf.to(device).eval()

            return Models(towers, load(getattr(torch, dtype)), load(torch.float64) if with_reference else None)
    from torch_cache.model import Mistral as TorchMistral  # the fallback is torch_cache by definition

    floor = towers["torch"] if "torch" in towers else set_window(
        TorchMistral.from_pretrained(model_dir, getattr(torch, dtype), device), sliding_window)
    reference = set_window(TorchMistral.from_pretrained(model_dir, torch.float64, device),
                           sliding_window) if with_reference else None
    return Models(towers, floor, reference, why_not)


FORCED_TOKENS = "forced_tokens"  # a failure's name: the run emitted other tokens than the forced ones


def judged_row(cache: str, name: str, kind: str, found: Distance, floor: Distance, dtype: str,
               strayed: str | None = None) -> Row:
    """A row of the table: `found` judged against the floor's distance by the rule (twincache.parity_metrics); a
    run that `strayed` from its forced tokens fails first for that (its logits follow other tokens)."""
    strays = [] if strayed is None else [f"{FORCED_TOKENS} not followed ({strayed})"]
    return Row(cache, name, kind, found, strays + parity_metrics.failures(found, floor, dtype),
               parity_metrics.ratios(found, floor))


def non_finite_distance(floor: Distance) -> Distance:
    """A run its backend stopped at NaN or Inf logits: every logit metric not finite, its cache unmeasured."""
    nan = float("nan")
    return dataclasses.replace(floor, max_abs_logit_diff=nan, rel_max_abs_logit_diff=nan, mean_kl=nan, max_kl=nan,
                               top1_agreement=nan, first_greedy_divergence=None, first_decisive_divergence=None,
                               max_abs_kv_diff=None)


def direct_distance(first: Run, second: Run, decisive: np.ndarray, lengths: list[int], cache: str,
                    sliding_window: int | None, whole_caches: bool = True) -> Distance:
    """Two runs' distance from each other (a direct row); K/V unmeasured (None) unless both caches are whole here."""
    return dataclasses.replace(parity_metrics.distance(first.logits, second.logits, decisive),
                               max_abs_kv_diff=runs_kv_distance(first, second, lengths, cache, sliding_window)
                               if whole_caches else None)


def parity_report(models: Models, prompts: Sequence[Sequence[int]], steps: int, dtype: str, caches: Sequence[str],
                  impls: Sequence[str] = IMPLEMENTATIONS, reference: Reference | None = None,
                  single: Models | None = None, on_row: Callable[[Row], None] | None = None) -> ParityReport:
    """The table: the floor, then each implementation and each direct torch-vs-JAX pair, per cache kind.
    `reference` may be given (computed once for several dtypes); else the float64 model computes it. With `single`
    (the same implementations on one device, when `models` is split over a mesh), each implementation also gets a
    direct row against itself on one device, judged like the torch-vs-JAX rows. `on_row` sees each row as it is
    judged (a run that may be cut short can report what it finished)."""
    if steps < 1:
        raise InputError(f"max_new_tokens={steps} must be >= 1 for a parity run")
    config = next(iter(models.towers.values())).config
    prompts = validate_prompts(prompts, config)
    if reference is None:
        if models.reference is None:
            raise ValueError("parity_report: these models were loaded with with_reference=False, so no float64 model "
                             "computes the reference; pass reference=float64_reference(...) or load them with "
                             "with_reference=True")
        reference = float64_reference(models.reference, prompts, steps, models.why_not_transformers)
    floor = floor_oracle(models.floor, prompts, reference.tokens, dtype, models.why_not_transformers)
    lengths = [ref_keys.shape[2] for ref_keys in reference.keys]
    window = config.sliding_window
    decisive = parity_metrics.decisive_steps(reference.logits, floor.logits, dtype)  # [B, N]
    floor_logits = parity_metrics.distance(reference.logits, floor.logits, decisive)
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for cache in caches:
        floor_distance = dataclasses.replace(floor_logits, max_abs_kv_diff=oracle_kv_distance(reference, floor, cache,
                                                                                              window))
        add(Row(cache, f"{floor.source.split()[0]} (floor)", "floor", floor_distance, [],
                parity_metrics.ratios(floor_distance, floor_distance)))
        runs = {}
        for impl in impls:
            try:
                runs[impl] = run_implementation(impl, models, prompts, reference.tokens, cache)
            except NonFiniteLogitsError:
                if not np.isfinite(floor.logits).all():  # the floor's too: the weights or dtype, as the error says
                    raise
                # transformers ran these weights in this dtype: the implementation is out of bounds, not the input
                add(judged_row(cache, models.label(impl), "implementation", non_finite_distance(floor_distance),
                               floor_distance, dtype))
                continue
            whole = models.holds_whole_cache(impl)
            found = dataclasses.replace(parity_metrics.distance(reference.logits, runs[impl].logits, decisive),
                                        max_abs_kv_diff=kv_distance(reference, runs[impl], cache, window) if whole
                                        else None)
            add(judged_row(cache, models.label(impl), "implementation", found, floor_distance, dtype,
                           runs[impl].strayed))
            if single is not None:
                alone = run_implementation(impl, single, prompts, reference.tokens, cache)
                found = direct_distance(runs[impl], alone, decisive, lengths, cache, window, whole)
                add(judged_row(cache, f"{models.label(impl)} vs {impl}", "direct", found, floor_distance, dtype,
                               alone.strayed))
        for first, second in direct_pairs(list(runs)):
            whole = models.holds_whole_cache(first) and models.holds_whole_cache(second)
            found = direct_distance(runs[first], runs[second], decisive, lengths, cache, window, whole)
            add(judged_row(cache, f"{models.label(first)} vs {models.label(second)}", "direct", found,
                           floor_distance, dtype))
    return ParityReport(dtype, reference.source, floor.source, [len(p) for p in prompts], steps,
                        reference.self_disagreements, int(decisive.sum()), rows)


def report_json(report: ParityReport, model: str) -> dict[str, Any]:
    """The report as `--json` prints it (non-finite values become null); `format_table` renders this."""
    return {"model": model, "dtype": report.dtype, "reference": report.reference_source, "floor": report.floor_source,
            "prompt_lens": report.prompt_lens, "steps": report.steps,
            "reference_self_disagreements": report.reference_self_disagreements, "passed": report.passed,
            "decisive_steps": report.decisive_steps, "factors": parity_metrics.FACTORS,
            "absolute": parity_metrics.ABSOLUTE.get(report.dtype, {}),
            "rows": [row_json(row) for row in report.rows]}


def row_json(row: Row) -> dict[str, Any]:
    """One row of the report as `--json` prints it (non-finite values become null)."""
    def clean(value: float) -> float | None:  # JSON has no inf
        return value if np.isfinite(value) else None

    return {"cache": row.cache, "name": row.name, "kind": row.kind,
            "metrics": {k: (clean(v) if isinstance(v, float) else v)
                        for k, v in dataclasses.asdict(row.distance).items()},
            "ratios": {k: clean(v) for k, v in row.ratios.items()}, "failed": row.failed}


def _number(value: float | None, spec: str) -> str:
    """A metric of `report_json` as the table prints it (null, from inf or nan, as "inf/nan")."""
    return "inf/nan" if value is None else format(value, spec)


def _metric(metrics: dict[str, Any], name: str) -> float | None:
    """A metric of `report_json`'s "metrics" by its FACTORS name (top-1 disagreement is stored as agreement)."""
    if name == "top1_disagreement":
        agreement = metrics.get("top1_agreement")
        return None if agreement is None else 1.0 - agreement
    value = metrics.get(name)
    return None if value is None else float(value)


def _failure(name: str, row: dict[str, Any], floor: dict[str, Any] | None) -> str:
    """One failed metric of a row as its verdict names it: the ratio to the floor where that is a finite, non-zero
    number; else the row's value beside the floor's (a ratio to a zero or non-finite floor says nothing)."""
    if name == "first_decisive_divergence":  # an event, not a multiple of the floor's
        return f"{name} at step {row['metrics'].get(name)}"
    if name.startswith(FORCED_TOKENS):  # says where, in words
        return name
    ratio = row["ratios"].get(name)
    if ratio is not None and ratio > 0:
        return f"{name} {ratio:.1f}x"
    ours = _metric(row["metrics"], name)
    text = f"{name} {'non-finite' if ours is None else format(ours, '.2e')}"
    if floor is None:
        return f"{text} (no finite ratio to the floor)"
    theirs = _metric(floor["metrics"], name)
    return f"{text} vs floor {'non-finite' if theirs is None else format(theirs, '.2e')} (no ratio)"


def row_verdict(row: dict[str, Any], floor: dict[str, Any] | None = None) -> str:
    """A row's verdict (a row of `report_json`) as the table gives it: "floor", "ok (worst 1.2x the floor)" or
    "OUT OF BOUNDS: " and each failed metric: its ratio to the floor (`floor`, the floor row of `report_json` for
    the row's cache), or both values where the floor's is zero or either is not finite, or the step of a decisive
    greedy divergence."""
    ratios = row["ratios"]
    if row["kind"] == "floor":
        return "floor"
    if row["failed"]:
        return "OUT OF BOUNDS: " + ", ".join(_failure(name, row, floor) for name in row["failed"])
    return f"ok (worst {max((v for v in ratios.values() if v is not None), default=0.0):.1f}x the floor)"


def window_text(data: dict[str, Any]) -> str:
    """The model's window as the table's heading gives it: nothing where the report does not record it; "not
    reached" where no row feeds more positions than the window holds (no key left it, so a wrong window passes), and
    "never reached" where the window is not shorter than max_position_embeddings (no run can reach it)."""
    if "sliding_window" not in data:
        return ""
    window = data["sliding_window"]
    if window is None:
        return ", no sliding window"
    fed = max(data["prompt_lens"]) + data["steps"] - 1  # the last step's token is emitted, never fed
    if fed > window:
        return f", sliding window {window}"
    positions = data.get("max_position_embeddings")  # absent from a report saved before it was recorded
    if positions is not None and window >= positions:  # more tokens would be refused: say so, not "give more"
        return (f", sliding window {window} (never reached: it is not shorter than max_position_embeddings="
                f"{positions}, so no key can leave it and the model attends as without a window)")
    return (f", sliding window {window} (not reached: the longest row feeds {fed} positions, so no key left the "
            "window; give a longer prompt or more --max-new-tokens to judge it)")


def format_table(data: dict[str, Any]) -> str:
    """The table `twincache parity` prints, from `report_json`'s object (so a saved --json renders the same)."""
    width = max([27] + [len(row["name"]) for row in data["rows"]])
    header = (f"{'cache':<15} {'implementation':<{width}} {'max|Δlogit|':>11} {'rel':>8} {'mean KL':>8} {'max KL':>8} "
              f"{'top-1 same':>11} {'diverges at':>12} {'max|ΔKV|':>9}  verdict")
    lines = [f"reference: {data['reference']}; continuation: its own greedy tokens",
             f"floor:     {data['floor']}",
             f"prompt {'/'.join(map(str, data['prompt_lens']))} tokens, {data['steps']} teacher-forced steps, "
             f"{data['dtype']}{window_text(data)}; {data['decisive_steps']} of "
             f"{data['steps'] * len(data['prompt_lens'])} steps decisive "
             "(a greedy divergence there is out of bounds)", header, "-" * len(header)]
    floors = {row["cache"]: row for row in data["rows"] if row["kind"] == "floor"}
    for row in data["rows"]:
        d, ratios = row["metrics"], row["ratios"]
        diverges = "-" if d["first_greedy_divergence"] is None else str(d["first_greedy_divergence"])
        kv = ("n/a" if d["max_abs_kv_diff"] is None and "max_abs_kv_diff" not in ratios  # not measured
              else _number(d["max_abs_kv_diff"], ">9.2e"))
        lines.append(f"{row['cache']:<15} {row['name']:<{width}} {_number(d['max_abs_logit_diff'], '.2e'):>11} "
                     f"{_number(d['rel_max_abs_logit_diff'], '.1e'):>8} {_number(d['mean_kl'], '.1e'):>8} "
                     f"{_number(d['max_kl'], '.1e'):>8} {_number(d['top1_agreement'], '.1%'):>11} {diverges:>12} "
                     f"{kv:>9}  {row_verdict(row, floors.get(row['cache']))}")
    factors = ", ".join(f"{name} {factor:g}x" for name, factor in data["factors"].items())
    lines.append(f"bounds: each metric within its factor of the floor ({factors}); no greedy divergence at a decisive "
                 "step (float64 top-1 margin > 2 x the max|Δlogit| bound at that step)"
                 + (f"; absolute allowances where the floor is near 0: {data['absolute']}" if data["absolute"] else ""))
    if data["reference"].startswith("torch_cache"):  # the fallback judges torch_cache by itself
        lines.append("note: torch_cache is the reference and the floor here, so a bug its model has in every dtype "
                     "cannot show in its own rows (only in JAX's and the direct rows, as the JAX side's); judge "
                     "torch_cache against transformers (installed, without --no-transformers)")
    if "mesh" in data:
        lines.append(f"mesh {data['mesh']}: NAME@MESH is that implementation split over the mesh, 'vs NAME' the "
                     "same one on one device; max|ΔKV| n/a: each torch rank holds only its shard of the cache (not "
                     "gathered, so not measured)")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    factors = ", ".join(f"{name} {factor:g}x" for name, factor in parity_metrics.FACTORS.items())
    parser = subparsers.add_parser(
        "parity", help="measure torch_cache and jax_cache against the float64 truth, beside transformers",
        description="Teacher-forced parity over every decode step. The reference is transformers' "
                    "MistralForCausalLM (LlamaForCausalLM for a Llama) in float64 (uncached, over the prompt plus its "
                    "own greedy continuation); the floor is transformers in --dtype. Each implementation passes "
                    f"when every metric is within its factor of the floor ({factors}; in fp32 an absolute allowance "
                    "where the floor is near 0) and no "
                    "greedy divergence happens at a decisive step (one whose float64 top-1 margin exceeds twice the "
                    "max |Δlogit| bound there), and so must torch vs JAX directly. Exit 0 when every row passes, 1 "
                    "when one does not, 2 on bad input. See docs/design.md §4.")
    add_model_arguments(parser)
    parser.add_argument("--cache", choices=(*CACHE_KINDS, "both"), default="both",
                        help="the cache(s) to judge each implementation with (default: both)")
    parser.add_argument("--modes", nargs="+", default=["all"], metavar="MODE",
                        help=f"implementations to measure: all (default: {', '.join(IMPLEMENTATIONS)}), default "
                             f"(what generate runs: {', '.join(DEFAULTS)}), or any of those labels")
    parser.add_argument("--no-transformers", action="store_true",
                        help="use torch_cache in float64 as the reference (what happens without transformers)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    impls = resolve_implementations(args.modes)
    if args.max_new_tokens < 2:  # one token is the prefill's alone: a PASS would judge no decode step
        raise InputError(f"--max-new-tokens {args.max_new_tokens} must be >= 2 for a parity run: the first token "
                         "comes from the prefill, the decode steps (each reading the cache) from the second on")
    with notices_on_stderr(not args.json):  # a first run converts the default model: seconds, said before
        model_dir = args.model if args.model is not None else default_model_dir()
    config = model_config(args, model_dir)
    args.dtype = resolve_dtype(args.dtype, model_dir)
    # several: one left-padded batch, each row against its own truth
    prompts, _ = resolve_prompts(args, model_dir, config.vocab_size)
    validate_prompts(prompts, config)
    # as the towers' generate would, but before the float64 reference decodes every one of those steps
    longest = max(len(prompt) for prompt in prompts)
    check_positions(config, longest, args.max_new_tokens, longest + args.max_new_tokens - 1)
    if args.cache == "both":  # a window-less config has no sliding cache to compare
        caches = [kind for kind in CACHE_KINDS if kind == "static" or config.sliding_window is not None]
    elif args.cache == "sliding_window" and config.sliding_window is None:
        raise InputError("--cache sliding_window needs a config with a sliding_window; this one has none (give it one "
                         "with --sliding-window N)")
    else:
        caches = [args.cache]
    if split_mesh(args.mesh) is not None:
        from twincache_app import mesh_parity

        report = mesh_parity.mesh_report(args, config, model_dir, prompts, caches, impls)
        if report is None or isinstance(report, int):  # a rank other than 0, or the launcher's exit code
            return report or 0
    else:  # no --mesh, or a mesh of one device: plain parity in this process ("mesh" below still names it)
        start_mesh(args, config, [])  # a one-device mesh inside a torch.distributed world of another size is refused
        models = load_models(model_dir, args.dtype, with_transformers=not args.no_transformers, impls=impls,
                             sliding_window=args.sliding_window)
        report = parity_report(models, prompts, args.max_new_tokens, args.dtype, caches, impls)
    data = (report_json(report, str(model_dir))
            | {"sliding_window": config.sliding_window, "max_position_embeddings": config.max_position_embeddings}
            | ({} if args.mesh is None else {"mesh": str(args.mesh)}))
    if args.json:
        print(json.dumps(data))
    else:
        print(format_table(data))
        judged = [row for row in report.rows if row.kind != "floor"]
        print(f"{'PASS' if report.passed else 'FAIL'}: {sum(not row.failed for row in judged)}/{len(judged)} rows "
              f"within bounds of the {args.dtype} floor" + ("" if args.mesh is None else f" (mesh {args.mesh})"),
              file=sys.stderr)
    return 0 if report.passed else 1
