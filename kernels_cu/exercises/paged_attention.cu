// GPU track, chapter 11: a first paged-attention decode kernel, written by you.
// Query row r (one new token of sequence seq_idx[r], at position positions[r]) attends to the keys
// at positions j = 0 .. positions[r] (inclusive: ctx = positions[r] + 1 keys) of its sequence.
// Key j lives in page page_tables[seq][j / page_size], at offset j % page_size: its slot is
//     slot = page * page_size + j % page_size,
// and the cache [pages, page_size, Hkv, D] holds KV head kvh of that key at
//     k_cache + slot * (n_kv_heads * HEAD_DIM) + kvh * HEAD_DIM   (the same for v_cache).
// GQA: query head h = kvh * GROUP + g (g < GROUP) reads KV head kvh.
// Softmax without a score array, one key at a time (online softmax, in base 2: q is pre-scaled by
// scale * log2(e) so that exp2f gives exp(scale * q.k)):
//     m' = max(m, s);  l' = l * exp2(m - m') + exp2(s - m');  acc' = acc * exp2(m - m') + exp2(s - m') * v
// and the output is acc / l, written in bf16 at out + r * out_row_stride + h * HEAD_DIM.
//
// Launch (as the engine launches kernels_cu/paged_attention.cu with one split): grid = (rows, Hkv, 1),
// block = (128) threads = 4 warps; HEAD_DIM and GROUP are compile-time constants (-D options,
// HEAD_DIM a power of two from 16 to 256, GROUP 1 to 8). part_ml and part_acc are for the engine's
// split version: leave them alone.
// Who owns what:
//   * block (r, kvh) owns query row r and the GROUP query heads that share KV head kvh;
//   * warp w owns query heads g = w, w + 4, ... < GROUP (one warp per query head);
//   * lane l owns dimensions d = l, l + 32, ... < HEAD_DIM of that head (DIMS_PER_LANE of them,
//     fewer than 32 lanes have work when HEAD_DIM = 16): its slices of q and of acc stay in registers;
//   * for each key, every lane multiplies its q and k dimensions, a warp sum (shuffles) gives the
//     score s in every lane, and every lane updates the same m and l and its own slice of acc.
// The checker tries page sizes that do not divide the context, GROUP 1 to 8, HEAD_DIM 16 to 128.
// Check it with: engine.exercises.ch11.check_paged_attention_kernel()
#include "common.cuh"   // bf16, bf2f, f2bf, warp_sum, INFINITY

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

extern "C" __global__ void paged_attention(const bf16* __restrict__ q, long long q_row_stride,   // [R, ...]
                                            const bf16* __restrict__ k_cache,   // [pages, page_size, Hkv, D]
                                            const bf16* __restrict__ v_cache,   // [pages, page_size, Hkv, D]
                                            const int* __restrict__ page_tables, int max_pages,  // [S, max_pages]
                                            const int* __restrict__ seq_idx,    // [R]
                                            const int* __restrict__ positions,  // [R]
                                            int page_size, int n_kv_heads, float scale_log2e,
                                            bf16* __restrict__ out, long long out_row_stride,      // [R, Hq*D]
                                            float* __restrict__ part_ml, float* __restrict__ part_acc) {
    const int r = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int* table = page_tables + (long long)seq_idx[r] * max_pages;   // this sequence's pages
    const int ctx = positions[r] + 1;
    const long long token_stride = (long long)n_kv_heads * HEAD_DIM;        // one slot of the cache
    for (int g = warp; g < GROUP; g += NWARPS) {
        const int h = kvh * GROUP + g;
        float qf[DIMS_PER_LANE], acc[DIMS_PER_LANE];
        // TODO 1: for i < DIMS_PER_LANE, d = lane + 32 * i: qf[i] = q[r * q_row_stride + h * HEAD_DIM + d]
        //         (bf2f) times scale_log2e, and acc[i] = 0 (use 0 for d >= HEAD_DIM).

        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j < ctx; ++j) {
            // TODO 2: the slot of key j, then pointers to its K and V vectors of head kvh.

            // TODO 3: s = this lane's part of q.k; then s = warp_sum(s).

            // TODO 4: the online-softmax update of m, l and this lane's acc[i] (exp2f).

        }
        // TODO 5: write acc[i] / l for this lane's dimensions (f2bf).

    }
}
