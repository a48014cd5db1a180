"""The JAX fused mode in bounded blocks (docs/design.md §5): the decode loop runs as jitted `lax.while_loop` blocks
of FUSED_BLOCK_STEPS steps, so Ctrl-C takes effect between blocks and tokens stream a block at a time.

Blocks of 4 steps here, with budgets that end mid-block: the tokens must be those of one loop over the whole budget
and of the step mode, greedy and sampled; rows that stop at their EOS mid-block stop there; a non-finite step mid-block
hands on no garbage token; and every block of every budget runs one compiled executable.
"""

from __future__ import annotations

import collections
import logging

import jax
import numpy as np
import pytest

import jax_cache.generate as jg
from jax_cache.model import Mistral
from parity_tests.conftest import record_fused_blocks
from parity_tests.test_cli_bad_inputs import copy_checkpoint, rewrite_tensors
from parity_tests.test_jax_generate import count_forward_traces, with_eos
from twincache.errors import NonFiniteLogitsError
from twincache.generation import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 8, 61], [11, 2, 70, 35]]
BLOCK = 4
NEW_TOKENS = 23  # 22 decode steps after the prefill's token: 5 whole blocks and a part


@pytest.fixture(scope="module")
def model(checkpoints) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"])


@pytest.fixture
def blocks_of(monkeypatch):
    def set_block(steps: int) -> None:
        monkeypatch.setattr(jg, "FUSED_BLOCK_STEPS", steps)
    return set_block


def run(model: Mistral, mode: str, sampling: SamplingParams | None = None, new_tokens: int = NEW_TOKENS,
        stream: bool = False) -> tuple[jg.GenerationResult, list[list[int]]]:
    streamed: list[list[int]] = []
    result = jg.generate(model, PROMPTS, new_tokens, cache="sliding_window", max_cache_len=64, sampling=sampling,
                         fused=mode == "fused", on_token=streamed.append if stream else None, return_logits=True)
    return result, streamed


def test_blocks_give_the_tokens_of_one_loop_and_of_the_step_mode(model, blocks_of):
    """Sampled, so that the PRNG key folded with the step index must carry across block boundaries (greedy decoding
    is checked against the step mode by the tests below)."""
    sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    blocks_of(BLOCK)
    blocked, streamed = run(model, "fused", sampling, stream=True)
    blocks_of(64)  # one block holds the whole budget: the single loop
    single, _ = run(model, "fused", sampling)
    stepped, _ = run(model, "step", sampling)
    assert blocked.token_ids == single.token_ids == stepped.token_ids
    assert blocked.decode_steps == single.decode_steps == NEW_TOKENS - 1
    assert [list(step) for step in zip(*blocked.token_ids)] == streamed, "on_token must get every step, in order"
    np.testing.assert_array_equal(np.asarray(blocked.step_logits), np.asarray(single.step_logits))
    np.testing.assert_allclose(np.asarray(blocked.step_logits), np.asarray(stepped.step_logits), rtol=0, atol=1e-5)


def test_every_block_of_every_budget_runs_one_executable(model, blocks_of, monkeypatch):
    """Budgets of 1, 3, 9 and 33 blocks compile the loop at most once (none when an earlier test compiled it): the
    block's step limit is an array, not a shape."""
    blocks_of(BLOCK)
    traced = count_forward_traces(monkeypatch)
    # counted in a table of its own: the session's is an LRU whose length stays put once full
    monkeypatch.setattr(jg, "_fused_executables", collections.OrderedDict())
    before = len(jg._fused_executables)
    for new_tokens in (3, 10, 34, 133):
        result, _ = run(model, "fused", new_tokens=new_tokens)
        assert result.decode_steps == new_tokens - 1 and all(len(row) == new_tokens for row in result.token_ids)
    assert len(jg._fused_executables) - before <= 1
    assert traced[1] <= 1, f"the loop body was traced {traced[1]} times"


def test_return_logits_compiles_nothing_when_a_call_repeats_in_other_blocks(model, blocks_of, monkeypatch, caplog):
    """A fused block's size follows wall time, so a repeated call splits its steps into other blocks: each block's
    logits are written into one array (jg._write_logits, offsets traced), where slicing each block to its steps and
    concatenating them compiled 2-3 ops on most calls. The repeat, and the step mode's, compile nothing (JAX's compile
    log) and give the same logits. A budget no other test here decodes: compiled code is per process, and the other
    tests' blocks would have compiled a variant per block size (an offset or size made static, say) before this."""
    blocks_of(BLOCK)
    monkeypatch.setattr(jg, "FIRST_BLOCK_STEPS", 2)
    sizes = record_fused_blocks(monkeypatch, jg)
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", 1e9)  # blocks as fast steps size them
    new_tokens = NEW_TOKENS - 2
    first, stepped = run(model, "fused", new_tokens=new_tokens)[0], run(model, "step", new_tokens=new_tokens)[0]
    first_sizes = sizes[:]
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", 1e-9)  # ... and as slow steps do
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        again, step_again = run(model, "fused", new_tokens=new_tokens)[0], run(model, "step", new_tokens=new_tokens)[0]
    compiled = [record.getMessage()[:120] for record in caplog.records if "Compiling" in record.getMessage()]
    assert sizes[len(first_sizes):] != first_sizes, f"the blocks were not split otherwise: {sizes}"
    assert compiled == [], f"a repeated return_logits call compiled: {compiled}"
    np.testing.assert_array_equal(np.asarray(again.step_logits), np.asarray(first.step_logits))
    np.testing.assert_array_equal(np.asarray(step_again.step_logits), np.asarray(stepped.step_logits))


def test_rows_stop_at_their_own_eos_mid_block(model, blocks_of):
    """Rows ending at different steps inside blocks: finished rows stream EOS, decoding ends with the last row, and
    the tokens equal the step mode's."""
    blocks_of(BLOCK)
    free = run(model, "step")[0].token_ids
    candidates = [t for t in sorted(set(free[0]) & set(free[1])) if free[0].index(t) != free[1].index(t)
                  and max(free[0].index(t), free[1].index(t)) < NEW_TOKENS - BLOCK - 1
                  and max(free[0].index(t), free[1].index(t)) % BLOCK != 0]
    assert candidates, f"no token ends both rows at different steps inside a block in {free}; change the prompts"
    eos = candidates[0]
    stops = [row.index(eos) for row in free]
    variant = with_eos(model, eos)
    fused, streamed = run(variant, "fused", stream=True)
    stepped, stepped_stream = run(variant, "step", stream=True)
    assert fused.token_ids == stepped.token_ids == [row[:stop + 1] for row, stop in zip(free, stops)]
    assert fused.decode_steps == stepped.decode_steps == max(stops)
    assert streamed == stepped_stream and len(streamed) == max(stops) + 1


def test_a_non_finite_step_mid_block_hands_on_no_garbage_token(model, checkpoints, tmp_path, blocks_of):
    """Poison the embedding of the token greedy decoding emits at step k (mid-block): step k + 1 sees NaN; exactly
    the k + 1 clean tokens are streamed, and the error names step k + 1."""
    blocks_of(BLOCK)
    clean, other = run(model, "fused")[0].token_ids
    k = next(i for i in range(BLOCK + 1, len(clean)) if clean[i] not in PROMPTS[0] + PROMPTS[1] + clean[:i]
             and clean[i] not in other[:i + 1] and (i + 1) % BLOCK not in (0, 1))
    model_dir = copy_checkpoint(checkpoints["gqa"], tmp_path / "nan_embedding")
    rewrite_tensors(model_dir, lambda t: t["model.embed_tokens.weight"].__setitem__((clean[k],), float("nan")))
    streamed: list[list[int]] = []
    with pytest.raises(NonFiniteLogitsError, match=f"NaN or Inf logits at generated token {k + 1};"):
        jg.generate(Mistral.from_pretrained(model_dir), PROMPTS, NEW_TOKENS, cache="sliding_window",
                    max_cache_len=64, on_token=streamed.append, return_logits=True)  # the shapes above: no compile
    assert [row[0] for row in streamed] == clean[:k + 1]


@pytest.mark.parametrize(("seconds", "sizes"), [(1e-9, [2, 2] + [1] * 18), (1e9, [2, 2, 4, 4, 4, 4, 2])],
                         ids=["slow_steps", "fast_steps"])
def test_blocks_are_sized_to_last_about_the_target_time(model, blocks_of, monkeypatch, seconds, sizes):
    """The first two blocks are dispatched before any was timed; each later one is sized from the last one's time
    to last FUSED_BLOCK_SECONDS, between 1 step and the compiled capacity (4 here); the last ends with the budget."""
    blocks_of(BLOCK)
    monkeypatch.setattr(jg, "FIRST_BLOCK_STEPS", 2)
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", seconds)
    seen: list[int] = []
    original = jg.decode_fused

    def recording(*args, on_block=None, **kwargs):
        def count(tokens, logits):
            seen.append(tokens.shape[1])
            on_block(tokens, logits)
        return original(*args, on_block=count, **kwargs)

    monkeypatch.setattr(jg, "decode_fused", recording)
    result, _ = run(model, "fused")
    assert seen == sizes and sum(seen) == result.decode_steps == NEW_TOKENS - 1


@pytest.mark.parametrize(("argv", "expected"), [
    (["--blocks", "0"], "argument --blocks: '0': give comma-separated integers >= 1"),
    (["--blocks", "4,abc"], "argument --blocks: '4,abc': give comma-separated integers >= 1"),
    (["--new-tokens", "2"], "argument --new-tokens: '2': give an integer >= 3"),
    (["--rounds", "0"], "argument --rounds: '0': give an integer >= 1"),
    ([], "checkpoint /nonexistent/model does not exist"),
])
def test_the_study_refuses_bad_flags_in_one_line(argv, expected, capsys):
    """`python -m bench.fused_blocks` answered each of these with a traceback and exit code 1 (--blocks 0: JAX's
    IndexError; --new-tokens 2 or --rounds 0: a TypeError or StatisticsError after the table's header; a missing
    model: CheckpointError), as twincache's commands never do."""
    from bench import fused_blocks

    with pytest.raises(SystemExit) as exit_info:  # a missing model too, so that no regression runs a study
        fused_blocks.main([*argv, "--model", "/nonexistent/model"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m bench.fused_blocks: error: ") and expected in err, err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--rounds", "0"], "argument --rounds: '0': give an integer >= 1"),
    (["--new-tokens", "3"], "argument --new-tokens: '3': give an integer >= 4"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    ([], "checkpoint /nonexistent/model does not exist"),
])
def test_the_switch_studies_refuse_bad_flags_in_one_line(argv, expected, capsys, monkeypatch):
    """`python -m bench.guard_skip` and `bench.overlap_steps` (bench.study.switch_study) answered these with a
    traceback: --rounds 0 or --new-tokens 3 a StatisticsError after the model compiled, --dtype float64 and a
    missing model their errors' tracebacks."""
    import sys

    from bench import study

    monkeypatch.setattr(sys, "argv", ["guard_skip", *argv, "--model", "/nonexistent/model"])
    with pytest.raises(SystemExit) as exit_info:  # a missing model too, so that no regression runs a study
        study.switch_study("guard_skip", "A study.")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m bench.guard_skip: error: ") and expected in err, err


def test_a_switch_studys_quantiles_stay_within_the_steps_measured():
    """`python -m bench.overlap_steps --new-tokens 4 --rounds 1` printed p10 -0.055 ms and p25 -0.018 ms for steps of
    0.044 ms median: statistics.quantiles' default method extrapolates past the data."""
    from bench.study import step_row

    cells = step_row("v", [0.0, 0.1]).split(" | ")
    median, p10, p25, mean = map(float, cells[1:5])
    assert 0.0 <= p10 <= p25 <= median <= 0.1 and mean == pytest.approx(0.05), cells
