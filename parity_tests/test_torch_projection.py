"""torch_cache.model.project: a compiled CPU decode step streams its weights through multiply-and-sum, not F.linear.

On CPU, oneMKL's gemv behind F.linear streams a weight at ~15 GB/s on one row; the multiply-and-sum that inductor
fuses into one reduction reaches ~40 (bench/README.md). These tests count which path each projection takes in the
traced decode graph (dynamo only, no inductor compile), so they do not depend on the machine. The numerics of the
compiled multiply-and-sum against eager are checked in test_torch_generate.py; speed is measured in bench/.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_cache.cache import make_cache
from torch_cache.model import Mistral, project


def traced_graph(model: Mistral, batch: int) -> torch.fx.GraphModule:
    """The FX graph dynamo traces for one decode step at `batch` rows."""
    graphs: list[torch.fx.GraphModule] = []

    def record(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph_module)
        return graph_module.forward

    def step(input_ids: torch.Tensor, positions: torch.Tensor, cache: object) -> torch.Tensor:
        return model(input_ids, positions, cache)[:, -1]

    dtype = model.dtype
    cache = make_cache("sliding_window", model.config, batch, 16, dtype)
    ids = torch.zeros(batch, 1, dtype=torch.long)
    with torch.inference_mode():
        torch.compile(step, backend=record, fullgraph=True, dynamic=False)(ids, torch.zeros_like(ids), cache)
    assert len(graphs) == 1
    return graphs[0]


def linear_calls(graph: torch.fx.GraphModule) -> int:
    """F.linear calls a step makes: in the graph, and in each call of a compiled region (a decoder layer traced once,
    torch_cache.model.compile_region) as many times as the graph calls it."""
    targets = (F.linear, torch._C._nn.linear)
    count = 0
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            count += 1
        elif node.op == "call_function" and "invoke_subgraph" in str(node.target):
            count += linear_calls(getattr(graph, node.args[0].target))
    return count


def projections(config: object) -> int:
    return 7 * config.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer, and the LM head


@pytest.mark.parametrize("dtype, batch, expect_linear", [
    (torch.float32, 1, False), (torch.float32, 4, False), (torch.float32, 8, True),
    (torch.bfloat16, 1, False), (torch.bfloat16, 2, True),
])
def test_compiled_cpu_decode_projects_few_rows_by_multiply_and_sum(checkpoints: dict[str, Path], dtype: torch.dtype,
                                                                  batch: int, expect_linear: bool):
    model = Mistral.from_pretrained(checkpoints["gqa"], dtype=dtype)
    graph = traced_graph(model, batch)
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
