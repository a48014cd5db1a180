"""`twincache bench --prefill-memory`: peak memory of a prefill against prompt length, in chunks of `--prefill-chunk`
and in one chunk (the whole prompt at once, as before chunked prefill), for every backend.

Each point runs in a fresh process: load the model, warm up (JAX compiles; first-touch allocations happen: the whole
prompt, whose chunks reach every attention bucket of the cache), reset the kernel's peak-RSS mark
(/proc/self/clear_refs), prefill the whole prompt, and read the peak back (VmHWM). The figure is that peak over the RSS
just before the measured prefill: memory the prefill itself needed, measured, not computed; the process's peak RSS is
recorded beside it. Where the kernel cannot reset the mark, a 5 ms sampler of RSS stands in (`how` says which). A parent
watchdog kills a point whose RSS passes `--memory-limit-gb` and records it as such, so a one-chunk prefill that would
exhaust the machine is a data point, not a crash; longer prompts of that kind are then skipped.

The default model's config allows 4096 positions; the points run on a copy of its config with
max_position_embeddings raised to the longest prompt (weights and tokenizer linked, not copied). RoPE has no scaling
here, so nothing else changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from twincache.checkpoint import load_config

DEFAULT_LENGTHS = (1_000, 3_000, 10_000, 30_000, 100_000)
# The tiny preset's sweep is a quick look (55 s under load on 2 cores; its one-chunk prefill at 4,000 tokens adds
# ~0.5 GB in JAX): short enough that the one-chunk points stay far from the limit, long enough to show them grow.
PRESET_LENGTHS = {"tiny": (1_000, 2_000, 4_000)}
DEFAULT_LIMIT_GB = 6.0
VARIANTS = ("chunked", "one_chunk")


# --- one point, in its own process ---------------------------------------------------------------------------------

def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


class _PeakSinceReset:
    """The process's peak RSS from `reset()` on: the kernel's own mark where it can be reset, else a sampler."""

    def __init__(self) -> None:
        self.how = "sampled"
        self._sampled = 0
        self._stop = threading.Event()

    def reset(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            _vm_hwm_bytes()
            self.how = "kernel VmHWM"
            return
        except OSError:
            pass
        process = psutil.Process()

        def sample() -> None:
            while not self._stop.is_set():
                self._sampled = max(self._sampled, process.memory_info().rss)
                time.sleep(0.005)

        threading.Thread(target=sample, daemon=True).start()

    def peak(self) -> int:
        if self.how == "sampled":
            self._stop.set()
            return max(self._sampled, psutil.Process().memory_info().rss)
        return _vm_hwm_bytes()


def measure_point(backend: str, model_dir: str, length: int, chunk: int) -> dict[str, Any]:
    """Prefill a `length`-token prompt in chunks of `chunk` (one chunk when chunk >= length); peak RSS over it."""
    from twincache_app.backends import BACKENDS

    entry = BACKENDS[backend]
    tower = entry.module()
    model = tower.load(model_dir, "float32")
    config = load_config(model_dir)
    prompt = [3 + (7 * i) % (config.vocab_size - 3) for i in range(length)]
    cache = "sliding_window" if config.sliding_window is not None else "static"

    def prefill(tokens: list[int]) -> float:
        start = time.perf_counter()
        tower.generate(model, [tokens], 1, mode=entry.default_mode, cache=cache, max_cache_len=length + 1,
                       prefill_chunk=chunk)
        return time.perf_counter() - start

    loaded_rss = psutil.Process().memory_info().rss
    # JAX compiles here, and both frameworks touch their allocations for the first time. The whole prompt, chunked
    # too: every chunk has one shape, but a chunk of a static cache reads the attention bucket of the prefix before
    # it (twincache.buckets), and each bucket is one more JAX compile, which must not land in the measured prefill.
    prefill(prompt)
    peak = _PeakSinceReset()
    before = psutil.Process().memory_info().rss
    peak.reset()
    seconds = prefill(prompt)
    top = peak.peak()
    return {"backend": backend, "prompt_len": length, "chunk": min(chunk, length), "cache": cache,
            "status": "ok", "loaded_rss_mb": loaded_rss / 2**20, "rss_before_mb": before / 2**20,
            "peak_rss_mb": top / 2**20, "prefill_peak_mb": (top - before) / 2**20, "how": peak.how,
            "prefill_s": seconds}


# --- the sweep, in the parent ----------------------------------------------------------------------------------------

def long_position_model(model_dir: Path, longest: int, work: Path) -> Path:
    """`model_dir` with max_position_embeddings raised to `longest` + 1 when it is lower (files linked, config
    rewritten); the directory itself when it already allows that many positions."""
    raw = json.loads((model_dir / "config.json").read_text())
    if raw.get("max_position_embeddings", 0) > longest:
        return model_dir
    derived = work / f"{model_dir.name}-positions-{longest + 1}"
    derived.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "config.json" and not (derived / item.name).exists():
            (derived / item.name).symlink_to(item.resolve())
    (derived / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": longest + 1}, indent=1))
    return derived


def run_point(backend: str, model_dir: Path, length: int, chunk: int, limit_bytes: int,
              timeout_s: float = 1800) -> dict[str, Any]:
    """One point in a fresh process, killed by the watchdog past `limit_bytes` of RSS."""
    spec = json.dumps({"backend": backend, "model_dir": str(model_dir), "length": length, "chunk": chunk})
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    # As a context manager, Popen closes the pipes and reaps the process on every way out, a killed point's too.
    with subprocess.Popen([sys.executable, "-m", "bench.prefill_memory", spec], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as proc:
        process, highest, start = psutil.Process(proc.pid), 0, time.monotonic()
        try:
            while proc.poll() is None:
                try:
                    highest = max(highest, process.memory_info().rss)
                except psutil.NoSuchProcess:
                    break
                if highest > limit_bytes or time.monotonic() - start > timeout_s:
                    why = "memory" if highest > limit_bytes else "time"
                    return {"backend": backend, "prompt_len": length, "chunk": min(chunk, length),
                            "status": f"killed ({why})", "peak_rss_mb": highest / 2**20,
                            "note": f"killed at {highest / 2**30:.2f} GB RSS (limit {limit_bytes / 2**30:.1f} GB)"
                                    if why == "memory" else f"killed after {timeout_s:.0f} s"}
                time.sleep(0.02)
            out, err = proc.communicate()
        finally:  # a point over its limit, or the sweep interrupted: the point's process must not outlive it
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        return {"backend": backend, "prompt_len": length, "chunk": min(chunk, length), "status": "error",
                "note": (err.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(out.strip().splitlines()[-1])


def sweep(backends: list[str], model_dir: Path, lengths: list[int], chunk: int, limit_gb: float, out: Path,
          progress: bool = True) -> list[dict[str, Any]]:
    """Every backend x length x variant (chunked, one chunk); writes out/prefill_memory.{json,md,png}."""
    out.mkdir(parents=True, exist_ok=True)
    model = long_position_model(model_dir, max(lengths), out / "model")
    records: list[dict[str, Any]] = []
    try:
        for backend in backends:
            for variant in VARIANTS:
                exceeded = None
                for length in sorted(lengths):
                    point_chunk = chunk if variant == "chunked" else length
                    if exceeded is not None:
                        record = {"backend": backend, "prompt_len": length, "chunk": point_chunk,
                                  "status": "skipped", "note": f"the {exceeded}-token prompt already passed the limit"}
                    else:
                        record = run_point(backend, model, length, point_chunk, int(limit_gb * 2**30))
                        if record["status"] == "killed (memory)":
                            exceeded = length
                    record["variant"] = variant
                    records.append(record)
                    if progress:
                        print(f"bench prefill-memory: {backend} {variant} {length} tokens: {_cell(record)}",
                              file=sys.stderr, flush=True)
                    _write(out, records, model_dir, chunk, limit_gb)
    except KeyboardInterrupt:  # Ctrl-C: the points measured stay, and the table says the rest were never run
        _write(out, records, model_dir, chunk, limit_gb, planned=len(backends) * len(VARIANTS) * len(set(lengths)))
        raise
    _plot(out, records, chunk, model_dir)
    return records


def _cell(record: dict[str, Any]) -> str:
    if record["status"] == "ok":
        return f"{record['prefill_peak_mb']:.0f} MB ({record['prefill_s']:.1f} s)"
    return f"{record['status']}: {record.get('note', '')}"


def _write(out: Path, records: list[dict[str, Any]], model_dir: Path, chunk: int, limit_gb: float,
           planned: int | None = None) -> None:
    """prefill_memory.json and .md from the points so far; `planned`: the sweep was interrupted, of that many."""
    (out / "prefill_memory.json").write_text(json.dumps(records, indent=1))
    lengths = sorted({r["prompt_len"] for r in records})
    rows = sorted({(r["backend"], r["variant"]) for r in records})
    lines = [f"Peak RSS a prefill adds over the loaded model (MB), model {model_dir}, float32, one new token; "
             f"chunked = chunks of {chunk} tokens, one chunk = the whole prompt at once; watchdog limit "
             f"{limit_gb:.1f} GB.", "",
             "| backend | prefill | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
             "|---|---|" + "---:|" * len(lengths)]
    for backend, variant in rows:
        cells = []
        for n in lengths:
            key = (backend, variant, n)
            record = next((r for r in records if (r["backend"], r["variant"], r["prompt_len"]) == key), None)
            cells.append("" if record is None else f"{record['prefill_peak_mb']:.0f}" if record["status"] == "ok"
                         else f"> {limit_gb:.0f} GB (killed)" if record["status"].startswith("killed (memory")
                         else "out of memory" if "out of memory" in record.get("note", "").lower()
                         else record["status"])
        lines.append(f"| {backend} | {variant.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines += ["", "The process's peak RSS during the measured prefill (MB), the loaded model included:", "",
              "| backend | prefill | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
              "|---|---|" + "---:|" * len(lengths)]
    for backend, variant in rows:
        found = {r["prompt_len"]: r for r in records if (r["backend"], r["variant"]) == (backend, variant)}
        lines.append(f"| {backend} | {variant.replace('_', ' ')} | " + " | ".join(
            f"{found[n]['peak_rss_mb']:.0f}" if n in found and found[n]["status"] == "ok" else "" for n in lengths)
            + " |")
    notes = [f"- {r['backend']}, {r['variant'].replace('_', ' ')}, {r['prompt_len']:,} tokens: {r['status']}: "
             f"{r['note']}" for r in records if r["status"] != "ok" and r.get("note")]
    lines += ["", *notes] if notes else []
    if planned is not None:
        lines += ["", f"**Interrupted** after {len(records)} of {planned} points: the others (lengths, variants or "
                      "backends the tables lack) were never run."]
    (out / "prefill_memory.md").write_text("\n".join(lines) + "\n")


def _plot(out: Path, records: list[dict[str, Any]], chunk: int, model_dir: Path) -> None:
    """The process's peak RSS (the loaded model included: an increase of a few MB over it is not readable on a log
    scale, and allocators reuse what the warm-up freed) against prompt length; x where the watchdog killed a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (backend, variant), color in zip(sorted({(r["backend"], r["variant"]) for r in records}),
                                         ("C0", "C1", "C2", "C3", "C4", "C5")):
        ok = sorted((r["prompt_len"], r["peak_rss_mb"]) for r in records
                    if (r["backend"], r["variant"]) == (backend, variant) and r["status"] == "ok")
        killed = [r for r in records if (r["backend"], r["variant"]) == (backend, variant)
                  and r["status"].startswith("killed (memory")]
        style = "-" if variant == "chunked" else "--"
        label = f"{backend}, {'chunks of ' + str(chunk) if variant == 'chunked' else 'one chunk'}"
        if ok:
            ax.plot(*zip(*ok), style, marker="o", color=color, label=label)
        for r in killed:
            ax.plot(r["prompt_len"], r["peak_rss_mb"], "x", color=color, markersize=10,
                    label=f"{label}: killed at the limit" if r is killed[0] else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("process peak RSS during the prefill (MB)")
    ax.set_title(f"Prefill peak memory vs prompt length ({Path(model_dir).name})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "prefill_memory.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # one point: python -m bench.prefill_memory '{"backend": ..., "length": ...}'
    point = json.loads(sys.argv[1])
    print(json.dumps(measure_point(point["backend"], point["model_dir"], point["length"], point["chunk"])))
