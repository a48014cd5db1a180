"""Safe loading: pickled weights are refused without being unpickled, and no code path can unpickle or run remote code.

A trap file (a real torch.save file whose unpickling touches a sentinel) proves that nothing unpickles it: the control
test shows the trap fires under `torch.load(weights_only=False)`, the refusal tests show our loaders leave it alone.
A source scan guards the rest: no `torch.load` without `weights_only=True`, no pickle/dill/joblib loads, no
`numpy.load(allow_pickle=True)`, no `trust_remote_code` anywhere in the product code.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest

from parity_tests.test_cli_bad_inputs import write_trap_bin
from twincache.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ["twincache", "torch_cache", "jax_cache", "bench"]
CONVERT_HINT = "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"


BACKENDS = ["torch", "jax"]


def load_with_backends(model_dir: Path) -> None:
    """Every loader a user can reach: the shared checker, then each backend's from_pretrained."""
    from twincache.checkpoint import open_checkpoint

    open_checkpoint(model_dir)
    for backend in BACKENDS:
        if backend == "torch":
            from torch_cache.model import Mistral

            Mistral.from_pretrained(model_dir)
        else:
            from jax_cache.model import Mistral as JaxMistral

            JaxMistral.from_pretrained(model_dir)


def test_trap_fires_when_unpickled(tmp_path):
    """The control: the trap is armed, and weights_only=True (the only allowed torch.load) refuses it."""
    import pickle

    import torch

    sentinel = tmp_path / "unpickled"
    path = write_trap_bin(tmp_path, sentinel)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not sentinel.exists()
    torch.load(path, weights_only=False)  # what an unsafe loader would do
    assert sentinel.exists()


@pytest.mark.parametrize("names", [["pytorch_model.bin"], ["consolidated.00.pt"],
                                   ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]])
def test_only_pickled_weights_are_refused_with_how_to_convert(checkpoints, tmp_path, names: list[str]):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    shutil.copy(checkpoints["gqa"] / "config.json", model_dir)
    sentinel = tmp_path / "unpickled"
    for name in names:
        write_trap_bin(model_dir, sentinel, name)
    with pytest.raises(CheckpointError) as info:
        load_with_backends(model_dir)
    message = str(info.value)
    assert "twincache never unpickles" in message and CONVERT_HINT in message
    assert all(name in message for name in names)
    assert "\n" not in message
    assert not sentinel.exists(), "a loader unpickled the .bin"


def test_safetensors_win_over_a_pickled_file_beside_them(checkpoints, tmp_path):
    model_dir = shutil.copytree(checkpoints["gqa"], tmp_path / "both")
    sentinel = tmp_path / "unpickled"
    write_trap_bin(model_dir, sentinel)
    load_with_backends(model_dir)
    assert not sentinel.exists()


def test_index_pointing_at_a_pickled_shard_is_refused_unopened(checkpoints, tmp_path):
    """A safetensors index whose weight_map names a .bin: read as safetensors, refused as corrupt, never unpickled."""
    model_dir = shutil.copytree(checkpoints["sharded"], tmp_path / "index_to_bin")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    (model_dir / victim).unlink()
    sentinel = tmp_path / "unpickled"
    write_trap_bin(model_dir, sentinel, "pytorch_model-00001.bin")
    index["weight_map"] = {k: ("pytorch_model-00001.bin" if v == victim else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="pytorch_model-00001.bin is (corrupted|truncated)"):
        load_with_backends(model_dir)
    assert not sentinel.exists()


# --- source scan ------------------------------------------------------------------------------------------------------

_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "pandas"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def unsafe_calls(source: str, filename: str = "<string>") -> list[str]:
    """Findings in one file: unsafe deserialisation calls and any mention of trust_remote_code."""
    findings = []
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> dotted origin, from imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(
                    ".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        where = f"{filename}:{node.lineno}: {full}("
        if full in ("torch.load", "torch.serialization.load") and not _keyword_is_true(node, "weights_only"):
            findings.append(where + ") without weights_only=True")
        elif full.split(".")[0] in _PICKLE_MODULES and full.rsplit(".", 1)[-1] in ("load", "loads", "read_pickle",
                                                                                     "Unpickler"):
            findings.append(where + ") unpickles")
        elif full in ("numpy.load", "np.load") and _keyword_is_true(node, "allow_pickle"):
            findings.append(where + ") with allow_pickle=True")
        elif full.endswith("from_pretrained") and any(k.arg == "trust_remote_code" for k in node.keywords):
            findings.append(where + ") with trust_remote_code")
    for lineno, line in enumerate(source.splitlines(), 1):
        if re.search(r"trust_remote_code", line):
            findings.append(f"{filename}:{lineno}: mentions trust_remote_code")
    return findings


def product_files() -> list[Path]:
    return sorted(p for d in PRODUCT_DIRS if (REPO / d).is_dir() for p in (REPO / d).rglob("*.py"))


def test_scanner_catches_every_unsafe_form():
    bad = """
import torch, pickle
import numpy as np
from torch import load as tload
import dill as d
torch.load("x")
torch.load("x", weights_only=False)
tload("x")
pickle.loads(b"")
d.load(open("x", "rb"))
np.load("x.npy", allow_pickle=True)
AutoModel.from_pretrained("x", trust_remote_code=True)
"""
    findings = unsafe_calls(bad)
    assert len([f for f in findings if "weights_only" in f]) == 3
    assert len([f for f in findings if "unpickles" in f]) == 2
    assert len([f for f in findings if "allow_pickle" in f]) == 1
    assert any("trust_remote_code" in f for f in findings)
    good = 'import torch\nimport numpy as np\ntorch.load("x", weights_only=True)\nnp.load("x.npy")\n'
    assert unsafe_calls(good) == []


def test_product_code_never_unpickles_or_trusts_remote_code():
    files = product_files()
    scanned = {p.relative_to(REPO).parts[0] for p in files}
    assert set(PRODUCT_DIRS) <= scanned  # every product package is read: the scan is not vacuous
    assert any(p.name == "checkpoint.py" for p in files) and any(p.name == "model.py" for p in files)
    findings = [f for p in files for f in unsafe_calls(p.read_text(), str(p.relative_to(REPO)))]
    assert findings == []
