"""Tokenizer: a checkpoint's tokenizer.json through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from twincache.errors import CheckpointError, InputError


class Tokenizer:
    """Encodes text to ids (with the checkpoint's own special-token template) and decodes ids to text."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            self._tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{path} is not a readable tokenizer.json ({err})") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir} has no tokenizer.json; pass token ids with --prompt-ids instead")
        return cls(path)

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text).ids
        if not ids:
            raise InputError("the prompt encodes to zero tokens; give a non-empty prompt")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class StreamDecoder:
    """Turns a growing list of ids into text deltas, holding back bytes that are not yet a whole character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._emitted = text[self._emitted:], len(text)
        return delta

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        delta, self._emitted = text[self._emitted:], len(text)
        return delta
