"""Synthetic tests of torch_cache's StaticCache and SlidingWindowCache with hand-computed contents.

head_dim 1 and one KV head, so every cached key is one number: K = position + 100 * layer, V = -K. The expected
buffers below are written out by hand; each test also checks that no buffer ever moved (data_ptr).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torch_cache.cache import SlidingWindowCache, StaticCache, make_cache
from torch_cache.model import attention_visibility

EMPTY = -1  # slot_positions of a slot that holds no token


def tiny_config(window: int | None = 4, layers: int = 2, kv_heads: int = 1, head_dim: int = 1) -> SimpleNamespace:
    """The four config fields a cache reads (MistralConfig itself refuses head_dim 1, which RoPE cannot use)."""
    return SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim,
                           sliding_window=window)


def buffers(cache: StaticCache) -> list[torch.Tensor]:
    return [*cache.keys, *cache.values, cache.slot_positions, cache.length]


def pointers(cache: StaticCache) -> list[int]:
    return [t.data_ptr() for t in buffers(cache)]


def key_value(positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K = position + 100 * layer, V = -K, as [B, 1, S, 1] float32."""
    k = (positions.float() + 100 * layer)[:, None, :, None]
    return k, -k


def forward(cache: StaticCache, positions: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward's cache protocol: attended_positions, update on every layer, advance.

    Returns the attended positions [B, Lkv] and the keys each layer's update returned (for attention).
    """
    new = torch.tensor(positions, dtype=torch.int32)  # [B, S]
    attended = cache.attended_positions(new)
    keys = []
    for layer in range(cache.num_layers):
        k, v = key_value(new, layer)
        got_k, got_v = cache.update(layer, k, v)
        assert torch.equal(got_v, -got_k), "values must be written where keys are"
        keys.append(got_k.clone())
    cache.advance(new)
    return attended, keys


def ring_keys(cache: StaticCache, row: int = 0, layer: int = 0) -> list[float]:
    return (cache.keys[layer][row, 0, :, 0] - 100 * layer).tolist()


def cached_positions(cache: StaticCache, row: int = 0) -> list[int]:
    return cache.slot_positions[row].tolist()


def test_layout_is_per_layer_4d_and_allocated_up_front():
    config = tiny_config(window=6, layers=3, kv_heads=2, head_dim=4)
    static = StaticCache(config, batch_size=2, max_cache_len=10)
    ring = SlidingWindowCache(config, batch_size=2, max_cache_len=10)
    short_ring = SlidingWindowCache(config, batch_size=2, max_cache_len=5)  # max_cache_len < window
    for cache, length in ((static, 10), (ring, 6), (short_ring, 5)):
        assert len(cache.keys) == len(cache.values) == 3
        for buffer in (*cache.keys, *cache.values):
            assert buffer.shape == (2, 2, length, 4) and buffer.dtype == torch.float32
        assert len(set(pointers(cache))) == len(buffers(cache)), "each layer owns separate K and V buffers"
        assert cache.slot_positions.shape == (2, length) and cache.slot_positions.dtype == torch.int32
        assert (cache.slot_positions == EMPTY).all()
        assert isinstance(cache.length, torch.Tensor) and cache.length.shape == () and cache.length.dtype == torch.int32
        assert int(cache.length) == 0
    assert static.capacity == 10
    assert ring.capacity is None, "a ring that covers the whole window never runs out"
    assert short_ring.capacity == 5, "a ring shorter than the window is bounded like a static cache"
    assert isinstance(make_cache("sliding_window", config, 2, 10), SlidingWindowCache)
    assert type(make_cache("static", config, 2, 10)) is StaticCache


def test_static_cache_writes_in_place_at_column():
    cache = StaticCache(tiny_config(window=None), batch_size=1, max_cache_len=6)
    ptrs = pointers(cache)

    attended, keys = forward(cache, [[0, 1, 2]])
    assert attended.tolist() == [[0, 1, 2, EMPTY, EMPTY, EMPTY]]
    assert keys[0][0, 0, :, 0].tolist() == [0, 1, 2, 0, 0, 0]
    assert keys[1][0, 0, :, 0].tolist() == [100, 101, 102, 0, 0, 0]
    assert ring_keys(cache) == [0, 1, 2, 0, 0, 0]
    assert ring_keys(cache, layer=1) == [0, 1, 2, -100, -100, -100]
    assert cached_positions(cache) == [0, 1, 2, EMPTY, EMPTY, EMPTY]
    assert int(cache.length) == 3

    new = torch.tensor([[3]], dtype=torch.int32)
    k, v = key_value(new, 0)
    cache.attended_positions(new)
    got_k, got_v = cache.update(0, k, v)
    assert got_k is cache.keys[0] and got_v is cache.values[0], "StaticCache.update returns its own buffers"

    cache.reset()
    forward(cache, [[0, 1, 2]])
    forward(cache, [[3]])
    forward(cache, [[4, 5]])
    assert ring_keys(cache) == [0, 1, 2, 3, 4, 5]
    assert cache.values[1][0, 0, :, 0].tolist() == [-100, -101, -102, -103, -104, -105]
    assert cached_positions(cache) == [0, 1, 2, 3, 4, 5]
    assert int(cache.length) == 6
    assert pointers(cache) == ptrs


def test_ring_decode_writes_slot_column_mod_window_through_wraps():
    window = 4
    cache = SlidingWindowCache(tiny_config(window=window), batch_size=1, max_cache_len=100)
    ptrs = pointers(cache)
    wraps = 0
    for p in range(15):  # 15 tokens one by one: the ring wraps at 4, 8 and 12
        before = ring_keys(cache)
        attended, keys = forward(cache, [[p]])
        slot = p % window
        wraps += p > 0 and slot == 0
        expected = before.copy()
        expected[slot] = p  # exactly one slot changed
        assert ring_keys(cache) == expected, f"position {p}"
        assert cached_positions(cache)[slot] == p
        assert attended.tolist() == [cached_positions(cache)], "a decode step attends the ring after its own write"
        assert ring_keys(cache, layer=1)[slot] == p
        assert torch.equal(keys[1], cache.keys[1]), "a decode step reads the ring buffer itself"
        assert int(cache.length) == p + 1
    assert wraps == 3
    # After 15 tokens (0..14) the slots hold [12, 13, 14, 11]; after 10 they held [8, 9, 6, 7].
    assert ring_keys(cache) == [12, 13, 14, 11]
    assert cached_positions(cache) == [12, 13, 14, 11]
    assert pointers(cache) == ptrs


def test_ring_snapshot_after_ten_tokens():
    cache = SlidingWindowCache(tiny_config(window=4), batch_size=1, max_cache_len=100)
    for p in range(10):
        forward(cache, [[p]])
    assert ring_keys(cache) == [8, 9, 6, 7]
    assert cache.values[0][0, 0, :, 0].tolist() == [-8, -9, -6, -7]
    assert cached_positions(cache) == [8, 9, 6, 7]


def test_prefill_longer_than_window_keeps_last_window_in_their_slots():
    cache = SlidingWindowCache(tiny_config(window=4), batch_size=1, max_cache_len=100)
    ptrs = pointers(cache)

    # 6 tokens into an empty ring of 4: attention reads the (empty) ring plus all 6 new tokens.
    attended, keys = forward(cache, [[0, 1, 2, 3, 4, 5]])
    assert attended.tolist() == [[EMPTY] * 4 + [0, 1, 2, 3, 4, 5]]
    assert keys[0][0, 0, :, 0].tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5]
    assert keys[1][0, 0, :, 0].tolist() == [0, 0, 0, 0, 100, 101, 102, 103, 104, 105]
    assert ring_keys(cache) == [4, 5, 2, 3]  # columns 2..5 in slots 2, 3, 0, 1
    assert cached_positions(cache) == [4, 5, 2, 3]
    assert int(cache.length) == 6

    # A 3-token chunk on a ring with content: attention reads the old ring, then the new tokens.
    attended, keys = forward(cache, [[6, 7, 8]])
    assert attended.tolist() == [[4, 5, 2, 3, 6, 7, 8]]
    assert keys[0][0, 0, :, 0].tolist() == [4, 5, 2, 3, 6, 7, 8]
    assert ring_keys(cache) == [8, 5, 6, 7]  # columns 6, 7, 8 -> slots 2, 3, 0
    assert cached_positions(cache) == [8, 5, 6, 7]

    forward(cache, [[9]])
    assert ring_keys(cache) == [8, 9, 6, 7]
    assert int(cache.length) == 10

    # More than two windows at once: only the last 4 (columns 7..10) survive, each in slot column % 4.
    cache.reset()
    attended, _ = forward(cache, [list(range(11))])
    assert attended.tolist() == [[EMPTY] * 4 + list(range(11))]
    assert ring_keys(cache) == [8, 9, 10, 7]
    assert cached_positions(cache) == [8, 9, 10, 7]
    assert int(cache.length) == 11
    assert pointers(cache) == ptrs


def test_left_padded_rows_map_columns_to_slots_and_padding_is_never_visible():
    window = 4
    cache = SlidingWindowCache(tiny_config(window=window), batch_size=2, max_cache_len=100)
    # Row 0 has two pads, so its position = column - 2; row 1 is unpadded. Padding positions are -1.
    attended, _ = forward(cache, [[-1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    assert attended.tolist() == [[EMPTY] * 4 + [-1, -1, 0, 1, 2, 3], [EMPTY] * 4 + [0, 1, 2, 3, 4, 5]]
    assert cached_positions(cache, row=0) == [2, 3, 0, 1]  # columns 2..5 -> slots 2, 3, 0, 1
    assert cached_positions(cache, row=1) == [4, 5, 2, 3]
    assert ring_keys(cache, row=0) == [2, 3, 0, 1]

    static = StaticCache(tiny_config(window=window), batch_size=2, max_cache_len=6)
    forward(static, [[-1, -1, 0], [0, 1, 2]])
    assert cached_positions(static, row=0) == [EMPTY, EMPTY, 0, EMPTY, EMPTY, EMPTY]
    new = torch.tensor([[1], [3]], dtype=torch.int32)
    keys_pos = static.attended_positions(new)  # [2, 6]
    visible = attention_visibility(new, keys_pos, torch.ones_like(new, dtype=torch.bool), window)[:, 0, 0]
    assert keys_pos[0].tolist() == [EMPTY, EMPTY, 0, 1, EMPTY, EMPTY]
    assert visible[0].tolist() == [False, False, True, True, False, False], "pads and empty slots are invisible"
    assert visible[1].tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
def test_window_rule_sees_exactly_the_last_window_positions(kind):
    """From the cache's positions, a query at q sees keys q - W < k <= q: exactly W once q >= W - 1.

    With head_dim 1, a zero query (uniform scores) and V = position, attention returns the mean visible position.
    """
    window = 4
    cache = make_cache(kind, tiny_config(window=window), batch_size=1, max_cache_len=20)
    forward(cache, [[0, 1, 2]])
    for q in range(3, 20):
        new = torch.tensor([[q]], dtype=torch.int32)
        key_positions = cache.attended_positions(new)  # [1, Lkv]
        visible = attention_visibility(new, key_positions, torch.ones(1, 1, dtype=torch.bool), window)  # [1,1,1,L]
        seen = sorted(key_positions[0][visible[0, 0, 0]].tolist())
        assert seen == list(range(q - window + 1, q + 1)), f"{kind}: query {q} sees {seen}"
        k, v = key_value(new, 0)
        keys, values = cache.update(0, k, v)
        for layer in range(1, cache.num_layers):
            cache.update(layer, *key_value(new, layer))
        cache.advance(new)
        out = F.scaled_dot_product_attention(torch.zeros(1, 1, 1, 1), keys, -values, attn_mask=visible)
        assert out.item() == pytest.approx(q - (window - 1) / 2, abs=1e-5), f"{kind}: query {q}"


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
def test_reset_then_reuse_equals_fresh_cache(kind):
    config = tiny_config(window=4)
    used, fresh = make_cache(kind, config, 2, 16), make_cache(kind, config, 2, 16)
    ptrs = pointers(used)
    script = [[[-1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]], [[5], [6]], [[6, 7], [7, 8]], [[8], [9]]]
    for step in script:
        forward(used, step)
    assert int(used.length) == 10 and not torch.equal(used.keys[0], fresh.keys[0])

    used.reset()
    for a, b in zip(buffers(used), buffers(fresh)):
        assert torch.equal(a, b), "reset() must restore the empty state"
    for step in script:
        got_used, got_fresh = forward(used, step), forward(fresh, step)
        assert torch.equal(got_used[0], got_fresh[0])
        for a, b in zip(got_used[1], got_fresh[1]):
            assert torch.equal(a, b)
    for a, b in zip(buffers(used), buffers(fresh)):
        assert torch.equal(a, b), "a reset cache must behave exactly like a fresh one"
    assert pointers(used) == ptrs


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
@pytest.mark.parametrize("max_cache_len", [16, 8192], ids=["plain_zeros", "huge_page_arena"])
def test_a_cache_holds_plain_tensors_wherever_it_is_built(kind, max_cache_len):
    """generate builds its cache inside inference mode; make_cache, README's API and the JAX handoff build one outside
    it. dynamo guards on a tensor's inference-ness, so caches of the two kinds compiled the same decode step twice
    (toward its recompile limit), and an inference tensor cannot be written outside inference mode: every cache
    holds plain tensors. 8,192 slots x 64 floats are 2 MiB a buffer: the huge-page arena (host_buffers)."""
    config = tiny_config(window=4, head_dim=64)
    with torch.inference_mode():
        inside = make_cache(kind, config, 1, max_cache_len)
    outside = make_cache(kind, config, 1, max_cache_len)
    assert [t.is_inference() for t in buffers(inside)] == [False] * len(buffers(inside))
    assert [t.is_inference() for t in buffers(outside)] == [False] * len(buffers(outside))
    inside.reset()  # written outside inference mode: refused on an inference tensor
    assert int(inside.length) == 0
