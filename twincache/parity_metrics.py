"""Distances between step logits, and the verdict rule of `twincache parity` (numpy only; docs/design.md §4).

Every implementation is judged by its distance to a float64 reference, beside the floor: transformers' own
distance to that reference in the dtype under test. A distance passes when every metric is within a calibrated
factor of the floor's; an absolute allowance takes over only where the floor itself is near zero (tiny fp32 models).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Metrics where larger is worse, and the factor each may exceed the floor by, calibrated in docs/parity.md on the
# trained 30-layer model and the tiny test checkpoints: each leaves a margin of ~2x over the largest ratio seen there
# (a direct torch-vs-JAX row adds two runs' errors, so its KL sits near twice the floor).
FACTORS = {
    "max_abs_logit_diff": 4.0,
    "rel_max_abs_logit_diff": 4.0,
    "mean_kl": 3.0,
    "max_kl": 6.0,
    "top1_disagreement": 4.0,
    "max_abs_kv_diff": 8.0,
}
# Where the floor is near zero (fp32 on a shallow model: transformers then differs from float64 by ~1e-7), a factor
# of it would judge rounding noise; these absolute allowances apply instead, by dtype. Half precision has none:
# its floor is never near zero.
ABSOLUTE = {
    "float32": {"max_abs_logit_diff": 1e-5, "rel_max_abs_logit_diff": 1e-6, "mean_kl": 1e-10, "max_kl": 1e-9,
                "top1_disagreement": 0.0, "max_abs_kv_diff": 1e-5},
}


@dataclasses.dataclass(frozen=True)
class Distance:
    """How far candidate step logits are from reference ones, over a batch of rows of `steps` steps each."""

    steps: int  # per row
    rows: int
    max_abs_logit_diff: float
    rel_max_abs_logit_diff: float  # worst step's max |Δlogit| over that step's largest |reference logit|
    mean_kl: float  # KL(reference || candidate) per step, averaged over steps and rows
    max_kl: float
    top1_agreement: float  # share of steps whose argmax equals the reference's
    first_greedy_divergence: int | None  # earliest step, in any row, whose argmax differs; None: never
    # earliest such step among the decisive ones (`decisive_steps`); None: none, or no decisive mask was given
    first_decisive_divergence: int | None = None
    max_abs_kv_diff: float | None = None  # max |ΔK|, |ΔV| over the final cache's positions; None: not measured

    @property
    def top1_disagreement(self) -> float:
        return 1.0 - self.top1_agreement


def _rows(logits: np.ndarray) -> np.ndarray:
    """Step logits as fp64 [B, steps, V] (a single row may come as [steps, V])."""
    logits = np.asarray(logits, dtype=np.float64)
    return logits[None] if logits.ndim == 2 else logits


def distance(reference: np.ndarray, candidate: np.ndarray, decisive: np.ndarray | None = None) -> Distance:
    """Distance of candidate step logits from reference ones, both [B, steps, V] (or [steps, V]); computed in fp64.
    `decisive` [B, steps] (from `decisive_steps`) marks the steps where a greedy divergence is out of bounds."""
    ref, cand = _rows(reference), _rows(candidate)
    if ref.shape != cand.shape:
        raise ValueError(f"logits of shapes {ref.shape} and {cand.shape} cannot be compared; they must match")
    rows, steps, _ = ref.shape
    abs_diff = np.abs(ref - cand).max(-1)  # [B, steps]
    scale = np.maximum(np.abs(ref).max(-1), np.finfo(np.float64).tiny)  # [B, steps]
    ref_logp, cand_logp = log_softmax(ref), log_softmax(cand)
    kl = (np.exp(ref_logp) * (ref_logp - cand_logp)).sum(-1)  # [B, steps]
    differs = ref.argmax(-1) != cand.argmax(-1)  # [B, steps]
    decisive_differs = differs & (np.zeros_like(differs) if decisive is None else np.asarray(decisive, bool))  # [B, N]
    return Distance(steps=steps, rows=rows, max_abs_logit_diff=float(abs_diff.max()),
                    rel_max_abs_logit_diff=float((abs_diff / scale).max()), mean_kl=float(kl.mean()),
                    max_kl=float(kl.max()), top1_agreement=float(1.0 - differs.mean()),
                    first_greedy_divergence=_first_step(differs),
                    first_decisive_divergence=_first_step(decisive_differs))


def _first_step(mask: np.ndarray) -> int | None:
    """The earliest step, in any row, where `mask` [B, steps] holds; None where it never does."""
    steps = [int(np.argmax(row)) for row in mask if row.any()]
    return min(steps) if steps else None


def decisive_steps(reference: np.ndarray, floor: np.ndarray, dtype: str) -> np.ndarray:
    """[B, steps] bool: the steps whose reference top-1 margin exceeds twice the max |Δlogit| bound at that step
    (FACTORS x the floor's max |Δlogit| there, or the absolute allowance). A greedy flip moves the top-1 and top-2
    logits across each other, so it needs an error of at least half the margin: at a decisive step, an error beyond
    the bound; elsewhere, a near-tie that rounding within the bound (the floor's own included) may flip."""
    ref, floor = _rows(reference), _rows(floor)
    top2 = np.sort(ref, axis=-1)[..., -2:]  # [B, steps, 2]
    margin = top2[..., 1] - top2[..., 0]  # [B, steps]
    floor_step = np.abs(ref - floor).max(-1)  # [B, steps]
    allowance = ABSOLUTE.get(dtype, {}).get("max_abs_logit_diff", 0.0)
    return margin > 2 * np.maximum(FACTORS["max_abs_logit_diff"] * floor_step, allowance)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(-1, keepdims=True)
    shifted = logits - peak
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _measured(*distances: Distance) -> list[str]:
    """The factor-judged metrics that every one of `distances` measured."""
    return [name for name in FACTORS if all(getattr(d, name) is not None for d in distances)]


def floor_value(floor: Distance, name: str) -> float:
    """The floor's value of a metric, as the rule uses it. Top-1 disagreements are discrete events: a floor that
    flipped no token over its N steps bounds its own rate only below ~1/N, so it counts as one flip."""
    value = getattr(floor, name)
    return max(value, 1.0 / (floor.rows * floor.steps)) if name == "top1_disagreement" else value


def bounds(floor: Distance, dtype: str) -> dict[str, float]:
    """What a distance may reach on each metric, given the floor: factor x floor, or the absolute allowance where
    that is larger (upper bounds)."""
    absolute = ABSOLUTE.get(dtype, {})
    return {name: max(FACTORS[name] * floor_value(floor, name), absolute.get(name, 0.0)) for name in _measured(floor)}


def failures(candidate: Distance, floor: Distance, dtype: str) -> list[str]:
    """The metrics on which `candidate` is out of bounds (empty: it passes): any factor-judged metric beyond its
    bound, and a greedy divergence at a decisive step. A NaN distance is out of bounds."""
    if candidate.steps != floor.steps or candidate.rows != floor.rows:
        raise ValueError(f"a distance over {candidate.rows}x{candidate.steps} steps cannot be judged against a floor "
                         f"over {floor.rows}x{floor.steps}")
    limits = bounds(floor, dtype)
    failed = [name for name in _measured(candidate, floor) if not getattr(candidate, name) <= limits[name]]
    if candidate.first_decisive_divergence is not None:
        failed.append("first_decisive_divergence")
    return failed


def ratios(candidate: Distance, floor: Distance) -> dict[str, float]:
    """Each factor-judged metric as a multiple of the floor's value (`floor_value`; inf where that is 0 and the
    candidate's is not)."""
    def ratio(ours: float, theirs: float) -> float:
        if theirs == 0:
            return 0.0 if ours == 0 else float("inf")
        return ours / theirs

    return {name: ratio(getattr(candidate, name), floor_value(floor, name)) for name in _measured(candidate, floor)}


def kv_at_positions(keys: list[np.ndarray], values: list[np.ndarray], slot_positions: np.ndarray, row: int,
                    positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """One row of a cache, reordered by position: keys/values are per layer [B, Hkv, S, D] and slot_positions [S]
    the positions that row's slots record (-1: empty). Returns keys and values [layers, Hkv, n, D] at `positions`,
    or None when the row's slots do not record exactly those positions, each once."""
    held = [int(p) for p in slot_positions if p >= 0]
    if sorted(held) != [int(p) for p in positions]:
        return None
    slot_of = {int(p): slot for slot, p in enumerate(slot_positions) if p >= 0}
    slots = [slot_of[int(p)] for p in positions]
    return (np.stack([np.asarray(k[row])[:, slots] for k in keys]),  # [layers, Hkv, n, D]
            np.stack([np.asarray(v[row])[:, slots] for v in values]))
