"""Property-based tests of the KV caches against a plain Python reference (docs/design.md §2, §3).

Random sequences of cache operations -- left-padded prefills of random lengths (some longer than the window),
multi-token extends, decode steps, resets -- drive a cache through the model's forward protocol
(attended_positions -> update per layer -> advance) with tiny shapes and random K/V. A reference keeps, per row,
the list of (column, position, k, v) ever written and derives everything from the window rule: a key at position k
is visible to a query at q iff k >= 0 and q - W < k <= q; padding is never visible. After every operation:

* per query, the multiset of (position, k, v) that the attention mask (the backend's `attention_visibility` over the
  positions `attended_positions` returned) selects from the K/V that `update` returned equals the reference's. Where
  `attended_positions` covers L + S columns (a JAX forward that reads before it writes), the K/V attended are, by
  `update`'s contract, the buffers as they were followed by the new tokens' K/V: the adapter takes those; that the
  model attends over them is the parity tests' to judge;
* the buffers hold exactly the reference's retained tokens (the last cache_len columns) with their positions, and
  `length` counts the columns written;
* a write past a bounded cache's capacity is refused with CacheError and changes nothing;
* after reset() every buffer equals a fresh cache's.

Backends plug in through a small adapter (numpy in, numpy out): TorchAdapter and JaxAdapter, both enabled in
BACKENDS.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twincache.config import MistralConfig
from twincache.errors import CacheError

BACKENDS = ["torch", "jax"]
EXAMPLES = {"torch": 60, "jax": 18}  # JAX runs these tiny ops eagerly, compiling each new shape: ~0.5 s an example

HEAD_DIM = 2  # the smallest even head_dim the config accepts


# --- backend adapters: numpy in, numpy out ---------------------------------------------------------------------------


@dataclasses.dataclass
class CacheState:
    keys: list[np.ndarray]  # per layer [B, Hkv, L, D]
    values: list[np.ndarray]  # per layer [B, Hkv, L, D]
    slot_positions: np.ndarray  # [B, L]
    length: int

    def assert_equal(self, other: CacheState) -> None:
        assert self.length == other.length
        np.testing.assert_array_equal(self.slot_positions, other.slot_positions)
        assert len(self.keys) == len(other.keys)
        for mine, theirs in zip(self.keys + self.values, other.keys + other.values):
            np.testing.assert_array_equal(mine, theirs)


class TorchAdapter:
    """torch_cache: in-place caches; `forward` returns the cache object it was given."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        from torch_cache import cache as cache_module
        from torch_cache.model import attention_visibility

        self.torch, self.cache_module, self.attention_visibility = torch, cache_module, attention_visibility

    def make(self, kind: str, config: MistralConfig, batch: int, max_cache_len: int):
        return self.cache_module.make_cache(kind, config, batch, max_cache_len)

    def forward(self, cache, new_positions: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]]):
        """One forward's cache traffic. Returns (cache, key_positions [B, Lkv], [(keys, values)] per layer)."""
        torch = self.torch
        positions = torch.from_numpy(new_positions)
        key_positions = cache.attended_positions(positions).numpy().copy()
        attended = []
        for layer_idx, (k, v) in enumerate(kv):
            keys, values = cache.update(layer_idx, torch.from_numpy(k), torch.from_numpy(v))
            attended.append((keys.numpy().copy(), values.numpy().copy()))  # static returns the live buffers: copy now
        cache.advance(positions)
        return cache, key_positions, attended

    def visibility(self, query_positions: np.ndarray, key_positions: np.ndarray, query_valid: np.ndarray,
                   window: int | None) -> np.ndarray:
        torch = self.torch
        visible = self.attention_visibility(torch.from_numpy(query_positions).long(), torch.from_numpy(key_positions),
                                            torch.from_numpy(query_valid), window)
        return visible.numpy()[:, 0]  # [B, S, Lkv]

    def reset(self, cache):
        cache.reset()
        return cache

    def state(self, cache) -> CacheState:
        return CacheState([k.numpy().copy() for k in cache.keys], [v.numpy().copy() for v in cache.values],
                          cache.slot_positions.numpy().copy(), int(cache.length))

    def update_raw(self, cache, layer_idx: int, k: np.ndarray, v: np.ndarray, device: str | None = None):
        """A bare `update` call, for the refusal tests; `device` moves the states (e.g. "meta")."""
        torch = self.torch
        key_states, value_states = torch.from_numpy(k), torch.from_numpy(v)
        if device is not None:
            key_states, value_states = key_states.to(device), value_states.to(device)
        cache.update(layer_idx, key_states, value_states)

    def check_forward(self, cache, config: MistralConfig, input_ids: np.ndarray) -> None:
        torch = self.torch
        cache.check_forward(config, torch.from_numpy(input_ids), torch.float32, torch.device("cpu"))

    def positions(self, new_positions: np.ndarray):
        return self.torch.from_numpy(new_positions)


class JaxAdapter:
    """jax_cache: functional caches; `update`/`advance`/`reset` return the new cache."""

    name = "jax"

    def __init__(self) -> None:
        import jax.numpy as jnp

        from jax_cache import cache as cache_module
        from jax_cache.model import attention_visibility

        self.jnp, self.cache_module, self.attention_visibility = jnp, cache_module, attention_visibility

    def make(self, kind: str, config: MistralConfig, batch: int, max_cache_len: int):
        return self.cache_module.make_cache(kind, config, batch, max_cache_len)

    def forward(self, cache, new_positions: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]]):
        jnp = self.jnp
        positions = jnp.asarray(new_positions)
        key_positions = np.asarray(cache.attended_positions(positions))
        reads_before_writing = key_positions.shape[1] == cache.cache_len + positions.shape[1]
        attended = []
        for layer_idx, (k, v) in enumerate(kv):
            if reads_before_writing:  # the buffers as they were, then the new tokens (jax_cache.model.DecoderLayer)
                attended.append((np.concatenate([np.asarray(cache.keys[layer_idx]), k], axis=2),
                                 np.concatenate([np.asarray(cache.values[layer_idx]), v], axis=2)))
            keys, values, cache = cache.update(layer_idx, jnp.asarray(k), jnp.asarray(v))
            if not reads_before_writing:
                attended.append((np.asarray(keys), np.asarray(values)))
        return cache.advance(positions), key_positions, attended

    def visibility(self, query_positions: np.ndarray, key_positions: np.ndarray, query_valid: np.ndarray,
                   window: int | None) -> np.ndarray:
        jnp = self.jnp
        visible = self.attention_visibility(jnp.asarray(query_positions), jnp.asarray(key_positions),
                                            jnp.asarray(query_valid), window)
        return np.asarray(visible)[:, 0]  # [B, S, Lkv]

    def reset(self, cache):
        return cache.reset()

    def state(self, cache) -> CacheState:
        return CacheState([np.asarray(k) for k in cache.keys], [np.asarray(v) for v in cache.values],
                          np.asarray(cache.slot_positions), int(cache.length))

    def update_raw(self, cache, layer_idx: int, k: np.ndarray, v: np.ndarray, device: str | None = None):
        cache.update(layer_idx, self.jnp.asarray(k), self.jnp.asarray(v))

    def check_forward(self, cache, config: MistralConfig, input_ids: np.ndarray) -> None:
        cache.check_forward(config, self.jnp.asarray(input_ids), self.jnp.float32, cache.device)

    def positions(self, new_positions: np.ndarray):
        return self.jnp.asarray(new_positions)


ADAPTERS = {"torch": TorchAdapter, "jax": JaxAdapter}


@pytest.fixture(scope="module", params=BACKENDS)
def adapter(request):
    return ADAPTERS[request.param]()


# --- the reference --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    column: int
    position: int
    keys: tuple  # per layer: the [Hkv * D] key as a tuple of floats
    values: tuple


class Reference:
    """Per row, every token written since the last reset; visibility straight from the window rule."""

    def __init__(self, batch: int, window: int | None, cache_len: int, capacity: int | None) -> None:
        self.batch, self.window, self.cache_len, self.capacity = batch, window, cache_len, capacity
        self.reset()

    def reset(self) -> None:
        self.rows: list[list[Entry]] = [[] for _ in range(self.batch)]
        self.columns = 0

    def next_position(self, row: int) -> int:
        return self.rows[row][-1].position + 1 if self.rows[row] else 0

    def fits(self, num_new: int) -> bool:
        return self.capacity is None or self.columns + num_new <= self.capacity

    def write(self, new_positions: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for row in range(self.batch):
            for s, position in enumerate(new_positions[row]):
                if position >= 0:
                    self.rows[row].append(Entry(
                        self.columns + s, int(position),
                        tuple(tuple(k[row, :, s].ravel().tolist()) for k, _ in kv),
                        tuple(tuple(v[row, :, s].ravel().tolist()) for _, v in kv)))
        self.columns += new_positions.shape[1]

    def visible(self, row: int, query: int, layer: int) -> list[tuple]:
        low = -1 if self.window is None else max(-1, query - self.window)
        return sorted((e.position, e.keys[layer], e.values[layer]) for e in self.rows[row]
                      if low < e.position <= query)

    def retained(self, row: int, layer: int) -> list[tuple]:
        first_kept = self.columns - self.cache_len
        return sorted((e.position, e.keys[layer], e.values[layer]) for e in self.rows[row] if e.column >= first_kept)


# --- one operation through backend and reference, then every check ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    kind: str
    num_layers: int
    kv_heads: int
    window: int | None
    batch: int
    max_cache_len: int

    def config(self) -> MistralConfig:
        return MistralConfig(vocab_size=8, hidden_size=4, intermediate_size=4, num_hidden_layers=self.num_layers,
                             num_attention_heads=self.kv_heads, num_key_value_heads=self.kv_heads, head_dim=HEAD_DIM,
                             sliding_window=self.window)


def gather(key_positions: np.ndarray, attended: tuple[np.ndarray, np.ndarray], mask: np.ndarray,
           row: int) -> list[tuple]:
    """The (position, k, v) multiset, sorted, that one query's mask row selects."""
    keys, values = attended
    return sorted((int(key_positions[row, j]), tuple(keys[row, :, j].ravel().tolist()),
                   tuple(values[row, :, j].ravel().tolist())) for j in np.flatnonzero(mask))


def check_state(adapter, cache, ref: Reference, setup: Setup) -> None:
    state = adapter.state(cache)
    assert state.length == ref.columns
    for row in range(setup.batch):
        held = np.flatnonzero(state.slot_positions[row] >= 0)
        for layer in range(setup.num_layers):
            got = sorted((int(state.slot_positions[row, j]), tuple(state.keys[layer][row, :, j].ravel().tolist()),
                          tuple(state.values[layer][row, :, j].ravel().tolist())) for j in held)
            assert got == ref.retained(row, layer), f"row {row} layer {layer}: buffers differ from the reference"


class Runner:
    """Applies operations to a backend cache and the reference together, checking after each."""

    def __init__(self, adapter, setup: Setup, seed: int) -> None:
        self.adapter, self.setup = adapter, setup
        self.rng = np.random.default_rng(seed)
        self.cache = adapter.make(setup.kind, setup.config(), setup.batch, setup.max_cache_len)
        self.fresh = adapter.state(adapter.make(setup.kind, setup.config(), setup.batch, setup.max_cache_len))
        cache_len = self.fresh.slot_positions.shape[1]
        window = setup.window if setup.kind == "sliding_window" else None
        expected_len = setup.max_cache_len if window is None else min(window, setup.max_cache_len)
        assert cache_len == expected_len
        capacity = None if setup.kind == "sliding_window" and cache_len == setup.window else setup.max_cache_len
        self.ref = Reference(setup.batch, setup.window, cache_len, capacity)

    def prefill(self, lengths: list[int]) -> None:
        """A left-padded first forward: row r holds lengths[r] real tokens."""
        assert self.ref.columns == 0
        width = max(lengths)
        mask = np.array([[0] * (width - n) + [1] * n for n in lengths], dtype=np.int32)  # [B, T]
        self._forward(np.cumsum(mask, axis=1) - 1, mask.astype(bool))

    def extend(self, num_new: int) -> None:
        """num_new more tokens per row (a decode step when 1), positions continuing each row."""
        starts = np.array([[self.ref.next_position(r)] for r in range(self.setup.batch)])
        self._forward(starts + np.arange(num_new)[None], np.ones((self.setup.batch, num_new), dtype=bool))

    def reset(self) -> None:
        self.cache = self.adapter.reset(self.cache)
        self.ref.reset()
        self.adapter.state(self.cache).assert_equal(self.fresh)

    def _forward(self, positions: np.ndarray, valid: np.ndarray) -> None:
        setup, adapter = self.setup, self.adapter
        positions = positions.astype(np.int32)  # [B, S]; padding queries carry -1, as positions_from_mask gives
        new_positions = np.where(valid, positions, -1).astype(np.int32)  # padding is never a key
        num_new = positions.shape[1]
        kv = [tuple(self.rng.standard_normal((setup.batch, setup.kv_heads, num_new, HEAD_DIM)).astype(np.float32)
                    for _ in range(2)) for _ in range(setup.num_layers)]
        if not self.ref.fits(num_new):
            before = adapter.state(self.cache)
            with pytest.raises(CacheError, match="capacity"):
                adapter.forward(self.cache, new_positions, kv)
            adapter.state(self.cache).assert_equal(before)  # a refused write changes nothing
            return
        self.cache, key_positions, attended = adapter.forward(self.cache, new_positions, kv)
        self.ref.write(new_positions, kv)
        visible = adapter.visibility(positions, key_positions, valid, setup.window)  # [B, S, Lkv]
        assert visible.shape == (setup.batch, num_new, key_positions.shape[1])
        for keys, values in attended:
            assert keys.shape[2] == values.shape[2] == key_positions.shape[1]
        for row in range(setup.batch):
            for s in np.flatnonzero(valid[row]):
                query = int(positions[row, s])
                for layer in range(setup.num_layers):
                    got = gather(key_positions, attended[layer], visible[row, s], row)
                    assert got == self.ref.visible(row, query, layer), (
                        f"row {row} query position {query} layer {layer}: visible keys differ from the reference")
        check_state(adapter, self.cache, self.ref, setup)


# --- hypothesis -----------------------------------------------------------------------------------------------------


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    kind = draw(st.sampled_from(["static", "sliding_window"]))
    window = draw(st.integers(1, 6)) if kind == "sliding_window" else draw(st.none() | st.integers(1, 6))
    return Setup(kind=kind, num_layers=draw(st.integers(1, 2)), kv_heads=draw(st.integers(1, 2)), window=window,
                 batch=draw(st.integers(1, 3)), max_cache_len=draw(st.integers(1, 16)))


def test_random_operations_match_reference(adapter):
    @settings(max_examples=EXAMPLES[adapter.name], deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=setups(), seed=st.integers(0, 2**32 - 1), data=st.data())
    def check(setup: Setup, seed: int, data: st.DataObject) -> None:
        runner = Runner(adapter, setup, seed)
        for _ in range(data.draw(st.integers(1, 10), label="operations")):
            if runner.ref.columns == 0:
                op = data.draw(st.sampled_from(["prefill", "prefill", "reset"]), label="op")
            else:
                op = data.draw(st.sampled_from(["decode", "decode", "decode", "extend", "reset"]), label="op")
            if op == "prefill":
                width = data.draw(st.integers(1, 12), label="prompt width")
                lengths = data.draw(st.lists(st.integers(1, width), min_size=setup.batch, max_size=setup.batch),
                                    label="row lengths")
                lengths[data.draw(st.integers(0, setup.batch - 1), label="longest row")] = width  # as left_pad does
                runner.prefill(lengths)
            elif op == "decode":
                for _ in range(data.draw(st.integers(1, 8), label="decode steps")):
                    runner.extend(1)
            elif op == "extend":
                runner.extend(data.draw(st.integers(2, 10), label="extend length"))
            else:
                runner.reset()

    check()


# --- scripted sequences: the edges are covered whatever hypothesis draws ----------------------------------------------


@pytest.mark.parametrize("setup", [
    Setup("sliding_window", num_layers=2, kv_heads=2, window=4, batch=3, max_cache_len=64),  # ring = window
    Setup("sliding_window", num_layers=1, kv_heads=1, window=1, batch=2, max_cache_len=64),  # W = 1: self only
    Setup("sliding_window", num_layers=1, kv_heads=2, window=6, batch=2, max_cache_len=14),  # ring shorter than W
    Setup("static", num_layers=2, kv_heads=1, window=4, batch=3, max_cache_len=20),  # static + sliding mask
    Setup("static", num_layers=1, kv_heads=1, window=None, batch=2, max_cache_len=20),  # full attention
], ids=lambda s: f"{s.kind}-W{s.window}-L{s.max_cache_len}")
def test_scripted_wraps_padding_and_reset(adapter, setup: Setup):
    runner = Runner(adapter, setup, seed=7)
    for _ in range(2):  # the second round proves reset() leaves nothing behind
        runner.prefill([9, 3, 6][:setup.batch])  # longer than the window, different left padding per row
        for _ in range(9):  # decode across several ring wraps
            runner.extend(1)
        runner.extend(5)  # a multi-token chunk after decoding; refused where it would pass the capacity
        runner.extend(1)
        runner.reset()
    assert runner.ref.columns == 0


# --- API-level refusals: a refused call leaves the cache unchanged ---------------------------------------------------


REFUSALS = {
    "batch": (lambda s: dict(batch=s.batch + 1), "cache needs"),
    "kv_heads": (lambda s: dict(heads=s.kv_heads + 1), "cache needs"),
    "head_dim": (lambda s: dict(head_dim=HEAD_DIM + 2), "cache needs"),
    "dtype": (lambda s: dict(dtype=np.float16), "dtype"),
    "layer_idx": (lambda s: dict(layer_idx=s.num_layers), "layer_idx"),
    "negative_layer_idx": (lambda s: dict(layer_idx=-1), "layer_idx"),
    "past_capacity": (lambda s: dict(seq=s.max_cache_len - 2), "capacity"),  # 3 written + 4 > 6
    "device": (lambda s: dict(device="meta"), "meta"),
}


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_update_leaves_cache_unchanged(adapter, kind: str, case: str):
    if case == "device" and not isinstance(adapter, TorchAdapter):
        case = "dtype"  # JAX arrays carry no per-call device choice here; the dtype refusal stands in
    # A ring shorter than the window is bounded by max_cache_len like a static cache, so both refuse past 6 columns.
    setup = Setup(kind, num_layers=2, kv_heads=2, window=8, batch=2, max_cache_len=6)
    runner = Runner(adapter, setup, seed=3)
    runner.prefill([3, 2])  # non-empty state, so "unchanged" is not trivially "empty"
    before = adapter.state(runner.cache)
    change, message = REFUSALS[case]
    args = dict(batch=setup.batch, heads=setup.kv_heads, seq=1, head_dim=HEAD_DIM, dtype=np.float32, layer_idx=0,
                device=None) | change(setup)
    k = np.ones((args["batch"], args["heads"], args["seq"], args["head_dim"]), dtype=args["dtype"])
    with pytest.raises(CacheError, match=message):
        adapter.update_raw(runner.cache, args["layer_idx"], k, k * 2, device=args["device"])
    adapter.state(runner.cache).assert_equal(before)


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_key_value_heads", "head_dim"])
def test_cache_from_another_model_is_refused(adapter, field: str):
    setup = Setup("sliding_window", num_layers=2, kv_heads=2, window=4, batch=1, max_cache_len=8)
    runner = Runner(adapter, setup, seed=5)
    runner.prefill([2])
    before = adapter.state(runner.cache)
    other = dataclasses.replace(setup.config(), **{field: getattr(setup.config(), field) * 2},
                                num_attention_heads=setup.kv_heads * 2)
    with pytest.raises(CacheError, match="build the cache from this model's config"):
        adapter.check_forward(runner.cache, other, np.zeros((1, 1), dtype=np.int64))
    adapter.state(runner.cache).assert_equal(before)


def test_a_checked_call_reads_the_length_from_the_device_once(adapter, monkeypatch):
    """Each host read of `length` is a device sync (torch) or a device-to-host copy (JAX). A direct call checks its
    write before it writes, and attended_positions checks its attend_len too: both checks share one read. Counted by
    wrapping the array type's int(), so the count does not depend on the machine."""
    setup = Setup("static", num_layers=1, kv_heads=1, window=None, batch=1, max_cache_len=8)
    cache = adapter.make(setup.kind, setup.config(), setup.batch, setup.max_cache_len)
    new_positions = adapter.positions(np.array([[0]], dtype=np.int32))  # [B, 1]
    length_type = type(cache.length)
    reads = []
    real_int = length_type.__int__
    monkeypatch.setattr(length_type, "__int__", lambda array: reads.append(array is cache.length) or real_int(array))
    cache.attended_positions(new_positions, attend_len=4)
    assert reads == [True], f"{len(reads)} host reads of length (one expected)"
    reads.clear()
    with pytest.raises(CacheError, match="attend_len=9 must cover"):  # the check the shared read still feeds
        cache.attended_positions(new_positions, attend_len=9)
    assert reads == [True]
