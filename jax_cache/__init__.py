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

from twincache.xla_flags import add_xla_flag

add_xla_flag("xla_allow_excess_precision", "false")

NAME = "jax"
# Decode modes, the default first, with what each runs.
MODES = {
    "fused": "jitted prefill, then the decode loop as jitted lax.while_loop blocks of steps (tokens come back a block "
             "at a time)",
    "step": "jitted prefill, then one jitted, donated step per token, queued one step ahead",
}
STREAMING_MODES = ("step", "fused")  # modes that hand each step's tokens to on_token as they are decoded
BLOCK_STREAMING_MODES = ("fused",)  # of those, the ones that hand them over a block of steps at a time

DEFAULT_MODE = next(iter(MODES))
MESH_PROCESSES = False  # one process drives every device of a mesh (XLA SPMD)

__all__ = ["NAME", "MODES", "STREAMING_MODES", "BLOCK_STREAMING_MODES", "DEFAULT_MODE", "MESH_PROCESSES"]
