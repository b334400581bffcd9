// Chapter 11: write the K and V of new tokens into the cache, one slot per token.
// The cache of one layer is [num_pages, page_size, Hkv, D]; a token's slot is
// page * page_size + offset (the slot mapping the scheduler computes from the page table),
// so the destination row is simply cache + slot * Hkv * D. A contiguous per-sequence cache is the
// special case page_size = max_context, one page per sequence.
// A negative slot marks a padding row of a CUDA-graph batch bucket (engine/graph_runner.py): nothing
// is written for it.
// Thread layout: one block per token; threads copy 4-byte pairs of bf16 along the K row and the V row.
#include "common.cuh"

extern "C" __global__ void kv_write(const bf16* __restrict__ qkv,           // [T, (Hq+2Hkv)*D] after RoPE
                                     const int* __restrict__ slot_mapping,    // [T]
                                     bf16* __restrict__ k_cache,              // [NB*BS, Hkv*D]
                                     bf16* __restrict__ v_cache,              // [NB*BS, Hkv*D]
                                     int q_dim, int kv_dim) {                 // Hq*D, Hkv*D (even)
    const int t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;                                                    // a padding row
    const long long row = (long long)t * (q_dim + 2 * kv_dim);
    const unsigned* k_src = reinterpret_cast<const unsigned*>(qkv + row + q_dim);
    const unsigned* v_src = reinterpret_cast<const unsigned*>(qkv + row + q_dim + kv_dim);
    unsigned* k_dst = reinterpret_cast<unsigned*>(k_cache + slot * kv_dim);
    unsigned* v_dst = reinterpret_cast<unsigned*>(v_cache + slot * kv_dim);
    for (int i = threadIdx.x; i < kv_dim / 2; i += blockDim.x) {
        k_dst[i] = k_src[i];
        v_dst[i] = v_src[i];
    }
}
