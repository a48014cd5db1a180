"""`twincache soak`: a long greedy decode with the sliding-window cache, watching what must stay flat.

It decodes `--steps` tokens (default 10,000, about 150 ring wraps on the default model's window of 64) through the
backend's own `generate` in a streaming mode, and never stops at EOS. A model without a window (most GGUFs) runs with
`--sliding-window N`, a window of our choosing. After the first decode step (which compiles or
traces) it watches, from the per-token callback:
  compiles    what the framework itself counts (the backend's compiled_variants(): graphs dynamo compiled, JAX's
              jitted executables) from the prefill's token to the end: the step compiles once per attention bucket
              the decode reaches (one, unless a ring of more than 2 * ATTEND_BLOCK slots is still filling), so
              more is a recompile. Expected: none (transformers #44609 recompiled every step). Counted
              over the whole decode, not at the first step's token: a JAX step (a torch one on a GPU) dispatches
              step k + 1 before step k's token arrives, so a recompile at step 2 came before step 1's token.
  RSS         process resident memory after the first step and at the end, plus the peak of periodic samples.
  finite      every step's logits: generate stops with NonFiniteLogitsError at the first that is not.
  cache       at the end the ring holds exactly the last W positions, and `length` counts every column written
              (JAX's prompt-bucket padding included, docs/design.md §5).
It may decode past the model's max_position_embeddings (10,000 steps on SmolLM2's 8192), which `generate` refuses;
the record says when it did (`past_max_position_embeddings`).
It prints one JSON record and exits 0 when all of these hold, else 1. Ctrl-C prints the record of the steps decoded
so far (`"interrupted": true`, never ok) before the CLI's "twincache: interrupted" and exit 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from twincache.buckets import decode_buckets
from twincache.checkpoint import load_config, resolve_dtype
from twincache.config import INT32_MAX, MistralConfig, check_window_flag
from twincache.errors import CacheError, InputError, NonFiniteLogitsError
from twincache_app.backends import BACKENDS
from twincache_app.generate_cmd import DTYPE_CHOICES, DTYPE_HELP

DEFAULT_STEPS = 10_000
DEFAULT_PROMPT_LEN = 16
RSS_SAMPLES = 20


class SoakInterrupted(KeyboardInterrupt):
    """Ctrl-C during the soak's decode: still a KeyboardInterrupt to a caller, carrying the record of the steps
    decoded until then (`record`), which `twincache soak` prints before it ends."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__()
        self.record = record


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def soak_prompt(config: MistralConfig, prompt_len: int) -> list[int]:
    """A deterministic prompt of in-vocabulary ids, starting with BOS."""
    first = config.bos_token_id if config.bos_token_id is not None else 1 % config.vocab_size
    return [first] + [(3 + 7 * i) % config.vocab_size for i in range(prompt_len - 1)]


def soak(backend: str = "torch", steps: int = DEFAULT_STEPS, model_dir: Path | None = None,
         prompt_len: int = DEFAULT_PROMPT_LEN, dtype: str = "float32", mode: str | None = None,
         sliding_window: int | None = None) -> dict[str, Any]:
    """Decode `steps` greedy tokens after a `prompt_len` prefill; returns the JSON record (see the module doc).

    `model_dir` is a checkpoint directory or GGUF file (default: the default model); `sliding_window` replaces its
    window (or gives a window-less model one)."""
    for name, flag, value in (("steps", "--steps", steps), ("prompt_len", "--prompt-len", prompt_len)):
        if value < 1:
            raise InputError(f"{flag} {value} ({name}) must be >= 1")
    if prompt_len + steps + 1 > INT32_MAX:  # before the prompt is built: a huge --prompt-len would fill the memory
        raise InputError(f"prompt_len={prompt_len} + steps={steps} takes positions up to {prompt_len + steps}, past "
                         f"{INT32_MAX - 1}, the last int32 position (the soak's cache holds one more slot); lower "
                         "--prompt-len or --steps")
    if backend not in BACKENDS:
        raise InputError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    entry = BACKENDS[backend]
    mode = entry.check_mode(mode or entry.streaming_modes[0])
    if mode not in entry.streaming_modes:
        raise InputError(f"the soak watches every decode step, so it needs a streaming mode; {backend} mode {mode} "
                         f"decodes without handing steps back (use --mode {' or '.join(entry.streaming_modes)})")
    check_window_flag(sliding_window)
    if model_dir is None:
        from twincache.default_model import default_model_dir
        from twincache_app.generate_cmd import notices_on_stderr

        with notices_on_stderr(True):  # a first run converts the default model: seconds, said on stderr (not stdout's
            model_dir = default_model_dir()  # JSON record)
    config = load_config(model_dir)
    dtype = resolve_dtype(dtype, model_dir)
    if sliding_window is not None:
        config = dataclasses.replace(config, sliding_window=sliding_window)
    if config.sliding_window is None:
        raise CacheError(f"the soak exercises the sliding-window ring, but {model_dir} has sliding_window=null; "
                         "give it one with --sliding-window N")
    rss_before_load = _rss_mb()
    tower = entry.module()
    model = tower.load(Path(model_dir), dtype)
    total = prompt_len + steps  # positions 0 .. total-1 are written by the end
    # Never stop at EOS; the checkpoint's window, or the one --sliding-window gave. The soak may go past the model's
    # max_position_embeddings (10,000 steps > SmolLM2's 8192), which generate refuses: it stresses the ring and the
    # step, not the model's quality out there, and RoPE is computed from the positions, so nothing is out of range.
    model.config = dataclasses.replace(config, eos_token_id=None,
                                       max_position_embeddings=max(config.max_position_embeddings, total + 1))
    watch: dict[str, Any] = {"tokens": 0, "rss_peak": 0.0}
    every = max(1, (steps - 1) // RSS_SAMPLES)

    def on_token(_: list[int]) -> None:  # token 0 comes from the prefill, token k from decode step k
        if watch["tokens"] == 0:  # before any decode step is dispatched
            watch["graphs_before"] = tower.compiled_variants()
        elif watch["tokens"] == 1:
            watch["rss_start"] = watch["rss_peak"] = _rss_mb()
        elif watch["tokens"] % every == 0:
            watch["rss_peak"] = max(watch["rss_peak"], _rss_mb())
        watch["tokens"] += 1

    def record_so_far(finite: bool, rss_end: float) -> dict[str, Any]:
        return {"backend": backend, "mode": mode, "model": str(model_dir), "dtype": dtype, "steps": steps,
                "prompt_len": prompt_len, "window": config.sliding_window,
                # the last new token takes position `total`: generate refuses that at total >= max_position_embeddings
                "past_max_position_embeddings": total >= config.max_position_embeddings, "finite": finite,
                "rss_before_load_mb": round(rss_before_load, 1), "rss_end_mb": round(rss_end, 1)}

    def cut_short(finite: bool) -> dict[str, Any]:  # the steps decoded before generate stopped
        record = record_so_far(finite, _rss_mb()) | {"decoded_steps": max(watch["tokens"] - 1, 0), "cache_ok": False}
        if "graphs_before" in watch:
            record["decode_compiles"] = tower.compiled_variants() - watch["graphs_before"]
        if "rss_start" in watch:
            record |= {"rss_start_mb": round(watch["rss_start"], 1), "rss_peak_mb": round(watch["rss_peak"], 1)}
        return record | {"ok": False}

    try:  # steps + 1 tokens: the prefill's, then `steps` decode steps
        result = tower.generate(model, [soak_prompt(config, prompt_len)], steps + 1, mode=mode,
                                # room for prompt + new tokens, the capacity rule generate applies; a ring
                                # shorter than the window (a short soak) is bounded by it
                                cache="sliding_window", max_cache_len=total + 1, on_token=on_token)
    except NonFiniteLogitsError:
        return cut_short(finite=False)
    except KeyboardInterrupt:
        raise SoakInterrupted(cut_short(finite=True) | {"interrupted": True}) from None
    graphs_end = tower.compiled_variants()
    rss_end = _rss_mb()
    record = record_so_far(True, rss_end)
    cache = result.cache
    held = np.sort(np.asarray(cache.slot_positions)[0])
    # the last min(cache_len, total) positions, and the slots a short soak never reached still empty (-1)
    never_written = np.full(max(cache.cache_len - total, 0), -1)
    expected = np.concatenate([never_written, np.arange(max(total - cache.cache_len, 0), total)])
    cache_ok = np.array_equal(held, expected) and int(cache.length) >= total
    decode_compiles = graphs_end - watch["graphs_before"]
    # each attention bucket the decode reaches is one compiled variant (twincache/buckets.py): a ring of W > 2 *
    # ATTEND_BLOCK slots compiles a few while it fills; more than that is a recompile
    # (from the length the prefill left: JAX pads a prompt to its bucket)
    buckets = len(decode_buckets(int(cache.length) - steps, steps, cache.cache_len))
    record |= {
        "cache_len": cache.cache_len, "ring_wraps": total // cache.cache_len, "length": int(cache.length),
        "first_step_s": round(result.first_step_s, 3),
        "decode_tok_s": None if result.decode_tok_s is None else round(result.decode_tok_s, 1),  # null: none timed
        # a process that already holds the step (a test's) compiles nothing at the first step, and one recompile
        # then reads as the first step's compile; `twincache soak` runs in a fresh process
        "decode_compiles": decode_compiles, "decode_buckets": buckets,
        "recompiles": max(decode_compiles - buckets, 0),
        "rss_start_mb": round(watch["rss_start"], 1), "rss_peak_mb": round(max(watch["rss_peak"], rss_end), 1),
        "rss_growth_mb": round(rss_end - watch["rss_start"], 1), "cache_ok": bool(cache_ok),
    }
    device_mb = tower.device_memory_mb()
    if device_mb is not None:
        record["device_mem_end_mb"] = round(device_mb, 1)
    record["ok"] = decode_compiles <= buckets and record["cache_ok"]
    return record


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "soak", help="decode many steps with the sliding cache; report recompiles, RSS and finiteness",
        description="A long greedy decode (EOS ignored) with the sliding-window cache. Prints one JSON record; exits "
                    "0 when nothing recompiled after the first step, every logit was finite and the ring held the "
                    "last W positions.")
    parser.add_argument("--backend", choices=list(BACKENDS), default="torch", help="(default: torch)")
    parser.add_argument("--mode", help="a streaming decode mode of the backend (default: its first: "
                                       + "; ".join(f"{b.name}: {b.streaming_modes[0]}" for b in BACKENDS.values())
                                       + ")")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"decode steps (default {DEFAULT_STEPS})")
    parser.add_argument("--model", type=Path, help="HF Mistral or Llama checkpoint directory or .gguf file (default: "
                                                   "the default model, SmolLM2-135M-Instruct with a window of 64)")
    parser.add_argument("--sliding-window", type=int, help="run with this sliding window instead of the model's "
                                                           "(needed for a model without one, like most GGUFs)")
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN,
                        help=f"tokens of the deterministic prompt prefilled first (default {DEFAULT_PROMPT_LEN})")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help=DTYPE_HELP)
    # Ctrl-C raises KeyboardInterrupt here (not the CLI's immediate exit), so the record of the steps so far prints
    parser.set_defaults(run=run, keep_keyboard_interrupt=True)


def run(args: argparse.Namespace) -> int:
    try:
        record = soak(args.backend, args.steps, args.model, args.prompt_len, args.dtype, args.mode,
                      args.sliding_window)
    except SoakInterrupted as interrupted:  # what a long soak measured is kept; the CLI then says interrupted, 130
        print(json.dumps(interrupted.record), flush=True)
        raise
    print(json.dumps(record))
    return 0 if record["ok"] else 1
