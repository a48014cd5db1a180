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


def share_temp_dir() -> Path:
    """The temp dir Python uses, handed to child processes as TMPDIR. tempfile skips a TMPDIR (or TEMP, TMP) it
    cannot write a file in (missing, a file, /proc, a full disk) and falls back to /tmp; the C++ compiler inductor
    runs does not (g++ trusts access(), which root passes on /proc, and a full disk shows only when it writes), so a
    compiled torch step failed with "unexpected InductorError: ... Cannot create temporary file in /proc/" or "No
    space left on device". Children now use the directory Python checked."""
    try:
        chosen = tempfile.gettempdir()
    except FileNotFoundError as err:  # TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory all refused
        raise StorageError(f"no writable temporary directory ({err}); point TMPDIR at a writable directory") from None
    if any(os.environ.get(name) for name in ("TMPDIR", "TEMP", "TMP")) and os.environ.get("TMPDIR") != chosen:
        os.environ["TMPDIR"] = chosen
    return Path(chosen)
