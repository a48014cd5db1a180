"""The parity matrix: every implementation through its real decode path, judged by the rule of `twincache parity`
(docs/design.md §4) against transformers' MistralForCausalLM: fp32 on CPU, at prefill, at every decode step and on the
final cache, through >= 3 window wraps (window 8, 30 new tokens).

Axes
  implementation  torch:compiled, torch:eager, jax:fused, jax:step
  cache           static, sliding_window
  prompt          shorter than W (5), equal to W (8), longer than W (13), a left-padded batch of lengths 13, 5 and 8
  config          gqa, mqa, explicit head_dim (24 != 64 / 4), tied embeddings

The full product is 4 x 2 x 4 x 4 = 128 cells, and each torch:compiled cell costs a compile (~15 s on 2 cores), so
the matrix is a pairwise covering array of 16 cells instead: every implementation meets every config exactly once,
prompts follow a Latin square over (implementation, config), and the cache column is chosen so that every pair of
values of any two axes appears in some cell (`test_cells_cover_every_pair_of_axes` checks this). Denser grids of
single axes live in test_torch_parity.py and test_jax_parity.py.

Each cell: transformers in float64 chooses the greedy continuation of each prompt (each row alone, unpadded, so it
builds its own positions), the implementation is teacher-forced with it through `generate(forced_tokens=...)`, and
its step logits and final K/V are judged against the float64 ones beside transformers' own fp32 distance (the
floor). A failure names the cell and the metrics out of bounds.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import torch_cache.generate as tg
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import WINDOW
from parity_tests.oracle import load_transformers
from torch_cache.model import Mistral as TorchMistral
from twincache_app import parity

NEW_TOKENS = 30
IMPLEMENTATIONS = parity.IMPLEMENTATIONS
CACHES = ("static", "sliding_window")
PROMPTS = {"shorter": [5], "equal": [WINDOW], "longer": [13], "batch": [13, 5, 8]}
CONFIGS = ("gqa", "mqa", "head_dim", "tied")

# (implementation, config, prompt, cache) by index: implementation x config complete, prompt = (i + j) % 4.
_DESIGN = [(0, 0, 0, 0), (0, 1, 1, 0), (0, 2, 2, 0), (0, 3, 3, 1), (1, 0, 1, 0), (1, 1, 2, 0), (1, 2, 3, 0),
           (1, 3, 0, 1), (2, 0, 2, 0), (2, 1, 3, 1), (2, 2, 0, 0), (2, 3, 1, 0), (3, 0, 3, 1), (3, 1, 0, 0),
           (3, 2, 1, 1), (3, 3, 2, 1)]
CELLS = [(IMPLEMENTATIONS[i], CACHES[c], list(PROMPTS)[p], CONFIGS[j]) for i, j, p, c in _DESIGN]


def test_cells_cover_every_pair_of_axes():
    axes = (IMPLEMENTATIONS, CACHES, tuple(PROMPTS), CONFIGS)
    for a, b in itertools.combinations(range(len(axes)), 2):
        missing = set(itertools.product(axes[a], axes[b])) - {(cell[a], cell[b]) for cell in CELLS}
        assert not missing, f"axes {a} and {b}: pairs {sorted(missing)} are in no cell"


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, Path]):
    """Each checkpoint's models (both towers, transformers fp32 as the floor and float64 as the reference), loaded
    once, and each (checkpoint, prompt)'s float64 reference, computed once."""
    models: dict[str, parity.Models] = {}
    references: dict[tuple[str, str], parity.Reference] = {}

    def load(config_name: str, prompt: str) -> tuple[parity.Models, list[list[int]], parity.Reference]:
        if config_name not in models:
            path = checkpoints[config_name]
            towers = {"torch": TorchMistral.from_pretrained(path), "jax": JaxMistral.from_pretrained(path)}
            models[config_name] = parity.Models(towers, load_transformers(path, "float32"),
                                                load_transformers(path, "float64"))
        prompts = prompts_for(prompt, models[config_name].towers["torch"].config.vocab_size)
        if (config_name, prompt) not in references:
            references[config_name, prompt] = parity.float64_reference(models[config_name].reference, prompts,
                                                                       NEW_TOKENS)
        return models[config_name], prompts, references[config_name, prompt]

    return load


def prompts_for(label: str, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(len(label))
    return [rng.integers(1, vocab, length).tolist() for length in PROMPTS[label]]


@pytest.mark.parametrize(("impl", "cache", "prompt", "config"), CELLS, ids=["-".join(cell) for cell in CELLS])
def test_cell_within_bounds_of_the_float64_truth(loaded, impl, cache, prompt, config, monkeypatch):
    models, prompts, reference = loaded(config, prompt)
    assert reference.self_disagreements == 0, "the float64 greedy loop and its uncached forward disagree"
    steps_asked: list[bool] = []  # how each torch decode step was asked for: compiled or not
    real_decode_one_fn = tg._decode_one_fn
    monkeypatch.setattr(tg, "_decode_one_fn", lambda model, compile: (steps_asked.append(compile),
                                                                      real_decode_one_fn(model, compile))[1])
    report = parity.parity_report(models, prompts, NEW_TOKENS, "float32", [cache], [impl], reference=reference)
    if impl.startswith("torch:"):  # the cell runs the decode path its name says
        assert steps_asked and set(steps_asked) == {impl == "torch:compiled"}, (impl, steps_asked)
    floor, row = report.rows
    assert (floor.kind, row.name, row.distance.steps, row.distance.rows) == ("floor", impl, NEW_TOKENS, len(prompts))
    assert not row.failed, (f"cell {impl}/{cache}/{prompt}/{config}: out of bounds on {row.failed}: "
                            f"{row.distance} against the floor {floor.distance}")
