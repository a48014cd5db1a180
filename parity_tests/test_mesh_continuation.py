"""A generation continued on a data-split mesh whose batch generate padded (docs/design.md §10): generate's result
holds the real rows only and its cache the padding copies too, so continuing from the result's last tokens, as the
README shows, must decode the real rows on (not be refused for a batch of 3 against a cache of 4). JAX runs on 2
simulated CPU devices in a subprocess, so the rest of the suite keeps one device; transformers' greedy generate of
the whole length is the oracle. A torch cache of 3 rows handed to that mesh (cache_from_torch) continues alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import MistralForCausalLM

from parity_tests import background
from parity_tests.conftest import save_hf_checkpoint

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 7], [1, 5], [1, 8, 8]]  # 3 rows on data=2: generate pads a copy of the last row
FIRST, MORE, BACK = 4, 5, 2  # tokens: torch or JAX first, JAX on the mesh, then torch again (the handoff back)

_WORKER = """
import json, sys
from jax_cache import backend, generate
from twincache.mesh import parse_mesh
model = backend.load(sys.argv[1], "float32", mesh=parse_mesh("data=2"))
prompts = json.loads(sys.argv[2])
for mode in ("step", "fused"):
    first = backend.generate(model, prompts, {first}, mode=mode, cache="sliding_window")
    more = generate.continue_generation(model, first.cache, [row[-1] for row in first.token_ids], {more},
                                        fused=mode == "fused")
    print(json.dumps([list(a) + list(b) for a, b in zip(first.token_ids, more.token_ids)]))
# torch decodes the first tokens on one device; its cache of 3 rows continues on the data split (padded there)
import torch_cache.generate as tg
from torch_cache.model import Mistral as TorchMistral
from twincache_app.handoff import cache_from_torch, cache_to_torch
torch_model = TorchMistral.from_pretrained(sys.argv[1])
torch_first = tg.generate(torch_model, prompts, {first}, cache="sliding_window", compile=False)
cache = cache_from_torch(torch_first.cache, model.config, model.mesh)
more = generate.continue_generation(model, cache, [row[-1] for row in torch_first.token_ids], {more}, fused=False)
# and back to torch: the mesh's cache holds 4 rows, the padding copy dropped (batch_size), torch decodes on
back = cache_to_torch(more.cache, model.config, batch_size=len(prompts))
last = tg.continue_generation(torch_model, back, [row[-1] for row in more.token_ids], {back}, compile=False)
print(json.dumps([list(a) + list(b) + list(c) for a, b, c in zip(torch_first.token_ids, more.token_ids,
                                                                  last.token_ids)]))
"""


@background.job
def continued(request: pytest.FixtureRequest) -> Callable[[], tuple[Path, subprocess.CompletedProcess]]:
    """The worker above on a fresh checkpoint, a process only: it runs in the test lane (parity_tests/background.py)."""
    model_dir = save_hf_checkpoint(request.getfixturevalue("tmp_path_factory").mktemp("gqa"), seed=3,
                                   sliding_window=4)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}

    def run() -> tuple[Path, subprocess.CompletedProcess]:
        return model_dir, subprocess.run(
            [sys.executable, "-c", _WORKER.format(first=FIRST, more=MORE, back=BACK), str(model_dir),
             json.dumps(PROMPTS)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    return run


def test_jax_continues_a_padded_batch_on_a_data_split(continued: tuple[Path, subprocess.CompletedProcess]):
    model_dir, proc = continued
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = MistralForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=FIRST + MORE + BACK, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3
    for line in lines[:2]:  # step, fused
        assert json.loads(line) == [row[:FIRST + MORE] for row in expected]
    assert json.loads(lines[2]) == expected  # a torch cache handed to the mesh, and back to torch
