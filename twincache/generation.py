"""Framework-neutral generation inputs and outputs: prompt batching, sampling parameters, results.

Both backends validate through these functions, so a bad input gets the same message from either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from twincache.config import MistralConfig
from twincache.errors import CacheError, InputError

CACHE_KINDS = ("static", "sliding_window")

# Called after each generated step with the new token of every row: list[int] of length batch.
TokenCallback = Callable[[list[int]], None]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filtering."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self, vocab_size: int) -> None:
        if math.isnan(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 <= self.top_k <= vocab_size:
            raise InputError(f"top_k={self.top_k} must be in [0, vocab_size={vocab_size}] (0 disables it)")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1] (1 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns, in both backends. Ids are plain lists so the CLI can print them as JSON."""

    cache_kind: str  # "static" or "sliding_window"
    max_cache_len: int
    prompt_ids: list[list[int]]  # per row, without padding
    token_ids: list[list[int]]  # per row, generated ids up to and including its EOS
    prefill_s: float
    first_step_s: float  # compilation/tracing plus, in step mode, the first decode step: kept out of decode_s
    decode_s: float  # wall time of the `timed_steps` steady-state decode steps
    decode_steps: int  # forward calls after prefill
    timed_steps: int  # decode steps inside decode_s
    step_logits: Any = None  # [B, steps, V] float32 (backend array) when asked for
    cache: Any = None  # the cache after the last step: torch writes in place; JAX returns the donated result

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second per sequence in the steady state (warm-up and compile excluded)."""
        return self.timed_steps / self.decode_s if self.timed_steps and self.decode_s > 0 else 0.0


def pad_token_id(config: MistralConfig) -> int:
    """The id that fills left padding (never attended to, so any valid id works)."""
    return config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)


def append_tokens(tokens: list[list[int]], row_ids: list[int], eos: int | None) -> None:
    """Append one step's token per row, except to rows that already ended with EOS."""
    for row, token in enumerate(row_ids):
        if eos is None or not tokens[row] or tokens[row][-1] != eos:
            tokens[row].append(token)


def validate_prompts(prompts: Sequence[Sequence[int]], config: MistralConfig) -> list[list[int]]:
    """Check token ids and lengths of a batch of prompts; returns them as lists of ints."""
    if len(prompts) == 0:
        raise InputError("no prompts given; pass at least one prompt")
    checked = []
    for row, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise InputError(f"prompt {row} is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InputError(f"prompt {row} holds token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
        checked.append(ids)
    return checked


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to one length. Returns input_ids [B, T] int32 and attention_mask [B, T] int32."""
    longest = max(len(p) for p in prompts)
    input_ids = np.full((len(prompts), longest), pad_id, dtype=np.int32)  # [B, T]
    attention_mask = np.zeros((len(prompts), longest), dtype=np.int32)  # [B, T]
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = prompt
        attention_mask[row, longest - len(prompt):] = 1
    return input_ids, attention_mask


def validate_attention_mask(attention_mask: np.ndarray, input_shape: tuple[int, ...]) -> None:
    """A mask must match input_ids' shape, hold only 0/1, and be left-padded with at least one real token per row."""
    if tuple(attention_mask.shape) != tuple(input_shape):
        raise InputError(f"attention_mask has shape {list(attention_mask.shape)} but input_ids has "
                         f"{list(input_shape)}; they must match")
    if not np.isin(attention_mask, (0, 1)).all():
        raise InputError("attention_mask must hold only 0 (padding) and 1 (token)")
    for row, mask_row in enumerate(attention_mask):
        if not mask_row.any():
            raise InputError(f"attention_mask row {row} is all padding; every row needs at least one token")
        if (np.diff(mask_row) < 0).any():
            raise InputError(f"attention_mask row {row} has right padding or a gap; twincache requires left padding "
                             "(pads first, then tokens)")


def prepare_batch(prompts: Sequence[Sequence[int]], config: MistralConfig, sampling: SamplingParams,
                  max_new_tokens: int) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Validate a generation's inputs; returns the prompts, left-padded input_ids [B, T] and attention_mask [B, T]."""
    prompt_ids = validate_prompts(prompts, config)
    sampling.validate(config.vocab_size)
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
    return prompt_ids, *left_pad(prompt_ids, pad_token_id(config))


def check_budget(capacity: int | None, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse up front a generation that would overflow a given cache's capacity (None: an unbounded ring)."""
    if capacity is not None and prompt_len + max_new_tokens > capacity:
        raise CacheError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{prompt_len + max_new_tokens} exceeds the given cache's capacity {capacity}; build a larger "
                         "cache or generate fewer tokens")


def positions_from_mask(attention_mask: np.ndarray) -> np.ndarray:
    """Position ids cumsum(mask) - 1 as in transformers; padding gets -1. [B, T] int32."""
    return (np.cumsum(attention_mask, axis=-1) - 1).astype(np.int32)


def default_cache_kind(config: MistralConfig) -> str:
    return "sliding_window" if config.sliding_window is not None else "static"


def plan_cache(config: MistralConfig, cache_kind: str | None, prompt_len: int, max_new_tokens: int,
               max_cache_len: int | None) -> tuple[str, int]:
    """Choose cache kind and length for a generation, refusing up front what would not fit."""
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
    cache_kind = cache_kind or default_cache_kind(config)
    if cache_kind not in CACHE_KINDS:
        raise InputError(f"cache={cache_kind!r} is not one of {', '.join(CACHE_KINDS)}")
    if cache_kind == "sliding_window" and config.sliding_window is None:
        raise CacheError("a sliding_window cache was asked for, but this model's config has sliding_window=null; "
                         "use the static cache")
    total = prompt_len + max_new_tokens
    if max_cache_len is None:
        max_cache_len = total
    if max_cache_len <= 0:
        raise InputError(f"max_cache_len={max_cache_len} must be > 0")
    window_fits = cache_kind == "sliding_window" and max_cache_len >= config.sliding_window
    if not window_fits and total > max_cache_len:
        raise CacheError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"{cache_kind} cache capacity max_cache_len={max_cache_len}; raise --max-cache-len to at "
                         f"least {total} or generate fewer tokens")
    return cache_kind, max_cache_len
