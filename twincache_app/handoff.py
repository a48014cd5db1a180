"""torch <-> JAX handoff: weights and live caches. App layer: it sees both towers (docs/design.md §1).

Weights move zero-copy through DLPack where dtype and device allow (JAX then reads torch's memory: do not modify
the torch weights in place afterwards). Caches are copied, because torch writes its caches in place while JAX
treats arrays as immutable. Both arrive uncommitted, as jax_cache's own arrays are, so a handed-over model or cache
compiles only what a native one does (docs/design.md §7.29).

A generation continues on the other tower with that tower's `continue_generation(model, cache, last_tokens, n,
sampling=..., first_step=generated)`: `first_step`, the tokens generated so far, keeps a seeded generation at its
place in the seed's stream. The towers draw from different streams (greedy tokens agree), so each leg of a sampled
handoff draws from its own tower's stream, at the indices of one uninterrupted generation (README).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh

import torch_cache.cache as torch_caches
import torch_cache.model as torch_model
from jax_cache import cache as jax_caches
from jax_cache import sharding as jax_sharding
from jax_cache.model import Mistral
from torch_cache import sharding as torch_sharding
from twincache import cache_checks
from twincache.config import MistralConfig
from twincache.errors import CacheError, InputError
from twincache.generation import check_count


def _to_jax(tensor: torch.Tensor) -> jax.Array:
    """Zero-copy through DLPack when possible; a host copy otherwise (e.g. torch on a device JAX does not see).
    Uncommitted either way (_uncommitted)."""
    tensor = tensor.detach()
    try:
        shared = jax.dlpack.from_dlpack(tensor.contiguous())
    except Exception:  # noqa: BLE001 - DLPack refuses some devices/dtypes: fall back to a copy
        return jnp.asarray(tensor.float().cpu().numpy()).astype(_jax_dtype(tensor.dtype))
    return _uncommitted(shared)


def _uncommitted(array: jax.Array) -> jax.Array:
    """The same device buffer as an uncommitted array, like every array jax_cache makes (docs/design.md §7.29).
    from_dlpack commits its result, and a committed input commits a jitted call's outputs: a handed-over weight or
    cache was another jit signature for the prefill and the step (each compiled twice), and the cache a step
    returned stayed committed. No copy: the new array holds the buffer (and so torch's memory) alive.
    An array on another device than the default stays committed: JAX places uncommitted inputs on the default one."""
    # JAX's own re-wrap of single-device buffers (pxla.batched_device_put); no public API sets `committed`. Should a
    # JAX release move or change it, the array stays committed: more compiles, the same values (test_handoff.py says
    # which).
    try:
        from jax._src.array import ArrayImpl
    except ImportError:
        return array
    if not isinstance(array, ArrayImpl) or not array.committed or array.devices() != {jax_caches.default_device()}:
        return array
    try:
        return ArrayImpl(array.aval, array.sharding, [array], committed=False, _skip_checks=True)
    except (TypeError, ValueError):
        return array


@torch.inference_mode(False)
def _to_torch(array: jax.Array, device: torch.device) -> torch.Tensor:
    """A torch copy of a JAX array on `device` (a copy: torch will write it in place). A plain tensor even under
    inference mode, as torch_cache's own loader makes: an inference tensor counts no in-place writes (a reloaded
    model's packed copies would go stale, so one is never packed) and compiles the decode step again."""
    try:
        return torch.from_dlpack(array).to(device).clone()
    except Exception:  # noqa: BLE001 - fall back to a host round trip
        # torch.tensor copies, so JAX's read-only host view needs no from_numpy (which warns that it is not writable)
        host = np.asarray(array.astype(jnp.float32) if array.dtype == jnp.bfloat16 else array)
        return torch.tensor(host, dtype=_torch_dtype(array.dtype), device=device)


def _jax_dtype(dtype: torch.dtype) -> jnp.dtype:
    return jnp.dtype(str(dtype).removeprefix("torch."))


def _torch_dtype(dtype: jnp.dtype) -> torch.dtype:
    return getattr(torch, jnp.dtype(dtype).name)


def weights_from_torch(weights: dict[str, torch.Tensor], backend: str) -> dict[str, Any]:
    """HF-named torch tensors as `backend`'s arrays: the tensors themselves for torch, zero-copy views for JAX."""
    convert = {"torch": lambda tensor: tensor, "jax": _to_jax}[backend]
    return {name: convert(tensor) for name, tensor in weights.items()}


def from_torch(model: torch_model.Mistral) -> Mistral:
    """The jax_cache model with a torch_cache model's weights (same names, same [out, in] layout)."""
    _check_model_type(model, torch_model.Mistral, "from_torch", "to_torch")
    if model.mesh is not None:  # its state_dict is this rank's slice of every weight, not the model
        raise InputError(f"from_torch copies a torch model held whole by one process, but this one is split over "
                         f"{torch_sharding.mesh_label(model.mesh)} (each rank holds a slice of every weight); load "
                         "the JAX model from the checkpoint instead: jax_cache.model.Mistral.from_pretrained(path, "
                         "mesh=...)")
    return Mistral.from_weights(model.config, weights_from_torch(model.state_dict(), "jax"))


def to_torch(model: Mistral, device: str | torch.device = "cpu") -> torch_model.Mistral:
    """The torch_cache model with a jax_cache model's weights (copied)."""
    from flax import nnx

    _check_model_type(model, Mistral, "to_torch", "from_torch")
    device = torch_caches.usable_device(device)  # before any weight is copied
    # astype: the weights a half-precision model keeps as float32 on CPU (jax_cache.projection.stored_dtype) go back
    # exactly.
    state = {".".join(map(str, path)): _to_torch(variable.get_value().astype(model.dtype), device)
             for path, variable in nnx.to_flat_state(nnx.state(model))}
    return torch_model.Mistral.from_weights(model.config, state)


def _check_model_type(model: object, own_type: type, where: str, other: str) -> None:
    """Refuse a model of the other tower (or anything else) before any weight is read."""
    if not isinstance(model, own_type):
        raise InputError(f"{where} copies a {own_type.__module__}.Mistral, not a {type(model).__module__}."
                         f"{type(model).__name__}" + (f"; for the other direction use {other}"
                                                      if type(model).__name__ == "Mistral" else ""))


def _check_config(config: object, where: str) -> None:
    if not isinstance(config, MistralConfig):
        raise InputError(f"{where} needs the model's twincache.config.MistralConfig (model.config), not "
                         f"{type(config).__name__}")


def _check_handoff(cache: object, own_type: type, config: MistralConfig, where: str) -> None:
    """The cache must be of the source backend, built for `config` (kind, window, layers, heads, head_dim), and hold
    arrays of the shapes it describes: the copy is built from both, so neither is trusted alone."""
    _check_config(config, where)
    backend = own_type.__module__.split(".")[0]
    cache_checks.check_cache_type(cache, own_type, backend, f"{where} copies a {backend} cache")
    if isinstance(cache, torch_caches.StaticCache) and cache.mesh is not None:
        raise CacheError(f"{where} copies a torch cache held whole by one process, but this one is split over "
                         f"{torch_sharding.mesh_label(cache.mesh)} (each rank holds a shard); hand over from a "
                         "single-device torch cache")
    assert isinstance(cache, (torch_caches.StaticCache, jax_caches.StaticCache))  # check_cache_type refused others
    if isinstance(cache, jax_caches.StaticCache):
        cache.check_live()
    cache_checks.check_model_geometry(cache, config)
    keys, values, slot_positions, length = cache.keys, cache.values, cache.slot_positions, cache.length
    cache_checks.check_layout(cache, [k.shape for k in keys], [v.shape for v in values], slot_positions.shape,
                              length.shape, where)


def cache_from_torch(cache: torch_caches.StaticCache, config: MistralConfig,
                     mesh: Mesh | None = None) -> jax_caches.StaticCache:
    """A jax_cache copy of a live torch cache: same kind, sizes, contents, positions and length, on one device or
    split over a JAX `mesh` (docs/design.md §10): a cache decoded by torch continues on the mesh."""
    _check_handoff(cache, torch_caches.StaticCache, config, "cache_from_torch")
    rows = cache.batch_size
    # a data split takes a multiple of its size: copies of the last row, as generate pads a batch there (pad_batch);
    # continue_generation gives them that row's last token and leaves their outputs out (pad_continuation)
    padded = rows if mesh is None else rows + -rows % jax_sharding.mesh_shape(mesh).data
    jax_cache = jax_caches.make_cache(cache.kind, config, padded, cache.max_cache_len, _jax_dtype(cache.dtype), mesh)
    # Both caches list their arrays in the same order (ARRAY_FIELDS); each copy is an owned JAX buffer, uncommitted as
    # make_cache's (_to_jax) unless placed on a mesh below.
    copies = [jnp.array(_to_jax(t.clone())) for t in cache.arrays()]
    if padded != rows:  # the per-row arrays (K/V [B, H, L, D], slot_positions [B, L]) on their device; length: a scalar
        copies = [jnp.pad(copy, [(0, padded - rows)] + [(0, 0)] * (copy.ndim - 1), mode="edge") if copy.ndim else copy
                  for copy in copies]
    if mesh is not None:
        placements = jax_sharding.cache_shardings(mesh, jax_cache.num_layers, jax_cache.num_kv_heads)
        copies = [jax.device_put(copy, placement) for copy, placement in zip(copies, placements, strict=True)]
    copy = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(jax_cache), copies)
    # the rows a generate padded it for, or the data split's padding here (continue_generation pads them again)
    copy.real_rows = cache.real_rows if cache.real_rows is not None else (rows if padded != rows else None)
    return copy


def cache_to_torch(cache: jax_caches.StaticCache, config: MistralConfig, device: str | torch.device = "cpu",
                   batch_size: int | None = None) -> torch_caches.StaticCache:
    """A torch_cache copy of a live JAX cache. Its buffers are fresh static addresses on `device`. `batch_size`
    keeps the first rows only: a cache that generate padded (a batch size class, a JAX data split) holds its padding
    rows after the batch's (copies of the last row, pad_batch); torch's continue_generation from the result's rows
    pads them again as JAX's does, and the generation's batch here drops them (a smaller cache)."""
    _check_handoff(cache, jax_caches.StaticCache, config, "cache_to_torch")
    rows = cache.batch_size if batch_size is None else check_count("batch_size", batch_size, 1, cache.batch_size)
    torch_cache = torch_caches.make_cache(cache.kind, config, rows, cache.max_cache_len, _torch_dtype(cache.dtype),
                                          device)
    for buffer, array in zip(torch_cache.arrays(), cache.arrays(), strict=True):  # per-row arrays lead with the batch
        buffer.copy_(_to_torch(array[:rows] if array.ndim else array, torch_cache.device))
    # the rows a generate (or cache_from_torch) padded it for, where some padding rows are kept
    torch_cache.real_rows = cache.real_rows if cache.real_rows is not None and cache.real_rows < rows else None
    return torch_cache
