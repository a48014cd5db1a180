"""Checkpoint directories: find and validate safetensors files, and the tensors a Mistral checkpoint must hold.

Framework-neutral: each backend opens the files this module validated with safetensors' own loader.
Pickled `.bin` weights are never opened.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from safetensors import SafetensorError, safe_open

from twincache.config import MistralConfig
from twincache.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100_000_000


def load_config(model_dir: str | Path) -> MistralConfig:
    """The config of a checkpoint directory, after checking that the directory exists."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"checkpoint directory {model_dir} has no config.json")
    return MistralConfig.from_json(model_dir / "config.json")


def expected_tensor_shapes(config: MistralConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Mistral checkpoint; both backends name their parameters the same way."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (q_width, hidden),
            prefix + "self_attn.k_proj.weight": (kv_width, hidden),
            prefix + "self_attn.v_proj.weight": (kv_width, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_width),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse a safetensors header and check that the file holds every byte the header promises."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is truncated: {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path} is corrupted or truncated: header claims {header_len} bytes "
                                      f"but the file has {size}")
            header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is corrupted: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is corrupted: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        data_end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise CheckpointError(f"{path} is corrupted: its safetensors header has a tensor entry without valid "
                              "data_offsets") from None
    if 8 + header_len + data_end > size:
        raise CheckpointError(f"{path} is truncated: tensors need {8 + header_len + data_end} bytes "
                              f"but the file has {size}; re-download or re-save the checkpoint")
    try:  # safetensors' own header validation (dtypes, shapes vs offsets, no gaps) before any backend loads it
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as err:
        reason = " ".join(str(err).split())
        raise CheckpointError(f"{path} is corrupted: safetensors rejects its header ({reason})") from None
    return header


def tensor_files(model_dir: str | Path) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Each tensor's validated safetensors file and stored shape (one file, or shards with an index)."""
    model_dir = Path(model_dir)
    index_path, single_path = model_dir / INDEX_FILE, model_dir / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path} is not a valid safetensors index (no 'weight_map')") from None
        shard_names = sorted(set(weight_map.values()))
    elif single_path.is_file():
        shard_names = [SINGLE_FILE]
    else:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        if pickled:
            raise CheckpointError(
                f"{model_dir} holds only pickled weights ({', '.join(pickled)}); twincache never unpickles. "
                "Convert once with transformers: MistralForCausalLM.from_pretrained(dir)"
                ".save_pretrained(dir, safe_serialization=True)")
        raise CheckpointError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}")
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shard_names:
        shard_path = model_dir / shard
        if not shard_path.is_file():
            raise CheckpointError(f"shard {shard} named in {INDEX_FILE} is missing from {model_dir}")
        for name, entry in read_safetensors_header(shard_path).items():
            files[name], shapes[name] = shard_path, tuple(entry["shape"])
    return files, shapes


def check_tensor_shapes(config: MistralConfig, stored: dict[str, tuple[int, ...]], model_dir: str | Path) -> None:
    """Refuse a checkpoint that lacks a tensor or holds one of the wrong shape, naming it."""
    for name, shape in expected_tensor_shapes(config).items():
        if name not in stored:
            raise CheckpointError(f"checkpoint {model_dir} is missing tensor {name} (expected shape {list(shape)})")
        if tuple(stored[name]) != shape:
            raise CheckpointError(f"checkpoint {model_dir} tensor {name} has shape {list(stored[name])}, "
                                  f"but config.json implies {list(shape)}")


def open_checkpoint(model_dir: str | Path) -> tuple[MistralConfig, dict[str, Path]]:
    """Config plus the validated name -> file map of a checkpoint; raises CheckpointError/ConfigError otherwise."""
    config = load_config(model_dir)
    files, shapes = tensor_files(model_dir)
    check_tensor_shapes(config, shapes, model_dir)
    return config, files
