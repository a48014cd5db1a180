"""Smoke test of `python -m bench --preset tiny`: the records and files exist and have their fields. Speeds are
never asserted (this machine is shared and noisy). The bench runs in a subprocess because it sets process-wide
torch.compile options (recompile limit, compile-cache dir) that must not leak into the other tests."""

from __future__ import annotations

import json
import os
import stat
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.presets import PRESETS
from parity_tests import background
from twincache_app.cli import main

REPO = Path(__file__).resolve().parent.parent
REQUIRED = ("kind", "impl", "cache", "prompt_len", "new_tokens", "batch", "prefill_s", "decode_tok_s", "gbps",
            "roofline_frac", "compile_s", "peak_mem_mb", "machine", "status")
MEASURED = ("prefill_s", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "ms_per_token", "gbps",
            "roofline_frac", "roofline_frac_round", "compile_s", "peak_mem_mb", "bytes_per_step", "limit_gbps")
CACHES = {"static", "sliding_window"}


@background.job
def tiny_run(request: pytest.FixtureRequest) -> Callable[[], tuple[Path, list[dict]]]:
    root = request.getfixturevalue("tmp_path_factory").mktemp("bench")
    out = root / "out"
    env = {**os.environ, "TWINCACHE_HOME": str(root / "home"), "PYTHONPATH": str(REPO)}

    def run() -> tuple[Path, list[dict]]:
        proc = subprocess.run([sys.executable, "-m", "bench", "--preset", "tiny", "--out", str(out), "--no-progress"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "failed:" not in proc.stderr, proc.stderr[-3000:]
        return out, json.loads((out / "results.json").read_text())

    return run


def test_decode_records_cover_every_impl_and_cache(tiny_run):
    _, records = tiny_run
    for record in records:
        missing = [key for key in REQUIRED if key not in record]
        assert not missing, (record["kind"], record.get("impl"), missing)
    decode = [r for r in records if r["kind"] == "decode"]
    tiny = PRESETS["tiny"]
    assert {(r["impl"], r["cache"]) for r in decode} == {(i, c) for i in tiny.impls for c in CACHES}
    for r in decode:  # jax is a dependency: its rows must run, not be reported unavailable
        assert r["status"] == "ok", (r["impl"], r["cache"], r["status"], r.get("note"))
        for key in MEASURED:
            assert isinstance(r[key], (int, float)) and r[key] >= 0, (r["impl"], r["cache"], key, r[key])
        assert r["decode_tok_s_min"] <= r["decode_tok_s"] <= r["decode_tok_s_max"]
        assert r["prompt_len"] == tiny.prompt_len and r["new_tokens"] == tiny.new_tokens and r["batch"] == 1
        assert r["machine"]["cpu_cores"] and r["machine"]["torch"]
        # tiny's runs may be too short to resolve (None); the run as a whole never is
        assert r["others_cpu_per_wall"] is None or 0 <= r["others_cpu_per_wall"] <= r["machine"]["cpu_cores"]
        assert r["note"]
    machine = records[0]["machine"]
    assert 0 <= machine["others_cpu_per_wall"] <= machine["cpu_cores"] and machine["steal_per_wall"] >= 0
    reference = {r["cache"]: r for r in decode if r["impl"] == "transformers_eager"}
    assert all(r.get("ratio_to_transformers") is not None for r in decode if r["status"] == "ok")
    assert all(r["reference_impl"] == "transformers_eager" for c in CACHES for r in [reference[c]])


def test_probe_curve_and_batch_records(tiny_run):
    _, records = tiny_run
    probes = {r["impl"] for r in records if r["kind"] == "bandwidth_probe" and r["status"] == "ok"}
    assert {"torch_sum", "torch_gemv", "torch_sum_huge", "jax_sum", "jax_gemv", "jax_sum_huge"} <= probes
    rounds = {r["when"] for r in records if r["kind"] == "bandwidth_probe" and r["status"] == "ok"}
    assert rounds == {"start", "end"} | {f"round {n}" for n in range(1, PRESETS["tiny"].repeats + 1)}
    assert all(r["limit_gbps"] > 0 for r in records)
    tiny = PRESETS["tiny"]
    available = {r["impl"] for r in records if r["kind"] == "decode" and r["status"] == "ok"}
    curve = [r for r in records if r["kind"] == "latency_vs_context"]
    curve_cells = {(i, c) for i in tiny.curve_impls if i in available for c in CACHES}
    assert {(r["impl"], r["cache"]) for r in curve} == curve_cells
    assert all(r["status"] == "ok" and r["ms_per_token"] > 0 and r["step_ms"] for r in curve)
    assert {r["prompt_len"] for r in curve} == set(tiny.curve_contexts)
    assert len({r["max_cache_len"] for r in curve}) == 1  # one cache size for every context
    batch = [r for r in records if r["kind"] == "batch"]
    assert {(r["impl"], r["batch"]) for r in batch} == {(i, b) for i in tiny.batch_impls if i in available
                                                         for b in tiny.batch_sizes}
    assert all(r["status"] == "ok" and r["total_tok_s"] > 0 for r in batch)


def test_batch_points_are_timed_in_interleaved_rounds(tiny_run):
    """Issue 13 §2's batch table timed one run per point after its warm-up, so its verdict at batch 8 flipped from run
    to run. Each point now has `repeats` timed runs, median [min–max], made in rounds as the decode table's are:
    every warm-up first, then each round visits every point once, in an order rotated by one a round."""
    _, records = tiny_run
    repeats = PRESETS["tiny"].repeats
    batch = [r for r in records if r["kind"] == "batch"]
    assert len(batch) > 2 and repeats >= 2
    for r in batch:
        runs = r["tok_s_runs"]
        assert r["repeats"] == len(runs) == repeats and r["rounds"] == list(range(1, repeats + 1)), r
        assert r["decode_tok_s"] == pytest.approx(statistics.median(runs))
        assert (r["decode_tok_s_min"], r["decode_tok_s_max"]) == (min(runs), max(runs))
        assert r["total_tok_s"] == pytest.approx(r["batch"] * r["decode_tok_s"])
        assert r["total_tok_s_min"] <= r["total_tok_s"] <= r["total_tok_s_max"]
        assert r["total_tok_s_max"] == pytest.approx(r["batch"] * max(runs))
        # the roofline fraction is the median's: bytes a step reads x steps/s over the run's limit
        assert r["roofline_frac"] == pytest.approx(r["bytes_per_step"] * r["decode_tok_s"] / 1e9 / r["limit_gbps"])
    points = [(r["impl"], r["batch"]) for r in batch]  # recorded in the preset's order, the first round's
    last = max(r["warmup_started_s"] for r in batch)  # every warm-up before the first timed run
    for k in range(repeats):
        started = sorted((r["run_started_s"][k], (r["impl"], r["batch"])) for r in batch)
        assert started[0][0] > last, f"round {k + 1} began before round {k} (or a warm-up) ended"
        assert [point for _, point in started] == points[k:] + points[:k], f"round {k + 1}'s order"
        last = started[-1][0]


def test_markdown_and_plots(tiny_run):
    out, records = tiny_run
    markdown = (out / "results.md").read_text()
    for heading in ("## Bandwidth limit", "## Decode, batch 1", "## Per-token decode latency", "## Total decode tok/s"):
        assert heading in markdown
    assert "| first / last |" in markdown  # the latency curve's shortest-over-longest ratio (issue 13 §1)
    for r in records:
        if r["kind"] == "decode":
            assert f"| {r['impl']} | {r['cache']} |" in markdown
        if r["kind"] == "batch":  # median [min–max] (roofline of the median)
            assert (f"{r['total_tok_s']:.1f} [{r['total_tok_s_min']:.1f}–{r['total_tok_s_max']:.1f}] "
                    f"({100 * r['roofline_frac']:.0f}%)") in markdown, r
    assert f"median over {PRESETS['tiny'].repeats} interleaved runs [min–max] (each round" in markdown
    for name in ("latency_vs_context.png", "tok_s_by_impl.png", "tok_s_vs_batch.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_a_batch_point_recorded_before_repeats_reads_as_one_run():
    """results.json of a run before the batch table was repeated: a point has total_tok_s alone (no min, max or
    repeats); results.md shows it as a spread of one run."""
    from bench import report

    old = {**_decode_record("torch_eager", "static"), "kind": "batch", "batch": 4, "total_tok_s": 40.0,
           "roofline_frac": 0.5}
    del old["repeats"], old["decode_tok_s_min"], old["decode_tok_s_max"]
    markdown = report.markdown([_decode_record("torch_eager", "static"), old])
    assert "median over 1 interleaved run [min–max]" in markdown and "| 40.0 [40.0–40.0] (50%) |" in markdown


def test_the_batch_plot_draws_each_points_spread(tmp_path, monkeypatch):
    """tok_s_vs_batch.png: each point's median with an error bar from its slowest to its fastest timed run, as
    tok_s_by_impl.png draws the decode table's; a point from before the repeats draws no bar."""
    from bench import report

    drawn = []
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.append(fig))
    point = {**_decode_record("torch_eager", "static"), "kind": "batch"}
    points = [{**point, "batch": 1, "total_tok_s": 10.0, "total_tok_s_min": 8.0, "total_tok_s_max": 13.0},
              {**point, "batch": 4, "total_tok_s": 30.0}]
    report.plot_batch(points, tmp_path / "batch.png")
    (container,) = drawn[0].axes[0].containers
    line, _, (bars,) = container
    assert line.get_xydata().tolist() == [[1.0, 10.0], [4.0, 30.0]]
    assert [segment[:, 1].tolist() for segment in bars.get_segments()] == [[8.0, 13.0], [30.0, 30.0]]


def _decode_record(impl: str, cache: str) -> dict:
    machine = {"device": "cpu", "cpu_cores": 2}
    return {"kind": "decode", "impl": impl, "cache": cache, "status": "ok", "machine": machine, "preset": "tiny",
            "prompt_len": 8, "new_tokens": 4, "batch": 1, "repeats": 1, "decode_tok_s": 10.0, "decode_tok_s_min": 9.0,
            "decode_tok_s_max": 11.0, "bytes_per_step": 1e6, "note": "a stand-in"}


def test_a_plot_without_points_is_neither_drawn_nor_listed(tmp_path):
    """`--no-curves --no-batch`: before, latency_vs_context.png and tok_s_vs_batch.png were drawn with empty axes and
    listed under Figures; one an earlier run left in the directory must not be listed (nor left) either."""
    from bench import report

    (tmp_path / "tok_s_vs_batch.png").write_bytes(b"an earlier run's")
    records = [_decode_record("torch_eager", "static"), _decode_record("torch_eager", "sliding_window")]
    report.write_report(records, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["tok_s_by_impl.png"]
    markdown = (tmp_path / "results.md").read_text()
    assert "Figures: `tok_s_by_impl.png`\n" in markdown, markdown
    assert "latency_vs_context.png" not in markdown and "tok_s_vs_batch.png" not in markdown
    report.write_report([], tmp_path)  # nothing measured at all: no plot, no Figures line
    assert not list(tmp_path.glob("*.png")) and "Figures" not in (tmp_path / "results.md").read_text()


def test_a_run_on_another_model_names_it(checkpoints, tmp_path):
    """`bench --preset tiny --model DIR`: results.json and results.md named only the preset, as if its own random
    weights (2 layers, hidden 64) had run; each record now names the model, and results.md's title too."""
    from bench import report
    from bench.presets import resolve
    from bench.runner import _Results

    def record(preset):  # a record as the runner adds it; machine as finalize() attaches it
        return _Results(tmp_path, {}, preset).add("decode", status="skipped", machine={})

    on_model = record(resolve(PRESETS["tiny"], checkpoints["gqa"]))
    assert on_model["model"] == str(checkpoints["gqa"])
    assert report.markdown([on_model]).startswith(f"# twincache bench: preset `tiny` on `{checkpoints['gqa']}`\n")
    own = record(resolve(PRESETS["tiny"]))
    assert own["model"] is None and report.markdown([own]).startswith("# twincache bench: preset `tiny`\n")


def test_an_interrupted_runs_markdown_says_so():
    """results.md of a run cut short (Ctrl-C, a broken pipe) read "load average [...] at start, None at end; None s
    in all", with nothing saying the run stopped, nor why its later cells were missing."""
    from bench import report

    record = _decode_record("torch_eager", "static")
    record["machine"] = {**record["machine"], "loadavg_start": [0.4946, 3.2, 3.81], "interrupted_after_s": 13.4}
    header = report.markdown([record]).splitlines()[2]
    assert "load average [0.49, 3.20, 3.81] at start; **interrupted after 13.4 s**: below is what it measured" in header
    assert "None at end" not in header and "None s in all" not in header, header
    record["machine"] = {**record["machine"], "loadavg_end": [1.0, 2.0, 3.0], "elapsed_s": 34.4}
    del record["machine"]["interrupted_after_s"]
    assert "at start, [1.00, 2.00, 3.00] at end; 34.4 s in all." in report.markdown([record])
    # stopped mid-round: the table's prose gave the first cell's count of runs for every cell
    later = {**_decode_record("torch_eager", "sliding_window"), "repeats": 2}
    assert "(median over 1–2 interleaved runs per cell, the run cut short, [min" in report.markdown([record, later])
    assert "(median over 1 interleaved runs, [min" in report.markdown([record])


def test_curve_and_batch_points_not_measured_are_counted_in_the_markdown():
    """`--deadline`: skipped (or failed) latency and batch points are in results.json, but results.md left their
    sections out without a word, as if never asked for."""
    from bench import report

    skipped = [{**_decode_record("torch_eager", cache), "kind": kind, "status": "skipped", "note": "deadline"}
               for kind in ("latency_vs_context", "batch") for cache in ("static", "sliding_window")]
    failed = {**skipped[0], "status": "error", "note": "RuntimeError: out of memory"}
    markdown = report.markdown([_decode_record("torch_eager", "static"), *skipped, failed])
    assert ("Points not measured:\n\n- latency vs context: 2 points skipped (deadline)\n- latency vs context: 1 point "
            "error (RuntimeError: out of memory)\n- tok/s vs batch: 2 points skipped (deadline)\n") in markdown
    assert "Points not measured" not in report.markdown([_decode_record("torch_eager", "static")])


@pytest.fixture
def transformers_bars_on():
    """transformers' progress bars on for the test, as in a fresh process (a test that loaded before may have turned
    them off process-wide), then as they were."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def test_no_progress_silences_transformers_loading_bar(tmp_path, capfd, transformers_bars_on):
    """`twincache bench --no-progress` printed transformers' "Loading weights" bar when its reference model loaded;
    with progress on it still shows (and transformers' switch is back as it was after a quiet load)."""
    from transformers.utils import logging as hf_logging

    from bench.presets import resolve
    from bench.workload import Workload

    capfd.readouterr()
    Workload(resolve(PRESETS["tiny"]), "cpu", tmp_path, progress=False).hf_model(sliding=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    Workload(resolve(PRESETS["tiny"]), "cpu", tmp_path).hf_model(sliding=False)
    assert "Loading weights" in capfd.readouterr().err, "the bar this test looks for no longer exists"


def test_cli_refuses_bad_arguments_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--impls", "torch_eager,nope"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["bench", "--repeats", "0"]) == 2
    assert "--repeats=0 must be >= 1" in capsys.readouterr().err
    for deadline in ("-5", "nan"):  # every cell would be skipped, or none ever
        assert main(["bench", "--deadline", deadline]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--deadline={float(deadline)} must be a number of seconds >= 0" in err, err


@pytest.mark.parametrize(("flags", "expected"), [
    (["--prefill-memory", "--meshes", "model=2"], "--prefill-memory would ignore --meshes (flags of the decode bench)"),
    (["--prefill-memory", "--sliding-window", "8", "--impls", "torch_eager"],
     "--prefill-memory would ignore --impls, --sliding-window (flags of the decode bench): leave them out"),
    (["--compare", *[str(REPO / "bench" / "results" / "small")] * 2, "--repeats", "5"], "--compare would ignore"),
    (["--meshes", "model=1", "--deadline", "60"], "--meshes would ignore --deadline"),
    (["--prompt-lengths", "100"], "a decode bench would ignore --prompt-lengths (flags of --prefill-memory): add "),
])
def test_a_flag_the_chosen_way_of_running_ignores_is_refused(flags, expected, tmp_path, capsys):
    """Each was silently ignored: --prefill-memory swept every backend (its --backends) at the model's own window
    whatever --impls or --sliding-window said, --compare took run flags, --meshes a deadline, a decode bench the
    sweep's lengths."""
    from parity_tests.test_cli_bad_inputs import assert_one_line_error, run_in_process

    # a missing --model too (where it is not itself ignored), so that a regression fails at once instead of running
    model = [] if "--compare" in flags else ["--model", str(tmp_path / "missing")]
    code, _, err = run_in_process(["bench", *flags, *model, "--out", str(tmp_path / "out"), "--no-progress"], capsys)
    assert_one_line_error(code, err, expected)
    assert not (tmp_path / "out").exists()


def test_a_name_given_twice_is_one_cell(tmp_path, monkeypatch):
    """`--impls torch_eager,torch_eager --caches static,static`: the cell ran four times a round into one list of
    runs (8 timed, "median over 2 runs") and was written as four identical rows; a prompt length or a mesh given
    twice was measured twice too."""
    from bench import mesh
    from twincache_app.cli import build_parser

    args = build_parser().parse_args(["bench", "--impls", "torch_eager,jax_step,torch_eager", "--caches",
                                      "static,static", "--prefill-memory", "--backends", "jax,jax"])
    assert (args.impls, args.caches, args.backends) == (["torch_eager", "jax_step"], ["static"], ["jax"])
    assert build_parser().parse_args(["bench", "--prompt-lengths", "8,16,8"]).prompt_lengths == [8, 16]
    ran: list = []
    monkeypatch.setattr(mesh, "run_mesh_bench", lambda preset, out, meshes, *args: ran.append(meshes))
    assert main(["bench", "--meshes", "model=2", "model=2,data=1", "--out", str(tmp_path / "out")]) == 0
    assert [str(m) for m in ran[0]] == ["model=2,data=1"]


def test_the_mesh_bench_of_a_model_without_a_window_needs_no_cache_flag(checkpoints, tmp_path, monkeypatch, capsys):
    """The mesh bench runs the static cache only, yet a model without a window was refused ("the sliding_window cache
    cannot run; ... pass --caches static"); the decode bench still refuses it."""
    from bench import mesh

    ran: list = []
    monkeypatch.setattr(mesh, "run_mesh_bench", lambda *args: ran.append(args))
    common = ["bench", "--model", str(checkpoints["no_window"]), "--out", str(tmp_path / "out")]
    assert main([*common, "--meshes", "model=1"]) == 0 and len(ran) == 1, capsys.readouterr().err
    assert main(common) == 2 and "has no sliding window" in capsys.readouterr().err
    assert main([*common, "--meshes", "model=1", "--caches", "sliding_window"]) == 2  # was run as static
    assert "--meshes runs the static cache only (bench/mesh.py): leave --caches out" in capsys.readouterr().err


def test_a_cached_random_checkpoint_damaged_since_its_build_is_built_again(tmp_path):
    """A bench checkpoint under --cache-dir whose weights were truncated after it was built (a disk error, a partial
    copy) was reused as complete: every cell of every later run failed with "corrupted or truncated"."""
    from bench.workload import checkpoint_dir

    config = PRESETS["tiny"].config
    built = checkpoint_dir(config, 0, tmp_path)
    weights = built / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:1000])
    assert checkpoint_dir(config, 0, tmp_path) == built and weights.read_bytes() == intact


def test_a_random_checkpoint_gets_the_umask_s_modes_as_the_default_model_does(tmp_path):
    """Bench checkpoints were built owner-only (mkdtemp's 0700, safetensors' 0600) whatever the umask: a bench cache
    shared by a team (--cache-dir) served only the user who built it."""
    from bench.workload import checkpoint_dir

    before = os.umask(0o027)
    try:
        built = checkpoint_dir(PRESETS["tiny"].config, 1, tmp_path)
    finally:
        os.umask(before)
    assert stat.S_IMODE(built.stat().st_mode) == 0o750
    assert {stat.S_IMODE(path.stat().st_mode) for path in built.iterdir()} == {0o640}


def test_without_matplotlib_bench_names_the_extra_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert main(["bench", "--preset", "tiny", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected" not in err
    assert "matplotlib, which is not installed: pip install 'twincache[bench]'" in err
    assert not (tmp_path / "out").exists(), "refused before running anything"


def test_7b_preset_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the 7b preset would run")
    assert main(["bench", "--preset", "7b"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and err.count("\n") == 1


def test_long_preset_is_a_16k_static_cache_where_kv_reads_dominate():
    """The `long` preset measures what attention buckets buy: its curve reaches a static cache of 16k+ slots, whose
    K/V reads at the longest context outweigh the weights several fold, and its decode table holds a short chat in
    such a cache."""
    from bench.metrics import kv_bytes_per_step, weight_bytes_per_step
    from bench.presets import PRESETS

    long = PRESETS["long"]
    cache_slots = max(long.curve_contexts) + long.curve_steps + 2  # as the runner sizes the curve's static cache
    assert cache_slots >= 16384 and long.table_cache_len >= 16384
    assert kv_bytes_per_step(long.config, 4, 1, max(long.curve_contexts)) > 5 * weight_bytes_per_step(long.config, 4, 1)
    assert {"torch_compiled", "jax_step"} <= set(long.curve_impls)
    assert min(long.curve_contexts) <= 256


def in_process_tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **changes: Any) -> None:
    """The `tiny` preset with `changes`, run by `main` in this process: the bench's process-wide settings (its
    environment variables) are restored afterwards, and the default model goes to a home of its own."""
    import dataclasses

    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], **changes))
    for name in ("XLA_PYTHON_CLIENT_PREALLOCATE", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CACHE_DIR"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path / "home"))


def test_a_run_that_times_no_step_is_an_error_record_not_zero_tok_s(tmp_path, monkeypatch):
    """Two new tokens: the prefill gives one and the first (untimed) decode step the other, so nothing was timed. The
    decode and batch records then say so, as GenerationResult.decode_tok_s (None) does, never 0.0 tok/s or a division
    by zero. No preset asks for so few tokens; a preset edited to would."""
    import torch._dynamo

    in_process_tiny(monkeypatch, tmp_path, new_tokens=2, batch_new_tokens=2, batch_sizes=(1,), repeats=1,
                    probe_bytes=16 << 20)
    out = tmp_path / "out"
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        assert main(["bench", "--preset", "tiny", "--impls", "torch_eager", "--caches", "static", "--no-curves",
                     "--warm-compile-cache", "--no-progress", "--out", str(out)]) == 0
    records = [r for r in json.loads((out / "results.json").read_text()) if r["kind"] in ("decode", "batch")]
    assert [(r["kind"], r["status"]) for r in records] == [("decode", "error"), ("batch", "error")], records
    assert all("no decode step after the first was timed (2 new tokens" in r["note"] for r in records), records
    assert all(r["decode_tok_s"] is None for r in records)
    assert "| torch_eager | static |" in (out / "results.md").read_text()


def test_a_reader_gone_mid_warm_ups_leaves_what_they_measured(tmp_path, monkeypatch, capsys):
    """`twincache bench --no-progress | head -2`: the warm-up line after head left raised BrokenPipeError, which the
    CLI ends quietly (141), but the warm-ups measured were dropped (only Ctrl-C kept them): results.json held no
    decode row. Now a broken pipe is a hard stop like Ctrl-C: each warm-up measured is an `untimed` row."""
    from bench import runner

    in_process_tiny(monkeypatch, tmp_path, new_tokens=4, repeats=1, probe_bytes=1 << 20)

    def reader_gone(*args: object, **kwargs: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(runner, "print", reader_gone, raising=False)  # the first warm-up's line
    out = tmp_path / "out"
    assert main(["bench", "--preset", "tiny", "--impls", "torch_eager", "--caches", "static", "--no-curves",
                 "--no-batch", "--warm-compile-cache", "--no-progress", "--out", str(out)]) == 141
    records = json.loads((out / "results.json").read_text())
    decode = [r for r in records if r["kind"] == "decode"]
    assert [(r["impl"], r["status"]) for r in decode] == [("torch_eager", "untimed")], decode
    assert records[0]["machine"]["interrupted_after_s"] > 0


def test_a_hard_stop_in_the_batch_rounds_keeps_each_points_runs(tmp_path, monkeypatch):
    """Ctrl-C during the batch table's first round: the point timed once keeps its run (an ok row of 1 run), the one
    only warmed up is `untimed` with its warm-up's figures, as the decode table's cells are. (~2 s.)"""
    from bench import runner

    in_process_tiny(monkeypatch, tmp_path, new_tokens=4, repeats=2, probe_bytes=1 << 20)
    measure = runner.Bench._measure
    batch_4: list[int] = []

    def stopped_in_batch_4s_first_timed_run(self, impl, prompts, *args, **kwargs):
        if len(prompts) == 4:
            batch_4.append(1)
            if len(batch_4) == 2:  # its warm-up, then (round 1: batch 1's run first) its first timed run
                raise KeyboardInterrupt
        return measure(self, impl, prompts, *args, **kwargs)

    monkeypatch.setattr(runner.Bench, "_measure", stopped_in_batch_4s_first_timed_run)
    out = tmp_path / "out"
    assert main(["bench", "--preset", "tiny", "--impls", "torch_eager", "--caches", "static", "--no-curves",
                 "--warm-compile-cache", "--no-progress", "--out", str(out)]) == 130
    batch = {r["batch"]: r for r in json.loads((out / "results.json").read_text()) if r["kind"] == "batch"}
    assert [(b, r["status"]) for b, r in batch.items()] == [(1, "ok"), (4, "untimed")], batch
    assert batch[1]["repeats"] == 1 and batch[1]["total_tok_s_min"] == batch[1]["total_tok_s_max"] > 0
    assert batch[4]["warmup_decode_tok_s"] > 0 and "stopped before its timed rounds" in batch[4]["note"]
    assert "tok/s vs batch: 1 point untimed (stopped before its timed rounds" in (out / "results.md").read_text()


class _Killed(BaseException):
    """Stands in for SIGKILL: nothing in the bench catches it, so nothing is saved on the way out."""


def test_a_bench_killed_mid_warm_ups_leaves_the_ones_it_finished(tmp_path, monkeypatch):
    """On a GPU, a SIGINT that comes while XLA compiles (C++) is seen only when the compile returns, maybe past
    gpu_7b.sh's --kill-after: the SIGKILL then runs no handler. results.json is rewritten after each warm-up, so the
    cells warmed up before are `untimed` rows in it; it held the empty table written before the warm-ups."""
    from bench import runner

    in_process_tiny(monkeypatch, tmp_path, new_tokens=4, repeats=1, probe_bytes=1 << 20)
    measure = runner.Bench._measure
    warm_ups: list[str] = []

    def killed_in_the_second(self, impl, prompts, new_tokens, cache, *args, **kwargs):
        warm_ups.append(cache)
        if len(warm_ups) == 2:
            raise _Killed
        return measure(self, impl, prompts, new_tokens, cache, *args, **kwargs)

    monkeypatch.setattr(runner.Bench, "_measure", killed_in_the_second)
    out = tmp_path / "out"
    with pytest.raises(_Killed):
        main(["bench", "--preset", "tiny", "--impls", "torch_eager", "--no-curves", "--no-batch",
              "--warm-compile-cache", "--no-progress", "--out", str(out)])
    decode = [r for r in json.loads((out / "results.json").read_text()) if r["kind"] == "decode"]
    assert [(r["impl"], r["cache"], r["status"]) for r in decode] == [("torch_eager", "static", "untimed")], decode
    assert "| torch_eager | static | untimed: stopped before its timed rounds" in (out / "results.md").read_text()


@pytest.mark.parametrize("killed_at", ["decode round 2", "batch warm-up 2"])
def test_a_bench_killed_later_leaves_the_rounds_and_warm_ups_it_finished(tmp_path, monkeypatch, killed_at):
    """The same SIGKILL later on: in the decode table's second timed round, or in the batch table's second warm-up.
    results.json is rewritten after each round and each batch warm-up too, so it holds the first round's runs (`ok`
    rows of one run each) or the first batch point (`untimed`); it held the table as the phase before it left it."""
    from bench import runner

    in_process_tiny(monkeypatch, tmp_path, new_tokens=4, batch_new_tokens=4, batch_sizes=(1, 2), repeats=2,
                    probe_bytes=1 << 20)
    measure = runner.Bench._measure
    runs: list[int] = []

    def killed(self, impl, prompts, new_tokens, cache, *args, **kwargs):
        runs.append(len(prompts))  # decode: 2 warm-ups, then 2 runs a round; then batch 1's warm-up and batch 2's
        if (killed_at == "decode round 2" and len(runs) == 5) or (killed_at == "batch warm-up 2" and runs[-1] == 2):
            raise _Killed
        return measure(self, impl, prompts, new_tokens, cache, *args, **kwargs)

    monkeypatch.setattr(runner.Bench, "_measure", killed)
    out = tmp_path / "out"
    with pytest.raises(_Killed):
        main(["bench", "--preset", "tiny", "--impls", "torch_eager", "--no-curves", "--warm-compile-cache",
              "--no-progress", "--out", str(out)])
    records = json.loads((out / "results.json").read_text())
    decode = [(r["cache"], r["status"], r.get("repeats")) for r in records if r["kind"] == "decode"]
    batch = [(r["batch"], r["status"]) for r in records if r["kind"] == "batch"]
    if killed_at == "decode round 2":
        assert decode == [("static", "ok", 1), ("sliding_window", "ok", 1)] and batch == [], records
    else:
        assert decode == [("static", "ok", 2), ("sliding_window", "ok", 2)] and batch == [(1, "untimed")], records


def test_a_model_too_short_for_the_presets_runs_is_refused_before_any(checkpoints, tmp_path, capsys):
    """`bench --model` on a checkpoint of 512 positions: the small preset's decode table (300 + 256 tokens) would
    be refused run by run, so the bench refuses at once, naming the phase; with 600 positions the table fits and
    the latency curve (up to 2048 + 6 tokens) is named, with the flag that skips it."""
    import shutil

    short = checkpoints["gqa"]
    longer = shutil.copytree(short, tmp_path / "gqa600")
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 600}))
    small = PRESETS["small"]
    table = small.prompt_len + small.new_tokens
    curve = max(small.curve_contexts) + small.curve_steps + 2
    assert table <= 600 < curve and table > 512
    for model, expected in (
            (short, f"preset small's decode table runs {table} tokens (prompt + new), but {short}'s "
                    "max_position_embeddings=512 holds 512; use a preset with shorter runs (--preset tiny)"),
            (longer, f"latency curve runs {curve} tokens (prompt + new), but {longer}'s max_position_embeddings="
                     "600 holds 600; use a preset with shorter runs (--preset tiny), or skip it with --no-curves")):
        assert main(["bench", "--preset", "small", "--model", str(model), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    # tiny itself too short: "use --preset tiny" was the advice to a tiny run as well
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 47}))
    assert main(["bench", "--preset", "tiny", "--model", str(longer), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "47 holds 47; tiny is the shortest preset: give a model of at least 48 " in err
    assert not (tmp_path / "out").exists(), "refused before running anything"


def test_what_torchs_ranks_would_refuse_is_refused_before_any_starts(checkpoints, tmp_path, capsys, monkeypatch):
    """`bench --meshes`: torch runs each mesh in its own ranks, where a refusal came as their tracebacks and then
    "unexpected RuntimeError". A mesh that cannot split the model (model=3 of the tiny preset's 4 query heads), a
    --model whose weights file is truncated and more ranks than CPU cores are now refused in one line before anything
    runs."""
    import shutil

    import torch

    from twincache_app import launch

    truncated = shutil.copytree(checkpoints["gqa"], tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    started = []
    monkeypatch.setattr(launch, "run_ranks", lambda *args, **kwargs: started.append(args) or 1)
    monkeypatch.setattr(launch, "cpu_cores", lambda: 2)  # on a CPU, at most one rank per core
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for extra, expected in ((["--meshes", "model=1", "model=3"], "mesh model=3 cannot split 4 query heads evenly"),
                            (["--meshes", "model=2", "--model", str(truncated)], f"{weights} is truncated"),
                            (["--meshes", "model=1", "model=2,data=2"], "needs 4 devices, but torch on a CPU")):
        argv = ["bench", "--preset", "tiny", *extra, "--impls", "torch_eager", "--out", str(tmp_path / "out"),
                "--cache-dir", str(tmp_path / "cache")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
        assert started == [] and not (tmp_path / "out" / "mesh.json").exists(), "refused before running anything"


def test_ranks_that_die_or_fail_unexpectedly_end_the_mesh_bench_in_one_line(tmp_path, capsys, monkeypatch):
    """A torch rank of `bench --meshes` killed by a signal (seen once here: glibc's "malloc(): unaligned tcache chunk
    detected", SIGABRT): the launcher printed "rank 0 of 2 was killed by SIGABRT; ..." and the bench a second line,
    "unexpected RuntimeError: the torch ranks of mesh model=2,data=1 failed (exit 2)". A rank's own unexpected error
    came as its traceback, then that line. Now the launcher's line alone (the real launch._outcome, the ranks faked),
    and a rank's unexpected error as one line naming it (the real _rank_main, its measurement faked). (~0.5 s.)"""
    import torch

    from bench import mesh
    from twincache_app import launch

    monkeypatch.setattr(launch, "cpu_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["bench", "--preset", "tiny", "--meshes", "model=2", "--impls", "torch_eager", "--out",
            str(tmp_path / "out")]
    # rank 0 killed by SIGABRT, rank 1 stopped by the launcher: what _wait hands _outcome
    monkeypatch.setattr(launch, "run_ranks", lambda *args, **kwargs: launch._outcome([-6, -15], [None, None], {1}))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "twincache: error: rank 0 of 2 was killed by SIGABRT; the other ranks were stopped\n", err

    def rank_0_fails(argv: list[str], world_size: int, module: str) -> int:
        monkeypatch.setattr(launch, "rank", lambda: 0)
        monkeypatch.setattr(mesh, "mesh_record", lambda *args, **kwargs: 1 / 0)
        with pytest.raises(SystemExit) as ended:
            mesh._rank_main(argv)  # in this process: init_rank and follow_launcher are no-ops outside a world
        return int(ended.value.code)

    monkeypatch.setattr(launch, "init_rank", lambda: None)
    monkeypatch.setattr(launch, "run_ranks", rank_0_fails)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("twincache: error: a torch rank of mesh model=2,data=1 failed: unexpected ZeroDivisionError: "
                   "division by zero\n"), err


def test_a_refusal_in_a_one_device_mesh_run_reaches_the_user_as_one_line(checkpoints, tmp_path, capfd):
    """What only a run can find (NaN logits from a checkpoint whose final norm is NaN: its headers are fine) is
    refused in torch's model=1 run, which runs in this process (a one-device mesh starts no rank); the bench says it
    once, as that error, not as a traceback and "unexpected RuntimeError". The same refusal inside two torch ranks
    runs beside the mesh workers (test_mesh)."""
    from parity_tests.conftest import nan_norm_checkpoint

    broken = nan_norm_checkpoint(checkpoints["gqa"], tmp_path / "nan_norm")
    assert main(["bench", "--preset", "tiny", "--model", str(broken), "--meshes", "model=1", "--impls", "torch_eager",
                 "--out", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err  # the rank's stderr too: it writes to this process's fd 2
    assert err.count("\n") == 1 and "NaN or Inf logits at generated token 0" in err and "unexpected" not in err, err


def test_a_jax_adapter_after_a_failed_run_builds_a_cache_instead_of_reusing_a_consumed_one(tmp_path, monkeypatch):
    """A JAX generate consumes the cache it is given (reset() donates it); a run that then fails leaves it consumed.
    The adapter kept it, and every later run of that shape failed with StaleCacheError."""
    import jax_cache.backend as jax_backend
    from bench.impls import impl_registry
    from bench.presets import resolve
    from bench.workload import Workload

    adapter = impl_registry()["jax_step"](Workload(resolve(PRESETS["tiny"]), "cpu", tmp_path, progress=False))
    prompt = [5, 17, 42, 99]
    first = adapter.generate([prompt], 4, "static", 32)
    real = jax_backend.generate

    def consume_then_fail(model, prompts, max_new_tokens, *, cache, **kwargs):
        if not isinstance(cache, str):
            cache.reset()  # what generate does first with a cache object: its buffers are donated
        raise RuntimeError("a run that fails after taking its cache")

    monkeypatch.setattr(jax_backend, "generate", consume_then_fail)
    with pytest.raises(RuntimeError, match="fails after taking"):
        adapter.generate([prompt], 4, "static", 32)
    monkeypatch.setattr(jax_backend, "generate", real)
    assert adapter.generate([prompt], 4, "static", 32).decode_steps == first.decode_steps
