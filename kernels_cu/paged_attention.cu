// Chapter 11: attention straight from the KV cache pages, with an fp32 online softmax.
//
// Every query row r (a decode token, or one token of a prompt being prefilled over the cache)
// belongs to sequence seq_idx[r], sits at absolute position pos[r], and attends to the keys at
// positions 0..pos[r] of its sequence. Key j lives in page page_tables[seq][j / BS] at offset j % BS.
// The cache of one layer is [num_pages, BS, Hkv, D] in bf16; a contiguous cache is the case of
// one page of BS = max_context per sequence, so the same kernel serves chapters 08-11.
//
// Grid: (rows, Hkv, splits). One block serves ONE KV head and ALL the GROUP query heads that share
// it (GQA): each key/value vector is loaded once and used GROUP times. No score matrix exists:
// keys stream through and a running (max m, sum l, weighted sum acc) per query head is updated,
//     m' = max(m, s),  l' = l*exp(m - m') + exp(s - m'),  acc' = acc*exp(m - m') + exp(s - m')*v.
// Thread layout inside the block: 4 warps; a key's D values are split across LPK = D/8 lanes,
// each lane moving 8 bf16 (16 bytes), so one warp handles KPW = 32/LPK keys per step and UNROLL
// steps per iteration; warps take interleaved groups of keys. K/V reach the lanes through shared
// memory: cp.async copies run STAGES - 1 iterations ahead of the math, so many bytes are in flight
// without holding registers (the kernel is bound by memory latency, not arithmetic). The dot
// product is finished with LPK-lane shuffles.
// At the end the per-lane states are merged (shuffles inside a warp, shared memory across warps).
// With splits > 1 each block covers one slice of the context and writes its unnormalized state;
// paged_attention_merge combines the slices (split-K, for when there are too few rows to fill the GPU).
//
// The first rung of the ladder is chapter 11's exercise, whose worked solution
// (kernels_cu/exercises/solutions/paged_attention.cu) takes the same arguments and grid (splits = 1):
// one warp per query head, keys one at a time. kernel_bench times both.
//
// Compile-time constants (NVRTC -D options): HEAD_DIM (16..256, power of two) and GROUP (query
// heads per KV head, 1..8); STAGES, UNROLL and MIN_BLOCKS are tuning knobs (notes/measurements/).
//
// paged_attention_tc (further down) is the same computation on the tensor cores, which the engine
// runs on sm_80+ for head_dim <= 128: same arguments, grid and split-K state.
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef NWARPS                  // the launcher's (engine/ops/paged_attention.py passes -DNWARPS; tests/test_kernels_compile.py checks they agree)
#define NWARPS 4
#endif
#define LPK (HEAD_DIM / 8)          // lanes per key
#define KPW (32 / LPK)              // keys per warp per step
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1                // blocks per SM the register allocation must allow
#endif
#ifndef STAGES
#define STAGES 3                    // iterations of K/V in flight through shared memory
#endif
#ifndef UNROLL
#define UNROLL 2                    // steps whose loads are issued before any math (latency hiding)
#endif

static_assert(HEAD_DIM >= 16 && HEAD_DIM <= 256 && (HEAD_DIM & (HEAD_DIM - 1)) == 0, "HEAD_DIM: power of two in [16, 256]");
static_assert(GROUP >= 1 && GROUP <= 8, "GROUP in [1, 8]");

struct MergeSmem {           // each warp's softmax state for every query head of the group
    float ml[NWARPS][GROUP][2];
    float acc[NWARPS][GROUP][HEAD_DIM];
};

// Fold the NWARPS states in `sh` for each (head, dim) and store row r's GROUP heads of KV head kvh:
// normalized bf16 (one split) or this split's unnormalized state for paged_attention_merge.
__device__ __forceinline__ void store_group(const MergeSmem& sh, int r, int kvh, bf16* __restrict__ out,
                                            long long out_row_stride, float* __restrict__ part_ml,
                                            float* __restrict__ part_acc) {
    const int split = blockIdx.z, n_splits = gridDim.z;
    for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
        const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float m = -INFINITY, l = 0.0f, acc = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float m2 = sh.ml[w][g][0], l2 = sh.ml[w][g][1];
            const float m_new = fmaxf(m, m2);
            if (m_new == -INFINITY) continue;
            const float a = exp2f(m - m_new), b = exp2f(m2 - m_new);
            l = l * a + l2 * b;
            acc = acc * a + sh.acc[w][g][d] * b;
            m = m_new;
        }
        const int h = kvh * GROUP + g;
        if (n_splits == 1) {
            out[r * out_row_stride + (long long)h * HEAD_DIM + d] = f2bf(l > 0.0f ? acc / l : 0.0f);
        } else {
            const long long p = ((long long)r * gridDim.y * GROUP + h) * n_splits + split;
            part_acc[p * HEAD_DIM + d] = acc;
            if (d == 0) { part_ml[2 * p] = m; part_ml[2 * p + 1] = l; }
        }
    }
}

struct State {               // running softmax state of one lane for every query head of the group
    float m[GROUP], l[GROUP], acc[GROUP][8];
};

__device__ __forceinline__ void unpack8(const uint4& raw, float* out) {   // 8 bf16 -> 8 fp32
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load8(const bf16* p, float* out) {
    unpack8(*reinterpret_cast<const uint4*>(p), out);             // one 16-byte load
}

// Fold state b (m2, l2, acc2) into state a.
__device__ __forceinline__ void merge_into(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    const float m_new = fmaxf(m, m2);
    if (m_new == -INFINITY) return;                 // both empty
    const float a = exp2f(m - m_new), b = exp2f(m2 - m_new);
    l = l * a + l2 * b;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acc2[i] * b;
    m = m_new;
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
paged_attention(const bf16* __restrict__ q, long long q_row_stride,        // [R, Hq*D] (row stride in elements)
                const bf16* __restrict__ k_cache,                          // [NB, BS, Hkv, D]
                const bf16* __restrict__ v_cache,                          // [NB, BS, Hkv, D]
                const int* __restrict__ page_tables, int max_pages,      // [S, max_pages]
                const int* __restrict__ seq_idx,                           // [R]
                const int* __restrict__ positions,                         // [R]
                int page_size, int n_kv_heads, float scale_log2e,
                bf16* __restrict__ out, long long out_row_stride,          // [R, Hq*D]   (splits == 1)
                float* __restrict__ part_ml,                               // [R, Hq, splits, 2] (splits > 1)
                float* __restrict__ part_acc) {                            // [R, Hq, splits, D]
    const int r = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kg = lane / LPK;                   // which key of the warp's step this lane works on
    const int d0 = (lane % LPK) * 8;             // first of this lane's 8 dimensions
    const int* table = page_tables + (long long)seq_idx[r] * max_pages;
    const int ctx = positions[r] + 1;

    // This split's slice of the context: keys [k_begin, k_end). Short rows leave late slices empty.
    const int per_split = (ctx + n_splits - 1) / n_splits;
    const int k_begin = split * per_split;
    const int k_end = min(ctx, k_begin + per_split);

    // This lane's slice of every query head of the group, pre-scaled so that exp2 gives exp(scale*q.k).
    float qf[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        load8(q + r * q_row_stride + (long long)(kvh * GROUP + g) * HEAD_DIM + d0, qf[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qf[g][i] *= scale_log2e;
    }
    State st;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        st.m[g] = -INFINITY;
        st.l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) st.acc[g][i] = 0.0f;
    }

    const long long head_off = (long long)kvh * HEAD_DIM + d0;
    const long long token_stride = (long long)n_kv_heads * HEAD_DIM;
    const int step = NWARPS * KPW * UNROLL;                // keys the whole block covers per iteration
    const int first = k_begin + warp * KPW * UNROLL;       // this warp's first key
    const int n_iter = first < k_end ? (k_end - first + step - 1) / step : 0;

    // K/V stream through shared memory with cp.async, STAGES - 1 iterations ahead of the math:
    // the copies in flight cost no registers, so many more bytes are in flight per SM than
    // register-staged loads allow. Each lane reads back only the 16-byte vectors it copied itself,
    // so waiting for its own copy groups is all the synchronization needed.
    // The pipeline's buffers and, once it has drained, the warps' partial states share one
    // allocation (static shared memory is capped at 48 KB; HEAD_DIM 256 x GROUP 8 needs both halves).
    __shared__ __align__(16) union {
        uint4 kv[NWARPS][STAGES][UNROLL][2][32];
        MergeSmem merge;
    } smem;
    auto& kv_smem = smem.kv;
    auto issue = [&](int it) {
        if (it < n_iter) {
            const int base = first + it * step;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int j = base + u * KPW + kg;
                if (j < k_end) {
                    const long long slot = (long long)table[j / page_size] * page_size + j % page_size;
                    cp_async16(&kv_smem[warp][it % STAGES][u][0][lane], k_cache + slot * token_stride + head_off);
                    cp_async16(&kv_smem[warp][it % STAGES][u][1][lane], v_cache + slot * token_stride + head_off);
                }
            }
        }
        cp_async_commit();                                 // one group per iteration, empty ones too
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    for (int it = 0; it < n_iter; ++it) {
        issue(it + STAGES - 1);
        cp_async_wait<STAGES - 1>();                       // iteration `it` has landed
        const int base = first + it * step;
        bool valid[UNROLL];
        uint4 kraw[UNROLL], vraw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            valid[u] = base + u * KPW + kg < k_end;
            kraw[u] = kv_smem[warp][it % STAGES][u][0][lane];
            vraw[u] = valid[u] ? kv_smem[warp][it % STAGES][u][1][lane] : make_uint4(0, 0, 0, 0);   // unwritten: any bits
        }
        // The iteration's UNROLL keys are folded in at once: their scores first, then one rescale of
        // the running state by the new maximum (one exp2 and 9 multiplies per query head per
        // iteration instead of per key). A key past the end scores -inf and weighs exp2(-inf) = 0.
        float kf[UNROLL][8], vf[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            unpack8(kraw[u], kf[u]);
            unpack8(vraw[u], vf[u]);
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s[UNROLL];
            float m_new = st.m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot += qf[g][i] * kf[u][i];
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
                s[u] = valid[u] ? dot : -INFINITY;
                m_new = fmaxf(m_new, s[u]);
            }
            if (m_new == -INFINITY) continue;        // no valid key seen yet (this lane's tail)
            const float alpha = exp2f(st.m[g] - m_new);
            st.l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < 8; ++i) st.acc[g][i] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float p = exp2f(s[u] - m_new);
                st.l[g] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) st.acc[g][i] += p * vf[u][i];
            }
            st.m[g] = m_new;
        }
    }
    cp_async_wait<0>();

    // Merge the KPW key groups of each warp: lanes with the same d0 combine through shuffles.
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float acc2[8];
            const float m2 = __shfl_xor_sync(0xffffffffu, st.m[g], off);
            const float l2 = __shfl_xor_sync(0xffffffffu, st.l[g], off);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, st.acc[g][i], off);
            merge_into(st.m[g], st.l[g], st.acc[g], m2, l2, acc2);
        }
    }
    // Merge the warps through shared memory: lanes 0..LPK-1 of each warp hold its whole state.
    auto& sh_ml = smem.merge.ml;
    auto& sh_acc = smem.merge.acc;
    __syncthreads();                 // every warp is done with the pipeline buffers they overlay
    if (lane < LPK) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (lane == 0) { sh_ml[warp][g][0] = st.m[g]; sh_ml[warp][g][1] = st.l[g]; }
#pragma unroll
            for (int i = 0; i < 8; ++i) sh_acc[warp][g][d0 + i] = st.acc[g][i];
        }
    }
    __syncthreads();
    store_group(smem.merge, r, kvh, out, out_row_stride, part_ml, part_acc);
}

// ---- paged_attention_tc: the same decode attention on the tensor cores (sm_80+) ------------------
//
// The CUDA-core kernel above spends its time on instructions, not bytes: per key and query head, 8
// FMAs and 3 shuffles for the score, 8 FMAs for the value, on every lane of the key. Here one
// mma.m16n8k16 does a 16 x 8 x 16 block of that work in one warp instruction. The GROUP query heads
// of the KV head are the M rows of the tile (GROUP <= 8 of 16: the other rows are zeros, a waste the
// tensor cores can afford), a tile of TC_KEYS = 16 keys is the N of S = Q K^T and the K of O += P V,
// exactly as in flash_attention.cu, whose fragment layouts and ldmatrix addressing this follows.
//
// Grid (rows, Hkv, splits) and the split-K state are the ones above; a split covers whole tiles.
// Each warp streams its own tiles (warp w takes tiles w, w + NWARPS, ...) through TC_STAGES
// shared-memory buffers with cp.async, so no block-wide barrier runs inside the loop; at the end the
// warps' states are folded by store_group like the CUDA-core kernel's.
#define TC_KEYS 16
#define TC_TILE_BYTES (2 * TC_KEYS * HEAD_DIM * 2)      // a K and a V tile, bf16
#ifndef TC_STAGES
#define TC_STAGES (48 * 1024 / (NWARPS * TC_TILE_BYTES) < 4 ? 48 * 1024 / (NWARPS * TC_TILE_BYTES) : 4)
#endif
// The shapes it is built for (the launcher checks the same): other builds of this file keep the
// CUDA-core kernel and compile this one to a trap.
#define TC_SHAPE_OK (HEAD_DIM % 16 == 0 && HEAD_DIM <= 128 && TC_STAGES >= 2)

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_attention_tc(const bf16* __restrict__ q, long long q_row_stride,
                   const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                   const int* __restrict__ page_tables, int max_pages,
                   const int* __restrict__ seq_idx, const int* __restrict__ positions,
                   int page_size, int n_kv_heads, float scale_log2e,
                   bf16* __restrict__ out, long long out_row_stride,
                   float* __restrict__ part_ml, float* __restrict__ part_acc) {
#if __CUDA_ARCH__ >= 800 && TC_SHAPE_OK
    constexpr int CHUNKS = HEAD_DIM / 8;                 // 16-byte chunks per key
    const int r = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;               // this lane's row (query head) and column pair
    const int mi = lane >> 3;                            // which 8x8 matrix this lane addresses in ldmatrix
    const int* table = page_tables + (long long)seq_idx[r] * max_pages;
    const int ctx = positions[r] + 1;

    // This split's whole tiles, and this warp's share of them.
    const int n_tiles = (ctx + TC_KEYS - 1) / TC_KEYS;
    const int per_split = (n_tiles + n_splits - 1) / n_splits;
    const int tile_end = min(n_tiles, (split + 1) * per_split);
    const int first = split * per_split + warp;
    const int n_iter = first < tile_end ? (tile_end - first + NWARPS - 1) / NWARPS : 0;

    __shared__ __align__(128) union {
        bf16 kv[NWARPS][TC_STAGES][2][TC_KEYS * HEAD_DIM];
        MergeSmem merge;
    } smem;

    // The group's query heads as A fragments: row g is head g (zeros past GROUP), rows g + 8 are zeros.
    unsigned qf[HEAD_DIM / 16][4];
    const bf16* qrow = q + r * q_row_stride + (long long)(kvh * GROUP + min(g, GROUP - 1)) * HEAD_DIM + 2 * t;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        qf[kk][0] = g < GROUP ? *reinterpret_cast<const unsigned*>(qrow + 16 * kk) : 0u;
        qf[kk][2] = g < GROUP ? *reinterpret_cast<const unsigned*>(qrow + 16 * kk + 8) : 0u;
        qf[kk][1] = qf[kk][3] = 0u;
    }

    const long long token_stride = (long long)n_kv_heads * HEAD_DIM;
    const bf16* k_head = k_cache + (long long)kvh * HEAD_DIM;
    const bf16* v_head = v_cache + (long long)kvh * HEAD_DIM;
    const bool tile_in_one_page = page_size % TC_KEYS == 0;   // tiles start at multiples of 16
    auto issue = [&](int it) {
        if (it < n_iter) {
            const int key0 = (first + it * NWARPS) * TC_KEYS;
            bf16* kd = smem.kv[warp][it % TC_STAGES][0];
            bf16* vd = smem.kv[warp][it % TC_STAGES][1];
            const long long slot0 = tile_in_one_page ? (long long)table[key0 / page_size] * page_size + key0 % page_size : 0;
#pragma unroll
            for (int i = lane; i < TC_KEYS * CHUNKS; i += 32) {
                const int row = i / CHUNKS, c = i % CHUNKS, j = key0 + row;
                const int off = tile_offset<HEAD_DIM>(row, c);
                if (j < ctx) {
                    const long long slot = tile_in_one_page ? slot0 + row
                                                            : (long long)table[j / page_size] * page_size + j % page_size;
                    cp_async16(kd + off, k_head + slot * token_stride + c * 8);
                    cp_async16(vd + off, v_head + slot * token_stride + c * 8);
                } else {   // past the context: zeros (a masked score times a stale NaN would still poison O)
                    *reinterpret_cast<uint4*>(kd + off) = make_uint4(0, 0, 0, 0);
                    *reinterpret_cast<uint4*>(vd + off) = make_uint4(0, 0, 0, 0);
                }
            }
        }
        cp_async_commit();                               // one group per iteration, empty ones too
    };

    float acc[HEAD_DIM / 8][4];                          // O: row g (c0 c1) dims 8nd + 2t (+1); rows g+8 stay 0
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    float m = -INFINITY, l = 0.0f;                       // row g's running max (log2 units), this lane's sum

#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) issue(s);
    for (int it = 0; it < n_iter; ++it) {
        __syncwarp();                                    // every lane is done with the buffer issued next
        issue(it + TC_STAGES - 1);
        cp_async_wait<TC_STAGES - 1>();
        __syncwarp();                                    // every lane's copies of tile `it` are visible
        const bf16* kt = smem.kv[warp][it % TC_STAGES][0];
        const bf16* vt = smem.kv[warp][it % TC_STAGES][1];
        const int key0 = (first + it * NWARPS) * TC_KEYS;

        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};   // keys key0 + 8nb + 2t (+1)
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            unsigned b[4];     // keys 0..7 dims lo, keys 0..7 dims hi, keys 8..15 dims lo, keys 8..15 dims hi
            ldmatrix_x4(b, kt + tile_offset<HEAD_DIM>(((mi >> 1) << 3) + (lane & 7), 2 * kk + (mi & 1)));
            mma_bf16(s[0], qf[kk], b[0], b[1]);
            mma_bf16(s[1], qf[kk], b[2], b[3]);
        }
        // Online softmax of row g over the tile's 16 keys (8 per n-block, 2 per lane of the quad).
        float mx = m;
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[nb][e] = key0 + 8 * nb + 2 * t + e < ctx ? s[nb][e] * scale_log2e : -INFINITY;
                mx = fmaxf(mx, s[nb][e]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float alpha = exp2f(m - mx);              // the tile's first key is in the context: mx is finite
        m = mx;
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[nb][e] = exp2f(s[nb][e] - mx);
                sum += s[nb][e];
            }
        }
        l = l * alpha + sum;
#pragma unroll
        for (int nd = 0; nd < HEAD_DIM / 8; ++nd) {
            acc[nd][0] *= alpha;
            acc[nd][1] *= alpha;
        }
        // P (row g; rows g+8 zero) as the A fragment of the tile's one k-block of O += P V.
        const unsigned pf[4] = {pack_bf16(s[0][0], s[0][1]), 0u, pack_bf16(s[1][0], s[1][1]), 0u};
#pragma unroll
        for (int nd2 = 0; nd2 < HEAD_DIM / 16; ++nd2) {
            unsigned b[4];     // keys 0..7 dims lo, keys 8..15 dims lo, keys 0..7 dims hi, keys 8..15 dims hi
            ldmatrix_x4_trans(b, vt + tile_offset<HEAD_DIM>(((mi & 1) << 3) + (lane & 7), 2 * nd2 + (mi >> 1)));
            mma_bf16(acc[2 * nd2], pf, b[0], b[1]);
            mma_bf16(acc[2 * nd2 + 1], pf, b[2], b[3]);
        }
    }
    cp_async_wait<0>();
    l += __shfl_xor_sync(0xffffffffu, l, 1);             // row g's sum over the quad's columns
    l += __shfl_xor_sync(0xffffffffu, l, 2);

    __syncthreads();                                     // every warp is done with the buffers merge overlays
    if (g < GROUP) {
        if (t == 0) { smem.merge.ml[warp][g][0] = m; smem.merge.ml[warp][g][1] = l; }
#pragma unroll
        for (int nd = 0; nd < HEAD_DIM / 8; ++nd) {
            smem.merge.acc[warp][g][8 * nd + 2 * t] = acc[nd][0];
            smem.merge.acc[warp][g][8 * nd + 2 * t + 1] = acc[nd][1];
        }
    }
    __syncthreads();
    store_group(smem.merge, r, kvh, out, out_row_stride, part_ml, part_acc);
#else
    __trap();   // sm_80+ (bf16 mma.sync) and TC_SHAPE_OK only: engine/ops/paged_attention.py launches nothing else
#endif
}

// Split-K epilogue: out[r, h, :] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.
// Grid (rows, Hq); HEAD_DIM threads, one per output dimension.
extern "C" __global__ void paged_attention_merge(const float* __restrict__ part_ml,    // [R, Hq, splits, 2]
                                                  const float* __restrict__ part_acc,   // [R, Hq, splits, D]
                                                  int n_splits,
                                                  bf16* __restrict__ out, long long out_row_stride) {
    const int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const long long p0 = ((long long)r * gridDim.y + h) * n_splits;
    float m = -INFINITY;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, part_ml[2 * (p0 + s)]);
    float l = 0.0f, acc = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
        const float ms = part_ml[2 * (p0 + s)];
        if (ms == -INFINITY) continue;              // an empty slice
        const float w = exp2f(ms - m);
        l += part_ml[2 * (p0 + s) + 1] * w;
        acc += part_acc[(p0 + s) * HEAD_DIM + d] * w;
    }
    out[r * out_row_stride + (long long)h * HEAD_DIM + d] = f2bf(l > 0.0f ? acc / l : 0.0f);
}
