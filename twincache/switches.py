"""On/off switches read from the environment at each use: "1" (the default) or "0"; any other value is refused in
one line, naming the variable and what each value does."""

from __future__ import annotations

import os

from twincache.errors import InputError


def switch(name: str, on: str, off: str) -> bool:
    """Whether the environment variable `name` leaves its feature on: unset or "1" is on, "0" is off. `on` and
    `off` say what each value does, for the error that refuses any other value."""
    value = os.environ.get(name, "1").strip()
    if value not in ("0", "1"):
        raise InputError(f"{name}={value!r}: set it to 0 ({off}) or 1 ({on})")
    return value == "1"
