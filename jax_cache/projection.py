"""How jax_cache's model multiplies by its weights: x @ W.T over the HF [out, in] layout, in the form XLA streams
fastest where it runs, and the dtype each weight is kept in on XLA-CPU (stored_dtype).

On XLA-CPU an fp32 weight is its dot's left operand, a half-precision decode row is padded to three rows and
accumulated in fp32, and some half-precision weights are kept as float32 holding the same values (docs/design.md
§7.20, §7.35). torch_cache/projection.py is the torch tower's counterpart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def matmul_precision(dtype: jnp.dtype) -> lax.Precision:
    """The precision of a product in `dtype`: HIGHEST for float32, whose parity needs true fp32 products (GPUs
    default to TF32), the default for lower precisions."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# XLA-CPU contracts a half-precision weight with fewer rows than this at ~1.4 GB/s (its matrix-vector path), with
# 3 or more rows and fp32 accumulation at ~14-23 GB/s (SmolLM2's [49152, 576] bf16 LM head, 2-core Xeon). A decode
# step's one row is padded up to it.
_HALF_PRECISION_MIN_ROWS = 3


def project(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x @ weight.T for weight [out, in] (HF layout), contracted over the last axis of both, in x's dtype. A weight
    stored wider than x (stored_dtype) is contracted in its own dtype, then rounded to x's."""
    if weight.dtype != x.dtype:
        return _contract(x.astype(weight.dtype), weight).astype(x.dtype)  # contracted in the stored dtype
    rows = int(np.prod(x.shape[:-1]))
    if (jnp.dtype(weight.dtype).itemsize == 2 and rows < _HALF_PRECISION_MIN_ROWS
            and jax.default_backend() == "cpu"):
        padded = jnp.pad(x.reshape(rows, -1), ((0, _HALF_PRECISION_MIN_ROWS - rows), (0, 0)))  # [3, in]
        out = lax.dot_general(padded, weight, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)[:rows]  # [rows, out] fp32 accumulated
        return out.astype(weight.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return _contract(x, weight)


def _contract(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] contracted with weight [out, in] over `in`: [..., out]. On XLA-CPU a float32 weight is the dot's
    left operand (weight @ x.T, then transposed), which streamed it 1.2-3x faster at 2-128 rows (batched decode;
    `small`'s [512, 1536] at 8 rows 23.1 against 11.2 GB/s) and as fast at one row, with the same
    values as x @ weight.T up to 8 rows and the same distance from float64 beyond (docs/design.md §7.35)."""
    if weight.dtype == jnp.float32 and jax.default_backend() == "cpu":
        out = lax.dot_general(weight, x, (((1,), (x.ndim - 1,)), ((), ())), precision=matmul_precision(weight.dtype))
        return jnp.moveaxis(out, 0, -1)  # [out, ...] -> [..., out]
    return lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())), precision=matmul_precision(weight.dtype))


_EMBEDDING_TABLE = "model.embed_tokens.weight"


def stored_dtype(name: str, array: jax.Array) -> jnp.dtype:
    """The dtype weight `name` is kept in: its own, but float32 on XLA-CPU (docs/design.md §7.20) for
    - every matrix of a float16 model: XLA-CPU contracts float16 at ~2 GB/s in every form measured, fp32 at 35-70 GB/s;
    - a bfloat16 embedding table: XLA-CPU gathers bf16 rows from an fp32 copy of the whole table, and in a decode loop
      it hoists that copy out of the loop, so every call of a loop converted the table (22 ms for the trained model's).
    The float32 arrays hold the same values, and the model computes in its own dtype (Mistral.dtype)."""
    on_cpu = all(device.platform == "cpu" for device in array.devices())
    half = array.dtype == jnp.float16 or (array.dtype == jnp.bfloat16 and name == _EMBEDDING_TABLE)
    return jnp.dtype(jnp.float32 if on_cpu and array.ndim == 2 and half else array.dtype)


__all__ = ["project", "stored_dtype", "matmul_precision"]
