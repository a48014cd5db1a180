"""Run by parity_tests/test_mesh.py in 2 gloo processes (twincache_app.launch.run_ranks): every torch mesh case
on the meshes model=2 and data=2, each rank writing what it saw to OUT/torch_rank{R}.json (tokens, its shards' bytes,
buffer addresses, graph counts) and its step logits to OUT/torch_rank{R}.npz. It judges nothing: the tests do.

    python -m parity_tests.mesh_torch_worker OUT GQA_DIR MQA_DIR     (as each rank of a torch.distributed world)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import torch_cache.generate as tg
from parity_tests import mesh_weights
from parity_tests.mesh_weights import reload_at_the_boundary
from torch_cache import backend, sharding
from torch_cache.cache import make_cache
from torch_cache.model import Mistral
from twincache.generation import SamplingParams
from twincache_app import launch

NEW_TOKENS = 20  # window 8, prompts of up to 12 tokens: each ring wraps several times
PROMPT_LENGTHS = (1, 3, 5, 7, 9, 11, 2, 12)  # a left-padded batch; data=2 gives each rank 4 rows
# (checkpoint, data, model, cache, mode)
CASES = (
    ("gqa", 1, 2, "static", "eager"),
    ("mqa", 1, 2, "sliding_window", "eager"),  # 1 KV head on model=2: replicated on both ranks
    ("gqa", 2, 1, "static", "eager"),
    ("gqa", 1, 2, "sliding_window", "compiled"),
)

CHUNKED_LENGTHS = (13, 6, 10)  # a chunked prefill's prompts (as in mesh_jax_worker), in chunks of CHUNK
CHUNK = 4


def prompts(vocab: int, salt: int = 0) -> list[list[int]]:
    return [[1] + [(7 * row + 3 * i + salt) % (vocab - 2) + 2 for i in range(length - 1)]
            for row, length in enumerate(PROMPT_LENGTHS)]


def main(out: Path, checkpoints: dict[str, Path]) -> None:
    torch.set_num_threads(1)  # two ranks on two cores (docs/design.md §7.11)
    launch.init_rank()
    rank = dist.get_rank()
    meshes = {(1, 2): sharding.make_mesh(model=2), (2, 1): sharding.make_mesh(data=2)}
    single = {name: Mistral.from_pretrained(path) for name, path in checkpoints.items()}
    record: dict[str, object] = {"rank": rank, "world": dist.get_world_size(), "cases": []}
    logits: dict[str, np.ndarray] = {}
    for index, (name, data, model_ways, kind, mode) in enumerate(CASES):
        model = Mistral.from_pretrained(checkpoints[name], mesh=meshes[(data, model_ways)])
        vocab = model.config.vocab_size
        reference = tg.generate(single[name], prompts(vocab), NEW_TOKENS, cache=kind, compile=False,
                                return_logits=True)
        cache = make_cache(kind, model.config, len(PROMPT_LENGTHS), 12 + NEW_TOKENS, model.dtype, mesh=model.mesh)
        addresses = [buffer.data_ptr() for buffer in cache.arrays()]
        graphs = backend.compiled_variants()
        result = tg.generate(model, prompts(vocab), NEW_TOKENS, cache=cache, compile=mode == "compiled",
                             return_logits=True)
        case = {"checkpoint": name, "data": data, "model": model_ways, "cache": kind, "mode": mode,
                "prompts": prompts(vocab), "tokens": result.token_ids, "reference_tokens": reference.token_ids,
                "addresses_kept": [buffer.data_ptr() for buffer in result.cache.arrays()] == addresses,
                "kv_shard": {"shape": list(cache.keys[0].shape), "bytes": sharding.device_bytes([cache.keys[0]]),
                             "whole_bytes": cache.batch_size * cache.num_kv_heads * cache.cache_len * cache.head_dim
                             * cache.keys[0].element_size()},
                "weights": {pname: {"bytes": sharding.device_bytes([param]), "shape": list(param.shape),
                                    "sum": float(param.double().sum()),
                                    "whole_bytes": single[name].get_parameter(pname).untyped_storage().nbytes()}
                            for pname, param in model.named_parameters()}}
        case["weights_check"] = weights_check(checkpoints[name], model)
        if mode == "compiled":
            case["graphs_first"] = backend.compiled_variants() - graphs
            torch.compiler.set_stance("fail_on_recompile")
            try:  # another generation of the same shapes must reuse the graph: a recompile raises here
                tg.generate(model, prompts(vocab, salt=5), NEW_TOKENS, cache=cache, compile=True)
                case["recompiled"] = False
            except RuntimeError as err:
                case["recompiled"] = str(err).splitlines()[0]
            finally:
                torch.compiler.set_stance("default")
        logits[f"case{index}"] = result.step_logits.numpy()
        logits[f"case{index}_reference"] = reference.step_logits.numpy()
        record["cases"].append(case)
    record["chunked"] = chunked(checkpoints["gqa"], single["gqa"], meshes)
    record["continued"] = continued(checkpoints["gqa"], single["gqa"], meshes[(2, 1)])
    record["padded"] = padded(checkpoints["gqa"], single["gqa"], meshes[(2, 1)], out / f"eos_rank{rank}")
    (out / f"torch_rank{rank}.json").write_text(json.dumps(record))
    np.savez(out / f"torch_rank{rank}.npz", **logits)
    launch.finish_rank()


def weights_check(path: Path, model: Mistral) -> dict[str, object]:
    """Load onto the model's mesh again with the host reporting one byte less than this rank's loaded parameters
    hold, then exactly that: the refusal, and the load (every rank is refused alike, before any collective)."""
    held = sum(param.numel() * param.element_size() for param in model.parameters())
    return reload_at_the_boundary(lambda: Mistral.from_pretrained(path, mesh=model.mesh).mesh is model.mesh, held)


def chunked(checkpoint: Path, single: Mistral, meshes: dict[tuple, object]) -> list[dict[str, object]]:
    """A prefill in chunks of CHUNK on each mesh (every rank runs the same chunks, so their collectives pair up),
    3 rows (padded to 4 on data=2) whose prompts wrap the ring of 8: against one device prefilling at once."""
    vocab = single.config.vocab_size
    rows = [[1] + [(5 * row + 3 * i + 1) % (vocab - 2) + 2 for i in range(length - 1)]
            for row, length in enumerate(CHUNKED_LENGTHS)]
    reference = tg.generate(single, rows, NEW_TOKENS, cache="sliding_window", compile=False)
    cases = []
    for (data, model_ways), mesh in meshes.items():
        model = Mistral.from_pretrained(checkpoint, mesh=mesh)
        result = tg.generate(model, rows, NEW_TOKENS, cache="sliding_window", compile=False, prefill_chunk=CHUNK)
        cases.append({"data": data, "model": model_ways, "chunk": CHUNK, "prompts": rows, "tokens": result.token_ids,
                      "reference_tokens": reference.token_ids})
    return cases


def continued(checkpoint: Path, single: Mistral, mesh: object) -> dict[str, object]:
    """3 rows on data=2 (generate pads a copy of the last row, which its result leaves out and its cache keeps),
    4 tokens, then continue_generation from the result's last tokens for 5 more, as README shows: against one device
    generating all 9 at once."""
    rows = [[1, 5, 9, 7], [1, 5], [1, 8, 8]]
    model = Mistral.from_pretrained(checkpoint, mesh=mesh)
    first = tg.generate(model, rows, 4, cache="sliding_window", compile=False)
    more = tg.continue_generation(model, first.cache, [row[-1] for row in first.token_ids], 5, compile=False)
    reference = tg.generate(single, rows, 9, cache="sliding_window", compile=False)
    return {"tokens": [a + b for a, b in zip(first.token_ids, more.token_ids, strict=True)],
            "reference_tokens": reference.token_ids}


def padded(checkpoint: Path, single: Mistral, mesh: object, directory: Path) -> dict[str, object]:
    """One sampled row on data=2, with an EOS id it emits and its padding copy never does (mesh_weights.pick_eos):
    the tokens, the decode steps, and one device's free run that picked the id."""
    sampling = SamplingParams(temperature=mesh_weights.PADDED_TEMPERATURE, seed=mesh_weights.PADDED_SEED)
    prompt = mesh_weights.PADDED_PROMPT
    free = tg.generate(single, [prompt, prompt], NEW_TOKENS, sampling=sampling, compile=False).token_ids
    step, eos = mesh_weights.pick_eos(free)
    model = Mistral.from_pretrained(mesh_weights.checkpoint_with_eos(checkpoint, eos, directory), mesh=mesh)
    run = tg.generate(model, [prompt], NEW_TOKENS, sampling=sampling, compile=False)
    return {"free": free, "eos_step": step, "tokens": {"eager": run.token_ids},
            "decode_steps": {"eager": run.decode_steps}}


if __name__ == "__main__":
    assert "RANK" in os.environ, "run as a rank of a torch.distributed world (twincache_app.launch.run_ranks)"
    main(Path(sys.argv[1]), {"gqa": Path(sys.argv[2]), "mqa": Path(sys.argv[3])})
