"""Generation with torch_cache: eager prefill, then a decode step under
`torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs on GPU), with `compile=False` as the opt-out.

Prefill runs eagerly, by measurement: on the `small` bench model (57M params, fp32, 2 CPU cores) a 300-token prefill
took 164-180 ms eager and 168 ms compiled with dynamic shapes, after a 23.6 s compile. It runs once per generation,
so compiling it would only add that compile.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import torch

from torch_cache import sharding
from torch_cache.cache import StaticCache, available_memory, make_cache, memory_label
from torch_cache.inductor_cpu import batched_kernels
from torch_cache.model import Mistral
from torch_cache.projection import pack_projections
from twincache import buckets, cache_checks, phases
from twincache.buckets import step_attend_len
from twincache.config import MistralConfig
from twincache.errors import NonFiniteLogitsError, ResourceError
from twincache.generation import (
    NOTICES,
    PREFILL_CHUNK,
    GenerationResult,
    SamplingParams,
    TokenCallback,
    announce_compile,
    append_tokens,
    build_batch_class,
    build_sized_cache,
    check_budget,
    check_continuation_room,
    check_first_step,
    check_flags,
    check_given_cache_len,
    check_model_type,
    check_positions,
    plan_cache,
    positions_from_mask,
    prefill_chunks,
    prepare_batch,
    prepare_continuation,
    validate_attention_mask,
    validate_forced_tokens,
)
from twincache.mesh import keep_rows, pad_batch, pad_continuation, pad_rows
from twincache.storage import share_temp_dir
from twincache.switches import switch

MAX_DECODE_VARIANTS = 64
_CACHE_HINT = cache_checks.cache_hint("torch_cache") + ", or a kind name"
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)  # 1.2e-38: lower temperatures sample as this one
# 3.4e38: higher temperatures (finite in Python, inf as float32) sample as this one, a uniform draw from the
# kept tokens
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, StaticCache, int | None], torch.Tensor]
_MASK32 = 0xFFFFFFFF
_Bits = TypeVar("_Bits", torch.Tensor, int)  # the 32-bit hash runs on tensors and on Python ints alike


def _sampling_kind(sampling: SamplingParams) -> str:
    """What a step computes to choose its tokens, one compiled graph each: "greedy" (argmax), "temperature" (a draw
    from every token) or "filtered" (a draw after top-k / top-p, which sorts the vocabulary). The values of the
    temperature, top_k and top_p are tensors, so another setting of the same kind reuses its graph."""
    if sampling.greedy:
        return "greedy"
    return "filtered" if sampling.top_k or sampling.top_p < 1.0 else "temperature"


def _knobs(sampling: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampling settings as the tensors `_filter` takes: temperature [] fp32, top_k [] int64, top_p [] fp32."""
    return (torch.tensor(min(sampling.temperature, MAX_TEMPERATURE), dtype=torch.float32, device=device),
            torch.tensor(sampling.top_k, dtype=torch.long, device=device),
            torch.tensor(sampling.top_p, dtype=torch.float32, device=device))


def _filter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            filters: bool) -> torch.Tensor:
    """filter_logits with its settings as tensors (the form the compiled step takes). `filters` False skips the
    sort when top_k is 0 and top_p 1. [B, V]"""
    peak = logits.max(dim=-1, keepdim=True).values  # [B, 1]
    temperature = temperature.clamp(min=MIN_TEMPERATURE)  # []
    scaled = (logits - peak) / temperature  # [B, V]
    if not filters:
        return scaled
    batch, vocab = logits.shape
    # Both cuts read the unscaled logits, whose order the temperature keeps: scaled, distinct logits can round to one
    # value (a huge T made every token 0 and top_k=1 kept them all: a uniform draw, not the greedy token).
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [B, V]
    k = torch.where(top_k > 0, top_k, vocab).expand(batch, 1)  # [B, 1]; 0 keeps all V
    kth_largest = sorted_logits.gather(-1, k - 1)  # [B, 1]
    # Masking a sorted row by value keeps it sorted: it is the sorted row of the top-k survivors.
    sorted_scaled = ((sorted_logits - peak) / temperature).masked_fill(
        sorted_logits < kth_largest, float("-inf"))  # [B, V]
    masses = sorted_scaled.exp()  # [B, V], the survivors' unnormalised probabilities (the top logit is 0; cut: 0)
    # Keep a token while the tokens ranked above it hold less than top_p; the top token always stays (also when
    # NaN logits make every comparison false: they are reported by the caller, not indexed out of range here).
    # The mass above each token, as jax_cache computes it (docs/design.md §5): the exclusive prefix sum (0 first) of
    # the unnormalised masses, each sum the exact one rounded once (summed in float64), divided once by the total.
    prefix = masses.double().cumsum(dim=-1)  # [B, V]
    total = prefix[:, -1:].float()  # [B, 1], softmax's denominator
    above = torch.nn.functional.pad(prefix[:, :-1].float(), (1, 0)) / total  # [B, V], the mass ranked above each
    kept = (above < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    kept = torch.where(top_p < 1.0, kept, vocab)  # top_p 1 keeps all: rounding in the cumsum must not cut the tail
    cutoff = sorted_logits.gather(-1, kept - 1)  # [B, 1], the smallest logit kept
    return scaled.masked_fill(logits < torch.maximum(kth_largest, cutoff), float("-inf"))


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """fp32 logits [B, V] scaled by the temperature, with the tokens top-k and top-p leave out at -inf. [B, V]

    Scaled as (logits - max) / T: the top token sits at 0 and every other is below it, so a tiny T overflows only
    to -inf (never to inf, or inf - inf = NaN), and sampling tends to greedy as T -> 0. A T below float32's smallest
    normal number acts as that number. Both filters cut by value, so a tie at the boundary keeps every tied token.
    top-p applies to the top-k survivors' renormalised mass. The compiled decode step computes this same function.
    """
    return _filter(logits, *_knobs(sampling, logits.device), _sampling_kind(sampling) == "filtered")


def _mul32(x: _Bits, factor: int) -> _Bits:
    """x * factor mod 2^32, for x in [0, 2^32) in int64 (or a Python int): in two 16-bit halves of the factor, so no
    product leaves int64 (signed overflow is undefined in the C++ inductor writes)."""
    low = x * (factor & 0xFFFF)
    high = ((x * (factor >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _hash32(x: _Bits) -> _Bits:
    """lowbias32 (C. Wellons' integer hash): a bijection on 32-bit values, held in int64 in [0, 2^32) (or Python ints).

    Kept out of the compiled step where it can be: inductor's codegen evaluates a fused pointwise chain's shared
    intermediates again at every use, and each of the hash's five stages uses its input twice, so chained hashes
    compile in O(2^stages) (a sampled step's two-hash fold-in and two-hash noise: 15-18 s of inductor codegen on a
    2-core CPU, against ~4 s with the one hash left in the step)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _fold_in(key: int, data: int) -> int:
    """A new 32-bit key from `key` (a seed) and `data` (the step index), as jax.random.fold_in; on the host, as a
    step's key is written before the step runs (`_StepKey`)."""
    return _hash32(key ^ _hash32(data & _MASK32))


@functools.lru_cache(maxsize=8)
def _index_bits(batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    """lowbias32 of each noise entry's flat index, [B, V] int64: the half of the Gumbel noise that does not depend on
    the key, made once per shape and passed to the compiled step, which then hashes once per entry (`_hash32`)."""
    with torch.inference_mode(False):  # a plain tensor, readable in and out of inference mode
        bits = _hash32(torch.arange(batch * vocab, device=device).view(batch, vocab))  # [B, V] in [0, 2^32)
    torch._dynamo.mark_static_address(bits)  # CUDA graphs read it where it is, with no copy per replay
    return bits


class _StepKey:
    """The key a sampled step draws with, `_fold_in(seed, step)`, held in a [] int64 device tensor that the compiled
    step reads: written in place before each step (`fill_` takes the value as a kernel argument: no host-to-device
    copy, no sync), so the hash chain of the fold-in stays out of the graph (`_hash32`)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.tensor = torch.zeros((), dtype=torch.long, device=device)

    def at(self, step: int) -> torch.Tensor:
        return self.tensor.fill_(_fold_in(self.seed, step))


def _gumbel(key: torch.Tensor, index_bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] fp32, a pure function of `key` and each entry's index (`_index_bits`, [B, V]):
    counter-based, so it needs no generator state and runs inside the compiled step (24-bit uniforms in (0, 1), then
    -log(-log(u)))."""
    bits = _hash32(index_bits ^ key)  # [B, V] in [0, 2^32)
    uniform = ((bits >> 8).float() + 0.5) * 2.0 ** -24  # [B, V] in (0, 1)
    return -torch.log(-torch.log(uniform))


def sample(logits: torch.Tensor, sampling: SamplingParams, key: torch.Tensor) -> torch.Tensor:
    """Next token per row from fp32 logits [B, V]: greedy, or a draw from softmax(filter_logits(logits)) by
    Gumbel-max with `key`'s noise ([] int64 in [0, 2^32): a seed, or a seed with a step folded in; greedy reads
    none). [B] int64

    jax_cache draws the same way (jax.random.categorical is Gumbel-max), from its own generator."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return _draw(filter_logits(logits, sampling), key, _index_bits(*logits.shape, logits.device))


def _draw(scaled: torch.Tensor, key: torch.Tensor, index_bits: torch.Tensor) -> torch.Tensor:
    """Gumbel-max: argmax(scaled + noise) is a draw from softmax(scaled) [B, V]. [B] int64"""
    return (scaled + _gumbel(key, index_bits)).argmax(dim=-1)


def _choose(logits: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor, forced: torch.Tensor,
            forcing: torch.Tensor, step_key: torch.Tensor, index_bits: torch.Tensor, temperature: torch.Tensor,
            top_k: torch.Tensor, top_p: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's decisions from fp32 logits [B, V], written to run inside the compiled step (and eagerly for the
    prefill's token): the tokens [B] (the `forced` ones [B] when `forcing`, [] bool: a tensor, so teacher forcing
    runs the greedy graph; a row ends at any of the `eos` ids, [E] int64 padded with -1 (`_eos_tensor`), and then
    keeps emitting the first), the new finished flags [B], and
    what the host reads, its one copy per step: [B + 1] int64, the tokens then 1 if any logit is NaN or Inf. A
    sampled step draws with `step_key` ([] int64: the seed folded with the generated-token index, `_StepKey`) and
    `index_bits` ([B, V], read by sampled steps only: `_sampling_bits`).
    """
    finite_rows = torch.isfinite(logits).all(dim=-1, keepdim=True)  # [B, 1]
    if kind == "greedy":
        next_ids = logits.argmax(dim=-1)
    else:  # a row with NaN/Inf is drawn from zeros: its draw is reported, never used
        scaled = _filter(logits.where(finite_rows, 0.0), temperature, top_k, top_p, kind == "filtered")  # [B, V]
        next_ids = _draw(scaled, step_key, index_bits)
    next_ids = torch.where(forcing, forced, next_ids)  # [B]
    next_ids = torch.where(finished, eos[0], next_ids)  # [B]
    finished = finished | ((next_ids[:, None] == eos) & (eos >= 0)).any(dim=-1)  # [B, E] -> [B]
    return next_ids, finished, torch.cat([next_ids, (~finite_rows.all()).long()[None]])


_DecodeOne = Callable[..., tuple[torch.Tensor, ...]]
# The attribute of a model that holds its compiled decode step (a _StepSlot). On the model, not in a table keyed by it:
# the step's closure holds the model, so a WeakKeyDictionary's value kept its key alive, and a dropped model (its
# weights and packed copies) was never freed; on the model it is a reference cycle, which the gc collects with it.
_DECODE_STEPS = "_twincache_decode_steps"
# In a CPU step, a pointwise result of more ops than this is written out once before the reductions that read it,
# instead of recomputed inside each (inductor's CPU default: 50). `small` and the trained model in bfloat16 over a
# 1,024-slot cache decoded 13-25% faster at 8; short contexts and float32 the same, and float32 gives the same values
# either way (docs/design.md §7.37).
_REALIZE_OPCOUNT_THRESHOLD = 8


def _decode_one_fn(model: Mistral, compile: bool) -> _DecodeSteps:
    """The whole decode step (`_DecodeSteps` runs it), compiled once per model: `(input_ids [B, 1], positions [B, 1],
    cache, attend_len, finished [B], eos [E], forced [B], forcing [], step_key [], index_bits, temperature [], top_k [],
    top_p [], kind) -> (logits [B, V] fp32, tokens [B], finished [B], next positions [B, 1], for_host [B + 1])`.
    The forward, the choice (greedy or a seeded draw), the EOS bookkeeping and the finiteness flag are one graph per
    sampling kind (`_sampling_kind`); teacher forcing runs the greedy one."""
    def decode_one(input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, attend_len: int | None,
                   finished: torch.Tensor, eos: torch.Tensor, forced: torch.Tensor, forcing: torch.Tensor,
                   step_key: torch.Tensor, index_bits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
        logits = model(input_ids, positions, cache, attend_len=attend_len)[:, -1].float()  # [B, V]
        next_ids, finished, for_host = _choose(logits, finished, eos, forced, forcing, step_key, index_bits,
                                               temperature, top_k, top_p, kind)
        return logits, next_ids, finished, positions + 1, for_host

    if not compile:
        return _DecodeSteps(decode_one, contextlib.ExitStack, compiled=False)
    slot = getattr(model, _DECODE_STEPS, None)
    steps = slot.steps_of(model) if isinstance(slot, _StepSlot) else None
    if steps is None:
        # Static shapes (batch and cache sizes specialise), but the bucket is symbolic where this torch can say so:
        # one graph then serves every partial bucket, and the whole cache is one more (docs/design.md §7.13).
        # Elsewhere each bucket compiles once.
        compiled: _DecodeOne = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
        share_temp_dir()  # inductor's g++ writes to TMPDIR: the one Python checked, not one it skipped
        from torch._inductor import config as inductor_config

        def compile_settings() -> contextlib.ExitStack:
            """Fresh patches per session: torch 2.11's config patches refuse to be entered twice at once, and a
            generation may run inside another's token callback."""
            settings = contextlib.ExitStack()
            # (torch.compiler.config gets patch() at runtime from install_config_module but, unlike inductor's config,
            # declares no type for it: hence the ignore)
            if hasattr(torch.compiler.config, "dynamic_sources"):
                settings.enter_context(torch.compiler.config.patch(  # type: ignore[attr-defined]
                    dynamic_sources="L['attend_len']"))
            # Inductor tries to fuse each pair of nodes that share a buffer, up to 64 apart. Every layer's K/V write
            # reads the same slot indices: ~2,000 pairs on a 30-layer model, 1 s of its compile, and the fusions it
            # finds are between neighbours (8 gave byte-identical code on every model, batch, cache and dtype tried).
            if hasattr(inductor_config, "max_fusion_buffer_group_pairwise_attempts"):
                settings.enter_context(inductor_config.patch(max_fusion_buffer_group_pairwise_attempts=8))
            # No size/stride asserts in the generated code: each decoder-layer region re-checks its 16 inputs at
            # every call, 136 checks a `small` CPU step (~3% of it), on tensors whose shapes dynamo's guards and the
            # outer graph already fix (docs/design.md §7.33).
            settings.enter_context(inductor_config.patch(size_asserts=False))
            if model.device.type == "cpu":
                # The rotated query and each normed input are written once, not recomputed for every key slot and
                # projection row that reads them (_REALIZE_OPCOUNT_THRESHOLD).
                settings.enter_context(inductor_config.patch(realize_opcount_threshold=_REALIZE_OPCOUNT_THRESHOLD))
            settings.enter_context(batched_kernels())
            return settings

        steps = _DecodeSteps(compiled, compile_settings, compiled=True, entry_calls=model.device.type == "cpu")
        setattr(model, _DECODE_STEPS, _StepSlot(model, steps))
    return steps


class _StepSlot:
    """A model's compiled decode step, kept on the model (_DECODE_STEPS) with the model it was made for. The step's
    closure holds that model: a copy of the model (copy.copy shares the slot, deepcopy and pickle copy it) must not
    decode with the original's weights, so the step serves only its own model, and a copied or pickled slot is empty
    (a local function does not pickle)."""

    def __init__(self, model: Mistral | None = None, steps: _DecodeSteps | None = None) -> None:
        self._model = None if model is None else weakref.ref(model)
        self._steps = steps

    def steps_of(self, model: Mistral) -> _DecodeSteps | None:
        return self._steps if self._model is not None and self._model() is model else None

    def __reduce__(self) -> tuple[type[_StepSlot], tuple[()]]:
        return _StepSlot, ()


# Every compiled decode step of the process runs under this lock: dynamo's stance (which skips guards) is process-wide,
# so a step that skips them must not overlap another thread's step. The last step run is recorded under it too.
_step_lock = threading.Lock()
_last_step_run: object = None  # the session whose step ran last, of any model


_SKIP_GUARDS = "TWINCACHE_SKIP_GUARDS"  # "0": every compiled step checks every guard (docs/design.md §7.30)


def _guard_skip_wanted() -> bool:
    """Whether a decode loop's steady steps may skip dynamo's guard check: yes unless TWINCACHE_SKIP_GUARDS is "0"
    (say, a process whose other threads run other compiled code while it decodes: the stance is process-wide)."""
    return switch(_SKIP_GUARDS, on="a decode loop's steady steps skip dynamo's guard check, the default",
                  off="every compiled step checks every guard")


@functools.cache
def _can_skip_guards() -> bool:
    """Whether this torch lets a call run only the guards that tell its compiled entries apart (torch >= 2.6)."""
    return (hasattr(torch._dynamo.eval_frame, "_stance")
            and "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters)


def _dynamo_entries(compiled: object) -> tuple[types.FunctionType, list[object]] | None:
    """The function that `compiled` (a torch.compile of it) compiles, and its code object's cache entries, most
    recently run first; None where this torch does not list a code object's entries."""
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    entries_of = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if not isinstance(original, types.FunctionType) or entries_of is None:
        return None
    return original, list(entries_of(original.__code__))


def _frame_locals(original: types.FunctionType, args: Sequence[object]) -> dict[str, object]:
    """What dynamo's guards read of a call of `original` with `args`: the arguments and the closure."""
    own = original.__code__
    frame_locals = dict(zip(own.co_varnames, args))
    frame_locals.update(zip(own.co_freevars, (cell.cell_contents for cell in original.__closure__ or ())))
    return frame_locals


def _guards_pass(entry: object, frame_locals: dict[str, object]) -> bool | None:
    """Whether a cache entry's guards pass for a call's frame; None where this torch's guard manager checks
    differently."""
    try:
        return bool(entry.guard_manager.check(frame_locals))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a torch whose guard manager checks differently
        return None


def _entry_function(compiled: object, args: Sequence[object]) -> _DecodeOne | None:
    """The code dynamo ran at the last call of the compiled function `compiled`, with `args`, as a plain function of
    the same arguments and closure (docs/design.md §7.34): its code object's most recent cache entry (dynamo moves the
    entry whose guards pass to the front), if that entry's guards pass for `args`. Calling it runs the entry's
    bytecode (gathering the graph's inputs, calling the compiled graph, returning its outputs) without dynamo's frame
    evaluation, guard lookup or stance. None where this torch does not list a code object's entries, the entry's
    code does not take the original's arguments, or its guards fail (the call ran another entry, or none; or this
    torch checks guards differently: the stance path instead)."""
    found = _dynamo_entries(compiled)
    if found is None:
        return None
    original, entries = found
    entry = entries[0] if entries else None
    code, own = getattr(entry, "code", None), original.__code__
    if not isinstance(code, types.CodeType) or (code.co_argcount, code.co_kwonlyargcount, code.co_freevars) != (
            own.co_argcount, own.co_kwonlyargcount, own.co_freevars) or len(args) != own.co_argcount:
        return None
    if not _guards_pass(entry, _frame_locals(original, args)):
        return None
    return types.FunctionType(code, original.__globals__, original.__name__, original.__defaults__,
                              original.__closure__)


@contextlib.contextmanager
def _decode_variant_limit() -> Iterator[None]:
    """Dynamo's recompile_limit at least MAX_DECODE_VARIANTS for the steps run inside: dynamo keys its graphs on
    the one decode-step code object, so every (model shape, cache kind, batch, dtype, bucket, sampling kind) a process
    decodes with is one entry, and the default limit of 8 made the 9th a hard error under fullgraph=True (at the
    limit, _make_room drops the step's entries instead, docs/design.md §5). The limit is the user's process-wide
    setting (one lowered to catch their own recompiles; the module raised it to 64 for good at the first compiled
    decode): it is theirs again after each step. Entered under _step_lock, so no two steps' restores interleave."""
    config = torch._dynamo.config
    before = config.recompile_limit
    config.recompile_limit = max(before, MAX_DECODE_VARIANTS)
    try:
        yield
    finally:
        config.recompile_limit = before


def _variant_limit() -> int:
    """The compiled entries one code object may hold before dynamo refuses another (FailOnRecompileLimitHit under
    fullgraph=True): its recompile_limit, or its cap over all of a code object's regions where that is lower."""
    config = torch._dynamo.config
    return min(config.recompile_limit, getattr(config, "accumulated_recompile_limit", config.recompile_limit))


def _must_make_room(entries: Sequence[object], frame_locals: dict[str, object], limit: int) -> bool:
    """Whether a call would compile one entry too many: its code holds `limit` entries or more, and none of them is
    known to pass this call's guards (one that cannot tell counts as failing: dropping the entries costs compiles
    again, reaching the limit a failed generation)."""
    return len(entries) >= limit and not any(_guards_pass(entry, frame_locals) for entry in entries)


def _make_room(compiled: object, args: Sequence[object]) -> None:
    """Before a call of the compiled decode step that may compile: if a new entry would pass dynamo's limit for the
    step's code (every model, cache shape, batch, dtype, bucket and sampling kind a process decodes with is one, and
    all models share the code), drop the code's entries and log one line, so that a long-running process keeps
    decoding (each variant used again compiles again) where it raised FailOnRecompileLimitHit. Where this torch
    cannot drop them, refuse the call with what to do. Checks guards only at the limit: a list's length otherwise."""
    found = _dynamo_entries(compiled)
    if found is None:
        return
    original, entries = found
    limit = _variant_limit()
    if len(entries) < limit or not _must_make_room(entries, _frame_locals(original, args), limit):
        return
    reset_code = getattr(torch._dynamo, "reset_code", None)
    if reset_code is None:
        raise ResourceError(f"the compiled decode step holds {len(entries)} variants (cache shapes, batches, sampling "
                            f"kinds, buckets), dynamo's limit of {limit} in one process, and this torch "
                            f"({torch.__version__}) cannot drop them; restart the process, raise "
                            "torch._dynamo.config.recompile_limit, or decode with compile=False")
    reset_code(original.__code__)
    NOTICES.warning("the compiled decode step reached dynamo's limit of %d variants in this process; dropped them, "
                    "so each variant used again compiles again", limit)


class _DecodeSteps:
    """A model's decode step (`_decode_one_fn`), run one call at a time (`__call__`) or as a loop's steps (`session`).

    A session enters inference mode and the compile settings once for all its steps (~15 us a step otherwise), and
    lets a step that repeats the one before it skip dynamo's guard checks (docs/design.md §7.30): 0.1-0.5 ms a step on
    CPU, where the trained model has ~300 guarded tensors. With `entry_calls` (CPU) such a step calls the code dynamo
    ran for the step before it directly (`_entry_function`, §7.34): no frame evaluation, guard lookup or stance at
    all, whose Python runs with caches the step's kernels have just flushed."""

    def __init__(self, step: _DecodeOne, settings: Callable[[], contextlib.AbstractContextManager[object]],
                 compiled: bool, entry_calls: bool = False) -> None:
        self.step, self.settings, self.compiled = step, settings, compiled
        self.compiled_step = step  # what dynamo compiled, whose entries `_entry_function` reads
        self.entry_calls = entry_calls

    def __call__(self, *args: object) -> tuple[torch.Tensor, ...]:
        with self.session(skip_guards=False) as run:
            return run(*args, repeats=False)

    @contextlib.contextmanager
    def session(self, skip_guards: bool) -> Iterator[Callable[..., tuple[torch.Tensor, ...]]]:
        """Yields `run(*args, repeats)`: one step. `repeats` True says the step's inputs are those of the session's
        previous step, with the outputs that step returned in place of its own (the same model, cache object, bucket,
        sampling kind, shapes, dtypes and devices): then, if no other compiled decode step ran since (in any thread),
        the entry that step's full guard check chose is dynamo's most recent, and only the guards that tell entries
        apart are checked (unless `skip_guards` is False). Every other step checks every guard, and may compile."""
        token = object()  # this session, as _last_step_run records it
        skip_allowed = skip_guards and self.compiled and _can_skip_guards()
        steady: list[_DecodeOne | None] = [None]  # the entry the last fully checked step ran, as a function
        eager: _DecodeOne = getattr(self.compiled_step, "_torchdynamo_orig_callable", self.compiled_step)

        def run(*args: object, repeats: bool) -> tuple[torch.Tensor, ...]:
            global _last_step_run
            if not self.compiled:
                return self.step(*args)
            if torch._dynamo.config.disable:  # TORCH_COMPILE_DISABLE=1: run eagerly, as torch.compile then does; under
                return eager(*args)  # fullgraph=True it raised "torch.compile ... found no compiled frames" instead
            with _step_lock:
                stance = torch._dynamo.eval_frame._stance  # kept: fail_on_recompile still fails, and so on
                evaluated = (not stance.skip_guard_eval_unsafe and stance.stance in ("default", "fail_on_recompile")
                             and stance.backend is None)  # dynamo checks every guard and runs (or compiles) an entry
                skip = skip_allowed and repeats and _last_step_run is token and evaluated
                _last_step_run = token
                if not skip:
                    steady[0] = None
                    with _decode_variant_limit():  # a step that may compile: under the lock, as every step
                        _make_room(self.compiled_step, args)
                        outputs = self.step(*args)
                    if skip_allowed and self.entry_calls and evaluated:  # under the lock: no other step ran since
                        steady[0] = _entry_function(self.compiled_step, args)
                    return outputs
                if steady[0] is not None:
                    return steady[0](*args)
                with torch.compiler.set_stance(stance.stance, skip_guard_eval_unsafe=True):
                    return self.step(*args)

        # grad mode is guarded on: entering inference mode here keeps it one graph for all callers
        with torch.inference_mode(), self.settings():
            yield run


_OVERLAP_STEPS = "TWINCACHE_OVERLAP_STEPS"  # "1": step k + 1 is launched before step k's tokens are read


def _overlap_wanted(device: torch.device) -> bool:
    """Whether a decode loop keeps two steps in flight (docs/design.md §7.31): by default where the device runs
    asynchronously to the host (not on CPU, where a step returns when it is done and an overlapped one only adds a
    step to roll back at EOS); TWINCACHE_OVERLAP_STEPS=1 or 0 says so for every device."""
    return switch(_OVERLAP_STEPS, on="two decode steps in flight", off="one decode step at a time",
                  default=device.type != "cpu")


@dataclasses.dataclass
class _InFlight:
    """A launched decode step whose tokens the host has not read: its host copy (`_HostCopies.start`), whether it
    is the first step of its attention bucket (timed apart: it may compile), and its logits' copy (return_logits)."""
    host: tuple[torch.Tensor, torch.cuda.Event | None]
    first_of_bucket: bool
    logits: torch.Tensor | None


def _outputs_replayed(compile: bool, device: torch.device) -> bool:
    """Whether each step returns the same output buffers, overwritten by the next step: a compiled step on a GPU,
    where reduce-overhead replays a CUDA graph. What the loop reads after launching the next step is copied out."""
    return compile and device.type == "cuda"


class _HostCopies:
    """A step's [B + 1] int64 for_host, copied to the host in stream order: into one of two buffers (pinned, with an
    event to wait on, on CUDA; the other buffer may hold the step before it) where the step's output is on a GPU or
    is overwritten by the next step (`replayed`); elsewhere the step's own output."""

    def __init__(self, size: int, device: torch.device, replayed: bool) -> None:
        self.cuda = device.type == "cuda"
        self.copies = self.cuda or replayed
        self.buffers = [torch.empty(size, dtype=torch.long, device="cpu", pin_memory=self.cuda) for _ in range(2)] \
            if self.copies else []
        self.turn = 0

    def start(self, for_host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if not self.copies:  # the step has run: its output is on the host (a fresh one per call)
            return for_host, None
        buffer, self.turn = self.buffers[self.turn], 1 - self.turn
        buffer.copy_(for_host, non_blocking=self.cuda)
        if not self.cuda:
            return buffer, None
        ready = torch.cuda.Event()
        ready.record()
        return buffer, ready

    @staticmethod
    def read(host: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[int]:
        buffer, ready = host
        if ready is not None:
            ready.synchronize()
        return buffer.tolist()


@contextlib.contextmanager
def _rolled_back_if_unread(cache: StaticCache, in_flight: collections.deque[_InFlight]) -> Iterator[None]:
    """On leaving a decode loop (done, or by an exception), undo the steps still in flight: an overlapped loop
    launched them before it knew it had ended (EOS, a non-finite step, on_token raising)."""
    try:
        yield
    finally:
        if in_flight:
            _roll_back(cache, len(in_flight))
            in_flight.clear()


def _roll_back(cache: StaticCache, steps: int) -> None:
    """Undo the last `steps` one-token writes: `length` goes back and their slots are empty again (position -1,
    zero K/V). A ring's slot held position p - W before the write, which no query from p on can see: it stays
    empty, not restored (its K/V were overwritten)."""
    cache.length.sub_(steps)
    slots, _ = cache._write_slots(steps)  # [steps] int64, from the restored length
    cache.slot_positions.index_fill_(1, slots, -1)
    for buffer in (*cache.keys, *cache.values):
        buffer.index_fill_(2, slots, 0)


def decode_step_fn(model: Mistral, compile: bool = True) -> DecodeStep:
    """The one-token step `(input_ids [B, 1], positions [B, 1], cache, attend_len=None) -> logits [B, V]` fp32,
    compiled once per model: the graph generate runs (its greedy choice unused here). `attend_len` is the step's
    attention bucket (twincache.buckets; None: every slot). Inputs, cache and bucket are checked before dispatch."""
    check_model_type(model, Mistral, "torch_cache")
    check_flags(compile=compile)
    decode_one = _decode_one_fn(model, compile)

    def step(input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache,
             attend_len: int | None = None) -> torch.Tensor:
        # The model's own checks are skipped inside the compiled step, where a write past the capacity or an id past
        # the vocabulary is an out-of-bounds kernel read and a short attend_len silently hides live keys: refuse them
        # (and bad positions, batch, dtype) before dispatch, as generate does up front.
        model.check_inputs(input_ids, positions, None)
        length = cache.check_forward(model.config, input_ids, model.dtype, model.device)
        if attend_len is not None:
            buckets.check_attend_len(attend_len, length, 1, cache.cache_len)
        device = input_ids.device
        if compile:  # batched CPU steps read packed weights (torch_cache/projection.py), checked once per call
            pack_projections(model, input_ids.shape[0])
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)  # [B]
        no_eos = _eos_tensor(model.config, (), device)  # [E]
        return decode_one(input_ids, positions, cache, attend_len, finished, no_eos,
                          *_no_draw_args(input_ids.shape[0], device), "greedy")[0]

    return step


@torch.inference_mode()
def prefill(model: Mistral, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: StaticCache,
            chunk_size: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run the left-padded prompt [B, T] through the model in chunks of at most `chunk_size` columns, filling the
    cache. Returns last-token logits [B, V] fp32.

    Each chunk attends over the cache plus itself, so memory is bounded by the chunk and the cache (a ring: W + chunk
    keys), not by the prompt. The whole prompt is checked before the first chunk: a refused prefill writes nothing.
    """
    phases.enter("prefill")
    mask_np = attention_mask.cpu().numpy()
    validate_attention_mask(mask_np, tuple(input_ids.shape))  # right padding would make [:, -1] a pad's logits
    positions = torch.from_numpy(positions_from_mask(mask_np)).to(input_ids.device).long()  # [B, T]
    chunks = prefill_chunks(input_ids.shape[1], chunk_size)
    model.check_inputs(input_ids, positions, attention_mask, mask_checked=True)
    # the host's copy of the cache length, read once for the check: it picks each chunk's attention bucket
    length = cache.check_forward(model.config, input_ids, model.dtype, model.device)
    for start, stop in chunks:
        attend = step_attend_len(length + start, stop - start, cache.cache_len)
        logits = model(input_ids[:, start:stop], positions[:, start:stop], cache, attention_mask[:, start:stop],
                       logits_to_keep=1, attend_len=attend)  # [B, 1, V]
    return logits[:, -1].float()


@torch.inference_mode()
def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, compile: bool = True,
             on_token: TokenCallback | None = None, return_logits: bool = False,
             forced_tokens: Sequence[Sequence[int]] | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. Rows are left-padded; each stops at its own EOS.

    `cache` is a kind ("static" / "sliding_window", default: sliding when the config has a window) or a cache
    object to reuse (it is reset first; a `max_cache_len` beside it must be its own); a cache built here without
    `max_cache_len` has prompt + max_new_tokens slots rounded up to a size class, and `result.max_cache_len` reports
    the planned capacity (docs/design.md §5). `on_token` receives each step's tokens, one per row. The prompt is
    prefilled in chunks of `prefill_chunk` columns. Every input is validated before a given cache is touched: a
    refused call changes nothing.
    `forced_tokens` teacher-forces the same decode path: row r emits forced_tokens[r][i] at step i instead of a
    sampled token and feeds it to step i + 1. Each row gives exactly max_new_tokens ids, and EOS ends no forced row.
    """
    check_model_type(model, Mistral, "torch_cache")
    config = model.config
    check_flags(compile=compile, return_logits=return_logits)
    _guard_skip_wanted()  # a bad TWINCACHE_SKIP_GUARDS or TWINCACHE_OVERLAP_STEPS is refused before the prefill
    _overlap_wanted(model.device)  # writes anything
    inputs = prepare_batch(prompts, config, sampling, max_new_tokens, prefill_chunk, on_token)
    rows = len(inputs.prompt_ids)
    forced = None if forced_tokens is None else validate_forced_tokens(forced_tokens, rows, inputs.max_new_tokens,
                                                                       config)  # [rows, N]
    sampling, max_new_tokens = inputs.sampling, inputs.max_new_tokens
    prompt_len = inputs.input_ids.shape[1]  # [rows, T]
    eos = config.eos_token_ids if forced is None else ()  # a forced row runs to its last forced token
    device, dtype = model.device, model.dtype
    if cache is not None and not isinstance(cache, str):
        cache_checks.check_cache_type(cache, StaticCache, "torch_cache", _CACHE_HINT)
        # a cache generate padded for this many rows (its real_rows: a batch class, a data split) is padded again
        padded_rows = cache.batch_size if cache.real_rows == rows else rows
        _check_outputs_fit(padded_rows, max_new_tokens, config.vocab_size, return_logits, device)
        check_given_cache_len(max_cache_len, cache.max_cache_len, cache.capacity)
        cache.check_compatible(config, padded_rows, dtype, device)  # before reset(): a refused call changes nothing
        model._check_mesh(cache)
        check_budget(cache.capacity, prompt_len, max_new_tokens)
        cache.reset()
        planned_len = cache.max_cache_len
    else:
        kind, planned_len = plan_cache(config, cache, prompt_len, max_new_tokens, max_cache_len)
        # reported as planned; a cache sized here is rounded up to a size class, so that every total in the class
        # runs one compiled step, and a ring holds only min(W, it) slots; its rows are the batch's size class, a
        # multiple of a data split (docs/design.md §5)
        def build_rows(batch: int) -> StaticCache:
            _check_outputs_fit(batch, max_new_tokens, config.vocab_size, return_logits, device)

            def build(slots: int) -> StaticCache:
                return make_cache(kind, config, batch, slots, dtype, device, model.mesh)

            return build(planned_len) if max_cache_len is not None else build_sized_cache(build, config, kind,
                                                                                           planned_len)

        cache = build_batch_class(build_rows, rows, 1 if model.mesh is None else sharding.mesh_shape(model.mesh).data)
    # the batch padded up to the cache's rows: copies of the last row, finished from the first decode step; the cache
    # records the real rows, for continue_generation to pad that many last tokens again (pad_continuation)
    inputs, on_token = pad_batch(inputs, cache.batch_size, on_token)
    cache.real_rows = rows if rows < cache.batch_size else None
    forced = None if forced is None else pad_rows(forced, cache.batch_size)  # [B, N]: the padding rows copy the last
    prompt_ids = inputs.prompt_ids
    if max_new_tokens == 0:  # logits asked for: [B, 0, V], as continue_generation gives
        no_logits = torch.zeros(len(prompt_ids), 0, config.vocab_size, device=device) if return_logits else None
        return keep_rows(GenerationResult(cache.kind, planned_len, prompt_ids, [[] for _ in prompt_ids], 0.0, 0.0,
                                          0.0, 0, 0, no_logits, cache, "compiled" if compile else "eager"), rows)
    if compile and max_new_tokens > 1 and not torch._dynamo.config.disable:  # the first decode step compiles
        announce_compile("torch.compile")
    start = time.perf_counter()
    logits = prefill(model, torch.from_numpy(inputs.input_ids).long().to(device),
                     torch.from_numpy(inputs.attention_mask).to(device), cache, inputs.prefill_chunk)  # [B, V]
    first_forced = None if forced is None else torch.from_numpy(forced[:, 0]).long().to(device)  # [B]
    first = _first_tokens(logits, sampling, _eos_tensor(config, eos, device), first_forced)[:rows]  # the real rows
    prefill_s = time.perf_counter() - start
    if on_token is not None:  # a copy: `first` feeds the continuation and the result, whatever the callback does
        on_token(list(first))
    # The real rows only: continue_generation gives a data split's padding rows their copies again, finished
    rest = continue_generation(model, cache, first, max_new_tokens - 1, sampling=sampling, compile=compile,
                               on_token=on_token, return_logits=return_logits,
                               forced_tokens=None if forced is None else forced[:rows, 1:], first_step=1)
    # Per row: rows end at different lengths (each at its own EOS), so they are joined row by row, never zipped.
    tokens = [[token] + ([] if token in eos else more) for token, more in zip(first, rest.token_ids, strict=True)]
    # [rows, steps, V]
    step_logits = torch.cat([logits[:rows, None], rest.step_logits], dim=1) if return_logits else None
    return dataclasses.replace(rest, max_cache_len=planned_len, prompt_ids=prompt_ids[:rows], token_ids=tokens,
                               prefill_s=prefill_s, step_logits=step_logits)


@torch.inference_mode()
def continue_generation(model: Mistral, cache: StaticCache, last_tokens: Sequence[int], max_new_tokens: int, *,
                        sampling: SamplingParams | None = None, compile: bool = True,
                        on_token: TokenCallback | None = None, return_logits: bool = False,
                        forced_tokens: Sequence[Sequence[int]] | np.ndarray | None = None,
                        first_step: int = 0) -> GenerationResult:
    """Feed each row's last sampled token (not yet in `cache`) and decode up to `max_new_tokens` more.

    Positions come from the cache itself, so a cache handed over from jax_cache continues exactly where it was.
    A row whose last token is EOS is finished. Returns only the new tokens; `result.cache` is `cache`, written in place.
    `forced_tokens` teacher-forces the steps, as in `generate`.
    When decoding ends by an exception (on_token raising, a KeyboardInterrupt, NonFiniteLogitsError: re-raised as it
    came), `cache` holds every step the host has read, the one whose tokens on_token was handed last included (and a
    non-finite step, whose input token it wrote), and none after it: a step in flight but not read is rolled back.
    Continue from on_token's last tokens with `first_step` advanced by the steps it received (docs/design.md §7.31;
    jax_cache's cache object does the same).
    `first_step`: the index, within the generation, of the first token this call samples (generate's prefill token
    is 0); pass the number of tokens generated so far to continue a seeded generation's stream: `generate(n)` then
    `continue_generation(..., m, first_step=n)` samples the tokens of one `generate(n + m)`. A sampled step k draws
    with the seed and step index `first_step + k`, as jax_cache does (each backend from its own stream). Greedy and
    teacher-forced tokens do not depend on it.
    """
    check_model_type(model, Mistral, "torch_cache")
    config = model.config
    check_flags(compile=compile, return_logits=return_logits)
    skip_guards = _guard_skip_wanted()
    cache_checks.check_cache_type(cache, StaticCache, "torch_cache", _CACHE_HINT)
    overlap = _overlap_wanted(cache.device)
    last_tokens, sampling, max_new_tokens = prepare_continuation(last_tokens, config, sampling, max_new_tokens,
                                                                 on_token)
    first_step = check_first_step(first_step, max_new_tokens)
    rows = len(last_tokens)  # generate keeps its padding rows in the cache (pad_batch: a batch class, a data split)
    last_tokens, on_token = pad_continuation(last_tokens, cache.batch_size, cache.real_rows, on_token)
    device, dtype = model.device, model.dtype
    cache.check_compatible(config, len(last_tokens), dtype, device)
    # refused up front, not after decoding part of the budget; the host's copy of the cache length picks each step's
    # attention bucket
    check_continuation_room(cache.capacity, int(cache.length), max_new_tokens)
    length = cache._check_write_range(max_new_tokens)
    positions = cache.next_positions()[:, None]  # [B, 1], the positions of last_tokens
    check_positions(config, int(positions.max()) + 1, max_new_tokens, length + max_new_tokens)
    _check_outputs_fit(len(last_tokens), max_new_tokens, config.vocab_size, return_logits, device)
    forced = None
    if forced_tokens is not None:
        forced_np = pad_rows(validate_forced_tokens(forced_tokens, rows, max_new_tokens, config),
                             len(last_tokens))
        # [N, B]: step k's row forced[k] is contiguous, laid out as a sampled [B] is, so the compiled step's stride
        # guards hold and forcing never recompiles it
        forced = torch.from_numpy(forced_np.T.copy()).long().to(device)
    eos = config.eos_token_ids if forced is None else ()  # a forced row runs to its last forced token
    eos_ids = _eos_tensor(config, eos, device)  # [E]
    next_ids = torch.tensor(last_tokens, dtype=torch.long, device=device)  # [B]
    finished = (next_ids[:, None] == eos_ids).any(dim=-1)  # [B, E] -> [B]; ids are >= 0, so -1 matches none
    if eos:  # generate's padding rows (pad_batch) are finished: a sampled copy would keep the batch decoding
        finished[rows:] = True
    kind = "greedy" if forced is not None else _sampling_kind(sampling)  # forcing replaces the choice
    not_forced = torch.zeros(len(last_tokens), dtype=torch.long, device=device)  # [B]
    forcing = torch.tensor(forced is not None, device=device)  # [] bool
    step_key = _StepKey(sampling.seed, device)
    index_bits = _sampling_bits(kind, len(last_tokens), config.vocab_size, device)
    knobs = _knobs(sampling, device)
    stepper = _decode_one_fn(model, compile)
    depth = 2 if overlap else 1  # steps in flight at once
    replayed = _outputs_replayed(compile, device)  # reduce-overhead replays CUDA graphs into the same output buffers
    if compile:  # batched CPU steps read packed weights (torch_cache/projection.py): made or checked once per call
        pack_projections(model, len(last_tokens))
    tokens: list[list[int]] = [[] for _ in last_tokens]
    step_logits: list[torch.Tensor] = []
    first_step_s = decode_s = 0.0
    decode_steps = timed_steps = launched = 0
    bucket = None
    all_done = bool(eos) and all(t in eos for t in last_tokens[:rows])
    in_flight: collections.deque[_InFlight] = collections.deque()  # launched steps whose tokens are not read yet
    host_copies = _HostCopies(len(last_tokens) + 1, device, replayed)
    phases.enter("compile" if compile else "decode")  # a compiled step compiles at its first call
    stamp = time.perf_counter()
    with stepper.session(skip_guards) as decode_one, _rolled_back_if_unread(cache, in_flight):
        while True:
            # Launch until `depth` steps are in flight: step k + 1 reads step k's tokens on the device, so it is
            # queued before the host waits for step k's (overlapped steps, docs/design.md §7.31)
            while len(in_flight) < depth and launched < max_new_tokens and not all_done:
                attend = step_attend_len(length, 1, cache.cache_len)
                forced_now = not_forced if forced is None else forced[launched]  # [B]
                # A step in the bucket of the step before it repeats that step: the same cache, kind and shapes, with
                # the outputs it returned as inputs (on_token, run in between, is handed ids and changes none of them)
                logits, next_ids, finished, positions, for_host = decode_one(
                    next_ids[:, None], positions, cache, attend, finished, eos_ids, forced_now, forcing,
                    step_key.tensor if kind == "greedy" else step_key.at(first_step + launched), index_bits, *knobs,
                    kind, repeats=attend == bucket)
                # cudagraph outputs are overwritten by the next replay: what is read later is copied out now, in
                # stream order (no host sync). Elsewhere each call returns new tensors.
                in_flight.append(_InFlight(host_copies.start(for_host), attend != bucket,
                                           (logits.clone() if replayed else logits) if return_logits else None))
                if replayed:
                    next_ids, finished, positions = next_ids.clone(), finished.clone(), positions.clone()
                length, launched, bucket = length + 1, launched + 1, attend
            if all_done or not in_flight:  # a step launched after the last one wanted is rolled back on the way out
                break
            step = in_flight.popleft()
            *row_ids, non_finite = host_copies.read(step.host)  # the step's one host copy: its tokens and NaN flag
            decode_steps += 1
            _raise_if_non_finite(non_finite != 0, decode_steps, logits.dtype)
            if step.logits is not None:
                step_logits.append(step.logits)
            all_done = bool(eos) and all(token in eos for token in row_ids)
            now = time.perf_counter()
            if step.first_of_bucket:  # the first step of each bucket may compile: timed apart from the steady state
                first_step_s += now - stamp
            else:
                decode_s, timed_steps = decode_s + now - stamp, timed_steps + 1
            stamp = now
            if decode_steps == 1 and compile:
                phases.enter("decode")
            append_tokens(tokens, row_ids, eos, last_tokens)
            if on_token is not None:
                on_token(row_ids)
    logits_out = None
    if return_logits:  # [B, steps, V]; steps is 0 when every row had already ended
        empty = torch.zeros(len(tokens), 0, config.vocab_size, device=device)
        logits_out = torch.stack(step_logits, dim=1) if step_logits else empty
    return keep_rows(GenerationResult(cache.kind, cache.max_cache_len, [[] for _ in tokens], tokens, 0.0, first_step_s,
                                      decode_s, decode_steps, timed_steps, logits_out, cache,
                                      "compiled" if compile else "eager"), rows)


def _check_outputs_fit(batch: int, steps: int, vocab_size: int, return_logits: bool, device: torch.device) -> None:
    """return_logits keeps [batch, steps, vocab] fp32 logits (twice, while they are stacked): refuse it up front."""
    if not return_logits:
        return
    cache_checks.check_fits(f"return_logits over {steps} steps (2 x [{batch}, {steps}, {vocab_size}] float32)",
                            2 * batch * steps * vocab_size * 4, available_memory(device), memory_label(device),
                            "generate fewer tokens or pass return_logits=False")


def _no_draw_args(batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """forced, forcing, step_key, index_bits, temperature, top_k, top_p for a greedy step that forces nothing."""
    return (torch.zeros(batch, dtype=torch.long, device=device), torch.tensor(False, device=device),
            torch.tensor(0, dtype=torch.long, device=device), _sampling_bits("greedy", batch, 0, device),
            *_knobs(SamplingParams(), device))


def _sampling_bits(kind: str, batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The `index_bits` a step of this sampling kind reads: [B, V] when it draws; [B, 0] for greedy (it reads none)."""
    if kind == "greedy":
        return torch.zeros(batch, 0, dtype=torch.long, device=device)
    return _index_bits(batch, vocab, device)


def _first_tokens(logits: torch.Tensor, sampling: SamplingParams, eos: torch.Tensor,
                  forced: torch.Tensor | None) -> list[int]:
    """The prefill's tokens (generated-token index 0), chosen as every later step chooses (`_choose`, eagerly, with
    the `eos` ids [E]), or the `forced` ones [B]. Raises on non-finite logits. Returns them on the host, in the one
    copy of this step."""
    batch = logits.shape[0]
    device = logits.device
    kind = "greedy" if forced is not None else _sampling_kind(sampling)
    forcing = torch.tensor(forced is not None, device=device)
    forced = torch.zeros(batch, dtype=torch.long, device=device) if forced is None else forced
    index_bits = _sampling_bits(kind, batch, logits.shape[-1], device)
    _, _, for_host = _choose(logits, torch.zeros(batch, dtype=torch.bool, device=device), eos, forced, forcing,
                             _StepKey(sampling.seed, device).at(0), index_bits, *_knobs(sampling, device), kind)
    *row_ids, non_finite = for_host.tolist()
    _raise_if_non_finite(non_finite != 0, 0, logits.dtype)
    return row_ids


def _eos_tensor(config: MistralConfig, eos: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The `eos` ids (() for none) as the step takes them: [E] int64, E = how many the config lists (at least 1),
    padded with -1, which no token matches. One shape per config, whether a call stops at EOS or not (teacher forcing,
    decode_step_fn), so stopping never compiles another step graph."""
    width = max(len(config.eos_token_ids), 1)
    return torch.tensor(list(eos) + [-1] * (width - len(eos)), dtype=torch.long, device=device)  # [E]


def _raise_if_non_finite(non_finite: bool, step: int, dtype: torch.dtype) -> None:
    if non_finite:
        raise NonFiniteLogitsError(f"the model produced NaN or Inf logits at generated token {step}; the weights "
                                   f"or dtype ({dtype}) are not usable for this input")


__all__ = ["MAX_DECODE_VARIANTS", "DecodeStep", "sample", "decode_step_fn", "prefill", "generate",
           "continue_generation", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "filter_logits"]
