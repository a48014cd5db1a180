"""transformers' MistralForCausalLM of any checkpoint twincache reads: the reference that parity and bench compare
against. A GGUF goes through transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`: its metadata
mapping, tensor names, dequantization and Q/K row order, none of ours; it needs gguf and accelerate), then into a
MistralForCausalLM, so a window that twincache gives the model applies there too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twincache.checkpoint import load_config
from twincache.gguf_checkpoint import is_gguf_file


def transformers_model(path: str | Path, dtype: Any, hf_config: Any = None,
                       attn_implementation: str | None = None) -> Any:
    """MistralForCausalLM of a checkpoint directory or GGUF file in `dtype` (a torch dtype), on the CPU, with
    `hf_config` (a transformers MistralConfig) instead of the checkpoint's own when given, and transformers' default
    attention unless `attn_implementation` names one."""
    from transformers import AutoModelForCausalLM, MistralForCausalLM
    from transformers import MistralConfig as HFMistralConfig

    path = Path(path)
    if not is_gguf_file(path):
        return MistralForCausalLM.from_pretrained(path, config=hf_config, dtype=dtype,
                                                  attn_implementation=attn_implementation)
    try:  # newer transformers may keep GGUF weights packed and compute in fp32; the reference must be dense in dtype
        from transformers import GgufConfig

        packing = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older transformers always dequantizes
        packing = {}
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **packing)
    config = hf_config if hf_config is not None else HFMistralConfig(**load_config(path).to_hf_dict())
    # its random init is replaced by the assign below
    model = MistralForCausalLM._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    return model


__all__ = ["transformers_model"]
