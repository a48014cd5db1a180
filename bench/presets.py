"""Benchmark presets: the model shape, the workload, and which implementations and curves each one runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from twincache.config import MistralConfig


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    config: MistralConfig | None  # None: the trained default model's, filled in by `resolve`
    dtype: str  # "float32" or "bfloat16", for every implementation
    device: str  # "cpu" or "cuda"
    prompt_len: int
    new_tokens: int
    repeats: int  # timed runs per cell, interleaved across cells; one more untimed warm-up run comes first
    impls: tuple[str, ...]  # run by default (--impls overrides)
    curve_impls: tuple[str, ...]  # latency vs context
    curve_contexts: tuple[int, ...]  # context lengths at which per-token decode latency is sampled
    curve_steps: int  # decode steps timed at each context
    batch_impls: tuple[str, ...]  # tok/s vs batch
    batch_sizes: tuple[int, ...]
    batch_prompt_len: int
    batch_new_tokens: int
    probe_bytes: int  # bandwidth-probe array size; several times the last-level cache
    weights_on_device: bool = False  # build weights in memory on the device instead of a checkpoint dir
    seed: int = 0
    table_cache_len: int | None = None  # static cache slots in the decode table (None: prompt + new tokens)
    trained: bool = False  # run the trained default model (its checkpoint dir) instead of random weights
    model_dir: Path | None = None  # a checkpoint directory or GGUF file, set by `resolve` (trained presets, --model)

    @property
    def model_config(self) -> MistralConfig:
        """The config the preset runs: its own, or the one `resolve` filled in (a trained preset's)."""
        if self.config is None:
            raise ValueError(f"preset {self.name} runs the trained default model: pass it through "
                             "bench.presets.resolve first")
        return self.config


def resolve(preset: Preset, model: Path | None = None, sliding_window: int | None = None) -> Preset:
    """The preset as it runs: on `model` (a checkpoint directory or GGUF file) when given, on the trained default model
    for a trained preset (built first if absent), else on its own random weights; with `sliding_window` instead of the
    model's window when given. A model's EOS is switched off so every run decodes its full budget on random prompts,
    as on random weights."""
    if model is None and preset.trained:
        from twincache.default_model import default_model_dir

        model = default_model_dir()
    if model is not None:
        from twincache.checkpoint import load_config

        config = dataclasses.replace(load_config(model), eos_token_id=None)
        preset = dataclasses.replace(preset, config=config, model_dir=Path(model), weights_on_device=False)
    if sliding_window is not None:
        preset = dataclasses.replace(preset, config=dataclasses.replace(preset.model_config,
                                                                        sliding_window=sliding_window))
    return preset


def _contexts(window: int, longest_multiple: int) -> tuple[int, ...]:
    """Context lengths from ~0 to longest_multiple * W, denser around the window edge."""
    fractions = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
    return tuple(sorted({max(1, int(f * window)) for f in fractions if f <= longest_multiple}))


def _mistral(**fields: Any) -> MistralConfig:
    # eos_token_id=None: random weights would emit EOS at random and end runs early; every run decodes its full budget.
    base = dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768, bos_token_id=1,
                eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    return MistralConfig(**{**base, **fields})


_TINY = _mistral(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=16)
# ~57M parameters: Mistral's proportions (GQA 4:1, head_dim 64) at a size whose decode is bandwidth-bound on a CPU.
_SMALL = _mistral(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, sliding_window=256)
# KV reads dominate: 4 layers of 2 KV heads x head_dim 128 hold 8 KB of K/V per token (134 MB at 16k tokens) beside
# 13 MB of weights, so a step's cost follows the slots its attention reads. Query heads = KV heads keeps the score
# matrix of a 16k-token JAX prefill (which XLA-CPU materialises) at 2 GB per layer.
_LONG = _mistral(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=128, sliding_window=4096)
_MISTRAL_7B = _mistral(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096,
                       rope_theta=10000.0)

def _trained(name: str, dtype: str) -> Preset:
    """The trained default model (SmolLM2-135M-Instruct, 30 layers, window 64) on CPU: prompts past the window."""
    return Preset(
        name=name, config=None, dtype=dtype, device="cpu", prompt_len=100, new_tokens=128, repeats=3,
        impls=("torch_eager", "torch_compiled", "jax_step", "jax_fused", "transformers", "transformers_eager"),
        curve_impls=("torch_eager", "torch_compiled", "jax_step", "transformers", "transformers_eager"),
        curve_contexts=_contexts(64, 8), curve_steps=16,
        batch_impls=("torch_eager", "torch_compiled", "jax_fused", "transformers_eager"),
        batch_sizes=(1, 2, 4, 8), batch_prompt_len=64, batch_new_tokens=32, probe_bytes=1 << 30, trained=True)


# tiny is the CI smoke test (< 40 s on a 2-core CPU): it leaves out the compiled torch implementations (a cold
# torch.compile costs ~30 s there; ask with --impls) and keeps JAX out of the curves, where every new prompt bucket and
# cache shape is another XLA compile. Every adapter still runs in its table.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny", config=_TINY, dtype="float32", device="cpu", prompt_len=24, new_tokens=24, repeats=2,
        impls=("torch_eager", "transformers_eager", "jax_step", "jax_fused"),
        curve_impls=("torch_eager", "transformers_eager"), curve_contexts=(1, 16, 32, 64), curve_steps=4,
        batch_impls=("torch_eager", "transformers_eager"), batch_sizes=(1, 4), batch_prompt_len=8,
        batch_new_tokens=8, probe_bytes=128 << 20),
    "small": Preset(
        name="small", config=_SMALL, dtype="float32", device="cpu", prompt_len=300, new_tokens=256, repeats=3,
        impls=("torch_eager", "torch_compiled", "jax_step", "jax_fused", "transformers", "transformers_eager"),
        curve_impls=("torch_eager", "torch_compiled", "jax_step", "transformers", "transformers_eager"),
        curve_contexts=_contexts(256, 8), curve_steps=16,
        batch_impls=("torch_eager", "torch_compiled", "jax_fused", "transformers_eager"),
        batch_sizes=(1, 2, 4, 8, 16, 32), batch_prompt_len=64, batch_new_tokens=32, probe_bytes=1 << 30),
    # A 16k-slot static cache: the decode table holds a short chat (512 + 256 tokens) in it, the curves go from 64
    # tokens to the full cache; the sliding ring is W = 4096.
    "long": Preset(
        name="long", config=_LONG, dtype="float32", device="cpu", prompt_len=512, new_tokens=256, repeats=3,
        table_cache_len=16384,
        impls=("torch_eager", "torch_compiled", "jax_step", "jax_fused", "transformers", "transformers_eager"),
        curve_impls=("torch_compiled", "jax_step", "transformers"),
        curve_contexts=(64, 256, 1024, 2048, 4096, 8192, 12288, 16366), curve_steps=16,  # 16366 + 18 = 16384 slots
        batch_impls=(), batch_sizes=(), batch_prompt_len=64, batch_new_tokens=32, probe_bytes=1 << 30),
    "7b": Preset(
        name="7b", config=_MISTRAL_7B, dtype="bfloat16", device="cuda", prompt_len=502, new_tokens=128, repeats=3,
        # Warm-up order, so that a deadline (bench/gpu_lease.sh) cuts the least needed: transformers eager first
        # (no compile; some transformers run must precede torch_cache's compiles), then ours compiled, then
        # transformers compiled (the seed's setup).
        # torch_compiled_one_step: torch_compiled's graphs with one step in flight, the A/B of its overlapped loop
        # (design.md §7.31), and its figures if that loop failed on the device; it compiles nothing of its own.
        impls=("transformers_eager", "torch_compiled", "torch_compiled_one_step", "jax_fused", "transformers",
               "jax_step", "torch_eager"),
        # Ordered so that, when gpu_7b.sh's deadline cuts the curves short, torch vs transformers is measured
        # first; JAX compiles one prefill per prompt bucket, so its curve costs the most compile time.
        curve_impls=("torch_compiled", "transformers", "jax_step"), curve_contexts=_contexts(4096, 4),
        curve_steps=16, batch_impls=("torch_compiled", "transformers", "jax_fused"),
        batch_sizes=(1, 2, 4, 8, 16, 32), batch_prompt_len=128, batch_new_tokens=32, probe_bytes=4 << 30,
        weights_on_device=True),
    "trained": _trained("trained", "float32"),
    "trained-bf16": _trained("trained-bf16", "bfloat16"),
}
