"""torch_cache's overlapped decode (TWINCACHE_OVERLAP_STEPS, docs/design.md §7.31): step k + 1 is launched before
the host reads step k's tokens, so a loop that ends at an EOS has launched one step too many and rolls it back.

On a GPU that hides the host's work between steps; on CPU (where it is off by default) the same loop runs, so these
tests force it on and hold it to the one-step-at-a-time loop: the same tokens, callbacks, logits, step counts and,
after the loop, the same cache, whether it ends at the budget, at every row's EOS, or by an exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity_tests.test_torch_generate import NEW_TOKENS, PROMPTS, first_index, with_eos
from torch_cache.cache import StaticCache, make_cache
from torch_cache.generate import continue_generation, generate
from torch_cache.model import Mistral
from twincache.generation import SamplingParams

OVERLAP = "TWINCACHE_OVERLAP_STEPS"
FORCED_AFTER = 4  # teacher-forced steps after a generation, through the cache it left
CACHE_LEN = max(map(len, PROMPTS)) + NEW_TOKENS + FORCED_AFTER


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Mistral]:
    """The gqa model, and the same with an EOS id at which every row of PROMPTS stops, each at another step before
    the budget ends (so the overlapped loop has a step in flight when the last row stops)."""
    model = Mistral.from_pretrained(checkpoints["gqa"])
    unstopped = generate(model, PROMPTS, NEW_TOKENS, compile=False).token_ids
    for token in sorted({t for row in unstopped for t in row}):
        stops = [first_index(row, token) for row in unstopped]
        if None not in stops and len(set(stops)) == len(stops) and max(stops) < NEW_TOKENS - 2:
            return {"plain": model, "eos": with_eos(checkpoints, tmp_path_factory.mktemp("overlap"), token)}
    raise AssertionError(f"no token of {unstopped} stops every row at a different step; change the prompts")


def run(model: Mistral, kind: str, overlap: str, monkeypatch: pytest.MonkeyPatch,
        **kwargs: object) -> tuple[object, StaticCache, list[list[int]]]:
    monkeypatch.setenv(OVERLAP, overlap)
    cache = make_cache(kind, model.config, len(PROMPTS), CACHE_LEN)
    streamed: list[list[int]] = []
    result = generate(model, PROMPTS, NEW_TOKENS, cache=cache, compile=False, return_logits=True,
                      on_token=streamed.append, **kwargs)
    return result, cache, streamed


def assert_same_cache(overlapped: StaticCache, plain: StaticCache) -> None:
    """Every buffer equal, but for a ring's slot that the rolled-back step took: empty there (position -1, zero K/V),
    where the one-step loop still holds position p - W, which no query from the next position p on can see."""
    assert int(overlapped.length) == int(plain.length)
    differ = (overlapped.slot_positions != plain.slot_positions).any(dim=0).nonzero().flatten().tolist()
    if overlapped.kind == "static":
        assert differ == []
    else:
        assert differ in ([], [int(plain.length) % plain.cache_len])
        next_positions = plain.next_positions()  # [B]
        for slot in differ:
            assert (overlapped.slot_positions[:, slot] == -1).all()
            assert (plain.slot_positions[:, slot] <= next_positions - plain.cache_len).all(), "outside every window"
    keep = [slot for slot in range(plain.cache_len) if slot not in differ]
    for name in ("keys", "values"):
        for layer, (ours, theirs) in enumerate(zip(getattr(overlapped, name), getattr(plain, name))):
            assert torch.equal(ours[:, :, keep], theirs[:, :, keep]), f"{name}[{layer}]"
            assert not ours[:, :, differ].any(), f"{name}[{layer}] of the rolled-back slot"


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
@pytest.mark.parametrize("ending", ["budget", "eos", "sampled"])
def test_overlapped_steps_give_what_one_step_at_a_time_gives(models, kind, ending, monkeypatch):
    model = models["eos" if ending == "eos" else "plain"]
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=5) if ending == "sampled" else None
    overlapped, overlapped_cache, overlapped_streamed = run(model, kind, "1", monkeypatch, sampling=sampling)
    plain, plain_cache, plain_streamed = run(model, kind, "0", monkeypatch, sampling=sampling)
    assert overlapped.token_ids == plain.token_ids and overlapped_streamed == plain_streamed
    assert torch.equal(overlapped.step_logits, plain.step_logits)
    assert overlapped.decode_steps == plain.decode_steps
    if ending == "eos":
        assert plain.decode_steps < NEW_TOKENS - 2, "every row stopped with budget left: a step was in flight"
        if kind == "sliding_window":
            assert int(plain.cache.length) > plain.cache.cache_len, "the ring had wrapped"
    assert_same_cache(overlapped_cache, plain_cache)
    # Both caches go on to give the same logits: the forced steps read every slot a query can see.
    forced = [[3 + row + step for step in range(FORCED_AFTER)] for row in range(len(PROMPTS))]
    last = [row[-1] for row in plain.token_ids]
    after = [continue_generation(model, cache, last, FORCED_AFTER, compile=False, return_logits=True,
                                 forced_tokens=forced)
             for cache in (overlapped_cache, plain_cache)]
    assert torch.equal(after[0].step_logits, after[1].step_logits)


def replaying_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every decode step behave as a CUDA graph's replay (reduce-overhead on a GPU): it returns the same output
    tensors each time, overwritten by the next step, and the loop knows it (`_outputs_replayed`). A step refuses an
    input in those buffers: CUDA graph trees would record the graph again for such an input, or find it freed. Returns
    the number of steps run, as a one-element list."""
    from torch_cache import generate as torch_generate

    decode_one_fn, steps = torch_generate._decode_one_fn, [0]

    def replaying(model: Mistral, compile: bool) -> object:
        eager = decode_one_fn(model, compile=False)
        static: dict[str, list[torch.Tensor]] = {}  # per graph (sampling kind): its output buffers

        def step(*args: object) -> tuple[torch.Tensor, ...]:
            replayed = {t.untyped_storage().data_ptr() for buffers in static.values() for t in buffers}
            fed_back = [i for i, arg in enumerate(args)
                        if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in replayed]
            assert not fed_back, f"step arguments {fed_back} are a replayed step's output buffers: clone them first"
            outputs = eager.step(*args)
            buffers = static.setdefault(str(args[-1]), [torch.empty_like(t) for t in outputs])
            for buffer, output in zip(buffers, outputs, strict=True):
                buffer.copy_(output)
            steps[0] += 1
            return tuple(buffers)

        return torch_generate._DecodeSteps(step, eager.settings, compiled=False)

    monkeypatch.setattr(torch_generate, "_decode_one_fn", replaying)
    monkeypatch.setattr(torch_generate, "_outputs_replayed", lambda compile, device: True)
    return steps


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
@pytest.mark.parametrize("ending", ["budget", "eos", "sampled"])
def test_steps_replayed_into_the_same_buffers_give_what_fresh_outputs_give(models, kind, ending, monkeypatch):
    """A GPU's compiled loop (two steps in flight, CUDA graph outputs overwritten by the next replay, docs/design.md
    §7.31), run on CPU: what the host reads after launching the next step (tokens, logits) is copied out first."""
    model = models["eos" if ending == "eos" else "plain"]
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=5) if ending == "sampled" else None
    plain, plain_cache, plain_streamed = run(model, kind, "0", monkeypatch, sampling=sampling)
    steps = replaying_steps(monkeypatch)
    replayed, replayed_cache, replayed_streamed = run(model, kind, "1", monkeypatch, sampling=sampling)
    assert steps[0] >= replayed.decode_steps > 0, "the replaying steps ran"
    assert replayed.token_ids == plain.token_ids and replayed_streamed == plain_streamed
    assert torch.equal(replayed.step_logits, plain.step_logits)
    assert_same_cache(replayed_cache, plain_cache)


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
def test_an_exception_in_on_token_rolls_back_the_step_in_flight(models, kind, monkeypatch):
    model, stop_after = models["plain"], 6
    caches = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv(OVERLAP, overlap)
        seen: list[list[int]] = []

        def interrupt(ids: list[int], seen: list[list[int]] = seen) -> None:
            seen.append(ids)
            if len(seen) == stop_after:
                raise KeyboardInterrupt

        caches[overlap] = make_cache(kind, model.config, len(PROMPTS), CACHE_LEN)
        with pytest.raises(KeyboardInterrupt):
            generate(model, PROMPTS, NEW_TOKENS, cache=caches[overlap], compile=False, on_token=interrupt)
        assert len(seen) == stop_after
    assert int(caches["0"].length) == max(map(len, PROMPTS)) + stop_after - 1
    assert_same_cache(caches["1"], caches["0"])


def test_overlap_is_off_on_cpu_by_default_and_a_bad_value_is_refused_before_the_prefill(models, monkeypatch):
    from torch_cache import generate as torch_generate
    from twincache.errors import InputError

    monkeypatch.delenv(OVERLAP, raising=False)
    assert not torch_generate._overlap_wanted(torch.device("cpu"))
    assert torch_generate._overlap_wanted(torch.device("cuda"))
    monkeypatch.setenv(OVERLAP, "2")
    cache = make_cache("static", models["plain"].config, 1, 32)
    with pytest.raises(InputError, match=r"TWINCACHE_OVERLAP_STEPS='2': set it to 0 \(one decode step at a time\) "
                                         r"or 1 \(two decode steps in flight\)"):
        generate(models["plain"], [PROMPTS[0]], 4, cache=cache, compile=False)
    assert int(cache.length) == 0, "a refused call changes nothing"
