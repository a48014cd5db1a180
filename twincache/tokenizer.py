"""Tokenizer: a checkpoint's tokenizer through the `tokenizers` library, with its chat template and special tokens.

A checkpoint directory gives `tokenizer.json` (and its chat template in `chat_template.jinja` or
`tokenizer_config.json`); a GGUF file gives both in its metadata (see twincache.gguf_tokenizer).

The special tokens (`bos_token`, `eos_token`, `unk_token`, ...) are the ones transformers' tokenizer has, by the
names its `special_tokens_map` gives them, since chat templates read them: from tokenizer_config.json, and from a
legacy special_tokens_map.json (which wins) when the config has no `added_tokens_decoder`, as transformers reads them;
from a GGUF's `tokenizer.ggml.{bos,eos,unknown,padding}_token_id`, as its GGUF loading does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from twincache.errors import CheckpointError, InputError


def has_tokenizer(path: str | Path) -> bool:
    """Whether a checkpoint directory or GGUF file carries a tokenizer."""
    from twincache.gguf_checkpoint import is_gguf_file, open_gguf

    path = Path(path)
    if is_gguf_file(path):
        return "tokenizer.ggml.model" in open_gguf(path).metadata
    return (path / "tokenizer.json").is_file()


# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), in its order
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# a GGUF's token-id key for each special token transformers reads from one
_GGUF_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                           "pad_token": "padding_token_id"}


class Tokenizer:
    """Encodes text to ids (with the checkpoint's own special-token template) and decodes ids to text.

    `special_tokens`: name -> token text, only the tokens the checkpoint names (SPECIAL_TOKEN_NAMES).
    `template_names`: the names of a checkpoint's named chat templates when none is named "default"."""

    def __init__(self, tokenizer: _HFTokenizer, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None, template_names: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.template_names = tuple(template_names)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint directory (its tokenizer.json) or of a GGUF file (its metadata)."""
        from twincache.gguf_checkpoint import is_gguf_file

        path = Path(path)
        return cls._from_gguf(path) if is_gguf_file(path) else cls._from_dir(path)

    @classmethod
    def _from_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            if (model_dir / "tokenizer.model").is_file():  # a SentencePiece model, as older Llama/Mistral saves ship
                raise CheckpointError(
                    f"{model_dir} has no tokenizer.json, only tokenizer.model (SentencePiece), which twincache "
                    "does not read; write tokenizer.json beside it with transformers (pip install sentencepiece, then "
                    "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)), or pass token ids with --prompt-ids")
            raise CheckpointError(f"{model_dir} has no tokenizer.json; pass token ids with --prompt-ids instead")
        try:
            tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{path} is not a readable tokenizer.json ({err}); restore the checkpoint's own "
                                  "file, or remove it and give token ids with --prompt-ids") from None
        settings = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        template = _read_utf8(template_file) if template_file.is_file() else settings.get("chat_template")
        names: list[str] = []
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            names = [str(t.get("name")) for t in template if isinstance(t, dict)]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {name: _token_text(settings.get(name)) for name in SPECIAL_TOKEN_NAMES}
        if "added_tokens_decoder" not in settings:  # transformers' legacy path: the older file's tokens win
            legacy = _read_json(model_dir / "special_tokens_map.json")
            special |= {name: _token_text(legacy[name]) for name in SPECIAL_TOKEN_NAMES if name in legacy}
        return cls(tokenizer, template, {name: token for name, token in special.items() if token is not None},
                   names if template is None else ())

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        from twincache.gguf_checkpoint import TOKENIZER_ARRAYS, open_gguf
        from twincache.gguf_tokenizer import tokenizer_from_gguf

        checkpoint = open_gguf(path)
        metadata = checkpoint.metadata
        arrays = {key: checkpoint.metadata_array(key) for key in TOKENIZER_ARRAYS}
        tokenizer = tokenizer_from_gguf(metadata, arrays, str(path))
        special = {}
        for name, key in _GGUF_SPECIAL_TOKEN_IDS.items():
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            token = None if token_id is None else tokenizer.id_to_token(token_id)
            if token is not None:
                special[name] = token
        return cls(tokenizer, metadata.get("tokenizer.chat_template"), special)

    @property
    def hf_tokenizer(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save as tokenizer.json)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not ids:
            raise InputError("the prompt encodes to zero tokens; give a non-empty prompt")
        return ids

    def chat_prompt(self, prompt: str) -> str:
        """`prompt` as one user message in the checkpoint's chat template, ready for the assistant's reply."""
        from twincache.chat import render_chat

        if self.chat_template is None and self.template_names:  # transformers refuses these too
            raise CheckpointError(f"--chat takes the checkpoint's chat template named 'default', as transformers does, "
                                  f"but tokenizer_config.json names only {', '.join(map(repr, self.template_names))}; "
                                  "save the one to use as chat_template.jinja beside tokenizer.json, or drop --chat")
        if self.chat_template is None:
            raise CheckpointError("--chat needs the checkpoint's chat template, but it has none (no "
                                  "chat_template.jinja, tokenizer_config.json chat_template or GGUF "
                                  "tokenizer.chat_template); drop --chat")
        return render_chat(self.chat_template, [{"role": "user", "content": prompt}], self.special_tokens)

    def encode_chat(self, prompt: str) -> list[int]:
        """Ids of `chat_prompt(prompt)`: the template writes any BOS itself, so none is added (as transformers)."""
        from twincache.chat import FIX_TEMPLATE

        text = self.chat_prompt(prompt)
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:  # the template's doing, whatever the prompt: encode's "give a non-empty prompt" misled
            raise CheckpointError(f"the checkpoint's chat template renders the prompt as {text!r}, which encodes to "
                                  f"zero tokens; {FIX_TEMPLATE}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def _read_utf8(path: Path) -> str:
    """A text file of the checkpoint, as UTF-8 whatever the locale (transformers reads it so; the locale's encoding
    failed on a non-ASCII template under LC_ALL=C with PYTHONUTF8=0, and would turn it into mojibake under latin-1)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                              f"{path.name} must be saved as UTF-8") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_utf8(path))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    return value if isinstance(value, dict) else {}


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with 'content'; None for
    null or anything else."""
    text = token.get("content") if isinstance(token, dict) else token
    return text if isinstance(text, str) else None


class StreamDecoder:
    """Turns a growing list of ids into text deltas whose concatenation (pushes, then flush) is `decode(all ids)`.

    Invariant: the text emitted so far is decode(ids[:end]), where `end` follows a *boundary* token: one whose text
    alone is non-empty (not a skipped special), does not end in U+FFFD (a cut UTF-8 character) and that is not a
    <0xNN> byte-fallback token (ByteFallback decodes a run of them all or nothing). No later id changes the text up
    to a boundary (UTF-8 resynchronizes at the boundary's last character; no byte run spans it), so every delta is
    final. Past it, decode(ids) = decode(ids[:end]) + decode(ids[start:])[len(decode(ids[start:end])):], where
    `start` is the boundary before: the anchor ids[start:end] holds a non-skipped token, so the effects only a
    decode's first token gets (Metaspace drops its "\u2581", Strip(" ", 1) one leading space) stay inside it. Each id
    is decoded a bounded number of times: alone when pushed, then in at most two windows and one anchor.
    `flush` ends the stream: it prints what is held, which later ids could have changed.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._start = 0  # the boundary before `_end` (or 0, the start of the text)
        self._end = 0  # the last boundary: decode(ids[:_end]) is what has been emitted
        self._anchor = ""  # decode(ids[_start:_end])

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit() if self._is_boundary(token_id) else ""

    def flush(self) -> str:
        return self._emit() if len(self._ids) > self._end else ""

    def _is_boundary(self, token_id: int) -> bool:
        text = self._tokenizer.decode([token_id])
        return text != "" and not text.endswith("\ufffd") and not self._is_byte_token(token_id)

    def _is_byte_token(self, token_id: int) -> bool:
        """A <0xNN> byte-fallback token, as tokenizers' ByteFallback decoder reads one."""
        piece = self._tokenizer.hf_tokenizer.id_to_token(token_id) or ""
        return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and all(
            c in "0123456789abcdefABCDEF" for c in piece[3:5])

    def _emit(self) -> str:
        window = self._tokenizer.decode(self._ids[self._start:])
        delta = window[len(self._anchor):]
        self._start, self._end = self._end, len(self._ids)
        self._anchor = self._tokenizer.decode(self._ids[self._start:self._end])
        return delta
