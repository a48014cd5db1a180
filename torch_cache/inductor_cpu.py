"""Inductor's CPU C++ toolchain, made cheaper for a first compile on a small machine (docs/design.md §7.17, §7.19).

Before its first CPU kernel inductor checks which vector ISAs the compiler can build for and builds a precompiled
header (ATen's vector headers); then it compiles each kernel of a graph as its own shared library, every one of them
loading that ~150 MB header. Here the checks and the header run in a background thread while the weights load
(`start_compiler_probe`), and a decode step's kernels compile as one shared library per compile worker
(`batched_kernels`). torch-only: XLA has no such step.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import platform
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twincache.storage import share_temp_dir, writable_directory

if TYPE_CHECKING:
    from torch._inductor.cpu_vec_isa import VecISA

__all__ = ["check_cache_dir", "start_compiler_probe", "batched_kernels", "balanced_groups", "library_source"]

_compiler_probe: threading.Thread | None = None


def check_cache_dir() -> None:
    """Refuse a TORCHINDUCTOR_CACHE_DIR that cannot be a writable directory, in one line naming it (StorageError).
    torch creates it when torch._dynamo is first imported (a cache marks its buffers static, inductor's checks load
    here): one it cannot create ended a run with "unexpected FileNotFoundError: [Errno 2] No such file or directory:
    '/proc/nope'", which named neither the variable nor what to do. First TMPDIR becomes the temp dir Python uses
    (twincache.storage.share_temp_dir)."""
    share_temp_dir()  # before the compiler probe's first g++ run: a TMPDIR Python skipped, g++ skips too
    directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if directory:
        writable_directory(Path(directory), "TORCHINDUCTOR_CACHE_DIR",
                           "point it at a writable directory, or unset it (inductor keeps its compiled kernels there)")


def start_compiler_probe() -> None:
    """Start, in a background thread, the checks inductor runs before its first CPU kernel: which vector ISAs
    (AVX2, AVX-512, VNNI, AMX...) the C++ compiler can build for and the process can load. Each builds a test program
    and loads it in a child process: measured on a 2-core Xeon, 10.2 s in series with an empty inductor cache, 1.5 s
    with a filled one. Here they run while the caller loads its model (subprocess waits: the GIL stays free), and
    with inductor's default config only the ISA it will compile for gets the full check. Inductor reads the same
    cached results; a check it reaches while this thread still runs it waits on the check's file lock and reuses the
    built program. Then it builds the precompiled header inductor's kernels include (~4 s, once per machine); the
    ISAs after the picked one are checked only if a config set later reads past it (_check_later_isas_on_demand).
    Idempotent; on a torch without these internals inductor simply does all of it itself."""
    global _compiler_probe
    if _compiler_probe is not None:
        return
    try:  # in this thread: see _CHECKS_IMPORT
        for module in _CHECKS_IMPORT:
            importlib.import_module(module)
    except ImportError:
        return
    # torch's config overrides (inductor's cpp.vec_isa_ok, simdlen...) are context variables: the checks run in copies
    # of the caller's context, so they see what inductor would see in the caller's thread
    _compiler_probe = threading.Thread(target=contextvars.copy_context().run, args=(_probe_vector_isas,),
                                       name="twincache-isa-probe", daemon=True)
    _compiler_probe.start()


# Everything the checks import, imported by the caller before the thread starts. torch's modules import each other
# in cycles: a thread importing them while the caller imports torch._dynamo (the cache marks its buffers static) can
# hand one of them a partly initialised module (CI: "cannot import name 'IndentedBuffer' from
# 'torch._inductor.utils'"). The thread then imports nothing; a test checks it.
_CHECKS_IMPORT = ("concurrent.futures", "torch._inductor.cpu_vec_isa", "torch._inductor.codecache",
                  "torch._inductor.cpp_builder", "torch.utils._filelock", "torch.utils.cpp_extension")


def _probe_vector_isas() -> None:
    try:
        from concurrent.futures import ThreadPoolExecutor

        from torch._inductor import config as inductor_config
        from torch._inductor import cpu_vec_isa
        _lower_thread_priority()
        if platform.machine() in ("x86_64", "AMD64"):
            cpu_flags = cpu_vec_isa.x86_isa_checker()
            candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                          if all(flag in cpu_flags for flag in str(isa).split())]
            if _inductor_picks_the_widest_isa(inductor_config):
                # Inductor will compile for the first candidate that passes its check, and reads only that one off
                # its list: check them in order and stop there, and list it alone while the precompiled header
                # builds for its flags. The ones after it are checked when a config first asks for one.
                picked = next((isa for isa in candidates if isa), None)  # verdicts are cached on the ISA objects
                if picked is not None:
                    listed = _list_vec_isas(cpu_vec_isa, [picked])
                    _build_precompiled_header()
                    _check_later_isas_on_demand(cpu_vec_isa, inductor_config, listed,
                                                candidates[candidates.index(picked) + 1:])
                    return
            else:  # the config or ATEN_CPU_CAPABILITY may pick any of them: inductor's full check for each
                contexts = [contextvars.copy_context() for _ in candidates]  # a context is entered by one thread

                def check(context: contextvars.Context, isa: object) -> bool:
                    _lower_thread_priority()
                    return context.run(bool, isa)

                with ThreadPoolExecutor(max(1, len(candidates))) as pool:
                    list(pool.map(check, contexts, candidates))
        cpu_vec_isa.valid_vec_isa_list()  # cached: inductor reads this list
        _build_precompiled_header()
    except Exception:  # noqa: BLE001 - a warm-up only: inductor repeats any check that did not finish
        return


def _list_vec_isas(cpu_vec_isa: Any, candidates: list[VecISA]) -> list[VecISA]:
    """Inductor's cached list of valid vector ISAs, computed over `candidates` only (their verdicts are cached).
    `cpu_vec_isa` is torch._inductor.cpu_vec_isa (typed Any: mypy has no type for one given module, whose
    attributes this sets)."""
    supported = cpu_vec_isa.supported_vec_isa_list
    cpu_vec_isa.supported_vec_isa_list = candidates  # read by valid_vec_isa_list alone; restored at once
    try:
        return cpu_vec_isa.valid_vec_isa_list()
    finally:
        cpu_vec_isa.supported_vec_isa_list = supported


def _check_later_isas_on_demand(cpu_vec_isa: Any, inductor_config: Any, listed: list[VecISA],
                                later: list[VecISA]) -> None:
    """Complete inductor's cached list of valid ISAs (`listed`, the picked one) with the `later` candidates the
    first time inductor reads it under a config that may pick one of them (cpp.simdlen, ATEN_CPU_CAPABILITY or
    cpp.vec_isa_ok set later in this process), by the CPU's flags and their short intrinsic checks, without the full
    test program (ATen's vector headers, ~1.3 s of a core apiece). Checked in the background as before, they took
    ~1.6 s of a core while the first graph's kernels compiled and it decoded (trained model, first run on a 2-core
    Xeon: 30-33 against 40 tok/s over 64 tokens); under the default config inductor reads only the first entry."""
    cached = cpu_vec_isa.valid_vec_isa_list
    lock = threading.Lock()

    def valid_vec_isa_list() -> list[VecISA]:
        valid = cached()
        if later and valid is listed and not _inductor_picks_the_widest_isa(inductor_config):
            with lock, inductor_config.patch({"cpp.vec_isa_ok": True}):
                if later:
                    listed.extend(isa for isa in later if isa)
                    later.clear()
        return valid

    valid_vec_isa_list.cache_clear = cached.cache_clear  # type: ignore[attr-defined]  # as torch's tests call it
    cpu_vec_isa.valid_vec_isa_list = valid_vec_isa_list


def _build_precompiled_header() -> None:
    """Inductor compiles every CPU kernel against a precompiled cpp_prefix.h (ATen's vector headers, ~150 MB), built
    on first use for its flags and the ISA it picked, and kept across processes in the system's temp dir. Building
    it is ~4 s on the first kernel's path. Inductor's loader builds it before it submits a kernel: submitting one
    tiny vector kernel that nobody loads builds the header alone (that kernel's own compile, ~0.5 s of a core, never
    runs)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    CppPythonBindingsCodeCache.load_pybinding_async(["const float*", "float*"], _VECTOR_KERNEL)


def _inductor_picks_the_widest_isa(inductor_config: object) -> bool:
    """Whether inductor will take the first ISA of its valid list: no ISA forced by config or environment."""
    cpp = inductor_config.cpp  # type: ignore[attr-defined]
    return cpp.vec_isa_ok is None and cpp.simdlen is None and not os.environ.get("ATEN_CPU_CAPABILITY")


_VECTOR_KERNEL = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const float* in_ptr0, float* out_ptr0)
{
    at::vec::Vectorized<float>::loadu(in_ptr0, static_cast<int64_t>(1)).store(out_ptr0, static_cast<int64_t>(1));
}
"""


def _lower_thread_priority() -> None:
    """Nice this thread, and so the compilers it starts (Linux: a child inherits its thread's nice value), by 10:
    on 2 cores the checks otherwise slowed the foreground's loading, prefill and tracing (trained model, empty
    inductor cache: prefill + first step 14.6-14.7 s with equal priority, 13.1-13.7 s niced)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


# --- a graph's kernels as one shared library per compile worker ----------------------------------------------------

_batching: contextvars.ContextVar[bool] = contextvars.ContextVar("twincache_batched_kernels", default=False)
_install_lock = threading.Lock()
_installed: bool | None = None  # None: not tried yet; False: this torch lacks the internals it wraps
_BATCH_ATTR = "_twincache_kernel_batch"  # on the AsyncCompile object each generated module makes for its kernels
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\(')  # each kernel's one exported function


@contextlib.contextmanager
def batched_kernels() -> Iterator[None]:
    """Within this block, the C++ kernels of each graph inductor compiles for the CPU build as one shared library per
    compile worker, not one apiece. A kernel's compiler run is ~0.5 s, most of it loading the precompiled header; the
    trained model's decode step has 12 kernels: 3.4 s of waiting on two workers, 0.95 s batched (a 2-core Xeon). The
    code and flags are inductor's; each library is cached in inductor's cache dir under the hash of its source, as
    inductor caches its own. On a torch without these internals, or for kernels this cannot wrap, inductor compiles
    them itself."""
    if not _install():
        yield
        return
    token = _batching.set(True)
    try:
        yield
    finally:
        _batching.reset(token)


def _install() -> bool:
    """Wrap inductor's AsyncCompile.cpp_pybinding (a generated module asks for each kernel) and wait (it asks for
    them all at once), once per process; they behave as before outside batched_kernels."""
    global _installed
    if _installed is not None:  # every decode step enters batched_kernels: no lock once decided
        return _installed
    with _install_lock:
        if _installed is None:
            try:
                from torch._inductor.async_compile import AsyncCompile
                from torch._inductor.codecache import CodeCacheFuture, CppPythonBindingsCodeCache
            except ImportError:
                _installed = False
                return False
            wrappable = all(hasattr(owner, name) for owner, name in (
                (AsyncCompile, "cpp_pybinding"), (AsyncCompile, "wait"), (AsyncCompile, "submit"),
                (CppPythonBindingsCodeCache, "load_async")))
            if wrappable:
                _wrap(AsyncCompile, CodeCacheFuture)
            _installed = wrappable  # published once wrapped: the fast path above reads it without the lock
    return bool(_installed)


def _wrap(async_compile: Any, code_cache_future: type) -> None:
    own_pybinding, own_wait = async_compile.cpp_pybinding, async_compile.wait

    class PendingKernel(code_cache_future):
        """A kernel of a batch: what inductor's own wait() resolves, should it see one."""

        def __init__(self, batch: _KernelBatch, index: int) -> None:
            self.batch, self.index = batch, index

        def result(self, timeout: float | None = None) -> Any:
            return self.batch.kernel(self.index)

    def cpp_pybinding(self: Any, argtypes: Sequence[str], source_code: str, *args: Any, **kwargs: Any) -> Any:
        if not _batching.get() or args or kwargs:
            return own_pybinding(self, argtypes, source_code, *args, **kwargs)
        batch = self.__dict__.get(_BATCH_ATTR)
        if batch is None or batch.loaded is not None:  # a module's first kernel (or one asked for after a wait)
            batch = self.__dict__[_BATCH_ATTR] = _KernelBatch(lambda *kernel: own_pybinding(self, *kernel))
        batch.kernels.append((list(argtypes), source_code))
        return PendingKernel(batch, len(batch.kernels) - 1)

    def wait(self: Any, scope: dict[str, Any]) -> None:
        batch = self.__dict__.pop(_BATCH_ATTR, None)
        if batch is not None:  # a module compiled outside batched_kernels has none: inductor's wait alone
            for name, value in list(scope.items()):
                if isinstance(value, PendingKernel) and value.batch is batch:
                    scope[name] = value.result()
        own_wait(self, scope)

    async_compile.cpp_pybinding, async_compile.wait = cpp_pybinding, wait


class _KernelBatch:
    """The CPU kernels one generated module asks for, built together when it waits for the first of them."""

    def __init__(self, compile_alone: Any) -> None:
        self.kernels: list[tuple[list[str], str]] = []  # (argument types, source) in the order inductor asked
        self.compile_alone = compile_alone  # inductor's own cpp_pybinding
        self.loaded: list[Any] | None = None
        self.lock = threading.Lock()

    def kernel(self, index: int) -> Any:
        with self.lock:
            if self.loaded is None:
                try:
                    self.loaded = _compile_together(self.kernels)
                except Exception:  # noqa: BLE001 - inductor's own path, one library each; its errors are its own
                    own = [self.compile_alone(argtypes, source) for argtypes, source in self.kernels]
                    self.loaded = [kernel.result() if hasattr(kernel, "result") else kernel for kernel in own]
        return self.loaded[index]


def _compile_together(kernels: list[tuple[list[str], str]]) -> list[Any]:
    """Each kernel's callable, built as min(compile workers, kernels) shared libraries of similar source sizes,
    compiled side by side on inductor's workers (in this thread when it has none)."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    workers = max(1, get_compile_threads())
    submit = AsyncCompile.submit if workers > 1 else None
    loads = [(members, CppPythonBindingsCodeCache.load_async(library_source([kernels[i] for i in members]), "cpu",
                                                             submit_fn=submit))
             for members in balanced_groups([len(source) for _, source in kernels], workers)]
    loaded: list[Any] = [None] * len(kernels)
    for members, load in loads:
        library = load()
        for entry, index in enumerate(members):
            loaded[index] = getattr(library, f"kernel_{entry}")
    return loaded


def balanced_groups(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """Indices of `sizes` split into at most `groups` non-empty lists of similar totals (largest first, each to the
    lightest list), each list in index order: the same split for the same kernels, so a rebuilt graph hits the cache."""
    count = max(1, min(groups, len(sizes)))
    totals = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = totals.index(min(totals))
        totals[lightest] += sizes[index]
        members[lightest].append(index)
    return [sorted(group) for group in members if group]


def library_source(kernels: Sequence[tuple[Sequence[str], str]]) -> str:
    """One C++ source for a Python extension module `kernel` whose function kernel_<i> runs the i-th kernel, called
    as inductor calls its own single-kernel modules: tensors by data pointer, sizes as ints. Each kernel's code goes
    into its own namespace (their helpers may share names); the #includes that open each source go first, once.
    A source that includes anything further down, or has no single `extern "C" void kernel(`, is refused
    (ValueError): inductor then compiles it alone."""
    includes: list[str] = []
    bodies, methods, entries = [], [], []
    for entry, (argtypes, source) in enumerate(kernels):
        lines = source.splitlines()
        opening = next((n for n, line in enumerate(lines) if line.strip() and not line.startswith("#include")),
                       len(lines))
        includes += [line for line in lines[:opening] if line.startswith("#include") and line not in includes]
        body = "\n".join(lines[opening:])
        if "#include" in body:
            raise ValueError(f"kernel {entry}: an #include after its code; it cannot go inside a namespace")
        if len(_ENTRY.findall(body)) != 1:
            raise ValueError(f"kernel {entry}: expected one extern \"C\" void kernel(...), found "
                             f"{len(_ENTRY.findall(body))}")
        bodies.append(f"namespace twincache_kernel_{entry} {{\n{_ENTRY.sub('void kernel(', body)}\n}}\n")
        parsed = ", ".join(f"parse_arg<{argtype.replace('const ', '')}>(args, {n})"
                           for n, argtype in enumerate(argtypes))
        methods.append(_METHOD.format(entry=entry, arg_len=len(argtypes), parsed=parsed))
        entries.append(f'{{"kernel_{entry}", kernel_{entry}_py, METH_VARARGS, ""}},')
    return "\n".join([*includes, *bodies, _BINDINGS_HEAD, *methods, _MODULE.replace("@ENTRIES@", " ".join(entries))])


# The Python bindings, as inductor writes them for a single kernel (codecache.CppPythonBindingsCodeCache), with one
# function per kernel. Tensors arrive as objects whose data pointer torch's own accessor reads (its address comes in
# the environment variable inductor sets before loading the module).
_BINDINGS_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

static void* (*_twincache_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or long");
    return static_cast<T>(_twincache_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (result == -1 && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, size_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (result == -1.0 && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}
"""
_METHOD = r"""
static PyObject* kernel_{entry}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args)) [[unlikely]] throw std::runtime_error("tuple args required");
        if (PyTuple_GET_SIZE(args) != {arg_len}) [[unlikely]] throw std::runtime_error("requires {arg_len} args");
        twincache_kernel_{entry}::kernel({parsed});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }}
}}
"""
_MODULE = r"""
static PyMethodDef py_methods[] = {@ENTRIES@ {NULL, NULL, 0, NULL}};
static struct PyModuleDef py_module = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, py_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* str_addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!str_addr) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }
    char* endptr = nullptr;
    errno = 0;
    uintptr_t addr = std::strtoull(str_addr, &endptr, 10);
    if (errno != 0 || endptr == str_addr || addr == 0) {
        PyErr_SetString(PyExc_RuntimeError, "Failed to parse _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }
    _twincache_tensor_data_ptr = reinterpret_cast<decltype(_twincache_tensor_data_ptr)>(addr);
    PyObject* module = PyModule_Create(&py_module);
    #ifdef Py_GIL_DISABLED
        if (module != NULL) PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    return module;
}
"""
