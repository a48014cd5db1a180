"""Checks both backends' caches run before anything is written or dispatched, with one wording for both.

A cache is read through the attributes both backends define: num_layers, num_kv_heads, head_dim, batch_size,
dtype, capacity. Dtypes are compared as their framework's own objects and printed as such.
"""

from __future__ import annotations

from typing import Any

from twincache.config import MistralConfig
from twincache.errors import CacheError


def check_compatible(cache: Any, config: MistralConfig, batch_size: int, model_dtype: object) -> None:
    """Refuse a cache built for another model (layers, kv heads, head_dim), batch or dtype."""
    if (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) != (
            cache.num_layers, cache.num_kv_heads, cache.head_dim):
        raise CacheError(
            f"cache was built for {cache.num_layers} layers x {cache.num_kv_heads} kv heads x head_dim "
            f"{cache.head_dim}, but the model has {config.num_hidden_layers} x {config.num_key_value_heads} x "
            f"{config.head_dim}; build the cache from this model's config")
    if model_dtype != cache.dtype:
        raise CacheError(f"cache dtype {cache.dtype} differs from model dtype {model_dtype}; "
                         f"build the cache with dtype={model_dtype}")
    if batch_size != cache.batch_size:
        raise CacheError(f"batch {batch_size} was given, but the cache was built for batch {cache.batch_size}; "
                         "build a cache whose batch_size equals the number of rows")


def check_write_range(cache: Any, start: int, num_new: int) -> None:
    """Refuse a write of num_new tokens from column `start` outside [0, capacity): JAX would clamp it silently."""
    if start < 0 or (cache.capacity is not None and start + num_new > cache.capacity):
        raise CacheError(f"writing {num_new} tokens at columns {start}..{start + num_new - 1} is outside this "
                         f"{type(cache).__name__}'s capacity [0, {cache.capacity}); reset() it or build a larger "
                         "cache (max_cache_len)")


def check_states(cache: Any, layer_idx: int, name: str, shape: tuple[int, ...], dtype: object) -> None:
    """Refuse key/value states of the wrong layer index, shape or dtype for a direct `update` call."""
    if not 0 <= layer_idx < cache.num_layers:
        raise CacheError(f"layer_idx={layer_idx} is outside [0, {cache.num_layers})")
    batch, heads, _, head_dim = shape if len(shape) == 4 else (None,) * 4
    if (batch, heads, head_dim) != (cache.batch_size, cache.num_kv_heads, cache.head_dim):
        raise CacheError(f"{name} has shape {list(shape)}; this cache needs [{cache.batch_size}, "
                         f"{cache.num_kv_heads}, seq_len, {cache.head_dim}]")
    if dtype != cache.dtype:
        raise CacheError(f"{name} dtype {dtype} differs from cache dtype {cache.dtype}")
