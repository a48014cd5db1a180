"""`twincache parity --mesh model=N[,data=M]`: each backend split over a mesh, against itself on one device and against
transformers, at every decode step (docs/design.md §10).

The sequence is the prompt plus one greedy continuation made on one device (as in `twincache parity`); every run is
teacher-forced through it by the backend's `step_logits`, the sharded runs through the same real decode paths.
torch's sharded run needs one process per device: the command re-runs itself in them (twincache_app.launch), every
rank runs the torch mesh steps, and rank 0 alone runs everything else and prints. Each pair is judged by
`judge`, the project's parity rule (docs/design.md §4), in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from twincache.config import MistralConfig
from twincache.errors import InputError
from twincache.generation import validate_prompts
from twincache.mesh import MeshShape
from twincache_app import launch
from twincache_app.backends import BACKENDS
from twincache_app.generate_cmd import start_mesh
from twincache_app.parity import (
    Implementations,
    PairReport,
    compare_logits,
    format_table,
    greedy_sequence,
    load_implementations,
    transformers_step_logits,
)


def judge(reference: np.ndarray, candidate: np.ndarray, dtype: str) -> dict[str, Any]:
    """The verdict on a sharded run's step logits [steps, V] against a reference's: the project's parity rule."""
    return compare_logits(reference, candidate, dtype)


def sharded_label(backend: str, mode: str, mesh: MeshShape, all_modes: bool) -> str:
    return f"{backend}{':' + mode if all_modes else ''}@{mesh}"


def _share(sequence: list[int] | None) -> list[int]:
    """Rank 0's sequence on every rank of a torch world (unchanged outside one)."""
    if not launch.in_world():
        return sequence
    import torch.distributed as dist

    box = [sequence]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mesh_reports(single: Implementations, sharded: dict[str, Any], mesh: MeshShape, prompt_ids: list[int],
                 max_new_tokens: int, dtype: str, caches: Sequence[str], all_modes: bool = False) -> list[PairReport]:
    """For each cache kind, backend and mode: the sharded run against the same backend on one device, and against
    transformers when it is loaded. `single` is empty on ranks other than 0, which run their torch steps only."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 1 for a parity run")
    lead = bool(single.models)
    if lead:
        validate_prompts([prompt_ids], next(iter(single.models.values())).config)
    sequence = _share(greedy_sequence(single, prompt_ids, max_new_tokens) if lead else None)
    prompt_len = len(prompt_ids)
    reference = transformers_step_logits(single.transformers, sequence, prompt_len) if single.transformers else None
    reports = []
    for cache in caches:
        for name, model in sharded.items():
            backend = BACKENDS[name]
            tower = backend.module()
            for mode in backend.modes if all_modes else [backend.default_mode]:
                candidate = tower.step_logits(model, sequence, prompt_len, cache, mode)
                if not lead:
                    continue
                label = sharded_label(name, mode, mesh, all_modes)
                pairs = {f"{name}:{mode}" if all_modes else name:
                         tower.step_logits(single.models[name], sequence, prompt_len, cache, mode)}
                if reference is not None:
                    pairs["transformers"] = reference
                for ref_label, ref_logits in pairs.items():
                    reports.append(PairReport(cache=cache, reference=ref_label, candidate=label, dtype=dtype,
                                              **judge(ref_logits, candidate, dtype)))
    return reports


def run(args: argparse.Namespace, config: MistralConfig, model_dir: Path, prompt_ids: list[int],
        caches: Sequence[str], backends: Sequence[str]) -> int:
    code = start_mesh(args, config, [BACKENDS[name] for name in backends])
    if code is not None:
        return code
    lead = launch.rank() == 0
    single = (load_implementations(model_dir, args.dtype, not args.no_transformers, backends) if lead
              else Implementations({}))
    sharded = {name: BACKENDS[name].module().load(model_dir, args.dtype, mesh=args.mesh) for name in backends
               if lead or BACKENDS[name].mesh_processes}
    reports = mesh_reports(single, sharded, args.mesh, prompt_ids, args.max_new_tokens, args.dtype, caches,
                           args.modes == "all")
    passed = all(r.within_bounds for r in reports)
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"model": str(model_dir), "dtype": args.dtype, "prompt_len": len(prompt_ids),
                          "mesh": str(args.mesh), "transformers_compared": single.transformers is not None,
                          "passed": passed, "pairs": [dataclasses.asdict(r) for r in reports]}))
    else:
        print(format_table(reports))
        print(f"{'PASS' if passed else 'FAIL'}: {sum(r.within_bounds for r in reports)}/{len(reports)} pairs within "
              f"the {args.dtype} bounds (mesh {args.mesh})", file=sys.stderr)
    return 0 if passed else 1


__all__ = ["judge", "sharded_label", "mesh_reports", "run"]
