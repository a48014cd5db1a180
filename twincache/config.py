"""`MistralConfig`: the frozen subset of an HF Mistral config.json that both backends compute exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from twincache.errors import ConfigError

# Keys that change the computation in ways twincache does not implement. A non-default value is refused.
_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "rope_scaling": None,
    "quantization_config": None,
    "attention_bias": False,
    "mlp_bias": False,
}


@dataclasses.dataclass(frozen=True)
class MistralConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sliding_window: int | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it to be")
        if self.head_dim % 2:
            raise ConfigError(f"config head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ConfigError(f"config sliding_window={self.sliding_window!r} must be a positive integer or null")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(f"config rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"config {name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MistralConfig:
        """Read an HF config dict; refuse, naming the field, anything not computed exactly."""
        model_type = raw.get("model_type")
        if model_type != "mistral":
            raise ConfigError(f"config model_type={model_type!r} is not supported; twincache implements 'mistral' only")
        for key, default in _UNSUPPORTED_IF_SET.items():
            if raw.get(key, default) not in (default, {}):
                raise ConfigError(f"config field {key}={raw[key]!r} is not supported; only {key}={default!r} is")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config field hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
        rope_theta = raw.get("rope_theta")
        rope_parameters = raw.get("rope_parameters")
        if rope_parameters is not None:
            extra = {k: v for k, v in rope_parameters.items() if k not in ("rope_theta", "rope_type")}
            if rope_parameters.get("rope_type", "default") != "default" or extra:
                raise ConfigError(f"config field rope_parameters={rope_parameters!r} is not supported; "
                                  "only rope_type 'default' (plain RoPE, no scaling) is")
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
        eos = raw.get("eos_token_id", 2)
        if isinstance(eos, list):
            if len(eos) != 1:
                raise ConfigError(f"config field eos_token_id={eos!r} lists several ids; twincache supports one")
            eos = eos[0]
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=hidden,
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or hidden // heads,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                sliding_window=raw.get("sliding_window"),
                max_position_embeddings=raw.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos,
                pad_token_id=raw.get("pad_token_id"),
            )
        except KeyError as missing:
            raise ConfigError(f"config.json lacks the required field {missing.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> MistralConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist; a checkpoint directory needs an HF config.json") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers' MistralForCausalLM reads back to the same model."""
        fields = dataclasses.asdict(self)
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                "attention_dropout": 0.0, **fields}
