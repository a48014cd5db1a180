"""Long prompts: chunked prefill in both towers (docs/design.md §5, "Long prompts").

A prompt goes through the model in fixed-size chunks through the same cache, so prefill memory is bounded by the chunk
and the cache (a ring: W + chunk keys), not by the prompt. Checked here on tiny checkpoints (window 8) with chunks of a
few tokens, by things that do not depend on the machine: logits against transformers and against a one-shot prefill,
the largest tensor a torch prefill creates, the number of JAX prefill traces and the width of every traced chunk.
Peak memory itself (RSS against prompt length) is measured by `twincache bench --prefill-memory`.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MistralForCausalLM

import jax_cache.generate as jg
import torch_cache.generate as tg
from jax_cache.cache import make_cache as jax_make_cache
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import WINDOW
from parity_tests.test_jax_generate import count_forward_traces
from torch_cache.cache import make_cache as torch_make_cache
from torch_cache.model import Mistral as TorchMistral
from twincache.errors import CacheError
from twincache.generation import prefill_chunks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# docs/design.md §4: chunked vs one-shot is the same code (an equivalence: 1e-5), and against transformers fp32 on a
# tiny model the rule's absolute allowance for max |logit diff| (1e-5) is above F x floor
ATOL = 1e-5
TOP1_MARGIN = 1e-4
NEW_TOKENS = 6
LENGTHS = (29, 17)  # a left-padded batch, both rows longer than the window of 8
CHUNKS = {"sliding_window": 5, "static": 11}  # shorter and longer than the window; neither divides the prompts
MAX_CACHE_LEN = 48  # one cache size for every run: JAX compiles one decode step per test
UNIQUE_CACHE_LEN = 101  # a cache size no other test uses, so its prefill is traced afresh here


@pytest.fixture(scope="module")
def models(checkpoints):
    path = checkpoints["gqa"]
    return TorchMistral.from_pretrained(path), JaxMistral.from_pretrained(path), MistralForCausalLM.from_pretrained(
        path).eval()


def make_prompts(lengths: tuple[int, ...], vocab: int = 128, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for length in lengths]


def run(tower: str, models, prompts: list[list[int]], cache: str, chunk: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens and step logits [B, steps, V] of one tower with prefill chunks of `chunk` columns."""
    torch_model, jax_model, _ = models
    if tower == "torch":
        result = tg.generate(torch_model, prompts, NEW_TOKENS, cache=cache, max_cache_len=MAX_CACHE_LEN,
                             compile=False, return_logits=True, prefill_chunk=chunk)
        return result.token_ids, result.step_logits.numpy()
    result = jg.generate(jax_model, prompts, NEW_TOKENS, cache=cache, max_cache_len=MAX_CACHE_LEN, fused=False,
                         return_logits=True, prefill_chunk=chunk)
    return result.token_ids, np.asarray(result.step_logits)


def transformers_logits(reference: MistralForCausalLM, prompts: list[list[int]],
                        generated: list[list[int]]) -> np.ndarray:
    """transformers' uncached forward over each row alone, unpadded, with its own positions (so the padding and
    position rules under test never build the reference's inputs): step logits [B, steps, V]."""
    rows = []
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, generated, strict=True):
            logits = reference(torch.tensor([prompt + tokens])).logits[0]  # [len, V]
            rows.append(logits[len(prompt) - 1:-1].float().numpy())  # the logits that chose each generated token
    return np.stack(rows)


def assert_parity(label: str, reference: np.ndarray, candidate: np.ndarray, tokens: list[list[int]]) -> None:
    assert candidate.shape == reference.shape, f"{label}: shapes {candidate.shape} != {reference.shape}"
    diff = np.abs(candidate - reference).max(axis=-1)  # [B, steps]
    assert diff.max() <= ATOL, f"{label}: max |logit diff| {diff.max():.3e} > {ATOL} at (row, step) " \
                               f"{np.unravel_index(diff.argmax(), diff.shape)}"
    top2 = np.sort(reference, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > TOP1_MARGIN
    assert not (clear & (np.asarray(tokens) != reference.argmax(-1))).any(), f"{label}: a clear greedy token differs"


def test_prefill_chunks_cover_the_prompt_with_the_remainder_first():
    assert prefill_chunks(10, 4) == [(0, 2), (2, 6), (6, 10)]
    assert prefill_chunks(8, 4) == [(0, 4), (4, 8)]
    assert prefill_chunks(3, 4) == [(0, 3)]
    for columns, chunk in ((1, 1), (29, 5), (100, 7), (512, 512), (513, 512)):
        spans = prefill_chunks(columns, chunk)
        assert [start for start, _ in spans[1:]] == [stop for _, stop in spans[:-1]]
        assert spans[0][0] == 0 and spans[-1][1] == columns
        assert all(stop - start == chunk for start, stop in spans[1:]) and 0 < spans[0][1] <= chunk


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_chunked_prefill_matches_one_shot_and_transformers(models, tower, cache):
    """A left-padded batch longer than the window, in chunks shorter (ring) and longer (static) than the window: the
    same logits as one chunk (the whole prompt at once) and as transformers' uncached forward, at prefill and every
    step."""
    prompts, chunk = make_prompts(LENGTHS), CHUNKS[cache]
    one_shot_tokens, one_shot = run(tower, models, prompts, cache, chunk=max(LENGTHS))
    reference = transformers_logits(models[2], prompts, one_shot_tokens)
    assert_parity(f"{tower}/{cache} one-shot vs transformers", reference, one_shot, one_shot_tokens)
    tokens, chunked = run(tower, models, prompts, cache, chunk)
    assert tokens == one_shot_tokens, f"{tower}/{cache} chunk {chunk}: greedy tokens differ from one-shot"
    assert_parity(f"{tower}/{cache} chunk {chunk} vs one-shot", one_shot, chunked, tokens)
    assert_parity(f"{tower}/{cache} chunk {chunk} vs transformers", reference, chunked, tokens)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def torch_prefill_largest(model: TorchMistral, length: int, chunk: int) -> int:
    """Elements of the largest tensor a sliding-window prefill of `length` tokens creates, chunk by chunk."""
    cache = torch_make_cache("sliding_window", model.config, 1, length + 1)
    ids = torch.tensor(make_prompts((length,)), dtype=torch.long)
    with LargestTensor() as largest:
        tg.prefill(model, ids, torch.ones_like(ids), cache, chunk)
    assert int(cache.length) == length
    return largest.numel


def test_torch_prefill_memory_is_bounded_by_chunk_and_window_not_prompt(models):
    """The largest tensor of a chunked prefill on a ring is the same for a prompt 4x longer (each chunk attends over
    W + chunk keys); in one chunk it grows with the prompt (the square of it, in the attention mask and scores)."""
    model, chunk = models[0], 8
    short, long = torch_prefill_largest(model, 40, chunk), torch_prefill_largest(model, 160, chunk)
    assert short == long, f"the largest tensor grew with the prompt in chunks of {chunk}: {short} -> {long}"
    heads = model.config.num_attention_heads
    assert long <= heads * chunk * (WINDOW + chunk) + model.config.intermediate_size * chunk
    assert torch_prefill_largest(model, 160, 160) > 8 * long, "one chunk: the largest tensor grows with the prompt"


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_jax_prefill_compiles_once_for_every_long_prompt(models, monkeypatch, cache):
    """Prompts past one chunk are padded to whole chunks, not to a power of two, and every chunk has the chunk's
    width: prompts of 3 and 9 chunks into caches of one size share one prefill trace and one compile. (A cache's
    buffer length is part of its shape, so caches of other sizes compile their own prefill; this cache is under two
    attention buckets, so every chunk reads all of it: test_buckets covers chunks that read a bucket.)"""
    jax_model, chunk = models[1], 8
    widths = count_forward_traces(monkeypatch)  # by input width; no decode step runs below
    before = jg._prefill._cache_size()
    for length in (3 * chunk - 2, 9 * chunk - 5):  # one new token: the prefill's (no decode step is compiled)
        result = jg.generate(jax_model, make_prompts((length,)), 1, cache=cache, max_cache_len=UNIQUE_CACHE_LEN,
                             prefill_chunk=chunk)
        assert len(result.token_ids[0]) == 1
    assert dict(widths) == {chunk: 1}, f"expected one prefill trace of width {chunk}: {dict(widths)}"
    assert jg._prefill._cache_size() == before + 1
    assert jg.prompt_bucket(1100, None, 512) == 1536, "a whole number of chunks, not the power of two 2048"
    assert jg.prompt_bucket(300, None, 512) == 512 and jg.prompt_bucket(20, None, 512) == 32
    assert jg.prompt_bucket(20, None, 8) == 24 and jg.prompt_bucket(5, None, 8) == 8


@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_a_prompt_past_the_capacity_is_refused_before_the_first_chunk(models, tower):
    """The whole prompt is checked before any chunk runs: a refused prefill leaves the cache as it was."""
    torch_model, jax_model, _ = models
    ids = np.asarray(make_prompts((30,)), np.int32)
    mask = np.ones_like(ids)
    if tower == "torch":
        cache = torch_make_cache("static", torch_model.config, 1, 20)
        with pytest.raises(CacheError, match="capacity"):
            tg.prefill(torch_model, torch.from_numpy(ids).long(), torch.from_numpy(mask), cache, 8)
        assert int(cache.length) == 0 and not any(k.any() for k in cache.keys)
    else:
        cache = jax_make_cache("static", jax_model.config, 1, 20)
        with pytest.raises(CacheError, match="capacity"):
            jg.prefill(jax_model, jnp.asarray(ids), jnp.asarray(mask), cache, 8)
        cache.check_live()  # not donated to a first chunk
        assert int(cache.length) == 0 and not any(bool(k.any()) for k in cache.keys)


def test_prefill_memory_bench_measures_a_point_and_records_a_killed_one(checkpoints, tmp_path):
    """`twincache bench --prefill-memory`'s pieces, small: a point measured in this process (torch, two chunks), the
    watchdog killing a point past its memory limit (1 MB: at once), and the table and plot written from both."""
    from bench import prefill_memory

    model = prefill_memory.long_position_model(checkpoints["gqa"], 600, tmp_path)
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 601
    point = prefill_memory.measure_point("torch", str(model), 40, 16)
    assert point["status"] == "ok" and point["chunk"] == 16 and point["peak_rss_mb"] >= point["rss_before_mb"] > 0
    killed = prefill_memory.run_point("torch", model, 40, 40, limit_bytes=2**20)
    assert killed["status"] == "killed (memory)" and "limit 0.0 GB" in killed["note"]
    records = [{**point, "variant": "chunked"}, {**killed, "variant": "one_chunk"}]
    prefill_memory._write(tmp_path, records, model, 16, 0.001)
    prefill_memory._plot(tmp_path, records, 16, model)
    table = (tmp_path / "prefill_memory.md").read_text()
    assert "| torch | chunked |" in table and "(killed)" in table
    assert (tmp_path / "prefill_memory.png").stat().st_size > 0


def test_prefill_memory_bench_runs_on_the_preset_model(checkpoints, tmp_path, monkeypatch, capsys):
    """`twincache bench --prefill-memory` sweeps the preset's own model: by default tiny's random checkpoint over its
    short lengths, --model DIR over the full range; a GGUF file (no config.json to copy) and a GPU preset are one line
    each. The sweep itself is replaced: its pieces are tested above."""
    from bench import prefill_memory
    from parity_tests.test_cli_bad_inputs import assert_one_line_error, run_in_process

    swept: list[tuple] = []
    monkeypatch.setattr(prefill_memory, "sweep", lambda backends, model, lengths, chunk, limit, out, progress:
                        swept.append((backends, model, lengths, chunk, out)))
    common = ["bench", "--prefill-memory", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    code, _, err = run_in_process([*common, "--out", str(tmp_path / "tiny")], capsys)
    assert code == 0, err
    backends, model, lengths, chunk, out = swept[-1]
    config = json.loads((model / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"], config["sliding_window"]) == (64, 512, 16), "not tiny's"
    assert lengths == [1000, 2000, 4000] and chunk == 512 and backends == ["torch", "jax"]
    code, _, err = run_in_process([*common, "--model", str(checkpoints["gqa"]), "--backends", "jax",
                                   "--prefill-chunk", "64", "--out", str(tmp_path / "gqa")], capsys)
    assert code == 0, err
    assert swept[-1][:4] == (["jax"], checkpoints["gqa"], list(prefill_memory.DEFAULT_LENGTHS), 64)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    code, _, err = run_in_process([*common, "--model", str(gguf)], capsys)
    assert_one_line_error(code, err, "is not a checkpoint directory")
    code, _, err = run_in_process([*common, "--preset", "7b"], capsys)
    assert_one_line_error(code, err, "builds its weights on a GPU")
    assert len(swept) == 2


def test_prefill_memory_numbers_past_what_a_point_can_take_are_refused_at_once(tmp_path, monkeypatch, capsys):
    """--memory-limit-gb inf was "unexpected OverflowError" (the watchdog's byte count), and a --prefill-chunk or
    prompt length past int32 ran the sweep, every point failing (or killed) alone, and exited 0."""
    from bench import prefill_memory
    from parity_tests.test_cli_bad_inputs import assert_one_line_error, run_in_process

    monkeypatch.setattr(prefill_memory, "sweep", lambda *args, **kwargs: pytest.fail("the sweep ran"))
    common = ["bench", "--prefill-memory", "--out", str(tmp_path / "out"), "--no-progress"]
    for flags, expected in ((["--memory-limit-gb", "inf"], "--memory-limit-gb=inf must be a finite number of GB"),
                            (["--prefill-chunk", str(2**31)], f"--prefill-chunk={2**31} must be in [1, 2147483647]"),
                            (["--prompt-lengths", f"8,{2**31}"], "give prompt lengths in [1, 2147483647]")):
        code, _, err = run_in_process([*common, *flags], capsys)
        assert_one_line_error(code, err, expected)
    assert not (tmp_path / "out").exists()


def test_an_interrupted_prefill_memory_sweep_says_so(checkpoints, tmp_path, monkeypatch):
    """Ctrl-C mid-sweep left prefill_memory.md as a table of the points measured, with nothing saying the rest (here
    2,000 tokens, the one-chunk row, jax) were never run rather than absent from the sweep."""
    from bench import prefill_memory

    points = iter([{"backend": "torch", "prompt_len": 1000, "chunk": 64, "status": "ok", "prefill_peak_mb": 5.0,
                    "peak_rss_mb": 300.0, "prefill_s": 0.1}])

    def run_point(*args: object, **kwargs: object) -> dict:
        point = next(points, None)
        if point is None:
            raise KeyboardInterrupt
        return point

    monkeypatch.setattr(prefill_memory, "run_point", run_point)
    with pytest.raises(KeyboardInterrupt):
        prefill_memory.sweep(["torch", "jax"], checkpoints["gqa"], [1000, 2000], 64, 1.0, tmp_path, progress=False)
    table = (tmp_path / "prefill_memory.md").read_text()
    assert "| torch | chunked | 5 |" in table
    assert "**Interrupted** after 1 of 8 points: the others (lengths, variants or backends the tables lack) were " \
           "never run." in table
