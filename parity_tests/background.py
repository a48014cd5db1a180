"""Module fixtures whose work is only processes to start and wait for, run in one background thread ("the lane")
from the session's first test, so their processes use the core that the in-process tests leave idle.

Most in-process tests run on one core; on a 2-core machine the other one idled while they ran, and then the session
stood still while a fixture's processes ran (bench runs, fresh-cache inductor probes, the mesh workers: ~7 minutes of
the suite's wall time). A fixture opts in by splitting itself in two:

    @background.job
    def bench_results(request: pytest.FixtureRequest) -> Callable[[], Result]:
        ...  # here, in the main thread: fixtures, checkpoints, directories, the environment, copied from os.environ
        def run() -> Result:
            ...  # in the lane: start processes, wait, read their files; nothing of this process's torch/JAX state
        return run

`job` makes it a module fixture of the same name whose value is the run's `Result`; tests and fixtures ask for it by
that name. The session runs the modules whose jobs its selected tests ask for after all the others
(`lane_modules_last`), so the lane has done most of its work when their tests collect it. At the session's first test,
`start` prepares, in the order of the first test that asks for each, the jobs that a selected test asks for (directly or
through its fixtures: `pytest -k` on one test of a module starts none of that module's jobs it does not need), and the
lane runs them one after another at a lower CPU priority (a thread's nice value on Linux, which the processes it starts
inherit), so they never slow the tests in the foreground much. `collect` waits for a job the lane has started; one it
has not reached yet runs at once in the foreground, at full priority, as does a job of a module run on its own. A run
that fails raises in `collect`, with its traceback, in the test that needed it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

Prepare = Callable[[pytest.FixtureRequest], Callable[[], Any]]
LANE_NICENESS = 10


@dataclass
class _Job:
    prepare: Prepare
    module_file: Path
    run: Callable[[], Any] | None = None
    state: str = "registered"  # -> "queued" (prepared for the lane) -> "running" -> "done"
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    ran_in: str = ""  # "lane" or "foreground"
    collected: bool = False  # a test has had its result (else the session ended while it ran)
    seconds: float = 0.0  # its run, start to end
    waited: float = 0.0  # how long the foreground stood waiting for it in `collect`


_jobs: dict[Prepare, _Job] = {}
_lock = threading.Lock()
_lane: threading.Thread | None = None
_queued: list[_Job] = []  # what the session's lane was given, in order
_stopping = threading.Event()


def job(prepare: Prepare) -> Any:
    """Register a module fixture's background work (see the module docstring); returns the module fixture, named as
    `prepare`, whose value is the work's result."""
    module = sys.modules[prepare.__module__]
    _jobs[prepare] = _Job(prepare, Path(module.__file__).resolve())

    def result(request: pytest.FixtureRequest) -> Any:
        return collect(request, prepare)

    result.__doc__ = prepare.__doc__
    return pytest.fixture(scope="module", name=prepare.__name__)(result)


def collect(request: pytest.FixtureRequest, prepare: Prepare) -> Any:
    """The job's result: the lane's, once it has finished, or computed here when the lane has not started it."""
    entry = _jobs[prepare]
    with _lock:
        run_here = entry.state in ("registered", "queued")
        if run_here:
            needs_prepare = entry.state == "registered"
            entry.state = "running"
    if run_here:
        _run(entry, request if needs_prepare else None, "foreground")
    waiting_since = time.monotonic()
    entry.done.wait()
    entry.waited += time.monotonic() - waiting_since
    entry.collected = True
    if entry.error is not None:
        raise entry.error
    return entry.result


def lane_modules_last(items: list[pytest.Item]) -> None:
    """Reorder the selected tests in place: the modules whose jobs they ask for after all the others, each group in
    its own order. The lane needs about as long for its jobs as the foreground for its in-process tests, so a module
    that collects a job early stands waiting on it (the bench and mesh runs: ~40 s of the session); last, it finds it
    done. A module whose jobs no selected test asks for keeps its place: nothing of it waits on the lane."""
    asked = {entry.module_file for entry in needed(items)}
    items.sort(key=lambda item: Path(str(item.path)).resolve() in asked)  # stable: each group keeps its order


def needed(items: list[pytest.Item]) -> list[_Job]:
    """The jobs that the selected tests ask for, directly or through their fixtures (`item.fixturenames` is the
    closure), each asked for by a test of its own module, in the order of the first test that asks."""
    asked: dict[Prepare, _Job] = {}  # insertion order: the order of each job's first asking test
    for item in items:
        path, names = Path(str(item.path)).resolve(), set(getattr(item, "fixturenames", ()))
        for entry in _jobs.values():
            if entry.module_file == path and entry.prepare.__name__ in names:
                asked.setdefault(entry.prepare, entry)
    return list(asked.values())


def start(request: pytest.FixtureRequest) -> None:
    """Prepare, in order, the jobs that this session's selected tests ask for, then start the lane on them."""
    global _lane
    queued = needed(request.session.items)
    _queued[:] = queued
    for entry in queued:
        try:
            entry.run = entry.prepare(request)
        except BaseException as error:  # noqa: BLE001 - raised again in the test that collects it
            entry.error, entry.state = error, "done"
            entry.done.set()
            continue
        entry.state = "queued"
    if any(entry.state == "queued" for entry in queued):
        _lane = threading.Thread(target=_lane_loop, args=(queued,), name="test-background-lane", daemon=True)
        _lane.start()


def stop() -> None:
    """End of the session: start nothing more; a run still going (the session was interrupted) has its processes
    stopped, so none outlives the session."""
    _stopping.set()
    if _lane is None or not _lane.is_alive():
        return
    with _lock:
        busy = any(entry.state == "running" and not entry.done.is_set() for entry in _jobs.values())
    if busy:
        _terminate_descendants()
    _lane.join(timeout=60)


def _lane_loop(queued: list[_Job]) -> None:
    if sys.platform == "linux":  # per thread on Linux; elsewhere it would lower the whole test process
        try:
            # relative to the session's own: a suite started under `nice` keeps its lane below its tests too
            lane = min(os.getpriority(os.PRIO_PROCESS, 0) + LANE_NICENESS, 19)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), lane)
        except OSError:
            pass
    for entry in queued:
        if _stopping.is_set():
            return
        with _lock:
            if entry.state != "queued":
                continue  # collected in the foreground first
            entry.state = "running"
        _run(entry, None, "lane")


def _run(entry: _Job, request: pytest.FixtureRequest | None, where: str) -> None:
    entry.ran_in = where
    started = time.monotonic()
    try:
        if request is not None:
            entry.run = entry.prepare(request)
        entry.result = entry.run()
    except BaseException as error:  # noqa: BLE001 - raised again in the test that collects it
        entry.error = error
    finally:
        entry.seconds = time.monotonic() - started
        entry.done.set()


def summary() -> list[str]:
    """One line per job the session ran: where, for how long, and how long the foreground waited for it (the
    end of the session's terminal report; what to look at when the suite grows slow)."""
    return [f"{entry.module_file.stem}::{entry.prepare.__name__}: {entry.seconds:.0f} s in the {entry.ran_in}, "
            + (f"the foreground waited {entry.waited:.0f} s" if entry.collected
               else "never collected (the session ended while it ran, or the tests that ask for it did not run)")
            for entry in _jobs.values() if entry.ran_in]


def _terminate_descendants() -> None:
    """SIGTERM to every process below this one (read from /proc; Linux only)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    below, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    for pid in below:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
