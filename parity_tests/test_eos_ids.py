"""Several EOS ids (`eos_token_id` a list, as transformers' MistralConfig takes it): every decode path stops a row
at any of them, where transformers' `generate(..., eos_token_id=[a, b])` stops it; configs read them as transformers
does, generation_config.json included.

The oracle is transformers alone: the two ids are picked from its own greedy runs of a tiny checkpoint, so that in
one left-padded batch rows end at `a` and at `b`, at different steps (one at its first token), and each row's
expected tokens are its `generate` run alone. One compiled torch generation (~20 s of compile on 2 cores); the rest
is eager or JAX (seconds).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import MistralForCausalLM

from twincache.checkpoint import load_config
from twincache.config import MistralConfig
from twincache.errors import ConfigError

VOCAB = 128
NEW_TOKENS = 16
PROMPTS = [np.random.default_rng(35).integers(1, VOCAB, n).tolist() for n in (3, 9, 14, 5, 11)]  # window 8: wraps


def hf_generate(hf: MistralForCausalLM, prompt: list[int], **kwargs: object) -> list[int]:
    """transformers' greedy new tokens for one prompt alone (its own positions, no padding)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def first_stop(row: list[int], ids: set[int]) -> int | None:
    return next((step for step, token in enumerate(row) if token in ids), None)


@pytest.fixture(scope="module")
def hf_model(checkpoints: dict[str, Path]) -> MistralForCausalLM:
    return MistralForCausalLM.from_pretrained(checkpoints["gqa"]).eval()


@pytest.fixture(scope="module")
def eos_pair(hf_model: MistralForCausalLM) -> tuple[int, int]:
    """Two ids `a, b` that transformers' greedy runs of PROMPTS emit, such that with eos_token_id=[a, b] every row
    stops before the budget, each row that stops after its first token at its own step, and a check of one id alone
    changes the outcome:
    - a row's first token (the prefill's) is `b`: it is finished before the first decode step;
    - a row stops at `a` after its first token;
    - a row stops at `b` after its first token while another decodes on: it must emit `a` from then on;
    - the last row to stop stops at `b`, while the rows already stopped emit `a`: the batch must end there."""
    free = [hf_generate(hf_model, prompt, eos_token_id=None) for prompt in PROMPTS]
    assert all(len(row) == NEW_TOKENS for row in free)
    for b in sorted({row[0] for row in free}):
        for a in sorted(set(itertools.chain(*free)) - {b}):
            stops = [first_stop(row, {a, b}) for row in free]
            if None in stops or max(stops) >= NEW_TOKENS - 1:
                continue
            ends = [row[stop] for row, stop in zip(free, stops)]
            later = sorted((stop, end) for stop, end in zip(stops, ends) if stop >= 1)  # by step
            if ((0, b) in zip(stops, ends) and len({stop for stop, _ in later}) == len(later) >= 3
                    and a in [end for _, end in later] and b in [end for _, end in later[:-1]] and later[-1][1] == b):
                return a, b
    raise AssertionError(f"no pair of ids of {free} fits; change PROMPTS")


@pytest.fixture(scope="module")
def expected(hf_model: MistralForCausalLM, eos_pair: tuple[int, int]) -> list[list[int]]:
    """Each row as transformers' generate gives it with eos_token_id=[a, b]: up to and including its first EOS."""
    rows = [hf_generate(hf_model, prompt, eos_token_id=list(eos_pair)) for prompt in PROMPTS]
    assert all(row[-1] in eos_pair and len(row) < NEW_TOKENS for row in rows)
    return rows


@pytest.fixture(scope="module")
def eos_dir(hf_model: MistralForCausalLM, eos_pair: tuple[int, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gqa checkpoint as transformers saves it with eos_token_id=[a, b] (config.json and generation_config.json)."""
    directory = tmp_path_factory.mktemp("eos_ids") / "gqa_two_eos"
    hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = list(eos_pair)
    try:
        hf_model.save_pretrained(directory)
    finally:
        hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = None
    assert json.loads((directory / "config.json").read_text())["eos_token_id"] == list(eos_pair)
    return directory


# --- every decode path ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["torch_eager", "torch_compiled", "jax_step", "jax_fused"])
def test_each_row_stops_at_whichever_eos_id_it_reaches_first(eos_dir, eos_pair, expected, path):
    streamed: list[list[int]] = []
    if path.startswith("torch"):
        from torch_cache.generate import continue_generation, generate
        from torch_cache.model import Mistral

        model = Mistral.from_pretrained(eos_dir)
        result = generate(model, PROMPTS, NEW_TOKENS, compile=path == "torch_compiled", on_token=streamed.append)
        if path == "torch_compiled":  # teacher forcing stops nowhere, yet runs the same step graph: no recompile
            with torch.compiler.set_stance("fail_on_recompile"):
                continue_generation(model, result.cache, [1] * len(PROMPTS), 2, forced_tokens=[[2, 3]] * len(PROMPTS))
    else:
        from jax_cache.generate import generate
        from jax_cache.model import Mistral as JaxMistral

        jax_model = JaxMistral.from_pretrained(eos_dir)
        result = generate(jax_model, PROMPTS, NEW_TOKENS, fused=path == "jax_fused", on_token=streamed.append)
    assert result.token_ids == expected, f"{path}: eos_token_id={list(eos_pair)}"
    assert len(streamed) == max(map(len, expected)), "the batch ends once every row has reached an EOS id"
    for row, want in enumerate(expected):
        after = [step[row] for step in streamed[len(want):]]
        assert after == [eos_pair[0]] * len(after), f"{path} row {row}: a finished row streams the first EOS id"


# --- reading the ids --------------------------------------------------------------------------------------------------


def _raw(checkpoints: dict[str, Path], eos: object) -> dict:
    return json.loads((checkpoints["gqa"] / "config.json").read_text()) | {"eos_token_id": eos}


@pytest.mark.parametrize("eos", [[5, 7], [5], 5, None])
def test_eos_token_id_reads_as_transformers_reads_it(checkpoints, eos):
    from transformers import MistralConfig as HFMistralConfig

    config = MistralConfig.from_dict(_raw(checkpoints, eos))
    hf_eos = HFMistralConfig(**_raw(checkpoints, eos)).eos_token_id
    assert config.eos_token_ids == tuple([] if hf_eos is None else hf_eos if isinstance(hf_eos, list) else [hf_eos])
    assert config.eos_token_id == (tuple(eos) if isinstance(eos, list) else eos), "an int stays an int"
    assert HFMistralConfig(**config.to_hf_dict()).eos_token_id == hf_eos, "written back as transformers reads it"
    assert hash(config) == hash(MistralConfig.from_dict(_raw(checkpoints, eos))), "hashable: a jit static argument"


@pytest.mark.parametrize(("eos", "fragments"), [
    ([], ["eos_token_id=[] lists no ids", "or null for no EOS"]),
    ([2, True], ["eos_token_id=[2, True] must list integers", "item 1 is a boolean"]),
    ([2, 3.0], ["eos_token_id=[2, 3.0] must list integers", "item 1 is a float"]),
    ([2, "3"], ["eos_token_id=[2, '3'] must list integers", "item 1 is a string"]),
    ([[2]], ["eos_token_id=[[2]] must list integers", "item 0 is a list"]),
    ([2, VOCAB], [f"eos_token_id=[2, {VOCAB}] lists {VOCAB}", f"outside the vocabulary [0, {VOCAB})"]),
    ([-1, 2], ["lists -1, outside the vocabulary"]),
], ids=["empty", "bool", "float", "string", "nested", "past_vocab", "negative"])
def test_a_bad_list_of_eos_ids_is_refused_naming_it(checkpoints, eos, fragments):
    with pytest.raises(ConfigError) as info:
        MistralConfig.from_dict(_raw(checkpoints, eos))
    for fragment in fragments:
        assert fragment in str(info.value)


def _with_files(checkpoints: dict[str, Path], directory: Path, config_eos: object,
                generation: dict | str | None) -> Path:
    """The gqa checkpoint with config.json's eos_token_id set and generation_config.json as given (None: no file)."""
    shutil.copytree(checkpoints["gqa"], directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(raw | {"eos_token_id": config_eos}))
    (directory / "generation_config.json").unlink()
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (directory / "generation_config.json").write_text(text)
    return directory


@pytest.mark.parametrize("generation", [{"eos_token_id": [5, 7]}, {"eos_token_id": 7}, {"bos_token_id": 1},
                                        {"eos_token_id": None}, None],
                         ids=["list", "int", "no_eos_field", "null", "no_file"])
def test_a_checkpoint_stops_at_the_ids_transformers_generate_takes(checkpoints, tmp_path, generation):
    """transformers' from_pretrained reads generation_config.json, when there is one, into the generation config its
    generate stops with, instead of config.json's eos_token_id (9 here)."""
    directory = _with_files(checkpoints, tmp_path / "model", 9, generation)
    hf_eos = MistralForCausalLM.from_pretrained(directory).generation_config.eos_token_id
    hf_ids = tuple([] if hf_eos is None else hf_eos if isinstance(hf_eos, list) else [hf_eos])
    assert load_config(directory).eos_token_ids == hf_ids


@pytest.mark.parametrize(("generation", "fragments"), [
    ("{not json", ["generation_config.json is not valid JSON"]),
    ("[2]", ["generation_config.json must hold a JSON object of fields, not a list"]),
    ({"eos_token_id": [2, VOCAB]}, ["generation_config.json: config eos_token_id=[2, 128] lists 128",
                                    "fix or remove the file"]),
    ({"eos_token_id": []}, ["generation_config.json: config field eos_token_id=[] lists no ids"]),
], ids=["not_json", "not_object", "past_vocab", "empty"])
def test_a_bad_generation_config_is_refused_naming_the_file(checkpoints, tmp_path, generation, fragments):
    directory = _with_files(checkpoints, tmp_path / "model", 2, generation)
    with pytest.raises(ConfigError) as info:
        load_config(directory)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_cli_stops_where_transformers_generate_stops_on_the_same_directory(checkpoints, tmp_path, capsys,
                                                                               eos_pair):
    """config.json names `a` alone, generation_config.json `[a, b]`: transformers' generate on the directory (its own
    settings, no eos argument) stops rows at `b` too, and so must `twincache generate --model DIR`."""
    from twincache_app import cli

    a, b = eos_pair
    directory = _with_files(checkpoints, tmp_path / "model", a, {"bos_token_id": 1, "eos_token_id": [a, b]})
    hf = MistralForCausalLM.from_pretrained(directory).eval()
    want = [hf_generate(hf, prompt) for prompt in PROMPTS]
    assert b in [row[-1] for row in want], "a row ends at the id only generation_config.json names"
    args = ["generate", "--backend", "torch", "--mode", "eager", "--model", str(directory), "--json",
            "--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    assert cli.main(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["token_ids"] for row in rows] == want
