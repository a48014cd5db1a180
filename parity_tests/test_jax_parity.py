"""jax_cache against the float64 truth and against torch_cache directly, fp32 on CPU, by the rule of
`twincache parity` (docs/design.md §4), at prefill, at every decode step and on the final cache; plus cached ==
uncached within jax_cache.

Teacher-forced: jax_cache's generate() records the logits of prefill and of every decode step (the fused loop, with
return_logits). torch_cache's generate is fed the same generated tokens (forced_tokens) through its own cache of the
same kind; transformers runs one uncached forward in float64 (the truth) and one in fp32 (the floor) over each
prompt + generated tokens (parity_tests/oracle.py); jax_cache runs one uncached forward into a fresh static cache over
the whole sequence. jax_cache against itself is an equivalence of one implementation on tiny fp32 models, where any
real bug moves a logit by far more than SAME_CODE_ATOL. Every checkpoint directory was written by transformers'
save_pretrained (eos_token_id None: every token is generated).
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

import torch_cache.generate as torch_generate
from jax_cache.cache import SlidingWindowCache, StaticCache
from jax_cache.generate import generate
from jax_cache.model import Mistral
from parity_tests.conftest import WINDOW
from parity_tests.oracle import Judge
from torch_cache.model import Mistral as TorchMistral

SAME_CODE_ATOL = 1e-5  # jax_cache against itself only (see the module docstring)
VOCAB = 128
NEW_TOKENS = 30  # with window 8, decoding from any prompt below writes ring slot 0 again at least 3 times
PROMPT_LENGTHS = {"shorter": 3, "equal": WINDOW, "longer": 13}
CACHES = ("static", "sliding_window")

# Full grid on GQA and MQA; the head_dim/tied variants and the window-less config get one cell per cache kind.
CELLS = ([(name, cache, label) for name in ("gqa", "mqa") for cache in CACHES for label in PROMPT_LENGTHS]
         + [("head_dim", "static", "longer"), ("tied", "sliding_window", "longer")]
         + [("no_window", "static", "shorter"), ("no_window", "static", "longer")])

def make_prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(1000 * seed + length).integers(1, VOCAB, length).tolist()


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]):
    """(jax_cache, torch_cache, judge) for a checkpoint name, each loaded once from the same directory."""
    loaded: dict[str, tuple[Mistral, TorchMistral, Judge]] = {}

    def load(name: str) -> tuple[Mistral, TorchMistral, Judge]:
        if name not in loaded:
            loaded[name] = (Mistral.from_pretrained(checkpoints[name], jnp.float32),
                            TorchMistral.from_pretrained(checkpoints[name], torch.float32),
                            Judge(checkpoints[name], "float32"))
        return loaded[name]

    return load


def assert_steps_close(ours: np.ndarray, ref: np.ndarray, cell: str, atol: float = SAME_CODE_ATOL) -> float:
    """[steps, V] each. Fail naming the cell and the first step whose max |logit diff| exceeds atol (0 = prefill)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{cell}: logits shape {list(ours.shape)} != reference {list(ref.shape)}"
    diffs = np.abs(ours - ref).max(axis=-1)
    diffs = np.where(np.isnan(diffs), np.inf, diffs)
    bad = np.flatnonzero(diffs > atol)
    if bad.size:
        step = int(bad[0])
        what = "prefill" if step == 0 else f"decode step {step}"
        pytest.fail(f"{cell}: step {step} ({what}) max |logit diff| = {diffs[step]:.3g} > {atol}; {bad.size} of "
                    f"{len(diffs)} steps fail, worst {diffs.max():.3g} at step {int(diffs.argmax())}")
    return float(diffs.max())


def decode_wraps(prompt_len: int, new_tokens: int, window: int = WINDOW) -> int:
    """Times decoding writes ring slot 0 again: decode steps write positions prompt_len .. prompt_len+new-2."""
    return sum(1 for p in range(prompt_len, prompt_len + new_tokens - 1) if p % window == 0)


def torch_cache_teacher_forced(model: TorchMistral, prompts: list[list[int]], generated: list[list[int]],
                               kind: str) -> np.ndarray:
    """torch_cache's logits for the steps that produced `generated`, fed those tokens through its own eager decode
    path and cache of `kind`. [B, steps, V]."""
    result = torch_generate.generate(model, prompts, len(generated[0]), cache=kind, compile=False,
                                     return_logits=True, forced_tokens=generated)
    assert result.token_ids == generated
    return result.step_logits.numpy()


UNCACHED_LEN = 48  # every sequence below (prompt <= 13, + 30 new) fits: one compiled uncached forward per model


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_cls"))
def _uncached_forward(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, mask: jax.Array,
                      cache_cls: type) -> jax.Array:
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)  # [1, L]
    return model(ids, positions, cache_cls(model.config, 1, ids.shape[1]), mask)[0]


def jax_uncached_logits(model: Mistral, prompt: list[int], generated: list[int],
                        cache_cls: type = StaticCache) -> np.ndarray:
    """One forward over the whole sequence into a fresh cache that holds all of it (padded at the end to a fixed
    length so it compiles once; the padding comes after every real token, so no real query can see it). [steps, V]"""
    full = prompt + generated
    ids = np.zeros((1, UNCACHED_LEN), np.int32)
    mask = np.zeros((1, UNCACHED_LEN), np.int32)
    ids[0, : len(full)], mask[0, : len(full)] = full, 1
    graphdef, state = nnx.split(model)
    logits = _uncached_forward(graphdef, state, jnp.asarray(ids), jnp.asarray(mask), cache_cls)  # [1, L, V]
    return np.asarray(logits[0, len(prompt) - 1: len(prompt) - 1 + len(generated)])


@pytest.mark.parametrize(("name", "cache", "label"), CELLS)
def test_logits_match_torch_cache_and_transformers_at_prefill_and_every_decode_step(models, name, cache, label):
    prompt_len = PROMPT_LENGTHS[label]
    cell = f"checkpoint={name} cache={cache} prompt_len={prompt_len} ({label} than window {WINDOW})"
    ours, torch_model, judge = models(name)
    prompt = make_prompt(prompt_len)
    result = generate(ours, [prompt], NEW_TOKENS, cache=cache, return_logits=True)
    assert result.cache_kind == cache and result.cache.kind == cache
    generated = result.token_ids[0]
    assert len(generated) == NEW_TOKENS, f"{cell}: eos_token_id is None, so every token must be generated"
    assert decode_wraps(prompt_len, NEW_TOKENS) >= 3
    if cache == "sliding_window":
        assert result.cache.cache_len == WINDOW, f"{cell}: the ring must hold exactly the window"
    jax_logits = np.asarray(result.step_logits[0])  # [steps, V]
    assert jax_logits.shape == (NEW_TOKENS, VOCAB)

    judge.check(result.step_logits, [prompt], [generated], f"{cell} vs the float64 truth", result, cache)
    torch_logits = torch_cache_teacher_forced(torch_model, [prompt], [generated], cache)
    judge.check_pair(torch_logits, result.step_logits, [prompt], [generated], f"{cell}: torch_cache vs jax_cache")
    expected = jax_uncached_logits(ours, prompt, generated)
    assert_steps_close(jax_logits, expected, f"{cell} vs one uncached forward")


@pytest.mark.parametrize("cache", CACHES)
def test_left_padded_batch_matches_each_row_alone(models, cache):
    """Rows shorter than, equal to and longer than the window, left-padded into one batch (and to the prefill
    bucket): the batch is within bounds of the float64 truth of each row alone (unpadded) and of torch_cache's
    logits on the same padded batch, so padding changes nothing."""
    ours, torch_model, judge = models("gqa")
    prompts = [make_prompt(13, seed=3), make_prompt(3, seed=3), make_prompt(WINDOW, seed=3)]
    result = generate(ours, prompts, NEW_TOKENS, cache=cache, return_logits=True)
    assert [len(row) for row in result.token_ids] == [NEW_TOKENS] * 3
    assert result.prompt_ids == prompts
    assert all(decode_wraps(len(prompt), NEW_TOKENS) >= 3 for prompt in prompts)
    cell = f"checkpoint=gqa cache={cache} left-padded batch of prompt lengths {[len(p) for p in prompts]}"
    judge.check(result.step_logits, prompts, result.token_ids, f"{cell} vs the float64 truth", result, cache)
    torch_logits = torch_cache_teacher_forced(torch_model, prompts, result.token_ids, cache)
    judge.check_pair(torch_logits, result.step_logits, prompts, result.token_ids, f"{cell}: torch_cache vs jax_cache")


@pytest.mark.parametrize("cache_cls", [StaticCache, SlidingWindowCache])
def test_cached_decode_equals_uncached_full_forward_into_either_cache(models, cache_cls):
    """A prefill longer than the window into a fresh cache of either kind gives the same logits as cached decoding."""
    ours, _, _ = models("mqa")
    prompt = make_prompt(13, seed=4)
    result = generate(ours, [prompt], NEW_TOKENS, cache="sliding_window", fused=False, return_logits=True)
    expected = jax_uncached_logits(ours, prompt, result.token_ids[0], cache_cls)
    assert_steps_close(np.asarray(result.step_logits[0]), expected,
                       f"step-mode sliding cache vs one {cache_cls.__name__} forward")


def test_static_cache_on_windowed_config_applies_the_window(models):
    """The window is the model's rule, not the cache's: past the window, logits differ from a window-less config."""
    ours, _, judge = models("gqa")
    prompt = make_prompt(3, seed=5)
    result = generate(ours, [prompt], NEW_TOKENS, cache="static", return_logits=True)
    jax_logits = np.asarray(result.step_logits[0])
    judge.check(result.step_logits, [prompt], result.token_ids, "checkpoint=gqa cache=static prompt_len=3", result,
                "static")
    weights = {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(ours))}
    no_window = Mistral.from_weights(dataclasses.replace(ours.config, sliding_window=None), weights)
    unwindowed = jax_uncached_logits(no_window, prompt, result.token_ids[0])
    beyond = [s for s in range(NEW_TOKENS) if 2 + s >= WINDOW]  # step s predicts from position 2 + s
    inside = [s for s in range(NEW_TOKENS) if 2 + s < WINDOW]
    assert np.abs(jax_logits[inside] - unwindowed[inside]).max() <= SAME_CODE_ATOL
    assert np.abs(jax_logits[beyond] - unwindowed[beyond]).max(axis=-1).min() > 1e-3, (
        "past the window the logits must differ from a model without a window, else the window is not applied")
