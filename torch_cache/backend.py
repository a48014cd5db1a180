"""torch_cache's backend: the small surface the app layer drives. jax_cache/backend.py mirrors it name for name
(docs/design.md §5); parity_tests/test_mirror.py checks that they stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from torch_cache import DEFAULT_MODE, MODES, NAME, STREAMING_MODES
from torch_cache.cache import StaticCache, make_cache
from torch_cache.generate import decode_step_fn, prefill
from torch_cache.generate import generate as _generate
from torch_cache.model import Mistral
from twincache.config import MistralConfig
from twincache.generation import PREFILL_CHUNK, GenerationResult, SamplingParams, TokenCallback, check_dtype, check_mode


def load(path: str | Path, dtype: str = "float32", device: str | None = None) -> Mistral:
    """A model from a checkpoint directory, in `dtype` (a name) on `device` (default: CUDA when torch sees one)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Mistral.from_pretrained(path, getattr(torch, check_dtype(dtype)), device)


def from_weights(config: MistralConfig, weights: dict[str, torch.Tensor]) -> Mistral:
    """A model holding these HF-named tensors themselves (no copy)."""
    return Mistral.from_weights(config, weights)


def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, mode: str = DEFAULT_MODE,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, on_token: TokenCallback | None = None,
             return_logits: bool = False, prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """torch_cache.generate.generate in a decode mode: "compiled" (default) or "eager"."""
    check_mode(NAME, MODES, STREAMING_MODES, mode, on_token is not None)
    return _generate(model, prompts, max_new_tokens, cache=cache, max_cache_len=max_cache_len, sampling=sampling,
                     compile=mode == "compiled", on_token=on_token, return_logits=return_logits,
                     prefill_chunk=prefill_chunk)


def step_logits(model: Mistral, sequence: Sequence[int], prompt_len: int, cache_kind: str,
                mode: str = DEFAULT_MODE) -> np.ndarray:
    """Teacher-forced logits [len(sequence) - prompt_len, V] float32: the prompt through `prefill`, then each later
    token through the decode step `generate` runs in `mode`. Row i predicts sequence[prompt_len + i]."""
    check_mode(NAME, MODES, STREAMING_MODES, mode, False)
    ids = torch.tensor([list(sequence)], dtype=torch.long, device=model.device)  # [1, L]
    step = decode_step_fn(model, compile=mode == "compiled")
    with torch.inference_mode():  # the cache too, as in generate: an inference tensor is a different graph input
        cache = make_cache(cache_kind, model.config, 1, len(sequence), model.dtype, model.device)
        logits = [prefill(model, ids[:, :prompt_len], torch.ones_like(ids[:, :prompt_len]), cache)]  # [1, V]
        for pos in range(prompt_len, len(sequence) - 1):
            # Fresh [1, 1] tensors, laid out as generate's are, so the step generate compiled serves here too.
            token = torch.tensor([[sequence[pos]]], dtype=torch.long, device=model.device)  # [1, 1]
            positions = torch.tensor([[pos]], dtype=torch.long, device=model.device)  # [1, 1]
            logits.append(step(token, positions, cache).float().clone())  # cudagraphs reuse their outputs
        return torch.cat(logits).float().cpu().numpy()


def compiled_variants() -> int:
    """Graphs dynamo has compiled in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def device_memory_mb() -> float | None:
    """Device memory torch holds now, in MiB; None on CPU."""
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


__all__ = ["load", "from_weights", "generate", "step_logits", "compiled_variants", "device_memory_mb"]
