"""jax_cache against torch_cache and against transformers' MistralForCausalLM, fp32 on CPU: max |logit diff| <= 1e-5
at prefill and at every decode step, plus cached == uncached within jax_cache.

Teacher-forced: jax_cache's generate() records the logits of prefill and of every decode step (the fused loop, with
return_logits). torch_cache is fed the same prompt and the same generated tokens through its own cache of the same
kind, one cached step at a time; transformers runs one uncached forward over prompt + generated tokens (it applies the
sliding window itself); jax_cache runs one uncached forward into a fresh static cache over the whole sequence.
Every checkpoint directory was written by transformers' save_pretrained (eos_token_id None: every token is generated).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import MistralForCausalLM

import torch_cache.cache as torch_caches
import torch_cache.generate as torch_generate
from jax_cache.cache import SlidingWindowCache, StaticCache
from jax_cache.generate import generate
from jax_cache.model import Mistral
from parity_tests.conftest import WINDOW
from torch_cache.model import Mistral as TorchMistral
from twincache.generation import left_pad, pad_token_id, plan_cache

ATOL = 1e-5
VOCAB = 128
NEW_TOKENS = 30  # with window 8, decoding from any prompt below writes ring slot 0 again at least 3 times
PROMPT_LENGTHS = {"shorter": 3, "equal": WINDOW, "longer": 13}
CACHES = ("static", "sliding_window")

# Full grid on GQA and MQA; the head_dim/tied variants and the window-less config get one cell per cache kind.
CELLS = ([(name, cache, label) for name in ("gqa", "mqa") for cache in CACHES for label in PROMPT_LENGTHS]
         + [("head_dim", "static", "longer"), ("tied", "sliding_window", "longer")]
         + [("no_window", "static", "shorter"), ("no_window", "static", "longer")])

# Worst |diff| per (reference, cache kind), printed at the end of the module (pytest -s) for the report.
WORST: dict[tuple[str, str], float] = {}


def make_prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(1000 * seed + length).integers(1, VOCAB, length).tolist()


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]):
    """(jax_cache, torch_cache, transformers) for a checkpoint name, each loaded once from the same directory."""
    loaded: dict[str, tuple[Mistral, TorchMistral, MistralForCausalLM]] = {}

    def load(name: str) -> tuple[Mistral, TorchMistral, MistralForCausalLM]:
        if name not in loaded:
            loaded[name] = (Mistral.from_pretrained(checkpoints[name], jnp.float32),
                            TorchMistral.from_pretrained(checkpoints[name], torch.float32),
                            MistralForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval())
        return loaded[name]

    yield load
    if WORST:
        print("\njax_cache max |logit diff| per reference and cache kind:",
              {f"{ref}/{cache}": f"{diff:.3g}" for (ref, cache), diff in sorted(WORST.items())})


def assert_steps_close(ours: np.ndarray, ref: np.ndarray, cell: str, atol: float = ATOL) -> float:
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


def record(ref: str, cache: str, diff: float) -> None:
    WORST[ref, cache] = max(WORST.get((ref, cache), 0.0), diff)


def decode_wraps(prompt_len: int, new_tokens: int, window: int = WINDOW) -> int:
    """Times decoding writes ring slot 0 again: decode steps write positions prompt_len .. prompt_len+new-2."""
    return sum(1 for p in range(prompt_len, prompt_len + new_tokens - 1) if p % window == 0)


@torch.inference_mode()
def torch_cache_teacher_forced(model: TorchMistral, prompts: list[list[int]], generated: list[list[int]],
                               kind: str) -> np.ndarray:
    """torch_cache's logits for the steps that produced `generated` (same length per row), decoding those tokens
    through its own cache of `kind`: prefill, then one cached forward per token. [B, steps, V]."""
    ids, mask = left_pad(prompts, pad_token_id(model.config))  # [B, T]
    steps = len(generated[0])
    kind, cache_len = plan_cache(model.config, kind, ids.shape[1], steps, None)
    cache = torch_caches.make_cache(kind, model.config, len(prompts), cache_len)
    logits = [torch_generate.prefill(model, torch.from_numpy(ids).long(), torch.from_numpy(mask), cache)]  # [B, V]
    positions = cache.next_positions()[:, None]  # [B, 1]
    forced = torch.tensor(generated)  # [B, steps]
    for step in range(steps - 1):
        logits.append(model(forced[:, step: step + 1], positions, cache)[:, -1].float())
        positions = positions + 1
    return torch.stack(logits, dim=1).numpy()


@torch.no_grad()
def transformers_logits(ref: MistralForCausalLM, prompt: list[int], generated: list[int]) -> np.ndarray:
    """One uncached transformers forward over prompt + generated; the rows that predicted `generated`. [steps, V]"""
    logits = ref(input_ids=torch.tensor([prompt + generated]), use_cache=False).logits[0].float()  # [T + N, V]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(generated)].numpy()


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
    ours, torch_model, ref = models(name)
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

    expected = torch_cache_teacher_forced(torch_model, [prompt], [generated], cache)[0]
    record("torch_cache", cache, assert_steps_close(jax_logits, expected, f"{cell} vs torch_cache"))
    expected = transformers_logits(ref, prompt, generated)
    record("transformers", cache, assert_steps_close(jax_logits, expected, f"{cell} vs transformers"))
    expected = jax_uncached_logits(ours, prompt, generated)
    record("jax uncached", cache, assert_steps_close(jax_logits, expected, f"{cell} vs one uncached forward"))


@pytest.mark.parametrize("cache", CACHES)
def test_left_padded_batch_matches_each_row_alone(models, cache):
    """Rows shorter than, equal to and longer than the window, left-padded into one batch (and to the prefill
    bucket): each row's logits equal torch_cache's on the same padded batch and transformers' on the row alone
    (unpadded), so padding changes nothing."""
    ours, torch_model, ref = models("gqa")
    prompts = [make_prompt(13, seed=3), make_prompt(3, seed=3), make_prompt(WINDOW, seed=3)]
    result = generate(ours, prompts, NEW_TOKENS, cache=cache, return_logits=True)
    assert [len(row) for row in result.token_ids] == [NEW_TOKENS] * 3
    assert result.prompt_ids == prompts
    jax_logits = np.asarray(result.step_logits)  # [B, steps, V]
    torch_logits = torch_cache_teacher_forced(torch_model, prompts, result.token_ids, cache)
    for row, prompt in enumerate(prompts):
        assert decode_wraps(len(prompt), NEW_TOKENS) >= 3
        cell = f"checkpoint=gqa cache={cache} batch row {row} (prompt_len={len(prompt)}, left-padded)"
        record("torch_cache", cache, assert_steps_close(jax_logits[row], torch_logits[row], f"{cell} vs torch_cache"))
        expected = transformers_logits(ref, prompt, result.token_ids[row])
        record("transformers", cache, assert_steps_close(jax_logits[row], expected, f"{cell} vs transformers"))


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
    ours, _, ref = models("gqa")
    prompt = make_prompt(3, seed=5)
    result = generate(ours, [prompt], NEW_TOKENS, cache="static", return_logits=True)
    jax_logits = np.asarray(result.step_logits[0])
    chex.assert_trees_all_close(jax_logits, transformers_logits(ref, prompt, result.token_ids[0]), atol=ATOL, rtol=0)
    weights = {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(ours))}
    no_window = Mistral.from_weights(dataclasses.replace(ours.config, sliding_window=None), weights)
    unwindowed = jax_uncached_logits(no_window, prompt, result.token_ids[0])
    beyond = [s for s in range(NEW_TOKENS) if 2 + s >= WINDOW]  # step s predicts from position 2 + s
    inside = [s for s in range(NEW_TOKENS) if 2 + s < WINDOW]
    assert np.abs(jax_logits[inside] - unwindowed[inside]).max() <= ATOL
    assert np.abs(jax_logits[beyond] - unwindowed[beyond]).max(axis=-1).min() > 1e-3, (
        "past the window the logits must differ from a model without a window, else the window is not applied")
