"""Framework-neutral generation inputs and outputs: prompt batching, sampling parameters, results.

Both backends validate through these functions, so a bad input gets the same message from either.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import operator
import re
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from typing import Any, SupportsIndex, TypeVar, cast

import numpy as np

from twincache.config import INT32_MAX, MistralConfig
from twincache.errors import CacheError, InputError, ResourceError

CACHE_KINDS = ("static", "sliding_window")
# jax.random.key keeps only a seed's low 32 bits (without x64), so seeds 2^32 apart would repeat a stream there;
# both backends take seeds in [0, 2^32) so that a seed means the same thing in either.
SEED_LIMIT = 2**32
DTYPES = ("float32", "bfloat16", "float16")  # by name, the same in every backend
# Columns a prefill runs through the model at once (docs/design.md §5, "Long prompts"): a longer prompt goes through
# the same cache in chunks, so prefill memory is bounded by the chunk and the cache, not by the prompt.
PREFILL_CHUNK = 512

# Called after each generated step with the new token of every row: list[int] of length batch.
TokenCallback = Callable[[list[int]], None]


def as_integer(name: str, value: object) -> int:
    """`value` as a Python int when it is an integer of any kind (int, numpy or 0-d tensor ints); refused otherwise:
    a float (even 5.0), a bool or a string would be truncated, or loop forever, further in."""
    if not isinstance(value, bool):
        try:
            return operator.index(cast(SupportsIndex, value))  # index() itself refuses a non-integer
        except TypeError:
            pass
    raise InputError(f"{name}={value!r} must be an integer, not {type(value).__name__}")


def check_count(name: str, value: object, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """The one check of every count at the API (max_new_tokens, max_cache_len, batch_size, ...): an integer in
    [minimum, maximum]. Returns it as a Python int."""
    value = as_integer(name, value)
    if value < minimum:
        raise InputError(f"{name}={value} must be {'> 0' if minimum == 1 else f'>= {minimum}'}")
    if value > maximum:
        why = " (the int32 limit of positions and lengths)" if maximum == INT32_MAX else ""
        raise InputError(f"{name}={value} must be <= {maximum}{why}")
    return value


def _as_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"{name}={value!r} must be a number, not {type(value).__name__}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filtering. The seed is checked even when greedy,
    so both backends accept and refuse the same settings."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self, vocab_size: int) -> SamplingParams:
        """Refuse settings out of range; returns them with plain Python int/float fields."""
        temperature = _as_real("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InputError(f"temperature={self.temperature} must be >= 0 and finite (0 means greedy)")
        top_k = as_integer("top_k", self.top_k)
        if not 0 <= top_k <= vocab_size:
            raise InputError(f"top_k={top_k} must be in [0, vocab_size={vocab_size}] (0 disables it)")
        top_p = _as_real("top_p", self.top_p)
        if math.isnan(top_p) or not 0 < top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1] (1 disables it)")
        seed = as_integer("seed", self.seed)
        if not 0 <= seed < SEED_LIMIT:
            raise InputError(f"seed={seed} must be in [0, 2**32 - 1 = {SEED_LIMIT - 1}]: both backends draw from a "
                             "32-bit seed")
        return SamplingParams(temperature, top_k, top_p, seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns, in both backends. Ids are plain lists so the CLI can print them as JSON."""

    cache_kind: str  # "static" or "sliding_window"
    max_cache_len: int  # the capacity planned for the generation; a cache the tower sized is rounded up (`cache`)
    prompt_ids: list[list[int]]  # per row, without padding
    token_ids: list[list[int]]  # per row, generated ids up to and including its EOS
    prefill_s: float
    first_step_s: float  # compilation/tracing plus the first decode step (JAX fused: its first block, one step)
    decode_s: float  # wall time of the `timed_steps` steady-state decode steps
    decode_steps: int  # forward calls after prefill
    timed_steps: int  # decode steps inside decode_s
    step_logits: Any = None  # [B, steps, V] float32 (backend array) when asked for
    cache: Any = None  # the cache after the last step: torch writes in place; JAX returns the donated result
    mode: str | None = None  # the decode mode that ran (docs/design.md §5)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second per sequence in the steady state (warm-up and compile excluded); None when no step after
        the first was timed (max_new_tokens <= 2, or EOS at once): not measured, rather than 0 tok/s."""
        return self.timed_steps / self.decode_s if self.timed_steps and self.decode_s > 0 else None


def pad_token_id(config: MistralConfig) -> int:
    """The id that fills left padding (never attended to, so any valid id works): as transformers, the first EOS id
    when the config has no pad id."""
    return config.pad_token_id if config.pad_token_id is not None else (config.eos_token_ids or (0,))[0]


def append_tokens(tokens: list[list[int]], row_ids: list[int], eos: tuple[int, ...],
                  last_tokens: Sequence[int]) -> None:
    """Append one step's token per row, except to rows that already ended with any of the `eos` ids (() for none): in
    this call, or before it (a continuation whose last token was EOS returns nothing for that row)."""
    for row, token in enumerate(row_ids):
        ended = tokens[row][-1] in eos if tokens[row] else last_tokens[row] in eos
        if not ended:
            tokens[row].append(token)


def _scalar_array(value: object) -> bool:
    """A 0-d numpy array, tensor or jax array: it has __len__ and __iter__, but both raise TypeError."""
    return getattr(value, "ndim", None) == 0


def validate_prompts(prompts: Sequence[Sequence[int]] | np.ndarray, config: MistralConfig,
                     label: str = "prompt", allow_empty: bool = False) -> list[list[int]]:
    """Check token ids and lengths of a batch of prompts; returns them as lists of Python ints.

    Ids must be integers (a float id would be truncated) inside the vocabulary; `label` names a row in messages.
    `allow_empty`: rows may hold no ids (forced_tokens for max_new_tokens=0)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or _scalar_array(prompts):
        name = "forced_tokens" if label == "forced_tokens row" else "prompts"
        raise InputError(f"{name} must be a list of token-id lists, e.g. [[1, 2, 3]], not {type(prompts).__name__}")
    if len(prompts) == 0:
        plural = {"last token of row": "last tokens (one per cache row)"}.get(label, f"{label}s")
        raise InputError(f"no {plural} given; pass at least one")
    checked = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__") or _scalar_array(prompt):
            raise InputError(f"{label} {row} is {prompt!r}, not a sequence of token ids; pass one list of ids per row, "
                             "e.g. [[1, 2, 3]] (tokenize text first)")
        if isinstance(prompt, (Set, Mapping)):  # iterates, but in no order a prompt could mean
            raise InputError(f"{label} {row} is a {type(prompt).__name__}, whose ids have no order; pass a list of ids")
        ids = []
        for token in prompt:
            try:
                ids.append(as_integer("token id", token))
            except InputError:
                raise InputError(f"{label} {row} holds token id {token!r}, which is not an integer") from None
        if not ids and not allow_empty:
            raise InputError(f"{label} {row} is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InputError(f"{label} {row} holds token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
        checked.append(ids)
    return checked


def parse_token_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """Comma-separated token ids as typed on a command line. An empty field ("1,,2") is refused, not skipped;
    only an all-empty text gives [] (the caller refuses an empty prompt)."""
    fields = text.split(",")
    if not any(field.strip() for field in fields):
        return []
    ids = []
    for number, field in enumerate(fields, 1):
        if not field.strip():
            raise InputError(f"{flag} has an empty field (field {number} of {text!r}); separate ids with single "
                             "commas, e.g. 1,2,3")
        try:
            ids.append(int(field))
        except ValueError:
            raise InputError(f"{flag} must be comma-separated integers, got {text!r} (field {number} is "
                             f"{field.strip()!r})") from None
    return ids


_ID_FIELD = re.compile(r"[^\s,]+")
_INTEGER = re.compile(r"[+-]?[0-9]+")


def parse_token_id_text(text: str, source: str) -> list[int]:
    """Token ids separated by commas and/or whitespace, newlines included (e.g. a --prompt-ids-file). As on a command
    line, an empty field (two commas with no id between them, or a leading or trailing comma) is refused, not
    skipped; `source` names the text in messages. Returns [] for a text with no ids (the caller refuses it)."""
    ids: list[int] = []
    end = 0
    for match in _ID_FIELD.finditer(text):
        field, line = match.group(), text.count("\n", 0, match.start()) + 1
        if text[end:match.start()].count(",") > (1 if ids else 0):
            raise InputError(f"{source} has an empty field before {field!r} on line {line}; separate ids with one "
                             "comma or with whitespace, e.g. 1,2,3 or 1 2 3")
        if not _INTEGER.fullmatch(field):
            raise InputError(f"{source} holds {field!r} on line {line}, which is not an integer token id; separate "
                             "ids with commas or whitespace, e.g. 1,2,3 or 1 2 3")
        ids.append(int(field))
        end = match.end()
    if "," in text[end:]:
        line = text.count("\n", 0, text.rindex(",")) + 1
        raise InputError(f"{source} ends with an empty field (a trailing comma on line {line}); remove the comma")
    return ids


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to one length. Returns input_ids [B, T] int32 and attention_mask [B, T] int32."""
    longest = max(len(p) for p in prompts)
    input_ids = np.full((len(prompts), longest), pad_id, dtype=np.int32)  # [B, T]
    attention_mask = np.zeros((len(prompts), longest), dtype=np.int32)  # [B, T]
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = prompt
        attention_mask[row, longest - len(prompt):] = 1
    return input_ids, attention_mask


def validate_attention_mask(attention_mask: np.ndarray, input_shape: tuple[int, ...],
                            whole_prompt: bool = True) -> None:
    """A mask must match input_ids' shape, hold only 0/1, and be left-padded, with at least one real token per row of
    a `whole_prompt` (a forward's chunk of a longer prompt may hold only padding in some rows)."""
    if tuple(attention_mask.shape) != tuple(input_shape):
        raise InputError(f"attention_mask has shape {list(attention_mask.shape)} but input_ids has "
                         f"{list(input_shape)}; they must match")
    outside = ~np.isin(attention_mask, (0, 1))
    if outside.any():
        row, column = (int(i) for i in np.argwhere(outside)[0])
        value = attention_mask[row, column].item()
        raise InputError(f"attention_mask row {row} holds {value!r} at column {column}; it must hold only 0 (padding) "
                         "and 1 (token)")
    for row, mask_row in enumerate(attention_mask):
        if whole_prompt and not mask_row.any():
            raise InputError(f"attention_mask row {row} is all padding; every row needs at least one token")
        if (np.diff(mask_row) < 0).any():
            raise InputError(f"attention_mask row {row} has right padding or a gap; twincache requires left padding "
                             "(pads first, then tokens)")


@dataclasses.dataclass(frozen=True)
class Batch:
    """A generation's validated inputs."""

    prompt_ids: list[list[int]]  # per row, without padding
    input_ids: np.ndarray  # [B, T] int32, left-padded
    attention_mask: np.ndarray  # [B, T] int32
    sampling: SamplingParams
    max_new_tokens: int
    prefill_chunk: int  # columns per prefill chunk


def check_sampling(sampling: object) -> SamplingParams:
    """The sampling settings: a SamplingParams, or None for greedy."""
    if sampling is None:
        return SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise InputError(f"sampling must be a twincache.generation.SamplingParams (or None: greedy), not "
                         f"{type(sampling).__name__}, e.g. SamplingParams(temperature=0.7, top_p=0.9, seed=0)")
    return sampling


def check_flags(**flags: object) -> None:
    """Refuse a switch (return_logits, compile, fused) that is not a bool: `fused="step"` or `compile="no"` ran the
    compiled mode, `return_logits="no"` kept the logits, `fused=None` ran the step mode, all without a word."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise InputError(f"{name}={value!r} must be True or False, not {type(value).__name__}" + (
                "; backend.generate(..., mode=...) takes a mode's name" if name in ("compile", "fused") else ""))


def check_model_type(model: object, own_type: type, tower: str) -> None:
    """Refuse a model of the other tower (or anything else) where `tower`'s Mistral is needed: the torch tower raised
    AttributeError on a jax_cache model, the JAX tower blamed the cache's dtype or device."""
    if not isinstance(model, own_type):
        other = {"torch_cache": "jax_cache", "jax_cache": "torch_cache"}[tower]
        copy = "to_torch" if tower == "torch_cache" else "from_torch"
        raise InputError(f"model is a {type(model).__module__}.{type(model).__name__}, not a {tower}.model.Mistral; "
                         f"call {other}'s own functions for a {other} model, or copy it with "
                         f"twincache_app.handoff.{copy}")


def check_on_token(on_token: object) -> None:
    """Refuse a streaming callback that cannot be called, before any cache is touched (it is first called after
    the prefill, when a JAX cache has been donated)."""
    if on_token is not None and not callable(on_token):
        raise InputError(f"on_token must be a function taking each step's new tokens (one id per row), or None; got "
                         f"{type(on_token).__name__}")


def prepare_batch(prompts: Sequence[Sequence[int]], config: MistralConfig, sampling: SamplingParams | None,
                  max_new_tokens: int, prefill_chunk: int = PREFILL_CHUNK, on_token: object = None) -> Batch:
    """Validate every input of a generation (prompts, sampling with its seed, the budget and the positions it
    reaches, the prefill chunk, the streaming callback) before anything is built or touched; returns them
    left-padded."""
    check_on_token(on_token)
    prompt_ids = validate_prompts(prompts, config)
    sampling = check_sampling(sampling).validate(config.vocab_size)
    max_new_tokens = check_count("max_new_tokens", max_new_tokens)
    prefill_chunk = check_count("prefill_chunk", prefill_chunk, minimum=1)
    longest = max(len(p) for p in prompt_ids)  # the last column fed is longest + max_new_tokens - 2
    check_positions(config, longest, max_new_tokens, longest + max(max_new_tokens - 1, 0))
    return Batch(prompt_ids, *left_pad(prompt_ids, pad_token_id(config)), sampling, max_new_tokens, prefill_chunk)


def prepare_continuation(last_tokens: Sequence[int], config: MistralConfig, sampling: SamplingParams | None,
                         max_new_tokens: int, on_token: object = None) -> tuple[list[int], SamplingParams, int]:
    """Validate a continuation's inputs: one last token per row, sampling, the budget, the streaming callback.
    Positions are checked by the caller against its cache (check_positions)."""
    check_on_token(on_token)
    if isinstance(last_tokens, (str, bytes)) or not hasattr(last_tokens, "__iter__") or _scalar_array(last_tokens):
        raise InputError(f"last_tokens must be a list of one token id per row, not {type(last_tokens).__name__}")
    rows = validate_prompts([[token] for token in last_tokens], config, label="last token of row")
    sampling = check_sampling(sampling).validate(config.vocab_size)
    return [row[0] for row in rows], sampling, check_count("max_new_tokens", max_new_tokens)


def check_first_step(first_step: object, max_new_tokens: int) -> int:
    """continue_generation's `first_step`: the index, within the generation, of the first token the call samples
    (generate's prefill token is 0), the step both backends fold into the seed's key. A non-negative integer whose
    last step stays within int32, as positions do (jax_cache counts steps in int32). Returns it as a Python int."""
    first_step = as_integer("first_step", first_step)
    if first_step < 0:
        raise InputError(f"first_step={first_step} must be >= 0: it is the index, within the generation, of the first "
                         "token this call samples; pass the number of tokens generated so far")
    if first_step + max_new_tokens > INT32_MAX:
        raise InputError(f"first_step={first_step} with max_new_tokens={max_new_tokens} would count generated tokens "
                         f"past {INT32_MAX}, the int32 limit of step indices")
    return first_step


def split_teacher_forced(sequence: Sequence[int], prompt_len: int,
                         config: MistralConfig) -> tuple[list[int], list[int]]:
    """A teacher-forced row (backend.step_logits): its ids, checked as a prompt's are, split after `prompt_len`, which
    leaves a prompt of at least one token."""
    (row,) = validate_prompts([sequence], config, label="sequence")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, numbers.Integral) or not 1 <= prompt_len <= len(row):
        raise InputError(f"prompt_len={prompt_len!r} must be an int in [1, {len(row)}]: the sequence has {len(row)} "
                         "tokens, and its first prompt_len are the prompt")
    return row[:prompt_len], row[prompt_len:]


def check_positions(config: MistralConfig, first_position: int, max_new_tokens: int, length_after: int) -> None:
    """Refuse up front new tokens at positions first_position .. first_position + max_new_tokens - 1 beyond the
    model's max_position_embeddings, or a cache length beyond int32 (positions and lengths would wrap silently)."""
    last_position = first_position + max_new_tokens - 1
    limit = config.max_position_embeddings
    if first_position > limit:  # the prompt itself (or the cache's last tokens) is past the limit, new tokens or not
        raise InputError(f"the tokens given reach position {first_position - 1}, but this model's "
                         f"max_position_embeddings={limit} allows positions up to {limit - 1}; give a prompt of at "
                         f"most {limit} tokens, new tokens included")
    if max_new_tokens and last_position >= limit:
        if first_position < limit:
            advice = f"generate at most {limit - first_position} new tokens"
        elif max_new_tokens < limit:  # the tokens given fill every position: "at most 0 new tokens" is no advice
            advice = (f"the {first_position} tokens given leave no position for a new token; give at most "
                      f"{limit - max_new_tokens} tokens to generate {max_new_tokens}")
        else:
            advice = f"generate at most {limit - 1} new tokens (after a one-token prompt)"
        raise InputError(f"max_new_tokens={max_new_tokens} from position {first_position} would reach position "
                         f"{last_position}, but this model's max_position_embeddings={limit} allows positions up to "
                         f"{limit - 1}; {advice}")
    if max_new_tokens and last_position > INT32_MAX:
        raise InputError(f"max_new_tokens={max_new_tokens} from position {first_position} would reach position "
                         f"{last_position}, past {INT32_MAX}, the int32 limit of positions; generate at most "
                         f"{max(INT32_MAX + 1 - first_position, 0)} new tokens")
    if length_after > INT32_MAX:
        raise InputError(f"max_new_tokens={max_new_tokens} would fill the cache to {length_after} columns, past "
                         f"{INT32_MAX}, the int32 limit of positions and lengths; generate fewer tokens")


def validate_forced_tokens(forced_tokens: Sequence[Sequence[int]] | np.ndarray, batch: int, max_new_tokens: int,
                           config: MistralConfig) -> np.ndarray:
    """Teacher forcing: one row of exactly `max_new_tokens` in-vocabulary ids per prompt. Returns [B, N] int32."""
    # rows of no ids are checked too: unchecked, an int raised TypeError and a string was read as rows of letters
    rows = validate_prompts(forced_tokens, config, label="forced_tokens row", allow_empty=not max_new_tokens)
    if len(rows) != batch or any(len(row) != max_new_tokens for row in rows):
        raise InputError(f"forced_tokens has {len(rows)} rows of lengths {sorted({len(row) for row in rows})}; "
                         f"give one row of exactly max_new_tokens={max_new_tokens} ids per prompt ({batch})")
    return np.asarray(rows, dtype=np.int32).reshape(batch, max_new_tokens)  # [B, N]


def check_budget(capacity: int | None, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse up front a generation that would overflow a given cache's capacity (None: an unbounded ring)."""
    if capacity is not None and prompt_len + max_new_tokens > capacity:
        raise CacheError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{prompt_len + max_new_tokens} exceeds the given cache's capacity {capacity}; build a larger "
                         "cache or generate fewer tokens")


def check_continuation_room(capacity: int | None, length: int, max_new_tokens: int) -> None:
    """Refuse up front a continuation that would write past a bounded cache (None: an unbounded ring): it writes
    `max_new_tokens` columns (each row's last token, then every new token but the last) after the `length` written.
    Said as a continuation's budget: the raw write's advice, reset() the cache, would throw away what it continues."""
    if capacity is None or length + max_new_tokens <= capacity:
        return
    room = capacity - length
    held = f"its capacity is {capacity} columns, {length} of them written (left padding included)"
    advice = "size the generation's cache for the whole run (max_cache_len: prompt + every new token)"
    if room <= 0:
        raise CacheError(f"max_new_tokens={max_new_tokens} cannot continue in this cache: it is full, {held}; "
                         f"{advice}")
    raise CacheError(f"max_new_tokens={max_new_tokens} needs {max_new_tokens} free columns of this cache (each row's "
                     f"last token given, then every new token but the last), but {held}: {room} left; continue with "
                     f"at most {room} new token{'' if room == 1 else 's'}, or {advice}")


def check_given_cache_len(max_cache_len: object, built_len: int, capacity: int | None) -> None:
    """A cache object handed to generate keeps the capacity it was built with: a `max_cache_len` beside it that says
    otherwise was ignored without a word, so it is refused (the same value, or None, is fine; so is any value from
    the window up for a ring as long as its window, which every such request builds: `capacity` None)."""
    if max_cache_len is None:
        return
    asked = check_count("max_cache_len", max_cache_len, minimum=1)
    if asked != built_len and not (capacity is None and asked >= built_len):
        raise InputError(f"max_cache_len={max_cache_len} was given with a cache object built for max_cache_len="
                         f"{built_len}; a given cache keeps its own capacity: leave max_cache_len out, or build the "
                         f"cache with max_cache_len={max_cache_len}")


def prefill_chunks(num_columns: int, chunk_size: int) -> list[tuple[int, int]]:
    """The [start, stop) column ranges a prefill of `num_columns` runs, each at most `chunk_size` wide. A remainder
    comes first, so every later chunk is exactly `chunk_size` wide (one compiled shape in JAX)."""
    chunk_size = check_count("prefill_chunk", chunk_size, minimum=1)
    first = num_columns % chunk_size or min(chunk_size, num_columns)
    return [(0, first)] + [(start, start + chunk_size) for start in range(first, num_columns, chunk_size)]


def positions_from_mask(attention_mask: np.ndarray) -> np.ndarray:
    """Position ids cumsum(mask) - 1 as in transformers; padding gets -1. [B, T] int32."""
    return (np.cumsum(attention_mask, axis=-1) - 1).astype(np.int32)


def default_cache_kind(config: MistralConfig) -> str:
    return "sliding_window" if config.sliding_window is not None else "static"


def plan_cache(config: MistralConfig, cache_kind: str | None, prompt_len: int, max_new_tokens: int,
               max_cache_len: int | None) -> tuple[str, int]:
    """Choose cache kind and length for a generation, refusing up front what would not fit."""
    max_new_tokens = check_count("max_new_tokens", max_new_tokens)
    cache_kind = cache_kind or default_cache_kind(config)
    if not isinstance(cache_kind, str) or cache_kind not in CACHE_KINDS:
        raise InputError(f"cache={cache_kind!r} is not one of {', '.join(CACHE_KINDS)} (or a cache object of this "
                         "backend)")
    if cache_kind == "sliding_window" and config.sliding_window is None:
        raise CacheError("a sliding_window cache was asked for, but this model's config has sliding_window=null; "
                         "use the static cache, or give the model a window (the CLI's --sliding-window N)")
    total = prompt_len + max_new_tokens
    max_cache_len = check_count("max_cache_len", total if max_cache_len is None else max_cache_len, minimum=1)
    window_fits = (cache_kind == "sliding_window" and config.sliding_window is not None
                   and max_cache_len >= config.sliding_window)
    if not window_fits and total > max_cache_len:
        # A ring as long as the window holds a generation of any length; a shorter one only what fits in it.
        needed = total if cache_kind == "static" else min(total, config.sliding_window or total)
        why = f" (the window: a ring of {needed} slots holds any length)" if needed < total else ""
        raise CacheError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"{cache_kind} cache capacity max_cache_len={max_cache_len}; raise max_cache_len "
                         f"(--max-cache-len) to at least {needed}{why}, or generate fewer tokens")
    return cache_kind, max_cache_len


CacheT = TypeVar("CacheT")

# A cache a tower sizes itself (no max_cache_len, no cache object given) is rounded up to a size class, so that one
# compiled decode step serves every prompt + max_new_tokens in the class: its buffers' shape is what torch's graph
# specialises on and what JAX's executables are keyed by (docs/design.md §5, "Cache size classes").
CACHE_CLASSES_PER_OCTAVE = 4  # a power of two; 4: classes m * 2^e, m in 4..7, under 25% extra slots
MIN_CACHE_SLOTS = 16  # every shorter cache is one class (at most 15 extra slots)


def _size_class(count: int) -> int:
    """The smallest m * 2^e >= count with m in [4, 8) (every count below 8 is one): CACHE_CLASSES_PER_OCTAVE classes
    per octave, so for a count of 8 or more the class is at most count + count / 4 - 1."""
    step = 1 << max(count.bit_length() - CACHE_CLASSES_PER_OCTAVE.bit_length(), 0)  # 2^e: count / step in [4, 8)
    return -(-count // step) * step


def cache_size_class(needed: int, limit: int | None = None) -> int:
    """The slots a tower allocates for a cache it sizes itself that must hold `needed` columns: the smallest
    m * 2^e >= needed with m in [4, 8) (CACHE_CLASSES_PER_OCTAVE per octave, so the extra slots are under a quarter of
    `needed`), at least MIN_CACHE_SLOTS, and at most `limit` (a ring's window, a static cache's
    max_position_embeddings) unless `needed` itself is past it."""
    needed = check_count("needed", needed, minimum=1)
    rounded = max(_size_class(needed), MIN_CACHE_SLOTS)
    return max(needed, min(rounded, limit)) if limit is not None else rounded


def batch_size_class(rows: int, data: int = 1) -> int:
    """The rows a tower decodes a batch of `rows` with when it sizes the cache itself (docs/design.md §5, "Batch size
    classes"): the smallest m * 2^e >= rows with m in [4, 8), as the cache's columns (1..7 rows stay exact; 9 -> 10,
    17 -> 20; from 8 rows up at most rows + rows / 4 - 1), rounded up to a multiple of `data`, a data-split mesh's
    axis. For a power-of-two `data` that is the smallest class that is a multiple of it; for another `data` it may be
    no class (data=3: 17 -> 20 -> 21), but it is one count per class, and never more than data - 1 rows past the
    class, where the smallest class that is a multiple of 3 or 5 can be twice the rows."""
    rows = check_count("rows", rows, minimum=1)
    data = check_count("data", data, minimum=1)
    return -(-_size_class(rows) // data) * data


def build_batch_class(build: Callable[[int], CacheT], rows: int, data: int = 1) -> CacheT:
    """A cache a tower sizes itself for a batch of `rows`: `build(batch_rows)` at `batch_size_class(rows, data)`, or
    at the exact rows (a multiple of `data`) when the class's extra rows are what does not fit in memory (build's
    ResourceError), as `build_sized_cache` falls back to the exact columns. The tower then pads its batch up to the
    cache's rows (twincache.mesh.pad_batch)."""
    padded, exact = batch_size_class(rows, data), rows + -rows % data
    try:
        return build(padded)
    except ResourceError:
        if padded == exact:
            raise
        return build(exact)


def allocated_cache_len(config: MistralConfig, cache_kind: str, needed: int) -> int:
    """The max_cache_len a tower builds a cache of `cache_kind` with when it sizes it itself for `needed` columns:
    `cache_size_class`, never longer than the window for a ring (rounded up to the window, it is the full-window ring:
    capacity None) nor past max_position_embeddings for a static cache (no position reaches those slots)."""
    window = config.sliding_window if cache_kind == "sliding_window" else None
    return cache_size_class(needed, window or config.max_position_embeddings)


def build_sized_cache(build: Callable[[int], CacheT], config: MistralConfig, cache_kind: str, needed: int) -> CacheT:
    """A cache a tower sizes itself for `needed` columns: `build(max_cache_len)` at its size class
    (`allocated_cache_len`), or at `needed` when the class's extra slots are what does not fit in memory (build's
    ResourceError): one more compiled shape, where a refusal would refuse a generation that fits."""
    rounded = allocated_cache_len(config, cache_kind, needed)
    try:
        return build(rounded)
    except ResourceError:
        if rounded == needed:
            raise
        return build(needed)


NOTICES = logging.getLogger("twincache")  # progress a person waits on; the CLI prints it on stderr (not with --json)


def announce_compile(compiler: str, what: str = "the decode step") -> None:
    """Say that decoding may be about to compile `what` (with `compiler`), once every input has been checked and the
    cache allocated: a compile takes seconds (XLA) to tens of seconds (torch.compile on a small CPU), and a line before
    that silence explains it. Whether it compiles is not known before the step runs (a process compiles again for each
    new cache shape, batch and sampling kind), so the line says both. Logged at INFO, which Python shows nowhere
    unless a handler is set."""
    NOTICES.info("compiling %s with %s, unless this process already has it for this cache shape, batch and sampling "
                 "kind...", what, compiler)


def check_dtype(dtype: object) -> str:
    """Refuse a dtype name that no backend computes in. Only a name: a framework's dtype object (torch.bfloat16,
    jnp.bfloat16, np.dtype("float32"), which == "float32" and slipped through a membership test) was refused with
    "is not one of ..." naming the very dtype given, or crashed torch's getattr."""
    if not isinstance(dtype, str):
        raise InputError(f"dtype={dtype!r} must be a dtype name, one of {', '.join(DTYPES)} (e.g. dtype=\"bfloat16\"), "
                         f"not a {type(dtype).__name__}; a tower's Mistral.from_pretrained takes its framework's dtype")
    if dtype not in DTYPES:
        raise InputError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def check_mode(backend: str, modes: Collection[str], streaming_modes: Collection[str], mode: str,
               streams: bool) -> None:
    """Refuse a decode mode the backend does not have, or a callback for a mode that does not stream."""
    if not isinstance(mode, str) or mode not in modes:
        raise InputError(f"mode {mode!r} is not a {backend} mode; choose one of {', '.join(modes)}")
    if streams and mode not in streaming_modes:
        raise InputError(f"{backend} mode {mode!r} does not stream tokens as it decodes; use "
                         f"{' or '.join(repr(m) for m in streaming_modes)} for on_token")
