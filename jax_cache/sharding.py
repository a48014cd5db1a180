"""jax_cache on a mesh: XLA SPMD places the weights and the KV cache, and inserts the collectives itself.

A mesh has the axes `data` (batch rows) and `model` (Megatron tensor parallelism); twincache.mesh holds the split
(docs/design.md §10). Weights and caches are global arrays with a NamedSharding; the jitted prefill and decode
functions take those shardings as their input shardings and pin the cache they return to the same ones
(`place_cache`), so donation keeps every shard's buffer in place. No shard_map: SPMD partitions the model as
written, with an all-reduce after o_proj and down_proj, a masked local lookup plus all-reduce for the vocabulary-split
embedding, and a local argmax plus a gather of one (value, index) pair per device for the vocabulary-split head.

KV heads fewer than `model` are replicated within groups: the arrays are placed on a three-axis view of the user's
mesh, (data, model_kv, model_copy), where model_kv splits the KV heads and model_copy holds copies of them; every
model-axis split uses both, so a device's query heads meet its own KV head. torch_cache/sharding.py mirrors this file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.errors import MeshError
from twincache.mesh import AXES, MeshShape, ShardPlan, check_batch, check_devices, plan_shards, wrong_mesh_type

if TYPE_CHECKING:  # jax_cache.cache imports this module
    from jax_cache.cache import StaticCache

# The three-axis view every array is placed on; MODEL is the user's `model` axis as its two factors.
_VIEW_AXES = ("data", "model_kv", "model_copy")
MODEL = ("model_kv", "model_copy")


def make_mesh(model: int = 1, data: int = 1) -> Mesh:
    """A mesh of data x model of the devices JAX sees, with the axes ("data", "model")."""
    shape = MeshShape(data=data, model=model)
    devices = jax.devices()
    check_devices(shape, len(devices), f"JAX sees {len(devices)} {devices[0].platform} device(s) (on a CPU, "
                  f"XLA_FLAGS=--xla_force_host_platform_device_count={shape.devices} simulates more)")
    return Mesh(np.array(devices[:shape.devices]).reshape(data, model), AXES)


def mesh_shape(mesh: Mesh) -> MeshShape:
    """The sizes of a mesh with the axes ("data", "model")."""
    if not isinstance(mesh, Mesh):
        raise wrong_mesh_type(mesh, "jax.sharding.Mesh (a torch DeviceMesh is torch_cache's)",
                              "jax_cache.sharding.make_mesh(model=N, data=M)")
    if tuple(mesh.axis_names) != AXES:
        raise MeshError(f"a twincache mesh has the axes {AXES}, not {tuple(mesh.axis_names)}; build it with "
                        "jax_cache.sharding.make_mesh(model=N, data=M)")
    return MeshShape(data=mesh.shape["data"], model=mesh.shape["model"])


def plan(mesh: Mesh, config: MistralConfig) -> ShardPlan:
    """How `config` splits over `mesh` (refused in one line when it cannot)."""
    return _plan(config, mesh_shape(mesh))  # the mesh checked first: a cache keyed on it hashed a list's TypeError


_plan = functools.lru_cache(maxsize=64)(plan_shards)


@functools.lru_cache(maxsize=64)
def _view(mesh: Mesh, num_kv_heads: int) -> Mesh:
    """The (data, model_kv, model_copy) view of a mesh's devices for a model of `num_kv_heads` KV heads."""
    shape = mesh_shape(mesh)
    kv_shards = min(num_kv_heads, shape.model)
    return Mesh(mesh.devices.reshape(shape.data, kv_shards, shape.model // kv_shards), _VIEW_AXES)


def _named(view: Mesh, spec: P) -> NamedSharding:
    """A NamedSharding in the form XLA hands a jitted function's outputs back: no axis of size 1, no trailing None.
    An input sharding written otherwise compares unequal to the output it becomes, and the next call compiles again."""
    def kept(entry: object) -> object:
        axes = [axis for axis in (entry if isinstance(entry, tuple) else (entry,)) if axis and view.shape[axis] > 1]
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    entries = [kept(entry) for entry in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return NamedSharding(view, P(*entries))


def kv_shards_per_device(mesh: Mesh, num_kv_heads: int) -> int:
    """Into how many pieces a mesh splits a cache: the batch over `data` times the KV heads over `model` (KV heads
    copied within a group count once)."""
    shape = mesh_shape(mesh)
    return shape.data * min(num_kv_heads, shape.model)


def weight_sharding(name: str, config: MistralConfig, mesh: Mesh) -> NamedSharding:
    """Where the HF-named weight `name` lives: split Megatron-style over `model`, else replicated."""
    split, view = plan(mesh, config), _view(mesh, config.num_key_value_heads)
    module = name.split(".")[-2]
    if module in ("q_proj", "gate_proj", "up_proj"):
        spec = P(MODEL, None)  # [out, in]: split over heads / intermediate columns
    elif module in ("k_proj", "v_proj"):
        spec = P("model_kv", None)  # KV heads split, copied within a group when fewer than `model`
    elif module in ("o_proj", "down_proj"):
        spec = P(None, MODEL)  # [out, in]: split over the input; XLA all-reduces the partial sums
    elif module in ("embed_tokens", "lm_head") and split.vocab_split:
        spec = P(MODEL, None)  # [V, hidden]: split over the vocabulary
    else:
        spec = P()  # norms; embed and head when `model` does not divide the vocabulary
    return _named(view, spec)


def shard_parameters(config: MistralConfig, mesh: Mesh) -> int:
    """How many of the model's parameters one device of `mesh` holds (each holds a shard of every weight's shape)."""
    return sum(math.prod(weight_sharding(name, config, mesh).shard_shape(shape))
               for name, shape in expected_tensor_shapes(config).items())


def cache_shardings(mesh: Mesh, num_layers: int, num_kv_heads: int) -> list[NamedSharding]:
    """The sharding of each of a mesh cache's arrays, in `arrays()` order: K/V [B, Hkv, L, D] with B on `data` and
    the KV heads on `model`; slot_positions [B, L] following the batch; length replicated."""
    view = _view(mesh, num_kv_heads)
    kv = _named(view, P("data", "model_kv", None, None))
    return [kv] * (2 * num_layers) + [_named(view, P("data", None)), _named(view, P())]


def batch_sharding(cache: StaticCache) -> NamedSharding:
    """Arrays whose first axis is a mesh cache's batch ([B, ...]): rows on `data`, replicated along `model`."""
    assert cache.mesh is not None  # callers place arrays by a cache only when it is on a mesh
    return _named(_view(cache.mesh, cache.num_kv_heads), P("data"))


def replicated(cache: StaticCache) -> NamedSharding:
    """Arrays every device of a mesh cache's mesh holds whole (counters, the step index)."""
    assert cache.mesh is not None  # as in batch_sharding
    return _named(_view(cache.mesh, cache.num_kv_heads), P())


def check_batch_size(mesh: Mesh | None, batch_size: int) -> None:
    """Refuse a batch that `data` cannot split."""
    if mesh is not None:
        check_batch(mesh_shape(mesh), batch_size)


def place(array: jax.Array, placement: NamedSharding) -> jax.Array:
    """`array` on `placement`: a sharding constraint inside a jitted function (it fixes that output's sharding, as
    out_shardings would), a transfer outside."""
    if isinstance(array, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(array, placement)
    return jax.device_put(array, placement)


def place_cache(cache: StaticCache) -> StaticCache:
    """A mesh cache with every array on its sharding; a cache off any mesh is returned as it is. Jitted functions
    pin the cache they return with it, so its out_shardings equal its in_shardings and donation reuses the buffers."""
    if cache.mesh is None:
        return cache
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    placements = cache_shardings(cache.mesh, cache.num_layers, cache.num_kv_heads)
    placed = [place(leaf, placement) for leaf, placement in zip(leaves, placements, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, placed)


def shard_weights(config: MistralConfig, weights: dict[str, jax.Array], mesh: Mesh) -> dict[str, jax.Array]:
    """HF-named arrays placed on `mesh` (each device keeps only its slice)."""
    return {name: jax.device_put(array, weight_sharding(name, config, mesh)) for name, array in weights.items()}


def device_bytes(arrays: Sequence[jax.Array]) -> dict[str, int]:
    """Bytes each device holds of these arrays, read from their addressable shards (not computed from shapes)."""
    held: dict[str, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held


def mesh_label(mesh: Mesh) -> str:
    """A mesh (the user's or its three-axis view) as cache and model device labels show it."""
    data = mesh.shape["data"]
    ids = ",".join(str(device.id) for device in mesh.devices.flat)
    return f"mesh {MeshShape(data=data, model=mesh.size // data)} ({mesh.devices.flat[0].platform} devices {ids})"


__all__ = ["MODEL", "make_mesh", "mesh_shape", "plan", "kv_shards_per_device", "weight_sharding", "cache_shardings",
           "batch_sharding", "replicated", "check_batch_size", "place", "place_cache", "shard_parameters",
           "shard_weights", "device_bytes", "mesh_label"]
