"""What an abrupt exit must still undo. The command line's Ctrl-C leaves with `os._exit(130)`
(twincache_app/interrupts.py), which unwinds nothing: no `finally` runs, no `TemporaryDirectory` is removed. Code
that makes something that must not outlive its process (a half-written default-model build, a mesh run's folder, the
ranks of a mesh) registers its undo here for as long as that thing exists, and the exit runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_cleanups: list[Callable[[], None]] = []  # run by run_cleanups, newest first


@contextlib.contextmanager
def on_abrupt_exit(cleanup: Callable[[], None]) -> Iterator[None]:
    """Within the block, an abrupt exit (`run_cleanups`, then `os._exit`) calls `cleanup` first."""
    _cleanups.append(cleanup)
    try:
        yield
    finally:
        _cleanups.remove(cleanup)


def run_cleanups() -> None:
    """Run every registered cleanup, newest first (what was made last is undone first); one that fails does not stop
    the others."""
    for cleanup in reversed(list(_cleanups)):
        with contextlib.suppress(BaseException):
            cleanup()


__all__ = ["on_abrupt_exit", "run_cleanups"]
