"""How torch_cache's model multiplies by its weights: x @ W.T, in the form that streams W fastest where it runs.

A compiled CPU decode step with few rows writes the product as multiply-and-sum, which inductor fuses into one
threaded reduction; a batched one reads oneDNN-packed copies of the weights (q, k and v stacked into one, gate and up
into another) through a custom op; everything else is F.linear. The row counts at which each form takes over depend on
the CPU's vendor, measured (docs/design.md §5, §7.36). jax_cache/projection.py is the JAX tower's counterpart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from torch_cache.cache import available_memory

if TYPE_CHECKING:
    from torch_cache.model import DecoderLayer, Mistral


def _cpu_vendor() -> str:
    """The CPU's vendor id as Linux reports it ("GenuineIntel", "AuthenticAMD", ...); "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        return ""


_NEVER = 1 << 62  # a row count no batch reaches


def _multiply_sum_max_rows(vendor: str) -> tuple[int, int]:
    """Most rows a compiled CPU projection writes as multiply-and-sum, (float32, half precision); more rows take
    F.linear (oneMKL / oneDNN) or, from _packed_min_rows, the weight's oneDNN-packed copy. Multiply-and-sum reads
    the weight once per row. Measured with torch 2.13 on 2-core machines: on an AMD EPYC oneMKL's gemv streamed
    a [1536, 512] fp32 weight at 15 GB/s against 40 for inductor's fused multiply-and-sum; on an AMD EPYC (Zen 4) the
    small bench model's projections at 1 / 2 / 3 / 4 rows streamed 41 / 22 / 14 / 12 GB/s as multiply-and-sum,
    25 / 24 / 25 / 25 packed and 10 / 5 / 4 / 6 through F.linear, and decoding batch 2 packed was no faster; on an
    Intel Xeon (AVX-512) F.linear decoded the small bench model faster at every fp32 row count (1 row 163 vs 141
    tok/s, 2 rows 268 vs 142, 4 rows 362 vs 170 in total), while bf16 still gained at one row (trained model 46.6 vs
    35.0 tok/s) and was level at two. oneMKL picks its fast kernels on Intel CPUs."""
    return (0, 1) if vendor == "GenuineIntel" else (2, 1)


def _packed_min_rows(vendor: str) -> tuple[int, int]:
    """Fewest rows from which a compiled CPU projection reads its weight's oneDNN-packed copy, (float32, bfloat16).
    On AMD, where oneMKL's GEMM is slow at few rows: float32 from 3 (the figures above: `small` at batch 4 decoded
    1.4x faster packed than as multiply-and-sum), bfloat16 from 2 (Zen 4: 2 / 4 / 8 rows streamed 25 / 24 / 16 GB/s
    packed against 12 / 11 / 9 through F.linear, with the same results). On Intel, float32 from 5, where F.linear at
    2-4 rows was the faster, and bfloat16 never (packed there unmeasured). float16 never: oneDNN's packed float16
    needs AVX512-FP16 or AVX-NE-CONVERT."""
    return (5, _NEVER) if vendor == "GenuineIntel" else (3, 2)


_VENDOR = _cpu_vendor()  # read once: both rules below depend on it
# Plain ints, not a dict keyed by dtype: dynamo's subgraph reuse cannot re-resolve a guard on a dtype key.
_MULTIPLY_SUM_MAX_ROWS_FP32, _MULTIPLY_SUM_MAX_ROWS_HALF = _multiply_sum_max_rows(_VENDOR)
# From _PACKED_MIN_ROWS_* rows (batched decode), a compiled CPU float32 or bfloat16 projection reads a oneDNN-packed
# copy of its weight (pack_projections): measured on an EPYC, a [32000, 512] weight at 8 rows streams at 38 GB/s
# packed vs 17.5 with F.linear (16 rows 27 vs 14, 32 rows 16 vs 10), and the small bench model decoded batch 8, 16 and
# 32 1.24-1.31x faster. The packed copies cost as much memory again as the projection weights. Needs
# torch.library.custom_op and oneDNN.
_PACKED_LINEAR = hasattr(torch.library, "custom_op") and torch.backends.mkldnn.is_available()
_PACKED_MIN_ROWS_FP32, _PACKED_MIN_ROWS_BF16 = _packed_min_rows(_VENDOR)

if _PACKED_LINEAR:
    @torch.library.custom_op("torch_cache::packed_linear", mutates_args=())
    def _packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [N, in] @ W.T [in, out_features] through `packed`, the oneDNN-reordered copy of W (one weight, or
        several stacked along out: pack_projections), an opaque tensor inductor calls out to as it is.
        [N, out_features]"""
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")

    @_packed_linear.register_fake
    def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)


def project(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for weight [out, in] (HF layout): [..., out].

    Compiled for CPU with few rows (decode), it is written as multiply-and-sum where that measured faster than
    F.linear (`_multiply_sum_max_rows`): inductor fuses it into one vectorised, threaded reduction that streamed the
    weight ~2.7x faster than the oneMKL gemv behind F.linear on a 2-core AMD EPYC; on an Intel Xeon F.linear wins in
    float32. With more rows it reads `packed` (the weight's oneDNN copy, pack_projections) where one is given and the
    rows reach _packed_rows_from(dtype) (_reads_packed).
    """
    rows = x.shape[:-1].numel()
    if torch.compiler.is_compiling() and x.device.type == "cpu" and rows <= _multiply_sum_rows(x.dtype):
        return (x.unsqueeze(-2) * weight).sum(-1)  # [..., out]
    if _reads_packed(x, packed):
        return _packed_linear(x.reshape(rows, x.shape[-1]), packed, weight.shape[0]).view(*x.shape[:-1], -1)
    return F.linear(x, weight)  # [..., out]


def project_stacked(x: torch.Tensor, linears: Sequence[nn.Linear],
                    packed: torch.Tensor | None) -> list[torch.Tensor]:
    """Each of `linears` applied to x, [..., out_i] each. Where a step reads packed copies (_reads_packed), one call
    reads `packed`, the joint copy of their weights stacked along out (pack_projections), and splits its output:
    one call on one larger matrix instead of several, which oneDNN streams faster (docs/design.md §7.36)."""
    if not _reads_packed(x, packed):
        return [linear(x) for linear in linears]
    sizes = [linear.weight.shape[0] for linear in linears]
    rows = x.shape[:-1].numel()
    out = _packed_linear(x.reshape(rows, x.shape[-1]), packed, sum(sizes))  # [N, sum(out_i)]
    return [part.view(*x.shape[:-1], size) for part, size in zip(out.split(sizes, dim=-1), sizes, strict=True)]


def _multiply_sum_rows(dtype: torch.dtype) -> int:
    """Most rows of `dtype` a compiled CPU projection writes as multiply-and-sum (_multiply_sum_max_rows)."""
    return _MULTIPLY_SUM_MAX_ROWS_FP32 if dtype == torch.float32 else _MULTIPLY_SUM_MAX_ROWS_HALF


def _reads_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a projection of x reads the packed copy `packed`: one is made, and a compiled CPU step has more rows
    than multiply-and-sum takes and at least _packed_rows_from(dtype)."""
    rows = x.shape[:-1].numel()
    return (packed is not None and torch.compiler.is_compiling() and x.device.type == "cpu"
            and _multiply_sum_rows(x.dtype) < rows and rows >= _packed_rows_from(x.dtype))


def _packed_rows_from(dtype: torch.dtype) -> int:
    """Fewest rows of `dtype` whose compiled CPU projection reads the packed copy (_packed_min_rows)."""
    if dtype == torch.float32:
        return _PACKED_MIN_ROWS_FP32
    return _PACKED_MIN_ROWS_BF16 if dtype == torch.bfloat16 else _NEVER


def pack_projections(model: Mistral, rows: int) -> None:
    """Give the projection weights of a CPU float32 or bfloat16 model oneDNN-packed copies (laid out for `rows`-row
    inputs; any row count reads them), which compiled steps of _packed_rows_from(dtype) rows or more read instead of
    F.linear: q, k and v stacked into one copy per layer, gate and up into another, o, down and the LM head one each.
    Made once, and again when a weight was replaced or written in place since (its data pointer or version counter
    moved). An inference tensor counts no writes, so a model holding one (from_weights keeps the tensors it is given)
    is never packed: its steps read the weights themselves (F.linear: slower, the same results). A write through
    `.data`, which torch does not count either, is not seen: write the parameter itself (load_state_dict, copy_)."""
    if not _PACKED_LINEAR or model.device.type != "cpu" or rows < _packed_rows_from(model.dtype):
        return
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    layers = cast("list[DecoderLayer]", list(model.model.layers))
    attentions, mlps = [layer.self_attn for layer in layers], [layer.mlp for layer in layers]
    linears = [linear for attention in attentions
               for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)]
    linears += [linear for mlp in mlps for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    weights = [linear.weight for linear in linears] + [head]
    counted = not any(weight.is_inference() for weight in weights)  # an inference tensor has no version counter
    made_from = [(weight.data_ptr(), weight._version) for weight in weights] if counted else []
    if counted and made_from == model._packed_from:
        return
    model._packed_head, model._packed_from = None, []  # a stale copy is never read, even if repacking stops here
    for linear in linears:
        linear._packed = None
    for attention in attentions:
        attention._packed_qkv = None
    for mlp in mlps:
        mlp._packed_gate_up = None
    if not counted:  # rewritten in place under inference mode, a copy would be read stale (wrong tokens)
        return
    free = available_memory(model.device)
    if free is not None and 2 * sum(weight.nbytes for weight in weights) > free:
        return  # the copies would crowd the host: F.linear reads the weights themselves (slower, same results)

    def packed(*stacked: torch.Tensor) -> torch.Tensor:  # [out, in] weights stacked along out, laid out for `rows`
        weight = torch.cat(stacked) if len(stacked) > 1 else stacked[0]
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)

    with torch.no_grad():
        for attention in attentions:
            attention._packed_qkv = packed(attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)
            attention.o_proj._packed = packed(attention.o_proj.weight)
        for mlp in mlps:
            mlp._packed_gate_up = packed(mlp.gate_proj.weight, mlp.up_proj.weight)
            mlp.down_proj._packed = packed(mlp.down_proj.weight)
        model._packed_head = packed(head)
    model._packed_from = made_from


__all__ = ["project", "project_stacked", "pack_projections"]
