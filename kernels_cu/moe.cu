// Appendix (mixture of experts): Qwen3-MoE's sparse MLP with tokens grouped by expert.
//     out[t] = sum_j w[t, j] * down_e( silu(gate_e(x_t)) * up_e(x_t) ),   e = experts[t, j],  j < k
// T tokens, E experts, k chosen per token, H hidden, I the expert width (moe_intermediate_size).
// The launcher is engine/ops/moe.py (grouped_experts, route); the NumPy references are router_ref and
// experts_ref there. Weights bf16 [E, 2I, H] (gate rows, then up rows, per expert) and [E, H, I];
// activations bf16, every sum in fp32.
//
// Why group: a token's k experts are a different k for every token. Looping over experts on the host
// would be E launches per layer (128 for Qwen3-30B-A3B), most of them tiny, and a host sync to learn
// which experts have tokens. Instead the T*k (token, expert) pairs are sorted by expert on the device,
// and one launch computes every expert's rows: a block owns one tile of grouped rows (all of one
// expert) and reads only that expert's weights. At decode, T*k rows fall on at most T*k experts, so
// the weights of the experts nobody chose are never read: a step streams k/E of the expert bytes.
//
// Five launches per sparse layer (the router logits are an ordinary linear() before them):
//   moe_route        <<<T, 32>>>          one warp per token: softmax over E, k rounds of a warp arg-max
//                                         (ties: the lower expert index), renormalise if asked
//   moe_group        <<<1, 1024>>>        counting sort of the R = T*k pairs by expert:
//                                         count (shared atomics), exclusive scan (thread 0, E steps),
//                                         tiles of <= MOE_TILE_M rows per expert, scatter (atomics on
//                                         per-expert cursors). Within an expert the order of its rows
//                                         is whatever the atomics give; nothing depends on it, since
//                                         every grouped row is computed on its own and combined by
//                                         its position (pair_row), not by its order.
//   moe_expert_gemm  <<<(tiles, ceil(N / MOE_TILE_N)), 16 MOE_TILE_M>>>
//                                         y[r] = W_e x[r] for the rows of every tile, twice: gate_up (x gathered from the tokens) and down (x =
//                                         swiglu's output, already in grouped order). `tiles` is an
//                                         upper bound known from T and E alone; blocks past the real
//                                         count (num_tiles, on the device) return at once, so the
//                                         host never waits for it (CUDA graphs capture the step).
//   (swiglu          kernels_cu/swiglu.cu on the [R, 2I] gate_up rows)
//   moe_combine      <<<T, 256>>>         out[t] = sum_j w[t, j] * y[pair_row[t*k + j]], j in order:
//                                         deterministic, no atomics on the output
//
// moe_expert_gemm's tile: MOE_TILE_M rows x MOE_TILE_N columns, K in steps of MOE_BK. 16 MOE_TILE_M threads:
// thread (ty = tid / 16, tx = tid % 16) owns row ty and columns tx, tx + 16, ... (MOE_TILE_N / 16). Each
// step stages x [MOE_TILE_M, MOE_BK] and W [MOE_TILE_N, MOE_BK] in shared memory as fp32 (rows padded
// to MOE_BK + 1 floats: the 16 column threads of a row read 16 different banks). An output's sum runs
// over k in order whatever the other rows are: a token's result does not depend on its batch.
// Plain CUDA-core FMAs, no tensor cores: correct on any GPU from sm_75; the grouped layout is the
// point here, not the tile's speed.
#include "common.cuh"

#ifndef MOE_TILE_M
#define MOE_TILE_M 16
#endif
#ifndef MOE_TILE_N
#define MOE_TILE_N 64
#endif
#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 1024   // E <= this: one float (moe_route) or two ints (moe_group) of shared memory each
#endif
#define MOE_BK 32
#define GEMM_THREADS (MOE_TILE_M * 16)   // a row of 16 threads per grouped row of the tile
static_assert(GEMM_THREADS <= 1024, "MOE_TILE_M: at most 64 rows per tile");
static_assert(MOE_TILE_N % 16 == 0, "each of a row's 16 threads owns MOE_TILE_N / 16 columns");

// ------------------------------------------------------------------------------------------------
extern "C" __global__ void moe_route(const float* __restrict__ logits,   // [T, E]
                                     float* __restrict__ weights,        // [T, k]
                                     int* __restrict__ experts,          // [T, k]
                                     int E, int k, int norm_topk_prob) {
    __shared__ float probs[MOE_MAX_EXPERTS];                              // [E] this token's probabilities
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* row = logits + (long long)t * E;
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < E; e += 32) {
        const float z = expf(row[e] - m);
        probs[e] = z;
        s += z;
    }
    s = warp_sum(s);
    for (int e = lane; e < E; e += 32) probs[e] /= s;                    // each lane its own entries
    __syncwarp();
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
        float best = -1.0f;                                               // taken experts hold -1
        int arg = E;
        for (int e = lane; e < E; e += 32) {
            const float v = probs[e];
            if (v > best) { best = v; arg = e; }                          // e increasing: ties keep the lower
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, offset);
            const int oa = __shfl_xor_sync(0xffffffffu, arg, offset);
            if (ov > best || (ov == best && oa < arg)) { best = ov; arg = oa; }
        }
        if (arg >= E) arg = j;            // every probability NaN: any in-range index keeps the reads safe
        if (lane == 0) {
            weights[(long long)t * k + j] = best;
            experts[(long long)t * k + j] = arg;
            probs[arg] = -1.0f;
        }
        total += best;
        __syncwarp();
    }
    if (norm_topk_prob && lane == 0)
        for (int j = 0; j < k; ++j) weights[(long long)t * k + j] /= total;
}

// ------------------------------------------------------------------------------------------------
extern "C" __global__ void moe_group(const int* __restrict__ experts,   // [R] = [T, k] flattened
                                     int R, int k, int E,
                                     int* __restrict__ offsets,          // [E + 1] first grouped row per expert
                                     int* __restrict__ row_token,        // [R] token of each grouped row
                                     int* __restrict__ pair_row,         // [R] grouped row of pair t*k + j
                                     int* __restrict__ tile_expert,      // [tiles] expert of each tile
                                     int* __restrict__ tile_start,       // [tiles] first grouped row of each tile
                                     int* __restrict__ num_tiles) {      // [1]
    __shared__ int count[MOE_MAX_EXPERTS];    // [E] rows per expert, then each expert's first tile
    __shared__ int cursor[MOE_MAX_EXPERTS];   // [E] next free grouped row of each expert
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < R; a += blockDim.x) atomicAdd(&count[experts[a]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {       // E <= MOE_MAX_EXPERTS steps: cheaper than a parallel scan's syncs
        int rows = 0, tiles = 0;
        for (int e = 0; e < E; ++e) {
            const int c = count[e];
            offsets[e] = cursor[e] = rows;
            count[e] = tiles;
            rows += c;
            tiles += (c + MOE_TILE_M - 1) / MOE_TILE_M;
        }
        offsets[E] = rows;
        num_tiles[0] = tiles;
    }
    __syncthreads();              // offsets (global) and count/cursor (shared) are visible to the block
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int r = offsets[e], i = count[e]; r < offsets[e + 1]; r += MOE_TILE_M, ++i) {
            tile_expert[i] = e;
            tile_start[i] = r;
        }
    for (int a = threadIdx.x; a < R; a += blockDim.x) {
        const int pos = atomicAdd(&cursor[experts[a]], 1);
        row_token[pos] = a / k;
        pair_row[a] = pos;
    }
}

// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
moe_expert_gemm(const bf16* __restrict__ x,            // [rows of x, K]: tokens (gather) or grouped rows
                const int* __restrict__ row_token,     // [R] x row of each grouped row, when gather
                int gather,
                const bf16* __restrict__ w,            // [E, N, K]
                const int* __restrict__ tile_expert, const int* __restrict__ tile_start,
                const int* __restrict__ offsets, const int* __restrict__ num_tiles,
                float* __restrict__ y,                 // [R, N]
                int N, int K) {
    const int tile = blockIdx.x;                       // x: up to 2^31 - 1 tiles (y would stop at 65535)
    if (tile >= num_tiles[0]) return;                  // past the real tiles of this step
    const int e = tile_expert[tile], r0 = tile_start[tile];
    const int rows = min(MOE_TILE_M, offsets[e + 1] - r0);
    const int n0 = blockIdx.y * MOE_TILE_N;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const bf16* W = w + (long long)e * N * K;
    __shared__ float xs[MOE_TILE_M][MOE_BK + 1];
    __shared__ float ws[MOE_TILE_N][MOE_BK + 1];
    float acc[MOE_TILE_N / 16];
#pragma unroll
    for (int j = 0; j < MOE_TILE_N / 16; ++j) acc[j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += MOE_BK) {
        for (int i = tid; i < MOE_TILE_M * MOE_BK; i += GEMM_THREADS) {
            const int r = i / MOE_BK, kk = i % MOE_BK;
            float v = 0.0f;
            if (r < rows && k0 + kk < K) {
                const long long src = gather ? row_token[r0 + r] : r0 + r;
                v = bf2f(x[src * K + k0 + kk]);
            }
            xs[r][kk] = v;
        }
        for (int i = tid; i < MOE_TILE_N * MOE_BK; i += GEMM_THREADS) {   // consecutive threads: one row's k
            const int n = i / MOE_BK, kk = i % MOE_BK;
            ws[n][kk] = (n0 + n < N && k0 + kk < K) ? bf2f(W[(long long)(n0 + n) * K + k0 + kk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < MOE_BK; ++kk) {
            const float xv = xs[ty][kk];
#pragma unroll
            for (int j = 0; j < MOE_TILE_N / 16; ++j) acc[j] += xv * ws[tx + 16 * j][kk];
        }
        __syncthreads();
    }
    if (ty >= rows) return;
#pragma unroll
    for (int j = 0; j < MOE_TILE_N / 16; ++j) {
        const int n = n0 + tx + 16 * j;
        if (n < N) y[(long long)(r0 + ty) * N + n] = acc[j];
    }
}

// ------------------------------------------------------------------------------------------------
extern "C" __global__ void moe_combine(const float* __restrict__ y,         // [R, H] expert outputs, grouped
                                       const int* __restrict__ pair_row,    // [T * k]
                                       const float* __restrict__ weights,   // [T * k]
                                       float* __restrict__ out,             // [T, H]
                                       int k, int H) {
    const long long t = blockIdx.x;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) acc += weights[t * k + j] * y[(long long)pair_row[t * k + j] * H + c];
        out[t * H + c] = acc;
    }
}
