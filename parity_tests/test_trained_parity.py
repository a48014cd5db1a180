"""Parity on a trained model: SmolLM2-135M-Instruct (30 layers, 9 heads / 3 KV heads, vocab 49152) with our window
of 64, judged by the rule of `twincache parity` (docs/design.md §4) against the float64 truth beside transformers'
own distance.

One left-padded batch: the 93-token English prompt of parity_tests/trained_model.py (longer than the window, so the
prefill already wraps the ring) and a 9-token one. The float64 model chooses both continuations (8 tokens: the
float64 greedy loop and every 30-layer run cost seconds per step on 2 CPU cores); every run is teacher-forced with
them. Each JAX run compiles a 30-layer prefill and decode loop and bf16 runs slowly on CPU, so the runs cover each
axis rather than the product: fp32 on both caches, bf16 on the ring (sliding_window), fp16 on the static cache
(where JAX on CPU keeps float16 matrices as float32: jax_cache.projection.stored_dtype), torch eager beside a JAX
mode in each (a direct torch-vs-JAX row), JAX step and fused both. torch compiled, and every cell of the product, run on
the tiny checkpoints (test_parity_matrix.py, test_parity_cli.py) and in `twincache parity` on this model
(docs/parity.md has those tables).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from parity_tests import trained_model
from parity_tests.oracle import load_transformers
from twincache_app import parity

STEPS = 8
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
    config = json.loads((setup["path"] / "config.json").read_text())
    assert (config["sliding_window"], config["num_hidden_layers"], config["vocab_size"]) == (WINDOW, 30, 49152)
    assert setup["reference"].self_disagreements == 0


def judge(report: parity.ParityReport) -> None:
    failed = [f"{row.cache} {row.name}: {row.failed}" for row in report.rows if row.failed]
    assert not failed, f"{failed}\n{parity.format_table(parity.report_json(report, ''))}"


def test_fp32_within_bounds_of_the_float64_truth(setup):
    models = parity.load_models(setup["path"], "float32", impls=("torch:eager", "jax:step", "jax:fused"),
                               with_reference=False)  # the module's reference: no float64 copy per test
    args = (models, setup["prompts"], STEPS, "float32")
    static = parity.parity_report(*args, ["static"], ("torch:eager", "jax:step"), reference=setup["reference"])
    sliding = parity.parity_report(*args, ["sliding_window"], ("torch:eager", "jax:fused"),
                                   reference=setup["reference"])
    judge(static)
    judge(sliding)
    assert [row.name for row in sliding.rows][1:] == ["torch:eager", "jax:fused", "torch:eager vs jax:fused"]
    floor = static.rows[0].distance
    assert floor.max_abs_logit_diff > 1e-5, "a trained model's fp32 floor is far above the tiny models' ~1e-6"


@pytest.mark.parametrize(("dtype", "cache", "jax_impl", "floor_above"),
                         [("bfloat16", "sliding_window", "jax:step", 0.1), ("float16", "static", "jax:fused", 1e-2)])
def test_half_precision_within_bounds_of_the_float64_truth(setup, dtype, cache, jax_impl, floor_above):
    models = parity.load_models(setup["path"], dtype, impls=("torch:eager", jax_impl), with_reference=False)
    report = parity.parity_report(models, setup["prompts"], STEPS, dtype, [cache], ("torch:eager", jax_impl),
                                  reference=setup["reference"])
    judge(report)
    assert [row.name for row in report.rows][1:] == ["torch:eager", jax_impl, f"torch:eager vs {jax_impl}"]
    assert report.rows[0].distance.max_abs_logit_diff > floor_above, "a floor far from 0, else this judges nothing"
