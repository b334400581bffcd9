// The paged-attention ladder (chapter 11): decode attention straight from the KV cache pages.
// Query row r (one decode token of sequence seq_idx[r] at position positions[r]) attends to keys
// 0..positions[r]; key j lives in page page_tables[seq][j / page_size] at offset j % page_size of a
// cache [num_pages, page_size, Hkv, HEAD_DIM] in bf16. Every rung takes the engine's arguments and
// grid (rows, Hkv, splits): one block per (row, KV head), serving the GROUP query heads of that KV
// head, with an fp32 online softmax (no score vector in memory). The work is reading the context's
// K and V once: sum(ctx) Hkv HEAD_DIM 2 2 bytes, at best at copy bandwidth.
// `python -m engine.kernel_bench --ladder paged_attention` checks every rung against
// engine.ops.paged_attention.paged_attention_ref.
//
//   v1  kernels_cu/exercises/solutions/paged_attention.cu   chapter 11's solution: a warp per query
//                                                           head, a lane per dimension, one key at a time.
//   v2  paged_attention_v2_vec (below)                      16-byte lanes: a key over HEAD_DIM/8 lanes,
//                                                           a warp on 32/(HEAD_DIM/8) keys per step.
//   v3  paged_attention_v3_gqa (below)                      each K/V vector loaded once for the whole
//                                                           GQA group; the block's warps split the keys.
//   v4  kernels_cu/paged_attention.cu paged_attention       + a cp.async pipeline through shared memory,
//                                                           several keys' math per softmax rescale.
//   v5  kernels_cu/paged_attention.cu paged_attention_tc    the group's heads on the tensor cores.
//   v6  paged_attention_tc + paged_attention_merge          split-K: the context cut into slices, for
//                                                           more blocks when rows are few.
// HEAD_DIM (a power of two, 16..256) and GROUP (query heads per KV head) are compile-time, as in
// the engine's kernel; the number of warps is blockDim.x / 32 (at most MAX_WARPS).
#include "../common.cuh"   // kernels_cu/common.cuh, the helpers every kernel shares

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 4
#endif
#define MAX_WARPS 8
#define LPK (HEAD_DIM / 8)          // lanes per key: each lane moves 8 bf16 = 16 bytes
#define KPW (32 / LPK)              // keys per warp per step
static_assert(HEAD_DIM >= 16 && HEAD_DIM <= 256 && (HEAD_DIM & (HEAD_DIM - 1)) == 0, "HEAD_DIM: power of two in [16, 256]");
static_assert(GROUP >= 1 && GROUP <= 8, "GROUP in [1, 8]");
static_assert(MAX_WARPS * GROUP * (HEAD_DIM + 2) * 4 <= 48 * 1024, "v3's merge buffer exceeds 48 KB of shared memory");

__device__ __forceinline__ void unpack8_bf16(const uint4& raw, float* out) {   // 8 bf16 -> 8 fp32
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Fold the state (m2, l2, acc2) into (m, l, acc); scores are in log2 units (exp2).
__device__ __forceinline__ void fold8(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    const float m_new = fmaxf(m, m2);
    if (m_new == -INFINITY) return;                          // both empty
    const float a = exp2f(m - m_new), b = exp2f(m2 - m_new);
    l = l * a + l2 * b;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acc2[i] * b;
    m = m_new;
}

// One key's score s (already in log2 units) and value v folded into the running state.
__device__ __forceinline__ void online_step(float& m, float& l, float* acc, float s, const float* v) {
    const float m_new = fmaxf(m, s), alpha = exp2f(m - m_new), p = exp2f(s - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * alpha + p * v[i];
    m = m_new;
}

// The KPW key groups of a warp merged: lanes with the same dimensions (lane % LPK) exchange states.
__device__ __forceinline__ void merge_key_groups(float& m, float& l, float* acc) {
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
        float acc2[8];
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[i], off);
        fold8(m, l, acc, m2, l2, acc2);
    }
}

// v2: still one warp per query head (warp w serves heads w, w + warps, ...), but a key's HEAD_DIM
// values are split over LPK = HEAD_DIM / 8 lanes that each load 8 bf16 with ONE 16-byte load, so
// the warp works on KPW keys per step (4 at HEAD_DIM 64); the LPK partial dot products meet through
// log2(LPK) shuffles. Each lane keeps the softmax state of its key group; the groups are merged at
// the end. Why faster than v1: v1 loads 2 bytes per lane and walks the keys one by one (64 lanes of
// 2 bytes = one 128-byte row per step); here each load instruction moves 512 bytes, 4 keys at once,
// and a score costs 3 shuffles instead of 5.
extern "C" __global__ void paged_attention_v2_vec(const bf16* __restrict__ q, long long q_row_stride,
                                                   const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                                   const int* __restrict__ page_tables, int max_pages,
                                                   const int* __restrict__ seq_idx, const int* __restrict__ positions,
                                                   int page_size, int n_kv_heads, float scale_log2e,
                                                   bf16* __restrict__ out, long long out_row_stride,
                                                   float* __restrict__ part_ml, float* __restrict__ part_acc) {
    const int r = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int kg = lane / LPK, d0 = (lane % LPK) * 8;
    const int* table = page_tables + (long long)seq_idx[r] * max_pages;
    const int ctx = positions[r] + 1;
    const long long token_stride = (long long)n_kv_heads * HEAD_DIM;
    const long long head_off = (long long)kvh * HEAD_DIM + d0;
    for (int g = warp; g < GROUP; g += warps) {
        const int h = kvh * GROUP + g;
        float qf[8], acc[8];
        unpack8_bf16(*reinterpret_cast<const uint4*>(q + r * q_row_stride + (long long)h * HEAD_DIM + d0), qf);
#pragma unroll
        for (int i = 0; i < 8; ++i) { qf[i] *= scale_log2e; acc[i] = 0.0f; }
        float m = -INFINITY, l = 0.0f;
        for (int base = 0; base < ctx; base += KPW) {        // warp-uniform loop: the shuffles need every lane
            const int j = base + kg;
            const bool valid = j < ctx;
            float kf[8], vf[8];
            if (valid) {
                const long long slot = (long long)table[j / page_size] * page_size + j % page_size;
                unpack8_bf16(*reinterpret_cast<const uint4*>(k_cache + slot * token_stride + head_off), kf);
                unpack8_bf16(*reinterpret_cast<const uint4*>(v_cache + slot * token_stride + head_off), vf);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) kf[i] = vf[i] = 0.0f;
            }
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) s += qf[i] * kf[i];
#pragma unroll
            for (int off = LPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            if (valid) online_step(m, l, acc, s, vf);
        }
        merge_key_groups(m, l, acc);
        if (kg == 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) out[r * out_row_stride + (long long)h * HEAD_DIM + d0 + i] = f2bf(acc[i] / l);
        }
    }
}

// v3: the GQA group shares its loads. Every lane keeps the state of ALL GROUP query heads (their q
// slices in registers), so each 16-byte K/V load serves GROUP heads instead of one; and instead of
// one warp per head, the block's warps split the keys (warp w takes steps w, w + warps, ...), so a
// row's context is read by all of them at once. The warps' states meet in shared memory.
// Why faster than v2: GROUP (4 for Llama-3.2-1B) times fewer bytes loaded per head, and every warp
// of the block streams keys, whatever GROUP is. Loads still go through registers, one step at a time.
extern "C" __global__ void paged_attention_v3_gqa(const bf16* __restrict__ q, long long q_row_stride,
                                                   const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                                   const int* __restrict__ page_tables, int max_pages,
                                                   const int* __restrict__ seq_idx, const int* __restrict__ positions,
                                                   int page_size, int n_kv_heads, float scale_log2e,
                                                   bf16* __restrict__ out, long long out_row_stride,
                                                   float* __restrict__ part_ml, float* __restrict__ part_acc) {
    __shared__ float sh_ml[MAX_WARPS][GROUP][2];
    __shared__ float sh_acc[MAX_WARPS][GROUP][HEAD_DIM];
    const int r = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int kg = lane / LPK, d0 = (lane % LPK) * 8;
    const int* table = page_tables + (long long)seq_idx[r] * max_pages;
    const int ctx = positions[r] + 1;
    const long long token_stride = (long long)n_kv_heads * HEAD_DIM;
    const long long head_off = (long long)kvh * HEAD_DIM + d0;

    float qf[GROUP][8], acc[GROUP][8], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        unpack8_bf16(*reinterpret_cast<const uint4*>(q + r * q_row_stride + (long long)(kvh * GROUP + g) * HEAD_DIM + d0),
                     qf[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) { qf[g][i] *= scale_log2e; acc[g][i] = 0.0f; }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int base = warp * KPW; base < ctx; base += warps * KPW) {   // uniform within the warp
        const int j = base + kg;
        const bool valid = j < ctx;
        float kf[8], vf[8];
        if (valid) {
            const long long slot = (long long)table[j / page_size] * page_size + j % page_size;
            unpack8_bf16(*reinterpret_cast<const uint4*>(k_cache + slot * token_stride + head_off), kf);
            unpack8_bf16(*reinterpret_cast<const uint4*>(v_cache + slot * token_stride + head_off), vf);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) kf[i] = vf[i] = 0.0f;
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) s += qf[g][i] * kf[i];
#pragma unroll
            for (int off = LPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            if (valid) online_step(m[g], l[g], acc[g], s, vf);
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) merge_key_groups(m[g], l[g], acc[g]);
    if (lane < LPK) {                                        // key group 0 holds the warp's state
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (lane == 0) { sh_ml[warp][g][0] = m[g]; sh_ml[warp][g][1] = l[g]; }
#pragma unroll
            for (int i = 0; i < 8; ++i) sh_acc[warp][g][d0 + i] = acc[g][i];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
        const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float mm = -INFINITY, ll = 0.0f, aa = 0.0f;
        for (int w = 0; w < warps; ++w) {                    // in warp order: deterministic
            const float m2 = sh_ml[w][g][0], l2 = sh_ml[w][g][1];
            const float m_new = fmaxf(mm, m2);
            if (m_new == -INFINITY) continue;                // a warp that saw no key (short context)
            const float a = exp2f(mm - m_new), b = exp2f(m2 - m_new);
            ll = ll * a + l2 * b;
            aa = aa * a + sh_acc[w][g][d] * b;
            mm = m_new;
        }
        out[r * out_row_stride + (long long)(kvh * GROUP + g) * HEAD_DIM + d] = f2bf(aa / ll);
    }
}
