"""dtype "auto" (`backend.load(path, "auto")`, `--dtype auto`): the dtype transformers' from_pretrained loads a
checkpoint in by default (its `dtype="auto"`), judged by transformers itself on checkpoints it saved: config.json's
field when there is one (`dtype`, or `torch_dtype` in older files, even against the weights), else the weights'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parity_tests.conftest import save_hf_checkpoint
from twincache.checkpoint import stored_dtype
from twincache_app import cli
from twincache_app.backends import BACKENDS


def rewrite_config(directory: Path, edit: dict[str, object]) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (directory / "config.json").write_text(json.dumps({**config, **edit}))
    return directory


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stored_dtype")
    bf16 = checkpoints["bf16_stored"]
    return {
        "float32": checkpoints["gqa"],
        "bfloat16": bf16,
        "float16": save_hf_checkpoint(root / "float16", seed=3, dtype="float16"),
        # no field: the weights decide
        "bf16_weights_no_field": rewrite_config(Path(shutil.copytree(bf16, root / "no_field")), {}),
        # an older file's field, naming another dtype than the weights': the field decides
        "torch_dtype_field": rewrite_config(Path(shutil.copytree(bf16, root / "old_field")),
                                            {"torch_dtype": "float16"}),
    }


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "bf16_weights_no_field", "torch_dtype_field"])
def test_auto_is_the_dtype_transformers_loads_the_checkpoint_in(stored, name):
    from transformers import AutoModelForCausalLM

    theirs = str(AutoModelForCausalLM.from_pretrained(stored[name], dtype="auto").dtype).removeprefix("torch.")
    assert stored_dtype(stored[name]) == theirs
    expected = {"bf16_weights_no_field": "bfloat16", "torch_dtype_field": "float16"}.get(name, name)
    assert theirs == expected, "the case is what its name says (else it judges nothing new)"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_load_auto_holds_the_stored_dtype(stored, backend):
    model = BACKENDS[backend].module().load(stored["bfloat16"], "auto")
    assert str(model.dtype).removeprefix("torch.") == "bfloat16"


def test_cli_dtype_auto_reports_the_dtype_it_ran_in(stored, capsys):
    code = cli.main(["generate", "--model", str(stored["float16"]), "--prompt-ids", "1,5,9", "--max-new-tokens", "2",
                     "--backend", "torch", "--mode", "eager", "--dtype", "auto", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["dtype"] == "float16"


def test_a_float64_checkpoint_is_refused_in_one_line_naming_what_to_give(tmp_path, capsys):
    directory = save_hf_checkpoint(tmp_path / "float64", dtype="float64")
    capsys.readouterr()  # save_pretrained's progress bar
    code = cli.main(["generate", "--model", str(directory), "--prompt-ids", "1,5", "--max-new-tokens", "1",
                     "--mode", "eager", "--dtype", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "stored in float64 (config.json's dtype)" in err and "give --dtype float32" in err, err
