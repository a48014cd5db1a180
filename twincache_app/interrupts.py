"""Ctrl-C for the command line: exit 130 with one line, at once, in every phase (docs/design.md §6).

Python's default turns SIGINT into a KeyboardInterrupt raised wherever the main thread happens to run, and only when
it next runs Python code. Under JAX that went wrong three ways: raised inside JAX's garbage-collection callback the
exception was swallowed (a traceback, then the run went on and exited 0 with the full text); unwinding through XLA
work and then shutting the interpreter down under XLA's threads crashed (exit 139); and during a long XLA call
(a compile, a whole fused decode loop) the signal waited until the call returned.

So while a command runs, SIGINT wakes a watcher thread through `signal.set_wakeup_fd` (written by Python's C-level
handler the moment the signal arrives), and the watcher writes the line and leaves with `os._exit(130)`: nothing is
unwound, no finalizer runs, and the main thread may be anywhere, even inside a call that holds no GIL. The Python-level
handler does the same if the main thread gets there first. Output already flushed stays; streaming modes flush every
step (or block).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from twincache import exit_cleanup
from twincache_app import streams

EXIT_CODE = 128 + signal.SIGINT  # 130, as a shell reports a program ended by SIGINT
MESSAGE = b"twincache: interrupted\n"
_exiting = threading.Lock()


def exit_interrupted(*_: object) -> None:
    """Write the one line and end the process now, after the cleanups registered with
    twincache.exit_cleanup.on_abrupt_exit (nothing else is unwound). The first caller exits; a second one waits here
    for that."""
    _exiting.acquire()
    try:
        streams.end_open_line_raw()  # at column 0, where streamed text shares stderr's terminal or file
        os.write(2, MESSAGE)
        exit_cleanup.run_cleanups()
    finally:
        os._exit(EXIT_CODE)


def _watch(read_fd: int) -> None:
    """The watcher thread: exits the process when the wakeup fd carries SIGINT; ends when the fd is closed."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            os.close(read_fd)
            return
        if signal.SIGINT in data:
            exit_interrupted()


class ExitOnInterrupt:
    """SIGINT exits the process with one line and code 130 while installed (main thread only, as signal handlers can
    only be set there; not where SIGINT is ignored). `restore()` puts Python's own handling back early."""

    def __init__(self) -> None:
        self._restore: list = []

    def install(self) -> None:
        # A SIGINT ignored from the start (`nohup`, a background job of a script) stays ignored, as Python leaves it.
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored or threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it
        previous_handler = signal.signal(signal.SIGINT, exit_interrupted)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        watcher = threading.Thread(target=_watch, args=(read_fd,), name="twincache-interrupt", daemon=True)
        watcher.start()

        def restore() -> None:
            signal.set_wakeup_fd(previous_fd)
            signal.signal(signal.SIGINT, previous_handler)
            os.close(write_fd)  # the watcher reads end-of-file and ends
            watcher.join()

        self._restore.append(restore)

    def restore(self) -> None:
        """Back to what was installed before (Python's KeyboardInterrupt, unless a caller had set another)."""
        while self._restore:
            self._restore.pop()()


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[ExitOnInterrupt]:
    """Within the block, Ctrl-C exits with one line and code 130; afterwards the previous handling is back."""
    guard = ExitOnInterrupt()
    guard.install()
    try:
        yield guard
    finally:
        guard.restore()


__all__ = ["EXIT_CODE", "MESSAGE", "exit_interrupted", "ExitOnInterrupt", "exit_on_interrupt"]
