"""jax_cache.model on XLA-CPU: a half-precision decode row is contracted as one of 3 rows with fp32 accumulation, and
stored_dtype keeps as float32 (holding the same values) the matrices of a float16 model and a bf16 embedding table.

XLA-CPU's matrix-vector path for bf16/fp16 weights streams at ~1.4 GB/s, against ~14-23 GB/s for 3 or more rows
with fp32 accumulation (bench/README), which made JAX bf16 decoding ~7x slower than fp32; float16 stays at ~2 GB/s
in every form, fp32 at 35-70 GB/s, and a bf16 table's row gather converted the whole table on every call of a decode
loop (docs/design.md §7.20). These tests check the compiled HLO (what XLA runs), the stored weights and the values;
speed is measured in bench/.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jax_cache.cache import StaticCache
from jax_cache.model import Mistral
from jax_cache.projection import project
from twincache.errors import CacheError

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="an XLA-CPU workaround (jax_cache/projection.py)")


def compiled_dots(fn, *args) -> list[str]:
    return [line for line in jax.jit(fn).lower(*args).compile().as_text().splitlines() if " dot(" in line]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 1, 64)])
def test_few_half_precision_rows_are_padded_to_three_and_accumulated_in_fp32(dtype, shape):
    weight = jax.random.normal(jax.random.key(0), (96, 64), dtype)
    x = jax.random.normal(jax.random.key(1), shape, dtype)
    out = project(x, weight)
    assert out.shape == (*shape[:-1], 96) and out.dtype == dtype
    hlo = jax.jit(project).lower(x, weight).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots and all(re.search(r"= f32\[3,96\]", line) for line in dots), dots
    expected = np.asarray(x, np.float32).reshape(-1, 64) @ np.asarray(weight, np.float32).T  # fp32 truth
    np.testing.assert_allclose(np.asarray(out, np.float32).reshape(-1, 96), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [3, 8])
def test_three_or_more_half_precision_rows_contract_as_they_are(rows):
    weight = jax.random.normal(jax.random.key(0), (96, 64), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (rows, 64), jnp.bfloat16)
    dots = compiled_dots(project, x, weight)
    assert dots and all(f"[{rows},96]" in line.split(" dot(")[0] for line in dots), dots


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 1, 64), (8, 1, 64), (4, 5, 64)])
def test_an_fp32_weight_is_the_left_operand_of_its_dot(shape):
    """XLA-CPU streamed an fp32 weight 1.2-3x faster at 2-128 rows as the dot's left operand (weight @ x.T) than as
    its right (x @ weight.T), with the same rounding (docs/design.md §7.35): the dot's output is [out, rows]. x is
    [B, S, in], as the model calls it (of a 2D x XLA folds the transpose back into x @ weight.T)."""
    weight = jax.random.normal(jax.random.key(0), (96, 64), jnp.float32)
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    out = project(x, weight)
    assert out.shape == (*shape[:-1], 96) and out.dtype == jnp.float32
    rows = int(np.prod(shape[:-1]))
    dots = compiled_dots(project, x, weight)
    assert dots and all(re.search(rf"= f32\[96,{rows}\]", line) for line in dots), dots
    expected = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T  # float64 truth
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_weight_stored_wider_than_x_is_contracted_in_its_dtype_and_returns_x_dtype(rows):
    weight = jax.random.normal(jax.random.key(0), (96, 64), jnp.float16).astype(jnp.float32)  # fp16 values
    x = jax.random.normal(jax.random.key(1), (rows, 1, 64), jnp.float16)  # [B, S, in], as the model calls it
    out = project(x, weight)
    assert out.shape == (rows, 1, 96) and out.dtype == jnp.float16
    dots = compiled_dots(project, x, weight)
    assert dots and all(re.search(rf"= f32\[96,{rows}\]", line) and "f16" not in line for line in dots), dots
    expected = (np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T).astype(np.float16)  # one rounding
    np.testing.assert_allclose(np.asarray(out, np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_model_keeps_the_weights_xla_cpu_is_slow_on_as_float32(checkpoints: dict[str, Path], dtype):
    """float16: every matrix; bfloat16: the embedding table. Each holds exactly the values of the dtype."""
    checkpoint = load_file(str(checkpoints["gqa"] / "model.safetensors"))
    model = Mistral.from_pretrained(checkpoints["gqa"], jnp.dtype(dtype))
    stored = {".".join(map(str, path)): variable.get_value() for path, variable in nnx.to_flat_state(nnx.state(model))}
    assert set(stored) == set(checkpoint)
    for name, array in stored.items():
        widened = array.ndim == 2 and (dtype == "float16" or name == "model.embed_tokens.weight")
        assert array.dtype == (jnp.float32 if widened else jnp.dtype(dtype)), (name, array.dtype)
        rounded = np.asarray(jnp.asarray(checkpoint[name]).astype(dtype), np.float32)
        np.testing.assert_array_equal(np.asarray(array, np.float32), rounded, err_msg=name)
    assert model.dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_a_decode_loop_converts_no_whole_weight_outside_its_body(checkpoints: dict[str, Path], dtype, name):
    """XLA-CPU gathers bf16 embedding rows from an fp32 copy of the table, and hoists that copy out of a while loop:
    each call of a decode loop then converted the whole table (22 ms on the trained model). No [V, hidden] array may
    be computed in the entry computation of a loop over decode steps (both decode modes are such loops)."""
    model = Mistral.from_pretrained(checkpoints[name], jnp.dtype(dtype))
    graphdef, params = nnx.split(model)

    def decode_loop(params, cache, ids, steps):
        def body(carry):
            cache, ids, step = carry
            logits, cache = nnx.merge(graphdef, params)(ids, step[None, None], cache)
            return cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], step + 1

        return jax.lax.while_loop(lambda carry: carry[2] < steps, body, (cache, ids, jnp.int32(0)))

    cache = StaticCache(model.config, 1, 16, model.dtype)
    hlo = jax.jit(decode_loop).lower(params, cache, jnp.ones((1, 1), jnp.int32), jnp.int32(4)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    shape = rf"= \w+\[{model.config.vocab_size},{model.config.hidden_size}\]"
    computed = [line.strip()[:160] for line in entry
                if re.search(shape, line) and not re.search(r"parameter\(|get-tuple-element\(", line)]
    assert not computed, computed


def test_a_float16_model_computes_and_caches_in_float16(checkpoints: dict[str, Path]):
    model = Mistral.from_pretrained(checkpoints["tied"], jnp.float16)  # the tied table is also the LM head
    ids = jnp.asarray([[5, 17, 3]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    logits, cache = model(ids, positions, StaticCache(model.config, 1, 16, jnp.float16))
    assert logits.dtype == jnp.float16 and {k.dtype for k in (*cache.keys, *cache.values)} == {jnp.dtype("float16")}
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    with pytest.raises(CacheError, match="float32"):
        model(ids, positions, StaticCache(model.config, 1, 16, jnp.float32))


def test_without_the_memory_for_float32_copies_the_weights_stay_as_they_are(checkpoints: dict[str, Path],
                                                                             monkeypatch):
    """As torch_cache's packed weights: copies that would crowd the host are not made; the model is slower, and its
    logits are the same sums of the same products."""
    import jax_cache.model as jax_model

    widened = Mistral.from_pretrained(checkpoints["gqa"], jnp.float16)
    # room for the float16 weights themselves (the load's own check), not for float32 copies of their matrices
    fp16_bytes = sum(array.size * 2 for array in load_file(str(checkpoints["gqa"] / "model.safetensors")).values())
    monkeypatch.setattr(jax_model, "available_memory", lambda device: fp16_bytes)  # bytes
    narrow = Mistral.from_pretrained(checkpoints["gqa"], jnp.float16)
    assert {variable.get_value().dtype for _, variable in nnx.to_flat_state(nnx.state(narrow))} == {
        jnp.dtype("float16")}
    ids, positions = jnp.asarray([[5, 17, 3]], jnp.int32), jnp.arange(3, dtype=jnp.int32)[None]
    logits = [np.asarray(model(ids, positions, StaticCache(model.config, 1, 8, jnp.float16))[0], np.float32)
              for model in (widened, narrow)]
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=2e-2)
