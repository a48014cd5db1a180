"""The oracle of `twincache generate`'s tokens: transformers' own greedy `generate` on the same checkpoint directory.

It borrows nothing of the code it judges: it imports neither tower, nor twincache, nor twincache_app, and it reads the
directory with `AutoModelForCausalLM.from_pretrained` (its config.json, generation_config.json and weights, EOS
included), which builds the class config.json names: MistralForCausalLM, or LlamaForCausalLM for a Llama. Each prompt
runs alone and unpadded, so transformers makes its own positions, mask and sliding-window cache.

A greedy token is a fact only where the choice is clear: random tiny models have near-tied logits, where two correct
fp32 implementations may pick differently. So every token the oracle gives is checked, here, against transformers'
float64 logits of the whole sequence, uncached: it must be their argmax, by a margin over the runner-up of more than
MARGIN. A prompt or seed without that margin fails the test that chose it (choose another), never skips.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

MARGIN = 1e-4  # float64 top-1 minus top-2 logit, at every step; fp32 rounding on these models is ~1e-6


def greedy(checkpoint: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (alone) on `checkpoint`, in fp32: up to `max_new_tokens` ids,
    ending at the checkpoint's EOS (included) when it comes sooner. Fails unless each id is the float64 argmax of its
    step by more than MARGIN."""
    return greedy_of(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(), prompts,
                     max_new_tokens)


def greedy_of(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """greedy() on a transformers causal LM loaded in fp32 by the caller (e.g. from a GGUF file, through transformers'
    own reader); the check turns it float64, in place."""
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])  # [1, P]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)  # [1, P + N]
            rows.append(out[0, len(prompt):].tolist())
        model.double()
        for row, (prompt, tokens) in enumerate(zip(prompts, rows, strict=True)):
            assert tokens, f"row {row}: transformers generated nothing"
            logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0, len(prompt) - 1:-1]  # [N, V]
            top = logits.topk(2, dim=-1)
            argmax, margins = top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()
            assert argmax == tokens, (f"row {row}: transformers' fp32 generate {tokens} is not its float64 argmax "
                                      f"{argmax}")
            step = min(range(len(margins)), key=margins.__getitem__)
            assert margins[step] > MARGIN, (f"row {row}: a near tie at step {step} (float64 top-1 - top-2 = "
                                            f"{margins[step]:.3g} <= {MARGIN}): greedy tokens are no fact here; "
                                            "choose another prompt or seed")
    return rows
