"""jax_cache's jitted functions keep at most MAX_DECODE_VARIANTS compiled variants each (docs/design.md §5, "JAX's
executables, bounded too"): a service that gives each request its own exact max_cache_len compiled a new prefill
and step per request, held in jax.jit's own caches (~40-50 MB of RSS each on the default model), without bound."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

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


def drops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, one entry per jax.clear_caches() call (each drop makes one)."""
    calls: list[int] = []
    clear = jax.clear_caches

    def counted() -> None:
        calls.append(1)
        clear()

    monkeypatch.setattr(jax, "clear_caches", counted)
    return calls


def test_a_jitted_function_past_the_limit_drops_its_variants(monkeypatch, caplog):
    """Up to the limit, variants are kept and one held runs without a drop; the call that compiles one past it drops
    every executable after it ran (one warning): after any call the cache holds at most the limit, and every compile
    is counted, a variant compiled again after the drop counted again."""
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
    assert notices(caplog) == [
        f"jax_cache's <lambda> passed the limit of {LIMIT} compiled variants in this process (cache shapes, batches, "
        "buckets, sampling kinds); dropped JAX's compiled executables (all of this process's), so each variant used "
        "again compiles again. To compile few: reuse a cache object, or let the tower size the cache (no "
        "max_cache_len: size classes)"]


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
