"""`python -m bench.interrupts`: what Ctrl-C does to `twincache` at random moments, over many runs.

Each run starts `python -m twincache_app.cli ARGS...` as a terminal would (SIGINT at its default), sends it SIGINT after
a delay drawn uniformly from [0.2 s, --max-delay], and sorts the outcome: `ok` (exit 130, the last stderr line
"twincache: interrupted", no traceback), `finished first` (the run ended before the signal), or what went wrong (exit
code, traceback, "Exception ignored"). It prints one JSON line per run, then the counts and the time from the signal to
the exit (docs/design.md §6).

    python -m bench.interrupts [--runs 30] [--max-delay 3] [--seed 0] -- generate --backend jax
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any


def one_run(args: list[str], delay: float) -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-m", "twincache_app.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        pass
    sent = time.monotonic()
    finished_first = proc.poll() is not None
    if not finished_first:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    stderr = err.decode(errors="replace")
    lines = stderr.splitlines()
    if finished_first:
        outcome = "finished first"
    elif (proc.returncode == 130 and lines and lines[-1] == "twincache: interrupted" and "Traceback" not in stderr
          and "Exception ignored" not in stderr):
        outcome = "ok"
    else:
        outcome = " ".join([f"exit {proc.returncode}"] + ["traceback"] * ("Traceback" in stderr)
                           + ["exception ignored"] * ("Exception ignored" in stderr) + [f"stdout {len(out)} B"])
    return {"delay_s": round(delay, 3), "exit": proc.returncode, "outcome": outcome,
            "signal_to_exit_s": round(time.monotonic() - sent, 3),
            "stderr_tail": "" if outcome == "ok" else stderr[-300:]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.interrupts", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--max-delay", type=float, default=3.0, help="seconds; delays are uniform in [0.2, this]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the twincache arguments")
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    rng = random.Random(opts.seed)
    runs: list[dict[str, Any]] = []
    for _ in range(opts.runs):
        runs.append(one_run(args or ["generate", "--backend", "jax"], rng.uniform(0.2, opts.max_delay)))
        print(json.dumps(runs[-1]), flush=True)
    latencies = sorted(r["signal_to_exit_s"] for r in runs if r["outcome"] == "ok")
    print(json.dumps({"outcomes": collections.Counter(r["outcome"] for r in runs),
                      "signal_to_exit_s": {"median": statistics.median(latencies), "max": latencies[-1]}
                      if latencies else None}))


if __name__ == "__main__":
    main()
