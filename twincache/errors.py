"""Errors that twincache raises on bad input. Each says what was wrong, the numbers, and what to do instead.

The CLI prints any `TwincacheError` as one line on stderr and exits with code 2.
"""


class TwincacheError(ValueError):
    """Base class: a user-facing error with a complete, one-line message."""


class ConfigError(TwincacheError):
    """config.json describes something twincache cannot compute exactly."""


class CheckpointError(TwincacheError):
    """The checkpoint directory or its weight files are missing, malformed or incomplete."""


class CacheError(TwincacheError):
    """A cache was used with inputs it was not built for (batch, dtype, device, model, capacity, positions)."""


class StaleCacheError(CacheError):
    """A cache whose buffers were donated to a jitted call was used again."""


class InputError(TwincacheError):
    """Token ids, prompt, lengths, attention mask or sampling parameters are out of range."""


class NonFiniteLogitsError(TwincacheError):
    """The model produced NaN or Inf logits during generation."""


class ResourceError(TwincacheError):
    """Something would not fit: a cache or buffer larger than the memory available for it."""


class StorageError(TwincacheError):
    """A directory twincache must write to (TWINCACHE_HOME, bench --out) is not a writable directory."""


class OutputError(TwincacheError):
    """The command's output cannot be written: stdout is closed, or a write to it failed (a full disk)."""


class UnavailableError(TwincacheError):
    """A backend or an optional dependency that the command needs is not installed."""


class MeshError(TwincacheError):
    """A mesh that cannot split this model or batch, or that needs more devices than there are."""
