"""The CPU executor: a learner's CUDA kernel compiled and run without a GPU, for the same checker.

On a machine without a usable GPU, `engine.exercises.cuda_check.check_kernel` goes through here:

  1. the GPU compile check: the kernel is compiled for the GPU with NVRTC (libnvrtc found through
     CuPy's or NVIDIA's wheels, CUDA_PATH or the loader; it needs no GPU) or, without it, with
     `nvcc -ptx`; the engine's options, so compile errors are the ones a GPU would give, at the
     learner's file and line. Neither found: the host compiler's errors are shown instead, and the
     message says so;
  2. the CPU build: the host C++ compiler (c++ / g++ / clang++, or $CXX) compiles the same source
     against cuda_cpu.h (threadIdx and friends, __shared__, a real __syncthreads, warp shuffles,
     atomics, bf16 with round-to-nearest-even) into a shared library with the scheduler of
     runtime.cpp: a block's threads are fibers, blocks run one after another;
  3. each case runs in a child process (a time limit, a memory limit, buffers between inaccessible
     pages): the same inputs and argument tuple as on the GPU, the output poisoned with NaN bits and
     followed by the poisoned guard, three launches in three thread orders (in order, reversed,
     shuffled), so that a race shows as results that change from one launch to the next. The
     checker's `diagnose` reads the result exactly as it reads a GPU's.

It measures no speed: a CPU emulating thousands of threads says nothing about a GPU.
"""
from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine import gpu_compile

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_cpu.h"
RUNTIME = HERE / "runtime.cpp"
INCLUDE = HERE / "include"
CHILD = HERE / "_child.py"
CXX_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-fdiagnostics-color=never",
             "-fmax-errors=8")
TIMEOUT_S = 30.0                  # per case (three launches); an endless loop is stopped here
MEMORY_LIMIT = 4 << 30            # address space of a case's process, beyond its buffers
PRINT_LIMIT = 1 << 20             # bytes of the kernel's printf output kept
LAUNCHER = "<cpu executor launcher>"


class CpuBuildError(RuntimeError):
    """The host compiler rejected a kernel that the GPU compile check accepted (or could not run)."""


# ----------------------------------------------------------------------------------------------
# What is available here
# ----------------------------------------------------------------------------------------------

def _cxx() -> str:
    """The host compiler (callers have checked unavailable_reason())."""
    cxx = host_compiler()
    if cxx is None:
        raise CpuBuildError(unavailable_reason() or "no host C++ compiler")
    return cxx


@functools.cache
def host_compiler() -> str | None:
    for name in filter(None, (os.environ.get("CXX"), "c++", "g++", "clang++")):
        path = shutil.which(name)
        if path:
            return path
    return None


def unavailable_reason() -> str | None:
    """None when kernels can run on the CPU executor here, else why not (one sentence)."""
    if os.name != "posix":
        return "the CPU executor needs Linux or macOS (its threads are POSIX ucontext fibers)."
    if host_compiler() is None:
        return "no host C++ compiler was found (c++, g++ or clang++; or set CXX)."
    return None


def gpu_compiler() -> str | None:
    """"NVRTC", "nvcc" or None: what checks the kernel for the GPU here (engine/gpu_compile.py)."""
    return gpu_compile.compiler()


# ----------------------------------------------------------------------------------------------
# 1. The GPU compile check
# ----------------------------------------------------------------------------------------------

def _gpu_options(defines: dict, kernels_dir: Path) -> list[str]:
    from engine.backend import NVRTC_OPTIONS
    return [*NVRTC_OPTIONS, f"-I{kernels_dir}", *(f"-D{k}={v}" for k, v in sorted(defines.items()))]


def compile_for_gpu(text: str, shown: str, defines: dict) -> tuple[str | None, str | None]:
    """(the tool that checked it or None, the compile error formatted as the GPU path formats it or None)."""
    from engine.backend import KERNELS_DIR, _point_at_source
    tool = gpu_compiler()
    if tool == "NVRTC":
        log = gpu_compile.nvrtc_log(text, _gpu_options(defines, KERNELS_DIR) + [f"-I{gpu_compile.cuda_include()}"])
    elif tool == "nvcc":
        log = gpu_compile.nvcc_log(text, _gpu_options(defines, KERNELS_DIR))
    else:
        return None, None
    return tool, (None if log is None else _point_at_source(log, shown))


# ----------------------------------------------------------------------------------------------
# 2. The CPU build
# ----------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = Path(os.environ.get("ENGINE_CUDA_CPU_CACHE") or Path(tempfile.gettempdir()) / f"llm-engine-cuda-cpu-{uid}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


@functools.cache
def _compiler_id() -> str:
    try:
        return subprocess.run([_cxx(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return str(host_compiler())


@functools.cache
def _kernel_flags() -> tuple[str, ...]:
    """-fstack-clash-protection where the compiler has it: a thread's large local array then touches
    every page it allocates, so a stack overflow lands on the guard page below the stack (and is
    named) instead of on another thread's stack."""
    with tempfile.TemporaryDirectory(prefix="cuda_cpu_probe_") as tmp:
        (Path(tmp) / "probe.cpp").write_text("int probe() { return 0; }\n")
        r = _run_compiler([_cxx(), "-fstack-clash-protection", "-Werror", "-c", "probe.cpp", "-o", "probe.o"], Path(tmp))
    return ("-fstack-clash-protection",) if r.returncode == 0 else ()


def _run_compiler(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", "error: the host compiler did not finish within 300 s")


def _runtime_object() -> Path:
    """runtime.cpp compiled once per compiler and source (shared by every kernel)."""
    key = _digest(RUNTIME.read_bytes(), HEADER.read_bytes(), _compiler_id(), CXX_FLAGS)
    obj = cache_dir() / f"runtime-{key}.o"
    if not obj.is_file():
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        r = _run_compiler([_cxx(), *CXX_FLAGS, "-c", f"-I{HERE}", str(RUNTIME), "-o", str(tmp)], cache_dir())
        if r.returncode != 0:
            raise CpuBuildError(f"the CPU executor's runtime does not compile with {host_compiler()}:\n{r.stderr}")
        os.replace(tmp, obj)
    return obj


def launcher(kernel: str) -> str:
    return (f'extern "C" __attribute__((visibility("default"))) void cudacpu_entry(void** a) {{ cudacpu_invoke({kernel}, a); }}\n'
            f'extern "C" __attribute__((visibility("default"))) int cudacpu_kernel_signature(int* s, int* k, int cap) '
            f'{{ return cudacpu_signature({kernel}, s, k, cap); }}\n')


def build(text: str, shown: str, kernel: str, defines: dict) -> Path:
    """The kernel compiled for the CPU executor: the path of its shared library (cached by content).

    Raises KernelCompileError (the message names shown(line), as a GPU compile error does),
    LookupError (no kernel of that name) or CpuBuildError (the executor itself cannot build)."""
    from engine.backend import KERNELS_DIR, KernelCompileError
    if re.search(r"\bextern\s+__shared__", text):
        raise CpuBuildError("the CPU executor runs no kernel with dynamic shared memory (extern __shared__): "
                            "declare the array with a fixed size")
    runtime = _runtime_object()
    flags = [*CXX_FLAGS, *_kernel_flags(), "-include", str(HEADER), f"-I{INCLUDE}", f"-I{KERNELS_DIR}",
             *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    key = _digest(text, kernel, flags, runtime.name, _include_texts(text, KERNELS_DIR))
    so = cache_dir() / f"kernel-{key}.so"
    _PARAMS[so] = parse_params(text, kernel)
    if so.is_file():
        return so
    with tempfile.TemporaryDirectory(prefix="cuda_cpu_build_") as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(f'#line 1 "{shown}"\n{text}\n#line 1 "{LAUNCHER}"\n{launcher(kernel)}')
        out = Path(tmp) / "kernel.so"
        r = _run_compiler([_cxx(), *flags, "-shared", str(src), str(runtime), "-o", str(out)], Path(tmp))
        if r.returncode != 0:
            log = r.stderr
            if re.search(rf"{re.escape(LAUNCHER)}:\d+:\d+: error: .*\b{re.escape(kernel)}\b", log):
                raise LookupError(f"{shown} has no kernel named {kernel} (it must be declared "
                                  f"extern \"C\" __global__ void {kernel}(...))")
            raise KernelCompileError(format_host_log(log, shown))
        tmp_so = so.with_suffix(f".{os.getpid()}.tmp.so")
        shutil.copyfile(out, tmp_so)
        os.replace(tmp_so, so)
    return so


def _include_texts(text: str, kernels_dir: Path) -> str:
    """The texts of the headers a source includes from kernels_cu/ (a changed common.cuh rebuilds)."""
    names = re.findall(r'#\s*include\s*"([^"]+)"', text)
    return "".join((kernels_dir / n).read_text() for n in names if (kernels_dir / n).is_file())


_LOCATION = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?:(?P<col>\d+):)? "
                       r"(?P<kind>fatal error|error|warning|note): (?P<msg>.*)$")
_NOISE = re.compile(r"^(In file included from|\s+from |\S+: In (function|instantiation))")


def format_host_log(log: str, shown: str) -> str:
    """The host compiler's errors as the GPU path shows NVRTC's: 'shown(line): error: ...' first, the
    source line and caret kept, the executor's own file names replaced by what they are."""
    out, head = [], None
    for line in log.splitlines():
        if _NOISE.match(line):
            continue
        m = _LOCATION.match(line)
        if m:
            where = m["file"]
            where = "cuda_cpu.h" if where.endswith("cuda_cpu.h") else where
            line = f"{where}({m['line']}): {m['kind']}: {m['msg']}"
            if head is None and m["kind"] in ("error", "fatal error") and m["file"] == shown:
                head = line
        out.append(line)
    if head is None:
        head = next((ln for ln in out if ": error" in ln), out[0] if out else "unknown error")
    return f"{shown} failed to compile: {head}\n" + "\n".join(out)


# ----------------------------------------------------------------------------------------------
# 3. Running a case
# ----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    runs: list            # raw output bits of each launch (as cuda_check's GPU path returns them)
    crash: str | None     # why the launches stopped (a fault, a deadlock, a time-out), or None
    printed: str          # what the kernel printed (printf), cut at PRINT_LIMIT


class _Layout:
    """The buffers of one case in one shared file, each between inaccessible pages."""

    def __init__(self):
        self.page = mmap.PAGESIZE
        self.size = self.page                     # a guard page first
        self.guards = [0]
        self.slots: list[tuple[int, int]] = []    # (offset, nbytes)

    def add(self, nbytes: int) -> int:
        span = -(-max(nbytes, 1) // self.page) * self.page
        end = self.size + span
        offset = end - (-(-max(nbytes, 1) // 256) * 256)   # 256-byte aligned, its end against the next guard page
        self.slots.append((offset, nbytes))
        self.guards.append(end)
        self.size = end + self.page
        return offset


def run_case(so: Path, kernel: str, case, runs: int, poison, bits_dtype, timeout: float | None = None) -> Outcome:
    """Launch the kernel `runs` times (thread orders 0, 1, 2, ...) on a case in a child process."""
    timeout = TIMEOUT_S if timeout is None else timeout
    n = case.want.size
    guard = max(4096, n // 4)
    out_nbytes = (n + guard) * np.dtype(bits_dtype).itemsize
    layout = _Layout()
    inputs = {name: np.ascontiguousarray(a) for name, a in case.inputs.items()}
    offsets = {name: layout.add(a.nbytes) for name, a in inputs.items()}
    out_offsets = [layout.add(out_nbytes) for _ in range(runs)]
    with tempfile.TemporaryDirectory(prefix="cuda_cpu_case_") as tmp:
        data_path = Path(tmp) / "buffers"
        with open(data_path, "wb") as f:
            f.truncate(layout.size)
        fd = os.open(data_path, os.O_RDWR)
        mm = mmap.mmap(fd, layout.size)
        os.close(fd)
        try:
            whole = np.frombuffer(mm, dtype=np.uint8)
            base = whole.ctypes.data
            dev = {name: whole[offsets[name]:offsets[name] + a.nbytes].view(a.dtype).reshape(a.shape)
                   for name, a in inputs.items()}
            for name, a in inputs.items():
                dev[name][...] = a
            outs = [whole[off:off + out_nbytes].view(bits_dtype) for off in out_offsets]
            for out in outs:
                out[...] = poison
            launches = [_describe_args(case.args({**dev, "out": out[:n].reshape(case.want.shape)}), base, layout.size)
                        for out in outs]
            desc = {"kernel": kernel, "grid": _dim3(case.grid), "block": _dim3(case.block), "launches": launches,
                    "guards": layout.guards, "page": layout.page, "size": layout.size,
                    "memory_limit": MEMORY_LIMIT + layout.size, "print_limit": PRINT_LIMIT}
            crash, printed = _run_child(so, data_path, desc, Path(tmp), timeout, _PARAMS.get(so, []))
            results = [np.array(b) for b in outs]
            del whole, dev, outs, out        # the views of the mapping, before it closes
        finally:
            _close(mm)
    return Outcome(results if crash is None else [], crash, printed)


def _close(mm) -> None:
    try:
        mm.close()
    except BufferError:   # a view still alive somewhere: the mapping goes with it
        pass


def _dim3(v) -> list[int]:
    v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return [int(x) for x in (*v, 1, 1, 1)[:3]]


def _describe_args(args: tuple, base: int, size: int) -> list[dict]:
    """Each argument as the child passes it: a buffer (offset, bytes) or a scalar (its bytes)."""
    out: list[dict] = []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            off = a.ctypes.data - base
            if not (0 <= off <= size) or not a.flags.c_contiguous:
                raise ValueError(f"argument {i + 1} is an array outside the case's buffers (or not contiguous)")
            out.append({"ptr": off, "nbytes": int(a.nbytes)})
        elif isinstance(a, np.generic):
            kind = "f" if np.issubdtype(a.dtype, np.floating) else "i"
            out.append({"scalar": np.asarray(a).tobytes().hex(), "size": a.dtype.itemsize, "kind": kind,
                        "type": a.dtype.name})
        else:
            raise TypeError(f"argument {i + 1} is a {type(a).__name__}: pass numpy scalars (np.int32, np.float32, ...) "
                            "and arrays, as a CUDA launch needs")
    return out


_PARAMS: dict[Path, list[str]] = {}      # a built kernel's parameter names (read by `build`, for fault messages)


def parse_params(text: str, kernel: str) -> list[str]:
    """The names of the parameters of `kernel`'s definition in a CUDA source ([] when not found)."""
    m = re.search(rf"__global__[^;{{]*?\b{re.escape(kernel)}\s*\(([^)]*)\)", re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S))
    if not m:
        return []
    return [(re.findall(r"\w+", p) or ["?"])[-1] for p in m[1].split(",") if p.strip()]


def _run_child(so: Path, data: Path, desc: dict, tmp: Path, timeout: float, names=()) -> tuple[str | None, str]:
    desc_path = tmp / "launch.json"
    desc_path.write_text(json.dumps(desc))
    out_path, err_path = tmp / "stdout", tmp / "stderr"
    cmd = [sys.executable, "-I", "-S", str(CHILD), str(so), str(data), str(desc_path)]
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return (f"it did not finish within {timeout:.0f} s on the CPU executor (three launches): an endless loop? "
                    "(a loop whose index never advances, e.g. a stride of 0, or a while loop whose condition never "
                    "changes)"), _head(out_path)
    printed, errors = _head(out_path), _head(err_path)
    if proc.returncode == 0:
        return None, printed
    return _crash_text(proc.returncode, errors, names), printed


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _head(path: Path, limit: int = PRINT_LIMIT) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _crash_text(code: int, errors: str, names=()) -> str:
    lines = [ln for ln in errors.splitlines() if ln.startswith("CUDACPU ")]
    if lines:
        kind, _, text = lines[-1][len("CUDACPU "):].partition(": ")
        if kind == "fault":
            m = re.search(r"(past the end of|before the start of) argument (\d+)$", text)
            if m:
                k = int(m[2])
                name = f" ({names[k - 1]})" if 0 < k <= len(names) else ""
                text += (f"{name}: an index out of range, most likely a missing bounds check (`if (i < n)`) or a "
                         "wrong stride or offset")
            return f"the kernel crashed on the CPU executor: {text}"
        if kind == "deadlock":
            return f"the kernel cannot go on: {text}"
        if kind in ("nokernel", "signature", "launch"):
            return text
        return f"the kernel stopped on the CPU executor ({kind}: {text})"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = f" (out of memory? a case's process may use {MEMORY_LIMIT >> 30} GiB)" if name == "SIGKILL" else ""
        return f"the kernel's process was killed by {name}{why}"
    tail = errors.strip().splitlines()[-3:] if errors.strip() else []
    return f"the kernel's process exited with status {code}" + (f": {' / '.join(tail)}" if tail else "")

