"""`twincache generate` end to end in real subprocesses: `--backend jax` text and --json, fused (the default) and
--mode step, beside torch, on the tiny random model (with its byte-level tokenizer) and on a transformers-written
checkpoint (no tokenizer.json, so --prompt-ids): its JSON has the torch backend's keys, its greedy tokens equal
torch's, and both equal transformers' greedy generate on the same directory (parity_tests/hf_greedy.py; prompt ids and
text by the `tokenizers` library on the tiny model's tokenizer.json).

Two runs use the trained default model (SmolLM2-135M-Instruct with our window of 64), built by the first of them into
a fresh TWINCACHE_HOME: the fused JAX --json run, and the plain `twincache generate`, the first command a newcomer
runs (torch, compiled, no flag). It must print legible English, say that it compiles before the compile's silence,
and wrap the ring buffer. It is this suite's one compile of the 30-layer model, so it runs alone, after the others.

The other runs are independent, so the module fixture starts them all at once and collects them (each mostly waits
on its own imports and XLA compiles).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_tests import background
from parity_tests.hf_greedy import greedy
from twincache.default_model import DEFAULT_WINDOW, default_model_dir
from twincache.tokenizer import Tokenizer
from twincache_app.backends import compiled_programs_dir
from twincache_app.generate_cmd import DEFAULT_PROMPT

REPO = Path(__file__).resolve().parents[1]
PROMPT_IDS = [5, 17, 42, 99, 3]
NEW_TOKENS = 30  # window 8 on the checkpoint: decoding writes ring slot 0 again 3 times

RUNS: dict[str, list[str]] = {
    "tiny jax json": ["--backend", "jax", "--json"],
    "tiny torch json": ["--backend", "torch", "--json", "--mode", "eager"],
    "tiny jax step json": ["--backend", "jax", "--json", "--mode", "step"],
    "tiny jax text": ["--backend", "jax"],
    "tiny jax stream": ["--backend", "jax", "--mode", "step"],
    "checkpoint jax json": ["--backend", "jax", "--json", "--max-new-tokens", str(NEW_TOKENS)],
    "checkpoint jax text": ["--backend", "jax", "--max-new-tokens", str(NEW_TOKENS)],
    "default jax json": ["--backend", "jax", "--json"],
}
PLAIN_RUN = "default torch plain"  # `twincache generate`: compiled torch, the default prompt and max_new_tokens
AGAIN_RUN = "tiny jax json again"  # after the others, logging XLA's persistent-cache hits and misses


def command() -> list[str]:
    """The installed console script when there is one (it is what users run), else the module."""
    script = Path(sys.executable).with_name("twincache")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "twincache_app.cli"]


@background.job
def cli_runs(request: pytest.FixtureRequest) -> Callable[[], tuple[Path, dict[str, tuple[str, str]]]]:
    """Every run in RUNS, then PLAIN_RUN and AGAIN_RUN, in an empty TWINCACHE_HOME (the CLI runs build the default
    model there themselves)."""
    home = request.getfixturevalue("tmp_path_factory").mktemp("jax_cli_home")
    checkpoints, tiny_model_dir = request.getfixturevalue("checkpoints"), request.getfixturevalue("tiny_model_dir")
    env = {**os.environ, "TWINCACHE_HOME": str(home), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TWINCACHE_DEBUG", None)
    model_args = {"default": [], "tiny": ["--model", str(tiny_model_dir), "--max-new-tokens", "40"],
                  "checkpoint": ["--model", str(checkpoints["gqa"]), "--prompt-ids", ",".join(map(str, PROMPT_IDS))]}

    def start(name: str, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([*command(), "generate", *model_args[name.split()[0]], *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def finish(name: str, proc: subprocess.Popen) -> tuple[str, str]:
        stdout, stderr = (stream.decode("utf-8") for stream in proc.communicate(timeout=900))
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\nstdout: {stdout}\nstderr: {stderr}"
        assert "Traceback" not in stderr, f"{name}: {stderr}"
        return stdout, stderr

    def run() -> tuple[Path, dict[str, tuple[str, str]]]:
        procs = {name: start(name, args) for name, args in RUNS.items()}
        results = {name: finish(name, proc) for name, proc in procs.items()}
        results[PLAIN_RUN] = finish(PLAIN_RUN, start(PLAIN_RUN, []))
        env.update(JAX_LOG_COMPILES="1", JAX_EXPLAIN_CACHE_MISSES="1")
        results[AGAIN_RUN] = finish(AGAIN_RUN, start(AGAIN_RUN, RUNS["tiny jax json"]))
        return home, results

    return run


@pytest.fixture(scope="module")
def cli_home(cli_runs: tuple[Path, dict[str, tuple[str, str]]]) -> Path:
    """The TWINCACHE_HOME of the runs below, where they built the default model."""
    return cli_runs[0]


@pytest.fixture(scope="module")
def runs(cli_runs: tuple[Path, dict[str, tuple[str, str]]]) -> dict[str, tuple[str, str]]:
    """name -> (stdout, stderr) of every run in RUNS and PLAIN_RUN, each checked to have exited 0 without a
    traceback."""
    return cli_runs[1]


def parse_json(stdout: str, name: str) -> dict:
    lines = stdout.splitlines()
    assert len(lines) == 1, f"{name}: --json must print exactly one line, got {stdout!r}"
    return json.loads(lines[0])


def test_jax_json_has_the_torch_keys_and_the_torch_tokens(runs):
    ours = parse_json(runs["tiny jax json"][0], "tiny jax json")
    theirs = parse_json(runs["tiny torch json"][0], "tiny torch json")
    assert ours.keys() == theirs.keys(), f"key sets differ: {ours.keys() ^ theirs.keys()}"
    assert (ours["backend"], theirs["backend"]) == ("jax", "torch")
    assert ours["cache"] == theirs["cache"] == "sliding_window"
    assert ours["prompt_ids"] == theirs["prompt_ids"]
    assert ours["token_ids"] == theirs["token_ids"], "greedy tokens differ between the backends"
    assert ours["text"] == theirs["text"]
    assert ours["decode_steps"] == theirs["decode_steps"] == len(ours["token_ids"]) - 1
    assert isinstance(ours["decode_tok_s"], float) and ours["decode_tok_s"] > 0
    assert isinstance(ours["prefill_s"], float) and ours["prefill_s"] > 0
    assert (ours["mode"], theirs["mode"]) == ("fused", "eager")
    # The same call reports the same capacity: prompt + new tokens, whatever padding JAX's prompt bucket adds.
    assert ours["max_cache_len"] == theirs["max_cache_len"] == len(ours["prompt_ids"]) + 40  # --max-new-tokens 40


def test_a_second_jax_run_loads_its_executables_from_disk(runs):
    """`generate --backend jax` keeps XLA's executables in the system temp dir (twincache_app.backends), as inductor
    keeps torch's kernels: the same run again compiles none of them (JAX logs every persistent-cache hit and miss
    here) and decodes the same tokens."""
    stdout, stderr = runs[AGAIN_RUN]
    assert parse_json(stdout, AGAIN_RUN)["token_ids"] == parse_json(runs["tiny jax json"][0], "")["token_ids"]
    hits = set(re.findall(r"Persistent compilation cache hit for '(\w+)'", stderr))
    assert {"jit__prefill", "jit__fused_decode"} <= hits, f"hits: {hits}\n{stderr[-3000:]}"
    assert "PERSISTENT COMPILATION CACHE MISS" not in stderr, stderr[-3000:]
    assert any(compiled_programs_dir("jax").iterdir())


def test_json_with_a_streaming_mode_decodes_in_that_mode(runs):
    """--json prints nothing until the end, but the mode still decides the decode path: the step mode runs (and says
    so), one jitted step per token, with the fused mode's tokens."""
    step = parse_json(runs["tiny jax step json"][0], "tiny jax step json")
    fused = parse_json(runs["tiny jax json"][0], "tiny jax json")
    assert step["mode"] == "step" and fused["mode"] == "fused"
    assert step["token_ids"] == fused["token_ids"] and step["decode_steps"] == fused["decode_steps"]
    assert step.keys() == fused.keys()


def test_checkpoint_json_has_the_torch_keys_and_transformers_tokens(runs, checkpoints):
    record = parse_json(runs["checkpoint jax json"][0], "checkpoint jax json")
    assert record.keys() == parse_json(runs["tiny torch json"][0], "tiny torch json").keys()
    assert record["backend"] == "jax" and record["cache"] == "sliding_window"
    assert record["prompt_ids"] == PROMPT_IDS and record["text"] is None  # no tokenizer.json
    assert record["model"] == str(checkpoints["gqa"])
    expected = greedy(checkpoints["gqa"], [PROMPT_IDS], NEW_TOKENS)[0]
    assert len(expected) == NEW_TOKENS  # the checkpoint has no EOS
    assert record["token_ids"] == expected, "greedy tokens differ from transformers' on the same checkpoint"


def test_tiny_model_json_is_the_tokenized_default_prompt_and_transformers_text(runs, tiny_model_dir):
    from tokenizers import Tokenizer as HFTokenizer

    record = parse_json(runs["tiny jax json"][0], "tiny jax json")
    assert record["model"] == str(tiny_model_dir)
    tokenizer = HFTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert record["prompt_ids"] == tokenizer.encode(DEFAULT_PROMPT).ids
    assert record["dtype"] == "float32"
    assert record["token_ids"] == greedy(tiny_model_dir, [record["prompt_ids"]], 40)[0]
    assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True) and record["text"]


def test_plain_generate_prints_legible_english_and_wraps_the_window(runs, cli_home):
    """`twincache generate` alone: the compile is announced first, the text is English, and the run goes past the
    window, so the ring buffer wraps; compiled torch prints the text of the fused JAX run."""
    stdout, stderr = runs[PLAIN_RUN]
    model_dir = default_dir(cli_home)
    record = parse_json(runs["default jax json"][0], "default jax json")
    tokenizer = Tokenizer.from_checkpoint(model_dir)
    assert record["model"] == str(model_dir) and record["cache"] == "sliding_window"
    assert record["prompt_ids"] == tokenizer.encode(DEFAULT_PROMPT)
    assert stdout == record["text"] + "\n", "torch compiled and JAX fused print different text"
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("twincache: compiling the decode step"), stderr
    assert lines[1].startswith("[torch sliding_window cache:"), stderr
    config = json.loads((model_dir / "config.json").read_text())
    assert config["sliding_window"] == DEFAULT_WINDOW and "not SmolLM2's" in config["twincache_note"]
    assert config["num_hidden_layers"] == 30, "the default must be the trained SmolLM2, not the tiny model"
    assert len(record["prompt_ids"]) + len(record["token_ids"]) > DEFAULT_WINDOW + 8, "the default run must wrap"
    assert_legible_english(stdout, tokenizer)


def assert_legible_english(text: str, tokenizer: Tokenizer) -> None:
    """English words, not noise: at least 20 words (12 distinct), >= 85% of them whole words of the vocabulary (a word
    there is a single token, spelled with its leading space), and almost only letters, spaces and punctuation."""
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 20, f"too few words: {text!r}"
    assert len(set(words)) >= 12, f"a collapse into repetition: {text!r}"
    known = [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
    assert len(known) >= 0.85 * len(words), f"only {len(known)}/{len(words)} dictionary words: {text!r}"
    plain = sum(c.isalpha() or c.isspace() or c in ".,;:'\"!?-()" for c in text)
    assert plain >= 0.95 * len(text), f"too many other characters: {text!r}"


def default_dir(home: Path) -> Path:
    previous = os.environ.get("TWINCACHE_HOME")
    os.environ["TWINCACHE_HOME"] = str(home)  # the stamped build the CLI made: found, not rebuilt
    try:
        return default_model_dir()
    finally:
        if previous is None:
            os.environ.pop("TWINCACHE_HOME")
        else:
            os.environ["TWINCACHE_HOME"] = previous


@pytest.mark.parametrize("mode", ["text", "stream"])
def test_tiny_model_text_modes_print_the_json_text(runs, mode):
    text = parse_json(runs["tiny jax json"][0], "tiny jax json")["text"]
    stdout, stderr = runs[f"tiny jax {mode}"]
    assert stdout == text + "\n", f"{mode}: stdout {stdout!r} != the --json text {text!r}"
    assert re.search(rf"\[jax sliding_window cache: {'step' if mode == 'stream' else 'fused'} mode, load [0-9.]+ s, "
                     r"prefill [0-9.]+ ms, first step [0-9.]+ s, decode ", stderr), stderr
    assert "tok/s" in stderr
    assert stderr.startswith("twincache: compiling the decode step with XLA"), stderr


def test_checkpoint_without_tokenizer_prints_token_ids(runs):
    record = parse_json(runs["checkpoint jax json"][0], "checkpoint jax json")
    stdout, stderr = runs["checkpoint jax text"]
    assert [int(t) for t in stdout.split()] == record["token_ids"]
    assert "[jax sliding_window cache:" in stderr
