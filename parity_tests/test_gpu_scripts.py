"""The GPU scripts (bench/gpu_lease.sh, which runs bench/gpu_7b.sh and parity_tests/gpu_check.sh) and the Python
behind them, run end to end on CPU with tiny shapes. A GPU is lent to few sessions, for minutes: a bug found there
costs them. (On CPU this checks that the scripts run, record, judge and keep to a lease's limits, not GPU numerics.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_tests import background, gpu_parity
from twincache_app import parity

REPO = Path(__file__).resolve().parent.parent


def test_gpu_parity_cases_are_the_ones_its_docstring_names():
    assert [(name, config.num_hidden_layers, config.sliding_window, dtype, prompt, steps)
            for name, config, dtype, prompt, steps, _ in gpu_parity.CASES] == [
        ("mistral-7b-shape", 32, 4096, "bfloat16", 502, 128),
        ("small-fp32-window-64", 8, 64, "float32", 160, 128),
        ("mistral-7b-shape-window-256", 32, 256, "bfloat16", 300, 128)]
    assert gpu_parity.CASES[1][5] == parity.IMPLEMENTATIONS  # fp32: every implementation, torch compiled included


def test_gpu_parity_runs_and_judges_tiny_cases_on_cpu(tmp_path, capsys, monkeypatch):
    """A tiny fp32 case runs and passes (the bf16 one whose ring wraps runs in the lease's smoke test below); a
    second, reached after the deadline (a clock that jumps), is recorded as skipped, not run; the JSON is written
    after each case, so a run killed later keeps the finished ones. The float64 model is gone before any
    implementation runs (at 7B shape it held 58 GB of an H100's 80 beside JAX's compile)."""
    import weakref

    from twincache_app import parity

    built, reference_alive = [], []

    def build_models(*args, **kwargs):
        models = real_build(*args, **kwargs)
        built.append(weakref.ref(models.reference))
        return models

    def run_implementation(*args, **kwargs):
        reference_alive.append(built[-1]() is not None)
        return real_run(*args, **kwargs)

    real_build, real_run = gpu_parity.build_models, parity.run_implementation
    monkeypatch.setattr(gpu_parity, "build_models", build_models)
    monkeypatch.setattr(parity, "run_implementation", run_implementation)
    cases = [("tiny-fp32", gpu_parity.TINY, "float32", 5, 10, ("torch:eager", "jax:fused")),
             ("past-the-deadline", gpu_parity.TINY, "float32", 5, 10, gpu_parity.AT_7B)]
    written_before_each_case = []
    ticks = iter([0.0, 0.0, 100.0])  # start, then before each case

    def clock():
        written_before_each_case.append((tmp_path / "gpu_parity.json").exists())
        return next(ticks)

    assert gpu_parity.main(tmp_path, cases, deadline_s=50.0, clock=clock) == 0
    assert written_before_each_case == [False, False, True]
    records = json.loads((tmp_path / "gpu_parity.json").read_text())
    rows = {(r["case"], r["cache"], r["name"]) for r in records if r["kind"] != "skipped"}
    for cache in ("static", "sliding_window"):
        assert {("tiny-fp32", cache, impl) for impl in ("torch:eager", "jax:fused")} <= rows
    assert all(not r["failed"] for r in records) and len({r["case"] for r in records}) == 2
    assert [r["case"] for r in records if r["kind"] == "skipped"] == ["past-the-deadline"]
    text = (tmp_path / "gpu_parity.md").read_text()
    assert "## tiny-fp32: float32, window 8, prompt 5, 10 steps" in text and "## past-the-deadline: skipped" in text
    assert text.rstrip().splitlines()[-1].startswith("PASS: 6/6 rows") and "past-the-deadline" in text
    assert all("partial" not in r for r in records)  # a finished case's rows replace its partial ones
    assert reference_alive and not any(reference_alive), reference_alive
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny-fp32: ")]
    assert re.fullmatch(r"tiny-fp32: models built \(\d+ s\)", progress[0]), progress
    assert re.fullmatch(r"tiny-fp32: float64 reference computed, its model freed \(\d+ s\)", progress[1]), progress
    # each row's verdict as the table gives it
    assert [re.sub(r" \(worst [\d.]+x the floor\) \(\d+ s\)$| \(\d+ s\)$", "", line) for line in progress[2:]] == [
        f"tiny-fp32: {cache} {name}: {'floor' if name.endswith('(floor)') else 'ok'}"
        for cache in ("static", "sliding_window")
        for name in ("transformers (floor)", "torch:eager", "jax:fused", "torch:eager vs jax:fused")], progress


def test_a_gpu_parity_case_cut_short_leaves_the_rows_it_judged(tmp_path, monkeypatch):
    """The lease's hard stop (SIGINT, then SIGKILL) can cut a case: gpu_parity.json then holds the finished cases'
    records and, marked partial, each row of the cut case judged before the stop, with its seconds."""
    calls = []
    run_implementation = parity.run_implementation

    def stopped_at_the_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run_implementation(*args, **kwargs)

    monkeypatch.setattr(parity, "run_implementation", stopped_at_the_second)
    cases = [("cut", gpu_parity.TINY, "float32", 5, 4, ("torch:eager", "jax:step"))]
    with pytest.raises(KeyboardInterrupt):
        gpu_parity.main(tmp_path, cases)
    records = json.loads((tmp_path / "gpu_parity.json").read_text())
    assert [(r["case"], r["cache"], r["name"], r["partial"]) for r in records] == [
        ("cut", "static", "transformers (floor)", True), ("cut", "static", "torch:eager", True)], records
    assert records[0]["seconds"] <= records[1]["seconds"] and not records[1]["failed"]


def test_gpu_parity_holds_the_weights_once_in_the_dtype_and_once_in_float64():
    """At 7B shape the weights are 14.5 GB in bf16 and 57.9 GB in float64: with transformers' floor holding a bf16 copy
    of its own the run needs 86.9 GB and cannot fit an H100's 80 GB. Counted by distinct storages at a tiny shape:
    torch_cache's model, JAX's view of it and transformers' floor hold one set of bf16 tensors; the float64
    reference is the only copy, and an exact one."""
    import torch

    models = gpu_parity.build_models(gpu_parity.TINY, torch.bfloat16)
    torch_model, floor, reference = models.towers["torch"], models.floor, models.reference  # JAX's view: test_handoff
    held = {id(t): t for m in (torch_model, floor, reference) for t in m.state_dict().values()}
    storages = {(t.untyped_storage().data_ptr(), t.dtype): t.untyped_storage().nbytes() for t in held.values()}
    params = sum(t.numel() for t in torch_model.state_dict().values())
    assert sum(storages.values()) == params * 2 + params * 8, (sum(storages.values()), params)
    assert {dtype for _, dtype in storages} == {torch.bfloat16, torch.float64}
    for name, tensor in torch_model.state_dict().items():
        assert floor.state_dict()[name].data_ptr() == tensor.data_ptr(), name
        assert torch.equal(reference.state_dict()[name], tensor.double()), name


def test_a_gpu_parity_case_frees_its_models_before_the_next_one_builds(tmp_path, monkeypatch):
    """The models are held by a reference cycle (build_models' frame, kept by what transformers' lazy import leaves
    the first time), so dropping them frees nothing until the collector runs: at 7B shape the first case's 14.5 GB
    would still be held while the third builds its 72.4 GB, past an H100's 80 GB. With automatic collection off,
    every model run_case built must be gone when it returns, here with a cycle of our own around them (the one
    transformers leaves arises only in a process's first import)."""
    import gc
    import weakref

    built: list[weakref.ref] = []
    build = gpu_parity.build_models

    def watched(*args, **kwargs):
        models = build(*args, **kwargs)
        built.extend(weakref.ref(m) for m in (*models.towers.values(), models.floor, models.reference))
        cycle: list = [models]
        cycle.append(cycle)
        return models

    monkeypatch.setattr(gpu_parity, "build_models", watched)
    gc.collect()
    gc.disable()
    try:
        gpu_parity.run_case("tiny-bf16", gpu_parity.TINY, "bfloat16", 5, 2, tmp_path, ("torch:eager",))
        alive = [type(ref()).__module__ for ref in built if ref() is not None]
    finally:
        gc.enable()
    assert len(built) == 4 and alive == [], alive


def test_gpu_parity_refuses_a_file_as_its_output_folder_in_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as refused:
        gpu_parity._parse_args([str(tmp_path / "a_file"), "--smoke"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m parity_tests.gpu_parity: error: OUT_DIR {tmp_path / 'a_file'} is a file; give a directory (made "
        "if missing) for gpu_parity.md/json")
    assert gpu_parity._parse_args([str(tmp_path / "new")]).out_dir == str(tmp_path / "new")


def test_gpu_parity_with_every_case_skipped_is_not_a_pass(tmp_path):
    assert gpu_parity.main(tmp_path, gpu_parity.SMOKE_CASES, deadline_s=-1.0) == 1
    assert "FAIL: 0/0 rows" in (tmp_path / "gpu_parity.md").read_text()


_SEVEN_B_AT_A_TINY_SHAPE = """
import dataclasses, sys
from pathlib import Path
from bench.presets import PRESETS
from bench.runner import Options, run_bench
from parity_tests.gpu_parity import TINY
preset = dataclasses.replace(
    PRESETS["7b"], config=TINY, device="cpu", prompt_len=12, new_tokens=8, repeats=2,
    impls=("jax_fused", "transformers_eager", "jax_step", "torch_eager", "transformers"), curve_impls=("jax_step",),
    curve_contexts=(1, 16), curve_steps=2, batch_impls=("jax_fused",), batch_sizes=(1, 2), batch_prompt_len=8,
    batch_new_tokens=4, probe_bytes=16 << 20)
assert preset.weights_on_device and preset.dtype == "bfloat16"
from bench import runner
checks = []
def past_deadline(self):  # the deadline passes after the 8th check: the 9th and 10th warm-ups are skipped
    checks.append(1)
    return len(checks) > 8
runner.Bench._past_deadline = past_deadline
probe = runner.Bench._probe
def probe_then_stop(self, when, repeats=10):  # a hard stop (timeout's SIGINT) as the second round begins
    if when == "round 2":
        raise KeyboardInterrupt
    probe(self, when, repeats)
runner.Bench._probe = probe_then_stop
try:
    run_bench(Options(preset=preset, out=Path(sys.argv[1]), impls=list(preset.impls), progress=False))
except KeyboardInterrupt:
    print("stopped in round 2")
"""


ScriptRun = Callable[[], tuple[Path, subprocess.CompletedProcess]]


def _bench_script(request: pytest.FixtureRequest, script: str) -> ScriptRun:
    """A job running `script` in a fresh Python with its own TWINCACHE_HOME; its output folder is ROOT/out."""
    root = request.getfixturevalue("tmp_path_factory").mktemp("bench_script")
    env = {**os.environ, "TWINCACHE_HOME": str(root / "home"), "PYTHONPATH": str(REPO)}

    def run() -> tuple[Path, subprocess.CompletedProcess]:
        return root, subprocess.run([sys.executable, "-c", script, str(root / "out")], cwd=REPO, env=env,
                                    capture_output=True, text=True, timeout=300)

    return run


@background.job
def seven_b_at_a_tiny_shape(request: pytest.FixtureRequest) -> ScriptRun:
    return _bench_script(request, _SEVEN_B_AT_A_TINY_SHAPE)


def test_the_7b_preset_runs_its_pipeline_on_cpu_at_a_tiny_shape(
        seven_b_at_a_tiny_shape: tuple[Path, subprocess.CompletedProcess]):
    """bench/gpu_7b.sh runs `--preset 7b`: bf16 weights built in memory on the device and shared by every
    implementation (no checkpoint directory). The same preset at a tiny shape on CPU, through the runner (the CLI
    refuses 7b without a GPU); torch compiled left out for time. In a subprocess, as test_bench_smoke. Warm-ups
    (compiles) run in the order given, but for one transformers impl first (its first run registers pytree nodes that
    torch_cache's graphs guard on); past the deadline (after the 8th warm-up here) none starts: the compiled
    transformers, last, is recorded as skipped. A hard stop (gpu_7b.sh's timeout sends SIGINT) as the second round
    begins still leaves every cell's row from the first round."""
    root, proc = seven_b_at_a_tiny_shape
    out = root / "out"
    assert proc.returncode == 0 and "stopped in round 2" in proc.stdout, proc.stderr[-3000:]
    records = json.loads((out / "results.json").read_text())
    assert records[0]["machine"]["interrupted_after_s"] > 0
    decode = {(r["impl"], r["cache"]): r for r in records if r["kind"] == "decode" and r["batch"] == 1}
    for impl in ("torch_eager", "jax_step", "jax_fused", "transformers_eager"):
        for cache in ("static", "sliding_window"):
            record = decode[(impl, cache)]
            assert record["status"] == "ok" and record["decode_tok_s"] > 0, (impl, cache, record["status"])
            assert record["repeats"] == 1, (impl, cache, record["repeats"])
    for cache in ("static", "sliding_window"):
        assert decode[("transformers", cache)]["status"] == "skipped", decode[("transformers", cache)]
    assert not (root / "home" / "bench").exists() or not any((root / "home" / "bench").iterdir()), \
        "weights on the device: no checkpoint directory is written"
    assert (out / "results.md").is_file()


_STOPPED_IN_THE_WARM_UPS = """
import dataclasses, sys
from pathlib import Path
from bench.presets import PRESETS
from bench.runner import Options, run_bench
from bench import runner
preset = dataclasses.replace(PRESETS["tiny"], impls=("torch_eager", "transformers_eager", "jax_step"), repeats=2)
measure = runner.Bench._measure
warm_ups = []
def measure_then_stop(self, impl, *args, track_rss):  # a hard stop (timeout's SIGINT) in the 5th warm-up
    if track_rss:
        warm_ups.append(1)
        if len(warm_ups) == 5:
            raise KeyboardInterrupt
    return measure(self, impl, *args, track_rss=track_rss)
runner.Bench._measure = measure_then_stop
try:
    run_bench(Options(preset=preset, out=Path(sys.argv[1]), impls=list(preset.impls), progress=False))
except KeyboardInterrupt:
    print("stopped in the warm-ups")
"""


@background.job
def stopped_in_the_warm_ups(request: pytest.FixtureRequest) -> ScriptRun:
    return _bench_script(request, _STOPPED_IN_THE_WARM_UPS)


def test_a_bench_stopped_during_its_warm_ups_keeps_what_each_warm_up_measured(
        stopped_in_the_warm_ups: tuple[Path, subprocess.CompletedProcess]):
    """On a GPU the table's warm-ups are its compiles, minutes of a lease that has never been timed: a hard stop
    (gpu_7b.sh's timeout) can come before any timed round. Each cell warmed up by then is still a row, `untimed`,
    with its warm-up's compile time, first step and wall time; and with no progress bar (gpu_7b.sh) each warm-up
    prints a line as it ends, so the device call's output tail shows them even if results.json is lost."""
    root, proc = stopped_in_the_warm_ups
    assert proc.returncode == 0 and "stopped in the warm-ups" in proc.stdout, proc.stderr[-3000:]
    # in the order they warm up: a transformers impl first (test_the_7b_preset_runs_its_pipeline_on_cpu_at_a_tiny_shape)
    warmed = [(impl, cache) for impl in ("transformers_eager", "torch_eager") for cache in ("static", "sliding_window")]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("bench: ")]
    assert [line.split(" warmed up: ")[0] for line in lines] == [f"bench: {i}/{c}" for i, c in warmed], proc.stdout
    assert all(re.search(r"warmed up: [\d.]+ s, compile [\d.]+ s, first step [\d.]+ s", line) for line in lines)
    records = json.loads((root / "out" / "results.json").read_text())
    decode = {(r["impl"], r["cache"]): r for r in records if r["kind"] == "decode"}
    assert sorted(decode) == sorted(warmed), sorted(decode)
    for cell in warmed:
        record = decode[cell]
        assert record["status"] == "untimed" and "stopped before its timed rounds" in record["note"], record
        assert record["warmup_wall_s"] >= record["warmup_first_step_s"] > 0 and record["compile_s"] >= 0, record
    table = (root / "out" / "results.md").read_text()
    assert "| torch_eager | static | untimed: stopped before its timed rounds; warm-up " in table


def test_the_gpu_shell_scripts_parse_and_run_python3(tmp_path):
    """Each script parses, and runs Python as ${PYTHON:-python3}: the GPU image's python3 holds torch, and a bare
    `python` may not exist there."""
    scripts = sorted([*REPO.glob("bench/gpu_*.sh"), *REPO.glob("parity_tests/gpu_*.sh")])
    assert [script.name for script in scripts] == ["gpu_7b.sh", "gpu_lease.sh", "gpu_mesh.sh", "gpu_check.sh"]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        code = [line.split("#")[0] for line in script.read_text().splitlines()]
        assert not [line for line in code if re.search(r"(^|[\s;|&(])python\s", line)], script.name
    # The commands a real lease runs, with an `echo` for Python: the 7b preset with the deadline its share leaves
    # (360 s: 178 s hard stop, warm-ups until 108 s), then the GPU cases with theirs; no smoke arguments. The bench's
    # stand-in logs the warnings of a slow run (inductor's for a step left out of CUDA graphs, JAX's for a donation
    # XLA could not use), which the reply's tail repeats. Its version check (`-c`) fails, as a JAX that cannot start
    # would: parity still runs and says what failed.
    cudagraphs = "W1206 cudagraph_utils.py:210] skipping cudagraphs due to cpu device (arg7_1)"
    donation = "UserWarning: Some donated buffers were not usable: bf16[1,8,630,128]"
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\necho "$@ (unbuffered: ${{PYTHONUNBUFFERED:-no}})"\n'
                      f'[[ "$*" == "-m bench "* ]] && echo "{cudagraphs}" >&2 && echo "{donation}" >&2\n'
                      '[[ "$1" == -c ]] && exit 1\nexit 0\n')
    python.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_lease.sh"), "360"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                                                     "PYTHON": str(python), "OUT": str(tmp_path)})
    calls = [line for line in proc.stdout.splitlines() if line.startswith("-m ")]
    # Both unbuffered: a hard stop that ends in SIGKILL would drop what Python had buffered (a cell's failure line)
    assert calls[0] == (f"-m bench --preset 7b --out {tmp_path}/bench_7b --deadline 108 --no-progress "
                        "(unbuffered: 1)"), proc.stdout
    assert re.fullmatch(rf"-m parity_tests\.gpu_parity {tmp_path}/parity --deadline \d+ \(unbuffered: 1\)",
                        calls[1]), proc.stdout
    assert "gpu_check: the version check failed or hung (exit 1); running parity anyway" in proc.stdout
    tail = proc.stdout.split("== gpu_lease.sh:")[-1].splitlines()
    assert cudagraphs in tail and donation in tail, proc.stdout
    for seconds in ("abc", "60"):  # not a number; too short to split (a timeout of 0 would mean none at all)
        proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_lease.sh"), seconds], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert proc.stderr.count("\n") == 1 and "at least 120" in proc.stderr, proc.stderr


@background.job
def lease_smoke(request: pytest.FixtureRequest) -> Callable[[], tuple[Path, subprocess.CompletedProcess]]:
    root = request.getfixturevalue("tmp_path_factory").mktemp("lease")
    env = {**os.environ, "OUT": str(root / "out"), "GPU_LEASE_SMOKE": "1", "PYTHON": sys.executable,
           "TWINCACHE_HOME": str(root / "home")}

    def run() -> tuple[Path, subprocess.CompletedProcess]:
        return root / "out", subprocess.run(["bash", str(REPO / "bench" / "gpu_lease.sh"), "360"], env=env,
                                            capture_output=True, text=True, timeout=600)

    return run


def test_the_lease_script_runs_both_and_returns_what_a_device_call_brings_back(
        lease_smoke: tuple[Path, subprocess.CompletedProcess]):
    """bench/gpu_lease.sh is the one prepared call of a GPU lease. In its smoke mode (tiny shapes, CPU) it runs the
    bench and the parity through the same shell scripts, and leaves under $OUT only what a device call brings back:
    at most 8 files, no more than 2 folders down, named in letters, digits, '.', '_' and '-'. The reply carries the
    end of the output: the decode table and the parity verdict."""
    out, proc = lease_smoke
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    files = sorted(path.relative_to(out) for path in out.rglob("*") if path.is_file())
    assert {str(path) for path in files} >= {"bench_7b/results.json", "bench_7b/results.md", "parity/gpu_parity.json",
                                              "parity/gpu_parity.md"}, files
    assert len(files) <= 8 and all(len(path.parts) <= 3 for path in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for path in files for part in path.parts), files
    decode = [r for r in json.loads((out / "bench_7b" / "results.json").read_text()) if r["kind"] == "decode"]
    assert {(r["impl"], r["status"]) for r in decode} == {("transformers_eager", "ok"), ("torch_eager", "ok")}
    tail = proc.stdout[-12000:]
    assert "## Decode, batch 1" in tail and "| torch_eager | static |" in tail, tail
    assert "## tiny-bf16-wraps: bfloat16, window 8, prompt 12, 10 steps" in tail and "PASS: 6/6 rows" in tail, tail
