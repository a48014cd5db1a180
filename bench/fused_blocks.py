"""`python -m bench.fused_blocks`: decode speed of the JAX fused mode against its steps per block, to choose
jax_cache.generate.FUSED_BLOCK_STEPS: the smallest block that keeps the speed of one loop over the whole budget
(smaller blocks answer Ctrl-C and stream sooner). Rounds are interleaved and rotated, so drift of a shared machine
hits every block size alike; run it on an idle machine for figures.

    python -m bench.fused_blocks [--model DIR] [--blocks 1,2,4,...] [--new-tokens N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.study import model_and_prompt
from twincache_app.bench_adapters import fused_block_tok_s


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fused_blocks", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the trained default model)")
    parser.add_argument("--blocks", default="1,2,4,8,16,32,64,128,256", help="steps per block, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=2000, help="tokens per run; also run as one block")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.model, prompt = model_and_prompt(args.model, 16)
    blocks = [int(b) for b in args.blocks.split(",")] + [args.new_tokens]  # the last: one loop over the budget
    speeds = fused_block_tok_s(args.model, blocks, args.new_tokens, args.rounds, prompt)
    whole = [statistics.median(column) for column in zip(*speeds[args.new_tokens])]
    print(f"model {args.model}, {args.new_tokens} new tokens, {args.rounds} rounds (medians; min-max)")
    print("| steps per block | decode tok/s (wall) | vs one loop | tokens per CPU second | vs one loop |\n"
          "|---:|---:|---:|---:|---:|")
    for block, runs in speeds.items():
        wall, cpu = ([run[i] for run in runs] for i in (0, 1))
        wall_median, cpu_median = statistics.median(wall), statistics.median(cpu)
        print(f"| {block}{' (one loop)' if block == args.new_tokens else ''} | {wall_median:.0f} "
              f"({min(wall):.0f}-{max(wall):.0f}) | {wall_median / whole[0]:.2f} | "
              f"{cpu_median:.0f} ({min(cpu):.0f}-{max(cpu):.0f}) | {cpu_median / whole[1]:.2f} |")
    print(json.dumps({str(b): runs for b, runs in speeds.items()}))

if __name__ == "__main__":
    main()
