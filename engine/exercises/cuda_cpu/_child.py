"""One case of a kernel on the CPU executor, in a process of its own (engine/exercises/cuda_cpu).

Run as `python -I -S _child.py KERNEL.so BUFFERS LAUNCH.json` (standard library only, so it starts in
milliseconds): maps the case's buffers (a file the checker also maps), makes the pages between them
inaccessible, checks the kernel's parameter list against the arguments, and launches the grid once
per entry of "launches" (thread order 0, 1, 2, ...). Problems go to stderr as one line
'CUDACPU <kind>: <text>' and a non-zero exit; the kernel's own faults are reported by runtime.cpp.
"""
import ctypes
import json
import mmap
import os
import signal
import sys

KINDS = {0: "a pointer", 1: "an integer", 2: "a floating-point number", 3: "a struct"}


def fail(kind: str, text: str, code: int) -> None:
    sys.stderr.write(f"CUDACPU {kind}: {text}\n")
    sys.stderr.flush()
    os._exit(code)


def describe(arg: dict) -> str:
    if "ptr" in arg:
        return "a pointer (an array)"
    return f"{'an integer' if arg['kind'] == 'i' else 'a floating-point number'} of {arg['size']} bytes ({arg['type']})"


def check_signature(lib, launch: list) -> None:
    sizes, kinds = (ctypes.c_int * 64)(), (ctypes.c_int * 64)()
    n = lib.cudacpu_kernel_signature(sizes, kinds, 64)
    if n != len(launch):
        fail("signature", f"the kernel takes {n} argument(s) but is launched with {len(launch)} (the engine's "
                          "argument list: see the skeleton's signature)", 4)
    for i, arg in enumerate(launch):
        kind, size = kinds[i], sizes[i]
        if "ptr" in arg:
            ok = kind == 0
        else:
            ok = kind == (1 if arg["kind"] == "i" else 2) and size == arg["size"]
        if not ok:
            fail("signature", f"parameter {i + 1} of the kernel is {KINDS.get(kind, 'a value')} of {size} bytes, but "
                              f"the launch passes {describe(arg)} (on a GPU its bytes would be read as the wrong type)", 4)


def main() -> None:
    so, data, desc_path = sys.argv[1:4]
    with open(desc_path) as f:
        desc = json.load(f)
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (desc["memory_limit"], desc["memory_limit"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (desc["print_limit"], desc["print_limit"]))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # printf past the limit fails instead of killing
    except (ImportError, ValueError, OSError):            # a platform without these limits: the time limit still holds
        pass
    fd = os.open(data, os.O_RDWR)
    mm = mmap.mmap(fd, desc["size"])
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for off in desc["guards"]:
        libc.mprotect(base + off, desc["page"], 0)         # PROT_NONE: a stray access faults
    lib = ctypes.CDLL(so)
    if not hasattr(lib, desc["kernel"]):
        fail("nokernel", f"the source has no kernel named {desc['kernel']} (it must be declared extern \"C\" "
                         f"__global__ void {desc['kernel']}(...))", 5)
    grid = (ctypes.c_uint * 3)(*desc["grid"])
    block = (ctypes.c_uint * 3)(*desc["block"])
    message = ctypes.create_string_buffer(4096)
    lib.cudacpu_launch.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    for schedule, launch in enumerate(desc["launches"]):
        if schedule == 0:
            check_signature(lib, launch)
        storage: list = []
        ranges = (ctypes.c_ulonglong * (2 * len(launch)))()
        for i, arg in enumerate(launch):
            value: object
            if "ptr" in arg:
                value = ctypes.c_void_p(base + arg["ptr"])
                ranges[2 * i], ranges[2 * i + 1] = base + arg["ptr"], base + arg["ptr"] + arg["nbytes"]
            else:
                value = ctypes.create_string_buffer(bytes.fromhex(arg["scalar"]), max(arg["size"], 8))
            storage.append(value)
        args = (ctypes.c_void_p * len(launch))(*[ctypes.addressof(v) for v in storage])
        rc = lib.cudacpu_launch(grid, block, args, schedule, ranges, len(launch), message, len(message))
        if rc != 0:
            libc.fflush(None)
            fail("deadlock" if rc == 2 else "launch", message.value.decode(errors="replace"), 6)
    libc.fflush(None)
    os._exit(0)


main()
