"""Hugging Face Llama checkpoint directories (model_type "llama"), judged by transformers' LlamaForCausalLM.

A Llama without RoPE scaling or biases is a Mistral without a sliding window, so twincache reads its config.json into
the same MistralConfig (twincache/config.py), with transformers' LlamaConfig defaults for absent fields. Every oracle
is transformers' own: `LlamaConfig.from_dict` for the fields (read at test time), LlamaForCausalLM's greedy `generate`
for the tokens (parity_tests/hf_greedy.py, each token checked as float64's clear argmax), its float64 and fp32
uncached forwards for the logits and K/V (the Judge of parity_tests/oracle.py, by the rule of `twincache parity`).

The directories are seeded random LlamaForCausalLM models written by save_pretrained: "gqa" (2 KV heads, untied, EOS
null) as saved, and "minimal" (4 KV heads, tied) whose config.json keeps only the fields a Llama needs, and no
generation_config.json, so the model runs with transformers' defaults: KV heads, head_dim, positions, RoPE theta,
norm epsilon and EOS (2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers import MistralConfig as HFMistralConfig

import jax_cache.generate as jax_generate
import torch_cache.generate as torch_generate
from jax_cache.model import Mistral as JaxMistral
from parity_tests.hf_greedy import greedy_of
from parity_tests.oracle import Judge
from torch_cache.model import Mistral as TorchMistral
from twincache.checkpoint import load_config, open_checkpoint
from twincache.config import MistralConfig
from twincache.errors import CheckpointError, ConfigError, TwincacheError
from twincache_app import cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=0.15)
# what the "minimal" config.json keeps: the fields without a default, and the one it does not have the default of
KEPT = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "tie_word_embeddings")
PROMPTS = [[5, 17, 42], [9, 8, 7, 300, 64, 211, 88, 120, 31, 400, 77]]  # unequal: the batch is left-padded
NEW_TOKENS = 20  # past position 16 in both rows: a window read into a Llama (e.g. 16) would move those steps


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, bos_token_id=1, eos_token_id=None,
                                 pad_token_id=0)).save_pretrained(root / "gqa")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=4, tie_word_embeddings=True)).save_pretrained(
        root / "minimal")
    raw = json.loads((root / "minimal" / "config.json").read_text())
    (root / "minimal" / "config.json").write_text(json.dumps({key: raw[key] for key in KEPT}))
    (root / "minimal" / "generation_config.json").unlink()
    return {"gqa": root / "gqa", "minimal": root / "minimal"}


@pytest.fixture(scope="module")
def expected(llama_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """transformers' LlamaForCausalLM greedy tokens of PROMPTS (each alone) on each directory."""
    return {name: greedy_of(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), PROMPTS, NEW_TOKENS)
            for name, path in llama_dirs.items()}


# --- (a) config.json as transformers' LlamaConfig reads it ----------------------------------------------------------

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
          "bos_token_id", "eos_token_id", "pad_token_id")
REQUIRED = {key: TINY[key] for key in KEPT[1:-1]}
RAW_CONFIGS: dict[str, dict[str, Any]] = {
    "llama_minimal": {"model_type": "llama", **REQUIRED},
    "llama_nulls": {"model_type": "llama", **REQUIRED, "num_key_value_heads": None, "head_dim": None,
                    "bos_token_id": None, "eos_token_id": None, "rope_parameters": None, "sliding_window": None},
    "llama_4x_rope_theta": {"model_type": "llama", **REQUIRED, "rope_theta": 500000.0, "rope_scaling": None,
                            "num_key_value_heads": 1, "pretraining_tp": 1},
    # Mistral's path, unchanged: its own defaults (8 KV heads when absent, so 8 query heads here; a 4,096 window)
    "mistral_minimal": {"model_type": "mistral", **REQUIRED, "num_attention_heads": 8},
}


def transformers_reads(raw: dict[str, Any]) -> dict[str, Any]:
    hf = (LlamaConfig if raw["model_type"] == "llama" else HFMistralConfig).from_dict(raw)
    return {**{name: getattr(hf, name) for name in FIELDS}, "rope_theta": hf.rope_parameters["rope_theta"],
            "sliding_window": getattr(hf, "sliding_window", None)}  # a LlamaConfig has no such attribute


@pytest.mark.parametrize("name", [*RAW_CONFIGS, "gqa_as_saved"])
def test_config_fields_present_absent_or_null_are_what_transformers_reads(llama_dirs, name):
    raw = RAW_CONFIGS.get(name) or json.loads((llama_dirs["gqa"] / "config.json").read_text())
    config = MistralConfig.from_dict(raw)
    ours = {key: getattr(config, key) for key in (*FIELDS, "rope_theta", "sliding_window")}
    theirs = transformers_reads(raw)
    assert ours == theirs


def test_pretraining_tp_is_ignored_as_transformers_ignores_it(llama_dirs, tmp_path):
    """transformers 5's LlamaForCausalLM does not read pretraining_tp (4.x summed each projection in that many slices,
    the same sums in another order); twincache reads the config as if it were 1."""
    directory = shutil.copytree(llama_dirs["gqa"], tmp_path / "tp2")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "pretraining_tp": 2}))
    assert load_config(directory) == load_config(llama_dirs["gqa"])
    ids = torch.tensor([PROMPTS[1]])  # [1, P]
    with torch.inference_mode():
        logits = [LlamaForCausalLM.from_pretrained(path).eval()(ids).logits for path in (llama_dirs["gqa"], directory)]
    assert torch.equal(*logits), "transformers now reads pretraining_tp: twincache must refuse it (or compute it)"


# --- (b) what twincache does not compute exactly: refused, naming the field -----------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128, "rope_theta": 500000.0}
REFUSALS = {  # name -> (config.json edit, error, what its one line must say)
    "sliding_window": ({"sliding_window": 16}, ConfigError, ["sliding_window=16", "'llama'", "null"]),
    "rope_llama3": ({"rope_parameters": LLAMA3_ROPE}, ConfigError, ["rope_parameters=", "llama3"]),
    "rope_linear_4x": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ConfigError, ["rope_scaling=", "linear"]),
    "rope_dynamic": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ConfigError, ["rope_scaling=",
                                                                                             "dynamic"]),
    "rope_yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, ConfigError,
                  ["rope_parameters=", "yarn"]),
    "attention_bias": ({"attention_bias": True}, ConfigError, ["attention_bias=True"]),
    "mlp_bias": ({"mlp_bias": True}, ConfigError, ["mlp_bias=True"]),
    "hidden_act": ({"hidden_act": "gelu"}, ConfigError, ["hidden_act='gelu'"]),
    "heads_not_dividing": ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 16}, ConfigError,
                           ["hidden_size=64", "num_attention_heads=3"]),
    "head_dim_not_the_weights": ({"head_dim": 32}, CheckpointError, ["q_proj.weight", "[64, 64]", "[128, 64]"]),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_what_is_not_computed_exactly_is_refused_naming_the_field(llama_dirs, tmp_path, name):
    edit, error, fragments = REFUSALS[name]
    directory = shutil.copytree(llama_dirs["gqa"], tmp_path / name)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(TwincacheError) as info:
        open_checkpoint(directory)
    message = str(info.value)
    assert type(info.value) is error and "\n" not in message, message
    assert all(fragment in message for fragment in fragments), message


def test_the_cli_refuses_a_windowed_llama_in_one_line(llama_dirs, tmp_path, capsys):
    directory = shutil.copytree(llama_dirs["gqa"], tmp_path / "windowed")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "sliding_window": 16}))
    code = cli.main(["generate", "--model", str(directory), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "config field sliding_window=16" in err, err


# --- (c) both towers against transformers' LlamaForCausalLM ---------------------------------------------------------

def run_tower(backend: str, directory: Path) -> Any:
    """A greedy GenerationResult of PROMPTS with step logits: torch eager or JAX step mode, static cache."""
    if backend == "torch":
        return torch_generate.generate(TorchMistral.from_pretrained(directory, torch.float32), PROMPTS, NEW_TOKENS,
                                       cache="static", compile=False, return_logits=True)
    return jax_generate.generate(JaxMistral.from_pretrained(directory, jnp.float32), PROMPTS, NEW_TOKENS,
                                 cache="static", fused=False, return_logits=True)


# JAX's compiles are the cost here: it runs the minimal directory only, whose shapes the CLI and parity tests below
# compile again (read back from the session's compilation cache); GQA is the towers' own matter, tested on Mistral
@pytest.mark.parametrize(("backend", "name"), [("torch", "gqa"), ("torch", "minimal"), ("jax", "minimal")])
def test_greedy_tokens_are_transformers_and_logits_and_cache_within_bounds(llama_dirs, expected, backend, name):
    judge = Judge(llama_dirs[name], "float32")
    assert type(judge.truth) is LlamaForCausalLM, "the judge must be transformers' Llama, not a Mistral reading"
    result = run_tower(backend, llama_dirs[name])
    assert result.token_ids == expected[name]
    # every row decodes all its steps (no EOS among them): the logits compare step for step
    assert all(len(row) == NEW_TOKENS for row in expected[name])
    judge.check(result.step_logits, PROMPTS, expected[name], f"{backend} on the {name} Llama", result, "static")


# --- (d) `twincache generate --model DIR` ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend, mode", [("torch", "eager"), ("jax", "step")])
def test_cli_generate_on_a_llama_dir_is_transformers_greedy(llama_dirs, expected, capsys, backend, mode):
    ids = [arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))]
    code = cli.main(["generate", "--model", str(llama_dirs["minimal"]), *ids, "--max-new-tokens", str(NEW_TOKENS),
                     "--backend", backend, "--mode", mode, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out)
    assert (record["cache"], record["sliding_window"]) == ("static", None)
    assert [row["token_ids"] for row in record["rows"]] == expected["minimal"]


def test_cli_parity_on_a_llama_dir_judges_by_transformers_llama(llama_dirs, capsys):
    ids = [arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))]
    code = cli.main(["parity", "--model", str(llama_dirs["minimal"]), *ids, "--max-new-tokens", str(NEW_TOKENS),
                     "--modes", "torch:eager", "--cache", "static", "--json"])  # JAX's compiles: in (c)
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["reference"] == "transformers LlamaForCausalLM, float64, uncached"
    assert report["floor"] == "transformers LlamaForCausalLM, float32, uncached"
    assert report["passed"] and report["reference_self_disagreements"] == 0
    assert [row["name"] for row in report["rows"]] == ["transformers (floor)", "torch:eager"]


@pytest.mark.parametrize("backend, mode", [("torch", "eager"), ("jax", "step")])
def test_a_negative_pad_token_id_runs_as_transformers_runs_it(llama_dirs, tmp_path, capsys, backend, mode):
    """pad_token_id -1, as the original LLaMA conversions wrote it (LlamaConfig's first default): transformers loads
    the directory and decodes with it (its embedding counts a negative padding_idx from the end; no output changes).
    twincache refused it as outside the vocabulary; a left-padded batch now decodes transformers' tokens, row by row."""
    directory = shutil.copytree(llama_dirs["gqa"], tmp_path / "pad_minus_one")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "pad_token_id": -1}))
    expected = greedy_of(LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), PROMPTS, NEW_TOKENS)
    ids = [arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))]
    code = cli.main(["generate", "--model", str(directory), *ids, "--max-new-tokens", str(NEW_TOKENS),
                     "--backend", backend, "--mode", mode, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [row["token_ids"] for row in json.loads(out)["rows"]] == expected
