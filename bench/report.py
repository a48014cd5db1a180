"""results.md and the PNG plots, from the records in results.json."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

PLOTS = {"latency": "latency_vs_context.png", "impls": "tok_s_by_impl.png", "batch": "tok_s_vs_batch.png"}
_CACHE_STYLE = {"static": "-", "sliding_window": "--"}


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# Other processes' CPU per wall second above which a run's timings are called disturbed: a quarter of a core on
# average over the whole run, or half a core during any one timed run (a quiet machine measures ~0.01-0.05).
SHARED_RUN_CORES = 0.25
SHARED_TIMED_CORES = 0.5


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _loads(value: Any) -> str:
    """os.getloadavg()'s 1, 5 and 15-minute figures as results.json keeps them, in two decimals."""
    if isinstance(value, list) and value and all(_finite(v) for v in value):
        return "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
    return str(value)


def shared_machine(records: list[dict[str, Any]]) -> str | None:
    """What says other processes competed for the CPU during a CPU run, or None: the CPU they used while it ran
    (OthersCPU); a run recorded before that was measured falls back to its load average."""
    machine = records[0].get("machine") if records else None
    if not isinstance(machine, dict) or machine.get("device") != "cpu":  # a hand-edited run may lack its machine
        return None
    cores: Any = machine.get("cpu_cores")
    # Only numbers count: a record edited by hand or written by another tool may hold anything there.
    timed = [(r["others_cpu_per_wall"], r) for r in records if _finite(r.get("others_cpu_per_wall"))]
    run_wide = machine.get("others_cpu_per_wall") if _finite(machine.get("others_cpu_per_wall")) else None
    if run_wide is None and not timed:
        loads = [load[0] for load in (machine.get("loadavg_start"), machine.get("loadavg_end"))
                 if isinstance(load, list) and load and _finite(load[0])]
        busy = max(loads, default=0.0)
        return f"load average up to {busy:.1f} on {cores} cores" if busy > (cores if _finite(cores) else 0.0) else None
    worst, worst_record = max(timed, key=lambda item: item[0], default=(None, None))
    if not ((run_wide or 0.0) > SHARED_RUN_CORES or (worst or 0.0) > SHARED_TIMED_CORES):
        return None
    where = (f", up to {worst:.2f} during one timed run ({worst_record.get('kind')} {worst_record.get('impl')} / "
             f"{worst_record.get('cache')}, batch {worst_record.get('batch')})" if worst is not None and worst_record
             else "")
    return f"other processes used {_fmt(run_wide, 2)} of {cores} cores on average over the run{where}"


def shared_machine_warning(records: list[dict[str, Any]]) -> list[str]:
    """results.md's paragraph on a shared machine, or nothing."""
    found = shared_machine(records)
    if found is None:
        return []
    return [f"**Shared machine:** {found}, so timings are noisy: rerun alone. The CPU/wall column gives the CPU each "
            "cell's process got (2.0 = both cores of two), the others column the rest of the machine's.", ""]


def _ok(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind and r["status"] == "ok"]


def markdown(records: list[dict[str, Any]]) -> str:
    machine = records[0]["machine"] if records else {}
    preset = records[0]["preset"] if records else "?"
    limit = records[0].get("limit_gbps") if records else None
    model = records[0].get("model") if records else None  # a run on --model: the preset's workload, not its weights
    lines = [f"# twincache bench: preset `{preset}`" + (f" on `{model}`" if model else ""), ""]
    load = f"load average {_loads(machine.get('loadavg_start'))} at start"
    if machine.get("interrupted_after_s") is not None:  # Ctrl-C or a broken pipe: no end probe, load or elapsed
        ended = (f"**interrupted after {machine['interrupted_after_s']} s**: below is what it measured by then "
                 "(an `untimed` cell was stopped before its timed rounds; cells, points and phases it never reached "
                 "are absent)")
    else:
        load += f", {_loads(machine.get('loadavg_end'))} at end"
        ended = f"{machine.get('elapsed_s')} s in all"
    lines += [f"Machine: {machine.get('cpu')}, {machine.get('cpu_cores')} cores ({machine.get('torch_threads')} torch "
              f"threads), {machine.get('memory_gb')} GB, device `{machine.get('device')}`"
              + (f" ({machine['gpu']})" if machine.get("gpu") else "")
              + f"; torch {machine.get('torch')}, transformers {machine.get('transformers')}, "
              f"jax {machine.get('jax')}; commit {machine.get('git_commit')}; "
              f"started {machine.get('started_utc')} UTC; {load}; {ended}.", ""]
    lines += shared_machine_warning(records)

    probes = _ok(records, "bandwidth_probe")
    typical = max((p["median_gbps"] for p in probes if p.get("median_gbps")), default=None)
    lines += ["## Bandwidth limit", "",
              f"Limit = the best streaming read any probe achieved in this run: **{_fmt(limit)} GB/s**; roofline "
              f"fractions are against it. The highest median of any probe was {_fmt(typical)} GB/s: a large gap "
              "between the two means the probes were bimodal or disturbed.", "",
              "| probe | when | best GB/s | median GB/s |", "|---|---|---:|---:|"]
    lines += [f"| {p['impl']} | {p.get('when')} | {_fmt(p.get('best_gbps'))} | {_fmt(p.get('median_gbps'))} |"
              for p in probes]
    lines += [f"| {r['impl']} | {r.get('when')} | {r['status']} | |" for r in records
              if r["kind"] == "bandwidth_probe" and r["status"] != "ok"]

    decode = [r for r in records if r["kind"] == "decode"]
    lines += ["", "## Decode, batch 1", ""]
    ok = [r for r in decode if r["status"] == "ok"]
    if ok:
        r0 = ok[0]
        # a run cut short mid-round leaves some cells a run fewer than others: say so, not the first cell's count
        counts = sorted({r.get("repeats") for r in ok}, key=lambda n: (n is None, n or 0))
        runs = (f"{counts[0]} interleaved runs" if len(counts) == 1
                else f"{counts[0]}–{counts[-1]} interleaved runs per cell, the run cut short")
        lines += [f"Prompt {r0['prompt_len']} tokens, {r0['new_tokens']} new; tok/s = decode steps per second after "
                  f"the first step (median over {runs}, [min–max]), warm-up excluded. "
                  "GB/s = (weights + K/V a step must read) x steps/s; roofline = GB/s / limit; roofline (round) = "
                  "median over the runs of each run's GB/s / the best probe of its own round, the fraction of the "
                  "bandwidth available at the time (a shared machine's drifts). compile s = compile "
                  "time the framework reports during the warm-up (dynamo's timer; jax.monitoring). "
                  "x tf = ratio to `transformers` (forward compiled, the seed's setup), x tf-eager = ratio to "
                  "`transformers_eager`, same cache column. CPU/wall = this process's CPU seconds per wall "
                  "second (2.0 = both cores of two); others = the rest of the machine's, during the cell's worst "
                  "timed run (~0 alone).", ""]
    lines += ["| impl | cache | tok/s [min–max] | ms/tok | x tf | x tf-eager | GB/s | roofline | roofline (round) | "
              "prefill s | compile s | compiles (warm-up / timed) | CPU/wall | others | peak MB |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    eager_ref = {r["cache"]: r["decode_tok_s"] for r in ok if r["impl"] == "transformers_eager"}
    for r in decode:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['cache']} | {r['status']}: {r.get('note', '')} ||||||||||||")
            continue
        ratio_eager = r["decode_tok_s"] / eager_ref[r["cache"]] if r["cache"] in eager_ref else None
        ratio = r.get("ratio_to_transformers")
        if r.get("reference_impl") != "transformers":
            ratio = None
        frac = f"{100 * r['roofline_frac']:.0f}%" if r.get("roofline_frac") is not None else "–"
        frac_round = f"{100 * r['roofline_frac_round']:.0f}%" if r.get("roofline_frac_round") is not None else "–"
        lines.append(
            f"| {r['impl']} | {r['cache']} | {_fmt(r['decode_tok_s'])} [{_fmt(r['decode_tok_s_min'])}–"
            f"{_fmt(r['decode_tok_s_max'])}] | {_fmt(r.get('ms_per_token'), 2)} | {_fmt(ratio, 2)} | "
            f"{_fmt(ratio_eager, 2)} | {_fmt(r.get('gbps'))} | {frac} | {frac_round} | {_fmt(r.get('prefill_s'), 3)} | "
            f"{_fmt(r.get('compile_s'))} | {_fmt(r.get('compiles'))} / {_fmt(r.get('recompiles'))} | "
            f"{_fmt(r.get('cpu_per_wall'), 2)} | {_fmt(r.get('others_cpu_per_wall'), 2)} | "
            f"{_fmt(r.get('peak_mem_mb'), 0)} |")
    if ok:
        per_cache = {r["cache"]: r for r in ok}
        lines += ["", "Bytes a decode step must read: " + "; ".join(
            f"{cache} {r['bytes_per_step'] / 1e6:.1f} MB (roofline {_fmt(r.get('roofline_tok_s'))} tok/s)"
            for cache, r in per_cache.items()) + "."]

    lines += _curve_section(records) + _batch_section(records) + _unmeasured_points(records)
    notes = {(r["impl"], r["cache"]): r.get("note") for r in ok}
    if notes:
        lines += ["", "## What each cell measures", ""]
        lines += [f"- `{impl}` / `{cache}`: {note}" for (impl, cache), note in notes.items() if note]
    names = figures(records)
    if names:
        lines += ["", "Figures: " + ", ".join(f"`{name}`" for name in names)]
    lines += [""]
    return "\n".join(lines)


# Which records each plot draws: a plot none of them feeds (--no-curves, --no-batch, every cell failed) is not drawn.
_PLOT_KINDS = {"latency": "latency_vs_context", "impls": "decode", "batch": "batch"}


def figures(records: list[dict[str, Any]]) -> list[str]:
    """The PNGs this run's records draw: those with at least one measured point."""
    return [name for key, name in PLOTS.items() if _ok(records, _PLOT_KINDS[key])]


def _unmeasured_points(records: list[dict[str, Any]]) -> list[str]:
    """Curve and batch points not measured (skipped at a deadline, failed), counted with why: a section or a column
    missing for them read as one never asked for."""
    lines = []
    for kind, label in (("latency_vs_context", "latency vs context"), ("batch", "tok/s vs batch")):
        missed = Counter(f"{r['status']} ({r.get('note') or 'no note'})" for r in records
                         if r["kind"] == kind and r["status"] != "ok")
        lines += [f"- {label}: {count} point{'s' * (count > 1)} {why}" for why, count in missed.items()]
    return ["", "Points not measured:", "", *lines] if lines else []


def _curve_section(records: list[dict[str, Any]]) -> list[str]:
    points = _ok(records, "latency_vs_context")
    if not points:
        return []
    window = records[0].get("sliding_window")
    contexts = sorted({p["context"] for p in points})
    series: dict[tuple[str, str], dict[int, float]] = {}
    for p in points:
        series.setdefault((p["impl"], p["cache"]), {})[p["context"]] = p["ms_per_token"]
    lines = ["", "## Per-token decode latency (ms) vs context", "",
             "Static cache sized for the longest context; sliding = a W-slot ring. Each point: prefill to the context, "
             "then timed steps (median)." + (f" W = {window}." if window else ""), "",
             "| impl | cache | " + " | ".join(str(c) for c in contexts) + " | last / first past W | first / last |",
             "|---|---|" + "---:|" * (len(contexts) + 2)]
    for (impl, cache), by_context in series.items():
        past_window = [c for c in contexts if window and c >= window and c in by_context]
        flat = by_context[past_window[-1]] / by_context[past_window[0]] if len(past_window) > 1 else None
        measured = [c for c in contexts if c in by_context]
        # The shortest context's per-token time over the longest's: ~1 when every step reads the whole cache.
        follows = by_context[measured[0]] / by_context[measured[-1]] if len(measured) > 1 else None
        lines.append(f"| {impl} | {cache} | " + " | ".join(_fmt(by_context.get(c), 2) for c in contexts)
                     + f" | {_fmt(flat, 2)} | {_fmt(follows, 2)} |")
    return lines


def _batch_section(records: list[dict[str, Any]]) -> list[str]:
    points = _ok(records, "batch")
    if not points:
        return []
    sizes = sorted({p["batch"] for p in points})
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for p in points:
        table.setdefault(p["impl"], {})[p["batch"]] = p
    counts = sorted({timed_runs(p, unrecorded=1) for p in points})
    runs = (f"{counts[0]} interleaved run{'s' * (counts[0] != 1)}" if len(counts) == 1
            else f"{counts[0]}–{counts[-1]} interleaved runs per point, the run cut short")
    lines = ["", "## Total decode tok/s vs batch (static cache)", "",
             f"Prompt {points[0]['prompt_len']}, {points[0]['new_tokens']} new tokens per row; one warm-up per point, "
             f"then total tok/s = batch x decode steps per second, median over {runs} [min–max] (each round visits "
             "every point); roofline fraction of the median in parentheses.", "",
             "| impl | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for impl, by_batch in table.items():
        cells = []
        for b in sizes:
            point = by_batch.get(b)
            if point is None:
                cells.append("–")
                continue
            frac = f" ({100 * point['roofline_frac']:.0f}%)" if point.get("roofline_frac") is not None else ""
            low, high = (point.get(f"total_tok_s_{end}", point["total_tok_s"]) for end in ("min", "max"))
            cells.append(f"{_fmt(point['total_tok_s'])} [{_fmt(low)}–{_fmt(high)}]{frac}")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    return lines


def timed_runs(record: dict[str, Any], unrecorded: int) -> int:
    """How many timed runs a decode cell's or batch point's min-max spans: its tok/s per run, else the run's repeats,
    else `unrecorded` (a decode cell: 2, a hand-written record taken at its word; a batch point: 1, as every run before
    the batch table was repeated timed it once)."""
    runs, repeats = record.get("tok_s_runs"), record.get("repeats")
    if isinstance(runs, list):
        return len(runs)
    return repeats if isinstance(repeats, int) and not isinstance(repeats, bool) else unrecorded


def plot_latency(records: list[dict[str, Any]], path: Path) -> None:
    points = _ok(records, "latency_vs_context")
    fig, ax = plt.subplots(figsize=(10, 5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for p in points:
        series.setdefault((p["impl"], p["cache"]), []).append((p["context"], p["ms_per_token"]))
    colors = _impl_colors({impl for impl, _ in series})
    for (impl, cache), xy in sorted(series.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], _CACHE_STYLE.get(cache, "-"), marker="o", markersize=3,
                color=colors[impl], label=f"{impl} / {cache}")
    window = records[0].get("sliding_window") if records else None
    if window:
        ax.axvline(window, color="grey", linewidth=0.8, linestyle=":", label=f"W = {window}")
    ax.set(xlabel="context length (tokens)", ylabel="ms per decode step (median)",
           title="Per-token decode latency vs context (solid: static, dashed: sliding)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path)


def plot_impls(records: list[dict[str, Any]], path: Path) -> None:
    rows = _ok(records, "decode")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(impls) + 3), 5))
    width = 0.8 / max(1, len(caches))
    for j, cache in enumerate(caches):
        for i, impl in enumerate(impls):
            r = next((r for r in rows if r["impl"] == impl and r["cache"] == cache), None)
            if r is None:
                continue
            x = i + (j - (len(caches) - 1) / 2) * width
            err = [[r["decode_tok_s"] - r["decode_tok_s_min"]], [r["decode_tok_s_max"] - r["decode_tok_s"]]]
            ax.bar(x, r["decode_tok_s"], width, yerr=err, capsize=3, color=f"C{j}",
                   label=cache if i == 0 else None)
            if r.get("roofline_tok_s"):
                ax.hlines(r["roofline_tok_s"], x - width / 2, x + width / 2, colors="black", linewidth=1.5)
    ax.set_xticks(range(len(impls)), impls, rotation=20, ha="right")
    ax.set(ylabel="decode tok/s, batch 1 (median, min–max)",
           title="Decode tok/s by implementation (black bar: bandwidth roofline)")
    ax.grid(axis="y", alpha=0.3)
    if rows:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path)


def plot_batch(records: list[dict[str, Any]], path: Path) -> None:
    points = _ok(records, "batch")
    fig, ax = plt.subplots(figsize=(7, 5))
    # (batch, median, min, max): a point recorded before the table was repeated has one run (no spread)
    series: dict[str, list[tuple[int, float, float, float]]] = {}
    for p in points:
        median = p["total_tok_s"]
        series.setdefault(p["impl"], []).append(
            (p["batch"], median, p.get("total_tok_s_min", median), p.get("total_tok_s_max", median)))
    colors = _impl_colors(set(series))
    for impl, rows in sorted(series.items()):
        rows.sort()
        batches, medians = [row[0] for row in rows], [row[1] for row in rows]
        spread = [[row[1] - row[2] for row in rows], [row[3] - row[1] for row in rows]]
        ax.errorbar(batches, medians, yerr=spread, marker="o", capsize=3, color=colors[impl], label=impl)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="total decode tok/s (median, min–max)",
           title="Decode throughput vs batch (static cache)")
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path)


def _impl_colors(impls: set[str]) -> dict[str, str]:
    order = ["torch_eager", "torch_compiled", "jax_step", "jax_fused", "transformers", "transformers_eager"]
    ranked = sorted(impls, key=lambda name: order.index(name) if name in order else len(order))
    return {name: f"C{i}" for i, name in enumerate(ranked)}


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: list[dict[str, Any]], out: Path) -> None:
    """results.md and the PNGs with data next to results.json. A plot with no points is not drawn, and one an
    earlier run left in `out` is removed: every figure there is this run's, as results.json is."""
    out = Path(out)
    (out / "results.md").write_text(markdown(records))
    drawn = figures(records)
    for key, plot in (("latency", plot_latency), ("impls", plot_impls), ("batch", plot_batch)):
        path = out / PLOTS[key]
        if PLOTS[key] in drawn:
            plot(records, path)
        else:
            path.unlink(missing_ok=True)
