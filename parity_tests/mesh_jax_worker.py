"""Run by parity_tests/test_mesh.py in a subprocess with 8 simulated CPU devices, so the rest of the suite keeps
one: it decodes every mesh case and writes what it saw to OUT/jax.json (tokens, trace counts, per-device bytes read
from addressable shards, buffer pointers, warnings), the step logits to OUT/jax_logits.npz and the compiled HLO to
OUT/*.hlo. It judges nothing: the tests do.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m parity_tests.mesh_jax_worker OUT GQA_DIR MQA_DIR
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_cache.generate as jg
from jax_cache import backend, sharding
from jax_cache.cache import StaticCache
from jax_cache.model import Mistral
from parity_tests import mesh_weights
from parity_tests.mesh_weights import reload_at_the_boundary
from twincache.generation import SamplingParams

NEW_TOKENS = 20  # with the tests' window of 8 and prompts of up to 12 tokens: each ring wraps several times
# A left-padded batch of 8 rows of different lengths (8 rows: the data axis of the 8 x 1 mesh splits them one each).
PROMPT_LENGTHS = (1, 3, 5, 7, 9, 11, 2, 12)
# (checkpoint, data, model, cache, mode): the 2 x 4 mesh covers both axes; KV heads are replicated in groups for GQA
# (2 KV heads on model 4) and MQA (1 KV head on model 4 and 8); 8 x 1 splits the batch alone.
CASES = (
    ("gqa", 2, 4, "sliding_window", "fused"),
    ("gqa", 2, 4, "sliding_window", "step"),
    ("mqa", 2, 4, "static", "fused"),
    ("mqa", 2, 4, "sliding_window", "step"),
    ("mqa", 1, 8, "static", "step"),
    ("gqa", 8, 1, "static", "fused"),
)
HANDOFF = ("gqa", 2, 4, "sliding_window")  # a torch cache continues on this JAX mesh
HANDOFF_TORCH_TOKENS = 6
# A chunked prefill on this mesh (each mode): chunks of 4 columns, shorter than the window of 8, over 3 rows (padded
# to 4 for the data axis) whose prompts of up to 13 tokens wrap the ring during the prefill.
CHUNKED = ("gqa", 2, 4, "sliding_window")
CHUNKED_LENGTHS = (13, 6, 10)
CHUNK = 4


def prompts(vocab: int, salt: int = 0) -> list[list[int]]:
    return [[1] + [(7 * row + 3 * i + salt) % (vocab - 2) + 2 for i in range(length - 1)]
            for row, length in enumerate(PROMPT_LENGTHS)]


def shard_bytes(array: jax.Array) -> dict[str, object]:
    return {"nbytes": int(array.nbytes), "per_device": sharding.device_bytes([array])}


def pointers(arrays: list[jax.Array]) -> list[list[int]]:
    return [[shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards] for array in arrays]


def written_in_place(cache: StaticCache) -> list[jax.Array]:
    """The arrays a step writes in place: every layer's K/V and slot_positions. Deletion checks leave the length
    scalar out: JAX >= 0.11 keeps a donated array alive once the host has read its value (the checks before each
    dispatch read the length), so its is_deleted() tells the JAX version, not the donation, and its output takes a
    new buffer. That it is donated too is read off the compiled step (test_jax_generate.aliased_parameters)."""
    return [*cache.keys, *cache.values, cache.slot_positions]


def main(out: Path, checkpoints: dict[str, Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"devices": jax.device_count(), "cases": [], "weights": {},
                              "weights_check": {}}
    logits: dict[str, np.ndarray] = {}
    single = {name: Mistral.from_pretrained(path) for name, path in checkpoints.items()}
    sharded: dict[tuple, Mistral] = {}
    references: dict[tuple, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, (name, data, model_ways, kind, mode) in enumerate(CASES):
            key = (name, data, model_ways)
            if key not in sharded:
                sharded[key] = Mistral.from_pretrained(checkpoints[name], mesh=sharding.make_mesh(model_ways, data))
                weights = {".".join(map(str, path)): shard_bytes(variable.get_value())
                           for path, variable in nnx.to_flat_state(nnx.state(sharded[key]))}
                record["weights"][f"{name}@{data}x{model_ways}"] = weights
                record["weights_check"][f"{name}@{data}x{model_ways}"] = weights_check(
                    checkpoints[name], sharded[key].mesh, sum(sum(entry["per_device"].values())
                                                              for entry in weights.values()))
            model, vocab = sharded[key], single[name].config.vocab_size
            if (name, kind) not in references:  # one device, fused: the run every mesh is compared with
                references[(name, kind)] = jg.generate(single[name], prompts(vocab), NEW_TOKENS, cache=kind,
                                                       return_logits=True)
            reference = references[(name, kind)]
            before = backend.compiled_variants()
            result = jg.generate(model, prompts(vocab), NEW_TOKENS, cache=kind, fused=mode == "fused",
                                 return_logits=True)
            after_first = backend.compiled_variants()
            again = jg.generate(model, prompts(vocab, salt=5), NEW_TOKENS, cache=kind, fused=mode == "fused",
                                return_logits=True)
            after_second = backend.compiled_variants()
            cache = again.cache
            case = {"checkpoint": name, "data": data, "model": model_ways, "cache": kind, "mode": mode,
                    "prompts": prompts(vocab), "tokens": result.token_ids, "reference_tokens": reference.token_ids,
                    "variants": [before, after_first, after_second],
                    "cache_bytes": {"keys": shard_bytes(cache.keys[0]), "slot_positions": shard_bytes(
                        cache.slot_positions), "length": shard_bytes(cache.length)},
                    "cache_shape": list(cache.keys[0].shape), "cache_spec": str(cache.keys[0].sharding.spec)}
            logits[f"case{index}"] = np.asarray(result.step_logits)
            logits[f"case{index}_reference"] = np.asarray(reference.step_logits)
            if mode == "step":  # continuing steps write the donated cache in place, shard by shard
                first = pointers(written_in_place(cache))
                more = jg.continue_generation(model, cache, [t[-1] for t in again.token_ids], 1, fused=False)
                case["pointers_kept"] = pointers(written_in_place(more.cache)) == first
                case["input_deleted"] = all(array.is_deleted() for array in written_in_place(cache))
            record["cases"].append(case)
        write_hlo(out, sharded[("gqa", 2, 4)], single["gqa"].config.vocab_size, record)
        record["handoff"] = handoff(checkpoints, sharded)
        record["chunked"] = chunked(single, sharded, logits)
        record["padded"] = padded(checkpoints["gqa"], single["gqa"], sharded[("gqa", 2, 4)].mesh, out)
    record["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    (out / "jax.json").write_text(json.dumps(record))
    np.savez(out / "jax_logits.npz", **logits)


def weights_check(path: Path, mesh: jax.sharding.Mesh, held: int) -> dict[str, object]:
    """Load onto `mesh` again with the host reporting one byte less than the `held` bytes every device's shards of
    the loaded weights add up to (the devices share the host's memory), then exactly that: the refusal, and the load."""
    return reload_at_the_boundary(lambda: Mistral.from_pretrained(path, mesh=mesh).mesh is mesh, held)


def write_hlo(out: Path, model: Mistral, vocab: int, record: dict[str, object]) -> None:
    """The compiled streaming step and fused loops on the 2 x 4 mesh, with the per-device and global K/V shapes."""
    graph, params = jg.split_model(model)
    result = jg.generate(model, prompts(vocab), 2, cache="sliding_window", fused=False)
    cache = result.cache
    state = jg.initial_state(jnp.asarray([t[-1] for t in result.token_ids], jnp.int32), cache.next_positions(),
                             cache, (), 0)
    key, knobs = jax.random.key(0), jg._knobs(SamplingParams())
    compiled = jg._sampled_step.lower(graph, params, state, key, knobs, "greedy", (), vocab, None).compile()  # all
    (out / "step.hlo").write_text(compiled.as_text())
    fused = {signature: executable for signature, executable in jg._fused_executables.items()
             if signature[0] == graph}
    for i, executable in enumerate(fused.values()):
        (out / f"fused{i}.hlo").write_text(executable.as_text())
    memory = [executable.memory_analysis() for executable in fused.values()]
    record["hlo"] = {"global_kv": list(cache.keys[0].shape),
                     "local_kv": list(cache.keys[0].addressable_shards[0].data.shape), "fused": len(fused),
                     "state_out_shardings_equal_in": [state_kept(executable) for executable in
                                                      (compiled, *fused.values())],
                     "fused_alias_bytes": [m.alias_size_in_bytes for m in memory],
                     "fused_temp_bytes": [m.temp_size_in_bytes for m in memory]}


def state_kept(compiled: jax.stages.Compiled) -> bool:
    """Whether a compiled step or fused loop returns its decode state (its last output) on the shardings that state
    came in with (its second argument after the model's params): what lets donation reuse every buffer."""
    into, out = compiled.input_shardings[0][1], compiled.output_shardings[-1]
    shapes = [info.shape for info in jax.tree.leaves(compiled.args_info[0][1])]
    return all(a.is_equivalent_to(b, len(shape)) for a, b, shape in
               zip(jax.tree.leaves(out), jax.tree.leaves(into), shapes, strict=True))


def handoff(checkpoints: dict[str, Path], sharded: dict[tuple, Mistral]) -> dict[str, object]:
    """torch decodes the first tokens on one device, its cache is copied onto the JAX mesh, JAX decodes the rest."""
    import torch_cache.generate as tg
    from torch_cache.model import Mistral as TorchMistral
    from twincache_app.handoff import cache_from_torch, cache_to_torch

    name, data, model_ways, kind = HANDOFF
    torch_model = TorchMistral.from_pretrained(checkpoints[name])
    vocab = torch_model.config.vocab_size
    whole = tg.generate(torch_model, prompts(vocab), NEW_TOKENS, cache=kind, compile=False)
    first = tg.generate(torch_model, prompts(vocab), HANDOFF_TORCH_TOKENS, cache=kind, compile=False)
    model = sharded[(name, data, model_ways)]
    cache = cache_from_torch(first.cache, model.config, model.mesh)
    rest = jg.continue_generation(model, cache, [t[-1] for t in first.token_ids], NEW_TOKENS - HANDOFF_TORCH_TOKENS,
                                  fused=False)  # the step a case above compiled for this mesh and batch
    # and back: a cache split over the mesh has no DLPack view, so it takes the host copy
    back = cache_to_torch(rest.cache, model.config)
    back_equal = all(np.array_equal(theirs.numpy(), np.asarray(ours))
                     for theirs, ours in zip(back.arrays(), rest.cache.arrays(), strict=True))
    return {"torch_tokens": whole.token_ids, "handed_over": [a + b for a, b in zip(first.token_ids, rest.token_ids)],
            "cache_spec": str(rest.cache.keys[0].sharding.spec), "mesh": str(sharding.mesh_shape(model.mesh)),
            "back_to_torch_equal": back_equal}


def chunked(single: dict[str, Mistral], sharded: dict[tuple, Mistral],
            logits: dict[str, np.ndarray]) -> list[dict[str, object]]:
    """Each mode on the mesh, prefilling in chunks of CHUNK, against one device prefilling in one chunk (fused)."""
    name, data, model_ways, kind = CHUNKED
    vocab = single[name].config.vocab_size
    rows = [[1] + [(5 * row + 3 * i + 1) % (vocab - 2) + 2 for i in range(length - 1)]
            for row, length in enumerate(CHUNKED_LENGTHS)]
    reference = jg.generate(single[name], rows, NEW_TOKENS, cache=kind, return_logits=True)
    cases = []
    for mode in ("step", "fused"):
        result = jg.generate(sharded[(name, data, model_ways)], rows, NEW_TOKENS, cache=kind, fused=mode == "fused",
                             return_logits=True, prefill_chunk=CHUNK)
        logits[f"chunked_{mode}"] = np.asarray(result.step_logits)
        cases.append({"checkpoint": name, "data": data, "model": model_ways, "cache": kind, "mode": mode,
                      "chunk": CHUNK, "prompts": rows, "tokens": result.token_ids,
                      "reference_tokens": reference.token_ids, "cache_rows": int(result.cache.keys[0].shape[0]),
                      "cache_spec": str(result.cache.keys[0].sharding.spec)})
    logits["chunked_reference"] = np.asarray(reference.step_logits)
    return cases


def padded(checkpoint: Path, single: Mistral, mesh: jax.sharding.Mesh, out: Path) -> dict[str, object]:
    """One sampled row on a data split of 2, in each mode, with an EOS id it emits and its padding copy never does
    (mesh_weights.pick_eos): the tokens, the decode steps, and one device's free run that picked the id."""
    sampling = SamplingParams(temperature=mesh_weights.PADDED_TEMPERATURE, seed=mesh_weights.PADDED_SEED)
    prompt = mesh_weights.PADDED_PROMPT
    free = jg.generate(single, [prompt, prompt], NEW_TOKENS, sampling=sampling).token_ids
    step, eos = mesh_weights.pick_eos(free)
    model = Mistral.from_pretrained(mesh_weights.checkpoint_with_eos(checkpoint, eos, out / "eos_jax"), mesh=mesh)
    runs = {mode: jg.generate(model, [prompt], NEW_TOKENS, sampling=sampling, fused=mode == "fused")
            for mode in ("fused", "step")}
    return {"free": free, "eos_step": step, "tokens": {mode: run.token_ids for mode, run in runs.items()},
            "decode_steps": {mode: run.decode_steps for mode, run in runs.items()}}


if __name__ == "__main__":
    main(Path(sys.argv[1]), {"gqa": Path(sys.argv[2]), "mqa": Path(sys.argv[3])})
