"""`twincache bench --meshes model=1 model=2 model=4,data=2 ...`: per-device bytes (weights and KV) and decode tok/s
against the mesh shape, for each backend (docs/design.md §10). Writes DIR/mesh.json and DIR/mesh.md.

Bytes are read from the arrays each device holds (JAX: addressable shards; torch: each rank's tensors), never computed
from shapes. JAX runs every mesh in this process, on CPU devices it simulates (XLA_FLAGS, set before JAX starts) or
on the GPUs; JAX meshes with model > 1 also run with the embedding and LM head replicated instead of split over the
vocabulary, the measurement behind that choice. torch runs each mesh in its own ranks (twincache_app.launch), each
writing its record; rank r's bytes are listed as device "rank r". On a 2-core CPU simulated devices share the cores:
the bytes are the figure, the tok/s mostly measure collective overhead (bench/gpu_mesh.sh is the GPU run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.presets import Preset
from bench.workload import Workload
from twincache import errors
from twincache.checkpoint import load_config, open_checkpoint
from twincache.config import MistralConfig
from twincache.errors import InputError
from twincache.mesh import MeshShape, parse_mesh, plan_shards, split_mesh
from twincache_app import launch
from twincache_app.backends import BACKENDS
from twincache_app.bench_adapters import mesh_record

BATCH = 2  # rows per data shard: a batch of BATCH x data keeps every device's rows the same across meshes
CACHE = "static"
_RANK_INPUTS = "inputs.json"  # what a torch rank runs, written by its launcher
_RANK_ERROR = ".error.json"  # rank{R}.error.json: [error class, message] of a rank that refused


def mesh_impls(impls: Sequence[str] | None) -> dict[str, str]:
    """backend -> mode for the mesh bench: from impl names backend_mode (e.g. torch_eager), else every backend in its
    default mode."""
    if not impls:
        return {name: backend.default_mode for name, backend in BACKENDS.items()}
    chosen = {}
    for impl in impls:
        name, _, mode = impl.partition("_")
        if name not in BACKENDS or mode not in BACKENDS[name].modes:
            raise InputError(f"--meshes runs the backends only; {impl} is not one of "
                             f"{', '.join(f'{b}_{m}' for b in BACKENDS for m in BACKENDS[b].modes)}")
        chosen[name] = mode
    return chosen


def workload_inputs(preset: Preset, mesh: MeshShape,
                    cache_dir: Path | None) -> tuple[Path, MistralConfig, list[list[int]]]:
    """The checkpoint, the config every run uses (the preset's as resolved: --model's, EOS off, --sliding-window) and
    the prompts of `mesh`'s batch."""
    workload = Workload(preset, preset.device, cache_dir)
    if workload.model_dir is None:
        raise ValueError(f"preset {preset.name} builds its weights on the device; the mesh bench loads a checkpoint "
                         "directory on every rank, so use a CPU preset (tiny, small)")
    return workload.model_dir, workload.config, workload.prompts(BATCH * mesh.data, preset.prompt_len)


def run_mesh_bench(preset: Preset, out: Path, meshes: Sequence[MeshShape], backends: Sequence[str],
                   cache_dir: Path | None = None, modes: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every backend (in its mode of `modes`, default its default) on every mesh; returns the records and writes
    DIR/mesh.json and DIR/mesh.md."""
    modes = modes or {}
    # What torch's ranks would refuse (as their tracebacks) is refused here in one line before anything runs: a
    # checkpoint that cannot be read, a mesh that cannot split the model.
    model_dir, config, _ = workload_inputs(preset, meshes[0], cache_dir)
    if model_dir.is_dir():
        open_checkpoint(model_dir)  # reads the config and every tensor's header, no weights
    else:
        load_config(model_dir)  # a GGUF: validated whole when opened
    for mesh in meshes:
        plan_shards(config, mesh)
        if any(BACKENDS[name].mesh_processes for name in backends):
            launch.check_torch_devices(mesh)
    if "jax" in backends:
        launch.simulate_cpu_devices(max(meshes, key=lambda mesh: mesh.devices))
    records = []
    for name in backends:
        backend = BACKENDS[name]
        for mesh in meshes:
            model_dir, config, prompts = workload_inputs(preset, mesh, cache_dir)
            mode = backend.check_mode(modes.get(name))
            if backend.mesh_processes and split_mesh(mesh) is not None:  # one device: no rank, this process
                records.append(_ranks_record(model_dir, config, preset, mesh, prompts, mode))
                continue
            for vocabulary in ("split", "replicated") if mesh.model > 1 else ("split",):
                records.append(mesh_record(backend, model_dir, config, preset.dtype, mesh, prompts,
                                           preset.new_tokens, CACHE, vocabulary, mode))
    for record in records:
        record["preset"] = preset.name
        record["model"] = None if preset.model_dir is None else str(preset.model_dir)  # --model's; None: random
        record["weights_max_bytes"] = max(record["weights_bytes"].values())
        record["kv_max_bytes"] = max(record["kv_bytes"].values())
    out.mkdir(parents=True, exist_ok=True)
    (out / "mesh.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / "mesh.md").write_text(markdown(records))
    return records


def _ranks_record(model_dir: Path, config: MistralConfig, preset: Preset, mesh: MeshShape,
                  prompts: list[list[int]], mode: str) -> dict[str, Any]:
    """torch on `mesh`: one process per device, each running exactly this process's inputs (written for them, not
    recomputed from the preset's name, which would drop --model and --sliding-window) and writing its record; merged
    with each rank's bytes."""
    with launch.rank_folder() as folder:  # removed by a later launch if this one is killed outright
        inputs = {"model_dir": str(model_dir), "config": dataclasses.asdict(config), "dtype": preset.dtype,
                  "mesh": str(mesh), "prompts": prompts, "new_tokens": preset.new_tokens, "mode": mode}
        (folder / _RANK_INPUTS).write_text(json.dumps(inputs))
        code = launch.run_ranks(["--rank-of", str(folder)], mesh.devices, module="bench.mesh")
        refused = sorted(folder.glob(f"rank*{_RANK_ERROR}"))
        if refused:  # a rank refused in one line (it printed nothing): the same error here, named once
            kind, message = json.loads(refused[0].read_text())
            if not isinstance(getattr(errors, kind, None), type):  # a rank's own bug: named, still one line
                raise errors.TwincacheError(f"a torch rank of mesh {mesh} failed: unexpected {kind}: {message}")
            raise getattr(errors, kind)(message)
        if code != 0:  # the launcher said why (a rank killed, or lost) in its one line: nothing more to say
            raise RanksFailed(code)
        ranks = [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]
    record = ranks[0]
    for field in ("weights_bytes", "kv_bytes"):
        record[field] = {f"rank {r}": sum(rank[field].values()) for r, rank in enumerate(ranks)}
    return record


class RanksFailed(Exception):
    """torch's ranks of a mesh ended with exit `code`, and the launcher has printed the one line that says why (a rank
    killed by a signal, or one that failed on its own): the bench ends with that code and prints nothing more. It
    raised RuntimeError, a second line: "unexpected RuntimeError: the torch ranks of mesh ... failed (exit 2)"."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the torch ranks failed (exit {code}); the launcher said why")
        self.code = code


def markdown(records: list[dict[str, Any]]) -> str:
    first = records[0] if records else {}
    model = f" on `{first['model']}`" if first.get("model") else ""  # a --model run: its weights, not the preset's
    lines = [f"# twincache bench: one model and one cache across devices, preset `{first.get('preset')}`{model}", "",
             "Bytes per device are read from what each device holds (the largest share is shown); tok/s is the "
             "steady decode rate of one generation after a warm-up.", "",
             "| backend | mode | mesh | vocabulary | devices | weights / device | KV / device | decode tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['backend']} | {r['mode']} | {r['mesh']} | {r['vocabulary']} | {len(r['weights_bytes'])} | "
                     f"{r['weights_max_bytes'] / 1e6:.2f} MB | {r['kv_max_bytes'] / 1e6:.3f} MB | "
                     f"{r['decode_tok_s']:.1f} |")
    return "\n".join(lines) + "\n"


def _rank_main(argv: Sequence[str]) -> None:
    """A torch rank of one mesh: measure the inputs its launcher wrote and write FOLDER/rank{R}.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-of", required=True)  # the folder of _RANK_INPUTS
    launch.follow_launcher()  # Ctrl-C is the launcher's to handle; and end with it
    folder = Path(parser.parse_args(argv).rank_of)
    inputs = json.loads((folder / _RANK_INPUTS).read_text())
    launch.init_rank()
    try:
        record = mesh_record(BACKENDS["torch"], Path(inputs["model_dir"]), MistralConfig(**inputs["config"]),
                             inputs["dtype"], parse_mesh(inputs["mesh"]), inputs["prompts"], inputs["new_tokens"],
                             CACHE, mode=inputs["mode"])
    except Exception as err:  # noqa: BLE001 - for the launcher to raise: one line, not every rank's traceback
        (folder / f"rank{launch.rank()}{_RANK_ERROR}").write_text(json.dumps([type(err).__name__, str(err)]))
        sys.exit(2)
    (folder / f"rank{launch.rank()}.json").write_text(json.dumps(record))
    launch.finish_rank()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
