// Worked solution of kernels_cu/exercises/quant_gemv.cu (chapter 18): see the skeleton for the layout.
// One warp per output row, one 32-bit word (8 codes) per lane per step, x read element by element.
// The engine's kernels_cu/quant_gemv.cu computes the same sums faster: 16-byte loads (4 words per lane,
// several in flight), x read 8 bf16 at a time, s factored out of a whole chunk, and q - z computed
// without an int-to-float conversion (the code ORed into the mantissa of 2^23).
#include "common.cuh"

#define MAX_ROWS 8

__device__ __forceinline__ float half_to_float(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16, mag = h & 0x7fffu;
    if (mag < 0x0400u) return __uint_as_float(sign | __float_as_uint((float)mag * 5.9604644775390625e-8f));
    return __uint_as_float(sign | ((mag << 13) + 0x38000000u));
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

extern "C" __global__ void quant_gemv_int4(const unsigned short* __restrict__ x, long long ldx,  // [T, ldx] bf16 bits
                                           const unsigned* __restrict__ qweight,                 // [N, K / 8]
                                           const unsigned short* __restrict__ scales,            // [N, K / G] fp16 bits
                                           const unsigned char* __restrict__ zeros,              // [N, K / G]
                                           float* __restrict__ out, long long ldo,               // [T, ldo]
                                           int T, int N, int K, int G) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    const int words = K / 8, groups = K / G;

    float acc[MAX_ROWS];
    for (int t = 0; t < MAX_ROWS; ++t) acc[t] = 0.0f;

    for (int j = lane; j < words; j += 32) {                      // step 1: coalesced words
        const unsigned word = __ldg(qweight + (long long)n * words + j);
        const int k0 = 8 * j, g = k0 / G;                         // the group of the INPUTS
        const float s = half_to_float(scales[(long long)n * groups + g]);
        const float z = (float)zeros[(long long)n * groups + g];
        float d[8];                                               // q_i - z, unpacked in registers
        for (int i = 0; i < 8; ++i) d[i] = (float)((word >> (4 * i)) & 0xFu) - z;   // first input lowest
        for (int t = 0; t < T; ++t) {
            const unsigned short* xr = x + t * ldx + k0;
            float p = 0.0f;
            for (int i = 0; i < 8; ++i) p = fmaf(bf16_bits_to_float(__ldg(xr + i)), d[i], p);
            acc[t] = fmaf(p, s, acc[t]);                          // s once per word, not per value
        }
    }

    for (int t = 0; t < T; ++t) {                                 // step 2: the warp's total
        const float v = warp_sum(acc[t]);
        if (lane == 0) out[t * ldo + n] = v;
    }
}
