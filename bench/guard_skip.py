"""`python -m bench.guard_skip`: per-step time of torch_cache's compiled decode with every dynamo guard checked at
every step (TWINCACHE_SKIP_GUARDS=0) against a loop's steady steps skipping them (docs/design.md §7.30), generations
alternating in one process, so the machine's drift hits both alike; run it on an idle machine for figures.

    python -m bench.guard_skip [--model DIR] [--cache static|sliding_window] [--prompt-len N] [--new-tokens N]
                               [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.study import model_and_prompt
from twincache_app.bench_adapters import guard_skip_step_ms


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.guard_skip", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the trained default model)")
    parser.add_argument("--cache", default="sliding_window", choices=["static", "sliding_window"])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    args.model, prompt = model_and_prompt(args.model, args.prompt_len)
    times = guard_skip_step_ms(args.model, prompt, args.new_tokens, args.rounds, args.cache)
    print(f"model {args.model}, {args.cache} cache, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds; ms per step")
    print("| variant | median | p10 | p25 | mean | steps |\n|---|---:|---:|---:|---:|---:|")
    for name, steps in times.items():
        p10, p25 = (statistics.quantiles(steps, n=20)[1], statistics.quantiles(steps, n=4)[0])
        print(f"| {name} | {statistics.median(steps):.3f} | {p10:.3f} | {p25:.3f} | {statistics.fmean(steps):.3f} "
              f"| {len(steps)} |")


if __name__ == "__main__":
    main()
