"""`--prompt-file` and `--prompt-ids-file` (generate and parity): a prompt too long for a command line (one argument
is capped at 128 KB) read from a file or stdin, and every way a file can be bad as one line with exit 2."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from parity_tests.hf_greedy import greedy
from parity_tests.test_cli_bad_inputs import assert_one_line_error, run_in_process
from twincache.errors import InputError
from twincache.generation import parse_token_id_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate_json(argv: list[str], capsys: pytest.CaptureFixture) -> dict:
    code, out, err = run_in_process(["generate", "--backend", "torch", "--mode", "eager", "--max-new-tokens", "2",
                                     "--json", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def stdin_bytes(monkeypatch):
    def feed(data: bytes) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    return feed


def test_ids_may_be_separated_by_commas_whitespace_and_newlines():
    assert parse_token_id_text("1,2, 3\n4 5\t6,\n7\r\n", "f") == [1, 2, 3, 4, 5, 6, 7]
    assert parse_token_id_text(" \n", "f") == []
    for text, says in (("1,,2", "empty field before '2' on line 1"), (",1", "empty field before '1'"),
                       ("1,\n,2", "empty field before '2' on line 2"), ("1,2,\n", "trailing comma on line 1"),
                       ("1 x", "'x' on line 1"), ("1\n2.5", "'2.5' on line 2"), ("1_0", "'1_0'")):
        with pytest.raises(InputError, match=says):
            parse_token_id_text(text, "f")


def test_an_ids_file_gives_the_same_prompt_as_prompt_ids(checkpoints, tmp_path, capsys, stdin_bytes):
    ids = [(7 * i) % 120 + 3 for i in range(500)]  # 500 ids: ~2 KB on a command line, fine in a file
    path = tmp_path / "ids.txt"
    path.write_text("\n".join(", ".join(map(str, ids[i:i + 10])) + "," for i in range(0, 490, 10))
                    + "\n" + " ".join(map(str, ids[490:])) + "\n")
    model = ["--model", str(checkpoints["gqa"])]
    from_file = generate_json([*model, "--prompt-ids-file", str(path)], capsys)
    from_flag = generate_json([*model, "--prompt-ids", ",".join(map(str, ids))], capsys)
    assert from_file["prompt_ids"] == ids
    assert from_file["token_ids"] == from_flag["token_ids"] == greedy(checkpoints["gqa"], [ids], 2)[0]
    stdin_bytes(path.read_bytes())
    assert generate_json([*model, "--prompt-ids-file", "-"], capsys)["prompt_ids"] == ids
    path.write_bytes(path.read_text().encode("utf-8-sig"))  # a byte-order mark first is dropped
    assert generate_json([*model, "--prompt-ids-file", str(path)], capsys)["prompt_ids"] == ids


def test_a_text_file_gives_the_same_prompt_as_prompt(checkpoints, tmp_path, capsys, stdin_bytes):
    text = "The ring buffer\nremembers, ünïcode too"
    model = ["--model", str(_with_tokenizer(checkpoints["gqa"], tmp_path))]
    path = tmp_path / "prompt.txt"
    path.write_text(text + "\n", encoding="utf-8")  # the one trailing newline an editor adds is dropped
    from_flag = generate_json([*model, "--prompt", text], capsys)
    assert len(from_flag["prompt_ids"]) == len(text), "one id per character, the newline and ü included"
    assert generate_json([*model, "--prompt-file", str(path)], capsys)["prompt_ids"] == from_flag["prompt_ids"]
    stdin_bytes((text + "\n").encode())
    assert generate_json([*model, "--prompt-file", "-"], capsys)["prompt_ids"] == from_flag["prompt_ids"]
    path.write_text(text + "\n\n", encoding="utf-8")  # only one newline is dropped: the rest is prompt text
    assert generate_json([*model, "--prompt-file", str(path)], capsys)["prompt_ids"] == from_flag["prompt_ids"] + [
        from_flag["prompt_ids"][text.index("\n")]]
    # as Notepad saves it: a byte-order mark first and CRLF line ends; the mark is dropped, as Python's utf-8-sig does
    saved = (text + "\n").replace("\n", "\r\n").encode("utf-8-sig")
    assert saved.startswith(b"\xef\xbb\xbf")
    path.write_bytes(saved)
    expected = generate_json([*model, "--prompt", saved.decode("utf-8-sig").removesuffix("\r\n")], capsys)
    assert generate_json([*model, "--prompt-file", str(path)], capsys)["prompt_ids"] == expected["prompt_ids"]
    stdin_bytes(saved)
    assert generate_json([*model, "--prompt-file", "-"], capsys)["prompt_ids"] == expected["prompt_ids"]


BAD_FILES = {  # case -> (flag, file content or None for no file, what the one line must say)
    "missing": ("--prompt-file", None, "no such file"),
    "missing_ids": ("--prompt-ids-file", None, "no such file"),
    "directory": ("--prompt-ids-file", "<dir>", "is a directory"),
    "under_a_file": ("--prompt-file", "<under a file>", "cannot be read: Not a directory"),
    "empty_text": ("--prompt-file", b"", "is empty"),
    "only_a_newline": ("--prompt-file", b"\n", "is empty"),
    "empty_ids": ("--prompt-ids-file", b" \n\n", "is empty"),
    "not_utf8": ("--prompt-file", b"caf\xe9", "is not UTF-8 text (byte 0xe9 at offset 3)"),
    "binary_ids": ("--prompt-ids-file", b"1,2\xff", "byte 0xff at offset 3"),
    "binary_ids_after_a_bom": ("--prompt-ids-file", b"\xef\xbb\xbf1,2\xff", "byte 0xff at offset 6"),  # of the file
    "only_a_bom": ("--prompt-file", b"\xef\xbb\xbf\r\n", "is empty"),
    "word_in_ids": ("--prompt-ids-file", b"1, 2\nthree", "'three' on line 2"),
    "double_comma": ("--prompt-ids-file", b"1,,2", "empty field"),
    "trailing_comma": ("--prompt-ids-file", b"1,2,", "trailing comma"),
    "id_outside_vocab": ("--prompt-ids-file", b"1 2 4096", "token id 4096 outside the vocabulary"),
}


@pytest.mark.parametrize("command", ["generate", "parity"])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_prompt_file_is_one_line_exit_2(checkpoints, tmp_path, capsys, command, case):
    flag, content, says = BAD_FILES[case]
    path = tmp_path / "prompt"
    if content == "<dir>":
        path.mkdir()
    elif content == "<under a file>":
        (tmp_path / "a_file").write_text("1")
        path = tmp_path / "a_file" / "prompt"
    elif content is not None:
        path.write_bytes(content)
    model = checkpoints["gqa"] if flag == "--prompt-ids-file" else _with_tokenizer(checkpoints["gqa"], tmp_path)
    argv = [command, "--model", str(model), flag, str(path), "--max-new-tokens", "2"]
    code, _, err = run_in_process(argv if command == "parity" else [*argv, "--mode", "eager"], capsys)
    line = assert_one_line_error(code, err, says)
    assert str(path) in line or case == "id_outside_vocab", f"the line does not name the file: {line}"


def _with_tokenizer(checkpoint: Path, tmp_path: Path, vocab_size: int = 128) -> Path:
    """The checkpoint with a character-level tokenizer.json: one id per character (newlines too) of ASCII and a few
    accented letters, every id of the vocabulary named."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    directory = tmp_path / "with_tokenizer"
    directory.mkdir()
    for item in checkpoint.iterdir():
        (directory / item.name).symlink_to(item)
    chars = ["[UNK]", "\n", *map(chr, range(32, 127)), *"üïéàç"]
    vocab = {token: i for i, token in enumerate(chars + [f"<{i}>" for i in range(len(chars), vocab_size)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("command", ["generate", "parity"])
def test_a_tokenizer_past_the_models_vocabulary_is_blamed_not_the_prompt(checkpoints, tmp_path, capsys, command):
    """Text the tokenizer encodes to an id the model has no row for (a GGUF whose token list outgrows its embedding,
    a tokenizer.json from another model) said "prompt 0 holds token id 500 outside the vocabulary [0, 128)", as if
    the user had given that id."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    model = _with_tokenizer(checkpoints["gqa"], tmp_path)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "z": 500}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.save(str(model / "tokenizer.json"))
    argv = [command, "--model", str(model), "--prompt", "aza", "--max-new-tokens", "2"]
    code, _, err = run_in_process(argv if command == "parity" else [*argv, "--mode", "eager"], capsys)
    line = assert_one_line_error(code, err, "tokenizer encodes prompt 0 to token id 500, but the model's vocabulary "
                                            "is [0, 128)")
    assert "--prompt-ids" in line, line


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_a_prompt_argument_that_is_not_utf8_is_one_line_exit_2(checkpoints, tmp_path, capsys, chat):
    """`--prompt $'caf\\xe9'`: Python hands the byte over as a lone surrogate (surrogateescape), which the tokenizer
    refused with an unexpected TypeError; the line names the byte and its offset, as a prompt file's does, and which
    prompt it is when there are several."""
    model = _with_tokenizer(checkpoints["gqa"], tmp_path)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    argument = b"caf\xe9".decode("utf-8", "surrogateescape")  # what sys.argv holds for those bytes
    with pytest.raises(UnicodeDecodeError) as error:
        b"caf\xe9".decode("utf-8")
    says = f"--prompt is not UTF-8 text (byte 0xe9 at offset {error.value.start})"
    argv = ["generate", "--model", str(model), "--mode", "eager", *(["--chat"] if chat else [])]
    code, _, err = run_in_process([*argv, "--prompt", argument], capsys)
    assert_one_line_error(code, err, says)
    code, _, err = run_in_process([*argv, "--prompt", "fine", "--prompt", argument], capsys)
    assert_one_line_error(code, err, f"prompt 1 of 2: {says}")


@pytest.mark.parametrize("flag", ["--prompt-file", "--prompt-ids-file"])
def test_prompt_sources_are_mutually_exclusive(capsys, flag):
    code, _, err = run_in_process(["generate", "--prompt", "x", flag, "p"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "not allowed with argument" in err


def test_a_prompt_that_starts_with_a_dash_is_told_how_to_pass_it(capsys):
    """argparse reads `--prompt -hello` as an option, and said only "argument --prompt: expected one argument", which
    the user gave. A value the user forgot (the flag followed by another option) keeps argparse's message."""
    code, _, err = run_in_process(["generate", "--prompt", "ok", "--prompt", "-hello"], capsys)
    assert_one_line_error(code, err, "expected one argument; '-hello' starts with '-', so it was read as an option: "
                                     "write --prompt=-hello (see --help)")
    code, _, err = run_in_process(["generate", "--prompt", "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, "argument --prompt: expected one argument (see --help)")


def test_a_prompt_typed_at_a_terminal_is_asked_for(checkpoints, capsys, monkeypatch):
    """`--prompt-file -` with stdin on a terminal waited without a word for the prompt to be typed; a pipe or file
    is read without the line."""
    for tty in (True, False):
        stdin = io.TextIOWrapper(io.BytesIO(b"1,2,3"))
        monkeypatch.setattr(stdin, "isatty", lambda tty=tty: tty)
        monkeypatch.setattr(sys, "stdin", stdin)
        code, out, err = run_in_process(["generate", "--mode", "eager", "--max-new-tokens", "2", "--json", "--model",
                                         str(checkpoints["gqa"]), "--prompt-ids-file", "-"], capsys)
        assert code == 0 and json.loads(out)["prompt_ids"] == [1, 2, 3], err
        said = "twincache: reading --prompt-ids-file from the terminal; end it with Ctrl-D"
        assert (said in err) == tty, err


def test_stdin_that_is_closed_is_one_line(checkpoints, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # as when started with `<&-`
    code, _, err = run_in_process(["generate", "--model", str(checkpoints["gqa"]), "--prompt-ids-file", "-"], capsys)
    assert_one_line_error(code, err, "reads stdin, but stdin is closed")


def test_chat_formats_a_prompt_file_as_it_formats_prompt(checkpoints, tmp_path, capsys):
    """--chat applies the chat template to the text of --prompt-file exactly as to --prompt's."""
    model = _with_tokenizer(checkpoints["gqa"], tmp_path)
    (model / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                                               "{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}")
    path = tmp_path / "prompt.txt"
    path.write_text("hi there\n", encoding="utf-8")
    plain = generate_json(["--model", str(model), "--prompt", "hi there"], capsys)["prompt_ids"]
    from_flag = generate_json(["--model", str(model), "--prompt", "hi there", "--chat"], capsys)["prompt_ids"]
    from_file = generate_json(["--model", str(model), "--prompt-file", str(path), "--chat"], capsys)["prompt_ids"]
    assert from_file == from_flag == generate_json(["--model", str(model), "--prompt", "<user>hi there\n<bot>"],
                                                   capsys)["prompt_ids"]
    assert from_file != plain


def test_chat_with_an_ids_file_is_one_line(checkpoints, tmp_path, capsys):
    path = tmp_path / "ids.txt"
    path.write_text("1 2 3\n")
    code, _, err = run_in_process(["generate", "--model", str(checkpoints["gqa"]), "--prompt-ids-file", str(path),
                                   "--chat"], capsys)
    assert_one_line_error(code, err, "--chat formats prompt text; it cannot apply to --prompt-ids-file")


def test_a_prompt_read_from_stdin_reaches_every_rank_of_a_mesh(tmp_path, stdin_bytes):
    """A torch --mesh run re-runs its command line in one process per device, after this process read stdin: each
    rank gets a file holding what was read instead of "-" (which would read an exhausted stdin)."""
    from twincache_app import generate_cmd

    stdin_bytes(b"1, 5 9\n")
    assert generate_cmd.read_prompt_ids_file("-") == [1, 5, 9]
    argv = generate_cmd._rank_argv(["generate", "--prompt-ids-file", "-", "--mesh", "model=2"], tmp_path)
    assert argv[:2] == ["generate", "--prompt-ids-file"] and argv[3:] == ["--mesh", "model=2"]
    assert Path(argv[2]).read_bytes() == b"1, 5 9\n"
    joined = generate_cmd._rank_argv(["parity", "--prompt-file=-", "--mesh=model=2"], tmp_path)
    assert joined[1] == f"--prompt-file={tmp_path / 'stdin'}" and joined[2] == "--mesh=model=2"
    generate_cmd._STDIN_READ.clear()  # as the next command starts (resolve_prompt)
    assert generate_cmd._rank_argv(["generate", "--prompt-ids", "1,2", "--mesh", "model=2"], tmp_path) == [
        "generate", "--prompt-ids", "1,2", "--mesh", "model=2"]
