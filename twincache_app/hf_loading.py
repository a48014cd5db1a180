"""transformers' model of any checkpoint twincache reads: the reference that parity and bench compare against. A
checkpoint directory loads as the class its config.json names (MistralForCausalLM, or LlamaForCausalLM for a Llama:
transformers' own Llama, not ours read as a Mistral), or as the class of the config given instead. A GGUF goes through
transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`: its metadata mapping, tensor names, dequantization
and Q/K row order, none of ours; it needs gguf and accelerate), then into a MistralForCausalLM, so a window that
twincache gives the model applies there too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twincache.checkpoint import load_config
from twincache.gguf_checkpoint import is_gguf_file


@contextlib.contextmanager
def _no_progress_bars(gguf: bool) -> Iterator[None]:
    """transformers' own progress bars off for a load, then as they were: its "Loading weights" one (through its
    logging's tqdm, which disable_progress_bar reaches) and, for a GGUF, its loader's "Converting and de-quantizing
    GGUF tensors" (a plain tqdm, which that switch does not reach)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_utils: Any = None
    if gguf:
        try:
            gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        except ImportError:  # another layout: its bar, if any, shows
            pass
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def transformers_model(path: str | Path, dtype: Any, hf_config: Any = None,
                       attn_implementation: str | None = None, progress: bool = True) -> Any:
    """transformers' causal LM of a checkpoint directory (Mistral or Llama, as its config.json says) or GGUF file
    (MistralForCausalLM) in `dtype` (a torch dtype), on the CPU, with `hf_config` (a transformers MistralConfig, which
    makes it a MistralForCausalLM) instead of the checkpoint's own when given, and transformers' default attention
    unless `attn_implementation` names one; without `progress`, transformers' progress bars stay off."""
    from transformers import AutoModelForCausalLM, MistralForCausalLM
    from transformers import MistralConfig as HFMistralConfig

    path = Path(path)
    gguf = is_gguf_file(path)
    with contextlib.nullcontext() if progress else _no_progress_bars(gguf):
        if not gguf:
            load_config(path)  # twincache's checks first: transformers would load another model_type as well
            return AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=dtype,
                                                        attn_implementation=attn_implementation)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                      **_dequantized())
    config = hf_config if hf_config is not None else HFMistralConfig(**load_config(path).to_hf_dict())
    # its random init is replaced by the assign below
    model = MistralForCausalLM._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    return model


def _dequantized() -> dict[str, Any]:
    """from_pretrained's options that make a GGUF's weights dense in the requested dtype."""
    try:  # newer transformers may keep GGUF weights packed and compute in fp32; the reference must be dense in dtype
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantizes
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


__all__ = ["transformers_model"]
