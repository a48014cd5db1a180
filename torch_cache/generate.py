"""Generation with torch_cache: eager prefill, then a decode step under
`torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs on GPU), with `compile=False` as the opt-out.

Prefill runs eagerly, by measurement: on the `small` bench model (57M params, fp32, 2 CPU cores) a 300-token prefill
took 164-180 ms eager and 168 ms compiled with dynamic shapes, after a 23.6 s compile. It runs once per generation,
so compiling it would only add that compile.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from torch_cache.cache import StaticCache, make_cache
from torch_cache.model import Mistral
from twincache.errors import InputError, NonFiniteLogitsError
from twincache.generation import (
    GenerationResult,
    SamplingParams,
    TokenCallback,
    append_tokens,
    check_budget,
    plan_cache,
    positions_from_mask,
    prepare_batch,
    validate_attention_mask,
    validate_prompts,
)

MAX_DECODE_VARIANTS = 64
DecodeStep = Callable[[torch.Tensor, torch.Tensor, StaticCache], torch.Tensor]
_compiled_steps: weakref.WeakKeyDictionary[Mistral, DecodeStep] = weakref.WeakKeyDictionary()


def sample(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from fp32 logits [B, V]: greedy, or temperature with top-k and top-p filtering. [B] int64."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def decode_step_fn(model: Mistral, compile: bool = True) -> DecodeStep:
    """The one-token step `(input_ids [B, 1], positions [B, 1], cache) -> logits [B, V]`, compiled once per model."""
    def step(input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        return model(input_ids, positions, cache)[:, -1]

    if not compile:
        return step
    if model not in _compiled_steps:
        # Dynamo keys its graphs on this one code object, so every (model shape, cache kind, batch, dtype) a process
        # decodes with is one entry; the default limit of 8 would make the 9th a hard error under fullgraph=True.
        # A generation itself still compiles exactly once (the tests assert it with fail_on_recompile).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_DECODE_VARIANTS)
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)

        def inference_step(input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache) -> torch.Tensor:
            with torch.inference_mode():  # grad mode is guarded on: entering it here keeps it one graph for all callers
                return compiled(input_ids, positions, cache)

        _compiled_steps[model] = inference_step
    return _compiled_steps[model]


@torch.inference_mode()
def prefill(model: Mistral, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            cache: StaticCache) -> torch.Tensor:
    """Run the left-padded prompt [B, T] through the model, filling the cache. Returns last-token logits [B, V] fp32."""
    mask_np = attention_mask.cpu().numpy()
    validate_attention_mask(mask_np, tuple(input_ids.shape))  # right padding would make [:, -1] a pad's logits
    positions = torch.from_numpy(positions_from_mask(mask_np)).to(input_ids.device)
    return model(input_ids, positions.long(), cache, attention_mask)[:, -1].float()


@torch.inference_mode()
def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, compile: bool = True,
             on_token: TokenCallback | None = None, return_logits: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. Rows are left-padded; each stops at its own EOS.

    `cache` is a kind ("static" / "sliding_window", default: sliding when the config has a window) or a cache
    object to reuse (it is reset first). `on_token` receives each step's tokens, one per row.
    """
    config = model.config
    sampling = sampling or SamplingParams()
    prompt_ids, ids_np, mask_np = prepare_batch(prompts, config, sampling, max_new_tokens)  # ids, mask: [B, T]
    batch, prompt_len = ids_np.shape
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    if isinstance(cache, StaticCache):
        cache.check_compatible(config, batch, dtype, device)  # before reset(): a refused call changes nothing
        check_budget(cache.capacity, prompt_len, max_new_tokens)
        cache.reset()
    else:
        kind, cache_len = plan_cache(config, cache, prompt_len, max_new_tokens, max_cache_len)
        cache = make_cache(kind, config, batch, cache_len, dtype, device)
    if max_new_tokens == 0:
        return GenerationResult(cache.kind, cache.max_cache_len, prompt_ids, [[] for _ in prompt_ids], 0.0, 0.0, 0.0,
                                0, 0, None, cache)
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
    start = time.perf_counter()
    logits = prefill(model, torch.from_numpy(ids_np).long().to(device), torch.from_numpy(mask_np).to(device), cache)
    _, _, first = _pick(logits, torch.zeros(batch, dtype=torch.bool, device=device), sampling, generator,
                        config.eos_token_id, step=0)
    prefill_s = time.perf_counter() - start
    if on_token is not None:
        on_token(first)
    rest = continue_generation(model, cache, first, max_new_tokens - 1, sampling=sampling, compile=compile,
                               on_token=on_token, return_logits=return_logits, generator=generator)
    # Per row: rows end at different lengths (each at its own EOS), so they are joined row by row, never zipped.
    tokens = [[token] + ([] if token == config.eos_token_id else more) for token, more in zip(first, rest.token_ids)]
    step_logits = torch.cat([logits[:, None], rest.step_logits], dim=1) if return_logits else None  # [B, steps, V]
    return dataclasses.replace(rest, prompt_ids=prompt_ids, token_ids=tokens, prefill_s=prefill_s,
                               step_logits=step_logits)


@torch.inference_mode()
def continue_generation(model: Mistral, cache: StaticCache, last_tokens: Sequence[int], max_new_tokens: int, *,
                        sampling: SamplingParams | None = None, compile: bool = True,
                        on_token: TokenCallback | None = None, return_logits: bool = False,
                        generator: torch.Generator | None = None) -> GenerationResult:
    """Feed each row's last sampled token (not yet in `cache`) and decode up to `max_new_tokens` more.

    Positions come from the cache itself, so a cache handed over from jax_cache continues exactly where it was.
    A row whose last token is EOS is finished. Returns only the new tokens; `result.cache` is `cache`, written in place.
    """
    config = model.config
    sampling = sampling or SamplingParams()
    sampling.validate(config.vocab_size)
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    last_tokens = validate_prompts([[int(t)] for t in last_tokens], config)
    cache.check_compatible(config, len(last_tokens), dtype, device)
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
    cache._check_write_range(max_new_tokens)  # refused up front, not after decoding part of the budget
    if generator is None and not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    eos = config.eos_token_id
    next_ids = torch.tensor([t[0] for t in last_tokens], dtype=torch.long, device=device)  # [B]
    finished = next_ids == eos if eos is not None else torch.zeros_like(next_ids, dtype=torch.bool)
    positions = cache.next_positions()[:, None]  # [B, 1]
    step = decode_step_fn(model, compile)
    tokens: list[list[int]] = [[] for _ in last_tokens]
    step_logits: list[torch.Tensor] = []
    first_step_s = decode_s = 0.0
    decode_steps = 0
    decode_start = time.perf_counter()
    all_done = eos is not None and all(t[0] == eos for t in last_tokens)
    while decode_steps < max_new_tokens and not all_done:
        logits = step(next_ids[:, None], positions, cache).float()  # [B, V]
        positions = positions + 1
        decode_steps += 1
        if return_logits:
            step_logits.append(logits.clone())  # cudagraph outputs are overwritten by the next replay
        next_ids, finished, row_ids = _pick(logits, finished, sampling, generator, eos, decode_steps)
        all_done = eos is not None and all(token == eos for token in row_ids)
        if decode_steps == 1:  # compile happens here; timing of the steady state starts after it
            first_step_s, decode_start = time.perf_counter() - decode_start, time.perf_counter()
        append_tokens(tokens, row_ids, eos)
        if on_token is not None:
            on_token(row_ids)
    if decode_steps > 1:
        decode_s = time.perf_counter() - decode_start
    logits_out = None
    if return_logits:  # [B, steps, V]; steps is 0 when every row had already ended
        empty = torch.zeros(len(tokens), 0, config.vocab_size, device=device)
        logits_out = torch.stack(step_logits, dim=1) if step_logits else empty
    return GenerationResult(cache.kind, cache.max_cache_len, [[] for _ in tokens], tokens, 0.0, first_step_s,
                            decode_s, decode_steps, max(decode_steps - 1, 0), logits_out, cache)


def _pick(logits: torch.Tensor, finished: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
          eos: int | None, step: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Sample one step's tokens [B]; finished rows keep emitting EOS. Raises on non-finite logits.

    Returns the tokens on device and on the host: one host sync per step carries them and the finiteness flag."""
    next_ids = sample(logits, sampling, generator)  # [B]
    if eos is not None:
        next_ids = torch.where(finished, eos, next_ids)
        finished = finished | (next_ids == eos)
    *row_ids, non_finite = torch.cat([next_ids, (~torch.isfinite(logits).all())[None].long()]).tolist()
    if non_finite:
        raise NonFiniteLogitsError(f"the model produced NaN or Inf logits at generated token {step}; the weights "
                                   f"or dtype ({logits.dtype}) are not usable for this input")
    return next_ids, finished, row_ids
