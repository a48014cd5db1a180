"""Devices for `--mesh` (docs/design.md §10): the processes torch needs, and the CPU devices JAX can simulate.

torch splits a model over processes, one per device. `twincache ... --backend torch --mesh model=N[,data=M]` starts
them itself: `run_ranks` re-runs the same command in N*M processes (ranks) with the torch.distributed environment
set, waits for them and returns rank 0's exit code; only rank 0 prints. A command that already runs inside a
torch.distributed world (ours, or torchrun's on many hosts) is a rank and runs directly (`in_world`).

JAX splits a model over the devices of one process. On a CPU it sees one device unless XLA is told to simulate more
before it starts (`simulate_cpu_devices`); on GPU hosts that flag is ignored and JAX uses the GPUs.

The two are capped differently on a CPU (`check_torch_devices`): a torch rank is a whole process (its own
interpreter, torch, weights and OpenMP threads), so at most one per core; JAX's simulated devices are one process's,
sharing its one thread pool, so their count is limited only by what the model can split (the suite runs 8 of them on
2 cores).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from twincache import exit_cleanup
from twincache.xla_flags import add_xla_flag

if TYPE_CHECKING:  # twincache.mesh imports numpy: the CLI imports this module before it handles Ctrl-C
    from twincache.mesh import MeshShape

# A rank that waits this long on another (which failed) is stopped; a compile on a busy CPU can take minutes.
_GRACE_S = 10.0
_COLLECTIVE_TIMEOUT_S = 1800
LAUNCHER_ENV = "TWINCACHE_MESH_LAUNCHER"  # the launcher's pid, in the environment of the ranks it starts
PEER_LOST_EXIT = 3  # a rank's exit code when a collective failed because another rank was gone
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def in_world() -> bool:
    """Whether this process is one rank of a torch.distributed world (launched by us or by torchrun)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank (0 outside a world: a RANK without WORLD_SIZE, left from another job, is none)."""
    return int(os.environ["RANK"]) if in_world() else 0


def cpu_cores() -> int:
    """The cores torch's CPU ranks share: each rank's OpenMP threads are its share of them, and there are at most as
    many ranks as cores."""
    try:  # the cores this process may run on (taskset, a container's cpuset), not all the host's
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity call on this platform (macOS)
        return os.cpu_count() or 1


def simulate_cpu_devices(mesh: MeshShape) -> None:
    """Let JAX on a CPU show as many devices as `mesh` needs (XLA_FLAGS, read once when JAX starts its backend;
    GPU backends ignore it). An XLA_FLAGS that already sets a device count is left as it is. Not capped by the cores,
    unlike torch's ranks: the simulated devices live in this one process and share its thread pool."""
    add_xla_flag("xla_force_host_platform_device_count", mesh.devices)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_FOLDER_PREFIX = "twincache-ranks-"  # + the launcher's pid + a random tail (tempfile.mkdtemp)
_FOLDER_LOCK = "launcher.lock"  # flock-ed by the launcher for the folder's life; the kernel unlocks it at its death


@contextlib.contextmanager
def rank_folder() -> Iterator[Path]:
    """A private folder for what the ranks of one run share (a prompt read from stdin, the bench's records), removed
    when the run ends, by Ctrl-C's exit too (which skips the `with` block's own cleanup). A launcher killed outright
    (SIGKILL, out of memory) removes nothing: the next launch removes such folders (`_remove_orphaned_folders`)."""
    _remove_orphaned_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-"))
    lock = _hold_lock(folder)

    def remove() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    try:
        with exit_cleanup.on_abrupt_exit(remove):
            yield folder
    finally:
        remove()
        if lock is not None:
            os.close(lock)  # after the removal: until then a sweep sees a live owner


def _hold_lock(folder: Path) -> int | None:
    """Lock FOLDER/launcher.lock while this process holds the fd (not inherited: the ranks do not hold it). It is locked
    under another name, then renamed: a sweep never sees the lock file unlocked while this process lives. None where
    the platform or file system has no flock: the folder is then never swept."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    path = folder / f".{_FOLDER_LOCK}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.rename(path, folder / _FOLDER_LOCK)
    return fd


def _remove_orphaned_folders() -> None:
    """Remove the rank folders (rank_folder's, in this TMPDIR, of this user) whose launcher is dead: one whose lock
    this process can take has no live holder. Anything else is left alone: another name, a link, another user's, no
    lock file (an older twincache's folder, or a platform without flock), a lock held (a live launcher's)."""
    try:
        import fcntl
    except ImportError:
        return
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            if not entry.name.startswith(_FOLDER_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            try:
                fd = os.open(os.path.join(entry.path, _FOLDER_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:  # no lock file (or a link): not ours to judge
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its launcher is alive
                os.close(fd)
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            os.close(fd)


def run_ranks(argv: Sequence[str], world_size: int, module: str = "twincache_app.cli") -> int:
    """Run `python -m <module> <argv>` (the twincache command by default) in `world_size` processes on this host,
    ranks 0..world_size-1; returns rank 0's exit code, or 2 when another rank's end stopped the run (that rank is
    named in one line on stderr). Only rank 0 prints to stdout; the others' stderr is shown only when one of them
    fails."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), LAUNCHER_ENV: str(os.getpid())}
    # Ranks on a CPU share its cores: more OpenMP threads than cores spin-wait each other (docs/design.md §7.11), so
    # each rank gets its share, as torchrun does, unless OMP_NUM_THREADS is set.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // world_size)))
    logs = [tempfile.TemporaryFile() for _ in range(world_size)]
    procs = [subprocess.Popen([sys.executable, "-m", module, *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=None if r == 0 else subprocess.DEVNULL, stderr=None if r == 0 else logs[r])
             for r in range(world_size)]
    def stop_all() -> None:
        _stop(procs)

    try:
        # Ctrl-C: the CLI's interrupt exit (twincache_app.interrupts) stops the ranks first (a SIGINT sent to the
        # launcher alone would leave them waiting in a collective); a KeyboardInterrupt
        # (where that exit is not installed) does the same here. Either way none is left behind.
        with exit_cleanup.on_abrupt_exit(stop_all):
            return _wait(procs, logs)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    finally:
        for log in logs:
            log.close()


def _wait(procs: list[subprocess.Popen], logs: list) -> int:
    failed_at, stopped = None, set()
    # Every rank is polled each round (a list, not any()'s generator, which stopped at the first one still running):
    # a rank that dies before the first collective (loading) is seen while rank 0 waits for it at the rendezvous.
    while None in [proc.poll() for proc in procs]:
        if failed_at is None and any(proc.returncode not in (None, 0) for proc in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            stopped = _stop(procs)  # the others wait in a collective for a rank that is gone
            break
        time.sleep(0.05)
    return _outcome([proc.returncode for proc in procs], logs, stopped)


def _outcome(codes: list[int], logs: list, stopped: set[int]) -> int:
    """The run's exit code, and one line on stderr naming the rank that ended it when rank 0 has not said why. A
    rank's end that others only lost (PEER_LOST_EXIT) or that this launcher caused (`stopped`) is never the cause."""
    world = len(codes)
    if all(code == 0 for code in codes):
        return 0
    for r, code in enumerate(codes):  # killed from outside (by hand; SIGKILL also by the kernel, out of memory)
        if code < 0 and r not in stopped:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            hint = " (sent by hand, or by the kernel when memory ran out)" if -code == signal.SIGKILL else ""
            print(f"twincache: error: rank {r} of {world} was killed by {name}{hint}; the other ranks were stopped",
                  file=sys.stderr)
            return 2
    if codes[0] not in (0, PEER_LOST_EXIT) and 0 not in stopped:
        return codes[0]  # rank 0 ran to its end: it printed its result, or its one-line error
    for r, code in enumerate(codes[1:], 1):  # another rank failed on its own: its last line says why
        if code not in (0, PEER_LOST_EXIT) and r not in stopped:
            logs[r].seek(0)
            lines = logs[r].read().decode(errors="replace").strip().splitlines()
            said = lines[-1].removeprefix("twincache: ").removeprefix("error: ") if lines else "no message"
            print(f"twincache: error: rank {r} of {world} failed (exit {code}): {said}", file=sys.stderr)
            return code if code > 0 else 2
    print(f"twincache: error: the {world} ranks of this mesh run lost each other in a collective, and none said why "
          f"(exit codes {codes})", file=sys.stderr)
    return 2


def _stop(procs: list[subprocess.Popen]) -> set[int]:
    """Stop every rank still running; returns which ranks it stopped."""
    stopped = {r for r, proc in enumerate(procs) if proc.poll() is None}
    for r in stopped:
        procs[r].terminate()
    for r in stopped:
        try:
            procs[r].wait(timeout=10)
        except subprocess.TimeoutExpired:
            procs[r].kill()
    return stopped


def follow_launcher() -> None:
    """In a rank that run_ranks started, before anything else: leave Ctrl-C to the launcher (a terminal's SIGINT
    reaches the whole foreground group, and each rank said "interrupted" too; the launcher's exit stops the ranks),
    and end with the launcher (Linux's parent-death signal), so that a launcher killed outright (SIGKILL, or the
    SIGTERM of `timeout` or a job scheduler) leaves no rank running on."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or not in_world():
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != int(launcher):  # it was gone before the call above: nothing would send the signal
            os._exit(PEER_LOST_EXIT)


# The words of a collective's error, in gloo and NCCL, when another rank's process is gone. Taken from the sources:
# - gloo, gloo/transport/tcp/pair.cc (its strings are in torch/lib/libtorch_cpu.so: "Connection closed by peer ",
#   "Read error ", "writev "): "[pair.cc:N] Connection closed by peer [ADDR]:PORT" (EOF; torch 2.13 adds ". This is
#   typically caused by a remote worker crashing. GLHF!"), "Read error [ADDR]:PORT: <strerror>", "writev [ADDR]:PORT:
#   <strerror>" with strerror ECONNRESET "Connection reset by peer" or EPIPE "Broken pipe". Its timeout's "remote
#   worker hanging" is not a rank gone.
# - NCCL, torch/include/torch/csrc/distributed/c10d/NCCLUtils.hpp (C10D_NCCL_CHECK): "NCCL error in: FILE:LINE,
#   <ncclGetErrorString>, NCCL version V\n<detail>"; the texts are in torch/csrc/distributed/c10d/NCCLUtils.cpp, not
#   in the CPU wheel: ncclRemoteError's "remote process exited or there was a network error" (NCCL's own string, also
#   after ProcessGroupNCCL's "NCCL error: "), and an aborted communicator's "NCCL communicator was aborted on rank R.
#   Original reason for failure was: ...". ncclSystemError (NCCL < 2.13 reported a dead peer so) is any system call's
#   failure: not taken for a rank gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
              "remote process exited or there was a network error", "NCCL communicator was aborted")


def peer_lost_words(text: str) -> str | None:
    """The clause of a collective's error text that says another rank is gone, on one line, to quote ("Connection
    closed by peer [127.0.0.1]:19340", "remote process exited or there was a network error"); None when it says
    nothing of the kind."""
    for line in text.splitlines():
        for sentence in line.split("] ", 1)[-1].split(". "):  # after gloo's "[file:line] "
            for clause in sentence.split(", "):  # NCCL's "NCCL error in: FILE:LINE, <what>, NCCL version V"
                if any(words in clause for words in _PEER_GONE):
                    return clause.strip().removesuffix(".")
    return None


def peer_lost(err: BaseException) -> bool:
    """Whether `err`, in a rank, is a collective failing because another rank of the world is gone."""
    if not in_world() or "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return isinstance(err, dist.DistNetworkError) or (
        isinstance(err, RuntimeError) and peer_lost_words(str(err)) is not None)


def report_peer_lost(err: BaseException) -> int:
    """A rank's exit when another rank is gone: under run_ranks, quietly with PEER_LOST_EXIT (the launcher knows
    which rank ended and how, and says it in one line); under torchrun, one line of its own."""
    if os.environ.get(LAUNCHER_ENV) is None:
        said = peer_lost_words(str(err)) or str(err).strip().split("\n")[0]  # a DistNetworkError's own first line
        print(f"twincache: error: rank {rank()} lost another rank of its torch.distributed world in a collective "
              f"({said}); that rank's own output says why it ended", file=sys.stderr)
        return 2
    return PEER_LOST_EXIT


def check_world(mesh: MeshShape) -> None:
    """Refuse, before joining, a torch.distributed environment this mesh cannot run in: RANK and WORLD_SIZE set (so
    this command is taken for a rank, as under torchrun) without MASTER_ADDR and MASTER_PORT (torch said "unexpected
    ValueError ... environment variable MASTER_ADDR expected"), or a world of another size than the mesh (rank 0
    waited at the rendezvous for ranks that never come)."""
    from twincache.errors import MeshError

    world = os.environ.get("WORLD_SIZE", "")
    given = f"RANK={os.environ.get('RANK')} WORLD_SIZE={world}"
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise MeshError(f"{given} in the environment make this command one rank of a torch.distributed world (as "
                        f"torchrun starts them), but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                        "not set; unset RANK and WORLD_SIZE (left from another job?) to let twincache start its own "
                        "ranks, or run it under torchrun")
    if not world.isdigit() or int(world) != mesh.devices:
        raise MeshError(f"mesh {mesh} needs {mesh.devices} ranks, but {given} in the environment; start "
                        f"{mesh.devices} ranks (torchrun --nproc-per-node), or unset RANK and WORLD_SIZE to let "
                        "twincache start its own")


def init_rank() -> None:
    """Join the torch.distributed world this process is a rank of (gloo on CPU, NCCL on GPUs, each rank on the GPU of
    its local rank). Ranks other than 0 print nothing to stdout."""
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
    if rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def check_torch_devices(mesh: MeshShape) -> None:
    """Refuse, before any process starts, a mesh with more ranks than this host runs: more than its GPUs on a GPU
    host; more than its cores on a CPU. CPU ranks share the cores (and the memory: a CPU mesh splits nothing the host
    does not hold anyway); past one rank per core the ranks (one thread each, at least) take turns on the cores and
    every collective waits for the last of them, while each costs its own interpreter and torch (~300 MB). Ranks
    started by torchrun are not checked."""
    import torch

    from twincache.mesh import check_devices

    if torch.cuda.is_available():
        check_devices(mesh, torch.cuda.device_count(), f"torch sees {torch.cuda.device_count()} GPU(s) on this host "
                      "(for more hosts, run the command under torchrun on each)")
    else:
        check_devices(mesh, cpu_cores(), f"torch on a CPU runs one process per device, at most one per core, and this "
                      f"host has no GPU and {cpu_cores()} CPU core(s) (to oversubscribe them anyway, start the ranks "
                      "under torchrun)")


def finish_rank() -> None:
    """Leave the torch.distributed world cleanly (nothing to do when this process never joined one)."""
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["LAUNCHER_ENV", "PEER_LOST_EXIT", "in_world", "rank", "cpu_cores", "simulate_cpu_devices", "run_ranks",
           "follow_launcher", "peer_lost_words", "peer_lost", "report_peer_lost", "check_world", "init_rank",
           "check_torch_devices", "finish_rank"]
