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

// The Qwen variants of the same step, in one pass over qkv (appendix: model families).
//   Qwen2: qkv += bias (the q/k/v projections' biases; cuBLAS wrote the product without them).
//   Qwen3: each q head is RMS-normalized over its D values and scaled by q_norm[D] (k heads by
//          k_norm[D]) before the rotation: x * rsqrt(mean(x^2) + eps) * w.
//   Qwen3.5: the same norm, then only the first R dims of each head rotate (partial rotary: pairs
//          i and i + R/2, tables [P, R/2]); dims R..D-1 pass through normalized. Its projection
//          row also holds the query gate after v, so the input rows are ld_in floats apart.
// has_bias = 0 skips the bias (bias is then not read), has_norm = 0 the norm (q_norm, k_norm not
// read); v heads get only the bias. R = D rotates whole heads.
// Thread layout: one block per token, one warp per head (heads strided over the block's warps).
// A head's sum of squares is a warp_sum, no shared memory; the second pass re-reads the head
// (D floats, just loaded: an L1 hit) and writes the rotated pairs, i and i + R/2 per lane.
extern "C" __global__ void rope_qkv_bias_norm(const float* __restrict__ qkv,      // [T, ld_in]: q, k, v heads first
                                               const float* __restrict__ bias,     // [(Hq+2Hkv)*D]
                                               const float* __restrict__ q_norm,   // [D]
                                               const float* __restrict__ k_norm,   // [D]
                                               const int* __restrict__ positions,  // [T]
                                               const float* __restrict__ cos_tab,  // [P, R/2]
                                               const float* __restrict__ sin_tab,  // [P, R/2]
                                               bf16* __restrict__ out,             // [T, (Hq+2Hkv)*D]
                                               int Hq, int Hkv, int D, int R, long long ld_in, float eps,
                                               int has_bias, int has_norm) {
    const int t = blockIdx.x, half = R / 2, lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5, n_heads = Hq + 2 * Hkv;
    const long long in_row = (long long)t * ld_in, out_row = (long long)t * n_heads * D;
    const float* c = cos_tab + (long long)positions[t] * half;
    const float* s = sin_tab + (long long)positions[t] * half;
    for (int h = warp; h < n_heads; h += n_warps) {
        const float* x = qkv + in_row + (long long)h * D;
        bf16* y = out + out_row + (long long)h * D;
        const float* b = has_bias ? bias + (long long)h * D : nullptr;
        if (h >= Hq + Hkv) {                                   // a v head: bias, no rotation
            for (int d = lane; d < D; d += 32) y[d] = f2bf(x[d] + (b ? b[d] : 0.0f));
            continue;
        }
        const float* w = !has_norm ? nullptr : h < Hq ? q_norm : k_norm;
        float scale = 1.0f;
        if (w) {
            float ss = 0.0f;
            for (int d = lane; d < D; d += 32) {
                const float v = x[d] + (b ? b[d] : 0.0f);
                ss += v * v;
            }
            scale = rsqrtf(warp_sum(ss) / D + eps);
        }
        for (int i = lane; i < half; i += 32) {
            float x1 = (x[i] + (b ? b[i] : 0.0f)) * scale;
            float x2 = (x[i + half] + (b ? b[i + half] : 0.0f)) * scale;
            if (w) { x1 *= w[i]; x2 *= w[i + half]; }
            y[i] = f2bf(x1 * c[i] - x2 * s[i]);
            y[i + half] = f2bf(x2 * c[i] + x1 * s[i]);
        }
        for (int d = R + lane; d < D; d += 32)                 // partial rotary: the rest passes through
            y[d] = f2bf((x[d] + (b ? b[d] : 0.0f)) * scale * (w ? w[d] : 1.0f));
    }
}
