"""torch_cache's backend: the small surface the app layer drives. jax_cache/backend.py mirrors it name for name
(docs/design.md §5); parity_tests/test_mirror.py checks that they stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from torch_cache import DEFAULT_MODE, MODES, NAME, STREAMING_MODES, sharding
from torch_cache.cache import StaticCache, usable_device
from torch_cache.generate import generate as _generate
from torch_cache.inductor_cpu import check_cache_dir, start_compiler_probe
from torch_cache.model import Mistral
from twincache import cache_checks
from twincache.checkpoint import resolve_dtype
from twincache.config import MistralConfig
from twincache.generation import (
    PREFILL_CHUNK,
    GenerationResult,
    SamplingParams,
    TokenCallback,
    check_dtype,
    check_mode,
    check_model_type,
    split_teacher_forced,
)
from twincache.mesh import MeshShape


def load(path: str | Path, dtype: str = "float32", device: str | None = None,
         mesh: MeshShape | None = None) -> Mistral:
    """A model from a checkpoint directory or GGUF file, in `dtype` (a name) on `device` (default: CUDA when torch
    sees one), or this rank's part of it on a `mesh` of the torch.distributed world's processes
    (docs/design.md §10). dtype "auto" is the checkpoint's stored dtype, as transformers' from_pretrained picks
    it."""
    check_cache_dir()  # before anything imports torch._dynamo, which creates it
    dtype = resolve_dtype(dtype, path)
    if mesh is not None:
        return Mistral.from_pretrained(path, getattr(torch, check_dtype(dtype)),
                                       mesh=sharding.make_mesh(mesh.model, mesh.data))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    usable_device(device)  # an unknown or absent device is named here, before the weights are read
    if str(device).split(":")[0] == "cpu":  # inductor's CPU checks run while the weights load
        start_compiler_probe()
    return Mistral.from_pretrained(path, getattr(torch, check_dtype(dtype)), device)


def from_weights(config: MistralConfig, weights: dict[str, torch.Tensor]) -> Mistral:
    """A model holding these HF-named tensors themselves (no copy)."""
    return Mistral.from_weights(config, weights)


def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, mode: str = DEFAULT_MODE,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, on_token: TokenCallback | None = None,
             return_logits: bool = False,
             forced_tokens: Sequence[Sequence[int]] | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """torch_cache.generate.generate in a decode mode: "compiled" (default) or "eager"."""
    check_mode(NAME, MODES, STREAMING_MODES, mode, on_token is not None)
    return _generate(model, prompts, max_new_tokens, cache=cache, max_cache_len=max_cache_len, sampling=sampling,
                     compile=mode == "compiled", on_token=on_token, return_logits=return_logits,
                     forced_tokens=forced_tokens, prefill_chunk=prefill_chunk)


def step_logits(model: Mistral, sequence: Sequence[int], prompt_len: int, cache_kind: str,
                mode: str = DEFAULT_MODE) -> np.ndarray:
    """Teacher-forced logits [len(sequence) - prompt_len, V] float32 of one row: `generate` in `mode` with
    forced_tokens, so the prompt goes through its prefill and each later token through its decode path. Row i
    predicts sequence[prompt_len + i]. On a mesh split over `data`, generate decodes a copy of the row on each data
    shard (twincache.mesh.pad_batch) and returns row 0's logits; every rank of a torch mesh must make this call."""
    prompt, forced = split_teacher_forced(sequence, prompt_len, model.config)
    result = generate(model, [prompt], len(forced), mode=mode, cache=cache_kind, return_logits=True,
                      forced_tokens=[forced])
    return np.asarray(result.step_logits[0].cpu(), np.float32)


def compiled_variants() -> int:
    """Graphs dynamo has compiled in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def memory_per_device(model: Mistral, cache: StaticCache) -> dict[str, dict[str, int]]:
    """Bytes of the model's weights and of the cache's K/V on each device this process holds, read from the tensors'
    storage (on a mesh, this rank's shards; docs/design.md §10)."""
    # the other tower's cache (or None) raised AttributeError from inside device_bytes
    check_model_type(model, Mistral, "torch_cache")
    cache_checks.check_cache_type(cache, StaticCache, "torch_cache", cache_checks.cache_hint("torch_cache"))
    return {"weights": sharding.device_bytes(list(model.parameters())),
            "kv": sharding.device_bytes([*cache.keys, *cache.values])}


def device_memory_mb() -> float | None:
    """Device memory torch holds now, in MiB; None on CPU."""
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


__all__ = ["load", "from_weights", "generate", "step_logits", "compiled_variants", "memory_per_device",
           "device_memory_mb"]
