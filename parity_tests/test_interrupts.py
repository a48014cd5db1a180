"""Ctrl-C: `twincache generate` ends with exit 130 and the one line "twincache: interrupted" in every phase (load,
prefill, compile, decode, and the process's exit after its output) in both backends, never with a traceback, never
with exit 0 and the full text, never with a crash (twincache_app/interrupts.py, docs/design.md §6).

Each case is a real process. The phases are hit deterministically through the test hook TWINCACHE_INTERRUPT_AT
(twincache/phases.py: the process sends itself SIGINT as it enters the phase); one more case sends SIGINT from here,
at a time of our choosing, to a JAX fused decode far too long to finish: it must end within seconds (it used to
decode every token first). The processes run concurrently to keep within the time budget.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from parity_tests.conftest import save_hf_checkpoint
from parity_tests.test_cli_bad_inputs import REPO, _entry_point
from twincache import phases
from twincache.phases import ENV, PHASES
from twincache_app import launch

# (backend, mode, phase). torch's decode phase runs eagerly: a compiled one would first spend a whole compile.
PHASE_CASES = [("torch", "compiled", "load"), ("torch", "eager", "prefill"), ("torch", "compiled", "compile"),
               ("torch", "eager", "decode"), ("jax", "fused", "load"), ("jax", "fused", "prefill"),
               ("jax", "fused", "compile"), ("jax", "fused", "decode")]
LONG_DECODE = 400_000  # tokens: minutes of fused decoding on the tiny model


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny checkpoint whose positions reach far enough for a decode that cannot finish during the test."""
    return save_hf_checkpoint(tmp_path_factory.mktemp("long_positions") / "ckpt", seed=3,
                              max_position_embeddings=2 * LONG_DECODE)


@contextlib.contextmanager
def children_start_with_sigint(disposition: object = signal.default_int_handler) -> Iterator[None]:
    """Processes started inside get SIGINT at its default, as a terminal's children do (exec resets a handled signal
    to the default), or ignored with SIG_IGN, as a script's background jobs do; whatever this process has. No
    preexec_fn: forking a multithreaded (JAX) process to run Python in the child risks a deadlock."""
    previous = signal.signal(signal.SIGINT, disposition)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start(backend: str, mode: str, model: Path, new_tokens: int, env: dict[str, str],
          sigint: object = signal.default_int_handler, merged: bool = False) -> subprocess.Popen:
    """`twincache generate` in a process whose SIGINT starts at its default (or ignored, sigint=SIG_IGN); merged:
    stderr goes where stdout goes (`2>&1`, or a terminal)."""
    argv = ["generate", "--backend", backend, "--mode", mode, "--model", str(model), "--prompt-ids", "1,5,9,13",
            "--max-new-tokens", str(new_tokens)]
    with children_start_with_sigint(sigint):
        return subprocess.Popen(_entry_point() + argv, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env}, cwd=REPO)


def assert_interrupted(label: str, returncode: int, stderr: str) -> None:
    assert returncode == 130, f"{label}: exit {returncode}, stderr {stderr!r}"
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, f"{label}: {stderr!r}"
    *notices, last = stderr.splitlines() or [""]
    assert last == "twincache: interrupted", f"{label}: the last stderr line is {last!r}"
    assert all(line.startswith("twincache: ") and "interrupt" not in line for line in notices), \
        f"{label}: more than the one line: {stderr!r}"


def test_the_cases_cover_every_phase_of_both_backends():
    """PHASE_CASES cover every phase a decode enters, in both backends; "exit" has its own test below."""
    for backend in ("torch", "jax"):
        assert {phase for name, _, phase in PHASE_CASES if name == backend} | {"exit"} == set(PHASES), backend
    with pytest.raises(ValueError, match="unknown phase 'decoding'"):
        phases.enter("decoding")


def test_sigint_in_every_phase_exits_130_with_one_line(long_model):
    procs = {case: start(case[0], case[1], long_model, 300, {ENV: case[2]}) for case in PHASE_CASES}
    # A process that started with SIGINT ignored (`nohup`, `cmd &` in a script) keeps ignoring it, as Python does.
    ignoring = start("jax", "fused", long_model, 20, {ENV: "decode"}, sigint=signal.SIG_IGN)
    # stdout and stderr on one pipe, as on a terminal: the line starts at column 0, after the streamed ids ("5 9 ")
    merged = start("torch", "eager", long_model, 300, {ENV: "decode"}, merged=True)
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert_interrupted("/".join(case), proc.returncode, err)
        assert len(out.split()) < 300, f"{'/'.join(case)}: it decoded every token before stopping"
    out, err = ignoring.communicate(timeout=300)
    assert ignoring.returncode == 0 and len(out.split()) == 20, f"an ignored SIGINT ended the run: {err!r}"
    out, _ = merged.communicate(timeout=300)
    text, line, end = out.rpartition("\ntwincache: interrupted\n")
    assert merged.returncode == 130 and line and not end, f"glued to the streamed text: {out!r}"
    assert text.endswith(" ") and all(token.isdigit() for token in text.split()), out


@pytest.mark.parametrize("backend, mode", [("torch", "eager"), ("jax", "step")])
def test_sigint_as_the_process_exits_after_its_output_is_one_line_and_130(long_model, backend, mode):
    """After the command has run and written its output, the `twincache` process ends (atexit callbacks, teardown):
    a SIGINT there (the hook's "exit" phase) ends it with the same one line and code 130, the output kept. main() had
    given Python's handling back by then, and such a SIGINT printed a KeyboardInterrupt traceback."""
    proc = start(backend, mode, long_model, 5, {ENV: "exit"})
    out, err = proc.communicate(timeout=300)
    assert len(out.split()) == 5, f"{backend}/{mode}: the output is not all there: {out!r}"
    # the finished run's summary line stays, as its output does; then the interrupt's one line
    summary = [line for line in err.splitlines() if line.startswith(f"[{backend} ")]
    assert len(summary) == 1 and "tok/s" in summary[0], f"{backend}/{mode}: {err!r}"
    assert_interrupted(f"{backend}/{mode} at exit", proc.returncode, err.replace(summary[0] + "\n", "", 1))


def test_sigint_during_a_long_fused_decode_ends_it_within_seconds(long_model):
    """SIGINT arrives while the main thread waits on XLA for a block of the fused loop; before the loop ran in
    bounded blocks, it decoded all the tokens first (minutes here; 15 s for 2M tokens in the field)."""
    proc = start("jax", "fused", long_model, LONG_DECODE, {})
    try:
        first = proc.stdout.read(1)  # the first block of tokens has been streamed: the loop is running
        assert first, f"no output before the end: {proc.communicate()[1]!r}"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # the hang guard; the token count below shows it did not finish
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_interrupted("jax/fused during decode", proc.returncode, err)
    assert len((first + out).split()) < LONG_DECODE


def test_the_cli_restores_python_interrupt_handling_after_a_command(capsys):
    """In-process callers (these tests) get Python's KeyboardInterrupt back once main() returns."""
    from twincache_app.cli import main

    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts (unless SIGINT is ignored)
    try:
        assert main(["generate", "--backend", "torch", "--mode", "nope"]) == 2
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.set_wakeup_fd(-1) == -1, "the wakeup fd was left installed"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGINT, outer)
    capsys.readouterr()


@pytest.mark.skipif(sys.platform != "linux", reason="signals as on Linux")
def test_interrupt_handler_is_installed_before_the_subcommands_are_imported():
    """The console script's import is small, so the window before Ctrl-C is handled is Python's own start-up."""
    code = "import sys; import twincache_app.cli; print(sorted(m for m in sys.modules if m.startswith(('torch', " \
           "'jax', 'numpy', 'bench', 'tokenizers'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]", out


BLOCKED_IN_C = """
import hashlib, mmap, os, signal, sys, threading, time
from twincache_app.interrupts import exit_on_interrupt

# Read-only anonymous memory reads as zeros and costs no RAM. Size it so hashing takes about two minutes here.
zeros = mmap.mmap(-1, 64 * 2**30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
start = time.perf_counter()
hashlib.sha256(memoryview(zeros)[:2**26]).digest()
size = min(len(zeros), int(2**26 * 120 / (time.perf_counter() - start)))
with exit_on_interrupt():
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    print("hashing", flush=True)
    hashlib.sha256(memoryview(zeros)[:size]).digest()  # one C call, GIL released, no Python signal handler runs
print("finished", flush=True)
"""


def test_sigint_ends_the_process_while_the_main_thread_is_inside_one_long_c_call():
    """As during a long torch op or an XLA compile: the main thread runs no Python signal handler until the call
    returns (here ~2 minutes of hashing), but the watcher thread exits at once."""
    start = time.monotonic()
    with children_start_with_sigint():
        proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO)
    stdout, stderr = proc.communicate(timeout=600)
    elapsed = time.monotonic() - start
    assert stdout == "hashing\n", stdout
    assert_interrupted("inside one C call", proc.returncode, stderr)
    assert elapsed < 30, f"the process took {elapsed:.0f} s: it waited for the C call to return"


LAUNCHER = """
import sys
from twincache_app import interrupts, launch

with interrupts.exit_on_interrupt(), launch.rank_folder() as folder:  # as the CLI runs a --mesh command
    print(folder, flush=True)
    # each rank starts as the CLI's main() does (launch.follow_launcher, then its one-line Ctrl-C), then sleeps
    launch.run_ranks(["-n", "1", "-r", "1", "-s", "from twincache_app import interrupts, launch; "
                      "launch.follow_launcher(); interrupts.ExitOnInterrupt().install()",
                      "import time; time.sleep(120)"], 2, module="timeit")
print("finished", flush=True)
"""


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    try:  # a zombie (dead, not yet reaped by whoever adopted it) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _sigint_ignored(pid: int) -> bool:
    ignored = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn"))
    return bool(int(ignored.split()[1], 16) >> (signal.SIGINT - 1) & 1)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and signals as on Linux")
@pytest.mark.parametrize("how", ["SIGINT to the launcher", "SIGINT to the group", "SIGKILL to the launcher"])
def test_a_mesh_launcher_ended_from_outside_leaves_no_rank_running(how: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    """`kill -INT` (or a timeout's SIGINT) reaches the launcher of a torch --mesh run, not its ranks: its exit 130
    stops them first, or they would wait in a collective for half an hour, and removes the folder they shared (the
    exit skips its `with`). A terminal's Ctrl-C reaches the whole group: the ranks leave it to the launcher, so one
    line is said (each rank said "interrupted" too, rank 0 on the same stderr). A launcher killed outright takes its
    ranks with it (the parent-death signal; they decoded on, rank 0 printing, to the end). The ranks here sleep
    (python -m timeit), after the start every rank of the CLI makes (launch.follow_launcher). The folder of a launcher
    killed outright stays behind (it runs no code): the next launch removes it, and nothing else."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this TMPDIR is the launcher's, and the sweep's here
    with children_start_with_sigint():
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, start_new_session=how == "SIGINT to the group",
                                env={**os.environ, "TMPDIR": str(tmp_path)})
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            ranks = _children(proc.pid)
        assert len(ranks) == 2, f"the launcher did not start its 2 ranks: {ranks}"
        time.sleep(1.0)  # the ranks are running their sleep
        if how == "SIGKILL to the launcher":
            proc.kill()
            deadline = time.monotonic() + 10
            while any(map(_running, ranks)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(map(_running, ranks)), f"{how}: ranks {ranks} ran on without their launcher"
            stdout, _ = proc.communicate(timeout=10)  # its pipes, which no rank holds open any more
            _the_next_launch_removes_only_dead_launchers_folders(Path(stdout.splitlines()[0]), tmp_path)
            return
        if how == "SIGINT to the group":
            # Which of the launcher and rank 0 says "interrupted" first is a race; that only the launcher can is not.
            ignoring = [rank for rank in ranks if _sigint_ignored(rank)]
            assert ignoring == ranks, f"ranks {sorted(set(ranks) - set(ignoring))} would say 'interrupted' too"
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        folder, *rest = stdout.splitlines()
        assert rest == [], f"the launcher went on after the ranks: {rest}"
        assert_interrupted(how, proc.returncode, stderr)
        assert "twincache-ranks-" in folder and not Path(folder).exists(), f"{folder} outlived its run"
        alive = [rank for rank in ranks if _running(rank)]
        assert alive == [], f"ranks {alive} outlived their launcher"
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def _the_next_launch_removes_only_dead_launchers_folders(killed: Path, tmp: Path) -> None:
    """`killed`: the folder of a launcher SIGKILLed in `tmp` (the TMPDIR). A launch here removes it, and leaves a live
    launcher's folder (this process's own, open), folders with no lock file (an older twincache's, another program's
    with our prefix), a link to an unlocked folder, and every other name."""
    assert killed.parent == tmp and (killed / "launcher.lock").is_file(), f"{killed} was not left behind"
    unlocked = tmp / "elsewhere"  # a lock file nobody holds, reached only through a link
    unlocked.mkdir()
    (unlocked / "launcher.lock").touch()
    (tmp / "twincache-ranks-1-link").symlink_to(unlocked)
    kept = [tmp / "twincache-ranks-old", tmp / "other", unlocked, tmp / "twincache-ranks-1-link"]
    for folder in kept[:2]:
        folder.mkdir()
    with launch.rank_folder() as live, launch.rank_folder() as mine:
        assert not killed.exists(), f"{killed} outlived the next launch"
        assert live.exists() and mine.exists() and all(folder.exists() for folder in kept), sorted(tmp.iterdir())
    assert not live.exists() and not mine.exists()


# A rank that kills itself (SIGKILL) at the start, as the OOM killer or a user ends one; rank 0 sleeps on, as a rank
# waits for its peers at the rendezvous (loading) or in a collective.
KILLED_RANK = ["-n", "1", "-r", "1", "-s", "import os, signal; os.environ['RANK'] == '1' and os.kill(os.getpid(), 9)",
               "import time; time.sleep(20)"]


@pytest.mark.skipif(sys.platform != "linux", reason="signals as on Linux")
def test_a_rank_killed_while_rank_0_waits_is_named_and_ends_the_run(monkeypatch: pytest.MonkeyPatch,
                                                                    capfd: pytest.CaptureFixture[str]):
    """The launcher polled its ranks with any(), which stopped at rank 0 (running): a rank killed before the first
    collective went unseen while rank 0 waited for it at the rendezvous (30 minutes). It is seen now, rank 0 is
    stopped after the grace, and one line names the rank and the signal."""
    monkeypatch.setattr(launch, "_GRACE_S", 0.5)
    start = time.monotonic()
    code = launch.run_ranks(KILLED_RANK, 2, module="timeit")
    elapsed = time.monotonic() - start
    assert elapsed < 12, f"the launcher took {elapsed:.0f} s: it waited for rank 0 to end on its own"
    assert code == 2
    assert capfd.readouterr().err.splitlines() == [
        "twincache: error: rank 1 of 2 was killed by SIGKILL (sent by hand, or by the kernel when memory ran out); "
        "the other ranks were stopped"]


@pytest.mark.parametrize(("codes", "stopped", "line", "code"), [
    # rank 1 killed: rank 0 only lost it in a collective (gloo: "Connection closed by peer") and left quietly
    ([launch.PEER_LOST_EXIT, -9], set(), "rank 1 of 2 was killed by SIGKILL", 2),
    # rank 0 killed: rank 1's lost-peer error was named as the failure ("rank 1 failed (exit 2): ... RuntimeError")
    ([-9, launch.PEER_LOST_EXIT], set(), "rank 0 of 2 was killed by SIGKILL", 2),
    ([-15, 2], {0}, "rank 1 of 2 failed (exit 2): mesh ... refused", 2),  # rank 0 stopped by us: rank 1's own line
    ([2, 2], set(), None, 2),  # every rank refused the same input: rank 0 said it
    ([130, launch.PEER_LOST_EXIT], set(), None, 130),  # rank 0 interrupted on its own: it said so
    ([launch.PEER_LOST_EXIT] * 2, set(), "the 2 ranks of this mesh run lost each other", 2),
])
def test_the_launcher_names_the_rank_that_ended_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      codes: list[int], stopped: set[int], line: str | None,
                                                      code: int):
    logs = []
    for r in range(2):
        log = (tmp_path / f"rank{r}").open("w+b")
        log.write(b"twincache: note: something\ntwincache: error: mesh ... refused\n")
        logs.append(log)
    assert launch._outcome(codes, logs, stopped) == code
    err = capsys.readouterr().err
    assert (err.splitlines() == []) if line is None else (err.startswith(f"twincache: error: {line}")
                                                          and len(err.splitlines()) == 1), err
    for log in logs:
        log.close()


def test_a_rank_that_lost_its_peer_leaves_the_line_to_its_launcher(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]):
    """A collective whose peer is gone raises gloo's RuntimeError; the rank printed it as "unexpected RuntimeError:
    [.../pair.cc:553] Connection closed by peer ... GLHF!". Under our launcher it leaves quietly (the launcher names
    the rank that ended); under torchrun it says so in one line."""
    import torch.distributed  # noqa: F401 - peer_lost looks only where torch.distributed runs

    from twincache_app import cli

    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:19340. This is typically caused by a remote worker crashing. GLHF!")

    def collective(_: object) -> int:
        raise gloo

    args = argparse.Namespace(run=collective)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(launch.LAUNCHER_ENV, "1")
    assert cli._run(args) == launch.PEER_LOST_EXIT
    assert capsys.readouterr().err == ""
    monkeypatch.delenv(launch.LAUNCHER_ENV)  # torchrun's rank
    assert cli._run(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        "twincache: error: rank 0 lost another rank of its torch.distributed world in a collective (Connection closed "
        "by peer [127.0.0.1]:19340); that rank's own output says why it ended"]
    monkeypatch.delenv("RANK")  # outside a world the same error is nothing special
    assert "unexpected RuntimeError" in (cli._run(args), capsys.readouterr().err)[1]


# Real texts of a collective whose peer is gone (sources cited at twincache_app.launch._PEER_GONE), and the words the
# one line quotes; None: not a rank gone. NCCL's cannot be produced here (no GPU): the texts are fed as they are built.
PEER_TEXTS = [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
     "[127.0.0.1]:19340. This is typically caused by a remote worker crashing. GLHF!",
     "Connection closed by peer [127.0.0.1]:19340"),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:19340: "
     "Connection reset by peer", "Read error [127.0.0.1]:19340: Connection reset by peer"),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:599] writev [127.0.0.1]:19340: Broken pipe",
     "writev [127.0.0.1]:19340: Broken pipe"),
    ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or there "
     "was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network error or a "
     "remote process exiting prematurely.\nLast error: Unknown NCCL Error\n",
     "remote process exited or there was a network error"),
    ("NCCL error: remote process exited or there was a network error, NCCL version 2.27.5\nncclRemoteError: A call "
     "failed possibly due to a network error or a remote process exiting prematurely.",
     "NCCL error: remote process exited or there was a network error"),
    ("NCCL communicator was aborted on rank 1.  Original reason for failure was: NCCL error: remote process exited or "
     "there was a network error, NCCL version 2.27.5", "NCCL communicator was aborted on rank 1"),
    # this rank's own failures, and a peer that hangs (alive): not a rank gone
    ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, invalid usage (run with "
     "NCCL_DEBUG=WARN for details), NCCL version 2.27.5\nncclInvalidUsage: This usually reflects invalid usage of "
     "NCCL library.", None),
    ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, unhandled cuda error (run with "
     "NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclUnhandledCudaError: Call to CUDA function failed.", None),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
     "for recv operation to complete. This is typically caused by a remote worker hanging or bugs in the "
     "application. Check the logs of the remote worker before reporting an error.", None),
]


@pytest.mark.parametrize(("text", "words"), PEER_TEXTS)
def test_a_lost_peer_is_recognised_in_gloos_and_nccls_own_words(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 text: str, words: str | None):
    """NCCL's texts were untested (no GPU here), and its ncclRemoteError ("remote process exited ...") was not
    recognised; the one line quoted up to the first ". ", which for NCCL's multi-line text printed several lines.
    Under torchrun a rank that lost its peer says so in one line quoting those words; any other error is not taken
    for it (it reaches the CLI's own handling)."""
    import torch.distributed as dist

    assert launch.peer_lost_words(text) == words
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = dist.DistBackendError(text) if text.startswith("NCCL") else RuntimeError(text)
    assert launch.peer_lost(err) == (words is not None)
    if words is not None:
        assert launch.report_peer_lost(err) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"twincache: error: rank 0 lost another rank of its torch.distributed world in a collective ({words}); "
            "that rank's own output says why it ended"]
