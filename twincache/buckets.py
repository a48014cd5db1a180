"""Attention length buckets: how many cache slots a forward's attention reads (docs/design.md §2).

Both caches fill their slots from 0 upwards (a ring wraps only once all W are live), so every live key sits in the
first `filled` slots. Attention reads a prefix of the buffers that covers them, rounded up to a bucket:
ATTEND_BLOCK * 2^i while that is less than half the buffer, else the whole buffer. A static cache's attention cost
then follows its filled length (it reads at most 2x the live slots in a partial bucket, 4x in the whole buffer), and
each backend compiles one variant per bucket a process reaches: at most ceil(log2(cache_len / ATTEND_BLOCK)) in all.
The slots past the prefix hold no visible key (position -1), so reading fewer of them changes no logit beyond
rounding.
"""

from __future__ import annotations

from twincache.errors import CacheError
from twincache.generation import as_integer

# The smallest bucket, in slots. Below it a step's K/V reads are small next to its weights; each bucket above it is
# one more compiled variant. Read at call time, so a test can lower it.
ATTEND_BLOCK = 256


def attend_len(filled: int, cache_len: int) -> int:
    """Slots attention reads when the first `filled` of `cache_len` slots hold every live key: the smallest
    ATTEND_BLOCK * 2^i >= filled, or all cache_len slots once that bucket would be half the buffer or more (a bucket
    that close to the whole would be one more compiled variant for little saved)."""
    bucket = ATTEND_BLOCK
    while bucket < filled:
        bucket *= 2
    return bucket if 2 * bucket < cache_len else cache_len


def step_attend_len(length: int, num_new: int, cache_len: int) -> int:
    """The bucket of a forward writing `num_new` tokens into a cache that holds `length` columns: every slot written
    so far or now is live (a ring's slot count stops at its length)."""
    return attend_len(min(length + num_new, cache_len), cache_len)


def decode_buckets(length: int, steps: int, cache_len: int) -> list[tuple[int, int]]:
    """`steps` one-token decode steps from a cache holding `length` columns, as runs that share one bucket:
    [(attend_len, steps in the run)], in order. A loop compiled per bucket runs each run as one piece."""
    runs: list[tuple[int, int]] = []
    done = 0
    while done < steps:
        bucket = step_attend_len(length + done, 1, cache_len)
        # Steps stay in this bucket while the slots they fill fit in it (a full ring stays in its last bucket).
        room = steps - done if bucket == cache_len else bucket - (length + done)
        run = min(room, steps - done)
        runs.append((bucket, run))
        done += run
    return runs


def check_attend_len(attend: int, length: int, num_new: int, cache_len: int) -> None:
    """Refuse a read prefix that would hide live keys, or that is longer than the buffers."""
    needed = min(length + num_new, cache_len)
    attend = as_integer("attend_len", attend)
    if not needed <= attend <= cache_len:
        raise CacheError(f"attend_len={attend} must cover the {needed} live slots after this write and fit the "
                         f"cache's {cache_len} slots; pass attend_len in [{needed}, {cache_len}] or None (all slots)")
