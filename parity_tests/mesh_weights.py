"""The mesh workers' weights check (mesh_jax_worker, mesh_torch_worker): a load with the host reporting one byte less
than the loaded weights were measured to hold, then exactly that. It judges nothing: test_mesh does."""

from __future__ import annotations

from collections.abc import Callable

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
