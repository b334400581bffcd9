"""Chapter 11 (used from chapter 08 on): attention over the KV cache, and writing K/V into it.

The cache of one layer is [num_pages, page_size, Hkv, D]. A sequence's page table lists its
pages; the token at absolute position p lives in page page_table[p // page_size] at offset
p % page_size, i.e. at slot page * page_size + offset. The contiguous cache of chapters 08-10 is
the special case of one page of page_size = max_context per sequence.

Every query row r attends to positions 0..positions[r] of sequence seq_idx[r]: a decode step is one
row per sequence; a prompt appended to a cached prefix is one row per prompt token.
"""
from __future__ import annotations

import functools

import numpy as np

from engine.backend import KERNELS_DIR, is_device_array, load_kernel, load_source, sm_count, tensor_cores_usable
from engine.formats.config import ConfigError, LlamaConfig
from engine.ops.attention import softmax
from engine.ops.qkv_layout import split_qkv
from engine.plugins import OVERRIDES, cache_function_on_gpu, checked_result

NAIVE_SOURCE = KERNELS_DIR / "exercises" / "solutions" / "paged_attention.cu"   # the ladder's first rung
NWARPS = 4          # warps per thread block of kernels_cu/paged_attention.cu (passed to it as -DNWARPS)


def tensor_core_warps(head_dim: int) -> int | None:
    """Warps per block of paged_attention_tc for this head_dim (its K/V pipeline fills 48 KB of shared
    memory: fewer warps for bigger heads), None where it does not apply (its TC_SHAPE_OK)."""
    if head_dim % 16 or head_dim > 128:
        return None
    return NWARPS if head_dim <= 64 else 2


def paged_attention_ref(q, k_cache, v_cache, page_tables, seq_idx, positions, scale: float) -> np.ndarray:
    """q [R, Hq, D] -> [R, Hq, D]; row r attends to positions 0..positions[r] of its sequence."""
    R, Hq, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = np.empty((R, Hq, D), dtype=np.float32)
    for r in range(R):
        ctx = int(positions[r]) + 1
        pages = page_tables[seq_idx[r], : (ctx + BS - 1) // BS]
        if len(pages) == 1:      # one page (always, for a contiguous cache): a view, no copy
            keys, values = k_cache[pages[0], :ctx], v_cache[pages[0], :ctx]    # [ctx, Hkv, D]
        else:                    # gather the pages in table order, then drop the unused tail
            keys = k_cache[pages].reshape(-1, Hkv, D)[:ctx]
            values = v_cache[pages].reshape(-1, Hkv, D)[:ctx]
        qg = q[r].reshape(Hkv, Hq // Hkv, D)                                 # [Hkv, r, D]
        p = softmax(np.einsum("grd,sgd->grs", qg, keys) * np.float32(scale))  # [Hkv, r, ctx]
        out[r] = np.einsum("grs,sgd->grd", p, values).reshape(Hq, D)
    return out


def check_gpu_shape(config: LlamaConfig) -> None:
    """The decode kernel's compile-time shapes (kernels_cu/paged_attention.cu's static_asserts): refuse
    a model the GPU cannot decode when it is loaded, not at its first decode step."""
    D, group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    if not (16 <= D <= 256 and D & (D - 1) == 0) or not 1 <= group <= 8:
        raise ConfigError(f"head_dim {D} with {group} query heads per KV head: the CUDA decode kernel needs a "
                          f"power-of-two head_dim in [16, 256] and at most 8 query heads per KV head "
                          f"(load this model with backend='numpy')")


def choose_splits(rows: int, n_kv_heads: int, max_context: int, n_sms: int) -> int:
    """How many slices of the context each (row, KV head) is cut into.

    With fewer (row, KV head) thread blocks than about one wave (~3 per SM) most SMs would idle, so the
    context is split until there are that many, keeping at least 128 keys per slice so that the
    merge stays cheap. Measured on an H200: 64 sequences x 2,048 keys is fastest unsplit; one
    sequence of 4,096 keys runs ~6x faster with 8+ slices than unsplit.
    """
    blocks = rows * n_kv_heads                   # thread blocks of one split
    wanted = -(-3 * n_sms // blocks)              # ceil
    return int(max(1, min(wanted, -(-max_context // 128), 64)))


def paged_attention(qkv, k_cache, v_cache, page_tables, seq_idx, positions, config: LlamaConfig,
                    max_context: int, splits: int | None = None, tensor_cores: bool | None = None):
    """Attention of every row of qkv [R, (Hq+2Hkv)*D] over the cache -> [R, Hq*D].

    CPU: fp32 reference. GPU: the decode kernel, split along the context (plus the merge kernel) when
    there are too few rows to fill the GPU: paged_attention_tc on the tensor cores where it applies
    (sm_80+, head_dim a multiple of 16 up to 128; `tensor_cores=False` forces the CUDA-core kernel,
    for comparisons). `max_context` bounds positions + 1 (the longest context in the batch: it sizes
    the split).
    """
    scale = config.head_dim ** -0.5
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    R = qkv.shape[0]
    plug = OVERRIDES.get("paged_attention")      # your stage (engine/plugins.py), if one is active
    if not is_device_array(qkv):
        q, _, _ = split_qkv(qkv, config)
        if plug is not None:
            attend = plug.require_function()
            got = attend(q.copy(), k_cache, v_cache, page_tables, seq_idx, positions, scale)
            return checked_result("paged_attention", got, q.shape).reshape(R, -1)
        return paged_attention_ref(q, k_cache, v_cache, page_tables, seq_idx, positions, scale).reshape(R, -1)
    if plug is not None:
        if plug.fn is not None:
            cache_function_on_gpu("paged_attention")
        splits = 1                                   # your kernel runs alone: no merge of split slices
    import cupy as cp
    out = cp.empty((R, Hq * D), dtype=cp.uint16)
    if R == 0:
        return out
    if splits is None:
        splits = choose_splits(R, Hkv, max_context, sm_count(cp.cuda.Device().id))
    warps = tensor_core_warps(D) if plug is None and tensor_cores is not False else None
    if warps is not None and not tensor_cores_usable(cp.cuda.Device().id):
        warps = None
    name = "paged_attention" if warps is None else "paged_attention_tc"
    warps = warps or NWARPS
    kernel_args = dict(HEAD_DIM=D, GROUP=Hq // Hkv, NWARPS=warps)
    if splits > 1:
        part_ml = cp.empty((R, Hq, splits, 2), dtype=cp.float32)
        part_acc = cp.empty((R, Hq, splits, D), dtype=cp.float32)
    else:
        part_ml = part_acc = cp.empty(1, dtype=cp.float32)   # unused
    kernel = plug.kernel(**kernel_args) if plug is not None else load_kernel("paged_attention", name, **kernel_args)
    kernel((R, Hkv, splits), (32 * warps,), _kernel_args(qkv, k_cache, v_cache, page_tables, seq_idx, positions,
                                                         config, out, part_ml, part_acc))
    if splits > 1:
        load_kernel("paged_attention", "paged_attention_merge", **kernel_args)(
            (R, Hq), (D,), (part_ml, part_acc, np.int32(splits), out, np.int64(Hq * D)))
    return out


def _kernel_args(qkv, k_cache, v_cache, page_tables, seq_idx, positions, config: LlamaConfig, out, part_ml, part_acc):
    """The argument tuple of paged_attention and of the naive rung (chapter 11's exercise kernel)."""
    scale_log2e = config.head_dim ** -0.5 * np.log2(np.e)
    return (qkv, np.int64(qkv.shape[1]), k_cache, v_cache, page_tables, np.int32(page_tables.shape[1]),
            seq_idx, positions, np.int32(k_cache.shape[1]), np.int32(config.num_key_value_heads),
            np.float32(scale_log2e), out, np.int64(config.q_dim), part_ml, part_acc)


def paged_attention_naive(qkv, k_cache, v_cache, page_tables, seq_idx, positions, config: LlamaConfig):
    """The ladder's first rung on the GPU (kernel_bench compares it with `paged_attention`): chapter
    11's worked solution (NAIVE_SOURCE), one warp per query head, keys one at a time, no split. Same
    arguments and result as paged_attention."""
    import cupy as cp
    R, Hkv = qkv.shape[0], config.num_key_value_heads
    out = cp.empty((R, config.q_dim), dtype=cp.uint16)
    if R:
        unused = cp.empty(1, dtype=cp.float32)
        _naive_kernel(config.head_dim, config.num_attention_heads // Hkv)(
            (R, Hkv, 1), (32 * NWARPS,), _kernel_args(qkv, k_cache, v_cache, page_tables, seq_idx, positions, config,
                                              out, unused, unused))
    return out


@functools.cache
def _naive_kernel(head_dim: int, group: int):
    defines = (("GROUP", group), ("HEAD_DIM", head_dim), ("NWARPS", NWARPS))
    return load_source(NAIVE_SOURCE.read_text(), NAIVE_SOURCE, defines).get_function("paged_attention")
