"""The Python behind the GPU scripts (parity_tests/gpu_check.sh, bench/gpu_7b.sh), run end to end on CPU with tiny
shapes. A GPU is lent to few sessions, for minutes: a bug found there costs them. (On CPU this checks that the scripts
run, record and judge, not GPU numerics.)"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from parity_tests import gpu_parity
from twincache_app import parity

REPO = Path(__file__).resolve().parent.parent
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


_SEVEN_B_AT_A_TINY_SHAPE = """
import dataclasses, sys
from pathlib import Path
from bench.presets import PRESETS
from bench.runner import Options, run_bench
from parity_tests.test_gpu_scripts import TINY
preset = dataclasses.replace(
    PRESETS["7b"], config=TINY, device="cpu", prompt_len=12, new_tokens=8, repeats=1,
    impls=("torch_eager", "jax_step", "jax_fused", "transformers_eager"), curve_impls=("jax_step",),
    curve_contexts=(1, 16), curve_steps=2, batch_impls=("jax_fused",), batch_sizes=(1, 2), batch_prompt_len=8,
    batch_new_tokens=4, probe_bytes=16 << 20)
assert preset.weights_on_device and preset.dtype == "bfloat16"
run_bench(Options(preset=preset, out=Path(sys.argv[1]), impls=list(preset.impls), progress=False))
"""


def test_the_7b_preset_runs_its_pipeline_on_cpu_at_a_tiny_shape(tmp_path):
    """bench/gpu_7b.sh runs `--preset 7b`: bf16 weights built in memory on the device and shared by every
    implementation (no checkpoint directory). The same preset at a tiny shape on CPU, through the runner (the CLI
    refuses 7b without a GPU); compiled implementations left out for time. In a subprocess, as test_bench_smoke."""
    out = tmp_path / "out"
    env = {**os.environ, "TWINCACHE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _SEVEN_B_AT_A_TINY_SHAPE, str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((out / "results.json").read_text())
    decode = {(r["impl"], r["cache"]): r for r in records if r["kind"] == "decode" and r["batch"] == 1}
    for impl in ("torch_eager", "jax_step", "jax_fused", "transformers_eager"):
        for cache in ("static", "sliding_window"):
            record = decode[(impl, cache)]
            assert record["status"] == "ok" and record["decode_tok_s"] > 0, (impl, cache, record["status"])
    assert not (tmp_path / "home" / "bench").exists() or not any((tmp_path / "home" / "bench").iterdir()), \
        "weights on the device: no checkpoint directory is written"
    assert (out / "results.md").is_file()


def test_the_gpu_shell_scripts_parse_and_run_python3():
    """Each script parses, and runs Python as ${PYTHON:-python3}: the GPU image's python3 holds torch, and a bare
    `python` may not exist there."""
    scripts = sorted([*REPO.glob("bench/gpu_*.sh"), *REPO.glob("parity_tests/gpu_*.sh")])
    assert [script.name for script in scripts] == ["gpu_7b.sh", "gpu_mesh.sh", "gpu_check.sh"]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        code = [line.split("#")[0] for line in script.read_text().splitlines()]
        assert not [line for line in code if re.search(r"(^|[\s;|&(])python\s", line)], script.name
