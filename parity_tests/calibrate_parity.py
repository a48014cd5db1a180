"""The data behind the verdict factors of twincache/parity_metrics.py (docs/parity.md), reproducible on a CPU.

Runs `twincache parity`'s report on the trained model (SmolLM2-135M-Instruct as Mistral checkpoints, window 64 and
none, built by parity_tests/trained_model.py) and on the tiny test checkpoints of conftest.py, in fp32 and bf16, and
prints every table plus, per metric, the largest ratio to the floor over the implementation rows and over the direct
torch-vs-JAX rows. Appends to calibration.json and calibration.md in OUT_DIR after each case, so cases may run in
separate processes into one directory; --summary prints the table of largest ratios over everything there.
Usage: python -m parity_tests.calibrate_parity OUT_DIR [--steps 100] [--cases window64 no_window tiny] [--summary]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from parity_tests import trained_model
from parity_tests.conftest import CHECKPOINT_VARIANTS, WINDOW, save_hf_checkpoint
from twincache import parity, parity_metrics
from twincache.tokenizer import Tokenizer

DTYPES = ("float32", "bfloat16")


def run_case(label: str, model_dir: Path, prompts: list[list[int]], steps: int, caches: list[str],
             out: Path) -> list[dict]:
    records: list[dict] = []
    reference = None
    for dtype in DTYPES:
        start = time.perf_counter()
        models = parity.load_models(model_dir, dtype)
        if reference is None:  # the float64 truth does not depend on the dtype under test
            reference = parity.float64_reference(models.reference, prompts, steps)
        report = parity.parity_report(models, prompts, steps, dtype, caches, reference=reference)
        seconds = time.perf_counter() - start
        text = f"## {label}, {dtype} ({seconds:.0f} s)\n\n```\n{parity.format_table(report)}\n```\n"
        print(text, flush=True)
        with (out / "calibration.md").open("a") as f:
            f.write(text + "\n")
        records += [{"case": label, "dtype": dtype, "cache": row.cache, "name": row.name, "kind": row.kind,
                     "metrics": dataclasses.asdict(row.distance), "ratios": row.ratios, "failed": row.failed}
                    for row in report.rows]
    path = out / "calibration.json"
    earlier = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(earlier + records, indent=1, default=float))
    return records


def summary(records: list[dict]) -> str:
    """Largest ratio to the floor per (model family, dtype, row kind, metric)."""
    lines = ["| models | dtype | rows | " + " | ".join(parity_metrics.METRICS) + " |",
             "|---" * (3 + len(parity_metrics.METRICS)) + "|"]
    for family in ("trained", "tiny"):
        for dtype in DTYPES:
            for kind in ("implementation", "direct"):
                rows = [r for r in records if r["case"].startswith(family) and r["dtype"] == dtype
                        and r["kind"] == kind]
                worst = [max((r["ratios"].get(m, 0.0) for r in rows), default=0.0) for m in parity_metrics.METRICS]
                lines.append(f"| {family} | {dtype} | {kind} | " + " | ".join(f"{w:.2f}" for w in worst) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity_tests.calibrate_parity")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=100, help="teacher-forced steps on the trained model")
    parser.add_argument("--cases", nargs="+", choices=("window64", "no_window", "tiny"),
                        default=["window64", "no_window", "tiny"])
    parser.add_argument("--summary", action="store_true", help="only print the summary of what OUT_DIR holds")
    args = parser.parse_args(argv)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary:
        trained_cases = [case for case in args.cases if case in trained_model.WINDOWS]
        if trained_cases:
            trained = trained_model.build(out / "trained")
            prompt = Tokenizer.from_model_dir(trained["window64"]).encode(trained_model.PROMPT)
            for name in trained_cases:
                caches = ["static", "sliding_window"] if name == "window64" else ["static"]
                run_case(f"trained {name}, prompt {len(prompt)}", trained[name], [prompt], args.steps, caches, out)
        if "tiny" in args.cases:
            rng = np.random.default_rng(0)
            batch = [rng.integers(1, 128, n).tolist() for n in (13, 5, WINDOW)]  # left-padded
            for i, (name, overrides) in enumerate(CHECKPOINT_VARIANTS.items()):
                model_dir = save_hf_checkpoint(out / "tiny" / name, seed=i, **overrides)
                caches = ["static"] if name == "no_window" else ["static", "sliding_window"]
                run_case(f"tiny {name}, batch 13/5/8", model_dir, batch, 30, caches, out)
    table = summary(json.loads((out / "calibration.json").read_text()))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
