"""jax_cache.generate: traces and compiles, buffer donation, stale-cache errors, refused bad writes, fused vs step
decoding, sampling, per-row EOS and prompt buckets. All on the tiny transformers-written checkpoints (window 8).

Trace and compile counts start from `jax.clear_caches()`, so they are exact whatever ran before in the process, and
a counting wrapper around `_forward_last` (what every jitted entry point traces) counts traces by sequence length.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cache.generate as jg
from jax_cache.cache import StaticCache, make_cache
from jax_cache.model import Mistral
from parity_tests.conftest import WINDOW, save_hf_checkpoint
from parity_tests.hf_greedy import greedy
from parity_tests.mesh_jax_worker import written_in_place
from twincache.errors import CacheError, InputError, StaleCacheError
from twincache.generation import SamplingParams

VOCAB = 128
NEW_TOKENS = 30  # from the prompts below, decoding writes ring slot 0 again at least 3 times
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)


def make_prompt(length: int, seed: int = 2) -> list[int]:
    return np.random.default_rng(1000 * seed + length).integers(1, VOCAB, length).tolist()


PROMPTS = [make_prompt(13), make_prompt(3)]  # longer and shorter than the window, left-padded together


def decode_wraps(prompt_len: int, new_tokens: int, window: int = WINDOW) -> int:
    """Times decoding writes ring slot 0 again: decode steps write positions prompt_len .. prompt_len+new-2."""
    return sum(1 for p in range(prompt_len, prompt_len + new_tokens - 1) if p % window == 0)


@pytest.fixture(scope="module")
def model(checkpoints: dict[str, Path]) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"], jnp.float32)


def count_forward_traces(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[int]:
    """From now on, count traces of the model forward by sequence length (a prefill chunk or bucket, or 1)."""
    counts: collections.Counter[int] = collections.Counter()
    original = jg._forward_last

    def counting(graphdef, state, cache, input_ids, positions, attention_mask, attend_len):
        counts[input_ids.shape[1]] += 1
        return original(graphdef, state, cache, input_ids, positions, attention_mask, attend_len)

    monkeypatch.setattr(jg, "_forward_last", counting)
    return counts


@pytest.fixture
def traces(monkeypatch):
    """Clear every jit cache and the memoised fused executables, then count traces of the model forward by sequence
    length (prefill bucket or 1). Sizes come from buffer shapes, so an earlier test's executable could match."""
    jax.clear_caches()
    jg._fused_executables.clear()
    yield count_forward_traces(monkeypatch)
    chex.clear_trace_counter()


def leaves(cache: StaticCache) -> list[jax.Array]:
    return [*cache.keys, *cache.values, cache.slot_positions, cache.length]


def pointers(cache: StaticCache) -> list[int]:
    return [array.unsafe_buffer_pointer() for array in written_in_place(cache)]


def aliased_parameters(hlo: str) -> list[int]:
    """Parameter numbers of a compiled module that share a buffer with one of its outputs (its input_output_alias)."""
    header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
    return [int(number) for number in re.findall(r"\{[\d, ]*\}: \((\d+), \{[\d, ]*\}, \w+-alias\)", header)]


def prefilled(model: Mistral, kind: str, prompts: list[list[int]], max_cache_len: int) -> tuple[jax.Array, StaticCache]:
    """A cache of `kind` after prefilling the left-padded prompts (no bucket). Returns (last logits, cache)."""
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, ids.shape[1] - len(prompt):], mask[row, ids.shape[1] - len(prompt):] = prompt, 1
    cache = make_cache(kind, model.config, len(prompts), max_cache_len)
    return jg.prefill(model, jnp.asarray(ids), jnp.asarray(mask), cache)


def compiled_counts() -> tuple[int, ...]:
    return (jg._decode_step._cache_size(), jg._prefill._cache_size(), jg._sampled_step._cache_size(),
            len(jg._fused_executables))


def donation_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "donat" in str(w.message).lower()]


# --- donation (these tests clear the jit caches, so each compile they check happens inside them) ----------------------

@pytest.mark.parametrize(("kind", "max_cache_len"), [("static", 40), ("sliding_window", 64)])
def test_decode_steps_update_the_cache_in_place_by_donation(model, traces, kind, max_cache_len):
    """Every step of a loop that wraps the window 3 times returns the buffers it was given; no donation warning."""
    _, cache = prefilled(model, kind, PROMPTS, max_cache_len)
    step = jg.decode_step_fn(model)
    tokens = jnp.asarray([[3], [4]], jnp.int32)
    positions = cache.next_positions()[:, None]  # [B, 1]
    first = pointers(cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3 * WINDOW + 1):
            inputs = written_in_place(cache)
            logits, cache = step(tokens, positions, cache)
            assert pointers(cache) == first, f"a decode step moved the cache buffers: {first} -> {pointers(cache)}"
            assert all(array.is_deleted() for array in inputs), "the input cache must be consumed by donation"
            tokens, positions = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], positions + 1
    assert jg._decode_step._cache_size() == 1 and traces[1] == 1, "one compile of the step, inside the loop above"
    assert donation_warnings(caught) == []
    assert logits.shape == (2, VOCAB) and int(cache.length) == 13 + 3 * WINDOW + 1
    graph, params = jg.split_model(model)
    hlo = jg._decode_step.lower(graph, params, cache, tokens, positions, None).compile().as_text()
    first_cache_parameter = len(jax.tree_util.tree_leaves(params))  # the step's arguments: params, then the cache
    assert aliased_parameters(hlo) == list(range(first_cache_parameter, first_cache_parameter + len(leaves(cache)))), \
        "every cache array, the length included, is donated to the step's output and nothing else is"


@pytest.mark.parametrize("fused", [True, False])
def test_a_cache_given_to_generate_is_emptied_in_place_and_consumed(model, fused):
    """generate(cache=c) empties c by donation, as torch's reset() empties its own in place: c is consumed, and the
    result's cache holds c's buffers, so a server reusing one cache holds one cache's memory, not two."""
    cache = make_cache("static", model.config, 2, 40)
    first = pointers(cache)  # the K/V and slot_positions (the length scalar: see written_in_place)
    result = jg.generate(model, PROMPTS, 4, cache=cache, fused=fused)
    assert all(array.is_deleted() for array in written_in_place(cache)), "the given cache must be consumed"
    assert pointers(result.cache) == first, "the result's cache must hold the given cache's buffers"
    length = int(result.cache.length)
    again = jg.generate(model, PROMPTS, 4, cache=result.cache, fused=fused)
    assert again.token_ids == result.token_ids and int(again.cache.length) == length
    assert pointers(again.cache) == first


def buffer_copies(hlo: str, buffer_shape: tuple[int, ...]) -> list[str]:
    """Lines of optimized HLO that copy an array of the K/V buffer's shape."""
    shape = "[" + ",".join(map(str, buffer_shape)) + "]"
    return [line.strip() for line in hlo.splitlines() if " copy(" in line and shape in line.split(" copy(")[0]]


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory: pytest.TempPathFactory) -> Mistral:
    """As many KV heads as query heads (the bench's `long` preset is such a model): one query row per KV head."""
    directory = save_hf_checkpoint(tmp_path_factory.mktemp("mha"), seed=3, num_key_value_heads=4)
    return Mistral.from_pretrained(directory, jnp.float32)


@pytest.fixture(scope="module")
def window_64_model(tmp_path_factory: pytest.TempPathFactory) -> Mistral:
    """Grouped heads and a 64-token window: a ring long enough for an attention bucket (16 of its 64 slots)."""
    directory = save_hf_checkpoint(tmp_path_factory.mktemp("window_64"), seed=4, sliding_window=64)
    return Mistral.from_pretrained(directory, jnp.float32)


COPY_TEST_MODELS = {"gqa": "model", "mha": "mha_model", "gqa_w64": "window_64_model"}


# Each regression's own case (grouped heads through a dot over the whole buffer; one query row per KV head over a
# prefix, `long`'s), each cache kind and a prefix for both head layouts: 5 of the 8 of the product at batch 1; then
# batches of 2 and 3 over a prefix (static, a ring of the whole window, one-to-one heads) and over a whole ring.
@pytest.mark.parametrize(("heads", "kind", "cache_len", "attend_len", "batch"),
                         [("gqa", "static", 48, None, 1), ("gqa", "static", 48, 16, 1),
                          ("gqa", "sliding_window", 48, None, 1), ("mha", "static", 1024, 64, 1),
                          ("mha", "sliding_window", 48, None, 1),
                          ("gqa", "static", 48, 16, 2), ("gqa_w64", "sliding_window", 64, 16, 2),
                          ("mha", "static", 1024, 64, 3), ("gqa", "sliding_window", 48, None, 2)])
def test_compiled_decode_copies_no_kv_buffer(request, heads, kind, cache_len, attend_len, batch):
    """In place means no hidden copies either: XLA-CPU copied each K/V buffer 4 times per step when attention read
    the freshly updated buffer through a dot, at batch 1 (64 MB per step on the small bench's 2066-slot cache), and
    twice when it read a prefix of it by multiply-and-sum with one query row per KV head (the `long` bench preset:
    65 ms per step for a 256-slot bucket of a 16k cache). Whole buffers and prefixes (an attention bucket of 16 of
    the 48 slots, 64 of 1024), grouped and one-to-one heads: no copy of a K/V buffer. A step over every slot reads
    the buffers before its write, which depends on the layer's output: without that dependency XLA copied them. A
    fused block on a ring (the window's 8 of 48 slots) also reads the slot each step writes, for its undo log, before
    the write, which depends on the log (jax_cache.generate._logged): without that dependency XLA copied every buffer
    twice per step. From batch 2 a prefix's halves are read through a bitcast, as batch 1's are: read by bare slices,
    XLA fused the buffer's update into them and copied every K/V buffer twice per step (docs/design.md §7.39). Nor is
    slot_positions copied: a step over every slot writes it after the layers that read it (twice per step before)."""
    if jax.default_backend() != "cpu":
        pytest.skip("an XLA-CPU property: other backends keep the attention dots (jax_cache/model.py)")
    model = request.getfixturevalue(COPY_TEST_MODELS[heads])
    cache = make_cache(kind, model.config, batch, cache_len)  # lowering reads its shapes only: no prefill to compile
    graph, params = jg.split_model(model)
    state = jg.initial_state(jnp.full((batch,), 3, jnp.int32), cache.next_positions(), cache, (), 0)
    key, knobs = jax.random.key(0), jg._knobs(SamplingParams())
    step_hlo = jg._sampled_step.lower(graph, params, state, key, knobs, "greedy", (), VOCAB,
                                      attend_len).compile().as_text()
    fused_hlo = jg._fused_decode.lower(graph, params, state, key, knobs, None, jnp.int32(2), kind="greedy", eos=(),
                                       block_steps=2, vocab_size=VOCAB, return_logits=False,
                                       attend_len=attend_len).compile().as_text()
    assert " dynamic-update-slice(" in step_hlo, "the step writes the cache (else this test checks nothing)"
    for shape in (cache.keys[0].shape, cache.slot_positions.shape):
        assert buffer_copies(step_hlo, shape) == []
        assert buffer_copies(fused_hlo, shape) == []


def test_fused_loop_aliases_the_whole_cache_and_holds_no_second_copy(model):
    """The donated cache is the loop's output buffer (alias = every cache byte) and its temporaries are far smaller than
    the cache, so it is not copied: XLA regressed to copying a donated buffer read by a while_loop (docs/design.md
    §7.9). A step over every slot reads each layer's buffers as they were and writes after (jax_cache.model
    .DecoderLayer), so no part of a buffer is materialised: the temporaries are the scores and the new tokens' K/V
    (~7% of this cache). Reading the updated buffer in two halves materialised each half for its dot: 53%. A static
    cache of 1024 slots, so that the buffers outweigh the step's other temporaries."""
    cache = make_cache("static", model.config, 1, 1024)
    graph, params = jg.split_model(model)
    state = jg.initial_state(jnp.asarray([3], jnp.int32), jnp.asarray([0], jnp.int32), cache, (), 0)
    executable, _ = jg.fused_executable(graph, params, state, jax.random.key(0), jg._knobs(SamplingParams()), None,
                                        jnp.int32(8), kind="greedy", eos=(), block_steps=8,
                                        vocab_size=VOCAB, return_logits=False, attend_len=None)
    analysis = executable.memory_analysis()
    cache_bytes = sum(array.nbytes for array in cache.arrays())
    kv_bytes = sum(array.nbytes for array in (*cache.keys, *cache.values))
    assert len(cache.keys) == 2
    assert analysis.alias_size_in_bytes >= cache_bytes
    limit = 0.25 if jax.default_backend() == "cpu" else 0.75  # elsewhere the step reads the updated buffers
    assert analysis.temp_size_in_bytes < limit * kv_bytes, (analysis.temp_size_in_bytes, kv_bytes)


def test_a_write_ordered_after_the_layer_output_keeps_its_values_whatever_that_output_holds():
    """The write that follows a read of the old buffers depends on the layer's output through a zero; a NaN or inf in
    that output must not reach the cache (nan_to_num), and finite values pass unchanged."""
    from jax_cache.model import _ordered_after

    k = jnp.arange(2 * 3 * 1 * 4, dtype=jnp.float32).reshape(2, 3, 1, 4) - 5  # [B, Hkv, S, D]
    v = -k
    x = jnp.asarray([[[jnp.nan, 1.0]], [[jnp.inf, -jnp.inf]]], jnp.float32)  # [B, S, hidden]
    for output in (x, jnp.ones_like(x)):
        ordered_k, ordered_v = _ordered_after(output, k, v)
        chex.assert_trees_all_equal((ordered_k, ordered_v), (k, v))


# --- traces and compiles ---------------------------------------------------------------------------------------------

def test_prefill_compiles_at_most_log2_of_the_longest_prompt(model, traces):
    lengths = [1, 2, 3, 5, 8, 11, 13, 16, 17, 20, 24, 31, 32, 33, 40]
    for length in lengths:
        result = jg.generate(model, [make_prompt(length)], 1, cache="static")
        assert len(result.token_ids[0]) == 1
    buckets = {jg.prompt_bucket(length, None) for length in lengths}
    assert buckets == {16, 32, 64}
    assert jg._prefill._cache_size() == len(buckets) <= math.ceil(math.log2(max(lengths)))
    assert sum(traces.values()) == len(buckets)


def test_decode_is_traced_once_per_mode_across_generations_that_wrap_three_times(model, traces, monkeypatch):
    monkeypatch.setattr(jg, "_forward_last", chex.assert_max_traces(jg._forward_last, n=3))  # prefill, step, loop
    assert min(decode_wraps(len(p), NEW_TOKENS) for p in PROMPTS) >= 3
    fused_before = len(jg._fused_executables)
    for mode in ("step", "fused"):
        for prompts in (PROMPTS, [make_prompt(9), make_prompt(14)]):  # other lengths, the same bucket
            result = jg.generate(model, prompts, NEW_TOKENS, cache="sliding_window", fused=mode == "fused")
            assert result.decode_steps == NEW_TOKENS - 1 and [len(t) for t in result.token_ids] == [NEW_TOKENS] * 2
    # (The budget stays: max_cache_len = bucket + max_new_tokens is static pytree metadata, so another budget compiles
    # anew; so do other shapes, sampling kinds (not their settings) and, in fused mode, the number of steps.)
    assert dict(traces) == {16: 1, 1: 2}, f"expected 1 prefill trace (bucket 16), 1 step and 1 loop body: {traces}"
    assert jg._prefill._cache_size() == 1
    assert jg._sampled_step._cache_size() == 1
    assert len(jg._fused_executables) == fused_before + 1  # the second fused generation reused the executable
    assert result.timed_steps == result.decode_steps - 1  # its first block (one step) is its first step, untimed


def test_the_fused_executables_kept_are_the_most_recently_used_few(monkeypatch):
    """The fused blocks compiled ahead of time are kept per argument shapes and static settings: a service whose
    requests bring ever new shapes (each its own max_cache_len or batch, say) held every one. Only the
    MAX_DECODE_VARIANTS (2 here) most recently used are kept: one used again stays over an older one, which is
    dropped and compiled again when it comes back. The compiler is a stub that counts (no XLA: ~0 s)."""
    compiled: list[int] = []

    class Stub:  # stands for _fused_decode: lower(...).compile() gives a new object per compile
        def lower(self, graph: object, state: jax.Array, **static: object) -> Stub:
            return self

        def compile(self) -> object:
            compiled.append(1)
            return object()

    monkeypatch.setattr(jg, "_fused_decode", Stub())
    monkeypatch.setattr(jg, "MAX_DECODE_VARIANTS", 2)
    monkeypatch.setattr(jg, "_fused_executables", collections.OrderedDict())

    def executable(slots: int) -> object:  # a cache of `slots` columns: one shape each
        return jg.fused_executable("graph", jnp.zeros((1, slots)), kind="greedy")[0]

    from jax_cache import backend

    variants = backend.compiled_variants()
    kept = {16: executable(16), 24: executable(24)}
    assert executable(16) is kept[16]  # used again: the same one, now the most recent
    kept[32] = executable(32)  # a third: 24, the least recently used, is dropped
    assert list(jg._fused_executables.values()) == [kept[16], kept[32]] and len(compiled) == 3
    assert executable(24) is not kept[24] and len(compiled) == 4  # compiled again
    assert executable(32) is kept[32] and len(jg._fused_executables) == 2
    # the compile count (bench warm-ups, the soak's recompile check) counts the 4 compiles, not the 2 kept
    assert backend.compiled_variants() - variants == 4


def test_sampling_settings_of_one_kind_share_every_executable(model, monkeypatch):
    """Only the sampling kind is static (greedy / temperature / filtered, as torch_cache's compiled step); the
    temperature, top_k and top_p are traced. After one filtered generation per mode (which compiles the kind's step
    and loop, unless an earlier test did: the fused-vs-step test below runs these shapes), three other settings trace
    nothing, and each draws the tokens its own setting defines (the oracle): the values do reach the executables."""
    settings = [SAMPLED, SamplingParams(1.3, top_k=5, top_p=0.6, seed=7), SamplingParams(0.5, top_p=0.95, seed=3),
                SamplingParams(1.0, top_k=64, seed=7)]

    def run(sampling: SamplingParams, fused: bool) -> None:
        result = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window", sampling=sampling, fused=fused,
                             return_logits=True)
        assert oracle_tokens(result.step_logits, sampling) == result.token_ids, (sampling, fused)

    # counted in a table of its own: the session's is an LRU whose length stays put once full
    monkeypatch.setattr(jg, "_fused_executables", collections.OrderedDict())
    for fused in (True, False):
        run(settings[0], fused)
    executables = jg._sampled_step._cache_size(), len(jg._fused_executables)
    traces = count_forward_traces(monkeypatch)
    for fused in (True, False):
        for sampling in settings[1:]:
            run(sampling, fused)
    assert dict(traces) == {}, f"other settings of one kind traced the decode again: {traces}"
    assert (jg._sampled_step._cache_size(), len(jg._fused_executables)) == executables


def test_prompt_bucket_is_a_power_of_two_at_least_16_capped_by_the_room():
    assert [jg.prompt_bucket(n, None) for n in (1, 15, 16, 17, 33, 100)] == [16, 16, 16, 32, 64, 128]
    assert jg.prompt_bucket(13, 13) == 13  # no room for padding: the exact length
    assert jg.prompt_bucket(13, 14) == 14
    assert jg.prompt_bucket(20, 100) == 32
    # Near a caller-sized cache's capacity the room (capacity - max_new_tokens) caps the bucket, rounded down to a
    # power of two that holds the prompt: every room from 8 to 15 shares the bucket 8, not a prefill per room.
    for room in range(5, 16):
        assert 5 <= jg.prompt_bucket(5, room) <= room
    assert {jg.prompt_bucket(5, room) for room in range(8, 16)} == {8}
    assert jg.prompt_bucket(5, 7) == 7  # no power of two in [5, 7]: the room


def test_bucket_padding_does_not_change_tokens(model):
    prompt = make_prompt(13)
    padded = jg.generate(model, [prompt], 10, cache="static")  # bucket 16: 3 padding columns
    assert padded.cache.max_cache_len == 28, "16 + 10 columns, rounded up to a size class (docs/design.md §5)"
    assert padded.max_cache_len == 13 + 10, "the planned capacity, as torch_cache reports it (docs/design.md §5)"
    exact = jg.generate(model, [prompt], 10, cache=StaticCache(model.config, 1, 13 + 10))  # no room for a bucket
    assert exact.max_cache_len == 23
    assert exact.token_ids == padded.token_ids


@pytest.mark.parametrize("fused", [True, False])
def test_generation_keeps_the_cache_buffers_it_was_given(model, fused):
    _, cache = prefilled(model, "sliding_window", PROMPTS, 64)
    before, inputs = pointers(cache), written_in_place(cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jg.continue_generation(model, cache, [3, 4], NEW_TOKENS, fused=fused)
    assert donation_warnings(caught) == []
    assert pointers(result.cache) == before
    assert all(array.is_deleted() for array in inputs)
    assert int(result.cache.length) == 13 + NEW_TOKENS


# --- a donated cache used again --------------------------------------------------------------------------------------

def _use_step(model, cache):
    return jg.decode_step_fn(model)(jnp.asarray([[3], [4]], jnp.int32), jnp.asarray([[13], [13]], jnp.int32), cache)


STALE_USES = {
    "decode_step_fn": _use_step,
    "model __call__": lambda model, cache: model(jnp.asarray([[3], [4]], jnp.int32),
                                                 jnp.asarray([[13], [13]], jnp.int32), cache),
    "continue_generation fused": lambda model, cache: jg.continue_generation(model, cache, [3, 4], 5),
    "continue_generation step": lambda model, cache: jg.continue_generation(model, cache, [3, 4], 5, fused=False),
    "generate(cache=...)": lambda model, cache: jg.generate(model, PROMPTS, 5, cache=cache),
    "prefill": lambda model, cache: jg.prefill(model, jnp.ones((2, 4), jnp.int32), jnp.ones((2, 4), jnp.int32),
                                               cache),
    "next_positions via continue": lambda model, cache: jg.continue_generation(model, cache, [3, 4], 0),
}


@pytest.mark.parametrize("use", list(STALE_USES))
def test_reusing_a_donated_cache_raises_our_stale_cache_error(model, use):
    _, cache = prefilled(model, "sliding_window", PROMPTS, 64)
    _, live = _use_step(model, cache)  # consumes `cache`
    with pytest.raises(StaleCacheError) as caught:
        STALE_USES[use](model, cache)
    message = str(caught.value)
    assert "donated" in message and "use the cache that call returned" in message.lower()
    assert "has been deleted" not in message
    assert not any(array.is_deleted() for array in leaves(live)), "the refused call must not consume the live cache"


# --- silent JAX behaviour refused before dispatch --------------------------------------------------------------------

def filled_static(model: Mistral, batch: int, capacity: int, length: int) -> StaticCache:
    """A static cache holding `length` columns of random K/V (built on the host: nothing compiles)."""
    rng = np.random.default_rng(length)
    cache = StaticCache(model.config, batch, capacity)
    shape = cache.keys[0].shape
    positions = np.where(np.arange(capacity) < length, np.arange(capacity), -1)
    return cache.replace(keys=[jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in cache.keys],
                         values=[jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in cache.values],
                         slot_positions=jnp.asarray(np.tile(positions, (batch, 1)), jnp.int32),
                         length=jnp.int32(length))


def _full_static(model):  # a static cache holding as many columns as it has: any write is out of range
    return filled_static(model, 1, 4, 4)


def _chunk_past_capacity(model):  # room for 1 more column, a 2-token write would be clamped by dynamic_update_slice
    return filled_static(model, 1, 4, 3)


def _negative_length(model):  # dynamic_update_slice would clamp -1 to 0 and overwrite the first column
    return filled_static(model, 1, 16, 3).replace(length=jnp.int32(-1))


def _batch_mismatch(model):  # a batch-2 cache fed one row: dynamic_update_slice would write row 0 only
    return filled_static(model, 2, 16, 3)


def _dtype_mismatch(model):  # a bf16 cache under an fp32 model
    return StaticCache(model.config, 1, 16, jnp.bfloat16)


BAD_CACHES = {"full static": (_full_static, 1), "chunk past capacity": (_chunk_past_capacity, 2),
              "negative length": (_negative_length, 1), "batch mismatch": (_batch_mismatch, 1),
              "dtype mismatch": (_dtype_mismatch, 1)}
ENTRY_POINTS = ["decode_step_fn", "model __call__", "prefill", "continue_generation"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", list(BAD_CACHES))
def test_out_of_range_batch_and_dtype_writes_are_refused_and_change_nothing(model, case, entry):
    make, num_new = BAD_CACHES[case]
    cache = make(model)
    ids = jnp.full((1, num_new), 5, jnp.int32)  # one row: the batch-mismatch cache has two
    positions = jnp.arange(20, 20 + num_new, dtype=jnp.int32)[None]
    snapshot = [np.asarray(array) for array in leaves(cache)]
    compiled_before = compiled_counts()
    with pytest.raises(CacheError) as caught:
        if entry == "decode_step_fn":
            jg.decode_step_fn(model)(ids, positions, cache)
        elif entry == "model __call__":
            model(ids, positions, cache)
        elif entry == "prefill":
            jg.prefill(model, ids, jnp.ones_like(ids), cache)
        else:
            jg.continue_generation(model, cache, [5], num_new)
    assert not isinstance(caught.value, StaleCacheError)
    message = str(caught.value)
    assert {"full static": "capacity", "chunk past capacity": "capacity", "negative length": "capacity",
            "batch mismatch": "batch", "dtype mismatch": "dtype"}[case] in message, message
    assert not any(array.is_deleted() for array in leaves(cache)), "a refused call must not consume the cache"
    for name, old, array in zip(["keys/values"] * (len(snapshot) - 2) + ["slot_positions", "length"], snapshot,
                                leaves(cache)):
        np.testing.assert_array_equal(np.asarray(array), old, err_msg=f"{case} via {entry} changed the cache's {name}")
    assert compiled_counts() == compiled_before, "the refused call reached compiled code"


BAD_MASKS = {  # as torch_cache's prefill refuses them (test_torch_bad_inputs.py, item 11)
    "shape": ([[1, 1, 1, 1], [1, 1, 1, 1]], ["[2, 4]", "[2, 3]"]),
    "right padding": ([[1, 1, 1], [1, 1, 0]], ["row 1", "right padding"]),
    "gap": ([[0, 1, 0], [1, 1, 1]], ["row 0", "left padding"]),
    "all padding": ([[0, 0, 0], [1, 1, 1]], ["row 0", "all padding"]),
    "not 0/1": ([[2, 1, 1], [1, 1, 1]], ["only 0 (padding) and 1"]),
}


@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_prefill_refuses_a_bad_attention_mask_like_torch_and_keeps_the_cache(model, case):
    """JAX prefill validates the mask with the floor's rule before dispatch, as torch's does (docs/design.md §2)."""
    mask, fragments = BAD_MASKS[case]
    cache = make_cache("static", model.config, 2, 12)
    with pytest.raises(InputError) as caught:
        jg.prefill(model, jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32), jnp.asarray(mask, jnp.int32), cache)
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)
    assert not any(array.is_deleted() for array in leaves(cache)), "a refused prefill must not consume the cache"


def test_generate_refuses_a_given_cache_too_small_without_touching_it(model):
    cache = StaticCache(model.config, 2, 20)
    snapshot = [np.asarray(array) for array in leaves(cache)]
    with pytest.raises(CacheError, match="capacity"):
        jg.generate(model, PROMPTS, 10, cache=cache)  # 13 + 10 > 20
    assert not any(array.is_deleted() for array in leaves(cache))
    chex.assert_trees_all_equal([np.asarray(a) for a in leaves(cache)], snapshot)


# --- fused vs step, sampling -----------------------------------------------------------------------------------------

def oracle_tokens(step_logits: np.ndarray, sampling: SamplingParams) -> list[list[int]]:
    """The tokens a seeded generation must pick, from its own step logits [B, steps, V], computed without jax_cache:
    step i draws argmax(filtered l / T + Gumbel noise of fold_in(key(seed), i)) (jax.random.categorical's
    definition), with top-k and top-p filtered here in float64 (test_sampling.oracle_kept); greedy is the argmax."""
    from parity_tests.test_sampling import oracle_kept

    logits = np.asarray(step_logits, np.float64)
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    key = jax.random.key(sampling.seed)
    tokens = []
    for step in range(logits.shape[1]):
        noise = np.asarray(jax.random.gumbel(jax.random.fold_in(key, step), logits[:, step].shape, jnp.float32))
        kept = oracle_kept(logits[:, step], sampling)
        masked = np.where([[t in row for t in range(logits.shape[2])] for row in kept], logits[:, step], -np.inf)
        tokens.append((masked / sampling.temperature + noise).argmax(-1))
    return np.stack(tokens, axis=1).tolist()


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, SamplingParams(temperature=1.5, top_p=0.6, seed=11)],
                         ids=["greedy", "sampled", "wide_nucleus"])
def test_fused_and_step_modes_give_identical_tokens(model, sampling):
    """Both fold the step index into one PRNG key, so even sampled tokens agree (logits: test_jax_parity). The two
    modes share sample() and _pick(), so each is also checked against an oracle that shares neither."""
    fused = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window", sampling=sampling, return_logits=True)
    streamed: list[list[int]] = []
    step = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window", sampling=sampling, fused=False,
                       on_token=streamed.append, return_logits=True)
    assert fused.token_ids == step.token_ids
    assert [list(row) for row in zip(*streamed)] == step.token_ids, "on_token must see every step's tokens"
    assert fused.decode_steps == step.decode_steps == NEW_TOKENS - 1
    assert oracle_tokens(fused.step_logits, sampling) == fused.token_ids
    assert oracle_tokens(step.step_logits, sampling) == step.token_ids


@pytest.mark.parametrize(("setting", "value", "fused"), [("jax_default_prng_impl", "rbg", True),
                                                        ("jax_threefry_partitionable", False, False)])
def test_a_user_s_global_jax_setting_changes_no_seeded_token(model, setting, value, fused):
    """A process's own JAX settings: under jax_default_prng_impl="rbg" or jax_threefry_partitionable=False a seed
    drew other tokens than in a default process (the key and the draw now pin JAX's defaults). Judged by the
    oracle, under JAX's defaults again. The batch and sampling kind of the sampling-settings test above, whose
    executables the rbg case reads back (the key is pinned); the partitionable setting changes the step's trace."""
    before = getattr(jax.config, setting)
    jax.config.update(setting, value)
    try:
        result = jg.generate(model, PROMPTS, 3, cache="sliding_window", sampling=SAMPLED, fused=fused,
                             return_logits=True)
    finally:
        jax.config.update(setting, before)
    assert result.token_ids == oracle_tokens(result.step_logits, SAMPLED)


def test_the_fused_mode_runs_under_the_user_s_disable_jit(model, checkpoints):
    """Under jax.disable_jit() the fused mode raised JAX's ValueError "Disable jit is not supported in the AOT path"
    (a traceback; the step mode ran): its blocks now run op by op there, as every jitted function does. One fused
    step (op by op costs a compile per primitive), after a jitted start, judged by transformers' greedy tokens."""
    prompt = PROMPTS[0]
    start = jg.generate(model, [prompt], 2, cache="static", max_cache_len=len(prompt) + 3)
    with jax.disable_jit():
        more = jg.continue_generation(model, start.cache, [start.token_ids[0][-1]], 1, fused=True)
    assert start.token_ids[0] + more.token_ids[0] == greedy(checkpoints["gqa"], [prompt], 3)[0]


def test_sampling_is_seeded_and_differs_from_greedy(model):
    greedy = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window")
    first = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window", sampling=SAMPLED)
    again = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window", sampling=SAMPLED)
    other = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window",
                        sampling=dataclasses.replace(SAMPLED, seed=8))
    assert first.token_ids == again.token_ids, "one seed must give one sequence"
    assert first.token_ids != other.token_ids, "another seed should give another sequence"
    assert first.token_ids != greedy.token_ids, "temperature 0.8 sampling should not reproduce greedy decoding"


# --- per-row EOS -----------------------------------------------------------------------------------------------------

def with_eos(model: Mistral, eos: int) -> Mistral:
    variant = nnx.merge(*nnx.split(model))  # a new module object sharing the weights
    variant.config = dataclasses.replace(model.config, eos_token_id=eos)
    return variant


def test_fused_mode_stops_each_row_at_its_own_eos(model):
    free = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window")
    first_row, second_row = free.token_ids
    # An id that greedy decoding emits mid-way in row 0 (first time there) and never in row 1.
    candidates = [(k, t) for k, t in enumerate(first_row) if 3 <= k < NEW_TOKENS - 5 and t not in first_row[:k]
                  and t not in second_row]
    assert candidates, "no usable EOS candidate: change the prompts' seed"
    stop, eos = candidates[0]
    variant = with_eos(model, eos)
    for fused in (True, False):
        result = jg.generate(variant, PROMPTS, NEW_TOKENS, cache="sliding_window", fused=fused)
        assert result.token_ids[0] == first_row[: stop + 1], f"fused={fused}: row 0 must end at its EOS"
        assert result.token_ids[1] == second_row, f"fused={fused}: row 1 must run on to max_new_tokens"
        assert result.decode_steps == NEW_TOKENS - 1


def test_both_modes_end_early_once_every_row_has_emitted_eos_and_leave_the_same_cache(model):
    """The fused while_loop stops at the EOS step; the streaming loop has already queued one more step by then (it
    dispatches step k + 1 before reading step k's tokens), which must leave the cache exactly as it was."""
    prompts = [PROMPTS[0], PROMPTS[0]]  # the shapes of PROMPTS, so the EOS variant's executables are reused
    free = jg.generate(model, prompts, NEW_TOKENS, cache="sliding_window").token_ids[0]
    stop = next(k for k, t in enumerate(free) if k >= 3 and t not in free[:k])
    variant = with_eos(model, free[stop])
    fused, streamed = (jg.generate(variant, prompts, NEW_TOKENS, cache="sliding_window", fused=mode)
                       for mode in (True, False))
    for result in (fused, streamed):
        assert result.token_ids == [free[: stop + 1]] * 2
        assert result.decode_steps == stop, "decoding must stop at the step that emitted EOS"
    assert int(streamed.cache.length) == int(fused.cache.length)
    chex.assert_trees_all_equal(streamed.cache.slot_positions, fused.cache.slot_positions)
    # K/V agree to fp32 rounding: the step and the loop are separate XLA compilations.
    chex.assert_trees_all_close(streamed.cache.keys + streamed.cache.values, fused.cache.keys + fused.cache.values,
                                rtol=0, atol=1e-5)


def test_step_mode_stops_every_row_at_its_own_eos_and_streams_eos_after_it(model):
    """Rows that stop at different steps: finished rows keep emitting EOS (in on_token too), and decoding ends at the
    step where the last row emits it. torch's every_row_stops case, in both JAX modes."""
    free = jg.generate(model, PROMPTS, NEW_TOKENS, cache="sliding_window").token_ids
    candidates = [t for t in sorted(set(free[0]) & set(free[1]))
                  if free[0].index(t) != free[1].index(t) and max(free[0].index(t), free[1].index(t)) < NEW_TOKENS - 3]
    assert candidates, f"no token ends both rows at different steps in {free}; change the prompts"
    eos = candidates[0]
    stops = [row.index(eos) for row in free]
    variant = with_eos(model, eos)
    for fused in (False, True):
        streamed: list[list[int]] = []
        result = jg.generate(variant, PROMPTS, NEW_TOKENS, cache="sliding_window", fused=fused,
                             on_token=None if fused else streamed.append)
        assert result.token_ids == [row[: stop + 1] for row, stop in zip(free, stops)], f"fused={fused}"
        assert result.decode_steps == max(stops), f"fused={fused}: decoding must end when the last row ends"
        if not fused:
            assert len(streamed) == max(stops) + 1
            for step, ids in enumerate(streamed):
                want = [row[step] if step <= stop else eos for row, stop in zip(free, stops)]
                assert ids == want, f"step {step}: on_token got {ids}, want {want} (finished rows emit EOS)"


# --- the model and the step refuse bad inputs themselves (not only through prompt validation) -----------------------

@pytest.mark.parametrize("bad", [-1, VOCAB, 10_000])
def test_model_and_step_refuse_token_ids_outside_the_vocabulary(model, bad):
    """jnp.take would clamp or fill an out-of-range id silently (NaN logits); both entry points refuse it first."""
    cache = filled_static(model, 1, 16, 3)
    snapshot = [np.asarray(array) for array in leaves(cache)]
    ids, positions = jnp.asarray([[5, bad]], jnp.int32), jnp.asarray([[3, 4]], jnp.int32)
    for name, call in (("model", lambda: model(ids, positions, cache)),
                       ("step", lambda: jg.decode_step_fn(model)(ids[:, 1:], positions[:, 1:], cache)),
                       ("prefill", lambda: jg.prefill(model, ids, jnp.ones_like(ids), cache))):
        with pytest.raises(InputError, match=rf"token id {bad} is outside the vocabulary \[0, {VOCAB}\)"):
            call()
        assert not any(array.is_deleted() for array in leaves(cache)), name
    chex.assert_trees_all_equal([np.asarray(a) for a in leaves(cache)], snapshot)


@pytest.mark.parametrize(("ids", "positions", "mask", "fragment"), [
    ([[5, 6]], [[-3, -2]], None, "positions of real tokens must be in [0, 2147483647] (int32), got -3"),
    ([[5, 6]], [[3]], None, "positions has shape [1, 1] but input_ids has [1, 2]"),
    ([[5, 6]], [[3, 4]], [[1, 1, 1]], "attention_mask has shape [1, 3] but input_ids has [1, 2]"),
    (np.zeros((1, 0), np.int32), np.zeros((1, 0), np.int32), None, "expected [batch >= 1, seq_len >= 1]"),
    (np.asarray([[5.0, 6.0]], np.float32), [[3, 4]], None, "input_ids dtype float32 must be int32 or int64"),
], ids=["negative_position", "positions_shape", "mask_shape", "empty", "float_ids"])
def test_model_refuses_bad_positions_shapes_and_dtypes(model, ids, positions, mask, fragment):
    cache = filled_static(model, 1, 16, 3)
    mask = None if mask is None else jnp.asarray(mask, jnp.int32)
    with pytest.raises(InputError) as caught:
        model(jnp.asarray(ids), jnp.asarray(positions, jnp.int32), cache, mask)
    assert fragment in str(caught.value)
    if fragment.startswith("positions of real tokens"):  # the step checks positions too
        with pytest.raises(InputError, match="positions of real tokens"):
            jg.decode_step_fn(model)(jnp.asarray(ids)[:, :1], jnp.asarray(positions, jnp.int32)[:, :1], cache)


def test_the_suite_refuses_implicit_dtype_promotion_and_warnings():
    """conftest and pyproject make the tests strict (docs/design.md §7.25): an implicit bfloat16 + float32 in any JAX
    code a test runs, here or in a process it starts, fails it, and so does any warning."""
    with pytest.raises(jax.dtypes.TypePromotionError):
        jnp.ones(2, jnp.bfloat16) + jnp.ones(2, jnp.float32)
    child = subprocess.run([sys.executable, "-c", "import jax; print(jax.config.jax_numpy_dtype_promotion)"],
                           capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == "strict", child.stderr[-2000:]
    with pytest.raises(UserWarning, match="fails the test"):
        warnings.warn("a warning fails the test it comes from", stacklevel=1)
