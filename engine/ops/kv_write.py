"""Writing K/V into the cache (chapter 08 on; kernels_cu/kv_write.cu).

After RoPE, each token's k and v heads go to the cache row of its slot: slot = page * page_size +
offset in the paged cache (chapter 11), the sequence's slot * max_context + position in the
contiguous one (one page per sequence). Attention then reads them back through the page tables
(engine/ops/paged_attention.py).
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.formats.config import LlamaConfig
from engine.ops.qkv_layout import split_qkv
from engine.plugins import OVERRIDES, cache_function_on_gpu


def kv_write_ref(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping) -> None:
    """k, v [T, Hkv, D] -> the cache rows slot_mapping[t] of k_cache/v_cache [NB, BS, Hkv, D].

    A negative slot is a padding row (a CUDA-graph batch bucket, engine/runtime/cuda_graphs.py): not written."""
    Hkv, D = k_cache.shape[2:]
    slot_mapping = np.asarray(slot_mapping)
    real = slot_mapping >= 0
    if not real.all():
        k, v, slot_mapping = k[real], v[real], slot_mapping[real]
    k_cache.reshape(-1, Hkv, D)[slot_mapping] = k
    v_cache.reshape(-1, Hkv, D)[slot_mapping] = v


def kv_write(qkv, slot_mapping, k_cache, v_cache, config: LlamaConfig) -> None:
    """Store the k and v heads of a QKV buffer [T, (Hq + 2Hkv) * D] (after RoPE) in the cache."""
    plug = OVERRIDES.get("kv_write")             # your stage (engine/plugins.py), if one is active
    if not is_device_array(qkv):
        _, k, v = split_qkv(qkv, config)
        write = kv_write_ref
        if plug is not None:
            write = plug.require_function()
        write(k, v, k_cache, v_cache, np.asarray(slot_mapping))
        return
    if plug is not None and plug.fn is not None:
        cache_function_on_gpu("kv_write")
    T = qkv.shape[0]
    if T:
        kernel = plug.kernel() if plug is not None else load_kernel("kv_write", "kv_write")
        kernel((T,), (128,), (qkv, slot_mapping, k_cache, v_cache, np.int32(config.q_dim), np.int32(config.kv_dim)))
