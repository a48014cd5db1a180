"""Bytes a decode step must read, peak memory, and the machine description stored with every record."""

from __future__ import annotations

import datetime
import os
import platform
import threading
import time
from typing import Any

import psutil

from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig


def weight_bytes_per_step(config: MistralConfig, dtype_bytes: int, batch: int) -> int:
    """Weight bytes one decode step streams: every matrix and norm once, but only `batch` rows of the embedding
    table (a lookup, not a stream) unless it is tied to the LM head, which reads it whole."""
    total = 0
    for name, shape in expected_tensor_shapes(config).items():
        count = 1
        for dim in shape:
            count *= dim
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            count = batch * config.hidden_size
        total += count
    return total * dtype_bytes


def kv_bytes_per_step(config: MistralConfig, dtype_bytes: int, batch: int, slots_read: float) -> float:
    """K and V bytes one decode step reads over `slots_read` cache slots in every layer."""
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    return batch * slots_read * per_slot


def live_slots(config: MistralConfig, cache: str, context: float) -> float:
    """Keys a decode step at `context` tokens must read: all of them, or at most W in a sliding cache (a window
    sees W keys, whatever the cache). Not the allocation: reading a static cache's empty slots is overhead."""
    if cache == "sliding_window" and config.sliding_window is not None:
        return min(config.sliding_window, context)
    return context


def bytes_per_step(config: MistralConfig, dtype_bytes: int, batch: int, cache: str, context: float) -> int:
    """Bytes a decode step at `context` tokens must read: its weights and the K/V of its live keys."""
    return (weight_bytes_per_step(config, dtype_bytes, batch)
            + round(kv_bytes_per_step(config, dtype_bytes, batch, live_slots(config, cache, context))))


def gbps(bytes_per_step: int, steps_per_s: float) -> float:
    """Effective streaming rate of a decode: the bytes a step must read, times steps per second, in GB/s."""
    return bytes_per_step * steps_per_s / 1e9


def param_count(config: MistralConfig) -> int:
    total = 0
    for shape in expected_tensor_shapes(config).values():
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


class PeakRSS:
    """Samples this process's RSS from a thread while active; `peak_mb` is the highest seen (on CPU)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self._process = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_bytes = 0

    def cpu_seconds(self) -> float:
        """User + system CPU time of this process so far, all threads."""
        times = self._process.cpu_times()
        return times.user + times.system

    def sample(self) -> int:
        rss = self._process.memory_info().rss
        self.peak_bytes = max(self.peak_bytes, rss)
        return rss

    def __enter__(self) -> PeakRSS:
        self.sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20


OTHERS_MIN_WALL_S = 0.5  # shorter intervals read CPU seconds too coarsely: 0.04 s of ticks in 0.05 s is 0.8 cores


class OthersCPU:
    """CPU seconds per wall second that the rest of the machine used since this object was made: the machine's busy
    time over all cores, less this process's own and its reaped children's. The 1-minute load average lags a minute
    behind and counts this run itself; this covers exactly the interval measured. Hypervisor steal (the host giving
    this VM's cores to another) is kept apart: it slows a run too, but no process here causes it."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._start = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        """(monotonic s, machine busy CPU s, machine steal CPU s, own CPU s)."""
        machine = psutil.cpu_times()
        busy = machine.user + machine.nice + machine.system + getattr(machine, "irq", 0.0) + getattr(
            machine, "softirq", 0.0)  # Linux counts guest time inside user
        own = self._process.cpu_times()
        own_s = own.user + own.system + getattr(own, "children_user", 0.0) + getattr(own, "children_system", 0.0)
        return time.monotonic(), busy, getattr(machine, "steal", 0.0), own_s

    def per_wall(self) -> dict[str, float | None]:
        """{"others_cpu_per_wall": ..., "steal_per_wall": ...} since construction (None for both when too short)."""
        return others_per_wall(self._start, self._read())


def others_per_wall(start: tuple[float, float, float, float],
                    end: tuple[float, float, float, float]) -> dict[str, float | None]:
    """What OthersCPU reports, from two readings: (machine busy - own) and steal, per wall second; None for an
    interval too short for the clock tick (10 ms a reading, ~0.04 s in a difference of four) to resolve."""
    wall = end[0] - start[0]
    if wall < OTHERS_MIN_WALL_S:
        return {"others_cpu_per_wall": None, "steal_per_wall": None}
    others = (end[1] - start[1]) - (end[3] - start[3])
    return {"others_cpu_per_wall": max(0.0, others) / wall,  # clock-tick rounding can leave it a hair below 0
            "steal_per_wall": max(0.0, end[2] - start[2]) / wall}


def device_peak_mb(device: str, framework: str) -> float | None:
    """Peak device memory on GPU: torch's max_memory_allocated (reset per cell) or JAX's peak_bytes_in_use."""
    if not device.startswith("cuda"):
        return None
    if framework == "jax":
        import jax

        stats = jax.devices("gpu")[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use", 0) / 2**20
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def reset_device_peak(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: record that as None
        return None


def _git_commit() -> str | None:
    """The source tree's commit (with "+dirty" when it has local changes), to tie results to code."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine_description(device: str) -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, memory, GPU, library versions, and the load from other processes."""
    import torch

    desc: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "jax": _version("jax"),
        "loadavg_start": list(os.getloadavg()),
        "git_commit": _git_commit(),
        "started_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
    }
    return desc
