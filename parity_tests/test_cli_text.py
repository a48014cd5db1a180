"""What `twincache generate` prints as text: text that stdout's encoding cannot show, streamed or as a batch.

The checkpoint is one tiny random transformers model with a character-level tokenizer.json whose characters are
mostly Japanese and emoji, so that the greedy reply holds characters latin-1 cannot encode. The tokens are
transformers' greedy generate (hf_greedy) and the text is the `tokenizers` library's decoding of them, encoded by
Python's own codec with errors="replace".
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from parity_tests.conftest import save_hf_checkpoint
from parity_tests.hf_greedy import greedy
from twincache_app import cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 128
# id 0 is the unknown token; a few latin-1 letters, then hiragana, katakana and emoji
CHARACTERS = ["[UNK]", *"aeé", *map(chr, range(0x3041, 0x3041 + 80)), *map(chr, range(0x30A1, 0x30A1 + 24)),
              *map(chr, range(0x1F600, 0x1F600 + VOCAB - 108))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    directory = save_hf_checkpoint(tmp_path_factory.mktemp("cli_text") / "model", seed=3, vocab_size=VOCAB)
    assert len(CHARACTERS) == VOCAB
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARACTERS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def latin1_stdout(monkeypatch: pytest.MonkeyPatch, encoding: str = "latin-1", errors: str = "strict") -> io.BytesIO:
    """sys.stdout as a latin-1 text stream with Python's default (strict) error handler, as PYTHONIOENCODING=latin-1
    gives (or another encoding and handler); returns the bytes under it."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding, errors=errors, newline="", write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    return raw


def oracle_text(model: Path, prompts: list[str], new_tokens: int) -> list[str]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    replies = greedy(model, [tokenizer.encode(p).ids for p in prompts], new_tokens)
    texts = [tokenizer.decode(ids) for ids in replies]
    assert all(any(ord(c) > 255 for c in text) for text in texts), f"no character latin-1 lacks: {texts}"
    return texts


@pytest.mark.parametrize(("prompts", "encoding", "errors"), [
    (["あい"], "latin-1", "strict"), (["あい", "カキ😀"], "latin-1", "strict"),
    # Python's stdout in a C/POSIX locale with UTF-8 mode off (LC_ALL=C PYTHONUTF8=0): it raised UnicodeEncodeError
    (["あい"], "ascii", "surrogateescape"),
], ids=["streamed", "batch", "c_locale_streamed"])
def test_text_stdout_cannot_encode_is_printed_with_replacements(model, monkeypatch, capsys, prompts, encoding, errors):
    """A latin-1 stdout gets the reply with "?" for what latin-1 lacks, exit 0: one prompt streams token by token,
    two print a line per row at the end. The stream's own error handler is back afterwards."""
    raw = latin1_stdout(monkeypatch, encoding, errors)
    argv = ["generate", "--model", str(model), "--mode", "eager", "--max-new-tokens", "6"]
    code = cli.main([*argv, *(arg for p in prompts for arg in ("--prompt", p))])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Error" not in err
    texts = oracle_text(model, prompts, 6)
    shown = texts[0] if len(texts) == 1 else "\n".join(f"[row {row}] {text}" for row, text in enumerate(texts))
    assert raw.getvalue() == (shown + "\n").encode(encoding, errors="replace")
    assert sys.stdout.errors == errors


@pytest.mark.parametrize("flags", [["--top-p", "0.9", "--seed", "5"], ["--top-k", "3"]], ids=["top_p_seed", "top_k"])
def test_sampling_flags_without_a_temperature_get_one_note(model, capsys, flags):
    """--top-k, --top-p and --seed without --temperature do nothing (greedy): one note on stderr says so, naming the
    flags given, and the run goes on greedily (transformers' greedy tokens), exit 0. With a temperature, no note."""
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(model / "tokenizer.json")).encode("あい").ids
    argv = ["generate", "--model", str(model), "--mode", "eager", "--max-new-tokens", "4", "--json", "--prompt", "あい"]
    code = cli.main([*argv, *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    given = [flag for flag in flags if flag.startswith("--")]
    assert err.splitlines() == [f"twincache: note: {' and '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} "
                                "when sampling; give --temperature > 0 to sample (decoding greedily)"]
    assert json.loads(out)["token_ids"] == greedy(model, [prompt], 4)[0]
    capsys.readouterr()  # transformers' loading bar
    assert cli.main([*argv, *flags, "--temperature", "0.7"]) == 0
    assert capsys.readouterr().err == ""


def test_the_json_record_says_how_its_tokens_were_drawn(model, capsys):
    """--json with --temperature: the record names the sampling settings (null when greedy), and a run given the
    record's settings draws the record's tokens again. The record had none of them: a sampled record could not be told
    from a greedy one, nor drawn again."""
    argv = ["generate", "--model", str(model), "--mode", "eager", "--max-new-tokens", "12", "--json", "--prompt",
            "あい"]
    assert cli.main([*argv, "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95", "--seed", "7"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["sampling"] == {"temperature": 1.5, "top_k": 40, "top_p": 0.95, "seed": 7}
    again = [f"--{key.replace('_', '-')}={value}" for key, value in record["sampling"].items()]
    assert cli.main([*argv, *again]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == record["token_ids"]
    assert cli.main(argv) == 0
    greedy_record = json.loads(capsys.readouterr().out)
    assert greedy_record["sampling"] is None and greedy_record["token_ids"] != record["token_ids"]


def test_an_eos_that_is_an_ordinary_token_ends_the_text_alike_streamed_and_in_json(model, tmp_path, capsys):
    """A checkpoint whose EOS id is an ordinary token of its tokenizer.json (not a special one, so decoding does not
    skip it): the streamed text left the EOS out while the JSON record's text kept its character. Both are now the
    text of the tokens before the EOS, as the `tokenizers` library decodes transformers' greedy tokens up to it."""
    import shutil

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt = tokenizer.encode("あい").ids
    reply = greedy(model, [prompt], 8)[0]
    eos = reply[3]  # the 4th greedy token becomes the EOS: the reply then ends at its first occurrence
    end = reply.index(eos)
    directory = Path(shutil.copytree(model, tmp_path / "ordinary_eos"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    (directory / "generation_config.json").unlink(missing_ok=True)
    expected = tokenizer.decode(reply[:end])
    assert tokenizer.decode(reply[:end + 1]) != expected, "the EOS's own text would show if kept"
    argv = ["generate", "--model", str(directory), "--mode", "eager", "--max-new-tokens", "8", "--prompt", "あい"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert cli.main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["token_ids"] == reply[:end + 1] and record["text"] == expected
