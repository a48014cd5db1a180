"""The command line's stdout and stderr as scripts and terminals hand them over: closed (`>&-`, `2>&-`), failing
(`> /dev/full`, `2> /dev/full`), or one destination shared by the streamed text and stderr's lines (a terminal, `2>&1`).

- A closed descriptor 1 or 2 is pointed at /dev/null before anything else opens a file: the next file opened would
  otherwise take its number, and whatever writes "stderr" at the C level (torch, XLA) would write into that file.
  Python itself gives None for a stream closed at its start: `print(..., file=sys.stderr)` then printed on stdout,
  and `sys.stdout.write` raised AttributeError. A closed stdout refuses the command (its output would be lost); a
  closed stderr only silences the notices and the summary.
- A write to stdout that fails for another reason than a reader gone away (EPIPE: the CLI's quiet exit 141) raises
  OutputError, one line naming stdout and the cause (a full disk), exit 2, where "unexpected OSError: [Errno 28]"
  was printed.
- A write to stderr that fails is dropped: a notice or a summary that cannot be shown must not turn a successful run
  into exit 1 (parity's FAIL), as an uncaught OSError at the summary did.
- Streamed text leaves stdout's line open until the run ends; a line written to stderr meanwhile (an error found
  while decoding, Ctrl-C's "twincache: interrupted") first ends it where both streams reach one destination, so that
  the line starts at column 0 instead of being glued to the text ("...known for his kindness andtwincache:
  interrupted"). Where they reach two, stdout's text is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from twincache.errors import OutputError

_line_open = False  # the last text written to stdout did not end a line
_shared = False  # stdout and stderr reach one destination (the same terminal, file or pipe)

CLOSED_STDOUT = ("stdout is closed (as `>&-` leaves it), so the output would be lost; send it to a file or to "
                 "/dev/null instead (> FILE)")


def plug_closed_descriptors() -> bool:
    """Point a closed descriptor 1 or 2 at /dev/null, and give Python a stream where it has None; True when stdout
    was closed (the command's output would go nowhere)."""
    closed = set()
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:  # the lowest free number: fd itself when nothing took it since
                os.dup2(null, fd)
                os.close(null)
            closed.add(fd)
    if sys.stdout is None:  # closed when Python started: whatever holds number 1 now is not stdout
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        closed.add(1)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    return 1 in closed


def _fd(stream: object) -> int | None:
    try:
        return stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both; a test's capture has none
        return None


def _same_destination(out: object, err: object) -> bool:
    """Whether two streams write to one file, pipe or terminal (one inode: `2>&1`, or both on a terminal)."""
    fds = (_fd(out), _fd(err))
    try:
        a, b = (os.fstat(fd) for fd in fds if fd is not None)
    except (OSError, ValueError):  # a descriptor gone, or a stream without one (unpacking fewer than two)
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def end_open_line_raw() -> None:
    """End stdout's open line on descriptor 1 where stderr shares it, for a line about to be written with
    os.write(2, ...): Ctrl-C's, from the watcher thread, just before the process ends."""
    if _line_open and _shared:
        with contextlib.suppress(OSError):
            os.write(1, b"\n")


class _Stdout:
    """sys.stdout while a command runs: the stream itself, but a failed write or flush raises OutputError (EPIPE
    stays BrokenPipeError, which the CLI ends quietly), and it notes whether its text so far ends a line."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        global _line_open
        written = self._call("write", text)
        if text:
            _line_open = not text.endswith("\n")
        return written

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise OutputError(f"cannot write the output to stdout: {err.strerror or err} (errno {err.errno}); "
                              "send it where it can be written (> FILE)") from None

    def __getattr__(self, name: str) -> Any:  # encoding, errors, reconfigure, fileno, isatty, buffer, ...
        return getattr(self._stream, name)


class _Stderr:
    """sys.stderr while a command runs: the stream itself, but a write first ends stdout's open line where the two
    share a destination, and a failed write or flush is dropped."""

    def __init__(self, stream: TextIO, stdout: _Stdout) -> None:
        self._stream = stream
        self._stdout = stdout

    def write(self, text: str) -> int:
        global _line_open
        if text and _line_open and _shared:
            with contextlib.suppress(OSError, OutputError):
                self._stdout.write("\n")
                self._stdout.flush()
            _line_open = False
        with contextlib.suppress(OSError):
            return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, reconfigure, fileno, isatty, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """sys.stdout and sys.stderr as this module describes, for the block; the streams themselves come back after it
    (unless something replaced them meanwhile: a mesh rank's stdout on /dev/null stays)."""
    global _line_open, _shared
    out, err = sys.stdout, sys.stderr
    _line_open, _shared = False, _same_destination(out, err)
    guarded_out = _Stdout(out)
    sys.stdout, sys.stderr = guarded_out, _Stderr(err, guarded_out)
    try:
        yield
    finally:
        if isinstance(sys.stdout, _Stdout):
            sys.stdout = out
        if isinstance(sys.stderr, _Stderr):
            sys.stderr = err
        _line_open = False
