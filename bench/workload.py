"""The one set of weights every implementation runs, and the models built from it.

CPU presets write a seeded random checkpoint directory once (cached under $TWINCACHE_HOME/bench) that torch_cache,
transformers and jax_cache each load with their own loader. The 7b preset builds its bf16 weights on the GPU from a
seeded torch generator and hands the same tensors to transformers (shared storage) and to JAX (DLPack), so 14 GB
never touch the disk. The trained presets load the trained default model's checkpoint directory instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.presets import Preset
from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.default_model import build_once, cache_root, default_weights, write_checkpoint
from twincache_app.hf_loading import transformers_model

_BUILD_VERSION = 1


def checkpoint_dir(config: MistralConfig, seed: int, root: Path | None = None) -> Path:
    """A checkpoint dir of `default_weights(config, seed)`, built once per (config, seed) and reused; as the default
    model is built (`build_once`): under a lock, aside, with the umask's modes, and again when a file was truncated or
    edited since (else every cell of every later run fails on it)."""
    key = json.dumps({"config": dataclasses.asdict(config), "seed": seed, "v": _BUILD_VERSION}, sort_keys=True)
    root = Path(root) if root is not None else cache_root() / "bench"
    final = root / f"mistral-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    return build_once(final, lambda staging: write_checkpoint(staging, config, default_weights(config, seed)), key,
                      f"building the bench's random weights into {final}")


def preset_checkpoint(preset: Preset, root: Path | None = None) -> Path | None:
    """Where a preset's weights come from: its own checkpoint (a trained preset or --model), else its seeded random
    one (built on first use under `root`), or None when they are built on the device instead."""
    if preset.model_dir is not None:
        return preset.model_dir
    return None if preset.weights_on_device else checkpoint_dir(preset.model_config, preset.seed, root)


def device_weights(config: MistralConfig, seed: int, dtype: Any, device: str) -> dict[str, Any]:
    """Seeded random weights generated directly on `device` (no host copy), scaled like `default_weights`."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_tensor_shapes(config).items():
        w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        elif name != "model.embed_tokens.weight":
            w = w / shape[1] ** 0.5  # fan-in scaling keeps activations O(1)
        weights[name] = w.to(dtype)
    return weights


def hf_config(config: MistralConfig, sliding: bool) -> Any:
    """transformers' MistralConfig for this model, with the sliding window on (its sliding layers) or off."""
    from transformers import MistralConfig as HFMistralConfig

    fields = config.to_hf_dict()
    fields["sliding_window"] = config.sliding_window if sliding else None
    return HFMistralConfig(**fields)


class Workload:
    """One set of weights (a checkpoint directory, or tensors built on the device), the models built from it, and the
    prompts; shared by every implementation adapter. The backends' models are built by twincache_app.bench_adapters
    and kept in `models`, one per backend, shared by its modes."""

    def __init__(self, preset: Preset, device: str, cache_dir: Path | None = None, progress: bool = True) -> None:
        self.preset = preset
        self.progress = progress  # transformers' loading bars (off with --no-progress)
        self.config = preset.model_config
        self.dtype_name = preset.dtype
        self.device = device
        self.model_dir = preset_checkpoint(preset, cache_dir)
        self.models: dict[str, Any] = {}
        # A backend mode's caches by (cache kind, batch, length), shared by its adapters: a compiled torch step's CUDA
        # graphs are recorded on the cache buffers' addresses, so another adapter of the same step reuses them
        self.caches: dict[tuple[str, str], dict[tuple[str, int, int], Any]] = {}
        self._weights: dict[str, Any] | None = None
        self._hf_models: dict[bool, Any] = {}

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype_name]

    def prompts(self, batch: int, length: int, salt: int = 0) -> list[list[int]]:
        """Seeded random prompts, the same for every implementation; ids avoid the special tokens 0-2."""
        rng = np.random.default_rng([self.preset.seed, salt, batch, length])
        return rng.integers(3, self.config.vocab_size, size=(batch, length)).tolist()

    def weights(self) -> dict[str, Any]:
        """The weights built on the device (presets with weights_on_device), once: HF-named torch tensors."""
        if self._weights is None:
            self._weights = device_weights(self.config, self.preset.seed, self.torch_dtype, self.device)
        return self._weights

    def hf_model(self, sliding: bool) -> Any:
        """MistralForCausalLM with config.sliding_window = W (sliding) or None. Both share one set of weight tensors."""
        if sliding not in self._hf_models:
            import torch
            from transformers import MistralForCausalLM

            config = hf_config(self.config, sliding)
            if self.model_dir is not None and not self._hf_models:
                model = transformers_model(self.model_dir, self.torch_dtype, config,
                                           progress=self.progress).to(self.device)
            else:  # share the tensors already loaded (transformers' own or, for 7b, the device weights)
                state = next(iter(self._hf_models.values())).state_dict() if self._hf_models else self.weights()
                with torch.device(self.device):  # its random init is replaced (and freed) by the assign below
                    model = MistralForCausalLM._from_config(config, dtype=self.torch_dtype)
                model.load_state_dict(state, strict=True, assign=True)
            self._hf_models[sliding] = model.eval().requires_grad_(False)
        return self._hf_models[sliding]
