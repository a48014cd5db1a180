"""The backend surface (docs/design.md §5) and its registry: each tower's `backend` module runs each decode mode on
that mode's real path, teacher-forced `step_logits` agree with what `generate` computes along its own greedy path,
and a mode is checked before anything runs.
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

import jax_cache.generate as jg
from twincache.errors import InputError, UnavailableError
from twincache.generation import check_mode
from twincache_app.backends import BACKENDS, Backend, modes_help

PROMPT = [5, 17, 42, 99, 3, 8, 61]
NEW_TOKENS = 12  # window 8: the decode steps wrap the ring


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, object]:
    return {name: backend.module().load(checkpoints["gqa"]) for name, backend in BACKENDS.items()}


def test_registry_lists_each_tower_with_its_modes_default_first():
    assert {name: list(b.modes) for name, b in BACKENDS.items()} == {"torch": ["compiled", "eager"],
                                                                   "jax": ["fused", "step"]}
    assert {name: b.default_mode for name, b in BACKENDS.items()} == {"torch": "compiled", "jax": "fused"}
    assert modes_help() == "torch: compiled (default), eager; jax: fused (default), step"
    assert BACKENDS["jax"].check_mode(None) == "fused" and BACKENDS["torch"].check_mode("eager") == "eager"
    with pytest.raises(InputError, match="--mode fused is not a torch mode; --backend torch takes compiled or eager"):
        BACKENDS["torch"].check_mode("fused")


def test_jax_keeps_no_executables_on_disk_for_a_uid_without_a_passwd_entry(monkeypatch):
    """Run as a uid with no passwd entry, every executable JAX wrote to the persistent cache warned (etils' stat
    looks up the file owner's name): 17 UserWarnings around one `generate --backend jax`. The cache stays off then."""
    import pwd

    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from twincache_app import backends

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_compilation_cache_max_size")
    saved = {name: getattr(jax.config, name) for name in names}  # the session's (conftest), put back below
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        backends._persist_xla_compiles()
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.undo()
        backends._persist_xla_compiles()  # the same call for a uid with an entry turns it on
        assert jax.config.jax_compilation_cache_dir == str(backends.compiled_programs_dir("jax"))
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def test_an_unimportable_backend_is_one_clear_error():
    def missing() -> None:
        raise ImportError("No module named 'jax'")

    ghost = Backend("jax", "jax_cache", {"fused": ""}, (), (), False, missing)
    with pytest.raises(UnavailableError, match=r"the jax backend is unavailable: cannot import jax_cache.backend "
                                               r"\(No module named 'jax'\); install its framework, or use --backend"):
        ghost.module()


def stance_without_recompiles(name: str) -> contextlib.AbstractContextManager:
    if name != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.compiler.set_stance("fail_on_recompile")


@pytest.mark.parametrize(("name", "mode"), [(n, m) for n, b in BACKENDS.items() for m in b.modes])
def test_step_logits_equal_generate_logits_along_its_own_greedy_path(models, name, mode):
    """Teacher-forced on the tokens generate chose, a mode's step_logits are the logits generate saw in that mode."""
    tower = BACKENDS[name].module()
    result = tower.generate(models[name], [PROMPT], NEW_TOKENS, mode=mode, cache="sliding_window",
                            return_logits=True)
    assert result.mode == mode
    sequence = PROMPT + result.token_ids[0]
    with stance_without_recompiles(name):  # the step generate compiled serves the teacher-forced run too
        forced = tower.step_logits(models[name], sequence, len(PROMPT), "sliding_window", mode)
    assert forced.shape == (NEW_TOKENS, models[name].config.vocab_size) and forced.dtype == np.float32
    np.testing.assert_allclose(forced, np.asarray(result.step_logits[0], np.float32), rtol=0, atol=1e-5)


def test_step_logits_run_each_jax_mode_on_its_own_loop(models, monkeypatch):
    """fused: one ahead-of-time while_loop executable; step: the streaming step, once per shape."""
    jax_backend = BACKENDS["jax"].module()
    # counted in a table of its own: the session's is an LRU whose length stays put once full
    monkeypatch.setattr(jg, "_fused_executables", collections.OrderedDict())
    sequence = list(range(3, 3 + 29))  # a length no other test uses: its executables are compiled here
    fused_before, step_before = len(jg._fused_executables), jg._sampled_step._cache_size()
    jax_backend.step_logits(models["jax"], sequence, 9, "static", "fused")
    assert (len(jg._fused_executables), jg._sampled_step._cache_size()) == (fused_before + 1, step_before)
    jax_backend.step_logits(models["jax"], sequence, 9, "static", "step")
    assert (len(jg._fused_executables), jg._sampled_step._cache_size()) == (fused_before + 1, step_before + 1)


def test_step_logits_ask_torch_for_the_compiled_step_only_in_compiled_mode(models, monkeypatch):
    """Which decode step each torch mode asks for (a spy; the equality test above runs the compiled one for real)."""
    import torch_cache.backend as torch_backend
    import torch_cache.generate as tg

    asked: list[bool] = []
    decode_one_fn = tg._decode_one_fn  # the step generate decodes with (decode_step_fn wraps the same)

    def spy(model: object, compile: bool) -> object:
        asked.append(compile)
        return decode_one_fn(model, compile=False)  # run eagerly here: no second compile for this test

    monkeypatch.setattr(tg, "_decode_one_fn", spy)
    sequence = list(range(3, 3 + 12))
    for mode in ("eager", "compiled"):
        torch_backend.step_logits(models["torch"], sequence, 7, "static", mode)
    assert asked == [False, True]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_generate_refuses_a_foreign_mode_and_streams_every_step_in_every_mode(models, name):
    tower, backend = BACKENDS[name].module(), BACKENDS[name]
    foreign = next(m for other in BACKENDS.values() if other is not backend for m in other.modes)
    with pytest.raises(InputError, match=f"mode '{foreign}' is not a {name} mode"):
        tower.generate(models[name], [PROMPT], 2, mode=foreign)
    assert set(backend.streaming_modes) == set(backend.modes)  # the JAX fused mode streams a block at a time
    assert set(backend.block_streaming_modes) == ({"fused"} if name == "jax" else set())
    for mode in backend.modes:
        streamed: list[list[int]] = []
        result = tower.generate(models[name], [PROMPT], NEW_TOKENS, mode=mode, on_token=streamed.append)
        assert [row[0] for row in streamed] == result.token_ids[0] and len(streamed) == NEW_TOKENS, mode


def test_a_callback_for_a_mode_that_cannot_stream_is_refused():
    check_mode("jax", ("fused", "step"), ("step",), "step", True)
    with pytest.raises(InputError, match="jax mode 'fused' does not stream tokens as it decodes; use 'step'"):
        check_mode("jax", ("fused", "step"), ("step",), "fused", True)


def test_torch_model_reports_its_dtype_and_device(models):
    import torch

    assert models["torch"].dtype == torch.float32 and models["torch"].device == torch.device("cpu")
    assert models["jax"].dtype == np.float32


_AS_ON_A_GPU = """
import sys
import jax
import numpy as np
jax.default_backend = lambda: "gpu"  # what jax_cache asks to pick a platform's path; JAX itself stays on the CPU
from jax_cache import backend
model = backend.load(sys.argv[1])
sequence = [int(token) for token in sys.argv[3].split(",")]
np.save(sys.argv[2], np.stack([backend.step_logits(model, sequence, int(sys.argv[4]), cache, mode)
                               for cache, mode in (("static", "step"), ("sliding_window", "fused"))]))
"""


def test_the_jax_paths_of_other_platforms_give_the_torch_logits(models, checkpoints, tmp_path):
    """A GPU takes JAX paths the CPU never does: one attention dot over the buffer updated in place (no halves), the
    cache write before the attention read (nothing orders it after). A GPU is lent rarely, for minutes, so here
    jax_cache is told it runs on one (in a fresh process: nothing traced for the CPU is reused) and must give the
    torch tower's teacher-forced logits (fp32): the step mode on a static cache, the fused mode on a sliding one across
    a window wrap. (A planted error in the GPU-only attention branch fails it.)"""
    import subprocess
    import sys

    sequence = PROMPT + [11, 23, 5, 64, 7, 90, 31, 2, 48, 77, 19, 60]  # window 8: the ring wraps
    out = tmp_path / "logits.npy"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _AS_ON_A_GPU, str(checkpoints["gqa"]), str(out),
                           ",".join(map(str, sequence)), str(len(PROMPT))], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_tower = BACKENDS["torch"].module()
    expected = [torch_tower.step_logits(models["torch"], sequence, len(PROMPT), cache, "eager")
                for cache in ("static", "sliding_window")]
    np.testing.assert_allclose(np.load(out), np.stack(expected), rtol=0, atol=1e-4)
