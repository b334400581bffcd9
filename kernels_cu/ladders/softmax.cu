// The softmax ladder (chapter 06): the fused scale + causal mask + softmax of prefill attention,
//     P[t, s] = exp(scale S[t, s] - m) / sum_{s' <= t} exp(scale S[t, s'] - m)   for s <= t, else 0,
// S fp32 [H, T, T] (one score matrix per query head, from cuBLAS), P bf16 [H, T, T] (the operand of
// the next GEMM). Row t of head h is row h * T + t. A row must read its t + 1 scores once and write
// its T probabilities once: H T (T + 1) / 2 * 4 + H T T * 2 bytes, at best at copy bandwidth.
// `python -m engine.kernel_bench --ladder softmax` checks every rung against engine.ops.attention.softmax.
//
//   v1  kernels_cu/attention.cu causal_softmax_naive   one THREAD per row, three serial passes.
//   v2  causal_softmax_v2_smem_tree (below)            one BLOCK per row, tree reductions in shared memory.
//   v3  kernels_cu/attention.cu causal_softmax         one block per row, warp-shuffle block reductions.
//   v4  causal_softmax_v4_online (below)               v3 with the online softmax: max and sum in one pass.
//   v5  causal_softmax_v5_float4 (below)               v4 with 16-byte loads and 8-byte stores.
// v1 and v3 are the engine's kernels, compiled from their own file.
#include "../common.cuh"   // kernels_cu/common.cuh, the helpers every kernel shares

// v2: one block per row, threads stride over its keys (coalesced); the max and then the sum are
// each reduced by halving through blockDim floats of shared memory (log2(blockDim) barriers each).
// Why faster than v1: H T blocks instead of H T threads, coalesced loads, and a long row is split
// over blockDim threads instead of walked by one (v1's last rows set its time).
// Launch: grid H T, block a power of two 32..1024, blockDim * 4 bytes of dynamic shared memory.
extern "C" __global__ void causal_softmax_v2_smem_tree(const float* __restrict__ scores, bf16* __restrict__ probs,
                                                        int T, float scale) {
    extern __shared__ float red[];                           // [blockDim.x]
    const int t = blockIdx.x % T, n_valid = t + 1;
    const long long base = (long long)blockIdx.x * T;
    float m = -INFINITY;
    for (int s = threadIdx.x; s < n_valid; s += blockDim.x) m = fmaxf(m, scores[base + s] * scale);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + k]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();                                         // everyone has read the max before reuse
    float sum = 0.0f;
    for (int s = threadIdx.x; s < n_valid; s += blockDim.x) sum += __expf(scores[base + s] * scale - m);
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k];
        __syncthreads();
    }
    const float inv = 1.0f / red[0];
    for (int s = threadIdx.x; s < T; s += blockDim.x)
        probs[base + s] = f2bf(s < n_valid ? __expf(scores[base + s] * scale - m) * inv : 0.0f);
}

// Fold the online-softmax state (m2, l2) into (m, l): l is a sum of exp(x - m).
__device__ __forceinline__ void online_merge(float& m, float& l, float m2, float l2) {
    const float m_new = fmaxf(m, m2);
    if (m_new == -INFINITY) return;                          // both empty
    l = l * __expf(m - m_new) + l2 * __expf(m2 - m_new);
    m = m_new;
}

// The block's (m, l) states folded into one, every thread gets it: warp shuffles, then one float2
// per warp through shared memory (32 entries: blockDim at most 1024).
__device__ __forceinline__ void block_online(float& m, float& l, float2* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
        online_merge(m, l, m2, l2);
    }
    if (lane == 0) scratch[warp] = make_float2(m, l);
    __syncthreads();
    m = -INFINITY;
    l = 0.0f;
    for (int j = 0; j < n_warps; ++j) online_merge(m, l, scratch[j].x, scratch[j].y);
}

// v4: one block per row like v3, but the max and the sum come from ONE pass over the scores: each
// thread keeps a running max m and a running sum l of exp(x - m), rescaling l by exp(m - m') when
// its max grows (the recurrence flash attention builds on); the threads' states are merged the same
// way. Then the write pass.
// Why faster than v3: the row is read twice instead of three times (max, sum, write), with one
// block reduction instead of two.
// Launch: grid H T, block 32..1024 (whole warps).
extern "C" __global__ void causal_softmax_v4_online(const float* __restrict__ scores, bf16* __restrict__ probs,
                                                     int T, float scale) {
    __shared__ float2 scratch[32];
    const int t = blockIdx.x % T, n_valid = t + 1;
    const long long base = (long long)blockIdx.x * T;
    float m = -INFINITY, l = 0.0f;
    for (int s = threadIdx.x; s < n_valid; s += blockDim.x) {
        const float x = scores[base + s] * scale;
        if (x > m) { l = l * __expf(m - x) + 1.0f; m = x; }
        else l += __expf(x - m);
    }
    block_online(m, l, scratch);
    const float inv = 1.0f / l;
    for (int s = threadIdx.x; s < T; s += blockDim.x)
        probs[base + s] = f2bf(s < n_valid ? __expf(scores[base + s] * scale - m) * inv : 0.0f);
}

// v5: v4 with each thread moving 4 neighbouring keys at a time: one 16-byte load of scores, one
// 8-byte store of four bf16 probabilities. Keys past the causal end inside a float4 count as -inf.
// Why faster than v4: a quarter of the memory instructions, four times the bytes in flight per
// load; the write pass of a row's masked tail is pure 8-byte zero stores.
// Needs T % 4 == 0 (rows 16-byte aligned). Launch: grid H T, block 32..1024.
extern "C" __global__ void causal_softmax_v5_float4(const float* __restrict__ scores, bf16* __restrict__ probs,
                                                     int T, float scale) {
    __shared__ float2 scratch[32];
    const int t = blockIdx.x % T, n_valid = t + 1;
    const long long base = (long long)blockIdx.x * T;
    const float4* s4 = reinterpret_cast<const float4*>(scores + base);
    const int n4 = (n_valid + 3) / 4;                       // float4s holding a valid key
    float m = -INFINITY, l = 0.0f;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 v = s4[i];
        const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (4 * i + j >= n_valid) break;
            const float x = e[j] * scale;
            if (x > m) { l = l * __expf(m - x) + 1.0f; m = x; }
            else l += __expf(x - m);
        }
    }
    block_online(m, l, scratch);
    const float inv = 1.0f / l;
    for (int i = threadIdx.x; i < T / 4; i += blockDim.x) {
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (i < n4) {
            const float4 v = s4[i];
            const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) p[j] = 4 * i + j < n_valid ? __expf(e[j] * scale - m) * inv : 0.0f;
        }
        __nv_bfloat162 lo = __floats2bfloat162_rn(p[0], p[1]), hi = __floats2bfloat162_rn(p[2], p[3]);
        uint2 out;
        out.x = *reinterpret_cast<unsigned*>(&lo);
        out.y = *reinterpret_cast<unsigned*>(&hi);
        *reinterpret_cast<uint2*>(probs + base + 4 * i) = out;
    }
}
