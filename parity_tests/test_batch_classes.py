"""Batch size classes (docs/design.md §5): a tower that sizes the cache itself pads the batch up to its class
(`twincache.generation.batch_size_class`) with copies of the last row, so batches of 9 and 10 rows run one compiled
decode shape; the copies are finished from the first decode step, invisible to `on_token` and to the result, and a
continuation from the real rows' last tokens gives them back their copies (`twincache.mesh.pad_continuation`).

Cheap by design: torch counts dynamo's graphs with the eager backend (the guards, not inductor's codegen: ~1.5 s
where a real compile is 15-20 s), JAX decodes in step mode, and the reference tokens are torch's eager ones.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import jax_cache.generate as jg
import torch_cache.generate as tg
from jax_cache import backend as jax_backend
from jax_cache.model import Mistral as JaxMistral
from parity_tests.mesh_weights import checkpoint_with_eos
from torch_cache.model import Mistral as TorchMistral
from twincache.errors import CacheError
from twincache.generation import SamplingParams, batch_size_class
from twincache.mesh import pad_continuation
from twincache_app.handoff import cache_to_torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 9 real rows of unequal lengths (left-padded together), and a 10th, other prompt for the exact batch of 10
PROMPTS = [[(7 * i + 11 * row) % 120 + 2 for i in range(3 + row % 5)] for row in range(10)]
# new tokens of the generation, of its continuation, and of a continuation handed to torch (a full-window ring holds
# any length)
FIRST, MORE, BACK = 6, 4, 2
ATOL = 1e-5


# --- the rule (the floor) ---------------------------------------------------------------------------------------------

@given(rows=st.integers(1, 5000), data=st.sampled_from([1, 2, 3, 4, 5, 8]))
def test_a_batch_class_holds_the_rows_with_under_a_quarter_more_a_multiple_of_data(rows, data):
    padded = batch_size_class(rows, data)
    plain = batch_size_class(rows)
    assert padded % data == 0 and rows <= plain <= padded < plain + data
    if rows < 8:
        assert plain == rows, "1..7 rows are classes of their own"
    else:  # the extra rows are under a quarter: at most rows // 4 - 1 (the class's step is at most rows / 4)
        assert plain - rows <= rows // 4 - 1 and 4 * plain < 5 * rows
    assert plain % (1 << max(plain.bit_length() - 3, 0)) == 0, "m * 2^e, m in [4, 8): all but its top 3 bits are 0"
    assert batch_size_class(rows + 1, data) >= padded, "monotone"
    if data & (data - 1) == 0:  # a power of two: the smallest class that is a multiple of it
        assert batch_size_class(padded) == padded


def test_there_are_four_batch_classes_per_octave_and_the_first_are_exact():
    classes = [batch_size_class(rows) for rows in range(1, 4097)]
    assert classes[:20] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20, 20, 20, 20]
    for octave in range(3, 12):
        assert len({c for c in classes if 2 ** octave <= c < 2 ** (octave + 1)}) == 4, octave
    assert batch_size_class(17, 3) == 21, "not a multiple of 3: the class (20) rounded up to one"
    assert batch_size_class(9, 4) == 12 and batch_size_class(3, 2) == 4


def test_a_continuation_is_padded_to_the_rows_generate_gave_its_cache_and_to_no_other():
    seen = []
    assert pad_continuation([4] * 9, 10, 9, None) == ([4] * 10, None)
    padded, on_token = pad_continuation([1] * 8 + [5], 10, 9, seen.append)
    assert padded == [1] * 8 + [5, 5]
    on_token(list(range(10)))
    assert seen == [list(range(9))], "the callback sees the real rows only"
    assert pad_continuation([4] * 9, 12, 9, None)[0] == [4] * 12, "the class (10) rounded up to data=4"
    # the cache's real_rows, not a guess from the counts: 17 tokens for a cache of 18 real rows in 20 (a row lost
    # by the caller) is not padding, nor 9 for a 10-row cache the caller filled (no real_rows)
    for rows, cache_rows, real in ((17, 20, 18), (9, 10, None), (9, 12, 10), (10, 10, None), (10, 9, 9)):
        assert pad_continuation([4] * rows, cache_rows, real, None)[0] == [4] * rows, (rows, cache_rows, real)


def test_a_padded_cache_refuses_a_row_too_few_and_is_reused_for_its_rows(gqa):
    """generate(18 rows) pads to 20: continued with 17 last tokens (a row dropped) it is refused in one line that
    names the 18, where it was read as padding; given back to generate with its 18 prompts it is padded again,
    where it was refused. torch eager and JAX step mode, one new token each."""
    prompts = [[(3 * row + i) % 120 + 2 for i in range(3)] for row in range(18)]
    for tower, model, mode in ((tg, TorchMistral.from_pretrained(gqa), {"compile": False}),
                               (jg, JaxMistral.from_pretrained(gqa, jnp.float32), {"fused": False})):
        first = tower.generate(model, prompts, 1, **mode)
        assert (first.cache.batch_size, first.cache.real_rows) == (20, 18)
        with pytest.raises(CacheError, match=r"batch 17 was given, .* a batch of 18 rows \(padded to 20: give 18\)"):
            tower.continue_generation(model, first.cache, [row[-1] for row in first.token_ids][:17], 1, **mode)
        again = tower.generate(model, prompts, 1, cache=first.cache, **mode)
        assert again.token_ids == first.token_ids and again.cache.real_rows == 18


# --- the towers -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gqa(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["gqa"]


@pytest.fixture(scope="module")
def alone(gqa: Path) -> list[list[int]]:
    """Each of the 9 real rows alone (a batch of 1, exact), torch eager: FIRST + MORE + BACK greedy tokens."""
    model = TorchMistral.from_pretrained(gqa)
    return [tg.generate(model, [prompt], FIRST + MORE + BACK, compile=False).token_ids[0] for prompt in PROMPTS[:9]]


def test_torch_batches_of_9_and_10_rows_run_one_compiled_decode_and_9_decode_as_each_row_alone(gqa, alone,
                                                                                              monkeypatch):
    """The decode step compiled with dynamo's eager backend (its guards specialise on the batch as inductor's would):
    9 rows compile one graph, 10 rows and the continuation of the 9 compile none."""
    compile_eagerly = functools.partial(torch.compile, backend="eager", fullgraph=True, dynamic=False)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: compile_eagerly(fn))
    model = TorchMistral.from_pretrained(gqa)  # a fresh model: its own compiled step
    graphs = counters["stats"]["unique_graphs"]
    seen: list[int] = []
    nine = tg.generate(model, PROMPTS[:9], FIRST, on_token=lambda ids: seen.append(len(ids)))
    compiled = counters["stats"]["unique_graphs"] - graphs
    ten = tg.generate(model, PROMPTS, FIRST)
    more = tg.continue_generation(model, nine.cache, [row[-1] for row in nine.token_ids], MORE,
                                  on_token=lambda ids: seen.append(len(ids)))
    assert (compiled, counters["stats"]["unique_graphs"] - graphs) == (1, 1), "one decode shape for 9 and 10 rows"
    assert nine.cache.batch_size == ten.cache.batch_size == 10 and len(nine.token_ids) == len(more.token_ids) == 9
    assert seen == [9] * (FIRST + MORE), "on_token sees the real rows only, in generate and in the continuation"
    assert nine.token_ids == [row[:FIRST] for row in alone] and ten.token_ids[:9] == nine.token_ids
    assert more.token_ids == [row[FIRST:FIRST + MORE] for row in alone]


def test_torch_a_padded_batch_s_logits_are_each_row_s_alone(gqa):
    model = TorchMistral.from_pretrained(gqa)
    batch = tg.generate(model, PROMPTS[:9], FIRST, compile=False, return_logits=True)
    assert batch.cache.batch_size == 10 and batch.step_logits.shape == (9, FIRST, model.config.vocab_size)
    for row, prompt in enumerate(PROMPTS[:9]):
        one = tg.generate(model, [prompt], FIRST, compile=False, return_logits=True)
        torch.testing.assert_close(batch.step_logits[row], one.step_logits[0], atol=ATOL, rtol=0)


def test_jax_batches_of_9_and_10_rows_run_one_set_of_executables_and_9_decode_as_each_row_alone(gqa, alone):
    """Step mode from cleared jit caches: 9 rows compile the prefill and the step; 10 rows and the continuation of the
    9 compile nothing. The 9 real rows' tokens are torch's rows alone (fp32 greedy parity), their logits the 10-row
    batch's first 9 (the same executables: no compile). The cache of 10 rows hands over to torch, whole (torch pads
    the continuation as JAX does) or cut to the 9 real rows (`batch_size`), and decodes on there."""
    model = JaxMistral.from_pretrained(gqa, jnp.float32)
    jax.clear_caches()
    variants = jax_backend.compiled_variants()
    seen: list[int] = []
    nine = jg.generate(model, PROMPTS[:9], FIRST, fused=False, return_logits=True,
                       on_token=lambda ids: seen.append(len(ids)))
    compiled = jax_backend.compiled_variants() - variants
    ten = jg.generate(model, PROMPTS, FIRST, fused=False, return_logits=True)
    more = jg.continue_generation(model, nine.cache, [row[-1] for row in nine.token_ids], MORE, fused=False,
                                  on_token=lambda ids: seen.append(len(ids)))
    assert compiled >= 2 and jax_backend.compiled_variants() - variants == compiled, "one set for 9 and 10 rows"
    assert nine.cache.batch_size == ten.cache.batch_size == 10 and len(nine.token_ids) == len(more.token_ids) == 9
    assert seen == [9] * (FIRST + MORE), "on_token sees the real rows only, in generate and in the continuation"
    assert nine.token_ids == [row[:FIRST] for row in alone] and ten.token_ids[:9] == nine.token_ids
    assert more.token_ids == [row[FIRST:FIRST + MORE] for row in alone]
    np.testing.assert_allclose(np.asarray(nine.step_logits), np.asarray(ten.step_logits)[:9], atol=ATOL, rtol=0)
    torch_model = TorchMistral.from_pretrained(gqa)
    for batch_size in (None, 9):
        handed = cache_to_torch(more.cache, model.config, batch_size=batch_size)
        assert handed.batch_size == (batch_size or 10)
        back = tg.continue_generation(torch_model, handed, [row[-1] for row in more.token_ids], BACK, compile=False)
        assert back.token_ids == [row[FIRST + MORE:] for row in alone], batch_size


def test_a_sampled_padding_copy_never_holds_the_loop_open(gqa, tmp_path):
    """9 sampled rows, padded with a copy of the last (drawing its own noise: a row's draws follow its index), and EOS
    ids chosen from a free run of the exact batch of 10 (the 9 prompts and the copy) so that every real row ends
    before the budget and the copy does not: decoding stops when the last real row ends. Counted unfinished, the copy
    kept it going until its own draws hit one of the ids (step 21 of 23 here; it decodes on from the last real row's
    token, so it is not the free run's row 10 after the prefill). torch eager."""
    sampling, budget = SamplingParams(temperature=1.5, seed=3), 24
    free = tg.generate(TorchMistral.from_pretrained(gqa), PROMPTS[:9] + [PROMPTS[8]], budget, sampling=sampling,
                       compile=False).token_ids
    *real, copy = free
    eos = sorted({next(token for step, token in enumerate(row) if step >= 1 and token not in row[:step]
                       and token not in copy) for row in real})
    ends = [next(step for step, token in enumerate(row) if token in eos) for row in real]
    assert max(ends) < budget - 1, "every real row ends before the budget"
    model = TorchMistral.from_pretrained(checkpoint_with_eos(gqa, eos, tmp_path / "eos"))  # type: ignore[arg-type]
    result = tg.generate(model, PROMPTS[:9], budget, sampling=sampling, compile=False)
    assert result.cache.batch_size == 10
    assert result.token_ids == [row[:end + 1] for row, end in zip(real, ends, strict=True)]
    assert result.decode_steps == max(ends), "the loop ends with the last real row"
