"""Small checks every layer shares: what counts as an integer or a real number in user input, and
the ENGINE_* environment switches, read in one place.

A count (max_new_tokens, top_k, max_seqs, ...) is any integer type, NumPy's included, never a bool
(True is not a count) and never a float (3.0 included: one rule for every float, rather than
accepting the integral ones and refusing 3.5).
"""
from __future__ import annotations

import numbers
import os
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
