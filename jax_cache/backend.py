"""jax_cache's backend: the small surface the app layer drives, the mirror of torch_cache/backend.py name for name
(docs/design.md §5); parity_tests/test_mirror.py checks that they stay the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_cache import DEFAULT_MODE, MODES, NAME, STREAMING_MODES, sharding
from jax_cache import generate as _jax_generate
from jax_cache.cache import StaticCache
from jax_cache.generate import generate as _generate
from jax_cache.model import Mistral
from twincache import cache_checks
from twincache.checkpoint import resolve_dtype
from twincache.config import MistralConfig
from twincache.errors import InputError
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
    """A model from a checkpoint directory or GGUF file, in `dtype` (a name) on `device` (default: JAX's default
    device; "cuda" and "gpu" both mean the first GPU, "cuda:N" / "cpu:N" the Nth), or split over a `mesh` of the
    devices JAX sees (docs/design.md §10). Needs no torch. dtype "auto" is the checkpoint's stored dtype, as
    transformers' from_pretrained picks it."""
    dtype = resolve_dtype(dtype, path)
    if mesh is not None:
        return Mistral.from_pretrained(path, jnp.dtype(check_dtype(dtype)),
                                       mesh=sharding.make_mesh(mesh.model, mesh.data))
    placement = contextlib.nullcontext()
    if device is not None:
        # "platform:N" as torch spells it: "cuda:1" was placed on the first GPU and "cpu:0" refused
        platform, _, index = str(device).partition(":")
        try:
            devices = jax.devices("gpu" if platform == "cuda" else platform)
        except RuntimeError as err:  # an unknown platform, or one JAX has no device of
            raise InputError(f"device={device!r} is not usable by this JAX ({' '.join(str(err).split())[:160]}); "
                             f"pass one of its platforms, e.g. {jax.default_backend()!r}") from None
        if index and not (index.isdigit() and int(index) < len(devices)):
            raise InputError(f"device={device!r} names no device of this JAX: it sees {len(devices)} {platform} "
                             f"device(s), {platform}:0 to {platform}:{len(devices) - 1}")
        placement = jax.default_device(devices[int(index or 0)])
    with placement:
        return Mistral.from_pretrained(path, jnp.dtype(check_dtype(dtype)))


def from_weights(config: MistralConfig, weights: dict[str, jax.Array]) -> Mistral:
    """A model holding these HF-named arrays themselves (no copy, but for the half-precision ones
    jax_cache.projection.stored_dtype widens on CPU)."""
    return Mistral.from_weights(config, weights)


def generate(model: Mistral, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, mode: str = DEFAULT_MODE,
             cache: str | StaticCache | None = None, max_cache_len: int | None = None,
             sampling: SamplingParams | None = None, on_token: TokenCallback | None = None,
             return_logits: bool = False,
             forced_tokens: Sequence[Sequence[int]] | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """jax_cache.generate.generate in a decode mode: "fused" (default) or "step"."""
    check_mode(NAME, MODES, STREAMING_MODES, mode, on_token is not None)
    return _generate(model, prompts, max_new_tokens, cache=cache, max_cache_len=max_cache_len, sampling=sampling,
                     fused=mode == "fused", on_token=on_token, return_logits=return_logits,
                     forced_tokens=forced_tokens, prefill_chunk=prefill_chunk)


def step_logits(model: Mistral, sequence: Sequence[int], prompt_len: int, cache_kind: str,
                mode: str = DEFAULT_MODE) -> np.ndarray:
    """Teacher-forced logits [len(sequence) - prompt_len, V] float32 of one row: `generate` in `mode` with
    forced_tokens, so the prompt goes through its (chunked) prefill and each later token through its decode path (the
    fused blocks or the streaming step). Row i predicts sequence[prompt_len + i]. On a mesh split over `data`,
    generate decodes a copy of the row on each data shard (twincache.mesh.pad_batch) and returns row 0's logits."""
    prompt, forced = split_teacher_forced(sequence, prompt_len, model.config)
    result = generate(model, [prompt], len(forced), mode=mode, cache=cache_kind, return_logits=True,
                      forced_tokens=[forced])
    return np.asarray(result.step_logits[0], np.float32)


def compiled_variants() -> int:
    """Executables jax_cache has compiled: the jitted prefill's and steps' compiles plus the fused loop's
    ahead-of-time compiles so far (counted, not read off a cache: the jit caches are emptied at MAX_DECODE_VARIANTS
    and the fused table stops there, where a variant that comes back compiles again). Each is one trace + compile."""
    jitted = (_jax_generate._prefill, _jax_generate._decode_step, _jax_generate._sampled_step,
              _jax_generate._roll_back, _jax_generate._undone)  # the last two only where a decode ended by an exception
    return sum(fn.compiles for fn in jitted) + _jax_generate._fused_compiles


def memory_per_device(model: Mistral, cache: StaticCache) -> dict[str, dict[str, int]]:
    """Bytes of the model's weights and of the cache's K/V on each device, read from the arrays' addressable shards
    (on a mesh, each device's share; docs/design.md §10)."""
    # the other tower's cache (or None) raised AttributeError from inside device_bytes
    check_model_type(model, Mistral, "jax_cache")
    cache_checks.check_cache_type(cache, StaticCache, "jax_cache", cache_checks.cache_hint("jax_cache"))
    cache.check_live()  # a donated cache raised JAX's bare "Array has been deleted"
    weights = [variable.get_value() for _, variable in nnx.to_flat_state(nnx.state(model))]
    return {"weights": sharding.device_bytes(weights), "kv": sharding.device_bytes([*cache.keys, *cache.values])}


def device_memory_mb() -> float | None:
    """Device memory JAX holds now on its default device, in MiB; None where the device does not report it (CPU)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return stats["bytes_in_use"] / 2**20 if stats else None


__all__ = ["load", "from_weights", "generate", "step_logits", "compiled_variants", "memory_per_device",
           "device_memory_mb"]
