"""StreamDecoder: what the CLI prints token by token adds up to the tokenizer's decode of all the ids, never prints
text that a later id changes, and decodes each id a bounded number of times.

The oracle is the `tokenizers` library's own decode of all ids (skip_special_tokens=True, as Tokenizer.decode), run
on tokenizers built here in the two families Mistral-style checkpoints carry:
- SentencePiece BPE with byte fallback (<0xNN> tokens, whose run ByteFallback decodes all or nothing: one U+FFFD per
  byte when it is not UTF-8), under the decoders of Mistral/Llama tokenizer.json files: Replace/ByteFallback/Fuse with
  and without Strip(" ", 1) (transformers' LlamaConverter, twincache.gguf_tokenizer), and Metaspace, which drops the
  "▁" of a decode's first token (SpmConverter);
- byte-level BPE (GPT-2 style, as the default model's GGUF tokenizer): one trained here, whose merges hold pieces of
  multi-byte characters, and the tiny model's bytes-only tokenizer.
Random id sequences (seeded) lean on what breaks incremental decoding: byte tokens, cut and invalid UTF-8, special
tokens (skipped) inside byte runs, leading "▁" pieces. The default model's own 49k tokenizer takes ~4 s to build from
its GGUF, so it is not loaded here; the trained byte-level BPE stands in for it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from parity_tests.conftest import save_hf_checkpoint
from twincache import default_model
from twincache.tokenizer import StreamDecoder, Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
PIECES = ["▁", "▁▁", "e", "l", "o", "H", "w", "r", "d", "a", "c", "f", "é", "h", "t", "i", "n", "ll", "llo", "Hello",
          "▁w", "▁wor", "▁world", "or", "ld", "▁c", "▁ca", "▁caf", "▁café", "▁t", "▁th", "▁the", "▁H", "▁Hello",
          "▁i", "▁in", "b▁c", "▁▁x", "日本", "▁日", "\ufffd", "x\ufffd"]
MERGES = [("l", "l"), ("ll", "o"), ("▁", "w"), ("▁w", "or"), ("▁wor", "ld"), ("▁", "c"), ("▁c", "a"), ("▁ca", "f"),
          ("▁caf", "é"), ("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "H"), ("▁", "i"), ("▁i", "n")]
SP_DECODERS = {
    "mistral": [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)],
    "no_strip": [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()],
    "metaspace": [decoders.Metaspace("▁", "first", False), decoders.ByteFallback(), decoders.Fuse()],
}
# Text the byte-level BPE is trained on, so that its merges hold whole and cut multi-byte characters.
CORPUS = ["Hello world, the café is naïve. ", "日本語のテキストと中文混合 ", "emoji 😀👍🏽 family 👨‍👩‍👧 ",
          "ünïcödé ß ẞ Ωmega ", "line1\nline2\r\n\tline3 ", "€100 → ∞ ≠ ½ "] * 20
TEXTS = ["Hello world", "Hello café 日本 😀", "  two leading", "a\nb\n\n", "€ in the world", "x" * 5 + "é" * 3]


def sp_tokenizer(decoder: str) -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback, laid out as a Mistral tokenizer.json: specials, the 256 <0xNN>
    byte tokens, pieces with and without "▁" (two hold U+FFFD itself), one non-special added token."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in PIECES:
        vocab.setdefault(piece, len(vocab))
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>", byte_fallback=True,
                                       fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(SP_DECODERS[decoder])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    tokenizer.add_tokens([AddedToken("<plain>", special=False, normalized=False)])
    return Tokenizer(tokenizer)


def byte_level_bpe() -> Tokenizer:
    """A GPT-2 style byte-level BPE (ByteLevel pre-tokenizer and decoder) trained on CORPUS, with the specials of the
    default model's tokenizer."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return Tokenizer(tokenizer)


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {
    "sp_mistral": lambda: sp_tokenizer("mistral"),
    "sp_no_strip": lambda: sp_tokenizer("no_strip"),
    "sp_metaspace": lambda: sp_tokenizer("metaspace"),
    "byte_level_bpe": byte_level_bpe,
    "tiny_bytes": lambda: Tokenizer(default_model.byte_level_tokenizer()),
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]()


def oracle(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.hf_tokenizer.decode(ids, skip_special_tokens=True)


def streamed(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The deltas of pushing `ids` then flushing, each checked on arrival: what is printed so far is a prefix of the
    oracle's text (it cannot be taken back), and all of it at the end is the oracle's text."""
    final = oracle(tokenizer, ids)
    decoder, printed = StreamDecoder(tokenizer), ""
    for n, token_id in enumerate(ids):
        printed += decoder.push(token_id)
        assert final.startswith(printed), f"after push {n} of {ids}: printed {printed!r}, decode is {final!r}"
    printed += decoder.flush()
    assert printed == final, f"{ids}: streamed {printed!r}, decode is {final!r}"
    return printed


def id_classes(tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """The tokenizer's special ids, its single-byte ids (<0xNN>, or a byte-level BPE's 256 base symbols), the rest."""
    hf = tokenizer.hf_tokenizer
    special = sorted(i for i, token in hf.get_added_tokens_decoder().items() if token.special)
    byte_ids = sorted(byte_id(tokenizer, byte) for byte in range(256))
    rest = sorted(set(range(hf.get_vocab_size())) - set(special) - set(byte_ids)) or byte_ids  # tiny: bytes only
    return special, byte_ids, rest


def byte_id(tokenizer: Tokenizer, byte: int) -> int:
    """The id of one byte: its <0xNN> token, or a byte-level BPE's symbol for it (GPT-2's byte-to-unicode table)."""
    hf = tokenizer.hf_tokenizer
    token_id = hf.token_to_id(f"<0x{byte:02X}>")
    return token_id if token_id is not None else hf.token_to_id(_BYTE_SYMBOLS[byte])


def _gpt2_byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: printable bytes stand for themselves, the others for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte], extra = chr(256 + extra), extra + 1
    return [symbols[byte] for byte in range(256)]


_BYTE_SYMBOLS = _gpt2_byte_symbols()
# Bytes weighted toward what cuts or breaks UTF-8: ASCII, continuation bytes, 2/3/4-byte leads, never-valid bytes.
BYTE_POOLS = [range(0x20, 0x7F), range(0x80, 0xC0), range(0xC2, 0xE0), range(0xE0, 0xF0), range(0xF0, 0xF5),
              [0xC0, 0xC1, 0xF5, 0xFF], [0x0A, 0x20]]


def random_sequences(tokenizer: Tokenizer, seed: int, count: int) -> list[list[int]]:
    """`count` id sequences (1-16 ids) of four kinds: uniform over the vocabulary; byte-heavy with sprinkled
    specials and pieces; real text's ids cut at random points and spliced; real text with specials inserted."""
    rng = random.Random(seed)
    special, byte_ids, rest = id_classes(tokenizer)
    vocab_size = tokenizer.hf_tokenizer.get_vocab_size()
    texts = [tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS + CORPUS[:6]]
    sequences = []
    for n in range(count):
        length = rng.randint(1, 16)
        kind = n % 4
        if kind == 0:
            ids = [rng.randrange(vocab_size) for _ in range(length)]
        elif kind == 1:
            ids = []
            for _ in range(length):
                draw = rng.random()
                if draw < 0.7:
                    ids.append(byte_id(tokenizer, rng.choice(rng.choice(BYTE_POOLS))))
                elif draw < 0.85:
                    ids.append(rng.choice(rest))
                else:
                    ids.append(rng.choice(special))
        elif kind == 2:
            a, b = rng.choice(texts), rng.choice(texts)
            ids = a[rng.randrange(len(a)):][:length] + b[:rng.randrange(len(b) + 1)][-length:]
        else:
            ids = list(rng.choice(texts))
            for _ in range(rng.randint(1, 3)):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(special + byte_ids[:1]))
        sequences.append(ids or [rng.choice(rest)])
    return sequences


def test_the_tokenizers_have_what_breaks_streaming(tokenizer):
    """The families above hold the cases: specials, all 256 bytes, ids beyond the bytes whose text alone ends in
    U+FFFD (a byte-level merge that cuts a character; a piece holding U+FFFD itself), and id sequences whose decode
    is not the concatenation of their ids' decodes."""
    special, byte_ids, rest = id_classes(tokenizer)
    assert special and len(set(byte_ids)) == 256
    assert [i for i in rest if tokenizer.decode([i]).endswith("\ufffd")]
    euro = [byte_id(tokenizer, b) for b in "€".encode()]
    assert oracle(tokenizer, euro) == "€" != "".join(tokenizer.decode([i]) for i in euro)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_id_sequences_stream_their_decode(tokenizer, seed):
    for ids in random_sequences(tokenizer, seed, 1500):
        streamed(tokenizer, ids)


def test_texts_stream_their_decode(tokenizer):
    for text in TEXTS + CORPUS[:6]:
        ids = tokenizer.hf_tokenizer.encode(text).ids
        assert streamed(tokenizer, ids) == oracle(tokenizer, ids)
        assert streamed(tokenizer, ids[1:]) == oracle(tokenizer, ids[1:])  # a reply: begins mid-text, no BOS


def test_the_audit_repro_streams_its_decode():
    """The audit's case: "\\n" as a byte token, then a stray byte: ByteFallback makes the run two U+FFFD, so the
    "\\n" that the old StreamDecoder printed at once was never in the decode."""
    tokenizer = sp_tokenizer("mistral")
    hf = tokenizer.hf_tokenizer
    ids = [hf.token_to_id(token) for token in ("<0x0A>", "<0x80>", "▁world")]
    assert oracle(tokenizer, ids) == "\ufffd\ufffd world"
    assert streamed(tokenizer, ids) == "\ufffd\ufffd world"


@pytest.mark.parametrize("name", ["sp_mistral", "sp_metaspace", "byte_level_bpe"])
def test_decode_work_per_token_is_bounded(name, monkeypatch):
    """The ids StreamDecoder hands to Tokenizer.decode over N pushes are O(N) (re-decoding everything would be
    N(N+1)/2): on text, on one run of N byte tokens (a byte-fallback run is held whole), on N cut characters."""
    tokenizer = TOKENIZERS[name]()
    decoded = [0]
    decode = tokenizer.decode

    def counting_decode(ids: list[int]) -> str:
        decoded[0] += len(ids)
        return decode(ids)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    n = 2000
    text_ids = (tokenizer.hf_tokenizer.encode(" ".join(TEXTS) * 200, add_special_tokens=False).ids * 2)[:n]
    runs = [byte_id(tokenizer, b) for b in ("日本語" * n).encode()][:n]  # one run of byte tokens
    cuts = [byte_id(tokenizer, 0xE6)] * n  # a lead byte again and again: the text always ends in U+FFFD
    for ids in (text_ids, runs, cuts):
        assert len(ids) == n
        decoded[0] = 0
        decoder = StreamDecoder(tokenizer)
        printed = "".join(decoder.push(i) for i in ids) + decoder.flush()
        assert printed == decode(ids)
        assert decoded[0] <= 5 * n, f"{decoded[0]} ids decoded over {n} pushes"


@pytest.mark.usefixtures("one_torch_thread")
def test_the_cli_streams_its_own_json_text_on_a_byte_fallback_checkpoint(tmp_path: Path, twincache_home, capsys):
    """End to end, the audit's case: `twincache generate` sampling at temperature 1.5 from a random 2-layer model
    whose tokenizer is sp_tokenizer("mistral") prints, as it streams, the text its --json run decodes."""
    from twincache_app import cli

    tokenizer = sp_tokenizer("mistral").hf_tokenizer
    directory = save_hf_checkpoint(tmp_path / "sp", vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(directory / "tokenizer.json"))
    run = ["generate", "--model", str(directory), "--prompt", "Hello", "--temperature", "1.5", "--seed", "0",
           "--mode", "eager", "--max-new-tokens", "40"]
    assert cli.main(run) == 0
    streamed_text = capsys.readouterr().out
    assert cli.main([*run, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert streamed_text == record["text"] + "\n"
    byte_tokens = [i for i in record["token_ids"] if tokenizer.id_to_token(i).startswith("<0x")]
    assert len(byte_tokens) > 10 and "\ufffd" in record["text"], "what makes it bite: byte runs that are not UTF-8"
