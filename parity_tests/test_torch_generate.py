"""torch_cache.generate: left-padded batches, per-row EOS, compiled decode (once, no recompiles), fixed cache
addresses, and sampling.

Only two compiled generations run in this file (each compile costs ~15-20 s on a 2-core CPU): both in the
module-scoped `compiled` fixture, on one model, so the second reuses the first one's compiled step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import io
import json
import logging
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from parity_tests.conftest import WINDOW, save_hf_checkpoint
from parity_tests.hf_greedy import greedy as hf_greedy
from torch_cache import generate as torch_generate
from torch_cache.cache import SlidingWindowCache, StaticCache, make_cache
from torch_cache.generate import generate, sample
from torch_cache.model import Mistral
from twincache.errors import ResourceError
from twincache.generation import SamplingParams

ATOL = 1e-5
VOCAB = 128
NEW_TOKENS = 20


def make_prompt(length: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(1, VOCAB, (length,), generator=generator).tolist()


PROMPTS = [make_prompt(3), make_prompt(9), make_prompt(14)]  # shorter than, just over, and well over window 8


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs().max()
    return float("inf") if torch.isnan(diff) else float(diff)


def cache_buffers(cache: StaticCache) -> list[torch.Tensor]:
    return [*cache.keys, *cache.values, cache.slot_positions, cache.length]


def pointers(cache: StaticCache) -> list[int]:
    return [t.data_ptr() for t in cache_buffers(cache)]


def decode_wraps(prompt_len: int, new_tokens: int, window: int = WINDOW) -> int:
    """Times decoding writes ring slot 0 again: decode steps write positions prompt_len .. prompt_len+new-2."""
    return sum(1 for p in range(prompt_len, prompt_len + new_tokens - 1) if p % window == 0)


@pytest.fixture(scope="module")
def model(checkpoints: dict[str, Path]) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"])


# --- batches ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_left_padded_batch_rows_equal_each_prompt_alone(model, cache):
    batch = generate(model, PROMPTS, NEW_TOKENS, cache=cache, compile=False, return_logits=True)
    assert batch.step_logits.shape == (len(PROMPTS), NEW_TOKENS, VOCAB)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], NEW_TOKENS, cache=cache, compile=False, return_logits=True)
        assert batch.token_ids[row] == alone.token_ids[0], f"cache={cache} row {row} (prompt_len={len(prompt)})"
        for step in range(NEW_TOKENS):
            diff = max_abs_diff(batch.step_logits[row, step], alone.step_logits[0, step])
            assert diff <= ATOL, f"cache={cache} row {row} (prompt_len={len(prompt)}) step {step}: {diff:.3g}"
    assert batch.prompt_ids == PROMPTS


@pytest.fixture(scope="module")
def unstopped(model) -> list[list[int]]:
    """Greedy tokens of PROMPTS as a batch without an EOS id (the fixture checkpoints have eos_token_id=None)."""
    assert model.config.eos_token_id is None
    return generate(model, PROMPTS, NEW_TOKENS, compile=False).token_ids


def with_eos(checkpoints: dict[str, Path], tmp_path: Path, eos: int) -> Mistral:
    """The gqa checkpoint copied with eos_token_id set in its config.json and generation_config.json, as
    save_pretrained writes both (generate, transformers' and ours, stops at the latter's ids)."""
    directory = tmp_path / f"gqa_eos{eos}"
    shutil.copytree(checkpoints["gqa"], directory)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config["eos_token_id"] = eos
        (directory / name).write_text(json.dumps(config))
    eos_model = Mistral.from_pretrained(directory)
    assert eos_model.config.eos_token_id == eos
    return eos_model


def first_index(row: list[int], token: int) -> int | None:
    return row.index(token) if token in row else None


@pytest.mark.parametrize("pattern", ["every_row_stops", "some_rows_never_stop"])
def test_each_row_stops_at_its_own_eos(checkpoints, tmp_path, unstopped, pattern):
    # Pick an EOS id that greedy decoding produces, at different steps in different rows.
    candidates = []
    for token in sorted({t for row in unstopped for t in row}):
        stops = [first_index(row, token) for row in unstopped]
        found = [s for s in stops if s is not None]
        if pattern == "every_row_stops":
            ok = len(found) == len(stops) and len(set(found)) == len(found) and max(found) < NEW_TOKENS - 1
        else:
            ok = len(found) >= 2 and len(set(found)) == len(found) and len(found) < len(stops)
        if ok:
            candidates.append((token, stops))
    assert candidates, f"no token of {unstopped} fits the pattern {pattern}; change the prompts"
    eos, stops = candidates[0]

    eos_model = with_eos(checkpoints, tmp_path, eos)
    streamed: list[list[int]] = []
    result = generate(eos_model, PROMPTS, NEW_TOKENS, compile=False, return_logits=True, on_token=streamed.append)
    for row, stop in enumerate(stops):
        expected = unstopped[row] if stop is None else unstopped[row][: stop + 1]
        assert result.token_ids[row] == expected, f"eos={eos} row {row}: expected to stop at step {stop}"
    steps_run = NEW_TOKENS if None in stops else max(stops) + 1
    assert len(streamed) == steps_run, "generation must end as soon as every row has produced its EOS"
    assert result.decode_steps == steps_run - 1
    assert result.step_logits.shape[1] == steps_run
    for row, stop in enumerate(stops):
        for step, ids in enumerate(streamed):
            want = unstopped[row][step] if stop is None or step <= stop else eos
            assert ids[row] == want, f"eos={eos} row {row} step {step}: callback got {ids[row]}, want {want}"


# --- compiled decode ----------------------------------------------------------------------------------------------


def graph_stats() -> dict[str, int]:
    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "aot_compiles": counters["aot_autograd"]["total"]}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two compiled greedy generations on one model (its decode step compiles here, exactly once).

    dynamo caches compiled code per code object and reuses a graph for another model of the same shapes, so this
    model has a shape no other test uses (3 layers): its first decode step must compile. The first generation counts
    dynamo graphs around a generation that wraps the window 4 times; the second uses a new cache object and another
    prompt length under torch.compiler.set_stance("fail_on_recompile"), and so do one on a ring generate builds
    itself (inside inference mode, where the others were built outside it), two on rings it sizes for totals under
    the window (another max_new_tokens each: one size class) and a teacher-forced one (forced_tokens feed the same
    compiled step).
    """
    directory = save_hf_checkpoint(tmp_path_factory.mktemp("compiled") / "three_layers", seed=21, num_hidden_layers=3)
    # The model whose first step compiles is dropped at the end, and must be freed; the rest run its graph on another.
    first_model, compiled_model = Mistral.from_pretrained(directory), Mistral.from_pretrained(directory)
    assert compiled_model.config.sliding_window == WINDOW
    first_prompt, second_prompt, new_tokens = make_prompt(5, seed=7), make_prompt(11, seed=7), 30
    cache = SlidingWindowCache(compiled_model.config, 1, len(first_prompt) + new_tokens)
    allocated = pointers(cache)
    before = graph_stats()
    # a user's own recompile_limit, lowered to catch their recompiles: left as it was
    with torch._dynamo.config.patch(recompile_limit=1):
        first = generate(first_model, [first_prompt], new_tokens, cache=cache, compile=True, return_logits=True)
        user_limit = torch._dynamo.config.recompile_limit
    after_first = graph_stats()
    after_first_pointers = pointers(cache)
    second_cache = SlidingWindowCache(compiled_model.config, 1, len(second_prompt) + new_tokens)
    with torch.compiler.set_stance("fail_on_recompile"):
        second = generate(compiled_model, [second_prompt], new_tokens, cache=second_cache, compile=True,
                          return_logits=True)
        # generate's own ring, built inside its inference mode, has the user-made rings' shape: the same graph
        own = generate(compiled_model, [second_prompt], new_tokens, cache="sliding_window", compile=True)
        # and so do rings it sizes for 2 + 4 and 2 + 5 tokens, under the window: rounded up, they are its ring
        short = [generate(compiled_model, [first_prompt[:2]], budget, cache="sliding_window", compile=True)
                 for budget in (4, 5)]
    assert own.token_ids == second.token_ids
    assert short[1].token_ids[0][:4] == short[0].token_ids[0]
    after_second = graph_stats()
    forced_tokens = [list(reversed(first.token_ids[0]))]
    with torch.compiler.set_stance("fail_on_recompile"):
        forced = generate(compiled_model, [first_prompt], new_tokens, compile=True, forced_tokens=forced_tokens,
                          cache=SlidingWindowCache(compiled_model.config, 1, len(first_prompt) + new_tokens))
    assert forced.token_ids == forced_tokens and graph_stats() == after_second
    dropped = weakref.ref(first_model)
    del first_model
    gc.collect()
    return dict(model=compiled_model, prompts=(first_prompt, second_prompt), new_tokens=new_tokens,
                results=(first, second), cache=cache, allocated=allocated, after_first_pointers=after_first_pointers,
                stats=(before, after_first, after_second), dropped=dropped, user_limit=user_limit)


def test_compiled_decode_equals_eager(compiled):
    for prompt, result in zip(compiled["prompts"], compiled["results"]):
        eager = generate(compiled["model"], [prompt], compiled["new_tokens"], cache="sliding_window", compile=False,
                         return_logits=True)
        assert result.token_ids == eager.token_ids, f"prompt_len={len(prompt)}"
        for step in range(compiled["new_tokens"]):
            diff = max_abs_diff(result.step_logits[0, step], eager.step_logits[0, step])
            assert diff <= ATOL, f"prompt_len={len(prompt)} step {step}: compiled vs eager {diff:.3g}"


def test_decode_compiles_once_and_never_recompiles_across_window_wraps(compiled):
    before, after_first, after_second = compiled["stats"]
    for prompt in compiled["prompts"]:
        assert decode_wraps(len(prompt), compiled["new_tokens"]) >= 3
    assert all(r.decode_steps == compiled["new_tokens"] - 1 for r in compiled["results"])
    assert after_first["unique_graphs"] - before["unique_graphs"] == 1, (before, after_first)
    assert after_first["aot_compiles"] - before["aot_compiles"] == 1, (before, after_first)
    assert after_first["graph_breaks"] == before["graph_breaks"], "fullgraph=True: no graph breaks"
    # The second generation ran under fail_on_recompile (any recompile raises) and added nothing.
    assert after_second == after_first


def test_a_compiled_generation_leaves_the_user_s_recompile_limit_as_it_was(compiled):
    """The decode step needs up to MAX_DECODE_VARIANTS entries, and raised dynamo's process-wide recompile_limit
    to it for good at its first compile (a user's limit of 1 came back as 64); now only while its own steps run, so
    they compile past a user's lower limit (a step of the same machinery with dynamo's eager backend here)."""
    assert compiled["user_limit"] == 1

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    steps = torch_generate._DecodeSteps(torch.compile(step, backend="eager", fullgraph=True, dynamic=False),
                                        contextlib.ExitStack, compiled=True)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            for size in (1, 2, 3):  # three variants of the step's code
                assert steps(torch.ones(size)).tolist() == [2.0] * size
                assert torch._dynamo.config.recompile_limit == 1
    finally:
        torch._C._dynamo.eval_frame.reset_code(step.__code__)


def test_a_compiled_generation_runs_eagerly_under_torch_compile_disable(model, checkpoints, caplog):
    """TORCH_COMPILE_DISABLE=1 (torch._dynamo.config.disable): torch.compile runs functions eagerly, but under
    fullgraph=True the decode step raised "torch.compile with fullgraph=True found no compiled frames" (the CLI's
    "unexpected RuntimeError"), after announcing a compile. Now it decodes eagerly, as torch.compile then does, without
    the notice; judged by transformers' greedy tokens."""
    prompt = PROMPTS[1]
    with torch._dynamo.config.patch(disable=True), caplog.at_level(logging.INFO, logger="twincache"):
        result = generate(model, [prompt], 6, compile=True)
    assert result.token_ids == hf_greedy(checkpoints["gqa"], [prompt], 6)
    assert not [r for r in caplog.records if r.name == "twincache" and "compiling" in r.getMessage()]


def test_a_generation_on_a_cpu_model_ignores_the_user_s_default_device(model, checkpoints):
    """torch.set_default_device("cuda") (here "meta", which any CPU has) in a library user's process: a cache
    generate built for a CPU model under 2 MiB (plain zeros, not huge-page host memory) landed on the default device,
    and the call was refused as "input_ids is on cpu but the cache is on meta; move them to one device", inputs the
    caller never placed. Judged by transformers' greedy tokens."""
    prompt = PROMPTS[2]
    with torch.device("meta"):
        result = generate(model, [prompt], 6, cache="static", compile=False)
    assert result.cache.keys[0].device.type == "cpu"
    assert result.token_ids == hf_greedy(checkpoints["gqa"], [prompt], 6)


def test_a_dropped_model_is_freed_after_its_step_was_made(checkpoints):
    """generate makes a model's compiled decode step (compiled at its first run) once per model, and the step's
    closure holds the model: kept in a table keyed by the model, it kept every model a process had decoded with alive,
    weights and all (the CLI run in one process three times: RSS 957 -> 1505 -> 2040 MB)."""
    model = Mistral.from_pretrained(checkpoints["gqa"])
    steps = torch_generate._decode_one_fn(model, compile=True)
    assert torch_generate._decode_one_fn(model, compile=True) is steps, "made once per model"
    dropped = weakref.ref(model)
    del model, steps
    gc.collect()
    assert dropped() is None


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, lambda m: torch.load(_saved(m), weights_only=False)])
def test_a_copied_model_decodes_with_its_own_step(checkpoints, duplicate):
    """The step's closure holds the model it was made for: a copy of a model whose step was made (copy.copy and
    deepcopy copy its attributes, torch.save pickles them) must not decode with the original's weights, and the model
    must still pickle (a local function does not)."""
    model = Mistral.from_pretrained(checkpoints["gqa"])
    steps = torch_generate._decode_one_fn(model, compile=True)
    twin = duplicate(model)
    twin_steps = torch_generate._decode_one_fn(twin, compile=True)
    assert twin_steps is not steps
    held = [cell.cell_contents for cell in twin_steps.compiled_step._torchdynamo_orig_callable.__closure__
            if isinstance(cell.cell_contents, Mistral)]
    assert held == [twin], "the copy's step decodes with the copy"
    assert torch_generate._decode_one_fn(model, compile=True) is steps, "the original keeps its own step"


def _saved(model: Mistral) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


def test_a_dropped_model_is_freed_after_its_step_compiled(compiled):
    """The same after a real compile: neither dynamo's cache entries nor inductor's graph keep the model that compiled
    them (CPU; the fixture's first model, dropped once every generation ran)."""
    assert compiled["dropped"]() is None


def test_cache_buffers_keep_their_addresses_through_a_compiled_generation(compiled):
    cache = compiled["cache"]
    assert compiled["after_first_pointers"] == compiled["allocated"]
    assert pointers(cache) == compiled["allocated"]
    prompt_len = len(compiled["prompts"][0])
    assert int(cache.length) == prompt_len + compiled["new_tokens"] - 1, "the cache was really written"
    assert sorted(cache.slot_positions[0].tolist()) == list(range(int(cache.length) - WINDOW, int(cache.length)))


def test_a_compiled_generation_writes_the_keys_and_values_an_eager_one_writes(compiled):
    """The compiled step writes each layer's K/V inside that layer's compiled region, on its buffers as inputs
    (DecoderLayer.forward_in_place): a write lost there would leave the ring as the prefill and earlier steps left it.
    After the same tokens every buffer of the cache equals an eager generation's."""
    model, prompt, new_tokens = compiled["model"], compiled["prompts"][0], compiled["new_tokens"]
    eager_cache = SlidingWindowCache(model.config, 1, len(prompt) + new_tokens)
    eager = generate(model, [prompt], new_tokens, cache=eager_cache, compile=False)
    assert eager.token_ids == compiled["results"][0].token_ids
    for layer_idx in range(model.config.num_hidden_layers):
        for name in ("keys", "values"):
            written, expected = getattr(compiled["cache"], name)[layer_idx], getattr(eager_cache, name)[layer_idx]
            diff = max_abs_diff(written, expected)
            assert diff <= ATOL, f"layer {layer_idx} {name}: compiled vs eager {diff:.3g}"
    assert torch.equal(compiled["cache"].slot_positions, eager_cache.slot_positions)


def test_a_step_at_dynamo_s_limit_drops_its_compiled_variants_and_keeps_running(monkeypatch, caplog):
    """Every cache shape, batch, bucket and sampling kind is one compiled entry of the one decode step code, and the
    entry past dynamo's recompile_limit raised FailOnRecompileLimitHit (fullgraph=True): a long-running process
    stopped decoding. _DecodeSteps drops the code's entries first, and only when the call would compile. Run on a
    step of the same machinery with dynamo's eager backend and a limit of 2 (no inductor compile)."""
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    steps = torch_generate._DecodeSteps(compiled, contextlib.ExitStack, compiled=True)
    entries = functools.partial(torch._C._dynamo.eval_frame._debug_get_cache_entry_list, step.__code__)

    def notices() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.name == "twincache"]

    # (torch.compile's config patch: monkeypatch's undo hides a torch config entry; a step raises the limit to
    # MAX_DECODE_VARIANTS while it runs)
    monkeypatch.setattr(torch_generate, "MAX_DECODE_VARIANTS", 2)
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            with caplog.at_level(logging.WARNING, logger="twincache"):
                assert steps(torch.zeros(1)).tolist() == [1] and steps(torch.zeros(2)).tolist() == [1, 1]
                assert steps(torch.zeros(1)).tolist() == [1], "a variant it holds, at the limit"
                assert len(entries()) == 2 and notices() == [], "nothing to drop for a call that compiles nothing"
                with torch.inference_mode(), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
                    compiled(torch.zeros(3))  # what the step raised
                assert steps(torch.zeros(3)).tolist() == [1, 1, 1]
            assert len(entries()) == 1, "the old entries were dropped, the new one compiled"
            assert notices() == [
                "the compiled decode step reached dynamo's limit of 2 variants in this process; dropped them, so each "
                "variant used again compiles again"]
            steps(torch.zeros(4))
            monkeypatch.delattr(torch._dynamo, "reset_code")  # a torch that cannot drop them: a clear refusal
            with pytest.raises(ResourceError, match="holds 2 variants .* dynamo's limit of 2"):
                steps(torch.zeros(5))
    finally:
        torch._C._dynamo.eval_frame.reset_code(step.__code__)


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
def test_cache_buffers_keep_their_addresses_through_reused_eager_generations(model, kind):
    cache = make_cache(kind, model.config, len(PROMPTS), 40)
    allocated = pointers(cache)
    first = generate(model, PROMPTS, NEW_TOKENS, cache=cache, compile=False)
    assert pointers(cache) == allocated
    again = generate(model, PROMPTS, NEW_TOKENS, cache=cache, compile=False)  # reused: reset, then written again
    assert pointers(cache) == allocated
    assert again.token_ids == first.token_ids
    longest = max(len(p) for p in PROMPTS)
    assert int(cache.length) == longest + NEW_TOKENS - 1
    # Left padding: positions are cumsum(mask) - 1, so each row's cached positions run 0.. from its first real token.
    for row, prompt in enumerate(PROMPTS):
        held = len(prompt) + NEW_TOKENS - 1  # prompt plus every generated token but the last
        slots = cache.slot_positions[row].tolist()
        if kind == "static":
            unused = cache.cache_len - int(cache.length)
            assert slots == [-1] * (longest - len(prompt)) + list(range(held)) + [-1] * unused, f"row {row}"
        else:
            assert sorted(slots) == list(range(held - WINDOW, held)), f"row {row}"


# --- sampling -----------------------------------------------------------------------------------------------------


def run(model: Mistral, sampling: SamplingParams, prompts: list[list[int]] = PROMPTS, **kwargs: object):
    return generate(model, prompts, NEW_TOKENS, sampling=sampling, compile=False, **kwargs)


@pytest.fixture(scope="module")
def greedy(model) -> list[list[int]]:
    return generate(model, PROMPTS, NEW_TOKENS, compile=False).token_ids


def test_same_seed_gives_same_tokens_and_seeds_matter(model):
    first = run(model, SamplingParams(temperature=1.0, seed=7)).token_ids
    assert run(model, SamplingParams(temperature=1.0, seed=7)).token_ids == first
    others = [run(model, SamplingParams(temperature=1.0, seed=seed)).token_ids for seed in (8, 9)]
    assert any(other != first for other in others), "different seeds must be able to give different samples"


def test_top_k_one_equals_greedy(model, greedy):
    for seed in (0, 1):
        assert run(model, SamplingParams(temperature=1.5, top_k=1, seed=seed)).token_ids == greedy
    # a huge temperature scales every logit to ~0, but top-k cuts the logits' order, not the scaled values
    assert run(model, SamplingParams(temperature=1e39, top_k=1)).token_ids == greedy


def test_tiny_top_p_equals_greedy(model, greedy):
    for seed in (0, 1):
        assert run(model, SamplingParams(temperature=1.5, top_p=1e-6, seed=seed)).token_ids == greedy


def test_temperature_sampling_differs_from_greedy(model, greedy):
    sampled = [run(model, SamplingParams(temperature=1.0, seed=seed)).token_ids for seed in range(3)]
    assert any(tokens != greedy for tokens in sampled)


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.5)])
def test_sampled_tokens_stay_inside_the_filter(model, top_k, top_p):
    temperature = 0.8
    result = run(model, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=3), return_logits=True)
    for row, tokens in enumerate(result.token_ids):
        for step, token in enumerate(tokens):
            logits = result.step_logits[row, step] / temperature
            order = logits.argsort(descending=True)
            rank = int((order == token).nonzero())
            if top_k:
                assert rank < top_k, f"row {row} step {step}: token of rank {rank} escaped top_k={top_k}"
            else:
                mass_above = float(logits.softmax(-1)[order[:rank]].sum())
                assert mass_above < top_p, f"row {row} step {step}: token with {mass_above:.3f} mass above it"


def test_sample_on_hand_made_logits():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0], [3.0, 0.0, 0.0, 2.9]])
    assert sample(logits, SamplingParams(), None).tolist() == [1, 0]
    seen: list[set[int]] = [set(), set()]
    for seed in range(40):
        key = torch.tensor(seed)
        assert sample(logits, SamplingParams(temperature=2.0, top_k=1), key).tolist() == [1, 0]
        # top_p 0.6: the top token alone has ~0.52 of the mass, so the runner-up stays in and nothing else does.
        for row, pick in enumerate(sample(logits, SamplingParams(temperature=1.0, top_p=0.6), key).tolist()):
            seen[row].add(pick)
    assert seen == [{1, 2}, {0, 3}]
