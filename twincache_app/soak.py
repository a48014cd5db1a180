"""`twincache soak`: a long greedy decode with the sliding-window cache, watching what must stay flat.

It decodes `--steps` tokens (default 10,000, about 300 ring wraps on the default model's window of 32) and never
stops at EOS. After the first decode step (which compiles or traces) it watches:
  recompiles  torch: graphs dynamo compiled after the first step (torch._dynamo counters); jax: new traces of the
              jitted decode step (its `_cache_size()`). Expected 0 (transformers #44609 recompiled every step).
  RSS         process resident memory after the first step and at the end, plus the peak of periodic samples.
  finite      every step's logits, accumulated on the device (no extra host sync per step).
  cache       at the end the ring holds exactly the last W positions, and `length` counts every column.
It prints one JSON record and exits 0 when all of these hold, else 1.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from twincache.checkpoint import load_config
from twincache.config import MistralConfig
from twincache.errors import CacheError, InputError, TwincacheError

DEFAULT_STEPS = 10_000
DEFAULT_PROMPT_LEN = 16
RSS_SAMPLES = 20


class BackendUnavailableError(TwincacheError):
    """The requested backend's package cannot be imported here."""


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def soak_prompt(config: MistralConfig, prompt_len: int) -> list[int]:
    """A deterministic prompt of in-vocabulary ids, starting with BOS."""
    first = config.bos_token_id if config.bos_token_id is not None else 1 % config.vocab_size
    return [first] + [(3 + 7 * i) % config.vocab_size for i in range(prompt_len - 1)]


class TorchDriver:
    """torch_cache: eager prefill, then the (compiled) one-token decode step of torch_cache.generate, greedy."""

    backend = "torch"

    def __init__(self, model_dir: Path, dtype: str, compile: bool) -> None:
        import torch

        from torch_cache.model import Mistral

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = Mistral.from_pretrained(model_dir, getattr(torch, dtype), self.device)
        self.config = self.model.config
        self.compile = compile

    def start(self, prompt: list[int], max_cache_len: int) -> None:
        torch = self.torch
        from torch_cache.cache import SlidingWindowCache
        from torch_cache.generate import decode_step_fn, prefill

        self.cache = SlidingWindowCache(self.config, 1, max_cache_len, self.model.dtype, self.model.device)
        self._inference = torch.inference_mode()  # one mode for every call: switching it would recompile
        self._inference.__enter__()
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, T]
        logits = prefill(self.model, ids, torch.ones_like(ids), self.cache)  # [1, V]
        self.finite = torch.isfinite(logits).all()
        self.next_ids = logits.argmax(dim=-1)  # [1]
        self.positions = torch.full((1, 1), len(prompt), dtype=torch.long, device=self.device)  # [1, 1]
        self.step_fn = decode_step_fn(self.model, self.compile)

    def step(self) -> None:
        logits = self.step_fn(self.next_ids[:, None], self.positions, self.cache)  # [1, V]
        self.finite = self.finite & self.torch.isfinite(logits).all()
        self.next_ids = logits.argmax(dim=-1)
        self.positions = self.positions + 1

    def sync(self) -> None:
        self.next_ids.cpu()

    def compiled_graphs(self) -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def finish(self) -> dict[str, Any]:
        state = {"finite": bool(self.finite), "slot_positions": self.cache.slot_positions.cpu().numpy(),
                 "length": int(self.cache.length), "cache_len": self.cache.cache_len}
        if self.device == "cuda":
            state["device_mem_mb"] = self.torch.cuda.memory_allocated() / 2**20
        self._inference.__exit__(None, None, None)
        return state


class JaxDriver:
    """jax_cache: jitted prefill, then its jitted one-token step with the cache donated every call, greedy."""

    backend = "jax"

    def __init__(self, model_dir: Path, dtype: str, compile: bool) -> None:
        try:
            import jax.numpy as jnp

            from jax_cache import generate as jax_generate
            from jax_cache.cache import SlidingWindowCache
            from jax_cache.model import Mistral
        except ImportError as err:
            raise BackendUnavailableError(f"the jax backend is unavailable: cannot import jax_cache ({err}); install "
                                          "jax and flax, or run with --backend torch") from None
        self.jnp, self.generate, self.cache_class = jnp, jax_generate, SlidingWindowCache
        self.model = Mistral.from_pretrained(model_dir, getattr(jnp, dtype))
        self.config = self.model.config

    def start(self, prompt: list[int], max_cache_len: int) -> None:
        jnp = self.jnp
        self.cache = self.cache_class(self.config, 1, max_cache_len, self.model.dtype)
        ids = jnp.asarray([prompt], dtype=jnp.int32)  # [1, T]
        logits, self.cache = self.generate.prefill(self.model, ids, jnp.ones_like(ids), self.cache)  # [1, V]
        self.finite = jnp.isfinite(logits).all()
        self.next_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [1]
        self.positions = jnp.full((1, 1), len(prompt), dtype=jnp.int32)  # [1, 1]
        self.step_fn = self.generate.decode_step_fn(self.model)

    def step(self) -> None:
        jnp = self.jnp
        logits, self.cache = self.step_fn(self.next_ids[:, None], self.positions, self.cache)  # [1, V]
        self.finite = self.finite & jnp.isfinite(logits).all()
        self.next_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        self.positions = self.positions + 1

    def sync(self) -> None:
        self.next_ids.block_until_ready()

    def compiled_graphs(self) -> int:
        jitted = getattr(self.generate, "_decode_step", None)
        if jitted is None or not hasattr(jitted, "_cache_size"):
            raise BackendUnavailableError("jax_cache.generate._decode_step (the jitted decode step) is missing, so "
                                          "the soak cannot count its traces")
        return int(jitted._cache_size())

    def finish(self) -> dict[str, Any]:
        return {"finite": bool(self.finite), "slot_positions": np.asarray(self.cache.slot_positions),
                "length": int(self.cache.length), "cache_len": self.cache.cache_len}


DRIVERS = {"torch": TorchDriver, "jax": JaxDriver}


def soak(backend: str = "torch", steps: int = DEFAULT_STEPS, model_dir: Path | None = None,
         prompt_len: int = DEFAULT_PROMPT_LEN, dtype: str = "float32", compile: bool = True) -> dict[str, Any]:
    """Decode `steps` greedy tokens after a `prompt_len` prefill; returns the JSON record (see the module doc)."""
    if steps < 1 or prompt_len < 1:
        raise InputError(f"steps={steps} and prompt_len={prompt_len} must both be >= 1")
    if backend not in DRIVERS:
        raise InputError(f"backend={backend!r} is not one of {', '.join(DRIVERS)}")
    if model_dir is None:
        from twincache.default_model import default_model_dir

        model_dir = default_model_dir()
    config = load_config(model_dir)
    if config.sliding_window is None:
        raise CacheError(f"the soak exercises the sliding-window ring, but {model_dir} has sliding_window=null")
    rss_before_load = _rss_mb()
    driver = DRIVERS[backend](Path(model_dir), dtype, compile)
    total = prompt_len + steps  # positions 0 .. total-1 are written by the end
    graphs_before = driver.compiled_graphs()
    driver.start(soak_prompt(config, prompt_len), max_cache_len=total)
    start = time.perf_counter()
    driver.step()  # compiles (torch) or traces (jax)
    driver.sync()
    first_step_s = time.perf_counter() - start
    graphs_first = driver.compiled_graphs()
    rss_start = rss_peak = _rss_mb()
    every = max(1, (steps - 1) // RSS_SAMPLES)
    start = time.perf_counter()
    for done in range(1, steps):
        driver.step()
        if done % every == 0:
            rss_peak = max(rss_peak, _rss_mb())
    driver.sync()
    decode_s = time.perf_counter() - start
    graphs_end = driver.compiled_graphs()
    rss_end = _rss_mb()
    state = driver.finish()
    held = np.sort(state["slot_positions"][0])
    expected = np.arange(total - state["cache_len"], total)
    cache_ok = state["length"] == total and np.array_equal(held, expected)
    record = {
        "backend": backend, "model": str(model_dir), "dtype": dtype, "compiled": compile or backend == "jax",
        "steps": steps, "prompt_len": prompt_len, "window": config.sliding_window, "cache_len": state["cache_len"],
        "ring_wraps": total // state["cache_len"],
        "first_step_s": round(first_step_s, 3), "decode_tok_s": round((steps - 1) / decode_s, 1) if decode_s else 0.0,
        "graphs_at_first_step": graphs_first - graphs_before, "recompiles_after_first": graphs_end - graphs_first,
        "rss_before_load_mb": round(rss_before_load, 1), "rss_start_mb": round(rss_start, 1),
        "rss_end_mb": round(rss_end, 1), "rss_peak_mb": round(rss_peak, 1),
        "rss_growth_mb": round(rss_end - rss_start, 1), "finite": state["finite"], "cache_ok": bool(cache_ok),
    }
    if "device_mem_mb" in state:
        record["device_mem_end_mb"] = round(state["device_mem_mb"], 1)
    record["ok"] = record["recompiles_after_first"] == 0 and record["finite"] and record["cache_ok"]
    return record


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "soak", help="decode many steps with the sliding cache; report recompiles, RSS and finiteness",
        description="A long greedy decode (EOS ignored) with the sliding-window cache. Prints one JSON record; exits "
                    "0 when nothing recompiled after the first step, every logit was finite and the ring held the "
                    "last W positions.")
    parser.add_argument("--backend", choices=sorted(DRIVERS), default="torch")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"decode steps (default {DEFAULT_STEPS})")
    parser.add_argument("--model", type=Path, help="HF Mistral checkpoint directory with a sliding window "
                                                   "(default: the embedded tiny model)")
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--no-compile", action="store_true", help="torch: decode eagerly (JAX: ignored)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from twincache_app.cli import print_json

    record = soak(args.backend, args.steps, args.model, args.prompt_len, args.dtype, not args.no_compile)
    print_json(record)
    return 0 if record["ok"] else 1
