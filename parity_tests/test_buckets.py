"""Attention length buckets (twincache.buckets, docs/design.md §2): a step's attention reads only the prefix of the
cache that holds its live keys, rounded up to a bucket, in both towers and every decode mode; crossing a bucket
compiles at most once per bucket; and the same tokens come out as when every slot is read. A chunk of a chunked
prefill reads the bucket of the live prefix and itself; JAX's fused blocks end where a bucket does; forced tokens run
through all of it.

What attention reads is probed with NaN: slots past the bucket are filled with NaN, which any read would spread to
the logits (a masked score is still added to, and a zero weight still multiplied by, the NaN), and a non-finite
logit stops generation with NonFiniteLogitsError. ATTEND_BLOCK is lowered to 8 so the tiny models cross buckets.
"""

from __future__ import annotations

import collections
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_cache.generate as jg
import torch_cache.generate as tg
from jax_cache.cache import StaticCache as JaxStaticCache
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import record_fused_blocks, save_hf_checkpoint
from parity_tests.sampling_oracle import oracle_draw
from torch_cache.cache import StaticCache as TorchStaticCache
from torch_cache.cache import make_cache as torch_cache
from torch_cache.model import Mistral as TorchMistral
from twincache import buckets
from twincache.buckets import attend_len, decode_buckets, step_attend_len
from twincache.generation import SamplingParams, cache_size_class

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 8
CACHE_LEN = 256  # buckets 8, 16, 32, 64 and the whole cache (128 would be half of it)
PROMPT = [5, 9, 14, 3, 77]
NEW_TOKENS = 70  # from 5 columns to 74: every bucket


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    monkeypatch.setattr(buckets, "ATTEND_BLOCK", BLOCK)


def visited_buckets(length: int, steps: int, cache_len: int) -> list[int]:
    """The oracle, step by step: the bucket of each one-token step's live slots (independent of decode_buckets)."""
    seen = []
    for step in range(steps):
        live = min(length + step + 1, cache_len)
        bucket = BLOCK
        while bucket < live:
            bucket *= 2
        seen.append(bucket if bucket < cache_len / 2 else cache_len)
    return seen


# --- the rule (the floor) ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_len", [1, 7, 8, 9, 16, 17, 64, 100, 2066])
def test_a_bucket_covers_the_live_slots_and_there_are_few(cache_len):
    seen = set()
    for filled in range(1, cache_len + 1):
        bucket = attend_len(filled, cache_len)
        assert filled <= bucket <= cache_len
        if bucket < cache_len:  # a partial bucket: a power of two times the block, under half the cache
            assert bucket % BLOCK == 0 and (bucket // BLOCK) & (bucket // BLOCK - 1) == 0 and 2 * bucket < cache_len
            assert bucket == BLOCK or bucket < 2 * filled, "not the smallest bucket"
        else:  # the whole cache, only once the smallest covering bucket would be half of it or more
            assert 4 * filled > cache_len or cache_len <= 2 * BLOCK, (filled, cache_len)
        seen.add(bucket)
    assert len(seen) <= max(1, math.ceil(math.log2(cache_len / BLOCK))), sorted(seen)


@pytest.mark.parametrize(("length", "steps", "cache_len"), [(5, 50, 64), (0, 1, 64), (13, 40, 16), (30, 100, 40),
                                                             (100, 7, 2066), (7, 1, 8)])
def test_decode_runs_group_the_steps_by_their_bucket(length, steps, cache_len):
    per_step = visited_buckets(length, steps, cache_len)
    runs = decode_buckets(length, steps, cache_len)
    assert [bucket for bucket, count in runs for _ in range(count)] == per_step
    assert all(a != b for (a, _), (b, _) in zip(runs, runs[1:])), "one run per bucket"
    assert per_step[0] == step_attend_len(length, 1, cache_len)


# --- cache size classes: a cache generate sizes itself is one shape for every total in its class -------------------

def test_a_cache_size_class_holds_what_is_needed_with_under_a_quarter_more_and_there_are_few():
    """Every total compiled its own decode step (torch) and executables (JAX) when a tower allocated exactly
    prompt + max_new_tokens slots; rounded up to classes, a process meets at most 4 per octave, under 25% extra K/V
    (at least 16 slots: every shorter total is one class), and never past a limit that the total itself is not past."""
    slots = [cache_size_class(needed) for needed in range(1, 5000)]
    for needed, allocated in enumerate(slots, 1):
        assert needed <= allocated, needed
        assert allocated == 16 if needed <= 16 else 4 * (allocated - needed) < needed, (needed, allocated)
    assert slots == sorted(slots)
    for octave in range(4, 12):
        classes = {allocated for allocated in slots if 2 ** octave <= allocated < 2 ** (octave + 1)}
        assert len(classes) <= 4, (octave, sorted(classes))
    for limit in (8, 40, 64):
        for needed in range(1, 100):
            assert needed <= cache_size_class(needed, limit) <= max(needed, limit), (needed, limit)


@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_a_cache_generate_sizes_itself_is_one_shape_for_every_total_in_its_class(gqa, tower):
    """max_new_tokens=0 builds the cache and decodes nothing (no compile in either tower). JAX pads a prompt past one
    prefill chunk (5 columns here) to whole chunks, so in both towers prompts of 33, 36 and 40 tokens need 33 to 40
    columns, one class, and 41 the next. The result reports the planned capacity; a max_cache_len given is allocated as
    asked; a ring rounded past its window is the window's ring (window 8 here, unbounded: capacity None)."""
    if tower == "torch":
        model, make = TorchMistral.from_pretrained(gqa), functools.partial(tg.generate, compile=False)
    else:
        model, make = JaxMistral.from_pretrained(gqa), jg.generate

    def build(prompt_len: int, kind: str, **kwargs: object):
        return make(model, [list(range(3, 3 + prompt_len))], 0, cache=kind, prefill_chunk=5, **kwargs)

    results = [build(prompt_len, "static") for prompt_len in (33, 36, 40, 41)]
    assert [result.cache.cache_len for result in results] == [40, 40, 40, 48]
    assert [result.max_cache_len for result in results] == [33, 36, 40, 41], "the planned capacity"
    assert build(33, "static", max_cache_len=33).cache.cache_len == 33, "a max_cache_len given is never rounded"
    ring = build(3, "sliding_window").cache
    assert (ring.cache_len, ring.capacity) == (model.config.sliding_window, None)


# --- the read: a NaN past the bucket never reaches the logits --------------------------------------------------------

@pytest.fixture(scope="module")
def gqa(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["gqa"]


def poison_torch(cache, first_slot: int) -> None:
    for buffer in (*cache.keys, *cache.values):
        buffer[:, :, first_slot:] = float("nan")


def poison_jax(cache, first_slot: int):
    nan = jnp.float32(jnp.nan)
    return cache.replace(keys=[k.at[:, :, first_slot:].set(nan) for k in cache.keys],
                         values=[v.at[:, :, first_slot:].set(nan) for v in cache.values])


def test_torch_eager_decode_reads_only_its_bucket(gqa):
    model = TorchMistral.from_pretrained(gqa)
    reference = tg.generate(model, [PROMPT], 20, cache="static", max_cache_len=CACHE_LEN, compile=False)
    cache = torch_cache("static", model.config, 1, CACHE_LEN)
    tg.prefill(model, torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long), cache)
    last_bucket = visited_buckets(len(PROMPT), 19, CACHE_LEN)[-1]
    assert last_bucket < CACHE_LEN
    poison_torch(cache, last_bucket)
    rest = tg.continue_generation(model, cache, [reference.token_ids[0][0]], 19, compile=False)
    assert reference.token_ids[0][1:] == rest.token_ids[0]


@pytest.mark.parametrize("mode", ["fused", "step"])
def test_jax_decode_reads_only_its_bucket(gqa, mode):
    model = JaxMistral.from_pretrained(gqa)
    reference = jg.generate(model, [PROMPT], 20, cache="static", max_cache_len=CACHE_LEN, fused=False)
    cache = jg.make_cache("static", model.config, 1, CACHE_LEN)
    _, cache = jg.prefill(model, jnp.asarray([PROMPT]), jnp.ones((1, len(PROMPT)), jnp.int32), cache)
    last_bucket = visited_buckets(len(PROMPT), 19, CACHE_LEN)[-1]
    cache = poison_jax(cache, last_bucket)
    rest = jg.continue_generation(model, cache, [reference.token_ids[0][0]], 19, fused=mode == "fused")
    assert reference.token_ids[0][1:] == rest.token_ids[0]


def test_jax_prefill_reads_only_its_bucket(gqa):
    """A static prefill writes in place, so it reads a bucket too (5 prompt tokens: a bucket of 8 slots)."""
    model = JaxMistral.from_pretrained(gqa)
    clean = jg.make_cache("static", model.config, 1, CACHE_LEN)
    ids, mask = jnp.asarray([PROMPT]), jnp.ones((1, len(PROMPT)), jnp.int32)
    expected, _ = jg.prefill(model, ids, mask, clean)
    poisoned = poison_jax(jg.make_cache("static", model.config, 1, CACHE_LEN), 8)
    logits, _ = jg.prefill(model, ids, mask, poisoned)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)


# --- compiles: at most one per bucket a generation reaches ----------------------------------------------------------

@pytest.fixture(scope="module")
def torch_bucket_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Compiled greedy generations through every bucket of a 256-slot static cache, on a model shape no other test
    compiles (4 layers), so the counts start from nothing; the second runs under fail_on_recompile."""
    from torch._dynamo.utils import counters

    directory = save_hf_checkpoint(tmp_path_factory.mktemp("buckets") / "four_layers", seed=31, num_hidden_layers=4)
    model = TorchMistral.from_pretrained(directory)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(buckets, "ATTEND_BLOCK", BLOCK)
        before = counters["stats"]["unique_graphs"]
        first = tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN)
        compiles = counters["stats"]["unique_graphs"] - before
        with torch.compiler.set_stance("fail_on_recompile"):
            second = tg.generate(model, [PROMPT[1:]], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN)
        recompiles = counters["stats"]["unique_graphs"] - before - compiles
    return dict(model=model, first=first, second=second, compiles=compiles, recompiles=recompiles,
                directory=directory)


def test_torch_compiles_at_most_once_per_bucket_and_once_for_every_partial_bucket(torch_bucket_runs):
    visited = set(visited_buckets(len(PROMPT), NEW_TOKENS - 1, CACHE_LEN))
    assert visited == {8, 16, 32, 64, CACHE_LEN}
    assert 1 <= torch_bucket_runs["compiles"] <= len(visited)
    if hasattr(torch.compiler.config, "dynamic_sources"):  # the bucket is symbolic: partial buckets share one graph
        assert torch_bucket_runs["compiles"] == 2, "one graph for the partial buckets, one for the whole cache"
    assert torch_bucket_runs["recompiles"] == 0


def test_torch_compiled_buckets_give_the_tokens_of_full_reads(torch_bucket_runs, monkeypatch):
    monkeypatch.setattr(buckets, "ATTEND_BLOCK", 1 << 20)  # one bucket: the whole cache
    for result, prompt in ((torch_bucket_runs["first"], PROMPT), (torch_bucket_runs["second"], PROMPT[1:])):
        full = tg.generate(torch_bucket_runs["model"], [prompt], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                           compile=False)
        assert result.token_ids == full.token_ids


def test_torch_compiled_decode_reads_only_its_bucket(torch_bucket_runs):
    model = torch_bucket_runs["model"]
    with torch.inference_mode():  # as generate builds its caches: the compiled graphs are for inference tensors
        cache = torch_cache("static", model.config, 1, CACHE_LEN)
        tg.prefill(model, torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long), cache)
        poison_torch(cache, visited_buckets(len(PROMPT), 19, CACHE_LEN)[-1])
    first = torch_bucket_runs["first"].token_ids[0]
    with torch.compiler.set_stance("fail_on_recompile"):  # the graphs the fixture compiled
        rest = tg.continue_generation(model, cache, [first[0]], 19)
    assert rest.token_ids[0] == first[1:20]


@pytest.mark.parametrize("mode", ["fused", "step"])
def test_jax_compiles_once_per_bucket_reached(gqa, mode, monkeypatch):
    model = JaxMistral.from_pretrained(gqa)
    jax.clear_caches()
    monkeypatch.setattr(jg, "_fused_executables", collections.OrderedDict())

    def count() -> int:
        return jg._sampled_step._cache_size() + len(jg._fused_executables)

    monkeypatch.setattr(buckets, "ATTEND_BLOCK", 1 << 20)  # one bucket: the whole cache
    full = jg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN, fused=mode == "fused")
    before = count()
    monkeypatch.setattr(buckets, "ATTEND_BLOCK", BLOCK)
    result = jg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN, fused=mode == "fused")
    # JAX pads the prompt to a bucket of 16 columns, so decoding runs from column 16: buckets 32, 64 and the whole
    # cache (compiled above).
    visited = set(visited_buckets(jg.prompt_bucket(len(PROMPT), CACHE_LEN - NEW_TOKENS), NEW_TOKENS - 1, CACHE_LEN))
    assert visited == {32, 64, CACHE_LEN}
    assert count() - before == len(visited - {CACHE_LEN})
    again = jg.generate(model, [PROMPT[1:]], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN, fused=mode == "fused")
    assert count() - before == len(visited - {CACHE_LEN}), "a second generation reuses every bucket's executable"
    assert result.token_ids == full.token_ids
    assert len(again.token_ids[0]) == NEW_TOKENS


# --- JAX: sizes come from the buffers, not from pytree metadata (issue 13 §3) ----------------------------------------

def test_jax_caches_with_equal_buffers_share_their_executables(gqa, monkeypatch):
    """Rings asked for different max_cache_len (both past the window) have equal buffers: another max_new_tokens
    (step mode) or another max_cache_len (fused) must not trace the decode again."""
    model = JaxMistral.from_pretrained(gqa)
    jax.clear_caches()
    monkeypatch.setattr(jg, "_fused_executables", collections.OrderedDict())
    first = jg.generate(model, [PROMPT], 20, cache="sliding_window", fused=False)
    steps = jg._sampled_step._cache_size()
    second = jg.generate(model, [PROMPT], 31, cache="sliding_window", fused=False)
    assert jg._sampled_step._cache_size() == steps == 1
    assert jax.tree_util.tree_structure(first.cache) == jax.tree_util.tree_structure(second.cache)
    jg.generate(model, [PROMPT], 20, cache="sliding_window", max_cache_len=40)
    jg.generate(model, [PROMPT], 20, cache="sliding_window", max_cache_len=400)
    assert len(jg._fused_executables) == 1


def test_torch_compiled_decode_copies_to_the_host_once_per_step(torch_bucket_runs, torch_sampled_runs, monkeypatch):
    """The choice (greedy or a seeded draw), the EOS bookkeeping and the NaN flag are in the compiled step (issue 13
    §2): each further step costs exactly one device-to-host copy, whatever happens at the bucket edges."""
    model = torch_bucket_runs["model"]
    copies = {"n": 0}
    for name in ("tolist", "item", "__int__", "__bool__", "__float__", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            copies["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    def copies_for(steps: int, sampling: SamplingParams | None = None) -> int:
        with torch.inference_mode():
            cache = torch_cache("static", model.config, 1, CACHE_LEN)
            tg.prefill(model, torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long), cache)
        before = copies["n"]
        with torch.compiler.set_stance("fail_on_recompile"):
            result = tg.continue_generation(model, cache, [7], steps, sampling=sampling)
        assert result.decode_steps == steps
        return copies["n"] - before

    assert copies_for(40) - copies_for(20) == 20
    # a seeded draw is in the graph too (the sampled graph is torch_sampled_runs', within the partial buckets)
    assert copies_for(40, SAMPLED[0]) - copies_for(20, SAMPLED[0]) == 20


# --- torch: the seeded draw inside the compiled step (issue 13 §2) ----------------------------------------------------

# Two settings of one sampling kind ("filtered": top-k / top-p sort the vocabulary), and the first with another seed.
SAMPLED = [SamplingParams(0.8, top_k=20, top_p=0.9, seed=5), SamplingParams(1.3, top_k=7, top_p=0.95, seed=6),
           SamplingParams(0.8, top_k=20, top_p=0.9, seed=9)]
SAMPLED_TOKENS = 40  # from 5 columns to 44: partial buckets only (one graph where the bucket is symbolic)


@pytest.fixture(scope="module")
def torch_sampled_runs(torch_bucket_runs) -> dict:
    """Compiled sampled generations on the bucket model: the first compiles the "filtered" graph; the others (the
    same setting again, another setting, another seed) run under fail_on_recompile."""
    from torch._dynamo.utils import counters

    model = torch_bucket_runs["model"]

    def run(sampling: SamplingParams) -> object:
        return tg.generate(model, [PROMPT], SAMPLED_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                           sampling=sampling, return_logits=True)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(buckets, "ATTEND_BLOCK", BLOCK)
        before = counters["stats"]["unique_graphs"]
        first = run(SAMPLED[0])
        compiles = counters["stats"]["unique_graphs"] - before
        with torch.compiler.set_stance("fail_on_recompile"):
            again, *others = (run(sampling) for sampling in SAMPLED)
    return dict(model=model, compiles=compiles, first=first, again=again, others=others)


def test_torch_compiled_sampling_compiles_one_graph_for_every_setting_of_its_kind(torch_sampled_runs):
    visited = set(visited_buckets(len(PROMPT), SAMPLED_TOKENS - 1, CACHE_LEN))
    assert visited == {8, 16, 32, 64}  # partial buckets only
    assert 1 <= torch_sampled_runs["compiles"] <= len(visited)
    if hasattr(torch.compiler.config, "dynamic_sources"):
        assert torch_sampled_runs["compiles"] == 1


def test_torch_compiled_sampling_reproduces_a_seed_and_seeds_matter(torch_sampled_runs):
    first, again, (other_setting, other_seed) = (torch_sampled_runs[name] for name in ("first", "again", "others"))
    assert len(first.token_ids[0]) == SAMPLED_TOKENS
    assert again.token_ids == first.token_ids
    assert other_seed.token_ids != first.token_ids and other_setting.token_ids != first.token_ids


def test_torch_compiled_sampling_draws_the_defined_tokens(torch_sampled_runs):
    """Each step's token is the independent oracle's draw (numpy filters, numpy hash noise, the step folded into the
    seed) on that step's logits: the compiled graph computes the floor's definition, step index included."""
    for result, sampling in zip([torch_sampled_runs["first"], *torch_sampled_runs["others"]],
                                [SAMPLED[0], SAMPLED[1], SAMPLED[2]]):
        logits = result.step_logits.numpy()  # [1, steps, V]
        expected = [int(oracle_draw(logits[:, step], sampling, step)[0]) for step in range(logits.shape[1])]
        assert result.token_ids[0] == expected, str(sampling)


def test_torch_eager_sampling_draws_the_tokens_of_the_compiled_step(torch_sampled_runs):
    eager = tg.generate(torch_sampled_runs["model"], [PROMPT], SAMPLED_TOKENS, cache="static",
                        max_cache_len=CACHE_LEN, sampling=SAMPLED[0], compile=False)
    assert eager.token_ids == torch_sampled_runs["first"].token_ids


# --- torch: a steady step checks only the guards that tell entries apart (docs/design.md §7.30) --------------------

def record_guard_skips(model, monkeypatch, how: list[str] | None = None, codes: list[object] | None = None
                       ) -> list[bool]:
    """Whether each compiled decode step of `model` from now on skipped dynamo's guards: a call of the compiled
    function under the skip stance, or (CPU) a direct call of the entry the step before it ran (§7.34). `how`, if
    given, gets each step's way: "checked", "stance" or "entry"; `codes` the code each ran: for a checked step the
    code of dynamo's most recent entry after it, for an entry step the code called."""
    steps = tg._decode_one_fn(model, True)
    skipped: list[bool] = []
    how = [] if how is None else how
    codes = [] if codes is None else codes
    decode_code = steps.compiled_step._torchdynamo_orig_callable.__code__
    # this torch's (where it has one), whatever a test patches later
    entries_of = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)

    def recording(*args, _step=steps.step):
        skip = torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe
        skipped.append(skip)
        how.append("stance" if skip else "checked")
        outputs = _step(*args)
        codes.append(entries_of(decode_code)[0].code if entries_of is not None else None)
        return outputs

    def entry_function(compiled, args, _own=tg._entry_function):
        direct = _own(compiled, args)
        if direct is None:
            return None

        def recorded(*args):
            skipped.append(True)
            how.append("entry")
            codes.append(direct.__code__)
            return direct(*args)
        return recorded

    monkeypatch.setattr(steps, "step", recording)
    monkeypatch.setattr(tg, "_entry_function", entry_function)
    return skipped


def expected_skips(steps: int) -> list[bool]:
    """Decoding `steps` steps after PROMPT's prefill: the first step of each bucket (the oracle's) checks every guard,
    the steps after it in the same bucket skip them."""
    seen = visited_buckets(len(PROMPT), steps, CACHE_LEN)
    return [step > 0 and seen[step] == seen[step - 1] for step in range(steps)]


def test_this_torch_lets_a_steady_step_skip_its_guards():
    """The guard skipping below needs torch.compiler.set_stance's skip_guard_eval_unsafe (torch >= 2.6, the floor
    pyproject.toml pins): asserted rather than skipped on, so that losing it fails instead of hiding its tests."""
    assert tg._can_skip_guards(), torch.__version__


def test_torch_compiled_decode_checks_every_guard_at_the_first_step_of_each_bucket(torch_bucket_runs, monkeypatch):
    model = torch_bucket_runs["model"]
    skipped = record_guard_skips(model, monkeypatch)
    with torch.compiler.set_stance("fail_on_recompile"):  # the graphs the fixture compiled
        result = tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN)
        assert torch._dynamo.eval_frame._stance.stance == "fail_on_recompile", "the caller's stance is kept"
    assert result.token_ids == torch_bucket_runs["first"].token_ids
    assert set(visited_buckets(len(PROMPT), NEW_TOKENS - 1, CACHE_LEN)) == {8, 16, 32, 64, CACHE_LEN}
    assert skipped == expected_skips(NEW_TOKENS - 1)  # the prefill's token is not a decode step
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


def count_graph_calls(monkeypatch) -> list[int]:
    """One entry per call of an inductor-compiled graph from now on (a step that ran eagerly adds none)."""
    from torch._inductor.output_code import CompiledFxGraph

    calls: list[int] = []
    graph_call = CompiledFxGraph.__call__
    monkeypatch.setattr(CompiledFxGraph, "__call__", lambda self, inputs: calls.append(1) or graph_call(self, inputs))
    return calls


def test_torch_compiled_steady_cpu_steps_call_the_entry_the_checked_step_ran(torch_bucket_runs, monkeypatch):
    """On CPU a steady step runs the code of the entry its bucket's first step chose, called directly (§7.34): the
    fixture's tokens across five buckets, whose graphs differ (a symbolic partial bucket and the whole cache), so a
    stale or wrong entry would not give them; the compiled function (dynamo's frame evaluation) is called only at
    each bucket's first step."""
    model = torch_bucket_runs["model"]
    how: list[str] = []
    codes: list[object] = []
    record_guard_skips(model, monkeypatch, how, codes)  # "checked": a call of the compiled function, dynamo's frame
    original = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    entries_read = []
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list",
                        lambda code: entries_read.append(code) or original(code))
    graph_calls = count_graph_calls(monkeypatch)
    with torch.compiler.set_stance("fail_on_recompile"):
        result = tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN)
    assert result.token_ids == torch_bucket_runs["first"].token_ids
    assert how == ["entry" if skip else "checked" for skip in expected_skips(NEW_TOKENS - 1)]
    assert len(graph_calls) == NEW_TOKENS - 1  # each step ran inductor's graph, not the function's eager code
    checked_code = [codes[max(i for i in range(step + 1) if how[i] == "checked")] for step in range(len(how))]
    assert all(code is checked for code, checked in zip(codes, checked_code)), "an entry step ran another entry"
    assert len({id(code) for code in codes}) == 2  # the symbolic partial bucket's graph and the whole cache's
    # two reads per bucket's checked step: before it (the variant limit, _make_room) and after it (its entry)
    assert len(entries_read) == 2 * how.count("checked") == 10


@pytest.mark.parametrize("entries", ["unlisted", "first fails its guards", "force_eager"])
def test_torch_compiled_steady_steps_keep_the_skip_stance_without_a_checked_entry(torch_bucket_runs, monkeypatch,
                                                                                 entries):
    """No entry to call directly: a torch that does not list a code object's entries, or a most recent entry whose
    guards do not pass for the step's arguments (listed here oldest first, so the one in front is another bucket's):
    steady steps skip the guards under the stance instead, with the same tokens. Under the caller's `force_eager`
    stance every step runs the eager code, none skips anything."""
    how: list[str] = []
    record_guard_skips(torch_bucket_runs["model"], monkeypatch, how)
    if entries == "unlisted":
        monkeypatch.delattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list")
    elif entries == "first fails its guards":
        listed = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
        monkeypatch.setattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list",
                            lambda code: list(reversed(listed(code))))
    graph_calls = count_graph_calls(monkeypatch)
    with torch.compiler.set_stance("force_eager" if entries == "force_eager" else "fail_on_recompile"):
        result = tg.generate(torch_bucket_runs["model"], [PROMPT], NEW_TOKENS, cache="static",
                             max_cache_len=CACHE_LEN)
    assert result.token_ids == torch_bucket_runs["first"].token_ids
    if entries == "force_eager":
        assert how == ["checked"] * (NEW_TOKENS - 1) and not graph_calls
    else:
        assert how == ["stance" if skip else "checked" for skip in expected_skips(NEW_TOKENS - 1)]
        assert len(graph_calls) == NEW_TOKENS - 1


def greedy_with_switch(torch_bucket_runs, monkeypatch, variable: str, value: str) -> tuple[object, list[bool]]:
    """The fixture's first greedy generation again, on its graphs (fail_on_recompile), with the environment switch
    `variable` set to `value`: its result, checked to give the fixture's tokens, and the guard skip of each step."""
    skipped = record_guard_skips(torch_bucket_runs["model"], monkeypatch)
    monkeypatch.setenv(variable, value)
    with torch.compiler.set_stance("fail_on_recompile"):
        result = tg.generate(torch_bucket_runs["model"], [PROMPT], NEW_TOKENS, cache="static",
                             max_cache_len=CACHE_LEN)
    assert result.token_ids == torch_bucket_runs["first"].token_ids
    return result, skipped


def test_torch_overlapped_compiled_steps_run_the_same_graphs_with_the_same_guard_checks(torch_bucket_runs,
                                                                                         monkeypatch):
    """Two steps in flight (TWINCACHE_OVERLAP_STEPS=1, on CPU for the test, docs/design.md §7.31): a step's bucket and
    whether it repeats the step before it are decided at its launch, so the loop runs the fixture's graphs, checks
    every guard exactly where the one-step loop does, and gives its tokens; the last step's cache is not rolled
    back (nothing was launched after it)."""
    result, skipped = greedy_with_switch(torch_bucket_runs, monkeypatch, "TWINCACHE_OVERLAP_STEPS", "1")
    assert skipped == expected_skips(NEW_TOKENS - 1)
    assert int(result.cache.length) == len(PROMPT) + NEW_TOKENS - 1


def test_torch_compiled_decode_checks_every_guard_after_another_decode_ran_in_between(
        torch_bucket_runs, torch_sampled_runs, monkeypatch):
    """A sampled generation run inside a greedy one's token callback, between two steps of one bucket, makes its own
    graph dynamo's most recent entry: the greedy loop's next step checks every guard again (a skip would trust the
    guards that failed before to tell the two graphs apart). Each generation gives its own tokens, and so do a sampled
    generation after a greedy one and a greedy one after that."""
    model = torch_bucket_runs["model"]
    skipped = record_guard_skips(model, monkeypatch)
    inner: list[object] = []
    calls = []
    between = 5  # the callbacks after the prefill's token and decode steps 0-4; steps 4 and 5 share bucket 16

    def sample_once(_ids: list[int]) -> None:
        calls.append(_ids)
        if len(calls) == between + 1:
            inner.append(tg.generate(model, [PROMPT], SAMPLED_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                                     sampling=SAMPLED[0]))

    with torch.compiler.set_stance("fail_on_recompile"):
        greedy = tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                             on_token=sample_once)
        sampled = tg.generate(model, [PROMPT], SAMPLED_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                              sampling=SAMPLED[0])
        greedy_again = tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN)
    assert greedy.token_ids == greedy_again.token_ids == torch_bucket_runs["first"].token_ids
    assert inner[0].token_ids == sampled.token_ids == torch_sampled_runs["first"].token_ids
    inner_steps, greedy_steps = SAMPLED_TOKENS - 1, NEW_TOKENS - 1
    outer = expected_skips(greedy_steps)
    assert outer[between - 1:between + 1] == [True, True], "step 5 would skip had nothing run in between"
    outer[between] = False
    assert skipped[:between] + skipped[between + inner_steps:between + inner_steps + greedy_steps - between] == outer
    assert skipped[between:between + inner_steps] == expected_skips(inner_steps)


def test_twincache_skip_guards_0_checks_every_guard_and_another_value_is_refused_up_front(
        torch_bucket_runs, monkeypatch):
    from twincache.errors import InputError

    model = torch_bucket_runs["model"]
    _, skipped = greedy_with_switch(torch_bucket_runs, monkeypatch, "TWINCACHE_SKIP_GUARDS", "0")
    assert len(skipped) == NEW_TOKENS - 1 and not any(skipped)
    monkeypatch.setenv("TWINCACHE_SKIP_GUARDS", "yes")
    refused = r"TWINCACHE_SKIP_GUARDS='yes': set it to 0 \(every compiled step checks every guard\) or 1"
    with pytest.raises(InputError, match=refused):
        tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN)
    with torch.inference_mode():
        cache = torch_cache("static", model.config, 1, CACHE_LEN)
        tg.prefill(model, torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long), cache)
    with pytest.raises(InputError, match=refused):
        tg.continue_generation(model, cache, [7], 4)
    assert int(cache.length) == len(PROMPT), "a refused call changes nothing"
    assert len(skipped) == NEW_TOKENS - 1


@pytest.mark.parametrize("study", ["guard_skip", "overlap_steps"])
def test_the_switch_benches_time_both_variants(torch_bucket_runs, study):
    """bench/guard_skip.py's and bench/overlap_steps.py's measurement, on the bucket model's graphs: every step of
    every timed run, both ways, of the variable the generation reads."""
    import os

    from twincache_app.bench_adapters import switch_step_ms, switch_studies

    variable, variants = switch_studies()[study]
    assert variable == {"guard_skip": "TWINCACHE_SKIP_GUARDS", "overlap_steps": "TWINCACHE_OVERLAP_STEPS"}[study]
    assert sorted(variants.values()) == ["0", "1"]
    before = os.environ.get(variable)
    with torch.compiler.set_stance("fail_on_recompile"):
        times = switch_step_ms(torch_bucket_runs["directory"], PROMPT, NEW_TOKENS, 1, "static", variable, variants,
                               CACHE_LEN, device="cpu")
    assert set(times) == set(variants)
    assert all(len(steps) == NEW_TOKENS - 2 and min(steps) > 0 for steps in times.values())
    assert os.environ.get(variable) == before, "the variable is restored"


def test_the_one_step_adapter_runs_torch_compileds_graphs_and_caches_with_the_overlap_off(torch_bucket_runs,
                                                                                         monkeypatch):
    """bench's torch_compiled_one_step (the 7b preset's A/B of design.md §7.31): torch_compiled's model, compiled
    step and cache buffers (a GPU's CUDA graphs are recorded on their addresses), with its decode loop's overlap off
    whatever the environment says, and the environment restored after."""
    import os

    from bench.impls import impl_registry
    from bench.presets import PRESETS, resolve
    from bench.workload import Workload

    monkeypatch.setattr(buckets, "ATTEND_BLOCK", BLOCK)
    monkeypatch.setenv("TWINCACHE_OVERLAP_STEPS", "1")
    workload = Workload(resolve(PRESETS["tiny"], model=torch_bucket_runs["directory"]), "cpu")
    workload.models["torch"] = torch_bucket_runs["model"]  # compiled by the fixture
    wanted, overlapped_loops = tg._overlap_wanted, []
    monkeypatch.setattr(tg, "_overlap_wanted", lambda device: overlapped_loops.append(wanted(device)) or wanted(device))
    registry = impl_registry()
    adapters = [registry[name](workload) for name in ("torch_compiled", "torch_compiled_one_step")]
    with torch.compiler.set_stance("fail_on_recompile"):
        runs = [adapter.generate([PROMPT], NEW_TOKENS, "static", CACHE_LEN) for adapter in adapters * 2]
    # generate asks before its prefill (a bad value is refused there) and its decode loop asks again
    assert overlapped_loops == [True, True, False, False] * 2, overlapped_loops
    assert os.environ["TWINCACHE_OVERLAP_STEPS"] == "1"
    caches = [adapter._caches for adapter in adapters]  # type: ignore[attr-defined]
    assert caches[0] is caches[1] and len(caches[0]) == 1, "one cache for both"
    assert len({run.decode_steps for run in runs}) == 1


def test_torch_compiled_decodes_in_two_threads_take_turns_and_give_their_own_tokens(
        torch_bucket_runs, torch_sampled_runs, monkeypatch):
    """A greedy and a sampled generation of one model, side by side in two threads: the skip stance is process-wide,
    so their steps take turns under one lock (none starts while another runs, though the interpreter switches threads
    every 10 us here), and each gives its own tokens."""
    import sys
    import threading

    model = torch_bucket_runs["model"]
    steps = tg._decode_one_fn(model, True)
    running, overlaps = [0], [0]

    def counting(*args, _step=steps.step):
        running[0] += 1
        overlaps[0] += running[0] > 1
        try:
            return _step(*args)
        finally:
            running[0] -= 1

    def entry_function(compiled, args, _own=tg._entry_function):  # steady CPU steps call an entry directly (§7.34)
        direct = _own(compiled, args)
        return None if direct is None else functools.partial(counting, _step=direct)

    monkeypatch.setattr(steps, "step", counting)
    monkeypatch.setattr(tg, "_entry_function", entry_function)
    results: dict[str, object] = {}

    def run(name: str, sampling: SamplingParams | None, new_tokens: int) -> None:
        results[name] = tg.generate(model, [PROMPT], new_tokens, cache="static", max_cache_len=CACHE_LEN,
                                    sampling=sampling)

    threads = [threading.Thread(target=run, args=("greedy", None, NEW_TOKENS)),
               threading.Thread(target=run, args=("sampled", SAMPLED[0], SAMPLED_TOKENS))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert overlaps[0] == 0
    assert results["greedy"].token_ids == torch_bucket_runs["first"].token_ids
    assert results["sampled"].token_ids == torch_sampled_runs["first"].token_ids


# --- with chunked prefill, fused blocks and forced tokens -------------------------------------------------------------

LONG_PROMPT = [(7 * i + 3) % 70 + 2 for i in range(20)]
CHUNK = 4
FORCED = [(5 * i + 1) % 70 + 2 for i in range(NEW_TOKENS)]


def chunk_buckets(prompt_len: int, chunk: int) -> list[int]:
    """The oracle: the bucket of each whole chunk of `chunk` columns, from the slots filled once it is written."""
    return [visited_buckets(end - 1, 1, CACHE_LEN)[0] for end in range(chunk, prompt_len + 1, chunk)]


def recorded_reads(monkeypatch, cache_class) -> list[int | None]:
    """From now on, the attend_len of every attended_positions call (JAX: once per trace, so per compiled variant)."""
    seen: list[int | None] = []
    original = cache_class.attended_positions

    def recording(self, new_positions, attend_len=None):
        seen.append(attend_len)
        return original(self, new_positions, attend_len)

    monkeypatch.setattr(cache_class, "attended_positions", recording)
    return seen


def test_torch_prefill_chunks_read_the_bucket_of_the_live_prefix(gqa, monkeypatch):
    """Each chunk of a static prefill reads the bucket of the slots filled once it is written: not the whole cache,
    not the chunk alone. The slots past the last chunk's bucket hold NaN, and the logits are one full read's."""
    model = TorchMistral.from_pretrained(gqa)
    ids, mask = torch.tensor([LONG_PROMPT]), torch.ones(1, len(LONG_PROMPT), dtype=torch.long)
    with monkeypatch.context() as patch:
        patch.setattr(buckets, "ATTEND_BLOCK", 1 << 20)  # one bucket: the whole cache
        expected = tg.prefill(model, ids, mask, torch_cache("static", model.config, 1, CACHE_LEN), len(LONG_PROMPT))
    read = chunk_buckets(len(LONG_PROMPT), CHUNK)
    assert read == [8, 8, 16, 16, 32]
    cache = torch_cache("static", model.config, 1, CACHE_LEN)
    poison_torch(cache, read[-1])
    seen = recorded_reads(monkeypatch, TorchStaticCache)
    logits = tg.prefill(model, ids, mask, cache, CHUNK)
    assert seen == read
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_jax_prefill_chunks_read_the_bucket_of_the_live_prefix(gqa, monkeypatch):
    """As torch's: chunks of one width compile once per bucket they read (8, 16, 32), never the whole cache."""
    model = JaxMistral.from_pretrained(gqa)
    ids, mask = jnp.asarray([LONG_PROMPT]), jnp.ones((1, len(LONG_PROMPT)), jnp.int32)
    with monkeypatch.context() as patch:
        patch.setattr(buckets, "ATTEND_BLOCK", 1 << 20)
        expected, _ = jg.prefill(model, ids, mask, jg.make_cache("static", model.config, 1, CACHE_LEN),
                                 len(LONG_PROMPT))
    jax.clear_caches()
    read = chunk_buckets(len(LONG_PROMPT), CHUNK)
    seen = recorded_reads(monkeypatch, JaxStaticCache)
    logits, _ = jg.prefill(model, ids, mask, poison_jax(jg.make_cache("static", model.config, 1, CACHE_LEN), read[-1]),
                           CHUNK)
    assert seen == sorted(set(read)) == [8, 16, 32]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=0, atol=1e-5)


def jax_uncached(model: JaxMistral, sequence: list[int]) -> np.ndarray:
    """One forward over the whole sequence into a fresh static cache, every slot read. [len, V]. Jitted: one
    compile, where op by op each of the forward's primitives compiled for this length (~2 s)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_jax_uncached(graphdef, state, jnp.asarray([sequence], jnp.int32))[0])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _jax_uncached(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]  # [1, L]
    return model(ids, positions, JaxStaticCache(model.config, 1, ids.shape[1]))[0]


def test_jax_forced_tokens_through_chunked_prefill_and_fused_blocks_that_end_at_bucket_edges(gqa, monkeypatch):
    """Forced tokens after a prefill in chunks of 4 (the prompt padded to 8 columns), decoded from column 8 through
    the buckets 16, 32, 64 and the whole cache. Blocks timed as very fast grow to the compiled capacity but end where
    their bucket does ([8, 8, 8, 32, 13] steps); every step's logits are those of the model fed exactly the prompt
    and the forced tokens, in the fused and the step mode."""
    model = JaxMistral.from_pretrained(gqa)
    monkeypatch.setattr(jg, "FIRST_BLOCK_STEPS", 8)
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", 1e9)  # each timed block as long as capacity and bucket allow
    sizes = record_fused_blocks(monkeypatch, jg)
    room = CACHE_LEN - NEW_TOKENS
    assert jg.prompt_bucket(len(PROMPT), room, CHUNK) == 8
    results = {mode: jg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                                 fused=mode == "fused", forced_tokens=[FORCED], return_logits=True,
                                 prefill_chunk=CHUNK) for mode in ("fused", "step")}
    per_step = visited_buckets(8, NEW_TOKENS - 1, CACHE_LEN)
    edges = np.cumsum([0, *sizes])
    assert edges[-1] == NEW_TOKENS - 1
    assert all(len(set(per_step[a:b])) == 1 for a, b in zip(edges, edges[1:])), (sizes, per_step)
    assert sizes == [8, 8, 8, 32, 13]
    expected = jax_uncached(model, PROMPT + FORCED[:-1])[len(PROMPT) - 1:]  # [N, V]
    for mode, result in results.items():
        assert result.token_ids == [FORCED], mode
        np.testing.assert_allclose(np.asarray(result.step_logits[0]), expected, rtol=0, atol=1e-5, err_msg=mode)


def test_torch_compiled_graphs_decode_after_a_chunked_prefill(torch_bucket_runs, torch_sampled_runs):
    """A prefill in chunks of 2 columns, then the graphs the fixtures compiled (no recompile): forced tokens run the
    greedy graph, with each step's logits those of the model fed exactly those tokens; a seeded draw gives the
    tokens of the run prefilled at once."""
    model = torch_bucket_runs["model"]
    with torch.compiler.set_stance("fail_on_recompile"):
        forced = tg.generate(model, [PROMPT], NEW_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                             forced_tokens=[FORCED], return_logits=True, prefill_chunk=2)
        sampled = tg.generate(model, [PROMPT], SAMPLED_TOKENS, cache="static", max_cache_len=CACHE_LEN,
                              sampling=SAMPLED[0], prefill_chunk=2)
    assert forced.token_ids == [FORCED]
    sequence = PROMPT + FORCED[:-1]
    with torch.inference_mode():
        expected = model(torch.tensor([sequence]), torch.arange(len(sequence))[None],
                         torch_cache("static", model.config, 1, len(sequence)))[0, len(PROMPT) - 1:]  # [N, V]
    torch.testing.assert_close(forced.step_logits[0], expected.float(), rtol=0, atol=1e-5)
    assert sampled.token_ids == torch_sampled_runs["first"].token_ids
