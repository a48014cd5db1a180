"""KV caches for Mistral decoding, PyTorch side. jax_cache/cache.py mirrors this file.

Layout (the same in both backends):
  keys[layer], values[layer]  [batch, kv_heads, cache_len, head_dim]  one pair per layer, allocated up front
  slot_positions              [batch, cache_len] int32  absolute position of the token held in each slot; -1 = empty
  length                      []                 int32  columns written so far = the next column to write
A column indexes the left-padded batch layout; for an unpadded row it equals the token's absolute position.
  StaticCache:         column c lives in slot c; cache_len = max_cache_len.
  SlidingWindowCache:  a ring of W = min(sliding_window, max_cache_len) slots; column c lives in slot c % W.
Visibility comes from slot_positions (the model's mask), never from slot order: RoPE is applied before caching.

On a mesh (`mesh=`, docs/design.md §10) a cache still describes the whole cache (batch_size, num_kv_heads), and each
rank holds its K/V shard [batch_size / data, KV heads of its group, cache_len, head_dim] on its own device;
slot_positions and length are whole on every rank (torch_cache.sharding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from torch_cache import sharding
from twincache import buckets, cache_checks, hugepages
from twincache.cache_layout import BufferSizes
from twincache.config import MistralConfig
from twincache.errors import CacheError, InputError


class StaticCache(BufferSizes):
    """Per-layer K/V buffers written in place with `index_copy_`; addresses never change."""

    kind = "static"
    # The cache's tensors, declared once: what reset() empties, what is marked as static addresses and what the
    # torch <-> JAX handoff copies. keys and values are per-layer lists.
    ARRAY_FIELDS = ("keys", "values", "slot_positions", "length")

    def __init__(self, config: MistralConfig, batch_size: int, max_cache_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 mesh: DeviceMesh | None = None) -> None:
        batch_size, max_cache_len = cache_checks.check_cache_size(batch_size, max_cache_len)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CacheError(f"dtype={dtype!r} must be a floating-point torch.dtype (the model's), e.g. torch.float32 "
                             "or torch.bfloat16")
        rows, kv_heads, shards = batch_size, config.num_key_value_heads, 1
        if mesh is not None:  # a mesh that cannot split this model or batch is refused before anything is built
            split = sharding.plan(mesh, config)
            sharding.check_batch_size(mesh, batch_size)
            rows, kv_heads = batch_size // split.mesh.data, split.num_kv_heads
            shards = sharding.kv_shards_per_device(mesh, config.num_key_value_heads)
            device = sharding.local_device(mesh)
        self.mesh = mesh
        self._num_kv_heads = config.num_key_value_heads  # the whole cache's: a rank on a mesh holds some of them
        device = usable_device(device)  # normalised as tensors report it: "cuda" -> cuda:0
        cache_len = self._buffer_len(config, max_cache_len)
        shape = (batch_size, config.num_key_value_heads, cache_len, config.head_dim)  # the whole cache
        # Refused before allocating: a cache that cannot fit would otherwise be allocated until the OS kills us.
        cache_checks.check_cache_fits(self.kind, config.num_hidden_layers, shape, dtype, dtype.itemsize,
                                      available_memory(device), memory_label(device), shards)
        local = (rows, kv_heads, cache_len, config.head_dim)  # this rank's shard on a mesh
        layers = config.num_hidden_layers
        # Plain tensors wherever the cache is built (inside generate's inference mode or outside it, as make_cache,
        # README's API and the handoff build one): dynamo guards on a tensor's inference-ness, so one of each kind
        # compiled the same decode step twice; and a plain tensor can be written in and out of inference mode.
        with torch.inference_mode(False):
            if device.type == "cpu":  # a step streams its K/V as it does its weights: from 2 MiB pages
                buffers = host_buffers([local] * (2 * layers), dtype)
                self.keys, self.values = buffers[:layers], buffers[layers:]
            else:
                self.keys = [torch.zeros(local, dtype=dtype, device=device) for _ in range(layers)]  # [B, Hkv, L, D]
                self.values = [torch.zeros(local, dtype=dtype, device=device) for _ in range(layers)]  # [B, Hkv, L, D]
            self.slot_positions = torch.full((batch_size, cache_len), -1, dtype=torch.int32, device=device)  # [B, L]
            self.length = torch.zeros((), dtype=torch.int32, device=device)  # []
        for buffer in self.arrays():
            torch._dynamo.mark_static_address(buffer)  # cudagraphs may keep pointers to these across replays

    @staticmethod
    def _buffer_len(config: MistralConfig, max_cache_len: int) -> int:
        return max_cache_len

    # --- sizes are read off the buffers (twincache.cache_layout.BufferSizes), and so is the dtype ------------------

    @property
    def batch_size(self) -> int:
        return self.slot_positions.shape[0]  # whole on every rank; a mesh rank's K/V hold its rows only

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads  # the whole cache's; a mesh rank's K/V hold its group's

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def arrays(self) -> list[torch.Tensor]:
        """Every tensor of the cache: keys and values of each layer, slot_positions, length."""
        return [*self.keys, *self.values, self.slot_positions, self.length]

    # --- slot mapping: the only place the two caches differ ---------------------------------------------------------

    def _write_slots(self, num_new: int) -> tuple[torch.Tensor, int]:
        """Slots receiving the last `kept` of `num_new` tokens written from column `length`. [kept] int64."""
        columns = self.length + torch.arange(num_new, device=self.device, dtype=torch.int32)  # [S]
        return columns.long(), num_new

    def _attends_in_place(self, num_new: int) -> bool:
        """Whether attention can read the buffers after this write (else it reads old buffers + new tokens)."""
        return True

    # --- the forward-pass protocol: attended_positions, update (or in_place_slots, write_in_place) per layer, advance

    def attended_positions(self, new_positions: torch.Tensor, attend_len: int | None = None) -> torch.Tensor:
        """Positions of the keys attention reads in this forward. new_positions: [B, S] (-1 = padding).

        `attend_len` (twincache.buckets): attention reads only the first attend_len slots, which must hold every live
        key; None reads them all. A forward that attends over the old buffers plus its new tokens (a ring's
        multi-token write) reads them all regardless.
        """
        num_new = new_positions.shape[1]
        length = None  # the host's copy of `length`, read once for both checks (each read is a device sync)
        if not torch.compiler.is_compiling():  # the first call of a forward: refuse before index_copy's IndexError
            length = self._check_write_range(num_new)
        slots, kept = self._write_slots(num_new)
        if self._attends_in_place(num_new):
            if attend_len is not None and length is not None:
                buckets.check_attend_len(attend_len, length, num_new, self.cache_len)
            positions = self.slot_positions.index_copy(1, slots, new_positions[:, num_new - kept:])  # [B, L]
            return positions if attend_len is None else positions.narrow(1, 0, attend_len)  # [B, attend_len]
        return torch.cat([self.slot_positions, new_positions], dim=1)  # [B, L + S]

    def update(self, layer_idx: int, key_states: torch.Tensor,
               value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write S new tokens' K/V ([B, Hkv, S, D]) of one layer; return the K/V attention reads."""
        if not torch.compiler.is_compiling():
            self._check_states(layer_idx, key_states, value_states)
        num_new = key_states.shape[2]
        slots, kept = self._write_slots(num_new)
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [B, Hkv, L, D]
        if self._attends_in_place(num_new):
            self.write_in_place(keys, values, slots, key_states, value_states)
            return keys, values
        attended_keys = torch.cat([keys, key_states], dim=2)  # [B, Hkv, L + S, D], read before the write below
        attended_values = torch.cat([values, value_states], dim=2)  # [B, Hkv, L + S, D]
        self.write_in_place(keys, values, slots, key_states[:, :, num_new - kept:], value_states[:, :, num_new - kept:])
        return attended_keys, attended_values

    def in_place_slots(self, num_new: int) -> torch.Tensor | None:
        """The slots [S] int64 a forward of `num_new` tokens writes when attention reads the buffers after the write
        (a static cache's every forward, a ring's one-token steps): each layer's write is then `write_in_place`, on
        tensors alone, so that a compiled region can hold it (docs/design.md §7.16). None when attention reads the
        old buffers plus the new tokens; `update` writes those."""
        return self._write_slots(num_new)[0] if self._attends_in_place(num_new) else None

    @staticmethod
    def write_in_place(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor,
                       value_states: torch.Tensor) -> None:
        """Write one layer's new K/V ([B, Hkv, K, D]) into its buffers ([B, Hkv, L, D]) at `slots` [K]: the write of
        `update`, and of a layer given in_place_slots."""
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)

    def advance(self, new_positions: torch.Tensor) -> None:
        """Record the positions written by this forward ([B, S]) and move `length` past them; call once per forward."""
        num_new = new_positions.shape[1]
        if not torch.compiler.is_compiling():  # a direct call: nothing checked it (the compiled step's inputs were)
            cache_checks.check_new_positions(self, tuple(new_positions.shape), not new_positions.is_floating_point())
            self._check_write_range(num_new)
        slots, kept = self._write_slots(num_new)
        self.slot_positions.index_copy_(1, slots, new_positions[:, num_new - kept:].to(torch.int32))
        self.length.add_(num_new)

    def reset(self) -> None:
        """Empty the cache in place: afterwards it behaves exactly like a fresh one, at the same addresses."""
        for buffer in (*self.keys, *self.values):
            buffer.zero_()
        self.slot_positions.fill_(-1)
        self.length.zero_()

    # --- eager-only checks (skipped while torch.compile traces; generate validates its whole budget up front) --------

    def check_compatible(self, config: MistralConfig, batch_size: int, model_dtype: torch.dtype,
                         model_device: torch.device) -> None:
        """Refuse a cache built for another device, model (kind, window, layers, heads, head_dim), dtype or batch."""
        cache_checks.check_compatible(self, config, batch_size, model_dtype, model_device)

    def check_forward(self, config: MistralConfig, input_ids: torch.Tensor, model_dtype: torch.dtype,
                      model_device: torch.device) -> int:
        """Refuse a forward this cache was not built for, before anything is written. Returns `length` as read on
        the host for the check (a caller that needs it reads it once)."""
        if input_ids.device != self.device:
            raise CacheError(f"input_ids is on {input_ids.device} but the cache is on {self.device}; "
                             "move them to one device")
        if input_ids.ndim != 2:
            raise CacheError(f"input_ids has shape {list(input_ids.shape)}; expected [batch, seq_len]")
        self.check_compatible(config, input_ids.shape[0], model_dtype, model_device)
        return self._check_write_range(input_ids.shape[1])

    def next_positions(self) -> torch.Tensor:
        """Position the next token of each row takes: one past the newest position held. [B] int64."""
        return self.slot_positions.max(dim=1).values.long() + 1

    def _check_write_range(self, num_new: int) -> int:
        """Refuse a write of `num_new` tokens past the capacity; returns `length` as read on the host for it."""
        length = int(self.length)
        cache_checks.check_write_range(self, length, num_new)
        return length

    def _check_states(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cache_checks.check_state_pair(tuple(key_states.shape), tuple(value_states.shape))
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            cache_checks.check_states(self, layer_idx, name, tuple(states.shape), states.dtype,
                                      tuple(self.keys[0].shape))
            if states.device != self.device:
                raise CacheError(f"{name} is on {states.device} but the cache is on {self.device}; move the states to "
                                 "the cache's device, or build the cache on the model's")
        self._check_write_range(key_states.shape[2])


class SlidingWindowCache(StaticCache):
    """A ring buffer of W slots: a decode step writes one slot; nothing is rolled, shifted or copied."""

    kind = "sliding_window"

    def __init__(self, config: MistralConfig, batch_size: int, max_cache_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 mesh: DeviceMesh | None = None) -> None:
        if config.sliding_window is None:
            raise CacheError("a SlidingWindowCache needs a config with sliding_window set, but it is null; "
                             "use StaticCache")
        self.sliding_window = config.sliding_window
        super().__init__(config, batch_size, max_cache_len, dtype, device, mesh)

    @staticmethod
    def _buffer_len(config: MistralConfig, max_cache_len: int) -> int:
        assert config.sliding_window is not None  # __init__ refused a config without one before calling this
        return min(config.sliding_window, max_cache_len)

    @property
    def capacity(self) -> int | None:
        # A ring shorter than the window would forget keys the window still sees, so it is bounded like a static cache.
        return None if self.cache_len == self.sliding_window else self.max_cache_len

    def _write_slots(self, num_new: int) -> tuple[torch.Tensor, int]:
        kept = min(num_new, self.cache_len)  # a prefill longer than the ring keeps only its last W tokens
        first = self.length + (num_new - kept)
        columns = first + torch.arange(kept, device=self.device, dtype=torch.int32)  # [kept]
        return torch.remainder(columns, self.cache_len).long(), kept

    def _attends_in_place(self, num_new: int) -> bool:
        # One token overwrites the slot of position q - W, which its query cannot see; several would overwrite
        # keys that earlier queries of the same chunk still need.
        return num_new == 1


def usable_device(device: str | torch.device) -> torch.device:
    """`device` as tensors report it ("cuda" -> cuda:0), or an InputError naming it when this torch cannot place a
    tensor there: "tpu" raised RuntimeError, "cuda" on a CPU-only torch AssertionError, from inside a cache's
    constructor or the handoff."""
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError, TypeError) as err:  # TypeError: not a device at all (None, 3.5)
        raise InputError(f"device={device!r} is not usable by this torch ({' '.join(str(err).split())[:160]}); "
                         "pass 'cpu', 'cuda' or 'cuda:N' for a device it sees") from None


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can still take (None when unknown: no check)."""
    if device.type == "cpu":
        return cache_checks.host_available_bytes()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # + the pool's free
    return None


def host_buffers(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, prefault: bool = True) -> list[torch.Tensor]:
    """Zero-filled CPU tensors of these shapes, each 64-byte aligned, in one allocation advised to be backed by 2 MiB
    pages (twincache.hugepages): a decode step streams them faster than from malloc's 4 KiB pages. Each tensor has a
    storage of its own over its part of the allocation (which lives as long as any of them): dynamo refuses region
    inputs that share a storage. Less than one huge page in all: plain zeros. `prefault=False` leaves the pages to
    be taken by the first write (a loader that writes every byte next: one pass over the memory, not two)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    offsets, total = hugepages.arena_offsets(sizes)
    # read at every allocation, so a bad TWINCACHE_HUGE_PAGES is refused for a tiny model too, not only past 2 MiB
    hugepages.huge_pages_wanted()
    if total < hugepages.HUGE_PAGE:  # at most one TLB entry to save, and a whole 2 MiB page to take for it
        return [torch.zeros(shape, dtype=dtype, device="cpu") for shape in shapes]  # host, not the default device
    arena = hugepages.host_buffer(total)  # [total] uint8
    if prefault:
        arena[...] = 0  # already zeros (a fresh mapping): this takes the pages now, not in the middle of a decode
    return [torch.from_numpy(arena[offset:offset + size]).view(dtype).view(shape)
            for offset, size, shape in zip(offsets, sizes, shapes)]


def memory_label(device: torch.device) -> str:
    return "host memory" if device.type == "cpu" else f"{device} memory"


def make_cache(kind: str, config: MistralConfig, batch_size: int, max_cache_len: int,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               mesh: DeviceMesh | None = None) -> StaticCache:
    """Build a cache by name: "static" or "sliding_window", on one device or as this rank's part of `mesh`."""
    classes = {cls.kind: cls for cls in (StaticCache, SlidingWindowCache)}
    if kind not in classes:
        raise InputError(f"cache={kind!r} is not one of {', '.join(classes)}")
    return classes[kind](config, batch_size, max_cache_len, dtype, device, mesh)


__all__ = ["StaticCache", "SlidingWindowCache", "make_cache", "available_memory", "host_buffers", "memory_label",
           "usable_device"]
