"""How one model and one cache split over a mesh of devices, the same in both towers (docs/design.md §10).

A mesh has two axes: `data` (rows of the batch) and `model` (Megatron tensor parallelism). This module holds the
framework-free rules: parsing `model=N,data=M`, which meshes a model can use, and which slice of each weight and of
the KV cache a device holds. jax_cache turns a plan into PartitionSpecs for XLA SPMD; torch_cache slices each rank's
weights and cache with it. A mesh that cannot work is refused here, before anything is built, in one line.

The split (Megatron-style, along the heads and the MLP's intermediate dimension):
  q_proj, k_proj, v_proj, gate_proj, up_proj   [out, in]  split over `out` (heads / intermediate) on `model`
  o_proj, down_proj                            [out, in]  split over `in` on `model`; the partial sums are all-reduced
  embed_tokens, lm_head                        [V, hidden] split over the vocabulary on `model` when `model` divides V,
                                                          else replicated (docs/design.md §10 measures the choice)
  norms                                                   replicated
  K/V cache [B, Hkv, L, D]                     B on `data`, Hkv on `model`; slot_positions follow the batch or are
                                                          replicated, length is replicated

Fewer KV heads than `model` (MQA, small GQA): each KV head is replicated within its group of devices. `model` must
then be a multiple of num_key_value_heads: the devices form Hkv groups of `model / Hkv` (kv_copies), and the query
heads a device holds all read its group's one KV head, so attention needs no communication. Each device then holds
1/Hkv of the cache (not 1/model): the price of exact, communication-free attention.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from twincache.config import MistralConfig
from twincache.errors import MeshError
from twincache.generation import Batch, GenerationResult, TokenCallback, as_integer

AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A mesh's size along each axis."""

    data: int = 1
    model: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            try:
                value = as_integer(f"mesh {axis}", value)
            except Exception:  # noqa: BLE001 - one MeshError wording for every bad size
                raise MeshError(f"mesh {axis}={value!r} must be a positive integer") from None
            if value < 1:
                raise MeshError(f"mesh {axis}={value} must be a positive integer")
            object.__setattr__(self, axis, value)

    @property
    def devices(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"model={self.model},data={self.data}"


def parse_mesh(text: str) -> MeshShape:
    """`model=N[,data=M]` (either order; an axis left out is 1) as a MeshShape."""
    sizes: dict[str, int] = {}
    for field in text.split(","):
        axis, sep, value = field.strip().partition("=")
        axis = axis.strip()
        if not sep or axis not in AXES:
            raise MeshError(f"mesh {text!r}: each field is data=M or model=N, comma-separated (e.g. model=2,data=4)")
        if axis in sizes:
            raise MeshError(f"mesh {text!r} gives {axis} twice")
        try:
            sizes[axis] = int(value)
        except ValueError:
            raise MeshError(f"mesh {text!r}: {axis}={value.strip()!r} is not an integer") from None
    return MeshShape(**sizes)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which part of the model and cache each device holds on a mesh, for one config."""

    mesh: MeshShape
    num_heads: int  # query heads per device
    num_kv_heads: int  # KV heads per device
    kv_shards: int  # ways the KV heads are split: min(num_key_value_heads, model)
    kv_copies: int  # devices along `model` holding the same KV heads: model / kv_shards
    intermediate_size: int  # MLP columns per device
    vocab_split: bool  # embed_tokens and lm_head split over the vocabulary (else replicated)
    vocab_size: int  # vocabulary rows per device

    def q_heads(self, model_rank: int) -> range:
        """Query heads held by the device at this position along `model`."""
        return range(model_rank * self.num_heads, (model_rank + 1) * self.num_heads)

    def kv_heads(self, model_rank: int) -> range:
        """KV heads held by the device at this position along `model` (its group's, when they are replicated)."""
        first = (model_rank // self.kv_copies) * self.num_kv_heads
        return range(first, first + self.num_kv_heads)

    def columns(self, model_rank: int) -> range:
        """MLP intermediate columns held by the device at this position along `model`."""
        return range(model_rank * self.intermediate_size, (model_rank + 1) * self.intermediate_size)

    def vocab(self, model_rank: int) -> range:
        """Vocabulary rows of embed_tokens and lm_head held by the device at this position along `model`."""
        first = model_rank * self.vocab_size if self.vocab_split else 0
        return range(first, first + self.vocab_size)

    def rows(self, data_rank: int, batch_size: int) -> range:
        """Batch rows held by the device at this position along `data`."""
        per_device = batch_size // self.mesh.data
        return range(data_rank * per_device, (data_rank + 1) * per_device)


def plan_shards(config: MistralConfig, mesh: MeshShape) -> ShardPlan:
    """The split of `config` over `mesh`; refuses, naming the numbers, a mesh that cannot split it."""
    model = mesh.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % model:
        raise MeshError(f"mesh model={model} cannot split {heads} query heads evenly; use a model axis that divides "
                        f"num_attention_heads={heads}")
    if kv_heads >= model and kv_heads % model:
        raise MeshError(f"mesh model={model} cannot split {kv_heads} KV heads evenly; use a model axis that divides "
                        f"num_key_value_heads={kv_heads}, or a multiple of it (KV heads are then replicated)")
    if kv_heads < model and model % kv_heads:
        raise MeshError(f"mesh model={model} is larger than the {kv_heads} KV heads but not a multiple of them; use "
                        f"a model axis that divides {kv_heads} or is a multiple of it (each KV head is then "
                        "replicated on model / KV heads devices)")
    if config.intermediate_size % model:
        raise MeshError(f"mesh model={model} cannot split intermediate_size={config.intermediate_size} evenly; use a "
                        "model axis that divides it")
    kv_shards = min(kv_heads, model)
    vocab_split = config.vocab_size % model == 0
    return ShardPlan(mesh=mesh, num_heads=heads // model, num_kv_heads=kv_heads // kv_shards, kv_shards=kv_shards,
                     kv_copies=model // kv_shards, intermediate_size=config.intermediate_size // model,
                     vocab_split=vocab_split, vocab_size=config.vocab_size // model if vocab_split else
                     config.vocab_size)


def check_batch(mesh: MeshShape, batch_size: int) -> None:
    """The batch is split over `data`: refuse a batch that is not a multiple of it."""
    if batch_size % mesh.data:
        raise MeshError(f"a batch of {batch_size} rows cannot be split over mesh data={mesh.data}; give a batch that "
                        f"is a multiple of {mesh.data}, or use data=1")


def pad_batch(batch: Batch, rows: int, on_token: TokenCallback | None) -> tuple[Batch, TokenCallback | None]:
    """A generation's batch with copies of its last row appended up to `rows` rows (the rows of the cache a tower
    sized for it: `batch_size_class`, a multiple of a data-split mesh's `data`, so that any batch decodes there and
    batches of nearby sizes share one compiled shape), and an `on_token` that sees the real rows only; `keep_rows`
    drops the copies' outputs afterwards. The copies are prefilled as their row is; the decode then counts them
    finished from its first step (a sampled copy draws its own noise, a row's draws following its index, and would
    hold the loop open past the real rows' EOS for steps whose outputs are dropped)."""
    real = len(batch.prompt_ids)
    if rows <= real:
        return batch, on_token
    padded = dataclasses.replace(batch, prompt_ids=batch.prompt_ids + [batch.prompt_ids[-1]] * (rows - real),
                                 input_ids=pad_rows(batch.input_ids, rows),
                                 attention_mask=pad_rows(batch.attention_mask, rows))
    return padded, None if on_token is None else (lambda row_ids: on_token(row_ids[:real]))


def pad_continuation(last_tokens: list[int], cache_rows: int, real_rows: int | None,
                     on_token: TokenCallback | None) -> tuple[list[int], TokenCallback | None]:
    """A continuation of a generation that pad_batch padded: generate's result leaves the copies of its last row out
    but its cache keeps them, so the result's last tokens (one per real row) are given the copies' as well, the last
    row's own (the decode counts the copies finished), with an `on_token` that sees the real rows only. That is when
    there are exactly the cache's `real_rows` tokens (`BufferSizes.real_rows`: the rows generate padded this cache
    for, or the handoff's data-split padding). Any other count of rows is left as given, for the cache's batch check
    to refuse: a row too few for a padded cache is a caller's mistake, never read as padding."""
    rows = len(last_tokens)
    if real_rows is None or rows != real_rows or rows >= cache_rows:
        return last_tokens, on_token
    padded = last_tokens + [last_tokens[-1]] * (cache_rows - rows)
    return padded, None if on_token is None else (lambda row_ids: on_token(row_ids[:rows]))


def pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """A per-row array [B, ...] as pad_batch pads its batch: copies of the last row appended up to `rows`."""
    return np.concatenate([array, np.repeat(array[-1:], rows - len(array), axis=0)])


def keep_rows(result: GenerationResult, rows: int) -> GenerationResult:
    """A result of the first `rows` rows only (the padding rows of pad_batch left out); the cache keeps them all and
    records `rows` as its `real_rows` (None where it holds no padding), for a continuation to pad again."""
    if result.cache is not None:
        result.cache.real_rows = rows if rows < result.cache.batch_size else None
    if len(result.token_ids) == rows:
        return result
    return dataclasses.replace(result, prompt_ids=result.prompt_ids[:rows], token_ids=result.token_ids[:rows],
                               step_logits=None if result.step_logits is None else result.step_logits[:rows])


def split_mesh(mesh: MeshShape | None) -> MeshShape | None:
    """The mesh a tower splits a model over: `mesh`, or None (one device) for no mesh or a mesh of one device, which
    splits nothing. Both backends run a one-device mesh as one device, in the calling process: torch starts no rank
    for it, JAX builds no one-device Mesh (their tokens and output equal a run without --mesh)."""
    return mesh if mesh is not None and mesh.devices > 1 else None


def wrong_mesh_type(mesh: object, expected: str, how: str) -> MeshError:
    """The refusal of a `mesh=` that is not the tower's own mesh type (a string, a MeshShape, the other tower's
    mesh): each tower's mesh_shape read attributes from it, and a user saw AttributeError "'str' object has no
    attribute 'axis_names'" from inside the loader."""
    kind = f"{type(mesh).__module__}.{type(mesh).__qualname__}"
    shown = f" {mesh!r}" if isinstance(mesh, (str, int, float, MeshShape)) else ""
    return MeshError(f"mesh is a {kind}{shown}, not a {expected}; build one with {how}")


def check_devices(mesh: MeshShape, available: int, where: str) -> None:
    """Refuse a mesh larger than the devices there are (`where` names them, e.g. "JAX sees 1 cpu device")."""
    if mesh.devices > available:
        raise MeshError(f"mesh {mesh} needs {mesh.devices} devices, but {where}; use a smaller mesh")


__all__ = ["AXES", "MeshShape", "parse_mesh", "ShardPlan", "plan_shards", "check_batch", "pad_batch",
           "pad_continuation", "pad_rows", "keep_rows", "split_mesh", "wrong_mesh_type", "check_devices"]
