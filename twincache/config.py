"""`MistralConfig`: the frozen subset of an HF Mistral or Llama config.json that both backends compute exactly.

A Llama (model_type "llama") without RoPE scaling or biases is a Mistral without a sliding window: its config is read
into the same MistralConfig, with transformers' LlamaConfig defaults for absent fields."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from twincache.errors import ConfigError, InputError

INT32_MAX = 2**31 - 1  # positions, cache columns and lengths are int32 in both backends
# What transformers' MistralConfig takes for a config.json field that is absent (not null)
HF_DEFAULT_WINDOW = 4096
HF_DEFAULT_MAX_POSITIONS = 4096 * 32
HF_DEFAULT_KV_HEADS = 8
# ... and its LlamaConfig, where it differs (absent num_key_value_heads: one per query head; no window ever)
HF_LLAMA_DEFAULT_MAX_POSITIONS = 2048
HF_DEFAULT_BOS = 1  # both configs' (null: none)
MODEL_TYPES = ("mistral", "llama")

# Keys that change the computation in ways twincache does not implement. A non-default value is refused.
_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "quantization_config": None,
    "attention_bias": False,
    "mlp_bias": False,
}


_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_TOKEN_FIELDS = ("bos_token_id", "pad_token_id")  # one id or null each; eos_token_id may also list several


def _type_name(value: object) -> str:
    """How a JSON value reads to a user: a string, a boolean, null, a list, ..."""
    names = {str: "a string", bool: "a boolean", type(None): "null", list: "a list", dict: "an object",
             float: "a float"}
    return names.get(type(value), type(value).__name__)


def _integer(name: str, value: object) -> int:
    """A config integer: a JSON integer, never a boolean, float or numeric string."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field {name}={value!r} must be an integer, not {_type_name(value)}")
    return value


def _positive_integer(name: str, value: object) -> int:
    number = _integer(name, value)
    if number <= 0:
        raise ConfigError(f"config field {name}={value!r} must be a positive integer")
    return number


def _positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field {name}={value!r} must be a number, not {_type_name(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"config field {name}={value!r} must be a finite number > 0")
    return float(value)


def check_window_flag(sliding_window: int | None) -> int | None:
    """A `--sliding-window N` flag (generate, parity, soak, bench): None, or a window the config accepts."""
    if sliding_window is not None and not 1 <= sliding_window <= INT32_MAX:
        raise InputError(f"--sliding-window={sliding_window} must be in [1, {INT32_MAX}] (positions are int32; a "
                         "window that long sees every position)")
    return sliding_window


def _read_json(path: Path) -> Any:
    """The JSON value in the file at `path`, or a ConfigError that names the file and what is wrong with it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start}); {path.name} must be UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    except OSError as err:
        raise ConfigError(f"{path} cannot be read ({err.strerror or err}); it must be a readable file") from None


def _eos_ids(ids: list[object], vocab_size: int) -> tuple[int, ...]:
    """A listed eos_token_id: at least one id, each an integer (not a boolean) inside the vocabulary."""
    if not ids:
        raise ConfigError("config field eos_token_id=[] lists no ids; give the id that ends a reply, a list of them, "
                          "or null for no EOS")
    checked: list[int] = []
    for index, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field eos_token_id={ids!r} must list integers; item {index} is "
                              f"{_type_name(value)} ({value!r})")
        if not 0 <= value < vocab_size:
            raise ConfigError(f"config eos_token_id={ids!r} lists {value}, outside the vocabulary [0, {vocab_size}); "
                              "every EOS id must be a token of the model")
        checked.append(value)
    return tuple(checked)


@dataclasses.dataclass(frozen=True)
class MistralConfig:
    """Every field is type-checked on construction: integers are ints (not bools, floats or strings), floats are
    finite numbers, tie_word_embeddings is a bool. A wrong type is a ConfigError naming the field."""

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
    # As transformers reads it: one id, several (a list, kept as a tuple: a row stops at any of them), or None (no
    # EOS). Code that compares with EOS reads `eos_token_ids`.
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            _positive_integer(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):  # an int in JSON (rope_theta: 10000) is the same number
            object.__setattr__(self, name, _positive_number(name, getattr(self, name)))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it to be")
        if self.head_dim % 2:
            raise ConfigError(f"config head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ConfigError(f"config sliding_window={self.sliding_window!r} must be a positive integer or null")
        if self.sliding_window is not None and self.sliding_window > INT32_MAX:
            # The masks compute q - W in int32: a longer window overflowed (JAX) or wrapped (torch).
            raise ConfigError(f"config sliding_window={self.sliding_window} is past {INT32_MAX}, the int32 limit of "
                              "positions; a window that long sees every position: use null (no window)")
        if not isinstance(self.tie_word_embeddings, bool):  # "false" (a string) is truthy: it would tie silently
            raise ConfigError(f"config field tie_word_embeddings={self.tie_word_embeddings!r} must be true or false, "
                              f"not {_type_name(self.tie_word_embeddings)}")
        for name in _TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and not 0 <= _integer(name, value) < self.vocab_size:
                raise ConfigError(f"config {name}={value} is outside the vocabulary [0, {self.vocab_size})")
        if isinstance(self.eos_token_id, (list, tuple)):  # a tuple: the config stays hashable (a jit static argument)
            object.__setattr__(self, "eos_token_id", _eos_ids(list(self.eos_token_id), self.vocab_size))
        elif self.eos_token_id is not None and not 0 <= _integer("eos_token_id", self.eos_token_id) < self.vocab_size:
            raise ConfigError(f"config eos_token_id={self.eos_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size})")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a row, as transformers' generate stops at any of them; () when there is no EOS."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MistralConfig:
        """Read an HF config dict; refuse, naming the field, anything not computed exactly or of the wrong type."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object of fields, not {_type_name(raw)}")
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"config model_type={model_type!r} is not supported; twincache implements 'mistral' and "
                              "'llama' (without RoPE scaling or biases) only")
        # A Llama's pretraining_tp is not read: transformers 5 ignores it (4.x split each projection into that many
        # slices, the same sums in another order)
        llama = model_type == "llama"
        if llama and raw.get("sliding_window") is not None:
            # transformers' LlamaForCausalLM attends to every position in its forward but its generate's DynamicCache
            # keeps only the window (from config.sliding_window): no one model matches both
            raise ConfigError(f"config field sliding_window={raw['sliding_window']!r} is not supported in a "
                              "model_type 'llama' config (transformers' LlamaForCausalLM ignores it in its forward "
                              "but crops its generate cache to it); remove it or set it to null for Llama's full "
                              "attention, or set model_type 'mistral' for a windowed model")
        for key in ("attention_bias", "mlp_bias"):
            if key in raw and not isinstance(raw[key], bool):
                raise ConfigError(f"config field {key}={raw[key]!r} must be true or false, not {_type_name(raw[key])}")
        for key, default in _UNSUPPORTED_IF_SET.items():
            if raw.get(key, default) not in (default, {}):
                raise ConfigError(f"config field {key}={raw[key]!r} is not supported; only {key}={default!r} is")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config field hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
        rope_theta = raw.get("rope_theta")
        # transformers 5 writes rope_parameters, 4.x rope_scaling (null, or {"rope_type"/"type": "default"}): plain
        # RoPE either way; any scaling is refused.
        for field in ("rope_parameters", "rope_scaling"):
            rope = raw.get(field)
            if rope is None:
                continue
            if not isinstance(rope, dict):
                raise ConfigError(f"config field {field}={rope!r} must be an object or null, not {_type_name(rope)}")
            extra = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type", "type")}
            if rope.get("rope_type", rope.get("type", "default")) != "default" or extra:
                raise ConfigError(f"config field {field}={rope!r} is not supported; only rope_type 'default' (plain "
                                  "RoPE, no scaling) is")
            nested = rope.get("rope_theta")
            if nested is not None:
                nested = _positive_number(f"{field}.rope_theta", nested)
                if rope_theta is not None and _positive_number("rope_theta", rope_theta) != nested:
                    raise ConfigError(f"config fields rope_theta={rope_theta!r} and {field}.rope_theta={nested!r} "
                                      "disagree; keep one of them")
                rope_theta = nested
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if name not in raw:
                raise ConfigError(f"config.json lacks the required field {name!r}")
        hidden = _positive_integer("hidden_size", raw["hidden_size"])
        heads = _positive_integer("num_attention_heads", raw["num_attention_heads"])
        if llama and hidden % heads:  # transformers' LlamaConfig refuses it too, even with an explicit head_dim
            raise ConfigError(f"config hidden_size={hidden} is not a multiple of num_attention_heads={heads}; a "
                              "model_type 'llama' config needs it to be (transformers' LlamaConfig refuses it)")

        def optional(name: str, default: Any) -> Any:  # absent or null: HF's default (a JSON value, checked below)
            return default if raw.get(name) is None else raw[name]

        pad_token_id = raw.get("pad_token_id")
        vocab_size = _positive_integer("vocab_size", raw["vocab_size"])
        if isinstance(pad_token_id, int) and not isinstance(pad_token_id, bool) and -vocab_size <= pad_token_id < 0:
            # The original LLaMA conversions write pad_token_id -1 (LlamaConfig's first default). transformers loads
            # it (its embedding counts a negative padding_idx from the end, which changes no output) and never feeds
            # it to the model; twincache only fills masked padding with the pad id: -1 there is no pad id (null)
            pad_token_id = None

        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            # absent: transformers' default, 8 (Mistral-7B's), or for a Llama one per query head; null: one per
            # query head, as transformers reads it
            num_key_value_heads=optional("num_key_value_heads", heads) if "num_key_value_heads" in raw or llama
            else HF_DEFAULT_KV_HEADS,
            head_dim=optional("head_dim", hidden // heads),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            # absent, as in transformers' MistralConfig: a 4,096 window (null: none) and 4096 * 32 positions; as in
            # its LlamaConfig: no window (null, checked above) and 2,048 positions
            sliding_window=None if llama else raw.get("sliding_window", HF_DEFAULT_WINDOW),
            max_position_embeddings=raw.get("max_position_embeddings", HF_LLAMA_DEFAULT_MAX_POSITIONS if llama
                                            else HF_DEFAULT_MAX_POSITIONS),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id", HF_DEFAULT_BOS),
            eos_token_id=raw.get("eos_token_id", 2),
            pad_token_id=pad_token_id,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> MistralConfig:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"{path} does not exist; a checkpoint directory needs an HF config.json")
        return cls.from_dict(_read_json(path))

    def with_generation_config(self, path: str | Path) -> MistralConfig:
        """This config with the EOS ids of a checkpoint's generation_config.json at `path`.

        transformers' `from_pretrained` reads that file, when a directory has one, into the model's generation config,
        and its `generate` stops at that file's eos_token_id, not config.json's: the file may list more ids (an
        instruct model's end-of-turn token), and one without an eos_token_id (or with null) stops nowhere. The file's
        sampling settings are not taken: twincache's own sampling arguments stand (docs/design.md §5)."""
        path = Path(path)
        raw = _read_json(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object of fields, not {_type_name(raw)}")
        try:
            return dataclasses.replace(self, eos_token_id=raw.get("eos_token_id"))
        except ConfigError as err:  # the same checks as config.json's field, naming the file they came from
            raise ConfigError(f"{path}: {err}; fix or remove the file") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers' MistralForCausalLM reads back to the same model (a Llama's too: it is
        written as the Mistral it computes, sliding_window null)."""
        fields = dataclasses.asdict(self)
        if isinstance(self.eos_token_id, tuple):
            fields["eos_token_id"] = list(self.eos_token_id)  # as transformers writes a list of ids
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                "attention_dropout": 0.0, **fields}
