// Chapter 18: weight-only quantized projections, int4 and int8 weights with group-wise scales.
//     out[t, n] = sum_k x[t, k] * W[n, k],   W[n, k] = (q[n, k] - z[n, k / G]) * s[n, k / G]
// for t < T <= QGEMV_MAX_ROWS (<= 8, the decode rows), n < N, k < K; x bf16 [T, K] (row stride
// ldx), fp32 out [T, N] (row stride ldo), fp32 arithmetic throughout. The NumPy reference is
// engine/ops/quantization.py: quant_linear_ref (this GEMV) and dequantize_ref (the second kernel).
//
// The layout (engine/ops/quantization.py), rows contiguous:
//   qweight  uint32  [N, K * BITS / 32]   int4: word (n, j) holds q[n, 8j + i] in bits 4i..4i+3
//                                         int8: word (n, j) holds q[n, 4j + i] in bits 8i..8i+7
//   scales   float16 [N, K / G]           raw 16-bit halves (converted below, exactly)
//   zeros    uint8   [N, K / G]           the zero point, in quantized units
// G is a multiple of the values per word, so a word never straddles two groups.
//
// The design. A decode step is a pass over the weights: at T = 1 the floor is reading qweight,
// K * BITS / 8 bytes per row (a quarter / half of bf16's), so everything aims at streaming it:
//   * one warp per output row n, QGEMV_WARPS rows per block; the 32 lanes of a warp read the row's
//     consecutive 16-byte chunks (uint4; 32 int4 or 16 int8 values each), a warp-wide load covering
//     512 contiguous bytes; QGEMV_UNROLL chunks per lane are loaded before the first is used, so that
//     enough bytes are in flight to cover the memory latency. Every byte of qweight is read once,
//     streamed past L1 (ld.global.nc.L1::no_allocate) so that it does not evict x.
//   * a chunk lies inside one group (the 16-byte path needs G % values-per-chunk == 0): its scale and
//     zero point are loaded once (L1 resident: a row's are K / G * 3 bytes), and s is factored out of
//     the chunk's sum: sum_k x (q - z) s = s * sum_k x (q - z), one multiply per chunk, not per value.
//   * q - z without an integer-to-float conversion (cvt runs at a quarter of the FMA rate): the code
//     q ORed into the mantissa of 2^23 is the float 2^23 + q, and (2^23 + q) - (2^23 + z) = q - z
//     exactly, so a value costs a shift-and-mask, an add and one FMA per row of x.
//   * x (T K 2 bytes, 128 KiB at K = 8192, T = 8) is read with 16-byte loads through the read-only
//     path: after the first warps of an SM it hits in L1 (else L2).
//   * the lanes' partial sums meet by warp shuffles; lane 0 writes the T outputs of its row.
// At T = 8 the FMAs (8 per value, 16 per int4 byte) outrun the bandwidth on CUDA cores: that shape
// is compute bound here, and even at T = 1 this kernel reads only 13-22 % of the copy bandwidth on the
// H200 (int4, Llama-3.2-1B shapes): about ten instructions per int4 byte. It is the simple design (the
// chapter's exercise, the fallback for any layout and GPU); the engine's decode rows go to the
// tensor-core kernel further down (quant_mma_*), which unpacks two codes per instruction and lets
// mma.sync do the multiply (notes/18_quantization.md has its figures).
//
// Entry points, one templated body: quant_gemv_int4 / quant_gemv_int8 (16-byte loads: every
// qweight row a multiple of 16 bytes and 16-byte aligned, G a multiple of the values per chunk, x
// rows 16-byte aligned) and quant_gemv_int4_unaligned / _int8_unaligned (one word per lane per step,
// x element by element: any K, G and alignment; the same sums in another order).
// dequantize_bf16_int4 / _int8: W [N, K] as bf16 bits, rounded to nearest even (the prefill path,
// more than 16 rows: dequantize into a scratch matrix, then the cuBLAS GEMM); bit for bit
// f32_to_bf16(dequantize_ref(qw)), since (q - z) * s is exact in fp32.
//
// Compile-time constants, set by engine/ops/quant_gemv.py (the defaults below are its values, so that
// a plain `nvcc quant_gemv.cu` builds the kernel the engine runs; tests/test_kernels_compile.py checks that
// they agree): QGEMV_MAX_ROWS (rows of x), QGEMV_WARPS (rows of W per block, one per warp) and
// QGEMV_UNROLL (16-byte chunks in flight per lane) for this kernel, which needs no tensor cores (any
// GPU CuPy runs on); QMMA_WARPS, QMMA_UNROLL and QMMA_MIN_BLOCKS for the tensor-core one (sm_80+).
#include "common.cuh"
#include "mma.cuh"

#ifndef QGEMV_MAX_ROWS
#define QGEMV_MAX_ROWS 8
#endif
#ifndef QGEMV_WARPS
#define QGEMV_WARPS 8
#endif
#ifndef QGEMV_UNROLL
#define QGEMV_UNROLL 4
#endif
static_assert(QGEMV_MAX_ROWS >= 1 && QGEMV_MAX_ROWS <= 8, "QGEMV_MAX_ROWS: 1..8 decode rows");
static_assert(QGEMV_WARPS >= 1 && QGEMV_WARPS <= 32, "QGEMV_WARPS: 1..32 warps per block");
static_assert(QGEMV_UNROLL >= 1 && QGEMV_UNROLL <= 8, "QGEMV_UNROLL: 1..8 chunks per main-loop step");

#define MAGIC_BITS 0x4B000000u    // the float 2^23: with a code q < 2^23 in its mantissa, 2^23 + q
#define MAGIC 8388608.0f

// float16 bits -> float32, exact, by integer arithmetic (the CPU executor has no __half; the same
// code runs on both). A subnormal half is m * 2^-24, a normal fp32 value: no flush to zero under
// --use_fast_math.
__device__ __forceinline__ float half_bits_to_float(unsigned h) {
    const unsigned sign = (h & 0x8000u) << 16, mag = h & 0x7fffu;
    if (mag < 0x0400u)                                             // zero or subnormal
        return __uint_as_float(sign | __float_as_uint((float)mag * 5.9604644775390625e-8f));
    if (mag >= 0x7c00u)                                            // inf, nan: keep the payload
        return __uint_as_float(sign | 0x7f800000u | ((mag & 0x3ffu) << 13));
    return __uint_as_float(sign | ((mag << 13) + 0x38000000u));    // rebias the exponent: 15 -> 127
}

// bf16 pair in one 32-bit word -> its two floats (exact: bf16 is the top half of an fp32).
__device__ __forceinline__ float bf_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

// 16 bytes of qweight, streamed: read once, not cached in L1 (it would push x out).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

// part[t] += sum over the word's values i of x[t, k0 + i] * (q_i - z), zm = 2^23 + z.
// VEC: x rows 16-byte aligned and k0 a multiple of the word's values (8 bf16 = 16 bytes for int4,
// 4 bf16 = 8 bytes for int8): one vector load per row; else element loads.
template <int BITS, bool VEC>
__device__ __forceinline__ void word_dot(float* part, unsigned word, float zm,
                                         const unsigned short* __restrict__ x, long long ldx, int k0, int T) {
    constexpr int VPW = 32 / BITS;                        // values per word: 8 or 4
    constexpr unsigned MASK = (1u << BITS) - 1u;
    float d[VPW];                                         // q_i - z, exact
#pragma unroll
    for (int i = 0; i < VPW; ++i) d[i] = __uint_as_float(MAGIC_BITS | ((word >> (BITS * i)) & MASK)) - zm;
#pragma unroll
    for (int t = 0; t < QGEMV_MAX_ROWS; ++t) {
        if (t >= T) break;                                // uniform over the warp
        const unsigned short* xr = x + t * ldx + k0;      // [VPW] of row t
        float xv[VPW];
        if constexpr (VEC && VPW == 8) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(xr));
            xv[0] = bf_lo(v.x); xv[1] = bf_hi(v.x); xv[2] = bf_lo(v.y); xv[3] = bf_hi(v.y);
            xv[4] = bf_lo(v.z); xv[5] = bf_hi(v.z); xv[6] = bf_lo(v.w); xv[7] = bf_hi(v.w);
        } else if constexpr (VEC) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(xr));
            xv[0] = bf_lo(v.x); xv[1] = bf_hi(v.x); xv[2] = bf_lo(v.y); xv[3] = bf_hi(v.y);
        } else {
#pragma unroll
            for (int i = 0; i < VPW; ++i) xv[i] = __uint_as_float((unsigned)__ldg(xr + i) << 16);
        }
        float p = part[t];
#pragma unroll
        for (int i = 0; i < VPW; ++i) p = fmaf(xv[i], d[i], p);
        part[t] = p;
    }
}

// acc[t] += s * sum over the 16-byte chunk's values of x[t, k] (q - z): the chunk starts at k0 and
// lies inside one group (G % values-per-chunk == 0).
template <int BITS>
__device__ __forceinline__ void chunk_dot(float* acc, uint4 w, int k0, int G,
                                          const unsigned short* __restrict__ srow,   // [K / G] fp16
                                          const unsigned char* __restrict__ zrow,    // [K / G]
                                          const unsigned short* __restrict__ x, long long ldx, int T) {
    constexpr int VPW = 32 / BITS;
    const int g = k0 / G;
    const float zm = MAGIC + (float)zrow[g];
    float part[QGEMV_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < QGEMV_MAX_ROWS; ++t) part[t] = 0.0f;
    word_dot<BITS, true>(part, w.x, zm, x, ldx, k0, T);
    word_dot<BITS, true>(part, w.y, zm, x, ldx, k0 + VPW, T);
    word_dot<BITS, true>(part, w.z, zm, x, ldx, k0 + 2 * VPW, T);
    word_dot<BITS, true>(part, w.w, zm, x, ldx, k0 + 3 * VPW, T);
    const float s = half_bits_to_float(srow[g]);
#pragma unroll
    for (int t = 0; t < QGEMV_MAX_ROWS; ++t) acc[t] = fmaf(part[t], s, acc[t]);
}

template <int BITS, bool VEC>
__device__ __forceinline__ void quant_gemv_row(const unsigned short* __restrict__ x, long long ldx,  // [T, ldx] bf16
                                               const unsigned* __restrict__ qweight,                 // [N, K*BITS/32]
                                               const unsigned short* __restrict__ scales,            // [N, K/G] fp16
                                               const unsigned char* __restrict__ zeros,              // [N, K/G]
                                               float* __restrict__ out, long long ldo,               // [T, ldo]
                                               int T, int N, int K, int G) {
    constexpr int VPW = 32 / BITS;                        // values per 32-bit word
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * QGEMV_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;                                   // a whole warp: the shuffles below stay full
    const int words = K / VPW, groups = K / G;
    const unsigned* wrow = qweight + (long long)n * words;                // [words]
    const unsigned short* srow = scales + (long long)n * groups;          // [groups]
    const unsigned char* zrow = zeros + (long long)n * groups;            // [groups]

    float acc[QGEMV_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < QGEMV_MAX_ROWS; ++t) acc[t] = 0.0f;

    if constexpr (VEC) {
        constexpr int VPC = 4 * VPW;                      // values per 16-byte chunk: 32 or 16
        const int chunks = K / VPC;
        const uint4* crow = reinterpret_cast<const uint4*>(wrow);         // [chunks]
        // Main loop: QGEMV_UNROLL chunks per lane per step, all loaded before the first is used
        // (no bounds checks inside, so that the compiler issues them back to back); then the rest
        // one chunk at a time.
        int c = lane;
        for (; c + 32 * (QGEMV_UNROLL - 1) < chunks; c += 32 * QGEMV_UNROLL) {
            uint4 w[QGEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < QGEMV_UNROLL; ++u) w[u] = load_stream(crow + c + 32 * u);
#pragma unroll
            for (int u = 0; u < QGEMV_UNROLL; ++u) chunk_dot<BITS>(acc, w[u], (c + 32 * u) * VPC, G, srow, zrow, x, ldx, T);
        }
        for (; c < chunks; c += 32) chunk_dot<BITS>(acc, load_stream(crow + c), c * VPC, G, srow, zrow, x, ldx, T);
    } else {
        // Any layout: one word per lane per step (a word never straddles a group), x element by element.
        for (int j = lane; j < words; j += 32) {
            const int k0 = j * VPW, g = k0 / G;
            float part[QGEMV_MAX_ROWS];
#pragma unroll
            for (int t = 0; t < QGEMV_MAX_ROWS; ++t) part[t] = 0.0f;
            word_dot<BITS, false>(part, __ldg(wrow + j), MAGIC + (float)zrow[g], x, ldx, k0, T);
            const float s = half_bits_to_float(srow[g]);
#pragma unroll
            for (int t = 0; t < QGEMV_MAX_ROWS; ++t) acc[t] = fmaf(part[t], s, acc[t]);
        }
    }

#pragma unroll
    for (int t = 0; t < QGEMV_MAX_ROWS; ++t) {
        if (t >= T) break;
        const float v = warp_sum(acc[t]);
        if (lane == 0) out[t * ldo + n] = v;
    }
}

#define QGEMV_ARGS const unsigned short* __restrict__ x, long long ldx,  /* [T, ldx] bf16 bits */        \
                   const unsigned* __restrict__ qweight,                   /* [N, K * BITS / 32] */        \
                   const unsigned short* __restrict__ scales,              /* [N, K / G] fp16 bits */      \
                   const unsigned char* __restrict__ zeros,                /* [N, K / G] */                \
                   float* __restrict__ out, long long ldo,                 /* [T, ldo] */                  \
                   int T, int N, int K, int G
#define QGEMV_PASS x, ldx, qweight, scales, zeros, out, ldo, T, N, K, G

extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * 32) quant_gemv_int4(QGEMV_ARGS) {
    quant_gemv_row<4, true>(QGEMV_PASS);
}
extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * 32) quant_gemv_int8(QGEMV_ARGS) {
    quant_gemv_row<8, true>(QGEMV_PASS);
}
extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * 32) quant_gemv_int4_unaligned(QGEMV_ARGS) {
    quant_gemv_row<4, false>(QGEMV_PASS);
}
extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * 32) quant_gemv_int8_unaligned(QGEMV_ARGS) {
    quant_gemv_row<8, false>(QGEMV_PASS);
}

// ---------------------------------------------------------------------------------------------
// The tensor-core path (sm_80+): quant_mma_int4 / quant_mma_int8, 1 <= T <= 8 * TILES rows of x.
// The layout of gemv.cu with the unpacking in front of the mma: block b owns the 16 output columns
// n0 = 16 b .. 16 b + 15 (the M of mma.m16n8k16: W is the A operand), its warps split K into
// k-blocks of 4 chunks (one 16-byte chunk of a row per lane q: int4 128 k, int8 64 k), warp j taking
// k-blocks j, j + warps, ...; lane (g = lane / 4, q = lane % 4) reads the 16-byte chunk 4 kb + q of
// rows n0 + g and n0 + g + 8, so that 4 lanes read a row's 64 contiguous bytes. Every packed byte is
// read once; QMMA_UNROLL k-blocks of loads are issued before the first is unpacked.
//   A chunk holds VPC = 128 / BITS values (inside one group: G % VPC == 0); it is used as VPC / 8
//   sub-blocks of 8 values, each two mmas of k = 16 over the 4 lanes. A dot product does not care in
//   which order k is summed, provided A and B agree, so the 8 values of a sub-block fill the fragment
//   slots in the order the unpacking produces them: the pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7),
//     mma 1: a0 a2 = row n0+g (v0,v4) (v1,v5), a1 a3 = the same of row n0+g+8, b0 b1 = x (x0,x4) (x1,x5)
//     mma 2: the same with (v2,v6), (v3,v7) and (x2,x6), (x3,x7)
//   and x's 16 bytes (x0..x7) are rearranged into those pairs with four byte permutes.
// Unpacking to bf16 pairs, two values per instruction where possible:
//   int4: (word >> 4 j) & 0x000f000f | 0x43004300 is the bf16 pair (128 + v_j, 128 + v_{j+4}) (128 + q
//         is exact in bf16 for q < 128); minus the pair (128 + z) gives q - z exactly, times the
//         group's scale (rounded to bf16) gives W in bf16, rounded once.
//   int8: q - z (|q - z| <= 255, exact in fp32 and in bf16) through the float 2^23 + q (a byte permute),
//         two values converted to a bf16 pair at once, then times the scale in bf16.
// So A is W rounded to bf16 with the scale rounded to bf16 first: within a few bf16 ulps of
// dequantize_ref (W bf16 * x bf16 -> fp32 on the tensor cores, like the bf16 GEMV).
// TILES mmas of n = 8 per sub-block cover x rows 0..7, 8..15: the unpacked A serves all of them.
// Accumulators c0 c1 = out[8 t + 2q, + 1][n0+g], c2 c3 = out[8 t + 2q, + 1][n0+g+8]; the warps'
// partial sums meet in shared memory in warp order (deterministic), warp 0 writes the tile.
// Needs: 16-byte qweight rows and x rows (K % VPC == 0, ldx % 8 == 0, aligned), G % VPC == 0.
#ifndef QMMA_WARPS
#define QMMA_WARPS 16
#endif
#ifndef QMMA_UNROLL
#define QMMA_UNROLL 4
#endif
#ifndef QMMA_MIN_BLOCKS      // resident blocks of QMMA_WARPS warps the registers must leave room for
#define QMMA_MIN_BLOCKS 1
#endif
static_assert(QMMA_WARPS >= 1 && QMMA_WARPS <= 32, "QMMA_WARPS: 1..32 warps per block");
static_assert(QMMA_UNROLL >= 1 && QMMA_UNROLL <= 4, "QMMA_UNROLL: 1..4 k-blocks of loads in flight");

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned bf16x2_sub(unsigned a, unsigned b) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
}
__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
}
__device__ __forceinline__ float half_to_float(unsigned short h) {      // the hardware conversion, exact
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// One row's group constants for the chunk at k0: the scale as a bf16 pair, and the zero point as
// the pair (128 + z) (int4, bf16 bits 0x4300 | z) or the float 2^23 + z (int8).
template <int BITS>
struct GroupOf {
    unsigned scale2, zero2;
    float zero_magic;
    __device__ __forceinline__ GroupOf(const unsigned short* srow, const unsigned char* zrow, int group) {
        const float s = half_to_float(srow[group]);
        scale2 = pack_bf16(s, s);
        const unsigned z = zrow[group];
        zero2 = (0x4300u | z) * 0x00010001u;
        zero_magic = MAGIC + (float)z;
    }
};

// W values of sub-block `sub` of a chunk (8 values) as the four bf16 pairs (v_j, v_{j+4}), j = 0..3.
template <int BITS>
__device__ __forceinline__ void unpack_pairs(unsigned* pair, uint4 chunk, int sub, const GroupOf<BITS>& grp) {
    const unsigned words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    if constexpr (BITS == 4) {
        const unsigned w = words[sub];                               // 8 values, v_i in bits 4i
#pragma unroll
        for (int j = 0; j < 4; ++j)
            pair[j] = bf16x2_mul(bf16x2_sub(((w >> (4 * j)) & 0x000f000fu) | 0x43004300u, grp.zero2), grp.scale2);
    } else {
        const unsigned lo = words[2 * sub], hi = words[2 * sub + 1];  // v0..v3, v4..v7, v_i in byte i
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float a = __uint_as_float(__byte_perm(lo, MAGIC_BITS, 0x7650u | j)) - grp.zero_magic;
            const float b = __uint_as_float(__byte_perm(hi, MAGIC_BITS, 0x7650u | j)) - grp.zero_magic;
            pair[j] = bf16x2_mul(pack_bf16(a, b), grp.scale2);
        }
    }
}

// acc[t] += the chunk pair's products with x rows 8 t + g: the 16-byte chunks ca (row n0 + g) and
// cb (row n0 + g + 8) start at k0; `valid` false (a lane past K in the last k-block) adds zeros.
template <int BITS, int TILES>
__device__ __forceinline__ void chunk_mma(float (*acc)[4], uint4 ca, uint4 cb, int k0, bool valid, int G,
                                          const unsigned short* srow_a, const unsigned char* zrow_a,
                                          const unsigned short* srow_b, const unsigned char* zrow_b,
                                          const unsigned short* const* xrow) {
    constexpr int SUBS = 16 / BITS;                   // 8-value sub-blocks per chunk: 4 (int4) or 2 (int8)
    uint4 xv[TILES][SUBS];                            // x's 8 values per sub-block: loaded first, all at once
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int sub = 0; sub < SUBS; ++sub)
            xv[t][sub] = valid ? __ldg(reinterpret_cast<const uint4*>(xrow[t] + k0 + 8 * sub)) : make_uint4(0u, 0u, 0u, 0u);
    const int group = valid ? k0 / G : 0;
    const GroupOf<BITS> ga(srow_a, zrow_a, group), gb(srow_b, zrow_b, group);
#pragma unroll
    for (int sub = 0; sub < SUBS; ++sub) {
        unsigned pa[4] = {0u, 0u, 0u, 0u}, pb[4] = {0u, 0u, 0u, 0u};
        if (valid) { unpack_pairs<BITS>(pa, ca, sub, ga); unpack_pairs<BITS>(pb, cb, sub, gb); }
        const unsigned a1[4] = {pa[0], pb[0], pa[1], pb[1]}, a2[4] = {pa[2], pb[2], pa[3], pb[3]};
#pragma unroll
        for (int t = 0; t < TILES; ++t) {             // x0x1 x2x3 x4x5 x6x7 -> (x0,x4) (x1,x5), (x2,x6) (x3,x7)
            const uint4 v = xv[t][sub];
            mma_bf16(acc[t], a1, __byte_perm(v.x, v.z, 0x5410u), __byte_perm(v.x, v.z, 0x7632u));
            mma_bf16(acc[t], a2, __byte_perm(v.y, v.w, 0x5410u), __byte_perm(v.y, v.w, 0x7632u));
        }
    }
}
#endif

template <int BITS, int TILES>
__device__ __forceinline__ void quant_mma_tile(QGEMV_ARGS) {
#if __CUDA_ARCH__ >= 800
    constexpr int VPC = 128 / BITS;                   // values per 16-byte chunk: 32 or 16
    __shared__ float4 partial[TILES][QMMA_WARPS * 32];     // the warps' accumulators: lane L of warp j at 32 j + L
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int na = blockIdx.x * 16 + g, nb = na + 8;  // this lane's two rows of W (output columns)
    const bool a_ok = na < N, b_ok = nb < N;
    const int chunks = K / VPC, groups = K / G;
    // Rows past N and x rows past T read row 0 instead (their outputs are never written), as in gemv.cu.
    const long long ra = a_ok ? na : 0, rb = b_ok ? nb : 0;
    const uint4* wa = reinterpret_cast<const uint4*>(qweight) + ra * chunks;   // [chunks] row na
    const uint4* wb = reinterpret_cast<const uint4*>(qweight) + rb * chunks;   // [chunks] row nb
    const unsigned short* xrow[TILES];                                         // [K] x rows 8 t + g
#pragma unroll
    for (int t = 0; t < TILES; ++t) xrow[t] = x + (8 * t + g < T ? 8 * t + g : 0) * ldx;
#define QMMA_GROUPS scales + ra * groups, zeros + ra * groups, scales + rb * groups, zeros + rb * groups

    float acc[TILES][4];
#pragma unroll
    for (int t = 0; t < TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    const int kblocks = (chunks + 3) / 4, full = chunks / 4;
    int kb = warp;
    for (; kb + (QMMA_UNROLL - 1) * warps < full; kb += QMMA_UNROLL * warps) {   // every load first
        uint4 ca[QMMA_UNROLL], cb[QMMA_UNROLL];
#pragma unroll
        for (int u = 0; u < QMMA_UNROLL; ++u) {
            const int c = 4 * (kb + u * warps) + q;
            ca[u] = load_stream(wa + c);
            cb[u] = load_stream(wb + c);
        }
#pragma unroll
        for (int u = 0; u < QMMA_UNROLL; ++u)
            chunk_mma<BITS, TILES>(acc, ca[u], cb[u], (4 * (kb + u * warps) + q) * VPC, true, G, QMMA_GROUPS, xrow);
    }
    for (; kb < kblocks; kb += warps) {               // the rest; lanes past K add zeros
        const int c = 4 * kb + q;
        const bool valid = c < chunks;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        chunk_mma<BITS, TILES>(acc, valid ? load_stream(wa + c) : zero, valid ? load_stream(wb + c) : zero,
                               c * VPC, valid, G, QMMA_GROUPS, xrow);
    }
#undef QMMA_GROUPS

    if (warps > 1) {                                  // uniform over the block
#pragma unroll
        for (int t = 0; t < TILES; ++t) partial[t][threadIdx.x] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        __syncthreads();
        if (warp != 0) return;
        for (int j = 1; j < warps; ++j)
#pragma unroll
            for (int t = 0; t < TILES; ++t) {
                const float4 p = partial[t][32 * j + lane];
                acc[t][0] += p.x; acc[t][1] += p.y; acc[t][2] += p.z; acc[t][3] += p.w;
            }
    }
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
        const int t0 = 8 * t + 2 * q, t1 = t0 + 1;    // this lane's two rows of x / out
        if (t0 < T) {
            if (a_ok) out[t0 * ldo + na] = acc[t][0];
            if (b_ok) out[t0 * ldo + nb] = acc[t][2];
        }
        if (t1 < T) {
            if (a_ok) out[t1 * ldo + na] = acc[t][1];
            if (b_ok) out[t1 * ldo + nb] = acc[t][3];
        }
    }
#else
    __trap();   // needs sm_80+ (bf16 mma.sync); engine/ops/quant_gemv.py never launches it below that
#endif
}

extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32, QMMA_MIN_BLOCKS) quant_mma_int4_x8(QGEMV_ARGS) { quant_mma_tile<4, 1>(QGEMV_PASS); }
extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32, QMMA_MIN_BLOCKS) quant_mma_int4_x16(QGEMV_ARGS) { quant_mma_tile<4, 2>(QGEMV_PASS); }
extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32, QMMA_MIN_BLOCKS) quant_mma_int8_x8(QGEMV_ARGS) { quant_mma_tile<8, 1>(QGEMV_PASS); }
extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32, QMMA_MIN_BLOCKS) quant_mma_int8_x16(QGEMV_ARGS) { quant_mma_tile<8, 2>(QGEMV_PASS); }

// W [N, K] as bf16 bits: one thread per 32-bit word of qweight, writing its 8 (int4: one 16-byte
// store) or 4 (int8: one 8-byte store) values; K is a multiple of the values per word, so a word's
// outputs are contiguous and aligned like a row. Loads and stores are coalesced along the rows.
template <int BITS>
__device__ __forceinline__ void dequantize_word(const unsigned* __restrict__ qweight,     // [N, K * BITS / 32]
                                                const unsigned short* __restrict__ scales, // [N, K / G] fp16
                                                const unsigned char* __restrict__ zeros,   // [N, K / G]
                                                unsigned short* __restrict__ out,          // [N, K] bf16 bits
                                                int N, int K, int G) {
    constexpr int VPW = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const int words = K / VPW;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * words) return;
    const long long n = idx / words;
    const int k0 = (int)(idx - n * words) * VPW;
    const long long sg = n * (K / G) + k0 / G;
    const unsigned word = __ldg(qweight + idx);
    const float zm = MAGIC + (float)zeros[sg], s = half_bits_to_float(scales[sg]);
    unsigned packed[VPW / 2];                             // bf16 pairs, the first value in the low half
#pragma unroll
    for (int i = 0; i < VPW; i += 2) {
        const float lo = (__uint_as_float(MAGIC_BITS | ((word >> (BITS * i)) & MASK)) - zm) * s;
        const float hi = (__uint_as_float(MAGIC_BITS | ((word >> (BITS * (i + 1))) & MASK)) - zm) * s;
        packed[i / 2] = (unsigned)__bfloat16_as_ushort(f2bf(lo)) | ((unsigned)__bfloat16_as_ushort(f2bf(hi)) << 16);
    }
    unsigned short* dst = out + n * K + k0;               // [VPW]
    if constexpr (VPW == 8)
        *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    else
        *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
}

#define DEQ_ARGS const unsigned* __restrict__ qweight, const unsigned short* __restrict__ scales, \
                 const unsigned char* __restrict__ zeros, unsigned short* __restrict__ out, int N, int K, int G

extern "C" __global__ void dequantize_bf16_int4(DEQ_ARGS) { dequantize_word<4>(qweight, scales, zeros, out, N, K, G); }
extern "C" __global__ void dequantize_bf16_int8(DEQ_ARGS) { dequantize_word<8>(qweight, scales, zeros, out, N, K, G); }
