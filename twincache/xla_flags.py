"""XLA_FLAGS, the options XLA reads once when JAX starts its backend: an option goes in only when the variable does not
already name it, so a user's own setting always wins (jax_cache's excess precision, the CLI's simulated CPU
devices)."""

from __future__ import annotations

import os


def add_xla_flag(option: str, value: object) -> None:
    """Append `--option=value` to os.environ["XLA_FLAGS"] unless XLA_FLAGS already names `option`."""
    flags = os.environ.get("XLA_FLAGS", "")
    if option not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{option}={value}".strip()


__all__ = ["add_xla_flag"]
