"""torch_cache: the PyTorch tower of twincache (docs/design.md §1). It imports only torch and the floor `twincache`.

The backend's name and decode modes are declared here, free of torch, so the command line can list them without
importing the framework; `torch_cache.backend` is the surface the app layer drives (docs/design.md §5).
"""

NAME = "torch"
# Decode modes, the default first, with what each runs.
MODES = {
    "compiled": "eager prefill, then the decode step under torch.compile(mode='reduce-overhead', fullgraph=True) "
                "(CUDA graphs on GPU)",
    "eager": "eager prefill and eager decode steps",
}
STREAMING_MODES = ("compiled", "eager")  # modes that hand each step's tokens to on_token as they are decoded

DEFAULT_MODE = next(iter(MODES))
MESH_PROCESSES = True  # one process per device (torch.distributed): `--mesh` launches them

__all__ = ["NAME", "MODES", "STREAMING_MODES", "DEFAULT_MODE", "MESH_PROCESSES"]
