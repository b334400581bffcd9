// GPU track, chapter 04: RMSNorm with a block reduction, written by you.
//     y[t, i] = x[t, i] / sqrt(mean_i(x[t, i]^2) + eps) * w[i]      (fp32 math, bf16 output)
//
// Launch (as the engine launches kernels_cu/rmsnorm.cu): grid = (T), block = (blockDim.x) threads,
// blockDim.x a multiple of 32 between 32 and 1024 (the checker tries 32, 64, 160, 256, 1024).
// Who owns what:
//   * block b owns row b: x + b * H in, out + b * H out;
//   * thread x owns the columns i = x, x + blockDim.x, ... < H: it squares and adds them (step 1),
//     then later scales and writes exactly those columns (step 4);
//   * warp w (threads 32w..32w+31) adds its 32 partial sums with shuffles (step 2): after
//     `v += __shfl_xor_sync(0xffffffff, v, offset)` for offset = 16, 8, 4, 2, 1 EVERY lane holds the warp's sum;
//   * warps cannot see each other's registers: lane 0 of each warp writes its warp's sum to
//     shared memory, warp_sums[w] (step 3). Every thread then needs all of them, so there must be a
//     __syncthreads() between the writes and the reads: without it a fast warp reads slots that slower
//     warps have not written yet (a race: right with one warp, wrong or changing with several).
// Common mistakes the checker names: eps outside the square root, dividing by the sum instead of
// the mean, a missing weight, a missing __syncthreads(), a wrong row offset.
// Check it with: engine.exercises.ch04.check_rmsnorm_kernel()
#include "common.cuh"   // bf16, f2bf (float -> bf16)

extern "C" __global__ void rmsnorm(const float* __restrict__ x,   // [T, H]
                                    const float* __restrict__ w,   // [H]
                                    bf16* __restrict__ out,        // [T, H]
                                    int H, float eps) {
    __shared__ float warp_sums[32];                       // one slot per warp (at most 1024 / 32)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const float* xr = x + (long long)blockIdx.x * H;      // this block's row
    bf16* yr = out + (long long)blockIdx.x * H;

    // Step 1 (TODO): this thread's sum of x^2 over its columns.
    float ss = 0.0f;

    // Step 2 (TODO): the warp's sum, in every lane (five __shfl_xor_sync steps).

    // Step 3 (TODO): lane 0 stores the warp's sum in warp_sums[warp]; synchronize the block;
    //                every thread adds warp_sums[0 .. n_warps-1] into `total`.
    float total = 0.0f;

    // Step 4 (TODO): inv_rms = rsqrtf(total / H + eps), then yr[i] = f2bf(xr[i] * inv_rms * w[i])
    //                for this thread's columns.

}
