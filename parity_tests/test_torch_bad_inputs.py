"""docs/design.md §6, items 1-12 and 14-20, at the torch_cache Python API.

Each bad input must raise one specific twincache error class (exactly that class), with a one-line message holding
the relevant numbers, and a refused call must leave a cache it was given unchanged: every K/V buffer,
slot_positions and length compare equal before and after, at the same addresses. (Item 13 is JAX-only.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torch_cache.cache import SlidingWindowCache, StaticCache, make_cache
from torch_cache.generate import continue_generation, generate, prefill
from torch_cache.model import Mistral
from twincache.errors import (
    CacheError,
    CheckpointError,
    ConfigError,
    InputError,
    NonFiniteLogitsError,
    TwincacheError,
)
from twincache.generation import SamplingParams

VOCAB = 128
PROMPT = [5, 17, 42, 99]


# --- helpers ------------------------------------------------------------------------------------------------------


def buffers(cache: StaticCache) -> dict[str, torch.Tensor]:
    keys = {f"keys[{i}]": k for i, k in enumerate(cache.keys)}
    values = {f"values[{i}]": v for i, v in enumerate(cache.values)}
    return keys | values | {"slot_positions": cache.slot_positions, "length": cache.length}


def scribble(cache: StaticCache) -> StaticCache:
    """Give every buffer distinctive non-empty contents, in place (a reset or any write would change them)."""
    generator = torch.Generator().manual_seed(0)
    for buffer in (*cache.keys, *cache.values):
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    cache.slot_positions.copy_(torch.arange(cache.slot_positions.numel()).view_as(cache.slot_positions))
    cache.length.fill_(3)
    return cache


@contextmanager
def refused(error: type[TwincacheError], *fragments: object, cache: StaticCache | None = None) -> Iterator[None]:
    """The block must raise exactly `error` with every fragment in a one-line message, changing no cache buffer."""
    before = None if cache is None else {name: t.clone() for name, t in buffers(cache).items()}
    pointers = None if cache is None else {name: t.data_ptr() for name, t in buffers(cache).items()}
    with pytest.raises(TwincacheError) as info:
        yield
    err = info.value
    assert type(err) is error, f"raised {type(err).__name__}({err}), expected {error.__name__}"
    message = str(err)
    assert message and "\n" not in message, f"message must be one line: {message!r}"
    for fragment in fragments:
        assert str(fragment) in message, f"{fragment!r} missing from: {message}"
    if cache is not None:
        for name, tensor in buffers(cache).items():
            assert tensor.data_ptr() == pointers[name], f"{name} moved"
            assert torch.equal(tensor, before[name]), f"the refused call changed cache.{name}"


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


def arange_positions(batch: int, length: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length)


@pytest.fixture(scope="module")
def model(checkpoints: dict[str, Path]) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"])


@pytest.fixture(scope="module")
def no_window_model(checkpoints: dict[str, Path]) -> Mistral:
    return Mistral.from_pretrained(checkpoints["no_window"])


@pytest.fixture(params=["static", "sliding_window"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


# --- 1, 2: capacity -----------------------------------------------------------------------------------------------


def test_01_prompt_longer_than_static_capacity(model):
    prompt = list(range(1, 11))  # 10 tokens
    with refused(CacheError, "10", "max_cache_len=6"):
        generate(model, [prompt], 0, cache="static", max_cache_len=6)
    cache = scribble(StaticCache(model.config, 1, 6))
    with refused(CacheError, "10 tokens", "capacity 6", cache=cache):
        generate(model, [prompt], 0, cache=cache)
    cache = StaticCache(model.config, 1, 6)
    with refused(CacheError, "writing 10 tokens", "0..9", "[0, 6)", cache=cache), torch.inference_mode():
        model(ids(prompt), arange_positions(1, 10), cache)
    # A ring shorter than the window would forget keys the window still sees: bounded like a static cache.
    short_ring = SlidingWindowCache(model.config, 1, 5)
    with refused(CacheError, "writing 7 tokens", "[0, 5)", cache=short_ring), torch.inference_mode():
        model(ids(prompt[:7]), arange_positions(1, 7), short_ring)


def test_02_prompt_plus_new_tokens_beyond_static_capacity_refused_up_front(model):
    calls: list[list[int]] = []
    with refused(CacheError, "prompt (4 tokens)", "max_new_tokens (7)", "= 11", "max_cache_len=10"):
        generate(model, [PROMPT], 7, cache="static", max_cache_len=10, on_token=calls.append)
    cache = scribble(StaticCache(model.config, 1, 10))
    with refused(CacheError, "prompt (4 tokens)", "max_new_tokens (7)", "capacity 10", cache=cache):
        generate(model, [PROMPT], 7, cache=cache, on_token=calls.append)
    assert calls == [], "nothing may be generated before the refusal"
    # Continuing a cache that holds 3 columns by 8 more steps needs columns 3..10 of 10: 7 are left.
    with refused(CacheError, "needs 8 free columns", "capacity is 10 columns, 3 of them written", "7 left",
                 "at most 7 new tokens", cache=cache):
        continue_generation(model, cache, [7], 8, compile=False, on_token=calls.append)
    assert calls == []


# --- 3, 4, 5: batch, dtype, device --------------------------------------------------------------------------------


def test_03_input_batch_differs_from_cache_batch(model, kind):
    cache = scribble(make_cache(kind, model.config, 1, 12))
    with refused(CacheError, "batch 2", "batch 1", cache=cache):
        generate(model, [PROMPT, PROMPT[:2]], 3, cache=cache)
    cache.length.zero_()  # an otherwise valid forward
    cache.slot_positions.fill_(-1)
    with refused(CacheError, "batch 2", "batch 1", cache=cache), torch.inference_mode():
        model(ids(PROMPT, PROMPT), arange_positions(2, 4), cache)
    scribble(cache)
    with refused(CacheError, "batch 3", "batch 1", cache=cache):
        continue_generation(model, cache, [1, 2, 3], 1, compile=False)
    key = torch.zeros(4, 2, 1, 16)  # batch 4 must not broadcast into batch 1
    with refused(CacheError, "[4, 2, 1, 16]", "[1, 2, seq_len, 16]", cache=cache):
        cache.update(0, key, key)


def test_04_dtype_mismatch(model, kind):
    bf16_cache = scribble(make_cache(kind, model.config, 1, 12, dtype=torch.bfloat16))
    with refused(CacheError, "torch.bfloat16", "torch.float32", cache=bf16_cache):
        generate(model, [PROMPT], 3, cache=bf16_cache)
    with refused(CacheError, "torch.bfloat16", "torch.float32", cache=bf16_cache), torch.inference_mode():
        model(ids(PROMPT), arange_positions(1, 4), bf16_cache)
    cache = scribble(make_cache(kind, model.config, 1, 12))
    key = torch.zeros(1, 2, 1, 16, dtype=torch.float64)
    with refused(CacheError, "torch.float64", "torch.float32", cache=cache):
        cache.update(0, key, key)
    with refused(InputError, "torch.float32", "int32 or int64", cache=cache), torch.inference_mode():
        model(ids(PROMPT).float(), arange_positions(1, 4), cache)


def test_05_device_mismatch(model, kind):
    """The machine may have one device only; the meta device stands in for "another device"."""
    meta_cache = make_cache(kind, model.config, 1, 12, device="meta")
    with refused(CacheError, "cpu", "meta"):
        generate(model, [PROMPT], 3, cache=meta_cache)
    with refused(CacheError, "cpu", "meta"), torch.inference_mode():
        model(ids(PROMPT), arange_positions(1, 4), meta_cache)
    cache = scribble(make_cache(kind, model.config, 1, 12))
    key = torch.zeros(1, 2, 1, 16, device="meta")
    with refused(CacheError, "key_states is on meta", "cache is on cpu", cache=cache):
        cache.update(0, key, key)


# --- 6, 7, 8, 9, 10, 11, 12 ---------------------------------------------------------------------------------------


def test_06_write_position_out_of_range(model):
    cache = StaticCache(model.config, 1, 8)
    with torch.inference_mode():
        model(ids(list(range(1, 9))), arange_positions(1, 8), cache)  # full: columns 0..7
    with refused(CacheError, "columns 8..8", "[0, 8)", cache=cache), torch.inference_mode():
        model(ids([3]), arange_positions(1, 1, start=8), cache)
    key = torch.zeros(1, 2, 1, 16)
    with refused(CacheError, "columns 8..8", "[0, 8)", cache=cache):
        cache.update(0, key, key)
    cache.reset()
    cache.length.fill_(-1)  # tampered with: a negative column would wrap around in index_copy_
    with refused(CacheError, "columns -1..-1", cache=cache):
        cache.update(0, key, key)
    cache.length.zero_()
    with refused(CacheError, "layer_idx=2", "[0, 2)", cache=cache):
        cache.update(2, key, key)
    with refused(InputError, "-3", cache=cache), torch.inference_mode():
        model(ids([3, 4]), torch.tensor([[-3, -2]]), cache)


@pytest.mark.parametrize("bad", [-1, VOCAB, 10_000])
def test_07_token_id_outside_vocabulary(model, bad):
    cache = scribble(StaticCache(model.config, 1, 12))
    with refused(InputError, f"token id {bad}", f"[0, {VOCAB})", cache=cache):
        generate(model, [[5, bad, 6]], 3, cache=cache)
    with refused(InputError, f"prompt 1 holds token id {bad}"):
        generate(model, [[5], [5, bad]], 3)
    cache.length.zero_()
    cache.slot_positions.fill_(-1)
    with refused(InputError, f"token id {bad}", f"[0, {VOCAB})", cache=cache), torch.inference_mode():
        model(ids([5, bad, 6]), arange_positions(1, 3), cache)
    with refused(InputError, f"token id {bad}", f"[0, {VOCAB})", cache=scribble(cache)):
        continue_generation(model, cache, [bad], 2, compile=False)


def test_08_empty_prompt(model):
    cache = scribble(StaticCache(model.config, 2, 12))
    with refused(InputError, "prompt 1 is empty", cache=cache):
        generate(model, [PROMPT, []], 3, cache=cache)
    with refused(InputError, "prompt 0 is empty"):
        generate(model, [[]], 3)
    with refused(InputError, "no prompts"):
        generate(model, [], 3)
    with refused(InputError, "[2, 0]", cache=cache), torch.inference_mode():
        model(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long), cache)


def test_09_negative_max_new_tokens(model, kind):
    cache = scribble(make_cache(kind, model.config, 1, 12))
    with refused(InputError, "max_new_tokens=-1", cache=cache):
        generate(model, [PROMPT], -1, cache=cache)
    with refused(InputError, "max_new_tokens=-2"):
        generate(model, [PROMPT], -2, cache=kind)
    with refused(InputError, "max_new_tokens=-1", cache=cache):
        continue_generation(model, cache, [5], -1, compile=False)


@pytest.mark.parametrize(("sampling", "fragment"), [
    (SamplingParams(temperature=-0.5), "temperature=-0.5"),
    (SamplingParams(temperature=math.nan), "temperature=nan"),
    (SamplingParams(temperature=1.0, top_p=0.0), "top_p=0.0"),
    (SamplingParams(temperature=1.0, top_p=1.5), "top_p=1.5"),
    (SamplingParams(temperature=1.0, top_p=math.nan), "top_p=nan"),
    (SamplingParams(temperature=1.0, top_k=-1), "top_k=-1"),
    (SamplingParams(temperature=1.0, top_k=VOCAB + 1), f"top_k={VOCAB + 1}"),
], ids=["temperature<0", "temperature=nan", "top_p=0", "top_p>1", "top_p=nan", "top_k<0", "top_k>vocab"])
def test_10_bad_sampling_parameters(model, sampling, fragment):
    cache = scribble(SlidingWindowCache(model.config, 1, 12))
    with refused(InputError, fragment, cache=cache):
        generate(model, [PROMPT], 3, cache=cache, sampling=sampling)
    with refused(InputError, fragment, cache=cache):
        continue_generation(model, cache, [5], 3, sampling=sampling, compile=False)
    if "top_k" in fragment:
        assert f"vocab_size={VOCAB}" in str(pytest.raises(InputError, sampling.validate, VOCAB).value)


def test_11_attention_mask_shape_and_right_padding(model, kind):
    cache = make_cache(kind, model.config, 2, 12)
    input_ids = ids([5, 6, 7], [8, 9, 10])
    with refused(InputError, "[2, 4]", "[2, 3]", cache=cache), torch.inference_mode():
        model(input_ids, arange_positions(2, 3), cache, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with refused(InputError, "[2, 4]", "[2, 3]", cache=cache):
        prefill(model, input_ids, torch.ones(2, 4, dtype=torch.long), cache)
    with refused(InputError, "row 1", "right padding", cache=cache):
        prefill(model, input_ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), cache)
    with refused(InputError, "row 0", "left padding", cache=cache):
        prefill(model, input_ids, torch.tensor([[0, 1, 0], [1, 1, 1]]), cache)  # a gap is not left padding
    with refused(InputError, "row 1 holds 2 at column 0", "only 0 (padding) and 1", cache=cache):
        prefill(model, input_ids, torch.tensor([[1, 1, 1], [2, 1, 1]]), cache)  # not a 0/1 mask


def test_12_sliding_window_cache_on_config_without_window(no_window_model):
    config = no_window_model.config
    assert config.sliding_window is None
    with refused(CacheError, "sliding_window", "null"):
        generate(no_window_model, [PROMPT], 3, cache="sliding_window")
    with refused(CacheError, "sliding_window", "null"):
        SlidingWindowCache(config, 1, 12)
    with refused(CacheError, "sliding_window", "null"):
        make_cache("sliding_window", config, 1, 12)
    with refused(InputError, "'ring'"):
        generate(no_window_model, [PROMPT], 3, cache="ring")


# --- 14: a cache built for another model --------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("num_hidden_layers", 3, "3 layers x 2 kv heads x head_dim 16"),
    ("num_key_value_heads", 1, "2 layers x 1 kv heads x head_dim 16"),
    ("head_dim", 24, "2 layers x 2 kv heads x head_dim 24"),
])
def test_14_cache_built_for_another_model(model, kind, field, value, fragment):
    other = dataclasses.replace(model.config, **{field: value})
    cache = scribble(make_cache(kind, other, 1, 12))
    with refused(CacheError, fragment, "the model has 2 x 2 x 16", cache=cache):
        generate(model, [PROMPT], 3, cache=cache)
    cache.length.zero_()
    with refused(CacheError, fragment, "the model has 2 x 2 x 16", cache=cache), torch.inference_mode():
        model(ids(PROMPT), arange_positions(1, 4), cache)
    with refused(CacheError, fragment, cache=cache):
        continue_generation(model, cache, [5], 1, compile=False)


# --- 15-19: checkpoints -------------------------------------------------------------------------------------------


def copy_of(checkpoints: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoints[name], tmp_path / name))


def test_15_checkpoint_dir_missing_or_without_config_or_weights(checkpoints, tmp_path):
    with refused(CheckpointError, str(tmp_path / "absent"), "does not exist"):
        Mistral.from_pretrained(tmp_path / "absent")
    no_config = copy_of(checkpoints, "gqa", tmp_path)
    (no_config / "config.json").unlink()
    with refused(CheckpointError, "has no config.json"):
        Mistral.from_pretrained(no_config)
    gguf_dir = tmp_path / "gguf_only"  # a GGUF downloaded into a folder: the message names the file to give instead
    gguf_dir.mkdir()
    (gguf_dir / "model.Q4_1.gguf").write_bytes(b"GGUF")
    with refused(CheckpointError, "has no config.json", f"it holds {gguf_dir / 'model.Q4_1.gguf'}",
                 "give a .gguf file's path"):
        Mistral.from_pretrained(gguf_dir)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(checkpoints["gqa"] / "config.json", no_weights)
    with refused(CheckpointError, "model.safetensors", "model.safetensors.index.json"):
        Mistral.from_pretrained(no_weights)
    sharded = copy_of(checkpoints, "sharded", tmp_path)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    lost_shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / lost_shard).unlink()
    with refused(CheckpointError, lost_shard, "missing"):
        Mistral.from_pretrained(sharded)
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with refused(CheckpointError, "weight_map"):
        Mistral.from_pretrained(sharded)


def rewrite(directory: Path, edit: object) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_16_checkpoint_missing_a_tensor_or_with_a_wrong_shape(checkpoints, tmp_path):
    missing = copy_of(checkpoints, "gqa", tmp_path / "missing")
    rewrite(missing, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with refused(CheckpointError, "missing tensor model.layers.1.mlp.up_proj.weight", "[128, 64]"):
        Mistral.from_pretrained(missing)
    wrong = copy_of(checkpoints, "gqa", tmp_path / "wrong")
    rewrite(wrong, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with refused(CheckpointError, "model.layers.0.self_attn.k_proj.weight", "[16, 64]", "[32, 64]"):
        Mistral.from_pretrained(wrong)
    untied = copy_of(checkpoints, "tied", tmp_path / "untied")  # a tied checkpoint whose config claims untied
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    with refused(CheckpointError, "missing tensor lm_head.weight"):
        Mistral.from_pretrained(untied)
    bare = copy_of(checkpoints, "tied", tmp_path / "bare")  # a MistralModel's save: no "model." prefix
    rewrite(bare, lambda t: t.update({name.removeprefix("model."): t.pop(name) for name in list(t)}))
    with refused(CheckpointError, "missing tensor model.embed_tokens.weight", "it holds embed_tokens.weight",
                 "without the 'model.' prefix"):
        Mistral.from_pretrained(bare)


@pytest.mark.parametrize(("edit", "fragments"), [
    ({"model_type": "qwen2"}, ["model_type='qwen2'", "'mistral' and 'llama'"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["rope_scaling", "linear"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, ["rope_parameters", "yarn"]),
    ({"attention_bias": True}, ["attention_bias=True"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["rope_scaling", "dynamic"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads=4", "num_key_value_heads=3"]),
    ({"hidden_size": None}, ["hidden_size"]),
], ids=["model_type", "rope_scaling", "rope_parameters", "attention_bias", "hidden_act", "rope_scaling_type",
        "gqa_groups", "missing_field"])
def test_17_unsupported_config_names_the_field(checkpoints, tmp_path, edit, fragments):
    directory = copy_of(checkpoints, "gqa", tmp_path)
    config = json.loads((directory / "config.json").read_text()) | edit
    config = {k: v for k, v in config.items() if v is not None}
    (directory / "config.json").write_text(json.dumps(config))
    with refused(ConfigError, *fragments):
        Mistral.from_pretrained(directory)


class _Tripwire:
    """Unpickling this creates a directory: proof that a .bin file was (or was not) unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.makedirs, (str(self.path),)


def test_18_only_pickled_weights_are_never_unpickled(checkpoints, tmp_path):
    directory = tmp_path / "bin_only"
    directory.mkdir()
    shutil.copy(checkpoints["gqa"] / "config.json", directory)
    tripwire = tmp_path / "unpickled"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(tripwire)))
    with refused(CheckpointError, "pytorch_model.bin", "never unpickles", "safe_serialization=True"):
        Mistral.from_pretrained(directory)
    assert not tripwire.exists(), "the .bin file was unpickled"


def _truncate_tail(path: Path) -> list[str]:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size - 100])
    return ["truncated", f"need {size} bytes", f"has {size - 100}"]


def _garbage_header(path: Path) -> list[str]:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff\xfe garbage, not a JSON header \x00"[:32]
    path.write_bytes(bytes(data))
    return ["corrupted"]


def _huge_header_length(path: Path) -> list[str]:
    data = bytearray(path.read_bytes())
    data[:8] = (10**9).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return ["corrupted or truncated", f"claims {10**9} bytes", f"has {len(data)}"]


def _five_bytes(path: Path) -> list[str]:
    path.write_bytes(b"\x10\x00\x00\x00\x00")
    return ["truncated", "5 bytes"]


@pytest.mark.parametrize("damage", [_truncate_tail, _garbage_header, _huge_header_length, _five_bytes],
                         ids=["tail_cut", "garbage_header", "huge_header_length", "five_bytes"])
def test_19_truncated_or_corrupted_safetensors(checkpoints, tmp_path, damage):
    directory = copy_of(checkpoints, "gqa", tmp_path)
    fragments = damage(directory / "model.safetensors")
    with refused(CheckpointError, "model.safetensors", *fragments):
        Mistral.from_pretrained(directory)


def test_19_truncated_shard(checkpoints, tmp_path):
    directory = copy_of(checkpoints, "sharded", tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    fragments = _truncate_tail(shard)
    with refused(CheckpointError, shard.name, *fragments):
        Mistral.from_pretrained(directory)


# --- 20: non-finite logits ----------------------------------------------------------------------------------------


def test_20_non_finite_logits_during_decode(checkpoints, model):
    """Poison the input embedding of a token greedy decoding produces at step k: step k + 1 must be refused."""
    new_tokens = 12
    clean = generate(model, [PROMPT], new_tokens, compile=False).token_ids[0]
    step, token = next((s, t) for s, t in enumerate(clean) if s >= 2 and t not in PROMPT and t not in clean[:s])
    poisoned = Mistral.from_pretrained(checkpoints["gqa"])
    assert not poisoned.config.tie_word_embeddings  # so the poisoned row only feeds the input, not the logits
    poisoned.model.embed_tokens.weight[token] = math.nan
    streamed: list[list[int]] = []
    with refused(NonFiniteLogitsError, f"generated token {step + 1}", "torch.float32"):
        generate(poisoned, [PROMPT], new_tokens, compile=False, on_token=streamed.append)
    assert [ids[0] for ids in streamed] == clean[: step + 1], "tokens before the bad step are streamed unchanged"


def test_20_non_finite_logits_at_prefill(checkpoints):
    poisoned = Mistral.from_pretrained(checkpoints["gqa"])
    poisoned.model.norm.weight[7] = math.inf
    streamed: list[list[int]] = []
    with refused(NonFiniteLogitsError, "generated token 0"):
        generate(poisoned, [PROMPT, PROMPT[:2]], 5, compile=False, on_token=streamed.append)
    assert streamed == []
