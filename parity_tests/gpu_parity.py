"""GPU parity at Mistral-7B shape, built in memory with random weights (nothing is downloaded).

Runs `twincache parity`'s report, with its rule (docs/design.md §4): each implementation teacher-forced with the float64
model's greedy continuation, its distance to transformers in float64 judged beside transformers' own in the dtype:
  1. bf16, Mistral-7B shape (32 layers, hidden 4096, 32 heads, 8 KV heads, window 4096, vocab 32000), prompt 502;
  2. fp32 (TF32 off, JAX precision "highest") on a smaller shape with window 64 and a 160-token prompt, every
     implementation (torch compiled, under CUDA graphs, included): the ring wraps;
  3. bf16, the 7B shape with the window cut to 256 and a 300-token prompt, so the ring wraps at that shape too.
In that order, so that a deadline (--deadline; bench/gpu_lease.sh) cuts the last.
At 7B shape the float64 reference alone holds 58 GB of weights, freed once its logits are computed; torch eager and
JAX step are measured there (a compile of the 7B decode step per cache would not fit the time limit).
Usage: PYTHONPATH=. python -m parity_tests.gpu_parity OUT_DIR [--deadline S] [--smoke]   (see gpu_check.sh)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from twincache.config import MistralConfig
from twincache_app import parity

MISTRAL_7B = MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                           rope_theta=10000.0, sliding_window=4096, max_position_embeddings=32768,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SMALL_FP32 = dataclasses.replace(MISTRAL_7B, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=2, sliding_window=64)


def build_models(config: MistralConfig, dtype: torch.dtype, seed: int = 0) -> parity.Models:
    """torch_cache model with seeded random weights on the GPU; transformers' floor (in `dtype`) holds the same
    tensors, JAX a zero-copy view of them, and only the float64 reference is a copy. At 7B shape that is 14.5 GB once
    plus 57.9 GB, 72.4 GB: it fits an H100's 80 GB, where a floor of its own (14.5 GB more) would not."""
    from transformers import MistralConfig as HFMistralConfig
    from transformers import MistralForCausalLM

    from torch_cache.model import Mistral
    from twincache_app.handoff import from_torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run of this script
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Mistral(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # 1/sqrt(fan_in) keeps activations O(1) through 32 layers
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    model.eval().requires_grad_(False)
    hf_config = HFMistralConfig(**{k: v for k, v in config.to_hf_dict().items() if k != "architectures"})
    hf_config._attn_implementation = "sdpa"  # float64 attention stays float64 (transformers' "eager" rounds via fp32)

    def transformers_copy(copy_dtype: torch.dtype) -> MistralForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(copy_dtype)  # build transformers' model directly in `copy_dtype` on the device
        try:
            with torch.device(device):
                copy = MistralForCausalLM(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        # in `dtype` its own random init is replaced by (and freed for) the model's tensors; in float64, an exact upcast
        copy.load_state_dict(model.state_dict(), strict=True, assign=copy_dtype == dtype)
        return copy.eval()

    floor = transformers_copy(dtype)
    if torch.cuda.is_available():  # the float32 construction above and the floor's init, freed, go back to the device
        torch.cuda.empty_cache()
    return parity.Models({"torch": model, "jax": from_torch(model)}, floor=floor,
                         reference=transformers_copy(torch.float64))


def run_case(name: str, config: MistralConfig, dtype: str, prompt_len: int, steps: int, out: Path,
             impls: tuple[str, ...], finished: Sequence[dict] = ()) -> list[dict]:
    """One case's rows. Each row is printed as it is judged, with the seconds since the case began, and written to
    gpu_parity.json after the `finished` cases' records, marked partial: a case the lease's hard stop cuts still
    says how far it got, and how fast (no GPU time has been measured yet)."""
    start = time.perf_counter()
    models = build_models(config, getattr(torch, dtype))
    print(f"{name}: models built ({time.perf_counter() - start:.0f} s)", flush=True)
    prompt = np.random.default_rng(1).integers(3, config.vocab_size, prompt_len).tolist()
    # The truth first, then its model goes: at 7B shape the float64 copy is 57.9 GB of an H100's 80, and JAX's
    # compile and both towers' caches then run in the ~65 GB it leaves instead of the ~7 GB beside it
    reference = parity.float64_reference(models.reference, [prompt], steps, models.why_not_transformers)
    models = dataclasses.replace(models, reference=None)
    gc.collect()  # build_models' frame sits in a reference cycle (see below)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"{name}: float64 reference computed, its model freed ({time.perf_counter() - start:.0f} s)", flush=True)
    judged_so_far: list[dict] = []

    def on_row(row: parity.Row) -> None:
        seconds = time.perf_counter() - start
        judged_so_far.append(dict(parity.row_json(row), case=name, seconds=seconds, partial=True))
        (out / "gpu_parity.json").write_text(json.dumps([*finished, *judged_so_far], indent=1))
        floor = next((r for r in judged_so_far if r["kind"] == "floor" and r["cache"] == row.cache), None)
        print(f"{name}: {row.cache} {row.name}: {parity.row_verdict(judged_so_far[-1], floor)} ({seconds:.0f} s)",
              flush=True)

    report = parity.parity_report(models, [prompt], steps, dtype, ["static", "sliding_window"], impls,
                                  reference=reference, on_row=on_row)
    data = parity.report_json(report, name)
    table = parity.format_table(data)
    seconds = time.perf_counter() - start
    text = f"## {name}: {dtype}, window {config.sliding_window}, prompt {prompt_len}, {steps} steps ({seconds:.0f} s)\n"
    print(text + table, flush=True)
    with (out / "gpu_parity.md").open("a") as f:
        f.write(text + "\n```\n" + table + "\n```\n\n")
    # build_models' frame, and with it torch_cache's model and transformers' floor, is held in a reference cycle that
    # transformers' lazy import of MistralForCausalLM leaves (the process's first): without a collection here the
    # first 7B case's 14.5 GB stays held while the next one builds its 72.4 GB, past an H100's 80 GB
    del models
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [dict(row, case=name, seconds=seconds) for row in data["rows"]]


AT_7B = ("torch:eager", "jax:step")
TINY = dataclasses.replace(MISTRAL_7B, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
# (name, config, dtype, prompt length, steps, implementations): the three cases of the module docstring.
CASES = [("mistral-7b-shape", MISTRAL_7B, "bfloat16", 502, 128, AT_7B),
         ("small-fp32-window-64", SMALL_FP32, "float32", 160, 128, parity.IMPLEMENTATIONS),
         ("mistral-7b-shape-window-256", dataclasses.replace(MISTRAL_7B, sliding_window=256), "bfloat16", 300, 128,
          AT_7B)]
SMOKE_CASES = [("tiny-bf16-wraps", TINY, "bfloat16", 12, 10, AT_7B)]


def main(out_dir: str | Path, cases: list[tuple] = CASES, deadline_s: float | None = None,
         clock: Callable[[], float] = time.monotonic) -> int:
    """Runs `cases` in order (a CPU smoke test passes tiny ones) and writes OUT_DIR/gpu_parity.{md,json} after each,
    so a run cut short keeps the cases it finished. No case starts once `deadline_s` seconds have passed: it is
    recorded as skipped. 0 when at least one case ran and every judged row passes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs true fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    start = clock()
    records: list[dict] = []
    skipped = []
    for name, config, dtype, prompt_len, steps, impls in cases:
        if deadline_s is not None and clock() - start > deadline_s:
            skipped.append(name)
            records.append(dict(case=name, kind="skipped", failed=False, note=f"deadline: {deadline_s:g} s passed"))
            with (out / "gpu_parity.md").open("a") as f:
                f.write(f"## {name}: skipped (deadline: {deadline_s:g} s passed before it could start)\n\n")
        else:
            records += run_case(name, config, dtype, prompt_len, steps, out, impls, finished=records)
        (out / "gpu_parity.json").write_text(json.dumps(records, indent=1))
    judged = [r for r in records if r["kind"] not in ("floor", "skipped")]
    passed = bool(judged) and all(not r["failed"] for r in judged)
    verdict = (f"{'PASS' if passed else 'FAIL'}: {sum(not r['failed'] for r in judged)}/{len(judged)} rows within "
               "bounds of the floor" + (f"; skipped at the deadline: {', '.join(skipped)}" if skipped else ""))
    print(verdict)
    with (out / "gpu_parity.md").open("a") as f:
        f.write(verdict + "\n")
    return 0 if passed else 1


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m parity_tests.gpu_parity", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default="gpu_parity_out")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no more cases start (each is recorded as skipped)")
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny bf16 case whose ring wraps, instead of the GPU cases: runs on CPU in seconds "
                             "(bench/gpu_lease.sh's smoke mode)")
    args = parser.parse_args(argv)
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        parser.error(f"OUT_DIR {args.out_dir} is a file; give a directory (made if missing) for gpu_parity.md/json")
    return args


if __name__ == "__main__":
    args = _parse_args(sys.argv[1:])
    sys.exit(main(args.out_dir, SMOKE_CASES if args.smoke else CASES, args.deadline))
