"""Generation with torch_cache: eager prefill, then a decode step under
`torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs on GPU), with `compile=False` as the opt-out.

Prefill runs eagerly: it happens once per generation, and compiling it would add one dynamic-shape compile per
process for no decode-time gain (measured in bench/).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch

from torch_cache.cache import SlidingWindowCache, StaticCache, make_cache
from torch_cache.model import Mistral
from twincache.errors import CacheError, InputError, NonFiniteLogitsError
from twincache.generation import (
    GenerationResult,
    SamplingParams,
    TokenCallback,
    left_pad,
    plan_cache,
    positions_from_mask,
    validate_prompts,
)

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
        _compiled_steps[model] = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    return _compiled_steps[model]


@torch.inference_mode()
def prefill(model: Mistral, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            cache: StaticCache) -> torch.Tensor:
    """Run the left-padded prompt [B, T] through the model, filling the cache. Returns last-token logits [B, V] fp32."""
    positions = torch.from_numpy(positions_from_mask(attention_mask.cpu().numpy())).to(input_ids.device)
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
    prompt_ids = validate_prompts(prompts, config)
    sampling.validate(config.vocab_size)
    pad_id = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    ids_np, mask_np = left_pad(prompt_ids, pad_id)
    batch, prompt_len = ids_np.shape
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    if isinstance(cache, StaticCache):
        if cache.capacity is not None and prompt_len + max_new_tokens > cache.capacity:
            raise CacheError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the given "
                             f"cache's capacity {cache.capacity}; build a larger cache")
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
        cache.reset()
        kind = "sliding_window" if isinstance(cache, SlidingWindowCache) else "static"
    else:
        kind, cache_len = plan_cache(config, cache, prompt_len, max_new_tokens, max_cache_len)
        cache = make_cache(kind, config, batch, cache_len, dtype, device)
    input_ids = torch.from_numpy(ids_np).long().to(device)  # [B, T]
    attention_mask = torch.from_numpy(mask_np).to(device)  # [B, T]
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)

    tokens: list[list[int]] = [[] for _ in range(batch)]
    step_logits: list[torch.Tensor] = []
    if max_new_tokens == 0:
        return GenerationResult(kind, cache.max_cache_len, prompt_ids, tokens, 0.0, 0.0, 0.0, 0, None)

    start = time.perf_counter()
    logits = prefill(model, input_ids, attention_mask, cache)  # [B, V]
    step = decode_step_fn(model, compile)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    next_ids = torch.zeros(batch, dtype=torch.long, device=device)  # replaced by the first sample
    positions = torch.from_numpy(mask_np.sum(axis=1, keepdims=True)).long().to(device)  # [B, 1] next position
    prefill_s, first_step_s, decode_start, decode_steps = 0.0, 0.0, 0.0, 0
    for produced in range(max_new_tokens):
        if produced:
            logits = step(next_ids[:, None], positions, cache).float()  # [B, V]
            positions = positions + 1
            decode_steps += 1
        if return_logits:
            step_logits.append(logits.clone())
        next_ids = sample(logits, sampling, generator)
        if config.eos_token_id is not None:  # rows already done keep emitting EOS; they are trimmed below
            next_ids = torch.where(finished, config.eos_token_id, next_ids)
            finished = finished | (next_ids == config.eos_token_id)
        # One host sync per step: the tokens, whether every row is done, and whether any logit is non-finite.
        host = torch.cat([next_ids, finished.all()[None].long(), (~torch.isfinite(logits).all())[None].long()])
        *row_ids, all_done, non_finite = host.tolist()
        if non_finite:
            raise NonFiniteLogitsError(f"the model produced NaN or Inf logits at generated token {produced}; "
                                       f"the weights or dtype ({dtype}) are not usable for this input")
        if produced == 0:
            prefill_s, decode_start = time.perf_counter() - start, time.perf_counter()
        elif produced == 1:  # compile happens here; timing of the steady state starts after it
            first_step_s, decode_start = time.perf_counter() - decode_start, time.perf_counter()
        for row, token in enumerate(row_ids):
            if not tokens[row] or tokens[row][-1] != config.eos_token_id:
                tokens[row].append(token)
        if on_token is not None:
            on_token(row_ids)
        if all_done:
            break
    decode_s = time.perf_counter() - decode_start if decode_steps > 1 else 0.0
    logits_out = torch.stack(step_logits, dim=1) if return_logits else None  # [B, steps, V]
    return GenerationResult(kind, cache.max_cache_len, prompt_ids, tokens, prefill_s, first_step_s, decode_s,
                            decode_steps, logits_out)
