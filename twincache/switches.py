"""On/off switches read from the environment at each use: "1" or "0" (unset: the switch's default, on unless it says
otherwise); any other value is refused in one line, naming the variable and what each value does."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from twincache.errors import InputError


def switch(name: str, on: str, off: str, default: bool = True) -> bool:
    """Whether the environment variable `name` turns its feature on: "1" is on, "0" is off, unset is `default`. `on`
    and `off` say what each value does, for the error that refuses any other value."""
    value = os.environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise InputError(f"{name}={value!r}: set it to 0 ({off}) or 1 ({on})")
    return value == "1"


@contextlib.contextmanager
def switch_set(name: str, value: str) -> Iterator[None]:
    """The environment variable `name` set to `value` inside the block, and as it was (or unset) after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
