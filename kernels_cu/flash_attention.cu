// Prefill attention without a score matrix (FlashAttention-2 style), on the tensor cores.
//
// Query row i of sequence s sits at absolute position positions[i] and attends to the keys at
// positions 0..positions[i] of its sequence: a fresh prompt (keys = its own rows of qkv, PAGED 0)
// or a chunk whose earlier tokens are already in the paged KV cache (PAGED 1: key j lives in page
// page_tables[s][j / page_size] at offset j % page_size of a cache [num_pages, page_size, Hkv, D]).
// Positions increase along each sequence (a prompt or a chunk of one).
//
// Grid (Hq, query tiles, sequences): one CTA = one query head x BLOCK_M query rows of one sequence.
// Heads sharing a KV head (GQA) are neighbours in blockIdx.x, so their K/V reads meet in L2; K/V
// are never repeated in memory. Tiles run last-first: the long (late) ones start in the first wave.
//
// Inside the CTA: NWARPS warps, warp w owns query rows 16w..16w+15 (the M of mma.m16n8k16), for
// every key tile of BLOCK_N keys:
//     S = Q K^T        (tensor cores, bf16 in, fp32 out; S stays in registers)
//     online softmax   m' = max(m, rowmax S),  P = exp(S - m'),  l' = l e^(m - m') + rowsum P,
//                      O' = O e^(m - m')       (scores in log2 units: exp2 with a pre-scaled S)
//     O += P V         (P goes from the S accumulator registers straight into the A operand)
// and at the end O / l. K and V tiles are staged in shared memory by cp.async: V of this tile
// loads while S is computed, K of the next tile while P V is computed.
//
// Fragments of mma.m16n8k16 (g = lane / 4, t = lane % 4), each register 2 bf16 or 1 fp32:
//   A (16x16, Q or P):  a0 (row g,   cols 2t..2t+1)   a1 (row g+8, cols 2t..)
//                       a2 (row g,   cols 2t+8..)     a3 (row g+8, cols 2t+8..)
//   B (16x8, K^T or V): b0 (k 2t..2t+1, col g)        b1 (k 2t+8.., col g)
//   C (16x8, S or O):   c0 c1 (row g, cols 2t, 2t+1)  c2 c3 (row g+8, cols 2t, 2t+1)
// so each thread holds two query rows (g and g+8 of its warp's 16) and their softmax state.
// ldmatrix moves 8x8 bf16 blocks from shared memory into exactly these layouts (.trans for V,
// which is stored [key][dim] but consumed as a K x N column operand).
//
// Compile-time constants, set by engine/ops/flash_attention.py (the defaults below are its values
// for a Llama-3.2-1B head, so that a plain `nvcc flash_attention.cu` builds a kernel the engine runs;
// tests/test_kernels_compile.py checks they agree):
// HEAD_DIM (16, 32, 64 or 128), NWARPS (BLOCK_M = 16 * NWARPS query rows), BLOCK_N (keys per
// tile, a multiple of 16), PAGED (0: keys from qkv, 1: from the paged cache).
// The tensor-core instructions need sm_80+; older GPUs use the chapter 06 / 11 kernels instead.
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef PAGED
#define PAGED 0
#endif
#define BLOCK_M (16 * NWARPS)
#define CHUNKS (HEAD_DIM / 8)            // 16-byte chunks per row of a tile
#define THREADS (NWARPS * 32)

static_assert(HEAD_DIM == 16 || HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM: 16, 32, 64 or 128");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N: a multiple of 16 (the k of the P V product)");
static_assert((BLOCK_M + 2 * BLOCK_N) * HEAD_DIM * 2 <= 48 * 1024, "Q, K and V tiles exceed 48 KB of static shared memory");

extern "C" __global__ void __launch_bounds__(THREADS)
flash_attention(const bf16* __restrict__ q, long long q_row_stride,     // [T, q_row_stride]: head h at column h*D
                const bf16* __restrict__ k, const bf16* __restrict__ v,  // PAGED: caches [NP*PS rows]; else qkv
                long long kv_row_stride, int k_col, int v_col,           // row stride, first column of KV head 0
                const int* __restrict__ cu_seqlens,                      // [S + 1] query rows of each sequence
                const int* __restrict__ positions,                       // [T]
                const int* __restrict__ page_tables, int max_pages,      // [S, max_pages] (PAGED only)
                int page_size, int group, float scale_log2e,             // group = Hq / Hkv
                bf16* __restrict__ out, long long out_row_stride) {      // [T, Hq*D]
#if __CUDA_ARCH__ >= 800
    const int head = blockIdx.x, seq = blockIdx.z;
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int q_begin = cu_seqlens[seq] + tile * BLOCK_M;
    const int q_len = min(BLOCK_M, cu_seqlens[seq + 1] - q_begin);
    if (q_len <= 0) return;                          // a shorter sequence of the batch
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    __shared__ __align__(128) bf16 q_tile[BLOCK_M * HEAD_DIM];
    __shared__ __align__(128) bf16 k_tile[BLOCK_N * HEAD_DIM];
    __shared__ __align__(128) bf16 v_tile[BLOCK_N * HEAD_DIM];

    // The keys this tile needs: 0..last_pos. Per warp: the range of its rows' positions (a warp
    // skips key tiles wholly after its last row, and masks only tiles that reach past its first).
    const int last_pos = positions[q_begin + q_len - 1];
    const int kv_len = last_pos + 1;
    const int n_tiles = (kv_len + BLOCK_N - 1) / BLOCK_N;
    const bool warp_has_rows = warp * 16 < q_len;
    const int warp_first = warp_has_rows ? positions[q_begin + warp * 16] : 0;
    const int warp_last = warp_has_rows ? positions[q_begin + min(warp * 16 + 15, q_len - 1)] : -1;
    const int row0 = warp * 16 + g, row1 = row0 + 8;            // this thread's two rows of the tile
    const int pos0 = row0 < q_len ? positions[q_begin + row0] : last_pos;
    const int pos1 = row1 < q_len ? positions[q_begin + row1] : last_pos;

    const int kv_head = head / group;
    const bf16* k_src = k + k_col + kv_head * HEAD_DIM;
    const bf16* v_src = v + v_col + kv_head * HEAD_DIM;
#if PAGED
    const int* table = page_tables + (long long)seq * max_pages;
#endif
    // One tile of BLOCK_N keys starting at key0 -> shared memory (zeros past the context: a masked
    // score times a stale NaN in V would still poison the output).
    auto load_kv_tile = [&](bf16* dst, const bf16* src, int key0) {
#pragma unroll
        for (int i = threadIdx.x; i < BLOCK_N * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS, j = key0 + r;
            bf16* d = dst + tile_offset<HEAD_DIM>(r, c);
            if (j < kv_len) {
#if PAGED
                const long long row = (long long)table[j / page_size] * page_size + j % page_size;
#else
                const long long row = cu_seqlens[seq] + j;   // a fresh prompt: key j is its row j
#endif
                cp_async16(d, src + row * kv_row_stride + c * 8);
            } else {
                *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
            }
        }
    };

#pragma unroll
    for (int i = threadIdx.x; i < BLOCK_M * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        bf16* d = q_tile + tile_offset<HEAD_DIM>(r, c);
        if (r < q_len) cp_async16(d, q + (long long)(q_begin + r) * q_row_stride + head * HEAD_DIM + c * 8);
        else *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
    load_kv_tile(k_tile, k_src, 0);
    cp_async_commit();

    unsigned qf[HEAD_DIM / 16][4];               // this warp's 16 query rows as A fragments
    float acc[HEAD_DIM / 8][4];                  // O: dims 8*nd + 2t (+1) of rows g (c0 c1), g+8 (c2 c3)
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY;        // running max of rows g, g+8 (log2 units)
    float l0 = 0.0f, l1 = 0.0f;                  // running sums over this thread's columns only

    for (int kt = 0; kt < n_tiles; ++kt) {
        const int key0 = kt * BLOCK_N;
        cp_async_wait<0>();
        __syncthreads();                         // K tile (and Q) landed; every warp is done with the last V
        if (kt == 0) {
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
                ldmatrix_x4(qf[kk], q_tile + tile_offset<HEAD_DIM>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
        }
        load_kv_tile(v_tile, v_src, key0);       // V streams in while S is computed
        cp_async_commit();

        const bool active = key0 <= warp_last;   // warp-uniform
        unsigned pf[BLOCK_N / 16][4];            // P as A fragments (keys 16kk..16kk+15)
        if (active) {
            float s[BLOCK_N / 8][4];             // S: keys key0 + 8nb + 2t (+1), rows g, g+8
#pragma unroll
            for (int nb = 0; nb < BLOCK_N / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
            for (int nb2 = 0; nb2 < BLOCK_N / 16; ++nb2) {
#pragma unroll
                for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                    // matrices: keys +0..7 dims lo, keys +0..7 dims hi, keys +8..15 dims lo, keys +8..15 dims hi
                    unsigned b[4];
                    const int mi = lane >> 3;
                    ldmatrix_x4(b, k_tile + tile_offset<HEAD_DIM>(nb2 * 16 + ((mi >> 1) << 3) + (lane & 7), 2 * kk + (mi & 1)));
                    mma_bf16(s[2 * nb2], qf[kk], b[0], b[1]);
                    mma_bf16(s[2 * nb2 + 1], qf[kk], b[2], b[3]);
                }
            }
            const bool needs_mask = key0 + BLOCK_N - 1 > warp_first;
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int nb = 0; nb < BLOCK_N / 8; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + nb * 8 + 2 * t + (e & 1);
                    s[nb][e] *= scale_log2e;
                    if (needs_mask && key > (e < 2 ? pos0 : pos1)) s[nb][e] = -INFINITY;
                }
                mx0 = fmaxf(mx0, fmaxf(s[nb][0], s[nb][1]));
                mx1 = fmaxf(mx1, fmaxf(s[nb][2], s[nb][3]));
            }
            // A row's 8 columns per n-block are spread over the 4 lanes of a quad.
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            // Key 0 is in the first tile and visible to every row, so mx is finite from then on.
            const float alpha0 = exp2f(m0 - mx0), alpha1 = exp2f(m1 - mx1);
            m0 = mx0;
            m1 = mx1;
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int nb = 0; nb < BLOCK_N / 8; ++nb) {
                s[nb][0] = exp2f(s[nb][0] - mx0);
                s[nb][1] = exp2f(s[nb][1] - mx0);
                s[nb][2] = exp2f(s[nb][2] - mx1);
                s[nb][3] = exp2f(s[nb][3] - mx1);
                sum0 += s[nb][0] + s[nb][1];
                sum1 += s[nb][2] + s[nb][3];
            }
            l0 = l0 * alpha0 + sum0;
            l1 = l1 * alpha1 + sum1;
#pragma unroll
            for (int nd = 0; nd < HEAD_DIM / 8; ++nd) {
                acc[nd][0] *= alpha0;
                acc[nd][1] *= alpha0;
                acc[nd][2] *= alpha1;
                acc[nd][3] *= alpha1;
            }
            // The C layout of two neighbouring n-blocks is the A layout of one k-block: no shuffles.
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                pf[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pf[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pf[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        }

        cp_async_wait<0>();
        __syncthreads();                         // V tile landed; every warp is done with this K tile
        if (kt + 1 < n_tiles) load_kv_tile(k_tile, k_src, key0 + BLOCK_N);   // next K streams in during P V
        cp_async_commit();

        if (active) {
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
                for (int nd2 = 0; nd2 < HEAD_DIM / 16; ++nd2) {
                    // matrices: keys +0..7 dims lo, keys +8..15 dims lo, keys +0..7 dims hi, keys +8..15 dims hi
                    unsigned b[4];
                    const int mi = lane >> 3;
                    ldmatrix_x4_trans(b, v_tile + tile_offset<HEAD_DIM>(kk * 16 + ((mi & 1) << 3) + (lane & 7), 2 * nd2 + (mi >> 1)));
                    mma_bf16(acc[2 * nd2], pf[kk], b[0], b[1]);
                    mma_bf16(acc[2 * nd2 + 1], pf[kk], b[2], b[3]);
                }
            }
        }
    }

    // Finish the row sums across the quad, normalize, and write bf16 through the warp's own rows of
    // the Q tile (only this warp ever read them) so that the global stores are whole 16-byte chunks.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd) {
        *reinterpret_cast<unsigned*>(q_tile + tile_offset<HEAD_DIM>(row0, nd) + 2 * t) = pack_bf16(acc[nd][0] * inv0, acc[nd][1] * inv0);
        *reinterpret_cast<unsigned*>(q_tile + tile_offset<HEAD_DIM>(row1, nd) + 2 * t) = pack_bf16(acc[nd][2] * inv1, acc[nd][3] * inv1);
    }
    __syncwarp();
#pragma unroll
    for (int i = lane; i < 16 * CHUNKS; i += 32) {
        const int r = warp * 16 + i / CHUNKS, c = i % CHUNKS;
        if (r < q_len)
            *reinterpret_cast<uint4*>(out + (long long)(q_begin + r) * out_row_stride + head * HEAD_DIM + c * 8) =
                *reinterpret_cast<const uint4*>(q_tile + tile_offset<HEAD_DIM>(r, c));
    }
#else
    __trap();   // needs sm_80+ (bf16 mma.sync); engine/ops/flash_attention.py never launches it below that
#endif
}
