"""A `tokenizers` tokenizer built from a GGUF's metadata: the vocabulary, merges and special tokens llama.cpp stores.

Two tokenizer models cover llama and mistral GGUFs:
- `gpt2`: byte-level BPE (SmolLM, Llama 3, Mistral Nemo). The text is split by the regular expressions llama.cpp
  uses for the file's `tokenizer.ggml.pre` type, then BPE runs over the GPT-2 byte alphabet.
- `llama`: SentencePiece BPE (Llama 2, Mistral 7B): spaces become U+2581, unknown characters fall back to byte
  tokens, and merges come from the file or, when it has none, from the token scores.
Tokens the file marks as control (type 3) are special tokens, matched whole and skipped when decoding; user-defined
ones (type 4) are matched whole and kept. BOS/EOS are added as `tokenizer.ggml.add_bos_token`/`add_eos_token` say.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from twincache.errors import CheckpointError

_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's split expressions per `tokenizer.ggml.pre` (llama-vocab.cpp), each applied to the previous one's pieces.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),
}


def tokenizer_from_gguf(metadata: dict[str, Any], arrays: dict[str, list | None], source: str) -> Tokenizer:
    """The tokenizer a GGUF describes. `arrays` holds the large metadata arrays (tokens, merges, token_type, scores)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = arrays.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise CheckpointError(f"{source} has no tokenizer in its metadata; pass token ids with --prompt-ids instead")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, arrays, metadata, source)
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(tokens, arrays, metadata)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise CheckpointError(f"{source} has a {kind!r} tokenizer; twincache builds 'gpt2' (byte-level BPE) and "
                              "'llama' (SentencePiece BPE) tokenizers only; pass token ids with --prompt-ids instead")
    _add_marked_tokens(tokenizer, tokens, arrays.get("tokenizer.ggml.token_type") or [])
    tokenizer.post_processor = _bos_eos_template(tokens, metadata, add_bos_default, source)
    return tokenizer


def _byte_level_bpe(tokens: list[str], arrays: dict[str, list | None], metadata: dict[str, Any],
                    source: str) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(f"{source} uses the pre-tokenizer {pre!r}, whose text splitting twincache does not "
                              f"know (known: {', '.join(PRE_TOKENIZER_SPLITS)}); pass token ids with --prompt-ids")
    merges = [tuple(m.split(" ", 1)) for m in arrays.get("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    splits = [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str], arrays: dict[str, list | None], metadata: dict[str, Any]) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = arrays.get("tokenizer.ggml.merges")
    if merges:
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        merge_pairs = merges_from_scores(tokens, arrays.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, unk_token=unk, byte_fallback=True,
                                     fuse_unk=True))
    add_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), *strip])
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a scored vocabulary (for files that store no merges).

    Every split of a token into two tokens is a merge, ranked by the merged token's score (higher first, as
    SentencePiece merges the best-scoring pair first), then by longer left and right pieces, as transformers ranks them.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, str, str]] = []
    for token, score in zip(tokens, scores):
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = sorted((pair for pair in splits if pair[0] in vocab and pair[1] in vocab),
                        key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in splits)
    ranked.sort(key=lambda item: (item[0], len(item[1]), len(item[2])), reverse=True)  # stable: ties keep order
    return [(left, right) for _, left, right in ranked]


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    control = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if control:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _bos_eos_template(tokens: list[str], metadata: dict[str, Any], add_bos_default: bool,
                      source: str) -> processors.PostProcessor:
    """Prepend BOS / append EOS as the file asks (`tokenizer.ggml.add_bos_token` / `add_eos_token`)."""
    single, special = ["$A"], []
    for key, default, at_end in (("bos", add_bos_default, False), ("eos", False, True)):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None or not metadata.get(f"tokenizer.ggml.add_{key}_token", default):
            continue
        if not 0 <= token_id < len(tokens):  # the model's vocabulary may be larger than the tokenizer's list
            raise CheckpointError(f"{source} asks for tokenizer.ggml.{key}_token_id={token_id} to be added to every "
                                  f"prompt, but its tokenizer.ggml.tokens lists {len(tokens)} tokens (ids 0 to "
                                  f"{len(tokens) - 1}); pass token ids with --prompt-ids instead, or fix the key")
        token = tokens[token_id]
        single = single + [token] if at_end else [token] + single
        special.append((token, token_id))
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
