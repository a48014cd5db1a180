"""Reliability, round two, at the Python API of both backends: no silent wrong results, memory checked before it is
allocated, a refused call changes nothing, and every refusal is a one-line TwincacheError naming its cause.

Each test names the issue item it guards. Backends plug in through a small adapter (`Side`), so every check runs on
torch_cache and jax_cache alike; refusals happen before anything compiles, so these tests are cheap.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_cache.backend as jb
import jax_cache.cache as jc
import jax_cache.generate as jg
import jax_cache.model as jm
import torch_cache.backend as tb
import torch_cache.cache as tc
import torch_cache.generate as tg
import torch_cache.model as tm
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import WINDOW
from parity_tests.test_cli_bad_inputs import copy_checkpoint, edit_config, rewrite_tensors
from torch_cache.model import Mistral as TorchMistral
from twincache import cache_checks, default_model
from twincache.config import MistralConfig
from twincache.errors import (
    CacheError,
    CheckpointError,
    ConfigError,
    InputError,
    NonFiniteLogitsError,
    ResourceError,
    StaleCacheError,
    StorageError,
    TwincacheError,
)
from twincache.generation import INT32_MAX, SamplingParams
from twincache_app import handoff

VOCAB = 128
PROMPT = [5, 17, 42, 99]


# --- one adapter per backend ------------------------------------------------------------------------------------------


class Side:
    """What the tests need of a backend: its model, generate/continue, caches, a forward and a decode step."""

    name: str
    cache_module: Any

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config

    def make_cache(self, kind: str, config: MistralConfig | None = None, batch: int = 1, length: int = 24,
                   **kwargs: object) -> Any:
        return self.cache_module.make_cache(kind, config or self.config, batch, length, **kwargs)


class TorchSide(Side):
    name, cache_module = "torch", tc

    def generate(self, prompts: list[list[int]], max_new_tokens: object, **kwargs: object) -> Any:
        return tg.generate(self.model, prompts, max_new_tokens, compile=False, **kwargs)

    def continue_(self, cache: Any, last_tokens: object, max_new_tokens: object, **kwargs: object) -> Any:
        return tg.continue_generation(self.model, cache, last_tokens, max_new_tokens, compile=False, **kwargs)

    def forward(self, ids: list[list[int]], positions: object, cache: Any) -> Any:
        with torch.inference_mode():
            return self.model(torch.tensor(ids), torch.as_tensor(np.asarray(positions)), cache)

    def step(self, ids: list[list[int]], positions: object, cache: Any, attend_len: int | None = None) -> Any:
        # the compiled step (the default), whose model skips its own checks: every refusal must come before dispatch
        return tg.decode_step_fn(self.model)(torch.tensor(ids), torch.as_tensor(np.asarray(positions)), cache,
                                             attend_len)

    @staticmethod
    def arrays(cache: Any) -> list[np.ndarray]:
        return [t.numpy().copy() for t in (*cache.keys, *cache.values, cache.slot_positions, cache.length)]

    @staticmethod
    def fill(cache: Any, length: int, positions: np.ndarray | None = None) -> Any:
        """Give the cache distinctive contents, `length` columns written, in place."""
        generator = torch.Generator().manual_seed(0)
        for buffer in (*cache.keys, *cache.values):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        if positions is None:
            positions = np.where(np.arange(cache.cache_len) < length, np.arange(cache.cache_len), -1)
        cache.slot_positions.copy_(torch.as_tensor(np.broadcast_to(positions, cache.slot_positions.shape).copy()))
        cache.length.fill_(length)
        return cache


class JaxSide(Side):
    name, cache_module = "jax", jc

    def generate(self, prompts: list[list[int]], max_new_tokens: object, **kwargs: object) -> Any:
        return jg.generate(self.model, prompts, max_new_tokens, **kwargs)

    def continue_(self, cache: Any, last_tokens: object, max_new_tokens: object, **kwargs: object) -> Any:
        return jg.continue_generation(self.model, cache, last_tokens, max_new_tokens, **kwargs)

    def forward(self, ids: list[list[int]], positions: object, cache: Any) -> Any:
        return self.model(jnp.asarray(ids, jnp.int32), np.asarray(positions), cache)

    def step(self, ids: list[list[int]], positions: object, cache: Any, attend_len: int | None = None) -> Any:
        return jg.decode_step_fn(self.model)(jnp.asarray(ids, jnp.int32), np.asarray(positions), cache, attend_len)

    @staticmethod
    def arrays(cache: Any) -> list[np.ndarray]:
        return [np.asarray(a) for a in (*cache.keys, *cache.values, cache.slot_positions, cache.length)]

    @staticmethod
    def fill(cache: Any, length: int, positions: np.ndarray | None = None) -> Any:
        rng = np.random.default_rng(0)
        if positions is None:
            positions = np.where(np.arange(cache.cache_len) < length, np.arange(cache.cache_len), -1)
        shape = cache.keys[0].shape
        return cache.replace(keys=[jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in cache.keys],
                             values=[jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in cache.values],
                             slot_positions=jnp.asarray(np.broadcast_to(positions, cache.slot_positions.shape),
                                                        jnp.int32),
                             length=jnp.int32(length))


SIDES = {"torch": (TorchSide, TorchMistral), "jax": (JaxSide, JaxMistral)}


@pytest.fixture(scope="module", params=list(SIDES))
def side(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Side:
    adapter, model_class = SIDES[request.param]
    return adapter(model_class.from_pretrained(checkpoints["gqa"]))


@contextmanager
def refused(error: type[TwincacheError], *fragments: object, side: Side | None = None,
            cache: Any = None) -> Iterator[None]:
    """The block must raise exactly `error`, one line holding every fragment, leaving `cache` as it was."""
    before = None if cache is None else side.arrays(cache)
    with pytest.raises(TwincacheError) as info:
        yield
    assert type(info.value) is error, f"raised {type(info.value).__name__}({info.value}), expected {error.__name__}"
    message = str(info.value)
    assert message and "\n" not in message, f"message must be one line: {message!r}"
    for fragment in fragments:
        assert str(fragment) in message, f"{fragment!r} missing from: {message}"
    if cache is not None:
        if side.name == "jax":
            assert not any(a.is_deleted() for a in (*cache.keys, *cache.values)), "a refused call consumed the cache"
        for old, new in zip(before, side.arrays(cache), strict=True):
            np.testing.assert_array_equal(new, old, err_msg="the refused call changed the cache")


# --- 1. a cache built for another window (and kind, device) -----------------------------------------------------------


@pytest.mark.parametrize("other_window", [WINDOW // 2, WINDOW + 4, 32])
def test_item1_cache_for_another_window_is_refused_everywhere(side, other_window):
    other = dataclasses.replace(side.config, sliding_window=other_window)
    fragments = (f"sliding_window={other_window}", f"window is {WINDOW}")
    cache = side.fill(side.make_cache("sliding_window", other), 3)
    with refused(CacheError, *fragments, side=side, cache=cache):
        side.generate([PROMPT], 3, cache=cache)
    with refused(CacheError, *fragments, side=side, cache=cache):
        side.continue_(cache, [5], 2)
    with refused(CacheError, *fragments, side=side, cache=cache):
        side.forward([[5]], [[3]], cache)
    with refused(CacheError, *fragments, side=side, cache=cache):
        side.step([[5]], [[3]], cache)


def test_item13_the_decode_step_refuses_before_dispatch(side):
    """decode_step_fn's step (torch: compiled, where the model's own checks are skipped) refuses what would be an
    out-of-bounds kernel read or write, a silently wrong step (live keys hidden by a short attend_len) or a position
    the cache cannot hold, before anything runs: nothing compiles and the cache is unchanged."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    full = side.fill(side.make_cache("static", length=4), 4)
    with refused(CacheError, "columns 4..4", "capacity [0, 4)", "room for the continuation", side=side, cache=full):
        side.step([[5]], [[4]], full)
    cache = side.fill(side.make_cache("static"), 3)  # 3 live slots of 24
    with refused(InputError, VOCAB + 9, side=side, cache=cache):
        side.step([[VOCAB + 9]], [[3]], cache)
    with refused(InputError, -5, side=side, cache=cache):
        side.step([[5]], [[-5]], cache)
    with refused(CacheError, "attend_len=1", "4 live slots", side=side, cache=cache):
        side.step([[5]], [[3]], cache, attend_len=1)
    with refused(CacheError, "batch", side=side, cache=cache):
        side.step([[5], [6]], [[3], [3]], cache)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a refused step compiled"


def test_item1_a_ring_on_a_model_without_a_window_is_refused(side, checkpoints):
    no_window = SIDES[side.name][1].from_pretrained(checkpoints["no_window"])
    other = type(side)(no_window)
    cache = side.fill(side.make_cache("sliding_window", side.config), 3)  # a ring of window 8
    with refused(CacheError, "window of 8", "sliding_window=null", side=side, cache=cache):
        other.generate([PROMPT], 3, cache=cache)
    with refused(CacheError, "window of 8", "sliding_window=null", side=side, cache=cache):
        other.continue_(cache, [5], 2)
    with refused(CacheError, "window of 8", "sliding_window=null", side=side, cache=cache):
        other.forward([[5]], [[3]], cache)


def test_item1_the_same_window_still_works(side):
    """The control: a cache from an equal config (another object) is accepted, and its tokens are the model's."""
    cache = side.make_cache("sliding_window", dataclasses.replace(side.config), length=19)
    assert side.generate([PROMPT], 3, cache=cache).token_ids == side.generate([PROMPT], 3).token_ids


def test_item1_a_max_cache_len_that_contradicts_the_given_cache_is_refused(side):
    """generate(cache=<object>, max_cache_len=N) used the object's capacity and ignored N without a word; N must be
    the object's own (or left out)."""
    cache = side.fill(side.make_cache("static", length=24), 3)
    with refused(InputError, "max_cache_len=8", "built for max_cache_len=24", side=side, cache=cache):
        side.generate([PROMPT], 3, cache=cache, max_cache_len=8)
    with refused(InputError, "max_cache_len=24.0", "integer", side=side, cache=cache):
        side.generate([PROMPT], 3, cache=cache, max_cache_len=24.0)
    assert side.generate([PROMPT], 3, cache=cache, max_cache_len=24).token_ids == side.generate([PROMPT], 3).token_ids
    # a ring asked for 24 slots holds its window of 8 and serves any length: 24 again (as the bench passes it with
    # the cache of its previous run) is that cache's own request; 6 is not
    ring = side.make_cache("sliding_window", length=24)
    assert side.generate([PROMPT], 3, cache=ring, max_cache_len=24).cache.max_cache_len == WINDOW
    ring = side.make_cache("sliding_window", length=24)  # a JAX generate consumed the first
    with refused(InputError, "max_cache_len=6", f"built for max_cache_len={WINDOW}", side=side, cache=ring):
        side.generate([PROMPT], 3, cache=ring, max_cache_len=6)


def test_item1_jax_cache_on_another_device_is_refused(checkpoints, tmp_path):
    """Two XLA-CPU devices (a subprocess: the device count is fixed when JAX starts). A cache on device 1 under a
    model on device 0 is refused by every entry point, naming both devices, and left as it was."""
    import subprocess
    import sys

    script = tmp_path / "devices.py"
    script.write_text(f'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
import jax_cache.generate as jg
from jax_cache.cache import make_cache
from jax_cache.model import Mistral
from twincache.errors import CacheError
model = Mistral.from_pretrained({str(checkpoints["gqa"])!r})
assert model.device == "cpu:0", model.device
for kind in ("static", "sliding_window"):
    cache = jax.device_put(make_cache(kind, model.config, 1, 24), jax.devices()[1])
    snapshot = [np.asarray(a) for a in (*cache.keys, cache.slot_positions, cache.length)]
    ids = jnp.asarray([[5]], jnp.int32)
    calls = [lambda: jg.generate(model, [[5, 6]], 3, cache=cache), lambda: jg.continue_generation(model, cache, [5], 2),
             lambda: model(ids, jnp.asarray([[0]], jnp.int32), cache),
             lambda: jg.decode_step_fn(model)(ids, jnp.asarray([[0]], jnp.int32), cache),
             lambda: jg.prefill(model, ids, jnp.ones_like(ids), cache)]
    for call in calls:
        try:
            call()
        except CacheError as err:
            assert "model is on cpu:0 but the cache is on cpu:1" in str(err), err
        else:
            raise AssertionError("a cache on another device was accepted")
    assert not cache.keys[0].is_deleted()
    assert all((np.asarray(a) == b).all() for a, b in zip((*cache.keys, cache.slot_positions, cache.length), snapshot))
print("ok")
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --- 2. the handoff checks its config against the arrays --------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(checkpoints) -> tuple[TorchMistral, JaxMistral]:
    torch_model = TorchMistral.from_pretrained(checkpoints["gqa"])
    return torch_model, handoff.from_torch(torch_model)


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("sliding_window", 12, "sliding_window=8, but the model's window is 12"),
    ("sliding_window", None, "sliding_window=null"),
    ("num_hidden_layers", 3, "3 x 2 x 16"),
    ("num_key_value_heads", 1, "2 x 1 x 16"),
    ("head_dim", 24, "2 x 2 x 24"),
])
def test_item2_handoff_with_a_wrong_config_is_refused_both_ways(pair, field, value, fragment):
    torch_model, jax_model = pair
    wrong = dataclasses.replace(torch_model.config, **{field: value})
    torch_side = TorchSide.fill(tc.make_cache("sliding_window", torch_model.config, 1, 32), 5)
    with refused(CacheError, fragment):
        handoff.cache_from_torch(torch_side, wrong)
    jax_side = JaxSide.fill(jc.make_cache("sliding_window", jax_model.config, 1, 32), 5)
    with refused(CacheError, fragment):
        handoff.cache_to_torch(jax_side, wrong)
    assert not jax_side.keys[0].is_deleted()


def test_item2_handoff_of_arrays_that_disagree_with_their_cache_is_refused(pair):
    torch_model, jax_model = pair
    torch_side = tc.make_cache("sliding_window", torch_model.config, 1, 32)
    torch_side.keys[1] = torch.zeros(1, 2, 12, 16)  # tampered: 12 slots where the ring says 8
    with refused(CacheError, "cache_from_torch", "keys[1] has shape [1, 2, 12, 16]", "[1, 2, 8, 16]"):
        handoff.cache_from_torch(torch_side, torch_model.config)
    jax_side = jc.make_cache("static", jax_model.config, 1, 16)
    jax_side = jax_side.replace(slot_positions=jnp.zeros((1, 20), jnp.int32))
    with refused(CacheError, "cache_to_torch", "slot_positions has shape [1, 20]", "[1, 16]"):
        handoff.cache_to_torch(jax_side, jax_model.config)


def test_item2_handoff_of_the_wrong_backend_is_refused(pair):
    torch_model, jax_model = pair
    jax_side = jc.make_cache("static", jax_model.config, 1, 16)
    with refused(CacheError, "jax_cache.cache.StaticCache", "not a torch_cache cache", "cache_from_torch"):
        handoff.cache_from_torch(jax_side, torch_model.config)
    with refused(CacheError, "torch_cache.cache.StaticCache", "not a jax_cache cache", "cache_to_torch"):
        handoff.cache_to_torch(tc.make_cache("static", torch_model.config, 1, 16), jax_model.config)


# --- 3. tiny temperatures sample the greedy tokens --------------------------------------------------------------------


TINY_TEMPERATURES = [1e-30, 1e-38, 1e-45, 1e-300, 5e-324]


@pytest.fixture(scope="module")
def model_logits(checkpoints) -> np.ndarray:
    """Real step logits [rows, V]: 3 prompts x 8 steps of the gqa model, flattened."""
    model = TorchMistral.from_pretrained(checkpoints["gqa"])
    result = tg.generate(model, [PROMPT, PROMPT[:2], [9, 8, 7, 6, 5, 4, 3]], 8, compile=False, return_logits=True)
    return result.step_logits.reshape(-1, VOCAB).numpy()


@pytest.mark.parametrize("backend", list(SIDES))
def test_item3_tiny_temperatures_sample_the_greedy_token(model_logits, backend):
    """Every tiny temperature, with and without filters, draws each row's argmax (many seeds). Today JAX drew
    token 0 (logits / T overflowed to inf) and torch raised on inf/nan probabilities."""
    greedy = model_logits.argmax(-1)
    for temperature in TINY_TEMPERATURES:
        for top_k, top_p in ((0, 1.0), (5, 0.9), (0, 0.3)):
            sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            for seed in range(3):
                if backend == "torch":
                    drawn = tg.sample(torch.from_numpy(model_logits), sampling, torch.tensor(seed))
                else:
                    drawn = jg.sample(jnp.asarray(model_logits), sampling, jax.random.key(seed))
                np.testing.assert_array_equal(np.asarray(drawn), greedy, err_msg=f"T={temperature} {sampling}")


def test_item3_a_tiny_temperature_generates_the_greedy_tokens(side):
    greedy = side.generate([PROMPT], 3).token_ids
    sampling = SamplingParams(temperature=1e-38, seed=3)
    assert side.generate([PROMPT], 3, sampling=sampling).token_ids == greedy
    if side.name == "jax":  # the streaming step samples through the same function
        assert side.generate([PROMPT], 3, sampling=sampling, fused=False).token_ids == greedy


def test_item3_non_finite_logits_while_sampling_are_named_as_such(checkpoints):
    """torch.multinomial raises its own RuntimeError on NaN probabilities: the sampled path must still report the
    non-finite logits (the greedy path always did)."""
    poisoned = TorchMistral.from_pretrained(checkpoints["gqa"])
    poisoned.model.norm.weight[3] = math.nan
    with refused(NonFiniteLogitsError, "generated token 0"):
        tg.generate(poisoned, [PROMPT], 4, compile=False, sampling=SamplingParams(temperature=0.7, top_p=0.9))


# --- 4. checkpoints that do not match their config --------------------------------------------------------------------


def _extra_layer(tensors: dict) -> None:
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("layers.1.", "layers.2.")] = tensors[name].copy()


@pytest.mark.parametrize("backend", list(SIDES))
def test_item4_tensors_the_config_does_not_describe_are_refused(checkpoints, tmp_path, backend):
    load = SIDES[backend][1].from_pretrained
    extra = copy_checkpoint(checkpoints["gqa"], tmp_path / "extra_layer")
    rewrite_tensors(extra, _extra_layer)
    with refused(CheckpointError, "holds 9 tensor(s) config.json does not describe", "model.layers.2.",
                 "num_hidden_layers=2"):
        load(extra)
    stray = copy_checkpoint(checkpoints["gqa"], tmp_path / "stray")
    rewrite_tensors(stray, lambda t: t.__setitem__("model.extra_bias", np.zeros(3, np.float32)))
    with refused(CheckpointError, "model.extra_bias"):
        load(stray)
    derived = copy_checkpoint(checkpoints["gqa"], tmp_path / "inv_freq")  # older checkpoints store these buffers
    rewrite_tensors(derived, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq",
                                                                   np.ones(8, np.float32)))
    load(derived)


@pytest.mark.parametrize("backend", list(SIDES))
def test_item4_a_tied_config_beside_a_stored_head_loads_as_transformers_does(checkpoints, tmp_path, backend, caplog):
    """Some exporters write lm_head.weight beside tie_word_embeddings=true. transformers ties a head equal to the
    embedding, and takes a different one as the model's own (warning that it will not tie them); twincache too."""
    from transformers import MistralForCausalLM

    equal = copy_checkpoint(checkpoints["tied"], tmp_path / "equal")
    rewrite_tensors(equal, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    different = copy_checkpoint(checkpoints["gqa"], tmp_path / "different")  # untied weights, tied config
    edit_config(different, lambda raw: raw.__setitem__("tie_word_embeddings", True))
    adapter, model_class = SIDES[backend]
    for directory, tied in ((equal, True), (different, False)):
        with torch.no_grad():
            reference = MistralForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            expected = reference(torch.tensor([PROMPT])).logits[0, -1].numpy()  # [V]
        caplog.clear()
        with caplog.at_level("INFO", logger="twincache"):
            model = model_class.from_pretrained(directory)
        assert (model.lm_head is None) == tied  # an equal copy is not held twice
        assert ("differs from the embedding" in caplog.text) == (not tied)
        logits = adapter(model).generate([PROMPT], 1, return_logits=True).step_logits  # [1, 1, V]
        np.testing.assert_allclose(np.asarray(logits)[0, 0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", list(SIDES))
@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false, not a string"),
    ("tie_word_embeddings", 0, "tie_word_embeddings=0 must be true or false"),
    ("sliding_window", True, "sliding_window=True must be a positive integer or null"),
])
def test_item4_truthy_values_are_refused_by_both_loaders(checkpoints, tmp_path, backend, field, value, fragment):
    directory = copy_checkpoint(checkpoints["gqa"], tmp_path / "config")
    edit_config(directory, lambda raw: raw.__setitem__(field, value))
    with refused(ConfigError, fragment):
        SIDES[backend][1].from_pretrained(directory)


def _good_raw(checkpoints) -> dict:
    return json.loads((checkpoints["gqa"] / "config.json").read_text())


INT_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "bos_token_id",
              "eos_token_id", "pad_token_id"]
FLOAT_FIELDS = ["rms_norm_eps", "rope_theta"]
NULLABLE = {"num_key_value_heads", "head_dim", "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id",
            "rope_theta"}


def _bad_values() -> list[tuple[str, object, str]]:
    """Every config field with every wrong JSON type: numeric strings, booleans, floats, null, lists, objects."""
    cases = []
    for field in INT_FIELDS:
        listed = [2, "3"] if field == "eos_token_id" else [2, 3]  # eos_token_id may list ids, but only integers
        for value in ("2", True, 2.0, 2.5, listed, {"a": 2}) + (() if field in NULLABLE else (None,)):
            cases.append((field, value, f"{field}={value!r}"))
    for field in FLOAT_FIELDS:
        for value in ("1e-6", True, [1.0], float("nan"), float("inf"), 0, -1.0) + (
                () if field in NULLABLE else (None,)):
            cases.append((field, value, f"{field}={value!r}"))
    for value in ("false", "true", 0, 1, None, [True]):
        cases.append(("tie_word_embeddings", value, f"tie_word_embeddings={value!r}"))
    for field in ("attention_bias", "mlp_bias"):
        cases.append((field, "false", f"{field}='false'"))
    cases.append(("rope_parameters", "default", "rope_parameters='default'"))
    for value in ("1e4", True, -1.0):
        cases.append(("rope_parameters", {"rope_type": "default", "rope_theta": value},
                      f"rope_parameters.rope_theta={value!r}"))
    cases.append(("rope_theta", 5e5, "rope_theta=500000.0 and rope_parameters.rope_theta=10000.0 disagree"))
    for field in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size"):
        cases.append((field, 0, f"{field}=0"))
    return cases


@pytest.mark.parametrize(("field", "value", "fragment"), _bad_values(), ids=lambda v: repr(v)[:20])
def test_item4_every_config_field_is_type_checked(checkpoints, field, value, fragment):
    raw = _good_raw(checkpoints) | {field: value}
    with refused(ConfigError, fragment):
        MistralConfig.from_dict(raw)


def test_item4_nullable_fields_take_their_defaults(checkpoints):
    raw = _good_raw(checkpoints) | {name: None for name in ("num_key_value_heads", "head_dim", "sliding_window",
                                                             "pad_token_id", "rope_scaling")}
    config = MistralConfig.from_dict(raw)
    assert (config.num_key_value_heads, config.head_dim, config.sliding_window) == (4, 16, None)
    assert MistralConfig.from_dict(_good_raw(checkpoints) | {"rope_theta": 10000}).rope_theta == 10000.0


@pytest.mark.parametrize("absent", [("sliding_window",), ("max_position_embeddings",),
                                    ("num_key_value_heads",),
                                    ("sliding_window", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                                     "head_dim", "tie_word_embeddings")],
                         ids=["window", "positions", "kv_heads", "all_optional"])
def test_item4_absent_fields_read_as_transformers_reads_them(checkpoints, absent):
    """A field left out of config.json takes transformers' MistralConfig default (a 4,096 window, 131,072 positions),
    never one of ours: a config without `sliding_window` is windowed in transformers, so it must be here too (null is
    what turns the window off); an absent num_key_value_heads is 8, as in Mistral-7B, where null is one per head."""
    from transformers import MistralConfig as HFMistralConfig

    raw = {name: value for name, value in _good_raw(checkpoints).items() if name not in absent}
    if "num_key_value_heads" in absent:  # transformers' absent default, 8, must divide the heads
        raw |= {"num_attention_heads": 16, "hidden_size": 16 * raw["head_dim"]}
    ours, theirs = MistralConfig.from_dict(raw), HFMistralConfig(**raw)
    assert (ours.sliding_window, ours.max_position_embeddings, ours.rms_norm_eps, ours.num_key_value_heads,
            ours.head_dim, ours.tie_word_embeddings) == (
        theirs.sliding_window, theirs.max_position_embeddings, theirs.rms_norm_eps, theirs.num_key_value_heads,
        theirs.head_dim, theirs.tie_word_embeddings)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize("rope", [{"rope_scaling": {"rope_type": "default"}}, {"rope_scaling": {"type": "default"}},
                                  {"rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}],
                         ids=["rope_type", "type", "with_theta", "rope_parameters"])
def test_item4_plain_rope_spelt_out_is_plain_rope(checkpoints, rope):
    """transformers 4.x writes rope_scaling {"rope_type": "default"} (or "type") for no scaling, 5.x rope_parameters:
    each reads as the config without it; a theta given twice must agree."""
    plain = MistralConfig.from_dict(_good_raw(checkpoints) | {"rope_theta": 10000.0})
    assert MistralConfig.from_dict(_good_raw(checkpoints) | {"rope_theta": 10000.0} | rope) == plain
    field = next(iter(rope))
    disagreeing = {field: {"rope_type": "default", "rope_theta": 500.0}}
    with refused(ConfigError, f"{field}.rope_theta=500.0", "disagree"):
        MistralConfig.from_dict(_good_raw(checkpoints) | {"rope_theta": 10000.0} | disagreeing)


# --- 5. positions past the model's limit or int32 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_model_dir(checkpoints, tmp_path_factory) -> Path:
    """The gqa checkpoint with max_position_embeddings=12."""
    directory = copy_checkpoint(checkpoints["gqa"], tmp_path_factory.mktemp("short") / "gqa_short")
    edit_config(directory, lambda raw: raw.__setitem__("max_position_embeddings", 12))
    return directory


def test_item5_generation_past_max_position_embeddings_is_refused_up_front(side, short_model_dir):
    short = type(side)(SIDES[side.name][1].from_pretrained(short_model_dir))
    assert len(short.generate([PROMPT], 12 - len(PROMPT), cache="static").token_ids[0]) == 8  # exactly at the limit
    with refused(InputError, "max_new_tokens=9 from position 4 would reach position 12",
                 "max_position_embeddings=12", "at most 8"):
        short.generate([PROMPT], 9, cache="static")
    with refused(InputError, "the tokens given reach position 12", "max_position_embeddings=12", "at most 12 tokens"):
        short.generate([[5] * 13], 0, cache="static")  # a prompt past the limit, even without new tokens
    assert short.generate([[5] * 12], 0, cache="static").token_ids[0] == []  # one that fills it exactly
    ring = np.array([8, 1, 2, 3, 4, 5, 6, 7])  # columns 0..8 written: slot c % 8 holds c, the newest is 8
    cache = short.fill(short.make_cache("sliding_window", short.config), 9, ring)  # the last token takes 9
    with refused(InputError, "max_new_tokens=3 from position 10 would reach position 12", side=short, cache=cache):
        short.continue_(cache, [5], 3)
    assert len(short.continue_(cache, [5], 2).token_ids[0]) == 2  # new tokens at 10 and 11: allowed


def test_item5_continuing_past_int32_positions_is_refused(side):
    """With max_position_embeddings beyond int32, the int32 positions and cache lengths are the limit."""
    original = side.model.config
    side.model.config = side.config = dataclasses.replace(original, max_position_embeddings=2**40)
    try:
        cache = side.make_cache("sliding_window")
        newest = INT32_MAX - 5
        cache = side.fill(cache, 3, np.arange(newest - WINDOW + 1, newest + 1))  # the last token takes 2^31 - 5
        with refused(InputError, "from position 2147483644", "would reach position 2147483648", "int32 limit",
                     side=side, cache=cache):
            side.continue_(cache, [5], 5)
        with refused(CacheError, f"passes {INT32_MAX}", side=side, cache=cache):
            side.continue_(cache, [5], INT32_MAX - 2)  # columns 3 .. 2^31: the length would wrap
        assert len(side.continue_(cache, [5], 4).token_ids[0]) == 4  # new tokens up to position 2^31 - 1: allowed
    finally:
        side.model.config = side.config = original


def test_item5_model_positions_past_int32_are_refused(side):
    cache = side.make_cache("static", side.config)
    with refused(InputError, "positions of real tokens", str(INT32_MAX), "2147483648", side=side, cache=cache):
        side.forward([[5]], np.asarray([[2**31]], np.int64), cache)


# --- 6. non-integral counts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5.5, 5.0, "5", True, np.float32(5), None])
def test_item6_max_new_tokens_must_be_an_integer(side, bad):
    calls: list[list[int]] = []
    with refused(InputError, f"max_new_tokens={bad!r}", "must be an integer"):
        side.generate([PROMPT], bad, on_token=calls.append)
    if side.name == "jax":
        with refused(InputError, "must be an integer"):
            side.generate([PROMPT], bad, fused=False, on_token=calls.append)
    cache = side.fill(side.make_cache("static", side.config), 4)
    with refused(InputError, "must be an integer", side=side, cache=cache):
        side.continue_(cache, [5], bad)
    assert calls == []


def test_item6_integers_of_any_kind_are_accepted(side):
    ids = side.generate([PROMPT], 3).token_ids
    assert side.generate([np.asarray(PROMPT, np.int64)], np.int64(3), max_cache_len=np.int32(19)).token_ids == ids
    assert side.generate([torch.tensor(PROMPT)], 3).token_ids == ids  # 0-d integer tensors are integers too
    checked = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), seed=np.uint32(7)).validate(VOCAB)
    assert checked == SamplingParams(0.5, 4, 1.0, 7) and type(checked.top_k) is int and type(checked.seed) is int


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"max_cache_len": 10.5}, "max_cache_len=10.5 must be an integer"),
    ({"max_cache_len": 2**31}, "max_cache_len=2147483648 must be <= 2147483647"),
    ({"sampling": SamplingParams(temperature=1.0, top_k=2.5)}, "top_k=2.5 must be an integer"),
    ({"sampling": SamplingParams(temperature=1.0, seed=1.5)}, "seed=1.5 must be an integer"),
    ({"sampling": SamplingParams(temperature="1")}, "temperature='1' must be a number"),
    ({"sampling": SamplingParams(temperature=math.inf)}, "temperature=inf must be >= 0 and finite"),
], ids=["max_cache_len_float", "max_cache_len_int32", "top_k_float", "seed_float", "temperature_str",
        "temperature_inf"])
def test_item6_every_count_is_checked_at_the_api(side, kwargs, fragment):
    with refused(InputError, fragment):
        side.generate([PROMPT], 3, **kwargs)


@pytest.mark.parametrize(("batch", "length", "fragment"), [(1.5, 8, "batch_size=1.5"), (1, 8.0, "max_cache_len=8.0"),
                                                           (0, 8, "batch_size=0 must be > 0"), (True, 8, "batch_size")])
def test_item6_cache_sizes_must_be_positive_integers(side, batch, length, fragment):
    with refused(InputError, fragment):
        side.make_cache("static", side.config, batch, length)


# --- 7. caches and buffers are checked against memory before they are allocated ---------------------------------------


def test_item7_a_cache_larger_than_memory_is_refused_before_allocating(side):
    """10^9 slots of this model need 516 GB: no machine we run on has that, so the check is real, not patched."""
    with refused(ResourceError, "1000000000 slots", "needs 516.0 GB", "memory is available", "--max-cache-len"):
        side.make_cache("static", side.config, 1, 10**9)
    with refused(ResourceError, "needs 516.0 GB"):
        side.generate([PROMPT], 3, cache="static", max_cache_len=10**9)


def test_item7_the_figure_is_compared_with_what_is_available(side, monkeypatch):
    """With 1 MB available, a 1.1 MB cache is refused and a 0.9 MB one is built (2 x 2 layers x 2 heads x 16 x 4 B =
    512 B per slot, plus 4 B of positions)."""
    monkeypatch.setattr(cache_checks, "host_available_bytes", lambda: 1_000_000)
    with refused(ResourceError, "needs 1.1 MB", "only 1.0 MB"):
        side.make_cache("static", side.config, 1, 2100)
    assert side.make_cache("static", side.config, 1, 1900).cache_len == 1900
    with refused(ResourceError, "return_logits", "generate fewer tokens or pass return_logits=False"):
        side.generate([PROMPT] * 3, 400, cache="sliding_window", return_logits=True)  # 2 x 3 x 400 x 128 x 4 B


def test_item7_a_size_class_that_does_not_fit_falls_back_to_the_slots_needed(side, monkeypatch):
    """A cache generate sizes itself is rounded up to a size class (65 columns: 80 slots, twincache.generation);
    when those extra slots are what does not fit in memory, it is built with the 65 needed, not refused. 516 B a slot
    (above): 40,000 B hold 77 slots. 64 prompt tokens are one JAX prompt bucket, so both towers need 64 + 1."""
    prompt = [(7 * i) % VOCAB for i in range(64)]
    assert side.generate([prompt], 1, cache="static").cache.max_cache_len == 80  # the size class, memory permitting
    monkeypatch.setattr(cache_checks, "host_available_bytes", lambda: 40_000)
    result = side.generate([prompt], 1, cache="static")
    assert result.cache.max_cache_len == 65 and result.max_cache_len == 65
    with refused(ResourceError, "x 84 slots", "only 40.0 KB"):  # 84 needed do not fit either: refused, naming them
        side.generate([prompt], 20, cache="static")


def test_item7_a_batch_class_that_does_not_fit_falls_back_to_the_rows_given(side, monkeypatch):
    """A batch generate sizes the cache for is padded up to its batch class (9 rows: 10, twincache.generation); when
    the extra row is what does not fit in memory, the cache holds the 9 rows given, not refused. 16 slots of 516 B a
    row: 9 rows are 74,304 B, 10 are 82,560; with both out of reach the refusal names the 9."""
    prompts = [[(7 * i + row) % VOCAB for i in range(4)] for row in range(9)]
    expected = side.generate(prompts, 1, cache="static", max_cache_len=16)
    assert expected.cache.batch_size == 10  # the class, memory permitting
    monkeypatch.setattr(cache_checks, "host_available_bytes", lambda: 80_000)
    result = side.generate(prompts, 1, cache="static", max_cache_len=16)
    assert result.cache.batch_size == 9 and result.token_ids == expected.token_ids
    monkeypatch.setattr(cache_checks, "host_available_bytes", lambda: 70_000)
    with refused(ResourceError, "x batch 9 x", "only 70.0 KB"):
        side.generate(prompts, 1, cache="static", max_cache_len=16)


@pytest.mark.parametrize("backend", list(SIDES))
@pytest.mark.parametrize(("dtype", "itemsize"), [("float32", 4), ("bfloat16", 2)])
def test_item7_weights_larger_than_memory_are_refused_before_loading(checkpoints, monkeypatch, backend, dtype,
                                                                     itemsize):
    """A 7B checkpoint in float32 (29 GB) on a 24 GB host was read until the OS killed the process, with no message.
    The weights' size is counted from the safetensors file's own tensors (not the code's list): one byte short of it
    is refused, naming both figures and, in float32, what bfloat16 would need; exactly enough loads."""
    from safetensors import safe_open

    with safe_open(str(checkpoints["gqa"] / "model.safetensors"), framework="numpy") as f:
        parameters = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    needed = parameters * itemsize
    mistral = SIDES[backend][1]
    as_dtype = getattr(torch, dtype) if backend == "torch" else jnp.dtype(dtype)
    monkeypatch.setattr(cache_checks, "host_available_bytes", lambda: needed - 1)
    half = f"(--dtype bfloat16: {cache_checks.format_bytes(parameters * 2)})" if itemsize == 4 else "more memory"
    with refused(ResourceError, f"{parameters:,} parameters in {dtype}", f"needs {cache_checks.format_bytes(needed)}",
                 "host memory is available", half):
        mistral.from_pretrained(checkpoints["gqa"], as_dtype)
    monkeypatch.setattr(cache_checks, "host_available_bytes", lambda: needed)
    assert mistral.from_pretrained(checkpoints["gqa"], as_dtype).config.num_hidden_layers == 2


@pytest.mark.parametrize("backend", list(SIDES))
@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_item4_integer_weights_are_refused_not_cast(checkpoints, tmp_path, backend, dtype):
    """A weight stored as integers (a quantized or damaged checkpoint) was cast to float without a word."""
    directory = copy_checkpoint(checkpoints["gqa"], tmp_path / "int_weights")
    rewrite_tensors(directory, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].astype(dtype)))
    stored = {np.int32: "I32", np.int8: "I8", np.bool_: "BOOL"}[dtype]
    with refused(CheckpointError, f"tensor model.norm.weight in model.safetensors is stored as {stored}",
                 "floating-point weights", "dequantize or convert"):
        SIDES[backend][1].from_pretrained(directory)


@pytest.mark.parametrize("backend", list(SIDES))
def test_item4_weights_handed_over_without_some_tensors_are_refused_with_the_count(checkpoints, backend):
    """from_weights (the handoff's and the default model's loader) names how many tensors are missing, the first with
    its shape, and what to pass, before anything is built."""
    from safetensors.numpy import load_file

    arrays = load_file(str(checkpoints["gqa"] / "model.safetensors"))
    config = MistralConfig.from_json(checkpoints["gqa"] / "config.json")
    as_backend = torch.from_numpy if backend == "torch" else jnp.asarray
    dropped = ("model.layers.1.mlp.up_proj.weight", "model.norm.weight")
    weights = {name: as_backend(array) for name, array in arrays.items() if name not in dropped}
    with refused(CheckpointError, f"weights lack 2 of the {len(arrays)} tensors", "first model.layers.1.mlp.up_proj",
                 f"[{config.intermediate_size}, {config.hidden_size}]", "pass every tensor"):
        SIDES[backend][1].from_weights(config, weights)


@pytest.mark.parametrize("backend", list(SIDES))
def test_item4_weights_handed_over_in_another_shape_are_refused_naming_the_tensor(checkpoints, backend):
    """from_weights compared names only: JAX built a model of half an embedding table (one rank's slice of a torch
    model split over a mesh, through from_torch) that failed only when run; torch raised load_state_dict's
    multi-line RuntimeError."""
    from safetensors.numpy import load_file

    arrays = load_file(str(checkpoints["gqa"] / "model.safetensors"))
    config = MistralConfig.from_json(checkpoints["gqa"] / "config.json")
    as_backend = torch.from_numpy if backend == "torch" else jnp.asarray
    weights = {name: as_backend(array) for name, array in arrays.items()}
    weights["model.embed_tokens.weight"] = as_backend(arrays["model.embed_tokens.weight"][: config.vocab_size // 2])
    with refused(CheckpointError, "weights tensor model.embed_tokens.weight has shape "
                 f"[{config.vocab_size // 2}, {config.hidden_size}]", f"needs [{config.vocab_size}, "
                 f"{config.hidden_size}]", "pass the tensors of a checkpoint saved for this config"):
        SIDES[backend][1].from_weights(config, weights)
    # Arrays of another kind raised load_state_dict's RuntimeError wall (torch) or AttributeError (JAX); integer
    # ones built an int32 JAX model; two dtypes built a torch model whose first matmul raised RuntimeError.
    own, other = ("torch.Tensor", jnp.asarray) if backend == "torch" else ("jax.Array", torch.from_numpy)
    convert = "torch.from_numpy(array)" if backend == "torch" else "jnp.asarray(array)"
    name = "model.norm.weight"
    for foreign in (np.asarray, other):
        weights = {key: as_backend(array) for key, array in arrays.items()} | {name: foreign(arrays[name])}
        with refused(CheckpointError, f"weights tensor {name} is a", f"not a {own}", convert):
            SIDES[backend][1].from_weights(config, weights)
    weights = {key: as_backend(array) for key, array in arrays.items()} | {name: as_backend(arrays[name].astype(
        np.int32))}
    with refused(CheckpointError, f"weights tensor {name} is int32", "floating-point weights"):
        SIDES[backend][1].from_weights(config, weights)
    if backend == "torch":
        weights = {key: as_backend(array) for key, array in arrays.items()} | {name: as_backend(arrays[name]).half()}
        with refused(CheckpointError, "is torch.float32 but model.norm.weight is torch.float16", "convert every"):
            SIDES[backend][1].from_weights(config, weights)


# --- 9. absurd configs are refused before anything large is built -----------------------------------------------------


@pytest.mark.parametrize("backend", list(SIDES))
def test_item9_absurd_layer_count_is_refused_from_the_tensor_list(checkpoints, tmp_path, backend):
    directory = copy_checkpoint(checkpoints["gqa"], tmp_path / "absurd")
    edit_config(directory, lambda raw: raw.__setitem__("num_hidden_layers", 10**8))
    tracemalloc.start()
    try:
        with refused(CheckpointError, "missing tensor model.layers.2.self_attn.q_proj.weight"):
            SIDES[backend][1].from_pretrained(directory)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20e6, f"refusing took {peak / 1e6:.0f} MB of Python allocations: something was built per layer"


# --- 11. a refused call changes no state; the backends agree on seeds -------------------------------------------------


@pytest.mark.parametrize("seed", [2**70, 2**32, -1])
def test_item11_a_bad_seed_is_refused_before_the_cache_is_touched(side, seed):
    cache = side.fill(side.make_cache("sliding_window", side.config), 5)
    for temperature in (0.0, 0.7):  # greedy too: both backends refuse the same settings
        sampling = SamplingParams(temperature=temperature, seed=seed)
        with refused(InputError, f"seed={seed}", "[0, 2**32 - 1", side=side, cache=cache):
            side.generate([PROMPT], 3, cache=cache, sampling=sampling)
        with refused(InputError, f"seed={seed}", side=side, cache=cache):
            side.continue_(cache, [5], 2, sampling=sampling)


def test_item11_the_largest_seed_is_accepted_in_both_backends(side):
    assert side.generate([PROMPT], 3, sampling=SamplingParams(seed=2**32 - 1)).token_ids == side.generate(
        [PROMPT], 3).token_ids


# --- 12. messages that name their cause (API side) --------------------------------------------------------------------


def test_item12_a_cache_of_the_other_backend_is_named(side, pair):
    torch_model, jax_model = pair
    foreign = (jc.make_cache("sliding_window", jax_model.config, 1, 24) if side.name == "torch" else
               tc.make_cache("sliding_window", torch_model.config, 1, 24))
    other = "jax_cache" if side.name == "torch" else "torch_cache"
    for call in (lambda: side.continue_(foreign, [5], 2), lambda: side.generate([PROMPT], 2, cache=foreign),
                 lambda: _backend(side).memory_per_device(side.model, foreign)):  # AttributeError from inside
        with refused(CacheError, f"cache is a {other}.cache.SlidingWindowCache", f"not a {side.name}_cache cache",
                     "twincache_app.handoff.cache_"):
            call()
    # the other tower's model: torch raised AttributeError ('str' has no 'type'), JAX blamed the cache's dtype or device
    other_model = jax_model if side.name == "torch" else torch_model
    tower, backend = (tg, tb) if side.name == "torch" else (jg, jb)
    own = side.make_cache("sliding_window")
    for call in (lambda: tower.generate(other_model, [PROMPT], 2), lambda: tower.decode_step_fn(other_model),
                 lambda: tower.continue_generation(other_model, own, [5], 2),
                 lambda: backend.generate(other_model, [PROMPT], 2),
                 lambda: backend.memory_per_device(other_model, own)):
        with refused(InputError, f"model is a {other}.model.Mistral, not a {side.name}_cache.model.Mistral",
                     "twincache_app.handoff."):
            call()


@pytest.mark.parametrize(("prompts", "fragment"), [
    ([[5, 1.7, 6]], "prompt 0 holds token id 1.7, which is not an integer"),
    ([[5, 2.0]], "prompt 0 holds token id 2.0, which is not an integer"),
    ([[5, "6"]], "prompt 0 holds token id '6'"),
    ([[5, True]], "prompt 0 holds token id True"),
    ([5, 6], "prompt 0 is 5, not a sequence of token ids"),
    (["hello"], "prompt 0 is 'hello', not a sequence of token ids"),
    ("hello", "prompts must be a list of token-id lists"),
    ([np.asarray([5.0, 6.0])], "which is not an integer"),
    (np.asarray(5), "prompts must be a list of token-id lists, e.g. [[1, 2, 3]], not ndarray"),  # 0-d: TypeError
    ([torch.tensor(5)], "prompt 0 is tensor(5), not a sequence of token ids"),
    ([{5, 6}], "prompt 0 is a set, whose ids have no order"),  # was decoded in the set's iteration order
    ([{5: 1, 6: 2}], "prompt 0 is a dict, whose ids have no order"),
])
def test_item12_float_and_malformed_ids_are_refused_not_truncated(side, prompts, fragment):
    with refused(InputError, fragment):
        side.generate(prompts, 2)


def test_item12_float_last_tokens_are_refused(side):
    cache = side.fill(side.make_cache("static", side.config), 4)
    with refused(InputError, "last token of row 0 holds token id 5.9", side=side, cache=cache):
        side.continue_(cache, [5.9], 2)
    with refused(InputError, "last_tokens must be a list of one token id per row, not ndarray", side=side, cache=cache):
        side.continue_(cache, np.asarray(5), 2)  # 0-d: iterating it raised TypeError


@pytest.mark.parametrize(("content", "fragment"), [
    (b"[1, 2]", "must hold a JSON object of fields, not a list"),
    (b"null", "not null"),
    ("{\"model_type\": \"mistral\", \"x\": \"caf\u00e9\"}".encode("latin-1"), "is not UTF-8 text"),
])
@pytest.mark.parametrize("backend", list(SIDES))
def test_item12_config_files_that_are_not_objects_or_utf8(checkpoints, tmp_path, backend, content, fragment):
    directory = copy_checkpoint(checkpoints["gqa"], tmp_path / "config")
    (directory / "config.json").write_bytes(content)
    with refused(ConfigError, fragment):
        SIDES[backend][1].from_pretrained(directory)


@pytest.mark.parametrize(("weight_map", "fragment"), [
    ({"model.norm.weight": 1}, "weight_map['model.norm.weight'] = 1 is not a shard file name"),
    ({"model.norm.weight": None}, "= None is not a shard file name"),
    ({"model.norm.weight": "../outside.safetensors"}, "'../outside.safetensors' is not a shard file name"),
    (["model.norm.weight"], "'weight_map' must map tensor names to shard file names"),
])
def test_item12_a_weight_map_with_non_string_values(checkpoints, tmp_path, weight_map, fragment):
    directory = copy_checkpoint(checkpoints["sharded"], tmp_path / "sharded")
    index = directory / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"] = weight_map if isinstance(weight_map, list) else raw["weight_map"] | weight_map
    index.write_text(json.dumps(raw))
    for backend in SIDES:
        with refused(CheckpointError, "model.safetensors.index.json", fragment):
            SIDES[backend][1].from_pretrained(directory)


def test_item12_a_tensor_stored_in_two_shards_is_refused(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints["sharded"], tmp_path / "sharded")
    shards = sorted(directory.glob("model-*.safetensors"))
    shutil.copy(shards[0], directory / "model-extra.safetensors")
    index = directory / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["extra.marker"] = "model-extra.safetensors"
    index.write_text(json.dumps(raw))
    with refused(CheckpointError, "is stored twice", shards[0].name, "model-extra.safetensors"):
        TorchMistral.from_pretrained(directory)


def test_item12_a_directory_with_one_file_and_shards_loads_what_transformers_loads(checkpoints, tmp_path):
    """Beside an index and its shards, a model.safetensors is what transformers' from_pretrained reads; both towers
    read it too, or parity would compare two different models (the shards here hold another seed's weights)."""
    from safetensors.numpy import load_file
    from transformers import MistralForCausalLM

    directory = copy_checkpoint(checkpoints["sharded"], tmp_path / "both")
    shutil.copy(checkpoints["gqa"] / "model.safetensors", directory / "model.safetensors")
    single = load_file(str(checkpoints["gqa"] / "model.safetensors"))["model.embed_tokens.weight"]
    reference = MistralForCausalLM.from_pretrained(directory).model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(reference, single, err_msg="transformers no longer prefers the single file")
    np.testing.assert_array_equal(TorchMistral.from_pretrained(directory).model.embed_tokens.weight.numpy(), single)
    np.testing.assert_array_equal(np.asarray(JaxMistral.from_pretrained(directory).model.embed_tokens.weight[...]),
                                  single)


def _unwritable(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: chmod for a normal user, /sys for root (chmod binds no root)."""
    directory = tmp_path / "read_only"
    directory.mkdir()
    directory.chmod(0o555)
    probe = directory / "probe"
    try:
        probe.touch()
    except PermissionError:
        return directory
    probe.unlink()
    return Path("/sys/twincache-read-only-home")


def test_item12_twincache_home_that_is_a_file_or_read_only(tmp_path, monkeypatch):
    home_file = tmp_path / "home_file"
    home_file.write_text("not a directory")
    monkeypatch.setenv("TWINCACHE_HOME", str(home_file))
    with refused(StorageError, str(home_file), "is a file, not a directory", "TWINCACHE_HOME"):
        default_model.default_model_dir()
    read_only = _unwritable(tmp_path)
    monkeypatch.setenv("TWINCACHE_HOME", str(read_only))
    with refused(StorageError, str(read_only), "is not a writable directory", "TWINCACHE_HOME"):
        default_model.default_model_dir()
    # a link to a directory that is gone (a disk not mounted): mkdir said only "(File exists)"
    dangling = tmp_path / "home_link"
    dangling.symlink_to(tmp_path / "unmounted" / "cache")
    monkeypatch.setenv("TWINCACHE_HOME", str(dangling))
    with refused(StorageError, f"{dangling} is a symbolic link to {tmp_path / 'unmounted' / 'cache'}, which does not "
                 "exist", "TWINCACHE_HOME"):
        default_model.default_model_dir()
    # no home at all (a container run as a uid without a passwd entry, HOME unset): "unexpected RuntimeError: Could
    # not determine home directory."
    import pwd

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME")
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for home in ("", "~/models"):
        monkeypatch.setenv("TWINCACHE_HOME", home)
        with refused(StorageError, "there is none (HOME is unset and uid", "set TWINCACHE_HOME"):
            default_model.default_model_dir()



# --- 13. the Python API's own calls: refused before anything is written, in both towers -------------------------------


def _backend(side: Side) -> Any:
    return tb if side.name == "torch" else jb


def _mode(side: Side) -> str:
    return "eager" if side.name == "torch" else "step"


def test_item13_advance_past_the_capacity_is_refused_before_it_records_anything(side):
    """A direct advance() on a full cache: torch raised an IndexError after writing a row's positions, JAX recorded
    the position over the last one and counted past the capacity."""
    cache = side.fill(side.make_cache("static", batch=2, length=6), 6)
    cache_after = cache
    positions = np.tile(np.arange(6, 10), (2, 1))
    with refused(CacheError, "writing 4 tokens at columns 6..9", "capacity [0, 6)", side=side, cache=cache):
        cache_after = cache.advance(torch.as_tensor(positions) if side.name == "torch" else jnp.asarray(positions))
    assert cache_after is cache
    with refused(CacheError, "new_positions must hold whole positions", side=side, cache=cache):
        cache.advance(torch.zeros(2, 0) if side.name == "torch" else jnp.zeros((2, 0)))
    with refused(CacheError, "new_positions has shape [3, 1]", side=side, cache=cache):
        cache.advance(torch.zeros(3, 1, dtype=torch.long) if side.name == "torch" else jnp.zeros((3, 1), jnp.int32))


def test_item13_update_with_keys_and_values_of_other_shapes_writes_nothing(side):
    """torch wrote the keys, then failed on the values (an IndexError); JAX wrote them into different slots."""
    cache = side.make_cache("static", batch=1, length=8)
    heads, head_dim = side.config.num_key_value_heads, side.config.head_dim
    make = (lambda *shape: torch.ones(shape)) if side.name == "torch" else (lambda *shape: jnp.ones(shape))
    with refused(CacheError, "key_states has shape [1, 2, 1, 16] but value_states has [1, 2, 3, 16]", side=side,
                 cache=cache):
        cache.update(0, make(1, heads, 1, head_dim), make(1, heads, 3, head_dim))
    for layer in (0.5, True):
        with refused(CacheError, f"layer_idx={layer!r} must be an int", side=side, cache=cache):
            cache.update(layer, make(1, heads, 1, head_dim), make(1, heads, 1, head_dim))


@pytest.mark.parametrize(("positions", "mask", "fragment"), [
    ([[0.0, 1.0, 2.7]], None, "positions dtype"),  # RoPE read 2.7, the cache recorded 2
    ([[0, 1, 2]], [[2, 1, 1]], "attention_mask row 0 holds 2 at column 0"),
    ([[0, 1, 2]], [[1, 1, 0]], "attention_mask row 0 has right padding"),
])
def test_item13_a_forward_refuses_float_positions_and_masks_that_are_not_left_padded_0_1(side, positions, mask,
                                                                                         fragment):
    cache = side.make_cache("static", batch=1, length=8)
    if side.name == "torch":
        ids, call = torch.tensor([[5, 6, 7]]), lambda p, m: side.model(ids, p, cache, m)
        args = (torch.as_tensor(np.asarray(positions)), None if mask is None else torch.tensor(mask))
    else:
        ids, call = jnp.asarray([[5, 6, 7]], jnp.int32), lambda p, m: side.model(ids, p, cache, m)
        args = (jnp.asarray(positions), None if mask is None else jnp.asarray(mask))
    with refused(InputError, fragment, side=side, cache=cache):
        call(*args)


def test_item13_a_forward_names_inputs_of_the_wrong_kind_and_a_cache_of_the_other_tower(side):
    cache = side.make_cache("static", batch=1, length=8)
    with refused(InputError, "input_ids must be a [batch, seq_len]", "not list", side=side, cache=cache):
        side.model([[5, 6, 7]], np.zeros((1, 3), np.int64), cache)
    empty = torch.zeros(0, 3, dtype=torch.long) if side.name == "torch" else jnp.zeros((0, 3), jnp.int32)
    with refused(InputError, "input_ids has shape [0, 3]", side=side, cache=cache):
        side.model(empty, empty, cache)
    other = (jc if side.name == "torch" else tc).make_cache("static", side.config, 1, 8)  # the other tower's
    ids = torch.tensor([[5, 6, 7]]) if side.name == "torch" else jnp.asarray([[5, 6, 7]], jnp.int32)
    with refused(CacheError, f"not a {side.name}_cache cache", "twincache_app.handoff"):
        side.model(ids, torch.arange(3)[None] if side.name == "torch" else jnp.arange(3)[None], other)


def test_item13_an_on_token_that_cannot_be_called_is_refused_before_the_cache_is_touched(side):
    """JAX's continue_generation donated the cache and then failed calling it: the user's cache was gone."""
    cache = side.generate([PROMPT], 3, cache="static", max_cache_len=16).cache
    with refused(InputError, "on_token must be a function", "got int", side=side, cache=cache):
        side.continue_(cache, [7], 3, on_token=5)
    with refused(InputError, "on_token must be a function", side=side, cache=cache):
        side.generate([PROMPT], 3, cache=cache, on_token=5)


def test_item13_an_on_token_that_edits_its_list_changes_no_token(side):
    """on_token was handed generate's own list of first tokens, which then fed the continuation: a callback that
    cleared it got 'no last tokens given' mid-run, one that edited it changed the tokens generated."""
    expected = side.generate([PROMPT, PROMPT[:2]], 4).token_ids
    seen: list[list[int]] = []

    def edits(tokens: list[int]) -> None:
        seen.append(list(tokens))
        tokens[0] = VOCAB - 1
        tokens.append(3)

    assert side.generate([PROMPT, PROMPT[:2]], 4, on_token=edits).token_ids == expected
    assert seen == [list(step) for step in zip(*expected)]


def test_item13_step_logits_checks_its_sequence_and_prompt_len(side):
    backend, mode = _backend(side), _mode(side)
    for sequence, prompt_len, fragment in (([5, 2.7, 9], 1, "sequence 0"), ("579", 1, "tokenize"),
                                           ([5, 6, 7], 4, "prompt_len=4 must be an int in [1, 3]"),
                                           ([5, 6, 7], 0, "prompt_len=0"), ([5, 6, 7], 2.0, "prompt_len=2.0"),
                                           ([5, 6, 7], True, "prompt_len=True")):
        with refused(InputError, fragment):
            backend.step_logits(side.model, sequence, prompt_len, "static", mode)
    assert backend.step_logits(side.model, [5, 6, 7], 3, "static", mode).shape == (0, VOCAB)  # nothing to force
    result = side.generate([PROMPT, PROMPT[:2]], 0, return_logits=True)  # as continue_generation: [B, 0, V]
    assert tuple(result.step_logits.shape) == (2, 0, VOCAB)


def test_item13_a_donated_jax_cache_is_named_stale_by_every_method_that_reads_it(checkpoints):
    side = JaxSide(JaxMistral.from_pretrained(checkpoints["gqa"]))
    cache = side.make_cache("static", batch=1, length=8)
    side.step([[5]], [[0]], cache)  # donates it
    for read in (lambda: cache.advance(jnp.zeros((1, 1), jnp.int32)), lambda: cache.next_positions(),
                 lambda: cache.attended_positions(jnp.zeros((1, 1), jnp.int32)),
                 lambda: jb.memory_per_device(side.model, cache)):  # was JAX's bare "Array has been deleted"
        with refused(StaleCacheError, "donated to a jitted call"):
            read()


def test_item13_arguments_of_the_wrong_kind_are_named(side, checkpoints):
    """A dict for sampling, a list for mode, a dtype of the other framework or an integer one for a cache: each
    raised an AttributeError or TypeError from inside. So did a model's: torch's from_pretrained raised
    AttributeError for a name, load_state_dict's wall for torch.int32; JAX's built an int32 model, or a float32 one
    for float64 (x64 off); backend.load crashed in torch on np.dtype("float32"), which JAX took, and said
    'dtype=torch.bfloat16 is not one of float32, bfloat16, float16'."""
    with refused(InputError, "sampling must be a twincache.generation.SamplingParams", "not dict"):
        side.generate([PROMPT], 2, sampling={"temperature": 1.0})
    with refused(InputError, "mode ['eager'] is not a"):
        _backend(side).generate(side.model, [PROMPT], 2, mode=["eager"])
    other_framework = "float32" if side.name == "torch" else torch.float32
    integer = torch.int32 if side.name == "torch" else jnp.int32
    for dtype in (other_framework, integer):
        with refused(CacheError, f"dtype={dtype!r} must be a floating-point"):
            side.cache_module.StaticCache(side.config, 1, 8, dtype=dtype)
    model_class, example = type(side.model), "torch.bfloat16" if side.name == "torch" else "jnp.bfloat16"
    for dtype in (other_framework, integer):
        with refused(InputError, f"dtype={dtype!r} must be a floating-point", example, "load takes the name"):
            model_class.from_pretrained(checkpoints["gqa"], dtype)
    if side.name == "jax":  # x64 is off (JAX's default): a float64 model would be float32
        with refused(InputError, "dtype=float64 needs JAX's 64-bit mode", "jax_enable_x64"):
            model_class.from_pretrained(checkpoints["gqa"], jnp.float64)
        with refused(CacheError, "dtype=float64 needs JAX's 64-bit mode", "jax_enable_x64"):  # a float32 cache
            side.cache_module.StaticCache(side.config, 1, 8, dtype=jnp.float64)
    for dtype in (torch.bfloat16, jnp.bfloat16, np.dtype("float32")):
        with refused(InputError, f"dtype={dtype!r} must be a dtype name", 'dtype="bfloat16"'):
            _backend(side).load(checkpoints["gqa"], dtype)
    # switches were read for their truth: fused="step" / compile="no" ran the compiled mode, return_logits="no" kept
    # the logits, fused=None ran the step mode
    switch = "compile" if side.name == "torch" else "fused"
    generate, continue_ = (tg.generate, tg.continue_generation) if side.name == "torch" else (
        jg.generate, jg.continue_generation)
    cache = side.generate([PROMPT], 2, cache="static", max_cache_len=16).cache
    for wrong, fragment in ((-1, "max_cache_len=-1 must be > 0"), (32, "max_cache_len=32 was given with a cache "
                                                                        "object built for max_cache_len=16")):
        with refused(InputError, fragment, side=side, cache=cache):  # was ignored without a word
            generate(side.model, [PROMPT], 2, cache=cache, max_cache_len=wrong)
    assert generate(side.model, [PROMPT], 2, cache=cache, max_cache_len=16).max_cache_len == 16  # its own: accepted
    cache = side.generate([PROMPT], 2, cache="static", max_cache_len=16).cache  # JAX consumed the one given
    for kwargs in ({switch: "step"}, {switch: None}, {"return_logits": "no"}):
        (name, value), = kwargs.items()
        with refused(InputError, f"{name}={value!r} must be True or False", side=side, cache=cache):
            generate(side.model, [PROMPT], 2, cache=cache, **kwargs)
        with refused(InputError, f"{name}={value!r} must be True or False", side=side, cache=cache):
            continue_(side.model, cache, [5], 2, **kwargs)


def test_item13_the_handoff_names_a_model_or_config_of_the_wrong_kind(pair):
    torch_model, jax_model = pair
    with refused(InputError, "to_torch copies a jax_cache.model.Mistral", "use from_torch"):
        handoff.to_torch(torch_model)
    with refused(InputError, "from_torch copies a torch_cache.model.Mistral", "use to_torch"):
        handoff.from_torch(jax_model)
    cache = tc.make_cache("static", torch_model.config, 1, 8)
    with refused(InputError, "cache_from_torch needs the model's twincache.config.MistralConfig", "not dict"):
        handoff.cache_from_torch(cache, {})
    # a device torch cannot use raised RuntimeError (or, for "cuda" on a CPU-only torch, AssertionError) from inside
    jax_cache = jc.make_cache("static", jax_model.config, 1, 8)
    for call in (lambda: handoff.to_torch(jax_model, "tpu"),
                 lambda: handoff.cache_to_torch(jax_cache, jax_model.config, "tpu"),
                 lambda: tc.StaticCache(torch_model.config, 1, 8, device="tpu")):
        with refused(InputError, "device='tpu' is not usable by this torch", "pass 'cpu', 'cuda' or 'cuda:N'"):
            call()


def test_item13_continuing_a_row_that_ended_with_eos_gives_it_nothing(side):
    """A row whose last token is EOS is finished: its continuation is empty (it was [EOS]), while the other row goes
    on; the streamed steps still carry EOS for it, as for any finished row."""
    config = side.model.config
    side.model.config = dataclasses.replace(config, eos_token_id=2)
    try:
        cache = side.generate([PROMPT, [3, 4]], 3, cache="static", max_cache_len=32).cache
        streamed: list[list[int]] = []
        if side.name == "torch":
            result = tg.continue_generation(side.model, cache, [2, 9], 3, compile=False, on_token=streamed.append)
        else:  # the fused loop hands its tokens over by block, through the same bookkeeping
            fused = jg.continue_generation(side.model, side.generate([PROMPT, [3, 4]], 3, cache="static",
                                                                     max_cache_len=32).cache, [2, 9], 3, fused=True)
            assert fused.token_ids[0] == [], fused.token_ids
            result = jg.continue_generation(side.model, cache, [2, 9], 3, fused=False, on_token=streamed.append)
    finally:
        side.model.config = config
    assert result.token_ids[0] == [], result.token_ids
    assert len(result.token_ids[1]) == 3 or result.token_ids[1][-1] == 2, result.token_ids
    assert [row[0] for row in streamed] == [2] * len(streamed) and streamed, streamed


def test_item13_a_continuation_past_a_bounded_cache_says_how_many_tokens_fit(side):
    """A continuation that would write past a static cache (or a ring shorter than the window) was refused with the
    raw write's words, "writing 1 tokens at columns 6..6 ... reset() it": reset() throws away what it continues. It
    says how many new tokens still fit, or that the cache is full, in both towers, and changes nothing."""
    for kind, length in (("static", 6), ("sliding_window", WINDOW - 2)):  # the ring: bounded, shorter than its window
        cache = side.fill(side.make_cache(kind, length=length), length - 2)
        with refused(CacheError, "max_new_tokens=3 needs 3 free columns",
                     f"capacity is {length} columns, {length - 2} of them written", "at most 2 new tokens",
                     side=side, cache=cache):
            side.continue_(cache, [5], 3)
        cache = side.continue_(cache, [5], 2).cache  # exactly the room left
        with refused(CacheError, "max_new_tokens=1 cannot continue", "it is full",
                     f"capacity is {length} columns, {length} of them", "max_cache_len", side=side, cache=cache):
            side.continue_(cache, [5], 1)
        assert side.continue_(cache, [5], 0).token_ids == [[]]


def test_item13_continuation_messages_speak_of_last_tokens_and_rows(side):
    cache = side.generate([PROMPT, PROMPT], 2, cache="static", max_cache_len=40).cache  # JAX pads to 16 columns
    with refused(InputError, "no last tokens (one per cache row) given", side=side, cache=cache):
        side.continue_(cache, [], 2)
    with refused(CacheError, "batch 1 was given", "one last token) per cache row", side=side, cache=cache):
        side.continue_(cache, [7], 2)
    with refused(InputError, "forced_tokens row 0 is 1", "one list of ids per row", side=side, cache=cache):
        side.continue_(cache, [7, 8], 2, forced_tokens=[1, 2])


def test_item13_a_negative_logits_to_keep_is_refused(side):
    """-1 returned S - 1 positions' logits without a word."""
    cache = side.make_cache("static", batch=1, length=8)
    ids = torch.tensor([[5, 6, 7]]) if side.name == "torch" else jnp.asarray([[5, 6, 7]], jnp.int32)
    positions = torch.arange(3)[None] if side.name == "torch" else jnp.arange(3)[None]
    with refused(InputError, "logits_to_keep=-1 must be >= 0", side=side, cache=cache):
        side.model(ids, positions, cache, None, -1)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_item13_a_device_the_framework_cannot_use_is_named_before_loading(checkpoints, backend):
    """backend.load(device=...) with a device name the framework does not know raised its own RuntimeError."""
    module = tb if backend == "torch" else jb
    with refused(InputError, "device='nope' is not usable by this"):
        module.load(checkpoints["gqa"], device="nope")
    if backend == "torch":  # the model's own loader raised torch's RuntimeError
        with refused(InputError, "device='nope' is not usable by this torch"):
            TorchMistral.from_pretrained(checkpoints["gqa"], torch.float32, "nope")
    # torch's "platform:N" spelling: JAX refused "cpu:0" and put "cuda:1" on the first GPU
    assert "cpu" in str(module.load(checkpoints["gqa"], device="cpu:0").device)
    if backend == "jax":
        count = len(jax.devices("cpu"))
        with refused(InputError, f"device='cpu:{count}' names no device of this JAX", f"cpu:0 to cpu:{count - 1}"):
            module.load(checkpoints["gqa"], device=f"cpu:{count}")


def test_a_prefill_validates_its_mask_once(side, monkeypatch):
    """prefill validates the whole prompt's mask (0/1, left-padded, a token per row) before its first chunk; the
    model's input check after it no longer reads the mask again. Counted at validate_attention_mask, wherever the
    tower calls it; the cache refuses the prompt after the input checks, so nothing runs."""
    import twincache.generation

    model_module, generate_module = (tm, tg) if side.name == "torch" else (jm, jg)
    validated: list[tuple[int, ...]] = []

    def counted(mask: np.ndarray, shape: tuple[int, ...], whole_prompt: bool = True) -> None:
        validated.append(tuple(mask.shape))
        twincache.generation.validate_attention_mask(mask, shape, whole_prompt)

    for module in (model_module, generate_module):
        monkeypatch.setattr(module, "validate_attention_mask", counted)
    cache = side.make_cache("static", batch=2, length=3)  # 4 columns do not fit: refused after the input checks
    mask = [[0, 1, 1, 1], [1, 1, 1, 1]]
    ids, mask = ((torch.tensor([[0, 5, 6, 7], [4, 5, 6, 7]]), torch.tensor(mask)) if side.name == "torch" else
                 (jnp.asarray([[0, 5, 6, 7], [4, 5, 6, 7]], jnp.int32), jnp.asarray(mask, jnp.int32)))
    with refused(CacheError, "writing 4 tokens at columns 0..3 is outside", side=side, cache=cache):
        generate_module.prefill(side.model, ids, mask, cache)
    assert validated == [(2, 4)], f"the mask was validated {len(validated)} times"
