"""The bench's adapters for the towers: each backend in each of its decode modes is one implementation
(`torch_compiled`, `torch_eager`, `jax_fused`, `jax_step`), driven through the backend surface
(docs/design.md §5). bench/ reaches the towers only through this module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from bench.impls import Impl, Run
from bench.workload import Workload
from twincache.config import MistralConfig
from twincache.errors import UnavailableError
from twincache.mesh import MeshShape, split_mesh
from twincache.switches import switch_set
from twincache_app.backends import BACKENDS, Backend


def bench_model(workload: Workload, backend: Backend) -> Any:
    """The workload's weights as `backend`'s model, built once per workload and shared by the backend's modes."""
    if backend.name not in workload.models:
        tower = backend.module()
        if workload.model_dir is not None:
            model = tower.load(workload.model_dir, workload.dtype_name, workload.device)
            model.config = workload.config  # the preset's: a trained model's EOS is off
        else:  # weights built on the device (7b): every backend takes the same tensors, zero-copy where it can
            from twincache_app.handoff import weights_from_torch

            model = tower.from_weights(workload.config, weights_from_torch(workload.weights(), backend.name))
        workload.models[backend.name] = model
    return workload.models[backend.name]


class BackendImpl(Impl):
    """One backend in one decode mode. Caches are built once per shape and passed back in (a server keeps them):
    torch writes them in place at fixed addresses; JAX's reset() empties the donated buffers in place each run."""

    backend: ClassVar[Backend]
    mode: ClassVar[str]

    def __init__(self, workload: Workload) -> None:
        super().__init__(workload)
        self._caches = workload.caches.setdefault((self.backend.name, self.mode), {})

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            cls.backend.module()
        except UnavailableError as err:
            return str(err)
        return None

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int, cache: str, max_cache_len: int) -> Run:
        tower, model = self.backend.module(), bench_model(self.workload, self.backend)
        key = (cache, len(prompts), max_cache_len)
        times: list[float] = []
        # Streaming modes copy each step's tokens to the host before on_token, so these stamps follow the device; a
        # fused loop hands its steps over a block at a time, so it has no steps to stamp.
        on_token = (lambda _: times.append(time.perf_counter())) if self.per_step_timing else None
        start = time.perf_counter()
        # taken out while it runs: a JAX generate consumes the cache it is given, so after a failed run the next
        # one builds its own instead of reusing a consumed one
        result = tower.generate(model, prompts, new_tokens, mode=self.mode, cache=self._caches.pop(key, cache),
                                max_cache_len=max_cache_len, on_token=on_token)
        wall_s = time.perf_counter() - start
        self._caches[key] = result.cache
        return Run.from_result(result, wall_s, times)

    def note(self, cache: str) -> str:
        reads = ("the bucket of its filled slots (twincache.buckets)" if cache == "static" else
                 "a ring of W slots (the bucket of its filled slots until it is full), one slot written per step")
        return f"{self.backend.package} generate, {self.mode}: {self.backend.modes[self.mode]}; attention reads {reads}"

    def release(self) -> None:
        self._caches.clear()

    def compile_count(self) -> int | None:
        return self.backend.module().compiled_variants()


class SwitchedImpl(BackendImpl):
    """A backend mode run with one of torch_cache's environment switches set (a `variant` of a study of
    switch_studies): the same compiled step and caches as the mode's own adapter, another host loop."""

    study: ClassVar[str]
    variant: ClassVar[str]

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int, cache: str, max_cache_len: int) -> Run:
        variable, variants = switch_studies()[self.study]  # read here: the parser lists names without torch
        with switch_set(variable, variants[self.variant]):
            return super().generate(prompts, new_tokens, cache, max_cache_len)

    def note(self, cache: str) -> str:
        variable, variants = switch_studies()[self.study]
        return f"{super().note(cache)}; {self.variant} ({variable}={variants[self.variant]})"


def backend_impls() -> dict[str, type[Impl]]:
    """name -> adapter class for every backend x mode in the registry, named backend_mode, and torch_compiled with
    one decode step in flight (torch_compiled_one_step: on a GPU, the loop torch_compiled overlaps, design.md §7.31)."""
    impls: dict[str, type[Impl]] = {}
    for backend in BACKENDS.values():
        for mode in backend.modes:
            name = f"{backend.name}_{mode}"
            impls[name] = type(name, (BackendImpl,), {
                "name": name, "framework": backend.name, "backend": backend, "mode": mode,
                "per_step_timing": mode in backend.streaming_modes and mode not in backend.block_streaming_modes})
    impls["torch_compiled_one_step"] = type("torch_compiled_one_step", (SwitchedImpl, impls["torch_compiled"]), {
        "name": "torch_compiled_one_step", "study": "overlap_steps", "variant": "one step at a time"})
    return impls


def replicate_vocabulary(model: Any) -> None:
    """A JAX model on a mesh with its embedding and LM head replicated instead of split over the vocabulary: the
    other side of the measurement behind that choice (docs/design.md §10)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    for module in (model.model.embed_tokens, model.lm_head):
        if module is not None:
            weight = module.weight.get_value()
            module.weight.set_value(jax.device_put(weight, NamedSharding(weight.sharding.mesh, PartitionSpec())))


def mesh_record(backend: Backend, model_dir: Path, config: MistralConfig, dtype: str, mesh: MeshShape,
                prompts: Sequence[Sequence[int]], new_tokens: int, cache: str, vocabulary: str = "split",
                mode: str | None = None) -> dict[str, Any]:
    """One generation of `backend` with `model_dir`'s weights under `config` (the preset's: a trained model's EOS off,
    a --sliding-window) on `mesh` in `mode` (default: the backend's) after a warm-up (the compile): its
    steady decode tok/s and the bytes of weights and K/V each device holds, read from the arrays (a torch rank reads
    its own). `vocabulary="replicated"` (JAX only) replicates the embedding and LM head for the comparison."""
    tower, mode = backend.module(), backend.check_mode(mode)
    model = tower.load(model_dir, dtype, mesh=split_mesh(mesh))  # a one-device mesh: as one device, unsplit
    model.config = config
    if vocabulary == "replicated":
        replicate_vocabulary(model)
    warm = tower.generate(model, prompts, new_tokens, mode=mode, cache=cache)
    result = tower.generate(model, prompts, new_tokens, mode=mode, cache=warm.cache)
    memory = tower.memory_per_device(model, result.cache)
    return {"kind": "mesh", "backend": backend.name, "mode": mode, "mesh": str(mesh), "data": mesh.data,
            "model": mesh.model,
            "vocabulary": vocabulary, "cache": cache, "batch": len(prompts), "prompt_len": len(prompts[0]),
            "new_tokens": new_tokens, "decode_tok_s": result.decode_tok_s, "first_step_s": warm.first_step_s,
            "weights_bytes": memory["weights"], "kv_bytes": memory["kv"], "token_ids": result.token_ids}



def fused_block_tok_s(model_dir: Path, block_sizes: Sequence[int], new_tokens: int, rounds: int,
                      prompt: Sequence[int]) -> dict[int, list[tuple[float, float]]]:
    """Decode speed of the JAX fused mode at each number of steps per block (jax_cache.generate.FUSED_BLOCK_STEPS),
    `rounds` interleaved rounds after a warm-up each (compiles excluded); for choosing that constant
    (bench/fused_blocks.py). Each run gives (decode tok/s by the wall clock, generated tokens per CPU second of the
    whole process over the whole call: less sensitive to other processes on the machine). The constant is restored
    afterwards."""
    import jax_cache.generate as jax_generate

    tower = BACKENDS["jax"].module()
    model = tower.load(model_dir, "float32")
    model.config = dataclasses.replace(model.config, eos_token_id=None)  # every run decodes its whole budget
    chosen = jax_generate.FUSED_BLOCK_STEPS
    speeds: dict[int, list[tuple[float, float]]] = {block: [] for block in block_sizes}
    try:
        for round_index in range(rounds + 1):  # round 0 warms up (compiles)
            turn = round_index % len(block_sizes)
            for block in [*block_sizes[turn:], *block_sizes[:turn]]:
                jax_generate.FUSED_BLOCK_STEPS = block
                cpu_start = time.process_time()
                result = tower.generate(model, [list(prompt)], new_tokens, mode="fused")
                cpu_s = time.process_time() - cpu_start
                if round_index:
                    speeds[block].append((result.decode_tok_s, new_tokens / cpu_s))
    finally:
        jax_generate.FUSED_BLOCK_STEPS = chosen
    return speeds


def switch_studies() -> dict[str, tuple[str, dict[str, str]]]:
    """The environment switches of torch_cache's decode that a study times each way (bench/guard_skip.py,
    bench/overlap_steps.py): {study: (variable, {variant name: value})}, the variables as torch_cache reads them."""
    from torch_cache.generate import _OVERLAP_STEPS, _SKIP_GUARDS

    return {"guard_skip": (_SKIP_GUARDS, {"every guard": "0", "steady skip": "1"}),
            "overlap_steps": (_OVERLAP_STEPS, {"one step at a time": "0", "two in flight": "1"})}


def switch_step_ms(model_dir: Path, prompt: Sequence[int], new_tokens: int, rounds: int, cache: str,
                   variable: str, variants: dict[str, str], max_cache_len: int | None = None,
                   dtype: str = "float32", device: str | None = None) -> dict[str, list[float]]:
    """Per-step times (ms) of torch_cache's compiled decode with the environment switch `variable` set to each of
    `variants` ({name: value}), generations alternating in one process, `rounds` rounds after a warm-up
    (bench/guard_skip.py, bench/overlap_steps.py). A step's time is the wall time between two token callbacks; the
    prefill's token is left out. The variable is restored."""
    tower = BACKENDS["torch"].module()
    model = tower.load(model_dir, dtype, device)
    model.config = dataclasses.replace(model.config, eos_token_id=None)  # every run decodes its whole budget
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds + 1):  # round 0 warms up (compiles)
        for name in (list(variants) if round_index % 2 else list(variants)[::-1]):
            stamps: list[float] = []
            with switch_set(variable, variants[name]):
                tower.generate(model, [list(prompt)], new_tokens, cache=cache, max_cache_len=max_cache_len,
                               on_token=lambda _ids, stamps=stamps: stamps.append(time.perf_counter()))
            if round_index:
                times[name] += [1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]
    return times


__all__ = ["bench_model", "BackendImpl", "backend_impls", "replicate_vocabulary", "mesh_record", "fused_block_tok_s",
           "switch_studies", "switch_step_ms"]
