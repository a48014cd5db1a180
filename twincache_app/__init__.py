"""twincache_app: the app layer, the only package that sees both towers (docs/design.md §1).

It holds the `twincache` command line, the parity runner, the soak, the torch <-> JAX handoff, the backend registry
and the bench's adapters; the floor `twincache` and the towers `torch_cache` and `jax_cache` never import it.
"""
