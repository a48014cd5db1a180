"""Reliability, round two, through `twincache generate` and `twincache bench`: every case of issue 14 a CLI user can
reach ends with exit 2 and one line naming its cause (never "unexpected ..."), in both backends; a reader that goes
away ends the run quietly; a tiny temperature prints the greedy tokens.

Most cases run in this process through `twincache_app.cli.main` (helpers shared with test_cli_bad_inputs.py); the
broken-pipe cases need a real pipe, so they run the entry point in a subprocess.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_tests.hf_greedy import greedy
from parity_tests.test_cli_bad_inputs import (
    BACKENDS,
    REPO,
    _entry_point,
    argv_for,
    assert_one_line_error,
    copy_checkpoint,
    edit_config,
    rewrite_tensors,
    run_in_process,
)
from twincache_app import streams


def _set(field: str, value: object) -> Callable[[dict], None]:
    return lambda raw: raw.__setitem__(field, value)


def _extra_layer(tensors: dict) -> None:
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("layers.1.", "layers.2.")] = tensors[name].copy()


def _write(content: bytes) -> Callable[[Path], None]:
    return lambda directory: (directory / "config.json").write_bytes(content)


def _weight_map(value: object) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        index = directory / "model.safetensors.index.json"
        raw = json.loads(index.read_text())
        raw["weight_map"]["model.norm.weight"] = value
        index.write_text(json.dumps(raw))
    return damage


# name -> (base checkpoint, damage to a copy of it)
BROKEN: dict[str, tuple[str, Callable[[Path], None]]] = {
    "config_list": ("gqa", _write(b"[1, 2, 3]")),
    "config_null": ("gqa", _write(b"null")),
    "config_latin1": ("gqa", _write('{"model_type": "mistral", "name": "caf\u00e9"}'.encode("latin-1"))),
    "numbers_as_strings": ("gqa", lambda d: edit_config(d, _set("hidden_size", "64"))),
    "zero_heads": ("gqa", lambda d: edit_config(d, _set("num_attention_heads", 0))),
    "zero_kv_heads": ("gqa", lambda d: edit_config(d, _set("num_key_value_heads", 0))),
    "eos_string": ("gqa", lambda d: edit_config(d, _set("eos_token_id", "2"))),
    "eos_float": ("gqa", lambda d: edit_config(d, _set("eos_token_id", 2.5))),
    "tie_string": ("gqa", lambda d: edit_config(d, _set("tie_word_embeddings", "false"))),
    "window_true": ("gqa", lambda d: edit_config(d, _set("sliding_window", True))),
    "rms_norm_eps_null": ("gqa", lambda d: edit_config(d, _set("rms_norm_eps", None))),
    "extra_layer": ("gqa", lambda d: rewrite_tensors(d, _extra_layer)),
    "absurd_layers": ("gqa", lambda d: edit_config(d, _set("num_hidden_layers", 10**8))),
    "weight_map_int": ("sharded", _weight_map(3)),
    "weight_map_null": ("sharded", _weight_map(None)),
    "short_positions": ("gqa", lambda d: edit_config(d, _set("max_position_embeddings", 8))),
}


# name -> (checkpoint, extra argv, what the one line must contain)
CASES: dict[str, tuple[str, list[str], str]] = {
    "config_list": ("config_list", [], "must hold a JSON object of fields, not a list"),
    "config_null": ("config_null", [], "must hold a JSON object of fields, not null"),
    "config_latin1": ("config_latin1", [], "config.json is not UTF-8 text"),
    "numbers_as_strings": ("numbers_as_strings", [], "config field hidden_size='64' must be an integer, not a string"),
    "zero_heads": ("zero_heads", [], "config field num_attention_heads=0 must be a positive integer"),
    "zero_kv_heads": ("zero_kv_heads", [], "config field num_key_value_heads=0 must be a positive integer"),
    "eos_string": ("eos_string", [], "config field eos_token_id='2' must be an integer, not a string"),
    "eos_float": ("eos_float", [], "config field eos_token_id=2.5 must be an integer, not a float"),
    "tie_string": ("tie_string", [], "tie_word_embeddings='false' must be true or false, not a string"),
    "window_true": ("window_true", [], "sliding_window=True must be a positive integer or null"),
    "rms_norm_eps_null": ("rms_norm_eps_null", [], "rms_norm_eps=None must be a number, not null"),
    "extra_layer": ("extra_layer", [], "holds 9 tensor(s) config.json does not describe: model.layers.2."),
    "absurd_layers": ("absurd_layers", [], "missing tensor model.layers.2.self_attn.q_proj.weight"),
    "weight_map_int": ("weight_map_int", [], "weight_map['model.norm.weight'] = 3 is not a shard file name"),
    "weight_map_null": ("weight_map_null", [], "weight_map['model.norm.weight'] = None is not a shard file name"),
    "positions_past_max": ("short_positions", ["--max-new-tokens", "6"],
                           "max_new_tokens=6 from position 3 would reach position 8, but this model's "
                           "max_position_embeddings=8 allows positions up to 7; generate at most 5 new tokens"),
    "positions_full": ("short_positions", ["--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", "1"],
                       "max_new_tokens=1 from position 8 would reach position 8, but this model's "
                       "max_position_embeddings=8 allows positions up to 7; the 8 tokens given leave no position "
                       "for a new token; give at most 7 tokens to generate 1"),
    "huge_static_cache": ("gqa", ["--cache", "static", "--max-cache-len", "1000000000"],
                          "a static cache of 2 layers x batch 1 x 2 kv heads x 1000000000 slots x head_dim 16 in"),
    "huge_budget_static": ("gqa", ["--cache", "static", "--max-new-tokens", "100000000"],
                           "max_new_tokens=100000000 from position 3 would reach position 100000002"),
    "max_new_tokens_int32": ("gqa", ["--max-new-tokens", str(2**31)],
                             "max_new_tokens=2147483648 must be <= 2147483647"),
    "max_cache_len_int32": ("gqa", ["--cache", "static", "--max-cache-len", str(2**31)],
                            "max_cache_len=2147483648 must be <= 2147483647"),
    "seed_too_large": ("gqa", ["--seed", str(2**70)], f"seed={2**70} must be in [0, 2**32 - 1 = 4294967295]"),
    "seed_negative": ("gqa", ["--seed=-1", "--temperature", "0.5"], "seed=-1 must be in [0, 2**32 - 1"),
    "temperature_inf": ("gqa", ["--temperature", "inf"], "temperature=inf must be >= 0 and finite"),
    "prompt_ids_empty_field": ("gqa", ["--prompt-ids", "1,,2"],
                               "--prompt-ids has an empty field (field 2 of '1,,2')"),
    "prompt_ids_trailing_comma": ("gqa", ["--prompt-ids", "1,2,"], "has an empty field (field 3 of '1,2,')"),
    "prompt_ids_float": ("gqa", ["--prompt-ids", "1,2.5"], "field 2 is '2.5'"),
}


@pytest.fixture(scope="module")
def broken(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reliability_cli")
    dirs = {"gqa": checkpoints["gqa"]}
    for name, (base, damage) in BROKEN.items():
        dirs[name] = copy_checkpoint(checkpoints[base], root / name)
        damage(dirs[name])
    return dirs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_each_case_is_one_line_naming_its_cause(broken, capsys, backend, case):
    checkpoint, extra, expected = CASES[case]
    code, out, err = run_in_process(argv_for(backend, broken[checkpoint], extra), capsys)
    assert_one_line_error(code, err, expected)
    assert out == "", f"nothing may be generated before a refusal: {out!r}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_twincache_home_that_is_a_file_is_named(tmp_path, monkeypatch, capsys, backend):
    home = tmp_path / "home"
    home.write_text("a file")
    monkeypatch.setenv("TWINCACHE_HOME", str(home))
    code, out, err = run_in_process(["generate", "--backend", backend, "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, f"the default-model directory (TWINCACHE_HOME) {home} is a file")


def test_bench_out_that_is_a_file_is_named(tmp_path, capsys):
    out_file = tmp_path / "results"
    out_file.write_text("a file")
    code, out, err = run_in_process(["bench", "--preset", "tiny", "--out", str(out_file), "--no-progress"], capsys)
    assert_one_line_error(code, err, f"--out {out_file} is a file, not a directory")


@pytest.mark.parametrize("extra", [[], ["--prefill-memory"]], ids=["decode", "prefill_memory"])
def test_bench_cache_dir_that_is_a_file_is_named(tmp_path, capsys, extra):
    """Before, a file at --cache-dir ended in "unexpected FileExistsError" from the checkpoint build."""
    cache_file = tmp_path / "cache"
    cache_file.write_text("a file")
    code, out, err = run_in_process(["bench", "--preset", "tiny", *extra, "--cache-dir", str(cache_file),
                                     "--out", str(tmp_path / "out"), "--no-progress"], capsys)
    assert_one_line_error(code, err, f"--cache-dir {cache_file} is a file, not a directory; pass --cache-dir a "
                                     "directory")
    assert cache_file.read_text() == "a file"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tiny_temperature_prints_the_greedy_tokens(broken, capsys, backend):
    """Today JAX printed token 0 repeatedly (logits / 1e-38 overflowed) and torch died with a RuntimeError. The greedy
    tokens are transformers' (hf_greedy) for argv_for's prompt 1,5,9 and 3 new tokens."""
    records = []
    for extra in ([], ["--temperature", "1e-38", "--top-p", "0.9", "--seed", "5"]):
        code, out, err = run_in_process(argv_for(backend, broken["gqa"], ["--json", *extra]), capsys)
        assert code == 0, err
        records.append(json.loads(out))
    assert records[0]["prompt_ids"] == [1, 5, 9]
    assert records[0]["token_ids"] == greedy(broken["gqa"], [[1, 5, 9]], 3)[0]
    assert records[1]["token_ids"] == records[0]["token_ids"]


@pytest.mark.parametrize(("backend", "flags", "notice"), [
    ("torch", ["--mode", "eager"], ""),
    ("jax", [], "twincache: compiling the decode step with XLA, unless this process already has it for this cache "
                "shape, batch and sampling kind...\n"),
], ids=["torch_streaming", "jax_fused"])
def test_a_closed_pipe_ends_quietly(tiny_model_dir, tmp_path, backend, flags, notice):
    """`twincache generate | head -c 0`: the reader is gone before the first write. Exit 141 (128 + SIGPIPE, what a
    shell reports for a tool SIGPIPE ended) with nothing on stderr but the compile notice (which comes before any
    output), never a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader: every write fails with EPIPE
    env = dict(os.environ, TWINCACHE_HOME=str(tiny_model_dir.parent), PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run(_entry_point() + ["generate", "--backend", backend, "--model", str(tiny_model_dir),
                                                "--max-new-tokens", "40", *flags],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, timeout=300, cwd=REPO)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, notice), proc.stderr[-2000:]


# name -> (extra flags, the child's stdout / stderr: "closed", "full" (/dev/full, ENOSPC) or "pipe")
STREAMS = {
    "stderr_closed_json": (["--json", "--top-k", "3"], "pipe", "closed"),  # the greedy note would have gone to stdout
    "stderr_closed_text": ([], "pipe", "closed"),  # the summary would have gone to stdout
    "stderr_full": ([], "pipe", "full"),  # the summary's failed write ended a good run with exit 1
    "stdout_closed": ([], "closed", "pipe"),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_closed_or_full_stream_is_handled(tiny_model_dir, case):
    """`2>&-`, `2>/dev/full`, `>&-` from a script. Python gives None for a stream closed at its start, and
    print(file=None) writes on stdout: the greedy note landed before the JSON, the summary after the text, and
    `>&-` ended in "unexpected AttributeError". A stderr that fails a write ended a good run with exit 1. Now: a
    closed or failing stderr leaves stdout exactly as it is otherwise (the `tokenizers` decode of transformers'
    greedy ids; one JSON object), exit 0; a closed stdout is refused in one line, exit 2."""
    from tokenizers import Tokenizer

    flags, out, err = STREAMS[case]
    env = dict(os.environ, TWINCACHE_HOME=str(tiny_model_dir.parent), PYTHONPATH=str(REPO))
    env.pop("TWINCACHE_DEBUG", None)
    argv = ["generate", "--model", str(tiny_model_dir), "--mode", "eager", "--prompt-ids", "1,5,9",
            "--max-new-tokens", "6", *flags]
    closing = ">&-" if out == "closed" else "2>&-" if err == "closed" else ""  # as a script closes it
    with open("/dev/full", "w") as full:
        proc = subprocess.run(["/bin/sh", "-c", f'exec "$@" {closing}', "sh", *_entry_point(), *argv],
                              stdout=subprocess.PIPE, stderr=full if err == "full" else subprocess.PIPE,
                              text=True, env=env, timeout=300, cwd=REPO)
    if case == "stdout_closed":
        assert_one_line_error(proc.returncode, proc.stderr, "stdout is closed")
        return
    assert proc.returncode == 0
    tokens = greedy(tiny_model_dir, [[1, 5, 9]], 6)[0]
    if "--json" in flags:
        assert json.loads(proc.stdout)["token_ids"] == tokens, proc.stdout  # one object, nothing before or after it
    else:
        text = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(tokens, skip_special_tokens=True)
        assert proc.stdout == text + "\n"


class _FullDisk(io.RawIOBase):
    """A raw stream whose every write fails with ENOSPC, as /dev/full's."""

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("command", ["generate", "generate_json", "bench_compare"])
def test_a_stdout_that_fails_its_writes_is_one_line(tiny_model_dir, monkeypatch, capsys, command):
    """`> /dev/full`: the output's write fails with ENOSPC. One line naming stdout and the cause, exit 2; it read
    "unexpected OSError: [Errno 28] ... (set TWINCACHE_DEBUG=1 for a traceback)"."""
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(_FullDisk()), encoding="utf-8"))
    small = str(REPO / "bench" / "results" / "small")
    argv = {"generate": ["generate", "--model", str(tiny_model_dir), "--mode", "eager", "--max-new-tokens", "3"],
            "generate_json": ["generate", "--model", str(tiny_model_dir), "--mode", "eager", "--max-new-tokens", "3",
                              "--json"],
            "bench_compare": ["bench", "--compare", small, small]}[command]
    code, _, err = run_in_process(argv, capsys)
    assert_one_line_error(code, err, "cannot write the output to stdout: No space left on device (errno 28)")


@pytest.mark.parametrize("shared", [True, False], ids=["one_destination", "two"])
def test_a_line_on_stderr_starts_at_column_0_after_streamed_text(tmp_path, monkeypatch, shared):
    """Streamed text leaves stdout's line open; an error found mid-decode printed its line right after it on a
    terminal (or `2>&1`): "...kindness andtwincache: error: ...". Where the two streams reach one file the line now
    ends first; where they reach two, stdout's text is left as it was written."""
    out_path, err_path = tmp_path / "out", tmp_path / ("out" if shared else "err")
    with open(out_path, "a") as out, open(err_path, "a") as err:  # two descriptors; one inode when shared
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        with streams.guarded():
            for piece in (" kind", "ness and"):
                sys.stdout.write(piece)
                sys.stdout.flush()
            print("twincache: error: found mid-decode", file=sys.stderr, flush=True)
    text = " kindness and" + ("\n" if shared else "")
    assert out_path.read_text() == text + ("twincache: error: found mid-decode\n" if shared else "")
    if not shared:
        assert err_path.read_text() == "twincache: error: found mid-decode\n"


_AS_A_CUDA_BUILD_WITHOUT_A_GPU = """
import sys
from twincache_app.cli import main
code = main(["generate", "--backend", "torch", "--mode", "eager", "--model", sys.argv[1], "--max-new-tokens", "4"])
import torch.utils.cpp_extension as cpp_extension
# What a CUDA build's toolchain calls at its import and at each compile; on a CPU build only this call logs
assert cpp_extension._find_cuda_home(), "no CUDA_HOME: the check would pass vacuously"
sys.exit(code)
"""


def test_a_cuda_build_of_torch_on_a_machine_without_a_gpu_adds_no_line_to_stderr(tiny_model_dir, tmp_path):
    """pip's default torch is a CUDA build; on a machine with a CUDA toolkit but no GPU its C++ toolchain logs 'No
    CUDA runtime is found, using CUDA_HOME=...' whenever it looks for CUDA, as the CPU path's compiler checks do (seen
    with torch 2.11's wheel here): the CLI keeps stderr to its own line."""
    (tmp_path / "cuda").mkdir()
    env = dict(os.environ, TWINCACHE_HOME=str(tiny_model_dir.parent), PYTHONPATH=str(REPO),
               CUDA_HOME=str(tmp_path / "cuda"))
    proc = subprocess.run([sys.executable, "-c", _AS_A_CUDA_BUILD_WITHOUT_A_GPU,
                           str(tiny_model_dir)], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[torch sliding_window cache: eager mode"), proc.stderr[-2000:]
