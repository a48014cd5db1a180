"""torch_cache on a mesh: Megatron tensor parallelism with torch.distributed's functional collectives, as in
gpt-fast's tp.py. jax_cache/sharding.py mirrors this file (docs/design.md §10).

Every rank runs the same program (one process per device: `twincache_app.launch`, or torchrun). A mesh is a
DeviceMesh with the axes ("data", "model"); twincache.mesh holds the split. Each rank keeps only its slice of every
weight and of the KV cache, as plain tensors, and the model calls four collectives (`TensorParallel`): an all-reduce
after o_proj and after down_proj, an all-reduce after the vocabulary-split embedding lookup, and all-gathers of the
logits over the vocabulary (`model`) and over the batch rows (`data`). Functional collectives trace into the
compiled decode step, so it stays one graph. A forward takes the whole batch and returns the whole batch's logits on
every rank, exactly as on one device; inside, each rank computes its own rows, heads and MLP columns.

The cache keeps its K/V shard [B / data, Hkv per device, L, D] on each rank, and `slot_positions` and `length` whole
(replicated): every rank builds the attention mask of the whole batch from them, then takes its own rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from twincache.checkpoint import expected_tensor_shapes, missing_tensors_error
from twincache.config import MistralConfig
from twincache.errors import CheckpointError, MeshError
from twincache.mesh import AXES, MeshShape, ShardPlan, check_batch, plan_shards, wrong_mesh_type

if TYPE_CHECKING:
    from torch_cache.model import DecoderLayer, Mistral  # which imports this module

# torch 2.13 renamed all_gather_tensor (now a deprecated alias) to all_gather_single; torch 2.11 has the old name only.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def make_mesh(model: int = 1, data: int = 1) -> DeviceMesh:
    """A data x model DeviceMesh over the ranks of the running torch.distributed world, with the axes
    ("data", "model"); each rank uses the GPU of its local rank, or the CPU (gloo)."""
    shape = MeshShape(data=data, model=model)
    if not dist.is_available() or not dist.is_initialized():
        processes = "1 process" if shape.devices == 1 else f"{shape.devices} processes"
        raise MeshError(f"mesh {shape} needs torch.distributed with {processes}, and it is not initialised; run "
                        "through the twincache command (it launches them) or torchrun, or pass mesh=None for one "
                        "device")
    if dist.get_world_size() != shape.devices:
        raise MeshError(f"mesh {shape} needs {shape.devices} processes, but torch.distributed runs "
                        f"{dist.get_world_size()}; launch as many processes as the mesh has devices")
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (data, model), mesh_dim_names=AXES)


def mesh_shape(mesh: DeviceMesh) -> MeshShape:
    """The sizes of a mesh with the axes ("data", "model")."""
    if not isinstance(mesh, DeviceMesh):
        raise wrong_mesh_type(mesh, "torch DeviceMesh (a jax Mesh is jax_cache's)",
                              "torch_cache.sharding.make_mesh(model=N, data=M) in each process of a torch.distributed "
                              "world")
    if tuple(mesh.mesh_dim_names or ()) != AXES:
        raise MeshError(f"a twincache mesh has the axes {AXES}, not {tuple(mesh.mesh_dim_names or ())}; build it "
                        "with torch_cache.sharding.make_mesh")
    return MeshShape(data=mesh.size(0), model=mesh.size(1))


def plan(mesh: DeviceMesh, config: MistralConfig) -> ShardPlan:
    """How `config` splits over `mesh` (refused in one line when it cannot)."""
    return plan_shards(config, mesh_shape(mesh))


def kv_shards_per_device(mesh: DeviceMesh, num_kv_heads: int) -> int:
    """Into how many pieces a mesh splits a cache: the batch over `data` times the KV heads over `model` (KV heads
    copied within a group count once)."""
    shape = mesh_shape(mesh)
    return shape.data * min(num_kv_heads, shape.model)


def check_batch_size(mesh: DeviceMesh | None, batch_size: int) -> None:
    """Refuse a batch that `data` cannot split."""
    if mesh is not None:
        check_batch(mesh_shape(mesh), batch_size)


def local_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device: its GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def weight_slice(name: str, config: MistralConfig, mesh: DeviceMesh) -> tuple[slice, ...]:
    """The part of the HF-named weight `name` this rank holds, Megatron-style (the split of twincache.mesh)."""
    split, rank = plan(mesh, config), mesh.get_local_rank("model")
    module, head_dim = name.split(".")[-2], config.head_dim

    def rows(kept: range, width: int = 1) -> slice:
        return slice(kept.start * width, kept.stop * width)

    if module == "q_proj":
        return (rows(split.q_heads(rank), head_dim),)  # [out, in]: this rank's query heads
    if module in ("k_proj", "v_proj"):
        return (rows(split.kv_heads(rank), head_dim),)  # its KV heads (its group's, when they are copied)
    if module in ("gate_proj", "up_proj"):
        return (rows(split.columns(rank)),)
    if module == "o_proj":
        return (slice(None), rows(split.q_heads(rank), head_dim))  # [out, in]: split over the input
    if module == "down_proj":
        return (slice(None), rows(split.columns(rank)))
    if module in ("embed_tokens", "lm_head"):
        return (rows(split.vocab(rank)),)
    return ()  # norms: whole


def shard_parameters(config: MistralConfig, mesh: DeviceMesh) -> int:
    """How many of the model's parameters this rank holds: its weight_slice of every tensor."""
    total = 0
    for name, shape in expected_tensor_shapes(config).items():
        part = weight_slice(name, config, mesh)
        kept = [len(range(*piece.indices(size))) for piece, size in zip(part, shape)]  # the sliced leading dims
        total += math.prod(kept) * math.prod(shape[len(part):])
    return total


def shard_weights(config: MistralConfig, weights: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """This rank's slices of HF-named tensors, as its own contiguous tensors on its device."""
    plan(mesh, config)  # a mesh that is none, or cannot split this model, is refused before any tensor is sliced
    device = local_device(mesh)
    return {name: tensor[weight_slice(name, config, mesh)].to(device).contiguous().clone()
            for name, tensor in weights.items()}


class TensorParallel:
    """The collectives a model split over a mesh calls; one instance per model. `SINGLE` (below) is the identity
    every unsplit model uses, so the model's code is the same on one device and on a mesh."""

    def __init__(self, mesh: DeviceMesh | None = None, config: MistralConfig | None = None) -> None:
        self.mesh = mesh
        if mesh is None:
            return
        assert config is not None, "a TensorParallel on a mesh needs the model's config"
        self.plan = plan(mesh, config)
        self.model_group, self.data_group = mesh.get_group("model"), mesh.get_group("data")
        self.model_ways, self.data_ways = self.plan.mesh.model, self.plan.mesh.data
        self.vocab_start = self.plan.vocab(mesh.get_local_rank("model")).start
        self.data_rank = mesh.get_local_rank("data")

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole-batch tensor [B, ...]."""
        if self.mesh is None or self.data_ways == 1:
            return tensor
        per_rank = tensor.shape[0] // self.data_ways
        return tensor[self.data_rank * per_rank:(self.data_rank + 1) * per_rank]

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding table for `input_ids`; with the vocabulary split, each rank looks up the ids in its
        rows (zeros elsewhere) and the ranks' rows are summed."""
        if self.mesh is None or not self.plan.vocab_split or self.model_ways == 1:
            return F.embedding(input_ids, weight)  # [B, S, hidden]
        local = input_ids - self.vocab_start  # [B, S]
        held = (local >= 0) & (local < weight.shape[0])
        rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * held[..., None].to(weight.dtype)
        return funcol.all_reduce(rows, "sum", self.model_group)  # [B, S, hidden]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over `model` of the partial outputs of o_proj / down_proj (each rank holds a slice of their
        input)."""
        if self.mesh is None or self.model_ways == 1:
            return partial
        return funcol.all_reduce(partial, "sum", self.model_group)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits [B / data, S, V / model] -> the whole batch's [B, S, V], on every rank."""
        if self.mesh is None:
            return logits
        if self.plan.vocab_split and self.model_ways > 1:
            gathered = _all_gather(logits.contiguous(), 0, self.model_group)  # [model * B / data, S, V / model]
            # side by side along the vocabulary: torch 2.11's all-gather along a later dim calls a helper dynamo
            # will not trace (_maybe_view_chunk_cat), so a compiled step gathers along dim 0 and lays them out itself
            logits = torch.cat(gathered.chunk(self.model_ways, 0), dim=-1)  # [B / data, S, V]
        if self.data_ways > 1:
            logits = _all_gather(logits.contiguous(), 0, self.data_group)  # [B, S, V]
        return logits


SINGLE = TensorParallel()


def parallelize(model: Mistral, mesh: DeviceMesh, weights: dict[str, torch.Tensor]) -> None:
    """Make a model built on the meta device this rank's part of the mesh: its parameters become `weights` (this
    rank's slices, shard_weights), its attention modules take the local head counts, and every forward calls the
    mesh's collectives."""
    parameters = dict(model.named_parameters())
    missing = sorted(set(parameters) - set(weights))
    if missing:
        raise missing_tensors_error(model.config, missing)
    extra = sorted(set(weights) - set(parameters))
    if extra:
        raise CheckpointError(f"weights hold {len(extra)} tensor(s) a {model.config.num_hidden_layers}-layer Mistral "
                              f"of this config has no place for, first {extra[0]}; pass only its checkpoint's tensors")
    for name, tensor in weights.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))
    parallel = TensorParallel(mesh, model.config)
    model.mesh, model.parallel = mesh, parallel
    for layer in cast("Iterable[DecoderLayer]", model.model.layers):  # a ModuleList, typed as holding any Module
        layer.self_attn.num_heads, layer.self_attn.num_kv_heads = parallel.plan.num_heads, parallel.plan.num_kv_heads
        layer.self_attn.parallel = layer.mlp.parallel = parallel


def device_bytes(arrays: Sequence[torch.Tensor]) -> dict[str, int]:
    """Bytes this rank holds of these tensors (its shards), by device, read from the tensors' storage."""
    held: dict[str, int] = {}
    for tensor in arrays:
        held[str(tensor.device)] = held.get(str(tensor.device), 0) + tensor.untyped_storage().nbytes()
    return held


def mesh_label(mesh: DeviceMesh) -> str:
    """A mesh as cache and model device labels show it."""
    return f"mesh {mesh_shape(mesh)} ({mesh.device_type} ranks {','.join(map(str, mesh.mesh.flatten().tolist()))})"


__all__ = ["make_mesh", "mesh_shape", "plan", "kv_shards_per_device", "check_batch_size", "local_device",
           "weight_slice", "shard_parameters", "shard_weights", "TensorParallel", "SINGLE", "parallelize",
           "device_bytes", "mesh_label"]
