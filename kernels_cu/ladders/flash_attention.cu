// The flash-attention ladder (chapter 13): causal prefill attention of one prompt,
//     out[i, h] = sum_{j <= i} softmax_j(q[i, h] . k[j, h / group] * scale) v[j, h / group],
// read from the packed qkv [T, (Hq + 2 Hkv) HEAD_DIM] bf16 (after RoPE), written bf16 [T, Hq HEAD_DIM].
// The work is 4 Hq HEAD_DIM T (T + 1) / 2 flops (Q K^T and P V over the causal triangle); the
// ceiling is the measured bf16 GEMM rate of the tensor cores.
// `python -m engine.kernel_bench --ladder flash_attention` checks every rung against
// engine.ops.flash_attention.flash_attention_ref.
//
//   v1  engine/ops/attention.py prefill_attention   chapter 06: S = Q K^T (cuBLAS, fp32, T x T per
//                                                   head, through memory), causal softmax kernel, P V (cuBLAS).
//   v2  flash_v2_thread_row (below)                 no score matrix: one THREAD per (query row, head)
//                                                   runs the online softmax over its keys, from global memory.
//   v3  flash_v3_smem_tiles (below)                 a block of query rows shares K/V tiles in shared
//                                                   memory; one softmax rescale per 16 keys.
//   v4  kernels_cu/flash_attention.cu               the engine's kernel: Q K^T and P V on the tensor
//                                                   cores (mma.sync), cp.async double buffering.
// Online softmax in log2 units: the scores are pre-scaled by scale * log2(e), so exp2 gives exp.
#include "../common.cuh"   // kernels_cu/common.cuh, the helpers every kernel shares

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef BLOCK_N
#define BLOCK_N 32         // keys per shared-memory tile (v3)
#endif
#define CHUNK 16           // keys scored before one rescale of the running output (v3)
#define D8 (HEAD_DIM / 8)  // 16-byte chunks per head vector
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 128, "HEAD_DIM: a multiple of 8, at most 128");
static_assert(BLOCK_N % CHUNK == 0, "BLOCK_N: a multiple of CHUNK");

__device__ __forceinline__ void load_row_f32(const bf16* __restrict__ src, float* dst, float scale) {
#pragma unroll
    for (int c = 0; c < D8; ++c) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src + 8 * c);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            dst[8 * c + 2 * i] = f.x * scale;
            dst[8 * c + 2 * i + 1] = f.y * scale;
        }
    }
}

// q . k over HEAD_DIM, k read as 16-byte chunks (global memory in v2, shared memory in v3).
__device__ __forceinline__ float dot_row(const float* qf, const bf16* k) {
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < D8; ++c) {
        const uint4 raw = *reinterpret_cast<const uint4*>(k + 8 * c);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            s += qf[8 * c + 2 * i] * f.x + qf[8 * c + 2 * i + 1] * f.y;
        }
    }
    return s;
}

// acc += p * v over HEAD_DIM.
__device__ __forceinline__ void axpy_row(float* acc, float p, const bf16* v) {
#pragma unroll
    for (int c = 0; c < D8; ++c) {
        const uint4 raw = *reinterpret_cast<const uint4*>(v + 8 * c);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            acc[8 * c + 2 * i] += p * f.x;
            acc[8 * c + 2 * i + 1] += p * f.y;
        }
    }
}

__device__ __forceinline__ void store_row(bf16* dst, const float* acc, float inv) {
#pragma unroll
    for (int d = 0; d < HEAD_DIM; ++d) dst[d] = f2bf(acc[d] * inv);
}

// v2: thread (i, h) keeps q[i, h] and its output row in registers (2 HEAD_DIM floats) and walks
// keys j = 0..i: score, m' = max(m, s), l = l e^(m - m') + e^(s - m'), acc = acc e^(m - m') + e^(s - m') v_j.
// Why faster than v1: no T x T score matrix is written and read back (v1 moves 6 Hq T^2 bytes
// through memory and launches three kernels); the threads of a warp are neighbouring rows of the
// same head, so they read the same key at the same time (one broadcast load from L1 serves all 32).
// Its weakness: every key is re-read by every thread from L1/L2, one 16-byte load per 8 flops.
// Launch: grid (ceil(T / blockDim), Hq), block 32..1024.
extern "C" __global__ void flash_v2_thread_row(const bf16* __restrict__ qkv, long long ld, int T, int Hq, int Hkv,
                                                float scale_log2e, bf16* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
    if (i >= T) return;
    const int kvh = h / (Hq / Hkv);
    const bf16* kcol = qkv + (long long)Hq * HEAD_DIM + (long long)kvh * HEAD_DIM;
    const bf16* vcol = qkv + (long long)(Hq + Hkv) * HEAD_DIM + (long long)kvh * HEAD_DIM;
    float qf[HEAD_DIM], acc[HEAD_DIM];
    load_row_f32(qkv + i * ld + (long long)h * HEAD_DIM, qf, scale_log2e);
#pragma unroll
    for (int d = 0; d < HEAD_DIM; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = 0; j <= i; ++j) {
        const float s = dot_row(qf, kcol + j * ld);
        const float m_new = fmaxf(m, s), alpha = exp2f(m - m_new), p = exp2f(s - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] *= alpha;
        axpy_row(acc, p, vcol + j * ld);
        m = m_new;
    }
    store_row(out + (long long)i * Hq * HEAD_DIM + (long long)h * HEAD_DIM, acc, 1.0f / l);
}

// v3: a block = blockDim query rows of one head. Per tile of BLOCK_N keys, the block copies K and
// V into shared memory with 16-byte loads (each byte read from global memory once per block instead
// of once per thread), then every thread scores CHUNK keys from shared memory (all threads read the
// same key: a broadcast), rescales its output ONCE for the chunk's new max, and adds the CHUNK
// weighted values. Why faster than v2: global/L2 traffic drops by blockDim; the rescale of the
// HEAD_DIM accumulators (v2: once per key) happens once per 16 keys, a third of v2's inner-loop flops.
// Still on the CUDA cores, one fp32 FMA at a time: v4 moves these products onto the tensor cores.
// Launch: grid (ceil(T / blockDim), Hq), block 32..1024; 2 BLOCK_N HEAD_DIM 2 bytes of static shared memory.
extern "C" __global__ void flash_v3_smem_tiles(const bf16* __restrict__ qkv, long long ld, int T, int Hq, int Hkv,
                                                float scale_log2e, bf16* __restrict__ out) {
    __shared__ __align__(16) bf16 k_tile[BLOCK_N * HEAD_DIM];
    __shared__ __align__(16) bf16 v_tile[BLOCK_N * HEAD_DIM];
    const int row0 = blockIdx.x * blockDim.x, h = blockIdx.y;
    const int i = row0 + threadIdx.x;                      // this thread's query row (may be >= T)
    const int ic = min(i, T - 1);                          // rows past T compute row T - 1, never stored
    const int last = min(row0 + (int)blockDim.x, T) - 1;   // the block's last row: keys 0..last
    const int kvh = h / (Hq / Hkv);
    const bf16* kcol = qkv + (long long)Hq * HEAD_DIM + (long long)kvh * HEAD_DIM;
    const bf16* vcol = qkv + (long long)(Hq + Hkv) * HEAD_DIM + (long long)kvh * HEAD_DIM;
    float qf[HEAD_DIM], acc[HEAD_DIM];
    load_row_f32(qkv + ic * ld + (long long)h * HEAD_DIM, qf, scale_log2e);
#pragma unroll
    for (int d = 0; d < HEAD_DIM; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += BLOCK_N) {
        __syncthreads();                                   // every thread is done with the last tile
        for (int idx = threadIdx.x; idx < BLOCK_N * D8; idx += blockDim.x) {
            const int r = idx / D8, c = idx % D8, j = j0 + r;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
            if (j <= last) {
                kv = *reinterpret_cast<const uint4*>(kcol + j * ld + 8 * c);
                vv = *reinterpret_cast<const uint4*>(vcol + j * ld + 8 * c);
            }
            *reinterpret_cast<uint4*>(k_tile + r * HEAD_DIM + 8 * c) = kv;
            *reinterpret_cast<uint4*>(v_tile + r * HEAD_DIM + 8 * c) = vv;
        }
        __syncthreads();
        for (int c0 = 0; c0 < BLOCK_N; c0 += CHUNK) {
            if (j0 + c0 > ic) break;                       // the rest of the tile is after this row
            float s[CHUNK];
            float m_new = m;
#pragma unroll
            for (int u = 0; u < CHUNK; ++u) {
                s[u] = j0 + c0 + u <= ic ? dot_row(qf, k_tile + (c0 + u) * HEAD_DIM) : -INFINITY;
                m_new = fmaxf(m_new, s[u]);
            }
            const float alpha = exp2f(m - m_new);          // key j0 + c0 <= ic: m_new is finite
            l *= alpha;
#pragma unroll
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] *= alpha;
#pragma unroll
            for (int u = 0; u < CHUNK; ++u) {
                const float p = exp2f(s[u] - m_new);
                l += p;
                axpy_row(acc, p, v_tile + (c0 + u) * HEAD_DIM);
            }
            m = m_new;
        }
    }
    if (i < T) store_row(out + (long long)i * Hq * HEAD_DIM + (long long)h * HEAD_DIM, acc, 1.0f / l);
}
