"""jax_cache: a decode that ends by an exception leaves the caller's cache object usable (docs/design.md §7.31).

Every decode call donates the cache it is given; before, an exception from on_token (a web client gone), a
KeyboardInterrupt or NonFiniteLogitsError left the caller's object on deleted buffers and lost the live cache. Now the
object holds the steps the host read, the one on_token was handed last included, as torch_cache's cache does; a fused
decode on a wrapped ring restores the slots its undone steps overwrote from its blocks' undo logs.

The oracle is an uninterrupted run of the same backend from the same prefill: stopped after the steps read, its cache
is the rolled-back one bit for bit; run to the end, the interrupted run's delivered tokens, then a continuation from its
cache, must give its tokens and logits exactly (the same executables run), and the same final cache. torch_cache,
interrupted at the same step, holds the same positions.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cache.generate as jg
import torch_cache.generate as tg
from jax_cache import backend
from jax_cache.cache import SlidingWindowCache, StaticCache, make_cache
from jax_cache.model import Mistral
from parity_tests.conftest import nan_norm_checkpoint
from parity_tests.test_jax_generate import PROMPTS, SAMPLED, pointers
from torch_cache.model import Mistral as TorchMistral
from twincache.errors import NonFiniteLogitsError
from twincache.generation import SamplingParams

NEW = 12  # continuation steps: the fused mode's blocks are 1, 1 and the other 10 (blocks_of_the_rest)
RAISE_AT = 5  # on_token raises at the continuation's 6th step: the 4th column of that 10-step block
CACHE_LEN = {"static": 40, "sliding_window": 64}  # the ring holds the window's 8 slots, wrapped by the 16-column bucket
# Seeded draws on the ring (their stream must line up across the interruption: first_step), greedy on the static
# cache: the shapes and kinds test_jax_generate.py compiles, so the session's executables are shared (~10 s saved).
SAMPLING = {"static": SamplingParams(), "sliding_window": SAMPLED}


class Disconnected(Exception):
    """What a web server's on_token raises when its client is gone."""


@pytest.fixture(scope="module")
def model(checkpoints: dict[str, Path]) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"], jnp.float32)


@pytest.fixture
def blocks_of_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused blocks of 1 step, 1 step, then the whole rest: a raise inside the third leaves its later steps unread."""
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", 1e9)


@pytest.fixture
def two_blocks_of_six(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused blocks of 6 steps, the second dispatched before the first is read (the same executable as the others:
    the first block's steps are an argument): a raise in the first leaves its later steps and the whole second unread.
    """
    monkeypatch.setattr(jg, "FIRST_BLOCK_STEPS", 6)
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", 1e9)


@pytest.fixture
def one_step_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused blocks of one step each: a raise leaves exactly one block (one step) queued and unread."""
    monkeypatch.setattr(jg, "FUSED_BLOCK_SECONDS", 0.0)


def prefilled(model: Mistral, kind: str) -> tuple[StaticCache, list[int]]:
    """A cache of `kind` holding PROMPTS, and each row's first token (generated-token index 0)."""
    cache = make_cache(kind, model.config, len(PROMPTS), CACHE_LEN[kind])
    result = jg.generate(model, PROMPTS, 1, cache=cache, sampling=SAMPLING[kind])
    return result.cache, [row[-1] for row in result.token_ids]


def raising_at(step: int, error: BaseException) -> tuple[list[list[int]], object]:
    """An on_token that keeps what it is handed and raises `error` at its `step`-th call (0-based)."""
    delivered: list[list[int]] = []

    def on_token(ids: list[int]) -> None:
        delivered.append(ids)
        if len(delivered) == step + 1:
            raise error

    return delivered, on_token


def assert_same_cache(ours: StaticCache, control: StaticCache) -> None:
    for got, want in zip(ours.arrays(), control.arrays(), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def rollbacks() -> int:
    """Executables of the two rollbacks: emptying the undone slots, and restoring them from undo logs."""
    return jg._roll_back._cache_size() + jg._undone._cache_size()


@pytest.mark.parametrize(("fused", "kind", "blocks", "raise_at"), [
    (True, "static", "blocks_of_the_rest", RAISE_AT),  # 6 steps rolled back: the rest of the block
    # The same 6 on the wrapped 8-slot ring: emptying their slots lost the keys of 5 columns the window still sees
    # (the cache was left consumed); they come back from the block's undo log.
    (True, "sliding_window", "blocks_of_the_rest", RAISE_AT),
    # The last 4 steps of the block being read and the 6 of the block queued after it: two blocks' logs, and 10
    # steps on 8 slots, so two slots were written twice (restored newest first: each ends with what it held before
    # the first of its writes)
    (True, "sliding_window", "two_blocks_of_six", 1),
    (True, "sliding_window", "one_step_blocks", RAISE_AT),  # the queued block (1 step), on the wrapped ring
    (False, "static", None, RAISE_AT),  # the queued step
    (False, "sliding_window", None, RAISE_AT),
])
def test_on_token_raising_leaves_the_read_steps_in_the_callers_cache(model, request, fused, kind, blocks, raise_at):
    if blocks:
        request.getfixturevalue(blocks)
    sampling = SAMPLING[kind]
    cache, first = prefilled(model, kind)
    control = jg.continue_generation(model, cache, first, NEW, sampling=sampling, fused=fused, return_logits=True,
                                     first_step=1)
    cache, first = prefilled(model, kind)  # the control stopped after the steps the interrupted run reads
    read_control = jg.continue_generation(model, cache, first, raise_at + 1, sampling=sampling, fused=fused,
                                          return_logits=True, first_step=1)
    cache, first = prefilled(model, kind)
    length = int(cache.length)
    compiles, rolled_back = backend.compiled_variants(), rollbacks()
    buffers = pointers(cache)
    error = Disconnected("client gone")
    delivered, on_token = raising_at(raise_at, error)
    with pytest.raises(Disconnected) as caught:
        jg.continue_generation(model, cache, first, NEW, sampling=sampling, fused=fused, on_token=on_token,
                               return_logits=True, first_step=1)
    assert caught.value is error and caught.traceback[-1].name == "on_token", "re-raised as it came"
    assert not getattr(error, "__notes__", None), "no note: the cache was not lost"
    cache.check_live()  # not consumed: the caller's object holds the live cache
    assert int(cache.length) == length + raise_at + 1, "the steps read, the one on_token raised at included"
    assert pointers(cache) == buffers, "decoding and the rollback wrote the K/V in place (donated), copying none"
    if fused or kind == "static":  # the step mode's undone step on a ring empties its slot, which held p - W (§7.31)
        assert_same_cache(cache, read_control.cache)  # bit for bit, the ring's keys the window still sees included
    rest = jg.continue_generation(model, cache, delivered[-1], NEW - raise_at - 1, sampling=sampling, fused=fused,
                                  return_logits=True, first_step=1 + raise_at + 1)
    tokens = [[step[row] for step in delivered] + more for row, more in enumerate(rest.token_ids)]
    assert tokens == control.token_ids
    np.testing.assert_array_equal(np.asarray(rest.step_logits), np.asarray(control.step_logits)[:, raise_at + 1:])
    assert_same_cache(rest.cache, control.cache)
    # The rollback compiled once per cache shape, and nothing else did: the rolled-back cache is placed as the
    # control's was, so the continuation ran the executables the control compiled.
    assert backend.compiled_variants() - compiles == rollbacks() - rolled_back <= 1


@pytest.mark.parametrize(("cls", "batch", "block_steps"), [
    (SlidingWindowCache, 1, 256),  # 128 KiB a step: 32 MiB
    (SlidingWindowCache, 32, 16),  # 4 MiB a step: 256 steps were 1 GiB, 16 are 64 MiB
    (StaticCache, 32, 256),  # no log
])
def test_a_rings_blocks_keep_their_undo_log_within_undo_log_bytes(cls, batch, block_steps):
    """Mistral-7B's shapes (32 layers, 8 KV heads, head_dim 128, bf16, a 4,096-slot ring): a fused block's undo log
    holds one token's K/V a step. Shapes only: nothing is allocated."""
    kv = [jax.ShapeDtypeStruct((batch, 8, 4096, 128), jnp.bfloat16) for _ in range(32)]
    arrays = (kv, kv, jax.ShapeDtypeStruct((batch, 4096), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    window = (("sliding_window", 4096),) if cls is SlidingWindowCache else ()
    cache = cls.tree_unflatten((*window, ("mesh", None)), arrays)
    assert jg._block_capacity(cache) == block_steps
    if jg._logs_undo(cache):
        assert 2 * 32 * batch * 8 * block_steps * 128 * 2 <= jg.UNDO_LOG_BYTES


def test_generate_given_a_cache_object_leaves_it_holding_the_prompt_and_the_steps_read(model):
    cache = make_cache("static", model.config, len(PROMPTS), CACHE_LEN["static"])
    control = jg.generate(model, PROMPTS, 1 + NEW, cache=cache, fused=False, return_logits=True)
    cache = control.cache
    delivered, on_token = raising_at(RAISE_AT, KeyboardInterrupt())  # the prefill's token is call 0
    with pytest.raises(KeyboardInterrupt):
        jg.generate(model, PROMPTS, 1 + NEW, cache=cache, fused=False, on_token=on_token)
    assert int(cache.length) == 16 + RAISE_AT, "the 16-column prompt bucket and the steps read after it"
    rest = jg.continue_generation(model, cache, delivered[-1], NEW - RAISE_AT, fused=False, return_logits=True,
                                  first_step=RAISE_AT + 1)
    tokens = [[step[row] for step in delivered] + more for row, more in enumerate(rest.token_ids)]
    assert tokens == control.token_ids
    np.testing.assert_array_equal(np.asarray(rest.step_logits), np.asarray(control.step_logits)[:, RAISE_AT + 1:])


@pytest.fixture(scope="module")
def nan_model(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nan_norm_checkpoint(checkpoints["gqa"], tmp_path_factory.mktemp("nan") / "gqa")


@pytest.mark.parametrize("fused", [True, False])
def test_non_finite_logits_leave_the_cache_usable_as_torchs(model, nan_model, checkpoints, fused):
    """A NaN final norm: the first decode step's logits are NaN. The step wrote its input token's K/V (the layers
    before the norm are finite) and was read, so the cache keeps it, in both towers; the queued step is undone."""
    bad = Mistral.from_pretrained(nan_model, jnp.float32)
    cache, first = prefilled(model, "sliding_window")
    length = int(cache.length)
    with pytest.raises(NonFiniteLogitsError):
        jg.continue_generation(bad, cache, first, NEW, sampling=SAMPLED, fused=fused, return_logits=True)
    cache.check_live()
    assert int(cache.length) == length + 1

    torch_good, torch_bad = TorchMistral.from_pretrained(checkpoints["gqa"]), TorchMistral.from_pretrained(nan_model)
    prefill = tg.generate(torch_good, PROMPTS, 1, cache="sliding_window", max_cache_len=64, compile=False)
    torch_cache, torch_length = prefill.cache, int(prefill.cache.length)
    with pytest.raises(NonFiniteLogitsError):
        tg.continue_generation(torch_bad, torch_cache, first, NEW, compile=False)
    assert int(torch_cache.length) == torch_length + 1
    assert np.asarray(cache.next_positions()).tolist() == torch_cache.next_positions().tolist()


def test_torch_interrupted_at_the_same_step_holds_the_same_positions(model, checkpoints, monkeypatch):
    """torch_cache with two steps in flight (its rollback runs), interrupted where the JAX test above is."""
    monkeypatch.setenv("TWINCACHE_OVERLAP_STEPS", "1")
    torch_model = TorchMistral.from_pretrained(checkpoints["gqa"])
    prefill = tg.generate(torch_model, PROMPTS, 1, cache="sliding_window", max_cache_len=64, compile=False)
    _, on_token = raising_at(RAISE_AT, Disconnected())
    with pytest.raises(Disconnected):
        tg.continue_generation(torch_model, prefill.cache, [row[-1] for row in prefill.token_ids], NEW,
                               compile=False, on_token=on_token)
    cache, first = prefilled(model, "sliding_window")
    _, on_token = raising_at(RAISE_AT, Disconnected())
    with pytest.raises(Disconnected):
        jg.continue_generation(model, cache, first, NEW, fused=False, on_token=on_token)
    assert np.asarray(cache.next_positions()).tolist() == prefill.cache.next_positions().tolist()
