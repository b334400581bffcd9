// Worked solution of kernels_cu/exercises/paged_attention.cu (chapter 11): see the skeleton for the
// layout. It is also the first rung of the kernel ladder (engine.ops.paged_attention.paged_attention_naive).
// The engine's fast kernel loads each K/V vector once for all GROUP heads, splits a key's HEAD_DIM
// values over D/8 lanes (16 bytes each) so a warp works on several keys per step, and keeps many
// keys in flight with a cp.async pipeline through shared memory: see chapter 11.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef NWARPS                  // the engine launches 32 * NWARPS threads and passes -DNWARPS
#define NWARPS 4
#endif
#define DIMS_PER_LANE ((HEAD_DIM + 31) / 32)

extern "C" __global__ void paged_attention(const bf16* __restrict__ q, long long q_row_stride,
                                            const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                            const int* __restrict__ page_tables, int max_pages,
                                            const int* __restrict__ seq_idx, const int* __restrict__ positions,
                                            int page_size, int n_kv_heads, float scale_log2e,
                                            bf16* __restrict__ out, long long out_row_stride,
                                            float* __restrict__ part_ml, float* __restrict__ part_acc) {
    const int r = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int* table = page_tables + (long long)seq_idx[r] * max_pages;
    const int ctx = positions[r] + 1;
    const long long token_stride = (long long)n_kv_heads * HEAD_DIM;
    for (int g = warp; g < GROUP; g += NWARPS) {
        const int h = kvh * GROUP + g;
        float qf[DIMS_PER_LANE], acc[DIMS_PER_LANE];
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            qf[i] = d < HEAD_DIM ? bf2f(q[r * q_row_stride + (long long)h * HEAD_DIM + d]) * scale_log2e : 0.0f;
            acc[i] = 0.0f;
        }
        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j < ctx; ++j) {
            const long long slot = (long long)table[j / page_size] * page_size + j % page_size;
            const bf16* kr = k_cache + slot * token_stride + (long long)kvh * HEAD_DIM;
            const bf16* vr = v_cache + slot * token_stride + (long long)kvh * HEAD_DIM;
            float s = 0.0f;
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < HEAD_DIM) s += qf[i] * bf2f(kr[d]);
            }
            s = warp_sum(s);                          // every lane now holds the score of key j
            const float m_new = fmaxf(m, s), alpha = exp2f(m - m_new), p = exp2f(s - m_new);
            l = l * alpha + p;
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < HEAD_DIM) acc[i] = acc[i] * alpha + p * bf2f(vr[d]);
            }
            m = m_new;
        }
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < HEAD_DIM) out[r * out_row_stride + (long long)h * HEAD_DIM + d] = f2bf(acc[i] / l);
        }
    }
}
