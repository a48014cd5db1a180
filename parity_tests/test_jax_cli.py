"""`twincache generate --backend jax` end to end, in real subprocesses: text and --json, fused (the default) and
--mode step, on the embedded default model (built into a fresh TWINCACHE_HOME) and on a transformers-written checkpoint
(no tokenizer.json, so --prompt-ids). Its JSON has the torch backend's keys, and its greedy tokens equal torch's.

The runs are independent, so the module fixture starts them all at once and collects them (each mostly waits on
its own imports and XLA compiles).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_cache.generate import generate
from torch_cache.model import Mistral
from twincache.default_model import default_model_dir
from twincache.tokenizer import Tokenizer
from twincache_app.generate_cmd import DEFAULT_PROMPT

REPO = Path(__file__).resolve().parents[1]
PROMPT_IDS = [5, 17, 42, 99, 3]
NEW_TOKENS = 30  # window 8 on the checkpoint: decoding writes ring slot 0 again 3 times

RUNS: dict[str, list[str]] = {
    "default jax json": ["--backend", "jax", "--json"],
    "default torch json": ["--backend", "torch", "--json", "--mode", "eager"],
    "default jax step json": ["--backend", "jax", "--json", "--mode", "step"],
    "default jax text": ["--backend", "jax"],
    "default jax stream": ["--backend", "jax", "--mode", "step"],
    "checkpoint jax json": ["--backend", "jax", "--json", "--max-new-tokens", str(NEW_TOKENS)],
    "checkpoint jax text": ["--backend", "jax", "--max-new-tokens", str(NEW_TOKENS)],
}


def command() -> list[str]:
    """The installed console script when there is one (it is what users run), else the module."""
    script = Path(sys.executable).with_name("twincache")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "twincache_app.cli"]


@pytest.fixture(scope="module")
def cli_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty TWINCACHE_HOME: the CLI runs build the default model there themselves."""
    return tmp_path_factory.mktemp("jax_cli_home")


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, Path], cli_home: Path) -> dict[str, tuple[str, str]]:
    """name -> (stdout, stderr) of every run in RUNS, each checked to have exited 0 without a traceback."""
    env = {**os.environ, "TWINCACHE_HOME": str(cli_home), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TWINCACHE_DEBUG", None)
    model_args = {"default": [], "checkpoint": ["--model", str(checkpoints["gqa"]),
                                                "--prompt-ids", ",".join(map(str, PROMPT_IDS))]}
    procs = {name: subprocess.Popen([*command(), "generate", *model_args[name.split()[0]], *args], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, args in RUNS.items()}
    results = {}
    for name, proc in procs.items():
        stdout, stderr = (stream.decode("utf-8") for stream in proc.communicate(timeout=600))
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\nstdout: {stdout}\nstderr: {stderr}"
        assert "Traceback" not in stderr, f"{name}: {stderr}"
        results[name] = stdout, stderr
    return results


def parse_json(stdout: str, name: str) -> dict:
    lines = stdout.splitlines()
    assert len(lines) == 1, f"{name}: --json must print exactly one line, got {stdout!r}"
    return json.loads(lines[0])


def test_jax_json_has_the_torch_keys_and_the_torch_tokens(runs):
    ours = parse_json(runs["default jax json"][0], "default jax json")
    theirs = parse_json(runs["default torch json"][0], "default torch json")
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
    assert ours["max_cache_len"] == theirs["max_cache_len"] == len(ours["prompt_ids"]) + 64


def test_json_with_a_streaming_mode_decodes_in_that_mode(runs):
    """--json prints nothing until the end, but the mode still decides the decode path: the step mode runs (and says
    so), one jitted step per token, with the fused mode's tokens."""
    step = parse_json(runs["default jax step json"][0], "default jax step json")
    fused = parse_json(runs["default jax json"][0], "default jax json")
    assert step["mode"] == "step" and fused["mode"] == "fused"
    assert step["token_ids"] == fused["token_ids"] and step["decode_steps"] == fused["decode_steps"]
    assert step.keys() == fused.keys()


def test_checkpoint_json_has_the_torch_keys_and_the_torch_api_tokens(runs, checkpoints):
    record = parse_json(runs["checkpoint jax json"][0], "checkpoint jax json")
    assert record.keys() == parse_json(runs["default torch json"][0], "default torch json").keys()
    assert record["backend"] == "jax" and record["cache"] == "sliding_window"
    assert record["prompt_ids"] == PROMPT_IDS and record["text"] is None  # no tokenizer.json
    assert record["model"] == str(checkpoints["gqa"])
    torch_model = Mistral.from_pretrained(checkpoints["gqa"], torch.float32)
    expected = generate(torch_model, [PROMPT_IDS], NEW_TOKENS, compile=False).token_ids[0]
    assert len(expected) == NEW_TOKENS  # the checkpoint has no EOS
    assert record["token_ids"] == expected, "greedy tokens differ from torch_cache's on the same checkpoint"


def test_default_model_json_is_the_tokenized_default_prompt_and_its_decoded_text(runs, cli_home):
    record = parse_json(runs["default jax json"][0], "default jax json")
    model_dir = default_dir(cli_home)
    assert record["model"] == str(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert record["prompt_ids"] == tokenizer.encode(DEFAULT_PROMPT)
    assert record["dtype"] == "float32"
    assert 1 <= len(record["token_ids"]) <= 64
    assert record["text"] == tokenizer.decode(record["token_ids"]) and record["text"]


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
def test_default_model_text_modes_print_the_json_text(runs, mode):
    text = parse_json(runs["default jax json"][0], "default jax json")["text"]
    stdout, stderr = runs[f"default jax {mode}"]
    assert stdout == text + "\n", f"{mode}: stdout {stdout!r} != the --json text {text!r}"
    assert f"[jax sliding_window cache: {'step' if mode == 'stream' else 'fused'} mode, prefill" in stderr
    assert "tok/s" in stderr


def test_checkpoint_without_tokenizer_prints_token_ids(runs):
    record = parse_json(runs["checkpoint jax json"][0], "checkpoint jax json")
    stdout, stderr = runs["checkpoint jax text"]
    assert [int(t) for t in stdout.split()] == record["token_ids"]
    assert "[jax sliding_window cache:" in stderr
