"""Mistral in PyTorch: a lean decoder that reads and writes a StaticCache or SlidingWindowCache.

jax_cache/model.py mirrors this file: same classes, methods and argument order. Parameter names equal the HF
checkpoint's, so loading is a strict name-for-name copy. How a projection streams its weight on each device is
torch_cache/projection.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.torch_version import TorchVersion

from torch_cache import sharding
from torch_cache.cache import StaticCache, available_memory, host_buffers, memory_label, usable_device
from torch_cache.projection import project, project_stacked
from twincache import cache_checks
from twincache.checkpoint import (
    check_weight_arrays,
    check_weight_shapes,
    expected_tensor_shapes,
    fill_weights,
    open_checkpoint,
)
from twincache.config import MistralConfig
from twincache.errors import CacheError, CheckpointError, InputError
from twincache.generation import INT32_MAX, check_count, validate_attention_mask
from twincache.gguf_checkpoint import GGUFCheckpoint, is_gguf_file, open_gguf

_P = ParamSpec("_P")
_R = TypeVar("_R")


def compile_region(forward: Callable[_P, _R]) -> Callable[_P, _R]:
    """Regional compilation: under torch.compile, a module method marked so is traced and compiled once and reused
    for every module of the class with the same input shapes (one decoder layer for the whole stack, not 30
    layers), which cuts the compile time of a deep model several fold; eager calls are unchanged.
    Marked methods take only tensors and their module, the inputs dynamo's subgraph reuse accepts (docs/design.md
    §7.16). torch >= 2.11, where it was measured (2.11 is the GPU machine's); older versions compile the whole stack."""
    if TorchVersion(torch.__version__) < "2.11" or not hasattr(torch.compiler, "nested_compile_region"):
        return forward
    return functools.wraps(forward)(torch.compiler.nested_compile_region(forward))  # keeps the signature visible


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)  # weight [out, in], as in HF
        self._packed: torch.Tensor | None = None  # the weight's oneDNN copy, when made (pack_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self._packed)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # normalise in fp32, then cast back, as transformers does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for the rotate-half layout, computed in fp32 from positions [B, S] (as transformers computes them in
    every dtype), or in float64 for a float64 model: the fallback parity reference, exact as twincache_app.parity's
    float64 transformers is (fp32 angles are off by ~position x 6e-8). Each [B, 1, S, D]."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(compute) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    freqs = positions.to(compute)[:, :, None] * inv_freq  # [B, S, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [B, S, D]
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [B, H, S, D]
    return x * cos + rotated * sin


def attention_visibility(query_positions: torch.Tensor, key_positions: torch.Tensor, query_valid: torch.Tensor,
                         sliding_window: int | None) -> torch.Tensor:
    """Which keys each query sees: k >= 0 and q - W < k <= q. [B, 1, S, Lkv] bool.

    Padding queries see every key: their outputs are discarded, and an all-masked row would make softmax NaN.
    """
    q = query_positions[:, :, None]  # [B, S, 1]
    k = key_positions[:, None, :]  # [B, 1, Lkv]
    visible = (k >= 0) & (k <= q)  # [B, S, Lkv]
    if sliding_window is not None:
        visible = visible & (k > q - sliding_window)
    visible = visible | ~query_valid[:, :, None]
    return visible[:, None]  # [B, 1, S, Lkv]


class Attention(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size)
        self._packed_qkv: torch.Tensor | None = None  # q, k and v stacked: their copy (pack_projections)
        self.parallel = sharding.SINGLE  # on a mesh: local head counts, and o_proj's partial sums are all-reduced

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new tokens' q [B, H, S, D], k and v [B, Hkv, S, D], RoPE applied to q and k."""
        batch, seq_len, _ = x.shape
        q, k, v = project_stacked(x, (self.q_proj, self.k_proj, self.v_proj), self._packed_qkv)  # [B, S, out_i]
        q = q.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, D] over the K/V the cache update returned ([B, Hkv, L, D]), through o_proj: [B, S, hidden]."""
        batch, _, seq_len, _ = q.shape
        groups = self.num_heads // self.num_kv_heads
        # Attention reads as many slots as the mask covers: a prefix of the buffers when the forward was given an
        # attend_len bucket (every live key is in it), else all of them.
        keys, values = keys.narrow(2, 0, visible.shape[-1]), values.narrow(2, 0, visible.shape[-1])  # [B, Hkv, Lkv, D]
        # Grouped-query attention without repeating K/V: the G query heads of one KV head become G*S query rows.
        q = q.reshape(batch, self.num_kv_heads, groups * seq_len, self.head_dim)  # [B, Hkv, G*S, D]
        mask = visible[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * seq_len, -1)
        out = scaled_dot_product_attention(q, keys, values, mask, decode=seq_len == 1)  # [B, Hkv, G*S, D]
        out = out.view(batch, self.num_heads, seq_len, self.head_dim).transpose(1, 2)  # [B, S, H, D]
        return self.parallel.reduce(self.o_proj(out.reshape(batch, seq_len, self.num_heads * self.head_dim)))


def scaled_dot_product_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                                 decode: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v. q [B, Hkv, R, D], keys/values [B, Hkv, L, D], mask [B, 1, R, L] bool. [B, Hkv, R, D]

    A compiled CPU `decode` step (one new token) spells it out as multiply-and-sum in float32, which inductor turns
    into loops of the layer's own kernels: SDPA's CPU flash kernel, a call of its own, spends most of its time on the
    few query rows of a step: 1.2-2x slower a layer on the bench's decode shapes, 3.7x at 4k keys (docs/design.md
    §7.33). Elsewhere F.scaled_dot_product_attention.
    """
    if not (decode and q.device.type == "cpu" and torch.compiler.is_compiling()):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hkv, R, D]
    q = q.float() * q.shape[-1] ** -0.5  # [B, Hkv, R, D]
    scores = (q.unsqueeze(-2) * keys.float().unsqueeze(-3)).sum(-1)  # [B, Hkv, R, L]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)  # [B, Hkv, R, L]
    return (weights.unsqueeze(-1) * values.float().unsqueeze(-3)).sum(-2).to(values.dtype)  # [B, Hkv, R, D]


class MLP(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)
        self._packed_gate_up: torch.Tensor | None = None  # gate and up stacked: their copy (pack_projections)
        self.parallel = sharding.SINGLE  # on a mesh: down_proj's partial sums are all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_stacked(x, (self.gate_proj, self.up_proj), self._packed_gate_up)  # [B, S, I] x2
        return self.parallel.reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor,
                cache: StaticCache, layer_idx: int) -> torch.Tensor:
        slots = cache.in_place_slots(x.shape[1])  # [S], or None: attention reads the old buffers + the new tokens
        if slots is not None:  # every decode step, and a static cache's prefill
            return self.forward_in_place(x, cos, sin, visible, cache.keys[layer_idx], cache.values[layer_idx], slots)
        q, k, v = self.pre_attention(x, cos, sin)  # [B, H, S, D], [B, Hkv, S, D] x2
        keys, values = cache.update(layer_idx, k, v)  # [B, Hkv, L, D]
        return self.post_attention(x, q, keys, values, visible)  # [B, S, hidden]

    @compile_region
    def forward_in_place(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The layer with its cache write inside, on tensors alone (its K/V buffers [B, Hkv, L, D] and the slots
        [S] they take): under torch.compile dynamo traces it once and reuses that trace for every other layer, and
        inductor compiles one layer, not 30 cache writes around it (docs/design.md §7.16)."""
        q, k, v = self.pre_attention(x, cos, sin)  # [B, H, S, D], [B, Hkv, S, D] x2
        StaticCache.write_in_place(keys, values, slots, k, v)
        return self.post_attention(x, q, keys, values, visible)  # [B, S, hidden]

    # The layer's two halves around its cache write.
    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       visible: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.attend(q, keys, values, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class MistralModel(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Mistral(nn.Module):
    """Mistral causal LM. `forward(input_ids, positions, cache, attention_mask=None, logits_to_keep=0,
    attend_len=None) -> logits [B, S, V]`."""

    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MistralModel(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self._packed_head: torch.Tensor | None = None  # the head's oneDNN copy, when made (pack_projections)
        self._packed_from: list[tuple[int, int]] = []  # (data_ptr, version) of each weight the copies were made from
        self.mesh: DeviceMesh | None = None  # the mesh this rank's weights are a part of (docs/design.md §10)
        self.parallel = sharding.SINGLE  # the collectives of that mesh; the identity on one device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache,
                attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0,
                attend_len: int | None = None) -> torch.Tensor:
        """input_ids, positions, attention_mask: [B, S]; positions are absolute, attention_mask is 1 for tokens.
        attend_len: the cache slots attention reads (twincache.buckets.step_attend_len), None = all of them.
        Returns logits [B, S, V], or of the last `logits_to_keep` tokens only (a prefill needs the last one)."""
        embed = self.model.embed_tokens.weight
        if not torch.compiler.is_compiling():
            cache_checks.check_cache_type(cache, StaticCache, "torch_cache", cache_checks.cache_hint("torch_cache"))
            self.check_inputs(input_ids, positions, attention_mask)
            check_count("logits_to_keep", logits_to_keep)  # 0: every position's logits
            cache.check_forward(self.config, input_ids, embed.dtype, embed.device)
            self._check_mesh(cache)
        query_valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        new_positions = torch.where(query_valid, positions, -1).to(torch.int32)  # [B, S]; padding is never a key
        key_positions = cache.attended_positions(new_positions, attend_len)  # [B, Lkv]
        visible = attention_visibility(positions, key_positions, query_valid, self.config.sliding_window)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, embed.dtype)
        # On a mesh this rank computes its rows of the batch (the whole batch on one device).
        input_ids, visible, cos, sin = (self.parallel.rows(t) for t in (input_ids, visible, cos, sin))
        x = self.parallel.embed(embed, input_ids)  # [B, S, hidden]
        for layer_idx, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, visible, cache, layer_idx)
        cache.advance(new_positions)
        if logits_to_keep:  # [B, S, V] logits of a long chunk would outweigh its attention; most are not needed
            x = x[:, -logits_to_keep:]  # [B, K, hidden]
        x = self.model.norm(x)
        head = embed if self.lm_head is None else self.lm_head.weight
        # [B, S or K, V], the whole batch on every rank
        return self.parallel.gather_logits(project(x, head, self._packed_head))

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None,
                     mask_checked: bool = False) -> None:
        """Eager-only checks of ids, positions and mask (they read values, so they would sync a GPU). `mask_checked`:
        the caller validated the mask already (prefill, as a whole prompt), so its values are not read again."""
        for name, tensor in (("input_ids", input_ids), ("positions", positions), ("attention_mask", attention_mask)):
            if not isinstance(tensor, torch.Tensor) and (tensor is not None or name != "attention_mask"):
                raise InputError(f"{name} must be a [batch, seq_len] torch.Tensor, not {type(tensor).__name__}")
        if input_ids.ndim != 2 or 0 in input_ids.shape:
            raise InputError(f"input_ids has shape {list(input_ids.shape)}; expected [batch >= 1, seq_len >= 1]")
        for name, tensor in (("input_ids", input_ids), ("positions", positions)):
            if tensor.dtype not in (torch.int32, torch.int64):
                raise InputError(f"{name} dtype {tensor.dtype} must be int32 or int64 (whole token ids and "
                                 "positions)")
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        for name, tensor in (("positions", positions), ("attention_mask", attention_mask)):
            if tensor is not None and tuple(tensor.shape) != tuple(input_ids.shape):
                raise InputError(f"{name} has shape {list(tensor.shape)} but input_ids has "
                                 f"{list(input_ids.shape)}; they must match")
        if attention_mask is not None and not mask_checked:  # 0/1, left-padded; a chunk may be all padding in a row
            validate_attention_mask(attention_mask.cpu().numpy(), tuple(input_ids.shape), whole_prompt=False)
        valid = positions if attention_mask is None else positions[attention_mask.bool()]
        if valid.numel():
            low, high = torch.stack(torch.aminmax(valid)).tolist()  # one host sync
            if low < 0 or high > INT32_MAX:  # int64 positions past int32 would wrap in the cache's int32 positions
                raise InputError(f"positions of real tokens must be in [0, {INT32_MAX}] (int32), got "
                                 f"{low if low < 0 else high}")

    def _check_mesh(self, cache: StaticCache) -> None:
        """Refuse a cache split over another mesh than the model (the torch device alone cannot tell)."""
        if cache.mesh != self.mesh:
            def where(mesh: DeviceMesh | None) -> str:
                return "one device" if mesh is None else sharding.mesh_label(mesh)
            raise CacheError(f"the model is on {where(self.mesh)} but the cache is on {where(cache.mesh)}; build the "
                             "cache with mesh=model.mesh")

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @classmethod
    def from_weights(cls, config: MistralConfig, weights: dict[str, torch.Tensor],
                     mesh: DeviceMesh | None = None) -> Mistral:
        """Build a model from HF-named tensors (no copy: the model holds the tensors themselves). On `mesh`, the
        tensors are whole and this rank keeps copies of its slices of them."""
        check_weight_arrays(weights, torch.Tensor, lambda tensor: str(tensor.dtype).removeprefix("torch."),
                            "pass torch tensors (torch.from_numpy(array); a jax_cache model's weights: "
                            "twincache_app.handoff.to_torch)")
        check_weight_shapes(config, {name: tuple(tensor.shape) for name, tensor in weights.items()})
        dtypes = {tensor.dtype: name for name, tensor in weights.items()}
        if len(dtypes) > 1:  # torch's matmuls refuse operands of two dtypes: the first forward raised RuntimeError
            (first, one), (second, other) = list(dtypes.items())[:2]
            raise CheckpointError(f"weights tensor {one} is {first} but {other} is {second}; a torch_cache model "
                                  "computes in one dtype: convert every tensor to it (tensor.to(dtype))")
        if mesh is not None:
            weights = sharding.shard_weights(config, weights, mesh)
        return cls._assemble(config, weights, mesh)

    @classmethod
    def _assemble(cls, config: MistralConfig, weights: dict[str, torch.Tensor], mesh: DeviceMesh | None) -> Mistral:
        """A model holding `weights` (this rank's slices on a mesh) as its parameters."""
        with torch.device("meta"):
            model = cls(config)
        if mesh is None:
            model.load_state_dict(weights, strict=True, assign=True)
        else:
            sharding.parallelize(model, mesh, weights)
        return model.eval().requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", mesh: DeviceMesh | None = None) -> Mistral:
        """Load an HF Mistral or Llama checkpoint directory (safetensors only) or a GGUF file, converting to `dtype` on
        `device`. GGUF tensors of any type the `gguf` library dequantizes are dequantized, then converted. On `mesh`,
        this rank reads only its slice of every safetensors tensor, onto its own device (a GGUF is dequantized whole,
        then sliced)."""
        _check_model_dtype(dtype)
        if mesh is None:  # "tpu" raised RuntimeError, "cuda" on a CPU-only torch AssertionError, from inside
            device = usable_device(device)
        # Plain tensors wherever the model is loaded, as the caches are (StaticCache): dynamo guards on a tensor's
        # inference-ness, so a model loaded in inference mode compiled the decode step again, and an inference tensor
        # counts no in-place writes, so a model reloaded in place kept stale packed copies (pack_projections).
        with torch.inference_mode(False):
            gguf = open_gguf(path) if is_gguf_file(path) else None
            config, files = (gguf.config, {}) if gguf is not None else open_checkpoint(path)
            if mesh is not None:
                sharding.plan(mesh, config)  # an impossible mesh is refused before anything is read
                device = sharding.local_device(mesh)
            _check_weights_fit(config, dtype, torch.device(device), mesh)
            if mesh is None and torch.device(device).type == "cpu":
                return cls._assemble(config, _read_to_host(config, gguf, files, dtype), None)
            if gguf is not None:
                state = {}
                for name, array in gguf.arrays():
                    part = () if mesh is None else sharding.weight_slice(name, config, mesh)
                    tensor = torch.from_numpy(array)
                    tensor = tensor[part] if part else tensor
                    state[name] = _aligned(tensor.to(device=device, dtype=dtype).contiguous())
                return cls._assemble(config, state, mesh)
            wanted = expected_tensor_shapes(config)
            state = {}
            for file in sorted(set(files.values())):
                with safe_open(str(file), framework="pt", device=str(device)) as f:
                    for name in f.keys():
                        if name not in wanted:
                            continue
                        part = () if mesh is None else sharding.weight_slice(name, config, mesh)
                        tensor = f.get_slice(name)[part] if part else f.get_tensor(name)
                        state[name] = _aligned(tensor.to(dtype))
            return cls._assemble(config, state, mesh)


def _check_model_dtype(dtype: object) -> None:
    """A name ("bfloat16"), another framework's dtype or an integer one raised AttributeError or load_state_dict's
    wall of RuntimeErrors: refused here in one line, as the caches refuse theirs."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype={dtype!r} must be a floating-point torch.dtype, e.g. torch.float32 or torch.bfloat16 "
                         "(torch_cache.backend.load takes the name: dtype=\"bfloat16\")")


def _check_weights_fit(config: MistralConfig, dtype: torch.dtype, device: torch.device,
                       mesh: DeviceMesh | None = None) -> None:
    """Weights that cannot fit on `device` are refused before anything is read; on `mesh`, this rank's share. Ranks
    on one host check theirs apart, as each may already hold its own: a lower bound of what they need together."""
    share = None if mesh is None else sharding.shard_parameters(config, mesh)
    cache_checks.check_weights_fit(config, dtype, dtype.itemsize, available_memory(device), memory_label(device),
                                   share)


def _read_to_host(config: MistralConfig, gguf: GGUFCheckpoint | None, files: dict[str, Path],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint (a GGUF, else safetensors `files`), converted to `dtype` into one host
    allocation on 2 MiB pages (host_buffers), where a decode step streams them faster. Each tensor is copied in
    as it is read and then dropped, so loading holds the weights once plus one tensor."""
    shapes = expected_tensor_shapes(config)
    state = dict(zip(shapes, host_buffers(list(shapes.values()), dtype, prefault=False)))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        if gguf is not None:
            for name, array in gguf.arrays():
                yield name, torch.from_numpy(array)
            return
        for file in sorted(set(files.values())):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                yield from ((name, f.get_tensor(name)) for name in f.keys() if name in shapes)

    # copy_ converts to dtype as .to(dtype) would
    fill_weights(config, shapes, tensors(), lambda name, tensor: state[name].copy_(tensor))
    return state


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or an own copy when its CPU data is not 64-byte aligned.

    safetensors' CPU tensors sit 32 bytes into a Python bytes object (and large numpy arrays 16 bytes into their
    allocation); XLA-CPU copies anything not 64-byte aligned, so an own copy lets the handoff share the weights
    zero-copy (design.md §7.10).
    """
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


__all__ = ["compile_region", "Linear", "RMSNorm", "rope_cos_sin", "apply_rope", "attention_visibility",
           "Attention", "scaled_dot_product_attention", "MLP", "DecoderLayer", "MistralModel", "Mistral"]
