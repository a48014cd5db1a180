"""`twincache generate` end to end, in a real subprocess: text and --json, on the tiny random model (with its byte-level
tokenizer) and on transformers-written checkpoints (which have no tokenizer.json, so --prompt-ids). The trained
default model's end-to-end runs are in test_jax_cli.py.

The tokens the CLI prints must equal transformers' greedy `generate` on the same directory, each prompt alone
(parity_tests/hf_greedy.py), never the towers' API that the CLI itself calls; prompt ids and text are judged by the
`tokenizers` library reading the same tokenizer.json. Most runs pass --mode eager; one run takes the default compiled
decode path. The tiny model's --json and text runs and the compiled run are processes, started in the background
lane (parity_tests/background.py: `cli_processes`); the transformers-written checkpoints' runs, the error cases and a
few others call cli.main in this process (what the script calls: a process each would cost an interpreter start and a
torch import, ~3-4 s of a core).
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_tests import background
from parity_tests.hf_greedy import greedy
from twincache_app.generate_cmd import DEFAULT_PROMPT

REPO = Path(__file__).resolve().parents[1]
PROMPT_IDS = [5, 17, 42, 99, 3]
JSON_KEYS = {"backend", "mode", "cache", "prompt_ids", "token_ids", "text", "load_s", "prefill_s", "decode_tok_s"}


@pytest.fixture(scope="module")
def cli_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty TWINCACHE_HOME for the runs in this process: the CLI must build the default model there itself."""
    return tmp_path_factory.mktemp("cli_home")


def cli_env(home: Path) -> dict[str, str]:
    """The environment of a `twincache` process with TWINCACHE_HOME=home, taken from this process's (in the main
    thread: a lane job's run must not see what a test running beside it has monkeypatched)."""
    env = {**os.environ, "TWINCACHE_HOME": str(home), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TWINCACHE_DEBUG", None)  # it would turn unexpected errors into tracebacks
    return env


def twincache(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twincache_app.cli", "generate", *args], capture_output=True, env=env,
                          cwd=REPO, timeout=600, check=False)


# name -> (model, arguments): the runs that are processes (the tests below judge them)
PROCESS_RUNS = {
    "tiny json": ("tiny", ["--max-new-tokens", "40", "--mode", "eager", "--json"]),
    "tiny text": ("tiny", ["--max-new-tokens", "40", "--mode", "eager"]),
    "compiled": ("gqa", ["--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", "24", "--json"]),
}


@background.job
def cli_processes(request: pytest.FixtureRequest) -> Callable[[], dict[str, subprocess.CompletedProcess]]:
    """Every run in PROCESS_RUNS, one after another, in an empty TWINCACHE_HOME of their own: name -> the process."""
    env = cli_env(request.getfixturevalue("tmp_path_factory").mktemp("cli_process_home"))
    models = {"tiny": request.getfixturevalue("tiny_model_dir"), "gqa": request.getfixturevalue("checkpoints")["gqa"]}
    argv = {name: ["--model", str(models[model]), *args] for name, (model, args) in PROCESS_RUNS.items()}

    def run() -> dict[str, subprocess.CompletedProcess]:
        return {name: twincache(env, *args) for name, args in argv.items()}

    return run


def in_process(home: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
               *args: str) -> tuple[str, str]:
    """`twincache generate ARGS` through cli.main in this process, as `twincache` would run it with TWINCACHE_HOME=home:
    exit 0, no traceback. Returns (stdout, stderr)."""
    from twincache_app import cli

    monkeypatch.setenv("TWINCACHE_HOME", str(home))
    monkeypatch.delenv("TWINCACHE_DEBUG", raising=False)  # it would turn unexpected errors into tracebacks
    capsys.readouterr()
    code = cli.main(["generate", *args])
    stdout, stderr = capsys.readouterr()
    assert code == 0, f"exit {code}\nstdout: {stdout}\nstderr: {stderr}"
    assert "Traceback" not in stderr
    return stdout, stderr


def succeeded(proc: subprocess.CompletedProcess) -> tuple[str, str]:
    stdout, stderr = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {stdout}\nstderr: {stderr}"
    assert "Traceback" not in stderr
    return stdout, stderr


def parse_json(stdout: str) -> dict:
    lines = stdout.splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {len(lines)}: {stdout!r}"
    record = json.loads(lines[0])
    assert JSON_KEYS <= record.keys(), f"missing keys {JSON_KEYS - record.keys()}"
    assert record["backend"] == "torch"
    assert isinstance(record["prefill_s"], float) and record["prefill_s"] >= 0
    assert isinstance(record["load_s"], float) and record["load_s"] > 0
    assert isinstance(record["decode_tok_s"], float) and record["decode_tok_s"] >= 0
    assert all(isinstance(t, int) for t in record["prompt_ids"] + record["token_ids"])
    return record


def hf_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer.json read by the `tokenizers` library itself, not by twincache.tokenizer."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


# --- the tiny model, with a tokenizer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_expected(tiny_model_dir: Path) -> dict:
    """What transformers and tokenizers give for the CLI's default prompt on the tiny model."""
    tokenizer = hf_tokenizer(tiny_model_dir)
    prompt = tokenizer.encode(DEFAULT_PROMPT).ids
    tokens = greedy(tiny_model_dir, [prompt], 40)[0]
    return {"prompt_ids": prompt, "token_ids": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True)}


@pytest.fixture(scope="module")
def tiny_json(cli_processes: dict[str, subprocess.CompletedProcess]) -> dict:
    stdout, _ = succeeded(cli_processes["tiny json"])
    return parse_json(stdout)


def test_tiny_model_json(tiny_json, tiny_expected, tiny_model_dir):
    assert tiny_json["cache"] == "sliding_window", "the tiny model has a window, so the default cache slides"
    assert tiny_json["mode"] == "eager"
    assert tiny_json["model"] == str(tiny_model_dir)
    assert tiny_json["prompt_ids"] == tiny_expected["prompt_ids"]
    assert tiny_json["token_ids"] == tiny_expected["token_ids"]
    assert tiny_json["text"] == tiny_expected["text"]
    assert 0 < len(tiny_json["token_ids"]) <= 40


def test_tiny_model_text_streams_the_same_tokens(cli_processes, tiny_json):
    stdout, stderr = succeeded(cli_processes["tiny text"])
    assert stdout == tiny_json["text"] + "\n"
    summary = stderr.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("[torch sliding_window cache:"), stderr
    assert re.search(r", decode \d+\.\d tok/s over \d+ timed steps\]$", summary[0]), summary[0]


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_run_with_no_step_after_the_first_reports_no_decode_speed(tiny_model_dir, capsys, backend):
    """Two new tokens: the prefill gives one, the first decode step (compile or warm-up included) the other, so no
    steady step was timed: the summary says so and --json gives null, never a measured-looking 0.0 tok/s."""
    from twincache_app import cli

    mode = {"torch": "eager", "jax": "step"}[backend]
    common = ["generate", "--backend", backend, "--mode", mode, "--model", str(tiny_model_dir), "--max-new-tokens", "2"]
    assert cli.main(common) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.endswith(", no decode step after the first to time]"), summary
    assert cli.main([*common, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["decode_steps"] == 1 and record["decode_tok_s"] is None, record


def test_a_rank_left_in_the_environment_without_a_world_is_no_rank(tiny_model_dir, capsys, monkeypatch):
    """RANK=1 without WORLD_SIZE (a variable left from another job) made a one-device run take itself for rank 1 of
    a torch world: its summary line was dropped without a word."""
    from twincache_app import cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["generate", "--mode", "eager", "--model", str(tiny_model_dir), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("[torch "), "the summary line is printed"


# --- transformers-written checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "cache_flag", "expected_cache"), [
    ("gqa", None, "sliding_window"),
    ("no_window", None, "static"),
    ("mqa", "static", "static"),
])
def test_checkpoint_json_with_prompt_ids(checkpoints, cli_home, capsys, monkeypatch, name, cache_flag,
                                        expected_cache):
    args = ["--model", str(checkpoints[name]), "--prompt-ids", ",".join(map(str, PROMPT_IDS)),
            "--max-new-tokens", "20", "--mode", "eager", "--json"]
    if cache_flag:
        args += ["--cache", cache_flag]
    record = parse_json(in_process(cli_home, capsys, monkeypatch, *args)[0])
    assert record["cache"] == expected_cache
    assert record["prompt_ids"] == PROMPT_IDS
    assert record["token_ids"] == greedy(checkpoints[name], [PROMPT_IDS], 20)[0]
    assert len(record["token_ids"]) == 20, "eos_token_id is None: every requested token is generated"
    assert record["text"] is None, "no tokenizer.json, so no text"


def test_checkpoint_text_mode_prints_the_ids(checkpoints, cli_home, capsys, monkeypatch):
    stdout, stderr = in_process(cli_home, capsys, monkeypatch, "--model", str(checkpoints["sharded"]), "--prompt-ids",
                                ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", "20", "--mode", "eager")
    assert [int(t) for t in stdout.split()] == greedy(checkpoints["sharded"], [PROMPT_IDS], 20)[0]
    assert "[torch sliding_window cache:" in stderr


def test_compiled_decode_through_the_cli(checkpoints, cli_processes):
    """The default path (torch.compile on) gives transformers' tokens; 24 new tokens wrap the window 8 thrice."""
    record = parse_json(succeeded(cli_processes["compiled"])[0])
    assert record["mode"] == "compiled", "torch's default mode, as the decode path reports it"
    assert record["token_ids"] == greedy(checkpoints["gqa"], [PROMPT_IDS], 24)[0]
    assert record["decode_steps"] == 23


@pytest.mark.parametrize("backend, mode", [("torch", "eager"), ("jax", "step")])
def test_sliding_window_flag_gives_a_window_less_model_the_ring(checkpoints, tmp_path, capsys, backend, mode):
    """--sliding-window 4 on the window-less checkpoint decodes what transformers decodes from the same weights when
    their config.json says sliding_window 4; the default cache is then the ring (4 slots), which 20 tokens wrap five
    times."""
    import shutil

    from twincache_app import cli

    windowed = Path(shutil.copytree(checkpoints["no_window"], tmp_path / "windowed"))
    config = json.loads((windowed / "config.json").read_text())
    assert config["sliding_window"] is None
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 4}))
    common = ["generate", "--backend", backend, "--mode", mode, "--prompt-ids", ",".join(map(str, PROMPT_IDS)),
              "--max-new-tokens", "20", "--json"]
    assert cli.main([*common, "--model", str(checkpoints["no_window"]), "--sliding-window", "4"]) == 0
    flagged = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "--model", str(checkpoints["no_window"])]) == 0
    window_less = json.loads(capsys.readouterr().out)
    assert flagged["cache"] == "sliding_window" and flagged["sliding_window"] == 4
    assert window_less["cache"] == "static" and window_less["sliding_window"] is None
    assert flagged["token_ids"] == greedy(windowed, [PROMPT_IDS], 20)[0]
    assert flagged["token_ids"] != window_less["token_ids"], "a window of 4 over 25 positions must change the tokens"


# --- errors: one line on stderr, exit code 2, no traceback --------------------------------------------------------


ERROR_CASES = {
    "missing_model_dir": (lambda ck, tmp: ["--model", str(tmp / "absent"), "--prompt-ids", "1,2"],
                          ["does not exist"]),
    "token_id_outside_vocab": (lambda ck, tmp: ["--model", str(ck["gqa"]), "--prompt-ids", "5,999"],
                               ["999", "[0, 128)"]),
    "sliding_on_no_window": (lambda ck, tmp: ["--model", str(ck["no_window"]), "--prompt-ids", "1,2",
                                              "--cache", "sliding_window"],
                             ["sliding_window=null", "--sliding-window N"]),
    "sliding_window_zero": (lambda ck, tmp: ["--model", str(ck["no_window"]), "--prompt-ids", "1,2",
                                             "--sliding-window", "0"],
                            ["--sliding-window=0 must be in [1, 2147483647]"]),
    "static_budget": (lambda ck, tmp: ["--model", str(ck["gqa"]), "--prompt-ids", "1,2,3", "--cache", "static",
                                       "--max-cache-len", "5", "--max-new-tokens", "4"],
                      ["prompt (3 tokens)", "max_new_tokens (4)", "max_cache_len=5"]),
    "no_tokenizer_for_text": (lambda ck, tmp: ["--model", str(ck["gqa"]), "--prompt", "hello"],
                              ["tokenizer.json", "--prompt-ids"]),
    "bad_prompt_ids_syntax": (lambda ck, tmp: ["--model", str(ck["gqa"]), "--prompt-ids", "1,x"],
                              ["--prompt-ids", "'1,x'"]),
    "model_is_a_weight_file": (lambda ck, tmp: ["--model", str(ck["gqa"] / "model.safetensors"), "--prompt-ids", "1"],
                               ["model.safetensors is a file, a safetensors weight file", "directory or a .gguf"]),
    "model_is_another_file": (lambda ck, tmp: ["--model", str(ck["gqa"] / "config.json"), "--prompt-ids", "1"],
                              ["config.json is a file, a config file"]),
    "model_is_a_device": (lambda ck, tmp: ["--model", os.devnull, "--prompt-ids", "1"],
                          [f"{os.devnull} is not a regular file or a directory"]),
    "missing_gguf": (lambda ck, tmp: ["--model", str(tmp / "absent.gguf"), "--prompt-ids", "1,2"],
                     ["absent.gguf does not exist", ".gguf file"]),
    "chat_with_prompt_ids": (lambda ck, tmp: ["--model", str(ck["gqa"]), "--prompt-ids", "1,2", "--chat"],
                             ["--chat", "--prompt-ids"]),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_errors_are_one_line_exit_2_without_traceback(checkpoints, tmp_path, capsys, monkeypatch, case):
    """In process (cli.main), which is what the script calls: test_cli_bad_inputs runs cases through the real entry
    point, and a subprocess per case here would cost an interpreter start and a torch import each (~4 s)."""
    from twincache_app import cli

    monkeypatch.delenv("TWINCACHE_DEBUG", raising=False)  # it would turn unexpected errors into tracebacks
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path / "home"))  # a case that fell through never builds in the user's
    make_args, fragments = ERROR_CASES[case]
    capsys.readouterr()
    try:
        code = cli.main(["generate", *make_args(checkpoints, tmp_path), "--mode", "eager"])
    except SystemExit as exit_:  # argparse's own errors exit through the one-line parser
        code = exit_.code
    stdout, stderr = capsys.readouterr()
    assert code == 2, f"{case}: exit {code}; stderr: {stderr}"
    assert "Traceback" not in stderr + stdout
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"{case}: stderr must be one line, got {lines}"
    assert lines[0].startswith("twincache: error: ")
    assert "unexpected" not in lines[0], f"{case}: a known bad input reached the catch-all: {lines[0]}"
    for fragment in fragments:
        assert fragment in lines[0], f"{case}: {fragment!r} missing from {lines[0]!r}"


@pytest.mark.parametrize("backend, flags, notice", [
    ("jax", [], "twincache: compiling the decode step with XLA, unless this process already has it for this cache "
                "shape, batch and sampling kind..."),
    # one new token is the prefill's: no decode step runs, and the line said one compiled
    ("jax", ["--max-new-tokens", "1"], "twincache: compiling the prefill with XLA, unless this process already has "
                                        "it for this cache shape, batch and sampling kind..."),
    ("torch", ["--mode", "eager"], None),  # nothing compiles
    ("torch", ["--max-new-tokens", "1"], None),  # the prefill is eager: nothing compiles
    ("jax", ["--json"], None),  # --json prints one object and nothing else
])
def test_compile_is_announced_before_it_starts(tiny_model_dir, capsys, backend, flags, notice):
    """The line comes first on stderr, before the prefill and the compile's silence."""
    from twincache_app import cli

    code = cli.main(["generate", "--backend", backend, "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                     *flags])  # a later --max-new-tokens in `flags` wins
    err = capsys.readouterr().err
    assert code == 0, err
    lines = err.splitlines()
    assert (lines[0] == notice) if notice else not any("compiling" in line for line in lines), err


# --- several prompts: one batch ------------------------------------------------------------------------------------

BATCH_PROMPTS = ["Once upon a time", "The capital of France is a city of", "1, 2,"]  # unequal: rows are left-padded


@pytest.mark.parametrize("backend, mode", [("torch", "eager"), ("jax", "step")])
def test_repeated_prompts_decode_together_as_each_would_alone(tiny_model_dir, capsys, backend, mode):
    """Each --prompt is one batch row: every row's tokens are those the same command gives that prompt alone (greedy,
    fp32; the padding of the shorter rows is never attended to), in --json and in text; and those are transformers'
    for the prompt ids tokenizers gives."""
    from twincache_app import cli

    common = ["generate", "--backend", backend, "--mode", mode, "--model", str(tiny_model_dir), "--max-new-tokens",
              "12", "--json"]
    alone = []
    for prompt in BATCH_PROMPTS:
        assert cli.main([*common, "--prompt", prompt]) == 0
        alone.append(json.loads(capsys.readouterr().out))
    assert all(record["batch"] == 1 and record["rows"] == [{key: record[key] for key in
                                                            ("prompt_ids", "token_ids", "text")}] for record in alone)
    prompts = [hf_tokenizer(tiny_model_dir).encode(prompt).ids for prompt in BATCH_PROMPTS]
    assert [record["prompt_ids"] for record in alone] == prompts
    assert [record["token_ids"] for record in alone] == greedy(tiny_model_dir, prompts, 12)
    repeated = [flag for prompt in BATCH_PROMPTS for flag in ("--prompt", prompt)]
    assert cli.main([*common, *repeated]) == 0
    batch = json.loads(capsys.readouterr().out)
    assert batch["batch"] == len(BATCH_PROMPTS) and "token_ids" not in batch, "a batch's rows are only in rows"
    assert len({len(row["prompt_ids"]) for row in batch["rows"]}) == len(BATCH_PROMPTS)
    assert batch["rows"] == [{key: record[key] for key in ("prompt_ids", "token_ids", "text")} for record in alone]
    assert cli.main(common[:-1] + repeated) == 0
    out, err = capsys.readouterr()
    assert out == "\n".join(f"[row {i}] {record['text']}" for i, record in enumerate(alone)) + "\n"
    assert re.search(rf"tok/s per row x {len(BATCH_PROMPTS)} rows = \d+\.\d tok/s in all over", err), err


def test_prompt_id_files_and_prompt_ids_repeat_too(checkpoints, tmp_path, capsys):
    from twincache_app import cli

    (tmp_path / "a.txt").write_text("5 17 42\n")
    (tmp_path / "b.txt").write_text("99,3")
    common = ["generate", "--mode", "eager", "--model", str(checkpoints["gqa"]), "--max-new-tokens", "6", "--json"]
    assert cli.main([*common, "--prompt-ids-file", str(tmp_path / "a.txt"), "--prompt-ids-file",
                     str(tmp_path / "b.txt")]) == 0
    from_files = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "--prompt-ids", "5,17,42", "--prompt-ids", "99,3"]) == 0
    from_flags = json.loads(capsys.readouterr().out)
    assert [row["prompt_ids"] for row in from_files["rows"]] == [[5, 17, 42], [99, 3]]
    assert from_files["rows"] == from_flags["rows"]
    assert [row["token_ids"] for row in from_flags["rows"]] == greedy(checkpoints["gqa"], [[5, 17, 42], [99, 3]], 6)


def test_a_bad_prompt_of_a_batch_is_named(trained_model_dir, capsys):
    from twincache_app import cli

    assert cli.main(["generate", "--model", str(trained_model_dir), "--prompt", "a", "--prompt", ""]) == 2
    err = capsys.readouterr().err
    assert err == "twincache: error: prompt 1 of 2: the prompt encodes to zero tokens; give a non-empty prompt\n", err


def test_the_executable_freezes_what_is_alive_before_it_exits(capsys, tmp_path):
    """The `twincache` script (and `python -m twincache_app.cli`) is console_main: main's exit code, after gc.freeze,
    so the interpreter's last collection skips the objects a compile leaves alive (~1 s, bench/README.md). main()
    itself, which tests and other programs call in a process that goes on, leaves the collector alone."""
    from twincache_app import cli

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["twincache"] == "twincache_app.cli:console_main"
    gc.unfreeze()
    try:
        assert cli.main(["generate", "--model", str(tmp_path / "missing")]) == 2  # refused in one line
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
    # console_main ends its process (and takes over SIGINT to the end): run it in one, main stubbed to return 3
    script = ("import atexit, gc\n"
              "from twincache_app import cli\n"
              "cli.main = lambda: 3\n"
              "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
              "cli.console_main()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "frozen True\n", "")


def test_the_readme_mesh_examples_fit_the_default_model(trained_model_dir):
    """Every `twincache generate|parity ... --mesh` line of the README that runs on the default model asks for a mesh
    its heads split over: with 9 query heads, model=2 and model=4 were refused, so each example exited 2."""
    from twincache.checkpoint import load_config
    from twincache.mesh import parse_mesh, plan_shards

    config = load_config(trained_model_dir)
    readme = (REPO / "README.md").read_text()
    examples = re.findall(r"^twincache (?:generate|parity) (?!.*--model).*--mesh (\S+)", readme, flags=re.MULTILINE)
    assert len(examples) >= 3, examples
    for mesh in examples:
        plan_shards(config, parse_mesh(mesh))  # raises MeshError, naming the heads, for a mesh the model cannot use


def test_every_flag_with_a_default_says_it_in_its_help():
    """`--help` is where a user reads what a flag left out does: --max-new-tokens (64), soak's --prompt-len (16),
    bench's --preset (tiny: a bare `twincache bench` runs it), --backend and parity's --cache said nothing."""
    import argparse

    from twincache_app.cli import build_parser

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = []
    for name, parser in subcommands.items():
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS, "==SUPPRESS=="):
                continue
            shown = parser._get_formatter()._expand_help(action) if action.help else ""
            scalar = not isinstance(action.default, list)
            if "default" not in shown or (scalar and str(action.default) not in shown):
                silent.append(f"{name} {action.option_strings[0]} (default {action.default!r}): {shown!r}")
    assert not silent, "flags whose help does not state their default:\n" + "\n".join(silent)
