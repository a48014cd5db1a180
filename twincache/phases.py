"""The phases of a run that code marks as it enters them: "load", "prefill", "compile" (the decode step or loop),
"decode" (after the first decode step or block), "exit" (the `twincache` process ending, its command done).

Their one use is a test hook: with TWINCACHE_INTERRUPT_AT=<phase> in the environment, the process sends itself
SIGINT when it enters that phase, so that tests can interrupt each phase deterministically
(parity_tests/test_interrupts.py). Unset, `enter` is a membership test and one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

PHASES = ("load", "prefill", "compile", "decode", "exit")
ENV = "TWINCACHE_INTERRUPT_AT"


def enter(phase: str) -> None:
    """Mark the start of `phase` (one of PHASES: a misspelt one would never be interrupted, so it raises)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; the phases are {', '.join(PHASES)}")
    if os.environ.get(ENV) == phase:
        os.kill(os.getpid(), signal.SIGINT)


__all__ = ["PHASES", "ENV", "enter"]
