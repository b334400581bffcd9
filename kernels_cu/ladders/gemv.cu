// The GEMV ladder (chapter 14): the decode projections, out[t, n] = sum_k x[t, k] W[n, k],
// x bf16 [T, K] (T = 1..MAXT decode rows), W bf16 [N, K] (nn.Linear layout), out fp32 [T, N], fp32
// accumulation. The arithmetic is tiny; the time is reading W once: 2 N K bytes at copy bandwidth is
// the floor. Each rung changes how the GPU's threads walk W to keep more bytes of it in flight.
// `python -m engine.kernel_bench --ladder gemv` checks every rung against a float64 x @ W^T
// (engine.ops.linear.linear_ref computes the same in float32) and times each from a CUDA graph that
// cycles over copies of W, so that no pass finds W in L2.
//
//   v1  gemv_v1_thread (below)      one THREAD per output column n, walking its row of W.
//   v2  gemv_v2_warp (below)        one WARP per output: the lanes read neighbouring elements.
//   v3  gemv_v3_vec16 (below)       v2 with 16-byte loads (8 bf16 per lane per load).
//   v4  gemv_v4_rows (below)        ROWS outputs per warp, UNROLL steps: 2 ROWS loads in flight per lane.
//   v5  gemv_v5_splitk (below)      v4 with the block's warps splitting K of the same rows.
//   v6  kernels_cu/gemv.cu gemv_bf16   the engine's kernel: the tensor cores do the multiply, the
//                                  launcher sizes the split for the SM count (engine/ops/gemv.py).
// x and W rows are contiguous (row stride K); v3..v5 need K % 8 == 0 (rows 16-byte aligned).
#include "../common.cuh"   // kernels_cu/common.cuh, the helpers every kernel shares

#ifndef MAXT
#define MAXT 8           // most rows of x (the register arrays are this long; rows t >= T are skipped)
#endif
#define ROWS 4           // outputs per warp (v4, v5)
#define UNROLL 2         // 16-byte steps per lane per loop iteration (v4, v5)

// sum over 8 k of W chunk * x chunk (8 bf16 each, as uint4).
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x) {
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
        s += fa.x * fb.x + fa.y * fb.y;
    }
    return s;
}

__device__ __forceinline__ uint4 ld16(const bf16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// v1: thread n computes out[:, n] alone, k = 0..K-1 in order. Neighbouring threads read addresses
// 2 K bytes apart: every warp-wide load touches 32 different rows of W (32 sectors for 64 useful
// bytes), and each thread has one 2-byte load in flight at a time.
// Launch: grid ceil(N / blockDim), block 32..1024.
extern "C" __global__ void gemv_v1_thread(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                           float* __restrict__ out, int T, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const bf16* wr = w + (long long)n * K;
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const float wk = bf2f(wr[k]);
#pragma unroll
        for (int t = 0; t < MAXT; ++t)
            if (t < T) acc[t] += bf2f(x[(long long)t * K + k]) * wk;
    }
    for (int t = 0; t < T; ++t) out[(long long)t * N + n] = acc[t];
}

// v2: warp j of the grid owns output n = j; lane L reads k = L, L + 32, ...: one warp-wide load
// reads 64 contiguous bytes of one row (two 32-byte sectors, all used), then a warp_sum per x row.
// Why faster than v1: coalesced, so every byte fetched is used.
// Launch: grid ceil(N / (blockDim / 32)), block 32..1024.
extern "C" __global__ void gemv_v2_warp(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                         float* __restrict__ out, int T, int N, int K) {
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N) return;                                   // whole warps leave
    const bf16* wr = w + (long long)n * K;
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    for (int k = lane; k < K; k += 32) {
        const float wk = bf2f(wr[k]);
#pragma unroll
        for (int t = 0; t < MAXT; ++t)
            if (t < T) acc[t] += bf2f(x[(long long)t * K + k]) * wk;
    }
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
        if (t >= T) break;
        const float s = warp_sum(acc[t]);
        if (lane == 0) out[(long long)t * N + n] = s;
    }
}

// v3: v2 with 16-byte loads: lane L reads W[n, 8 L + 256 i .. + 7] (and the same chunk of each x
// row) as one uint4, so one warp-wide load moves 512 contiguous bytes of W.
// Why faster than v2: 8 times fewer load instructions for the same bytes; a 64-byte warp load
// could never keep enough bytes in flight to cover HBM latency.
// Needs K % 8 == 0. Launch: grid ceil(N / (blockDim / 32)), block 32..1024.
extern "C" __global__ void gemv_v3_vec16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          float* __restrict__ out, int T, int N, int K) {
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N) return;
    const bf16* wr = w + (long long)n * K;
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    for (int k = 8 * lane; k < K; k += 256) {
        const uint4 wv = ld16(wr + k);
#pragma unroll
        for (int t = 0; t < MAXT; ++t)
            if (t < T) acc[t] += dot8(wv, ld16(x + (long long)t * K + k));
    }
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
        if (t >= T) break;
        const float s = warp_sum(acc[t]);
        if (lane == 0) out[(long long)t * N + n] = s;
    }
}

// The inner loop of v4 and v5: this lane's 16-byte chunks c = c0, c0 + stride, ... of ROWS rows of
// W (rows n0 .. n0 + ROWS - 1, clamped to N - 1: those outputs are not written), UNROLL chunks per
// row per iteration, all UNROLL x ROWS loads issued before the first multiply.
__device__ __forceinline__ void gemv_rows_loop(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                               int T, int N, int K, int n0, int c0, int stride,
                                               float (&acc)[ROWS][MAXT]) {
    const int K8 = K / 8;                                 // 16-byte chunks per row
    const bf16* wr[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) wr[i] = w + (long long)min(n0 + i, N - 1) * K;
    for (int c = c0; c < K8; c += UNROLL * stride) {
        uint4 wv[UNROLL][ROWS];
        bool ok[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int cu = c + u * stride;
            ok[u] = cu < K8;
#pragma unroll
            for (int i = 0; i < ROWS; ++i) wv[u][i] = ok[u] ? ld16(wr[i] + 8 * cu) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (!ok[u]) break;
            const int k = 8 * (c + u * stride);
#pragma unroll
            for (int t = 0; t < MAXT; ++t) {
                if (t >= T) break;
                const uint4 xv = ld16(x + (long long)t * K + k);   // one x chunk serves ROWS rows
#pragma unroll
                for (int i = 0; i < ROWS; ++i) acc[i][t] += dot8(wv[u][i], xv);
            }
        }
    }
}

// v4: a warp owns ROWS = 4 outputs, and each lane issues UNROLL x ROWS = 8 independent 16-byte
// loads of W before it multiplies anything; each x chunk is loaded once for 4 rows.
// Why faster than v3: v3 has one 16-byte load in flight per lane, then waits ~1 us for HBM; memory
// bandwidth is bytes in flight / latency, so 8 in flight per lane move ~8 times more per wait.
// Needs K % 8 == 0. Launch: grid ceil(N / (ROWS blockDim / 32)), block 32..1024.
extern "C" __global__ void gemv_v4_rows(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                         float* __restrict__ out, int T, int N, int K) {
    const int warp_id = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int n0 = warp_id * ROWS;
    if (n0 >= N) return;
    float acc[ROWS][MAXT];
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int t = 0; t < MAXT; ++t) acc[i][t] = 0.0f;
    gemv_rows_loop(x, w, T, N, K, n0, lane, 32, acc);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
#pragma unroll
        for (int t = 0; t < MAXT; ++t) {
            if (t >= T) break;
            const float s = warp_sum(acc[i][t]);
            if (lane == 0 && n0 + i < N) out[(long long)t * N + n0 + i] = s;
        }
    }
}

// v5: a BLOCK owns ROWS outputs and its warps split K (warp j reads chunks j 32 + lane, stepping
// by warps 32); the warps' partial sums meet in shared memory, added in warp order.
// Why faster than v4: a narrow W (o_proj, down_proj: N = 2048) gives v4 only N / 4 = 512 warps,
// under 4 per SM, too few loads in flight to fill HBM; splitting K gives it blockDim / 32 times more
// warps for the same outputs. For a wide W it changes little.
// Needs K % 8 == 0. Launch: grid ceil(N / ROWS), block 32..1024, no dynamic shared memory.
extern "C" __global__ void gemv_v5_splitk(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                           float* __restrict__ out, int T, int N, int K) {
    __shared__ float partial[32][ROWS][MAXT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int n0 = blockIdx.x * ROWS;
    float acc[ROWS][MAXT];
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int t = 0; t < MAXT; ++t) acc[i][t] = 0.0f;
    gemv_rows_loop(x, w, T, N, K, n0, warp * 32 + lane, warps * 32, acc);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
#pragma unroll
        for (int t = 0; t < MAXT; ++t) {
            if (t >= T) break;
            const float s = warp_sum(acc[i][t]);
            if (lane == 0) partial[warp][i][t] = s;
        }
    }
    __syncthreads();
    if (threadIdx.x < ROWS * MAXT) {
        const int i = threadIdx.x / MAXT, t = threadIdx.x % MAXT;
        if (t < T && n0 + i < N) {
            float s = 0.0f;
            for (int j = 0; j < warps; ++j) s += partial[j][i][t];
            out[(long long)t * N + n0 + i] = s;
        }
    }
}
