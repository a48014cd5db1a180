"""Checkpoint directories: find and validate safetensors files, and the tensors a Mistral checkpoint must hold (a
Llama checkpoint holds the same names and shapes).

Framework-neutral: each backend opens the files this module validated with safetensors' own loader.
Pickled `.bin` weights are never opened.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from twincache.config import MistralConfig
from twincache.errors import CheckpointError
from twincache.generation import DTYPES, NOTICES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
_MAX_HEADER_BYTES = 100_000_000
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


def load_config(path: str | Path) -> MistralConfig:
    """The config of a checkpoint directory (config.json, with the EOS ids of its generation_config.json if it has
    one) or a GGUF file, after checking that the path is one of them."""
    path = Path(path)
    if path.is_file():
        from twincache.gguf_checkpoint import is_gguf_file, open_gguf

        if is_gguf_file(path):
            return open_gguf(path).config
        raise CheckpointError(not_a_checkpoint(path))
    if path.exists() and not path.is_dir():  # a device, a FIFO or a socket: nothing a checkpoint can be
        raise CheckpointError(f"checkpoint {path} is not a regular file or a directory; give an HF Mistral or "
                              "Llama checkpoint directory or a .gguf file")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; give an HF Mistral or Llama checkpoint directory "
                              "or a .gguf file")
    if not (path / "config.json").is_file():
        ggufs = sorted(str(file) for file in path.glob("*.gguf") if file.is_file())
        more = " ..." if len(ggufs) > 3 else ""
        hint = f"; it holds {', '.join(ggufs[:3])}{more}: give a .gguf file's path" if ggufs else ""
        raise CheckpointError(f"checkpoint directory {path} has no config.json{hint}")
    config = MistralConfig.from_json(path / "config.json")
    generation = path / GENERATION_CONFIG
    # transformers' generate stops at this file's EOS ids when the directory has one (a GGUF has none to read)
    return config.with_generation_config(generation) if generation.exists() else config


def not_a_checkpoint(path: Path) -> str:
    """Why a file that is not a GGUF cannot be a checkpoint, naming what it seems to be."""
    with path.open("rb") as f:
        head = f.read(8)
    if path.suffix == ".safetensors":
        what = "a safetensors weight file; give the directory that holds it and its config.json"
    elif path.suffix in (".bin", ".pt", ".pth", ".pkl"):
        what = "a pickled weight file, which twincache never unpickles; convert its checkpoint to safetensors"
    elif path.name == "config.json":
        what = "a config file; give the directory that holds it"
    else:
        what = f"not a GGUF file (it starts with {head[:4]!r}, not {b'GGUF'!r})"
    return f"{path} is a file, {what}; a checkpoint is an HF Mistral or Llama checkpoint directory or a .gguf file"


def _layer_shapes(config: MistralConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name suffix -> shape of one decoder layer (the same for every layer)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    return {
        "self_attn.q_proj.weight": (q_width, hidden),
        "self_attn.k_proj.weight": (kv_width, hidden),
        "self_attn.v_proj.weight": (kv_width, hidden),
        "self_attn.o_proj.weight": (hidden, q_width),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }


def iter_expected_tensor_shapes(config: MistralConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor a Mistral checkpoint holds, in file order, generated lazily: a config
    claiming 10^8 layers costs nothing until its first missing tensor is reached."""
    yield "model.embed_tokens.weight", (config.vocab_size, config.hidden_size)
    layer = _layer_shapes(config)
    for i in range(config.num_hidden_layers):
        for suffix, shape in layer.items():
            yield f"model.layers.{i}.{suffix}", shape
    yield "model.norm.weight", (config.hidden_size,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, config.hidden_size)


def expected_tensor_shapes(config: MistralConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Mistral checkpoint; both backends name their parameters the same way.
    Builds one entry per tensor: call it only for a config already checked against a checkpoint's tensor list."""
    return dict(iter_expected_tensor_shapes(config))


def expected_shape(config: MistralConfig, name: str) -> tuple[int, ...] | None:
    """The shape `name` has in a checkpoint of `config`; None when such a checkpoint holds no tensor of that name."""
    globals_ = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
                "model.norm.weight": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        globals_["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    if name in globals_:
        return globals_[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or int(match[1]) >= config.num_hidden_layers or match[1] != str(int(match[1])):
        return None
    return _layer_shapes(config).get(match[2])


def missing_tensors_error(config: MistralConfig, missing: list[str]) -> CheckpointError:
    """The error for weights that lack tensors `config` needs: how many, the first with its expected shape, and what
    to pass instead."""
    first = missing[0]
    shape = expected_shape(config, first)
    return CheckpointError(f"weights lack {len(missing)} of the {len(expected_tensor_shapes(config))} tensors a "
                           f"{config.num_hidden_layers}-layer Mistral of this config needs, first {first}"
                           + (f" (checkpoint shape {list(shape)})" if shape is not None else "")
                           + "; pass every tensor of a checkpoint saved for this config")


WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # what a from_weights takes, by name


def check_weight_arrays(weights: object, array_type: type, dtype_name: Callable[[Any], str], hint: str) -> None:
    """Refuse weights handed to a tower's `from_weights` that are not a mapping of its framework's arrays
    (`array_type`; `hint` says how to convert) of a floating-point dtype (`dtype_name` reads one's name). numpy
    arrays or the other tower's raised load_state_dict's wall of RuntimeErrors in torch and AttributeError in JAX;
    integer ones built an integer JAX model."""
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"weights must map HF tensor names to arrays, not be a {type(weights).__name__}; {hint}")
    wanted = f"{array_type.__module__.split('.')[0]}.{array_type.__name__.rsplit('.', 1)[-1]}"  # jax.Array's name
    for name, array in weights.items():  # is "jaxlib._jax.Array"
        if not isinstance(array, array_type):
            raise CheckpointError(f"weights tensor {name} is a {type(array).__module__}.{type(array).__name__}, not a "
                                  f"{wanted}; {hint}")
        dtype = dtype_name(array)
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"weights tensor {name} is {dtype}; a model takes floating-point weights "
                                  f"({', '.join(WEIGHT_DTYPES)}): dequantize or convert it first")


def check_weight_shapes(config: MistralConfig, shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse weights handed to a `from_weights` (name -> shape) that lack a tensor `config` needs or hold one of
    another shape, naming it. A checkpoint's own files are checked from their headers (check_tensor_shapes); arrays
    handed over in Python were not, and a misshapen one (e.g. one rank's slice of a model split over a mesh) built a
    model that failed only when run."""
    expected = expected_tensor_shapes(config)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise missing_tensors_error(config, missing)
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"weights tensor {name} has shape {list(shapes[name])}, but a Mistral of this "
                                  f"config needs {list(shape)}; pass the tensors of a checkpoint saved for this config")


def fill_weights(config: MistralConfig, shapes: dict[str, tuple[int, ...]], tensors: Iterable[tuple[str, Any]],
                 write: Callable[[str, Any], object]) -> None:
    """Hand each (name, tensor) a loader reads to `write`, which copies it into the place allocated for it, once the
    tensor is known to have a place of its shape; then check that every place got its tensor. The checkpoint's
    shapes were checked when it was opened, but a copy into a buffer allocated up front would broadcast a wrong shape
    and leave a missing tensor as zeros, so the loaders check again here."""
    filled: set[str] = set()
    for name, tensor in tensors:
        if name not in shapes:
            raise CheckpointError(f"the checkpoint holds tensor {name}, which a {config.num_hidden_layers}-layer "
                                  "Mistral of this config has no place for")
        if tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}; this config needs "
                                  f"{list(shapes[name])}")
        write(name, tensor)
        filled.add(name)
    missing = [name for name in shapes if name not in filled]
    if missing:
        raise missing_tensors_error(config, missing)


def is_ignorable_tensor(name: str) -> bool:
    """Buffers some older checkpoints store that are derived from config.json (transformers skips them too)."""
    return name.endswith(_IGNORABLE_SUFFIXES)


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


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names; integer weights would be cast without a word


def tensor_files(model_dir: str | Path) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Each tensor's validated safetensors file and stored shape (one file, or shards with an index). A directory
    holding both reads the single file, as transformers' from_pretrained does, so that both load the same weights."""
    model_dir = Path(model_dir)
    index_path, single_path = model_dir / INDEX_FILE, model_dir / SINGLE_FILE
    if single_path.is_file():
        shard_names = [SINGLE_FILE]
    elif index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_bytes().decode("utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path} is not a valid safetensors index (no 'weight_map')") from None
        shard_names = _shard_names(weight_map, index_path)
    else:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        if pickled:
            raise CheckpointError(
                f"{model_dir} holds only pickled weights ({', '.join(pickled)}); twincache never unpickles. "
                "Convert once with transformers: AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(dir, safe_serialization=True)")
        raise CheckpointError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}")
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shard_names:
        shard_path = model_dir / shard
        if not shard_path.is_file():
            raise CheckpointError(f"shard {shard} named in {INDEX_FILE} is missing from {model_dir}")
        for name, entry in read_safetensors_header(shard_path).items():
            if entry.get("dtype") not in _FLOAT_DTYPES and not is_ignorable_tensor(name):
                raise CheckpointError(f"tensor {name} in {shard} is stored as {entry.get('dtype')}; twincache reads "
                                      f"floating-point weights ({', '.join(_FLOAT_DTYPES)}): dequantize or convert the "
                                      "checkpoint first (transformers' from_pretrained, then save_pretrained)")
            if name in files:
                raise CheckpointError(f"tensor {name} is stored twice, in {files[name].name} and {shard}; a "
                                      "checkpoint must hold each tensor once")
            files[name], shapes[name] = shard_path, tuple(entry["shape"])
    return files, shapes


def _shard_names(weight_map: object, index_path: Path) -> list[str]:
    """The shard file names of an index's weight_map: plain file names in the checkpoint directory."""
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names, not hold "
                              f"{type(weight_map).__name__}")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: weight_map[{tensor!r}] = {shard!r} is not a shard file name in "
                                  "the checkpoint directory; each value must be a plain file name such as "
                                  "'model-00001-of-00002.safetensors'")
    return sorted(set(weight_map.values()))


def check_tensor_shapes(config: MistralConfig, stored: dict[str, tuple[int, ...]], model_dir: str | Path) -> None:
    """Refuse a checkpoint that lacks a tensor, holds one of the wrong shape, or holds one config.json does not
    describe (extra layers, an lm_head beside tied embeddings), naming it. Runs in time proportional to the
    checkpoint's own tensor list, whatever sizes config.json claims."""
    for name, shape in iter_expected_tensor_shapes(config):
        if name not in stored:
            bare = name.removeprefix("model.")
            hint = (f"; it holds {bare}: a base model's save (MistralModel, LlamaModel), without the 'model.' "
                    "prefix of a ForCausalLM's names. Load it with transformers' AutoModelForCausalLM.from_pretrained "
                    "and save_pretrained it again" if bare != name and bare in stored else "")
            raise CheckpointError(f"checkpoint {model_dir} is missing tensor {name} (expected shape {list(shape)})"
                                  + hint)
        if tuple(stored[name]) != shape:
            raise CheckpointError(f"checkpoint {model_dir} tensor {name} has shape {list(stored[name])}, "
                                  f"but config.json implies {list(shape)}")
    unexpected = sorted(name for name in stored
                        if expected_shape(config, name) is None and not is_ignorable_tensor(name))
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        hint = ("config.json says tie_word_embeddings=true, which uses the embedding as the output head; set it to "
                "false if lm_head.weight is the model's own head" if "lm_head.weight" in unexpected else
                f"config.json describes num_hidden_layers={config.num_hidden_layers}; fix config.json or the "
                "checkpoint so they describe the same model")
        raise CheckpointError(f"checkpoint {model_dir} holds {len(unexpected)} tensor(s) config.json does not "
                              f"describe: {shown}; {hint}")


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def stored_dtype(path: str | Path) -> str:
    """The dtype transformers' from_pretrained(dtype="auto", its default) loads a checkpoint in: config.json's `dtype`
    (`torch_dtype` in older files), else its weights' (the first floating-point tensor of the first file); float32 for
    a GGUF, which transformers dequantizes. Refuses one twincache cannot run (float64), naming what to give instead."""
    path = Path(path)
    load_config(path)  # a GGUF or a checkpoint directory, else the one-line refusal of what the path is
    if path.is_file():
        return "float32"
    raw = json.loads((path / "config.json").read_bytes())
    named = raw.get("dtype", raw.get("torch_dtype"))
    named = named.removeprefix("torch.") if isinstance(named, str) else None
    if named in (*DTYPES, "float64"):
        dtype, source = named, "config.json's dtype"
    else:
        files, _ = tensor_files(path)
        first_file = sorted(set(files.values()))[0]
        header = read_safetensors_header(first_file)
        stored = [header[name]["dtype"] for name in sorted(header) if header[name]["dtype"] in _SAFETENSORS_DTYPES]
        dtype, source = _SAFETENSORS_DTYPES[stored[0]] if stored else "float32", f"the weights in {first_file.name}"
    if dtype not in DTYPES:
        raise CheckpointError(f"{path} is stored in {dtype} ({source}); twincache runs float32, bfloat16 or float16: "
                              "give --dtype float32")
    return dtype


def resolve_dtype(dtype: str, path: str | Path) -> str:
    """A dtype name as given, or for "auto" the checkpoint's stored dtype (stored_dtype)."""
    return stored_dtype(path) if dtype == "auto" else dtype


def open_checkpoint(model_dir: str | Path) -> tuple[MistralConfig, dict[str, Path]]:
    """Config plus the validated name -> file map of a checkpoint directory; raises CheckpointError/ConfigError."""
    config = load_config(model_dir)
    files, shapes = tensor_files(model_dir)
    config, files, shapes = stored_head(config, files, shapes, model_dir)
    check_tensor_shapes(config, shapes, model_dir)
    return config, files


_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def stored_head(config: MistralConfig, files: dict[str, Path], shapes: dict[str, tuple[int, ...]],
                model_dir: str | Path) -> tuple[MistralConfig, dict[str, Path], dict[str, tuple[int, ...]]]:
    """A tied config whose checkpoint also stores lm_head.weight (some exporters write both) loads as transformers
    loads it: a head equal to the embedding stays tied (its copy is dropped from `files` and `shapes`, never read); a
    different one is the model's own head, so the config is untied, with a notice, where transformers warns that it
    will not tie them."""
    if not config.tie_word_embeddings or _HEAD not in files or shapes[_HEAD] != shapes.get(_EMBEDDING):
        return config, files, shapes  # nothing beside the tie, or a head of the wrong shape: check_tensor_shapes says
    if _same_stored_bytes(files[_HEAD], _HEAD, files[_EMBEDDING], _EMBEDDING):
        return (config, {name: path for name, path in files.items() if name != _HEAD},
                {name: shape for name, shape in shapes.items() if name != _HEAD})
    NOTICES.info("%s holds an lm_head.weight that differs from the embedding although config.json says "
                 "tie_word_embeddings=true; using it as the output head, as transformers does (set "
                 "tie_word_embeddings to false in config.json to silence this note)", model_dir)
    return dataclasses.replace(config, tie_word_embeddings=False), files, shapes


def _same_stored_bytes(path_a: Path, name_a: str, path_b: Path, name_b: str) -> bool:
    """Whether two tensors of validated safetensors files are stored with the same dtype and bytes (equal bytes are
    equal values; the reverse only matters for memory, as an untied copy of equal values gives the same logits)."""
    entry_a, entry_b = read_safetensors_header(path_a)[name_a], read_safetensors_header(path_b)[name_b]
    (start_a, end_a), (start_b, end_b) = entry_a["data_offsets"], entry_b["data_offsets"]
    if entry_a["dtype"] != entry_b["dtype"] or end_a - start_a != end_b - start_b:
        return False
    chunk = 1 << 24  # compared a piece at a time: a 7B model's embedding is ~0.5 GB
    with path_a.open("rb") as file_a, path_b.open("rb") as file_b:
        for file, start in ((file_a, start_a), (file_b, start_b)):
            (header_len,) = struct.unpack("<Q", file.read(8))
            file.seek(8 + header_len + start)
        for offset in range(0, end_a - start_a, chunk):
            size = min(chunk, end_a - start_a - offset)  # never into the next tensor's bytes
            if file_a.read(size) != file_b.read(size):
                return False
    return True
