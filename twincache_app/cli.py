"""The `twincache` command line. Every error is one line on stderr and exit code 2, without a traceback; Ctrl-C is
one line and exit code 130 (twincache_app.interrupts)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn

from twincache import phases
from twincache.errors import TwincacheError
from twincache_app import interrupts, launch, streams

# The modules that contribute a subcommand: each has add_parser(subparsers), which sets args.run(args) -> int, and
# may set args.keep_keyboard_interrupt (bench does, to save what it measured). They are imported by build_parser, so
# that Ctrl-C is handled from the start of main().
SUBCOMMANDS = ("twincache_app.generate_cmd", "twincache_app.parity", "twincache_app.soak", "bench.cli")


class _OneLineParser(argparse.ArgumentParser):
    _given: list[str] = []  # the arguments this parser was handed (a subcommand's parser: the subcommand's own)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # argparse prints usage plus the message; we print one line
        self.exit(2, f"twincache: error: {message}{self._dash_value_hint(message)} (see --help)\n")

    def _dash_value_hint(self, message: str) -> str:
        """argparse reads a value that starts with '-' and has no space (`--prompt -hello`) as an option, then says
        only that the flag "expected one argument", which the user gave; this says why and how to pass it. Not for a
        flag followed by one of this parser's options (or its abbreviation): that value was forgotten."""
        match = re.fullmatch(r"argument (\S+): expected one argument", message)
        for flag in match[1].split("/") if match else ():
            for arg, value in zip(self._given, self._given[1:]):
                option = value.split("=", 1)[0]
                if arg == flag and value.startswith("-") and not any(
                        known.startswith(option) for known in self._option_string_actions):
                    return f"; {value!r} starts with '-', so it was read as an option: write {flag}={value}"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="twincache", description="One KV-cache design for Mistral decoding, built twice: "
                            "torch_cache (PyTorch) and jax_cache (JAX/Flax).")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def _not_a_cuda_home_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No CUDA runtime is found")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if streams.plug_closed_descriptors():  # first: before a file can take number 1 or 2
        print(f"twincache: error: {streams.CLOSED_STDOUT}", file=sys.stderr)
        return 2
    # A CUDA build of torch (pip's default) on a machine with a CUDA toolkit but no GPU logs "No CUDA runtime is
    # found, using CUDA_HOME=..." each time inductor's C++ toolchain looks for CUDA, as the CPU path's compiler checks
    # do: nothing to do with CPU decoding, and a second line on the one-line stderr.
    logging.getLogger("torch.utils.cpp_extension").addFilter(_not_a_cuda_home_notice)  # once: the same function
    launch.follow_launcher()  # a rank of a torch --mesh run: Ctrl-C is its launcher's to handle
    with interrupts.exit_on_interrupt() as interrupt, _unencodable_text_replaced(), streams.guarded():
        args = build_parser().parse_args(argv)
        args.argv = argv  # a command that runs in several processes (--mesh, torch) re-runs itself in each
        if getattr(args, "keep_keyboard_interrupt", False):
            interrupt.restore()
        from twincache_app.generate_cmd import notices_on_stderr

        # A warning from a tower (jax_cache dropping its executables past MAX_DECODE_VARIANTS, the torch step its
        # graphs) is one `twincache: ...` line on stderr in every command; none with --json, as the other notices
        with notices_on_stderr(not getattr(args, "json", False), logging.WARNING):
            return _run(args)


@contextlib.contextmanager
def _unencodable_text_replaced() -> Iterator[None]:
    """stdout and stderr replace what their encoding cannot show (with "?"), as `errors="replace"` does: a terminal or
    pipe in latin-1 or ASCII would otherwise raise UnicodeEncodeError on the first emoji a model writes, after the
    text before it was printed. That is Python's "strict" (PYTHONIOENCODING=latin-1) and also its "surrogateescape",
    which it gives stdout in a C or POSIX locale with UTF-8 mode off (LC_ALL=C PYTHONUTF8=0): it only turns lone
    surrogates back into bytes, and decoded text holds none. Each stream's own error handler comes back afterwards."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
            changed.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(OSError, ValueError):  # a closed pipe, or a stream closed meanwhile
                stream.reconfigure(errors=errors)


def _run(args: argparse.Namespace) -> int:
    try:
        code = args.run(args)
        sys.stdout.flush()  # a reader that went away shows here, inside the handlers, not at interpreter exit
        return code
    except BrokenPipeError:  # `twincache generate | head -c 10`: stop quietly, as Unix tools do on SIGPIPE
        try:  # point stdout at /dev/null, so the flush at interpreter exit cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file descriptor (e.g. captured): nothing to redirect
            pass
        return 128 + signal.SIGPIPE
    except TwincacheError as err:
        print(f"twincache: error: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("twincache: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the CLI contract is one line, never a traceback
        if launch.peer_lost(err):  # a --mesh rank whose collective lost another rank: that rank is the news
            return launch.report_peer_lost(err)
        if os.environ.get("TWINCACHE_DEBUG"):
            raise
        print(f"twincache: error: unexpected {type(err).__name__}: {err} (set TWINCACHE_DEBUG=1 for a traceback)",
              file=sys.stderr)
    finally:
        launch.finish_rank()  # a rank of a --mesh run leaves its torch.distributed world
    return 2


def console_main() -> NoReturn:
    """The `twincache` executable (and `python -m twincache_app.cli`): main(), then exit with its code. Before the
    interpreter's teardown, every object alive is frozen (gc.freeze), so its last garbage collection skips them: a
    command that compiled leaves torch's compiler holding over half a million objects, and walking them took 1.0-1.4 s
    after the output was written (0.2-0.3 s frozen; bench/README.md, "A command's whole time"). Only a process's exit
    does this: main() called in a process that goes on keeps its collector as it was.

    Ctrl-C keeps its one line and exit code 130 to the end: main() gives Python's handling back when it returns, and a
    SIGINT then, during the atexit callbacks, printed a KeyboardInterrupt traceback."""
    code = main()
    interrupts.ExitOnInterrupt().install()  # never restored: the process is ending
    phases.enter("exit")
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    console_main()
