"""KV caches for Mistral decoding, JAX side: pytrees updated functionally, in place under buffer donation.
torch_cache/cache.py is the reference this file mirrors.

Layout (the same in both backends):
  keys[layer], values[layer]  [batch, kv_heads, cache_len, head_dim]  one pair per layer, allocated up front
  slot_positions              [batch, cache_len] int32  absolute position of the token held in each slot; -1 = empty
  length                      []                 int32  columns written so far = the next column to write
A column indexes the left-padded batch layout; for an unpadded row it equals the token's absolute position.
  StaticCache:         column c lives in slot c; cache_len = max_cache_len.
  SlidingWindowCache:  a ring of W = min(sliding_window, max_cache_len) slots; column c lives in slot c % W.
Visibility comes from slot_positions (the model's mask), never from slot order: RoPE is applied before caching.

On a mesh (`mesh=`, docs/design.md §10) every array is one global array: K/V with the batch on `data` and the KV
heads on `model`, slot_positions following the batch, length replicated (jax_cache.sharding places them).

Arrays are leaves; everything else (sizes, dtype, mesh) is static pytree metadata. A cache passed to a jitted call with
donation is consumed: using it again raises StaleCacheError instead of JAX's bare "Array has been deleted".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from jax_cache import sharding
from twincache import buckets, cache_checks, hugepages
from twincache.cache_layout import BufferSizes
from twincache.config import MistralConfig
from twincache.errors import CacheError, InputError, StaleCacheError


@jax.tree_util.register_pytree_node_class
class StaticCache(BufferSizes):
    """Per-layer K/V buffers written with `lax.dynamic_update_slice`; with donation XLA writes them in place."""

    kind = "static"
    # The cache's arrays, declared once: the pytree's children (everything else is static metadata) and what the
    # torch <-> JAX handoff copies. keys and values are per-layer lists.
    ARRAY_FIELDS = ("keys", "values", "slot_positions", "length")

    def __init__(self, config: MistralConfig, batch_size: int, max_cache_len: int,
                 dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None) -> None:
        batch_size, max_cache_len = cache_checks.check_cache_size(batch_size, max_cache_len)
        try:
            floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise CacheError(f"dtype={dtype!r} must be a floating-point jax dtype (the model's), e.g. jnp.float32 or "
                             "jnp.bfloat16")
        if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined, unused-ignore]
            raise CacheError("dtype=float64 needs JAX's 64-bit mode, which is off: JAX would build a float32 cache "
                             "(with a warning); set jax.config.update(\"jax_enable_x64\", True) first")
        if mesh is not None:  # a mesh that cannot split this model or batch is refused before anything is built
            sharding.plan(mesh, config)
            sharding.check_batch_size(mesh, batch_size)
        self.mesh = mesh
        dtype = jnp.dtype(dtype)
        shape = (batch_size, config.num_key_value_heads, self._buffer_len(config, max_cache_len), config.head_dim)
        # Refused before allocating: a cache that cannot fit would otherwise be allocated until the OS kills us.
        device = default_device() if mesh is None else mesh.devices.flat[0]  # also while a jit traces this
        shards = 1 if mesh is None else sharding.kv_shards_per_device(mesh, config.num_key_value_heads)
        cache_checks.check_cache_fits(self.kind, config.num_hidden_layers, shape, dtype, dtype.itemsize,
                                      available_memory(device), memory_label(device), shards)
        places = self._placements(config.num_hidden_layers, config.num_key_value_heads)  # before the buffers exist
        self.keys = [jnp.zeros(shape, dtype, device=places[0]) for _ in range(config.num_hidden_layers)]
        self.values = [jnp.zeros(shape, dtype, device=places[0]) for _ in range(config.num_hidden_layers)]
        self.slot_positions = jnp.full(shape[:1] + shape[2:3], -1, jnp.int32, device=places[-2])
        self.length = jnp.zeros((), jnp.int32, device=places[-1])

    def _placements(self, num_layers: int, num_kv_heads: int) -> Sequence[NamedSharding | None]:
        """Where each array of `arrays()` goes: its mesh sharding, or None (the default device)."""
        if self.mesh is None:
            return [None] * (2 * num_layers + 2)
        return sharding.cache_shardings(self.mesh, num_layers, num_kv_heads)

    @staticmethod
    def _buffer_len(config: MistralConfig, max_cache_len: int) -> int:
        return max_cache_len

    # --- sizes are read off the buffers (twincache.cache_layout.BufferSizes), and so is the dtype: no size is pytree
    # --- metadata, so two caches whose buffers have the same shapes are the same jit input ---------------------------

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.keys[0].dtype)

    # --- pytree protocol: arrays are children, the window is static metadata --------------------------------------

    def tree_flatten(self) -> tuple[tuple, tuple]:
        # the window, if any; real_rows is not: a padded cache and a full one of its rows run the same executables
        static = tuple((k, v) for k, v in vars(self).items() if k not in self.ARRAY_FIELDS and k != "real_rows")
        return tuple(getattr(self, name) for name in self.ARRAY_FIELDS), static

    @classmethod
    def tree_unflatten(cls, static: tuple, children: tuple) -> StaticCache:
        cache = object.__new__(cls)
        cache.__dict__.update(static)
        for name, child in zip(cls.ARRAY_FIELDS, children, strict=True):
            setattr(cache, name, list(child) if isinstance(child, (list, tuple)) else child)
        return cache

    def arrays(self) -> list[jax.Array]:
        """Every array of the cache: keys and values of each layer, slot_positions, length."""
        return [*self.keys, *self.values, self.slot_positions, self.length]

    def replace(self, **changes: object) -> StaticCache:
        """A shallow copy with some arrays replaced (the functional form of torch_cache's in-place writes)."""
        cache = object.__new__(type(self))
        cache.__dict__.update(vars(self), **changes)
        return cache

    # --- slot mapping: the only place the two caches differ ---------------------------------------------------------

    def _write_slots(self, num_new: int) -> tuple[jax.Array, int]:
        """Slots receiving the last `kept` of `num_new` tokens written from column `length`. [kept] int32."""
        return self.length + jnp.arange(num_new, dtype=jnp.int32), num_new  # [S]

    def _attends_in_place(self, num_new: int) -> bool:
        """Whether attention can read the buffers after this write (else it reads old buffers + new tokens)."""
        return True

    def _write(self, buffer: jax.Array, new: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
        # In-place-attended writes are contiguous, so one dynamic_update_slice; a wrapping chunk scatters.
        if self._attends_in_place(new.shape[axis]):
            return lax.dynamic_update_slice_in_dim(buffer, new, slots[0], axis=axis)
        index = (slice(None),) * axis + (slots,)
        return buffer.at[index].set(new, mode="promise_in_bounds")

    # --- the forward-pass protocol: attended_positions, update per layer, then advance ------------------------------

    def attended_positions(self, new_positions: jax.Array, attend_len: int | None = None) -> jax.Array:
        """Positions of the keys attention reads in this forward. new_positions: [B, S] (-1 = padding).

        `attend_len` (twincache.buckets): attention reads only the first attend_len slots, which must hold every live
        key; None reads them all. A forward that attends over the old buffers plus its new tokens (a ring's
        multi-token write; on XLA-CPU a one-token step over every slot, _reads_before_writing) reads them all: then
        [B, L + S].
        """
        num_new = new_positions.shape[1]
        length = None  # the host's copy of `length`, read once for both checks (each read is a device-to-host copy)
        if not isinstance(new_positions, jax.core.Tracer):  # the first call of a forward: refuse before any write
            self.check_live()
            length = self._check_write_range(num_new)
        slots, kept = self._write_slots(num_new)
        if attend_len is not None and self._attends_in_place(num_new) and not isinstance(self.length, jax.core.Tracer):
            buckets.check_attend_len(attend_len, int(self.length) if length is None else length, num_new,
                                     self.cache_len)
        if self._reads_before_writing(num_new, attend_len):
            return jnp.concatenate([self.slot_positions, new_positions], axis=1)  # [B, L + S]
        positions = self._write(self.slot_positions, new_positions[:, num_new - kept:], slots, axis=1)  # [B, L]
        return positions if attend_len is None else positions[:, :attend_len]  # [B, attend_len]

    def _reads_before_writing(self, num_new: int, attend_len: int | None) -> bool:
        """Whether attention reads the buffers as they were before this forward's write, plus the new tokens
        (the model then writes after attending). A ring's multi-token write must. A one-token step over every slot
        does on XLA-CPU: a dot reading a buffer that the same program updates in place made XLA copy the buffer
        (or duplicate the update), which one dot per half of the slots avoids at a 4x slower read (~6 vs ~26 GB/s,
        16k slots). The slot being written holds no key its query sees (empty, or position q - W of a full ring).
        Over a prefix (an attention bucket) the halves stay: a dot over a slice of a buffer that is not updated
        until later ran at ~3 GB/s."""
        if not self._attends_in_place(num_new):
            return True
        whole = attend_len is None or attend_len == self.cache_len
        return num_new == 1 and whole and self.mesh is None and jax.default_backend() == "cpu"

    def update(self, layer_idx: int, key_states: jax.Array,
               value_states: jax.Array) -> tuple[jax.Array, jax.Array, StaticCache]:
        """Write S new tokens' K/V ([B, Hkv, S, D]) of one layer; return the buffers after the write and the new cache.
        Attention reads those, unless attended_positions covered L + S columns (a forward that reads before it
        writes): then it reads this cache's buffers, as they were, followed by the new tokens' K/V, and the model
        writes afterwards (torch_cache returns that concatenation here: its write destroys the old buffers)."""
        if not isinstance(key_states, jax.core.Tracer):
            self._check_states(layer_idx, key_states, value_states)
        num_new = key_states.shape[2]
        slots, kept = self._write_slots(num_new)
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [B, Hkv, L, D]
        new_keys = self._write(keys, key_states[:, :, num_new - kept:], slots, axis=2)
        new_values = self._write(values, value_states[:, :, num_new - kept:], slots, axis=2)
        all_keys, all_values = list(self.keys), list(self.values)
        all_keys[layer_idx], all_values[layer_idx] = new_keys, new_values
        return new_keys, new_values, self.replace(keys=all_keys, values=all_values)

    def advance(self, new_positions: jax.Array) -> StaticCache:
        """Record the positions written by this forward ([B, S]) and move `length` past them; call once per forward."""
        num_new = new_positions.shape[1]
        if not isinstance(new_positions, jax.core.Tracer) and not isinstance(self.length, jax.core.Tracer):
            self.check_live()  # a direct call: nothing checked it (a jitted forward's inputs were)
            integer = jnp.issubdtype(new_positions.dtype, jnp.integer)
            cache_checks.check_new_positions(self, tuple(new_positions.shape), integer)
            self._check_write_range(num_new)
        slots, kept = self._write_slots(num_new)
        slot_positions = self._write(self.slot_positions, new_positions[:, num_new - kept:].astype(jnp.int32), slots,
                                     axis=1)
        return self.replace(slot_positions=slot_positions, length=self.length + num_new)

    def reset(self) -> StaticCache:
        """An empty cache of the same type, shapes and placement: using it is identical to using a fresh one. The
        buffers are donated and emptied in place, as torch's reset() empties its own, so this cache is consumed (use
        the returned one) and no second cache's memory is taken; a consumed cache gets fresh buffers."""
        if not self.is_consumed():
            arrays = self.arrays()
            *buffers, slot_positions, length = _emptier(arrays)(arrays)
            layers = self.num_layers
            return self.replace(keys=buffers[:layers], values=buffers[layers:], slot_positions=slot_positions,
                                length=length)
        places = self._placements(self.num_layers, self.num_kv_heads)
        return self.replace(keys=[jnp.zeros_like(k, device=places[0]) for k in self.keys],
                            values=[jnp.zeros_like(v, device=places[0]) for v in self.values],
                            slot_positions=jnp.full_like(self.slot_positions, -1, device=places[-2]),
                            length=jnp.zeros_like(self.length, device=places[-1]))

    # --- checks before dispatch (JAX would clamp or drop out-of-range writes silently) ------------------------------

    def is_consumed(self) -> bool:
        """Whether the buffers were donated to an earlier jitted call (and so no longer exist)."""
        return any(array.is_deleted() for array in self.arrays())

    def check_live(self) -> None:
        """Refuse a cache whose buffers were donated to an earlier jitted call."""
        if self.is_consumed():
            raise StaleCacheError(
                "this cache's buffers were donated to a jitted call and no longer exist: twincache updates caches "
                "in place by donation, so each call consumes its input cache. Use the cache that call returned "
                "(logits, cache = ...), or reset()/build a new cache")

    @property
    def device(self) -> str:
        """The device(s) holding the buffers, as a label: "TFRT_CPU_0", "cuda:0", or the mesh."""
        return device_label(self.keys[0])

    def check_compatible(self, config: MistralConfig, batch_size: int, model_dtype: jnp.dtype,
                         model_device: str) -> None:
        """Refuse a cache already donated, or built for another device, model (kind, window, layers, heads,
        head_dim), dtype or batch."""
        self.check_live()
        cache_checks.check_compatible(self, config, batch_size, jnp.dtype(model_dtype), model_device)

    def check_forward(self, config: MistralConfig, input_ids: jax.Array | np.ndarray, model_dtype: jnp.dtype,
                      model_device: str) -> int:
        """Refuse a forward this cache was not built for, before anything is dispatched. Returns `length` as read
        on the host for the check (a caller that needs it reads it once)."""
        if input_ids.ndim != 2:
            raise CacheError(f"input_ids has shape {list(input_ids.shape)}; expected [batch, seq_len]")
        self.check_compatible(config, input_ids.shape[0], model_dtype, model_device)
        return self._check_write_range(input_ids.shape[1])

    def next_positions(self) -> jax.Array:
        """Position the next token of each row takes: one past the newest position held. [B] int32."""
        if not isinstance(self.slot_positions, jax.core.Tracer):
            self.check_live()
        return self.slot_positions.max(axis=1) + 1

    def _check_write_range(self, num_new: int) -> int:
        """Refuse a write of `num_new` tokens past the capacity; returns `length` as read on the host for it."""
        length = int(self.length)
        cache_checks.check_write_range(self, length, num_new)
        return length

    def _check_states(self, layer_idx: int, key_states: jax.Array, value_states: jax.Array) -> None:
        self.check_live()
        cache_checks.check_state_pair(tuple(key_states.shape), tuple(value_states.shape))
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            cache_checks.check_states(self, layer_idx, name, tuple(states.shape), states.dtype,
                                      tuple(self.keys[0].shape))
        self._check_write_range(key_states.shape[2])


@jax.tree_util.register_pytree_node_class
class SlidingWindowCache(StaticCache):
    """A ring buffer of W slots: a decode step writes one slot; nothing is rolled, shifted or copied."""

    kind = "sliding_window"

    def __init__(self, config: MistralConfig, batch_size: int, max_cache_len: int,
                 dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None) -> None:
        if config.sliding_window is None:
            raise CacheError("a SlidingWindowCache needs a config with sliding_window set, but it is null; "
                             "use StaticCache")
        self.sliding_window = config.sliding_window
        super().__init__(config, batch_size, max_cache_len, dtype, mesh)

    @staticmethod
    def _buffer_len(config: MistralConfig, max_cache_len: int) -> int:
        assert config.sliding_window is not None  # __init__ refused a config without a window
        return min(config.sliding_window, max_cache_len)

    @property
    def capacity(self) -> int | None:
        # A ring shorter than the window would forget keys the window still sees, so it is bounded like a static cache.
        return None if self.cache_len == self.sliding_window else self.max_cache_len

    def _write_slots(self, num_new: int) -> tuple[jax.Array, int]:
        kept = min(num_new, self.cache_len)  # a prefill longer than the ring keeps only its last W tokens
        first = self.length + (num_new - kept)
        columns = first + jnp.arange(kept, dtype=jnp.int32)  # [kept]
        return jnp.remainder(columns, self.cache_len), kept

    def _attends_in_place(self, num_new: int) -> bool:
        # One token overwrites the slot of position q - W, which its query cannot see; several would overwrite
        # keys that earlier queries of the same chunk still need.
        return num_new == 1


def _emptied(arrays: list[jax.Array]) -> list[jax.Array]:
    """A cache's arrays ([*keys, *values, slot_positions, length]) emptied: zeros, every slot -1, length 0."""
    *buffers, slot_positions, length = arrays
    return [*(jnp.zeros_like(buffer) for buffer in buffers), jnp.full_like(slot_positions, -1), jnp.zeros_like(length)]


_empty_in_place = jax.jit(_emptied, donate_argnums=0, keep_unused=True)  # kept: their buffers are reused
_mesh_emptiers: dict[tuple[NamedSharding, ...], Callable[[list[jax.Array]], list[jax.Array]]] = {}


def _emptier(arrays: list[jax.Array]) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """`_emptied` jitted with the arrays donated, so XLA writes the empty cache into their buffers. On a mesh each
    output keeps its input's sharding (a constant's is XLA's choice otherwise: it could replicate the K/V); on one
    device no sharding is named, so an uncommitted cache stays uncommitted (docs/design.md §7.29)."""
    shardings = tuple(array.sharding for array in arrays)
    if not all(isinstance(placement, NamedSharding) for placement in shardings):
        return _empty_in_place
    named = cast(tuple[NamedSharding, ...], shardings)
    if named not in _mesh_emptiers:
        _mesh_emptiers[named] = jax.jit(_emptied, donate_argnums=0, keep_unused=True,
                                          out_shardings=list(named))
    return _mesh_emptiers[named]


def device_label(array: jax.Array) -> str:
    """The device(s) an array lives on, as a label for comparisons and messages: the device, or the mesh."""
    placement = array.sharding
    if isinstance(placement, NamedSharding) and placement.mesh.size > 1 and "data" in placement.mesh.axis_names:
        return sharding.mesh_label(cast(Mesh, placement.mesh))  # a placed array's mesh is concrete, not abstract
    return "+".join(sorted(str(device) for device in array.devices()))


def default_device() -> jax.Device:
    """The device new arrays go to: jax.default_device's when one is set, else the default backend's first."""
    # Config flags are set dynamically: jax 0.10's stubs lack them, 0.11's type them Any (hence unused-ignore too).
    device = jax.config.jax_default_device  # type: ignore[attr-defined, unused-ignore]
    if isinstance(device, str):
        return jax.devices(device)[0]
    return device if device is not None else jax.devices()[0]


def host_buffers(shapes: Sequence[tuple[int, ...]], dtype: jnp.dtype, prefault: bool = True) -> list[np.ndarray]:
    """Zero-filled host arrays of these shapes, each 64-byte aligned, in one allocation advised to be backed by 2 MiB
    pages (twincache.hugepages), to fill and then share with XLA-CPU without a copy (jax.device_put): a
    decode step streams them faster than from malloc's 4 KiB pages. NumPy arrays, not jax.Arrays: JAX arrays are
    immutable, and XLA owns a cache's K/V buffers (each step donates them), so here only weights live there. Less
    than one huge page in all: plain zeros. `prefault=False` leaves the pages to be taken by the first write (a
    loader that writes every byte next: one pass over the memory, not two)."""
    dtype = np.dtype(dtype)
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    offsets, total = hugepages.arena_offsets(sizes)
    # read at every allocation, so a bad TWINCACHE_HUGE_PAGES is refused for a tiny model too, not only past 2 MiB
    hugepages.huge_pages_wanted()
    if total < hugepages.HUGE_PAGE:  # at most one TLB entry to save, and a whole 2 MiB page to take for it
        return [np.zeros(shape, dtype) for shape in shapes]
    arena = hugepages.host_buffer(total)  # [total] uint8
    if prefault:
        arena[...] = 0  # already zeros (a fresh mapping): this takes the pages now, as jnp.zeros would
    return [arena[offset:offset + size].view(dtype).reshape(shape)
            for offset, size, shape in zip(offsets, sizes, shapes)]


def available_memory(device: jax.Device) -> int | None:
    """Bytes a new allocation on `device` can still take (None when unknown: no check)."""
    if device.platform == "cpu":
        return cache_checks.host_available_bytes()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def memory_label(device: jax.Device) -> str:
    return "host memory" if device.platform == "cpu" else f"{device} memory"


def make_cache(kind: str, config: MistralConfig, batch_size: int, max_cache_len: int,
               dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None) -> StaticCache:
    """Build a cache by name: "static" or "sliding_window", on one device or on `mesh`."""
    classes = {cls.kind: cls for cls in (StaticCache, SlidingWindowCache)}
    if kind not in classes:
        raise InputError(f"cache={kind!r} is not one of {', '.join(classes)}")
    return classes[kind](config, batch_size, max_cache_len, dtype, mesh)


__all__ = ["StaticCache", "SlidingWindowCache", "make_cache", "available_memory", "host_buffers", "default_device",
           "device_label", "memory_label"]
