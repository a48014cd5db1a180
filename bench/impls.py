"""One adapter per implementation, all in one registry (impl_registry()). Each turns (prompts, new tokens, cache kind,
cache length) into a `Run` with the same timing definitions, so the numbers side by side mean the same thing. The
towers' adapters live in the app layer (twincache_app.bench_adapters); transformers' are here.

Timing, for every adapter (twincache's GenerationResult definitions): `prefill_s` ends when the first token is on
the host; `first_step_s` holds compilation/tracing and the first decode step (a fused loop's first block, of one
step); `decode_s` covers the `timed_steps` steady-state steps after it, so decode tok/s = timed_steps / decode_s per
sequence. transformers' timings come from a logits processor's timestamps, with
the same split. `step_times` are host timestamps taken after each token is on the host.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from bench.workload import Workload


@dataclasses.dataclass
class Run:
    prefill_s: float
    first_step_s: float  # compile/trace plus the first decode step (a fused loop's first block); kept out of decode_s
    decode_s: float  # wall time of the `timed_steps` steady-state decode steps
    decode_steps: int  # forward calls after prefill
    timed_steps: int
    wall_s: float  # the whole generate call
    step_times: list[float]  # perf_counter after each token: [0] ends prefill, [i] ends decode step i; may be empty

    @classmethod
    def from_result(cls, result: Any, wall_s: float, step_times: list[float]) -> Run:
        """From a twincache GenerationResult (torch_cache and jax_cache return the same type)."""
        return cls(result.prefill_s, result.first_step_s, result.decode_s, result.decode_steps, result.timed_steps,
                   wall_s, step_times)

    @property
    def decode_tok_s(self) -> float | None:
        """Steady-state decode steps per second (= tokens per second per sequence); None when no step after the first
        was timed, as GenerationResult.decode_tok_s: not measured, rather than 0 tok/s."""
        return self.timed_steps / self.decode_s if self.timed_steps and self.decode_s > 0 else None

    def step_latencies(self) -> list[float]:
        """Seconds per decode step, the first (compiling) step left out."""
        return [b - a for a, b in zip(self.step_times[1:], self.step_times[2:])]


class Impl:
    """Base adapter. Subclasses set the class attributes and implement `generate`."""

    name: ClassVar[str]
    framework: ClassVar[str]  # "torch" or "jax": which probe/memory counters apply
    per_step_timing: ClassVar[bool] = True  # False when steps are not observable from the host (fused loops)
    # Warmed up before the others: its first run changes process-wide state that other implementations' compiled
    # graphs guard on (transformers registers pytree nodes, and dynamo guards on their count).
    warm_up_first: ClassVar[bool] = False

    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this implementation cannot run here, or None."""
        return None

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int, cache: str, max_cache_len: int) -> Run:
        raise NotImplementedError

    def note(self, cache: str) -> str:
        """What a cell of this implementation with this cache really measures."""
        return ""

    def release(self) -> None:
        """Drop per-shape state (cache buffers) between benchmark phases."""

    def compile_count(self) -> int | None:
        """Graphs compiled / functions traced so far in this process by this implementation's framework."""
        return None

    def compile_seconds(self) -> float:
        """Seconds this process has spent compiling so far, as the framework itself accounts them."""
        return torch_compile_seconds() if self.framework == "torch" else jax_compile_seconds()


def _torch_sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def torch_graph_count() -> int:
    """Graphs dynamo has compiled in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def torch_compile_seconds() -> float:
    """dynamo + inductor compile time so far: dynamo's own timer around each frame compile."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


_JAX_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                       "/jax/core/compile/backend_compile_duration")
_jax_compile_s = [0.0]


def _on_jax_event(event: str, duration_secs: float, **_: str | int) -> None:
    if event in _JAX_COMPILE_EVENTS:
        _jax_compile_s[0] += duration_secs


def jax_compile_seconds() -> float:
    """Trace + lowering + XLA compile time so far, from jax.monitoring (op-by-op compiles outside jit included)."""
    if not _jax_compile_s[1:]:  # register once, on first use
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_on_jax_event)
        _jax_compile_s.append(1.0)
    return _jax_compile_s[0]


class _TransformersImpl(Impl):
    """transformers' own `generate` on MistralForCausalLM: static cache, greedy, a fixed number of new tokens."""

    framework = "torch"
    compiled: ClassVar[bool]
    # Its first generate registers pytree nodes; a torch_cache graph compiled before that fails its guard on
    # len(torch.utils._pytree.SUPPORTED_NODES) and recompiles in the middle of the timed runs (measured: 1 recompile
    # per torch_compiled cell on `small`, 1.5-2.8 s inside a timed run).
    warm_up_first = True

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int, cache: str, max_cache_len: int) -> Run:
        import torch
        from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

        device = self.workload.device
        model = self.workload.hf_model(sliding=cache == "sliding_window")
        # transformers sizes its static cache as max(prompt + new - 1, the largest it sized before); pin it to this
        # call's max_cache_len so cells do not inherit a longer (slower) cache from an earlier phase.
        model._previous_max_cache_length = max_cache_len - 1
        times: list[float] = []

        class StepTimer(LogitsProcessor):  # called once per forward, right after it, with that step's logits
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                _torch_sync(device)  # on GPU generate would otherwise run ahead of the device
                times.append(time.perf_counter())
                return scores

        if self.compiled:
            compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
            # transformers compiles only on accelerators unless told to (a private flag, declared None)
            compile_config._compile_all_devices = True  # type: ignore[assignment]
            compile_kwargs: dict[str, Any] = {"compile_config": compile_config}
        else:
            compile_kwargs = {"disable_compile": True}
        input_ids = torch.tensor(prompts, dtype=torch.long, device=device)  # [B, T], no padding
        _torch_sync(device)
        start = time.perf_counter()
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, cache_implementation="static", eos_token_id=None,
                       pad_token_id=self.workload.config.pad_token_id,
                       logits_processor=LogitsProcessorList([StepTimer()]), **compile_kwargs)
        _torch_sync(device)
        wall = time.perf_counter() - start
        steps = len(times) - 1
        return Run(prefill_s=times[0] - start, first_step_s=times[1] - times[0] if steps else 0.0,
                   decode_s=times[-1] - times[1] if steps > 1 else 0.0, decode_steps=steps,
                   timed_steps=max(steps - 1, 0), wall_s=wall, step_times=times)

    def note(self, cache: str) -> str:
        mode = ("forward compiled by generate (CompileConfig fullgraph=True, mode='reduce-overhead')" if self.compiled
                else "eager forward (disable_compile=True)")
        if cache == "static":
            layer = ("config.sliding_window=None: full causal attention over StaticLayer buffers of max_cache_len "
                     "slots (the whole buffer is read every step)")
        else:
            layer = ("config.sliding_window=W: StaticSlidingWindowLayer of W slots; once full, every decode step "
                     "rolls K and V by one slot (roll + copy_ of the whole window, per layer)")
            if self.compiled:
                layer += ("; its Python-int cumulative_length_int is a dynamo guard, so the step after prefill "
                          "recompiles with that int made dynamic")
        return f"transformers generate, {mode}; {layer}"

    def compile_count(self) -> int | None:
        return torch_graph_count() if self.compiled else None


class Transformers(_TransformersImpl):
    name = "transformers"
    compiled = True


class TransformersEager(_TransformersImpl):
    name = "transformers_eager"
    compiled = False


def impl_registry() -> dict[str, type[Impl]]:
    """Every implementation by name: each backend in each of its decode modes (through the app layer,
    twincache_app.bench_adapters), then transformers' own generate."""
    from twincache_app.bench_adapters import backend_impls

    return {**backend_impls(), **{cls.name: cls for cls in (Transformers, TransformersEager)}}


REFERENCE_IMPLS = ("transformers", "transformers_eager")  # ratios are taken against the first one measured
