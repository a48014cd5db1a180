"""Parity on a trained model: SmolLM2-135M-Instruct (30 layers, 9 heads / 3 KV heads, vocab 49152) with our window
of 64, judged by the rule of `twincache parity` against the float64 truth beside transformers' own distance.

One left-padded batch: the 93-token English prompt of parity_tests/trained_model.py (longer than the window, so the
prefill already wraps the ring) and a 9-token one. The float64 model chooses both continuations (16 tokens: few
decode steps keep the 30-layer runs cheap on CPU); every run is teacher-forced with them. Each JAX cell compiles a
30-layer prefill and decode step (~10-20 s on 2 CPU cores), so the cells are chosen to cover each axis once: fp32 and
bf16, both caches, torch eager beside JAX step (the direct torch-vs-JAX pair) in each, and the fused JAX loop on the
fp32 static cache. torch compiled and the other cells run on the tiny checkpoints (test_parity_matrix.py) and in
`twincache parity` on this model (docs/parity.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from parity_tests import trained_model
from parity_tests.oracle import load_transformers
from twincache import parity

STEPS = 16
WINDOW = 64
SHORT_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def setup(trained_checkpoints: dict[str, Path]) -> dict:
    path = trained_checkpoints["window64"]
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in (trained_model.PROMPT, SHORT_PROMPT + " Paris. The")]
    truth = load_transformers(path, "float64")
    reference = parity.float64_reference(truth, prompts, STEPS)
    del truth
    return {"path": path, "prompts": prompts, "reference": reference}


def test_the_batch_is_what_the_module_says(setup):
    long, short = setup["prompts"]
    assert len(long) > WINDOW and len(short) < len(long), "one row longer than the window, left-padded with a short one"
    config = load_transformers(setup["path"], "float32").config
    assert (config.sliding_window, config.num_hidden_layers, config.vocab_size) == (WINDOW, 30, 49152)
    assert setup["reference"].self_disagreements == 0


def judge(report: parity.ParityReport) -> None:
    failed = [f"{row.cache} {row.name}: {row.failed}" for row in report.rows if row.failed]
    assert not failed, f"{failed}\n{parity.format_table(report)}"


def test_fp32_within_bounds_of_the_float64_truth(setup):
    models = parity.load_models(setup["path"], "float32", impls=("torch_eager", "jax_step", "jax_fused"))
    args = (models, setup["prompts"], STEPS, "float32")
    static = parity.parity_report(*args, ["static"], ("torch_eager", "jax_step", "jax_fused"),
                                  reference=setup["reference"])
    sliding = parity.parity_report(*args, ["sliding_window"], ("torch_eager", "jax_step"), reference=setup["reference"])
    judge(static)
    judge(sliding)
    assert [row.name for row in static.rows][1:] == ["torch_eager", "jax_step", "jax_fused", "torch_eager vs jax_step"]
    floor = sliding.rows[0].distance
    assert floor.max_abs_logit_diff > 1e-5, "a trained model's fp32 floor is far above the tiny models' ~1e-6"


def test_bf16_within_bounds_of_the_float64_truth(setup):
    models = parity.load_models(setup["path"], "bfloat16", impls=("torch_eager", "jax_step"))
    report = parity.parity_report(models, setup["prompts"], STEPS, "bfloat16", ["static", "sliding_window"],
                                  ("torch_eager", "jax_step"), reference=setup["reference"])
    judge(report)
    assert [row.name for row in report.rows].count("torch_eager vs jax_step") == 2
    assert report.rows[0].distance.max_abs_logit_diff > 0.1, "a bf16 floor far from 0, else this judges nothing"
