"""`twincache parity --mesh model=N[,data=M]`: each implementation split over a mesh, judged by the float64 rule of
`twincache parity` (docs/design.md §4 and §10).

The reference and the floor are plain parity's (`parity.load_models`: transformers in float64 chooses the greedy
continuation, transformers in the dtype under test is the floor). Each implementation on the mesh is teacher-forced
with that continuation through its real decode path and judged against the floor exactly like parity's
implementation rows (`parity.parity_report`, given the sharded towers), and gets one more row: itself on the mesh vs
itself on one device, judged like the direct torch-vs-JAX rows. torch's sharded run needs one process per device:
the command re-runs itself in them (twincache_app.launch); rank 0 computes the reference, sends the continuation to
the other ranks, and runs and prints everything; the other ranks make exactly the same torch `generate` calls (the
collectives) in the same order, and nothing else. Each torch rank holds only its shard of the cache, so a torch
mesh's K/V distance is left unmeasured (n/a); JAX's sharded cache gathers to the host and is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from twincache import parity_metrics
from twincache.config import MistralConfig
from twincache.errors import NonFiniteLogitsError
from twincache_app import launch
from twincache_app.backends import BACKENDS
from twincache_app.generate_cmd import set_window, start_mesh
from twincache_app.parity import (
    Models,
    Oracle,
    ParityReport,
    Row,
    float64_reference,
    judged_row,
    load_models,
    parity_report,
    run_implementation,
)


def judge(reference: Oracle, floor: Oracle, single: np.ndarray, sharded: np.ndarray, dtype: str) -> Row:
    """A sharded run's step logits [B, N, V] against the same implementation's on one device, over the same tokens:
    judged like a direct row of `twincache parity`, against the floor's distance from the float64 reference (their
    Oracles over those rows and tokens). The rule is parity's own (twincache.parity_metrics)."""
    decisive = parity_metrics.decisive_steps(reference.logits, floor.logits, dtype)  # [B, N]
    floor_distance = parity_metrics.distance(reference.logits, floor.logits, decisive)
    return judged_row("", "sharded vs one device", "direct", parity_metrics.distance(single, sharded, decisive),
                      floor_distance, dtype)


def _share(tokens: list[list[int]] | None) -> list[list[int]]:
    """Rank 0's continuation on every rank of a torch world (unchanged outside one)."""
    box = [tokens]
    if launch.in_world():
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0)
    assert box[0] is not None  # rank 0 shares its own tokens; outside a world only rank 0 runs
    return box[0]


def mesh_report(args: argparse.Namespace, config: MistralConfig, model_dir: Path, prompts: list[list[int]],
                caches: Sequence[str], impls: Sequence[str]) -> ParityReport | int | None:
    """The report on rank 0 (or without ranks); None on the other ranks; an exit code where this process launched
    the ranks (rank 0 printed)."""
    names = list(dict.fromkeys(impl.split(":")[0] for impl in impls))
    code = start_mesh(args, config, [BACKENDS[name] for name in names])
    if code is not None:
        return code
    lead = launch.rank() == 0
    # Every rank loads its torch shard (rank 0 also the JAX mesh model), in the same order.
    towers = {name: set_window(BACKENDS[name].module().load(model_dir, args.dtype, mesh=args.mesh),
                               args.sliding_window) for name in names if lead or BACKENDS[name].mesh_processes}
    if not lead:  # the torch generate calls rank 0's parity_report makes, in its order: cache, then implementation
        tokens = _share(None)
        sharded = Models(towers, None, None, mesh=args.mesh)
        for cache in caches:
            for impl in impls:
                if impl.split(":")[0] in towers:
                    # NaN logits are gathered to every rank: rank 0 makes that run a failed row and goes on, so do we
                    with contextlib.suppress(NonFiniteLogitsError):
                        run_implementation(impl, sharded, prompts, tokens, cache)
        return None
    single = load_models(model_dir, args.dtype, with_transformers=not args.no_transformers, impls=impls,
                         sliding_window=args.sliding_window)
    reference = float64_reference(single.reference, prompts, args.max_new_tokens, single.why_not_transformers)
    _share(reference.tokens)
    sharded = dataclasses.replace(single, towers=towers, mesh=args.mesh)
    return parity_report(sharded, prompts, args.max_new_tokens, args.dtype, caches, impls, reference=reference,
                         single=single)


__all__ = ["judge", "mesh_report"]
