"""Faults: interrupts mid-generation, damaged checkpoint files, a crash while building the default model, and
non-finite logits. Each must end in a clear error or a state that is safe to reuse -- never wrong tokens.

Interrupts, damaged files and non-finite logits go through torch_cache's API here (an interrupt needs its Python decode
loop and in-place cache); damaged checkpoints and non-finite logits reach jax_cache too, through the CLI, in
test_cli_bad_inputs.py, and the default-model build is framework-free.
"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import time
from pathlib import Path

import pytest
import torch

from parity_tests.test_cli_bad_inputs import copy_checkpoint, rewrite_tensors
from torch_cache.cache import make_cache
from torch_cache.generate import generate
from torch_cache.model import Mistral
from twincache import default_model
from twincache.errors import CheckpointError, NonFiniteLogitsError

PROMPTS = [[1, 5, 9, 13, 2, 7, 11], [3, 4, 6]]  # two rows, different left padding
MAX_CACHE_LEN = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(checkpoints) -> Mistral:
    return Mistral.from_pretrained(checkpoints["gqa"])


def cache_tensors(cache) -> list[torch.Tensor]:
    return [*cache.keys, *cache.values, cache.slot_positions, cache.length]


def assert_cache_equal(cache, other) -> None:
    assert type(cache) is type(other) and cache.cache_len == other.cache_len
    for mine, theirs in zip(cache_tensors(cache), cache_tensors(other), strict=True):
        assert torch.equal(mine, theirs)


# --- 1. KeyboardInterrupt mid-generation ------------------------------------------------------------------------------


def _interrupt_after(count: int, seen: list[list[int]]):
    def on_token(row_ids: list[int]) -> None:
        seen.append(row_ids)
        if len(seen) == count:
            raise KeyboardInterrupt

    return on_token


def _check_reset_then_reuse(model: Mistral, cache, kind: str, streamed: list[list[int]]) -> None:
    fresh = make_cache(kind, model.config, len(PROMPTS), MAX_CACHE_LEN)
    cache.reset()
    assert_cache_equal(cache, fresh)
    reused = generate(model, PROMPTS, 20, cache=cache, compile=False, return_logits=True)
    clean = generate(model, PROMPTS, 20, cache=fresh, compile=False, return_logits=True)
    assert reused.token_ids == clean.token_ids
    assert torch.equal(reused.step_logits, clean.step_logits)
    assert [list(step) for step in zip(*clean.token_ids)][:len(streamed)] == streamed  # what streamed was right


@pytest.mark.parametrize("kind", ["sliding_window", "static"])
def test_interrupt_from_streaming_callback_then_reset_equals_fresh(model, kind: str):
    cache = make_cache(kind, model.config, len(PROMPTS), MAX_CACHE_LEN)
    seen: list[list[int]] = []
    with pytest.raises(KeyboardInterrupt):
        generate(model, PROMPTS, 30, cache=cache, compile=False, on_token=_interrupt_after(12, seen))
    assert len(seen) == 12
    assert int(cache.length) == len(PROMPTS[0]) + 11  # interrupted mid-way, past a ring wrap (window 8)
    _check_reset_then_reuse(model, cache, kind, seen)


@pytest.mark.parametrize("kind", ["sliding_window", "static"])
def test_interrupt_inside_a_forward_between_layer_writes_then_reset_equals_fresh(model, kind: str):
    """The worst moment: layer 0 wrote its K/V, layer 1 did not, positions and length were never advanced."""
    cache = make_cache(kind, model.config, len(PROMPTS), MAX_CACHE_LEN)
    layer = model.model.layers[1]
    calls = {"n": 0}
    original_forward = layer.forward

    def interrupted_forward(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original_forward(*args, **kwargs)

    layer.forward = interrupted_forward
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(model, PROMPTS, 30, cache=cache, compile=False)
    finally:
        del layer.forward  # back to the class's forward
    assert calls["n"] == 10
    assert int(cache.length) == len(PROMPTS[0]) + 8  # prefill + 8 decode steps advanced; the 9th was cut
    _check_reset_then_reuse(model, cache, kind, [])


# --- 2. truncated or corrupted safetensors ----------------------------------------------------------------------------


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    return Mistral.from_pretrained(model_dir).state_dict()


def test_truncated_safetensors_at_any_length_is_a_checkpoint_error(checkpoints, tmp_path):
    model_dir = copy_checkpoint(checkpoints["gqa"], tmp_path / "cut")
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    cuts = [0, 3, 8, 9, 8 + header_len // 2, 8 + header_len, 8 + header_len + 1, len(data) // 2, len(data) - 1]
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|corrupted") as info:
            Mistral.from_pretrained(model_dir)
        assert str(path) in str(info.value) and "\n" not in str(info.value), cut


def test_corrupted_header_bytes_give_a_checkpoint_error_or_the_same_weights(checkpoints, tmp_path):
    """Random single-byte changes in the header: refused with CheckpointError, or (a harmless byte, e.g. in the
    metadata) loaded to exactly the original weights -- never another exception, never different weights."""
    original = _state(checkpoints["gqa"])
    model_dir = copy_checkpoint(checkpoints["gqa"], tmp_path / "flip")
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    rng = random.Random(0)
    refused = 0
    for _ in range(40):
        position = rng.randrange(8, 8 + header_len)
        damaged = bytearray(data)
        damaged[position] = (damaged[position] + rng.randrange(1, 256)) % 256  # always a different byte
        path.write_bytes(bytes(damaged))
        try:
            loaded = _state(model_dir)
        except CheckpointError as err:
            assert "\n" not in str(err)
            refused += 1
            continue
        assert all(torch.equal(loaded[name], original[name]) for name in original), position
    assert refused >= 30  # nearly every header byte matters


# --- 3. a crash while the default model is being built ----------------------------------------------------------------


def _final_dir(home: Path) -> Path:
    return home / f"tiny-mistral-v{default_model.BUILD_VERSION}-seed{default_model.DEFAULT_SEED}"


@pytest.fixture(scope="module")
def reference_build(tmp_path_factory) -> Path:
    """A default model built once without interference: every rebuild below must equal it file for file."""
    return default_model.build_tiny_model(_final_dir(tmp_path_factory.mktemp("reference_home")))


def _assert_good_default_model(home: Path, reference: Path) -> None:
    final = _final_dir(home)
    assert (final / default_model._COMPLETE_STAMP).is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (final / name).read_bytes() == (reference / name).read_bytes(), name
    Mistral.from_pretrained(final)  # and it loads


def _save_half_then_raise(error: BaseException):
    real_save = default_model.save_file

    def save_file(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        real_save(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[:len(data) // 2])  # half the bytes are on disk when the failure hits
        raise error

    return save_file


def _tokenizer_that_raises(error: BaseException):
    def byte_level_tokenizer() -> None:
        raise error

    return byte_level_tokenizer


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk_full", "interrupt"])
@pytest.mark.parametrize("stage", ["weights", "tokenizer"])
def test_failed_default_model_build_leaves_nothing_trusted_and_next_run_rebuilds(tmp_path, monkeypatch, error,
                                                                                 stage: str, reference_build):
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    if stage == "weights":
        monkeypatch.setattr(default_model, "save_file", _save_half_then_raise(error))
    else:
        monkeypatch.setattr(default_model, "byte_level_tokenizer", _tokenizer_that_raises(error))
    with pytest.raises(type(error)):
        default_model.tiny_model_dir()
    assert not _final_dir(tmp_path).exists()
    # the staging directory is gone too; only the (empty) lock file that serialises builders remains
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    assert default_model.tiny_model_dir() == _final_dir(tmp_path)
    _assert_good_default_model(tmp_path, reference_build)


def test_build_killed_without_cleanup_is_never_trusted(tmp_path, monkeypatch, reference_build):
    """A SIGKILL skips `finally`: the half-written staging dir stays, but never under the final name."""
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    stale = tmp_path / ".building-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    recent = tmp_path / ".building-recent"  # perhaps another process building right now: left alone
    recent.mkdir()
    assert default_model.tiny_model_dir() == _final_dir(tmp_path)
    _assert_good_default_model(tmp_path, reference_build)
    assert not stale.exists() and recent.exists()


def _dead_pid() -> int:
    """The pid of a process that has ended (reaped, so nothing answers to it until the pid is reused)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftover_builds_of_ended_processes_are_removed_even_once_the_model_exists(tmp_path, monkeypatch):
    """A staging directory records its builder's host and pid: one whose builder has ended goes at the next run, new
    or not, and whether or not a build runs then; a live builder's, or another host's, stays (it may be building)."""
    import socket

    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    built = default_model.tiny_model_dir()
    host, dead = socket.gethostname(), _dead_pid()
    ended = tmp_path / f".building-{host}-{dead}-abc123_x"
    running = tmp_path / f".building-{host}-{os.getpid()}-def456_y"
    elsewhere = tmp_path / f".building-another-host-{dead}-ghi789_z"
    for leftover in (ended, running, elsewhere):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"x" * 1024)
    assert default_model.tiny_model_dir() == built  # complete already: no build runs
    assert not ended.exists(), "an ended build's staging directory was kept"
    assert running.exists() and elsewhere.exists(), "a build that may be in progress was removed"


def test_a_killed_builder_not_yet_reaped_counts_as_ended(tmp_path):
    """A builder killed while a second first run waits on the lock wakes that run at once, before its parent reaps
    it: a zombie, which os.kill(pid, 0) still finds. Its staging directory (213 MB, seen) outlived the build that
    replaced it."""
    import socket
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    try:
        child.kill()
        for _ in range(200):  # dead, not reaped: its parent (this test) has not waited for it
            if Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                break
            time.sleep(0.01)
        leftover = tmp_path / f".building-{socket.gethostname()}-{child.pid}-abc123_x"
        leftover.mkdir()
        default_model._remove_stale_builds(tmp_path)
        assert not leftover.exists(), "a killed builder's staging directory was kept"
    finally:
        child.wait()


INTERRUPTED_BUILD = """
import os, signal, sys, time
from pathlib import Path
from twincache import default_model
from twincache_app import interrupts

def write(staging: Path) -> None:
    (staging / "model.safetensors").write_bytes(b"x" * 1_000_000)
    print(staging, flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C halfway through the build
    time.sleep(60)

with interrupts.exit_on_interrupt():  # as the CLI runs every command
    default_model.build_aside(Path(sys.argv[1]) / "model", write, "stamp")
"""


def test_ctrl_c_during_a_build_removes_its_staging_directory(tmp_path):
    """Ctrl-C exits by os._exit, which skips build_aside's `finally`; the half-built model must not stay behind."""
    import subprocess
    import sys

    from parity_tests.test_interrupts import children_start_with_sigint

    with children_start_with_sigint():  # as from a terminal, even when this run's SIGINT is ignored (a background job)
        proc = subprocess.run([sys.executable, "-c", INTERRUPTED_BUILD, str(tmp_path)], capture_output=True,
                              text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 130 and proc.stderr.endswith("twincache: interrupted\n"), proc.stderr
    staging = Path(proc.stdout.strip())
    assert staging.parent == tmp_path and staging.name.startswith(".building-"), staging
    assert not staging.exists() and not (tmp_path / "model").exists(), sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("contents", ["empty", "half_written", "other_model"])
def test_final_directory_without_stamp_is_rebuilt(tmp_path, monkeypatch, checkpoints, reference_build,
                                                 contents: str):
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    final = _final_dir(tmp_path)
    if contents == "empty":
        final.mkdir()
    elif contents == "half_written":
        final.mkdir()
        (final / "config.json").write_text(json.dumps(default_model.DEFAULT_CONFIG.to_hf_dict()))
        (final / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    else:  # a complete, loadable checkpoint -- but not the one this build would write
        copy_checkpoint(checkpoints["gqa"], final)
    assert default_model.tiny_model_dir() == final
    _assert_good_default_model(tmp_path, reference_build)


def test_a_build_has_the_modes_the_umask_gives_new_files(reference_build):
    """mkdtemp made the built directory 0700 (and safetensors' writer model.safetensors 0600), so a TWINCACHE_HOME
    shared by a team served only whoever built it. The umask is read from the kernel's own record of it."""
    status = Path("/proc/self/status").read_text().splitlines()
    mask = int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    assert reference_build.stat().st_mode & 0o777 == 0o777 & ~mask
    files = list(reference_build.iterdir())
    assert {"model.safetensors", default_model._COMPLETE_STAMP} <= {path.name for path in files}
    assert {path.name: path.stat().st_mode & 0o777 for path in files} == {path.name: 0o666 & ~mask for path in files}


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(),
                    reason="acting as a second user needs root and setpriv")
def test_a_second_user_of_a_shared_home_can_take_the_first_users_lock():
    """A home shared by a team (here sticky and world-writable, like /tmp): the first user's run left the build's
    lock file with the modes its umask 022 gave, 0644, and a second user's first run opened it for writing:
    "unexpected PermissionError: ... .lock". The lock is only flock'd, so it is opened read-only."""
    import shutil
    import subprocess
    import sys
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="twincache-shared-home-"))  # under /tmp: pytest's tmp_path is root-only
    try:
        shared.chmod(0o1777)
        lock = shared / f".tiny-mistral-v{default_model.BUILD_VERSION}-seed{default_model.DEFAULT_SEED}.lock"
        lock.touch()
        lock.chmod(0o644)  # the first user's, as umask 022 left it
        env = {"PATH": os.environ["PATH"], "HOME": str(shared), "TWINCACHE_HOME": str(shared),
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        as_second_user = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
        starts = subprocess.run([*as_second_user, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
        if starts.returncode != 0:  # e.g. pyenv's shared-library build under /root, unreadable to that user
            pytest.skip(f"this interpreter cannot start as uid 65534: {starts.stderr.strip()[-200:]}")
        second_user = subprocess.run(
            [*as_second_user, "-c", "from twincache import default_model; print(default_model.tiny_model_dir())"],
            env=env, capture_output=True, text=True, timeout=120)
        assert second_user.returncode == 0, second_user.stderr[-2000:]
        built = Path(second_user.stdout.strip())
        assert built.parent == shared and default_model.is_complete(built)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_home_given_with_a_tilde_is_under_the_users_home(tmp_path, monkeypatch):
    """TWINCACHE_HOME='~/models', quoted where no shell expands it, was a relative path: a directory named "~" in
    each working directory, each with its own build."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TWINCACHE_HOME", "~/models")
    monkeypatch.chdir(tmp_path / "..")
    assert default_model.cache_root() == tmp_path / "models"


@pytest.mark.parametrize("damage", ["weights_truncated", "tokenizer_removed", "config_grown",
                                    "stamp_of_an_older_build", "config_edited_same_size",
                                    "weights_header_same_size", "stamp_without_digests"])
def test_a_complete_build_damaged_afterwards_is_rebuilt(tmp_path, monkeypatch, caplog, reference_build, damage: str):
    """A finished build whose files changed since (a disk that filled up while copying a home, a user's edit) is
    rebuilt on the next run, not loaded into "model.safetensors is truncated ... re-download or re-save the
    checkpoint", advice that fits no file twincache built itself. So is a stamp without the build's file list, and
    edits that keep every size (the loader said "checkpoint ... is missing tensor ..." or "... is corrupted or
    truncated: header claims ...", with no advice at all), and a stamp from before its lines held digests."""
    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    final = default_model.tiny_model_dir()
    stamp = final / default_model._COMPLETE_STAMP
    weights = final / "model.safetensors"
    if damage == "weights_truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "tokenizer_removed":
        (final / "tokenizer.json").unlink()
    elif damage == "config_grown":
        (final / "config.json").write_text((final / "config.json").read_text() + " ")
    elif damage == "config_edited_same_size":
        config = (final / "config.json").read_text()
        edited = config.replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
        assert len(edited) == len(config) and edited != config
        (final / "config.json").write_text(edited)
    elif damage == "weights_header_same_size":
        weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    elif damage == "stamp_without_digests":
        stamp.write_text("".join(line.rsplit(" ", 1)[0] + "\n" if line.startswith("file ") else line + "\n"
                                 for line in stamp.read_text().splitlines()))
    else:
        stamp.write_text(stamp.read_text().splitlines()[0] + "\n")
    assert not default_model.is_complete(final)
    caplog.set_level(logging.INFO, logger="twincache")
    assert default_model.tiny_model_dir() == final
    _assert_good_default_model(tmp_path, reference_build)
    assert default_model.is_complete(final)
    # the notice said "(first use only)" of a rebuild that drops the user's edits
    assert [record.getMessage() for record in caplog.records] == [
        f"building the tiny model into {final} again: the build there is incomplete or its files changed since it "
        "was built (edits there are lost; give another window with --sliding-window N)..."]


# --- 4. non-finite logits stop generation -----------------------------------------------------------------------------


def test_non_finite_logits_at_prefill_stop_before_any_token(checkpoints, tmp_path):
    model_dir = copy_checkpoint(checkpoints["gqa"], tmp_path / "inf_head")
    rewrite_tensors(model_dir, lambda t: t["lm_head.weight"].__setitem__((7,), float("inf")))
    seen: list[list[int]] = []
    with pytest.raises(NonFiniteLogitsError, match="NaN or Inf logits at generated token 0"):
        generate(Mistral.from_pretrained(model_dir), PROMPTS, 10, compile=False, on_token=seen.append)
    assert seen == []


def test_non_finite_logits_mid_generation_stop_without_garbage_tokens(checkpoints, tmp_path):
    """Poison the embedding of the token greedy decoding emits at step k: step k+1 sees NaN and must stop there,
    after streaming exactly the k+1 clean tokens."""
    prompt = [[1, 5, 9, 13]]
    clean = generate(Mistral.from_pretrained(checkpoints["gqa"]), prompt, 16, compile=False).token_ids[0]
    k = next(i for i in range(2, len(clean)) if clean[i] not in prompt[0] + clean[:i])
    model_dir = copy_checkpoint(checkpoints["gqa"], tmp_path / "nan_embedding")
    rewrite_tensors(model_dir, lambda t: t["model.embed_tokens.weight"].__setitem__((clean[k],), float("nan")))
    seen: list[list[int]] = []
    with pytest.raises(NonFiniteLogitsError, match=f"NaN or Inf logits at generated token {k + 1};"):
        generate(Mistral.from_pretrained(model_dir), prompt, 16, compile=False, on_token=seen.append)
    assert [row[0] for row in seen] == clean[:k + 1]


def test_concurrent_first_runs_share_one_complete_default_model(tmp_path, monkeypatch):
    """Racing first runs all get one complete directory: none deletes another's finished build while it is read.

    Six threads start 0.1 s apart and each build step is slowed down (standing for a loaded machine), so later runs
    look for the model while an earlier one is still building it and again after it has finished."""
    import threading

    from twincache import default_model
    from twincache.tokenizer import Tokenizer

    monkeypatch.setenv("TWINCACHE_HOME", str(tmp_path))
    real_cleanup = default_model._remove_stale_builds

    def slow_cleanup(*args: object, **kwargs: object) -> None:
        time.sleep(0.3)
        real_cleanup(*args, **kwargs)

    monkeypatch.setattr(default_model, "_remove_stale_builds", slow_cleanup)
    errors, dirs = [], set()

    def first_run(delay: float) -> None:
        time.sleep(delay)
        try:
            built = default_model.tiny_model_dir()
            for _ in range(20):  # keep reading while slower threads finish: a deleted build would fail here
                Tokenizer.from_checkpoint(built)
                time.sleep(0.02)
            dirs.add(built)
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=first_run, args=(0.1 * i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(dirs) == 1
    assert {p.name for p in dirs.pop().iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not list(tmp_path.glob(".building-*")), "a staging directory was left behind"
