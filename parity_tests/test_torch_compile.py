"""What torch.compile sees of torch_cache's decode step: one decoder layer and its cache write traced once for the
whole stack (regional compilation, issue 13 §3). Graphs are captured with a recording backend, so nothing here runs
inductor."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from parity_tests import background
from parity_tests.conftest import save_hf_checkpoint
from torch_cache.cache import make_cache
from torch_cache.generate import prefill
from torch_cache.model import Mistral

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[1]


def recording_backend() -> tuple[list[torch.fx.GraphModule], Callable]:
    """A torch.compile backend that keeps each FX graph dynamo hands it (and runs it as is), and that list."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    return graphs, record


def captured_step_graph(model: Mistral) -> torch.fx.GraphModule:
    """The FX graph dynamo hands to the backend for one decode step of `model` (fullgraph)."""
    graphs, record = recording_backend()

    def step(input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        return model(input_ids, positions, cache)[:, -1]

    with torch.inference_mode():
        cache = make_cache("static", model.config, 1, 16)
        prefill(model, torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long), cache)
        torch.compile(step, backend=record, fullgraph=True, dynamic=False)(torch.tensor([[6]]), torch.tensor([[3]]),
                                                                           cache)
    assert len(graphs) == 1
    return graphs[0]


@pytest.mark.skipif(TorchVersion(torch.__version__) < "2.11", reason="regional compilation needs torch >= 2.11 "
                    "(torch_cache.model.compile_region): older versions compile the whole stack, as before")
def test_dynamo_traces_one_decoder_layer_with_its_cache_write_once_for_the_whole_stack(tmp_path: Path):
    """Each layer runs one region, its K/V write inside (DecoderLayer.forward_in_place), and dynamo traces it once:
    the other layers reuse that trace (subgraph reuse), which needs a region whose inputs are tensors and the module.
    A region that took the cache object would be traced again for every layer, which dynamo's timer counts; a write
    left outside the region would leave inductor 2 copy kernels per layer to generate around it."""
    from torch._dynamo.utils import compilation_time_metrics

    model = Mistral.from_pretrained(save_hf_checkpoint(tmp_path / "six", seed=3, num_hidden_layers=6))
    traced_before = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    graph = captured_step_graph(model)
    traced = len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - traced_before
    calls = [node for node in graph.graph.nodes if node.op == "call_function" and "invoke_subgraph" in str(node.target)]
    regions = sorted({node.args[0].target for node in calls})
    assert len(calls) == model.config.num_hidden_layers, "every layer runs its region"
    assert len(regions) == 1, f"one traced region for the whole stack, got {regions}"

    def writes(gm: torch.fx.GraphModule) -> int:
        return sum(1 for node in gm.graph.nodes if "index_copy" in str(node.target))

    assert writes(getattr(graph, regions[0])) == 2, "the region writes the layer's keys and values"
    # outside the regions only slot positions are written: attended_positions' copy and StaticCache.advance
    assert writes(graph) == 2, "a K/V write outside the region"
    if TorchVersion(torch.__version__) >= "2.12":  # 2.11 does not time (so count) dynamo's region traces
        assert traced == 1, f"dynamo traced the region {traced} times for {model.config.num_hidden_layers} layers"


def test_a_sampled_step_hashes_each_noise_entry_once_in_the_graph(checkpoints: dict[str, Path]):
    """The seed's fold-in with the step index and the hash of each entry's index stay out of the compiled step
    (torch_cache.generate._hash32: inductor's codegen time doubles with each hash stage of a fused chain, ~15 s of a
    sampled step's cold compile on a 2-core CPU). The graph keeps one hash per noise entry, three right shifts, and
    the shift that takes a uniform's 24 bits; the draws themselves are checked against an independent oracle
    (test_sampling, test_buckets)."""
    import operator

    from torch_cache import generate as torch_generate

    model = Mistral.from_pretrained(checkpoints["gqa"])
    graphs, record = recording_backend()
    decode_one = torch.compile(torch_generate._decode_one_fn(model, compile=False).step, backend=record, fullgraph=True,
                               dynamic=False)
    sampling = torch_generate.SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    with torch.inference_mode():
        cache = make_cache("static", model.config, 1, 16)
        prefill(model, torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long), cache)
        kind = torch_generate._sampling_kind(sampling)
        forced, forcing, _, _, *_ = torch_generate._no_draw_args(1, model.device)
        decode_one(torch.tensor([[6]]), torch.tensor([[3]]), cache, None, torch.zeros(1, dtype=torch.bool),
                   torch.tensor([-1]), forced, forcing, torch_generate._StepKey(sampling.seed, model.device).at(1),
                   torch_generate._sampling_bits(kind, 1, model.config.vocab_size, model.device),
                   *torch_generate._knobs(sampling, model.device), kind)
    assert kind == "filtered" and len(graphs) == 1
    shifts = [node for node in graphs[0].graph.nodes if node.op in ("call_function", "call_method")
              and node.target in (operator.rshift, "__rshift__", torch.bitwise_right_shift)]
    assert len(shifts) == 4, f"{len(shifts)} right shifts in the sampled step: hash chains moved into the graph"


_PICKED_ISA = """
import json
import os
import sys
import torch
if sys.argv[2] == "vectorisation off":
    torch._inductor.config.cpp.vec_isa_ok = False
from torch._inductor import cpu_vec_isa
full_checks = []  # inductor's full check of an ISA: a test program with ATen's vector headers, ~1.3 s of a core
checks_before_the_header = []  # every check of an ISA (full or short) made while no precompiled header existed
checks_of_other_isas = []  # every check of an ISA other than the one picked, before a config reads past it
check_build = cpu_vec_isa.VecISA.check_build


def headers():
    import glob
    import tempfile
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), "torchinductor_*", "precompiled_headers", "*.gch")))


def counted_check_build(isa, code):
    if not headers():
        checks_before_the_header.append(str(isa))
    if not reading_past_the_first:
        checks_of_other_isas.append(str(isa))
    if code == cpu_vec_isa.VecISA._avx_code:
        full_checks.append(str(isa))
        if sys.argv[2] == "widest ISA fails" and str(isa) == candidates[0]:  # a compiler without its flags
            return False
    return check_build(isa, code)


cpu_vec_isa.VecISA.check_build = counted_check_build
cpu_flags = cpu_vec_isa.x86_isa_checker()
candidates = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(f in cpu_flags for f in str(isa).split())]
imported = []
reading_past_the_first = False
if sys.argv[1] == "probed":
    import torch_cache.inductor_cpu as probe
    checks = probe._probe_vector_isas

    def watched_checks():
        before = set(sys.modules)
        checks()
        imported.extend(sorted(set(sys.modules) - before))

    probe._probe_vector_isas = watched_checks
    probe.start_compiler_probe()
    probe._compiler_probe.join()
isa = str(cpu_vec_isa.pick_vec_isa())
headers_before = headers()
torch.compile(lambda x: (x.sin() + 1).cos())(torch.randn(64))  # inductor's own first CPU kernel
checks_of_other_isas = [checked for checked in checks_of_other_isas if checked != isa]
headers_after = headers()
reading_past_the_first = True
torch._inductor.config.cpp.simdlen = 256  # a config set later in the process: inductor reads past its first ISA
print(json.dumps({"isa": isa, "imported by the thread": imported, "headers before a compile": headers_before,
                  "headers after it": headers_after, "full checks": full_checks, "candidates": candidates,
                  "picked for simdlen 256": str(cpu_vec_isa.pick_vec_isa()),
                  "valid list": [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()],
                  "checks before the header": checks_before_the_header,
                  "checks of other ISAs before a config read past the first": checks_of_other_isas}))
"""


ISA_SETTINGS = ("default config", "vectorisation off", "AVX2 forced", "widest ISA fails")


@background.job
def isa_runs(request: pytest.FixtureRequest) -> Callable[[], dict[str, dict[str, dict]]]:
    """For each setting, the ISA report of a process that ran the checks in the background ("probed"), then of one
    where inductor ran them itself ("inductor"), sharing the first one's inductor cache and temp dir (a fresh pair
    per setting, as on a new machine). The settings are independent: their processes run side by side."""
    import json
    import shutil
    import subprocess
    import sys

    envs = {}
    for setting in ISA_SETTINGS:
        root = request.getfixturevalue("tmp_path_factory").mktemp("isa")
        (root / "tmp").mkdir()
        envs[setting] = env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
                               "TMPDIR": str(root / "tmp"), "PYTHONPATH": str(REPO)}
        env.pop("ATEN_CPU_CAPABILITY", None)
        if setting == "AVX2 forced":
            env["ATEN_CPU_CAPABILITY"] = "avx2"

    def run() -> dict[str, dict[str, dict]]:
        runs: dict[str, dict[str, dict]] = {setting: {} for setting in ISA_SETTINGS}
        try:
            for how in ("probed", "inductor"):
                started = {setting: subprocess.Popen([sys.executable, "-c", _PICKED_ISA, how, setting], env=env,
                                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                           for setting, env in envs.items()}
                for setting, proc in started.items():
                    stdout, stderr = proc.communicate(timeout=300)
                    assert proc.returncode == 0, (setting, how, stderr[-2000:])
                    runs[setting][how] = json.loads(stdout)
        finally:
            for env in envs.values():
                shutil.rmtree(env["TMPDIR"], ignore_errors=True)  # a precompiled header is ~150 MB
        return runs

    return run


@pytest.mark.parametrize("setting", ISA_SETTINGS)
def test_the_background_isa_checks_leave_inductor_the_vector_isa_it_picks_itself(isa_runs, setting: str):
    """torch_cache runs inductor's CPU vector-ISA checks in a background thread (start_compiler_probe); inductor must
    then pick the same ISA as when it runs them itself, one after another, in a fresh process, also when the caller
    has set inductor's config (a context variable, which a new thread would not see) or ATEN_CPU_CAPABILITY. The
    second process shares the first one's inductor cache, so it rebuilds nothing, but it checks every ISA again.
    The thread must import no module: torch's modules import each other in cycles, and one imported in the
    background while the caller imports torch._dynamo can come out partly initialised (an ImportError in CI).
    It also builds the precompiled header inductor's kernels use (in a fresh temp dir here, as on a new machine):
    inductor's first kernel then builds none. With the default config it runs inductor's full check (a test program
    with ATen's vector headers) for the ISA inductor picks only, where inductor alone runs one per candidate, and
    checks the ISAs after that one only when a config set later reads past it (cpp.simdlen here): the ISA picked
    then and the list of valid ISAs are inductor's own."""
    runs = isa_runs[setting]
    probed = runs["probed"]
    assert probed["isa"] == runs["inductor"]["isa"], runs
    # read when a config set later asks for another ISA
    assert probed["picked for simdlen 256"] == runs["inductor"]["picked for simdlen 256"], runs
    assert probed["valid list"] == runs["inductor"]["valid list"], runs
    assert probed["imported by the thread"] == [], probed
    assert len(probed["headers before a compile"]) == 1, probed
    assert probed["headers after it"] == probed["headers before a compile"], probed
    if setting == "default config":
        assert len(probed["full checks"]) == min(1, len(probed["candidates"])), probed
        assert probed["full checks"] == [probed["isa"]] * len(probed["full checks"]), probed
        # the header, which inductor's first kernel waits for, is built before the ISAs after the picked one are
        assert set(probed["checks before the header"]) <= {probed["isa"]}, probed
        # which are checked only when a config first reads past the picked one, not while a first graph compiles
        assert probed["checks of other ISAs before a config read past the first"] == [], probed
    elif setting == "widest ISA fails":  # the next one is checked, and picked
        assert probed["full checks"] == probed["candidates"][:2], probed
        assert probed["isa"] == (probed["candidates"][1:] or ["INVALID_VEC_ISA"])[0], probed
    elif setting == "AVX2 forced":  # inductor may pick any candidate: each gets its full check
        assert sorted(probed["full checks"]) == sorted(probed["candidates"]), probed
    else:  # vectorisation off: no ISA is checked at all
        assert probed["full checks"] == runs["inductor"]["full checks"] == [], runs


_IMPORT_WHILE_PROBING = """
import torch
import torch_cache.inductor_cpu as probe
probe.start_compiler_probe()
import torch._dynamo  # what the caller's thread does next: StaticCache marks its buffers static
"""


def test_the_caller_can_import_dynamo_while_the_isa_checks_start(tmp_path: Path):
    """The CI failure this guards: a CLI error case constructed its cache (importing torch._dynamo) while the checks'
    thread imported inductor; one of them got a partly initialised torch._inductor.utils (ImportError). With the
    thread importing in the background it failed 7 runs in 8 here (on an empty inductor cache, as this one)."""
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_WHILE_PROBING], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
