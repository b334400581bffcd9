// Worked solution of kernels_cu/exercises/kv_write.cu (chapter 11): see the skeleton for the layout.
// The engine's kernels_cu/kv_write.cu moves two bf16 (4 bytes) per thread and step.
#include "common.cuh"

extern "C" __global__ void kv_write(const bf16* __restrict__ qkv,           // [T, q_dim + 2*kv_dim]
                                     const int* __restrict__ slot_mapping,    // [T]
                                     bf16* __restrict__ k_cache,              // [pages*page_size, kv_dim]
                                     bf16* __restrict__ v_cache,              // [pages*page_size, kv_dim]
                                     int q_dim, int kv_dim) {
    const int t = blockIdx.x;
    const bf16* k_src = qkv + (long long)t * (q_dim + 2 * kv_dim) + q_dim;   // skip the q heads
    const bf16* v_src = k_src + kv_dim;
    const long long dst = (long long)slot_mapping[t] * kv_dim;                // the slot, not t
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        k_cache[dst + i] = k_src[i];
        v_cache[dst + i] = v_src[i];
    }
}
