"""jax_cache: the JAX/Flax tower of twincache, the port of torch_cache (docs/design.md §1). It imports only jax, flax
and the floor `twincache`.

The backend's name and decode modes are declared here, free of jax, so the command line can list them without
importing the framework; `jax_cache.backend` is the surface the app layer drives (docs/design.md §5).

XLA by default keeps the bf16/fp16 intermediates of a fused elementwise chain in fp32 ("excess precision"), while
torch rounds every op's output. With it on, bf16 greedy tokens of jax_cache and torch_cache disagree at near-ties
(measured on the default model: 98.4% top-1 agreement over 128 steps; 100% with it off), so jax_cache turns it off
unless XLA_FLAGS already sets it. It only takes effect if jax_cache is imported before JAX initialises its backend
(docs/design.md §7.4).
"""

import os

if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

NAME = "jax"
# Decode modes, the default first, with what each runs.
MODES = {
    "fused": "jitted prefill, then the whole decode loop in one jitted lax.while_loop (tokens come back at the end)",
    "step": "jitted prefill, then one jitted, donated step per token, queued one step ahead",
}
STREAMING_MODES = ("step",)  # modes that hand each step's tokens to on_token as they are decoded

DEFAULT_MODE = next(iter(MODES))
MESH_PROCESSES = False  # one process drives every device of a mesh (XLA SPMD)

__all__ = ["NAME", "MODES", "STREAMING_MODES", "DEFAULT_MODE", "MESH_PROCESSES"]
