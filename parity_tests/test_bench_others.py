"""The bench's measure of other processes' CPU (bench.metrics.OthersCPU) and the shared-machine warning built on it:
it must count a competing process, never this process's own work, and judge a run by what happened during it, not
by the lagging 1-minute load average."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from bench import report
from bench.metrics import OthersCPU, others_per_wall


def test_others_are_the_machine_busy_time_less_this_processs_own():
    # (monotonic s, machine busy s, machine steal s, own s): 3 busy CPU-seconds in 2 s, 2 of them this process's.
    measured = others_per_wall((100.0, 10.0, 1.0, 5.0), (102.0, 13.0, 1.5, 7.0))
    assert measured == {"others_cpu_per_wall": 0.5, "steal_per_wall": 0.25}
    # This process alone: nothing is left for others, even when tick rounding makes own exceed the machine's delta.
    assert others_per_wall((0.0, 10.0, 0.0, 5.0), (1.0, 10.98, 0.0, 6.0))["others_cpu_per_wall"] == 0.0
    # Too short for 10 ms clock ticks: a number there would be rounding, up to ~1 core of it.
    assert others_per_wall((1.0, 0.0, 0.0, 0.0), (1.4, 0.04, 0.0, 0.0)) == {"others_cpu_per_wall": None,
                                                                          "steal_per_wall": None}


def test_a_competing_process_is_counted_while_it_runs():
    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
    with subprocess.Popen([sys.executable, "-c", spin]) as child:
        time.sleep(0.3)  # past the interpreter's start-up
        others = OthersCPU()
        time.sleep(1.0)  # this process idles: the busy core is the child's
        measured = others.per_wall()  # before the child is reaped, so its time is not yet this process's
        child.wait()
    assert measured["others_cpu_per_wall"] is not None and measured["others_cpu_per_wall"] >= 0.6, measured


def _machine_busy_s() -> float:
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + times.irq + times.softirq


def test_this_processs_own_work_is_not_counted_as_others():
    busy_before, own_before, wall_before = _machine_busy_s(), time.process_time(), time.monotonic()
    others = OthersCPU()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # one core busy, in this process
        pass
    measured = others.per_wall()["others_cpu_per_wall"]
    wall = time.monotonic() - wall_before
    busy, own = (_machine_busy_s() - busy_before) / wall, (time.process_time() - own_before) / wall
    assert own > 0.3, own  # the spin ran, whatever else the machine did
    # What is left for others is the machine's busy time less this process's spin (ticks: 10 ms a reading).
    assert abs(measured - max(0.0, busy - own)) < 0.1, (measured, busy, own)


def _records(run_wide: float | None, timed: list[float | None], loadavg: float = 0.1) -> list[dict]:
    machine = {"device": "cpu", "cpu_cores": 2, "loadavg_start": [loadavg, 0, 0], "loadavg_end": [loadavg, 0, 0]}
    if run_wide is not None:
        machine["others_cpu_per_wall"] = run_wide
    return [{"kind": "decode", "impl": f"impl{i}", "cache": "static", "batch": 1, "status": "ok", "machine": machine,
             **({} if value is None else {"others_cpu_per_wall": value})} for i, value in enumerate(timed)]


def test_the_shared_machine_warning_follows_what_others_used_during_the_run():
    # A load average still high from work that ended before the run (or counting the run itself) is no warning.
    assert report.shared_machine_warning(_records(0.03, [0.02, 0.05], loadavg=4.6)) == []
    over_the_run = report.shared_machine_warning(_records(0.40, [0.1, 0.2]))
    assert over_the_run and "0.40 of 2 cores" in over_the_run[0], over_the_run
    one_cell = report.shared_machine_warning(_records(0.10, [0.05, 0.9]))
    assert one_cell and "up to 0.90" in one_cell[0] and "impl1 / static" in one_cell[0], one_cell
    # A run recorded before others were measured: the load average is all there is.
    legacy = report.shared_machine_warning(_records(None, [None], loadavg=3.0))
    assert legacy and "load average up to 3.0 on 2 cores" in legacy[0]
    assert report.shared_machine_warning(_records(None, [None], loadavg=1.0)) == []


def test_values_that_are_not_numbers_count_as_unmeasured():
    """A results.json edited by hand (or by another tool) must not crash results.md or --compare."""
    lying = _records(None, [None], loadavg=0.1)
    lying[0]["machine"].update(others_cpu_per_wall="lots", loadavg_start="high", loadavg_end=[float("nan")])
    lying[0]["others_cpu_per_wall"] = [0.9]
    assert report.shared_machine_warning(lying) == []
    lying[0]["machine"]["loadavg_end"] = [3.0]  # the load average still speaks where it is a number
    assert "load average up to 3.0" in report.shared_machine_warning(lying)[0]
