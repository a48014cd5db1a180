"""The embedded default model: a tiny random Mistral checkpoint in full HF layout, built from a seed on first use.

Built into `$TWINCACHE_HOME` (default `~/.cache/twincache`) through a temporary directory and one atomic rename,
so a directory under the final name is always complete. transformers' `MistralForCausalLM.from_pretrained` loads it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.storage import writable_directory

DEFAULT_SEED = 1234
BUILD_VERSION = 2
_COMPLETE_STAMP = ".twincache-complete"
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

# Byte-level tokenizer (3 specials + 256 bytes), so the vocabulary is exactly 259.
DEFAULT_CONFIG = MistralConfig(
    vocab_size=len(_SPECIAL_TOKENS) + 256,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    sliding_window=32,  # small, so a default run (prompt + 64 new tokens) wraps the window
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


def cache_root() -> Path:
    return Path(os.environ.get("TWINCACHE_HOME") or Path.home() / ".cache" / "twincache")


def default_model_dir(seed: int = DEFAULT_SEED) -> Path:
    """The default checkpoint directory, built first if it is absent or incomplete."""
    final = cache_root() / f"default-mistral-v{BUILD_VERSION}-seed{seed}"
    if (final / _COMPLETE_STAMP).is_file():
        return final
    writable_directory(final.parent, "the default-model directory (TWINCACHE_HOME)",
                       "point TWINCACHE_HOME at a writable directory, or pass --model")
    # Concurrent first runs take turns: the one that waited finds the other's complete build and uses it, instead of
    # treating it as incomplete and deleting it while its builder reads from it.
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / _COMPLETE_STAMP).is_file():
            return final
        return build_default_model(final, seed)


def default_weights(config: MistralConfig, seed: int, quiet_token_ids: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """Seeded fp32 weights scaled so activations and logits are O(1): greedy margins are clear, not near-ties.

    The lm_head rows of `quiet_token_ids` are shrunk, so those tokens rarely win: the default model uses it to prefer
    printable ASCII over raw bytes that would decode to mojibake.
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            fan_in = shape[1]
            weights[name] = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    if quiet_token_ids and "lm_head.weight" in weights:
        weights["lm_head.weight"][list(quiet_token_ids)] *= 0.2
    return weights


def _non_printable_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Byte tokens other than printable ASCII, space and newline (special tokens excluded)."""
    printable: set[int] = set()
    for text in [chr(c) for c in range(32, 127)] + ["\n"]:
        printable.update(tokenizer.encode(text, add_special_tokens=False).ids)
    return tuple(i for i in range(len(_SPECIAL_TOKENS), tokenizer.get_vocab_size()) if i not in printable)


def byte_level_tokenizer() -> Tokenizer:
    """A deterministic byte-level tokenizer: no training, ids 0-2 special, 3-258 the 256 byte symbols."""
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(_SPECIAL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def write_checkpoint(directory: Path, config: MistralConfig, weights: dict[str, np.ndarray]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def build_default_model(final: Path, seed: int = DEFAULT_SEED) -> Path:
    """Build into a temporary sibling, then rename into place; a failure leaves nothing under the final name."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(final.parent)
    if final.exists():  # present but without the stamp: an interrupted or tampered build; never trust it
        shutil.rmtree(final)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
    try:
        tokenizer = byte_level_tokenizer()
        write_checkpoint(staging, DEFAULT_CONFIG, default_weights(DEFAULT_CONFIG, seed, _non_printable_ids(tokenizer)))
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / _COMPLETE_STAMP).write_text(f"seed={seed} version={BUILD_VERSION}\n")
        try:
            os.rename(staging, final)
        except OSError:  # another process finished first; its build is identical
            if not (final / _COMPLETE_STAMP).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _remove_stale_builds(parent: Path, max_age_s: float = 3600.0) -> None:
    for leftover in parent.glob(".building-*"):
        if time.time() - leftover.stat().st_mtime > max_age_s:
            shutil.rmtree(leftover, ignore_errors=True)
