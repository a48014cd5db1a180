"""Generation with jax_cache: a jitted prefill over power-of-two prompt buckets, then decoding with the cache donated
to every jitted call, so XLA updates its buffers in place.

Two decode modes:
  fused (default when nothing streams): the whole decode loop is one jitted `lax.while_loop`, stopping each row at EOS.
  step (streaming): one jitted step per token, queued one step ahead; each step's tokens come back to the host.
Both fold the step index into one PRNG key, so they sample the same tokens for the same seed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_cache.cache import StaticCache, available_memory, default_device, make_cache, memory_label
from jax_cache.model import Mistral
from twincache import cache_checks
from twincache.errors import NonFiniteLogitsError
from twincache.generation import (
    GenerationResult,
    SamplingParams,
    TokenCallback,
    append_tokens,
    check_budget,
    check_positions,
    pad_token_id,
    plan_cache,
    prepare_batch,
    prepare_continuation,
)

MIN_PROMPT_BUCKET = 16
_CACHE_HINT = ("pass a jax_cache.cache StaticCache or SlidingWindowCache (copy a torch_cache one with "
               "jax_cache.interop.cache_from_torch), or a kind name")
MIN_TEMPERATURE = float(jnp.finfo(jnp.float32).tiny)  # 1.2e-38: lower temperatures sample as this one
DecodeStep = Callable[[jax.Array, jax.Array, StaticCache], tuple[jax.Array, StaticCache]]


def filter_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """fp32 logits [B, V] scaled by the temperature, with the tokens top-k and top-p leave out at -inf. [B, V]

    Scaled as (logits - max) / T: the top token sits at 0 and every other is below it, so a tiny T overflows only
    to -inf (never to inf, or inf - inf = NaN), and sampling tends to greedy as T -> 0. A T below float32's smallest
    normal number acts as that number. Both filters cut by value, so a tie at the boundary keeps every tied token.
    """
    peak = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    logits = (logits - peak) / max(sampling.temperature, MIN_TEMPERATURE)
    if sampling.top_k:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # [B, V], descending
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token while the tokens ranked above it hold less than top_p; the top token always stays (also when
        # NaN logits make every comparison false: they are reported by the caller, not indexed out of range here).
        above = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # [B, V], the mass ranked above each token
        kept = jnp.maximum(jnp.sum(above < sampling.top_p, axis=-1, keepdims=True), 1)  # [B, 1]
        cutoff = jnp.take_along_axis(sorted_logits, kept - 1, axis=-1)  # [B, 1], the smallest logit kept
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample(logits: jax.Array, sampling: SamplingParams, key: jax.Array) -> jax.Array:
    """Next token per row from fp32 logits [B, V]: greedy, or temperature with top-k and top-p filtering. [B] int32."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampling), axis=-1).astype(jnp.int32)


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


def _forward_last(graph: ModelGraph, state: nnx.State, cache: StaticCache, input_ids: jax.Array,
                  positions: jax.Array, attention_mask: jax.Array | None) -> tuple[jax.Array, StaticCache]:
    logits, cache = nnx.merge(graph.graphdef, state)(input_ids, positions, cache, attention_mask)
    return logits[:, -1].astype(jnp.float32), cache  # [B, V]


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("cache",))
def _prefill(graph: ModelGraph, state: nnx.State, cache: StaticCache, input_ids: jax.Array,
             attention_mask: jax.Array) -> tuple[jax.Array, StaticCache]:
    positions = jnp.cumsum(attention_mask, axis=-1) - 1  # [B, T], padding at -1
    return _forward_last(graph, state, cache, input_ids, positions, attention_mask)


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("cache",))
def _decode_step(graph: ModelGraph, state: nnx.State, cache: StaticCache, input_ids: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, StaticCache]:
    return _forward_last(graph, state, cache, input_ids, positions, None)


def _pick(logits: jax.Array, finished: jax.Array, step: jax.Array, key: jax.Array, sampling: SamplingParams,
          eos: int | None) -> tuple[jax.Array, jax.Array]:
    """Sample step `step`'s tokens; rows already finished keep emitting EOS."""
    tokens = sample(logits, sampling, jax.random.fold_in(key, step))  # [B]
    if eos is None:
        return tokens, finished
    tokens = jnp.where(finished, eos, tokens)
    return tokens, finished | (tokens == eos)


@functools.partial(jax.jit, static_argnames=("graph", "sampling", "eos", "vocab_size"), donate_argnames=("cache",))
def _sampled_step(graph: ModelGraph, state: nnx.State, cache: StaticCache, loop: tuple, key: jax.Array,
                  sampling: SamplingParams, eos: int | None, vocab_size: int) -> tuple:
    """One streaming step: feed the loop's tokens at its positions and sample the next ones.

    loop = (tokens [B], positions [B], finished [B], step [], halted []) stays on the device. The streaming loop
    dispatches step k + 1 before it reads step k's tokens, so a halted step (every row has emitted EOS, or an earlier
    step's logits were not finite) changes nothing. Returns (for_host [B + 1]: the tokens, then a non-finite flag,
    the step's one device-to-host copy; logits [B, V]; the next loop; the cache).
    """
    tokens, positions, finished, step, halted = loop

    def advance(carry: tuple) -> tuple:
        _, _, _, cache, trips = carry
        logits, cache = _forward_last(graph, state, cache, tokens[:, None], positions[:, None], None)
        return (logits, *_pick(logits, finished, step, key, sampling, eos), cache, trips - 1)

    # A loop of zero or one trip rather than lax.cond: XLA-CPU updates the cache in place through a while loop, but
    # copies every K/V buffer through a conditional.
    no_logits = jnp.zeros((tokens.shape[0], vocab_size), jnp.float32)  # [B, V], what a halted step returns
    carry = (no_logits, tokens, finished, cache, (~halted).astype(jnp.int32))
    logits, next_tokens, finished, cache, _ = lax.while_loop(lambda carry: carry[-1] > 0, advance, carry)
    non_finite = ~jnp.isfinite(logits).all()
    for_host = jnp.concatenate([next_tokens, non_finite.astype(jnp.int32)[None]])  # [B + 1]
    loop = (next_tokens, positions + 1, finished, step + 1, halted | non_finite | finished.all())
    return for_host, logits, loop, cache


_FUSED_STATIC = ("graph", "sampling", "eos", "num_steps", "vocab_size", "return_logits")


@functools.partial(jax.jit, static_argnames=_FUSED_STATIC, donate_argnames=("cache",))
def _fused_decode(graph: ModelGraph, state: nnx.State, cache: StaticCache, tokens: jax.Array,
                  positions: jax.Array, finished: jax.Array, key: jax.Array, first_step: jax.Array,
                  sampling: SamplingParams,
                  eos: int | None, num_steps: int, vocab_size: int, return_logits: bool) -> tuple:
    """Up to `num_steps` decode steps in one lax.while_loop; stops early once every row has emitted EOS."""
    batch = tokens.shape[0]
    out_tokens = jnp.full((batch, num_steps), -1, jnp.int32)  # [B, N]
    out_logits = jnp.zeros((batch, num_steps if return_logits else 0, vocab_size), jnp.float32)  # [B, N, V]

    def cond(carry: tuple) -> jax.Array:
        step, finished, bad_step = carry[0], carry[3], carry[7]
        return (step < num_steps) & ~finished.all() & (bad_step < 0)

    def body(carry: tuple) -> tuple:
        step, tokens, positions, finished, cache, out_tokens, out_logits, bad_step = carry
        logits, cache = _forward_last(graph, state, cache, tokens[:, None], positions[:, None], None)
        next_tokens, finished = _pick(logits, finished, first_step + step, key, sampling, eos)
        out_tokens = out_tokens.at[:, step].set(next_tokens)
        if return_logits:
            out_logits = out_logits.at[:, step].set(logits)
        bad_step = jnp.where(jnp.isfinite(logits).all(), bad_step, step)
        return step + 1, next_tokens, positions + 1, finished, cache, out_tokens, out_logits, bad_step

    carry = (jnp.int32(0), tokens, positions, finished, cache, out_tokens, out_logits, jnp.int32(-1))
    steps, _, _, _, cache, out_tokens, out_logits, bad_step = jax.lax.while_loop(cond, body, carry)
    return out_tokens, out_logits, steps, bad_step, cache


_fused_executables: dict[tuple, jax.stages.Compiled] = {}


def fused_executable(*args: object, **static: object) -> tuple[jax.stages.Compiled, float]:
    """The compiled fused loop for these argument shapes, compiled ahead of time once per shape so its compile time is
    measured apart from decoding. Returns (executable, seconds spent compiling now: 0.0 when it was ready)."""
    leaves, treedef = jax.tree_util.tree_flatten(args[1:])
    signature = (args[0], treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves), tuple(sorted(static.items())))
    if signature in _fused_executables:
        return _fused_executables[signature], 0.0
    start = time.perf_counter()
    _fused_executables[signature] = _fused_decode.lower(*args, **static).compile()
    return _fused_executables[signature], time.perf_counter() - start


def decode_step_fn(model: Mistral) -> DecodeStep:
    """The one-token step `(input_ids [B, 1], positions [B, 1], cache) -> (logits [B, V], cache)`, jitted once, with
    the cache donated: the input cache is consumed and the returned one reuses its buffers."""
    graph, state = split_model(model)

    def step(input_ids: jax.Array, positions: jax.Array, cache: StaticCache) -> tuple[jax.Array, StaticCache]:
        # The model's own checks are skipped under tracing, and inside the jitted step an out-of-range write position
        # would be clamped silently by dynamic_update_slice: refuse it (and bad ids, batch, dtype) before dispatch.
        model.check_inputs(input_ids, positions, None)
        cache.check_forward(model.config, input_ids, model.dtype, model.device)
        return _decode_step(graph, state, cache, input_ids, positions)

    return step


def prompt_bucket(prompt_len: int, room: int | None) -> int:
    """Prompts are left-padded to a power of two (>= 16) so one process compiles few prefills; `room` caps it."""
    bucket = max(MIN_PROMPT_BUCKET, 1 << (prompt_len - 1).bit_length())
    return max(prompt_len, min(bucket, room)) if room is not None else bucket


def prefill(model: Mistral, input_ids: jax.Array, attention_mask: jax.Array,
            cache: StaticCache) -> tuple[jax.Array, StaticCache]:
    """Run the left-padded prompt [B, T] through the model, filling the (donated) cache.
    Returns last-token logits [B, V] fp32 and the new cache."""
    model.check_inputs(input_ids, jnp.cumsum(attention_mask, axis=-1) - 1, attention_mask)
    cache.check_forward(model.config, input_ids, model.dtype, model.device)
    graph, state = split_model(model)
    return _prefill(graph, state, cache, input_ids, attention_mask)


def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, fused: bool = True,
             on_token: TokenCallback | None = None, return_logits: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. Rows are left-padded; each stops at its own EOS.

    `cache` is a kind ("static" / "sliding_window", default: sliding when the config has a window) or a cache
    object to reuse (it is reset first, and donated: use `result.cache` afterwards). `fused=False`, or an `on_token`
    callback, decodes one jitted step at a time.
    """
    config = model.config
    inputs = prepare_batch(prompts, config, sampling, max_new_tokens)
    prompt_ids, ids_np, mask_np = inputs.prompt_ids, inputs.input_ids, inputs.attention_mask  # ids, mask: [B, T]
    sampling, max_new_tokens = inputs.sampling, inputs.max_new_tokens
    batch, prompt_len = ids_np.shape
    if cache is not None and not isinstance(cache, str):
        cache_checks.check_cache_type(cache, StaticCache, "jax_cache", _CACHE_HINT)
        cache.check_compatible(config, batch, model.dtype, model.device)  # before reset(): a refusal changes nothing
        check_budget(cache.capacity, prompt_len, max_new_tokens)
        bucket = prompt_bucket(prompt_len, None if cache.capacity is None else cache.capacity - max_new_tokens)
        check_positions(config, prompt_len, max_new_tokens, bucket + max(max_new_tokens - 1, 0))
        _check_outputs_fit(batch, max_new_tokens, config.vocab_size, fused and on_token is None, return_logits)
        cache = cache.reset()
    else:
        kind, cache_len = plan_cache(config, cache, prompt_len, max_new_tokens, max_cache_len)
        bounded = kind == "static" or cache_len < config.sliding_window
        bucket = prompt_bucket(prompt_len, cache_len - max_new_tokens if bounded and max_cache_len else None)
        check_positions(config, prompt_len, max_new_tokens, bucket + max(max_new_tokens - 1, 0))
        _check_outputs_fit(batch, max_new_tokens, config.vocab_size, fused and on_token is None, return_logits)
        if max_cache_len is None:  # room for the bucket's extra padding columns
            cache_len = bucket + max_new_tokens
        cache = make_cache(kind, config, batch, cache_len, model.dtype)
    if max_new_tokens == 0:
        return GenerationResult(cache.kind, cache.max_cache_len, prompt_ids, [[] for _ in prompt_ids], 0.0, 0.0, 0.0,
                                0, 0, None, cache)
    extra = ((0, 0), (bucket - prompt_len, 0))  # the bucket's extra columns are padding too
    ids_np = np.pad(ids_np, extra, constant_values=pad_token_id(config))  # [B, bucket]
    mask_np = np.pad(mask_np, extra)  # [B, bucket]
    key = jax.random.key(sampling.seed)
    start = time.perf_counter()
    logits, cache = prefill(model, jnp.asarray(ids_np), jnp.asarray(mask_np), cache)  # [B, V]
    first, _ = _pick(logits, jnp.zeros(batch, bool), jnp.int32(0), key, _without_seed(sampling), config.eos_token_id)
    first = np.asarray(first).tolist()
    prefill_s = time.perf_counter() - start
    _raise_if_non_finite(bool(~jnp.isfinite(logits).all()), 0, model.dtype)
    if on_token is not None:
        on_token(first)
    rest = continue_generation(model, cache, first, max_new_tokens - 1, sampling=sampling, fused=fused,
                               on_token=on_token, return_logits=return_logits, _first_step=1)
    # Per row: rows end at different lengths (each at its own EOS), so they are joined row by row, never zipped.
    tokens = [[token] + ([] if token == config.eos_token_id else more) for token, more in zip(first, rest.token_ids)]
    step_logits = jnp.concatenate([logits[:, None], rest.step_logits], axis=1) if return_logits else None
    return dataclasses.replace(rest, prompt_ids=prompt_ids, token_ids=tokens, prefill_s=prefill_s,
                               step_logits=step_logits)  # step_logits: [B, steps, V]


def continue_generation(model: Mistral, cache: StaticCache, last_tokens: Sequence[int], max_new_tokens: int, *,
                        sampling: SamplingParams | None = None, fused: bool = True,
                        on_token: TokenCallback | None = None, return_logits: bool = False,
                        _first_step: int = 0) -> GenerationResult:
    """Feed each row's last sampled token (not yet in `cache`) and decode up to `max_new_tokens` more.

    Positions come from the cache itself, so a cache handed over from torch_cache continues exactly where it was.
    A row whose last token is EOS is finished. Returns only the new tokens; `cache` is donated, and `result.cache`
    is the updated one.
    """
    config = model.config
    cache_checks.check_cache_type(cache, StaticCache, "jax_cache", _CACHE_HINT)
    last_tokens, sampling, max_new_tokens = prepare_continuation(last_tokens, config, sampling, max_new_tokens)
    cache.check_compatible(config, len(last_tokens), model.dtype, model.device)
    cache._check_write_range(max_new_tokens)  # refused up front, not after decoding part of the budget
    # next_positions() is int32 on the device: read the newest position here, where a position past int32 cannot wrap
    check_positions(config, int(jnp.max(cache.slot_positions)) + 2, max_new_tokens, int(cache.length) + max_new_tokens)
    _check_outputs_fit(len(last_tokens), max_new_tokens, config.vocab_size, fused and on_token is None, return_logits)
    eos, batch = config.eos_token_id, len(last_tokens)
    graph, state = split_model(model)
    key, static_sampling = jax.random.key(sampling.seed), _without_seed(sampling)
    tokens_now = jnp.asarray(last_tokens, jnp.int32)  # [B]
    finished = tokens_now == eos if eos is not None else jnp.zeros(batch, bool)  # [B]
    positions = cache.next_positions()  # [B]
    tokens: list[list[int]] = [[] for _ in range(batch)]
    logits_per_step: list[jax.Array] = []
    first_step_s = decode_s = 0.0
    decode_steps = timed_steps = 0
    all_done = eos is not None and all(t == eos for t in last_tokens)
    if fused and on_token is None and max_new_tokens and not all_done:
        executable, first_step_s = fused_executable(
            graph, state, cache, tokens_now, positions, finished, key, jnp.int32(_first_step),
            sampling=static_sampling, eos=eos, num_steps=max_new_tokens, vocab_size=config.vocab_size,
            return_logits=return_logits)
        decode_start = time.perf_counter()
        out_tokens, out_logits, steps, bad_step, cache = executable(state, cache, tokens_now, positions, finished,
                                                                    key, jnp.int32(_first_step))
        out_host, decode_steps, bad_step = np.asarray(out_tokens), int(steps), int(bad_step)
        decode_s, timed_steps = time.perf_counter() - decode_start, decode_steps
        if bad_step >= 0:
            _raise_if_non_finite(True, _first_step + bad_step, model.dtype)
        for step in range(decode_steps):
            append_tokens(tokens, out_host[:, step].tolist(), eos)
        if return_logits:
            logits_per_step = [out_logits[:, :decode_steps]]
    elif max_new_tokens and not all_done:
        loop = (tokens_now, positions, finished, jnp.int32(_first_step), jnp.bool_(False))
        decode_start = time.perf_counter()
        cache.check_live()
        pending = _sampled_step(graph, state, cache, loop, key, static_sampling, eos, config.vocab_size)
        while True:
            for_host, logits, loop, cache = pending
            decode_steps += 1
            if decode_steps < max_new_tokens:  # queue the next step before this one's tokens reach the host
                pending = _sampled_step(graph, state, cache, loop, key, static_sampling, eos, config.vocab_size)
                cache = pending[3]  # the live cache; a step queued after the last token holds it unchanged
            *row_ids, non_finite = np.asarray(for_host).tolist()  # the step's one host sync
            _raise_if_non_finite(bool(non_finite), _first_step + decode_steps - 1, model.dtype)
            all_done = eos is not None and all(token == eos for token in row_ids)
            if decode_steps == 1:  # compile happens here; timing of the steady state starts after it
                first_step_s, decode_start = time.perf_counter() - decode_start, time.perf_counter()
            if return_logits:
                logits_per_step.append(logits[:, None])
            append_tokens(tokens, row_ids, eos)
            if on_token is not None:
                on_token(row_ids)
            if all_done or decode_steps == max_new_tokens:
                break
        if decode_steps > 1:
            decode_s, timed_steps = time.perf_counter() - decode_start, decode_steps - 1
    step_logits = None
    if return_logits:
        empty = jnp.zeros((batch, 0, config.vocab_size), jnp.float32)
        step_logits = jnp.concatenate([empty, *logits_per_step], axis=1)  # [B, steps, V]
    return GenerationResult(cache.kind, cache.max_cache_len, [[] for _ in tokens], tokens, 0.0, first_step_s,
                            decode_s, decode_steps, timed_steps, step_logits, cache)


def _check_outputs_fit(batch: int, steps: int, vocab_size: int, fused: bool, return_logits: bool) -> None:
    """The fused loop allocates its [batch, steps] tokens (and [batch, steps, vocab] logits) up front, and returned
    logits are concatenated once more at the end: refuse what cannot fit before anything is compiled or run."""
    needed = (batch * steps * 4 if fused else 0) + (2 * batch * steps * vocab_size * 4 if return_logits else 0)
    device = default_device()
    what = f"decoding {steps} steps" + (f" with return_logits (2 x [{batch}, {steps}, {vocab_size}] float32)"
                                        if return_logits else f" fused ([{batch}, {steps}] int32 tokens)")
    cache_checks.check_fits(what, needed, available_memory(device), memory_label(device),
                            "generate fewer tokens" + (" or pass return_logits=False" if return_logits else ""))


def _without_seed(sampling: SamplingParams) -> SamplingParams:
    """The sampling settings as a static jit argument: the seed lives in the PRNG key, so it never retraces."""
    return dataclasses.replace(sampling, seed=0)


def _raise_if_non_finite(non_finite: bool, step: int, dtype: jnp.dtype) -> None:
    if non_finite:
        raise NonFiniteLogitsError(f"the model produced NaN or Inf logits at generated token {step}; the weights "
                                   f"or dtype ({dtype}) are not usable for this input")
