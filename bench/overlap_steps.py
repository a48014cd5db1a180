"""`python -m bench.overlap_steps`: per-step time of torch_cache's compiled decode one step at a time
(TWINCACHE_OVERLAP_STEPS=0) against two steps in flight, step k + 1 launched before the host reads step k's tokens
(docs/design.md §7.31), generations alternating in one process. On a GPU the overlap hides the host's work between
steps (the default there); on CPU a step returns when it is done, so the two should time the same.

    python -m bench.overlap_steps [--model DIR] [--cache static|sliding_window] [--prompt-len N] [--new-tokens N]
                                  [--rounds R] [--dtype D] [--device D]
"""

from __future__ import annotations

from bench.study import switch_study

if __name__ == "__main__":
    switch_study("overlap_steps", __doc__)
