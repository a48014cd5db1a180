"""`twincache parity` (any checkpoint, exit codes, JSON) and the half-precision bounds of docs/design.md §4 on CPU.

bf16 runs are kept tiny (bf16 matmuls are slow on CPU): one transformers-written checkpoint, 64 teacher-forced steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from twincache_app import cli, parity

PAIR_FIELDS = {"cache", "reference", "candidate", "dtype", "steps", "max_abs_logit_diff", "mean_kl", "top1_agreement",
               "decisive_steps", "top1_agreement_decisive", "first_greedy_divergence_step",
               "top1_mismatches_above_margin", "within_bounds"}


def run_cli(*argv: str, home: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TWINCACHE_HOME=home)
    return subprocess.run([sys.executable, "-m", "twincache_app.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def test_compare_logits_metrics_on_known_inputs():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 50)).astype(np.float32)
    same = parity.compare_logits(ref, ref.copy(), "float32")
    assert same["max_abs_logit_diff"] == 0 and same["mean_kl"] == pytest.approx(0, abs=1e-12)
    assert same["top1_agreement"] == 1 and same["first_greedy_divergence_step"] is None and same["within_bounds"]
    shifted = parity.compare_logits(ref, ref + 3.0, "float32")  # a constant shift changes no probability
    assert shifted["mean_kl"] == pytest.approx(0, abs=1e-12) and not shifted["within_bounds"]
    flipped = ref.copy()
    flipped[4] = -flipped[4]  # step 4's distribution inverted: its argmax changes
    report = parity.compare_logits(ref, flipped, "bfloat16")
    assert report["first_greedy_divergence_step"] == 4
    assert report["top1_agreement"] == pytest.approx(5 / 6) and not report["within_bounds"]
    assert report["mean_kl"] > 1e-3


def test_half_precision_top1_counts_only_decisive_steps():
    ref = np.zeros((4, 8), np.float32)
    ref[:, 0] = 4.0
    ref[:2, 1] = 4.0 - 2 * 2.0**-5  # steps 0-1: margin of 2 bf16 ulps at 4.0 (ulp 2^-5): a near-tie
    ref[2:, 1] = 3.0  # steps 2-3: a clear margin
    cand = ref.copy()
    cand[0, 1] = 4.5  # flips a near-tie: counted in top1_agreement, not in the decisive agreement
    report = parity.compare_logits(ref, cand, "bfloat16")
    assert report["decisive_steps"] == 2 and report["top1_agreement_decisive"] == 1.0
    assert report["top1_agreement"] == pytest.approx(0.75)
    cand[3, 1] = 5.0  # flips a decisive step
    report = parity.compare_logits(ref, cand, "bfloat16")
    assert report["top1_agreement_decisive"] == 0.5 and not report["within_bounds"]


def test_parity_json_on_tiny_model_passes(tiny_model_dir, tmp_path):
    proc = run_cli("parity", "--model", str(tiny_model_dir), "--json", "--max-new-tokens", "40", home=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] and report["transformers_compared"] and report["dtype"] == "float32"
    pairs = report["pairs"]
    assert {(p["cache"], p["reference"], p["candidate"]) for p in pairs} == {
        (cache, ref, cand) for cache in ("static", "sliding_window")
        for ref, cand in (("transformers", "torch"), ("transformers", "jax"), ("torch", "jax"))}
    for pair in pairs:
        assert set(pair) == PAIR_FIELDS
        assert pair["steps"] == 40 and pair["max_abs_logit_diff"] <= 1e-5 and pair["within_bounds"]


def test_parity_table_on_transformers_checkpoint(checkpoints, tmp_path):
    proc = run_cli("parity", "--model", str(checkpoints["mqa"]), "--prompt-ids", "1,5,9,33,2,7,11,4,8,3,100",
                   "--max-new-tokens", "24", home=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("static", "sliding_window"))]
    assert len(rows) == 6 and all(row.endswith("ok") for row in rows), proc.stdout
    assert "PASS: 6/6" in proc.stderr


def test_parity_without_window_compares_static_only(checkpoints, capsys):
    code = cli.main(["parity", "--model", str(checkpoints["no_window"]), "--prompt-ids", "1,2,3,4,5", "--json",
                     "--max-new-tokens", "8", "--no-transformers"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and not report["transformers_compared"]
    assert [(p["cache"], p["reference"], p["candidate"]) for p in report["pairs"]] == [("static", "torch", "jax")]
    assert report["modes"] == {"torch": "compiled", "jax": "fused"}, "each backend's default decode path"


def test_parity_of_every_mode_of_every_backend(checkpoints, capsys):
    code = cli.main(["parity", "--model", str(checkpoints["no_window"]), "--prompt-ids", "1,2,3,4,5", "--json",
                     "--max-new-tokens", "8", "--no-transformers", "--modes", "all"])
    report = json.loads(capsys.readouterr().out)
    runs = ["torch:compiled", "torch:eager", "jax:fused", "jax:step"]
    assert code == 0 and report["passed"]
    assert report["modes"] == {run: run.split(":")[1] for run in runs}
    assert [(p["reference"], p["candidate"]) for p in report["pairs"]] == [
        (ref, cand) for i, ref in enumerate(runs) for cand in runs[i + 1:]]
    assert all(p["steps"] == 8 and p["max_abs_logit_diff"] <= 1e-5 for p in report["pairs"])


def test_parity_exits_1_when_a_pair_is_out_of_bounds(checkpoints, capsys, monkeypatch):
    monkeypatch.setattr(parity, "FP32_MAX_ABS_LOGIT_DIFF", 0.0)  # a bound no real pair meets
    code = cli.main(["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2,3", "--cache", "static",
                     "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    assert code == 1 and "OUT OF BOUNDS" in captured.out and "FAIL" in captured.err


@pytest.mark.parametrize("argv", [["--model", "/nonexistent/dir"], ["--max-new-tokens", "0"],
                                  ["--prompt-ids", "1,99999"]])
def test_parity_bad_input_is_one_line_exit_2(tiny_model_dir, capsys, argv):
    code = cli.main(["parity", *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("twincache: error:")


def test_bf16_teacher_forced_kl_and_top1_within_bounds(checkpoints):
    impls = parity.load_implementations(checkpoints["gqa"], "bfloat16")
    prompt = np.random.default_rng(3).integers(1, 128, 12).tolist()
    reports = parity.parity_reports(impls, prompt, 64, "bfloat16", ["static", "sliding_window"])
    assert len(reports) == 6
    for r in reports:
        cell = f"{r.cache} {r.reference} vs {r.candidate}"
        assert r.steps == 64
        assert r.mean_kl <= parity.HALF_MEAN_KL, f"{cell}: mean KL {r.mean_kl:.2e}"
        assert r.decisive_steps >= 32, f"{cell}: only {r.decisive_steps} decisive steps"
        assert r.top1_agreement_decisive >= parity.HALF_TOP1_AGREEMENT, f"{cell}: top-1 {r.top1_agreement_decisive:.2%}"
        assert r.within_bounds
    assert any(r.max_abs_logit_diff > 0 for r in reports), "bf16 runs should differ somewhere, or the check is empty"
