"""CPU weights and K/V buffers live in host memory advised to be backed by 2 MiB pages (twincache.hugepages,
docs/design.md §7.29): one allocation for a model's weights and one for a cache's K/V, a storage per tensor, the same
bytes as the checkpoint.

What is checked is the advice (the mapping's `hg` flag in /proc/self/smaps), the layout and the values, not whether
the kernel then gave huge pages: that depends on the machine's THP setting and free memory.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jax_cache.cache import host_buffers as jax_host_buffers
from jax_cache.model import Mistral as JaxMistral
from parity_tests.conftest import save_hf_checkpoint
from torch_cache.cache import host_buffers as torch_host_buffers
from torch_cache.cache import make_cache
from torch_cache.model import Mistral as TorchMistral
from twincache import hugepages

# Linux with THP compiled in: where the advice exists, it must be given. Elsewhere the buffers are plain memory.
ADVICE = sys.platform == "linux" and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def advised_huge(address: int) -> bool | None:
    """Whether the mapping holding `address` is advised MADV_HUGEPAGE (its VmFlags in /proc/self/smaps carry `hg`);
    None where there is no /proc/self/smaps to read. What tests check: whether pages are then actually huge depends on
    the machine's THP setting and free memory, which this does not judge."""
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):  # a mapping's first line: start-end ...
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@pytest.fixture(scope="module")
def wide_vocab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer checkpoint whose embedding table and head are 2 MiB each: more than one huge page of weights."""
    return save_hf_checkpoint(tmp_path_factory.mktemp("wide_vocab"), seed=3, vocab_size=8192)


def storage_start(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_host_buffer_is_huge_page_aligned_zeroed_advised_and_outlives_its_first_view():
    buffer = hugepages.host_buffer(3 * hugepages.HUGE_PAGE + 5)
    assert buffer.dtype == np.uint8 and buffer.shape == (3 * hugepages.HUGE_PAGE + 5,) and buffer.flags.writeable
    assert buffer.ctypes.data % hugepages.HUGE_PAGE == 0
    assert not buffer.any()
    if ADVICE:
        assert advised_huge(buffer.ctypes.data) is True
    tensor = torch.from_numpy(buffer[hugepages.HUGE_PAGE:-5].view(np.float32))  # the tensor keeps the mapping alive
    tensor.fill_(2.5)
    del buffer
    gc.collect()
    assert float(tensor.sum()) == 2.5 * tensor.numel()


def test_arena_offsets_are_aligned_apart_and_sum_to_the_buffer():
    offsets, total = hugepages.arena_offsets([1, 64, 65, 0, 130])
    assert offsets == [0, 64, 128, 256, 256] and total == 448
    assert all(offset % hugepages.ALIGNMENT == 0 for offset in offsets)


@pytest.mark.parametrize("host_buffers", [torch_host_buffers, jax_host_buffers], ids=["torch", "jax"])
def test_host_buffers_share_one_advised_allocation_above_a_huge_page_and_are_plain_below(host_buffers):
    dtype = torch.float32 if host_buffers is torch_host_buffers else np.float32
    big = host_buffers([(1024, 512), (3,), (512, 1024)], dtype)  # 4 MiB and 12 bytes
    small = host_buffers([(16, 16)], dtype)
    pointer = (lambda a: a.data_ptr()) if host_buffers is torch_host_buffers else (lambda a: a.ctypes.data)
    assert [tuple(a.shape) for a in big] == [(1024, 512), (3,), (512, 1024)]
    assert all(pointer(a) % hugepages.ALIGNMENT == 0 for a in big)
    assert pointer(big[1]) - pointer(big[0]) == 1024 * 512 * 4 and pointer(big[2]) - pointer(big[1]) == 64
    assert all(not a.any() for a in big + small)
    if ADVICE:
        assert all(advised_huge(pointer(a)) for a in big)
        assert advised_huge(pointer(small[0])) is False


def test_torch_weights_load_into_one_advised_allocation_with_the_checkpoints_values(wide_vocab_checkpoint):
    expected = load_file(str(wide_vocab_checkpoint / "model.safetensors"))
    model = TorchMistral.from_pretrained(wide_vocab_checkpoint)
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    in_order = sorted(params.values(), key=lambda p: p.data_ptr())
    total = sum(-(-p.nbytes // hugepages.ALIGNMENT) * hugepages.ALIGNMENT for p in in_order)  # each rounded up
    assert in_order[-1].data_ptr() + in_order[-1].nbytes - in_order[0].data_ptr() <= total, "one allocation"
    # ... with a storage per tensor: dynamo refuses region inputs that share one (test_torch_compile compiles these)
    assert len({storage_start(p) for p in params.values()}) == len(params)
    for name, param in params.items():
        assert param.data_ptr() % hugepages.ALIGNMENT == 0, name
        np.testing.assert_array_equal(param.numpy(), expected[name], err_msg=name)
    if ADVICE:
        assert all(advised_huge(p.data_ptr()) for p in params.values())
    bf16 = TorchMistral.from_pretrained(wide_vocab_checkpoint, torch.bfloat16)
    for name, param in bf16.named_parameters():  # converted as .to(dtype) converts
        assert torch.equal(param, torch.from_numpy(expected[name]).to(torch.bfloat16)), name


def test_torch_kv_buffers_share_one_advised_zeroed_allocation_with_a_storage_each():
    from twincache.config import MistralConfig

    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cache = make_cache("static", config, batch_size=2, max_cache_len=8192)  # 2 MiB per buffer
    buffers = [*cache.keys, *cache.values]
    assert [b.data_ptr() - buffers[0].data_ptr() for b in buffers] == [n * (2 << 20) for n in range(len(buffers))]
    assert len({storage_start(b) for b in buffers}) == len(buffers)  # a compiled region refuses aliased inputs
    assert all(not b.any() for b in buffers)
    if ADVICE:
        assert all(advised_huge(b.data_ptr()) for b in buffers)


def test_jax_float32_weights_are_shared_from_one_advised_allocation_uncommitted(wide_vocab_checkpoint):
    expected = load_file(str(wide_vocab_checkpoint / "model.safetensors"))
    model = JaxMistral.from_pretrained(wide_vocab_checkpoint)
    head = model.lm_head.weight[...]
    embed = model.model.embed_tokens.weight[...]
    np.testing.assert_array_equal(np.asarray(head), expected["lm_head.weight"])
    np.testing.assert_array_equal(np.asarray(embed), expected["model.embed_tokens.weight"])
    # Uncommitted, as jnp arrays are: a committed weight would give the decode step a second jit signature.
    assert not head.committed and not embed.committed
    if ADVICE:
        assert advised_huge(head.unsafe_buffer_pointer()) is True
        assert advised_huge(embed.unsafe_buffer_pointer()) is True
    assert jax.devices()[0].platform == "cpu"


def test_torch_compiled_decoding_reads_weights_and_kv_from_the_arenas_as_eager_does(wide_vocab_checkpoint):
    """A model whose weights and cache are in arenas compiles (each tensor its own storage: dynamo refuses aliased
    region inputs) and decodes the same tokens as eager decoding."""
    from torch_cache.generate import generate

    model = TorchMistral.from_pretrained(wide_vocab_checkpoint)
    prompt = [[5, 9, 200, 7000, 31, 4]]
    cache = make_cache("static", model.config, batch_size=1, max_cache_len=4096)  # 2 MiB of K/V in all
    if ADVICE:
        assert advised_huge(cache.keys[0].data_ptr()) and advised_huge(
            model.lm_head.weight.data_ptr())
    compiled = generate(model, prompt, 6, cache=cache, compile=True).token_ids
    eager = generate(model, prompt, 6, cache="static", max_cache_len=4096, compile=False).token_ids
    assert compiled == eager


class _Arrays:
    """Stands in for a GGUFCheckpoint: the (name, array) pairs a loader reads."""

    def __init__(self, pairs: list[tuple[str, np.ndarray]]) -> None:
        self.pairs = pairs

    def arrays(self):
        return iter(self.pairs)


@pytest.mark.parametrize("tower", ["torch", "jax"])
def test_reading_into_the_arena_refuses_a_wrong_shape_an_unknown_tensor_and_a_missing_one(wide_vocab_checkpoint,
                                                                                           tower):
    """The checkpoint's shapes are checked when it is opened; the arena's reader checks again rather than let a copy
    broadcast a wrong-shaped tensor or leave a slot of zeros."""
    import jax.numpy as jnp

    import jax_cache.model as jax_model
    import torch_cache.model as torch_model
    from twincache.checkpoint import open_checkpoint
    from twincache.errors import CheckpointError

    config, _ = open_checkpoint(wide_vocab_checkpoint)
    full = list(load_file(str(wide_vocab_checkpoint / "model.safetensors")).items())
    read, dtype = ((torch_model._read_to_host, torch.float32) if tower == "torch"
                   else (jax_model._read_to_host, jnp.float32))
    assert len(read(config, _Arrays(full), {}, dtype)) == len(full)  # the stand-in is a valid checkpoint
    name, array = full[0]
    cases = {"has shape": [(name, array[:1]), *full[1:]], "has no place for": [*full, ("extra.weight", array)],
             "lack 1 of the": full[1:]}
    for message, pairs in cases.items():
        with pytest.raises(CheckpointError, match=message):
            read(config, _Arrays(pairs), {}, dtype)


def test_twincache_huge_pages_0_gives_plain_pages_and_another_value_a_clear_error(monkeypatch):
    monkeypatch.setenv("TWINCACHE_HUGE_PAGES", "0")
    plain = hugepages.host_buffer(2 * hugepages.HUGE_PAGE)
    assert plain.ctypes.data % hugepages.HUGE_PAGE == 0 and not plain.any()
    assert advised_huge(plain.ctypes.data) in (False, None)
    monkeypatch.setenv("TWINCACHE_HUGE_PAGES", "yes")
    from twincache.errors import InputError

    with pytest.raises(InputError, match=r"TWINCACHE_HUGE_PAGES='yes': set it to 0 .* or 1"):
        hugepages.host_buffer(hugepages.HUGE_PAGE)
    for host_buffers, dtype in ((torch_host_buffers, torch.float32), (jax_host_buffers, np.float32)):
        # under one huge page: plain zeros, but the setting is still read (a tiny model's weights took it silently)
        with pytest.raises(InputError, match=r"TWINCACHE_HUGE_PAGES='yes'"):
            host_buffers([(4, 4)], dtype)


def test_the_cli_reports_a_bad_twincache_huge_pages_in_one_line(tiny_model_dir, monkeypatch):
    """A model and a cache far under one huge page (plain zeros) still read the setting: they took a bad one silently,
    and only a cache past 2 MiB refused it."""
    import subprocess

    env = {**__import__("os").environ, "TWINCACHE_HUGE_PAGES": "2"}
    run = subprocess.run([sys.executable, "-m", "twincache_app.cli", "generate", "--model", str(tiny_model_dir),
                          "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--mode", "eager"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("twincache: ") and "TWINCACHE_HUGE_PAGES='2'" in lines[-1]
    assert "Traceback" not in run.stderr
