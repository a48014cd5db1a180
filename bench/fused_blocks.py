"""`python -m bench.fused_blocks`: decode speed of the JAX fused mode against its steps per block, to choose
jax_cache.generate.FUSED_BLOCK_STEPS: the smallest block that keeps the speed of one loop over the whole budget
(smaller blocks answer Ctrl-C and stream sooner). Rounds are interleaved and rotated, so drift of a shared machine
hits every block size alike; run it on an idle machine for figures.

    python -m bench.fused_blocks [--model DIR] [--blocks 1,2,4,...] [--new-tokens N] [--rounds R]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.study import OneLineParser, model_and_prompt, positive_ints
from twincache.errors import TwincacheError
from twincache_app.bench_adapters import fused_block_tok_s
from twincache_app.interrupts import exit_on_interrupt

# Tokens per run at least: the prefill gives one and the first decode step (a block of its own) is untimed, so 3
# leaves one timed step (fewer gave every run a null tok/s, and the table a TypeError).
MIN_NEW_TOKENS = 3


def main(argv: Sequence[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m bench.fused_blocks", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the trained default model)")
    parser.add_argument("--blocks", type=positive_ints(), default="1,2,4,8,16,32,64,128,256",
                        help="steps per block, comma-separated")
    parser.add_argument("--new-tokens", type=positive_ints(MIN_NEW_TOKENS, one=True), default=2000,
                        help=f"tokens per run (at least {MIN_NEW_TOKENS}); also run as one block")
    parser.add_argument("--rounds", type=positive_ints(one=True), default=5)
    args = parser.parse_args(argv)
    with exit_on_interrupt():  # Ctrl-C: one line and exit code 130, as twincache's commands
        try:  # a checkpoint that cannot run: one line, as twincache's commands say it
            args.model, prompt = model_and_prompt(args.model, 16)
            # the last: one loop over the budget (a --blocks entry equal to it is the same run)
            blocks = list(dict.fromkeys([*args.blocks, args.new_tokens]))
            speeds = fused_block_tok_s(args.model, blocks, args.new_tokens, args.rounds, prompt)
        except TwincacheError as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
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
