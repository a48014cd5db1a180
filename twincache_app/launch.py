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


def in_world() -> bool:
    """Whether this process is one rank of a torch.distributed world (launched by us or by torchrun)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank (0 outside a world)."""
    return int(os.environ.get("RANK", "0"))


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


@contextlib.contextmanager
def rank_folder() -> Iterator[Path]:
    """A private folder for what the ranks of one run share (a prompt read from stdin), removed when the run ends,
    by Ctrl-C's exit too (which skips the `with` block's own cleanup)."""
    with tempfile.TemporaryDirectory(prefix="twincache-ranks-") as folder:
        with exit_cleanup.on_abrupt_exit(lambda: shutil.rmtree(folder, ignore_errors=True)):
            yield Path(folder)


def run_ranks(argv: Sequence[str], world_size: int, module: str = "twincache_app.cli") -> int:
    """Run `python -m <module> <argv>` (the twincache command by default) in `world_size` processes on this host,
    ranks 0..world_size-1; returns rank 0's exit code (or a failed rank's, when rank 0 had to be stopped because that
    rank was gone). Only rank 0 prints to stdout; the others' stderr is shown only when one of them fails."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
    # Ranks on a CPU share its cores: more OpenMP threads than cores spin-wait each other (docs/design.md §7.11), so
    # each rank gets its share, as torchrun does, unless OMP_NUM_THREADS is set.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // world_size)))
    logs = [tempfile.TemporaryFile() for _ in range(world_size)]
    procs = [subprocess.Popen([sys.executable, "-m", module, *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=None if r == 0 else subprocess.DEVNULL, stderr=None if r == 0 else logs[r])
             for r in range(world_size)]
    try:
        # Ctrl-C: the CLI's interrupt exit (twincache_app.interrupts) stops the ranks first (a SIGINT sent to the
        # launcher alone would leave them waiting in a collective); a KeyboardInterrupt
        # (where that exit is not installed) does the same here. Either way none is left behind.
        with exit_cleanup.on_abrupt_exit(lambda: _stop(procs)):
            return _wait(procs, logs)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    finally:
        for log in logs:
            log.close()


def _wait(procs: list[subprocess.Popen], logs: list) -> int:
    failed_at = None
    while any(proc.poll() is None for proc in procs):
        if failed_at is None and any(proc.returncode not in (None, 0) for proc in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            _stop(procs)  # the others wait in a collective for a rank that is gone
            break
        time.sleep(0.05)
    code = procs[0].returncode
    others_failed = [r for r, proc in enumerate(procs[1:], 1) if proc.returncode not in (0, -signal.SIGTERM)]
    if code >= 2 or (code >= 0 and not others_failed):
        return code  # rank 0 ran to its end: it printed its result, or its one-line error
    for r in others_failed:  # rank 0 was stopped (or succeeded) while another rank failed: say why, in one line
        logs[r].seek(0)
        lines = logs[r].read().decode(errors="replace").strip().splitlines()
        print(f"twincache: rank {r} failed (exit {procs[r].returncode}): {lines[-1] if lines else 'no message'}",
              file=sys.stderr)
        return procs[r].returncode if procs[r].returncode > 0 else 2
    print(f"twincache: rank 0 ended by signal {-code}", file=sys.stderr)
    return 2


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


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


__all__ = ["in_world", "rank", "cpu_cores", "simulate_cpu_devices", "run_ranks", "init_rank", "check_torch_devices",
           "finish_rank"]
