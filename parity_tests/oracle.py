"""The tests' judge: transformers' MistralForCausalLM (LlamaForCausalLM for a Llama directory) in float64 (the truth)
and in the dtype under test (the floor), through the rule of `twincache parity` (twincache/parity_metrics.py,
explained in docs/design.md §4).

Its inputs are built independently of the code it judges: each row runs alone and unpadded (transformers makes its
own positions and mask), and the positions a cache must hold come from the sequence length alone. Nothing here
imports twincache.generation or either tower.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from twincache import parity_metrics
from twincache.parity_metrics import Distance
from twincache_app import parity


def load_transformers(checkpoint: Path, dtype: str, **overrides: object) -> PreTrainedModel:
    """transformers' own copy of a checkpoint, of the class its config.json names; sdpa keeps float64 attention in
    float64."""
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype), attn_implementation="sdpa",
                                                **overrides).eval()


class Judge:
    """Judges step logits (and optionally a final cache) of one checkpoint against the float64 truth and the floor."""

    def __init__(self, checkpoint: Path, dtype: str = "float32", **overrides: object) -> None:
        self.dtype = dtype
        self.truth = load_transformers(checkpoint, "float64", **overrides)
        self.floor = load_transformers(checkpoint, dtype, **overrides)
        self.window = getattr(self.truth.config, "sliding_window", None)  # a LlamaConfig has none

    def oracles(self, prompts: list[list[int]], tokens: list[list[int]]) -> tuple[parity.Oracle, parity.Oracle]:
        return (parity.transformers_oracle(self.truth, prompts, tokens, "transformers float64"),
                parity.transformers_oracle(self.floor, prompts, tokens, f"transformers {self.dtype}"))

    def check(self, logits: Any, prompts: list[list[int]], tokens: list[list[int]], cell: str,
              result: Any = None, cache: str | None = None) -> Distance:
        """Fail, naming the cell, unless `logits` [B, N, V] (of the steps that produced `tokens`) and, when given,
        the final cache of `result` (a GenerationResult with a `cache` kind of cache) are within bounds."""
        truth, floor = self.oracles(prompts, tokens)
        ours = parity.host(logits).reshape(truth.logits.shape)
        decisive = parity_metrics.decisive_steps(truth.logits, floor.logits, self.dtype)  # [B, N]
        found = parity_metrics.distance(truth.logits, ours, decisive)
        baseline = parity_metrics.distance(truth.logits, floor.logits, decisive)
        if result is not None:
            found = dataclasses.replace(found, max_abs_kv_diff=parity.kv_distance(
                truth, parity.Run.from_result(result), cache, self.window))
            baseline = dataclasses.replace(baseline, max_abs_kv_diff=parity.oracle_kv_distance(
                truth, floor, cache, self.window))
        self._judge(found, baseline, truth.logits, ours, cell)
        return found

    def check_pair(self, first: Any, second: Any, prompts: list[list[int]], tokens: list[list[int]],
                   cell: str) -> Distance:
        """torch vs JAX directly: the distance between two implementations' step logits [B, N, V] must be within
        the same bounds of the floor (transformers in this dtype against float64)."""
        truth, floor = self.oracles(prompts, tokens)
        first = parity.host(first).reshape(truth.logits.shape)
        decisive = parity_metrics.decisive_steps(truth.logits, floor.logits, self.dtype)  # [B, N]
        found = parity_metrics.distance(first, parity.host(second).reshape(truth.logits.shape), decisive)
        self._judge(found, parity_metrics.distance(truth.logits, floor.logits, decisive), first, second, cell)
        return found

    def _judge(self, found: Distance, baseline: Distance, reference: np.ndarray, candidate: Any, cell: str) -> None:
        failed = parity_metrics.failures(found, baseline, self.dtype)
        if failed:
            limits = parity_metrics.bounds(baseline, self.dtype)
            detail = "; ".join(f"{name} {getattr(found, name)} out of bounds ({limits.get(name, 'none allowed')}; "
                               f"floor {getattr(baseline, name)})" for name in failed)
            worst = np.abs(reference - parity.host(candidate).reshape(reference.shape)).max(-1)  # [B, N]
            row, step = np.unravel_index(int(worst.argmax()), worst.shape)
            pytest.fail(f"{cell}: {detail}; worst |Δlogit| {worst[row, step]:.3g} at row {row} step {step} "
                        f"(0 = prefill)")
