"""jax_cache.model.project: a half-precision decode row is contracted as one of 3 rows with fp32 accumulation.

XLA-CPU's matrix-vector path for bf16/fp16 weights streams at ~1.4 GB/s, against ~14-23 GB/s for 3 or more rows
with fp32 accumulation (bench/README), which made JAX bf16 decoding ~7x slower than fp32. These tests check the
lowered HLO (what XLA is asked to do) and the values; speed is measured in bench/.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cache.model import project

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA-CPU workaround (jax_cache/model.py)")


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


@pytest.mark.parametrize(("dtype", "rows"), [(jnp.float32, 1), (jnp.bfloat16, 3), (jnp.bfloat16, 8)])
def test_fp32_and_three_or_more_rows_contract_as_they_are(dtype, rows):
    weight = jax.random.normal(jax.random.key(0), (96, 64), dtype)
    x = jax.random.normal(jax.random.key(1), (rows, 64), dtype)
    hlo = jax.jit(project).lower(x, weight).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots and all(f"[{rows},96]" in line.split(" dot(")[0] for line in dots), dots
