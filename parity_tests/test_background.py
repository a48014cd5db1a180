"""The suite's background lane (parity_tests/background.py): a job runs once, in the lane at a lower CPU priority
that the processes it starts inherit, or in the foreground when the lane has not reached it; its error reaches every
test that collects it. Jobs made here run on a lane of their own, beside the session's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity_tests import background

NICENESS = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"


def registered(run: Callable[[], object], prepared: list[str], name: str = "prepare") -> background.Prepare:
    def prepare(request: pytest.FixtureRequest) -> Callable[[], object]:
        prepared.append(threading.current_thread().name)
        return run

    prepare.__module__, prepare.__name__ = __name__, name  # the job's fixture is named when it registers
    background.job(prepare)
    return prepare


def child_niceness() -> tuple[str, int]:
    """The thread this ran in, and the nice value of a process it started."""
    proc = subprocess.run([sys.executable, "-c", NICENESS], capture_output=True, text=True, check=True)
    return threading.current_thread().name, int(proc.stdout)


def item(path: Path, *names: str) -> SimpleNamespace:
    """A stand-in for a collected test of module `path` whose fixture closure holds `names`."""
    return SimpleNamespace(path=path, fixturenames=["request", *names])


def assert_summarised(entry: background._Job, where: str) -> None:
    """The session's report has the job's line: where it ran, and its time (a process start: more than 0 s)."""
    assert entry.ran_in == where and entry.seconds > 0, (entry.ran_in, entry.seconds)
    line = f"test_background::prepare: {entry.seconds:.0f} s in the {where}, the foreground waited"
    assert any(summary.startswith(line) for summary in background.summary()), background.summary()


@pytest.mark.skipif(sys.platform != "linux", reason="the lane lowers its priority per thread on Linux only")
def test_a_job_runs_once_in_the_lane_and_the_processes_it_starts_run_at_its_lower_priority(request):
    prepared: list[str] = []
    runs: list[int] = []

    def run() -> tuple[str, int]:
        runs.append(1)
        return child_niceness()

    prepare = registered(run, prepared)
    entry = background._jobs[prepare]
    try:
        entry.run, entry.state = prepare(request), "queued"  # as `start` prepares it, in the main thread
        lane = threading.Thread(target=background._lane_loop, args=([entry],), name="a test lane")
        lane.start()
        lane.join(timeout=60)
        thread, niceness = background.collect(request, prepare)
        lane = min(os.getpriority(os.PRIO_PROCESS, 0) + background.LANE_NICENESS, 19)  # the session may run niced
        assert (thread, niceness) == ("a test lane", lane)
        assert background.collect(request, prepare) == (thread, niceness) and len(runs) == 1
        assert prepared == [threading.current_thread().name]
        assert_summarised(entry, "lane")
    finally:
        del background._jobs[prepare]


def test_a_job_the_lane_has_not_reached_runs_in_the_foreground_at_full_priority(request):
    prepared: list[str] = []
    prepare = registered(child_niceness, prepared)
    try:
        thread, niceness = background.collect(request, prepare)
        assert thread == threading.current_thread().name and niceness == os.getpriority(os.PRIO_PROCESS, 0)
        assert prepared == [thread]
        assert_summarised(background._jobs[prepare], "foreground")
    finally:
        del background._jobs[prepare]


def test_a_failed_run_raises_in_every_test_that_collects_it(request):
    def run() -> None:
        raise AssertionError("the bench exited 1")

    prepare = registered(run, [])
    try:
        for _ in range(2):
            with pytest.raises(AssertionError, match="the bench exited 1"):
                background.collect(request, prepare)
    finally:
        del background._jobs[prepare]


def test_the_lane_takes_only_the_jobs_a_selected_test_of_their_module_asks_for_in_the_order_asked(request):
    """`pytest -k` on one test of a module must not build and run that module's jobs: the mesh job's preparing
    alone (the trained model) held one selected test 72 s. A fixture's name asked for in another module is another
    fixture."""
    first, second = registered(lambda: None, []), registered(lambda: None, [], name="prepare_too")
    here, elsewhere = Path(__file__), Path(__file__).with_name("test_mesh.py")

    try:
        jobs = background._jobs
        assert background.needed([item(here), item(here, "tmp_path")]) == []
        assert background.needed([item(elsewhere, "prepare", "prepare_too")]) == []
        asking = [item(here), item(here, "prepare_too"), item(here, "prepare"), item(here, "prepare_too")]
        assert background.needed(asking) == [jobs[second], jobs[first]]
    finally:
        del background._jobs[first], background._jobs[second]


def test_the_session_lane_holds_the_jobs_its_selected_tests_ask_for_in_the_order_of_their_first_tests(request):
    asked_at: dict[background.Prepare, int] = {}
    for index, item in enumerate(request.session.items):
        for prepare, entry in background._jobs.items():
            if entry.module_file == Path(str(item.path)).resolve() and prepare.__name__ in item.fixturenames:
                asked_at.setdefault(prepare, index)
    assert background._queued == [background._jobs[prepare] for prepare in sorted(asked_at, key=asked_at.get)]


def test_a_job_that_ran_but_was_never_collected_says_so_instead_of_a_wait(request):
    """The session's end stops a job no test has collected yet (an interrupted session): its line must not read
    as a finished job that nobody waited for."""
    prepare = registered(lambda: None, [])
    entry = background._jobs[prepare]
    try:
        entry.run, entry.state = prepare(request), "running"  # as the lane runs it
        background._run(entry, None, "lane")
        assert any(line.startswith("test_background::prepare:") and "never collected" in line
                   for line in background.summary()), background.summary()
        background.collect(request, prepare)
        assert_summarised(entry, "lane")
    finally:
        del background._jobs[prepare]


def test_the_modules_whose_jobs_are_asked_for_run_after_all_the_others(request):
    """Else a module collecting a job early stands waiting for the lane (bench and mesh runs: ~40 s of the session)."""
    asked = {entry.module_file for entry in background._queued}
    selected = [Path(str(item.path)).resolve() in asked for item in request.session.items]
    assert selected == sorted(selected), "a module without a job asked for runs after one with a job"


def test_a_module_whose_jobs_no_selected_test_asks_for_keeps_its_place(request):
    prepare = registered(lambda: None, [])
    here, elsewhere = Path(__file__), Path(__file__).with_name("test_mesh.py")

    try:
        not_asking = [item(here), item(elsewhere), item(here, "tmp_path")]
        kept = list(not_asking)
        background.lane_modules_last(kept)
        assert kept == not_asking
        asking = [item(here), item(elsewhere), item(here, "prepare")]
        background.lane_modules_last(asking)
        assert [entry.path for entry in asking] == [elsewhere, here, here]
    finally:
        del background._jobs[prepare]


def test_tests_deselected_by_k_ask_for_no_job_so_their_module_keeps_its_place():
    """The reordering runs after `-k` has deselected: a test_mesh test that is not selected asks for no mesh run. The
    module after it is one that imports neither torch nor JAX (the collection's process takes ~2 s, not ~6 s)."""
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(here / "test_mesh.py"), str(here / "test_parity_metrics.py"), "-k",
                           "parse_mesh or identical_logits"],
                          capture_output=True, text=True, cwd=here.parent, timeout=120)
    modules = [line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line]
    assert {"parity_tests/test_mesh.py", "parity_tests/test_parity_metrics.py"} <= set(modules), \
        proc.stdout + proc.stderr
    in_given_order = sorted(modules, key=["parity_tests/test_mesh.py", "parity_tests/test_parity_metrics.py"].index)
    assert modules == in_given_order, "test_mesh moved after test_parity_metrics for jobs only deselected tests ask for"
