"""`twincache parity`: teacher-forced logit parity of transformers, torch_cache and jax_cache on any checkpoint.

Every implementation is fed the same token sequence (the prompt, then a greedy continuation made once by
torch_cache), step by step through its own cache and the decode path of its mode (compiled or eager torch, fused or
step JAX); step i's logits predict continuation token i. Each pair is judged against the bounds of docs/design.md §4
for the dtype. Backends come from the registry and are imported when a run needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from twincache.checkpoint import load_config
from twincache.default_model import default_model_dir
from twincache.errors import InputError
from twincache.generation import CACHE_KINDS, validate_prompts
from twincache_app.backends import BACKENDS, modes_help
from twincache_app.generate_cmd import add_model_arguments, resolve_prompt
from twincache_app.hf_loading import transformers_model

# The promise (docs/design.md §4): fp32 logits within 1e-5 and the same greedy token wherever the reference's top-1
# margin exceeds 1e-4; half precision within a mean KL of 1e-3 with >= 99% top-1 agreement. Random-weight models have
# near-tied logits, and a bf16 logit moves by whole ulps (2^-7 relative), so the half-precision top-1 agreement is
# taken over the decisive steps: those whose reference top-1 margin exceeds HALF_DECISIVE_ULPS ulps of the top-1
# logit in that dtype. The raw agreement over all steps is reported beside it.
FP32_MAX_ABS_LOGIT_DIFF = 1e-5
FP32_TOP1_MARGIN = 1e-4
HALF_MEAN_KL = 1e-3
HALF_TOP1_AGREEMENT = 0.99
HALF_DECISIVE_ULPS = 4
_HALF_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


@dataclasses.dataclass
class PairReport:
    cache: str
    reference: str
    candidate: str
    dtype: str
    steps: int
    max_abs_logit_diff: float
    mean_kl: float
    top1_agreement: float  # over all steps
    decisive_steps: int  # steps whose reference top-1 margin is clear for the dtype (all steps for fp32: > 1e-4)
    top1_agreement_decisive: float  # over the decisive steps
    first_greedy_divergence_step: int | None  # first step whose argmax differs; None when they never do
    top1_mismatches_above_margin: int  # argmax differences where the reference's top-1 margin > 1e-4
    within_bounds: bool


def compare_logits(reference: np.ndarray, candidate: np.ndarray, dtype: str) -> dict[str, Any]:
    """Metrics of candidate vs reference step logits [steps, V] (any float dtype; computed in fp64)."""
    ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
    ref_logp = ref - _logsumexp(ref)
    cand_logp = cand - _logsumexp(cand)
    kl = (np.exp(ref_logp) * (ref_logp - cand_logp)).sum(-1)  # [steps]
    ref_top1, cand_top1 = ref.argmax(-1), cand.argmax(-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]  # [steps]
    differs = ref_top1 != cand_top1
    if dtype in _HALF_EPS:  # ulp of the top-1 logit: eps * 2^floor(log2 |x|)
        top1_ulp = _HALF_EPS[dtype] * 2.0 ** np.floor(np.log2(np.maximum(np.abs(top2[:, 1]), 1e-30)))
        decisive = margin > HALF_DECISIVE_ULPS * top1_ulp
    else:
        decisive = margin > FP32_TOP1_MARGIN
    metrics = {
        "steps": int(ref.shape[0]),
        "max_abs_logit_diff": float(np.abs(ref - cand).max()),
        "mean_kl": float(kl.mean()),
        "top1_agreement": float(1.0 - differs.mean()),
        "decisive_steps": int(decisive.sum()),
        "top1_agreement_decisive": float(1.0 - differs[decisive].mean()) if decisive.any() else 1.0,
        "first_greedy_divergence_step": int(np.argmax(differs)) if differs.any() else None,
        "top1_mismatches_above_margin": int((differs & (margin > FP32_TOP1_MARGIN)).sum()),
    }
    if dtype == "float32":
        ok = metrics["max_abs_logit_diff"] <= FP32_MAX_ABS_LOGIT_DIFF and metrics["top1_mismatches_above_margin"] == 0
    else:
        ok = metrics["mean_kl"] <= HALF_MEAN_KL and metrics["top1_agreement_decisive"] >= HALF_TOP1_AGREEMENT
    return metrics | {"within_bounds": bool(ok)}


def _logsumexp(x: np.ndarray) -> np.ndarray:
    peak = x.max(-1, keepdims=True)
    return peak + np.log(np.exp(x - peak).sum(-1, keepdims=True))


# --- teacher-forced runners: sequence [L] ids, prompt_len P -> logits [L - P, V] float32 -----------------------------
# Each backend's own `step_logits` feeds the sequence through the decode path of a mode (docs/design.md §5).

def transformers_step_logits(hf_model: Any, sequence: Sequence[int], prompt_len: int) -> np.ndarray:
    """One uncached full forward: transformers' own mask applies the sliding window over the whole sequence."""
    import torch

    device = next(hf_model.parameters()).device
    with torch.inference_mode():
        out = hf_model(torch.tensor([list(sequence)], device=device)).logits  # [1, L, V]
    return out[0, prompt_len - 1:len(sequence) - 1].float().cpu().numpy()


@dataclasses.dataclass
class Implementations:
    """Loaded models by backend name, and transformers' MistralForCausalLM as the reference (None: not compared)."""

    models: dict[str, Any]
    transformers: Any = None


def load_implementations(model_dir: Path, dtype: str, with_transformers: bool = True,
                         backends: Sequence[str] | None = None) -> Implementations:
    """The backends' models (all, or those named) on one device each, and transformers' unless asked not to."""
    impls = Implementations({name: backend.module().load(model_dir, dtype) for name, backend in BACKENDS.items()
                             if backends is None or name in backends})
    if with_transformers:
        try:
            import torch
            from transformers.utils import logging as hf_logging
        except ImportError:  # transformers is optional: compare the backends alone
            return impls
        hf_logging.disable_progress_bar()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        impls.transformers = transformers_model(model_dir, getattr(torch, dtype)).to(device)
        impls.transformers.eval()
    return impls


def greedy_sequence(impls: Implementations, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Prompt + a greedy continuation by the first backend (torch_cache) in its default mode, ignoring EOS so every
    run has max_new_tokens steps."""
    name, model = next(iter(impls.models.items()))
    config = model.config
    model.config = dataclasses.replace(config, eos_token_id=None)
    try:
        result = BACKENDS[name].module().generate(model, [prompt_ids], max_new_tokens, cache="static")
    finally:
        model.config = config
    return prompt_ids + result.token_ids[0]


def run_names(impls: Implementations, all_modes: bool) -> dict[str, tuple[str, str]]:
    """label -> (backend, mode) of every run: each backend in its default mode (labelled by the backend), or in
    every mode (labelled backend:mode)."""
    runs = {}
    for name in impls.models:
        backend = BACKENDS[name]
        for mode in backend.modes if all_modes else [backend.default_mode]:
            runs[f"{name}:{mode}" if all_modes else name] = (name, mode)
    return runs


def parity_reports(impls: Implementations, prompt_ids: list[int], max_new_tokens: int, dtype: str,
                   caches: Sequence[str], all_modes: bool = False) -> list[PairReport]:
    """Teacher-forced comparison of every pair of loaded implementations, for each cache kind."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 1 for a parity run")
    config = next(iter(impls.models.values())).config
    validate_prompts([prompt_ids], config)
    sequence = greedy_sequence(impls, prompt_ids, max_new_tokens)
    prompt_len = len(prompt_ids)
    reference = transformers_step_logits(impls.transformers, sequence, prompt_len) if impls.transformers else None
    reports = []
    for cache in caches:
        runs = {"transformers": reference} if reference is not None else {}
        for label, (name, mode) in run_names(impls, all_modes).items():
            tower = BACKENDS[name].module()
            runs[label] = tower.step_logits(impls.models[name], sequence, prompt_len, cache, mode)
        names = list(runs)
        for i, ref_name in enumerate(names):
            for cand_name in names[i + 1:]:
                metrics = compare_logits(runs[ref_name], runs[cand_name], dtype)
                reports.append(PairReport(cache=cache, reference=ref_name, candidate=cand_name, dtype=dtype, **metrics))
    return reports


def format_table(reports: Sequence[PairReport]) -> str:
    width = max([22] + [len(r.reference + " vs " + r.candidate) for r in reports])
    header = (f"{'cache':<15} {'pair':<{width}} {'steps':>5} {'max_abs_logit_diff':>19} {'mean_kl':>10} "
              f"{'top1_agree':>10} {'decisive':>15} {'diverges_at':>11}  verdict")
    lines = [header, "-" * len(header)]
    for r in reports:
        diverges = "-" if r.first_greedy_divergence_step is None else str(r.first_greedy_divergence_step)
        lines.append(f"{r.cache:<15} {r.reference + ' vs ' + r.candidate:<{width}} {r.steps:>5} "
                     f"{r.max_abs_logit_diff:>19.3e} {r.mean_kl:>10.2e} {r.top1_agreement:>10.2%} "
                     f"{f'{r.top1_agreement_decisive:.2%} of {r.decisive_steps}':>15} {diverges:>11}  "
                     f"{'ok' if r.within_bounds else 'OUT OF BOUNDS'}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:

    parser = subparsers.add_parser(
        "parity", help="check transformers, torch_cache and jax_cache agree on a checkpoint",
        description="Teacher-forced logit parity over every decode step. Exit 0 when every pair is within the "
                    "bounds for the dtype (fp32: max abs logit diff <= 1e-5 and the same greedy token wherever the "
                    "reference's top-1 margin > 1e-4; bf16/fp16: mean KL <= 1e-3 and top-1 agreement >= 99% over the "
                    "decisive steps, whose reference top-1 margin exceeds 4 ulps), 1 when one is not, 2 on bad input.")
    add_model_arguments(parser)
    parser.add_argument("--backend", choices=("all", *BACKENDS), default="all",
                        help="compare every backend (default), or one; with --mesh, each backend split over the mesh "
                             "is compared with itself on one device and with transformers")
    parser.add_argument("--cache", choices=(*CACHE_KINDS, "both"), default="both")
    parser.add_argument("--modes", choices=("default", "all"), default="default",
                        help=f"run each backend in its default mode (what generate runs), or in all of its modes "
                             f"({modes_help()})")
    parser.add_argument("--no-transformers", action="store_true", help="compare the backends only")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    model_dir = args.model if args.model is not None else default_model_dir()
    config = load_config(model_dir)
    prompt_ids, _ = resolve_prompt(args, model_dir)
    if args.cache == "both":  # a window-less config has no sliding cache to compare
        caches = [kind for kind in CACHE_KINDS if kind == "static" or config.sliding_window is not None]
    else:  # sliding_window on a window-less config is refused by the cache itself, with its clear error
        caches = [args.cache]
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    if args.mesh is not None:
        from twincache_app import mesh_parity

        return mesh_parity.run(args, config, model_dir, prompt_ids, caches, backends)
    impls = load_implementations(model_dir, args.dtype, not args.no_transformers, backends)
    all_modes = args.modes == "all"
    reports = parity_reports(impls, prompt_ids, args.max_new_tokens, args.dtype, caches, all_modes)
    passed = all(r.within_bounds for r in reports)
    if args.json:
        print(json.dumps({"model": str(model_dir), "dtype": args.dtype, "prompt_len": len(prompt_ids),
                          "transformers_compared": impls.transformers is not None, "passed": passed,
                          "modes": {label: mode for label, (_, mode) in run_names(impls, all_modes).items()},
                          "pairs": [dataclasses.asdict(r) for r in reports]}))
    else:
        print(format_table(reports))
        print(f"{'PASS' if passed else 'FAIL'}: {sum(r.within_bounds for r in reports)}/{len(reports)} pairs within "
              f"the {args.dtype} bounds", file=sys.stderr)
    return 0 if passed else 1
