"""The data behind the verdict factors of twincache/parity_metrics.py (docs/parity.md), reproducible on a CPU.

Runs `twincache parity --json` (in this process, through twincache_app.cli.main) on the trained model
(SmolLM2-135M-Instruct as Mistral checkpoints with window 64 and without a window, built by
parity_tests/trained_model.py; its 93-token English prompt, 100 teacher-forced steps) and on the tiny test
checkpoints of conftest.py (a 13-token prompt, 30 steps), in fp32, bf16 and fp16, every implementation, both caches
where the config has a window. Saves each case's JSON in OUT_DIR, prints its table, and prints per metric the largest
ratio to the floor over the implementation rows and over the direct torch-vs-JAX rows. Cases already saved in OUT_DIR
are not rerun, so an interrupted calibration resumes; --summary only prints what OUT_DIR holds.
Usage: python -m parity_tests.calibrate_parity OUT_DIR [--steps 100] [--cases window64 no_window tiny]
       [--dtypes float32 bfloat16 float16] [--summary]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

from parity_tests import trained_model
from parity_tests.conftest import CHECKPOINT_VARIANTS, save_hf_checkpoint
from twincache import parity_metrics
from twincache_app import cli, parity

DTYPES = ("float32", "bfloat16", "float16")
TINY_PROMPT = np.random.default_rng(0).integers(1, 128, 13).tolist()


def run_case(label: str, argv: list[str], out: Path) -> dict:
    """`twincache parity ARGV --json`, saved as OUT/label.json (read back when it is there already)."""
    path = out / f"{label}.json"
    if not path.is_file():
        start, stdout = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = cli.main(["parity", *argv, "--json"])
        if code == 2:
            raise SystemExit(f"{label}: twincache parity {' '.join(argv)} exited 2")
        data = json.loads(stdout.getvalue()) | {"seconds": time.perf_counter() - start, "argv": argv}
        path.write_text(json.dumps(data, indent=1))
    data = json.loads(path.read_text())
    print(f"## {label} ({data['seconds']:.0f} s): twincache parity {' '.join(data['argv'])}\n\n```\n"
          f"{parity.format_table(data)}\n```\n", flush=True)
    return data


def summary(cases: dict[str, dict]) -> str:
    """Largest ratio to the floor per (model family, dtype, row kind, metric), and the greedy divergences: rows that
    diverged at all, and at a decisive step."""
    metrics = list(parity_metrics.FACTORS)
    lines = ["| models | dtype | rows | " + " | ".join(metrics) + " | diverged | decisively |",
             "|---" * (5 + len(metrics)) + "|"]
    for family in ("trained", "tiny"):
        for dtype in DTYPES:
            for kind in ("implementation", "direct"):
                rows = [row for label, data in cases.items() if label.startswith(family) and data["dtype"] == dtype
                        for row in data["rows"] if row["kind"] == kind]
                if not rows:
                    continue
                worst = [max((np.inf if row["ratios"].get(m, 0.0) is None else row["ratios"].get(m, 0.0)
                              for row in rows), default=0.0) for m in metrics]
                diverged = sum(row["metrics"]["first_greedy_divergence"] is not None for row in rows)
                decisively = sum(row["metrics"]["first_decisive_divergence"] is not None for row in rows)
                lines.append(f"| {family} | {dtype} | {kind} | " + " | ".join(f"{w:.2f}" for w in worst)
                             + f" | {diverged} of {len(rows)} | {decisively} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity_tests.calibrate_parity")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=100, help="teacher-forced steps on the trained model")
    parser.add_argument("--cases", nargs="+", choices=("window64", "no_window", "tiny"),
                        default=["window64", "no_window", "tiny"])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--summary", action="store_true", help="only print the summary of what OUT_DIR holds")
    args = parser.parse_args(argv)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary:
        trained_cases = [case for case in args.cases if case in trained_model.WINDOWS]
        if trained_cases:
            trained = trained_model.build(out / "trained") if not (out / "trained").is_dir() else {
                name: out / "trained" / name for name in trained_model.WINDOWS}
            for name in trained_cases:
                for dtype in args.dtypes:
                    run_case(f"trained-{name}-{dtype}", ["--model", str(trained[name]), "--prompt",
                                                         trained_model.PROMPT, "--max-new-tokens", str(args.steps),
                                                         "--dtype", dtype], out)
        if "tiny" in args.cases:
            prompt_ids = ",".join(map(str, TINY_PROMPT))
            for i, (name, overrides) in enumerate(CHECKPOINT_VARIANTS.items()):
                model_dir = out / "tiny" / name
                if not model_dir.is_dir():
                    save_hf_checkpoint(model_dir, seed=i, **overrides)
                for dtype in args.dtypes:
                    run_case(f"tiny-{name}-{dtype}", ["--model", str(model_dir), "--prompt-ids", prompt_ids,
                                                      "--max-new-tokens", "30", "--dtype", dtype], out)
    cases = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}
    print(summary(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
