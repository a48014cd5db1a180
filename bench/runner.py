"""The benchmark run: probes, the impl x cache table (interleaved repeats), latency vs context, tok/s vs batch.

Every phase appends records and rewrites DIR/results.json (the decode and batch tables also after each warm-up and
each timed round), so a run cut short (a deadline, a crash, Ctrl-C, a SIGKILL) still leaves what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from bench import metrics, probes, report
from bench.impls import REFERENCE_IMPLS, Impl, Run, impl_registry
from bench.presets import Preset
from bench.workload import Workload
from twincache.generation import CACHE_KINDS


@dataclasses.dataclass
class Options:
    preset: Preset
    out: Path
    impls: Sequence[str]
    caches: Sequence[str] = CACHE_KINDS
    repeats: int | None = None  # None: the preset's
    curves: bool = True
    batch: bool = True
    cache_dir: Path | None = None  # where checkpoint dirs are built (default $TWINCACHE_HOME/bench)
    fresh_compile_cache: bool = True  # compile_s then means a cold compile, as a first run sees it
    deadline_s: float | None = None  # past this many seconds, start no more warm-ups, curve or batch points
    progress: bool = True


def _configure_frameworks(opts: Options) -> str | None:
    """Process-wide settings, before any compile; returns a temporary compile-cache dir to remove at the end."""
    # JAX must not grab 75% of the GPU: torch and transformers share it in this process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if opts.preset.device == "cpu":
        # Inductor's compile-worker pool keeps both cores busy for seconds after a compile, which would leak into
        # the timed runs that follow on a small CPU; compile in-process instead.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch._dynamo

    # Default 8: past it dynamo silently falls back to eager. Count every recompile instead of hiding it.
    torch._dynamo.config.recompile_limit = 64  # named cache_size_limit before torch 2.6 (docs/design.md §7.7)
    if not opts.fresh_compile_cache:
        return None
    compile_dir = tempfile.mkdtemp(prefix="twincache-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_dir  # read by inductor at each compile
    return compile_dir


def tokens_reached(preset: Preset, curves: bool = True, batch: bool = True) -> dict[str, int]:
    """Per phase, the most tokens one of its runs holds (prompt + new tokens): each must fit the model's
    max_position_embeddings, or every run of that phase is refused."""
    reached = {"decode table": preset.prompt_len + preset.new_tokens}
    if curves and preset.curve_contexts:
        reached["latency curve"] = max(preset.curve_contexts) + preset.curve_steps + 2  # as _latency_curves runs
    if batch and preset.batch_sizes:
        reached["batch sweep"] = preset.batch_prompt_len + preset.batch_new_tokens
    return reached


# What cuts a run short from outside: Ctrl-C (or a timeout's SIGINT), and the reader of stdout going away (`bench
# --no-progress | head`: the next warm-up line raises BrokenPipeError, which the CLI ends quietly, as Unix tools do).
HARD_STOPS = (KeyboardInterrupt, BrokenPipeError)


class _Results:
    def __init__(self, out: Path, machine: dict[str, Any], preset: Preset) -> None:
        self.out, self.machine, self.preset = out, machine, preset
        self.records: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        config = self.preset.model_config
        model = self.preset.model_dir  # --model's, or the trained default model's; None: the preset's random weights
        record = {"kind": kind, "preset": self.preset.name, "model": None if model is None else str(model),
                  "dtype": self.preset.dtype, "sliding_window": config.sliding_window,
                  "params": metrics.param_count(config), "impl": None,
                  "cache": None, "prompt_len": None, "new_tokens": None, "batch": None, "prefill_s": None,
                  "decode_tok_s": None, "gbps": None, "roofline_frac": None, "compile_s": None,
                  "peak_mem_mb": None, "status": "ok", **fields}
        self.records.append(record)
        return record

    def limit_gbps(self) -> float | None:
        measured = [p for p in self.probes if "best_gbps" in p]
        return probes.bandwidth_limit(measured) if measured else None

    def finalize(self) -> None:
        """Fill the bandwidth-derived fields from the best probe so far; attach the machine to every record."""
        limit = self.limit_gbps()
        for record in self.records:
            record["machine"] = self.machine
            record["limit_gbps"] = limit
            if record.get("bytes_per_step") and record.get("decode_tok_s"):
                record["gbps"] = metrics.gbps(record["bytes_per_step"], record["decode_tok_s"])
                record["roofline_frac"] = record["gbps"] / limit if limit else None
                record["roofline_tok_s"] = limit * 1e9 / record["bytes_per_step"] if limit else None

    def save(self) -> None:
        """results.json, results.md and the plots, from everything measured so far."""
        self.finalize()
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.records, indent=1, default=float) + "\n")
        tmp.replace(self.out / "results.json")
        report.write_report(self.records, self.out)


def _warm_up_text(run: Run, info: dict[str, Any]) -> str:
    """A warm-up's figures in one line: its wall time, compile time and (untimed) decode rate."""
    rate = f", decode {run.decode_tok_s:.1f} tok/s untimed" if run.decode_tok_s is not None else ""
    return f"{run.wall_s:.2f} s, compile {info['compile_s']:.2f} s, first step {run.first_step_s:.2f} s{rate}"


def _round_label(round_number: int) -> str:
    """The `when` of the bandwidth probe taken at the start of a decode-table round."""
    return f"round {round_number}"


Point = TypeVar("Point", bound=Hashable)  # what a phase times: a table cell (impl, cache), a batch point (impl, size)
Measured = tuple[Run, dict[str, Any]]


def _rotated(points: list[Point], round_idx: int) -> list[Point]:
    """The round's order: the points rotated by one a round, so no point always runs right after the same one (or a
    compile)."""
    shift = round_idx % max(1, len(points))
    return points[shift:] + points[:shift]


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def _debug() -> bool:
    return bool(os.environ.get("TWINCACHE_DEBUG"))


class Bench:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.preset = opts.preset
        self.device = self.preset.device
        self.repeats = opts.repeats if opts.repeats is not None else self.preset.repeats
        self.start = time.monotonic()
        self.others = metrics.OthersCPU()  # the rest of the machine's CPU over the whole run
        self.compile_dir = _configure_frameworks(opts)
        self.results = _Results(opts.out, metrics.machine_description(self.device), self.preset)
        self.workload = Workload(self.preset, self.device, opts.cache_dir, opts.progress)
        self.impls: dict[str, Impl] = {}
        self.bar: tqdm | None = None

    # --- helpers ----------------------------------------------------------------------------------------------------

    def _past_deadline(self) -> bool:
        return self.opts.deadline_s is not None and time.monotonic() - self.start > self.opts.deadline_s

    def _tick(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update()

    def _bytes(self, cache: str, batch: int, prompt_len: int, new_tokens: int) -> int:
        """Bytes a decode step must read, at the mean context of a run's decode steps."""
        context = prompt_len + new_tokens / 2
        return metrics.bytes_per_step(self.preset.model_config, self.workload.dtype_bytes, batch, cache, context)

    def _measure(self, impl: Impl, prompts: list[list[int]], new_tokens: int, cache: str, max_cache_len: int,
                 track_rss: bool) -> tuple[Run, dict[str, Any]]:
        """One generate call, with the compiles it caused and the memory it peaked at."""
        before, compile_s_before = impl.compile_count(), impl.compile_seconds()
        metrics.reset_device_peak(self.device)
        started_s = time.monotonic() - self.start
        rss = metrics.PeakRSS()
        cpu_before = rss.cpu_seconds()
        others = metrics.OthersCPU()
        if track_rss:
            with rss:
                run = impl.generate(prompts, new_tokens, cache, max_cache_len)
        else:
            run = impl.generate(prompts, new_tokens, cache, max_cache_len)
            rss.sample()
        after = impl.compile_count()
        device_mb = metrics.device_peak_mb(self.device, impl.framework)
        return run, {"started_s": round(started_s, 4),  # seconds into the bench: the order runs were made in
                     "compiles": None if before is None or after is None else after - before,
                     "compile_s": impl.compile_seconds() - compile_s_before,
                     # CPU seconds per wall second: near the thread count when the process had the cores to itself
                     "cpu_per_wall": (rss.cpu_seconds() - cpu_before) / run.wall_s if run.wall_s else None,
                     # other processes' CPU per wall second meanwhile: near 0 when the run had the machine alone
                     "others_cpu_per_wall": others.per_wall()["others_cpu_per_wall"],
                     "peak_mem_mb": device_mb if device_mb is not None else rss.peak_mb}

    def _guarded(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
        """fn(*args, **kwargs), or (None, a one-line error) when it raises."""
        try:
            return fn(*args, **kwargs), None
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - one failing cell must not end the benchmark; it is recorded
            if _debug():
                traceback.print_exc()
            tqdm.write(f"bench: {what} failed: {_one_line(err)}")
            return None, _one_line(err)

    # --- phases -----------------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        try:
            self._probe("start")
            self.results.machine["phase_s"] = {"setup_and_probe": round(time.monotonic() - self.start, 1)}
            self._load_impls()
            self.results.save()
            cells = [(name, cache) for name in self.impls for cache in self.opts.caches]
            curve = [(n, c) for n in self.preset.curve_impls if n in self.impls and self.impls[n].per_step_timing
                     for c in self.opts.caches] if self.opts.curves else []
            batch = [n for n in self.preset.batch_impls if n in self.impls] if self.opts.batch else []
            total = (len(cells) * (1 + self.repeats) + len(curve) * (1 + len(self.preset.curve_contexts))
                     + len(batch) * len(self.preset.batch_sizes) * (1 + self.repeats))
            with tqdm(total=total, desc=f"bench {self.preset.name}", unit="run", disable=not self.opts.progress,
                      dynamic_ncols=True) as self.bar:
                phases: tuple[tuple[str, Callable[[Any], None], list[Any]], ...] = (
                    ("decode_table", self._decode_table, cells), ("latency_vs_context", self._latency_curves, curve),
                    ("batch", self._batch_curve, batch))
                for phase, fn, arg in phases:
                    phase_start = time.monotonic()
                    fn(arg)
                    self.results.machine.setdefault("phase_s", {})[phase] = round(time.monotonic() - phase_start, 1)
                    self.results.save()
            self._probe("end")
            self.results.machine["loadavg_end"] = list(os.getloadavg())
            self.results.machine.update(self.others.per_wall())
            self.results.machine["elapsed_s"] = round(time.monotonic() - self.start, 1)
            self.results.save()
            return self.results.records
        except HARD_STOPS:  # a timeout's SIGINT, or `| head` gone: keep what was measured, marked as cut short
            self.results.machine["interrupted_after_s"] = round(time.monotonic() - self.start, 1)
            self.results.machine.update(self.others.per_wall())
            self.results.save()
            raise
        finally:
            if self.compile_dir:
                shutil.rmtree(self.compile_dir, ignore_errors=True)
                if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == self.compile_dir:
                    del os.environ["TORCHINDUCTOR_CACHE_DIR"]

    def _probe(self, when: str, repeats: int = 10) -> None:
        found = probes.run_probes(self.preset.probe_bytes, self.device, with_jax=True, repeats=repeats)
        for p in found:
            p["when"] = when
        self.results.probes += found
        for p in found:
            self.results.add("bandwidth_probe", impl=p["probe"], status="ok" if "error" not in p else p["error"],
                             **{k: v for k, v in p.items() if k not in ("probe", "error")})

    def _load_impls(self) -> None:
        registry = impl_registry()
        for name in self.opts.impls:
            cls = registry[name]
            reason = cls.unavailable()
            if reason is None:
                self.impls[name] = cls(self.workload)
                continue
            tqdm.write(f"bench: {name}: {reason}")
            for cache in self.opts.caches:
                self.results.add("decode", impl=name, cache=cache, status="unavailable", note=reason)

    def _decode_table(self, cells: list[tuple[str, str]]) -> None:
        """Warm up every cell once, then run `repeats` rounds; each round visits every cell, in a rotated order."""
        p = self.preset
        prompts = self.workload.prompts(1, p.prompt_len)
        max_cache_len = max(p.prompt_len + p.new_tokens, p.table_cache_len or 0)

        def measure(cell: tuple[str, str], warm_up: bool) -> tuple[Measured | None, str | None]:
            name, cache = cell
            return self._guarded(f"{name} {cache}" + (" warm-up" if warm_up else ""), self._measure, self.impls[name],
                                 prompts, p.new_tokens, cache, max_cache_len, track_rss=warm_up)

        def refused(cell: tuple[str, str], status: str, note: str) -> None:
            self.results.add("decode", impl=cell[0], cache=cell[1], prompt_len=p.prompt_len, new_tokens=p.new_tokens,
                             batch=1, max_cache_len=max_cache_len, status=status, note=note)

        def probe(round_idx: int) -> None:
            # The bandwidth a shared machine offers drifts (this 2-core VM: 46 GB/s for minutes, then 76): a probe
            # per round gives each timed run the limit measured next to it, beside the run-wide best.
            self._probe(_round_label(round_idx + 1), repeats=5)

        # In the order given (a deadline cuts the last), but the first impl that must warm up first goes first.
        first = next((name for name, _ in cells if self.impls[name].warm_up_first), None)
        self._warm_up_and_time(
            cells, lambda cell: measure(cell, True), lambda cell: measure(cell, False),
            lambda cell: f"{cell[0]}/{cell[1]}",
            lambda cell, warm, timed, error: self._table_record(cell, warm, timed, error, max_cache_len), refused,
            warm_up_order=sorted(cells, key=lambda cell: cell[0] != first), before_round=probe)  # sorted is stable

    def _warm_up_and_time(self, points: list[Point], warm_up: Callable[[Point], tuple[Measured | None, str | None]],
                          time_one: Callable[[Point], tuple[Measured | None, str | None]],
                          label: Callable[[Point], str],
                          record: Callable[[Point, Measured, list[Measured], str | None], None],
                          refused: Callable[[Point, str, str], None], warm_up_order: list[Point] | None = None,
                          before_round: Callable[[int], None] | None = None) -> None:
        """A table's two stages: one warm-up per point (in `warm_up_order`; one past the deadline is `refused` as
        skipped, its compile would not fit, and the points warmed up so far still get timed), then `repeats`
        interleaved rounds over the points warmed up (`_timed_rounds`). `record` adds a point's row from its warm-up,
        timed runs and error: results.json is rewritten with those rows after each warm-up and each round
        (`_save_provisional`), and a hard stop leaves them too."""
        warm: dict[Point, Measured] = {}

        def warmed_up() -> None:  # an `untimed` row each
            for point, measured in warm.items():
                record(point, measured, [], None)

        try:
            for point in warm_up_order or points:
                self._tick(f"{label(point)} warm-up")
                if self._past_deadline():
                    refused(point, "skipped", "deadline: not warmed up")
                    continue
                measured, error = warm_up(point)
                if error or measured is None:
                    refused(point, "error", error or "no result")
                else:
                    warm[point] = measured
                    if not self.opts.progress:  # no bar (gpu_7b.sh): a line per warm-up, for its log
                        print(f"bench: {label(point)} warmed up: {_warm_up_text(*measured)}", flush=True)
                self._save_provisional(warmed_up)
        except HARD_STOPS:
            warmed_up()
            raise
        live = [point for point in points if point in warm]
        timed: dict[Point, list[Measured]] = {point: [] for point in live}
        failed: dict[Point, str] = {}

        def rows_so_far() -> None:
            for point in live:
                record(point, warm[point], timed[point], failed.get(point))
            self._ratios()  # the decode table's ratios to transformers (the batch table's rows have none)

        try:
            self._timed_rounds(live, timed, failed, time_one, label, before_round,
                               after_round=lambda: self._save_provisional(rows_so_far))
        finally:  # a hard stop (SIGINT) between rounds still leaves a row for every point timed so far
            rows_so_far()
        for impl in self.impls.values():
            impl.release()

    def _timed_rounds(self, live: list[Point], timed: dict[Point, list[Measured]], failed: dict[Point, str],
                      time_one: Callable[[Point], tuple[Measured | None, str | None]], label: Callable[[Point], str],
                      before_round: Callable[[int], None] | None = None,
                      after_round: Callable[[], None] | None = None) -> None:
        """`repeats` interleaved rounds over the points warmed up: each round visits every point once, in an order
        rotated by one a round (`_rotated`), so slow drift of the machine hits every point alike. Each timed run is
        appended to timed[point] as it ends (with its `round`), so a hard stop leaves what was measured; a point whose
        run fails is recorded in `failed` and not run again. `after_round` saves what the rounds so far measured."""
        for round_idx in range(self.repeats):
            if before_round is not None:
                before_round(round_idx)
            for point in _rotated(live, round_idx):
                self._tick(f"{label(point)} #{round_idx + 1}")
                if point in failed:
                    continue
                measured, error = time_one(point)
                if error or measured is None:
                    failed[point] = error or "no result"
                else:
                    measured[1]["round"] = round_idx + 1
                    timed[point].append(measured)
            if after_round is not None and round_idx + 1 < self.repeats:  # the last round's rows come next anyway
                after_round()

    def _save_provisional(self, add_rows: Callable[[], None]) -> None:
        """results.json (and results.md, the plots) with the rows `add_rows` adds for what a phase has measured so
        far, as a hard stop would leave them; the rows are taken back out after the write. Called after each warm-up
        and each timed round of the decode and batch tables: a SIGINT that comes during a compile in C++ (XLA's) is
        seen only when the compile returns, maybe past the lease's --kill-after, and its SIGKILL then runs no handler,
        leaving this file as it was last written (without this, the table before the phase began)."""
        kept = len(self.results.records)
        try:
            add_rows()
            self.results.save()
        finally:
            del self.results.records[kept:]

    def _table_record(self, cell: tuple[str, str], warm: tuple[Run, dict[str, Any]],
                      timed: list[tuple[Run, dict[str, Any]]], error: str | None, max_cache_len: int) -> None:
        name, cache = cell
        impl, p = self.impls[name], self.preset
        bytes_per_step = self._bytes(cache, 1, p.prompt_len, p.new_tokens)
        common = dict(impl=name, cache=cache, prompt_len=p.prompt_len, new_tokens=p.new_tokens, batch=1,
                      max_cache_len=max_cache_len, note=impl.note(cache), bytes_per_step=bytes_per_step)
        runs = [run for run, _ in timed]
        if not error and any(run.decode_tok_s is None for run in runs):
            error = f"no decode step after the first was timed ({p.new_tokens} new tokens, or an early EOS)"
        if error:
            self.results.add("decode", status="error", **{**common, "note": error})
            return
        if not timed:  # a hard stop came before its timed rounds: the warm-up's figures, which include its compile
            self.results.add("decode", status="untimed", **{**common, "note": f"stopped before its timed rounds; "
                                                                           f"warm-up {_warm_up_text(*warm)}"},
                             compile_s=warm[1]["compile_s"], warmup_first_step_s=warm[0].first_step_s,
                             warmup_wall_s=warm[0].wall_s, warmup_decode_tok_s=warm[0].decode_tok_s)
            return
        # Each run against the best probe of its own round: the fraction of the bandwidth available at the time.
        tok_s = [run.decode_tok_s for run in runs if run.decode_tok_s is not None]  # every run's: checked above
        local_fracs = [metrics.gbps(bytes_per_step, speed) / limit
                       for speed, (_, info) in zip(tok_s, timed, strict=True)
                       if (limit := self._round_limit(info["round"]))]
        median_tok_s = statistics.median(tok_s)
        walls = statistics.median(run.wall_s for run in runs)
        warm_run, warm_info = warm
        recompiles = [info["compiles"] for _, info in timed if info["compiles"] is not None]
        self.results.add(
            "decode", **common,
            prefill_s=statistics.median(run.prefill_s for run in runs),
            decode_tok_s=median_tok_s, decode_tok_s_min=min(tok_s), decode_tok_s_max=max(tok_s),
            ms_per_token=1000.0 / median_tok_s if median_tok_s else None,
            decode_steps=runs[0].decode_steps, repeats=len(runs), tok_s_runs=tok_s,
            roofline_frac_round=statistics.median(local_fracs) if local_fracs else None,
            # Compile time as the framework accounts it (dynamo's timer; jax.monitoring) during the warm-up, then
            # the warm-up's wall-clock excess over a steady run and its first decode step, as cross-checks.
            compile_s=warm_info["compile_s"], recompile_s=sum(info["compile_s"] for _, info in timed),
            warmup_excess_s=max(0.0, warm_run.wall_s - walls), warmup_first_step_s=warm_run.first_step_s,
            compiles=warm_info["compiles"], recompiles=sum(recompiles) if recompiles else None,
            cpu_per_wall=statistics.median(info["cpu_per_wall"] or 0.0 for _, info in timed),
            others_cpu_per_wall=max((info["others_cpu_per_wall"] for _, info in timed
                                     if info["others_cpu_per_wall"] is not None), default=None),  # the worst run
            peak_mem_mb=max([warm_info["peak_mem_mb"]] + [info["peak_mem_mb"] for _, info in timed]),
        )

    def _round_limit(self, round_number: int) -> float | None:
        """The best any probe streamed in this round of the decode table."""
        label = _round_label(round_number)
        found = [p for p in self.results.probes if p.get("when") == label and "best_gbps" in p]
        return probes.bandwidth_limit(found) if found else None

    def _ratios(self) -> None:
        """ratio_to_transformers per cache column: against `transformers` (the seed's setup) when it ran."""
        rows = [r for r in self.results.records if r["kind"] == "decode" and r["status"] == "ok"]
        for cache in self.opts.caches:
            column = {r["impl"]: r for r in rows if r["cache"] == cache}
            reference = next((column[n] for n in REFERENCE_IMPLS if n in column), None)
            for record in column.values():
                record["reference_impl"] = reference["impl"] if reference else None
                record["ratio_to_transformers"] = (record["decode_tok_s"] / reference["decode_tok_s"]
                                                   if reference else None)

    def _latency_curves(self, cells: list[tuple[str, str]]) -> None:
        """Per-token decode latency at contexts from ~0 to the preset's longest, with one cache sized for the
        longest context (static) or a W-slot ring (sliding). Each point is a prefill to that context, then
        `curve_steps` timed decode steps."""
        p = self.preset
        steps = p.curve_steps
        max_cache_len = tokens_reached(p, batch=False)["latency curve"]
        for name, cache in cells:
            impl = self.impls[name]
            self._tick(f"curve {name}/{cache} warm-up")
            warm_prompt = self.workload.prompts(1, p.curve_contexts[0], salt=1)
            _, error = self._guarded(f"curve {name} {cache} warm-up", self._measure, impl, warm_prompt, steps + 2,
                                     cache, max_cache_len, track_rss=False)
            for context in p.curve_contexts:
                self._tick(f"curve {name}/{cache} @{context}")
                common = dict(impl=name, cache=cache, prompt_len=context, new_tokens=steps + 2, batch=1,
                              max_cache_len=max_cache_len, bytes_per_step=self._bytes(cache, 1, context, steps + 2))
                if error or self._past_deadline():
                    self.results.add("latency_vs_context", status="skipped", note=error or "deadline", **common)
                    continue
                prompt = self.workload.prompts(1, context, salt=1)
                measured, error_here = self._guarded(f"curve {name} {cache} @{context}", self._measure, impl, prompt,
                                                     steps + 2, cache, max_cache_len, track_rss=False)
                if error_here:
                    self.results.add("latency_vs_context", status="error", note=error_here, **common)
                    continue
                run, info = measured
                latencies = run.step_latencies()
                median_s = statistics.median(latencies)
                self.results.add("latency_vs_context", **common, context=context + steps // 2,
                                 prefill_s=run.prefill_s, ms_per_token=1000 * median_s, decode_tok_s=1 / median_s,
                                 step_ms=[1000 * s for s in latencies], compiles=info["compiles"],
                                 compile_s=info["compile_s"], cpu_per_wall=info["cpu_per_wall"],
                                 others_cpu_per_wall=info["others_cpu_per_wall"], peak_mem_mb=info["peak_mem_mb"])
            impl.release()

    def _batch_curve(self, names: list[str]) -> None:
        """Aggregate decode tok/s against batch size, static cache, as the decode table times its cells: one warm-up
        per (impl, size) point, then `repeats` interleaved rounds, each visiting every point in a rotated order."""
        p = self.preset
        max_cache_len = p.batch_prompt_len + p.batch_new_tokens
        points = [(name, batch) for name in names for batch in p.batch_sizes]  # the preset's order: a deadline cuts
        prompts = {batch: self.workload.prompts(batch, p.batch_prompt_len, salt=2) for batch in p.batch_sizes}

        def time_point(point: tuple[str, int]) -> tuple[Measured | None, str | None]:
            name, batch = point
            measured, error = self._guarded(f"batch {name} x{batch}", self._measure, self.impls[name],
                                            prompts[batch], p.batch_new_tokens, "static", max_cache_len,
                                            track_rss=False)
            if not error and measured[0].decode_tok_s is None:
                error = f"no decode step after the first was timed ({p.batch_new_tokens} new tokens)"
            return (None, error) if error else (measured, None)

        def refused(point: tuple[str, int], status: str, note: str) -> None:
            self.results.add("batch", status=status, note=note, **self._batch_common(point))

        self._warm_up_and_time(points, time_point, time_point, lambda point: f"batch {point[0]} x{point[1]}",
                               self._batch_record, refused)

    def _batch_common(self, point: tuple[str, int]) -> dict[str, Any]:
        name, batch = point
        p = self.preset
        return dict(impl=name, cache="static", prompt_len=p.batch_prompt_len, new_tokens=p.batch_new_tokens,
                    batch=batch, max_cache_len=p.batch_prompt_len + p.batch_new_tokens,
                    bytes_per_step=self._bytes("static", batch, p.batch_prompt_len, p.batch_new_tokens))

    def _batch_record(self, point: tuple[str, int], warm: Measured, timed: list[Measured], error: str | None) -> None:
        """A batch point's record: the median of its timed runs' tok/s with their min and max (per sequence, and
        total = batch x per sequence); `untimed` with its warm-up's figures when a hard stop came before any."""
        batch = point[1]
        common = self._batch_common(point)
        warm_run, warm_info = warm
        if error:
            self.results.add("batch", status="error", note=error, **common)
            return
        if not timed:
            self.results.add("batch", status="untimed", **common,
                             note=f"stopped before its timed rounds; warm-up {_warm_up_text(warm_run, warm_info)}",
                             compile_s=warm_info["compile_s"], warmup_first_step_s=warm_run.first_step_s,
                             warmup_wall_s=warm_run.wall_s, warmup_decode_tok_s=warm_run.decode_tok_s)
            return
        runs = [run for run, _ in timed]
        tok_s = [run.decode_tok_s for run in runs if run.decode_tok_s is not None]  # every run's: time_point checks
        median_tok_s = statistics.median(tok_s)
        recompiles = [info["compiles"] for _, info in timed if info["compiles"] is not None]
        self.results.add(
            "batch", **common, prefill_s=statistics.median(run.prefill_s for run in runs),
            decode_tok_s=median_tok_s, decode_tok_s_min=min(tok_s), decode_tok_s_max=max(tok_s),
            total_tok_s=batch * median_tok_s, total_tok_s_min=batch * min(tok_s),
            total_tok_s_max=batch * max(tok_s), ms_per_token=1000 / median_tok_s, repeats=len(runs),
            tok_s_runs=tok_s, rounds=[info["round"] for _, info in timed],
            # when each run started, seconds into the bench: the warm-up, then one run a round, interleaved
            warmup_started_s=warm_info["started_s"], run_started_s=[info["started_s"] for _, info in timed],
            compile_s=warm_info["compile_s"], compiles=warm_info["compiles"],
            recompiles=sum(recompiles) if recompiles else None,
            cpu_per_wall=statistics.median(info["cpu_per_wall"] or 0.0 for _, info in timed),
            others_cpu_per_wall=max((info["others_cpu_per_wall"] for _, info in timed
                                     if info["others_cpu_per_wall"] is not None), default=None),  # the worst run
            peak_mem_mb=max([warm_info["peak_mem_mb"]] + [info["peak_mem_mb"] for _, info in timed]))


def run_bench(opts: Options) -> list[dict[str, Any]]:
    """Run the benchmark and write DIR/results.json, DIR/results.md and the plots; returns the records."""
    return Bench(opts).run()
