"""The sampling definitions, written here in numpy from their statements and never from the code they judge: which
tokens top-k and top-p keep, and torch_cache's seeded draw (Gumbel-max on counter-based noise).

  scaled logits  l / T (shift-invariant: the backends compute (l - max) / T, which cannot overflow to +inf)
  top-k          keep every token whose scaled logit is >= the k-th largest (a tie with the k-th is kept)
  top-p          on the top-k survivors' softmax, keep every token t whose strictly-more-probable tokens hold less
                 than top_p in total: the top token always stays, the token that crosses top_p stays, and tokens
                 tied with a kept token stay.
  torch's draw   step s of seed k draws argmax over kept tokens of (l / T + g), g = -log(-log(u)), where for row r
                 and token t of a [B, V] batch u = ((h >> 8) + 1/2) / 2^24 with h = H(H(r V + t) xor K), the step's
                 key K = H(k xor H(s)), and H is lowbias32 (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
                 x *= 0x846ca68b; x ^= x >> 16, all mod 2^32).
"""

from __future__ import annotations

import numpy as np

from twincache.generation import SamplingParams


def oracle_kept(logits: np.ndarray, sampling: SamplingParams) -> list[set[int]]:
    """Per row, the token ids the filters keep, by the definitions above, in float64."""
    kept = []
    for row in np.asarray(logits, np.float64):
        scaled = row / sampling.temperature
        keep = np.ones(scaled.shape, bool)
        if sampling.top_k:
            keep &= scaled >= np.sort(scaled)[-sampling.top_k]
        if sampling.top_p < 1.0:
            probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
            probs /= probs.sum()
            mass_above = np.array([probs[probs > p].sum() for p in probs])
            keep &= mass_above < sampling.top_p
        kept.append(set(np.flatnonzero(keep).tolist()))
    return kept


def lowbias32(x: np.ndarray) -> np.ndarray:
    """C. Wellons' lowbias32 on uint32 (numpy's uint32 products wrap mod 2^32)."""
    x = np.asarray(x, np.uint32).copy()
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def step_key(seed: int, step: int) -> np.uint32:
    return lowbias32(np.uint32(seed) ^ lowbias32(np.uint32(step)))


def key_noise(key: int, shape: tuple[int, int]) -> np.ndarray:
    """[B, V] float64 Gumbel noise of torch's draw with the 32-bit key `key` (a step's, or one given to sample())."""
    counter = np.arange(shape[0] * shape[1], dtype=np.uint32).reshape(shape)
    bits = lowbias32(lowbias32(counter) ^ np.uint32(key))
    uniform = ((bits >> np.uint32(8)).astype(np.float64) + 0.5) / 2.0 ** 24
    return -np.log(-np.log(uniform))


def gumbel_noise(seed: int, step: int, shape: tuple[int, int]) -> np.ndarray:
    """[B, V] float64 Gumbel noise of torch's draw at `step` of `seed`."""
    return key_noise(int(step_key(seed, step)), shape)


def oracle_draw(logits: np.ndarray, sampling: SamplingParams, step: int) -> np.ndarray:
    """torch's tokens [B] for step logits [B, V] at generated-token index `step`, by the definitions above."""
    logits = np.asarray(logits, np.float64)
    kept = oracle_kept(logits, sampling)
    mask = np.array([[token in row for token in range(logits.shape[1])] for row in kept])
    scaled = np.where(mask, logits / sampling.temperature, -np.inf)
    return (scaled + gumbel_noise(sampling.seed, step, logits.shape)).argmax(-1)
