"""Sampling in both backends, judged by an oracle written in numpy from the definitions (stated in
parity_tests/sampling_oracle.py), never by the code it judges: the exact set of tokens top-k and top-p keep (ties at
the boundary included), tiny temperatures, and which token a seeded draw picks.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_cache.generate as jg
import torch_cache.generate as tg
from parity_tests.sampling_oracle import gumbel_noise, key_noise, oracle_kept
from torch_cache.model import Mistral as TorchMistral
from twincache.generation import SamplingParams

BACKENDS = ["torch", "jax"]


def filtered(backend: str, logits: np.ndarray, sampling: SamplingParams) -> list[set[int]]:
    """Per row, the tokens a backend's filter_logits leaves finite."""
    if backend == "torch":
        out = tg.filter_logits(torch.from_numpy(np.asarray(logits, np.float32)), sampling).numpy()
    else:
        out = np.asarray(jg.filter_logits(jnp.asarray(logits, jnp.float32), sampling))
    return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in out]


def drawn(backend: str, logits: np.ndarray, sampling: SamplingParams, draws: int = 2000) -> set[int]:
    """The set of tokens `draws` seeded draws of one row pick, through the backend's sample()."""
    tiled = np.tile(np.asarray(logits, np.float32), (draws, 1))
    if backend == "torch":
        picks = tg.sample(torch.from_numpy(tiled), sampling, torch.tensor(0))
    else:
        picks = jg.sample(jnp.asarray(tiled), sampling, jax.random.key(0))
    return set(np.asarray(picks).tolist())


def log_probs(*probs: float) -> list[float]:
    return np.log(np.asarray(probs)).tolist()


# (name, one row of logits, sampling, the kept set derived by hand from the definitions)
HAND_MADE = [
    ("top_k", [3.0, 2.0, 1.0, 0.0, -1.0], SamplingParams(1.0, top_k=2), {0, 1}),
    ("top_k_tie_at_k", [3.0, 2.0, 2.0, 1.0, 0.0], SamplingParams(1.0, top_k=2), {0, 1, 2}),
    ("top_k_tie_at_top", [2.0, 2.0, 2.0, 1.0, 0.0], SamplingParams(1.0, top_k=1), {0, 1, 2}),
    # p = .4 .3 .2 .1: token 1 crosses 0.5 (0.4 above it < 0.5) and stays; token 2 has 0.7 above it
    ("top_p_keeps_the_crossing_token", log_probs(.4, .3, .2, .1), SamplingParams(1.0, top_p=0.5), {0, 1}),
    ("top_p_0.75", log_probs(.4, .3, .2, .1), SamplingParams(1.0, top_p=0.75), {0, 1, 2}),
    ("top_p_top_token_alone", log_probs(.4, .3, .2, .1), SamplingParams(1.0, top_p=0.35), {0}),
    # p = .4 .2 .2 .1 .1: one 0.2 has 0.4 above it (kept), so its tie partner is kept too, whatever the sort order
    ("top_p_tie_at_the_boundary", log_probs(.4, .2, .2, .1, .1), SamplingParams(1.0, top_p=0.5), {0, 1, 2}),
    # top_p .8: the 0.1s have exactly 0.8 above them, not less: both go (float64 on these float32 logits: 0.80000001).
    # The logits are the float32 logs of float32 probabilities, as the audit built them: torch_cache's float32
    # probabilities summed as cumsum - p kept all five, jax_cache's three.
    ("top_p_exact_boundary", np.log(np.float32([.4, .2, .2, .1, .1])).tolist(), SamplingParams(1.0, top_p=0.8),
     {0, 1, 2}),
    # p = .5 .2 .2 .1, top_p .45: both 0.2s have 0.5 above them: both go
    ("top_p_tie_dropped_together", log_probs(.5, .2, .2, .1), SamplingParams(1.0, top_p=0.45), {0}),
    # at T = 2 the same logits flatten to p ~ .32 .27 .23 .18: top_p .5 now keeps two
    ("top_p_after_temperature", log_probs(.4, .3, .2, .1), SamplingParams(2.0, top_p=0.5), {0, 1}),
    ("top_p_after_temperature_wider", log_probs(.4, .3, .2, .1), SamplingParams(2.0, top_p=0.65), {0, 1, 2}),
    # top-k first, then top-p on the survivors' renormalised mass: among .4 .3 .2 top_p .6 keeps .4/.9 and .3/.9
    ("top_k_then_top_p", log_probs(.4, .3, .2, .1), SamplingParams(1.0, top_k=3, top_p=0.6), {0, 1}),
    ("no_filter", log_probs(.4, .3, .2, .1), SamplingParams(1.0), {0, 1, 2, 3}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("row", "sampling", "expected"), [case[1:] for case in HAND_MADE],
                         ids=[case[0] for case in HAND_MADE])
def test_filters_keep_exactly_the_defined_set_on_hand_made_logits(backend, row, sampling, expected):
    assert oracle_kept(np.asarray([row]), sampling) == [expected], "the oracle disagrees with the hand derivation"
    assert filtered(backend, np.asarray([row]), sampling) == [expected]
    assert drawn(backend, row, sampling) == expected, "draws must reach every kept token and nothing else"


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_with_top_p_one_keeps_tokens_below_float32_resolution(backend):
    """top_p = 1 filters nothing, also next to top-k: tokens of probability ~1e-13 sit where a float32 cumsum of the
    mass above them rounds to 1, and must stay (they are never drawn in practice, so only the filter is asked)."""
    row = [0.0, -30.0, -30.0, 5.0]
    sampling = SamplingParams(1.0, top_k=4)
    assert oracle_kept(np.asarray([row]), sampling) == [{0, 1, 2, 3}]
    assert filtered(backend, np.asarray([row]), sampling) == [{0, 1, 2, 3}]


@pytest.fixture(scope="module")
def model_logits(checkpoints: dict[str, Path]) -> np.ndarray:
    """Real step logits [24, V] of the gqa model: 3 prompts x 8 steps."""
    model = TorchMistral.from_pretrained(checkpoints["gqa"])
    result = tg.generate(model, [[5, 17, 42, 99], [5, 17], [9, 8, 7, 6, 5, 4, 3]], 8, compile=False,
                         return_logits=True)
    return result.step_logits.reshape(24, -1).numpy()


MODEL_SETTINGS = [SamplingParams(0.8, top_k=20, top_p=0.9), SamplingParams(1.0, top_p=0.5),
                  SamplingParams(0.5, top_k=3), SamplingParams(1.5, top_k=50, top_p=0.3), SamplingParams(1.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling", MODEL_SETTINGS, ids=str)
def test_filters_keep_exactly_the_defined_set_on_model_logits(backend, model_logits, sampling):
    expected = oracle_kept(model_logits, sampling)
    assert any(0 < len(s) < model_logits.shape[1] for s in expected) or sampling == SamplingParams(1.0)
    assert filtered(backend, model_logits, sampling) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_keeps_the_defined_set_over_a_large_vocabulary_whether_its_cut_is_among_the_top_tokens_or_not(backend):
    """jax_cache looks for the top-p cut among its TOP_P_CANDIDATES most probable tokens and sorts the whole row only
    when their mass stays under top_p: rows of 5,000 tokens whose cut falls inside the candidates (peaked), after
    them (flat), and a batch of both, each against the float64 definition."""
    vocab = 5 * jg.TOP_P_CANDIDATES
    rng = np.random.default_rng(7)
    peaked, flat = (rng.standard_normal((2, vocab)) * scale for scale in (8.0, 0.05))
    settings = (SamplingParams(1.0, top_p=0.9), SamplingParams(0.7, top_k=2 * jg.TOP_P_CANDIDATES, top_p=0.95))
    for logits in (peaked, flat, np.stack([peaked[0], flat[0]])):
        for sampling in settings:
            assert filtered(backend, logits, sampling) == oracle_kept(logits, sampling), sampling
    # the cases above take both of jax_cache's paths
    scaled = jnp.asarray(peaked - peaked.max(-1, keepdims=True), jnp.float32)
    for rows, inside in ((scaled, True), (scaled * 0.05 / 8.0, False)):
        top = jax.lax.top_k(rows, jg.TOP_P_CANDIDATES)[0]
        total = jnp.sum(jnp.exp(rows), axis=-1, keepdims=True)
        assert bool(jnp.all(jg._top_p_cutoff(top, total, 0.9)[1])) is inside


def test_jax_top_p_sums_are_the_exact_sums_rounded_once():
    """torch_cache sums top-p's masses in float64; jax_cache has none (JAX's default), so its total and prefix sums
    split each mass into a part that sums exactly in float32 and a small rest (`_grid`). Against numpy's float64
    sums rounded once: all within an ulp, nearly all equal (XLA's float32 cumsum: ~45% differ, by up to ~3 ulps)."""
    rng = np.random.default_rng(5)
    for vocab, scale in ((jg.TOP_P_CANDIDATES, 2.0), (5000, 8.0)):
        masses = np.exp(rng.standard_normal((2, vocab)) * scale - 3).astype(np.float32)  # [2, V]
        exact = np.cumsum(masses.astype(np.float64), axis=-1).astype(np.float32)  # [2, V], each rounded once
        total = np.asarray(jg._sum_exactly(jnp.asarray(masses)))  # [2, 1]
        prefix = np.asarray(jg._prefix_sums_exactly(jnp.asarray(masses), jnp.asarray(total)))  # [2, V]
        assert np.all(np.abs(total - exact[:, -1:]) <= np.spacing(exact[:, -1:])), (total, exact[:, -1:])
        assert np.all(np.abs(prefix - exact) <= np.spacing(exact)), np.abs(prefix - exact).max()
        assert np.mean(prefix == exact) > 0.99, np.mean(prefix == exact)


def test_jax_sampling_outside_the_jitted_steps_compiles_once_per_kind_and_shape(caplog):
    """filter_logits, sample and generate's first token filter outside the jitted steps. Once a kind has run on a
    shape, another setting of it compiles nothing: no lax.cond compiled anew per call (its eager branches close over
    that call's arrays; on a 49,152-token row that was ~2 s per generation). A row longer than TOP_P_CANDIDATES, so
    the filter takes its lax.cond; counted from JAX's own compile log, whatever the machine."""
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((2, jg.TOP_P_CANDIDATES + 100)), jnp.float32)
    jg.sample(logits, SamplingParams(0.8, top_k=20, top_p=0.9), jax.random.key(0))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        for sampling in (SamplingParams(1.3, top_k=5, top_p=0.6, seed=3), SamplingParams(0.5, top_p=0.95),
                         SamplingParams(1.0, top_k=jg.TOP_P_CANDIDATES + 50)):
            assert filtered("jax", logits, sampling) == oracle_kept(np.asarray(logits), sampling)
            jg.sample(logits, sampling, jax.random.key(sampling.seed))
    assert [record.getMessage() for record in caplog.records if "Compiling" in record.getMessage()] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_tends_to_greedy_as_temperature_goes_to_zero(backend, model_logits):
    """Below some temperature every draw is the argmax (no overflow, no NaN), down to the smallest float."""
    for temperature in (1e-4, 1e-30, 1e-38, 1e-45, 5e-324):
        for seed in range(3):
            sampling = SamplingParams(temperature, top_k=10, top_p=0.95, seed=seed)
            if backend == "torch":
                picks = tg.sample(torch.from_numpy(model_logits), sampling, torch.tensor(seed))
            else:
                picks = jg.sample(jnp.asarray(model_logits), sampling, jax.random.key(seed))
            np.testing.assert_array_equal(np.asarray(picks), model_logits.argmax(-1), err_msg=f"T={temperature}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_keeps_k_tokens_and_draws_them_uniformly_at_huge_temperatures(backend, model_logits):
    """top-k keeps the k largest logits at any temperature: scaled by a huge T (up to a Python float past float32's
    largest, which acts as it), distinct logits round to one value, and a cut on the scaled logits kept every tied
    token, so top_k=1 drew uniformly from the whole vocabulary. The k survivors are then near-uniform (their
    probabilities differ by < 1e-29): 3,000 draws of top_k=3, each count within 6 sigma of 1,000 (sigma 25.8; a
    false failure has probability < 2e-9 per count, 1.2e-8 for the test, and its seeds are fixed). No numpy
    overflow warning from the float32 cast of such a T."""
    rows = model_logits[:4]
    for temperature in (1e30, 3e38, 1e39, 1e300):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for top_k in (1, 3):
                sampling = SamplingParams(temperature, top_k=top_k)
                assert filtered(backend, rows, sampling) == oracle_kept(rows, sampling), (temperature, top_k)
            assert drawn(backend, rows[0], SamplingParams(temperature, top_k=1), 200) == {int(rows[0].argmax())}
            tiled = np.tile(rows[0], (3000, 1))
            sampling = SamplingParams(temperature, top_k=3, seed=5)
            if backend == "torch":
                picks = tg.sample(torch.from_numpy(tiled), sampling, torch.tensor(5)).numpy()
            else:
                picks = np.asarray(jg.sample(jnp.asarray(tiled), sampling, jax.random.key(5)))
        top3 = np.argsort(-rows[0].astype(np.float64))[:3]
        counts = np.array([np.sum(picks == token) for token in top3])
        assert counts.sum() == 3000 and np.all(np.abs(counts - 1000) < 6 * np.sqrt(3000 * 2 / 9)), counts.tolist()


def test_jax_draws_equal_an_independent_gumbel_max_oracle(model_logits):
    """jax.random.categorical is argmax(logits + Gumbel noise from the key): the oracle applies its own filter in
    float64 to l / T (the unshifted form, as before the overflow fix) and adds the same key's noise. The same token
    means the shifted form leaves ordinary-temperature sampling unchanged."""
    for i, sampling in enumerate(MODEL_SETTINGS):
        key = jax.random.key(100 + i)
        picks = np.asarray(jg.sample(jnp.asarray(model_logits), sampling, key))
        noise = np.asarray(jax.random.gumbel(key, model_logits.shape, jnp.float32), np.float64)
        kept = oracle_kept(model_logits, sampling)
        scaled = model_logits.astype(np.float64) / sampling.temperature
        masked = np.where([[t in row for t in range(scaled.shape[1])] for row in kept], scaled, -np.inf)
        np.testing.assert_array_equal(picks, (masked + noise).argmax(-1), err_msg=str(sampling))


def test_torch_draws_equal_an_independent_gumbel_max_oracle(model_logits):
    """torch's draw is argmax(l / T + Gumbel noise) over the kept tokens, the noise a hash of the key and the entry
    (sampling_oracle states it): the oracle filters in float64 and makes its own noise in numpy. Each row of a
    20-fold tiling gets its own noise, so this is 480 draws per setting."""
    rows = np.tile(model_logits, (20, 1))
    for i, sampling in enumerate(MODEL_SETTINGS):
        picks = tg.sample(torch.from_numpy(rows), sampling, torch.tensor(100 + i)).numpy()
        kept = oracle_kept(rows, sampling)
        mask = np.array([[t in row for t in range(rows.shape[1])] for row in kept])
        scaled = np.where(mask, rows.astype(np.float64) / sampling.temperature, -np.inf)
        noise = key_noise(100 + i, rows.shape)  # sample() draws with the key as given; generate folds in the step
        np.testing.assert_array_equal(picks, (scaled + noise).argmax(-1), err_msg=str(sampling))


def test_torch_draw_frequencies_follow_the_probabilities():
    """20,000 draws of p = .4 .3 .2 .1 (one row each, so each has its own noise): every frequency within 4.5 sigma."""
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    rows = torch.from_numpy(np.tile(np.log(probs, dtype=np.float32), (20_000, 1)))
    for seed in (0, 1):
        counts = np.bincount(tg.sample(rows, SamplingParams(1.0, seed=seed), torch.tensor(seed)).numpy(), minlength=4)
        sigma = np.sqrt(20_000 * probs * (1 - probs))
        assert np.all(np.abs(counts - 20_000 * probs) < 4.5 * sigma), f"seed {seed}: counts {counts.tolist()}"


def test_the_oracles_own_noise_differs_by_step_and_seed():
    """A check of the oracle itself, not of twincache: its step-folded noise differs between steps and seeds (else
    the oracle comparisons above could pass on a draw that ignores the step)."""
    first, second, other_seed = (gumbel_noise(seed, step, (2, 8)) for seed, step in ((3, 0), (3, 1), (4, 0)))
    assert not np.allclose(first, second) and not np.allclose(first, other_seed)
    assert np.isfinite(first).all()
