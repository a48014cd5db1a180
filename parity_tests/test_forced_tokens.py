"""Teacher forcing through the real decode paths: `generate(..., forced_tokens=...)` and
`continue_generation(..., forced_tokens=...)`, mirrored in torch_cache (eager step) and jax_cache (jitted step and
fused while loop). `twincache parity` feeds every implementation the float64 truth's tokens this way.

Eager torch only here: the compiled torch step is the same function `decode_step_fn` compiles, and the parity
matrix runs it forced (test_parity_matrix.py, checking the emitted tokens equal the forced ones).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_cache.cache as jax_caches
import jax_cache.generate as jax_generate
import torch_cache.cache as torch_caches
import torch_cache.generate as torch_generate
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import record_fused_blocks
from torch_cache.model import Mistral as TorchMistral
from twincache.errors import InputError

VOCAB = 128
NEW_TOKENS = 12
PATHS = ("torch_eager", "jax_step", "jax_fused")
PROMPTS = [np.random.default_rng(5).integers(1, VOCAB, 11).tolist(), [7, 8, 9]]  # left-padded together
FORCED = np.random.default_rng(6).integers(1, VOCAB, (2, NEW_TOKENS)).tolist()  # not what greedy would pick


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, object]:
    return {"torch": TorchMistral.from_pretrained(checkpoints["gqa"]),
            "jax": JaxMistral.from_pretrained(checkpoints["gqa"], jnp.float32)}


def run(models: dict, path: str, prompts: list[list[int]], steps: int, **kwargs: object):
    if path == "torch_eager":
        return torch_generate.generate(models["torch"], prompts, steps, compile=False, return_logits=True, **kwargs)
    return jax_generate.generate(models["jax"], prompts, steps, fused=path == "jax_fused", return_logits=True,
                                 **kwargs)


def logits_of(result) -> np.ndarray:
    logits = result.step_logits
    return logits.numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits)


def uncached(models: dict, path: str, sequence: list[int]) -> np.ndarray:
    """One forward of the same model over a whole sequence into a fresh static cache. [len, V]"""
    if path == "torch_eager":
        model = models["torch"]
        with torch.inference_mode():
            return model(torch.tensor([sequence]), torch.arange(len(sequence))[None],
                         torch_caches.StaticCache(model.config, 1, len(sequence)))[0].numpy()
    graphdef, state = nnx.split(models["jax"])
    return np.asarray(_jax_forward(graphdef, state, jnp.asarray([sequence], jnp.int32))[0])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _jax_forward(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]  # [1, L]
    return model(ids, positions, jax_caches.StaticCache(model.config, 1, ids.shape[1]))[0]


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
@pytest.mark.parametrize("path", PATHS)
def test_forced_tokens_are_emitted_and_fed(models, path, cache):
    """Each row emits its forced tokens, and each step's logits are those of the model fed exactly those tokens."""
    result = run(models, path, PROMPTS, NEW_TOKENS, cache=cache, forced_tokens=FORCED)
    assert result.token_ids == FORCED
    ours = logits_of(result)  # [B, N, V]
    for row, prompt in enumerate(PROMPTS):
        expected = uncached(models, path, prompt + FORCED[row])[len(prompt) - 1:-1]  # [N, V]
        np.testing.assert_allclose(ours[row], expected, rtol=0, atol=1e-5, err_msg=f"{path} {cache} row {row}")


@pytest.mark.parametrize("path", PATHS)
def test_forcing_the_greedy_tokens_changes_nothing(models, path):
    """Forced with its own greedy choice, a path computes exactly what it computes unforced."""
    free = run(models, path, PROMPTS, NEW_TOKENS, cache="sliding_window")
    forced = run(models, path, PROMPTS, NEW_TOKENS, cache="sliding_window", forced_tokens=free.token_ids)
    assert forced.token_ids == free.token_ids
    np.testing.assert_array_equal(logits_of(forced), logits_of(free))


@pytest.mark.parametrize("path", PATHS)
def test_eos_ends_no_forced_row(models, path):
    """The caller chose the sequence: a forced EOS is fed on like any token, and every row gets all its steps."""
    tower = models["torch" if path.startswith("torch") else "jax"]
    eos = FORCED[0][2]
    original = tower.config
    tower.config = dataclasses.replace(original, eos_token_id=eos)
    try:
        forced = run(models, path, PROMPTS, NEW_TOKENS, forced_tokens=FORCED)
    finally:
        tower.config = original
    assert forced.token_ids == FORCED and forced.decode_steps == NEW_TOKENS - 1


def tower_of(models: dict, tower: str) -> tuple:
    """(generate module, cache module, model, the eager/step-mode keyword of that tower)."""
    if tower == "torch":
        return torch_generate, torch_caches, models["torch"], {"compile": False}
    return jax_generate, jax_caches, models["jax"], {"fused": False}


@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_continue_generation_takes_forced_tokens(models, tower):
    module, cache_module, model, mode = tower_of(models, tower)
    first = module.generate(model, [PROMPTS[0]], 1, cache="static", max_cache_len=32, **mode)
    rest = module.continue_generation(model, first.cache, first.token_ids[0], 5, forced_tokens=[FORCED[0][:5]],
                                      **mode)
    assert rest.token_ids == [FORCED[0][:5]] and isinstance(rest.cache, cache_module.StaticCache)


@pytest.mark.parametrize("forced", [[[1] * NEW_TOKENS], [[1] * NEW_TOKENS, [1] * (NEW_TOKENS - 1)],
                                    [[1] * NEW_TOKENS, [VOCAB] + [1] * (NEW_TOKENS - 1)],
                                    [[1] * NEW_TOKENS, [-1] + [1] * (NEW_TOKENS - 1)]],
                         ids=["one_row_for_two", "short_row", "id_too_large", "negative_id"])
@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_bad_forced_tokens_are_refused_before_anything_changes(models, tower, forced):
    module, cache_module, model, mode = tower_of(models, tower)
    cache = module.generate(model, PROMPTS, 3, cache="static", max_cache_len=40, **mode).cache
    length = int(cache.length)
    with pytest.raises(InputError, match="forced_tokens"):
        module.generate(model, PROMPTS, NEW_TOKENS, cache=cache, forced_tokens=forced, **mode)
    assert int(cache.length) == length, "a refused call changed the cache"
    assert isinstance(cache, cache_module.StaticCache)


@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_forced_tokens_that_are_not_rows_are_refused_even_for_no_new_tokens(models, tower):
    """With max_new_tokens=0 the rows went unchecked: an int raised TypeError, a 0-d array 'iteration over a 0-d
    array', and a string was counted as rows of letters ('forced_tokens has 2 rows of lengths [1]')."""
    module, _, model, mode = tower_of(models, tower)
    for steps in (0, 2):
        for forced in ("ab", 5, np.asarray(5)):
            with pytest.raises(InputError, match=f"^forced_tokens must be a list of token-id lists.*not "
                                                 f"{type(forced).__name__}$"):
                module.generate(model, [[7, 8]], steps, forced_tokens=forced, **mode)
    assert module.generate(model, [[7, 8]], 0, forced_tokens=[[]], **mode).token_ids == [[]]


def test_forced_tokens_cross_fused_block_boundaries(models, monkeypatch):
    """The fused mode runs its loop in blocks (jax_cache.generate.FUSED_BLOCK_STEPS, here 4 steps) and hands each
    block its slice of the forced tokens: with 11 decode steps in blocks of 4, 4 and 3, every step still emits and
    feeds its own forced token, and each step's logits are those of the model fed exactly those tokens."""
    monkeypatch.setattr(jax_generate, "FUSED_BLOCK_STEPS", 4)
    blocks = record_fused_blocks(monkeypatch, jax_generate)
    result = run(models, "jax_fused", PROMPTS, NEW_TOKENS, cache="sliding_window", forced_tokens=FORCED)
    assert len(blocks) >= 3 and max(blocks) <= 4 and sum(blocks) == NEW_TOKENS - 1, blocks
    assert result.token_ids == FORCED
    ours = logits_of(result)  # [B, N, V]
    for row, prompt in enumerate(PROMPTS):
        expected = uncached(models, "jax_fused", prompt + FORCED[row])[len(prompt) - 1:-1]  # [N, V]
        np.testing.assert_allclose(ours[row], expected, rtol=0, atol=1e-5, err_msg=f"row {row}")


@pytest.mark.parametrize("path", PATHS)
def test_forced_tokens_after_a_chunked_prefill(models, path):
    """A prompt prefilled in chunks of 4 columns (the 11-token row in three chunks; the 3-token row's first chunk is
    all padding), then forced: the same tokens and the logits of the model fed exactly that sequence."""
    result = run(models, path, PROMPTS, NEW_TOKENS, cache="sliding_window", forced_tokens=FORCED, prefill_chunk=4)
    assert result.token_ids == FORCED
    ours = logits_of(result)  # [B, N, V]
    for row, prompt in enumerate(PROMPTS):
        expected = uncached(models, path, prompt + FORCED[row])[len(prompt) - 1:-1]  # [N, V]
        np.testing.assert_allclose(ours[row], expected, rtol=0, atol=1e-5, err_msg=f"{path} row {row}")
