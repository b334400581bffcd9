// Worked solution of kernels_cu/exercises/rope.cu (chapter 05): see the skeleton for the layout.
#include "common.cuh"

extern "C" __global__ void rope_qkv(const float* __restrict__ qkv,      // [T, (Hq+2Hkv)*D]
                                     const int* __restrict__ positions,  // [T]
                                     const float* __restrict__ cos_tab,  // [P, D/2]
                                     const float* __restrict__ sin_tab,  // [P, D/2]
                                     bf16* __restrict__ out,             // [T, (Hq+2Hkv)*D]
                                     int n_rot_heads, int n_heads_total, int D) {
    const int t = blockIdx.x, half = D / 2;
    const long long row = (long long)t * n_heads_total * D;
    const float* c = cos_tab + (long long)positions[t] * half;   // the token's position, not t
    const float* s = sin_tab + (long long)positions[t] * half;
    for (int j = threadIdx.x; j < n_rot_heads * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        const long long base = row + (long long)h * D;
        const float x1 = qkv[base + i], x2 = qkv[base + i + half];
        out[base + i] = f2bf(x1 * c[i] - x2 * s[i]);
        out[base + i + half] = f2bf(x2 * c[i] + x1 * s[i]);
    }
    const long long vbase = row + (long long)n_rot_heads * D;
    for (int j = threadIdx.x; j < (n_heads_total - n_rot_heads) * D; j += blockDim.x)
        out[vbase + j] = f2bf(qkv[vbase + j]);
}
