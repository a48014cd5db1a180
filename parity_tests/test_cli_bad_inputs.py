"""Every bad input of docs/design.md §6 that a CLI user can reach, through `twincache generate`.

Each must end with exit code 2 and exactly one non-empty line on stderr -- the case's own message, never the CLI's
catch-all "unexpected ..." and never a traceback. Most cases run in this process through `twincache_app.cli.main(argv)`
(a subprocess per case would not fit the time budget); a few run the installed entry point in a real subprocess.

The checkpoint-breaking helpers here are shared with test_faults.py and test_safe_loading.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from twincache_app.cli import main

BACKENDS = ["torch", "jax"]
VOCAB = 128  # the tiny conftest checkpoints
REPO = Path(__file__).resolve().parents[1]


# --- checkpoint breakers (each takes a copy of a good checkpoint dir and damages it) ---------------------------------


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(directory: Path, edit: Callable[[dict], None]) -> None:
    """Load model.safetensors with numpy, let `edit` change the dict, save it back (a well-formed file)."""
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def truncate_safetensors(directory: Path, keep_fraction: float = 0.6) -> Path:
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep_fraction)])
    return path


def corrupt_header_bytes(directory: Path) -> Path:
    """Overwrite the start of the JSON header with bytes that are not JSON."""
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"\x00\xffnot-json-at-all"
    path.write_bytes(bytes(data))
    return path


def rewrite_header(directory: Path, edit: Callable[[dict], None]) -> Path:
    """Edit the parsed JSON header and write it back with the data bytes untouched (valid JSON, wrong content)."""
    path = directory / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    edit(header)
    new_header = json.dumps(header).encode()
    new_header += b" " * (-len(new_header) % 8)
    path.write_bytes(struct.pack("<Q", len(new_header)) + new_header + data[8 + header_len:])
    return path


def edit_config(directory: Path, edit: Callable[[dict], None]) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


class Trap:
    """Unpickling this touches `sentinel`: any code path that unpickles a file holding it leaves evidence."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple:
        return Path.touch, (Path(self.sentinel),)


def write_trap_bin(directory: Path, sentinel: Path, name: str = "pytorch_model.bin") -> Path:
    """A torch.save file (the format of pytorch_model.bin) whose unpickling touches `sentinel`."""
    import torch

    path = directory / name
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "trap": Trap(sentinel)}, path)
    return path


# --- the cases --------------------------------------------------------------------------------------------------------


def _without(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def _build_checkpoints(root: Path, good: Path, no_window: Path, sharded: Path) -> dict[str, Path]:
    """name -> broken checkpoint directory."""
    dirs: dict[str, Path] = {"missing_dir": root / "does-not-exist", "a_file": good / "config.json"}

    d = dirs["no_config"] = copy_checkpoint(good, root / "no_config")
    (d / "config.json").unlink()
    d = dirs["no_safetensors"] = copy_checkpoint(good, root / "no_safetensors")
    (d / "model.safetensors").unlink()
    d = dirs["only_bin"] = copy_checkpoint(good, root / "only_bin")
    (d / "model.safetensors").unlink()
    write_trap_bin(d, root / "only_bin.unpickled")
    d = dirs["missing_tensor"] = copy_checkpoint(good, root / "missing_tensor")
    rewrite_tensors(d, _without("model.layers.1.mlp.up_proj.weight"))
    d = dirs["wrong_shape"] = copy_checkpoint(good, root / "wrong_shape")
    rewrite_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                               t["model.layers.0.self_attn.k_proj.weight"][:16]))
    truncate_safetensors(dirs.setdefault("truncated", copy_checkpoint(good, root / "truncated")))
    corrupt_header_bytes(dirs.setdefault("corrupted_header", copy_checkpoint(good, root / "corrupted_header")))
    d = dirs["huge_header_length"] = copy_checkpoint(good, root / "huge_header_length")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + data[8:])
    d = dirs["header_without_offsets"] = copy_checkpoint(good, root / "header_without_offsets")
    rewrite_header(d, lambda h: h["model.norm.weight"].pop("data_offsets"))
    d = dirs["header_bad_dtype"] = copy_checkpoint(good, root / "header_bad_dtype")
    rewrite_header(d, lambda h: h["model.norm.weight"].__setitem__("dtype", "F33"))
    d = dirs["shard_missing"] = copy_checkpoint(sharded, root / "shard_missing")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[-1]).unlink()
    d = dirs["config_not_json"] = copy_checkpoint(good, root / "config_not_json")
    (d / "config.json").write_text('{"model_type": "mistral",')
    d = dirs["config_missing_field"] = copy_checkpoint(good, root / "config_missing_field")
    edit_config(d, lambda raw: raw.pop("hidden_size"))
    d = dirs["model_type"] = copy_checkpoint(good, root / "model_type")
    edit_config(d, lambda raw: raw.__setitem__("model_type", "qwen2"))
    d = dirs["rope_scaling"] = copy_checkpoint(good, root / "rope_scaling")
    edit_config(d, lambda raw: raw.__setitem__("rope_scaling", {"rope_type": "linear", "factor": 2.0}))
    d = dirs["rope_parameters"] = copy_checkpoint(good, root / "rope_parameters")
    edit_config(d, lambda raw: raw.__setitem__("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4,
                                                                   "factor": 4.0}))
    d = dirs["window_past_int32"] = copy_checkpoint(good, root / "window_past_int32")
    edit_config(d, lambda raw: raw.__setitem__("sliding_window", 2**31))
    d = dirs["hidden_act"] = copy_checkpoint(good, root / "hidden_act")
    edit_config(d, lambda raw: raw.__setitem__("hidden_act", "gelu"))
    d = dirs["nan_weights"] = copy_checkpoint(good, root / "nan_weights")
    rewrite_tensors(d, lambda t: t["lm_head.weight"].__setitem__((5,), float("nan")))
    d = dirs["only_sentencepiece"] = copy_checkpoint(good, root / "only_sentencepiece")
    (d / "tokenizer.model").write_bytes(b"\x0a")  # named only: twincache must not try to read it
    d = dirs["broken_tokenizer"] = copy_checkpoint(good, root / "broken_tokenizer")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {')  # cut short
    dirs["good"], dirs["no_window"] = good, no_window
    return dirs


# name -> (checkpoint, extra argv, what the one line must contain)
CASES: dict[str, tuple[str, list[str], str]] = {
    # 15. checkpoint dir missing, or without config.json or safetensors files
    "missing_dir": ("missing_dir", [], "does-not-exist does not exist"),
    "model_is_a_file": ("a_file", [], "config.json is a file, a config file; give the directory that holds it"),
    "no_config": ("no_config", [], "has no config.json"),
    "no_safetensors": ("no_safetensors", [], "has no model.safetensors or model.safetensors.index.json"),
    "shard_missing": ("shard_missing", [], "named in model.safetensors.index.json is missing"),
    # 16. missing tensor / wrong shape: named
    "missing_tensor": ("missing_tensor", [], "missing tensor model.layers.1.mlp.up_proj.weight"),
    "wrong_shape": ("wrong_shape", [], "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], but "
                                       "config.json implies [32, 64]"),
    # 17. unsupported config: the field named
    "model_type": ("model_type", [], "model_type='qwen2' is not supported"),
    "rope_scaling": ("rope_scaling", [], "config field rope_scaling="),
    "rope_parameters": ("rope_parameters", [], "config field rope_parameters="),
    "hidden_act": ("hidden_act", [], "config field hidden_act='gelu' is not supported"),
    "config_missing_field": ("config_missing_field", [], "lacks the required field 'hidden_size'"),
    "config_not_json": ("config_not_json", [], "config.json is not valid JSON"),
    # 18. only pickled weights: refused, with how to convert
    "only_bin": ("only_bin", [], "holds only pickled weights (pytorch_model.bin); twincache never unpickles. Convert "
                                 "once with transformers: AutoModelForCausalLM.from_pretrained(dir)"
                                 ".save_pretrained(dir, safe_serialization=True)"),
    # 19. truncated or corrupted safetensors
    "truncated": ("truncated", [], "model.safetensors is truncated: tensors need"),
    "corrupted_header": ("corrupted_header", [], "is corrupted: its safetensors header is not valid JSON"),
    "huge_header_length": ("huge_header_length", [], "is corrupted or truncated: header claims 1099511627776 bytes"),
    "header_without_offsets": ("header_without_offsets", [], "tensor entry without valid data_offsets"),
    "header_bad_dtype": ("header_bad_dtype", [], "is corrupted: safetensors rejects its header"),
    # a checkpoint without tokenizer.json needs ids
    "no_tokenizer_no_ids": ("good", ["--prompt", "hello"], "has no tokenizer.json; pass token ids with --prompt-ids"),
    "only_sentencepiece": ("only_sentencepiece", ["--prompt", "hello"],
                           "has no tokenizer.json, only tokenizer.model (SentencePiece), which twincache does not "
                           "read; write tokenizer.json beside it with transformers (pip install sentencepiece, then "
                           "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"),
    # a tokenizer.json that does not parse blocks --prompt-ids too (it decodes the output): say how to go on
    "broken_tokenizer": ("broken_tokenizer", ["--prompt-ids", "1,5"],
                         "tokenizer.json is not a readable tokenizer.json (EOF while parsing an object at line 1 "
                         "column 29); restore the checkpoint's own file, or remove it and give token ids with "
                         "--prompt-ids"),
    # 7. token id out of range
    "token_id_too_large": ("good", ["--prompt-ids", f"1,{VOCAB}"], f"token id {VOCAB} outside the vocabulary [0, "
                                                                   f"{VOCAB})"),
    "token_id_negative": ("good", ["--prompt-ids=-1,5"], f"token id -1 outside the vocabulary [0, {VOCAB})"),
    # 8. empty prompt
    "empty_prompt_ids": ("good", ["--prompt-ids", ""], "--prompt-ids is empty"),
    "prompt_ids_only_commas": ("good", ["--prompt-ids", ",,"], "--prompt-ids is empty"),
    "second_prompt_ids_empty": ("good", ["--prompt-ids", "1,2", "--prompt-ids", ""],
                                "--prompt-ids (prompt 2 of 2) is empty"),
    "prompt_ids_not_ints": ("good", ["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    # 9. max_new_tokens < 0
    "max_new_tokens_negative": ("good", ["--max-new-tokens", "-1"], "max_new_tokens=-1 must be >= 0"),
    # 1. prompt longer than a static cache; 2. prompt + max_new_tokens beyond it: refused up front
    "prompt_beyond_static": ("good", ["--cache", "static", "--max-cache-len", "4", "--prompt-ids", "1,2,3,4,5,6",
                                      "--max-new-tokens", "0"],
                             "prompt (6 tokens) + max_new_tokens (0) = 6 exceeds the static cache capacity "
                             "max_cache_len=4"),
    "budget_beyond_static": ("good", ["--cache", "static", "--max-cache-len", "5", "--max-new-tokens", "4"],
                             "prompt (3 tokens) + max_new_tokens (4) = 7 exceeds the static cache capacity "
                             "max_cache_len=5; raise max_cache_len (--max-cache-len) to at least 7, or"),
    "budget_beyond_short_ring": ("good", ["--cache", "sliding_window", "--max-cache-len", "5", "--max-new-tokens",
                                          "4"], "= 7 exceeds the sliding_window cache capacity max_cache_len=5; raise "
                                                "max_cache_len (--max-cache-len) to at least 7, or"),
    # a ring as long as the window (8) holds any generation: that is what it asks for, not prompt + new tokens
    "budget_beyond_ring_shorter_than_window": ("good", ["--cache", "sliding_window", "--max-cache-len", "5",
                                                        "--max-new-tokens", "30"],
                                               "= 33 exceeds the sliding_window cache capacity max_cache_len=5; raise "
                                               "max_cache_len (--max-cache-len) to at least 8 (the window"),
    "max_cache_len_zero": ("good", ["--cache", "static", "--max-cache-len", "0"], "max_cache_len=0 must be > 0"),
    # 10. sampling parameters
    "temperature_negative": ("good", ["--temperature", "-0.5"], "temperature=-0.5 must be >= 0"),
    "temperature_nan": ("good", ["--temperature", "nan"], "temperature=nan must be >= 0"),
    "top_p_zero": ("good", ["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
    "top_p_above_one": ("good", ["--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
    "top_p_nan": ("good", ["--top-p", "nan"], "top_p=nan must be in (0, 1]"),
    "top_k_negative": ("good", ["--top-k", "-1"], f"top_k=-1 must be in [0, vocab_size={VOCAB}]"),
    "top_k_above_vocab": ("good", ["--top-k", str(VOCAB + 1)], f"top_k={VOCAB + 1} must be in [0, vocab_size="
                                                                f"{VOCAB}]"),
    # 12. sliding-window cache on a config without a window
    "sliding_without_window": ("no_window", ["--cache", "sliding_window"],
                               "a sliding_window cache was asked for, but this model's config has "
                               "sliding_window=null; use the static cache"),
    # a window past the int32 positions: JAX's masks overflowed ("unexpected OverflowError"); torch wrapped
    "window_flag_past_int32": ("good", ["--sliding-window", str(2**31)],
                               "--sliding-window=2147483648 must be in [1, 2147483647]"),
    "config_window_past_int32": ("window_past_int32", [], "config sliding_window=2147483648 is past 2147483647, "
                                                          "the int32 limit of positions"),
    # 20. logits that become non-finite during generation
    "nan_weights": ("nan_weights", [], "the model produced NaN or Inf logits at generated token 0"),
    # argparse-level mistakes keep the same one-line contract
    "unknown_cache_kind": ("good", ["--cache", "ring"], "argument --cache: invalid choice: 'ring'"),
    "max_new_tokens_not_int": ("good", ["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value"),
}


@pytest.fixture(scope="module")
def bad_checkpoints(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_checkpoints")
    return _build_checkpoints(root, checkpoints["gqa"], checkpoints["no_window"], checkpoints["sharded"])


FAST_MODE = {"torch": ["--mode", "eager"], "jax": []}  # no torch.compile per case; JAX's default (fused) mode


def argv_for(backend: str, model_dir: Path, extra: list[str]) -> list[str]:
    argv = ["generate", "--backend", backend, "--model", str(model_dir), *FAST_MODE[backend], "--max-new-tokens", "3"]
    if not any(arg.startswith(("--prompt", "--prompt-ids")) for arg in extra):
        argv += ["--prompt-ids", "1,5,9"]
    return argv + extra  # later flags win over the defaults above


def assert_one_line_error(code: int, stderr: str, expected: str) -> str:
    assert code == 2, f"exit code {code}, stderr: {stderr!r}"
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected exactly one non-empty stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith("twincache: error: "), line
    assert "unexpected" not in line, f"the CLI's catch-all answered instead of a specific check: {line}"
    assert expected in line, f"{expected!r} not in {line!r}"
    return line


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse errors exit through the one-line parser
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


# Every other case is refused before a compile starts; these are found by running the model, after the compile that
# `generate` announces on stderr (docs/design.md §5) has begun.
FOUND_WHILE_COMPUTING = {"nan_weights"}
COMPILE_NOTICE = "twincache: compiling the decode step"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2(bad_checkpoints, capsys, backend: str, case: str):
    checkpoint, extra, expected = CASES[case]
    code, out, err = run_in_process(argv_for(backend, bad_checkpoints[checkpoint], extra), capsys)
    if case in FOUND_WHILE_COMPUTING and err.startswith(COMPILE_NOTICE):
        err = err.split("\n", 1)[1]  # the compile had begun (and was announced) when the model produced NaN
    assert_one_line_error(code, err, expected)
    assert out == "", f"nothing may be generated before a refusal: {out!r}"
    if case == "only_bin":
        assert not (bad_checkpoints["only_bin"].parent / "only_bin.unpickled").exists(), "the .bin was unpickled"


@pytest.mark.parametrize("backend", BACKENDS)
def test_good_input_through_the_same_helper_succeeds(bad_checkpoints, capsys, backend: str):
    """The control: the argv the cases start from generates, so each refusal above is the case's own doing."""
    code, out, err = run_in_process(argv_for(backend, bad_checkpoints["good"], ["--json"]), capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["backend"] == backend and len(record["token_ids"]) == 3
    assert all(0 <= t < VOCAB for t in record["token_ids"]) and not math.isnan(record["prefill_s"])


@pytest.mark.parametrize(("backend", "mode"), [("torch", "fused"), ("torch", "step"), ("jax", "eager"),
                                             ("jax", "compiled"), ("jax", "turbo")])
def test_a_mode_of_another_backend_is_one_line_exit_2(bad_checkpoints, capsys, backend: str, mode: str):
    """Refused before anything loads, naming the backend's own modes (docs/design.md §5)."""
    argv = argv_for(backend, bad_checkpoints["good"], ["--mode", mode])
    code, out, err = run_in_process(argv, capsys)
    modes = {"torch": "compiled or eager (default compiled)", "jax": "fused or step (default fused)"}[backend]
    line = assert_one_line_error(code, err, f"--mode {mode} is not a {backend} mode; --backend {backend} takes {modes}")
    assert out == "" and "Traceback" not in line


def test_an_inductor_cache_dir_that_cannot_be_made_is_one_line_exit_2(bad_checkpoints, capsys, monkeypatch,
                                                                      tmp_path):
    """TORCHINDUCTOR_CACHE_DIR torch cannot create: its first import of torch._dynamo raised FileNotFoundError, and
    the run ended with "unexpected FileNotFoundError: ... '/proc/nope'" (in a fresh process; here torch._dynamo is
    imported already, so without the check the run would succeed). A directory under a file fails even for root."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a_file" / "inductor"))
    code, out, err = run_in_process(argv_for("torch", bad_checkpoints["good"], []), capsys)
    assert_one_line_error(code, err, f"TORCHINDUCTOR_CACHE_DIR {tmp_path / 'a_file' / 'inductor'} is not a writable "
                                     "directory (Not a directory); point it at a writable directory, or unset it")
    assert out == ""


@pytest.mark.parametrize("where", ["missing", "a file", "/proc"])
def test_a_temp_dir_python_skips_is_skipped_by_inductors_compiler_too(monkeypatch, tmp_path, where: str):
    """TMPDIR that Python's tempfile cannot write a file in: it falls back to /tmp, but g++ (which inductor runs for
    every compiled torch step) trusted the variable. With TMPDIR=/proc as root, or on a full disk, `twincache
    generate` ended with "unexpected InductorError: ... Cannot create temporary file in /proc/" (or "No space left
    on device") whenever a kernel was not in inductor's cache yet. The torch tower's first step hands Python's
    choice on as TMPDIR; g++ itself, given a one-line program, is the judge. (~0.1 s: one g++ run.)"""
    import tempfile

    from torch_cache.inductor_cpu import check_cache_dir

    (tmp_path / "a file").write_text("")
    skipped = where if where.startswith("/") else str(tmp_path / where)
    monkeypatch.setenv("TMPDIR", skipped)
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches its choice: choose again under this TMPDIR
    check_cache_dir()
    assert os.environ["TMPDIR"] == tempfile.gettempdir() != skipped
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "inductor's CPU steps need a C++ compiler"
    (tmp_path / "one.cpp").write_text("int main() { return 0; }\n")
    built = subprocess.run([compiler, "-c", str(tmp_path / "one.cpp"), "-o", str(tmp_path / "one.o")],
                           capture_output=True, text=True, env=os.environ.copy())
    assert built.returncode == 0, built.stderr


def _entry_point() -> list[str]:
    """The installed `twincache` script next to this interpreter, else `python -m twincache_app.cli`."""
    script = Path(sys.executable).with_name("twincache")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "twincache_app.cli"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["truncated", "temperature_nan", "empty_prompt_ids"])
def test_bad_input_through_the_real_entry_point(bad_checkpoints, tmp_path, backend: str, case: str):
    checkpoint, extra, expected = CASES[case]
    env = dict(os.environ, TWINCACHE_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    proc = subprocess.run(_entry_point() + argv_for(backend, bad_checkpoints[checkpoint], extra), env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert_one_line_error(proc.returncode, proc.stderr, expected)
    assert proc.stdout == ""
    assert not (tmp_path / "home").exists(), "a refused run must not build the default model"
