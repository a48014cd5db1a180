"""torch_cache.projection.project: a compiled CPU decode step streams its weights through multiply-and-sum or F.linear,
whichever measured faster on the CPU's vendor, and batched float32 and bfloat16 steps through oneDNN-packed copies.
Its attention is multiply-and-sum too (torch_cache.model.scaled_dot_product_attention).

On an AMD EPYC, oneMKL's gemv behind F.linear streamed a weight at ~15 GB/s on one row, the multiply-and-sum that
inductor fuses into one reduction ~40, and from 3 rows the packed copy beat both; on an Intel Xeon F.linear was faster
in float32 (bench/README.md). These tests count which path each projection takes in the traced decode graph (dynamo
only, no inductor compile) under each vendor's rule, set explicitly, so they do not depend on the machine. The
numerics of the compiled multiply-and-sum against eager are checked in test_torch_generate.py; speed is measured in
bench/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_cache.generate as tg
import torch_cache.model as tm
import torch_cache.projection as tp
from torch_cache.cache import make_cache
from torch_cache.model import Mistral
from torch_cache.projection import project


def traced_graph(model: Mistral, batch: int, new_tokens: int = 1) -> torch.fx.GraphModule:
    """The FX graph dynamo traces for one decode step at `batch` rows (a forward of `new_tokens` tokens)."""
    graphs: list[torch.fx.GraphModule] = []

    def record(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph_module)
        return graph_module.forward

    def step(input_ids: torch.Tensor, positions: torch.Tensor, cache: object) -> torch.Tensor:
        return model(input_ids, positions, cache)[:, -1]

    dtype = model.dtype
    cache = make_cache("sliding_window", model.config, batch, 16, dtype)
    ids = torch.zeros(batch, new_tokens, dtype=torch.long)
    positions = torch.arange(new_tokens).expand(batch, -1)
    # Every call traces `step`'s one code object again (a new model or rule): more than dynamo's default 8 entries
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
        torch.compile(step, backend=record, fullgraph=True, dynamic=False)(ids, positions, cache)
    assert len(graphs) == 1
    return graphs[0]


def linear_calls(graph: torch.fx.GraphModule, targets: tuple = (F.linear, torch._C._nn.linear)) -> int:
    """F.linear calls (or calls of `targets`) a step makes: in the graph, and in each call of a compiled region (a
    decoder layer traced once, torch_cache.model.compile_region) as many times as the graph calls it."""
    count = 0
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            count += 1
        elif node.op == "call_function" and "invoke_subgraph" in str(node.target):
            count += linear_calls(getattr(graph, node.args[0].target), targets)
    return count


def projections(config: object) -> int:
    return 7 * config.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer, and the LM head


def packed_projections(config: object) -> int:
    return 4 * config.num_hidden_layers + 1  # q|k|v stacked, o, gate|up stacked, down per layer, and the LM head


def use_vendor_rule(monkeypatch: pytest.MonkeyPatch, vendor: str) -> None:
    """Set the projection rule torch_cache.projection picks at import for `vendor`'s CPUs, whatever this machine is."""
    fp32_rows, half_rows = tp._multiply_sum_max_rows(vendor)
    monkeypatch.setattr(tp, "_MULTIPLY_SUM_MAX_ROWS_FP32", fp32_rows)
    monkeypatch.setattr(tp, "_MULTIPLY_SUM_MAX_ROWS_HALF", half_rows)
    fp32_packed, bf16_packed = tp._packed_min_rows(vendor)
    monkeypatch.setattr(tp, "_PACKED_MIN_ROWS_FP32", fp32_packed)
    monkeypatch.setattr(tp, "_PACKED_MIN_ROWS_BF16", bf16_packed)


@pytest.mark.parametrize("vendor, dtype, batch, expect_linear", [
    ("AuthenticAMD", torch.float32, 1, False), ("AuthenticAMD", torch.float32, 2, False),
    ("AuthenticAMD", torch.float32, 3, True), ("AuthenticAMD", torch.bfloat16, 1, False),
    ("AuthenticAMD", torch.bfloat16, 2, True),
    ("GenuineIntel", torch.float32, 1, True), ("GenuineIntel", torch.float32, 4, True),
    ("GenuineIntel", torch.bfloat16, 1, False), ("GenuineIntel", torch.bfloat16, 2, True),
])
def test_compiled_cpu_decode_projects_few_rows_by_the_vendors_faster_path(checkpoints: dict[str, Path], monkeypatch,
                                                                          vendor: str, dtype: torch.dtype,
                                                                          batch: int, expect_linear: bool):
    use_vendor_rule(monkeypatch, vendor)
    model = Mistral.from_pretrained(checkpoints["gqa"], dtype=dtype)
    graph = traced_graph(model, batch)  # no packed copies made: rows past multiply-and-sum take F.linear
    assert linear_calls(graph) == (projections(model.config) if expect_linear else 0), graph.code


def test_project_is_f_linear_outside_compilation():
    torch.manual_seed(0)
    x, weight = torch.randn(1, 1, 24), torch.randn(40, 24)  # [B, S, in], [out, in]
    assert torch.equal(project(x, weight), F.linear(x, weight))


def test_multiply_and_sum_matches_f_linear_within_fp32_rounding():
    torch.manual_seed(0)
    x, weight = torch.randn(1, 1, 512), torch.randn(1536, 512) / 512**0.5  # decode-shaped: one row, [out, in]
    compiled = torch.compile(project, fullgraph=True, backend="inductor")
    reference = F.linear(x.double(), weight.double())
    # Both sum 512 fp32 products in some order: each is within a few fp32 ulps of the float64 result.
    torch.testing.assert_close(compiled(x, weight).double(), reference, rtol=0, atol=2e-5)
    torch.testing.assert_close(F.linear(x, weight).double(), reference, rtol=0, atol=2e-5)


# --- a compiled CPU decode step attends in the layer's own kernels ------------------------------------------------

def attention_calls(graph: torch.fx.GraphModule) -> int:
    return linear_calls(graph, (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_cpu_decode_step_spells_attention_out_and_a_chunk_calls_sdpa(checkpoints: dict[str, Path],
                                                                                dtype: torch.dtype):
    """One new token: multiply-and-sum, no SDPA call (design.md §7.33). Two: SDPA in every layer."""
    model = Mistral.from_pretrained(checkpoints["gqa"], dtype=dtype)
    assert attention_calls(traced_graph(model, 1)) == 0
    assert attention_calls(traced_graph(model, 1, new_tokens=2)) == model.config.num_hidden_layers


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_compiled_decode_attention_matches_float64_attention(dtype: torch.dtype, atol: float):
    """The compiled multiply-and-sum against attention computed in float64 by matmuls, with masked keys and grouped
    query rows; bfloat16 within one rounding of its output."""
    torch.manual_seed(0)
    batch, kv_heads, rows, slots, head_dim = 2, 2, 3, 37, 64
    q = torch.randn(batch, kv_heads, rows, head_dim).to(dtype)  # [B, Hkv, R, D]
    keys, values = (torch.randn(batch, kv_heads, slots, head_dim).to(dtype) for _ in range(2))  # [B, Hkv, L, D]
    visible = torch.rand(batch, 1, rows, slots) > 0.3  # [B, 1, R, L]
    visible[..., 0] = True  # every row sees a key
    scores = q.double() @ keys.double().transpose(-1, -2) / head_dim**0.5  # [B, Hkv, R, L]
    reference = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values.double()  # [B, Hkv, R, D]
    compiled = torch.compile(tm.scaled_dot_product_attention, fullgraph=True, backend="inductor")
    out = compiled(q, keys, values, visible, decode=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=atol)


# --- batched CPU float32 steps read oneDNN-packed weights ---------------------------------------------------------

packed_only = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch built without oneDNN")


def test_packed_weights_are_on_wherever_onednn_is():
    """The packed tests skip only on a torch without oneDNN; where it is there, the feature must be on (a skip on the
    feature's own flag would hide its loss)."""
    assert tp._PACKED_LINEAR == torch.backends.mkldnn.is_available()


def packed_calls(graph: torch.fx.GraphModule) -> int:
    return linear_calls(graph, (torch.ops.torch_cache.packed_linear.default, torch.ops.torch_cache.packed_linear))


@packed_only
@pytest.mark.parametrize("vendor, dtype, first_packed", [
    ("AuthenticAMD", torch.float32, 3), ("GenuineIntel", torch.float32, 5), ("AuthenticAMD", torch.bfloat16, 2),
])
def test_a_packed_model_projects_batched_steps_through_its_packed_weights(checkpoints: dict[str, Path], monkeypatch,
                                                                          vendor: str, dtype: torch.dtype,
                                                                          first_packed: int):
    use_vendor_rule(monkeypatch, vendor)
    model = Mistral.from_pretrained(checkpoints["gqa"], dtype=dtype)
    tp.pack_projections(model, 8)
    for rows in (first_packed, 8):
        graph = traced_graph(model, rows)
        assert packed_calls(graph) == packed_projections(model.config) and linear_calls(graph) == 0, (rows, graph.code)
    graph = traced_graph(model, first_packed - 1)  # fewer rows never read the packed copy
    assert packed_calls(graph) == 0, graph.code


@packed_only
@pytest.mark.parametrize("vendor, dtype, first_packed", [
    ("AuthenticAMD", torch.float32, 3), ("GenuineIntel", torch.float32, 5), ("AuthenticAMD", torch.bfloat16, 2),
    ("GenuineIntel", torch.bfloat16, None), ("AuthenticAMD", torch.float16, None),
])
def test_packing_is_for_cpu_batches_from_the_vendors_threshold(checkpoints: dict[str, Path], monkeypatch,
                                                               vendor: str, dtype: torch.dtype,
                                                               first_packed: int | None):
    use_vendor_rule(monkeypatch, vendor)
    model = Mistral.from_pretrained(checkpoints["gqa"], dtype=dtype)
    if first_packed is None:  # this dtype is never packed on this vendor
        tp.pack_projections(model, 64)
        assert model._packed_head is None and model.model.layers[0].mlp._packed_gate_up is None
        return
    tp.pack_projections(model, first_packed - 1)
    assert model._packed_head is None
    tp.pack_projections(model, first_packed)
    assert model._packed_head is not None and model.model.layers[0].mlp._packed_gate_up is not None


@packed_only
def test_a_bfloat16_packed_projection_gives_f_linears_result():
    """oneDNN's packed bf16 product accumulates in fp32 and rounds once to bf16, as F.linear does: equal results."""
    torch.manual_seed(0)
    weight = (torch.randn(1536, 576) * 0.05).bfloat16()  # [out, in]
    x = torch.randn(4, 576).bfloat16()  # [N, in]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 4)
    out = torch.ops.torch_cache.packed_linear(x, packed, weight.shape[0])  # [N, out]
    assert out.dtype == torch.bfloat16
    reference = F.linear(x.double(), weight.double())
    bf16_step = reference.abs() * 2.0**-8  # half a bf16 ulp is 2^-9 relative; allow one
    assert ((out.double() - reference).abs() <= bf16_step + 1e-6).all()
    torch.testing.assert_close(out, F.linear(x, weight), rtol=0, atol=0)


@packed_only
def test_stacked_packed_copies_give_each_weights_own_product(checkpoints: dict[str, Path]):
    """q, k and v read one packed copy of their stacked weights, gate and up another (one oneDNN call each, not three
    and two): each part of its output is that weight's own product, in q, k, v and gate, up order."""
    model = Mistral.from_pretrained(checkpoints["gqa"])
    tp.pack_projections(model, 8)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attention.q_proj._packed is None and mlp.up_proj._packed is None  # read only through the stacked copies
    x = torch.randn(8, model.config.hidden_size)
    for stacked, linears in ((attention._packed_qkv, (attention.q_proj, attention.k_proj, attention.v_proj)),
                             (mlp._packed_gate_up, (mlp.gate_proj, mlp.up_proj))):
        sizes = [linear.weight.shape[0] for linear in linears]
        out = torch.ops.torch_cache.packed_linear(x, stacked, sum(sizes))  # [N, sum(out_i)]
        for part, linear in zip(out.split(sizes, dim=-1), linears, strict=True):
            reference = F.linear(x.double(), linear.weight.double())
            torch.testing.assert_close(part.double(), reference, rtol=1e-5, atol=1e-5)


@packed_only
def test_compiled_batched_decode_reads_packed_weights_and_equals_eager(checkpoints: dict[str, Path]):
    """A compiled generation of 8 rows packs the weights once, gives eager's tokens and logits within rounding, and
    repacks (without recompiling) after a weight is written in place, so it never reads a stale copy."""
    from torch._dynamo.utils import counters

    model = Mistral.from_pretrained(checkpoints["gqa"])
    prompts = [[5 + row, 17, 42, 99 - row][: 2 + row % 3] for row in range(8)]

    def both() -> tuple:
        compiled = tg.generate(model, prompts, 6, cache="static", return_logits=True)
        eager = tg.generate(model, prompts, 6, cache="static", return_logits=True, compile=False)
        return compiled, eager

    compiled, eager = both()
    assert model._packed_head is not None, "a batch of 8 packs the weights"
    packed = model._packed_head
    assert compiled.token_ids == eager.token_ids
    torch.testing.assert_close(compiled.step_logits, eager.step_logits, rtol=0, atol=1e-4)
    tg.generate(model, prompts, 3, cache="static")
    assert model._packed_head is packed, "unchanged weights keep their packed copies"
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a different argmax everywhere
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    before = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled_after, eager_after = both()
    assert counters["stats"]["unique_graphs"] == before
    assert eager_after.token_ids != eager.token_ids
    assert compiled_after.token_ids == eager_after.token_ids
    torch.testing.assert_close(compiled_after.step_logits, eager_after.step_logits, rtol=0, atol=1e-4)


@packed_only
def test_packing_that_would_crowd_the_host_is_skipped_and_drops_stale_copies(checkpoints: dict[str, Path],
                                                                            monkeypatch):
    model = Mistral.from_pretrained(checkpoints["gqa"])
    tp.pack_projections(model, 8)
    assert model._packed_head is not None and model.model.layers[0].mlp._packed_gate_up is not None
    monkeypatch.setattr(tp, "available_memory", lambda device: 1024)  # 1 KB free
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    tp.pack_projections(model, 8)
    layer = model.model.layers[0]
    assert model._packed_head is None and layer.mlp._packed_gate_up is None and layer.mlp.down_proj._packed is None
    assert layer.self_attn._packed_qkv is None and layer.self_attn.o_proj._packed is None, "a stale copy stays"
    fresh = Mistral.from_pretrained(checkpoints["gqa"])
    tp.pack_projections(fresh, 8)
    assert fresh._packed_head is None


@packed_only
def test_packed_copies_follow_weights_reloaded_in_place_under_inference_mode(checkpoints: dict[str, Path]):
    """A server loads a model and later loads other weights into it, both under inference mode. The model's own
    tensors are plain wherever it is loaded (an inference tensor counts no writes, and dynamo compiles a step again
    for one), so the packed copies follow the reload; a model handed inference tensors is never packed. Judged by
    F.linear in float64 on the new weights."""
    with torch.inference_mode():
        model = Mistral.from_pretrained(checkpoints["gqa"])
    assert not any(parameter.is_inference() for parameter in model.parameters())
    tp.pack_projections(model, 8)
    other = Mistral.from_pretrained(checkpoints["sharded"])  # the same shapes, other weights
    with torch.inference_mode():
        model.load_state_dict(other.state_dict())
    tp.pack_projections(model, 8)
    x = torch.randn(8, model.config.hidden_size)
    out = torch.ops.torch_cache.packed_linear(x, model._packed_head, model.config.vocab_size)  # [N, V]
    torch.testing.assert_close(out.double(), F.linear(x.double(), other.lm_head.weight.double()), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        held = Mistral.from_weights(model.config, {name: tensor.clone() for name, tensor in other.state_dict().items()})
    tp.pack_projections(held, 8)
    assert held._packed_head is None and held.model.layers[0].mlp._packed_gate_up is None, "writes it cannot see"


# --- a compiled CPU decode step computes a layer's normed input and its rotated query once, not once per row --------

def reduction_loops(source: str) -> list[str]:
    """The innermost C++ loops of inductor's generated `source` that accumulate a reduction (`tmp_acc`), each from its
    `for(` to its closing brace."""
    bodies = []
    for start in (match.start() for match in re.finditer(r"for\(int64_t x\d+=", source)):
        depth, position = 0, source.index("{", start)
        while True:
            depth += {"{": 1, "}": -1}.get(source[position], 0)
            if depth == 0:
                break
            position += 1
        body = source[start:position]
        if "tmp_acc" in body and "for(int64_t" not in body[1:]:
            bodies.append(body)
    return bodies


def test_a_decode_step_reads_its_normed_input_and_rotated_query_from_memory(checkpoints: dict[str, Path]):
    """Inductor inlines a pointwise result of up to 50 ops (its CPU default) into every reduction that reads it. It
    recomputed each RMSNorm for every output row of the projections after it (loads, conversions, a square root) and
    the rotated, scaled query (q, cos, rotate-half q, sin) for every key slot of the attention scores, which made a
    bfloat16 step over a long cache compute-bound (docs/design.md §7.37). A compiled CPU decode step's kernels (here
    bfloat16) take no square root inside a projection's multiply-and-sum (a loop over rows of a matrix, indexed
    `x1 + n*x0`), and read two arrays in each score loop (the query and a key row, indexed `x3 + D*x2`)."""
    from torch._inductor.utils import run_and_get_code

    model = Mistral.from_pretrained(checkpoints["gqa"], dtype=torch.bfloat16)
    torch._dynamo.reset()  # compile here, whatever compiled this model's shapes before
    result, sources = run_and_get_code(tg.generate, model, [list(range(3, 43))], 3, cache="static", max_cache_len=96,
                                       compile=True)
    assert len(result.token_ids[0]) == 3
    assert any("std::sqrt" in source for source in sources)  # the norms are in these kernels
    loops = [body for source in sources for body in reduction_loops(source)]
    projections = [body for body in loops if re.search(r"x1 \+ \d+L\*x0", body)]
    scores = [body for body in loops if re.search(r"x3 \+ \d+L\*x2", body)]
    assert projections and scores, "no multiply-and-sum or score loop found in the generated code"
    recomputing = [body for body in projections if "std::sqrt" in body]
    assert not recomputing, f"{len(recomputing)} of {len(projections)} projections recompute a norm:\n{recomputing[0]}"
    rotating = [body for body in scores if body.count("loadu(") > 2]
    assert not rotating, f"{len(rotating)} of {len(scores)} score loops recompute the query:\n{rotating[0]}"
