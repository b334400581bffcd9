"""Time the paged decode-attention kernel over its tuning knobs (GPU): pipeline stages x unroll x warps
per block x min blocks per SM, at 64 x 2,048 keys and at a mixed batch of 256 rows (100..2,048 keys).
    python notes/measurements/paged_attention_variants.py"""
import itertools

import cupy as cp
import numpy as np

import engine.ops.paged_attention as PA
from engine.backend import load_kernel
from engine.config import config_from_dict
from engine.kernel_bench import Bench

b = Bench(False)
cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 2048, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64})
mixed = [int(n) for n in np.random.default_rng(1).integers(100, 2049, 256)]
for name, ctxs in (("64x2048", [2048] * 64), ("mixed256", mixed)):
    S = len(ctxs)
    mb = max(-(-c // 16) for c in ctxs); NB = S * mb
    tables = cp.asarray(np.random.default_rng(0).permutation(NB).astype(np.int32).reshape(S, mb))
    kc, vc = b.bf16(NB, 16, 8, 64)[0], b.bf16(NB, 16, 8, 64)[0]     # random data, never zeros
    qkv = b.bf16(S, cfg.qkv_dim)[0]
    seq = cp.arange(S, dtype=cp.int32); pos = cp.asarray(np.array(ctxs, np.int32) - 1)
    kv_bytes = sum(ctxs) * 8 * 64 * 4
    for stages, unroll, nwarps, min_blocks in itertools.product((2, 3), (2, 4), (4, 8), (1, 3)):
        if nwarps * stages * unroll * 2 * 32 * 16 > 48 * 1024:
            continue                                                   # static shared memory cap
        PA.NWARPS = nwarps
        PA.load_kernel = lambda st, kn, **d: load_kernel(st, kn, **{**d, "NWARPS": nwarps, "STAGES": stages,
                                                                   "UNROLL": unroll, "MIN_BLOCKS": min_blocks})
        try:
            ms = b.time_ms(lambda: PA.paged_attention(qkv, kc, vc, tables, seq, pos, cfg, max(ctxs)))
        except Exception as e:                                          # e.g. too many registers for MIN_BLOCKS
            print(f"{name} stages={stages} unroll={unroll} nwarps={nwarps} min_blocks={min_blocks}: {type(e).__name__}")
            continue
        print(f"{name} stages={stages} unroll={unroll} nwarps={nwarps} min_blocks={min_blocks}: {ms*1e3:.1f} us "
              f"{kv_bytes/ms/1e6:.0f} GB/s ({100*kv_bytes/ms/1e6/b.copy_gbps:.0f}% of copy)")
