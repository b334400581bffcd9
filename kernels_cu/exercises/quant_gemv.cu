// GPU track, chapter 18: the dequantizing GEMV for int4 weights, written by you.
//     out[t, n] = sum_k x[t, k] * (q[n, k] - z[n, k / G]) * s[n, k / G]      (fp32 math and output)
//
// The engine's layout (engine/ops/quantization.py), W [N, K] of N outputs and K inputs:
//   qweight  uint32 [N, K / 8]    word (n, j) holds the codes q[n, 8j .. 8j + 7]: input 8j + i in bits
//                                 4i .. 4i + 3, so (word >> (4 * i)) & 0xF is the code of input 8j + i
//   scales   fp16   [N, K / G]    raw 16-bit halves: half_to_float below converts them exactly
//   zeros    uint8  [N, K / G]    the zero point of each group, in quantized units (the code of 0.0)
//   x        bf16   [T, ldx]      T rows (1..8) of K inputs, row t at x + t * ldx (ldx >= K)
//   out      fp32   [T, ldo]      row t at out + t * ldo
// G (the group size) is a multiple of 8: a word never straddles two groups.
//
// Launch (as the engine launches kernels_cu/quant_gemv.cu's quant_gemv_int4): grid = ceil(N / warps),
// block = 32 * warps threads. Who owns what:
//   * warp w of block b owns output row n = b * (blockDim.x / 32) + w (a warp past the last row returns);
//   * lane l of that warp reads the words j = l, l + 32, l + 64, ... < K / 8 of row n: consecutive
//     lanes read consecutive words, so one warp-wide load is 128 contiguous bytes (coalesced);
//   * for each word: the group g = (8 j) / G of its inputs (the INPUT index divided by G, not the word
//     index), its scale and zero point, the 8 codes, and for every row t of x the partial sum
//     sum_i x[t, 8j + i] * (q_i - z), multiplied by s;
//   * the 32 lanes' sums of row t meet with warp_sum (common.cuh: five shuffles, every lane gets the
//     total), and lane 0 writes out[t * ldo + n].
// Every packed byte is read once, and unpacked in registers: that single pass over a quarter of bf16's
// bytes is what makes a decode step faster.
// Common mistakes the checker names: the nibbles read from the high end, the zero point added or
// forgotten, the group taken from the word index or from the next group, x's rows read K apart.
// Check it with: engine.exercises.ch18.check_quant_gemv_kernel()
#include "common.cuh"   // bf16, warp_sum

#define MAX_ROWS 8      // rows of x per launch (the engine's QGEMV_MAX_ROWS)

// float16 bits -> float32, exact (normal, subnormal, zero; no inf or nan in a scale).
__device__ __forceinline__ float half_to_float(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16, mag = h & 0x7fffu;
    if (mag < 0x0400u) return __uint_as_float(sign | __float_as_uint((float)mag * 5.9604644775390625e-8f));
    return __uint_as_float(sign | ((mag << 13) + 0x38000000u));
}

// bf16 bits -> float32 (exact: bf16 is the top half of an fp32).
__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

extern "C" __global__ void quant_gemv_int4(const unsigned short* __restrict__ x, long long ldx,  // [T, ldx] bf16 bits
                                           const unsigned* __restrict__ qweight,                 // [N, K / 8]
                                           const unsigned short* __restrict__ scales,            // [N, K / G] fp16 bits
                                           const unsigned char* __restrict__ zeros,              // [N, K / G]
                                           float* __restrict__ out, long long ldo,               // [T, ldo]
                                           int T, int N, int K, int G) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;                                   // the whole warp: warp_sum below stays full
    const int words = K / 8, groups = K / G;

    float acc[MAX_ROWS];
    for (int t = 0; t < MAX_ROWS; ++t) acc[t] = 0.0f;

    // Step 1 (TODO): for j = lane, lane + 32, ... < words: the word qweight[n * words + j], its group
    //                g = 8 * j / G, s = half_to_float(scales[n * groups + g]), z = zeros[n * groups + g];
    //                for t < T: acc[t] += s * sum over i = 0..7 of x[t * ldx + 8 j + i] * (code_i - z),
    //                code_i = (word >> (4 * i)) & 0xF, x read with bf16_bits_to_float.

    // Step 2 (TODO): for t < T: the warp's total of acc[t] (warp_sum); lane 0 writes out[t * ldo + n].

}
