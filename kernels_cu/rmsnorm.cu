// Chapter 04: RMSNorm, y = x / sqrt(mean(x^2) + eps) * w, reduced in fp32.
// Thread layout: one block per token row; each thread accumulates x^2 over a strided slice of
// the row (coalesced), a block-wide reduction gives the mean, then the same threads scale and write.
// rmsnorm_naive is the first rung of the ladder (kernel_bench times both): one THREAD per row, the
// whole row summed serially. Neighbouring threads read addresses H floats apart (no coalescing) and
// only T threads run, so a few hundred rows leave most of the GPU idle.
// The fused variant first adds the sublayer's output into the fp32 residual stream (x += delta)
// and writes the normalized row straight in bf16: the input of the next GEMM, one pass instead of three.
#include "common.cuh"

extern "C" __global__ void rmsnorm(const float* __restrict__ x,   // [T, H]
                                    const float* __restrict__ w,   // [H]
                                    bf16* __restrict__ out,        // [T, H]
                                    int H, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    const float inv_rms = rsqrtf(block_sum(ss, scratch) / H + eps);
    bf16* yr = out + (long long)blockIdx.x * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) yr[i] = f2bf(xr[i] * inv_rms * w[i]);
}

// Naive rung: thread t owns row t. Launch with ceil(T / threads) blocks.
extern "C" __global__ void rmsnorm_naive(const float* __restrict__ x,   // [T, H]
                                          const float* __restrict__ w,   // [H]
                                          bf16* __restrict__ out,        // [T, H]
                                          int T, int H, float eps) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* xr = x + (long long)t * H;
    float ss = 0.0f;
    for (int i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float inv_rms = rsqrtf(ss / H + eps);
    bf16* yr = out + (long long)t * H;
    for (int i = 0; i < H; ++i) yr[i] = f2bf(xr[i] * inv_rms * w[i]);
}

extern "C" __global__ void add_rmsnorm(float* __restrict__ residual,     // [T, H], updated in place
                                        const float* __restrict__ delta,  // [T, H] sublayer output
                                        const float* __restrict__ w,      // [H]
                                        bf16* __restrict__ out,           // [T, H] normalized, bf16
                                        int H, float eps) {
    __shared__ float scratch[32];
    float* xr = residual + (long long)blockIdx.x * H;
    const float* dr = delta + (long long)blockIdx.x * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = xr[i] + dr[i];
        xr[i] = v;                 // each element is read and written by the same thread: no race
        ss += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(ss, scratch) / H + eps);
    bf16* yr = out + (long long)blockIdx.x * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) yr[i] = f2bf(xr[i] * inv_rms * w[i]);
}
