"""Mistral in Flax NNX: a lean decoder that reads and writes a StaticCache or SlidingWindowCache.

torch_cache/model.py is the reference this file mirrors: same classes, methods and argument order. Parameter names
equal the HF checkpoint's, so loading is a strict name-for-name copy. Weights keep the HF/torch [out, in] layout and
are contracted with dot_general over their last axis (jax_cache/projection.py): on XLA-CPU that runs ~26x faster than
`x @ W.T`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from safetensors import safe_open

from jax_cache import sharding
from jax_cache.cache import StaticCache, available_memory, default_device, device_label, host_buffers, memory_label
from jax_cache.projection import matmul_precision, project, stored_dtype
from twincache import cache_checks
from twincache.checkpoint import (
    check_weight_arrays,
    check_weight_shapes,
    expected_tensor_shapes,
    fill_weights,
    open_checkpoint,
)
from twincache.config import MistralConfig
from twincache.errors import InputError
from twincache.generation import INT32_MAX, check_count, validate_attention_mask
from twincache.gguf_checkpoint import GGUFCheckpoint, is_gguf_file, open_gguf

_ModuleList = getattr(nnx, "List", list)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))  # [out, in], as in HF and torch

    def __call__(self, x: jax.Array) -> jax.Array:
        return project(x, self.weight[...])


class Embedding(nnx.Module):
    def __init__(self, num_embeddings: int, features: int, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((num_embeddings, features), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)  # ids were range-checked before dispatch


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # normalise in fp32, then cast back, as transformers does
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                 dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin for the rotate-half layout, computed in fp32 from positions [B, S] (as transformers computes them in
    every dtype), or in float64 for a float64 model (with jax_enable_x64), as torch_cache's float64 parity reference
    does. Each [B, 1, S, D]."""
    compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(compute) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    freqs = positions.astype(compute)[:, :, None] * inv_freq  # [B, S, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, D]
    return jnp.cos(angles).astype(dtype)[:, None], jnp.sin(angles).astype(dtype)[:, None]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, H, S, D]
    return x * cos + rotated * sin


def attention_visibility(query_positions: jax.Array, key_positions: jax.Array, query_valid: jax.Array,
                         sliding_window: int | None) -> jax.Array:
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


# K or V as attention reads it: one array [B, Hkv, L, D], or segments read one after another along the slots (the
# buffers as they were before this forward's write, then the new tokens' [B, Hkv, S, D]).
_KeySegments = jax.Array | tuple[jax.Array, ...]


class Attention(nnx.Module):
    def __init__(self, config: MistralConfig, dtype: jnp.dtype) -> None:
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, dtype)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, dtype)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, dtype)

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The new tokens' q [B, H, S, D], k and v [B, Hkv, S, D], RoPE applied to q and k."""
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq_len, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)  # [B, H, S, D]
        k = self.k_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v  # k, v: [B, Hkv, S, D]

    def attend(self, q: jax.Array, keys: _KeySegments, values: _KeySegments, visible: jax.Array) -> jax.Array:
        """q [B, H, S, D] over the K/V the cache update returned ([B, Hkv, L, D]), or over the buffers as they were
        and the new tokens' K/V (a pair, read in that order), through o_proj: [B, S, hidden]."""
        batch, _, seq_len, _ = q.shape
        groups = self.num_heads // self.num_kv_heads
        if not isinstance(keys, tuple):
            assert not isinstance(values, tuple)  # keys and values come in the same form
            # Attention reads as many slots as the mask covers: a prefix of the buffers when the forward was given an
            # attend_len bucket (every live key is in it), else all of them.
            keys, values = keys[:, :, :visible.shape[-1]], values[:, :, :visible.shape[-1]]  # [B, Hkv, Lkv, D]
        # Grouped-query attention without repeating K/V: the G query heads of one KV head become G*S query rows.
        q = q.reshape(batch, self.num_kv_heads, groups * seq_len, self.head_dim)  # [B, Hkv, G*S, D]
        mask = jnp.broadcast_to(visible[:, :, None], (batch, 1, groups, seq_len, visible.shape[-1]))
        mask = mask.reshape(batch, 1, groups * seq_len, -1)  # [B, 1, G*S, Lkv]
        out = scaled_dot_product_attention(q, keys, values, mask, decode=seq_len == 1)  # [B, Hkv, G*S, D]
        out = out.reshape(batch, self.num_heads, seq_len, self.head_dim).transpose(0, 2, 1, 3)  # [B, S, H, D]
        return self.o_proj(out.reshape(batch, seq_len, self.num_heads * self.head_dim))


def scaled_dot_product_attention(q: jax.Array, keys: _KeySegments, values: _KeySegments, mask: jax.Array,
                                 decode: bool) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v with softmax in fp32. q [B, Hkv, R, D], keys/values [B, Hkv, L, D] or segments
    of it (_KeySegments), contracted one by one: nothing is concatenated. [B, Hkv, R, D]

    On XLA-CPU, `decode` (one new token) over a buffer it has just updated in place contracts over the two halves of
    the slots separately. One dot over the buffer made XLA-CPU duplicate the in-place update into the dot's operand
    and copy every K/V buffer per step; multiply-and-sum avoided that over a whole buffer but not over a prefix of it
    (an attention bucket), and it streams K/V at ~0.3 GB/s past a few thousand slots (docs/design.md §7.2). A whole
    buffer read before the write (segments) needs no halves: DecoderLayer orders the write after this read.
    Other backends keep one dot (einsum on the updated cache is the usual, in-place pattern there).
    """
    scale = jnp.sqrt(jnp.float32(q.shape[-1]))
    if isinstance(keys, tuple):
        assert isinstance(values, tuple)  # keys and values come in the same form
        key_parts, value_parts = keys, values
    else:
        assert not isinstance(values, tuple)
        if decode and jax.default_backend() == "cpu" and keys.shape[2] >= 2:
            half = keys.shape[2] // 2

            def halves(buffer: jax.Array) -> tuple[jax.Array, jax.Array]:
                """The two halves of the slots of `buffer` [B, Hkv, L, D]. Past batch 1 each is sliced from a bitcast
                to [B, Hkv, L*D] and bitcast back, as XLA reads batch 1 (it drops the unit batch): XLA-CPU fused the
                buffer's in-place update into a bare slice, which then read the buffer as it was, and copied every
                K/V buffer twice per step; into a slice with a bitcast it does not (docs/design.md §7.39). Not
                [B*Hkv, L, D]: on a mesh those two axes are split over different devices."""
                if buffer.shape[0] == 1:
                    return buffer[:, :, :half], buffer[:, :, half:]
                batch, heads, slots, head_dim = buffer.shape
                flat = buffer.reshape(batch, heads, slots * head_dim)  # [B, Hkv, L*D]
                return (flat[:, :, :half * head_dim].reshape(batch, heads, half, head_dim),
                        flat[:, :, half * head_dim:].reshape(batch, heads, slots - half, head_dim))

            key_parts, value_parts = halves(keys), halves(values)
        else:
            key_parts, value_parts = (keys,), (values,)
    scores = jnp.concatenate([jnp.einsum("bhrd,bhld->bhrl", q, part, precision=matmul_precision(q.dtype),
                                         preferred_element_type=jnp.float32) for part in key_parts],
                             axis=-1) / scale  # [B, Hkv, R, L]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # [B, Hkv, R, L] fp32
    starts = np.cumsum([0] + [part.shape[2] for part in value_parts])
    out = sum(jnp.einsum("bhrl,bhld->bhrd", weights[..., start:stop], part.astype(jnp.float32),
                         precision=lax.Precision.HIGHEST)
              for part, start, stop in zip(value_parts, starts[:-1], starts[1:], strict=True))  # [B, Hkv, R, D] fp32
    return cast(jax.Array, out).astype(value_parts[0].dtype)  # a sum of one or more arrays: never sum()'s start, 0


class MLP(nnx.Module):
    def __init__(self, config: MistralConfig, dtype: jnp.dtype) -> None:
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, dtype)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gate_proj(x)
        return self.down_proj(jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: MistralConfig, dtype: jnp.dtype) -> None:
        self.self_attn = Attention(config, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, visible: jax.Array,
                 cache: StaticCache, layer_idx: int) -> tuple[jax.Array, StaticCache]:
        q, k, v = self.pre_attention(x, cos, sin)  # [B, H, S, D], [B, Hkv, S, D] x2
        if visible.shape[-1] == cache.cache_len + k.shape[2]:
            # Attention reads the buffers as they were plus the new tokens (StaticCache.attended_positions), and the
            # write comes after: made to depend on the layer's output, so XLA must finish reading a buffer before it
            # updates it in place, and copies none (docs/design.md §7.2).
            x = self.post_attention(x, q, (cache.keys[layer_idx], k), (cache.values[layer_idx], v), visible)
            return x, cache.update(layer_idx, *_ordered_after(x, k, v))[2]  # [B, S, hidden]
        keys, values, cache = cache.update(layer_idx, k, v)  # [B, Hkv, L, D]
        return self.post_attention(x, q, keys, values, visible), cache  # [B, S, hidden]

    # The layer's two halves around its cache write (torch compiles them with the write as one region).
    def pre_attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: jax.Array, q: jax.Array, keys: _KeySegments, values: _KeySegments,
                       visible: jax.Array) -> jax.Array:
        x = x + self.self_attn.attend(q, keys, values, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


def _ordered_after(x: jax.Array, *states: jax.Array) -> tuple[jax.Array, ...]:
    """`states` ([B, Hkv, S, D], or positions [B, S]) with their values, plus a zero computed from x ([B, S, hidden]):
    a data dependency, so whatever x needs runs before anything that uses them. nan_to_num keeps a non-finite x out of
    the zero."""
    zero = jnp.nan_to_num(x[:, None, :, :1], nan=0.0, posinf=0.0, neginf=0.0) * 0  # [B, 1, S, 1]
    return tuple(state + (zero if state.ndim == 4 else zero[:, 0, :, 0]).astype(state.dtype) for state in states)


class MistralModel(nnx.Module):
    def __init__(self, config: MistralConfig, dtype: jnp.dtype) -> None:
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = _ModuleList([DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Mistral(nnx.Module):
    """Mistral causal LM. `__call__(input_ids, positions, cache, attention_mask=None, logits_to_keep=0,
    attend_len=None) -> (logits [B, S, V], cache)`."""

    def __init__(self, config: MistralConfig, dtype: jnp.dtype = jnp.float32) -> None:
        self.config = config
        self.mesh: Mesh | None = None  # the mesh the weights are split over (docs/design.md §10); None: one device
        self.model = MistralModel(config, dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, cache: StaticCache,
                 attention_mask: jax.Array | None = None, logits_to_keep: int = 0,
                 attend_len: int | None = None) -> tuple[jax.Array, StaticCache]:
        """input_ids, positions, attention_mask: [B, S]; positions are absolute, attention_mask is 1 for tokens.
        attend_len: the cache slots attention reads (twincache.buckets.step_attend_len), None = all of them.
        Returns logits [B, S, V], or of the last `logits_to_keep` tokens only (a prefill needs the last one), and
        the new cache."""
        embed, dtype = self.model.embed_tokens.weight[...], self.dtype
        if not isinstance(input_ids, jax.core.Tracer):
            cache_checks.check_cache_type(cache, StaticCache, "jax_cache", cache_checks.cache_hint("jax_cache"))
            self.check_inputs(input_ids, positions, attention_mask)
            check_count("logits_to_keep", logits_to_keep)  # 0: every position's logits
            cache.check_forward(self.config, input_ids, dtype, self.device)
        query_valid = jnp.ones_like(input_ids, dtype=bool) if attention_mask is None else attention_mask.astype(bool)
        new_positions = jnp.where(query_valid, positions, -1).astype(jnp.int32)  # [B, S]; padding is never a key
        key_positions = cache.attended_positions(new_positions, attend_len)  # [B, Lkv]
        visible = attention_visibility(positions, key_positions, query_valid, self.config.sliding_window)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        x = self.model.embed_tokens(input_ids).astype(dtype)  # [B, S, hidden]; the table may be stored wider
        for layer_idx, layer in enumerate(self.model.layers):
            x, cache = layer(x, cos, sin, visible, cache, layer_idx)
        if key_positions.shape[1] == cache.cache_len + new_positions.shape[1]:  # the layers read the old slots
            new_positions, = _ordered_after(x, new_positions)  # so written after them, as the K/V: no copy (§7.39)
        cache = cache.advance(new_positions)
        if logits_to_keep:  # [B, S, V] logits of a long chunk would outweigh its attention; most are not needed
            x = x[:, -logits_to_keep:]  # [B, K, hidden]
        x = self.model.norm(x)
        head = embed if self.lm_head is None else self.lm_head.weight[...]
        return project(x, head), cache  # [B, S or K, V]

    def check_inputs(self, input_ids: jax.Array | np.ndarray, positions: jax.Array | np.ndarray,
                     attention_mask: jax.Array | np.ndarray | None, mask_checked: bool = False) -> None:
        """Checks of ids, positions and mask before dispatch (they read values, so they wait for the device).
        `mask_checked`: the caller validated the mask already (prefill, as a whole prompt), so its values are not
        read again."""
        for name, array in (("input_ids", input_ids), ("positions", positions), ("attention_mask", attention_mask)):
            if not isinstance(array, (jax.Array, np.ndarray)) and (array is not None or name != "attention_mask"):
                raise InputError(f"{name} must be a [batch, seq_len] jax or numpy array, not {type(array).__name__}")
        if input_ids.ndim != 2 or 0 in input_ids.shape:
            raise InputError(f"input_ids has shape {list(input_ids.shape)}; expected [batch >= 1, seq_len >= 1]")
        for name, array in (("input_ids", input_ids), ("positions", positions)):
            if array.dtype not in (jnp.int32, jnp.int64):
                raise InputError(f"{name} dtype {array.dtype} must be int32 or int64 (whole token ids and positions)")
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        for name, array in (("positions", positions), ("attention_mask", attention_mask)):
            if array is not None and tuple(array.shape) != tuple(input_ids.shape):
                raise InputError(f"{name} has shape {list(array.shape)} but input_ids has "
                                 f"{list(input_ids.shape)}; they must match")
        if attention_mask is not None and not mask_checked:  # 0/1, left-padded; a chunk may be all padding in a row
            validate_attention_mask(np.asarray(attention_mask), tuple(input_ids.shape), whole_prompt=False)
        positions = np.asarray(positions)  # as given: an int64 position past int32 must not wrap on the way in
        valid = positions if attention_mask is None else positions[np.asarray(attention_mask).astype(bool)]
        if valid.size and (int(valid.min()) < 0 or int(valid.max()) > INT32_MAX):
            bad = int(valid.min()) if int(valid.min()) < 0 else int(valid.max())
            raise InputError(f"positions of real tokens must be in [0, {INT32_MAX}] (int32), got {bad}")

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (of activations, logits and the cache): the norms' weights keep it, while matrices may
        be stored wider (stored_dtype)."""
        return self.model.norm.weight[...].dtype

    @property
    def device(self) -> str:
        """The device(s) holding the weights, labelled as jax_cache.cache.device_label does."""
        return device_label(self.model.embed_tokens.weight[...])

    @classmethod
    def from_weights(cls, config: MistralConfig, weights: dict[str, jax.Array], mesh: Mesh | None = None) -> Mistral:
        """Build a model from HF-named arrays (no copy of the arrays themselves, but for the half-precision ones
        stored_dtype widens on CPU, when the host has the memory for them), or place them on `mesh`."""
        check_weight_arrays(weights, jax.Array, lambda array: jnp.dtype(array.dtype).name,
                            "pass jax arrays (jnp.asarray(array); a torch_cache model's weights: "
                            "twincache_app.handoff.from_torch)")
        check_weight_shapes(config, {name: tuple(array.shape) for name, array in weights.items()})
        if mesh is not None:
            weights = sharding.shard_weights(config, weights, mesh)
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: cls(config, jnp.float32)))
        stored = {name: stored_dtype(name, array) for name, array in weights.items()}
        widened = [name for name, dtype in stored.items() if dtype != weights[name].dtype]
        free = available_memory(next(iter(weights[widened[0]].devices()))) if widened else None
        if free is not None and sum(2 * weights[name].nbytes for name in widened) > free:
            # The float32 copies would crowd the host: the weights stay as they are (slower, the same sums).
            stored = {name: array.dtype for name, array in weights.items()}
        flat_state = [(".".join(map(str, path)), path, variable)
                      for path, variable in nnx.to_flat_state(abstract_state)]
        flat = []
        for name, path, variable in flat_state:
            array = weights[name]
            flat.append((path, variable.replace(array.astype(stored[name]))))
        model = nnx.merge(graphdef, nnx.from_flat_state(flat))
        model.mesh = mesh
        return model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.float32,
                        mesh: Mesh | None = None) -> Mistral:
        """Load an HF Mistral or Llama checkpoint directory (safetensors only, torch not needed) or a GGUF file,
        converting to `dtype`. GGUF tensors of any type the `gguf` library dequantizes are dequantized, then converted.
        On `mesh`, each device reads only its own slice of every safetensors tensor (as each host would, on many hosts);
        a GGUF is dequantized whole, then placed."""
        _check_model_dtype(dtype)
        if mesh is None and jnp.dtype(dtype) == jnp.float32 and default_device().platform == "cpu":
            gguf = open_gguf(path) if is_gguf_file(path) else None
            config, files = (gguf.config, {}) if gguf is not None else open_checkpoint(path)
            _check_weights_fit(config, dtype)
            return cls.from_weights(config, _read_to_host(config, gguf, files, dtype))
        if is_gguf_file(path):
            checkpoint = open_gguf(path)
            config = checkpoint.config
            if mesh is not None:
                sharding.plan(mesh, config)  # an impossible mesh is refused before anything is read
            _check_weights_fit(config, dtype, mesh)
            weights = {name: jnp.asarray(array, dtype) if mesh is None else
                       jax.device_put(jnp.asarray(array, dtype), sharding.weight_sharding(name, config, mesh))
                       for name, array in checkpoint.arrays()}
            return cls.from_weights(config, weights, mesh)
        config, files = open_checkpoint(path)
        if mesh is not None:
            sharding.plan(mesh, config)  # an impossible mesh is refused before anything is read
        _check_weights_fit(config, dtype, mesh)
        wanted = expected_tensor_shapes(config)
        weights = {}
        for file in sorted(set(files.values())):
            with safe_open(str(file), framework="flax") as f:
                for name in f.keys():
                    if name in wanted and mesh is None:
                        weights[name] = f.get_tensor(name).astype(dtype)
                    elif name in wanted and mesh is not None:
                        tensor = f.get_slice(name)

                        def read(index: tuple[slice, ...] | None, tensor: Any = tensor) -> jax.Array:
                            return tensor[index].astype(dtype)  # the block of the tensor one device holds

                        weights[name] = jax.make_array_from_callback(
                            tuple(tensor.get_shape()), sharding.weight_sharding(name, config, mesh), read)
        return cls.from_weights(config, weights, mesh)


def _check_model_dtype(dtype: object) -> None:
    """An integer dtype built an integer model, float64 without jax_enable_x64 silently a float32 one, and a torch
    dtype raised TypeError: refused here in one line, as the caches refuse theirs."""
    try:
        name = jnp.dtype(cast(Any, dtype)).name
    except TypeError:
        name = None
    if name is None or not jnp.issubdtype(name, jnp.floating):
        raise InputError(f"dtype={dtype!r} must be a floating-point jax dtype, e.g. jnp.float32 or jnp.bfloat16 "
                         "(jax_cache.backend.load takes the name: dtype=\"bfloat16\")")
    if name == "float64" and not jax.config.jax_enable_x64:  # type: ignore[attr-defined, unused-ignore]
        raise InputError("dtype=float64 needs JAX's 64-bit mode, which is off: JAX would build a float32 model; set "
                         "jax.config.update(\"jax_enable_x64\", True) first, or load in float32")


def _check_weights_fit(config: MistralConfig, dtype: jnp.dtype, mesh: Mesh | None = None) -> None:
    """Weights that cannot fit on the default device are refused before anything is read; on `mesh`, each device's
    share, and on CPU all of them together: its simulated devices share the host's memory."""
    devices = [default_device()] if mesh is None else list(mesh.devices.flat)
    share = None if mesh is None else sharding.shard_parameters(config, mesh)
    if share is not None and devices[0].platform == "cpu":
        devices, share = devices[:1], share * len(devices)  # one host's memory holds every device's share
    for device in devices:
        cache_checks.check_weights_fit(config, jnp.dtype(dtype), jnp.dtype(dtype).itemsize, available_memory(device),
                                       memory_label(device), share)


def _read_to_host(config: MistralConfig, gguf: GGUFCheckpoint | None, files: dict[str, Path],
                  dtype: jnp.dtype) -> dict[str, jax.Array]:
    """Every weight of the checkpoint (a GGUF, else safetensors `files`) in `dtype`, copied as it is read into one
    host allocation on 2 MiB pages (host_buffers) that XLA-CPU then reads without a copy, where a decode step streams
    them faster; loading holds the weights once plus one tensor. from_pretrained asks it for float32 only: on CPU
    stored_dtype widens some half-precision weights into XLA's own memory, which would strand their copies here."""
    shapes = expected_tensor_shapes(config)
    buffers = dict(zip(shapes, host_buffers(list(shapes.values()), dtype, prefault=False)))

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        if gguf is not None:
            yield from gguf.arrays()
            return
        for file in sorted(set(files.values())):
            # framework="flax", not "numpy": NumPy has no bfloat16 to read a bf16 checkpoint into
            with safe_open(str(file), framework="flax") as f:
                yield from ((name, np.asarray(f.get_tensor(name).astype(dtype))) for name in f.keys() if name in shapes)

    def write(name: str, array: np.ndarray) -> None:
        buffers[name][...] = array  # converts to dtype as astype would

    fill_weights(config, shapes, tensors(), write)
    # device_put of an aligned host array shares it (and keeps it alive). Unlike from_dlpack it leaves the arrays
    # uncommitted, like every other array a model is made of: a committed weight would commit the first step's
    # outputs, and the cache that step returns would then be another jit signature (a second compile).
    return {name: jax.device_put(buffer) for name, buffer in buffers.items()}


__all__ = ["Linear", "Embedding", "RMSNorm", "rope_cos_sin", "apply_rope",
           "attention_visibility", "Attention", "scaled_dot_product_attention", "MLP", "DecoderLayer", "MistralModel",
           "Mistral"]
