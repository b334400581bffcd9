// Chapter 14: the decode projections as a GEMV on the tensor cores.
//     out[t, n] = sum_k x[t, k] * W[n, k]      t < T <= GEMV_MAX_ROWS (<= 8), n < N, k < K
// x bf16 [T, K] (a few decode rows), W bf16 [N, K] (nn.Linear layout, row n = output column n),
// fp32 accumulation, fp32 out [T, N]. The work is tiny (2 T N K flops) and the time is reading W:
// N * K * 2 bytes at copy bandwidth is the floor, so everything below is about keeping enough
// 16-byte loads of W in flight, reading each byte of W exactly once, and doing the math for free.
//
// Why tensor cores for a GEMV: with CUDA-core FMAs, 8 rows cost 8 FMAs (plus conversions) per bf16
// of W, ~4 FMAs per byte: at ~4 TB/s that is half of an H200's fp32 issue rate, so T = 8 would be
// compute bound. One mma.m16n8k16 multiplies 16 rows of W by all 8 rows of x (rows t >= T are ignored).
//
// Grid and block (launch geometry from engine/ops/gemv.py):
//   grid.x = ceil(N / 16): block b owns the 16 output columns n0 = 16 b .. 16 b + 15 (the M of
//            the mma: W is the A operand, 16 of its rows) for all T rows of x (the mma's N = 8).
//   blockDim.x = 32 * warps, warps = 1..NWARPS (the launcher picks more warps for a narrow N, so
//            that the grid still fills every SM with loads): the block's warps split K. K is cut in
//            k-blocks of 32; warp j takes k-blocks j, j + warps, j + 2 warps, ... (at any moment
//            the block's warps read neighbouring bytes of the same 16 rows).
//   lane (g = lane / 4, q = lane % 4), in k-block kb: k = 32 kb + 8 q .. 8 q + 7, i.e. 16 bytes of
//            W row n0 + g, 16 bytes of W row n0 + g + 8 and 16 bytes of x row g: 4 lanes read a
//            row's 64 contiguous bytes, one warp-wide load reads 8 rows x 64 bytes (whole 32-byte
//            sectors). A main loop takes UNROLL k-blocks per step with every load issued before
//            the first mma (3 UNROLL 16-byte loads in flight per thread, no bounds checks); a tail
//            loop does what is left one k-block at a time, zeros past K.
//            Rows n >= N (the last tile) and x rows g >= T read row 0 instead of zeros: an mma's
//            output row depends only on its A row, an output column only on its B column, and
//            those outputs are never written.
//   Those registers ARE the mma operands. A dot product does not care in which order k is summed,
//   provided A and B use the same order, so the thread's own 8 k values fill its fragment slots
//   (layout below; logical k 2q+j of an mma reads physical 8q+j, logical 2q+8+j reads 8q+2+j):
//     mma 1:  a0 = W[n0+g][8q+0,1]  a1 = W[n0+g+8][8q+0,1]  a2 = W[n0+g][8q+2,3]  a3 = W[n0+g+8][8q+2,3]
//             b0 = x[g][8q+0,1]     b1 = x[g][8q+2,3]
//     mma 2:  the same with 8q+4,5 and 8q+6,7: the two mmas cover the k-block's 32 k exactly once.
//   Accumulators: c0 c1 = out[2q, 2q+1][n0+g], c2 c3 = out[2q, 2q+1][n0+g+8].
//   The warps' partial sums meet in shared memory (dynamic, 512 bytes per warp; none for a single
//   warp), added in warp order (deterministic); warp 0 writes the tile. An output's summation
//   order depends on N and K only, never on T or on the other rows: a row's result is bitwise the
//   same whatever else is in the batch.
//
// Memory: W is streamed (ld.global.nc.L1::no_allocate: read once, it must not evict x from L1).
// x (T K 2 bytes, up to 128 KiB at K = 8192) is read by every block through the read-only path
// (__ldg): after the first block on an SM it hits in L1 (else L2). Staging x in shared memory
// instead would copy T K 2 bytes per block of 16 columns, as much as the block's 16 K 2 bytes of W.
//
// Fragments of mma.m16n8k16 (g = lane / 4, q = lane % 4; as in flash_attention.cu):
//   A (16x16):  a0 (row g, cols 2q..2q+1)  a1 (row g+8, cols 2q..)  a2 (row g, cols 2q+8..)  a3 (row g+8, cols 2q+8..)
//   B (16x8):   b0 (k 2q..2q+1, col g)     b1 (k 2q+8.., col g)
//   C (16x8):   c0 c1 (row g, cols 2q, 2q+1)   c2 c3 (row g+8, cols 2q, 2q+1)
//
// Two entry points, the same layout: gemv_bf16 (16-byte loads: K % 8 == 0, rows of x and W
// 16-byte aligned) and gemv_bf16_unaligned (element loads, any K and alignment: the tiny test
// models, views). Compile-time constants, set by engine/ops/gemv.py (the defaults below are its
// values, so that a plain `nvcc gemv.cu` builds the kernel the engine runs; tests/test_kernels_compile.py
// checks they agree):
// GEMV_MAX_ROWS (rows of x, at most the mma's 8), NWARPS (most warps per block) and UNROLL
// (k-blocks per main-loop step: 3 UNROLL 16-byte loads in flight per thread).
// bf16 mma.sync needs sm_80+; engine/ops/linear.py keeps cuBLAS on older GPUs.
#include "common.cuh"

#ifndef GEMV_MAX_ROWS
#define GEMV_MAX_ROWS 8
#endif
#ifndef NWARPS
#define NWARPS 16
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
static_assert(GEMV_MAX_ROWS >= 1 && GEMV_MAX_ROWS <= 8, "GEMV_MAX_ROWS: 1..8 (x rows are the n = 8 of mma.m16n8k16)");
static_assert(NWARPS >= 1 && NWARPS <= 32, "NWARPS: 1..32 warps per block");
static_assert(UNROLL >= 1 && UNROLL <= 8, "UNROLL: 1..8 k-blocks per main-loop step");

#define TILE_N 16     // output columns per block (rows of W): the M of mma.m16n8k16
#define KBLOCK 32     // k per warp step: 8 bf16 per lane x 4 lanes, two mmas of k = 16
// Registers for 32 resident warps per SM (64 per thread). With this minimum stated, ptxas schedules
// for memory-level parallelism: all 3 UNROLL loads of a step are issued before its first mma. Left
// to itself it squeezes registers and interleaves loads and mmas (a few loads in flight at a time).
#define MIN_BLOCKS (1024 / (NWARPS * 32))

#if __CUDA_ARCH__ >= 800
// 16 bytes at p (16-byte aligned). STREAM (W): ld.global.nc.L1::no_allocate, read once and never
// cached in L1, so that it does not push x out. Else (x): ld.global.nc, the read-only path via L1.
template <bool STREAM>
__device__ __forceinline__ uint4 load16(const bf16* p) {
    uint4 v;
    if (STREAM)
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        v = __ldg(reinterpret_cast<const uint4*>(p));
    return v;
}

// 8 bf16 at row[k .. k+7] as four registers (element k in the low half of .x), zeros where k >= K.
// VEC (K % 8 == 0, so a chunk is all in or all out): one 16-byte load; else one element at a time
// (the slow path: tiny models with K % 8 != 0, unaligned views).
template <bool VEC, bool STREAM>
__device__ __forceinline__ uint4 load8(const bf16* row, int k, int K) {
    if (VEC) return k < K ? load16<STREAM>(row + k) : make_uint4(0u, 0u, 0u, 0u);
    unsigned e[8];
    const unsigned short* r = reinterpret_cast<const unsigned short*>(row);
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = k + j < K ? (unsigned)__ldg(r + k + j) : 0u;
    return make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16), e[6] | (e[7] << 16));
}

// c[16x8] += a[16x16] b[16x8], bf16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

template <bool VEC>
__device__ __forceinline__ void gemv_tile(const bf16* __restrict__ x, long long ldx,    // [T, ldx]
                                          const bf16* __restrict__ w, long long ldw,    // [N, ldw]
                                          float* __restrict__ out, long long ldo,       // [T, ldo]
                                          int T, int N, int K) {
#if __CUDA_ARCH__ >= 800
    extern __shared__ float4 partial[];                   // [warps * 32]: lane L of warp j at 32 j + L
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * TILE_N;
    const int na = n0 + g, nb = na + 8;                   // this lane's two rows of W (output columns)
    const bool a_ok = na < N, b_ok = nb < N;
    // Rows past N (last tile) and x rows past T read a real row instead (row 0): an mma's output row
    // depends only on its A row and an output column only on its B column, so those values land in
    // outputs that are never written. Only k past K must be zeros (in both operands).
    const bf16* w_a = w + (long long)(a_ok ? na : 0) * ldw;   // [K] row na of W
    const bf16* w_b = w + (long long)(b_ok ? nb : 0) * ldw;   // [K] row nb of W
    const bf16* x_g = x + (long long)(g < T ? g : 0) * ldx;   // [K] row g of x
    const int kblocks = (K + KBLOCK - 1) / KBLOCK;
    const int full = VEC ? K / KBLOCK : 0;                    // k-blocks wholly inside K

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int kb = warp;
    // Main loop: UNROLL whole k-blocks per step, no bounds to check, every load issued before the
    // first mma (3 UNROLL 16-byte loads in flight per thread). A guarded load (predicate, branch or
    // address clamp) here lets the compiler interleave loads and mmas, one k-block in flight at a time.
    if (VEC) for (; kb + (UNROLL - 1) * warps < full; kb += UNROLL * warps) {
        uint4 wa[UNROLL], wb[UNROLL], xv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = (kb + u * warps) * KBLOCK + 8 * q;
            wa[u] = load16<true>(w_a + k);
            wb[u] = load16<true>(w_b + k);
            xv[u] = load16<false>(x_g + k);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            mma_bf16(acc, wa[u].x, wb[u].x, wa[u].y, wb[u].y, xv[u].x, xv[u].y);   // k 8q+0..3
            mma_bf16(acc, wa[u].z, wb[u].z, wa[u].w, wb[u].w, xv[u].z, xv[u].w);   // k 8q+4..7
        }
    }
    // The rest (fewer than UNROLL k-blocks per warp, the partial last one, or everything on the
    // unaligned path): one k-block at a time, zeros past K.
    for (; kb < kblocks; kb += warps) {
        const int k = kb * KBLOCK + 8 * q;
        const uint4 wa = load8<VEC, true>(w_a, k, K), wb = load8<VEC, true>(w_b, k, K);
        const uint4 xv = load8<VEC, false>(x_g, k, K);
        mma_bf16(acc, wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
        mma_bf16(acc, wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
    }

    if (warps > 1) {                                      // uniform over the block
        partial[threadIdx.x] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        if (warp != 0) return;
        for (int j = 1; j < warps; ++j) {
            const float4 p = partial[32 * j + lane];
            acc[0] += p.x; acc[1] += p.y; acc[2] += p.z; acc[3] += p.w;
        }
    }
    const int t0 = 2 * q, t1 = t0 + 1;                    // this lane's two rows of x / out
    if (t0 < T) {
        if (a_ok) out[t0 * ldo + na] = acc[0];
        if (b_ok) out[t0 * ldo + nb] = acc[2];
    }
    if (t1 < T) {
        if (a_ok) out[t1 * ldo + na] = acc[1];
        if (b_ok) out[t1 * ldo + nb] = acc[3];
    }
#else
    __trap();   // needs sm_80+ (bf16 mma.sync); engine/ops/linear.py never launches it below that
#endif
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
gemv_bf16(const bf16* __restrict__ x, long long ldx,     // [T, ldx] rows 16-byte aligned, ldx % 8 == 0
          const bf16* __restrict__ w, long long ldw,     // [N, ldw] rows 16-byte aligned, ldw % 8 == 0
          float* __restrict__ out, long long ldo,        // [T, ldo]
          int T, int N, int K) {                         // K % 8 == 0
    gemv_tile<true>(x, ldx, w, ldw, out, ldo, T, N, K);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
gemv_bf16_unaligned(const bf16* __restrict__ x, long long ldx,   // [T, ldx]
                    const bf16* __restrict__ w, long long ldw,   // [N, ldw]
                    float* __restrict__ out, long long ldo,      // [T, ldo]
                    int T, int N, int K) {
    gemv_tile<false>(x, ldx, w, ldw, out, ldo, T, N, K);
}
