"""`twincache bench --compare OLD NEW`: two runs of one workload side by side, cell by cell.

A run's tok/s belong to its machine and its moment: the bandwidth a 2-core VM gives moves between sessions and
between machines (bench/README), and every implementation moves with it. So a verdict reads each decode cell's
min-max spread over its timed runs on the most machine-proof scale the two runs share: its ratio to transformers'
cell in the same run (code twincache does not change, the control), else its roofline fraction (tok/s over the run's
own measured limit) when the limits differ by more than LIMIT_TOLERANCE, else tok/s. A cell is faster or slower
only when the two spreads do not overlap. A batch point is judged alike on its total tok/s, against the reference's
point at the same batch size; a run recorded before the batch table was repeated timed each point once (its spread
is its value), so its points get no verdict.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.report import shared_machine, timed_runs
from twincache.errors import InputError

LIMIT_TOLERANCE = 0.10  # bandwidth limits this close count as one machine (probes on one VM vary ~5% a run)
WORKLOAD_FIELDS = ("preset", "params", "dtype", "sliding_window")  # any difference makes two tok/s incomparable
REFERENCES = ("transformers", "transformers_eager")  # code twincache does not change: ratios to it are the control
SINGLE_RUN = "no verdict: one timed run"  # a cell either run timed once: its min-max is no spread
# Per kind compared: the fields that name a record (a string or an integer each), and what an ok one must have
# measured (a positive finite number each).
_KEYS = {"decode": ("impl", "cache"), "latency_vs_context": ("impl", "cache", "context"), "batch": ("impl", "batch")}
_MEASURED = {"decode": ("decode_tok_s", "decode_tok_s_min", "decode_tok_s_max"),
             "latency_vs_context": ("ms_per_token",), "batch": ("total_tok_s",)}
# ... and what it must have measured where recorded (a batch point before the batch table was repeated has neither)
_SPREAD = {"batch": ("total_tok_s_min", "total_tok_s_max")}
_STRING_FIELDS = ("status", "impl", "cache")


def load_run(path: Path) -> list[dict[str, Any]]:
    """The records of one run: a directory `twincache bench --out` wrote, or its results.json."""
    file = path / "results.json" if path.is_dir() else path
    hint = "give a directory that `twincache bench --out DIR` wrote, or its results.json"
    if not file.is_file():
        raise InputError(f"--compare {path}: no {'results.json in that directory' if path.is_dir() else 'such file'}"
                         f"; {hint}")
    try:
        records = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--compare {file}: not a JSON file ({err}); {hint}") from None
    if (not isinstance(records, list) or not records
            or not all(isinstance(r, dict) and "kind" in r and "preset" in r for r in records)):
        raise InputError(f"--compare {file}: not a bench results.json (a list of records, each with a kind and a "
                         f"preset; a mesh.json or prefill_memory.json is another table); {hint}")
    for record in (r for r in records if r["kind"] in _KEYS):
        kind, ok = record["kind"], record.get("status") == "ok"
        # Every decode cell is listed, whatever its status; of the other kinds only ok records are compared (a
        # skipped curve point records no context).
        named = ("status", *(_KEYS[kind] if ok or kind == "decode" else ()),
                 *(("prompt_len", "new_tokens") if ok and kind == "decode" else ()))
        unnamed = [f for f in named if not _valid_name(f, record.get(f))]
        if unnamed:
            raise InputError(f"--compare {file}: a {kind} record has no valid {', '.join(unnamed)} (a string for "
                             f"{', '.join(_STRING_FIELDS)}, else an integer); {hint}")
        unmeasured = [f for f in _MEASURED[kind] if ok and not _positive(record.get(f))]
        unmeasured += [f for f in _SPREAD.get(kind, ()) if ok and f in record and not _positive(record[f])]
        if unmeasured:
            raise InputError(f"--compare {file}: a {kind} record of {record.get('impl')} / {record.get('cache')} "
                             f"has no positive {', '.join(unmeasured)}; {hint}")
    if not any(r["kind"] in _KEYS for r in records):
        raise InputError(f"--compare {file}: holds no decode, latency or batch record (only "
                         f"{sorted({r['kind'] for r in records})}); {hint}")
    return records


def _valid_name(field: str, value: object) -> bool:
    if field in _STRING_FIELDS:
        return isinstance(value, str)
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def check_comparable(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Refuse two runs of different workloads: the model, its dtype and window, and the decode table's lengths."""
    for field in WORKLOAD_FIELDS:
        if old[0].get(field) != new[0].get(field):
            raise InputError(f"--compare: the runs measured different workloads: {field} is {old[0].get(field)!r} in "
                             f"OLD and {new[0].get(field)!r} in NEW; compare two runs of one preset on one model")
    lengths = [{(r["prompt_len"], r["new_tokens"]) for r in run if r["kind"] == "decode" and r["status"] == "ok"}
               for run in (old, new)]
    if all(lengths) and lengths[0] != lengths[1]:
        raise InputError(f"--compare: the decode tables ran different lengths: prompt + new tokens "
                         f"{_lengths(lengths[0])} in OLD, {_lengths(lengths[1])} in NEW; compare runs of one preset")


def _lengths(pairs: set[tuple[int, int]]) -> str:
    return ", ".join(f"{prompt} + {new}" for prompt, new in sorted(pairs))


def _limit(records: list[dict[str, Any]]) -> float | None:
    return next((r["limit_gbps"] for r in records if r.get("limit_gbps")), None)


def same_machine(old_limit: float | None, new_limit: float | None) -> bool:
    """Whether raw tok/s compare: both limits measured and within LIMIT_TOLERANCE (a run without a limit is taken
    at its word, there being nothing to scale by)."""
    if not old_limit or not new_limit:
        return True
    return abs(new_limit - old_limit) <= LIMIT_TOLERANCE * max(old_limit, new_limit)


def verdict(old_span: tuple[float, float], new_span: tuple[float, float]) -> str:
    """faster / slower when the two min-max spreads do not overlap, else within spread."""
    if new_span[0] > old_span[1]:
        return "faster"
    if new_span[1] < old_span[0]:
        return "slower"
    return "within spread"


def _ok_by(records: list[dict[str, Any]], kind: str) -> dict[tuple, dict[str, Any]]:
    """The kind's ok records by the fields that name them (_KEYS)."""
    return {tuple(r[f] for f in _KEYS[kind]): r for r in records if r["kind"] == kind and r["status"] == "ok"}


def _status_by(records: list[dict[str, Any]], kind: str) -> dict[tuple, str]:
    return {tuple(r[f] for f in _KEYS[kind]): r["status"] for r in records if r["kind"] == kind}


# The figure each kind's verdict reads, with its `_min` and `_max`: a decode cell's tok/s, a batch point's total.
_SPEED = {"decode": "decode_tok_s", "batch": "total_tok_s"}


def _span(record: dict[str, Any], scale: float = 1.0) -> tuple[float, float]:
    """The record's min-max; a batch point of a run before the batch table was repeated has one run: its value."""
    speed = _SPEED[record["kind"]]
    low, high = record.get(speed + "_min", record[speed]), record.get(speed + "_max", record[speed])
    return low * scale, high * scale


def _ratio_span(record: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float]:
    """The record's spread over its reference's in the same run, widened by both: [min / ref max, max / ref min]."""
    (low, high), (ref_low, ref_high) = _span(record), _span(reference)
    return low / ref_high, high / ref_low


def _judge(o: dict[str, Any], n: dict[str, Any], refs: tuple[dict[str, Any], dict[str, Any]] | None,
           limits: tuple[float | None, float | None], one_machine: bool, unrecorded_runs: int) -> dict[str, str]:
    """The verdict on one decode cell or batch point and the scale it read, most machine-proof first: the ratio to a
    reference both runs measured (`refs`, OLD's and NEW's, named by their impl); each run's roofline fraction when the
    limits differ; tok/s on one machine (and for the references themselves). No verdict where either run timed it
    once."""
    old_limit, new_limit = limits
    if refs is not None and o["impl"] not in REFERENCES:  # the same untouched code in both runs: carries across
        found = {"judged_on": "x " + refs[0]["impl"], "verdict": verdict(_ratio_span(o, refs[0]),
                                                                        _ratio_span(n, refs[1]))}
    elif old_limit and new_limit and not one_machine:
        found = {"judged_on": "roofline", "verdict": verdict(_span(o, 1 / old_limit), _span(n, 1 / new_limit))}
    else:
        found = {"judged_on": "tok/s", "verdict": verdict(_span(o), _span(n))}
    if min(timed_runs(o, unrecorded_runs), timed_runs(n, unrecorded_runs)) < 2:  # a spread of one run is a point
        found["verdict"] = SINGLE_RUN
    return found


def compare(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, Any]:
    """Every decode cell, latency curve and batch point the two runs share, NEW against OLD."""
    check_comparable(old, new)
    old_limit, new_limit = _limit(old), _limit(new)
    one_machine = same_machine(old_limit, new_limit)
    decode: list[dict[str, Any]] = []
    old_cells, new_cells = _ok_by(old, "decode"), _ok_by(new, "decode")
    old_status, new_status = _status_by(old, "decode"), _status_by(new, "decode")
    for key in dict.fromkeys([*old_status, *new_status]):
        row: dict[str, Any] = {"impl": key[0], "cache": key[1]}
        o, n = old_cells.get(key), new_cells.get(key)
        if o is None or n is None:
            row.update(old_status=old_status.get(key, "absent"), new_status=new_status.get(key, "absent"))
            decode.append(row)
            continue
        row.update(old_tok_s=o["decode_tok_s"], new_tok_s=n["decode_tok_s"], old_span=list(_span(o)),
                   new_span=list(_span(n)), tok_s_change=n["decode_tok_s"] / o["decode_tok_s"],
                   old_roofline=o.get("roofline_frac"), new_roofline=n.get("roofline_frac"))
        reference = next((ref for ref in REFERENCES if (ref, key[1]) in old_cells and (ref, key[1]) in new_cells), None)
        if reference is not None:  # the same untouched code in both runs: its ratio carries across machines
            old_ref, new_ref = old_cells[(reference, key[1])], new_cells[(reference, key[1])]
            row.update(reference=reference, old_x_ref=o["decode_tok_s"] / old_ref["decode_tok_s"],
                       new_x_ref=n["decode_tok_s"] / new_ref["decode_tok_s"])
        row.update(_judge(o, n, None if reference is None else (old_ref, new_ref), (old_limit, new_limit),
                          one_machine, unrecorded_runs=2))
        decode.append(row)
    curves = []
    old_points, new_points = _ok_by(old, "latency_vs_context"), _ok_by(new, "latency_vs_context")
    for impl, cache in dict.fromkeys((k[0], k[1]) for k in old_points):
        shared = sorted(k[2] for k in old_points if k[:2] == (impl, cache) and k in new_points)
        if not shared:
            continue
        ms = {run: [points[(impl, cache, c)]["ms_per_token"] for c in shared]
              for run, points in (("old", old_points), ("new", new_points))}
        curves.append({"impl": impl, "cache": cache, "contexts": shared,
                       "old_first_over_last": ms["old"][0] / ms["old"][-1] if len(shared) > 1 else None,
                       "new_first_over_last": ms["new"][0] / ms["new"][-1] if len(shared) > 1 else None,
                       "median_ms_change": statistics.median(b / a for a, b in zip(ms["old"], ms["new"]))})
    batch = []
    old_sizes, new_sizes = _ok_by(old, "batch"), _ok_by(new, "batch")
    for key, o in old_sizes.items():
        n = new_sizes.get(key)
        if n is None:
            continue
        point: dict[str, Any] = {"impl": key[0], "batch": key[1], "old_tok_s": o["total_tok_s"],
                                 "new_tok_s": n["total_tok_s"], "old_span": list(_span(o)), "new_span": list(_span(n)),
                                 "tok_s_change": n["total_tok_s"] / o["total_tok_s"],
                                 "old_roofline": o.get("roofline_frac"), "new_roofline": n.get("roofline_frac")}
        # a reference's point at the same batch size in both runs, as the decode table's at the same cache
        reference = next((ref for ref in REFERENCES if (ref, key[1]) in old_sizes and (ref, key[1]) in new_sizes),
                         None)
        refs = None if reference is None else (old_sizes[(reference, key[1])], new_sizes[(reference, key[1])])
        if refs is not None:
            point.update(reference=reference, old_x_ref=o["total_tok_s"] / refs[0]["total_tok_s"],
                         new_x_ref=n["total_tok_s"] / refs[1]["total_tok_s"])
        point.update(_judge(o, n, refs, (old_limit, new_limit), one_machine, unrecorded_runs=1))
        batch.append(point)
    return {"old": _describe(old), "new": _describe(new), "same_machine": one_machine, "decode": decode,
            "latency_vs_context": curves, "batch": batch}


def _describe(records: list[dict[str, Any]]) -> dict[str, Any]:
    machine = records[0].get("machine")
    machine = machine if isinstance(machine, dict) else {}
    return {"preset": records[0]["preset"], "commit": machine.get("git_commit"),
            "started_utc": machine.get("started_utc"), "device": machine.get("gpu") or machine.get("cpu"),
            "torch": machine.get("torch"), "jax": machine.get("jax"),
            "transformers": machine.get("transformers"), "limit_gbps": _limit(records),
            "repeats": next((r.get("repeats") for r in records if r["kind"] == "decode" and r.get("repeats")), None),
            "shared_machine": shared_machine(records)}


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


_SHORT = {"x transformers": "x tf", "x transformers_eager": "x tf-eager", "roofline": "roofline", "tok/s": "tok/s"}


def _x_ref(row: dict[str, Any]) -> str:
    if "reference" not in row:
        return "–"
    return f"{row['old_x_ref']:.2f} → {row['new_x_ref']:.2f} ({_SHORT['x ' + row['reference']]})"


def markdown(result: dict[str, Any], old_path: Path, new_path: Path) -> str:
    old, new = result["old"], result["new"]
    lines = [f"# twincache bench --compare: preset `{old['preset']}`", ""]
    for label, run, path in (("OLD", old, old_path), ("NEW", new, new_path)):
        lines.append(f"- {label} `{path}`: commit {run['commit']}, {run['started_utc']} UTC, {run['device']}; torch "
                     f"{run['torch']}, jax {run['jax']}, transformers {run['transformers']}; limit "
                     f"{_num(run['limit_gbps'])} GB/s; {run['repeats']} timed runs per cell")
    lines.append("")
    if not result["same_machine"]:
        lines += [f"**The bandwidth limits differ by more than {LIMIT_TOLERANCE:.0%}** ({_num(old['limit_gbps'])} vs "
                  f"{_num(new['limit_gbps'])} GB/s): another machine, or the same one at another time. A tok/s change "
                  "mixes the machine's with the code's; rows without a reference are judged on each run's roofline "
                  "fraction (tok/s over its own limit).", ""]
    for label, run in (("OLD", old), ("NEW", new)):
        if run["shared_machine"]:
            lines += [f"**{label} ran on a shared machine:** {run['shared_machine']}. Its tok/s and spreads carry "
                      "that load, not only its code's speed: rerun it alone before reading a verdict.", ""]
    if old["transformers"] != new["transformers"]:
        lines += [f"**transformers differs** ({old['transformers']} in OLD, {new['transformers']} in NEW): the "
                  "references' code may have changed with it, so a verdict against them holds only as far as their "
                  "speed did not.", ""]
    counted = [row["verdict"] for row in result["decode"] if "verdict" in row]
    lines += ["## Decode, batch 1", "",
              f"{counted.count('faster')} faster, {counted.count('slower')} slower, "
              f"{counted.count('within spread')} within spread"
              + (f", {counted.count(SINGLE_RUN)} timed once in a run (no spread, so no verdict: rerun with --repeats "
                 "3 or more)" if SINGLE_RUN in counted else "")
              + f", of {len(counted)} cells both runs measured. A verdict "
              "compares the two runs' min–max spreads of the cell, faster or slower only where they do not overlap, "
              "on the most machine-proof scale at hand (in parentheses): the ratio to a reference both runs measured "
              "(x tf: transformers compiled; x tf-eager; each spread widened by the reference's), else the roofline "
              "fraction where the limits differ, else tok/s. x reference = tok/s over the reference's in the same "
              "run and cache column.", "",
              "| impl | cache | OLD tok/s [min–max] | NEW tok/s [min–max] | NEW / OLD | roofline OLD → NEW | "
              "x reference OLD → NEW | verdict |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in result["decode"]:
        if "verdict" not in row:
            lines.append(f"| {row['impl']} | {row['cache']} | {row['old_status']} | {row['new_status']} |||||")
            continue
        lines.append(f"| {row['impl']} | {row['cache']} | {_num(row['old_tok_s'])} [{_num(row['old_span'][0])}–"
                     f"{_num(row['old_span'][1])}] | {_num(row['new_tok_s'])} [{_num(row['new_span'][0])}–"
                     f"{_num(row['new_span'][1])}] | {_num(row['tok_s_change'], 2)} | {_pct(row['old_roofline'])} → "
                     f"{_pct(row['new_roofline'])} | {_x_ref(row)} | {row['verdict']} ({_SHORT[row['judged_on']]}) |")
    drift = [row for row in result["decode"] if row["impl"] in REFERENCES and "verdict" in row]
    if drift:
        lines += ["", "The references run transformers' code, so their own change is the machine's drift between "
                  "the runs (where transformers' version is the same in both), and it is in every tok/s above: "
                  + "; ".join(f"{row['impl']} / {row['cache']} {row['tok_s_change']:.2f}x" for row in drift) + "."]
    if result["latency_vs_context"]:
        lines += ["", "## Per-token latency vs context", "",
                  "Over the contexts both runs measured: the shortest context's time over the longest's in each run "
                  "(~1 when every step reads the whole cache), and the median of NEW / OLD ms per token.", "",
                  "| impl | cache | contexts | first / last OLD → NEW | NEW / OLD ms (median) |",
                  "|---|---|---:|---:|---:|"]
        lines += [f"| {c['impl']} | {c['cache']} | {c['contexts'][0]}–{c['contexts'][-1]} ({len(c['contexts'])}) | "
                  f"{_num(c['old_first_over_last'], 2)} → {_num(c['new_first_over_last'], 2)} | "
                  f"{_num(c['median_ms_change'], 2)} |" for c in result["latency_vs_context"]]
    if result["batch"]:
        counted = [p["verdict"] for p in result["batch"]]
        lines += ["", "## Total tok/s vs batch (static cache)", "",
                  f"{counted.count('faster')} faster, {counted.count('slower')} slower, "
                  f"{counted.count('within spread')} within spread"
                  + (f", {counted.count(SINGLE_RUN)} timed once in a run (a run before the batch table was repeated, "
                     "or --repeats 1: no spread, so no verdict)" if SINGLE_RUN in counted else "")
                  + f", of {len(counted)} points both runs measured. Total tok/s = batch x decode steps per second, "
                  "median [min–max] over the point's interleaved runs; verdicts as the decode table's, the reference "
                  "being its point at the same batch size.", "",
                  "| impl | batch | OLD total tok/s [min–max] | NEW total tok/s [min–max] | NEW / OLD | roofline OLD → "
                  "NEW | x reference OLD → NEW | verdict |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {p['impl']} | {p['batch']} | {_num(p['old_tok_s'])} [{_num(p['old_span'][0])}–"
                  f"{_num(p['old_span'][1])}] | {_num(p['new_tok_s'])} [{_num(p['new_span'][0])}–"
                  f"{_num(p['new_span'][1])}] | {_num(p['tok_s_change'], 2)} | {_pct(p['old_roofline'])} → "
                  f"{_pct(p['new_roofline'])} | {_x_ref(p)} | {p['verdict']} ({_SHORT[p['judged_on']]}) |"
                  for p in result["batch"]]
    return "\n".join(lines) + "\n"
