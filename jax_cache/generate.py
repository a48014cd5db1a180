"""Generation with jax_cache: a jitted prefill over power-of-two prompt buckets, then decoding with the cache donated
to every jitted call, so XLA updates its buffers in place.

Two decode modes:
  fused (default): the decode loop runs as jitted blocks of FUSED_BLOCK_STEPS steps, each one `lax.while_loop` that
    stops each row at EOS; each block's tokens come back to the host (and to `on_token`) when it ends.
  step: one jitted step per token, queued one step ahead; each step's tokens come back to the host.
Both run one decode body (`decode_body`) over a named `DecodeState`, and fold the step index into one PRNG key, so
they sample the same tokens for the same seed (docs/design.md §5).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_cache import sharding
from jax_cache.cache import StaticCache, _mesh_emptiers, available_memory, default_device, make_cache, memory_label
from jax_cache.model import Mistral
from twincache import buckets, cache_checks, phases
from twincache.buckets import decode_buckets, step_attend_len
from twincache.errors import NonFiniteLogitsError
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
    pad_token_id,
    plan_cache,
    positions_from_mask,
    prefill_chunks,
    prepare_batch,
    prepare_continuation,
    validate_attention_mask,
    validate_forced_tokens,
)
from twincache.mesh import keep_rows, pad_batch, pad_continuation, pad_rows

MIN_PROMPT_BUCKET = 16
# The fused mode's blocks (docs/design.md §5). Every block runs one compiled loop whose outputs hold up to
# FUSED_BLOCK_STEPS steps; the host sizes each block from the last one's wall time to last about FUSED_BLOCK_SECONDS,
# so tokens stream (and a KeyboardInterrupt lands) ~10 times a second on any model. Measured (bench/fused_blocks.py,
# CPU time per token against one loop over the whole budget): a block costs ~0.3 ms of host time, nothing next to a
# 135M model's step (blocks of 4 keep 100%), but a 2-layer random model's step is ~15 us, and it keeps ~90% of its
# speed only from 256 steps per block (32: 56%).
FUSED_BLOCK_STEPS = 256
FUSED_BLOCK_SECONDS = 0.1
# Before any block was timed: one step, so the first token comes as soon as the step mode's, and that block (whose
# first run also sets up XLA-CPU's kernels, ~0.4-0.9 s on the trained model) is the fused mode's "first step".
FIRST_BLOCK_STEPS = 1
_CACHE_HINT = cache_checks.cache_hint("jax_cache") + ", or a kind name"
MIN_TEMPERATURE = float(jnp.finfo(jnp.float32).tiny)  # 1.2e-38: lower temperatures sample as this one
# 3.4e38: higher temperatures (finite in Python, inf as float32) sample as this one, a uniform draw from the
# kept tokens
MAX_TEMPERATURE = float(jnp.finfo(jnp.float32).max)
# top-k and top-p look for their cuts among this many most probable tokens first, and sort the whole vocabulary only
# when top_k reaches past them or their mass stays under top_p: XLA-CPU sorts a 49,152-token row in ~20 ms (top_k of
# 1,024: ~0.9 ms), a 135M model's step is ~40 ms.
TOP_P_CANDIDATES = 1024
DecodeStep = Callable[[jax.Array, jax.Array, StaticCache, int | None], tuple[jax.Array, StaticCache]]
_Knobs = tuple[jax.Array, jax.Array, jax.Array]  # temperature [] float32, top_k [] int32, top_p [] float32


def _sampling_kind(sampling: SamplingParams) -> str:
    """What a step computes to choose its tokens, one executable each: "greedy" (argmax), "temperature" (a draw
    from every token) or "filtered" (a draw after top-k / top-p). The kind is a static argument of the jitted steps;
    the values of the temperature, top_k and top_p are traced (`_knobs`), so another setting of the same kind reuses
    its executables, as in torch_cache."""
    if sampling.greedy:
        return "greedy"
    return "filtered" if sampling.top_k or sampling.top_p < 1.0 else "temperature"


def _knobs(sampling: SamplingParams) -> _Knobs:
    """The sampling settings as the arrays `_filter` takes: temperature [] float32, top_k [] int32, top_p [] float32
    (the seed lives in the PRNG key)."""
    temperature = min(sampling.temperature, MAX_TEMPERATURE)  # a float32 cast of more overflows, with a warning
    return jnp.float32(temperature), jnp.int32(sampling.top_k), jnp.float32(sampling.top_p)


class _BoundedJit:
    """A jitted function whose compiled variants are bounded as the fused blocks' are (docs/design.md §5, "JAX's
    executables, bounded too"): every cache shape, batch, bucket and sampling kind is one executable in jax.jit's own
    cache, which keeps thousands (~40-50 MB of RSS each on the default model), so a service whose requests each size
    their own cache grew by GBs. A call that compiles a variant past MAX_DECODE_VARIANTS drops the executables of
    every jitted function of the tower and of the eager ops (`_drop_executables`; a user's jitted functions keep
    theirs), as torch_cache drops its decode step's entries at that count; the variant it ran compiles again at its
    next call. The steady path reads the jit cache's entry count before and after the call (two C++ calls, ~50 ns
    each; no host sync). Everything else (`lower`, `_cache_size`, ...) is the jitted function's."""

    def __init__(self, jitted: Any) -> None:
        self.jitted = jitted
        self.compiles = 0  # variants compiled in this process, one compiled again after a drop counted again
        functools.update_wrapper(self, jitted)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before = self.jitted._cache_size()
        out = self.jitted(*args, **kwargs)
        after = self.jitted._cache_size()
        if after != before:  # compiled now (or another thread did, or dropped, meanwhile)
            with _variants_lock:
                self.compiles += max(after - before, 0)
            if after > MAX_DECODE_VARIANTS:
                _drop_executables(self.__name__)
        return out


def _bounded(jitted: Any) -> _BoundedJit:
    bounded = _BoundedJit(jitted)
    _BOUNDED_JITS.append(bounded)
    return bounded


def _drop_executables(name: str) -> None:
    """Free the executables that jax_cache's variants hold, so that host memory stays bounded; each variant used
    again compiles again (from XLA's persistent cache where one is set). The process's other jitted functions keep
    theirs: a user's jitted function runs what it compiled before the drop without tracing or compiling again.

    What holds a variant's memory (docs/design.md §5, measured on jax 0.10.2): the jitted function's entry in jit's
    C++ cache and its trace (the jaxpr keys JAX's lowering cache, whose lowering keeps its compiled executable: the
    fused blocks' too, evicted from their table or not), both dropped by its `clear_cache()`; the eager ops that
    build and read a cache of each shape: primitives (`jnp.zeros`), each an executable of a jitted callable that
    dispatch.xla_primitive_callable keeps, and JAX's own jitted library functions called eagerly (`jnp.max` in a
    cache's `next_positions()`), whose C++ entries and traces their `clear_cache()` drops; and the traces of the JAX
    functions nested in ours (jnp's ufuncs, einsum), one per shape in partial_eval.trace_to_jaxpr, which has no
    size limit. So this clears jax_cache's jitted functions, JAX's module-level jitted functions, the primitive
    callables, and the traces of functions of jax_cache and JAX (a user's eager ops compile again once per shape,
    as after jax.clear_caches()). Where this JAX lacks one of those private caches (or its keys read otherwise),
    jax.clear_caches() drops every executable of the process instead, and the warning says so."""
    with _variants_lock:
        if all(bounded.jitted._cache_size() <= MAX_DECODE_VARIANTS for bounded in _BOUNDED_JITS):
            return  # another thread dropped them meanwhile
        dispatch = sys.modules.get("jax._src.dispatch")
        clear_primitives = getattr(getattr(dispatch, "xla_primitive_callable", None), "cache_clear", None)
        traces = getattr(sys.modules.get("jax._src.interpreters.partial_eval"), "trace_to_jaxpr", None)
        try:  # each key: (a weak reference to the traced function, its signature, ...)
            keys = traces.cache_keys()  # type: ignore[union-attr]
            traced = [key[0]() for key in keys if isinstance(key, tuple) and isinstance(key[0], weakref.ref)]
            evict = traces.evict_weakref if len(traced) == len(keys) else None  # type: ignore[union-attr]
        except (AttributeError, TypeError, IndexError):
            traced, evict = [], None
        if clear_primitives is None or evict is None:
            jax.clear_caches()
            dropped = "JAX's compiled executables (all of this process's)"
        else:
            jitted_type = type(_fused_decode)  # jax.jit's (jaxlib's PjitFunction)
            jitted = [bounded.jitted for bounded in _BOUNDED_JITS] + list(_mesh_emptiers.values())
            for module_name, module in list(sys.modules.items()):
                if module_name.partition(".")[0] in _DROPPED_MODULES:
                    jitted += [value for value in list(getattr(module, "__dict__", {}).values())
                               if type(value) is jitted_type]
            for function in jitted:
                function.clear_cache()
            clear_primitives()
            for function in traced:
                if str(getattr(function, "__module__", None)).partition(".")[0] in _DROPPED_MODULES:
                    evict(function)
            dropped = ("jax_cache's compiled executables and JAX's eager ops' (the process's other jitted functions "
                       "keep theirs)")
        with _fused_lock:
            _fused_executables.clear()
    NOTICES.warning("jax_cache's %s passed the limit of %d compiled variants in this process (cache shapes, "
                    "batches, buckets, sampling kinds); dropped %s, so each variant used again compiles again. To "
                    "compile few: reuse a cache object, or let the tower size the cache (no max_cache_len: size "
                    "classes)", name, MAX_DECODE_VARIANTS, dropped)


# The packages whose module-level jitted functions and traces a drop clears: jax_cache's own (_fused_decode, the
# cache's _empty_in_place, ...), and JAX's library functions, which hold the eager ops of each cache shape
_DROPPED_MODULES = ("jax_cache", "jax")

_BOUNDED_JITS: list[_BoundedJit] = []
_variants_lock = threading.Lock()


@_bounded
@functools.partial(jax.jit, static_argnames=("filters",))
def _filter(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
            filters: bool) -> jax.Array:
    """filter_logits with its settings as arrays (the form the jitted steps take). `filters` False skips top-k and
    top-p, which a kind other than "filtered" does not use. [B, V]

    Both cuts come from the row's first N tokens in descending order: the TOP_P_CANDIDATES most probable (lax.top_k),
    or, when top_k reaches past them or their mass stays under top_p (a flat distribution), the whole sorted row
    (lax.cond: only then is the vocabulary sorted). Jitted itself for the calls outside the jitted steps
    (filter_logits, sample, generate's first token): a lax.cond run eagerly compiles its branches again at every
    call (~2 s for a 49,152-token row), since they close over that call's arrays."""
    peak = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    temperature = jnp.maximum(temperature, MIN_TEMPERATURE)
    scaled = (logits - peak) / temperature  # [B, V]
    if not filters:
        return scaled

    def cut(sorted_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """From the first n unscaled logits of each row in descending order [B, n]: the smallest logit both filters
        keep [B, 1], and whether those n decided it [] (else the tokens after them might count). Both cuts read the
        unscaled logits, whose order the temperature keeps: scaled, distinct logits can round to one value (a huge T
        made every token 0 and top_k=1 kept them all: a uniform draw, not the greedy token)."""
        n = sorted_logits.shape[-1]
        # top_k 0 keeps all; a top_k past n reads the n-th here, and the whole row decides
        kth = lax.dynamic_slice_in_dim(sorted_logits, jnp.clip(top_k, 1, n) - 1, 1, axis=-1)  # [B, 1]
        kth_largest = jnp.where(top_k > 0, kth, -jnp.inf)  # [B, 1]
        # top-p on the top-k survivors: their softmax's denominator (the top logit is 0), over the whole row
        total = _sum_exactly(jnp.exp(jnp.where(logits < kth_largest, -jnp.inf, scaled)))  # [B, 1]
        survivors = jnp.where(sorted_logits < kth_largest, -jnp.inf, (sorted_logits - peak) / temperature)  # [B, n]
        cutoff, cut_inside = _top_p_cutoff(survivors, total, top_p, sorted_logits)
        cutoff = jnp.where(top_p < 1.0, cutoff, -jnp.inf)  # top_p 1 keeps all: rounding in the sums must not cut
        decided = (top_k <= n) & ((top_p >= 1.0) | jnp.all(cut_inside))  # []
        return jnp.maximum(kth_largest, cutoff), decided

    def from_whole_vocabulary() -> jax.Array:
        return cut(jnp.flip(jnp.sort(logits, axis=-1), axis=-1))[0]

    if logits.shape[-1] > TOP_P_CANDIDATES:
        bound, decided = cut(lax.top_k(logits, TOP_P_CANDIDATES)[0])  # [B, N], the first N of the sorted row
        bound = lax.cond(decided, lambda: bound, from_whole_vocabulary)
    else:
        bound = from_whole_vocabulary()
    return jnp.where(logits < bound, -jnp.inf, scaled)


def filter_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """fp32 logits [B, V] scaled by the temperature, with the tokens top-k and top-p leave out at -inf. [B, V]

    Scaled as (logits - max) / T: the top token sits at 0 and every other is below it, so a tiny T overflows only
    to -inf (never to inf, or inf - inf = NaN), and sampling tends to greedy as T -> 0. A T below float32's smallest
    normal number acts as that number. Both filters cut by value, so a tie at the boundary keeps every tied token.
    top-p applies to the top-k survivors' renormalised mass. The jitted decode steps compute this same function.
    """
    return _filter(logits, *_knobs(sampling), _sampling_kind(sampling) == "filtered")


def _top_p_cutoff(sorted_logits: jax.Array, total: jax.Array, top_p: jax.Array | float,
                  values: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """From the first N scaled logits of each row sorted in descending order [B, N] and the softmax's denominator
    over the whole row [B, 1]: the smallest logit top-p keeps [B, 1] (read from `values` [B, N], the same tokens'
    unscaled logits, when given), and whether the cut fell inside those N [B, 1] (else the tokens after them might
    be kept too). The masses are elementwise the whole row's, and a cumulative sum's prefix
    does not depend on what follows it, so any N that holds the cut gives the whole vocabulary's answer."""
    masses = jnp.exp(sorted_logits)  # [B, N], unnormalised probabilities (the top logit is 0)
    # Keep a token while the tokens ranked above it hold less than top_p; the top token always stays (also when
    # NaN logits make every comparison false: they are reported by the caller, not indexed out of range here).
    # The mass above each token, as torch_cache computes it (docs/design.md §5): the exclusive prefix sum (0 first)
    # of the unnormalised masses, each sum the exact one rounded once, divided once by the total.
    prefix = _prefix_sums_exactly(masses, total)  # [B, N]
    above = jnp.concatenate([jnp.zeros_like(prefix[:, :1]), prefix[:, :-1]], axis=-1) / total  # [B, N]
    kept = jnp.maximum(jnp.sum(above < top_p, axis=-1, keepdims=True), 1)  # [B, 1]
    cutoff = jnp.take_along_axis(sorted_logits if values is None else values, kept - 1, axis=-1)  # [B, 1]
    return cutoff, kept < sorted_logits.shape[-1]


def _grid(total: jax.Array) -> jax.Array:
    """A power of two per row [B, 1] for masses whose sum is `total` [B, 1]: multiples of it up to 4 x total sum
    exactly in float32, in any order, and a mass rounded to a multiple of it leaves at most 2^-22 x total over."""
    _, exponent = jnp.frexp(total)  # total = m * 2^exponent, m in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(total), exponent - 22)


def _split(x: jax.Array, grid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, N] as high + low, both exact: high a multiple of `grid` [B, 1] (it sums exactly), low the small rest."""
    high = jnp.round(x / grid) * grid
    return high, x - high


def _sum_exactly(x: jax.Array) -> jax.Array:
    """The sum of float32 masses [B, V] along the last axis, nearly the exact one rounded once: the high parts sum
    exactly (`_grid`), and only the small low parts carry float32 rounding. [B, 1]"""
    high, low = _split(x, _grid(jnp.sum(x, axis=-1, keepdims=True)))  # a float32 sum is well within 2x of the exact
    return jnp.sum(high, axis=-1, keepdims=True) + jnp.sum(low, axis=-1, keepdims=True)


def _prefix_sums_exactly(x: jax.Array, total: jax.Array) -> jax.Array:
    """Inclusive prefix sums of float32 masses [B, N] whose row sums to at most `total` [B, 1], as `_sum_exactly`:
    XLA's float32 cumsum (a tree) missed the correctly rounded sum at ~45% of the positions of 1,024- and
    49,152-token rows; these at 0-0.4% (the rest within an ulp), with no float64 (JAX's default has none). [B, N]"""
    high, low = _split(x, _grid(total))
    return jnp.cumsum(high, axis=-1) + jnp.cumsum(low, axis=-1)


def sample(logits: jax.Array, sampling: SamplingParams, key: jax.Array) -> jax.Array:
    """Next token per row from fp32 logits [B, V]: greedy, or temperature with top-k and top-p filtering. [B] int32."""
    return _sample(logits, _sampling_kind(sampling), _knobs(sampling), key)


def _sample(logits: jax.Array, kind: str, knobs: _Knobs, key: jax.Array) -> jax.Array:
    """sample() with the settings as the jitted steps take them: the `kind` (static) and the `knobs` (traced). [B]"""
    if kind == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # JAX's default since 0.5, pinned: a user's jax_threefry_partitionable=False drew other tokens for one seed
    with jax.threefry_partitionable(True):
        return jax.random.categorical(key, _filter(logits, *knobs, kind == "filtered"), axis=-1).astype(jnp.int32)


def _seed_key(seed: int) -> jax.Array:
    """The PRNG key of a generation's seed, as threefry2x32 whatever the process's default: a user's
    jax_default_prng_impl ("rbg", "unsafe_rbg") drew other tokens for one seed than a default process did."""
    return jax.random.key(seed, impl="threefry2x32")


class ModelGraph:
    """A model's nnx GraphDef as a jit static argument, hashed once. jit hashes its static arguments on every call,
    and hashing a GraphDef costs ~70 us: a third of a default-model decode step."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef) -> None:
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelGraph) and self.graphdef == other.graphdef


def split_model(model: Mistral) -> tuple[ModelGraph, nnx.State]:
    """nnx.split, with the GraphDef wrapped for jit."""
    graphdef, state = nnx.split(model)
    return ModelGraph(graphdef), state


def _forward_last(graph: ModelGraph, params: nnx.State, cache: StaticCache, input_ids: jax.Array,
                  positions: jax.Array, attention_mask: jax.Array | None,
                  attend_len: int | None) -> tuple[jax.Array, StaticCache]:
    logits, cache = nnx.merge(graph.graphdef, params)(input_ids, positions, cache, attention_mask, logits_to_keep=1,
                                                      attend_len=attend_len)
    return logits[:, -1].astype(jnp.float32), sharding.place_cache(cache)  # [B, V]


@_bounded
@functools.partial(jax.jit, static_argnames=("graph", "attend_len"), donate_argnames=("cache",))
def _prefill(graph: ModelGraph, params: nnx.State, cache: StaticCache, input_ids: jax.Array, positions: jax.Array,
             attention_mask: jax.Array, attend_len: int | None) -> tuple[jax.Array, StaticCache]:
    return _forward_last(graph, params, cache, input_ids, positions, attention_mask, attend_len)


@_bounded
@functools.partial(jax.jit, static_argnames=("graph", "attend_len"), donate_argnames=("cache",))
def _decode_step(graph: ModelGraph, params: nnx.State, cache: StaticCache, input_ids: jax.Array,
                 positions: jax.Array, attend_len: int | None) -> tuple[jax.Array, StaticCache]:
    return _forward_last(graph, params, cache, input_ids, positions, None, attend_len)


def _pick(logits: jax.Array, finished: jax.Array, kind: str, knobs: _Knobs, key: jax.Array, eos: tuple[int, ...],
          step: jax.Array, forced: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Sample step `step`'s tokens [B] (or take the `forced` ones); a row ends at any of the `eos` ids (() for none)
    and then keeps emitting the first. Returns (tokens, finished)."""
    tokens = _sample(logits, kind, knobs, jax.random.fold_in(key, step)) if forced is None else forced  # [B]
    if not eos:
        return tokens, finished
    tokens = jnp.where(finished, eos[0], tokens)  # [B]
    return tokens, finished | _is_eos(tokens, eos)


def _is_eos(tokens: jax.Array, eos: tuple[int, ...]) -> jax.Array:
    """[B] bool: which of `tokens` [B] are one of the `eos` ids (a compile-time constant [E])."""
    return (tokens[:, None] == jnp.asarray(eos, tokens.dtype)).any(axis=-1)  # [B, E] -> [B]


class DecodeState(NamedTuple):
    """What one decode step reads and writes. The fused loop carries it through `lax.while_loop`; the streaming loop
    keeps it on the device between jitted steps (gemma's SamplingState plays the same part)."""

    tokens: jax.Array  # [B] int32: each row's newest token, fed to the next step
    positions: jax.Array  # [B] int32: the position that token takes
    finished: jax.Array  # [B] bool: rows that have emitted an EOS id (they keep emitting the first)
    step: jax.Array  # [] int32: generated-token index the next step samples (folded into the PRNG key)
    non_finite_step: jax.Array  # [] int32: the first step whose logits were NaN or Inf; -1 while none was
    cache: StaticCache

    def halted(self) -> jax.Array:
        """[] bool: every row has emitted EOS, or a step's logits were not finite; further steps change nothing."""
        return self.finished.all() | (self.non_finite_step >= 0)


def initial_state(tokens: jax.Array, positions: jax.Array, cache: StaticCache, eos: tuple[int, ...],
                  first_step: int, live_rows: int | None = None) -> DecodeState:
    """The state before the first decode step: rows whose token is one of the `eos` ids are finished already, and so
    are the rows from `live_rows` on (a data split's padding rows, twincache.mesh.pad_batch: a sampled copy draws
    its own tokens and would keep the batch decoding after every real row has ended)."""
    finished = _is_eos(tokens, eos)  # [B]; all False for eos=()
    if live_rows is not None and eos:
        finished = finished | (jnp.arange(tokens.shape[0]) >= live_rows)  # [B]
    return _placed(DecodeState(tokens, positions, finished, jnp.int32(first_step), jnp.int32(-1), cache))


def _placed(state: DecodeState) -> DecodeState:
    """On a mesh: the per-row arrays on `data`, the counters replicated, the cache on its shardings. Every jitted
    step takes the state placed so, and pins the state it returns the same way (a sharding constraint on a returned
    value is that output's out_sharding), which keeps each donated buffer in place. Off a mesh: unchanged."""
    cache = state.cache
    if cache.mesh is None:
        return state
    rows, whole = sharding.batch_sharding(cache), sharding.replicated(cache)
    per_row = (state.tokens, state.positions, state.finished)
    tokens, positions, finished = (sharding.place(array, rows) for array in per_row)
    step, non_finite_step = (sharding.place(array, whole) for array in (state.step, state.non_finite_step))
    return DecodeState(tokens, positions, finished, step, non_finite_step, sharding.place_cache(cache))


def decode_body(graph: ModelGraph, params: nnx.State, key: jax.Array, kind: str, knobs: _Knobs,
                eos: tuple[int, ...],
                state: DecodeState, attend_len: int | None,
                forced: jax.Array | None = None) -> tuple[jax.Array, DecodeState]:
    """One decode step, the body of both loops: feed `state.tokens` at `state.positions`, sample the next tokens.

    `kind` and `knobs`: the sampling settings (`_sampling_kind`, static; `_knobs`, traced).
    `attend_len`: the step's attention bucket (twincache.buckets; None: every slot). `forced` ([B] int32, optional)
    replaces the sampled tokens: teacher forcing on the real decode path, for parity (give eos=() with it: a
    teacher-forced run never stops early).
    Returns this step's logits [B, V] fp32 and the next state.
    """
    logits, cache = _forward_last(graph, params, state.cache, state.tokens[:, None], state.positions[:, None], None,
                                  attend_len)
    tokens, finished = _pick(logits, state.finished, kind, knobs, key, eos, state.step, forced)
    first_bad = (state.non_finite_step < 0) & ~jnp.isfinite(logits).all()
    non_finite_step = jnp.where(first_bad, state.step, state.non_finite_step)
    return logits, _placed(DecodeState(tokens, state.positions + 1, finished, state.step + 1, non_finite_step, cache))


@_bounded
@functools.partial(jax.jit, static_argnames=("graph", "kind", "eos", "vocab_size", "attend_len"),
                   donate_argnames=("state",))
def _sampled_step(graph: ModelGraph, params: nnx.State, state: DecodeState, key: jax.Array, knobs: _Knobs, kind: str,
                  eos: tuple[int, ...], vocab_size: int, attend_len: int | None,
                  forced: jax.Array | None = None) -> tuple[jax.Array, jax.Array, DecodeState]:
    """One streaming step: `decode_body` with the step's attention bucket `attend_len`, unless the state has halted.

    The streaming loop dispatches step k + 1 before it reads step k's tokens, so a step queued after the last one
    must change nothing. `forced` ([B] int32 or None) as in `decode_body`. Returns (for_host [B + 1]: the tokens,
    then `non_finite_step`, the step's one device-to-host copy; logits [B, V], zeros when halted; the next state).
    """
    def body(carry: tuple[jax.Array, DecodeState, jax.Array]) -> tuple[jax.Array, DecodeState, jax.Array]:
        _, decode_state, trips = carry
        logits, decode_state = decode_body(graph, params, key, kind, knobs, eos, decode_state, attend_len, forced)
        return logits, decode_state, trips - 1

    # A loop of zero or one trip rather than lax.cond: XLA-CPU updates the cache in place through a while loop, but
    # copies every K/V buffer through a conditional (docs/design.md §7.3).
    no_logits = jnp.zeros((state.tokens.shape[0], vocab_size), jnp.float32)  # [B, V]
    trips = (~state.halted()).astype(jnp.int32)
    logits, state, _ = lax.while_loop(lambda carry: carry[2] > 0, body, (no_logits, state, trips))
    state = _placed(state)  # a loop's result takes the sharding XLA picks for its carry: pin the returned state
    for_host = jnp.concatenate([state.tokens, state.non_finite_step[None]])  # [B + 1]
    return for_host, logits, state


class UndoLog(NamedTuple):
    """A fused block's undo log on a ring that can wrap (`_logs_undo`): what each step's write overwrote, so that the
    steps run after the last one the host read can be undone exactly (`_undone`, docs/design.md §7.31). Column i holds
    the slot that the block's step i wrote, as it was before that write (zeros and -1 where a step did not run);
    N = the block's step capacity (`_block_capacity`)."""

    keys: list[jax.Array]  # [layers] x [B, Hkv, N, D]
    values: list[jax.Array]  # [layers] x [B, Hkv, N, D]
    slot_positions: jax.Array  # [B, N] int32


class FusedCarry(NamedTuple):
    """The fused loop's carry: the decode state plus the outputs it fills, one column per step."""

    state: DecodeState
    out_tokens: jax.Array  # [B, N] int32: step i's tokens in column i; -1 where no step ran
    out_logits: jax.Array  # [B, N, V] float32 with return_logits, else [B, 0, V]
    undo: UndoLog | None  # on a ring that can wrap (_logs_undo), else None: nothing in the executable


# The K/V bytes of one fused block's undo log on a ring (UndoLog), which bound its step capacity there
# (_block_capacity). A step logs one token's K/V of every layer: Mistral-7B (32 layers, 8 KV heads, head_dim 128,
# bf16) 128 KiB per row, so FUSED_BLOCK_STEPS (256) steps would be 32 MiB at batch 1 and 1 GiB at batch 32, and the
# host holds two blocks' logs (2 GiB beside a 16 GiB ring of 4,096 slots). Capped: batch 1 keeps 256 steps (32 MiB a
# block), batch 32 gets 16 (64 MiB). Nothing is lost: a step reads the whole ring, W tokens' K/V for each one it
# logs, so 16 steps at batch 32 read 16 x 16 GiB, ~80 ms at an H100's 3.35 TB/s, about FUSED_BLOCK_SECONDS: the host
# sizes blocks to that time and would not fill a longer one.
UNDO_LOG_BYTES = 64 * 2**20


def _logs_undo(cache: StaticCache) -> bool:
    """Whether a fused block on `cache` keeps an undo log (UndoLog): on a ring of the whole window (capacity None), the
    one cache whose steps overwrite keys the window still sees. A static cache or a ring shorter than its window
    never wraps: the slots its undone steps wrote were empty, as `_roll_back` leaves them, so its executable holds no
    log at all. Read off the cache's type and shapes, static under jit."""
    return cache.capacity is None


def _block_capacity(cache: StaticCache) -> int:
    """The steps a fused block on `cache` can hold (N, a static argument of its executable): FUSED_BLOCK_STEPS; on a
    ring with an undo log (`_logs_undo`), the largest power of two (>= 1) whose log's K/V fit UNDO_LOG_BYTES, where
    that is fewer (the whole cache's bytes: on a mesh each device holds its shard of them)."""
    if not _logs_undo(cache):
        return FUSED_BLOCK_STEPS
    step_bytes = cache.num_layers * 2 * cache.batch_size * cache.num_kv_heads * cache.head_dim * cache.dtype.itemsize
    fits = max(UNDO_LOG_BYTES // step_bytes, 1)
    return min(FUSED_BLOCK_STEPS, 1 << (fits.bit_length() - 1))


def _empty_log(cache: StaticCache, block_steps: int) -> UndoLog:
    """A block's undo log before its first step (UndoLog), zeros and -1 as an empty slot."""
    batch, heads, _, head_dim = cache.keys[0].shape

    def buffers() -> list[jax.Array]:  # [layers] x [B, Hkv, N, D]
        return [jnp.zeros((batch, heads, block_steps, head_dim), cache.dtype) for _ in range(cache.num_layers)]

    return UndoLog(buffers(), buffers(), jnp.full((batch, block_steps), -1, jnp.int32))  # [B, N]


def _logged(undo: UndoLog, cache: StaticCache, index: jax.Array) -> tuple[UndoLog, StaticCache]:
    """Before a fused step writes: the slot it writes (column `length`), in every layer and in slot_positions, kept
    in column `index` ([] int32, the step's in its block) of the block's undo log. Returns the log and the cache, its
    `length` plus a zero computed from one entry of each log buffer's new column (as jax_cache.model._ordered_after
    orders a layer's write after its output): every write of the step takes its slot from `length`, so XLA must read
    the old slots first, and then updates the buffers in place. Left unordered, XLA copied every K/V buffer twice per
    step (docs/design.md §7.2); an optimization barrier on the log and `length` left those copies (the compiled
    module held no barrier)."""
    slot = jnp.remainder(cache.length, cache.cache_len)  # [] the slot the step writes (its column on the ring)

    def kept(log: jax.Array, buffer: jax.Array, axis: int) -> jax.Array:  # the slot's entry, one column of the log
        return lax.dynamic_update_slice_in_dim(log, lax.dynamic_slice_in_dim(buffer, slot, 1, axis), index, axis)

    undo = UndoLog([kept(log, buffer, 2) for log, buffer in zip(undo.keys, cache.keys, strict=True)],
                   [kept(log, buffer, 2) for log, buffer in zip(undo.values, cache.values, strict=True)],
                   kept(undo.slot_positions, cache.slot_positions, 1))

    def entry(log: jax.Array, axis: int) -> jax.Array:  # [] float32: one value of the log's new column
        return lax.dynamic_index_in_dim(log, index, axis, keepdims=False).reshape(-1)[0].astype(jnp.float32)

    # from every log buffer: each was read from its own cache buffer
    entries = jnp.stack([*(entry(log, 2) for log in (*undo.keys, *undo.values)), entry(undo.slot_positions, 1)])
    zero = jnp.sum(jnp.nan_to_num(entries, nan=0.0, posinf=0.0, neginf=0.0) * 0).astype(jnp.int32)  # []
    return undo, cache.replace(length=cache.length + zero)


def _placed_log(cache: StaticCache, undo: UndoLog | None) -> UndoLog | None:
    """On a mesh: an undo log on its cache's shardings (its K/V as the K/V, its positions as slot_positions), pinned
    as `_placed` pins the state. Off a mesh, or no log: unchanged."""
    if undo is None or cache.mesh is None:
        return undo
    leaves, treedef = jax.tree_util.tree_flatten(undo)
    placements = sharding.cache_shardings(cache.mesh, cache.num_layers, cache.num_kv_heads)[:-1]  # length: none
    return jax.tree_util.tree_unflatten(treedef, [sharding.place(leaf, placement)
                                                  for leaf, placement in zip(leaves, placements, strict=True)])


_FUSED_STATIC = ("graph", "kind", "eos", "block_steps", "vocab_size", "return_logits", "attend_len")


@functools.partial(jax.jit, static_argnames=_FUSED_STATIC, donate_argnames=("state",))
def _fused_decode(graph: ModelGraph, params: nnx.State, state: DecodeState, key: jax.Array, knobs: _Knobs,
                  forced: jax.Array | None, steps: jax.Array, kind: str, eos: tuple[int, ...],
                  block_steps: int, vocab_size: int, return_logits: bool,
                  attend_len: int | None) -> tuple[jax.Array, jax.Array, jax.Array, UndoLog | None, DecodeState]:
    """One block: up to `steps` (<= `block_steps`, an array, so every block of one attention bucket runs one
    executable) decode steps in one lax.while_loop; stops early once the state halts. Every step reads the bucket
    `attend_len` (twincache.buckets): a block never crosses from one bucket into the next.

    `forced` ([B, block_steps] int32 or None): the tokens to feed instead of the sampled ones (teacher forcing).
    Returns (out_tokens [B, N], out_logits [B, N or 0, V], for_host [2]: the step index after the block and
    `non_finite_step`, the block's undo log: an UndoLog on a ring that can wrap, else None, which adds nothing to the
    executable; the final state, last as every jitted step returns it), N = block_steps.
    """
    batch, first_step = state.tokens.shape[0], state.step
    out_tokens = jnp.full((batch, block_steps), -1, jnp.int32)  # [B, N]
    out_logits = jnp.zeros((batch, block_steps if return_logits else 0, vocab_size), jnp.float32)  # [B, N, V]
    undo = _empty_log(state.cache, block_steps) if _logs_undo(state.cache) else None

    def cond(carry: FusedCarry) -> jax.Array:
        return (carry.state.step - first_step < steps) & ~carry.state.halted()

    def body(carry: FusedCarry) -> FusedCarry:
        index = carry.state.step - first_step  # [] int32, the output column
        forced_now = None if forced is None else forced[:, index]  # [B]
        decode_state, undo = carry.state, carry.undo
        if undo is not None:  # the slot this step overwrites, kept before it does
            undo, logged = _logged(undo, decode_state.cache, index)
            decode_state = decode_state._replace(cache=logged)
        logits, decode_state = decode_body(graph, params, key, kind, knobs, eos, decode_state, attend_len, forced_now)
        out_tokens = carry.out_tokens.at[:, index].set(decode_state.tokens)
        out_logits = carry.out_logits.at[:, index].set(logits) if return_logits else carry.out_logits
        return FusedCarry(decode_state, out_tokens, out_logits, undo)

    carry = lax.while_loop(cond, body, FusedCarry(state, out_tokens, out_logits, undo))
    for_host = jnp.stack([carry.state.step, carry.state.non_finite_step])  # [2]
    # pinned as they entered (see _placed)
    return (carry.out_tokens, carry.out_logits, for_host, _placed_log(carry.state.cache, carry.undo),
            _placed(carry.state))


# The fused blocks compiled ahead of time, most recently used last: one per model structure, batch, cache shape, dtype,
# placement, sampling kind and attention bucket. A long-running process that decodes with ever new shapes (each request
# its own max_cache_len or cache object, say) kept every one; now the least recently used is dropped past
# MAX_DECODE_VARIANTS (compiled again if used again), as torch_cache drops its decode step's entries at that count.
# An evicted block's executable stays held by JAX's lowering cache (keyed by _fused_decode's trace) until the jitted
# functions' next drop (_drop_executables, which also empties this table): measured, not freed at eviction.
MAX_DECODE_VARIANTS = 64  # also the bound of each jitted function's variants (_BoundedJit)
_fused_executables: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()
_fused_lock = threading.Lock()  # threads decoding at once share the table: a lookup's move and an eviction interleave
_fused_compiles = 0  # fused blocks compiled in this process, an evicted one compiled again counted again (the table's
# length stops at MAX_DECODE_VARIANTS, so compile counts read this)


def fused_executable(*args: object, **static: object) -> tuple[jax.stages.Compiled, float]:
    """The compiled fused block for these argument shapes, compiled ahead of time once per shape so its compile time
    is measured apart from decoding, and kept for the next call among the MAX_DECODE_VARIANTS most recently used.
    Returns (executable, seconds spent compiling now: 0.0 when it was ready).

    Under the caller's `jax.disable_jit()` the block is the Python function itself, run op by op as every other jitted
    function of the tower then is: an AOT executable refuses to run there (JAX's ValueError "Disable jit is not
    supported in the AOT path" was the fused mode's traceback)."""
    if jax.config.jax_disable_jit:  # type: ignore[attr-defined, unused-ignore]
        return functools.partial(_fused_decode, *args[:1], **static), 0.0  # type: ignore[return-value]
    leaves, treedef = jax.tree_util.tree_flatten(args[1:])
    signature = (args[0], treedef, tuple((leaf.shape, leaf.dtype, getattr(leaf, "sharding", None)) for leaf in leaves),
                 tuple(sorted(static.items())))
    with _fused_lock:
        if signature in _fused_executables:
            _fused_executables.move_to_end(signature)
            return _fused_executables[signature], 0.0
    start = time.perf_counter()
    compiled = _fused_decode.lower(*args, **static).compile()  # outside the lock: other threads' lookups go on
    global _fused_compiles
    with _fused_lock:
        _fused_compiles += 1
        _fused_executables[signature] = compiled
        while len(_fused_executables) > MAX_DECODE_VARIANTS:
            _fused_executables.popitem(last=False)
    return compiled, time.perf_counter() - start


BlockCallback = Callable[[np.ndarray, "jax.Array | None"], None]


def decode_fused(graph: ModelGraph, params: nnx.State, state: DecodeState, key: jax.Array, kind: str, knobs: _Knobs,
                 eos: tuple[int, ...], num_steps: int, length: int, vocab_size: int, return_logits: bool,
                 on_block: BlockCallback, forced: np.ndarray | None = None,
                 block_steps: int | None = None, live: list[DecodeState] | None = None,
                 undo: list[tuple[int, UndoLog]] | None = None) -> tuple[DecodeState, int, int, float, int]:
    """The fused mode: up to `num_steps` decode steps from a cache holding `length` columns, as jitted blocks, each
    one lax.while_loop over `decode_body` of at most `block_steps` (default `_block_capacity`: FUSED_BLOCK_STEPS, fewer
    on a ring whose undo log would pass UNDO_LOG_BYTES) steps. The block's step limit is an array, so every block of
    every budget runs one compiled executable per attention bucket (twincache.buckets.decode_buckets: a block ends
    where its bucket does), and the host sizes each block to last about FUSED_BLOCK_SECONDS.

    Bounded blocks return to Python often, so tokens stream a block at a time and Ctrl-C is seen between blocks:
    `on_block(tokens [B, n] numpy, logits [B, block_steps, V] or None)` after each block that ran n > 0 steps (its
    logits are the first n of the block's; sliced here, each n would compile a slice). Block k + 1 is
    queued before block k's tokens are read, so the device does not wait for the host. `forced` ([B, num_steps]
    int32, on the host) as in `decode_body`. `live` (a one-item list), when given, holds the newest state as each block
    is dispatched: every block donates the state it is given, so an exception leaving here (on_block raising, a
    KeyboardInterrupt) reaches the live cache only through it. `undo` (a list), when given, holds the undo logs of the
    blocks dispatched and not yet read through, oldest first, each with its first column (on a ring that can wrap,
    `_logs_undo`: at most two, the block being read and the one queued after it; else none): device arrays, kept and
    dropped without a host copy or a wait, for `_handed_back` to undo their steps exactly. Returns (the final state,
    steps run, the first non-finite step or -1, untimed seconds, untimed steps): what is not steady decoding, as the
    step mode counts it: compiling, and the first block up to its tokens on the host (the first run of an executable
    also sets up its kernels).
    """
    cache = state.cache  # for its placement and shapes only (donated)
    capacity = block_steps or _block_capacity(cache)
    cache_len = cache.cache_len

    def block_forced(start: int) -> jax.Array | None:  # sliced on the host: a device slice per start would compile
        if forced is None:
            return None
        chunk = forced[:, start:start + capacity]
        return _on_rows(cache, np.pad(chunk, ((0, 0), (0, capacity - chunk.shape[1]))))  # [B, capacity]

    static = dict(kind=kind, eos=eos, block_steps=capacity, vocab_size=vocab_size, return_logits=return_logits)
    executables: dict[int, jax.stages.Compiled] = {}  # per attention bucket, looked up once per generation

    def executable_at(start: int) -> tuple[jax.stages.Compiled, int, float]:
        """The block executable of step `start`'s bucket, the steps left in that bucket, and seconds compiling now."""
        (attend, room), *_ = decode_buckets(length + start, num_steps - start, cache_len)
        seconds = 0.0
        if attend not in executables:
            executables[attend], seconds = fused_executable(graph, params, state, key, knobs, block_forced(0),
                                                            jnp.int32(capacity), attend_len=attend, **static)
        return executables[attend], room, seconds

    phases.enter("compile")
    start, first_step, done, non_finite_step = time.perf_counter(), int(state.step), 0, -1
    executable_at(0)  # the first bucket's loop is compiled before any block runs
    untimed_s, untimed_steps, first_read = 0.0, 0, False
    dispatched, steps = 0, min(FIRST_BLOCK_STEPS, capacity)  # steps dispatched so far; the next block's steps
    queued, last_read = None, time.perf_counter()  # the block dispatched last: (outputs, its steps)
    while queued is not None or dispatched < num_steps:
        pending, compiled_now = None, 0.0
        if dispatched < num_steps:  # dispatch the next block on the live state (donated: it stays on the device) ...
            executable, room, compiled_now = executable_at(dispatched)
            untimed_s += compiled_now if first_read else 0.0  # before the first read, inside the first interval
            size = min(steps, num_steps - dispatched, room)
            outputs = executable(params, state, key, knobs, block_forced(dispatched), jnp.int32(size))
            if undo is not None and outputs[3] is not None:  # its steps write columns length + dispatched on
                undo.append((length + dispatched, outputs[3]))
            state, pending, dispatched = outputs[4], (outputs[:3], size), dispatched + size
            if live is not None:
                live[0] = state
        if queued is not None:  # ... then read the one before it
            (tokens, logits, for_host), queued_steps = queued
            step_after, non_finite_step = np.asarray(for_host).tolist()  # waits for that block only
            # Steps this block ran; a step whose logits were not finite ends the loop, and its token is not handed on.
            ran = (step_after if non_finite_step < 0 else non_finite_step) - first_step - done
            if ran:
                on_block(np.asarray(tokens)[:, :ran], logits if return_logits else None)
            if undo:  # read through: none of its steps is undone now, so its log goes (the next one's stays)
                del undo[0]
            now = time.perf_counter()
            if not first_read:  # the first block: the fused mode's first step
                first_read, untimed_s, untimed_steps = True, now - start, ran
                phases.enter("decode")
            done += ran
            # The device ran this block while the host handled the one before: its time is this interval (unless the
            # host compiled a new bucket's loop meanwhile; then the size stays).
            if ran and not compiled_now:
                steps = max(1, min(capacity, int(FUSED_BLOCK_SECONDS * ran / max(now - last_read, 1e-9))))
            last_read = now
            if non_finite_step >= 0 or ran < queued_steps:  # halted: the blocks after it run no step
                break
        queued = pending
    return state, done, non_finite_step, untimed_s, untimed_steps


@_bounded
@functools.partial(jax.jit, donate_argnames=("out",))
def _write_logits(out: jax.Array, logits: jax.Array, at: int, count: int) -> jax.Array:
    """`out` [B, N, V] with its steps at .. at + count - 1 set to the first `count` of `logits` ([B, n, V], or one
    step [B, V]). `at` and `count` are traced and `out` donated (written in place): one executable per shapes,
    whatever a call's blocks are (a fused block's size follows wall time, and a slice or concatenate per size compiled
    on every call)."""
    steps = logits[:, None] if logits.ndim == 2 else logits  # [B, n, V]
    offsets = jnp.arange(steps.shape[1])  # [n]
    rows = jnp.where(offsets < count, at + offsets, out.shape[1])  # [n]: the steps past `count` land out of range
    return out.at[:, rows].set(steps, mode="drop")


@_bounded
@functools.partial(jax.jit, donate_argnames=("cache",))
def _roll_back(cache: StaticCache, steps: jax.Array) -> StaticCache:
    """Undo the last `steps` ([] int32) one-token writes, as torch_cache's _roll_back: `length` goes back and their
    slots are empty again (position -1, zero K/V). A ring's slot held position p - W before the write, which no query
    from p on can see (one step back: the step mode's queued step); a fused decode on a ring undoes its steps from
    their undo logs instead (`_undone`). The cache is donated, so the buffers are emptied in place, and `steps` is
    traced: one executable per cache shape and placement, compiled only when a decode ends by an exception."""
    length = cache.length - steps
    slots = jnp.arange(cache.cache_len, dtype=jnp.int32)  # [L]
    # the undone columns length .. length + steps - 1, in their slots (a ring's wrap; a static cache's never do)
    undone = jnp.remainder(slots - length, cache.cache_len) < steps  # [L]
    keys = [jnp.where(undone[:, None], 0, buffer) for buffer in cache.keys]  # [B, Hkv, L, D]
    values = [jnp.where(undone[:, None], 0, buffer) for buffer in cache.values]  # [B, Hkv, L, D]
    slot_positions = jnp.where(undone, -1, cache.slot_positions)  # [B, L]
    # pinned as it came (on a mesh): the donated buffers are reused and a later step sees the placement it compiled for
    return sharding.place_cache(cache.replace(keys=keys, values=values, slot_positions=slot_positions, length=length))


@_bounded
@functools.partial(jax.jit, donate_argnames=("cache",))
def _undone(cache: StaticCache, logs: tuple[UndoLog, UndoLog], starts: jax.Array, steps: jax.Array) -> StaticCache:
    """Undo the last `steps` ([] int32) steps of a fused decode on a ring from the undo logs of the blocks that ran
    them (UndoLog): `logs` are (older, newer), the block being read and the one queued after it (one log twice where
    one block ran them all), `starts` ([2] int32) their first columns. Each undone step's slot gets back what it held
    before that step wrote it, K/V of every layer and position, the newest step first: a slot written twice (more
    undone steps than the ring has slots) ends with what it held before the first of them. So the cache is the one
    the decode had after the last step read, bit for bit, with the keys the window still sees, and `length` goes
    back. Donated and placed as `_roll_back` (in place, one executable per cache shape and placement, compiled only
    when a decode ends by an exception)."""
    older, newer = logs
    last = cache.length - 1  # [] the newest undone step's column

    def undo_step(i: jax.Array, arrays: tuple) -> tuple:
        keys, values, slot_positions = arrays
        column = last - i  # [] int32
        in_newer = column >= starts[1]  # []
        index = column - jnp.where(in_newer, starts[1], starts[0])  # [] the step's column in its block's log
        slot = jnp.remainder(column, cache.cache_len)  # []

        def restored(buffer: jax.Array, older_log: jax.Array, newer_log: jax.Array, axis: int) -> jax.Array:
            entry = jnp.where(in_newer, lax.dynamic_slice_in_dim(newer_log, index, 1, axis),
                              lax.dynamic_slice_in_dim(older_log, index, 1, axis))  # [B, Hkv, 1, D] or [B, 1]
            return lax.dynamic_update_slice_in_dim(buffer, entry, slot, axis)

        keys = [restored(buffer, old, new, 2)
                for buffer, old, new in zip(keys, older.keys, newer.keys, strict=True)]  # [B, Hkv, L, D]
        values = [restored(buffer, old, new, 2)
                  for buffer, old, new in zip(values, older.values, newer.values, strict=True)]  # [B, Hkv, L, D]
        return keys, values, restored(slot_positions, older.slot_positions, newer.slot_positions, 1)  # [B, L]

    keys, values, slot_positions = lax.fori_loop(0, steps, undo_step,
                                                 (cache.keys, cache.values, cache.slot_positions))
    # pinned as it came (on a mesh), as _roll_back's
    return sharding.place_cache(cache.replace(keys=keys, values=values, slot_positions=slot_positions,
                                              length=cache.length - steps))


def _given_back(given: StaticCache, live: StaticCache) -> None:
    """Point the caller's cache object at `live`'s arrays. A decode call donates the cache it is given, so when it ends
    by an exception (on_token raising, a KeyboardInterrupt, NonFiniteLogitsError) the caller's object refers to
    deleted buffers and the live cache, inside the loop's state, would be lost with the whole conversation, where
    torch's cache, written in place, survives. This is the one place a JAX cache object changes after it is built:
    on an exception's way out, to the arrays the call would have returned."""
    if given is live:
        return
    for name in StaticCache.ARRAY_FIELDS:
        value = getattr(live, name)
        setattr(given, name, list(value) if isinstance(value, list) else value)


def _handed_back(given: StaticCache, state: DecodeState, read_until: int,
                 undo: Sequence[tuple[int, UndoLog]] = ()) -> str | None:
    """On an exception leaving a decode loop: roll the live cache back to the steps the host has read (`read_until`:
    the state's step index after the last of them), as torch_cache's `_rolled_back_if_unread` does, and point the
    caller's object at it (`_given_back`). The steps after them (the step mode's queued step, the rest of a fused
    block and the block queued after it) ran, but their tokens never reached the host.

    A fused decode on a ring that can wrap hands its blocks' undo logs in `undo` (decode_fused's, oldest first, each
    with its first column): undoing n >= 2 steps from column c by emptying their slots would lose the keys of columns
    c - W + 1 .. c - W + n - 1, which the next queries read, so those slots get back what they held (`_undone`), and
    the cache is the one the decode had after the last step read, bit for bit (docs/design.md §7.31). Elsewhere the
    undone slots were empty (a static cache, a ring not wrapped), or one step's slot held a key no later query sees
    (the step mode's), and `_roll_back` empties them.
    Left consumed (StaleCacheError at its next use) where the exception cut a dispatch short (the live state was
    donated and not yet taken). Returns why, for a note on the exception, where it is left consumed."""
    if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state)):
        return "the exception cut a jitted dispatch short"
    live = state.cache
    steps = int(state.step) - read_until  # waits for the steps in flight: they ran whether read or not
    if steps > 0 and undo:
        (older_start, older), (newer_start, newer) = undo[0], undo[-1]
        # the steps undone are those of the blocks not read through, whose logs decode_fused keeps; should they not
        # reach back to the first of them, no exact cache can be rebuilt, and a consumed cache says so at its next use
        first_undone = int(live.length) - steps  # the column of the first undone step
        if first_undone < older_start:
            return (f"its undo logs reach back to column {older_start}, past the first undone step's column "
                    f"{first_undone}")
        live = _undone(live, (older, newer), jnp.asarray([older_start, newer_start], jnp.int32), jnp.int32(steps))
    elif steps > 0:
        live = _roll_back(live, jnp.int32(steps))
    _given_back(given, live)
    return None


def decode_step_fn(model: Mistral) -> DecodeStep:
    """The one-token step `(input_ids [B, 1], positions [B, 1], cache, attend_len=None) -> (logits [B, V], cache)`,
    jitted once per attention bucket `attend_len` (twincache.buckets; None: every slot), with the cache donated: the
    input cache is consumed and the returned one reuses its buffers."""
    check_model_type(model, Mistral, "jax_cache")
    graph, params = split_model(model)

    def step(input_ids: jax.Array, positions: jax.Array, cache: StaticCache,
             attend_len: int | None = None) -> tuple[jax.Array, StaticCache]:
        # The model's own checks are skipped under tracing, and inside the jitted step an out-of-range write position
        # would be clamped silently by dynamic_update_slice: refuse it (and bad ids, batch, dtype) before dispatch.
        model.check_inputs(input_ids, positions, None)
        length = cache.check_forward(model.config, input_ids, model.dtype, model.device)
        if attend_len is not None:
            buckets.check_attend_len(attend_len, length, 1, cache.cache_len)
        return _decode_step(graph, params, cache, input_ids, positions, attend_len)

    return step


def prompt_bucket(prompt_len: int, room: int | None, chunk_size: int = PREFILL_CHUNK) -> int:
    """The columns a prompt is left-padded to, so that one process compiles few prefills: a power of two (>= 16) up
    to one chunk, and beyond it a whole number of chunks, each of the one chunk shape. `room` caps it: to the largest
    power of two in [prompt_len, room] when one is (so every room up to the next power shares a prefill; the room
    itself compiled a prefill per max_new_tokens near a caller-sized cache's capacity), else to the room (a longer
    prompt's first, shorter chunk then takes the remainder: one more shape)."""
    if prompt_len <= chunk_size:
        bucket = min(max(MIN_PROMPT_BUCKET, 1 << (prompt_len - 1).bit_length()), chunk_size)
    else:
        bucket = -(-prompt_len // chunk_size) * chunk_size
    if room is None or bucket <= room:
        return bucket
    power = 1 << (room.bit_length() - 1) if room > 0 else 0  # the largest power of two <= room
    return power if prompt_len <= power <= chunk_size else max(prompt_len, room)


def prefill(model: Mistral, input_ids: jax.Array | np.ndarray, attention_mask: jax.Array | np.ndarray,
            cache: StaticCache, chunk_size: int = PREFILL_CHUNK) -> tuple[jax.Array, StaticCache]:
    """Run the left-padded prompt [B, T] through the model in chunks of at most `chunk_size` columns, filling the
    (donated) cache. Returns last-token logits [B, V] fp32 and the new cache.

    Each chunk attends over the cache plus itself, so memory is bounded by the chunk and the cache (a ring: W + chunk
    keys), not by the prompt; an in-place chunk reads only the attention bucket holding the live prefix and itself
    (twincache.buckets), so chunks of one width share one compiled prefill per bucket. The whole prompt is checked
    before the first chunk: a refused prefill dispatches nothing.
    """
    phases.enter("prefill")
    ids_np, mask_np = np.asarray(input_ids), np.asarray(attention_mask)
    validate_attention_mask(mask_np, tuple(ids_np.shape))  # right padding would make [:, -1] a pad's logits
    positions_np = positions_from_mask(mask_np)  # [B, T]; padding at -1
    chunks = prefill_chunks(ids_np.shape[1], chunk_size)
    model.check_inputs(input_ids, positions_np, attention_mask, mask_checked=True)
    # the host's copy of the cache length, read once for the check: it picks each chunk's attention bucket
    length = cache.check_forward(model.config, input_ids, model.dtype, model.device)
    graph, params = split_model(model)
    cache_len = cache.cache_len
    for start, stop in chunks:  # sliced on the host: a device slice per start would compile one op per start
        attend = step_attend_len(length + start, stop - start, cache_len)
        logits, cache = _prefill(graph, params, cache, *(_on_rows(cache, array[:, start:stop])
                                                         for array in (ids_np, positions_np, mask_np)), attend)
    return logits, cache


def _on_rows(cache: StaticCache, array: np.ndarray) -> jax.Array:
    """A host array whose first axis is the batch ([B, ...]) on the device; on a mesh, on the cache's batch sharding,
    as every per-row input of a jitted prefill, step or block is (one placement, so one executable)."""
    if cache.mesh is None:
        return jnp.asarray(array)
    return sharding.place(jnp.asarray(array), sharding.batch_sharding(cache))


def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, fused: bool = True,
             on_token: TokenCallback | None = None, return_logits: bool = False,
             forced_tokens: Sequence[Sequence[int]] | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. Rows are left-padded; each stops at its own EOS.

    `cache` is a kind ("static" / "sliding_window", default: sliding when the config has a window) or a cache
    object to reuse (it is reset first, and donated: use `result.cache` afterwards; a `max_cache_len` beside it
    must be its own; an exception from the first token on leaves it holding the prompt and the steps read, as
    `continue_generation` does). `fused` decodes in jitted blocks
    of steps (`on_token` then receives a block's steps when it ends); `fused=False` one jitted step at a time. The
    prompt is prefilled in chunks of `prefill_chunk` columns. `result.max_cache_len` is the capacity planned for this
    generation's tokens, as in torch_cache; the cache built for it may hold the prompt bucket's padding too, rounded
    up to a size class (docs/design.md §5).
    `forced_tokens` teacher-forces the same decode path: row r emits forced_tokens[r][i] at step i instead of a
    sampled token and feeds it to step i + 1. Each row gives exactly max_new_tokens ids, and EOS ends no forced row.
    """
    check_model_type(model, Mistral, "jax_cache")
    config = model.config
    check_flags(fused=fused, return_logits=return_logits)
    inputs = prepare_batch(prompts, config, sampling, max_new_tokens, prefill_chunk, on_token)
    rows = len(inputs.prompt_ids)
    forced = None if forced_tokens is None else validate_forced_tokens(forced_tokens, rows, inputs.max_new_tokens,
                                                                       config)  # [rows, N]
    sampling, max_new_tokens, chunk = inputs.sampling, inputs.max_new_tokens, inputs.prefill_chunk
    prompt_len = inputs.input_ids.shape[1]  # [rows, T]
    eos = config.eos_token_ids if forced is None else ()  # a forced row runs to its last forced token
    given = None  # the caller's cache object: an exception from the prefill's first token on points it at the live one
    if cache is not None and not isinstance(cache, str):
        cache_checks.check_cache_type(cache, StaticCache, "jax_cache", _CACHE_HINT)
        # a cache generate padded for this many rows (its real_rows: a batch class, a data split) is padded again
        padded_rows = cache.batch_size if cache.real_rows == rows else rows
        check_given_cache_len(max_cache_len, cache.max_cache_len, cache.capacity)
        # before reset(): a refusal changes nothing
        cache.check_compatible(config, padded_rows, model.dtype, model.device)
        check_budget(cache.capacity, prompt_len, max_new_tokens)
        planned_len = cache.max_cache_len
        bucket = prompt_bucket(prompt_len, None if cache.capacity is None else cache.capacity - max_new_tokens, chunk)
        check_positions(config, prompt_len, max_new_tokens, bucket + max(max_new_tokens - 1, 0))
        _check_outputs_fit(padded_rows, max_new_tokens, config.vocab_size, return_logits)
        given, cache = cache, cache.reset()
    else:
        kind, planned_len = plan_cache(config, cache, prompt_len, max_new_tokens, max_cache_len)
        # plan_cache gives a sliding_window cache only to a config with a window
        bounded = kind == "static" or (config.sliding_window is not None and planned_len < config.sliding_window)
        bucket = prompt_bucket(prompt_len, planned_len - max_new_tokens if bounded and max_cache_len else None, chunk)
        check_positions(config, prompt_len, max_new_tokens, bucket + max(max_new_tokens - 1, 0))
        # Without a given max_cache_len, the cache also holds the bucket's extra padding columns, rounded up to a
        # size class as torch_cache's is: every budget in the class runs the same executables; its rows are the
        # batch's size class, a multiple of a data split (docs/design.md §5).
        def build_rows(batch: int) -> StaticCache:
            _check_outputs_fit(batch, max_new_tokens, config.vocab_size, return_logits)

            def build(slots: int) -> StaticCache:
                return make_cache(kind, config, batch, slots, model.dtype, model.mesh)

            return build(planned_len) if max_cache_len else build_sized_cache(build, config, kind,
                                                                               bucket + max_new_tokens)

        cache = build_batch_class(build_rows, rows, 1 if model.mesh is None else sharding.mesh_shape(model.mesh).data)
    # the batch padded up to the cache's rows: copies of the last row, finished from the first decode step; the cache
    # records the real rows, for continue_generation to pad that many last tokens again (pad_continuation)
    inputs, on_token = pad_batch(inputs, cache.batch_size, on_token)
    real_rows = rows if rows < cache.batch_size else None  # set on the prefill's cache below
    if given is not None:  # an exception from the first token on hands the live arrays back to it (_given_back)
        given.real_rows = real_rows
    prompt_ids, ids_np, mask_np = inputs.prompt_ids, inputs.input_ids, inputs.attention_mask  # ids, mask: [B, T]
    batch = ids_np.shape[0]
    forced = None if forced is None else pad_rows(forced, batch)  # [B, N]: the padding rows copy the last one's
    if max_new_tokens == 0:  # logits asked for: [B, 0, V], as continue_generation gives
        no_logits = jnp.zeros((len(prompt_ids), 0, config.vocab_size), jnp.float32) if return_logits else None
        return keep_rows(GenerationResult(cache.kind, planned_len, prompt_ids, [[] for _ in prompt_ids], 0.0, 0.0,
                                          0.0, 0, 0, no_logits, cache, "fused" if fused else "step"), rows)
    extra = ((0, 0), (bucket - prompt_len, 0))  # the bucket's extra columns are padding too
    ids_np = np.pad(ids_np, extra, constant_values=pad_token_id(config))  # [B, bucket]
    mask_np = np.pad(mask_np, extra)  # [B, bucket]
    key = _seed_key(sampling.seed)
    # the prefill and the decode loop or step are jitted; one new token is the prefill's alone (no decode step)
    announce_compile("XLA", "the decode step" if max_new_tokens > 1 else "the prefill")
    start = time.perf_counter()
    logits, cache = prefill(model, ids_np, mask_np, cache, chunk)  # [B, V]
    cache.real_rows = real_rows  # not pytree metadata: the jitted prefill's cache comes back without it
    try:
        first, _ = _pick(logits, jnp.zeros(batch, bool), _sampling_kind(sampling), _knobs(sampling), key, eos,
                         jnp.int32(0), None if forced is None else jnp.asarray(forced[:, 0]))
        first = np.asarray(first).tolist()[:rows]  # the real rows (pad_batch: a batch class, a data split)
        prefill_s = time.perf_counter() - start
        _raise_if_non_finite(bool(~jnp.isfinite(logits).all()), 0, model.dtype)
        if on_token is not None:  # a copy: `first` feeds the continuation and the result, whatever the callback does
            on_token(list(first))
        # The real rows only: continue_generation gives the padding rows (pad_batch) their copies again, finished.
        # Raising, it leaves `cache` (this function's object) holding the steps read, for `given` below.
        rest = continue_generation(model, cache, first, max_new_tokens - 1, sampling=sampling, fused=fused,
                                   on_token=on_token, return_logits=return_logits,
                                   forced_tokens=None if forced is None else forced[:rows, 1:], first_step=1)
    except BaseException:
        if given is not None and not cache.is_consumed():
            _given_back(given, cache)  # the prompt, and the steps read; a tower-built cache has no one to go back to
        raise
    # Per row: rows end at different lengths (each at its own EOS), so they are joined row by row, never zipped.
    tokens = [[token] + ([] if token in eos else more) for token, more in zip(first, rest.token_ids, strict=True)]
    step_logits = jnp.concatenate([logits[:rows, None], rest.step_logits], axis=1) if return_logits else None
    return dataclasses.replace(rest, max_cache_len=planned_len, prompt_ids=prompt_ids[:rows], token_ids=tokens,
                               prefill_s=prefill_s, step_logits=step_logits)  # [rows, steps, V] logits


def continue_generation(model: Mistral, cache: StaticCache, last_tokens: Sequence[int], max_new_tokens: int, *,
                        sampling: SamplingParams | None = None, fused: bool = True,
                        on_token: TokenCallback | None = None, return_logits: bool = False,
                        forced_tokens: Sequence[Sequence[int]] | np.ndarray | None = None,
                        first_step: int = 0) -> GenerationResult:
    """Feed each row's last sampled token (not yet in `cache`) and decode up to `max_new_tokens` more.

    Positions come from the cache itself, so a cache handed over from torch_cache continues exactly where it was.
    A row whose last token is EOS is finished. Returns only the new tokens; `cache` is donated, and `result.cache`
    is the updated one. `forced_tokens` teacher-forces the steps, as in `generate`.
    When decoding ends by an exception (on_token raising, a KeyboardInterrupt, NonFiniteLogitsError: re-raised as it
    came), `cache` itself holds the live cache, as torch_cache's does: every step the host has read, the one whose
    tokens on_token was handed last included (and a non-finite step, whose input token it wrote), and none after it:
    steps launched but not read (the step mode's queued step, the rest of a fused block and the block queued after it)
    are rolled back; on a sliding-window ring the fused mode restores what their writes overwrote from its blocks'
    undo logs, so the keys the window still sees are back (docs/design.md §7.31). Continue from on_token's last tokens
    with `first_step` advanced by the steps it received: tokens, logits and cache are then one uninterrupted run's.
    `first_step`: the index, within the generation, of the first token this call samples (generate's prefill token
    is 0); pass the number of tokens generated so far to continue a seeded generation's stream: `generate(n)` then
    `continue_generation(..., m, first_step=n)` samples the tokens of one `generate(n + m)`. A sampled step k draws
    with the seed's key folded with `first_step + k`, as torch_cache does (each backend from its own stream). Greedy
    and teacher-forced tokens do not depend on it.
    """
    check_model_type(model, Mistral, "jax_cache")
    config = model.config
    check_flags(fused=fused, return_logits=return_logits)
    cache_checks.check_cache_type(cache, StaticCache, "jax_cache", _CACHE_HINT)
    last_tokens, sampling, max_new_tokens = prepare_continuation(last_tokens, config, sampling, max_new_tokens,
                                                                 on_token)
    first_step = check_first_step(first_step, max_new_tokens)
    rows = len(last_tokens)  # generate keeps its padding rows in the cache (pad_batch: a batch class, a data split)
    last_tokens, on_token = pad_continuation(last_tokens, cache.batch_size, cache.real_rows, on_token)
    cache.check_compatible(config, len(last_tokens), model.dtype, model.device)
    # refused up front, not after decoding part of the budget; the host's copy of the cache length picks each step's
    # attention bucket
    check_continuation_room(cache.capacity, int(cache.length), max_new_tokens)
    length = cache._check_write_range(max_new_tokens)
    # each row's newest position, read on the host: a reduction on the device would compile once per cache shape, and
    # a position past int32 cannot wrap here before check_positions sees it
    newest = np.asarray(cache.slot_positions).astype(np.int64).max(axis=1)  # [B]
    check_positions(config, int(newest.max()) + 2, max_new_tokens, length + max_new_tokens)
    _check_outputs_fit(len(last_tokens), max_new_tokens, config.vocab_size, return_logits)
    batch = len(last_tokens)
    forced = None  # [B, N] int32 on the host: sliced there per step or block, a device slice per start would compile
    if forced_tokens is not None:
        forced = pad_rows(validate_forced_tokens(forced_tokens, rows, max_new_tokens, config), batch)
    eos = config.eos_token_ids if forced is None else ()  # a forced row runs to its last forced token
    graph, params = split_model(model)
    key, kind, knobs = _seed_key(sampling.seed), _sampling_kind(sampling), _knobs(sampling)
    state = initial_state(jnp.asarray(last_tokens, jnp.int32), jnp.asarray(newest + 1, jnp.int32), cache, eos,
                          first_step, rows)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    # [B, N, V]: each step or block is written in at its step (_write_logits); on a mesh, rows on `data` as the logits
    placement = None if cache.mesh is None else sharding.batch_sharding(cache)
    out_logits = (jnp.zeros((batch, max_new_tokens, config.vocab_size), jnp.float32, device=placement)
                  if return_logits else None)
    first_step_s = decode_s = 0.0
    decode_steps = timed_steps = 0
    all_done = bool(eos) and all(t in eos for t in last_tokens[:rows])
    # An exception while decoding leaves `cache` holding the steps the host has read, the one it was reading or
    # handing to on_token included (torch_cache's rule, docs/design.md §7.31), as torch's cache written in place does;
    # the steps launched after them are rolled back (_handed_back).
    read, live = 0, [state]  # steps read; the newest state (every step or block donates the one before)
    undo: list[tuple[int, UndoLog]] = []  # a fused decode on a ring: the undo logs of the blocks not read through
    try:
        if fused and max_new_tokens and not all_done:
            taken = 0  # steps of the blocks before this one (a row that ended appends no token, but has its logits)

            def take_block(block_tokens: np.ndarray, block_logits: jax.Array | None) -> None:
                nonlocal out_logits, taken, read
                if out_logits is not None:
                    assert block_logits is not None  # decode_fused hands a block's logits on whenever return_logits
                    out_logits = _write_logits(out_logits, block_logits, taken, block_tokens.shape[1])
                taken += block_tokens.shape[1]
                for row_ids in block_tokens.T.tolist():  # one step's tokens per column
                    read += 1  # read, also when on_token raises at it
                    append_tokens(tokens, row_ids, eos, last_tokens)
                    if on_token is not None:
                        on_token(row_ids)

            decode_start = time.perf_counter()
            state, decode_steps, non_finite_step, first_step_s, untimed_steps = decode_fused(
                graph, params, state, key, kind, knobs, eos, max_new_tokens, length, config.vocab_size,
                return_logits, on_block=take_block, forced=forced, live=live, undo=undo)
            read = decode_steps + int(non_finite_step >= 0)  # a non-finite step was read too (its flag)
            decode_s = time.perf_counter() - decode_start - first_step_s
            timed_steps = decode_steps - untimed_steps
            _raise_if_non_finite(non_finite_step >= 0, non_finite_step, model.dtype)
        elif max_new_tokens and not all_done:
            cache.check_live()

            def forced_at(step: int) -> jax.Array | None:
                return None if forced is None else _on_rows(cache, forced[:, step])  # [B]

            def bucket(index: int) -> int:
                return step_attend_len(length + index, 1, cache.cache_len)  # step `index` of this call

            phases.enter("compile")  # the first step compiles
            stamp = time.perf_counter()
            pending = _sampled_step(graph, params, state, key, knobs, kind, eos, config.vocab_size, bucket(0),
                                    forced_at(0))
            while True:
                for_host, logits, state = pending
                live[0] = state
                # Dispatching a step of a new bucket traces and compiles it: that wait is timed apart from the
                # steady state.
                compiles = decode_steps == 0
                decode_steps += 1
                read = decode_steps  # this step is being read: it counts from here, as torch counts a step it pops
                if decode_steps < max_new_tokens:  # queue the next step before this one's tokens reach the host
                    compiles |= bucket(decode_steps) != bucket(decode_steps - 1)
                    pending = _sampled_step(graph, params, state, key, knobs, kind, eos, config.vocab_size,
                                            bucket(decode_steps), forced_at(decode_steps))
                    # the live state; a step queued after the last token holds it unchanged
                    state = live[0] = pending[2]
                *row_ids, non_finite_step = np.asarray(for_host).tolist()  # the step's one host sync
                _raise_if_non_finite(non_finite_step >= 0, non_finite_step, model.dtype)
                all_done = bool(eos) and all(token in eos for token in row_ids)
                now = time.perf_counter()
                if compiles:
                    first_step_s += now - stamp
                else:
                    decode_s, timed_steps = decode_s + now - stamp, timed_steps + 1
                stamp = now
                if decode_steps == 1:
                    phases.enter("decode")
                if out_logits is not None:
                    out_logits = _write_logits(out_logits, logits, decode_steps - 1, 1)
                append_tokens(tokens, row_ids, eos, last_tokens)
                if on_token is not None:
                    on_token(row_ids)
                if all_done or decode_steps == max_new_tokens:
                    break
    except BaseException as error:
        try:  # the caller's exception is what propagates, the same object, with a note where the cache is lost
            lost = _handed_back(cache, live[0], first_step + read, undo)
        except Exception as failure:  # a failed rollback must not replace the caller's exception
            lost = f"handing it back failed: {type(failure).__name__}: {failure}"
        if lost is not None:
            error.add_note(f"twincache: the cache this call was given is consumed (StaleCacheError at its next "
                           f"use): {lost}")
        raise
    # [B, steps, V]: sliced only when decoding ended before the budget (the same ending repeats the same slice)
    step_logits = out_logits if out_logits is None or decode_steps == max_new_tokens else out_logits[:, :decode_steps]
    return keep_rows(GenerationResult(state.cache.kind, state.cache.max_cache_len, [[] for _ in tokens], tokens, 0.0,
                                      first_step_s, decode_s, decode_steps, timed_steps, step_logits, state.cache,
                                      "fused" if fused else "step"), rows)


def _check_outputs_fit(batch: int, steps: int, vocab_size: int, return_logits: bool) -> None:
    """Returned logits ([batch, steps, vocab] float32) are written into one such array and copied once more at the
    end (generate prepends the prefill's; a generation that ends early is sliced): refuse what cannot fit before
    anything is compiled or run."""
    if not return_logits:
        return
    device = default_device()
    cache_checks.check_fits(f"decoding {steps} steps with return_logits (2 x [{batch}, {steps}, {vocab_size}] float32)",
                            2 * batch * steps * vocab_size * 4, available_memory(device), memory_label(device),
                            "generate fewer tokens or pass return_logits=False")


def _raise_if_non_finite(non_finite: bool, step: int, dtype: jnp.dtype) -> None:
    if non_finite:
        raise NonFiniteLogitsError(f"the model produced NaN or Inf logits at generated token {step}; the weights "
                                   f"or dtype ({dtype}) are not usable for this input")


__all__ = ["MAX_DECODE_VARIANTS", "MIN_PROMPT_BUCKET", "FUSED_BLOCK_STEPS", "FUSED_BLOCK_SECONDS", "FIRST_BLOCK_STEPS",
           "DecodeStep", "sample", "ModelGraph", "split_model", "DecodeState", "initial_state", "decode_body",
           "UndoLog", "FusedCarry", "UNDO_LOG_BYTES", "fused_executable", "BlockCallback", "decode_fused",
           "decode_step_fn", "prompt_bucket", "prefill", "generate", "continue_generation", "MIN_TEMPERATURE",
           "MAX_TEMPERATURE", "TOP_P_CANDIDATES", "filter_logits"]
