"""jax_cache's jitted functions keep at most MAX_DECODE_VARIANTS compiled variants each (docs/design.md §5, "JAX's
executables, bounded too"): a service that gives each request its own exact max_cache_len compiled a new prefill
and step per request, held in jax.jit's own caches (~40-50 MB of RSS each on the default model), without bound. A
drop frees the tower's executables and JAX's eager ops', never those of the process's other jitted functions."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jax_cache.cache as jax_cache_cache
import jax_cache.generate as jg
from jax_cache import backend
from jax_cache.model import Mistral

LIMIT = 3
PROMPT = [5, 9, 2, 7, 11]


@pytest.fixture(scope="module")
def model(checkpoints: dict[str, Path]) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"], jnp.float32)


class Watched:
    """A bounded jitted function that records the most executables its jit cache held after any call returned."""

    def __init__(self, bounded: jg._BoundedJit) -> None:
        self.bounded, self.most = bounded, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.bounded, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        out = self.bounded(*args, **kwargs)
        self.most = max(self.most, self.bounded.jitted._cache_size())
        return out


def notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "twincache"]


def traces_of_jax_functions() -> int:
    """The traces JAX keeps of functions of jax and jax_cache (jnp's nested in the tower's jitted functions, one per
    shape, and the tower's own) in partial_eval.trace_to_jaxpr, which has no size limit."""
    from jax._src.interpreters import partial_eval

    functions = [key[0]() for key in partial_eval.trace_to_jaxpr.cache_keys()]
    return sum(str(getattr(function, "__module__", None)).partition(".")[0] in ("jax", "jax_cache")
               for function in functions)


def drops(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """From now on, one entry per drop (a _drop_executables call that finds a jitted function past the limit): the
    executables each of jax_cache's jitted functions (bounded, the cache's emptier, the fused blocks' table) holds
    right after it, and the traces of JAX's and jax_cache's functions JAX holds then."""
    calls: list[dict[str, int]] = []
    drop = jg._drop_executables

    def counted(name: str) -> None:
        past = any(bounded.jitted._cache_size() > jg.MAX_DECODE_VARIANTS for bounded in jg._BOUNDED_JITS)
        drop(name)
        if past:
            calls.append({**{bounded.__name__: bounded.jitted._cache_size() for bounded in jg._BOUNDED_JITS},
                          "_empty_in_place": jax_cache_cache._empty_in_place._cache_size(),
                          "fused table": len(jg._fused_executables), "traces": traces_of_jax_functions()})

    monkeypatch.setattr(jg, "_drop_executables", counted)
    return calls


class UserJit:
    """A user's own jitted function (not jax_cache's), counting its traces: `callback` adds a jax.debug.callback, whose
    effect keeps the call off jit's C++ fast path (each call goes through JAX's Python dispatch)."""

    def __init__(self, callback: bool) -> None:
        self.traces = 0

        def scaled(x: jax.Array) -> jax.Array:
            self.traces += 1
            if callback:
                jax.debug.callback(lambda value: None, x)
            return x * 2.0 + 1.0

        self.jitted = jax.jit(scaled)


def compiled_names(call) -> list[str]:
    """The functions XLA compiles while `call()` runs (JAX's backend-compile events), by name: jit(_prefill), ..."""
    names: list[str] = []

    def listen(event: str, seconds: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        call()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return names


def compiles_during(call) -> int:
    """XLA compiles while `call()` runs."""
    return len(compiled_names(call))


@pytest.mark.parametrize(("mode", "size"), [("step", 61), ("fused", 67)])
def test_a_new_cache_size_compiles_its_prefill_decode_and_buffers_only(model, mode, size):
    """A request at a cache size the process has not seen compiles its prefill, its decode (step or fused block)
    and its cache's zeroed buffers (broadcast_in_dim), and no eager op on the host's path: each one compiles once
    per shape and holds an executable until a drop. Before, continue_generation reduced the cache's slot positions
    on the device (two `_reduce_max` compiles per size) to check and start the positions; it reads them on the host."""
    backend.generate(model, [PROMPT], 3, mode=mode, cache="static", max_cache_len=40)  # the size-free ops, compiled
    names = compiled_names(lambda: backend.generate(model, [PROMPT], 3, mode=mode, cache="static",
                                                    max_cache_len=size))
    decode = "jit(_sampled_step)" if mode == "step" else "jit(_fused_decode)"
    assert decode in names and "jit(_prefill)" in names, names  # the size is new to the process: both compiled
    assert set(names) <= {"jit(_prefill)", decode, "jit(broadcast_in_dim)"}, names


@pytest.mark.parametrize("route", ["surgical", "jax.clear_caches"])
def test_a_jitted_function_past_the_limit_drops_its_variants(monkeypatch, caplog, route):
    """Up to the limit, variants are kept and one held runs without a drop; the call that compiles one past it drops
    the executables after it ran (one warning): after any call the cache holds at most the limit, and every compile
    is counted, a variant compiled again after the drop counted again. A JAX without the eager ops' cache that the
    drop clears (dispatch.xla_primitive_callable) gets jax.clear_caches(), and the warning says it dropped all."""
    if route == "jax.clear_caches":
        monkeypatch.setitem(sys.modules, "jax._src.dispatch", None)  # where the drop looks the cache up
    cleared: list[int] = []
    clear = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), clear())[1])
    monkeypatch.setattr(jg, "MAX_DECODE_VARIANTS", LIMIT)
    monkeypatch.setattr(jg, "_BOUNDED_JITS", [])
    plus_one = jg._bounded(jax.jit(lambda x: x + 1))
    dropped = drops(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="twincache"):
        for size in range(1, LIMIT + 1):
            assert plus_one(jnp.zeros(size)).tolist() == [1.0] * size
        assert plus_one(jnp.zeros(2)).tolist() == [1.0] * 2  # held, at the limit
        assert (plus_one._cache_size(), dropped, notices(caplog)) == (LIMIT, [], [])
        assert plus_one(jnp.zeros(LIMIT + 1)).tolist() == [1.0] * (LIMIT + 1)
        assert plus_one._cache_size() == 0 and len(dropped) == 1
        assert plus_one(jnp.zeros(LIMIT + 1)).tolist() == [1.0] * (LIMIT + 1)  # compiled again
    assert plus_one._cache_size() == 1 and len(dropped) == 1 and plus_one.compiles == LIMIT + 2
    assert len(cleared) == (route == "jax.clear_caches")
    what = ("JAX's compiled executables (all of this process's)" if cleared else
            "jax_cache's compiled executables and JAX's eager ops' (the process's other jitted functions keep theirs)")
    assert notices(caplog) == [
        f"jax_cache's <lambda> passed the limit of {LIMIT} compiled variants in this process (cache shapes, batches, "
        f"buckets, sampling kinds); dropped {what}, so each variant used again compiles again. To compile few: reuse "
        "a cache object, or let the tower size the cache (no max_cache_len: size classes)"]


@pytest.mark.parametrize("mode", ["fused", "step"])
def test_exact_cache_sizes_past_the_limit_keep_every_jit_cache_bounded_and_tokens_unchanged(model, mode, monkeypatch,
                                                                                            caplog):
    """One exact max_cache_len per request: each a prefill and a step (or fused block) of its own. With the limit
    at 1 (a compile past it is a drop; the fewest compiles to watch), each jitted function's cache
    and the fused table hold one executable at most, one warning is logged per drop, and a size compiled again after
    a drop decodes the tokens it decoded before it."""
    def run(size: int) -> list[list[int]]:
        return backend.generate(model, [PROMPT], 3, mode=mode, cache="static", max_cache_len=size).token_ids

    fresh = run(40)
    monkeypatch.setattr(jg, "MAX_DECODE_VARIANTS", 1)
    watched = [Watched(bounded) for bounded in jg._BOUNDED_JITS]
    for each in watched:
        monkeypatch.setattr(jg, each.__name__, each)  # the module's callers look their jitted functions up by name
    dropped = drops(monkeypatch)
    most_fused = 0
    with caplog.at_level(logging.WARNING, logger="twincache"):
        for size in (41, 40):
            tokens = run(size)
            most_fused = max(most_fused, len(jg._fused_executables))
    assert tokens == fresh
    assert max(each.most for each in watched) == 1  # reached, never passed once a call returned
    assert most_fused <= 1
    assert dropped and len(notices(caplog)) == len(dropped)  # at least at 41's first compile: one warning each


@pytest.mark.parametrize("mode", ["fused", "step"])
def test_a_users_jitted_functions_run_their_executables_after_a_drop(model, mode, monkeypatch):
    """A service that jits its own pre- and post-processing beside the tower: drops (exact cache sizes past a limit
    of 1) empty every jitted function of jax_cache and JAX's traces of jnp's and jax_cache's functions, and the
    user's functions compiled before them run after them without compiling or tracing again, on jit's C++ fast path
    or through JAX's Python dispatch (a debug callback); the tokens are unchanged. Before, the drop was
    jax.clear_caches(), after which each compiled and traced again.
    Eager ops are dropped (they hold a cache shape's executables too): a primitive (jnp.zeros) and a jitted JAX
    library function (jnp.max) run before the drop compile again after it; so does each fused block the table lacks
    (its lowering, which keeps the executable, was dropped with it)."""
    def run(size: int) -> list[list[int]]:
        return backend.generate(model, [PROMPT], 3, mode=mode, cache="static", max_cache_len=size).token_ids

    fresh = run(40)
    users = [UserJit(callback=False), UserJit(callback=True)]
    x = jnp.arange(4.0)
    for user in users:
        assert user.jitted(x).tolist() == [1.0, 3.0, 5.0, 7.0] and user.traces == 1
    primitive, library = (lambda: jnp.zeros(7)), (lambda: jnp.max(x))
    primitive(), library()  # compiled here if not before
    assert compiles_during(primitive) + compiles_during(library) == 0
    blocks: list[int] = []  # XLA compiles of each fused block that was not in the table
    fused_executable = jg.fused_executable

    def compiled_block(*args: object, **static: object) -> tuple[object, float]:
        returned: list[tuple[object, float]] = []
        compiles = compiles_during(lambda: returned.append(fused_executable(*args, **static)))
        if returned[0][1] > 0.0:  # not in the table
            blocks.append(compiles)
        return returned[0]

    monkeypatch.setattr(jg, "fused_executable", compiled_block)
    monkeypatch.setattr(jg, "MAX_DECODE_VARIANTS", 1)
    dropped = drops(monkeypatch)
    assert [run(41), run(40)] == [fresh, fresh]  # 40's variants, dropped at 41's prefill, are compiled again
    assert (blocks == []) == (mode == "step") and 0 not in blocks, blocks
    assert dropped and all(set(after.values()) == {0} for after in dropped), dropped  # all emptied
    outputs: list[list[float]] = []
    assert compiles_during(lambda: outputs.extend(user.jitted(x).tolist() for user in users)) == 0
    assert outputs == [[1.0, 3.0, 5.0, 7.0]] * 2
    assert [(user.traces, user.jitted._cache_size()) for user in users] == [(1, 1), (1, 1)]
    assert compiles_during(primitive) >= 1 and compiles_during(library) == 1


@pytest.mark.parametrize("command", ["soak", "generate --json"])
def test_the_cli_says_a_drop_in_its_own_lines_and_not_with_json(monkeypatch, capsys, checkpoints, command):
    """A drop's warning reaches a CLI user as `twincache: ...` lines on stderr, one per drop, in a command that runs
    a tower outside the blocks that show its progress notices (the soak's decode); with --json none, as the other
    notices. Before, only those blocks set a handler: elsewhere Python's last resort printed the warning bare (no
    prefix), --json or not. The root logger's handlers (pytest's) are taken away, as a CLI process has none."""
    from twincache_app import cli

    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(jg, "MAX_DECODE_VARIANTS", 0)  # every compile drops
    dropped = drops(monkeypatch)
    model = ["--backend", "jax", "--mode", "step", "--model", str(checkpoints["gqa"])]
    argv = (["soak", *model, "--steps", "2", "--prompt-len", "4"] if command == "soak" else
            ["generate", *model, "--prompt-ids", "5,9,2", "--max-new-tokens", "2", "--json"])
    assert cli.main(argv) in (0, 1)  # the soak's record says the drops' compiles were recompiles (exit 1)
    err = capsys.readouterr().err.splitlines()
    assert dropped
    if command == "soak":
        assert all(line.startswith("twincache: ") for line in err), err
        assert len([line for line in err if "passed the limit of 0 compiled variants" in line]) == len(dropped)
    else:
        assert err == []
