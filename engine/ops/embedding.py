"""Chapter 03: embedding gather, token ids -> rows of the embedding table.

An id outside [0, V) has no row. Ids that come from the host are refused here with a ValueError;
ids already on the GPU cannot be read without a sync, so the kernel never reads out of bounds and
fills such a token's row with NaN instead: the non-finite logits it leads to are refused by the
sampler (engine/runtime/sampling_params.py), naming the request and the step.
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.plugins import OVERRIDES, run_function


def check_ids(ids, vocab_size: int) -> None:
    """Raise ValueError unless every id has a row in a table of vocab_size rows."""
    ids = np.asarray(ids)
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be integers in [0, {vocab_size}), got {ids.dtype} "
                         f"min {ids.min()} max {ids.max()}")


def embedding_ref(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids [T] int, table [V, H] -> [T, H] float32 (a row lookup, nothing more)."""
    check_ids(ids, table.shape[0])          # NumPy would wrap -1 to the last row silently
    return table[np.asarray(ids)].astype(np.float32, copy=False)


def embedding(ids, table):
    """Same as embedding_ref; on the GPU table is bf16 [V, H] and the result the fp32 residual stream."""
    plug = OVERRIDES.get("embedding")            # your stage (engine/plugins.py), if one is active
    if plug is not None and plug.fn is not None:
        return run_function(plug, (len(ids), table.shape[1]), False, table, ids, table)
    if not is_device_array(table):
        if plug is not None:
            plug.require_function()
        return embedding_ref(ids, table)
    import cupy as cp
    if not is_device_array(ids):
        check_ids(ids, table.shape[0])
    ids = cp.asarray(ids, dtype=cp.int32)              # [T]
    T, (V, H) = ids.shape[0], table.shape
    out = cp.empty((T, H), dtype=cp.float32)          # [T, H]
    if T:
        # an id outside [0, V) that never left the device is never read: its row comes out NaN
        kernel = plug.kernel() if plug is not None else load_kernel("embedding", "embedding_gather")
        kernel((T,), (128,), (ids, table, out, np.int32(V), np.int32(H)))
    return out
