"""Small checks every layer shares: what counts as an integer or a real number in user input, and
the ENGINE_* environment switches, read in one place.

A count (max_new_tokens, top_k, max_seqs, ...) is any integer type, NumPy's included, never a bool
(True is not a count) and never a float (3.0 included: one rule for every float, rather than
accepting the integral ones and refusing 3.5).
"""
from __future__ import annotations

import numbers
import os
import stat
from typing import TypeGuard

import numpy as np

# The switches, each "0" / "false" / "off" / "no" to turn off (anything else, or unset: on):
#   ENGINE_CUDA_GRAPHS        decode steps replayed as CUDA graphs (engine/runtime/cuda_graphs.py)
#   ENGINE_ASYNC_SCHEDULING   the engine loop schedules step N+1 while the GPU runs step N
#   ENGINE_GEMV               the engine's GEMV kernel for small-batch linears (engine/ops/linear.py)
# and the paths: ENGINE_CACHE_DIR, ENGINE_MODEL_DIR (engine/model/default_model.py),
# ENGINE_KERNELS_DIR (engine/backend.py).
OFF = ("0", "false", "off", "no")


def env_switch(name: str) -> bool:
    """An on/off ENGINE_* switch: on unless the variable says one of OFF."""
    return os.environ.get(name, "1").strip().lower() not in OFF


def is_int(v) -> TypeGuard[int]:
    """A Python or NumPy integer, not a bool. (For the type checker: usable as an int.)"""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> TypeGuard[float]:
    """A Python or NumPy real number (integers included), not a bool. (For the type checker: a float.)"""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


# ---- untrusted files ---------------------------------------------------------------------------

def path_exists(path) -> bool:
    """Anything at path, a dangling link or a FIFO included (Path.is_file() would skip those silently:
    what is there is then checked by read_regular_file)."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def read_regular_file(path, cap: int, error: type[Exception], what: str = "the file") -> bytes:
    """The bytes of a regular file of at most `cap` bytes, else `error` naming the path and the problem.
    Checked with fstat on the opened descriptor (O_NONBLOCK: opening a FIFO does not wait for a
    writer), so a FIFO, a device (a link to /dev/zero) or a directory is refused before a byte is read,
    and a file growing meanwhile is cut at cap + 1."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{path}: cannot open {what}: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: {what} is not a regular file (a FIFO, device, socket or directory); "
                        "refusing to read it")
        if info.st_size > cap:
            raise error(f"{path}: {what} is {info.st_size:,} bytes; the limit is {cap:,}")
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if size > cap:
        raise error(f"{path}: {what} grew past the {cap:,}-byte limit while being read")
    return b"".join(chunks)
