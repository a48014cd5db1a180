"""A shortened `twincache soak`: several hundred compiled decode steps through many ring wraps on the tiny model.

It asserts the counts, never the time: no recompile after the first step, finite logits, the ring holding exactly the
last W positions, and RSS that does not grow (bounded loosely: allocator noise is a few MB, a per-step leak over
~300 steps of this model is far more). The full 10,000-step run is `twincache soak` (twincache_app/soak.py).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from twincache_app.cli import main
from twincache_app.soak import soak

MODES = [("torch", "compiled"), ("jax", "step")]  # each backend's streaming mode that compiles its decode step
STEPS = 320  # the tiny model's window is 32: about ten wraps
RSS_GROWTH_LIMIT_MB = 50.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("backend", "mode"), MODES)
def test_short_compiled_soak_has_no_recompiles_finite_logits_and_flat_rss(tiny_model_dir, backend: str, mode: str,
                                                                          monkeypatch):
    import importlib

    module = importlib.import_module(f"{backend}_cache.backend")
    results = []

    def keep(*args: object, **kwargs: object) -> object:  # the soak's own generation, kept for the checks below
        results.append(real_generate(*args, **kwargs))
        return results[-1]

    real_generate = module.generate
    monkeypatch.setattr(module, "generate", keep)
    record = soak(backend, steps=STEPS, model_dir=tiny_model_dir, prompt_len=16, mode=mode)
    # The record's own verdicts, judged here from the generation itself: every token decoded, and the ring holding
    # exactly the last 32 positions (the window) of the 16 + STEPS written.
    (result,) = results
    assert len(result.token_ids[0]) == STEPS + 1, "the prefill's token and one per step: no step failed"
    held = np.sort(np.asarray(result.cache.slot_positions)[0])
    np.testing.assert_array_equal(held, np.arange(16 + STEPS - 32, 16 + STEPS))
    assert int(result.cache.length) == 16 + STEPS
    assert record["steps"] == STEPS and record["mode"] == mode
    assert record["length"] == 16 + STEPS, "prompt + one column per decode step (16 is a whole JAX prompt bucket)"
    assert record["ring_wraps"] >= 10 and record["cache_len"] == record["window"] == 32
    assert record["decode_compiles"] <= 1  # the step compiled (or reused) once, at the first step
    assert record["recompiles"] == 0
    assert record["finite"] is True
    assert record["cache_ok"] is True
    assert record["rss_growth_mb"] < RSS_GROWTH_LIMIT_MB
    assert record["rss_peak_mb"] - record["rss_start_mb"] < RSS_GROWTH_LIMIT_MB
    assert record["ok"] is True


def test_a_planted_recompile_is_reported_by_the_soak(tiny_model_dir, monkeypatch):
    """The soak's compile count is the framework's (JAX's jitted executables). Planted: each step reads exactly its
    live slots (no attention buckets), a new static attend_len per step, as transformers #44609's Python-int length
    was: each of the 2 steps compiles the step (slot counts 17 and 18 of a 19-slot ring, reached nowhere else). The
    second compile comes before the first step's token reaches the soak (the step loop dispatches one ahead), which
    a count taken at that token missed."""
    import jax_cache.generate as jg

    read: list[int] = []

    def live_slots(length: int, num_new: int, cache_len: int) -> int:
        read.append(min(length + num_new, cache_len))
        return read[-1]

    monkeypatch.setattr(jg, "step_attend_len", live_slots)
    record = soak("jax", steps=2, model_dir=tiny_model_dir, prompt_len=16, mode="step")
    assert sorted(set(read[1:])) == [17, 18] and record["cache_len"] == 19, (read, record)  # read[0]: the prefill's
    assert record["decode_compiles"] == 2 and record["recompiles"] == 1, record
    assert record["ok"] is False and record["finite"] and record["cache_ok"]


def test_a_filling_ring_compiles_once_per_attention_bucket_and_is_ok(tiny_model_dir, monkeypatch):
    """A ring of more than 2 * ATTEND_BLOCK slots reads a shorter prefix while it fills (twincache/buckets.py): one
    compiled step per bucket reached is expected, not a recompile. Here a 77-slot ring (window 128, bounded by the
    soak's 16 + 60 + 1 columns) with 8-slot blocks: the steps filling slots 17-32 read 32 slots, the rest all 77."""
    import twincache.buckets

    monkeypatch.setattr(twincache.buckets, "ATTEND_BLOCK", 8)
    record = soak("jax", steps=60, model_dir=tiny_model_dir, prompt_len=16, mode="step", sliding_window=128)
    assert record["cache_len"] == 77 and record["decode_buckets"] == 2, record
    assert record["decode_compiles"] == 2 and record["recompiles"] == 0, record
    assert record["ok"] is True and record["cache_ok"], record


def _one_line(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_soak_subcommand_prints_one_json_record(tiny_model_dir, capsys):
    """Through the CLI: eager torch for the record's shape (nothing compiles there, so its recompile count says
    nothing), then JAX in float16, whose jitted step really is traced, for the counts."""
    code, out, err = _one_line(capsys, ["soak", "--steps", "80", "--mode", "eager", "--model", str(tiny_model_dir)])
    assert code == 0, err
    record = json.loads(out)
    assert record["backend"] == "torch" and record["steps"] == 80 and record["mode"] == "eager"
    assert record["finite"] and record["cache_ok"] and record["ok"]
    assert set(record) >= {"rss_start_mb", "rss_end_mb", "rss_growth_mb", "first_step_s", "decode_tok_s",
                           "recompiles"}
    assert record["decode_tok_s"] > 0
    # A soak shorter than the window: its ring holds prompt + steps + 1 slots (the capacity generate asks for), one
    # never written. One step is the first step, so no steady speed was measured.
    code, out, err = _one_line(capsys, ["soak", "--steps", "1", "--mode", "eager", "--model", str(tiny_model_dir)])
    assert code == 0, err
    record = json.loads(out)
    assert record["cache_len"] == 16 + 1 + 1 and record["length"] == 17 and record["cache_ok"] and record["ok"]
    assert record["decode_tok_s"] is None, record
    code, out, err = _one_line(capsys, ["soak", "--backend", "jax", "--steps", "80", "--model", str(tiny_model_dir),
                                        "--dtype", "float16"])  # every dtype generate takes
    assert code == 0, err
    record = json.loads(out)
    assert record["backend"] == "jax" and record["steps"] == 80 and record["mode"] == "step"
    assert record["dtype"] == "float16"
    assert record["recompiles"] == 0 and record["finite"] and record["cache_ok"] and record["ok"]


def test_ctrl_c_prints_the_record_of_the_steps_decoded_so_far(tiny_model_dir, capsys, monkeypatch):
    """A long soak stopped with Ctrl-C kept nothing it had measured: the CLI now prints the record so far (never ok)
    before its one line and exit 130. The interrupt comes from the RSS sampler's third call, at decode step 4's token
    (it samples every (100 - 1) // 20 = 4 steps): steps 1-3 were handed back whole."""
    import twincache_app.soak as soak_module

    calls = []

    def rss_then_interrupt() -> float:
        calls.append(1)
        if len(calls) == 3:  # before the load, at step 1, then at step 4
            raise KeyboardInterrupt
        return 100.0

    monkeypatch.setattr(soak_module, "_rss_mb", rss_then_interrupt)
    code, out, err = _one_line(capsys, ["soak", "--steps", "100", "--mode", "eager", "--model", str(tiny_model_dir)])
    assert code == 130 and err == "twincache: interrupted\n", err
    record = json.loads(out)
    assert record["interrupted"] is True and record["ok"] is False and record["cache_ok"] is False, record
    assert record["decoded_steps"] == 3 and record["steps"] == 100 and record["rss_start_mb"] == 100.0, record


def test_a_real_sigint_in_the_decode_prints_the_record_too(tiny_model_dir, tmp_path):
    """The CLI's own SIGINT handling ended the process at once, past the soak's record (the test above raises the
    interrupt in Python): a real process, sent SIGINT as its decode starts (phases' test hook), prints it too."""
    import os
    import subprocess

    from parity_tests.test_cli_bad_inputs import REPO, _entry_point
    from parity_tests.test_interrupts import children_start_with_sigint
    from twincache import phases

    env = dict(os.environ, TWINCACHE_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO), **{phases.ENV: "decode"})
    # started as a terminal starts it (SIGINT at its default): once in a full suite's run the child ignored SIGINT
    # (exit 0, no record of an interruption), as a child of a process that ignores it does
    with children_start_with_sigint():
        proc = subprocess.run(_entry_point() + ["soak", "--steps", "100", "--mode", "eager", "--model",
                                                str(tiny_model_dir)], env=env, capture_output=True, text=True,
                              timeout=120, cwd=REPO)
    assert proc.returncode == 130 and proc.stderr == "twincache: interrupted\n", proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    assert record["interrupted"] is True and record["ok"] is False and record["steps"] == 100, record


@pytest.mark.parametrize("argv, expected", [
    (["--steps", "0"], "--steps 0 (steps) must be >= 1"),
    (["--prompt-len", "0"], "--prompt-len 0 (prompt_len) must be >= 1"),
    (["--prompt-len", "2147483647"], "prompt_len=2147483647 + steps=10000 takes positions up to 2147493647"),
    (["--prompt-len", "2147473647", "--steps", "10000"], "past 2147483646, the last int32 position"),
    (["--steps", "3000000000"], "lower --prompt-len or --steps"),
    (["--no-window"], "has sliding_window=null"),
    (["--backend", "jax", "--jax-missing"], "the jax backend is unavailable: cannot import jax_cache"),
    (["--backend", "torch", "--mode", "step"], "--mode step is not a torch mode"),
])
def test_soak_refusals_are_one_line_exit_2(tiny_model_dir, checkpoints, capsys, monkeypatch, argv, expected):
    model = checkpoints["no_window"] if "--no-window" in argv else tiny_model_dir
    if "--jax-missing" in argv:
        monkeypatch.setitem(sys.modules, "jax_cache", None)  # `import jax_cache...` now raises ImportError
    argv = [a for a in argv if a not in ("--no-window", "--jax-missing")]
    code, out, err = _one_line(capsys, ["soak", "--model", str(model), *argv])
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "unexpected" not in err
    assert expected in lines[0], lines[0]


def test_soak_goes_past_max_position_embeddings_and_says_so(checkpoints, capsys):
    """`twincache soak` with its defaults decodes 10,000 steps, past the default model's 8192 positions, which
    generate refuses: the soak lifts the limit and records that it did. Here at scale: a checkpoint of 512 positions
    (window 8), a prompt of 500 and 30 steps; `generate` on the same refuses."""
    from torch_cache.generate import generate
    from torch_cache.model import Mistral
    from twincache.errors import InputError

    model_dir = checkpoints["gqa"]
    code, out, err = _one_line(capsys, ["soak", "--model", str(model_dir), "--mode", "eager", "--prompt-len", "500",
                                        "--steps", "30"])
    assert code == 0, err
    record = json.loads(out)
    assert record["past_max_position_embeddings"] is True and record["length"] == 530
    assert record["finite"] and record["cache_ok"] and record["ok"]
    with pytest.raises(InputError, match="max_position_embeddings=512"):
        generate(Mistral.from_pretrained(model_dir), [[1] * 500], 31, cache="sliding_window", compile=False)
    code, out, err = _one_line(capsys, ["soak", "--model", str(model_dir), "--mode", "eager", "--steps", "30"])
    assert code == 0 and json.loads(out)["past_max_position_embeddings"] is False, err
