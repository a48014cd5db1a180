"""The two towers mirror each other (docs/design.md §1): the same modules, public names, classes and methods, and
module-level private helpers, with the same parameter names in the same order, each optional in both or in neither.
Every difference a framework forces is listed below with its reason; any other drift fails here, and so does a listed
difference that no longer exists. Only names and signatures are read.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

TOWERS = ("torch_cache", "jax_cache")
MODULES = ("", "cache", "model", "projection", "generate", "backend", "sharding")  # "" is the package itself

# Public names only one tower has (module.name or module.Class.member) -> why.
_TORCH_RANK = "torch runs one process per device, each holding plain local tensors and calling its collectives itself"
_JAX_SPMD = ("JAX holds global arrays placed by NamedShardings, and jitted calls pin them in and out (donation needs "
             "equal shardings); XLA SPMD inserts the collectives")
TORCH_ONLY = {
    "cache.StaticCache.batch_size": "a torch rank on a mesh holds a shard of the K/V buffers, so the whole cache's "
                                    "batch is read off slot_positions; JAX arrays are global (cache_layout reads them)",
    "cache.StaticCache.num_kv_heads": "as batch_size: the whole cache's KV heads, not the rank's shard's",
    "sharding.TensorParallel": f"{_TORCH_RANK} (functional collectives, as gpt-fast's tp.py)",
    "sharding.SINGLE": "the identity TensorParallel an unsplit torch model calls",
    "sharding.parallelize": "a torch rank's model takes its local head counts and collectives; a JAX model is the same "
                            "module on any mesh",
    "sharding.weight_slice": f"{_TORCH_RANK}; JAX's weight_sharding places the global array instead",
    "sharding.local_device": f"{_TORCH_RANK}; one JAX process drives every device of its mesh",
    "model.compile_region": "regional compilation for torch.compile (one decoder layer traced once); XLA compiles a "
                            "whole step in seconds",
    "model.DecoderLayer.forward_in_place": "the compiled region: a decoder layer and its cache write on tensors alone",
    "cache.usable_device": "a torch cache and model take a device argument, checked here; JAX places new arrays on "
                           "its default device (cache.default_device)",
    "cache.StaticCache.in_place_slots": "as model.DecoderLayer.forward_in_place: the write's slots, as a tensor",
    "cache.StaticCache.write_in_place": "as model.DecoderLayer.forward_in_place: the write itself, on the buffers; a "
                                        "JAX cache's update returns new arrays, which XLA writes in place",
    "projection.pack_projections": "oneDNN-packed weight copies that batched compiled CPU steps read through a custom "
                                   "op (docs/design.md §7.36); XLA-CPU has no packed layout to call",
    "projection.project_stacked": "as pack_projections: q, k and v (gate and up) read from one stacked packed copy",
}
JAX_ONLY = {
    "sharding.MODEL": "the model axis of the (data, model_kv, model_copy) view JAX places arrays on",
    "sharding.weight_sharding": f"{_JAX_SPMD}; torch's weight_slice cuts the rank's slice instead",
    **{f"sharding.{name}": _JAX_SPMD for name in ("cache_shardings", "batch_sharding", "replicated", "place",
                                                    "place_cache")},
    "model.Embedding": "torch uses nn.Embedding; NNX builds the HF [vocab, hidden] table itself",
    "projection.stored_dtype": "XLA-CPU contracts float16 at ~2 GB/s and gathers bf16 rows from an fp32 copy of the "
                          "table, so there some half-precision weights are kept as float32 (docs/design.md §7.20); "
                          "torch's CPU kernels read half-precision weights as they are",
    "projection.matmul_precision": "XLA takes a precision per product (float32 must ask for HIGHEST: GPUs default to "
                                   "TF32); torch's CPU and CUDA float32 products are true fp32 unless TF32 is enabled",
    "cache.StaticCache.check_live": "a donated JAX buffer is deleted; a torch cache is written in place, never stale",
    "cache.StaticCache.is_consumed": "as check_live: whether a donated JAX cache's buffers are gone",
    "cache.StaticCache.replace": "JAX arrays are immutable: a write returns a new cache",
    "cache.default_device": "a torch cache takes a device argument; JAX places new arrays on its default device",
    "cache.device_label": "a JAX array may span several devices, so placements are compared as labels",
    "cache.StaticCache.tree_flatten": "the pytree protocol",
    "cache.StaticCache.tree_unflatten": "the pytree protocol",
    "generate.MIN_PROMPT_BUCKET": "XLA compiles one prefill per shape, so prompts are padded to buckets; torch "
                                  "prefills eagerly",
    "generate.prompt_bucket": "as MIN_PROMPT_BUCKET",
    "generate.ModelGraph": "jit takes an NNX model as a hashed GraphDef plus its State",
    "generate.split_model": "as ModelGraph",
    "generate.DecodeState": "the jitted decode loops carry their state; torch loops in Python around one compiled step",
    "generate.FusedCarry": "as DecodeState",
    "generate.UndoLog": "as DecodeState: a fused block's log of the ring slots it overwrote, for a rollback after an "
                        "exception (docs/design.md §7.31); torch's steps run in Python, at most one queued",
    "generate.UNDO_LOG_BYTES": "as generate.UndoLog",
    "generate.initial_state": "as DecodeState",
    "generate.decode_body": "as DecodeState",
    "generate.fused_executable": "the fused lax.while_loop is compiled ahead of time, apart from decoding",
    "generate.FUSED_BLOCK_STEPS": "the fused mode runs its jitted loop in blocks of steps; torch loops in Python",
    "generate.decode_fused": "as FUSED_BLOCK_STEPS",
    "generate.FUSED_BLOCK_SECONDS": "as FUSED_BLOCK_STEPS",
    "generate.FIRST_BLOCK_STEPS": "as FUSED_BLOCK_STEPS",
    "generate.BlockCallback": "as FUSED_BLOCK_STEPS",
    "generate.TOP_P_CANDIDATES": "XLA-CPU sorts a vocabulary ~3x slower than torch, so top-k and top-p look among "
                                 "the top tokens first (lax.cond); torch sorts: torch.cond cost more than the sort on "
                                 "CPU and could take the step out of CUDA graphs (design.md §5)",
}
# Modules only one tower has -> why. Every other module file is in both towers.
TORCH_ONLY_MODULES = {
    "inductor_cpu": "inductor's C++ toolchain for CPU kernels (vector-ISA checks, a precompiled header, a compiler run "
                    "per kernel), warmed while the weights load and batched; XLA compiles a step itself",
}
JAX_ONLY_MODULES: dict[str, str] = {}
# Parameters only one tower's signature has: qualified function -> parameter names (and why).
TORCH_ONLY_PARAMS = {
    "cache.StaticCache.__init__": ("device",),  # torch allocates on a device; JAX on its default one
    "cache.SlidingWindowCache.__init__": ("device",),
    "cache.make_cache": ("device",),
    "model.Mistral.from_pretrained": ("device",),
    "model._check_weights_fit": ("device",),  # the memory it measures; JAX's is its default device's or its mesh's
    "generate.decode_step_fn": ("compile",),  # torch.compile or eager; JAX's step is always jitted
    "generate.generate": ("compile",),  # the tower's own decode knob; backend.generate(mode=...) is the neutral one
    "generate.continue_generation": ("compile",),
    "projection.project": ("packed",),  # the weight's oneDNN copy (pack_projections), where one is made
    "generate._check_outputs_fit": ("device",),  # the memory it measures; JAX's is its default device's
    "generate._knobs": ("device",),  # where the setting tensors are made; JAX's arrays go where the step runs
}
JAX_ONLY_PARAMS = {
    # NNX creates parameters at construction, in a dtype; torch modules are built first and converted afterwards.
    **{f"model.{cls}.__init__": ("dtype",) for cls in ("Linear", "RMSNorm", "Attention", "MLP", "DecoderLayer",
                                                      "MistralModel", "Mistral")},
    "generate.generate": ("fused",),  # the tower's own decode knob, as torch's `compile`
    "generate.continue_generation": ("fused",),
}
# Module-level private helpers only one tower has (module._name, wrapped ones such as jitted or cached functions
# included) -> why. A helper both towers have is compared like a public function (same parameters, same order).
_PACKED = "as projection.pack_projections: when and how a compiled CPU step reads a weight's oneDNN-packed copy"
_NOISE = ("torch's sampling noise: Gumbel noise from a counter-based hash (lowbias32) of the seed, the step and each "
          "entry's index, computed inside the compiled step with no RNG state; JAX draws with jax.random's keys")
_TENSOR_STEP = ("torch's compiled step takes every setting as a tensor (eos ids, forcing, key, noise bits), so greedy, "
                "forced and sampled steps of one kind share a graph; JAX's steps take them static (kind, eos) or "
                "traced (knobs) and choose with _pick")
_TORCH_STEP = "torch.compile's decode step and dynamo's guard check, which steady steps may skip (docs/design.md §5)"
_VARIANT_LIMIT = ("dynamo's recompile limit on the torch step's code, whose entries are dropped before a compile "
                  "would pass it (docs/design.md §5); JAX's jit caches have no such limit")
_IN_FLIGHT = ("two torch steps in flight on a GPU and CUDA graphs replaying into the same buffers (docs/design.md "
              "§7.31); JAX dispatches asynchronously by itself and returns new arrays")
_EXACT_SUMS = ("top-p's masses summed exactly in float32 (docs/design.md §5): JAX has no float64 by default; torch "
               "sums them in float64")
_JITTED = ("a jitted JAX prefill, step or block, or their shared body (torch prefills eagerly and compiles its step "
           "with _decode_one_fn)")
_HANDED_BACK = ("a decode call donates the JAX cache it is given: on an exception the caller's object is pointed at "
                "the live, rolled-back cache; torch's cache is written in place and rolls back in a context manager "
                "(_rolled_back_if_unread)")
_UNDO_LOG = ("a fused JAX block runs many steps before the host reads them, so on a ring it logs the slots they "
             "overwrite, and a rollback restores them (docs/design.md §7.31); torch undoes at most one queued step")
TORCH_ONLY_HELPERS = {
    "model._aligned": "safetensors' CPU tensors are not 64-byte aligned: torch copies them once so the handoff shares "
                      "them zero-copy with XLA (docs/design.md §7.10); JAX copies every weight into its own arrays",
    **{f"projection.{name}": _PACKED for name in ("_cpu_vendor", "_multiply_sum_max_rows", "_multiply_sum_rows",
                                                   "_packed_min_rows", "_packed_rows_from", "_packed_linear_shape",
                                                   "_reads_packed")},
    **{f"generate.{name}": _NOISE for name in ("_mul32", "_hash32", "_fold_in", "_index_bits", "_gumbel", "_draw")},
    **{f"generate.{name}": _TENSOR_STEP for name in ("_choose", "_first_tokens", "_eos_tensor", "_no_draw_args",
                                                      "_sampling_bits")},
    **{f"generate.{name}": _TORCH_STEP for name in ("_decode_one_fn", "_entry_function", "_guard_skip_wanted",
                                                     "_can_skip_guards", "_dynamo_entries", "_frame_locals",
                                                     "_guards_pass")},
    **{f"generate.{name}": _VARIANT_LIMIT for name in ("_decode_variant_limit", "_variant_limit", "_must_make_room",
                                                        "_make_room")},
    **{f"generate.{name}": _IN_FLIGHT for name in ("_overlap_wanted", "_outputs_replayed",
                                                    "_rolled_back_if_unread")},
}
JAX_ONLY_HELPERS = {
    **{f"cache.{name}": "reset() empties a JAX cache by donating its buffers to a jitted emptying (on a mesh keeping "
                        "each array's sharding); torch's reset() writes its buffers in place"
       for name in ("_emptied", "_emptier", "_empty_in_place")},
    "model._ordered_after": "a data dependency that orders a cache write after the attention that reads the old "
                            "buffers plus the new tokens, so XLA updates them in place and copies none (docs/design.md "
                            "§7.2); torch writes in place in program order",
    "projection._contract": "XLA-CPU streams a float32 weight faster as the dot's left operand (docs/design.md §7.35); "
                            "torch calls its linear kernels",
    **{f"generate.{name}": _EXACT_SUMS for name in ("_grid", "_split", "_sum_exactly", "_prefix_sums_exactly")},
    "generate._top_p_cutoff": "as generate.TOP_P_CANDIDATES: top-p's cut among the top tokens first",
    "generate._sample": "sample() with a static kind and traced knobs, as the jitted steps take them; torch's "
                        "compiled step draws with _draw",
    "generate._pick": "a step's choice of tokens with a static kind and eos and traced knobs; torch's _choose does "
                      "the same with every setting a tensor, in another order (the two cannot share a signature)",
    "generate._is_eos": "eos ids as a compile-time constant; torch's step takes them as a tensor (_eos_tensor)",
    "generate._seed_key": "a seed's jax.random key, its PRNG implementation pinned against the process's default; "
                          "torch's draw hashes the seed itself (_fold_in)",
    **{f"generate.{name}": _JITTED for name in ("_prefill", "_decode_step", "_sampled_step", "_fused_decode",
                                                 "_forward_last")},
    **{f"generate.{name}": _HANDED_BACK for name in ("_given_back", "_handed_back")},
    **{f"generate.{name}": _UNDO_LOG for name in ("_logs_undo", "_block_capacity", "_empty_log", "_logged",
                                                   "_placed_log", "_undone")},
    **{f"generate.{name}": "jax.jit keeps every compiled variant in its own cache: each jitted function is bounded "
                           "at MAX_DECODE_VARIANTS by a wrapper (torch's step by dynamo's entries, _make_room)"
       for name in ("_bounded", "_drop_executables")},
    "generate._placed": _JAX_SPMD,
    "generate._on_rows": _JAX_SPMD,
    "generate._write_logits": "return_logits writes each step or block into one donated array with traced offsets: "
                              "a JAX slice or concatenate compiles per shape, and a fused block's size follows wall "
                              "time; torch stacks its steps eagerly",
    "sharding._view": f"{_JAX_SPMD}: the (data, model_kv, model_copy) view arrays are placed on",
    "sharding._named": f"{_JAX_SPMD}: specs written as XLA hands them back, so a second call does not recompile",
}
RENAMED_PARAMS: dict[str, str] = {}  # none today: both towers take a key and fold the step into it
METHOD_NAMES = {"forward": "__call__"}  # torch modules compute in forward, NNX modules in __call__


def test_mirror_towers_have_the_same_module_files_but_for_the_listed_ones():
    files = {tower: {path.stem for path in (Path(__file__).resolve().parents[1] / tower).glob("*.py")}
             for tower in TOWERS}
    assert files["torch_cache"] - files["jax_cache"] == set(TORCH_ONLY_MODULES), files
    assert files["jax_cache"] - files["torch_cache"] == set(JAX_ONLY_MODULES), files
    assert files["torch_cache"] & files["jax_cache"] == {name or "__init__" for name in MODULES}, files


def tower_module(tower: str, name: str) -> ModuleType:
    return importlib.import_module(f"{tower}.{name}" if name else tower)


def defined_public_names(module: ModuleType) -> set[str]:
    """Top-level functions, classes and assignments the module's own source defines, without a leading underscore."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def members(cls: type) -> dict[str, object]:
    """The members a class defines itself (inherited ones count where they are defined), with torch's `forward`
    under NNX's name `__call__`."""
    return {METHOD_NAMES.get(name, name): value for name, value in vars(cls).items()
            if not name.startswith("__") or name in ("__init__", "__call__")}


def parameters(fn: object) -> list[tuple[str, str, bool]]:
    """(name, kind, whether it has a default) of each parameter: a default's value may name a framework type, but
    whether a caller may leave the argument out is the same in both towers."""
    function = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    return [(p.name, p.kind.name, p.default is not p.empty)
            for p in inspect.signature(inspect.unwrap(function)).parameters.values()]


def public_surface(tower: str, module_name: str) -> dict[str, object]:
    """qualified name -> object: the module's __all__, and each exported class's members (private ones included:
    where both towers have a private helper, its signature must match too)."""
    module = tower_module(tower, module_name)
    surface: dict[str, object] = {}
    for name in module.__all__:
        surface[f"{module_name}.{name}"] = getattr(module, name)
        value = getattr(module, name)
        if inspect.isclass(value) and value.__module__ == module.__name__:
            for member, member_value in members(value).items():
                surface[f"{module_name}.{name}.{member}"] = member_value
    for name, value in vars(module).items():  # private module-level functions, compared where both have them
        if name.startswith("_") and not name.startswith("__") and is_function(value):
            if inspect.unwrap(value).__module__ == module.__name__:
                surface[f"{module_name}.{name}"] = value
    return surface


def is_function(value: object) -> bool:
    """A function, or one wrapped by a decorator that keeps it as __wrapped__ (jax.jit, functools.lru_cache,
    contextlib.contextmanager)."""
    return inspect.isfunction(inspect.unwrap(value)) if callable(value) else False


def private_helpers(tower: str, module_name: str) -> set[str]:
    """module._name of each private module-level function the tower's module defines."""
    return {name for name in public_surface(tower, module_name)
            if name.count(".") == 1 and name.split(".")[1].startswith("_")}


def is_public(qualified: str) -> bool:
    return not any(part.startswith("_") and part not in ("__init__", "__call__") for part in qualified.split("."))


def listed(qualified: str, allowed: dict[str, str]) -> str | None:
    """The entry of `allowed` that covers a name: the name itself or a class it belongs to."""
    parts = qualified.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in allowed), None)


@pytest.mark.parametrize("module_name", MODULES)
@pytest.mark.parametrize("tower", TOWERS)
def test_mirror_all_lists_exactly_the_public_names_a_module_defines(tower, module_name):
    module = tower_module(tower, module_name)
    assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
    assert len(module.__all__) == len(set(module.__all__)), f"{module.__name__}.__all__ repeats a name"
    assert set(module.__all__) == defined_public_names(module), (
        f"{module.__name__}.__all__ differs from its public definitions: "
        f"{set(module.__all__) ^ defined_public_names(module)}")


@pytest.mark.parametrize("module_name", MODULES)
def test_mirror_public_names_are_the_same_but_for_the_listed_framework_differences(module_name):
    torch_side, jax_side = (public_surface(tower, module_name) for tower in TOWERS)
    only_torch = {name for name in set(torch_side) - set(jax_side) if is_public(name)}
    only_jax = {name for name in set(jax_side) - set(torch_side) if is_public(name)}
    for only, allowed, tower in ((only_torch, TORCH_ONLY, "torch_cache"), (only_jax, JAX_ONLY, "jax_cache")):
        unlisted = {name for name in only if listed(name, allowed) is None}
        assert not unlisted, f"{tower} only, and not listed as a framework difference: {sorted(unlisted)}"
        stale = {name for name in allowed if name.startswith(f"{module_name}.") and name not in only}
        assert not stale, f"listed as {tower} only, but mirrored or gone: {sorted(stale)}"


@pytest.mark.parametrize("module_name", MODULES)
def test_mirror_private_helpers_are_in_both_towers_but_for_the_listed_ones(module_name):
    """A module-level private helper is in both towers' same module (its signature then compared below), or listed
    with the reason only one tower needs it."""
    torch_side, jax_side = (private_helpers(tower, module_name) for tower in TOWERS)
    for only, allowed, tower in ((torch_side - jax_side, TORCH_ONLY_HELPERS, "torch_cache"),
                                 (jax_side - torch_side, JAX_ONLY_HELPERS, "jax_cache")):
        unlisted = only - set(allowed)
        assert not unlisted, f"{tower} only, and not listed as a one-tower helper: {sorted(unlisted)}"
        stale = {name for name in allowed if name.startswith(f"{module_name}.") and name not in only}
        assert not stale, f"listed as a {tower} helper, but in both towers or gone: {sorted(stale)}"


@pytest.mark.parametrize("module_name", MODULES)
def test_mirror_signatures_name_the_same_parameters_in_the_same_order(module_name):
    torch_side, jax_side = (public_surface(tower, module_name) for tower in TOWERS)
    compared = 0
    for name in sorted(set(torch_side) & set(jax_side)):
        ours, theirs = torch_side[name], jax_side[name]
        if isinstance(ours, (str, int, tuple)) and "." in name.removeprefix(f"{module_name}."):
            assert ours == theirs, f"{name}: class constant {ours!r} (torch) != {theirs!r} (jax)"
        if not (is_function(ours) or isinstance(ours, (classmethod, staticmethod))):
            continue  # properties and constants by name; classes member by member; type aliases name framework types
        torch_params = [(RENAMED_PARAMS.get(p, p), kind, default) for p, kind, default in parameters(ours)
                        if p not in TORCH_ONLY_PARAMS.get(name, ())]
        jax_params = [(p, kind, default) for p, kind, default in parameters(theirs)
                      if p not in JAX_ONLY_PARAMS.get(name, ())]
        assert torch_params == jax_params, f"{name}: torch_cache {torch_params} != jax_cache {jax_params}"
        compared += 1
    if module_name in ("cache", "model", "generate", "backend"):
        assert compared >= 3, f"{module_name}: only {compared} signatures compared; the test reads nothing"


def test_mirror_listed_parameter_differences_exist():
    """A listed parameter difference must still be one: in that tower's signature, not in the other's."""
    surfaces = {tower: {} for tower in TOWERS}
    for tower in TOWERS:
        for module_name in MODULES:
            surfaces[tower] |= public_surface(tower, module_name)
    for own, other, listed in (("torch_cache", "jax_cache", TORCH_ONLY_PARAMS),
                               ("jax_cache", "torch_cache", JAX_ONLY_PARAMS)):
        for name, params in listed.items():
            own_params = [p for p, _, _ in parameters(surfaces[own][name])]
            other_params = [p for p, _, _ in parameters(surfaces[other][name])]
            for param in params:
                assert param in own_params and param not in other_params, f"{name}({param}) is no longer {own} only"
