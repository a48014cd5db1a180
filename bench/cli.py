"""`twincache bench` and `python -m bench`: decode benchmarks of every implementation on the same weights."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import prefill_memory
from bench.impls import impl_registry
from bench.presets import PRESETS, resolve
from twincache.config import INT32_MAX, check_window_flag
from twincache.errors import InputError, MeshError, UnavailableError
from twincache.generation import CACHE_KINDS, PREFILL_CHUNK
from twincache.mesh import MeshShape, parse_mesh
from twincache.storage import writable_directory
from twincache_app.backends import BACKENDS


def _list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        # once each: a name given twice was a cell run twice per round into one record, written twice
        items = list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return items
    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark decode speed of every implementation against transformers and the bandwidth limit",
        description="Runs every implementation x cache on the same random weights (interleaved repeats, warm-up "
                    "excluded), a bandwidth probe, latency vs context and tok/s vs batch; writes DIR/results.json, "
                    "DIR/results.md and PNG plots.")
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="tiny: seconds, smoke test (the default); small: ~57M params fp32 on CPU (minutes); "
                             "long: a 16k-slot static cache on a small model, KV reads dominate (CPU, minutes); 7b: "
                             "Mistral-7B shape bf16, GPU only; trained / trained-bf16: the trained default model "
                             "(SmolLM2-135M, window 64) in fp32 / bf16 on CPU")
    parser.add_argument("--model", type=Path, default=None,
                        help="run the preset's workload on this HF Mistral or Llama directory or .gguf file instead "
                             "of its own weights (EOS off, so every run decodes its full budget); with "
                             "--prefill-memory, the checkpoint directory to sweep")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="run with this sliding window instead of the model's (a model without one, like most "
                             "GGUFs, needs it for the sliding_window cache)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: bench_out/<preset>)")
    names = list(impl_registry())
    parser.add_argument("--impls", type=_list(names), default=None,
                        help=f"comma-separated subset of {', '.join(names)} (default: the preset's)")
    parser.add_argument("--caches", type=_list(CACHE_KINDS), default=list(CACHE_KINDS),
                        help="comma-separated subset of static, sliding_window (default: both)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default: the preset's)")
    parser.add_argument("--no-curves", action="store_true", help="skip latency vs context")
    parser.add_argument("--no-batch", action="store_true", help="skip tok/s vs batch")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where random checkpoints are built once and reused (default: $TWINCACHE_HOME/bench)")
    parser.add_argument("--warm-compile-cache", action="store_true",
                        help="reuse inductor's on-disk compile cache (default: a fresh one, so compile_s is cold)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no more table warm-ups (compiles), curve or batch points start; "
                             "what they skip is recorded as skipped, and cells already warmed up are still timed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--meshes", nargs="+", type=_mesh, default=None, metavar="MESH",
                        help="instead of the decode table: each backend on each mesh (model=N[,data=M]), recording "
                             "per-device bytes of weights and KV and tok/s in DIR/mesh.json and DIR/mesh.md; --impls "
                             "picks backends and modes (default: each backend in its default mode)")
    parser.add_argument("--compare", nargs=2, type=Path, default=None, metavar=("OLD", "NEW"),
                        help="instead of running: two earlier runs of one workload (each a --out directory or its "
                             "results.json), cell by cell: tok/s, roofline fraction and ratio to transformers in the "
                             "same run, with a verdict from each cell's min-max spread (bench/compare.py); prints "
                             "markdown, and with --out also writes DIR/compare.md and DIR/compare.json")
    memory = parser.add_argument_group("prefill memory (--prefill-memory)")
    memory.add_argument("--prefill-memory", action="store_true",
                        help="instead of decode speed: peak RSS of a prefill against prompt length, chunked and in one "
                             "chunk, every backend, each point in a fresh process (bench/prefill_memory.py); writes "
                             "DIR/prefill_memory.json, .md and .png")
    memory.add_argument("--prompt-lengths", type=_lengths, default=None,
                        help="comma-separated prompt lengths (default: "
                             + "; ".join(f"{', '.join(map(str, lengths))} with --preset {name}"
                                         for name, lengths in prefill_memory.PRESET_LENGTHS.items())
                             + f"; else {','.join(map(str, prefill_memory.DEFAULT_LENGTHS))})")
    memory.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="chunk size (default: %(default)s)")
    memory.add_argument("--memory-limit-gb", type=float, default=prefill_memory.DEFAULT_LIMIT_GB,
                        help="a point whose RSS passes this is killed and recorded as such (default: %(default)s)")
    memory.add_argument("--backends", type=_list(tuple(BACKENDS)), default=list(BACKENDS),
                        help="comma-separated subset of " + ", ".join(BACKENDS) + " (default: all)")
    # Ctrl-C (or a timeout's SIGINT) raises KeyboardInterrupt here, so the runner saves what it measured first.
    parser.set_defaults(run=run, keep_keyboard_interrupt=True,
                        flag_defaults={flag: parser.get_default(_dest(flag)) for flags in _IGNORED.values()
                                       for flag in flags})


# The flags only one way of running reads, and what each other way would silently ignore: given there, they are
# refused, named (--preset, --model, --out, --cache-dir and --no-progress serve several ways).
_DECODE_FLAGS = ("--impls", "--caches", "--repeats", "--no-curves", "--no-batch", "--deadline", "--warm-compile-cache",
                 "--sliding-window")
_MEMORY_FLAGS = ("--prompt-lengths", "--prefill-chunk", "--memory-limit-gb", "--backends")
_IGNORED = {"--compare": (*_DECODE_FLAGS, *_MEMORY_FLAGS, "--model", "--cache-dir"),
            "--prefill-memory": (*_DECODE_FLAGS, "--meshes"),
            "--meshes": (*_MEMORY_FLAGS, "--repeats", "--deadline", "--warm-compile-cache"),
            "a decode bench": _MEMORY_FLAGS}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _refuse_ignored(args: argparse.Namespace, way: str, why: str, instead: str = "") -> None:
    given = [flag for flag in _IGNORED[way] if getattr(args, _dest(flag)) != args.flag_defaults[flag]]
    if given:
        raise InputError(f"{way} would ignore {', '.join(given)} ({why}): {instead}leave "
                         f"{'it' if len(given) == 1 else 'them'} out")


def _mesh(text: str) -> MeshShape:
    try:
        return parse_mesh(text)
    except MeshError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    if args.compare:
        return run_compare(args)
    try:
        import matplotlib  # noqa: F401 - the report's plots; an optional extra
    except ImportError:
        raise UnavailableError("twincache bench draws its plots with matplotlib, which is not installed: "
                               "pip install 'twincache[bench]'") from None
    from bench.runner import Options, run_bench

    if args.prefill_memory:
        _refuse_ignored(args, "--prefill-memory", "flags of the decode bench")
        return run_prefill_memory(args)
    if args.meshes:
        _refuse_ignored(args, "--meshes", "it times one generation per backend and mesh")
        if args.caches == ["sliding_window"]:
            raise InputError("--meshes runs the static cache only (bench/mesh.py): leave --caches out")
    else:
        _refuse_ignored(args, "a decode bench", "flags of --prefill-memory", "add --prefill-memory, or ")
    if args.repeats is not None and args.repeats < 1:
        raise InputError(f"--repeats={args.repeats} must be >= 1")
    if args.deadline is not None and not args.deadline >= 0:  # NaN too: it would never pass
        raise InputError(f"--deadline={args.deadline} must be a number of seconds >= 0 (inf: none)")
    check_window_flag(args.sliding_window)
    preset = resolve(PRESETS[args.preset], args.model, args.sliding_window)
    # the mesh bench runs the static cache only (bench.mesh.CACHE): a model without a window needs no flag there
    if "sliding_window" in args.caches and preset.model_config.sliding_window is None and not args.meshes:
        raise InputError(f"{args.model} has no sliding window, so the sliding_window cache cannot run; give it one "
                         "with --sliding-window N, or pass --caches static")
    from bench.runner import tokens_reached

    limit = preset.model_config.max_position_embeddings
    sweeps = not args.meshes  # a mesh bench runs the decode table's workload only
    for phase, tokens in tokens_reached(preset, sweeps and not args.no_curves, sweeps and not args.no_batch).items():
        if tokens > limit:  # every run of the phase would be refused: say so before any of them
            skip = {"latency curve": ", or skip it with --no-curves", "batch sweep": ", or skip it with --no-batch"}
            shorter = ("use a preset with shorter runs (--preset tiny)" if preset.name != "tiny"
                       else f"tiny is the shortest preset: give a model of at least {tokens} positions")
            raise InputError(f"preset {preset.name}'s {phase} runs {tokens} tokens (prompt + new), but "
                             f"{args.model}'s max_position_embeddings={limit} holds {limit}; {shorter}"
                             f"{skip.get(phase, '')}")
    if preset.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"preset {preset.name} needs a CUDA GPU; none is visible (use --preset small on CPU)")
    out = args.out if args.out is not None else Path("bench_out") / preset.name
    writable_directory(out, "--out", "pass --out a directory where results can be written")  # before hours of work
    _check_cache_dir(args.cache_dir)
    if args.meshes:
        from bench.mesh import RanksFailed, mesh_impls, run_mesh_bench

        modes = mesh_impls(args.impls)
        meshes = list(dict.fromkeys(args.meshes))  # a mesh given twice (model=2 model=2,data=1) runs once
        try:
            run_mesh_bench(preset, out, meshes, list(modes), args.cache_dir, modes)
        except RanksFailed as ranks:
            return ranks.code
        print(f"bench: wrote {out / 'mesh.json'} and {out / 'mesh.md'}", file=sys.stderr)
        return 0
    opts = Options(preset=preset, out=out, impls=args.impls or list(preset.impls), caches=args.caches,
                   repeats=args.repeats, curves=not args.no_curves, batch=not args.no_batch, cache_dir=args.cache_dir,
                   fresh_compile_cache=not args.warm_compile_cache, deadline_s=args.deadline,
                   progress=not args.no_progress)
    records = run_bench(opts)
    failed = [r for r in records if r["kind"] == "decode" and r["status"] not in ("ok", "unavailable", "skipped")]
    skipped = [r for r in records if r["kind"] == "decode" and r["status"] == "skipped"]
    from bench.report import figures

    plots = figures(records)
    print(f"bench: wrote {out / 'results.json'}, {out / 'results.md'}"
          + (f" and {', '.join(plots)}" if plots else " (no plots: nothing measured to draw)")
          + (f"; {len(failed)} cell(s) failed, see results.md" if failed else "")
          + (f"; {len(skipped)} cell(s) skipped at the deadline" if skipped else ""), file=sys.stderr)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """Two runs side by side; nothing is measured, so no plots and no probes."""
    import json

    from bench import compare

    if args.prefill_memory or args.meshes:
        raise InputError("--compare reads two runs' results.json; it takes no --prefill-memory or --meshes (compare "
                         "decode tables: the runs `twincache bench --preset P --out DIR` writes)")
    _refuse_ignored(args, "--compare", "it reads two earlier runs and runs nothing")
    old_path, new_path = args.compare
    result = compare.compare(compare.load_run(old_path), compare.load_run(new_path))
    text = compare.markdown(result, old_path, new_path)
    if args.out is not None:
        writable_directory(args.out, "--out", "pass --out a directory where the comparison can be written")
        (args.out / "compare.md").write_text(text, encoding="utf-8")
        (args.out / "compare.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"bench: wrote {args.out / 'compare.md'} and {args.out / 'compare.json'}", file=sys.stderr)
    print(text, end="")
    return 0


def _check_cache_dir(cache_dir: Path | None) -> None:
    """--cache-dir as --out: a file there (or no write permission) is one line naming it, not a FileExistsError."""
    if cache_dir is not None:
        writable_directory(cache_dir, "--cache-dir", "pass --cache-dir a directory where the bench's random "
                                                     "checkpoints can be built (or leave it out)")


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or max(lengths) > INT32_MAX:  # positions are int32
        raise argparse.ArgumentTypeError(f"{text!r}: give prompt lengths in [1, {INT32_MAX}], comma-separated, e.g. "
                                         "1000,10000")
    return list(dict.fromkeys(lengths))  # a length given twice is one point, not two into one table cell


def run_prefill_memory(args: argparse.Namespace) -> int:
    """The sweep on the preset's model (tiny by default: its random weights, seconds per point), or on --model."""
    from bench.workload import preset_checkpoint

    if not 1 <= args.prefill_chunk <= INT32_MAX:  # else every chunked point failed alone, and the run exited 0
        raise InputError(f"--prefill-chunk={args.prefill_chunk} must be in [1, {INT32_MAX}] (positions are int32)")
    if not 0 < args.memory_limit_gb < math.inf:  # the watchdog compares a byte count: inf has none
        raise InputError(f"--memory-limit-gb={args.memory_limit_gb} must be a finite number of GB > 0 (the RSS at "
                         "which a point is killed)")
    if args.model is not None and not args.model.is_dir():
        raise InputError(f"--prefill-memory --model {args.model} is not a checkpoint directory; the sweep runs on a "
                         "copy of its config.json (a GGUF file has none): give an HF checkpoint directory")
    preset = resolve(PRESETS[args.preset], args.model)
    _check_cache_dir(args.cache_dir)
    model = preset_checkpoint(preset, args.cache_dir)
    if model is None:
        raise InputError(f"--prefill-memory measures a CPU process's RSS; preset {preset.name} builds its weights on "
                         "a GPU: use --preset tiny, small or trained, or give --model DIR")
    lengths = args.prompt_lengths or list(prefill_memory.DEFAULT_LENGTHS if args.model is not None
                                          else prefill_memory.PRESET_LENGTHS.get(preset.name,
                                                                                 prefill_memory.DEFAULT_LENGTHS))
    out = args.out if args.out is not None else Path("bench_out") / f"prefill_memory-{preset.name}"
    writable_directory(out, "--out", "pass --out a directory where results can be written")
    prefill_memory.sweep(args.backends, model, lengths, args.prefill_chunk, args.memory_limit_gb, out,
                         progress=not args.no_progress)
    print(f"bench: wrote {out / 'prefill_memory.json'}, {out / 'prefill_memory.md'} and prefill_memory.png",
          file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench`: the same flags as `twincache bench`, through twincache's one-line error handling."""
    from twincache_app.cli import main as twincache_main

    return twincache_main(["bench", *(sys.argv[1:] if argv is None else argv)])
