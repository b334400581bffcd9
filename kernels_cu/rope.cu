// Chapter 05: rotary position embedding in Hugging Face's rotate-half layout.
// For a head vector x of size D and position p, with c = cos[p, i], s = sin[p, i], i < D/2:
//   y[i]       = x[i] * c - x[i + D/2] * s
//   y[i + D/2] = x[i + D/2] * c + x[i] * s
// Input: the fp32 output of the fused QKV projection, [T, (Hq + 2*Hkv) * D] (q heads, k heads, v heads).
// Output: the same layout in bf16, q and k rotated, v copied: what attention and the cache read.
// Thread layout: one block per token, threads over (head, i) pairs: consecutive threads touch
// consecutive i of one head, so the loads of x[i] and x[i + D/2] are both coalesced.
#include "common.cuh"

extern "C" __global__ void rope_qkv(const float* __restrict__ qkv,      // [T, (Hq+2Hkv)*D]
                                     const int* __restrict__ positions,  // [T] absolute positions
                                     const float* __restrict__ cos_tab,  // [P, D/2]
                                     const float* __restrict__ sin_tab,  // [P, D/2]
                                     bf16* __restrict__ out,             // [T, (Hq+2Hkv)*D]
                                     int n_rot_heads,                    // Hq + Hkv (heads that rotate)
                                     int n_heads_total,                  // Hq + 2*Hkv
                                     int D) {
    const int t = blockIdx.x, half = D / 2;
    const long long row = (long long)t * n_heads_total * D;
    const float* c = cos_tab + (long long)positions[t] * half;
    const float* s = sin_tab + (long long)positions[t] * half;
    for (int j = threadIdx.x; j < n_rot_heads * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        const long long base = row + (long long)h * D;
        const float x1 = qkv[base + i], x2 = qkv[base + i + half];
        out[base + i] = f2bf(x1 * c[i] - x2 * s[i]);
        out[base + i + half] = f2bf(x2 * c[i] + x1 * s[i]);
    }
    const int n_v = (n_heads_total - n_rot_heads) * D;   // v heads: plain fp32 -> bf16 copy
    const long long vbase = row + (long long)n_rot_heads * D;
    for (int j = threadIdx.x; j < n_v; j += blockDim.x) out[vbase + j] = f2bf(qkv[vbase + j]);
}
