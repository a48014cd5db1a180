"""The parity matrix: every implementation against transformers' MistralForCausalLM, fp32 on CPU, at prefill and at
every decode step, through >= 3 window wraps (window 8, 30 new tokens).

Axes
  implementation  torch_eager, torch_compiled, jax_step, jax_fused (the reference, transformers, is in every cell)
  cache           static, sliding_window
  prompt          shorter than W (5), equal to W (8), longer than W (13), a left-padded batch of lengths 13, 5 and 8
  config          gqa, mqa, explicit head_dim (24 != 64 / 4), tied embeddings

The full product is 4 x 2 x 4 x 4 = 128 cells, and each torch_compiled cell costs a compile (~15 s on 2 cores), so
the matrix is a pairwise covering array of 16 cells instead: every implementation meets every config exactly once,
prompts follow a Latin square over (implementation, config), and the cache column is chosen so that every pair of
values of any two axes appears in some cell (`test_cells_cover_every_pair_of_axes` checks this). Denser grids of
single axes live in test_torch_parity.py and test_jax_parity.py.

Each cell generates greedily with return_logits, then transformers runs one uncached forward over the same prompt
plus generated tokens (teacher forcing). A failure names the cell, the row and the step.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MistralForCausalLM

import jax_cache.generate as jax_generate
import torch_cache.generate as torch_generate
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import WINDOW
from torch_cache.model import Mistral as TorchMistral
from twincache.generation import left_pad, positions_from_mask

ATOL = 1e-5
TOP1_MARGIN = 1e-4
NEW_TOKENS = 30
IMPLEMENTATIONS = ("torch_eager", "torch_compiled", "jax_step", "jax_fused")
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
    """Each checkpoint's three models, loaded once from the same directory."""
    cache: dict[str, tuple] = {}

    def load(config_name: str) -> tuple[TorchMistral, JaxMistral, MistralForCausalLM]:
        if config_name not in cache:
            path = checkpoints[config_name]
            cache[config_name] = (TorchMistral.from_pretrained(path), JaxMistral.from_pretrained(path),
                                  MistralForCausalLM.from_pretrained(path).eval())
        return cache[config_name]

    return load


def prompts_for(label: str, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(len(label))
    return [rng.integers(1, vocab, length).tolist() for length in PROMPTS[label]]


def run_implementation(impl: str, torch_model: TorchMistral, jax_model: JaxMistral, prompts: list[list[int]],
                       cache: str) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens per row and step logits [B, steps, V] of one implementation."""
    if impl.startswith("torch"):
        result = torch_generate.generate(torch_model, prompts, NEW_TOKENS, cache=cache, return_logits=True,
                                         compile=impl == "torch_compiled")
        return result.token_ids, result.step_logits.numpy()
    result = jax_generate.generate(jax_model, prompts, NEW_TOKENS, cache=cache, return_logits=True,
                                   fused=impl == "jax_fused")
    return result.token_ids, np.asarray(result.step_logits.astype(jnp.float32))


def reference_logits(reference: MistralForCausalLM, prompts: list[list[int]],
                     generated: list[list[int]]) -> np.ndarray:
    """transformers, one uncached forward over left-padded prompt + generated tokens: step logits [B, steps, V]."""
    ids, mask = left_pad([p + g for p, g in zip(prompts, generated, strict=True)], 0)  # [B, T + steps]
    positions = np.maximum(positions_from_mask(mask), 0)
    with torch.inference_mode():
        logits = reference(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                           position_ids=torch.from_numpy(positions).long()).logits
    steps = len(generated[0])
    return logits[:, -steps - 1:-1].float().numpy()  # the logits that predicted each generated token


@pytest.mark.parametrize(("impl", "cache", "prompt", "config"), CELLS, ids=["-".join(cell) for cell in CELLS])
def test_cell_matches_transformers_at_every_step(loaded, impl, cache, prompt, config):
    torch_model, jax_model, reference = loaded(config)
    prompts = prompts_for(prompt, torch_model.config.vocab_size)
    tokens, ours = run_implementation(impl, torch_model, jax_model, prompts, cache)
    assert all(len(row) == NEW_TOKENS for row in tokens), f"cell {impl}/{cache}/{prompt}/{config}: short rows"
    ref = reference_logits(reference, prompts, tokens)
    assert ours.shape == ref.shape, f"cell {impl}/{cache}/{prompt}/{config}: shapes {ours.shape} != {ref.shape}"
    diff = np.abs(ours - ref).max(axis=-1)  # [B, steps]
    for row, step in zip(*np.nonzero(diff > ATOL), strict=True):
        pytest.fail(f"cell {impl}/{cache}/{prompt}/{config}: row {row} (prompt length {len(prompts[row])}) step "
                    f"{step}: max |logit diff| {diff[row, step]:.3e} > {ATOL}")
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > TOP1_MARGIN  # [B, steps]
    mismatched = clear & (np.asarray(tokens) != ref.argmax(-1))
    for row, step in zip(*np.nonzero(mismatched), strict=True):
        pytest.fail(f"cell {impl}/{cache}/{prompt}/{config}: row {row} step {step}: greedy token {tokens[row][step]} "
                    f"!= transformers' {ref[row, step].argmax()} although its top-1 margin exceeds {TOP1_MARGIN}")
