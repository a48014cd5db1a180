"""Directories twincache writes to (TWINCACHE_HOME, bench --out): checked up front, with one clear message."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from twincache.errors import StorageError


def writable_directory(path: Path, what: str, advice: str) -> Path:
    """Create `path` if needed and check that a file can be written in it; StorageError naming `what` otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StorageError(f"{what} {path} is a file, not a directory; {advice}")
    if path.is_symlink() and not path.exists():  # mkdir said only "(File exists)"; its target may be a disk not mounted
        raise StorageError(f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist; create "
                           f"that directory, or {advice}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".twincache-write-check-"):
            pass
    except OSError as err:
        raise StorageError(f"{what} {path} is not a writable directory ({err.strerror or err}); {advice}") from None
    return path
