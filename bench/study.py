"""What the single-question studies (`python -m bench.fused_blocks`, `python -m bench.guard_skip`) share: the
checkpoint they run (the trained default model unless one is named) and a fixed prompt of ids for it."""

from __future__ import annotations

from pathlib import Path

from twincache.checkpoint import load_config


def model_and_prompt(model: Path | None, prompt_len: int) -> tuple[Path, list[int]]:
    """The checkpoint directory (`model`, or the trained default model, built on first use) and `prompt_len` ids
    spread over its vocabulary (never 0)."""
    if model is None:
        from twincache.default_model import default_model_dir

        model = default_model_dir()
    vocab_size = load_config(model).vocab_size
    return model, [1 + (7 * i) % (vocab_size - 1) for i in range(prompt_len)]
