"""What the single-question studies (`python -m bench.fused_blocks`, `python -m bench.guard_skip`,
`python -m bench.overlap_steps`) share: the checkpoint they run (the trained default model unless one is named), a
fixed prompt of ids for it, and the command line of a study that times torch's decode with an environment switch
each way."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from twincache.checkpoint import load_config


class OneLineParser(argparse.ArgumentParser):
    """A study's flags as twincache's: a bad one is one line on stderr and exit code 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_ints(minimum: int = 1, one: bool = False) -> Callable[[str], Any]:
    """An argparse type: comma-separated integers >= minimum (a list), or with `one` a single one."""
    def parse(text: str) -> Any:
        try:
            values = [int(item) for item in text.split(",") if item.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum or (one and len(values) > 1):
            kind = "an integer" if one else "comma-separated integers"
            raise argparse.ArgumentTypeError(f"{text!r}: give {kind} >= {minimum}")
        return values[0] if one else values
    return parse


def model_and_prompt(model: Path | None, prompt_len: int) -> tuple[Path, list[int]]:
    """The checkpoint directory (`model`, or the trained default model, built on first use) and `prompt_len` ids
    spread over its vocabulary (never 0)."""
    if model is None:
        from twincache.default_model import default_model_dir

        model = default_model_dir()
    vocab_size = load_config(model).vocab_size
    return model, [1 + (7 * i) % (vocab_size - 1) for i in range(prompt_len)]


def switch_study(study: str, doc: str) -> None:
    """The command line of `python -m bench.<study>`: per-step times of torch_cache's compiled decode with the
    study's environment switch set each way (twincache_app.bench_adapters.switch_studies), alternating in one process
    (switch_step_ms), printed as a table."""
    from twincache.errors import TwincacheError
    from twincache_app.bench_adapters import switch_step_ms, switch_studies
    from twincache_app.generate_cmd import DTYPE_CHOICES
    from twincache_app.interrupts import exit_on_interrupt

    variable, variants = switch_studies()[study]
    parser = OneLineParser(prog=f"python -m bench.{study}", description=doc.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the trained default model)")
    parser.add_argument("--cache", default="sliding_window", choices=["static", "sliding_window"])
    parser.add_argument("--prompt-len", type=positive_ints(one=True), default=100)
    # a step's time is between two tokens after the prefill's: 4 tokens give each round 2, what quantiles need
    parser.add_argument("--new-tokens", type=positive_ints(4, one=True), default=48,
                        help="tokens per generation (at least 4)")
    parser.add_argument("--rounds", type=positive_ints(one=True), default=12)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--device", help="default: CUDA when torch sees one, else CPU")
    args = parser.parse_args()
    with exit_on_interrupt():  # Ctrl-C: one line and exit code 130, as twincache's commands
        try:  # a checkpoint that cannot run: one line, as twincache's commands say it
            args.model, prompt = model_and_prompt(args.model, args.prompt_len)
            times = switch_step_ms(args.model, prompt, args.new_tokens, args.rounds, args.cache, variable, variants,
                                   dtype=args.dtype, device=args.device)
        except TwincacheError as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"model {args.model}, {args.dtype}, {args.cache} cache, prompt {args.prompt_len}, {args.new_tokens} new "
          f"tokens, {args.rounds} rounds; ms per step, {variable} each way")
    print("| variant | median | p10 | p25 | mean | steps |\n|---|---:|---:|---:|---:|---:|")
    for name, steps in times.items():
        print(step_row(f"{name} ({variable}={variants[name]})", steps))


def step_row(label: str, steps: list[float]) -> str:
    """A variant's row: median, p10, p25 and mean ms per step. The quantiles interpolate within the steps measured
    (method="inclusive"): statistics' default extrapolates past them, and a few steps gave a negative p10."""
    p10, p25 = (statistics.quantiles(steps, n=20, method="inclusive")[1],
                statistics.quantiles(steps, n=4, method="inclusive")[0])
    return (f"| {label} | {statistics.median(steps):.3f} | {p10:.3f} | {p25:.3f} | {statistics.fmean(steps):.3f} "
            f"| {len(steps)} |")
