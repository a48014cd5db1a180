"""What the mesh workers (mesh_jax_worker, mesh_torch_worker) share: the weights check (a load with the host reporting
one byte less than the loaded weights were measured to hold, then exactly that), a checkpoint's copy with another
EOS id, and the sampled run whose copies of a padded row must end with it. It judges nothing: test_mesh does."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from twincache import cache_checks
from twincache.errors import ResourceError


def reload_at_the_boundary(load: Callable[[], bool], held: int) -> dict[str, object]:
    """`load()` (True when it placed the model where asked) with the host reporting `held` - 1 bytes, then `held`:
    the first one's refusal (None: it loaded), and the second one's result or refusal."""
    available = cache_checks.host_available_bytes
    try:
        cache_checks.host_available_bytes = lambda: held - 1
        try:
            load()
            refused = None
        except ResourceError as err:
            refused = str(err)
        cache_checks.host_available_bytes = lambda: held
        try:
            loaded: bool | str = load()
        except ResourceError as err:  # recorded, so that the test names it
            loaded = str(err)
    finally:
        cache_checks.host_available_bytes = available
    return {"held": held, "refused": refused, "loaded_with_exactly_that": loaded}


# One sampled row, padded with a copy on a data split of 2 (twincache.mesh.pad_batch). The copy draws its own tokens
# (a row's draws follow its index), so an EOS id the row emits and its copy never does ends the row alone.
PADDED_PROMPT = [1, 5, 9, 7]
PADDED_TEMPERATURE, PADDED_SEED = 1.5, 3


def pick_eos(free: list[list[int]]) -> tuple[int, int]:
    """From a free-running (no EOS) two-row run of PADDED_PROMPT: (step, id), the first step >= 2 where row 0 emits an
    id new to it that row 1 (the copy's stream) never emits."""
    row, copy = free
    return next((step, token) for step, token in enumerate(row)
                if step >= 2 and token not in row[:step] and token not in copy)


def checkpoint_with_eos(checkpoint: Path, eos: int, directory: Path) -> Path:
    """A copy of `checkpoint` whose config (and generation config, where there is one) ends rows at `eos`."""
    shutil.copytree(checkpoint, directory)
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if path.exists():
            path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": eos}))
    return directory
