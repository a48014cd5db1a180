"""The metrics and the verdict rule of `twincache parity` (twincache/parity_metrics.py), on inputs whose answers are
known by hand."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from twincache import parity_metrics as pm


def logits(steps: int = 6, vocab: int = 50, rows: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, steps, vocab)) * 4  # [B, N, V]


def test_identical_logits_are_at_distance_zero():
    ref = logits()
    d = pm.distance(ref, ref.copy())
    assert (d.max_abs_logit_diff, d.rel_max_abs_logit_diff, d.max_kl, d.top1_agreement) == (0, 0, 0, 1)
    assert d.mean_kl == pytest.approx(0, abs=1e-15) and d.first_greedy_divergence is None
    assert d.first_decisive_divergence is None


def test_a_constant_shift_moves_logits_but_no_probability():
    ref = logits()
    d = pm.distance(ref, ref + 3.0)
    assert d.max_abs_logit_diff == pytest.approx(3.0) and d.max_kl == pytest.approx(0, abs=1e-12)
    # relative to each step's largest |logit|: the worst ratio is at the step with the smallest scale
    assert d.rel_max_abs_logit_diff == pytest.approx(3.0 / np.abs(ref).max(-1).min())
    assert d.top1_agreement == 1


def test_kl_on_a_two_token_distribution():
    ref = np.log(np.array([[[0.75, 0.25], [0.5, 0.5]]]))  # [1, 2, 2]
    cand = np.log(np.array([[[0.5, 0.5], [0.5, 0.5]]]))
    d = pm.distance(ref, cand)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert d.max_kl == pytest.approx(kl) and d.mean_kl == pytest.approx(kl / 2)


def test_first_greedy_divergence_is_the_earliest_step_of_any_row():
    ref = logits(steps=8, rows=3)
    cand = ref.copy()
    cand[0, 6] = -cand[0, 6]  # row 0 diverges at step 6, row 2 at step 3: the report says 3
    cand[2, 3] = -cand[2, 3]
    d = pm.distance(ref, cand)
    assert d.first_greedy_divergence == 3 and d.first_decisive_divergence is None  # no decisive mask: none judged
    assert d.top1_agreement == pytest.approx(1 - 2 / 24) and (d.rows, d.steps) == (3, 8)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="cannot be compared"):
        pm.distance(logits(steps=4), logits(steps=5))


def floor_distance(**changes: object) -> pm.Distance:
    base = pm.Distance(steps=100, rows=1, max_abs_logit_diff=0.5, rel_max_abs_logit_diff=0.02, mean_kl=1e-3,
                       max_kl=5e-3, top1_agreement=0.98, first_greedy_divergence=40, max_abs_kv_diff=0.1)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("metric", list(pm.FACTORS))
def test_each_metric_passes_at_its_factor_and_fails_just_above(metric):
    floor = floor_distance()
    value = pm.FACTORS[metric] * getattr(floor, metric)
    if metric == "top1_disagreement":  # a property: set through top1_agreement
        at, above = floor_distance(top1_agreement=1 - value), floor_distance(top1_agreement=1 - value * 1.01)
    else:
        at, above = floor_distance(**{metric: value}), floor_distance(**{metric: value * 1.01})
    assert pm.failures(at, floor, "bfloat16") == []
    assert pm.failures(above, floor, "bfloat16") == [metric]


def test_decisive_steps_are_those_a_flip_within_the_bound_cannot_reach():
    """margin > 2 x max(FACTOR x the floor's max |Δlogit| at the step, the absolute allowance)."""
    factor = pm.FACTORS["max_abs_logit_diff"]
    ref = np.zeros((1, 4, 3))
    ref[0, :, 0] = [1.0, 1.0, 1.0, 1.0]  # top-1 margins over the other tokens (0): 1.0, then 0.3 at steps 2-3
    ref[0, 2:, 1] = 0.7
    floor = ref.copy()
    floor[0, :, 2] += [0.1, 0.13, 0.03, 0.04]  # the floor's max |Δlogit| per step
    decisive = pm.decisive_steps(ref, floor, "bfloat16")
    # step 0: 1.0 > 2 x 4 x 0.1; step 1: 1.0 < 2 x 4 x 0.13; step 2: 0.3 > 0.24; step 3: 0.3 < 0.32
    assert factor == 4.0 and decisive.tolist() == [[True, False, True, False]]
    near_tie = np.array([[[1.0, 1.0 - 1.5e-5, 0.0]]])  # a margin of 1.5e-5, the floor 1e-9 away
    # fp32: the absolute allowance (1e-5) decides, and 1.5e-5 < 2e-5; without one, 8e-9 would make it decisive
    assert pm.decisive_steps(near_tie, near_tie + 1e-9, "float32").tolist() == [[False]]
    assert pm.decisive_steps(near_tie, near_tie + 1e-9, "bfloat16").tolist() == [[True]]


def test_a_greedy_divergence_fails_only_at_a_decisive_step():
    ref = logits(steps=8, rows=2)
    cand = ref.copy()
    cand[1, 5] = -cand[1, 5]  # row 1 flips at step 5
    decisive = np.zeros((2, 8), bool)
    near_tie = pm.distance(ref, cand, decisive)
    assert (near_tie.first_greedy_divergence, near_tie.first_decisive_divergence) == (5, None)
    decisive[1, 5] = True
    flip = pm.distance(ref, cand, decisive)
    assert (flip.first_greedy_divergence, flip.first_decisive_divergence) == (5, 5)
    floor = floor_distance(steps=8, rows=2, top1_agreement=1.0, first_greedy_divergence=None)
    loose = dict(max_abs_logit_diff=0.0, rel_max_abs_logit_diff=0.0, mean_kl=0.0, max_kl=0.0, max_abs_kv_diff=0.0)
    assert pm.failures(dataclasses.replace(near_tie, **loose), floor, "bfloat16") == []
    assert pm.failures(dataclasses.replace(flip, **loose), floor, "bfloat16") == ["first_decisive_divergence"]


def test_absolute_allowance_applies_in_fp32_only_where_the_floor_is_near_zero():
    tiny_floor = floor_distance(max_abs_logit_diff=1e-7, top1_agreement=1.0, first_greedy_divergence=None)
    cand = dataclasses.replace(tiny_floor, max_abs_logit_diff=9e-6)  # 90x the floor, under fp32's 1e-5
    assert pm.failures(cand, tiny_floor, "float32") == []
    assert pm.failures(cand, tiny_floor, "bfloat16") == ["max_abs_logit_diff"]
    over = dataclasses.replace(tiny_floor, max_abs_logit_diff=2e-5)
    assert pm.failures(over, tiny_floor, "float32") == ["max_abs_logit_diff"]
    # a floor far above the allowance is judged by its factor alone
    big_floor = floor_distance(max_abs_logit_diff=5e-5)
    bound = pm.bounds(big_floor, "float32")["max_abs_logit_diff"]
    assert bound == pytest.approx(5e-5 * pm.FACTORS["max_abs_logit_diff"])


def test_nan_fails_and_unmeasured_kv_is_not_judged():
    floor = floor_distance()
    assert pm.failures(floor_distance(mean_kl=float("nan")), floor, "bfloat16") == ["mean_kl"]
    assert pm.failures(floor_distance(max_abs_kv_diff=float("inf")), floor, "bfloat16") == ["max_abs_kv_diff"]
    unmeasured = floor_distance(max_abs_kv_diff=None)
    assert pm.failures(unmeasured, floor, "bfloat16") == [] and "max_abs_kv_diff" not in pm.ratios(unmeasured, floor)


def test_a_floor_over_other_steps_cannot_judge():
    with pytest.raises(ValueError, match="cannot be judged"):
        pm.failures(floor_distance(steps=99), floor_distance(), "float32")


def test_ratios_to_the_floor():
    floor = floor_distance(top1_agreement=1.0)  # no flip in 100 steps: counts as one
    ratios = pm.ratios(floor_distance(max_abs_logit_diff=1.0, top1_agreement=0.97, first_greedy_divergence=20), floor)
    assert ratios["max_abs_logit_diff"] == pytest.approx(2.0) and ratios["top1_disagreement"] == pytest.approx(3.0)
    assert ratios["mean_kl"] == pytest.approx(1.0) and set(ratios) == set(pm.FACTORS)
    assert pm.ratios(floor_distance(max_kl=1.0), floor_distance(max_kl=0.0))["max_kl"] == float("inf")


def test_a_floor_without_flips_counts_as_one_flip():
    """32 steps (2 rows of 16): a floor that never flipped allows FACTORS["top1_disagreement"] flips, not 0."""
    floor = floor_distance(steps=16, rows=2, top1_agreement=1.0, first_greedy_divergence=None)
    allowed = int(pm.FACTORS["top1_disagreement"])

    def flips(n: int) -> pm.Distance:
        return dataclasses.replace(floor, top1_agreement=1 - n / 32, first_greedy_divergence=15 if n else None)

    assert pm.failures(flips(1), floor, "bfloat16") == [] and pm.failures(flips(allowed), floor, "bfloat16") == []
    assert pm.failures(flips(allowed + 1), floor, "bfloat16") == ["top1_disagreement"]


def test_kv_at_positions_reads_a_ring_by_the_positions_its_slots_record():
    layers, batch, heads, slots, dim = 2, 2, 3, 4, 5
    keys = [np.arange(batch * heads * slots * dim, dtype=float).reshape(batch, heads, slots, dim) + 1000 * i
            for i in range(layers)]
    values = [-k for k in keys]
    slot_positions = np.array([[8, 9, 6, 7], [-1, 0, 1, -1]])  # row 0 wrapped; row 1 holds two tokens
    k, v = pm.kv_at_positions(keys, values, slot_positions[0], 0, np.arange(6, 10))
    assert k.shape == (layers, heads, 4, dim)
    np.testing.assert_array_equal(k[1, :, 0], keys[1][0, :, 2])  # position 6 sits in slot 2
    np.testing.assert_array_equal(v[0, :, 3], values[0][0, :, 1])  # position 9 in slot 1
    assert pm.kv_at_positions(keys, values, slot_positions[1], 1, np.arange(2))[0].shape == (layers, heads, 2, dim)
    assert pm.kv_at_positions(keys, values, slot_positions[0], 0, np.arange(5, 9)) is None  # 5 missing, 9 extra
    assert pm.kv_at_positions(keys, values, np.array([0, 0, 1, 2]), 0, np.arange(3)) is None  # 0 held twice
