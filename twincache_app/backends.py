"""The backend registry: every tower the app layer drives, by name (docs/design.md §5).

An entry reads its tower's name and decode modes from the tower's package, which imports no framework, and imports
the tower's `backend` module only when a command needs it: `--help` imports neither torch nor jax, and
`--backend jax` never imports torch.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

import jax_cache
import torch_cache
from twincache.errors import InputError, UnavailableError


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    package: str
    modes: Mapping[str, str]  # mode -> what it runs; the first is the default
    streaming_modes: tuple[str, ...]  # modes that hand each step's tokens to on_token as they are decoded
    block_streaming_modes: tuple[str, ...]  # of those, the ones that hand them over a block of steps at a time
    mesh_processes: bool  # a mesh runs one process per device (torch), not one process for all (JAX)
    importer: Callable[[], ModuleType]
    # Keep compiled programs on disk across processes; call before the tower's first compile.
    persist_compiles: Callable[[], None] = lambda: None

    @property
    def default_mode(self) -> str:
        return next(iter(self.modes))

    def check_mode(self, mode: str | None) -> str:
        """The mode to run: `mode`, or the default when None; a mode of another backend is refused in one line."""
        if mode is None:
            return self.default_mode
        if mode not in self.modes:
            raise InputError(f"--mode {mode} is not a {self.name} mode; --backend {self.name} takes "
                             f"{' or '.join(self.modes)} (default {self.default_mode})")
        return mode

    def module(self) -> ModuleType:
        """The tower's backend module (load, generate, step_logits, compiled_variants), imported now."""
        try:
            return self.importer()
        except ImportError as err:
            others = ", ".join(name for name in BACKENDS if name != self.name)
            raise UnavailableError(f"the {self.name} backend is unavailable: cannot import {self.package}.backend "
                                   f"({err}); install its framework, or use --backend {others}") from None


def _torch_backend() -> ModuleType:
    import torch_cache.backend

    return torch_cache.backend


def _jax_backend() -> ModuleType:
    import jax_cache.backend

    return jax_cache.backend


def compiled_programs_dir(backend_name: str) -> Path:
    """Where a backend's compiled programs persist across runs: beside inductor's, in the system temp dir, per user
    (not in TWINCACHE_HOME, which a refused run must leave untouched)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / f"twincache_{user}" / backend_name


def _persist_xla_compiles() -> None:
    """XLA's persistent compilation cache in compiled_programs_dir("jax"), for every executable however fast it
    compiled: inductor keeps its kernels across runs by itself, XLA only when asked. On the trained default model a
    second `twincache generate --backend jax` then spends 1.7 s instead of 4.4 s in prefill + first step. A directory
    the user chose (JAX_COMPILATION_CACHE_DIR) wins; one that could not be created leaves the cache off."""
    try:
        import jax
    except ImportError:
        return  # the tower's import says so, in one line
    # Config flags are set dynamically: jax 0.10's stubs lack them, 0.11's type them Any (hence unused-ignore too).
    if jax.config.jax_compilation_cache_dir is not None:  # type: ignore[attr-defined, unused-ignore]
        return
    if not _owner_names_known():
        return
    directory = compiled_programs_dir("jax")
    existing = next(parent for parent in (directory, *directory.parents) if parent.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))  # JAX creates it at its first compile
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # A bounded cache evicts the least recently used entries, and reads and writes its entries under a file lock:
    # unbounded, a run could read an entry another run was still writing (the tests start several at once).
    jax.config.update("jax_compilation_cache_max_size", 1 << 30)


def _owner_names_known() -> bool:
    """Whether this process's uid and gid have passwd and group entries. JAX reads its cache's files through etils,
    whose stat looks up the owner's names: for a uid without one (a container run as an arbitrary uid) each
    executable written gave a UserWarning "Error writing persistent compilation cache entry ...: KeyError:
    'getpwuid(): uid not found: ...'", 17 of them around the text of one `generate --backend jax`."""
    import grp
    import pwd

    try:
        pwd.getpwuid(os.getuid())
        grp.getgrgid(os.getgid())
    except KeyError:
        return False
    return True


def _inductor_persists_by_itself() -> None:
    """torch: inductor's on-disk caches (FX graphs, kernels) are on by default."""


BACKENDS: dict[str, Backend] = {
    package.NAME: Backend(package.NAME, package.__name__, package.MODES, package.STREAMING_MODES,
                          package.BLOCK_STREAMING_MODES, package.MESH_PROCESSES, importer, persist_compiles)
    for package, importer, persist_compiles in ((torch_cache, _torch_backend, _inductor_persists_by_itself),
                                                (jax_cache, _jax_backend, _persist_xla_compiles))
}


def modes_help() -> str:
    """Every backend's modes for --help, the default first: 'torch: compiled (default), eager; jax: ...'."""
    return "; ".join(f"{b.name}: {', '.join(m + (' (default)' if m == b.default_mode else '') for m in b.modes)}"
                     for b in BACKENDS.values())


__all__ = ["Backend", "BACKENDS", "compiled_programs_dir", "modes_help"]
