"""Inductor's C++ kernels for the CPU, built as one shared library per compile worker (torch_cache.inductor_cpu,
issue 13 §3): what gets built, from what, and that the kernels compute what inductor's own do. Counts only: how many
libraries and compiler runs, never how long they take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_tests import background
from parity_tests.conftest import save_hf_checkpoint
from torch_cache.inductor_cpu import balanced_groups, library_source

REPO = Path(__file__).resolve().parents[1]

_COMPILES = """
import contextlib
import json
import re
import sys

import torch
import torch._inductor.cpp_builder as cpp_builder
from torch._inductor import config as inductor_config
from torch._inductor import cpu_vec_isa
from torch._inductor.codecache import CppPythonBindingsCodeCache

from torch_cache import inductor_cpu
from torch_cache.generate import generate
from torch_cache.model import Mistral

torch.set_num_threads(1)
inductor_config.compile_threads = 2  # as on a 2-core machine, whatever this one has
builds = []  # every C++ compiler run (kernels, ISA checks, headers)
build = cpp_builder.CppBuilder.build


def counted_build(self, *args, **kwargs):
    builds.append(self.get_target_file_path())
    return build(self, *args, **kwargs)


cpp_builder.CppBuilder.build = counted_build
batches = []  # kernels per batch built together
compile_together = inductor_cpu._compile_together


def spied(kernels):
    batches.append(len(kernels))
    return compile_together(kernels)


inductor_cpu._compile_together = spied


def kernels_around_two_matmuls(scale):
    # pointwise, matmul, pointwise, matmul, pointwise: three C++ kernels around two oneDNN/MKL calls
    return lambda x, w: ((((x.sin() + scale) @ w).relu() * scale) @ w).tanh() - scale  # each kernel its own


def compiled(fn, *args, batched):
    torch._dynamo.reset()  # each closure's scale a constant of its own graph, not a graph input after two values
    libraries, runs = set(CppPythonBindingsCodeCache.cache), len(builds)
    with inductor_cpu.batched_kernels() if batched else contextlib.nullcontext(), torch.inference_mode():
        out = torch.compile(fn, fullgraph=True)(*args)
    return {"libraries": len(set(CppPythonBindingsCodeCache.cache) - libraries), "compiler runs": len(builds) - runs,
            "max abs error": (out - fn(*args)).abs().max().item()}


x, w = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)), torch.randn(32, 32) / 8
cpu_vec_isa.pick_vec_isa()  # the ISA checks and the precompiled header, before anything is counted
compiled(lambda a: a.cos() * 3, x, batched=False)
report = {}
if sys.argv[1] == "first":
    report["batched"] = compiled(kernels_around_two_matmuls(1.0), x, w, batched=True)
    report["kernels in the batch"] = batches[-1]
    report["inductor alone"] = compiled(kernels_around_two_matmuls(2.0), x, w, batched=False)
    inductor_config.compile_threads = 1  # compiled in this thread, as the bench does
    report["one worker"] = compiled(kernels_around_two_matmuls(3.0), x, w, batched=True)
    inductor_config.compile_threads = 2
    entry = inductor_cpu._ENTRY
    inductor_cpu._ENTRY = re.compile("a kernel this cannot wrap")
    report["unwrappable"] = compiled(kernels_around_two_matmuls(4.0), x, w, batched=True)
    inductor_cpu._ENTRY = entry
    model = Mistral.from_pretrained(sys.argv[2])
    batches.clear()
    libraries = set(CppPythonBindingsCodeCache.cache)
    from torch._inductor.utils import run_and_get_code

    compiled_tokens, sources = run_and_get_code(lambda: generate(model, [[3, 4, 5, 6]], 6, compile=True).token_ids)
    tokens = {"compiled": compiled_tokens, "eager": generate(model, [[3, 4, 5, 6]], 6, compile=False).token_ids}
    report["decode step"] = {"tokens": tokens, "batches": batches,
                             "libraries": len(set(CppPythonBindingsCodeCache.cache) - libraries),
                             "modules": len(sources),
                             "size asserts": sum(len(re.findall(r"^\\s+assert_size_stride\\(", source, re.M))
                                                 for source in sources)}
else:  # a new process on the same inductor cache: the same graph's libraries are found, not rebuilt
    report["batched"] = compiled(kernels_around_two_matmuls(1.0), x, w, batched=True)
print(json.dumps(report))
"""


@background.job
def compiles(request: pytest.FixtureRequest) -> Callable[[], dict[str, dict]]:
    """A first process on an empty inductor cache, then a second one on the cache the first one filled."""
    root = request.getfixturevalue("tmp_path_factory").mktemp("batching")
    checkpoint = save_hf_checkpoint(root / "tiny")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "PYTHONPATH": str(REPO)}

    def run(phase: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", _COMPILES, phase, str(checkpoint)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return lambda: {phase: run(phase) for phase in ("first", "again")}


def test_a_graphs_kernels_build_as_one_library_per_compile_worker(compiles: dict[str, dict]):
    first = compiles["first"]
    kernels = first["kernels in the batch"]
    assert kernels >= 3, first
    # inductor alone: one library and one compiler run per kernel; batched: one per worker (2), or one in all
    assert first["inductor alone"]["libraries"] == first["inductor alone"]["compiler runs"] == kernels, first
    assert first["batched"]["libraries"] == first["batched"]["compiler runs"] == 2, first
    assert first["one worker"]["libraries"] == first["one worker"]["compiler runs"] == 1, first
    for case in ("batched", "inductor alone", "one worker", "unwrappable"):
        assert first[case]["max abs error"] < 1e-5, (case, first[case])


def test_kernels_it_cannot_wrap_are_left_to_inductor(compiles: dict[str, dict]):
    unwrappable = compiles["first"]["unwrappable"]
    assert unwrappable["libraries"] == compiles["first"]["kernels in the batch"], unwrappable
    assert unwrappable["max abs error"] < 1e-5, unwrappable


def test_a_new_process_finds_the_libraries_instead_of_building_them(compiles: dict[str, dict]):
    again = compiles["again"]["batched"]
    assert again["compiler runs"] == 0, again  # the same kernels split the same way: the same sources and keys
    assert again["libraries"] == 2, again
    assert again["max abs error"] < 1e-5, again


def test_the_decode_step_builds_its_kernels_together(compiles: dict[str, dict]):
    step = compiles["first"]["decode step"]
    assert step["tokens"]["compiled"] == step["tokens"]["eager"], step
    assert len(step["batches"]) == 1 and step["batches"][0] >= 3, step  # one graph, all of its kernels
    assert step["libraries"] == 2, step
    # ...and its wrapper checks no sizes at run time: 136 checks a step of `small` otherwise (design.md §7.33)
    assert step["modules"] >= 1 and step["size asserts"] == 0, step


def test_groups_cover_every_kernel_once_and_balance_their_sizes():
    sizes = [900, 100, 500, 400, 300, 300, 50]
    groups = balanced_groups(sizes, 2)
    assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
    assert all(group == sorted(group) for group in groups)
    totals = sorted(sum(sizes[i] for i in group) for group in groups)
    assert totals == [1250, 1300], groups  # largest first, each to the lighter group
    assert balanced_groups(sizes, 2) == groups  # the same split every time: the libraries' cache keys
    assert sorted(balanced_groups([10, 20], 8)) == [[0], [1]]  # no empty group
    assert balanced_groups([10, 20], 1) == [[0, 1]]


def test_the_library_exports_one_function_per_kernel_each_in_its_own_namespace():
    kernel = ('#include "prefix.h"\nstatic int helper() {{ return {n}; }}\n'
              'extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)\n{{ }}\n')
    source = library_source([(["const float*", "float*", "const int64_t"], kernel.format(n=n)) for n in range(3)])
    assert source.count('#include "prefix.h"') == 1
    assert 'extern "C"' not in source.split("PyMODINIT_FUNC")[0]  # only the module's init function is exported
    for n in range(3):
        assert f"namespace twincache_kernel_{n} {{" in source
        assert f"twincache_kernel_{n}::kernel(parse_arg<float*>(args, 0), parse_arg<float*>(args, 1), " \
               f"parse_arg<int64_t>(args, 2));" in source
        assert f'{{"kernel_{n}", kernel_{n}_py, METH_VARARGS, ""}}' in source
    with pytest.raises(ValueError, match="expected one"):
        library_source([(["float*"], "void not_a_kernel() {}")])
    with pytest.raises(ValueError, match="an #include after its code"):
        library_source([(["float*"], '#define X 1\n#include "needs_x.h"\nextern "C" void kernel(float* p) {}')])
