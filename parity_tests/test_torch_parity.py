"""torch_cache against transformers' MistralForCausalLM, fp32 on CPU, by the rule of `twincache parity`
(docs/design.md §4): at prefill, at every decode step and on the final cache, within the bounds of the floor.

Teacher-forced: our generate() records the logits of prefill and of every decode step; one uncached transformers
forward in float64 over prompt + generated tokens gives the true logits of all those steps at once and the true K/V
of every position (transformers applies the sliding window itself there), and the same forward in fp32 gives the
floor (parity_tests/oracle.py). Every checkpoint directory was written by transformers' save_pretrained.
Comparisons of torch_cache with itself (two cache kinds, cached vs one uncached forward) are equivalences of one
implementation on tiny fp32 models, where any real bug moves a logit by far more than SAME_CODE_ATOL.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from parity_tests.conftest import WINDOW
from parity_tests.oracle import Judge
from torch_cache.cache import SlidingWindowCache, StaticCache
from torch_cache.generate import generate
from torch_cache.model import Mistral
from twincache.checkpoint import read_safetensors_header

SAME_CODE_ATOL = 1e-5  # torch_cache against itself only (see the module docstring)
NEW_TOKENS = 30  # with window 8, decoding from any prompt below crosses slot 0 of the ring at least 3 times
VOCAB = 128
WINDOWED = ["gqa", "mqa", "head_dim", "tied", "sharded", "bf16_stored"]
PROMPT_LENGTHS = {"shorter": 3, "equal": WINDOW, "longer": 13}

Loader = Callable[..., tuple[Mistral, Judge]]


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> Loader:
    """(ours, its judge) for a checkpoint name, each loaded once from the same directory, fp32, eval."""
    loaded: dict[tuple, tuple[Mistral, Judge]] = {}

    def load(name: str, **hf_overrides: object) -> tuple[Mistral, Judge]:
        key = (name, tuple(sorted(hf_overrides.items())))
        if key not in loaded:
            loaded[key] = (Mistral.from_pretrained(checkpoints[name], dtype=torch.float32),
                           Judge(checkpoints[name], "float32", **hf_overrides))
        return loaded[key]

    return load


def make_prompt(length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(1, VOCAB, (length,), generator=generator).tolist()


def step_diffs(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Max |diff| per step, [steps]; NaN anywhere counts as an infinite difference."""
    diffs = (ours.float() - ref.float()).abs().amax(dim=-1)
    return torch.where(torch.isnan(diffs), torch.inf, diffs)


def assert_steps_close(ours: torch.Tensor, ref: torch.Tensor, cell: str, atol: float = SAME_CODE_ATOL) -> float:
    """Fail naming the cell and the first step whose max |logit diff| exceeds atol (step 0 = prefill)."""
    assert ours.shape == ref.shape, f"{cell}: logits shape {list(ours.shape)} != reference {list(ref.shape)}"
    diffs = step_diffs(ours, ref)
    bad = (diffs > atol).nonzero()
    if bad.numel():
        step = int(bad[0])
        what = "prefill" if step == 0 else f"decode step {step}"
        pytest.fail(f"{cell}: step {step} ({what}) max |logit diff| = {float(diffs[step]):.3g} > {atol}; "
                    f"{bad.numel()} of {len(diffs)} steps fail, worst {float(diffs.max()):.3g} at step "
                    f"{int(diffs.argmax())}")
    return float(diffs.max())


def decode_wraps(prompt_len: int, new_tokens: int, window: int = WINDOW) -> int:
    """Times decoding writes ring slot 0 again: decode steps write positions prompt_len .. prompt_len+new-2."""
    return sum(1 for p in range(prompt_len, prompt_len + new_tokens - 1) if p % window == 0)


CELLS = [(name, cache, label) for name in WINDOWED for cache in ("static", "sliding_window")
         for label in PROMPT_LENGTHS] + [("no_window", "static", label) for label in PROMPT_LENGTHS]


@pytest.mark.parametrize(("name", "cache", "label"), CELLS)
def test_within_bounds_of_the_float64_truth_at_prefill_every_decode_step_and_in_the_cache(models, name, cache,
                                                                                          label):
    prompt_len = PROMPT_LENGTHS[label]
    cell = f"checkpoint={name} cache={cache} prompt_len={prompt_len} ({label} than window {WINDOW})"
    ours, judge = models(name)
    prompt = make_prompt(prompt_len)
    result = generate(ours, [prompt], NEW_TOKENS, cache=cache, compile=False, return_logits=True)
    assert result.cache_kind == cache
    generated = result.token_ids[0]
    assert len(generated) == NEW_TOKENS, f"{cell}: eos_token_id is None, so every token must be generated"
    assert decode_wraps(prompt_len, NEW_TOKENS) >= 3
    judge.check(result.step_logits, [prompt], [generated], cell, result, cache)


def test_checkpoint_fixtures_are_what_they_claim(checkpoints):
    """The sharded checkpoint has several shards and the bf16 one stores bf16: otherwise their cells prove nothing."""
    index = json.loads((checkpoints["sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    header = read_safetensors_header(checkpoints["bf16_stored"] / "model.safetensors")
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert "lm_head.weight" not in read_safetensors_header(checkpoints["tied"] / "model.safetensors")


@pytest.mark.parametrize("name", ["sharded", "bf16_stored", "tied", "head_dim"])
def test_loaded_weights_equal_transformers_weights(models, name):
    ours, judge = models(name)
    ref = judge.floor
    ref_state = ref.state_dict()
    for key, tensor in ours.state_dict().items():
        assert tensor.dtype == torch.float32, f"{name}: {key} loaded as {tensor.dtype}, asked for float32"
        assert torch.equal(tensor, ref_state[key]), f"{name}: {key} differs from transformers' copy"
    if name == "tied":
        assert ours.lm_head is None and torch.equal(ref.lm_head.weight, ours.model.embed_tokens.weight)


def test_static_cache_on_windowed_config_applies_the_window(models):
    """The window is the model's rule, not the cache's: a static cache must hide keys at or before q - W."""
    ours, judge = models("gqa")
    _, judge_no_window = models("gqa", sliding_window=None)
    prompt = make_prompt(3)
    result = generate(ours, [prompt], NEW_TOKENS, cache="static", compile=False, return_logits=True)
    generated = result.token_ids[0]
    judge.check(result.step_logits, [prompt], [generated], "checkpoint=gqa cache=static prompt_len=3", result,
                "static")
    windowed = judge.oracles([prompt], [generated])[0].logits[0]  # float64 truths [steps, V]
    unwindowed = judge_no_window.oracles([prompt], [generated])[0].logits[0]
    # Step s predicts from position 2 + s: up to position W - 1 the window hides nothing, after it hides keys. So
    # judged within bounds of the windowed truth, ours also stands apart from the window-less one past the window.
    inside = [s for s in range(NEW_TOKENS) if 2 + s < WINDOW]
    beyond = [s for s in range(NEW_TOKENS) if 2 + s >= WINDOW]
    assert np.abs(windowed[inside] - unwindowed[inside]).max() < 1e-12
    assert np.abs(windowed[beyond] - unwindowed[beyond]).max(-1).min() > 1e-3
    ours_logits = result.step_logits[0].double().numpy()
    assert np.abs(ours_logits[beyond] - unwindowed[beyond]).max(-1).min() > 1e-3, (
        "past the window the logits must differ from a model without a window, else the window is not applied")


@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_static_and_sliding_caches_agree_under_the_window(models, name):
    ours, _ = models(name)
    prompt = make_prompt(3)
    new_tokens = WINDOW - len(prompt) + 1  # the last decode step writes position W - 1: the ring is just full
    static = generate(ours, [prompt], new_tokens, cache="static", compile=False, return_logits=True)
    sliding = generate(ours, [prompt], new_tokens, cache="sliding_window", compile=False, return_logits=True)
    assert static.token_ids == sliding.token_ids
    assert_steps_close(sliding.step_logits[0], static.step_logits[0], f"checkpoint={name} sliding vs static")


@pytest.mark.parametrize("cache_cls", [StaticCache, SlidingWindowCache])
@pytest.mark.parametrize("prompt_len", [3, 13])
def test_cached_decode_equals_uncached_full_forward(models, cache_cls, prompt_len):
    """generate()'s per-step logits equal one forward over the whole sequence into a fresh cache of either kind."""
    ours, _ = models("gqa")
    prompt = make_prompt(prompt_len)
    kind = "static" if cache_cls is StaticCache else "sliding_window"
    result = generate(ours, [prompt], NEW_TOKENS, cache=kind, compile=False, return_logits=True)
    full = prompt + result.token_ids[0]
    with torch.inference_mode():
        for full_cache_cls in (StaticCache, SlidingWindowCache):  # the sliding one takes a prefill longer than W
            fresh = full_cache_cls(ours.config, 1, len(full))
            logits = ours(torch.tensor([full]), torch.arange(len(full))[None], fresh)[0]  # [T + N, V]
            steps = logits[prompt_len - 1: prompt_len - 1 + NEW_TOKENS]
            assert_steps_close(result.step_logits[0], steps,
                               f"cache={kind} prompt_len={prompt_len} vs one {full_cache_cls.__name__} forward")


@pytest.mark.parametrize("cache_cls", [StaticCache, SlidingWindowCache])
def test_chunked_prefill_within_bounds_of_the_float64_truth(models, cache_cls):
    """Multi-token forwards into a cache with content (one chunk longer than W) give the true logits and K/V."""
    ours, judge = models("gqa")
    tokens = make_prompt(24, seed=5)
    chunks = [5, 9, 1, 6, 3]  # 9 > W = 8: that chunk attends the old ring plus its own tokens
    cache = cache_cls(ours.config, 1, len(tokens))
    pieces, start = [], 0
    with torch.inference_mode():
        for size in chunks:
            ids = torch.tensor([tokens[start: start + size]])
            pieces.append(ours(ids, torch.arange(start, start + size)[None], cache)[0])
            start += size
    assert int(cache.length) == len(tokens)
    # As the oracle sees it: a 1-token "prompt", then 24 steps whose logits predict tokens 1..23 and one more token
    # (never fed, so any id will do); the cache holds positions 0..23.
    logits = torch.cat(pieces)[None]  # [1, 24, V]
    kind = "static" if cache_cls is StaticCache else "sliding_window"
    judge.check(logits, [tokens[:1]], [tokens[1:] + [0]], f"{cache_cls.__name__} chunks {chunks}",
                types.SimpleNamespace(step_logits=logits, cache=cache), kind)
