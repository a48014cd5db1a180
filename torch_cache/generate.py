"""Generation with torch_cache: eager prefill, then a decode step under
`torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs on GPU), with `compile=False` as the opt-out.

Prefill runs eagerly, by measurement: on the `small` bench model (57M params, fp32, 2 CPU cores) a 300-token prefill
took 164-180 ms eager and 168 ms compiled with dynamic shapes, after a 23.6 s compile. It runs once per generation,
so compiling it would only add that compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from torch_cache.cache import StaticCache, available_memory, make_cache, memory_label
from torch_cache.model import Mistral
from twincache import cache_checks
from twincache.buckets import step_attend_len
from twincache.errors import NonFiniteLogitsError
from twincache.generation import (
    GenerationResult,
    SamplingParams,
    TokenCallback,
    announce_compile,
    append_tokens,
    check_budget,
    check_positions,
    plan_cache,
    positions_from_mask,
    prepare_batch,
    prepare_continuation,
    validate_attention_mask,
    validate_forced_tokens,
)

MAX_DECODE_VARIANTS = 64
_CACHE_HINT = ("pass a torch_cache.cache StaticCache or SlidingWindowCache (copy a jax_cache one with "
               "twincache_app.handoff.cache_to_torch), or a kind name")
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)  # 1.2e-38: lower temperatures sample as this one
DecodeStep = Callable[[torch.Tensor, torch.Tensor, StaticCache, int | None], torch.Tensor]


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """fp32 logits [B, V] scaled by the temperature, with the tokens top-k and top-p leave out at -inf. [B, V]

    Scaled as (logits - max) / T: the top token sits at 0 and every other is below it, so a tiny T overflows only
    to -inf (never to inf, or inf - inf = NaN), and sampling tends to greedy as T -> 0. A T below float32's smallest
    normal number acts as that number. Both filters cut by value, so a tie at the boundary keeps every tied token.
    """
    peak = logits.max(dim=-1, keepdim=True).values  # [B, 1]
    logits = (logits - peak) / max(sampling.temperature, MIN_TEMPERATURE)
    if sampling.top_k:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the tokens ranked above it hold less than top_p; the top token always stays (also when
        # NaN logits make every comparison false: they are reported by the caller, not indexed out of range here).
        above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V], the mass ranked above each token
        kept = (above < sampling.top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
        cutoff = sorted_logits.gather(-1, kept - 1)  # [B, 1], the smallest logit kept
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from fp32 logits [B, V]: greedy, or temperature with top-k and top-p filtering. [B] int64."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(filter_logits(logits, sampling).softmax(dim=-1), 1, generator=generator)[:, 0]


_DecodeOne = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
_compiled_decode: weakref.WeakKeyDictionary[Mistral, _DecodeOne] = weakref.WeakKeyDictionary()


def _greedy_choice(logits: torch.Tensor, finished: torch.Tensor,
                   eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy step's decisions from fp32 logits [B, V], written to run inside the compiled step: the tokens [B]
    (finished rows keep emitting `eos`, [] int64, -1 for none), the new finished flags [B], and what the host reads,
    its one copy per step: [B + 1] int64, the tokens then 1 if any logit is NaN or Inf."""
    next_ids = torch.where(finished, eos, logits.argmax(dim=-1))  # [B]
    finished = finished | ((next_ids == eos) & (eos >= 0))
    return next_ids, finished, torch.cat([next_ids, (~torch.isfinite(logits).all()).long()[None]])


def _decode_one_fn(model: Mistral, compile: bool) -> _DecodeOne:
    """The whole greedy decode step, compiled once per model: `(input_ids [B, 1], positions [B, 1], cache, attend_len,
    finished [B], eos []) -> (logits [B, V] fp32, tokens [B], finished [B], next positions [B, 1], for_host [B + 1])`.
    The forward, the greedy choice, the EOS bookkeeping and the finiteness flag are one graph; sampled decoding uses
    its logits and draws on the host's torch.Generator."""
    def decode_one(input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, attend_len: int | None,
                   finished: torch.Tensor, eos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = model(input_ids, positions, cache, attend_len=attend_len)[:, -1].float()  # [B, V]
        next_ids, finished, for_host = _greedy_choice(logits, finished, eos)
        return logits, next_ids, finished, positions + 1, for_host

    if not compile:
        return decode_one
    if model not in _compiled_decode:
        # Dynamo keys its graphs on this one code object, so every (model shape, cache kind, batch, dtype, bucket
        # kind) a process decodes with is one entry; the default limit of 8 would make the 9th a hard error under
        # fullgraph=True. The tests count the compiles of a generation with fail_on_recompile.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_DECODE_VARIANTS)
        # Static shapes (batch and cache sizes specialise), but the bucket is symbolic where this torch can say so:
        # one graph then serves every partial bucket, and the whole cache is one more (docs/design.md §7.13).
        # Elsewhere each bucket compiles once.
        compiled = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
        symbolic_bucket = (torch.compiler.config.patch(dynamic_sources="L['attend_len']")
                           if hasattr(torch.compiler.config, "dynamic_sources") else contextlib.nullcontext())

        def inference_step(*args: object) -> tuple[torch.Tensor, ...]:
            # grad mode is guarded on: entering inference mode here keeps it one graph for all callers
            with torch.inference_mode(), symbolic_bucket:
                return compiled(*args)

        _compiled_decode[model] = inference_step
    return _compiled_decode[model]


def decode_step_fn(model: Mistral, compile: bool = True) -> DecodeStep:
    """The one-token step `(input_ids [B, 1], positions [B, 1], cache, attend_len=None) -> logits [B, V]` fp32,
    compiled once per model: the graph generate runs (its greedy choice unused here). `attend_len` is the step's
    attention bucket (twincache.buckets; None: every slot)."""
    decode_one = _decode_one_fn(model, compile)

    def step(input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache,
             attend_len: int | None = None) -> torch.Tensor:
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # [B]
        no_eos = torch.tensor(-1, device=input_ids.device)
        return decode_one(input_ids, positions, cache, attend_len, finished, no_eos)[0]

    return step


@torch.inference_mode()
def prefill(model: Mistral, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            cache: StaticCache) -> torch.Tensor:
    """Run the left-padded prompt [B, T] through the model, filling the cache. Returns last-token logits [B, V] fp32."""
    mask_np = attention_mask.cpu().numpy()
    validate_attention_mask(mask_np, tuple(input_ids.shape))  # right padding would make [:, -1] a pad's logits
    positions = torch.from_numpy(positions_from_mask(mask_np)).to(input_ids.device)
    attend = step_attend_len(int(cache.length), input_ids.shape[1], cache.cache_len)
    return model(input_ids, positions.long(), cache, attention_mask, attend)[:, -1].float()


@torch.inference_mode()
def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, compile: bool = True,
             on_token: TokenCallback | None = None, return_logits: bool = False,
             forced_tokens: Sequence[Sequence[int]] | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. Rows are left-padded; each stops at its own EOS.

    `cache` is a kind ("static" / "sliding_window", default: sliding when the config has a window) or a cache
    object to reuse (it is reset first). `on_token` receives each step's tokens, one per row. Every input is
    validated before a given cache is touched: a refused call changes nothing.
    `forced_tokens` teacher-forces the same decode path: row r emits forced_tokens[r][i] at step i instead of a
    sampled token and feeds it to step i + 1. Each row gives exactly max_new_tokens ids, and EOS ends no forced row.
    """
    config = model.config
    inputs = prepare_batch(prompts, config, sampling, max_new_tokens)
    sampling, max_new_tokens = inputs.sampling, inputs.max_new_tokens
    batch, prompt_len = inputs.input_ids.shape  # [B, T]
    forced = None if forced_tokens is None else validate_forced_tokens(forced_tokens, batch, max_new_tokens, config)
    eos = config.eos_token_id if forced is None else None  # a forced row runs to its last forced token
    device, dtype = model.device, model.dtype
    if return_logits:
        _check_logits_fit(batch, max_new_tokens, config.vocab_size, device)
    if cache is not None and not isinstance(cache, str):
        cache_checks.check_cache_type(cache, StaticCache, "torch_cache", _CACHE_HINT)
        cache.check_compatible(config, batch, dtype, device)  # before reset(): a refused call changes nothing
        check_budget(cache.capacity, prompt_len, max_new_tokens)
        cache.reset()
        planned_len = cache.max_cache_len
    else:
        kind, cache_len = plan_cache(config, cache, prompt_len, max_new_tokens, max_cache_len)
        planned_len = cache_len  # reported as planned: a ring holds only min(W, it) slots (docs/design.md §5)
        cache = make_cache(kind, config, batch, cache_len, dtype, device)
    prompt_ids = inputs.prompt_ids
    if max_new_tokens == 0:
        return GenerationResult(cache.kind, planned_len, prompt_ids, [[] for _ in prompt_ids], 0.0, 0.0, 0.0,
                                0, 0, None, cache, "compiled" if compile else "eager")
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
    if compile and max_new_tokens > 1:  # the first decode step compiles
        announce_compile("torch.compile")
    start = time.perf_counter()
    logits = prefill(model, torch.from_numpy(inputs.input_ids).long().to(device),
                     torch.from_numpy(inputs.attention_mask).to(device), cache)  # [B, V]
    first_forced = None if forced is None else torch.from_numpy(forced[:, 0]).long().to(device)  # [B]
    _, _, first = _pick(logits, torch.zeros(batch, dtype=torch.bool, device=device), sampling, generator, eos,
                        step=0, forced=first_forced)
    prefill_s = time.perf_counter() - start
    if on_token is not None:
        on_token(first)
    rest = continue_generation(model, cache, first, max_new_tokens - 1, sampling=sampling, compile=compile,
                               on_token=on_token, return_logits=return_logits, generator=generator,
                               forced_tokens=None if forced is None else forced[:, 1:])
    # Per row: rows end at different lengths (each at its own EOS), so they are joined row by row, never zipped.
    tokens = [[token] + ([] if token == eos else more) for token, more in zip(first, rest.token_ids)]
    step_logits = torch.cat([logits[:, None], rest.step_logits], dim=1) if return_logits else None  # [B, steps, V]
    return dataclasses.replace(rest, max_cache_len=planned_len, prompt_ids=prompt_ids, token_ids=tokens,
                               prefill_s=prefill_s,
                               step_logits=step_logits)


@torch.inference_mode()
def continue_generation(model: Mistral, cache: StaticCache, last_tokens: Sequence[int], max_new_tokens: int, *,
                        sampling: SamplingParams | None = None, compile: bool = True,
                        on_token: TokenCallback | None = None, return_logits: bool = False,
                        generator: torch.Generator | None = None,
                        forced_tokens: Sequence[Sequence[int]] | None = None) -> GenerationResult:
    """Feed each row's last sampled token (not yet in `cache`) and decode up to `max_new_tokens` more.

    Positions come from the cache itself, so a cache handed over from jax_cache continues exactly where it was.
    A row whose last token is EOS is finished. Returns only the new tokens; `result.cache` is `cache`, written in place.
    `forced_tokens` teacher-forces the steps, as in `generate`.
    """
    config = model.config
    cache_checks.check_cache_type(cache, StaticCache, "torch_cache", _CACHE_HINT)
    last_tokens, sampling, max_new_tokens = prepare_continuation(last_tokens, config, sampling, max_new_tokens)
    device, dtype = model.device, model.dtype
    cache.check_compatible(config, len(last_tokens), dtype, device)
    cache._check_write_range(max_new_tokens)  # refused up front, not after decoding part of the budget
    positions = cache.next_positions()[:, None]  # [B, 1], the positions of last_tokens
    check_positions(config, int(positions.max()) + 1, max_new_tokens, int(cache.length) + max_new_tokens)
    if return_logits:
        _check_logits_fit(len(last_tokens), max_new_tokens, config.vocab_size, device)
    forced = None
    if forced_tokens is not None:
        forced_np = validate_forced_tokens(forced_tokens, len(last_tokens), max_new_tokens, config)
        # [N, B]: step k's row forced[k] is contiguous, laid out as a sampled [B] is, so the compiled step's stride
        # guards hold and forcing never recompiles it
        forced = torch.from_numpy(forced_np.T.copy()).long().to(device)
    if generator is None and not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    eos = config.eos_token_id if forced is None else None  # a forced row runs to its last forced token
    eos_id = torch.tensor(-1 if eos is None else eos, device=device)  # [] int64, -1 for none
    next_ids = torch.tensor(last_tokens, dtype=torch.long, device=device)  # [B]
    finished = next_ids == eos_id  # [B]
    decode_one = _decode_one_fn(model, compile)
    tokens: list[list[int]] = [[] for _ in last_tokens]
    step_logits: list[torch.Tensor] = []
    first_step_s = decode_s = 0.0
    decode_steps = timed_steps = 0
    length, bucket = int(cache.length), None  # the host's copy of the cache length picks each step's bucket
    all_done = eos is not None and all(t == eos for t in last_tokens)
    stamp = time.perf_counter()
    while decode_steps < max_new_tokens and not all_done:
        attend = step_attend_len(length, 1, cache.cache_len)
        logits, greedy_ids, greedy_finished, positions, for_host = decode_one(next_ids[:, None], positions, cache,
                                                                              attend, finished, eos_id)
        length, decode_steps = length + 1, decode_steps + 1
        positions = positions.clone()  # cudagraph outputs are overwritten by the next replay
        if return_logits:
            step_logits.append(logits.clone())
        if sampling.greedy and forced is None:  # decided inside the step: one host copy carries tokens and NaN flag
            *row_ids, non_finite = for_host.tolist()
            _raise_if_non_finite(non_finite, decode_steps, logits.dtype)
            next_ids, finished = greedy_ids.clone(), greedy_finished.clone()
        else:
            next_ids, finished, row_ids = _pick(logits, finished, sampling, generator, eos, decode_steps,
                                                None if forced is None else forced[decode_steps - 1])
        all_done = eos is not None and all(token == eos for token in row_ids)
        now = time.perf_counter()
        if attend != bucket:  # the first step of each bucket may compile: timed apart from the steady state
            first_step_s, bucket = first_step_s + now - stamp, attend
        else:
            decode_s, timed_steps = decode_s + now - stamp, timed_steps + 1
        stamp = now
        append_tokens(tokens, row_ids, eos)
        if on_token is not None:
            on_token(row_ids)
    logits_out = None
    if return_logits:  # [B, steps, V]; steps is 0 when every row had already ended
        empty = torch.zeros(len(tokens), 0, config.vocab_size, device=device)
        logits_out = torch.stack(step_logits, dim=1) if step_logits else empty
    return GenerationResult(cache.kind, cache.max_cache_len, [[] for _ in tokens], tokens, 0.0, first_step_s,
                            decode_s, decode_steps, timed_steps, logits_out, cache, "compiled" if compile else "eager")


def _check_logits_fit(batch: int, steps: int, vocab_size: int, device: torch.device) -> None:
    """return_logits keeps [batch, steps, vocab] fp32 logits (twice, while they are stacked): refuse it up front."""
    cache_checks.check_fits(f"return_logits over {steps} steps (2 x [{batch}, {steps}, {vocab_size}] float32)",
                            2 * batch * steps * vocab_size * 4, available_memory(device), memory_label(device),
                            "generate fewer tokens or pass return_logits=False")


def _pick(logits: torch.Tensor, finished: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
          eos: int | None, step: int,
          forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Sample one step's tokens [B] (or take the `forced` ones); finished rows keep emitting EOS. Raises on
    non-finite logits.

    Returns the tokens on device and on the host: one host sync per step carries them and the finiteness flag."""
    finite_rows = torch.isfinite(logits).all(dim=-1, keepdim=True)  # [B, 1]
    if not sampling.greedy:  # a row with NaN/Inf is drawn from zeros instead: multinomial would raise before we can
        logits = logits.where(finite_rows, 0.0)
    next_ids = sample(logits, sampling, generator) if forced is None else forced  # [B]
    if eos is not None:
        next_ids = torch.where(finished, eos, next_ids)
        finished = finished | (next_ids == eos)
    *row_ids, non_finite = torch.cat([next_ids, (~finite_rows.all())[None].long()]).tolist()
    _raise_if_non_finite(non_finite, step, logits.dtype)
    return next_ids, finished, row_ids


def _raise_if_non_finite(non_finite: int, step: int, dtype: torch.dtype) -> None:
    if non_finite:
        raise NonFiniteLogitsError(f"the model produced NaN or Inf logits at generated token {step}; the weights "
                                   f"or dtype ({dtype}) are not usable for this input")


__all__ = ["MAX_DECODE_VARIANTS", "DecodeStep", "sample", "decode_step_fn", "prefill", "generate",
           "continue_generation", "MIN_TEMPERATURE", "filter_logits"]
