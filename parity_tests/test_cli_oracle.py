"""`twincache generate` judged by an oracle that shares none of its code: transformers' greedy `generate` on the same
checkpoint directory, each prompt alone and unpadded (parity_tests/hf_greedy.py, which also checks that each oracle
token is float64's clear argmax).

In this process (cli.main), on conftest's gqa checkpoint (window 8) saved again by transformers with an EOS: a batch
of prompts of unequal lengths (left-padded rows), one longer than the window (its prefill keeps the last 8 of 12
positions), every row past the window (the ring wraps), one row ending at EOS while the others decode on; and one
prompt alone, streamed as it decodes, ending at EOS. JAX runs its step mode here: its compile for a batch of 3 costs
about half the fused loop's (~2 s against ~4-5 s on 2 cores), and both modes go through the same CLI code; the fused
mode is judged by the same oracle in test_jax_cli.py (one row), as are the CLI's other runs on transformers-written
checkpoints in test_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity_tests.conftest import CHECKPOINT_VARIANTS, WINDOW, save_hf_checkpoint
from parity_tests.hf_greedy import greedy
from twincache_app import cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = [5, 17, 42, 99, 3]
BATCH = [SHORT, [5, 17, 42, 99, 3, 64, 7, 88, 120, 31, 2, 77], [9, 8, 7]]  # 12 > WINDOW: a prefill past the window
NEW_TOKENS = 20
EOS_STEP = 5  # the EOS is the token transformers decodes at this step of SHORT


@pytest.fixture(scope="module")
def eos_checkpoint(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The gqa checkpoint's model (its seed and config) saved by transformers with eos_token_id set: the token it
    decodes at step EOS_STEP of SHORT without one, and nowhere before. Returns the directory and the EOS."""
    free = greedy(checkpoints["gqa"], [SHORT], NEW_TOKENS)[0]
    eos = free[EOS_STEP]
    assert eos not in free[:EOS_STEP]
    directory = save_hf_checkpoint(tmp_path_factory.mktemp("eos") / "gqa_eos", seed=list(CHECKPOINT_VARIANTS).index(
        "gqa"), eos_token_id=eos)
    assert greedy(directory, [SHORT], NEW_TOKENS)[0] == free[:EOS_STEP + 1], "gqa's weights, stopped at the EOS"
    return directory, eos


def generate(checkpoint: Path, prompts: list[list[int]], capsys: pytest.CaptureFixture, *flags: str) -> str:
    """stdout of `twincache generate` on `checkpoint`, one --prompt-ids per prompt, exit 0 checked."""
    ids = [arg for prompt in prompts for arg in ("--prompt-ids", ",".join(map(str, prompt)))]
    code = cli.main(["generate", "--model", str(checkpoint), *ids, "--max-new-tokens", str(NEW_TOKENS), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("backend, mode", [("torch", "eager"), ("jax", "step")])
def test_a_left_padded_batch_is_transformers_greedy_row_by_row(eos_checkpoint, capsys, backend, mode):
    checkpoint, eos = eos_checkpoint
    expected = greedy(checkpoint, BATCH, NEW_TOKENS)
    # what makes the comparison bite: rows that end apart, a long prefill, a ring that wraps in every row
    assert expected[0] == greedy(checkpoint, [SHORT], NEW_TOKENS)[0] and expected[0][-1] == eos
    assert len(expected[0]) == EOS_STEP + 1 < NEW_TOKENS
    assert all(eos not in row and len(row) == NEW_TOKENS for row in expected[1:])
    assert len({len(prompt) for prompt in BATCH}) == len(BATCH) and max(map(len, BATCH)) > WINDOW
    assert all(len(prompt) + len(row) > WINDOW for prompt, row in zip(BATCH, expected))
    flags = ("--backend", backend, "--mode", mode)
    record = json.loads(generate(checkpoint, BATCH, capsys, *flags, "--json"))
    assert (record["cache"], record["sliding_window"], record["batch"]) == ("sliding_window", WINDOW, len(BATCH))
    assert [row["prompt_ids"] for row in record["rows"]] == BATCH
    assert [row["token_ids"] for row in record["rows"]] == expected
    lines = generate(checkpoint, BATCH, capsys, *flags).splitlines()  # text: "[row i] id id ..." (no tokenizer)
    assert [line.split("] ", 1)[0] for line in lines] == [f"[row {i}" for i in range(len(BATCH))]
    assert [[int(t) for t in line.split("] ", 1)[1].split()] for line in lines] == expected


def test_one_prompt_streams_transformers_greedy_up_to_its_eos(eos_checkpoint, capsys):
    """torch's eager mode streams each id as it is decoded; the stream and --json both stop at EOS, included."""
    checkpoint, eos = eos_checkpoint
    expected = greedy(checkpoint, [SHORT], NEW_TOKENS)[0]
    assert expected[-1] == eos and len(expected) == EOS_STEP + 1 and len(SHORT) + len(expected) > WINDOW
    flags = ("--backend", "torch", "--mode", "eager")
    assert json.loads(generate(checkpoint, [SHORT], capsys, *flags, "--json"))["token_ids"] == expected
    assert [int(t) for t in generate(checkpoint, [SHORT], capsys, *flags).split()] == expected
