"""torch <-> JAX handoff: weights (zero-copy into JAX through DLPack, exact back to torch) and live caches mid-way
through a generation. A generation that switches backends gives the tokens of one that never switched.

Checkpoints have eos_token_id None, so every run generates all of its tokens; greedy decoding throughout (the two
backends draw random numbers differently, so only greedy tokens can be compared across them).
"""

from __future__ import annotations

import logging
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_cache.generate as jg
import torch_cache.generate as tg
from jax_cache.cache import StaticCache, make_cache
from jax_cache.model import Mistral
from torch_cache.cache import StaticCache as TorchStaticCache
from torch_cache.model import Mistral as TorchMistral
from twincache.cache_layout import cache_fields
from twincache.errors import InputError, StaleCacheError
from twincache.generation import SamplingParams
from twincache_app import handoff as interop

VOCAB = 128
N1, N2, N3 = 7, 12, 10  # with window 8 the JAX leg alone wraps the ring once and the whole run three times
PROMPTS = [np.random.default_rng(7).integers(1, VOCAB, 13).tolist(), [9, 40, 77]]  # left-padded batch


@pytest.fixture(scope="module")
def torch_model(checkpoints: dict[str, Path]) -> TorchMistral:
    return TorchMistral.from_pretrained(checkpoints["gqa"], torch.float32)


@pytest.fixture(scope="module")
def jax_model(torch_model: TorchMistral) -> Mistral:
    return interop.from_torch(torch_model)


def joined(*parts: list[list[int]]) -> list[list[int]]:
    return [sum(rows, []) for rows in zip(*parts)]


def last_tokens(token_ids: list[list[int]]) -> list[int]:
    return [row[-1] for row in token_ids]


def torch_arrays(cache) -> list[np.ndarray]:
    return [t.numpy() for t in (*cache.keys, *cache.values, cache.slot_positions, cache.length)]


def jax_arrays(cache: StaticCache) -> list[np.ndarray]:
    return [np.asarray(a) for a in (*cache.keys, *cache.values, cache.slot_positions, cache.length)]


@pytest.mark.parametrize("kind", ["sliding_window", "static"])
def test_torch_to_jax_to_torch_mid_generation_equals_one_torch_run(torch_model, jax_model, kind):
    cell = f"cache={kind}"
    whole = tg.generate(torch_model, PROMPTS, N1 + N2 + N3, cache=kind, max_cache_len=64, compile=False)
    first = tg.generate(torch_model, PROMPTS, N1, cache=kind, max_cache_len=64, compile=False)
    jax_cache = interop.cache_from_torch(first.cache, torch_model.config)
    assert type(jax_cache).__name__ == type(first.cache).__name__ and jax_cache.kind == kind
    second = jg.continue_generation(jax_model, jax_cache, last_tokens(first.token_ids), N2)  # fused
    torch_cache = interop.cache_to_torch(second.cache, jax_model.config)
    third = tg.continue_generation(torch_model, torch_cache, last_tokens(second.token_ids), N3, compile=False)
    assert [len(row) for row in second.token_ids] == [N2, N2] and [len(row) for row in third.token_ids] == [N3, N3]
    assert joined(first.token_ids, second.token_ids, third.token_ids) == whole.token_ids, (
        f"{cell}: torch {N1} -> jax {N2} -> torch {N3} tokens differ from one torch run of {N1 + N2 + N3}")
    # The caches end where the single run's does: same positions and length; K/V within fp32 parity.
    assert torch.equal(third.cache.slot_positions, whole.cache.slot_positions)
    assert int(third.cache.length) == int(whole.cache.length)
    for ours, ref in zip((*third.cache.keys, *third.cache.values), (*whole.cache.keys, *whole.cache.values)):
        assert float((ours - ref).abs().max()) <= 1e-5, f"{cell}: cache contents drifted"


def test_jax_to_torch_to_jax_mid_generation_equals_one_jax_run_and_one_torch_run(torch_model, jax_model):
    # One max_cache_len for every cache: it is static pytree metadata, so the legs share compiled code.
    whole = jg.generate(jax_model, PROMPTS, N1 + N2 + N3, cache="sliding_window", max_cache_len=64, fused=False)
    first = jg.generate(jax_model, PROMPTS, N1, cache="sliding_window", max_cache_len=64)  # fused
    torch_cache = interop.cache_to_torch(first.cache, jax_model.config)
    second = tg.continue_generation(torch_model, torch_cache, last_tokens(first.token_ids), N2, compile=False)
    jax_cache = interop.cache_from_torch(second.cache, torch_model.config)
    third = jg.continue_generation(jax_model, jax_cache, last_tokens(second.token_ids), N3, fused=False)
    tokens = joined(first.token_ids, second.token_ids, third.token_ids)
    assert tokens == whole.token_ids, f"jax {N1} -> torch {N2} -> jax {N3} differs from one jax run"
    torch_whole = tg.generate(torch_model, PROMPTS, N1 + N2 + N3, cache="sliding_window", max_cache_len=64,
                              compile=False)
    assert tokens == torch_whole.token_ids, "the switching run differs from one torch run"


SAMPLED = SamplingParams(temperature=1.0, seed=5)


@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_a_seeded_generation_continued_at_its_first_step_is_one_generation(torch_model, jax_model, tower):
    """A leg continues the seed's stream when told where the generation is: generate(n), then continue_generation(m,
    first_step=n), draws the tokens of one generate(n + m) (the default, 0, drew the noise of steps 0 .. m-1 again).
    Per tower: the two backends draw from different streams by design (README), so a sampled run that switches
    towers equals no single run. Eager torch and the JAX step mode (the fused loop folds the steps as it does:
    test_jax_generate)."""
    tower_module, model, mode = (tg, torch_model, {"compile": False}) if tower == "torch" else (jg, jax_model,
                                                                                                  {"fused": False})

    def run(tokens: int):
        return tower_module.generate(model, PROMPTS, tokens, cache="sliding_window", max_cache_len=64,
                                     sampling=SAMPLED, **mode)

    whole, first = run(N1 + N2 + N3), run(N1 + N2)
    rest = tower_module.continue_generation(model, first.cache, last_tokens(first.token_ids), N3, sampling=SAMPLED,
                                            first_step=N1 + N2, **mode)
    assert joined(first.token_ids, rest.token_ids) == whole.token_ids


@pytest.mark.parametrize("tower", ["torch", "jax"])
@pytest.mark.parametrize(("first_step", "fragment"), [(-1, "must be >= 0"), (1.5, "must be an integer"),
                                                      (True, "must be an integer"), ("3", "must be an integer"),
                                                      (2**31 - 5, "int32 limit")])
def test_continue_generation_refuses_a_first_step_that_is_not_a_step_index(torch_model, jax_model, tower, first_step,
                                                                          fragment):
    """Refused before anything runs: the JAX cache is not donated, the torch cache not written."""
    config = torch_model.config
    if tower == "torch":
        cache = TorchStaticCache(config, 2, 64, torch.float32, torch.device("cpu"))
        with pytest.raises(InputError, match=fragment):
            tg.continue_generation(torch_model, cache, [3, 4], 10, compile=False, first_step=first_step)
        assert int(cache.length) == 0
    else:
        cache = StaticCache(config, 2, 64, jnp.float32)
        with pytest.raises(InputError, match=fragment):
            jg.continue_generation(jax_model, cache, [3, 4], 10, first_step=first_step)
        cache.check_live()
        assert int(cache.length) == 0


def test_caches_round_trip_exactly_in_both_directions(torch_model, jax_model):
    torch_side = tg.generate(torch_model, PROMPTS, N1, cache="sliding_window", compile=False).cache
    there = interop.cache_from_torch(torch_side, torch_model.config)
    fields = cache_fields(there)
    assert (there.kind, fields["batch_size"], fields["max_cache_len"], fields["cache_len"], fields["dtype"]) == (
        torch_side.kind, torch_side.batch_size, torch_side.max_cache_len, torch_side.cache_len, jnp.float32)
    chex.assert_trees_all_equal(jax_arrays(there), torch_arrays(torch_side))
    back = interop.cache_to_torch(there, jax_model.config)
    assert type(back) is type(torch_side) and back.max_cache_len == torch_side.max_cache_len
    chex.assert_trees_all_equal(torch_arrays(back), torch_arrays(torch_side))
    # The copies are independent: JAX's arrays never alias torch's in-place-written buffers.
    assert there.keys[0].unsafe_buffer_pointer() != torch_side.keys[0].data_ptr()
    assert back.keys[0].data_ptr() != torch_side.keys[0].data_ptr()
    # batch_size keeps the first rows (a data split's padding rows come last) and is refused past the cache's
    first = interop.cache_to_torch(there, jax_model.config, batch_size=1)
    assert first.batch_size == 1 and torch.equal(first.keys[0], torch_side.keys[0][:1])
    for rows in (0, len(PROMPTS) + 1):
        with pytest.raises(InputError, match=f"batch_size={rows} must be"):
            interop.cache_to_torch(there, jax_model.config, batch_size=rows)


def test_a_donated_jax_cache_cannot_be_handed_to_torch(jax_model):
    result = jg.generate(jax_model, PROMPTS, 3, cache="sliding_window")
    stale = result.cache
    jg.continue_generation(jax_model, stale, last_tokens(result.token_ids), 2)  # consumes `stale`
    with pytest.raises(StaleCacheError, match="donated"):
        interop.cache_to_torch(stale, jax_model.config)


def test_from_torch_weights_are_zero_copy_on_cpu(torch_model, jax_model):
    jax_weights = {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(jax_model))}
    torch_weights = torch_model.state_dict()
    assert set(jax_weights) == set(torch_weights)
    shared = [name for name, tensor in torch_weights.items()
              if jax_weights[name].unsafe_buffer_pointer() == tensor.data_ptr()]
    assert "model.layers.0.self_attn.q_proj.weight" in shared
    assert sorted(shared) == sorted(torch_weights), f"copied instead of shared: {set(torch_weights) - set(shared)}"
    assert all(jax_weights[name].dtype == jnp.float32 for name in shared)


def test_from_torch_refuses_a_model_split_over_a_mesh(torch_model, monkeypatch):
    """A torch model on a mesh holds this rank's slice of every weight: from_torch copied the slices (on 2 gloo ranks,
    model=2: a JAX model that failed at generate with 'cannot reshape array', then from_weights' shape error, which
    does not say why). The 2-rank run is slow, so here the model only claims a mesh."""
    monkeypatch.setattr(torch_model, "mesh", "2 ranks")
    monkeypatch.setattr(interop.torch_sharding, "mesh_label", lambda mesh: f"mesh model=2 ({mesh})")
    with pytest.raises(InputError, match=r"split over mesh model=2 \(2 ranks\).*from_pretrained\(path, mesh=\.\.\.\)"):
        interop.from_torch(torch_model)


def test_to_torch_round_trips_weights_exactly(checkpoints, torch_model, jax_model):
    with torch.inference_mode():  # plain tensors even so, as torch_cache loads them: their writes are counted
        back = interop.to_torch(jax_model)
    assert not any(parameter.is_inference() for parameter in back.parameters())
    for name, tensor in torch_model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), f"{name} changed on the way torch -> JAX -> torch"
    loaded = interop.to_torch(Mistral.from_pretrained(checkpoints["tied"]))
    reference = TorchMistral.from_pretrained(checkpoints["tied"])
    assert loaded.lm_head is None
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), f"tied: {name} differs from torch_cache's own load"


def test_from_torch_model_equals_the_jax_loader(checkpoints, jax_model):
    own = Mistral.from_pretrained(checkpoints["gqa"])
    chex.assert_trees_all_equal(nnx.state(own), nnx.state(jax_model))
    ours = jg.generate(own, PROMPTS, N1, cache="sliding_window")
    assert ours.token_ids == jg.generate(jax_model, PROMPTS, N1, cache="sliding_window").token_ids


def test_a_handed_over_model_and_cache_compile_only_what_native_ones_do(checkpoints, torch_model, jax_model, caplog):
    """from_dlpack commits its arrays, and a committed input commits a jitted call's outputs: a model from from_torch
    or a cache from cache_from_torch was another signature of the prefill and the step (each compiled again), and
    the cache a step returned stayed committed, so a generate in it compiled its prefill and eager ops again
    (docs/design.md §7.29). A native control runs each call's shapes first; the handed-over runs then compile nothing,
    eager ops included (JAX's own compile log). The shapes of the tests above, so the control is mostly cached; those
    tests hand caches over too, and a committed variant they compiled first would hide one here (compiled code is
    per process), so the handed-over arrays' committedness is also compared with jax_cache's own."""
    native, config = Mistral.from_pretrained(checkpoints["gqa"]), torch_model.config
    handed = [interop.cache_from_torch(tg.generate(torch_model, PROMPTS, N1, cache="sliding_window", max_cache_len=64,
                                                   compile=False).cache, config) for _ in range(2)]
    natives = [make_cache("sliding_window", config, 2, 64) for _ in range(2)]

    def committed(model: Mistral, caches: list[StaticCache]) -> set[bool]:
        return {array.committed for array in jax.tree.leaves((nnx.state(model), [cache.arrays() for cache in caches]))}

    def run(model: Mistral, cache: StaticCache, fused: bool) -> None:
        jg.generate(model, PROMPTS, N1, cache="sliding_window", max_cache_len=64, fused=fused)
        result = jg.continue_generation(model, cache, [5, 6], N2, fused=fused)  # then a generation in its cache:
        jg.generate(model, PROMPTS, N1, cache=result.cache, fused=fused)

    arrays_given = committed(jax_model, handed), committed(native, natives)
    for fused, cache in zip((False, True), natives, strict=True):
        run(native, cache, fused)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        for fused, cache in zip((False, True), handed, strict=True):
            run(jax_model, cache, fused)
    compiled = [record.getMessage()[:120] for record in caplog.records if "Compiling" in record.getMessage()]
    assert compiled == [], f"a handed-over model and cache compiled beyond the native control: {compiled}"
    crossed, own = arrays_given
    assert crossed == own, f"committed: handed-over arrays {crossed}, jax_cache's own {own}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_model_crosses_in_its_dtype_both_ways(checkpoints, dtype):
    """On CPU a half-precision JAX model keeps some weights as float32 (jax_cache.projection.stored_dtype); torch gets
    them back in the model's dtype, bit for bit."""
    reference = TorchMistral.from_pretrained(checkpoints["tied"], getattr(torch, dtype))
    back = interop.to_torch(Mistral.from_pretrained(checkpoints["tied"], jnp.dtype(dtype)))
    for name, tensor in reference.state_dict().items():
        got = back.state_dict()[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"{name}: {got.dtype}, or values differ"
    crossed = interop.from_torch(reference)
    assert crossed.dtype == jnp.dtype(dtype)
    chex.assert_trees_all_equal(nnx.state(crossed),
                                nnx.state(Mistral.from_pretrained(checkpoints["tied"], jnp.dtype(dtype))))
