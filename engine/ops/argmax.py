"""Chapter 07: greedy decoding picks the largest logit of each row."""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel

THREADS = 1024     # threads per row; a power of two (kernels_cu/argmax.cu's tree reduction checks it)


def argmax_rows(logits):
    """logits [R, V] float32 -> int32 [R] (first index on ties). GPU: stays on the device."""
    if not is_device_array(logits):
        return np.argmax(logits, axis=-1).astype(np.int32)
    import cupy as cp
    R, V = logits.shape
    out = cp.empty(R, dtype=cp.int32)
    if R:
        load_kernel("argmax", "argmax_rows", THREADS=THREADS)((R,), (THREADS,), (logits, out, np.int32(V)))
    return out
