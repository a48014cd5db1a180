"""GGUF files (llama.cpp's one-file checkpoints) read as HF Mistral checkpoints: config, weights and tokenizer.

llama.cpp's own Python package `gguf` parses the file and dequantizes every tensor type it knows (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_x, the K-quants, the IQ types...); this module only reads the metadata into a `MistralConfig`,
renames llama.cpp's tensors to HF names, and undoes the row order llama.cpp gives Q and K for its RoPE layout. The
architectures read are `llama` (which is how llama.cpp writes Mistral models) and `mistral`.

Everything is validated when the file is opened, before any weight is dequantized: a truncated file, another
architecture, an unsupported tensor type, metadata that disagrees with a tensor's shape, or a missing tensor raises a
one-line `CheckpointError`/`ConfigError`, so nothing is half-built. `gguf` is imported only here, when a GGUF is read.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.errors import CheckpointError, ConfigError

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "mistral")
# Metadata arrays that are large and only the tokenizer needs: read on demand, not with the rest.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores")

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# The metadata key each config field comes from (after `<arch>.`, or whole for tokenizer.*): MistralConfig's own
# checks name the field, a GGUF's reader knows the key.
_CONFIG_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length",
                "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
                "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
                "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
                "rope_theta": "rope.freq_base", "sliding_window": "attention.sliding_window",
                "max_position_embeddings": "context_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
                "eos_token_id": "tokenizer.ggml.eos_token_id", "pad_token_id": "tokenizer.ggml.padding_token_id"}


def is_gguf_file(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic (whatever its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The HF Mistral name of a llama.cpp tensor name, or None when a Mistral model has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and int(match[1]) < num_layers and match[2] in _LAYER_NAMES:
        return f"model.layers.{int(match[1])}.{_LAYER_NAMES[match[2]]}.weight"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. [heads * head_dim, in] -> the same shape.

    llama.cpp's converter reorders each head's rows from the rotate-half layout (HF: row i pairs with row i + D/2)
    to the interleaved one (row 2i pairs with 2i + 1), so its RoPE rotates adjacent pairs. Within a head, converted
    row 2i + j is HF row j * D/2 + i; putting the rows back lets our rotate-half RoPE compute the same attention.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    interleaved = weight.reshape(num_heads, head_dim // 2, 2, cols)  # [H, D/2 (i), 2 (j), in]
    return interleaved.swapaxes(1, 2).reshape(rows, cols)  # [H, 2 (j), D/2 (i), in] -> HF rows j * D/2 + i


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A validated GGUF: its config, each HF-named tensor's reader entry, and the scalar metadata."""

    path: Path
    config: MistralConfig
    metadata: dict[str, Any]  # every field but the large tokenizer arrays
    tensors: dict[str, Any]  # HF name -> gguf.ReaderTensor
    reader: Any  # gguf.GGUFReader (memory-maps the file)

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array in HF layout), one tensor at a time: dequantized by `gguf`, Q/K rows restored."""
        from gguf import quants

        expected = expected_tensor_shapes(self.config)
        for name, tensor in self.tensors.items():
            array = quants.dequantize(tensor.data, tensor.tensor_type).reshape(expected[name])
            if name.endswith("self_attn.q_proj.weight"):
                array = unpermute_rope_rows(array, self.config.num_attention_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                array = unpermute_rope_rows(array, self.config.num_key_value_heads)
            if not array.flags.writeable:  # an F32 tensor is a view of the read-only memory map
                array = array.copy()
            yield name, array

    def metadata_array(self, key: str) -> list | None:
        """One of the large metadata arrays (TOKENIZER_ARRAYS), or None when the file has none."""
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    @property
    def tensor_types(self) -> dict[str, str]:
        """HF name -> the GGUF tensor type's name (F32, Q4_1, ...)."""
        return {name: tensor.tensor_type.name for name, tensor in self.tensors.items()}


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and validate a GGUF; raises CheckpointError/ConfigError with one line otherwise.

    Parsing a GGUF's metadata takes seconds (the gguf reader walks its whole vocabulary), so the last few files
    opened are kept: the CLI reads the config, the weights and the tokenizer from one parse.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _open_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFCheckpoint:
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"reading {path} needs the 'gguf' package (pip install gguf), which is missing here; "
                              "or convert the GGUF to a safetensors checkpoint directory elsewhere") from None
    if not is_gguf_file(path):
        raise CheckpointError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointError(f"{path} is truncated or corrupted: the gguf reader fails on it ({reason}); "
                              "re-download the file") from None
    if reader.byte_order != "I":  # gguf parses the metadata of either order, but dequantizes in the host's only
        raise CheckpointError(f"{path} is a {reader.endianess.name.lower()}-endian GGUF but this host is "
                              f"{sys.byteorder}-endian, and gguf dequantizes tensors in the host's byte order only; "
                              "convert the model again for this host (llama.cpp's convert_hf_to_gguf.py writes "
                              "big-endian files only with --bigendian)")
    data_end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if data_end > size:
        raise CheckpointError(f"{path} is truncated: its tensors need {data_end} bytes but the file has {size}; "
                              "re-download the file")
    metadata = {name: field.contents() for name, field in reader.fields.items() if name not in TOKENIZER_ARRAYS}
    config = config_from_metadata(metadata, path, {t.name for t in reader.tensors},
                                  _vocab_size_hint(reader))
    tensors = _map_tensors(reader, config, path)
    _check_tensor_types(tensors, path)
    return GGUFCheckpoint(path, config, metadata, tensors, reader)


def _vocab_size_hint(reader: Any) -> int | None:
    """The vocabulary size from the tokenizer's token list, for files without `<arch>.vocab_size`."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return len(tokens.data) if tokens is not None else None


def config_from_metadata(metadata: dict[str, Any], path: Path, tensor_names: set[str],
                         vocab_size_hint: int | None = None) -> MistralConfig:
    """A MistralConfig from llama.cpp's metadata keys; refuses, naming the key, what twincache cannot compute."""
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ConfigError(f"{path} lacks the metadata key general.architecture, which names the model a GGUF holds; "
                          f"twincache reads GGUF architectures {' and '.join(ARCHITECTURES)}: write the key with "
                          "the gguf library, or convert the model again with llama.cpp's convert_hf_to_gguf.py")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path} holds a {arch!r} model; twincache reads GGUF architectures "
                          f"{' and '.join(ARCHITECTURES)} only")

    def get(key: str, default: Any = None, required: bool = False, number: bool = True) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if required and value is None:
            raise CheckpointError(f"{path} lacks the GGUF metadata key {arch}.{key}, which llama.cpp needs too; "
                                  "convert the model again with llama.cpp's convert_hf_to_gguf.py, which writes it")
        if isinstance(value, list):
            raise ConfigError(f"{path} gives {arch}.{key} per layer ({value[:4]}...); twincache supports one value "
                              "for every layer")
        if number and isinstance(value, (str, bool)):  # arithmetic and float() below would fail without the key
            raise ConfigError(f"{path} gives {arch}.{key}={value!r}, a {type(value).__name__}, where llama.cpp "
                              "writes a number; rewrite the key as one (gguf's gguf_set_metadata.py) or convert the "
                              "model again")
        return value

    scaling = get("rope.scaling.type", number=False)
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise ConfigError(f"{path} uses RoPE scaling ({scaling or 'rope_freqs.weight factors'}); twincache "
                          "implements plain RoPE only")
    if get("expert_count", 0):
        raise ConfigError(f"{path} is a mixture of experts ({arch}.expert_count={get('expert_count')}); twincache "
                          "implements dense Mistral models only")
    hidden, heads = get("embedding_length", required=True), get("attention.head_count", required=True)
    head_dim = get("attention.key_length") or (hidden // heads if heads else 0)
    for key in ("attention.value_length", "rope.dimension_count"):
        if get(key) not in (None, head_dim):
            raise ConfigError(f"{path} has {arch}.{key}={get(key)} but a head_dim of {head_dim}; twincache needs "
                              "them equal (full-width rotary embeddings)")
    vocab_size = get("vocab_size") or vocab_size_hint
    if vocab_size is None:
        raise CheckpointError(f"{path} states no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens); "
                              "convert the model again with llama.cpp's convert_hf_to_gguf.py, which writes both")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", required=True),
        num_hidden_layers=get("block_count", required=True),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        sliding_window=get("attention.sliding_window"),
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )
    try:
        return MistralConfig(**fields)
    except ConfigError as err:  # it names a config.json field, which a GGUF has none of: name the key as well
        keys = [key if key.startswith("tokenizer.") else f"{arch}.{key}" for field, key in _CONFIG_KEYS.items()
                if re.search(rf"\b{field}\b", str(err))]
        source = f"the GGUF metadata key {' and '.join(keys)}" if keys else "its GGUF metadata"
        raise ConfigError(f"{path}: {err}, from {source}; rewrite it (gguf's gguf_set_metadata.py) or convert the "
                          "model again") from None


def _map_tensors(reader: Any, config: MistralConfig, path: Path) -> dict[str, Any]:
    """HF name -> reader tensor, after checking every tensor is one a Mistral model has, in the shape it needs."""
    expected = expected_tensor_shapes(config)
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, config.num_hidden_layers)
        if name is None or name not in expected:
            raise CheckpointError(f"{path} holds tensor {tensor.name}, which a Mistral model of its metadata does "
                                  "not have (biases, extra layers or another architecture); twincache cannot "
                                  "compute it")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if shape != expected[name]:
            raise CheckpointError(f"{path} tensor {tensor.name} ({name}) has shape {list(shape)}, but the GGUF "
                                  f"metadata implies {list(expected[name])}")
        tensors[name] = tensor
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path} is missing tensor {name} (llama.cpp name "
                                  f"{_gguf_name(name)}, expected shape {list(shape)})")
    return tensors


def _gguf_name(hf: str) -> str:
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf:
            return gguf_name
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    short = next(k for k, v in _LAYER_NAMES.items() if rest == f"{v}.weight")
    return f"blk.{layer}.{short}.weight"


def _check_tensor_types(tensors: dict[str, Any], path: Path) -> None:
    """Ask `gguf` to dequantize one row of each tensor type present, so an unsupported type fails before loading."""
    from gguf import quants

    seen = set()
    for name, tensor in tensors.items():
        if tensor.tensor_type in seen:
            continue
        seen.add(tensor.tensor_type)
        try:
            quants.dequantize(tensor.data.reshape(-1, tensor.data.shape[-1])[:1], tensor.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{path} tensor {tensor.name} ({name}) has type {tensor.tensor_type.name}, which "
                                  "the gguf library cannot dequantize; use a GGUF quantized to a supported type "
                                  "(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quants, IQ types)") from None
