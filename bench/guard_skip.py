"""`python -m bench.guard_skip`: per-step time of torch_cache's compiled decode with every dynamo guard checked at
every step (TWINCACHE_SKIP_GUARDS=0) against a loop's steady steps skipping them (docs/design.md §7.30), generations
alternating in one process, so the machine's drift hits both alike; run it on an idle machine for figures.

    python -m bench.guard_skip [--model DIR] [--cache static|sliding_window] [--prompt-len N] [--new-tokens N]
                               [--rounds R] [--dtype D] [--device D]
"""

from __future__ import annotations

from bench.study import switch_study

if __name__ == "__main__":
    switch_study("guard_skip", __doc__)
