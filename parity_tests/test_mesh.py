"""One model and one cache split over devices (docs/design.md §10), proved against the same model on one device.

JAX runs on 8 simulated CPU devices in a subprocess (parity_tests/mesh_jax_worker.py), so the rest of the suite keeps
one device; torch runs in 2 gloo processes (parity_tests/mesh_torch_worker.py). Both start together with the bench
mode and the command lines, once per module, and write what they saw; the tests below judge it: greedy tokens equal
to one device's and every decode step's logits within the project's parity rule (twincache_app.mesh_parity.judge:
sharded vs one device is a direct row of `twincache parity`, judged against transformers' fp32 distance from its
float64 self), each device's bytes read from its own shards, donation in place without a warning and no whole-cache
copy in the compiled HLO, one trace or compile per shape, the torch -> JAX-mesh handoff, and `parity --mesh` for
each backend. The checkpoints: GQA (8 query heads, 2 KV heads) and MQA (1 KV head, a vocabulary of 132 that model=8
cannot split, so its embed and head stay replicated there), window 8.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
import pytest

from parity_tests import background, trained_model
from parity_tests.conftest import nan_norm_checkpoint, save_hf_checkpoint
from twincache import cache_checks
from twincache.checkpoint import expected_tensor_shapes
from twincache.config import MistralConfig
from twincache.errors import InputError, MeshError
from twincache.generation import Batch, GenerationResult, SamplingParams
from twincache.mesh import MeshShape, keep_rows, pad_batch, pad_rows, parse_mesh, plan_shards
from twincache_app.parity import Oracle, Row

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = {"gqa": dict(seed=20, num_attention_heads=8),
               "mqa": dict(seed=21, num_attention_heads=8, num_key_value_heads=1, vocab_size=132)}


# --- the floor: which meshes work, and who holds what -----------------------------------------------------------------

def test_an_xla_option_is_added_once_and_never_over_the_users_setting(monkeypatch):
    """The CLI's simulated CPU devices and jax_cache's excess precision both go into XLA_FLAGS this way: appended to
    what is there, and not at all when XLA_FLAGS names the option already."""
    from twincache.xla_flags import add_xla_flag

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    add_xla_flag("xla_force_host_platform_device_count", 4)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    add_xla_flag("xla_force_host_platform_device_count", 8)  # set already: the first value stays
    add_xla_flag("xla_allow_excess_precision", "false")
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 --xla_allow_excess_precision=false"


def test_the_processes_tests_start_compile_xla_as_a_users_do():
    """conftest has this process's XLA skip LLVM's optimisations; the processes the tests start (the CLI, `twincache
    parity`, the mesh workers), which copy this environment, must not inherit that: they judge parity as users run."""
    from parity_tests.conftest import _USER_SET_IN_PROCESS_XLA_FLAG, IN_PROCESS_XLA_FLAG

    inherited = IN_PROCESS_XLA_FLAG in os.environ.get("XLA_FLAGS", "")
    assert inherited == _USER_SET_IN_PROCESS_XLA_FLAG, os.environ.get("XLA_FLAGS")


def test_parse_mesh_reads_both_axes_in_any_order_and_refuses_anything_else():
    assert parse_mesh("model=2") == MeshShape(data=1, model=2)
    assert parse_mesh("data=4, model=2") == MeshShape(data=4, model=2)
    for bad, fragment in (("model=0", "positive"), ("modl=2", "data=M or model=N"), ("model=2,model=4", "twice"),
                          ("model=x", "not an integer"), ("model", "data=M or model=N")):
        with pytest.raises(MeshError, match=fragment) as caught:
            parse_mesh(bad)
        # the flag is argparse's to name (--mesh, or the bench's --meshes): "argument --meshes: --mesh 'x'" misled
        assert "--mesh" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("heads", "kv_heads", "intermediate", "model", "numbers"), [
    (8, 2, 128, 3, ("model=3", "8 query heads")),
    (12, 4, 96, 6, ("model=6", "4 KV heads", "multiple")),  # 6 > 4 KV heads, and not a multiple of them
    (8, 8, 128, 4, ()),  # possible: 2 query and 2 KV heads per device
    (8, 8, 100, 8, ("model=8", "intermediate_size=100")),
    (16, 8, 128, 16, ()),  # possible: 16 > 8 KV heads, each on 2 devices
    (16, 8, 128, 32, ("model=32", "16 query heads")),
])
def test_an_impossible_mesh_is_refused_in_one_line_naming_the_numbers(heads, kv_heads, intermediate, model, numbers):
    config = MistralConfig(vocab_size=128, hidden_size=96, intermediate_size=intermediate, num_hidden_layers=1,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8)
    if not numbers:
        plan = plan_shards(config, MeshShape(model=model))
        assert plan.num_heads * model == heads and plan.num_kv_heads * min(kv_heads, model) == kv_heads
        return
    with pytest.raises(MeshError) as caught:
        plan_shards(config, MeshShape(model=model))
    message = str(caught.value)
    assert "\n" not in message and all(number in message for number in numbers), message


@pytest.mark.parametrize(("kv_heads", "model"), [(2, 2), (2, 4), (2, 8), (1, 8), (8, 4)])
def test_every_device_holds_the_kv_heads_its_query_heads_read(kv_heads, model):
    """Grouped-query attention reads KV head h // (heads / kv_heads) for query head h: a device's KV heads must be
    exactly those its query heads read (replicated within a group when there are fewer KV heads than devices)."""
    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=8)
    plan = plan_shards(config, MeshShape(model=model))
    group = 8 // kv_heads
    for rank in range(model):
        read = sorted({head // group for head in plan.q_heads(rank)})
        assert list(plan.kv_heads(rank)) == read, (rank, list(plan.q_heads(rank)), list(plan.kv_heads(rank)))
    assert sorted(h for rank in range(model) for h in plan.q_heads(rank)) == list(range(8)), "every head once"


def test_torch_gathers_the_split_vocabulary_along_dim_0_and_lays_it_side_by_side(monkeypatch):
    """torch 2.11's functional all-gather along any dim but 0 calls a helper dynamo will not trace
    (_maybe_view_chunk_cat), which broke every compiled decode on a torch mesh there (the GPU machine's torch):
    gather_logits gathers along dim 0 only, and must still give the ranks' vocabulary slices side by side, in rank
    order. A fake two-rank all-gather stands in for the process group."""
    import types

    import torch

    from torch_cache import sharding

    ranks = [torch.arange(12.0).reshape(2, 1, 6), 100 + torch.arange(12.0).reshape(2, 1, 6)]  # [B, S, V / 2] each
    gather_dims = []

    def all_gather(tensor: torch.Tensor, gather_dim: int, group: object) -> torch.Tensor:
        gather_dims.append(gather_dim)
        return torch.cat(ranks, dim=gather_dim)

    monkeypatch.setattr(sharding, "_all_gather", all_gather)
    parallel = object.__new__(sharding.TensorParallel)
    parallel.mesh, parallel.model_group, parallel.model_ways, parallel.data_ways = object(), None, 2, 1
    parallel.plan = types.SimpleNamespace(vocab_split=True)
    assert torch.equal(parallel.gather_logits(ranks[0]), torch.cat(ranks, dim=-1))  # [B, S, V]
    assert gather_dims == [0]


def test_a_batch_pads_to_the_data_axis_and_the_padding_rows_are_dropped():
    batch = Batch([[1, 2], [3]], np.array([[1, 2], [0, 3]]), np.array([[1, 1], [0, 1]]), SamplingParams(), 4,
                  prefill_chunk=3)
    seen = []
    padded, on_token = pad_batch(batch, 4, seen.append)
    assert padded.prompt_ids == [[1, 2], [3], [3], [3]] and padded.input_ids.tolist()[2:] == [[0, 3], [0, 3]]
    assert padded.prefill_chunk == 3, "the padded batch prefills in the chunks asked for"
    on_token([7, 8, 8, 8])
    assert seen == [[7, 8]], "a callback sees the real rows only"
    result = GenerationResult("static", 6, padded.prompt_ids, [[7], [8], [8], [8]], 0, 0, 0, 1, 0,
                              np.zeros((4, 1, 5)))
    kept = keep_rows(result, 2)
    assert kept.token_ids == [[7], [8]] and kept.prompt_ids == [[1, 2], [3]] and kept.step_logits.shape == (2, 1, 5)
    assert pad_batch(batch, 2, None) == (batch, None)
    forced = np.array([[4, 5], [6, 7]])  # [B, N] forced tokens follow their rows
    assert pad_rows(forced, 4).tolist() == [[4, 5], [6, 7], [6, 7], [6, 7]] and pad_rows(forced, 2) is not forced


def test_a_mesh_of_another_type_is_refused_in_one_line_by_both_towers(checkpoints):
    """`mesh=` given a string, a MeshShape (what backend.load takes), a list or the other tower's mesh: each tower read
    attributes from it and raised AttributeError "'str' object has no attribute 'axis_names'" (JAX) or "'Mesh'
    object has no attribute 'mesh_dim_names'" (torch), and torch's from_weights "... 'device_type'". Refused before
    anything is read, in one MeshError naming the type and how to build the tower's own. (In process, one device:
    ~0.1 s.)"""
    import jax.numpy as jnp
    import torch

    from jax_cache import sharding as jax_sharding
    from jax_cache.cache import StaticCache as JaxCache
    from jax_cache.model import Mistral as JaxMistral
    from torch_cache.cache import StaticCache as TorchCache
    from torch_cache.model import Mistral as TorchMistral

    path = checkpoints["gqa"]
    config = MistralConfig.from_json(path / "config.json")
    jax_mesh = jax_sharding.make_mesh()  # one device: a real jax Mesh with the twincache axes
    weights = {name: torch.zeros(shape) for name, shape in expected_tensor_shapes(config).items()}
    towers = {
        "jax": ([lambda mesh: JaxMistral.from_pretrained(path, jnp.float32, mesh=mesh),
                 lambda mesh: JaxCache(config, 2, 16, mesh=mesh)],
                ["model=2", MeshShape(model=2), [2, 1], torch.device("cpu")], "jax_cache.sharding.make_mesh(model=N"),
        "torch": ([lambda mesh: TorchMistral.from_pretrained(path, mesh=mesh),
                   lambda mesh: TorchMistral.from_weights(config, weights, mesh=mesh),
                   lambda mesh: TorchCache(config, 2, 16, mesh=mesh)],
                  ["model=2", MeshShape(model=2), [2, 1], jax_mesh], "torch_cache.sharding.make_mesh(model=N"),
    }
    for tower, (builders, meshes, how) in towers.items():
        for build in builders:
            for mesh in meshes:
                with pytest.raises(MeshError) as caught:
                    build(mesh)
                message = str(caught.value)
                assert message.startswith(f"mesh is a {type(mesh).__module__}.{type(mesh).__qualname__}"), message
                assert how in message and "\n" not in message, (tower, message)
    from torch_cache import sharding as torch_sharding

    for model, processes in ((1, "1 process,"), (2, "2 processes,")):  # outside a torch.distributed world
        with pytest.raises(MeshError, match=f"needs torch.distributed with {processes} and it is not initialised"):
            torch_sharding.make_mesh(model=model)


# --- the workers: JAX on 8 simulated devices and torch on 2 gloo processes, started together ----------------------

CLI_PROMPT = ["--prompt-ids", "1,5,9,3,7"]
TRAINED_PROMPT = trained_model.PROMPT
CLI_RUNS = {  # name -> (checkpoint, twincache arguments)
    "generate torch": ("gqa", ["generate", "--backend", "torch", "--mode", "eager", "--mesh", "model=2",
                               "--max-new-tokens", "12", "--json"]),
    "generate jax": ("gqa", ["generate", "--backend", "jax", "--mesh", "model=2,data=2", "--max-new-tokens", "12",
                             "--json"]),
    "parity jax": ("mqa", ["parity", "--modes", "jax:fused", "--mesh", "model=4,data=2", "--max-new-tokens", "10",
                           "--cache", "sliding_window", "--json"]),
    "parity torch": ("gqa", ["parity", "--modes", "torch:eager", "--mesh", "model=2", "--max-new-tokens", "6",
                             "--cache", "static", "--json"]),
    # The trained default model (SmolLM2-135M: 9 query heads, 3 KV heads, window 64) on model=3 and on one device,
    # from a prompt longer than the window: its ring has wrapped before the first decode step.
    "trained jax mesh": ("trained", ["generate", "--backend", "jax", "--mesh", "model=3", "--max-new-tokens", "12",
                                     "--json", "--prompt", TRAINED_PROMPT]),
    "trained jax": ("trained", ["generate", "--backend", "jax", "--max-new-tokens", "12", "--json", "--prompt",
                                TRAINED_PROMPT]),
}


@background.job
def mesh_runs(request: pytest.FixtureRequest) -> Callable[[], dict[str, object]]:
    """Builds the two checkpoints; its run starts both workers and the command lines below at once (independent
    processes: the 2 cores stay busy), and returns their records, logits and outputs."""
    root = request.getfixturevalue("tmp_path_factory").mktemp("mesh")
    trained_model_dir = request.getfixturevalue("trained_model_dir")
    dirs = {name: save_hf_checkpoint(root / name, **overrides) for name, overrides in CHECKPOINTS.items()}
    out = root / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # several processes share 2 cores (docs/design.md §7.11)
    jax_env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    paths = {**dirs, "trained": trained_model_dir}
    nan_norm = nan_norm_checkpoint(dirs["gqa"], root / "nan_norm")

    def run() -> dict[str, object]:
        with contextlib.ExitStack() as logs:  # each process's log files, closed once every process has ended

            def log(name: str) -> IO[str]:
                return logs.enter_context((root / name).open("w"))

            started = {"jax worker": subprocess.Popen(
                [sys.executable, "-m", "parity_tests.mesh_jax_worker", str(out), str(dirs["gqa"]), str(dirs["mqa"])],
                cwd=REPO, env=jax_env, stdout=subprocess.DEVNULL, stderr=log("jax worker.err"))}
            started["bench"] = subprocess.Popen(
                [sys.executable, "-m", "bench", "--preset", "tiny", "--model", str(dirs["gqa"]), "--meshes", "model=1",
                 "model=2", "--impls", "torch_eager,jax_fused", "--out", str(root / "bench"), "--cache-dir",
                 str(root)], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log("bench.err"))
            for name, (checkpoint, args) in CLI_RUNS.items():  # the CLI simulates JAX's CPU devices itself
                started[name] = subprocess.Popen(
                    [sys.executable, "-m", "twincache_app.cli", *args, "--model", str(paths[checkpoint]),
                     *([] if "--prompt" in args else CLI_PROMPT)],
                    cwd=REPO, env=env, stdout=log(f"{name}.out"), stderr=log(f"{name}.err"))
            started["bench refused"] = subprocess.Popen(  # a refusal only a run finds, inside torch's two ranks
                [sys.executable, "-m", "twincache_app.cli", "bench", "--preset", "tiny", "--model", str(nan_norm),
                 "--meshes", "model=2", "--impls", "torch_eager", "--out", str(root / "bench_refused")],
                cwd=REPO, env=env, stdout=log("bench refused.out"), stderr=log("bench refused.err"))
            # the two torch ranks, through twincache_app.launch.run_ranks in a process of their own (it waits on them)
            started["torch workers"] = subprocess.Popen(
                [sys.executable, "-c", _TORCH_WORKERS, str(out), str(dirs["gqa"]), str(dirs["mqa"])], cwd=REPO,
                env=env, stdout=subprocess.DEVNULL, stderr=log("torch workers.err"))
            codes = {name: proc.wait(timeout=900) for name, proc in started.items()}
        for name in ("jax worker", "bench", "torch workers"):
            assert codes[name] == 0, (name, (root / f"{name}.err").read_text()[-3000:])
        cli = {name: (codes[name], (root / f"{name}.out").read_text(), (root / f"{name}.err").read_text())
               for name in CLI_RUNS}
        cli["bench refused"] = (codes["bench refused"], (root / "bench refused.out").read_text(),
                                (root / "bench refused.err").read_text())
        return {"dirs": dirs, "out": out, "cli": cli, "jax": json.loads((out / "jax.json").read_text()),
                "bench": json.loads((root / "bench" / "mesh.json").read_text()),
                "bench_md": (root / "bench" / "mesh.md").read_text(),
                "jax_logits": dict(np.load(out / "jax_logits.npz")),
                "torch": [json.loads((out / f"torch_rank{r}.json").read_text()) for r in range(2)],
                "torch_logits": [dict(np.load(out / f"torch_rank{r}.npz")) for r in range(2)]}

    return run


_TORCH_WORKERS = """
import sys
from twincache_app.launch import run_ranks
sys.exit(run_ranks(sys.argv[1:], 2, module="parity_tests.mesh_torch_worker"))
"""


@pytest.fixture(scope="module")
def oracles(mesh_runs: dict[str, object]) -> Callable[[dict], tuple[Oracle, Oracle]]:
    """The float64 reference and the fp32 floor (transformers, uncached, row by row) over a case's prompts and the
    one-device run's tokens: what `twincache parity` judges a direct row against. Computed once per sequence."""
    from twincache_app.parity import floor_oracle, load_models

    models = {name: load_models(path, "float32", impls=()) for name, path in mesh_runs["dirs"].items()}
    done: dict[str, tuple[Oracle, Oracle]] = {}

    def of(case: dict) -> tuple[Oracle, Oracle]:
        key = json.dumps([case["checkpoint"], case["prompts"], case["reference_tokens"]])
        if key not in done:
            pair = models[case["checkpoint"]]
            done[key] = (floor_oracle(pair.reference, case["prompts"], case["reference_tokens"], "float64"),
                         floor_oracle(pair.floor, case["prompts"], case["reference_tokens"], "float32"))
        return done[key]

    return of


def judged(logits: dict[str, np.ndarray], index: int, case: dict, oracles: Callable) -> Row:
    """The parity rule's verdict on a case's step logits [8, steps, V], sharded against one device: a direct row of
    `twincache parity`, judged against the floor's distance from the float64 reference (mesh_parity.judge)."""
    from twincache_app.mesh_parity import judge

    sharded, single = logits[f"case{index}"], logits[f"case{index}_reference"]
    assert sharded.shape == single.shape and sharded.shape[0] == 8, (sharded.shape, single.shape)
    return judge(*oracles(case), single, sharded, "float32")


def label(case: dict) -> str:
    return f"{case['checkpoint']} {case['data']}x{case['model']} {case['cache']} {case['mode']}"


# --- JAX ------------------------------------------------------------------------------------------------------------

def test_jax_runs_on_eight_devices_and_covers_every_mesh_shape(mesh_runs):
    record = mesh_runs["jax"]
    assert record["devices"] == 8
    shapes = {(c["data"], c["model"]) for c in record["cases"]}
    assert shapes == {(1, 8), (2, 4), (8, 1)}
    assert {(c["checkpoint"], c["cache"], c["mode"]) for c in record["cases"]} >= {
        ("gqa", "static", "fused"), ("gqa", "sliding_window", "fused"), ("gqa", "sliding_window", "step"),
        ("mqa", "static", "fused"), ("mqa", "sliding_window", "step"), ("mqa", "static", "step")}


def test_jax_sharded_greedy_tokens_and_every_step_logits_equal_one_device(mesh_runs, oracles):
    """Free-running greedy decoding of a left-padded batch of 8 through rings that wrap: the same tokens, and at every
    step logits within the parity rule (the sequences are equal, so every step compares like with like)."""
    for index, case in enumerate(mesh_runs["jax"]["cases"]):
        assert case["tokens"] == case["reference_tokens"], label(case)
        row = judged(mesh_runs["jax_logits"], index, case, oracles)
        assert not row.failed, (label(case), row.failed, row.ratios, row.distance)


def test_jax_each_device_holds_its_share_of_the_cache_and_the_weights(mesh_runs):
    """Read from every device's addressable shards: K/V 1/(data x KV-head shards) each, slot_positions 1/data, the
    split weights 1/model (k/v_proj 1/min(KV heads, model)), embed and head 1/model where model divides the
    vocabulary, the rest whole."""
    record = mesh_runs["jax"]
    kv_heads = {"gqa": 2, "mqa": 1}
    for case in record["cases"]:
        data, model, kv = case["data"], case["model"], kv_heads[case["checkpoint"]]
        ways = {"keys": data * min(kv, model), "slot_positions": data, "length": 1}
        for name, measured in case["cache_bytes"].items():
            held = measured["per_device"]
            assert len(held) == 8 and set(held.values()) == {measured["nbytes"] // ways[name]}, (label(case), name,
                                                                                                  held)
    for key, weights in record["weights"].items():
        checkpoint, shape = key.split("@")
        data, model = map(int, shape.split("x"))
        kv, vocab = kv_heads[checkpoint], 132 if checkpoint == "mqa" else 128
        for name, measured in weights.items():
            module = name.split(".")[-2]
            ways = (model if module in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj") else
                    min(kv, model) if module in ("k_proj", "v_proj") else
                    (model if vocab % model == 0 else 1) if module in ("embed_tokens", "lm_head") else 1)
            held = measured["per_device"]
            assert len(held) == 8 and set(held.values()) == {measured["nbytes"] // ways}, (key, name, held)


def test_weights_are_checked_against_memory_before_loading_on_a_mesh(mesh_runs):
    """As on one device, a mesh's weights are checked before a byte is read: JAX's simulated devices all together
    (they share the host's memory), each torch rank its own slice. With the host reporting one byte less than the
    loaded weights were measured to hold (their shards' bytes), loading is refused, naming that figure; exactly
    that loads."""
    checks = [*mesh_runs["jax"]["weights_check"].values(),
              *(case["weights_check"] for rank in range(2) for case in mesh_runs["torch"][rank]["cases"])]
    assert len(checks) == 4 + 2 * 4
    for check in checks:
        assert check["refused"] is not None, check
        assert "loading its shares of the weights on the mesh" in check["refused"], check
        assert f"needs {cache_checks.format_bytes(check['held'])}" in check["refused"], check
        assert check["loaded_with_exactly_that"] is True, check


def test_jax_traces_and_compiles_once_per_shape(mesh_runs):
    """A generation compiles its decode loop once, and its prefill when no earlier case had that checkpoint, mesh and
    cache; another generation of the same shapes compiles nothing."""
    prefilled = set()
    for case in mesh_runs["jax"]["cases"]:
        before, first, second = case["variants"]
        shape = (case["checkpoint"], case["data"], case["model"], case["cache"])
        expected = 1 + (shape not in prefilled)
        prefilled.add(shape)
        assert (first - before, second - first) == (expected, 0), (label(case), case["variants"])


def test_jax_donation_keeps_every_shard_in_place_without_a_warning(mesh_runs):
    record = mesh_runs["jax"]
    stepped = [case for case in record["cases"] if case["mode"] == "step"]
    shown = ("checkpoint", "data", "model", "pointers_kept", "input_deleted")
    assert stepped and all(case["pointers_kept"] and case["input_deleted"] for case in stepped), \
        [{key: case[key] for key in shown} for case in stepped]
    assert not [w for w in record["warnings"] if "donat" in w.lower()], record["warnings"]
    kept = record["hlo"]["state_out_shardings_equal_in"]
    assert len(kept) >= 2 and all(kept), f"the step and every fused loop return their state as it came in: {kept}"


def hlo_outputs_of_shape(hlo: str, shape: list[int]) -> list[str]:
    """Instructions of an optimized HLO module whose result has this shape (any element type, any layout)."""
    pattern = re.compile(r"=\s*\w+\[" + ",".join(map(str, shape)) + r"\]")
    return [line.strip()[:160] for line in hlo.splitlines() if pattern.search(line)]


def test_jax_compiled_decode_holds_no_whole_cache_and_copies_no_shard(mesh_runs):
    """The partitioned programs (one per device) of the streaming step and every fused loop on the 2 x 4 mesh: no
    value of the whole cache's shape (a gathered cache), no copy of a device's K/V shard, and the fused loop's
    output aliases its donated cache."""
    hlo = mesh_runs["jax"]["hlo"]
    assert hlo["global_kv"] != hlo["local_kv"], "the K/V arrays must be split for this test to read anything"
    texts = [(mesh_runs["out"] / "step.hlo").read_text()]
    texts += [(mesh_runs["out"] / f"fused{i}.hlo").read_text() for i in range(hlo["fused"])]
    assert len(texts) >= 2 and all(" dynamic-update-slice(" in text or "scatter(" in text for text in texts)
    for text in texts:
        assert hlo_outputs_of_shape(text, hlo["global_kv"]) == []
        copies = [line for line in hlo_outputs_of_shape(text, hlo["local_kv"]) if " copy(" in line]
        assert copies == []
    cases = [c for c in mesh_runs["jax"]["cases"] if (c["checkpoint"], c["data"], c["model"]) == ("gqa", 2, 4)]
    shard_bytes = min(sum(next(iter(b["per_device"].values())) for b in c["cache_bytes"].values()) for c in cases)
    assert min(hlo["fused_alias_bytes"]) >= shard_bytes


def test_a_torch_cache_continues_on_a_jax_mesh(mesh_runs):
    handoff = mesh_runs["jax"]["handoff"]
    assert handoff["mesh"] == "model=4,data=2" and "model_kv" in handoff["cache_spec"]
    assert handoff["handed_over"] == handoff["torch_tokens"]
    # the cache back to torch through the host (no DLPack view of a split array): equal, and torch has no warning
    # that it was handed a read-only NumPy view
    assert handoff["back_to_torch_equal"] is True
    assert not [w for w in mesh_runs["jax"]["warnings"] if "not writable" in w], mesh_runs["jax"]["warnings"]


def test_jax_a_chunked_prefill_on_a_mesh_decodes_as_one_device_prefilling_at_once(mesh_runs, oracles):
    """Chunks of 4 columns through a ring of 8 on the 2 x 4 mesh, 3 rows padded to 4 for the data axis, in each mode:
    the greedy tokens of one device prefilling the whole prompt at once, and every step's logits within the parity
    rule against it (a direct row, as for the cases above)."""
    from twincache_app.mesh_parity import judge

    cases = mesh_runs["jax"]["chunked"]
    assert [case["mode"] for case in cases] == ["step", "fused"]
    single = mesh_runs["jax_logits"]["chunked_reference"]
    for case in cases:
        assert case["chunk"] < max(map(len, case["prompts"])) and len(case["prompts"]) == 3 and case["cache_rows"] == 4
        assert "data" in case["cache_spec"] and "model_kv" in case["cache_spec"], case["cache_spec"]
        assert case["tokens"] == case["reference_tokens"], label(case)
        sharded = mesh_runs["jax_logits"][f"chunked_{case['mode']}"]
        assert sharded.shape == single.shape and sharded.shape[0] == 3, (sharded.shape, single.shape)
        row = judge(*oracles(case), single, sharded, "float32")
        assert not row.failed, (label(case), row.failed, row.ratios, row.distance)


# --- torch ----------------------------------------------------------------------------------------------------------

def test_torch_sharded_greedy_tokens_and_every_step_logits_equal_one_device(mesh_runs, oracles):
    """On both ranks: the whole batch's tokens and logits, equal to one device's (eager and compiled)."""
    for rank in range(2):
        record = mesh_runs["torch"][rank]
        assert record["world"] == 2 and {(c["data"], c["model"]) for c in record["cases"]} == {(1, 2), (2, 1)}
        for index, case in enumerate(record["cases"]):
            assert case["tokens"] == case["reference_tokens"], (rank, label(case))
            row = judged(mesh_runs["torch_logits"][rank], index, case, oracles)
            assert not row.failed, (rank, label(case), row.failed, row.ratios, row.distance)


def expected_slice(name: str, shape: tuple[int, ...], rank: int, model: int, kv_heads: int) -> tuple[slice, ...]:
    """Megatron's split restated: the rows (or, for o/down_proj, columns) rank `rank` of `model` holds."""
    module = name.split(".")[-2]
    rows = shape[1] if module in ("o_proj", "down_proj") else shape[0]
    if module in ("k_proj", "v_proj") and kv_heads < model:
        group = rank // (model // kv_heads)  # the KV head its query heads read, whole
        part = slice(group * rows // kv_heads, (group + 1) * rows // kv_heads)
    elif module in ("input_layernorm", "post_attention_layernorm", "norm") or rows % model:
        part = slice(None)
    else:
        part = slice(rank * rows // model, (rank + 1) * rows // model)
    return (slice(None), part) if module in ("o_proj", "down_proj") else (part,)


def test_torch_a_chunked_prefill_on_a_mesh_decodes_as_one_device_prefilling_at_once(mesh_runs):
    """Chunks of 4 through a ring of 8 on model=2 and on data=2 (3 rows padded to 4): every rank ran the same chunks
    (a mismatch would hang or fail a collective) and decoded the greedy tokens of one device prefilling at once."""
    for rank_record in mesh_runs["torch"]:
        cases = rank_record["chunked"]
        assert {(case["data"], case["model"]) for case in cases} == {(1, 2), (2, 1)}
        for case in cases:
            assert case["chunk"] < max(map(len, case["prompts"])) and len(case["tokens"]) == 3
            assert case["tokens"] == case["reference_tokens"], (rank_record["rank"], case["data"], case["model"])


def test_torch_continues_a_batch_that_generate_padded_on_a_data_split(mesh_runs):
    """continue_generation from generate's result on data=2, 3 rows (the cache holds a 4th, padding copy): both ranks
    decode the real rows on, as one device generating the whole length (it was refused: batch 3 against 4)."""
    for rank_record in mesh_runs["torch"]:
        case = rank_record["continued"]
        assert len(case["tokens"]) == 3 and all(len(row) == 9 for row in case["tokens"])
        assert case["tokens"] == case["reference_tokens"], rank_record["rank"]


def test_a_sampled_row_ends_its_batch_though_its_padding_copy_would_draw_on(mesh_runs):
    """One sampled row on data=2 (padded with a copy of itself), whose config's EOS id is one the row emits at step k
    and its copy, drawing its own tokens, never does: the row ends at k and decoding stops there, in JAX's two modes
    and on both torch ranks (the copy kept every mode decoding the whole budget, its tokens dropped)."""
    records = [("jax", mesh_runs["jax"]["padded"])] + [(f"torch rank {r['rank']}", r["padded"])
                                                      for r in mesh_runs["torch"]]
    steps, expected = {}, {}
    for name, case in records:
        row, step = case["free"][0], case["eos_step"]
        assert 2 <= step < len(row) - 1, (name, step)  # the row ends before its budget
        for mode, tokens in case["tokens"].items():
            assert tokens == [row[:step + 1]], (name, mode)  # the free run's tokens up to and including EOS
            steps[f"{name} {mode}"], expected[f"{name} {mode}"] = case["decode_steps"][mode], step
    assert len(steps) == 4 and steps == expected


def test_torch_each_rank_holds_its_own_slice_of_the_weights_and_the_cache(mesh_runs):
    from safetensors.numpy import load_file

    full = {name: load_file(str(path / "model.safetensors")) for name, path in mesh_runs["dirs"].items()}
    for rank in range(2):
        for case in mesh_runs["torch"][rank]["cases"]:
            data, model, kv = case["data"], case["model"], {"gqa": 2, "mqa": 1}[case["checkpoint"]]
            shard = case["kv_shard"]
            assert shard["bytes"] == {"cpu": shard["whole_bytes"] // (data * min(kv, model))}, (rank, label(case))
            for name, held in case["weights"].items():
                whole = full[case["checkpoint"]][name]
                part = whole[expected_slice(name, whole.shape, rank % model, model, kv)]
                assert held["shape"] == list(part.shape), (rank, name, held["shape"], part.shape)
                assert held["sum"] == pytest.approx(float(part.astype(np.float64).sum()), rel=1e-9, abs=1e-9), name
                assert held["bytes"] == {"cpu": part.nbytes}, (rank, name)


def test_torch_compiled_decode_is_one_graph_that_never_recompiles_and_writes_in_place(mesh_runs):
    for rank in range(2):
        cases = mesh_runs["torch"][rank]["cases"]
        compiled = [case for case in cases if case["mode"] == "compiled"]
        assert compiled and all(case["graphs_first"] == 1 and case["recompiled"] is False for case in compiled)
        assert all(case["addresses_kept"] for case in cases), [label(c) for c in cases if not c["addresses_kept"]]


# --- the command line ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_cli_refuses_an_impossible_mesh_in_one_line_before_starting_anything(mesh_runs, backend, capsys):
    from twincache_app.cli import main

    code = main(["generate", "--backend", backend, "--mesh", "model=3", "--model", str(mesh_runs["dirs"]["gqa"]),
                 "--prompt-ids", "1,2,3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "model=3" in err and "8 query heads" in err, err


def test_cli_refuses_more_torch_ranks_than_cpu_cores_before_starting_any(checkpoints, capsys, monkeypatch):
    """On a CPU host torch starts one process per device: more than one per core is refused in one line naming the
    ranks and the cores (JAX's simulated devices share one process and are not capped). A mesh of as many ranks as
    cores starts them (the control: the cap is the cores, not fewer)."""
    import torch

    from twincache_app import launch
    from twincache_app.cli import main

    started: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU rule, on any host
    monkeypatch.setattr(launch, "cpu_cores", lambda: 2)
    monkeypatch.setattr(launch, "run_ranks", lambda argv, world_size, **kwargs: started.append(world_size) or 0)
    argv = ["generate", "--backend", "torch", "--model", str(checkpoints["gqa"]), "--prompt-ids", "1,2,3"]
    for mesh in ("model=2,data=2", "data=3"):
        assert main([*argv, "--mesh", mesh]) == 2
        err = capsys.readouterr().err
        ranks = parse_mesh(mesh).devices
        assert err.count("\n") == 1 and f"needs {ranks} devices" in err and "2 CPU core(s)" in err, err
    assert started == [], "refused before any rank started"
    assert main([*argv, "--mesh", "model=2"]) == 0 and started == [2]
    # RANK and WORLD_SIZE left in the environment (another job, a cluster's defaults) make the command a rank: without
    # MASTER_ADDR torch's rendezvous raised "unexpected ValueError", and a world of another size waited at it for
    # ranks that never come. Both are refused before joining, naming the variables.
    monkeypatch.setattr(launch, "init_rank", lambda: pytest.fail("joined a world it cannot run in"))
    for env, words in (({"RANK": "0", "WORLD_SIZE": "2"}, "but MASTER_ADDR and MASTER_PORT are not set; unset RANK"),
                       ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
                        "mesh model=2,data=1 needs 2 ranks, but RANK=0 WORLD_SIZE=4 in the environment")):
        with monkeypatch.context() as inside:
            for name, value in env.items():
                inside.setenv(name, value)
            assert main([*argv, "--mesh", "model=2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert started == [2]


TIMINGS = ("load_s", "prefill_s", "first_step_s", "decode_tok_s")


def test_a_one_device_mesh_runs_in_this_process_as_one_device(checkpoints, tmp_path, capsys, monkeypatch):
    """`--mesh model=1,data=1` (or data=1, or model=1) started one torch rank, a process that did what this one does
    without --mesh, and JAX built a one-device Mesh: both backends now run it here, unsplit. torch's --json equals the
    one-device run's but for its timings and "mesh", which names the mesh asked for; parity runs its plain report (its
    "mesh" names the mesh too); the bench runs torch's model=1 here."""
    import jax_cache.backend
    import torch_cache.backend
    from twincache_app import launch, mesh_parity
    from twincache_app.cli import main

    monkeypatch.setattr(launch, "run_ranks", lambda *args, **kwargs: pytest.fail("started ranks for one device"))
    monkeypatch.setattr(mesh_parity, "mesh_report", lambda *args: pytest.fail("a mesh report for one device"))
    loaded = []  # the mesh each tower's load was given

    def torch_load(*args, real=torch_cache.backend.load, **kwargs):
        loaded.append(kwargs.get("mesh"))
        return real(*args, **kwargs)

    def jax_load(*args, **kwargs):  # what it loads is all this asks; a JAX run costs a compile
        loaded.append(kwargs.get("mesh"))
        raise InputError("stopped after the load's arguments")

    monkeypatch.setattr(torch_cache.backend, "load", torch_load)
    monkeypatch.setattr(jax_cache.backend, "load", jax_load)
    model = str(checkpoints["gqa"])
    argv = ["generate", "--backend", "torch", "--mode", "eager", "--model", model, "--prompt-ids", "1,2,3",
            "--max-new-tokens", "4", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    for mesh in ("model=1,data=1", "data=1", "model=1"):
        assert main([*argv, "--mesh", mesh]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["mesh"] == "model=1,data=1" and single["mesh"] is None, out["mesh"]
        assert {k: v for k, v in out.items() if k not in (*TIMINGS, "mesh")} == \
            {k: v for k, v in single.items() if k not in (*TIMINGS, "mesh")}
    # JAX as torch: the model loads unsplit, in this process
    assert main(["generate", "--backend", "jax", "--model", model, "--prompt-ids", "1,2,3", "--mesh", "model=1"]) == 2
    assert "stopped after the load's arguments" in capsys.readouterr().err
    assert main(["parity", "--modes", "torch:eager", "--model", model, "--prompt-ids", "1,2,3", "--max-new-tokens",
                 "2", "--cache", "static", "--mesh", "data=1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == "model=1,data=1" and [row["name"] for row in report["rows"]][1:] == ["torch:eager"]
    assert main(["bench", "--preset", "tiny", "--model", model, "--meshes", "model=1", "--impls", "torch_eager",
                 "--out", str(tmp_path / "bench"), "--cache-dir", str(tmp_path / "cache")]) == 0
    record, = json.loads((tmp_path / "bench" / "mesh.json").read_text())
    assert (record["backend"], record["mesh"], len(record["weights_bytes"])) == ("torch", "model=1,data=1", 1)
    assert loaded == [None] * 7, loaded  # torch: 4 generate runs, parity and the bench; JAX: 1; none split


def test_the_cores_torch_ranks_share_are_those_this_process_may_run_on(monkeypatch):
    """Under taskset or a container's cpuset a process may run on fewer cores than the host has: those are what its
    ranks share (and the cap counts)."""
    import os

    from twincache_app import launch

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5}, raising=False)
    assert launch.cpu_cores() == 2
    monkeypatch.delattr(os, "sched_getaffinity")  # a platform without it (macOS)
    assert launch.cpu_cores() == 64


def test_cli_generate_on_a_mesh_prints_once_and_equals_one_device(mesh_runs):
    """torch launches its 2 processes itself and only rank 0 prints; JAX simulates the CPU devices it needs."""
    from torch_cache import backend

    model = backend.load(mesh_runs["dirs"]["gqa"], "float32", "cpu")
    prompt = [int(i) for i in CLI_PROMPT[1].split(",")]
    single = backend.generate(model, [prompt], 12, mode="eager").token_ids[0]
    for name, mesh in (("generate torch", "model=2,data=1"), ("generate jax", "model=2,data=2")):
        code, out, err = mesh_runs["cli"][name]
        assert code == 0, err[-2000:]
        lines = out.splitlines()
        assert len(lines) == 1, out  # one JSON object: rank 1 printed nothing
        result = json.loads(lines[0])
        assert result["mesh"] == mesh and result["token_ids"] == single, (name, result["token_ids"], single)


def test_the_trained_model_on_a_jax_mesh_of_3_decodes_the_tokens_of_one_device(mesh_runs, trained_model_dir):
    """SmolLM2 split 3 ways (3 query heads and its 1 KV head per device, a third of the MLP and of the vocabulary),
    its ring wrapped by the prompt: the same 12 greedy tokens as on one device."""
    from twincache.checkpoint import load_config

    config = load_config(trained_model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.sliding_window) == (9, 3, 64)
    results = {}
    for name in ("trained jax mesh", "trained jax"):
        code, out, err = mesh_runs["cli"][name]
        assert code == 0, err[-2000:]
        results[name] = json.loads(out)
    sharded, single = results["trained jax mesh"], results["trained jax"]
    assert sharded["mesh"] == "model=3,data=1" and single["mesh"] is None
    assert len(sharded["prompt_ids"]) > 64 and sharded["prompt_ids"] == single["prompt_ids"]
    assert len(single["token_ids"]) == 12 and sharded["token_ids"] == single["token_ids"], (sharded, single)


@pytest.mark.parametrize(("run", "impl", "mesh", "steps"), [("parity jax", "jax:fused", "model=4,data=2", 10),
                                                            ("parity torch", "torch:eager", "model=2,data=1", 6)])
def test_cli_parity_on_a_mesh_judges_it_against_float64_and_against_one_device(mesh_runs, run, impl, mesh, steps):
    """`parity --mesh --json` prints plain parity's JSON plus "mesh", once (torch: from rank 0 of its 2 processes):
    the floor, the implementation on the mesh against the float64 reference, and against itself on one device, all
    within the rule. JAX's sharded cache is compared; each torch rank holds a shard only, so its K/V is not measured."""
    from twincache_app.parity import format_table

    code, out, err = mesh_runs["cli"][run]
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert len(lines) == 1, out
    report = json.loads(lines[0])
    assert report["mesh"] == mesh and report["steps"] == steps and report["reference"].startswith("transformers")
    rows = {row["name"]: row for row in report["rows"]}
    sharded = f"{impl}@{mesh}"
    assert list(rows) == ["transformers (floor)", sharded, f"{sharded} vs {impl}"], list(rows)
    assert [rows[name]["kind"] for name in rows] == ["floor", "implementation", "direct"]
    assert report["passed"] and not any(row["failed"] for row in report["rows"]), report["rows"]
    kv = [rows[name]["metrics"]["max_abs_kv_diff"] for name in (sharded, f"{sharded} vs {impl}")]
    if impl.startswith("jax"):
        assert all(value is not None and value <= 1e-5 for value in kv), kv
    else:
        assert kv == [None, None] and not any("max_abs_kv_diff" in rows[name]["ratios"] for name in rows
                                               if name.startswith(sharded))
        assert "n/a" in format_table(report)


# --- the bench mode --------------------------------------------------------------------------------------------------

def test_a_refusal_inside_torchs_ranks_reaches_the_user_as_one_line(mesh_runs):
    """What only a run can find (NaN logits from a checkpoint whose final norm is NaN) is refused inside the bench's
    two torch ranks (bench.mesh writes a rank's refusal for the launcher's process); the bench says it once, as that
    error, not as the ranks' tracebacks and "unexpected RuntimeError", and exits 2."""
    code, out, err = mesh_runs["cli"]["bench refused"]
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "NaN or Inf logits at generated token 0" in err and "unexpected" not in err, err


def test_bench_meshes_records_each_devices_bytes_and_tok_s_per_mesh(mesh_runs):
    """`twincache bench --meshes` on the tiny preset's workload with --model (the GQA checkpoint: 2 KV heads),
    model=1 and model=2: both backends decode the same tokens (torch's ranks run the checkpoint given, not the
    preset's own weights); every device of model=2 holds half the KV of model=1's one device and less than its
    weights; JAX also runs the vocabulary replicated, which holds more per device than split."""
    records = {(r["backend"], r["mesh"], r["vocabulary"]): r for r in mesh_runs["bench"]}
    assert set(records) == {("torch", "model=1,data=1", "split"), ("torch", "model=2,data=1", "split"),
                            ("jax", "model=1,data=1", "split"), ("jax", "model=2,data=1", "split"),
                            ("jax", "model=2,data=1", "replicated")}
    for backend in ("torch", "jax"):
        one, two = records[(backend, "model=1,data=1", "split")], records[(backend, "model=2,data=1", "split")]
        assert len(one["weights_bytes"]) == 1 and len(two["weights_bytes"]) == 2 == len(two["kv_bytes"])
        assert set(two["kv_bytes"].values()) == {one["kv_max_bytes"] // 2}, (backend, one["kv_bytes"], two["kv_bytes"])
        assert max(two["weights_bytes"].values()) < 0.6 * one["weights_max_bytes"], backend
        assert two["decode_tok_s"] > 0 and two["token_ids"] == one["token_ids"], backend
    torch_one, jax_one = (records[(backend, "model=1,data=1", "split")] for backend in ("torch", "jax"))
    assert torch_one["token_ids"] == jax_one["token_ids"], "the backends ran different models or prompts"
    replicated = records[("jax", "model=2,data=1", "replicated")]
    assert replicated["weights_max_bytes"] > records[("jax", "model=2,data=1", "split")]["weights_max_bytes"]
    assert mesh_runs["bench_md"].count("| jax |") == 3 and mesh_runs["bench_md"].count("| torch |") == 2
    # a --model run names its checkpoint, not only the preset whose workload it ran
    assert mesh_runs["bench_md"].startswith(f"# twincache bench: one model and one cache across devices, preset "
                                            f"`tiny` on `{mesh_runs['dirs']['gqa']}`"), mesh_runs["bench_md"][:200]
    assert all(r["model"] == str(mesh_runs["dirs"]["gqa"]) for r in mesh_runs["bench"])
