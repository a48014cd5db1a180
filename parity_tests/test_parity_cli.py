"""`twincache parity` on any checkpoint: the table against the float64 truth beside the floor, JSON, exit codes, the
torch_cache fallback without transformers, and bf16 on a tiny model (bf16 matmuls are slow on CPU: kept small). The
JSON run is a process, started in the background lane (parity_tests/background.py: `parity_json`); the others call
cli.main in this process."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

from parity_tests import background
from parity_tests.conftest import save_hf_checkpoint
from parity_tests.oracle import load_transformers
from twincache import parity_metrics
from twincache_app import cli, parity

ROW_FIELDS = {"cache", "name", "kind", "metrics", "ratios", "failed"}
METRIC_FIELDS = {"steps", "rows", "max_abs_logit_diff", "rel_max_abs_logit_diff", "mean_kl", "max_kl",
                 "top1_agreement", "first_greedy_divergence", "first_decisive_divergence", "max_abs_kv_diff"}


@background.job
def parity_json(request: pytest.FixtureRequest) -> Callable[[], subprocess.CompletedProcess]:
    """`twincache parity --json` on the tiny model, every implementation on one cache kind (torch_compiled then
    compiles once), in a TWINCACHE_HOME of its own."""
    home = request.getfixturevalue("tmp_path_factory").mktemp("parity_json_home")
    env = dict(os.environ, TWINCACHE_HOME=str(home))  # taken here, in the main thread
    argv = [sys.executable, "-m", "twincache_app.cli", "parity", "--model", str(request.getfixturevalue(
        "tiny_model_dir")), "--json", "--max-new-tokens", "24", "--cache", "sliding_window"]

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)

    return run


def test_parity_json_on_tiny_model_passes(parity_json):
    proc = parity_json
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] and report["dtype"] == "float32" and report["steps"] == 24
    assert report["reference"].startswith("transformers MistralForCausalLM, float64")
    assert report["floor"].startswith("transformers MistralForCausalLM, float32")
    assert report["reference_self_disagreements"] == 0 and report["factors"] == parity_metrics.FACTORS
    names = {(row["cache"], row["name"]) for row in report["rows"]}
    runs = ("torch:compiled", "torch:eager", "jax:fused", "jax:step")
    pairs = [f"{a} vs {b}" for a in runs[:2] for b in runs[2:]]  # every torch run against every JAX run
    assert names == {("sliding_window", name) for name in ("transformers (floor)", *runs, *pairs)}
    for row in report["rows"]:
        assert set(row) == ROW_FIELDS and set(row["metrics"]) == METRIC_FIELDS and row["failed"] == []
        assert row["metrics"]["steps"] == 24 and row["metrics"]["max_abs_kv_diff"] is not None
        if row["kind"] != "floor":  # a real comparison, not an empty one: the runs differ from the truth somewhere
            assert 0 < row["metrics"]["max_abs_logit_diff"] <= 1e-5


def test_parity_table_on_transformers_checkpoint(checkpoints, capsys):
    # in this process (the JSON test above runs the command as a process): the table and the verdict line
    code = cli.main(["parity", "--model", str(checkpoints["mqa"]), "--prompt-ids", "1,5,9,33,2,7,11,4,8,3,100",
                     "--max-new-tokens", "16", "--modes", "torch:eager", "jax:step"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "reference: transformers MistralForCausalLM, float64" in out
    rows = [line for line in out.splitlines() if line.startswith(("static", "sliding_window"))]
    assert len(rows) == 8 and sum(row.endswith(" floor") for row in rows) == 2, out
    assert all(row.endswith(" floor") or " ok (worst " in row for row in rows), out
    assert "PASS: 6/6" in err
    # Each value ends where its heading does, and no heading runs into the next ("top-1 diverges" over "100.0%" read
    # as one heading over the agreement).
    header = next(line for line in out.splitlines() if line.startswith("cache "))
    number = r"\d\.\d+e[-+]\d+"
    for heading, value in (("max|Δlogit|", number), ("top-1 same", r"\d+\.\d%"), ("diverges at", r"-|\d+"),
                           ("max|ΔKV|", number)):
        assert f"  {heading}" in header, f"{heading!r} not set apart from the heading before it: {header}"
        end = header.index(heading) + len(heading)
        assert all(re.fullmatch(value, row[:end].split()[-1]) and row[end] == " " for row in rows), (heading, out)


def test_several_prompts_are_one_left_padded_batch_each_row_against_its_own_truth(checkpoints, capsys):
    """Repeated --prompt-ids: the implementations decode one batch (the shorter row left-padded) and each row is
    judged against the float64 model run on that prompt alone; 4 + 12 positions wrap the window of 8."""
    argv = ["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,5,9,33,2,7,11,4,8,3,100",
            "--prompt-ids", "6,2,40,3", "--max-new-tokens", "12", "--modes", "torch:eager", "jax:step", "--json"]
    code = cli.main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report
    assert report["prompt_lens"] == [11, 4]
    judged = [row for row in report["rows"] if row["kind"] != "floor"]
    assert judged and all(row["metrics"]["rows"] == 2 and row["metrics"]["steps"] == 12 for row in judged), judged
    assert "prompt 11/4 tokens" in parity.format_table(report)


@pytest.mark.parametrize("how", ["--no-transformers", "transformers is not installed"])
def test_without_transformers_torch_cache_float64_is_the_reference_and_says_so(checkpoints, capsys, monkeypatch,
                                                                               how):
    argv = ["parity", "--model", str(checkpoints["no_window"]), "--prompt-ids", "1,2,3,4,5", "--json",
            "--max-new-tokens", "8", "--modes", "jax:step"]
    if how == "--no-transformers":
        argv.append(how)
    else:
        monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it raises ImportError
    code = cli.main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"]
    assert report["reference"] == f"torch_cache Mistral, float64 ({how})"
    assert report["floor"] == f"torch_cache Mistral, float32, uncached ({how})"
    assert [(row["cache"], row["name"]) for row in report["rows"]] == [("static", "torch_cache (floor)"),
                                                                       ("static", "jax:step")]
    # torch_cache judged by itself: a bug in every dtype of its model would pass its rows, and the table says so
    assert "note: torch_cache is the reference and the floor here" in parity.format_table(report)
    assert "note:" not in parity.format_table(report | {"reference": "transformers MistralForCausalLM, float64"})


@pytest.mark.parametrize("reference", ["transformers", "--no-transformers", "transformers is not installed"])
def test_sliding_window_flag_windows_the_reference_the_floor_and_every_implementation(checkpoints, capsys,
                                                                                       monkeypatch, reference):
    """--sliding-window 4 on the window-less checkpoint: 5 + 12 positions wrap a ring of 4 thrice. Every model in the
    run must attend with the window: a reference or floor without it would put the implementations far out of
    bounds, and an implementation without it could not build the ring at all."""
    argv = ["parity", "--model", str(checkpoints["no_window"]), "--prompt-ids", "1,2,3,4,5", "--json",
            "--max-new-tokens", "12", "--modes", "torch:eager", "jax:step", "--sliding-window", "4"]
    if reference == "transformers is not installed":
        monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it raises ImportError
    code = cli.main(argv + ([reference] if reference.startswith("--") else []))
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["sliding_window"] == 4, report
    assert report["max_position_embeddings"] == 512  # what the heading reads a window that cannot be reached from
    assert {row["cache"] for row in report["rows"]} == {"static", "sliding_window"}
    assert report["reference"].startswith("transformers" if reference == "transformers" else "torch_cache")
    for row in report["rows"]:  # the floor is fp32 against float64 of one model: with a window on one side only,
        assert row["metrics"]["max_abs_logit_diff"] < 1e-4, row  # the implementations would pass beside it
    assert "sliding window 4;" in parity.format_table(report)


def test_a_run_that_never_reaches_the_window_says_so():
    """A torch_cache whose mask let each query see W + 1 keys passed `parity --prompt-ids 1,5,9 --max-new-tokens 4` on
    a window of 8 (6 positions fed: no key ever left the window), under a heading that named the window; with a
    13-token prompt it fails. The heading says when the window was not reached."""
    def heading(prompt_lens: list[int], steps: int, positions: int = 512) -> str:
        return parity.format_table({"reference": "r", "floor": "f", "prompt_lens": prompt_lens, "steps": steps,
                                    "dtype": "float32", "sliding_window": 8, "max_position_embeddings": positions,
                                    "decisive_steps": 0, "factors": parity_metrics.FACTORS, "absolute": {},
                                    "rows": []}).splitlines()[2]

    assert "sliding window 8 (not reached: the longest row feeds 7 positions" in heading([3], 5), heading([3], 5)
    assert "sliding window 8 (not reached: the longest row feeds 8 positions" in heading([3, 1], 6)
    assert "sliding window 8;" in heading([3], 7) and "sliding window 8;" in heading([1, 9], 1)  # 9 positions fed
    # A window no shorter than max_position_embeddings is never reached: "give more tokens" was advice that generate
    # and parity refuse (8 positions at most here); one position fewer than the window can still reach it.
    never = heading([3], 5, positions=8)
    assert "(never reached: it is not shorter than max_position_embeddings=8" in never and "give" not in never, never
    assert "(not reached: the longest row feeds 7 positions" in heading([3], 5, positions=9)


def test_fallback_reference_agrees_with_transformers_float64(checkpoints):
    """The two float64 references choose the same tokens and agree far below any fp32 floor."""
    import torch

    from torch_cache.model import Mistral

    prompts = [[1, 5, 9, 33, 2, 7, 11, 4, 8, 3, 100], [4, 4, 2]]
    hf = parity.float64_reference(load_transformers(checkpoints["gqa"], "float64"), prompts, 12)
    ours = parity.float64_reference(Mistral.from_pretrained(checkpoints["gqa"], torch.float64), prompts, 12)
    assert hf.tokens == ours.tokens and hf.self_disagreements == ours.self_disagreements == 0
    assert parity_metrics.distance(hf.logits, ours.logits).max_abs_logit_diff < 1e-9
    for a, b in zip(hf.keys + hf.values, ours.keys + ours.values, strict=True):
        assert a.shape == b.shape and abs(a - b).max() < 1e-9


def test_parity_exits_1_when_a_metric_is_out_of_bounds(checkpoints, capsys, monkeypatch):
    monkeypatch.setitem(parity_metrics.ABSOLUTE, "float32", {})  # the tiny floor alone: factors no run meets
    monkeypatch.setattr(parity_metrics, "FACTORS", {**parity_metrics.FACTORS, "max_abs_logit_diff": 1e-3})
    code = cli.main(["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2,3", "--cache", "static",
                     "--max-new-tokens", "4", "--modes", "torch:eager"])
    captured = capsys.readouterr()
    assert code == 1 and "OUT OF BOUNDS: max_abs_logit_diff" in captured.out and "FAIL: 0/1" in captured.err


def test_an_implementation_with_non_finite_logits_is_a_failed_row_not_bad_input(checkpoints, capsys, monkeypatch):
    """An implementation whose logits went NaN where transformers' in the same dtype did not (an overflow, a fully
    masked query) ended the run with exit 2 and "the weights or dtype (torch.float32) are not usable for this input",
    which the floor had just disproved, and no table: it is a row out of bounds (exit 1), the others still judged."""
    from twincache.errors import NonFiniteLogitsError

    measured = parity.run_implementation

    def run(impl: str, *args: object, **kwargs: object) -> parity.Run:
        if impl == "torch:eager":
            raise NonFiniteLogitsError("the model produced NaN or Inf logits at generated token 2; the weights or "
                                       "dtype (torch.float32) are not usable for this input")
        return measured(impl, *args, **kwargs)

    monkeypatch.setattr(parity, "run_implementation", run)
    code = cli.main(["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2,3", "--cache", "static",
                     "--max-new-tokens", "3", "--modes", "torch:eager", "jax:step", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["rows"]}
    assert code == 1 and not report["passed"] and set(rows) == {"transformers (floor)", "torch:eager", "jax:step"}
    assert "max_abs_logit_diff" in rows["torch:eager"]["failed"]
    assert rows["torch:eager"]["metrics"]["max_abs_logit_diff"] is None
    assert rows["jax:step"]["failed"] == []
    table = parity.format_table(report)
    assert "OUT OF BOUNDS: max_abs_logit_diff non-finite vs floor" in table, table
    floor_line, row_line = (next(line for line in table.splitlines() if f" {name} " in line)
                            for name in ("transformers (floor)", "torch:eager"))
    assert row_line.index("OUT OF BOUNDS") == floor_line.rindex("floor"), table  # its columns line up


def test_a_verdict_against_a_zero_or_non_finite_floor_gives_the_values_not_a_ratio():
    """A checkpoint whose parity failed badly printed "first_decisive_divergence inf/nanx": a divergence is an event,
    not a multiple of the floor, and a ratio to a zero or non-finite floor says nothing."""
    def distance(**fields: object) -> parity_metrics.Distance:
        base = dict(steps=4, rows=1, max_abs_logit_diff=1e-3, rel_max_abs_logit_diff=1e-4, mean_kl=1e-6, max_kl=1e-5,
                    top1_agreement=1.0, first_greedy_divergence=None)
        return parity_metrics.Distance(**{**base, **fields})

    floor = distance(max_abs_logit_diff=0.0, mean_kl=float("nan"))
    bad = distance(max_abs_logit_diff=2.5, mean_kl=0.3, max_kl=0.6, top1_agreement=0.5, first_greedy_divergence=2,
                   first_decisive_divergence=2)
    failed = parity_metrics.failures(bad, floor, "bfloat16")
    assert {"max_abs_logit_diff", "max_kl", "first_decisive_divergence"} <= set(failed), failed
    floor_row = parity.row_json(parity.Row("static", "transformers (floor)", "floor", floor, [], {}))
    row = parity.row_json(parity.Row("static", "torch:eager", "implementation", bad, failed,
                                     parity_metrics.ratios(bad, floor)))
    verdict = parity.row_verdict(row, floor_row)
    assert "inf/nan" not in verdict and "nanx" not in verdict and "infx" not in verdict, verdict
    assert "first_decisive_divergence at step 2" in verdict
    assert "max_abs_logit_diff 2.50e+00 vs floor 0.00e+00 (no ratio)" in verdict
    assert "max_kl 60000.0x" in verdict  # a finite, non-zero ratio is still a ratio
    assert "max_abs_logit_diff 2.50e+00 (no finite ratio to the floor)" in parity.row_verdict(row)  # floor unknown
    nan_row = dict(row, failed=["mean_kl"], metrics=dict(row["metrics"], mean_kl=None))
    assert parity.row_verdict(nan_row, floor_row) == "OUT OF BOUNDS: mean_kl non-finite vs floor non-finite (no ratio)"
    table = parity.format_table({"reference": "r", "floor": "f", "prompt_lens": [3], "steps": 4, "dtype": "bfloat16",
                                 "decisive_steps": 4, "factors": parity_metrics.FACTORS, "absolute": {},
                                 "rows": [floor_row, row]})
    assert verdict in table  # the table finds the row's floor by its cache


@pytest.mark.parametrize("argv", [["--model", "/nonexistent/dir"], ["--max-new-tokens", "0"],
                                  ["--prompt-ids", "1,99999"]])
def test_parity_bad_input_is_one_line_exit_2(trained_model_dir, capsys, argv):
    # the default model built first (its conversion notice is a line of its own, alone or not per test order)
    code = cli.main(["parity", *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("twincache: error:")


def test_one_new_token_is_refused_it_judges_no_decode_step(checkpoints, capsys):
    """--max-new-tokens 1 is the prefill's token alone: a torch_cache that computed every decode step's RoPE one
    position too far passed it (exit 0), and failed at 2 (max_abs_logit_diff 284206x)."""
    code = cli.main(["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2,3", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--max-new-tokens 1 must be >= 2 for a parity run" in err and "decode step" in err, err


def test_new_tokens_past_the_models_positions_are_refused_before_anything_runs(checkpoints, capsys, monkeypatch):
    """--max-new-tokens past max_position_embeddings was refused by the towers' generate only after the float64
    reference had decoded every one of them: 2**40 ran for 10 minutes without an answer (killed)."""
    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("models loaded for a run that cannot be made")

    monkeypatch.setattr(parity, "load_models", loaded)
    code = cli.main(["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2", "--max-new-tokens",
                     str(2**40)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "max_position_embeddings=512 allows positions up to 511; generate at most 510 new tokens" in err, err


@pytest.mark.parametrize("word", ["torch:fast", "jax:compiled", "eager"])
def test_parity_unknown_implementation_is_one_line_exit_2(capsys, word):
    code = cli.main(["parity", "--modes", "default", word])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--modes {word} is not an implementation; give all, default or any of torch:compiled, " in err


def test_parity_modes_select_implementations():
    assert parity.resolve_implementations(["all"]) == ["torch:compiled", "torch:eager", "jax:fused", "jax:step"]
    assert parity.resolve_implementations(["default"]) == ["torch:compiled", "jax:fused"]
    assert parity.resolve_implementations(["jax:step", "default", "jax:step"]) == ["jax:step", "torch:compiled",
                                                                                   "jax:fused"]
    assert parity.direct_pairs(["torch:eager", "jax:step", "jax:fused"]) == [("torch:eager", "jax:step"),
                                                                             ("torch:eager", "jax:fused")]


def test_bf16_on_a_tiny_model_within_bounds_of_its_floor(checkpoints):
    models = parity.load_models(checkpoints["gqa"], "bfloat16", impls=("torch:eager", "jax:fused"))
    prompt = [int(t) for t in range(3, 15)]
    report = parity.parity_report(models, [prompt], 32, "bfloat16", ["static", "sliding_window"],
                                  ("torch:eager", "jax:fused"))
    judged = [row for row in report.rows if row.kind != "floor"]
    assert len(judged) == 6 and report.passed, parity.format_table(parity.report_json(report, ""))
    floor = report.rows[0].distance
    assert floor.max_abs_logit_diff > 1e-3, "a bf16 floor far from 0, else this judges nothing"


def test_a_run_that_ignores_its_forced_tokens_is_a_failed_row_naming_where(checkpoints, capsys, monkeypatch):
    """The parity numbers rest on forcing. A tower whose forcing broke ended the run with "unexpected RuntimeError"
    and no table: it is that implementation's failed row, saying the row, the step and both tokens; the others are
    still judged."""
    from torch_cache import backend as torch_backend

    generate = torch_backend.generate

    def strays_at_step_2(*args: object, forced_tokens: list[list[int]], **kwargs: object) -> object:
        other = [row[:2] + [(row[2] + 1) % 64] + row[3:] for row in forced_tokens]  # a forcing off by one token
        return generate(*args, forced_tokens=other, **kwargs)

    monkeypatch.setattr(torch_backend, "generate", strays_at_step_2)
    code = cli.main(["parity", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2,3", "--cache", "static",
                     "--max-new-tokens", "4", "--modes", "torch:eager", "jax:step", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["rows"]}
    assert code == 1 and rows["jax:step"]["failed"] == [], rows
    strayed = rows["torch:eager"]["failed"][0]
    assert re.fullmatch(r"forced_tokens not followed \(row 0, step 2: (\d+) where (\d+) was forced\)", strayed), strayed
    assert f"OUT OF BOUNDS: {strayed}" in parity.format_table(report)
    assert parity._first_difference([[4, 5, 6], [7, 8]], [[4, 5, 6], [7, 9]]) == "row 1, step 1: 8 where 9 was forced"
    assert parity._first_difference([[4, 5]], [[4, 5, 6]]) == "row 0, step 2: nothing where 6 was forced"
    assert parity._first_difference([[4]], [[4], [5]]) == "1 rows, not 2"


def test_a_nan_in_the_cache_is_out_of_bounds():
    """A JAX static cache whose decode steps wrote NaN into the key of position 0 (out of the window, so masked by
    `where` and in no logit) passed with max|ΔKV| 1.4e-06: Python's max(worst, nan) kept worst."""
    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((2, 2, 1, 5, 4))  # each [layers, Hkv, L, D]: 2 layers, 5 positions
    reference = parity.Oracle("truth", np.zeros((1, 2, 8)), [keys], [values])
    for spoiled in ("keys", "values"):
        run = parity.Run(np.zeros((1, 2, 8)), [k[None] for k in keys], [v[None] for v in values],
                         np.arange(5)[None])  # per layer [B, Hkv, S, D]; slot s holds position s
        getattr(run, spoiled)[1][0, :, 0] = np.nan  # the last layer's entry at position 0
        gap = parity.kv_distance(reference, run, "static", None)
        assert np.isnan(gap), (spoiled, gap)
        floor = parity_metrics.distance(np.zeros((1, 2, 8)), np.full((1, 2, 8), 1e-7))
        found = dataclasses.replace(floor, max_abs_kv_diff=gap)
        failed = parity_metrics.failures(found, dataclasses.replace(floor, max_abs_kv_diff=1e-6), "float32")
        assert failed == ["max_abs_kv_diff"], failed


def test_the_float64_truth_computes_rope_in_float64(checkpoints):
    """transformers computes RoPE in float32 in every dtype, its float64 model included: a truth whose angles are off
    by ~position x 6e-8 radians. Inside parity.float64_rope (where the truth runs) its rotary embedding gives exact
    float64 cos/sin (numpy's, here), and the model is as it was afterwards."""
    import torch

    model = load_transformers(checkpoints["no_window"], "float64")
    positions = torch.tensor([[0, 1, 17, 4095, 30000, 123457]])  # [1, S]
    head_dim = 2 * model.model.rotary_emb.inv_freq.shape[-1]
    angles = positions.numpy()[0, :, None] * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)  # [S, D/2]
    exact = np.concatenate([angles, angles], axis=-1)  # [S, D]
    x = torch.zeros(1, dtype=torch.float64)
    before = [t.clone() for t in model.model.rotary_emb(x, positions)]
    with parity.float64_rope(model):
        cos, sin = model.model.rotary_emb(x, positions)
    assert cos.dtype == torch.float64 and abs(cos[0].numpy() - np.cos(exact)).max() < 1e-12
    assert abs(sin[0].numpy() - np.sin(exact)).max() < 1e-12
    assert abs(before[0][0].numpy() - np.cos(exact)).max() > 1e-4  # transformers' own float32 angles, as they were
    assert all(torch.equal(a, b) for a, b in zip(before, model.model.rotary_emb(x, positions), strict=True))


def test_jax_at_thousands_of_positions_is_within_bounds_of_the_float64_truth(tmp_path, capsys):
    """2,500 positions: JAX rounds its float32 RoPE angles otherwise than transformers (XLA rewrites 1 / theta**e as
    theta**-e), as close to exact RoPE as transformers' own. Against a truth with transformers' float32 RoPE, which the
    floor shares, jax:step was 13x past the floor's K/V error here (17x in its logits at 5,000 positions)."""
    directory = save_hf_checkpoint(tmp_path / "long", seed=3, sliding_window=None, max_position_embeddings=4096)
    ids = ",".join(str(3 + (i * 37) % 120) for i in range(2500))
    code = cli.main(["parity", "--model", str(directory), "--prompt-ids", ids, "--max-new-tokens", "4", "--cache",
                     "static", "--modes", "jax:step", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], [(row["name"], row["failed"]) for row in report["rows"]]
