"""The cache layout both towers share (docs/design.md §2): per-layer K/V buffers [batch, kv_heads, cache_len,
head_dim], and the sizes read off them. Nothing else describes a cache's size, so a JAX cache's pytree metadata holds
no size at all and two caches with equal buffers are the same jit input."""

from __future__ import annotations

from typing import Any


class BufferSizes:
    """A cache's sizes, read from its `keys` (a list of per-layer [batch, kv_heads, cache_len, head_dim] arrays)."""

    keys: list[Any]
    # The rows of the batch a tower padded this cache's rows for (the rest are copies of its last row, finished:
    # twincache.mesh.pad_batch, docs/design.md §5 "Batch size classes"); None: every row is the caller's. Set on every
    # result's cache (twincache.mesh.keep_rows) and by the handoff; continue_generation given that many last tokens,
    # and generate given that many prompts with this cache, pad them again (pad_continuation), any other count but
    # the cache's own rows is refused. Not pytree metadata in JAX: a padded and a full cache share executables.
    real_rows: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def cache_len(self) -> int:
        """Slots in each buffer."""
        return self.keys[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[3]

    @property
    def max_cache_len(self) -> int:
        """The buffer length. A ring asked for more slots than its window holds the window (and has no capacity
        limit), so its max_cache_len is the window too."""
        return self.cache_len

    @property
    def capacity(self) -> int | None:
        """Most columns this cache can ever hold; None when a ring covers the whole window (no limit)."""
        return self.max_cache_len


def cache_fields(cache: Any) -> dict[str, object]:
    """The description of a cache of either tower (everything but its arrays), for comparisons and handoff: the sizes
    read off its buffers, its kind and dtype, and its own attributes (the window, the mesh)."""
    names = ("kind", "num_layers", "batch_size", "num_kv_heads", "cache_len", "head_dim", "max_cache_len", "dtype")
    return {name: getattr(cache, name) for name in names} | {k: v for k, v in vars(cache).items()
                                                            if k not in cache.ARRAY_FIELDS}
