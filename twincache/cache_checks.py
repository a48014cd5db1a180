"""Checks both backends' caches run before anything is allocated, written or dispatched, with one wording for both.

A cache is read through the attributes both backends define: kind, num_layers, num_kv_heads, head_dim, batch_size,
dtype, device, capacity, cache_len and, for a ring, sliding_window. Dtypes and devices are compared as their
framework's own objects and printed as such.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.errors import CacheError, ResourceError
from twincache.generation import INT32_MAX, check_count


def check_model_geometry(cache: Any, config: MistralConfig) -> None:
    """Refuse a cache shaped for another model: its kind and window, layers, kv heads or head_dim."""
    if cache.kind == "sliding_window":
        if config.sliding_window is None:
            raise CacheError(f"this sliding_window cache was built for a window of {cache.sliding_window}, but the "
                             "model's config has sliding_window=null; use a static cache")
        if cache.sliding_window != config.sliding_window:
            raise CacheError(f"this sliding_window cache was built for sliding_window={cache.sliding_window}, but "
                             f"the model's window is {config.sliding_window}; build the cache from this model's config")
    if (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) != (
            cache.num_layers, cache.num_kv_heads, cache.head_dim):
        raise CacheError(
            f"cache was built for {cache.num_layers} layers x {cache.num_kv_heads} kv heads x head_dim "
            f"{cache.head_dim}, but the model has {config.num_hidden_layers} x {config.num_key_value_heads} x "
            f"{config.head_dim}; build the cache from this model's config")


def check_compatible(cache: Any, config: MistralConfig, batch_size: int, model_dtype: object,
                     model_device: object) -> None:
    """Refuse a cache built for another device, model (kind, window, layers, kv heads, head_dim), dtype or batch."""
    if model_device != cache.device:
        raise CacheError(f"model is on {model_device} but the cache is on {cache.device}; move them to one device")
    check_model_geometry(cache, config)
    if model_dtype != cache.dtype:
        raise CacheError(f"cache dtype {cache.dtype} differs from model dtype {model_dtype}; "
                         f"build the cache with dtype={model_dtype}")
    if batch_size != cache.batch_size:
        real = getattr(cache, "real_rows", None)  # a batch generate padded (docs/design.md §5 "Batch size classes")
        built = (f"a batch of {real} rows (padded to {cache.batch_size}: give {real})" if real is not None else
                 f"batch {cache.batch_size}")
        raise CacheError(f"batch {batch_size} was given, but the cache was built for {built}; "
                         "give one prompt (or, to continue, one last token) per cache row, or build a cache whose "
                         "batch_size equals the number of rows")


def cache_hint(backend: str) -> str:
    """What to pass instead of a cache `backend` cannot use: its own kind, or a copy of the other backend's."""
    other, copy = {"torch_cache": ("jax_cache", "cache_to_torch"), "jax_cache": ("torch_cache", "cache_from_torch")}[
        backend]
    return (f"pass a {backend}.cache StaticCache or SlidingWindowCache (copy a {other} one with "
            f"twincache_app.handoff.{copy})")


def check_cache_type(cache: object, own_type: type, backend: str, hint: str) -> None:
    """Refuse a cache object of the other backend (or anything else) where this backend's cache is needed."""
    if not isinstance(cache, own_type):
        raise CacheError(f"cache is a {type(cache).__module__}.{type(cache).__name__}, not a {backend} cache; {hint}")


def check_layout(cache: Any, key_shapes: Sequence[Sequence[int]], value_shapes: Sequence[Sequence[int]],
                 slot_positions_shape: Sequence[int], length_shape: Sequence[int], where: str) -> None:
    """Refuse arrays that do not match what the cache says it is (a handoff must not trust either side alone)."""
    expected_len = min(cache.sliding_window, cache.max_cache_len) if cache.kind == "sliding_window" else (
        cache.max_cache_len)
    if cache.cache_len != expected_len:
        raise CacheError(f"{where}: this {cache.kind} cache says cache_len={cache.cache_len}, but max_cache_len="
                         f"{cache.max_cache_len} implies {expected_len}")
    kv = (cache.batch_size, cache.num_kv_heads, cache.cache_len, cache.head_dim)
    for name, shapes in (("keys", key_shapes), ("values", value_shapes)):
        if len(shapes) != cache.num_layers:
            raise CacheError(f"{where}: the cache holds {len(shapes)} {name} arrays for {cache.num_layers} layers")
        for layer, shape in enumerate(shapes):
            if tuple(shape) != kv:
                raise CacheError(f"{where}: {name}[{layer}] has shape {list(shape)}, but the cache describes "
                                 f"{list(kv)} [batch, kv_heads, cache_len, head_dim]")
    for name, shape, want in (("slot_positions", slot_positions_shape, (cache.batch_size, cache.cache_len)),
                              ("length", length_shape, ())):
        if tuple(shape) != want:
            raise CacheError(f"{where}: {name} has shape {list(shape)}, but the cache describes {list(want)}")


def check_cache_size(batch_size: object, max_cache_len: object) -> tuple[int, int]:
    """A cache's batch and capacity: integers in [1, int32 max]. Returns them as Python ints."""
    return check_count("batch_size", batch_size, minimum=1), check_count("max_cache_len", max_cache_len, minimum=1)


def cache_bytes(num_layers: int, batch_size: int, num_kv_heads: int, cache_len: int, head_dim: int,
                itemsize: int) -> int:
    """Bytes a cache allocates: K and V per layer, plus int32 slot positions and length."""
    return 2 * num_layers * batch_size * num_kv_heads * cache_len * head_dim * itemsize + 4 * batch_size * cache_len + 4


def check_cache_fits(kind: str, num_layers: int, shape: tuple[int, int, int, int], dtype: object, itemsize: int,
                     available: int | None, memory: str, shards: int = 1) -> None:
    """Refuse, before allocating, a cache of `num_layers` K and V buffers of `shape` [batch, kv_heads, cache_len,
    head_dim] larger than the `memory` available to hold it (None: unknown, not checked). On a mesh each device holds
    1/`shards` of it (docs/design.md §10)."""
    batch, kv_heads, cache_len, head_dim = shape
    needed = cache_bytes(num_layers, batch, kv_heads, cache_len, head_dim, itemsize)
    check_fits(f"a {kind} cache of {num_layers} layers x batch {batch} x {kv_heads} kv heads x {cache_len} slots x "
               f"head_dim {head_dim} in {dtype}" + (f", split {shards} ways," if shards > 1 else ""),
               -(-needed // shards), available, memory,
               "lower max_cache_len (--max-cache-len) or max_new_tokens, or use the sliding_window cache")


def check_weights_fit(config: MistralConfig, dtype: object, itemsize: int, available: int | None,
                      memory: str, mesh_parameters: int | None = None) -> None:
    """Refuse, before reading a byte of it, a model whose weights alone, in `dtype`, are larger than the `memory`
    available (None: unknown, not checked): the OS would otherwise kill the process part way through loading, with no
    message. On a mesh, `mesh_parameters` is what this memory holds of them (its devices' shares, copies included).
    A lower bound: what a loader holds beside the weights (one tensor being converted) is not counted."""
    on_mesh = mesh_parameters is not None
    parameters = (sum(math.prod(shape) for shape in expected_tensor_shapes(config).values())
                  if mesh_parameters is None else mesh_parameters)
    needed = parameters * itemsize
    half = f"load it in bfloat16 (--dtype bfloat16: {format_bytes(needed * 2 // itemsize)}), " if itemsize > 2 else ""
    dtype_name = str(dtype).removeprefix("torch.")
    what = "loading its shares of the weights on the mesh" if on_mesh else "loading the weights"
    where = ("split the model over more devices (a larger model=N in --mesh), on devices with more memory free"
             if on_mesh else "use a machine or device with more memory free, or split the model over a mesh (--mesh)")
    check_fits(f"{what} ({parameters:,} parameters in {dtype_name})", needed, available, memory, half + where)


def check_fits(what: str, needed: int, available: int | None, memory: str, advice: str) -> None:
    """Refuse an allocation of `needed` bytes when less `memory` is available; the message gives both figures."""
    if available is not None and needed > available:
        raise ResourceError(f"{what} needs {format_bytes(needed)}, but only {format_bytes(available)} of {memory} "
                            f"is available; {advice}")


def format_bytes(count: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def host_available_bytes() -> int | None:
    """Memory the host can still give (Linux MemAvailable: free plus reclaimable cache); None when unknown."""
    try:
        import psutil
    except ImportError:  # psutil is optional: read the kernel's own figure
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None
    return int(psutil.virtual_memory().available)


def check_write_range(cache: Any, start: int, num_new: int) -> None:
    """Refuse a write of num_new tokens from column `start` outside [0, capacity) or past the int32 limit of
    columns: JAX would clamp it silently, and an int32 length would wrap."""
    end = start + num_new
    tokens = f"{num_new} token{'' if num_new == 1 else 's'}"
    if start < 0 or (cache.capacity is not None and end > cache.capacity):
        raise CacheError(f"writing {tokens} at columns {start}..{end - 1} is outside this "
                         f"{type(cache).__name__}'s capacity [0, {cache.capacity}); reset() it or build a larger "
                         "cache (max_cache_len; a cache generate builds holds prompt + max_new_tokens, rounded up: "
                         "to continue in it, pass generate a max_cache_len with room for the continuation)")
    if end > INT32_MAX:
        raise CacheError(f"writing {tokens} at columns {start}..{end - 1} passes {INT32_MAX}, the int32 "
                         "limit of cache columns and lengths; reset() the cache")


def check_state_pair(key_shape: tuple[int, ...], value_shape: tuple[int, ...]) -> None:
    """Refuse keys and values of different shapes for one write: one would be written and the other refused (torch)
    or both written to different slots (JAX)."""
    if key_shape != value_shape:
        raise CacheError(f"key_states has shape {list(key_shape)} but value_states has {list(value_shape)}; a write "
                         "gives both for the same tokens")


def check_new_positions(cache: Any, shape: tuple[int, ...], integer: bool) -> None:
    """Refuse the positions of a direct `advance` call that the cache cannot record: not [batch, S] or not whole
    numbers (the forward checks its own before any write)."""
    if len(shape) != 2 or shape[0] != cache.slot_positions.shape[0]:
        raise CacheError(f"new_positions has shape {list(shape)}; this cache records [{cache.slot_positions.shape[0]}, "
                         "seq_len] positions (-1 for padding)")
    if not integer:
        raise CacheError("new_positions must hold whole positions (an integer dtype); -1 marks padding")


def check_states(cache: Any, layer_idx: int, name: str, shape: tuple[int, ...], dtype: object,
                 buffer_shape: tuple[int, ...]) -> None:
    """Refuse key/value states of the wrong layer index, shape or dtype for a direct `update` call. `buffer_shape`
    is the shape of the K/V buffers the states go into (on a torch mesh: this rank's shard)."""
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral):
        raise CacheError(f"layer_idx={layer_idx!r} must be an int in [0, {cache.num_layers})")
    if not 0 <= layer_idx < cache.num_layers:
        raise CacheError(f"layer_idx={layer_idx} is outside [0, {cache.num_layers})")
    rows, kv_heads, _, head_dim = buffer_shape
    batch, heads, _, states_head_dim = shape if len(shape) == 4 else (None,) * 4
    if (batch, heads, states_head_dim) != (rows, kv_heads, head_dim):
        raise CacheError(f"{name} has shape {list(shape)}; this cache needs [{rows}, {kv_heads}, seq_len, "
                         f"{head_dim}]")
    if dtype != cache.dtype:
        raise CacheError(f"{name} dtype {dtype} differs from cache dtype {cache.dtype}; cast the states to the "
                         "cache's dtype, or build the cache in the model's")
