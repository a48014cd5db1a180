"""The Python behind the GPU scripts, run end to end on CPU with tiny shapes. A GPU is lent to few sessions, for
minutes: a bug found there costs them. (On CPU this checks that the scripts run and judge, not GPU numerics.)"""

from __future__ import annotations

import dataclasses
import json

from parity_tests import gpu_parity
from twincache_app import parity

TINY = dataclasses.replace(gpu_parity.MISTRAL_7B, vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           sliding_window=8)


def test_gpu_parity_cases_are_the_ones_its_docstring_names():
    assert [(name, config.num_hidden_layers, config.sliding_window, dtype, prompt, steps)
            for name, config, dtype, prompt, steps, _ in gpu_parity.CASES] == [
        ("mistral-7b-shape", 32, 4096, "bfloat16", 502, 128),
        ("mistral-7b-shape-window-256", 32, 256, "bfloat16", 300, 128),
        ("small-fp32-window-64", 8, 64, "float32", 160, 128)]
    assert gpu_parity.CASES[2][5] == parity.IMPLEMENTATIONS  # fp32: every implementation, torch compiled included


def test_gpu_parity_runs_and_judges_tiny_cases_on_cpu(tmp_path):
    cases = [("tiny-bf16-wraps", TINY, "bfloat16", 12, 10, gpu_parity.AT_7B),
             ("tiny-fp32", TINY, "float32", 5, 10, ("torch:eager", "jax:fused"))]
    assert gpu_parity.main(tmp_path, cases) == 0
    records = json.loads((tmp_path / "gpu_parity.json").read_text())
    rows = {(r["case"], r["cache"], r["name"]) for r in records}
    for case, impls in (("tiny-bf16-wraps", gpu_parity.AT_7B), ("tiny-fp32", ("torch:eager", "jax:fused"))):
        for cache in ("static", "sliding_window"):
            assert {(case, cache, impl) for impl in impls} <= rows
    assert all(not r["failed"] for r in records) and len({r["case"] for r in records}) == 2
    text = (tmp_path / "gpu_parity.md").read_text()
    assert "## tiny-bf16-wraps: bfloat16, window 8, prompt 12, 10 steps" in text and "## tiny-fp32" in text
