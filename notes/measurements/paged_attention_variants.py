"""Time the paged decode-attention kernel for pipeline-stages x unroll x split variants (GPU; python notes/measurements/paged_attention_variants.py)."""
import cupy as cp
import numpy as np

import engine.ops.paged_attention as PA
from engine.backend import load_kernel
from engine.config import config_from_dict
from engine.kernel_bench import Bench

b = Bench(False)
cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 2048, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64})
for S, ctx in [(64, 2048), (1, 4096), (256, 1024)]:
    mb = ctx // 16; NB = S * mb
    tables = cp.asarray(np.random.default_rng(0).permutation(NB).astype(np.int32).reshape(S, mb))
    kc, vc = b.bf16(NB, 16, 8, 64)[0], b.bf16(NB, 16, 8, 64)[0]     # random data, never zeros
    qkv = b.bf16(S, cfg.qkv_dim)[0]
    seq = cp.arange(S, dtype=cp.int32); pos = cp.full(S, ctx - 1, dtype=cp.int32)
    kv_bytes = S * ctx * 8 * 64 * 4
    for stages, unroll in ((2, 2), (3, 2), (4, 2), (5, 1)):   # (3, 4) needs more than 48 KB of static smem
        PA.load_kernel = lambda st, name, **d: load_kernel(st, name, STAGES=stages, UNROLL=unroll, **d)
        for sp in ((None,) if S > 1 else (None, 8)):
            ms = b.time_ms(lambda: PA.paged_attention(qkv, kc, vc, tables, seq, pos, cfg, ctx, splits=sp))
            print(f"S={S} ctx={ctx} stages={stages} unroll={unroll} splits={sp or 'auto'}: {ms*1e3:.1f} us {kv_bytes/ms/1e6:.0f} GB/s ({100*kv_bytes/ms/1e6/b.copy_gbps:.0f}% of copy)")
