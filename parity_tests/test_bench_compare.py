"""`twincache bench --compare OLD NEW` (bench/compare.py): which scale each verdict reads, refusals of runs that do
not compare, and the CLI on the committed runs. Records are written by hand in results.json's form, so every
expected ratio and verdict is worked out here, not by the code under test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import compare
from twincache.errors import InputError
from twincache_app.cli import main

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def decode(impl: str, tok_s: float, low: float, high: float, limit: float = 30.0, cache: str = "static",
           **fields: object) -> dict:
    bytes_per_step = 1e8
    return {"kind": "decode", "preset": "small", "params": 1000, "dtype": "float32", "sliding_window": 8,
            "impl": impl, "cache": cache, "prompt_len": 10, "new_tokens": 5, "batch": 1, "status": "ok",
            "decode_tok_s": tok_s, "decode_tok_s_min": low, "decode_tok_s_max": high, "repeats": 3,
            "roofline_frac": tok_s * bytes_per_step / 1e9 / limit, "limit_gbps": limit,
            "machine": {"git_commit": "abc1234", "cpu": "test CPU"}, **fields}


def rows(result: dict) -> dict[str, dict]:
    return {row["impl"]: row for row in result["decode"]}


def test_a_reference_in_both_runs_takes_the_machines_drift_out_of_the_verdict():
    old = [decode("transformers", 100, 99, 101), decode("torch_compiled", 200, 195, 205),
           decode("jax_fused", 200, 195, 205), decode("torch_eager", 100, 98, 102)]
    # The machine is 10% faster in NEW (transformers' own cell), with limits within the tolerance.
    new = [decode("transformers", 110, 109, 111, limit=31), decode("torch_compiled", 220, 215, 225, limit=31),
           decode("jax_fused", 260, 255, 265, limit=31), decode("torch_eager", 90, 88, 92, limit=31)]
    got = rows(compare.compare(old, new))
    # torch_compiled moved with the machine: x tf [195/101, 205/99] = [1.93, 2.07] then [215/111, 225/109] =
    # [1.94, 2.06], overlapping, though its tok/s spreads [195, 205] and [215, 225] do not.
    assert got["torch_compiled"]["verdict"] == "within spread"
    assert got["torch_compiled"]["judged_on"] == "x transformers"
    assert got["torch_compiled"]["tok_s_change"] == pytest.approx(1.1)
    assert got["torch_compiled"]["old_x_ref"] == pytest.approx(2.0) and got["torch_compiled"]["new_x_ref"] == 2.0
    assert got["jax_fused"]["verdict"] == "faster"  # x tf [2.30, 2.43] past [1.93, 2.07]
    assert got["torch_eager"]["verdict"] == "slower"  # [88/111, 92/109] = [0.79, 0.84] under [0.97, 1.03]
    # The reference itself has no control: its tok/s, on one machine.
    assert got["transformers"]["judged_on"] == "tok/s" and got["transformers"]["verdict"] == "faster"


def test_a_noisy_reference_widens_the_spread_rather_than_inventing_a_change():
    # 200 [198, 202] -> 220 [218, 222] beside a reference of 100 [90, 110] in both runs: over the reference's median
    # it would read [1.98, 2.02] -> [2.18, 2.22], "faster"; widened by the reference's own spread it is [1.80, 2.24]
    # -> [1.98, 2.47], which overlap.
    old = [decode("transformers", 100, 90, 110), decode("torch_compiled", 200, 198, 202)]
    new = [decode("transformers", 100, 90, 110), decode("torch_compiled", 220, 218, 222)]
    assert rows(compare.compare(old, new))["torch_compiled"]["verdict"] == "within spread"


def test_another_transformers_version_is_flagged():
    machine = {"git_commit": "abc1234", "cpu": "test CPU", "transformers": "5.24.0"}
    old = [decode("transformers", 100, 99, 101, machine=machine)]
    new = [decode("transformers", 100, 99, 101, machine={**machine, "transformers": "5.25.0"})]
    text = compare.markdown(compare.compare(old, new), Path("a"), Path("b"))
    assert "**transformers differs** (5.24.0 in OLD, 5.25.0 in NEW)" in text
    assert "transformers differs" not in compare.markdown(compare.compare(old, old), Path("a"), Path("b"))


def test_a_run_on_a_shared_machine_is_flagged():
    machine = {"git_commit": "abc1234", "cpu": "test CPU", "device": "cpu", "cpu_cores": 2,
               "others_cpu_per_wall": 0.02}
    old = [decode("transformers", 100, 99, 101, machine=machine, others_cpu_per_wall=0.01)]
    new = [decode("transformers", 80, 60, 90, machine={**machine, "others_cpu_per_wall": 0.9},
                  others_cpu_per_wall=1.1)]
    text = compare.markdown(compare.compare(old, new), Path("a"), Path("b"))
    assert "**NEW ran on a shared machine:** other processes used 0.90 of 2 cores" in text, text
    assert "OLD ran on a shared machine" not in text
    assert "shared machine" not in compare.markdown(compare.compare(old, old), Path("a"), Path("b"))


def test_the_eager_reference_serves_when_the_compiled_one_is_missing():
    old = [decode("transformers_eager", 50, 49, 51), decode("torch_compiled", 100, 99, 101)]
    new = [decode("transformers_eager", 50, 49, 51), decode("torch_compiled", 100, 99, 101),
           decode("transformers", 70, 69, 71)]
    got = compare.compare(old, new)
    assert rows(got)["torch_compiled"]["judged_on"] == "x transformers_eager"
    only_new = rows(got)["transformers"]
    assert only_new["old_status"] == "absent" and only_new["new_status"] == "ok" and "verdict" not in only_new


def test_without_a_reference_differing_limits_judge_the_roofline_fraction():
    old = [decode("torch_compiled", 100, 98, 102, limit=30)]
    twice_the_bandwidth = [decode("torch_compiled", 200, 196, 204, limit=60)]
    row = rows(compare.compare(old, twice_the_bandwidth))["torch_compiled"]
    assert row["judged_on"] == "roofline" and row["verdict"] == "within spread"
    assert row["tok_s_change"] == pytest.approx(2.0)
    assert row["old_roofline"] == pytest.approx(row["new_roofline"])
    # Limits 5% apart are one machine: tok/s decide, and 200 [196, 204] beats 100 [98, 102].
    same = [decode("torch_compiled", 200, 196, 204, limit=31.5)]
    row = rows(compare.compare(old, same))["torch_compiled"]
    assert row["judged_on"] == "tok/s" and row["verdict"] == "faster"


def test_spreads_that_touch_are_within_spread():
    assert compare.verdict((98, 102), (102, 110)) == "within spread"
    assert compare.verdict((98, 102), (102.01, 110)) == "faster"
    assert compare.verdict((98, 102), (90, 97.99)) == "slower"
    assert compare.same_machine(30.0, 33.0) and not compare.same_machine(30.0, 33.4)


def test_a_cell_timed_once_gets_no_verdict():
    """`bench --repeats 1` twice: each cell's min-max is one point, so a 0.5% change read "faster" (spreads that do
    not overlap), and every cell of two such runs was faster or slower."""
    old = [decode("transformers", 100, 100, 100, repeats=1), decode("torch_eager", 200, 200, 200, repeats=1),
           decode("jax_step", 300, 290, 310, tok_s_runs=[290, 300, 310])]
    new = [decode("transformers", 100, 100, 100, repeats=1), decode("torch_eager", 201, 201, 201, repeats=1),
           decode("jax_step", 400, 390, 410, tok_s_runs=[390, 400, 410])]
    result = compare.compare(old, new)
    got = rows(result)
    assert got["torch_eager"]["verdict"] == got["transformers"]["verdict"] == "no verdict: one timed run"
    assert got["jax_step"]["verdict"] == "faster"  # three runs each, spreads apart
    assert "0 slower, 0 within spread, 2 timed once in a run (no spread, so no verdict" in compare.markdown(
        result, Path("old"), Path("new"))


def test_a_failed_cell_is_listed_and_not_counted():
    old = [decode("torch_compiled", 100, 99, 101), decode("jax_step", 80, 79, 81)]
    new = [decode("torch_compiled", 100, 99, 101), {**decode("jax_step", 0, 0, 0), "status": "error"}]
    result = compare.compare(old, new)
    assert rows(result)["jax_step"] == {"impl": "jax_step", "cache": "static", "old_status": "ok",
                                        "new_status": "error"}
    text = compare.markdown(result, Path("a"), Path("b"))
    assert "0 faster, 0 slower, 1 within spread, of 1 cells" in text
    assert "| jax_step | static | ok | error |" in text


def test_cells_a_run_could_not_measure_compare_as_the_runner_records_them(tmp_path):
    """An unavailable decode cell (impl and cache only: no lengths) and a skipped curve point (no context), as
    bench/runner.py writes them, neither refuse the run nor count as another workload."""
    skipped_point = {**decode("jax_step", 0, 0, 0), "kind": "latency_vs_context", "status": "skipped",
                     "prompt_len": 64}
    skipped_point.pop("context", None)
    unavailable = {**decode("jax_fused", 0, 0, 0), "status": "unavailable", "prompt_len": None, "new_tokens": None}
    (tmp_path / "partial.json").write_text(json.dumps([decode("torch_compiled", 100, 99, 101), unavailable,
                                                       skipped_point]))
    partial = compare.load_run(tmp_path / "partial.json")
    got = rows(compare.compare([decode("torch_compiled", 100, 99, 101), decode("jax_fused", 90, 89, 91)], partial))
    assert got["torch_compiled"]["verdict"] == "within spread"
    assert got["jax_fused"] == {"impl": "jax_fused", "cache": "static", "old_status": "ok",
                                "new_status": "unavailable"}


@pytest.mark.parametrize(("change", "message"), [
    ({"status": None}, "a decode record has no valid status (a string for status, impl, cache, else an integer)"),
    ({"impl": ["torch_compiled"]}, "a decode record has no valid impl"),
    ({"prompt_len": True}, "a decode record has no valid prompt_len"),
    ({"decode_tok_s": float("inf")}, "a decode record of torch_compiled / static has no positive decode_tok_s"),
    ({"decode_tok_s_max": "fast"}, "a decode record of torch_compiled / static has no positive decode_tok_s_max"),
])
def test_records_that_lie_are_refused_in_one_line(tmp_path, change, message):
    (tmp_path / "lies.json").write_text(json.dumps([{**decode("torch_compiled", 100, 99, 101), **change}]))
    with pytest.raises(InputError, match=re.escape(message)):
        compare.load_run(tmp_path / "lies.json")


def test_a_run_without_its_machine_still_compares(tmp_path):
    """results.json whose records have no `machine` object (an older or hand-edited run) was "unexpected KeyError:
    'machine'", or AttributeError for a string there: nothing to flag as a shared machine, and the header's commit and
    versions read None."""
    (tmp_path / "bare.json").write_text(json.dumps([{**decode("torch_compiled", 100, 99, 101), "machine": "edited"},
                                                    decode("transformers", 50, 49, 51)]))
    for bare in (compare.load_run(tmp_path / "bare.json"),
                 [{k: v for k, v in r.items() if k != "machine"} for r in compare.load_run(tmp_path / "bare.json")]):
        result = compare.compare(bare, [decode("torch_compiled", 100, 99, 101), decode("transformers", 50, 49, 51)])
        assert result["old"]["shared_machine"] is None and result["old"]["commit"] is None
        assert rows(result)["torch_compiled"]["verdict"] == "within spread"
        assert "commit None" in compare.markdown(result, tmp_path, tmp_path)


def test_curves_and_batch_points_compare_where_both_runs_measured():
    def point(impl: str, context: int, ms: float) -> dict:
        return {**decode(impl, 1000 / ms, 0, 0), "kind": "latency_vs_context", "context": context,
                "ms_per_token": ms}

    old = [point("jax_step", 8, 1.0), point("jax_step", 64, 2.0), point("jax_step", 512, 9.0),
           size("jax_fused", 1, 100.0), size("jax_fused", 8, 400.0)]
    new = [point("jax_step", 8, 1.0), point("jax_step", 64, 1.0), size("jax_fused", 8, 600.0)]
    result = compare.compare(old, new)
    [curve] = result["latency_vs_context"]
    assert curve["contexts"] == [8, 64]  # 512 only in OLD
    assert curve["old_first_over_last"] == 0.5 and curve["new_first_over_last"] == 1.0
    assert curve["median_ms_change"] == pytest.approx(0.75)  # median of 1.0 / 1.0 and 1.0 / 2.0
    [point] = result["batch"]
    assert {k: point[k] for k in ("impl", "batch", "old_tok_s", "new_tok_s", "tok_s_change")} == {
        "impl": "jax_fused", "batch": 8, "old_tok_s": 400.0, "new_tok_s": 600.0, "tok_s_change": 1.5}


def size(impl: str, batch: int, total: float, low: float | None = None, high: float | None = None,
         limit: float = 30.0) -> dict:
    """A batch point as the runner records it: median total tok/s [min–max] over 3 runs; without low and high, as a
    run before the batch table was repeated recorded it (one run: no min, max or repeats)."""
    record = {**decode(impl, total / batch, total / batch, total / batch, limit=limit), "kind": "batch",
              "batch": batch, "total_tok_s": total}
    for field in ("decode_tok_s_min", "decode_tok_s_max", "repeats"):
        del record[field]
    if low is not None and high is not None:
        record.update(total_tok_s_min=low, total_tok_s_max=high, repeats=3, tok_s_runs=[low / batch, total / batch,
                                                                                        high / batch])
    return record


def test_batch_points_get_the_decode_tables_verdicts_where_both_runs_have_spreads():
    """Issue 13 §2 reads torch_compiled against jax_fused at batch 8-32, and the batch table timed one run a point:
    compare said "no verdict" for every point. With repeats, a point is judged as a decode cell: on its ratio to the
    reference's point at the same batch size, each spread widened by the reference's."""
    # The machine is 10% faster in NEW: transformers_eager 100 [95, 105] -> 110 [105, 115] at batch 8.
    old = [size("transformers_eager", 8, 100, 95, 105), size("torch_compiled", 8, 800, 780, 820),
           size("jax_fused", 8, 800, 790, 810), size("torch_eager", 8, 300, 290, 310),
           size("torch_compiled", 16, 1200), size("jax_fused", 4, 400, 390, 410)]
    new = [size("transformers_eager", 8, 110, 105, 115), size("torch_compiled", 8, 900, 870, 930),
           size("jax_fused", 8, 1000, 990, 1010), size("torch_eager", 8, 250, 240, 260),
           size("torch_compiled", 16, 1300, 1290, 1310), size("jax_fused", 4, 500, 495, 505)]
    result = compare.compare(old, new)
    got = {(p["impl"], p["batch"]): p for p in result["batch"]}
    # x tf-eager [780/105, 820/95] = [7.43, 8.63] then [870/115, 930/105] = [7.57, 8.86]: overlapping, though the
    # medians' ratio moved 8.0 -> 8.18 and the tok/s spreads [780, 820] and [870, 930] do not overlap.
    compiled = got["torch_compiled", 8]
    assert compiled["judged_on"] == "x transformers_eager" and compiled["verdict"] == "within spread"
    assert compiled["old_x_ref"] == pytest.approx(8.0) and compiled["new_x_ref"] == pytest.approx(900 / 110)
    assert compiled["old_span"] == [780, 820] and compiled["new_span"] == [870, 930]
    assert got["jax_fused", 8]["verdict"] == "faster"  # [7.52, 8.53] -> [8.61, 9.62]
    assert got["torch_eager", 8]["verdict"] == "slower"  # [2.76, 3.26] -> [2.09, 2.48]
    # The reference itself, on tok/s: [95, 105] and [105, 115] touch.
    assert got["transformers_eager", 8]["judged_on"] == "tok/s"
    assert got["transformers_eager", 8]["verdict"] == "within spread"
    # No reference at batch 4, limits within the tolerance: tok/s, [390, 410] -> [495, 505].
    assert got["jax_fused", 4]["judged_on"] == "tok/s" and got["jax_fused", 4]["verdict"] == "faster"
    # OLD's batch 16 was timed once (a run before repeats): its spread is its value, and there is no verdict.
    assert got["torch_compiled", 16]["old_span"] == [1200, 1200]
    assert got["torch_compiled", 16]["verdict"] == "no verdict: one timed run"
    text = compare.markdown(result, Path("old"), Path("new"))
    assert ("2 faster, 1 slower, 2 within spread, 1 timed once in a run (a run before the batch table was "
            "repeated, or --repeats 1: no spread, so no verdict), of 6 points") in text, text
    assert ("| torch_compiled | 8 | 800.0 [780.0–820.0] | 900.0 [870.0–930.0] | 1.12 | 33% → 38% | 8.00 → 8.18 "
            "(x tf-eager) | within spread (x tf-eager) |") in text, text
    # Limits 2x apart, no reference: each run's roofline fraction, on which [390, 410] / 30 -> [495, 505] / 60 is
    # slower; on tok/s it would be faster.
    doubled = [{**record, "limit_gbps": 60.0} for record in new]
    point = next(p for p in compare.compare(old, doubled)["batch"] if (p["impl"], p["batch"]) == ("jax_fused", 4))
    assert point["judged_on"] == "roofline" and point["verdict"] == "slower"


def test_a_batch_point_whose_spread_is_not_a_positive_number_is_refused(tmp_path):
    (tmp_path / "lies.json").write_text(json.dumps([size("jax_fused", 8, 800, 0, 810)]))
    with pytest.raises(InputError, match="a batch record of jax_fused / static has no positive total_tok_s_min"):
        compare.load_run(tmp_path / "lies.json")
    (tmp_path / "old.json").write_text(json.dumps([size("jax_fused", 8, 800)]))  # before repeats: neither field
    assert compare.load_run(tmp_path / "old.json")[0]["total_tok_s"] == 800


@pytest.mark.parametrize(("field", "value", "message"), [
    ("preset", "long", "preset is 'small' in OLD and 'long' in NEW"),
    ("params", 2000, "params is 1000 in OLD and 2000 in NEW"),
    ("dtype", "bfloat16", "dtype is 'float32' in OLD and 'bfloat16' in NEW"),
    ("prompt_len", 300, "prompt + new tokens 10 + 5 in OLD, 300 + 5 in NEW"),
])
def test_runs_of_other_workloads_are_refused(field, value, message):
    with pytest.raises(InputError, match=message.replace("+", r"\+")):
        compare.compare([decode("torch_compiled", 1, 1, 1)], [decode("torch_compiled", 1, 1, 1, **{field: value})])


def test_cli_on_the_committed_runs_of_the_bf16_embedding_change(capsys, tmp_path):
    """bench/results/trained-bf16 and trained-bf16-embedding-fp32: a change to JAX's bf16 embedding only, on a
    machine 7% faster (transformers_eager's cells): JAX faster, torch within spread."""
    old, new = RESULTS / "trained-bf16", RESULTS / "trained-bf16-embedding-fp32"
    assert main(["bench", "--compare", str(old), str(new / "results.json"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# twincache bench --compare: preset `trained-bf16`")
    assert (tmp_path / "compare.md").read_text() == out
    verdicts = {(row["impl"], row["cache"]): row.get("verdict")
                for row in json.loads((tmp_path / "compare.json").read_text())["decode"]}
    for cache in ("static", "sliding_window"):
        assert verdicts["jax_fused", cache] == verdicts["jax_step", cache] == "faster"
        assert verdicts["torch_compiled", cache] == verdicts["torch_eager", cache] == "within spread"
        assert verdicts["transformers", cache] is None  # only OLD ran it


def test_a_run_compared_with_itself_has_no_change(capsys):
    assert main(["bench", "--compare", str(RESULTS / "small"), str(RESULTS / "small")]) == 0
    out = capsys.readouterr().out
    assert "0 faster, 0 slower, 12 within spread, of 12 cells" in out
    assert "## Per-token latency vs context" in out and "## Total tok/s vs batch" in out
    result = compare.compare(*(compare.load_run(RESULTS / "small") for _ in range(2)))
    assert {row["tok_s_change"] for row in result["decode"]} == {1.0}
    assert {c["median_ms_change"] for c in result["latency_vs_context"]} == {1.0}


def test_cli_refuses_what_it_cannot_compare_in_one_line(capsys, tmp_path):
    (tmp_path / "notes.json").write_text("{not json")
    edited = json.loads((RESULTS / "small" / "results.json").read_text())
    next(r for r in edited if r["kind"] == "decode").pop("decode_tok_s_min")
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    cases = [
        ([str(tmp_path / "missing"), str(RESULTS / "small")], "no such file"),
        ([str(tmp_path), str(RESULTS / "small")], "no results.json in that directory"),
        ([str(tmp_path / "notes.json"), str(RESULTS / "small")], "not a JSON file"),
        ([str(RESULTS / "prefill_memory" / "tiny_preset" / "prefill_memory.json"), str(RESULTS / "small")],
         "not a bench results.json"),
        ([str(RESULTS / "small"), str(RESULTS / "long")], "preset is 'small' in OLD and 'long' in NEW"),
        ([str(RESULTS / "small"), str(tmp_path / "edited.json")],
         "a decode record of torch_eager / static has no positive decode_tok_s_min"),
    ]
    for paths, message in cases:
        assert main(["bench", "--compare", *paths]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert main(["bench", "--compare", str(RESULTS / "small"), str(RESULTS / "small"), "--prefill-memory"]) == 2
    assert "takes no --prefill-memory or --meshes" in capsys.readouterr().err
