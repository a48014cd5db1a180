"""Memory-bandwidth probes: how fast each framework can stream an array larger than the last-level cache.

A sum reads every byte once; a gemv (matrix [N, 4096] times a vector) reads the matrix once, the way a decode step
reads its weights. On CPU the sums run twice: over malloc's memory, and (`*_sum_huge`) over memory advised to be
backed by 2 MiB pages, where torch_cache and jax_cache keep their weights (twincache.hugepages): the machine's reach
is the better of the two. Each probe reports its best time over several runs (the hardware's reach, not the average
neighbour's noise) and its median. The bench takes the max over all probes as the machine's limit, so
roofline_frac is measured against the fastest streaming any framework achieved in this run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from twincache.hugepages import host_buffer

_GEMV_COLS = 4096


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    fn()  # warm-up: first touch, and for JAX the compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def _record(name: str, nbytes: int, best_s: float, median_s: float) -> dict[str, Any]:
    return {"probe": name, "bytes": nbytes, "best_gbps": nbytes / best_s / 1e9, "median_gbps": nbytes / median_s / 1e9}


def torch_probes(nbytes: int, device: str, repeats: int = 10) -> list[dict[str, Any]]:
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # [N]
    w = x.view(-1, _GEMV_COLS)  # [N / 4096, 4096]: the same bytes read as a matrix
    v = torch.ones(_GEMV_COLS, dtype=torch.float32, device=device)  # [4096]
    out = []
    cases: list[tuple[str, Callable[[], Any]]] = [("torch_sum", lambda: x.sum()),
                                                  ("torch_gemv", lambda: torch.mv(w, v))]
    if device == "cpu":
        huge = torch.from_numpy(host_buffer(nbytes // 4 * 4)).view(torch.float32).fill_(1.0)  # [N]
        cases.append(("torch_sum_huge", lambda: huge.sum()))
    for name, fn in cases:
        def run(fn: Callable[[], Any] = fn) -> None:
            fn()
            sync()
        out.append(_record(name, x.numel() * 4, *_time(run, repeats)))
    return out


def jax_probes(nbytes: int, device: str, repeats: int = 10) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    platform = "gpu" if device.startswith("cuda") else "cpu"
    with jax.default_device(jax.devices(platform)[0]):
        x = jnp.ones(nbytes // 4, dtype=jnp.float32)  # [N]
        w = x.reshape(-1, _GEMV_COLS)  # [N / 4096, 4096]
        v = jnp.ones((1, _GEMV_COLS), dtype=jnp.float32)  # [1, 4096]
        total = jax.jit(jnp.sum)
        # einsum contracts the weight's last axis directly; `v @ w.T` runs 26x slower on XLA-CPU (docs/design.md §7.1).
        gemv = jax.jit(lambda w, v: jnp.einsum("bd,od->bo", v, w, precision="highest"))
        out = [_record("jax_sum", x.size * 4, *_time(lambda: total(x).block_until_ready(), repeats)),
               _record("jax_gemv", w.size * 4, *_time(lambda: gemv(w, v).block_until_ready(), repeats))]
        if platform == "cpu":
            host = host_buffer(nbytes // 4 * 4).view(np.float32)  # [N]
            host[...] = 1.0
            huge = jax.device_put(host)  # shared, not copied (jax_cache.model reads its weights the same way)
            out.append(_record("jax_sum_huge", huge.size * 4, *_time(lambda: total(huge).block_until_ready(),
                                                                      repeats)))
    return out


def run_probes(nbytes: int, device: str, with_jax: bool, repeats: int = 10) -> list[dict[str, Any]]:
    """Every available probe; a framework that fails to probe is reported with its error instead."""
    probes = torch_probes(nbytes, device, repeats)
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # hand the probe's gigabytes back before the models load
    if with_jax:
        try:
            probes += jax_probes(nbytes, device, repeats)
        except Exception as err:  # noqa: BLE001 - jax missing or without this device: report, keep benchmarking
            probes.append({"probe": "jax", "error": f"{type(err).__name__}: {err}"})
    return probes


def bandwidth_limit(probes: list[dict[str, Any]]) -> float:
    """The machine's streaming limit in GB/s: the best any probe achieved."""
    return max(p["best_gbps"] for p in probes if "best_gbps" in p)
