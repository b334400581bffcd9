// The RMSNorm ladder (chapter 04): y[t, i] = x[t, i] / sqrt(mean_i x[t, i]^2 + eps) * w[i]
// x fp32 [T, H] (the residual stream), w fp32 [H], y bf16 [T, H] (the next GEMM's input).
// Every rung reads each x once from memory at best and writes each y once: T H (4 + 2) bytes, so
// the ceiling is the measured copy bandwidth. `python -m engine.kernel_bench --ladder rmsnorm`
// checks every rung against engine.ops.rmsnorm.rmsnorm_ref and times it at every block size.
//
//   v1  kernels_cu/rmsnorm.cu rmsnorm_naive   one THREAD per row, the row summed serially.
//   v2  rmsnorm_v2_smem_tree (below)          one BLOCK per row, tree reduction in shared memory.
//   v3  kernels_cu/rmsnorm.cu rmsnorm         one block per row, warp shuffles + 32 floats of shared memory.
//   v4  rmsnorm_v4_float4 (below)             v3 with 16-byte loads and the row kept in registers.
//   v5  rmsnorm_v5_warp_row (below)           one WARP per row, no block barrier at all.
// v1 and v3 are the engine's kernels, compiled from their own file: this file holds only the rungs
// the engine does not run.
#include "../common.cuh"   // kernels_cu/common.cuh, the helpers every kernel shares

#ifndef VPT
#define VPT 4          // float4s of its row each thread keeps in registers (v4, v5); the rest is re-read
#endif

// v2: one block per row; each thread sums x^2 over a strided slice of the row (neighbouring threads
// read neighbouring floats: coalesced, unlike v1), then the block adds its blockDim partial sums by
// halving: step s adds element i + s into i, a __syncthreads between steps (log2(blockDim) barriers,
// half of the threads idle at the first step, all but one at the last).
// Why faster than v1: T blocks of blockDim threads instead of T threads, and every load coalesced.
// Launch: grid T, block a power of two 32..1024, blockDim * 4 bytes of dynamic shared memory.
extern "C" __global__ void rmsnorm_v2_smem_tree(const float* __restrict__ x, const float* __restrict__ w,
                                                 bf16* __restrict__ out, int H, float eps) {
    extern __shared__ float partial[];                     // [blockDim.x]
    const float* xr = x + (long long)blockIdx.x * H;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    partial[threadIdx.x] = ss;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    const float inv_rms = rsqrtf(partial[0] / H + eps);
    bf16* yr = out + (long long)blockIdx.x * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) yr[i] = f2bf(xr[i] * inv_rms * w[i]);
}

// Four floats -> four bf16 in one 8-byte store.
__device__ __forceinline__ void store_bf16x4(bf16* dst, float a, float b, float c, float d) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    uint2 v;
    v.x = *reinterpret_cast<unsigned*>(&lo);
    v.y = *reinterpret_cast<unsigned*>(&hi);
    *reinterpret_cast<uint2*>(dst) = v;
}

// The row pass of v4 and v5: `lane` of `lanes` threads sums x^2 over its float4s of the row, keeps
// the first VPT of them in registers and re-reads the rest (from L1/L2) in the write pass.
// `reduce` turns the thread's partial sum into the row's sum.
template <typename Reduce>
__device__ __forceinline__ void rmsnorm_row_float4(const float* __restrict__ xr, const float* __restrict__ w,
                                                   bf16* __restrict__ yr, int H, float eps, int lane, int lanes,
                                                   Reduce reduce) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const int H4 = H / 4;
    float4 keep[VPT];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {                        // VPT independent 16-byte loads in flight
        const int i = lane + j * lanes;
        keep[j] = i < H4 ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        ss += keep[j].x * keep[j].x + keep[j].y * keep[j].y + keep[j].z * keep[j].z + keep[j].w * keep[j].w;
    }
    for (int i = lane + VPT * lanes; i < H4; i += lanes) {  // rows longer than VPT * lanes float4s
        const float4 v = x4[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float inv_rms = rsqrtf(reduce(ss) / H + eps);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = lane + j * lanes;
        if (i < H4) {
            const float4 v = keep[j], g = w4[i];
            store_bf16x4(yr + 4 * i, v.x * inv_rms * g.x, v.y * inv_rms * g.y, v.z * inv_rms * g.z, v.w * inv_rms * g.w);
        }
    }
    for (int i = lane + VPT * lanes; i < H4; i += lanes) {
        const float4 v = x4[i], g = w4[i];
        store_bf16x4(yr + 4 * i, v.x * inv_rms * g.x, v.y * inv_rms * g.y, v.z * inv_rms * g.z, v.w * inv_rms * g.w);
    }
}

// v4: v3's layout (block per row, warp shuffles, block_sum) with 16-byte loads (float4 of x and w)
// and 8-byte stores (four bf16): a quarter of the load instructions, and each thread keeps its first
// VPT float4s in registers so that the write pass does not read them again.
// Why faster than v3: the kernel is bound by bytes in flight; VPT independent 16-byte loads per
// thread put 4 VPT times more bytes in flight per instruction issued than v3's 4-byte loads.
// Needs H % 4 == 0 (rows 16-byte aligned). Launch: grid T, block 32..1024 (whole warps).
extern "C" __global__ void rmsnorm_v4_float4(const float* __restrict__ x, const float* __restrict__ w,
                                              bf16* __restrict__ out, int H, float eps) {
    __shared__ float scratch[32];
    rmsnorm_row_float4(x + (long long)blockIdx.x * H, w, out + (long long)blockIdx.x * H, H, eps,
                       threadIdx.x, blockDim.x, [&](float v) { return block_sum(v, scratch); });
}

// v5: one warp per row, blockDim / 32 rows per block; the row's sum is a warp_sum (5 shuffles) with
// no shared memory and no __syncthreads. Same 16-byte loads and registers as v4.
// Why faster than v4: no block-wide barrier, and small rows (SmolLM2's H = 576 is 144 float4s) keep
// all 32 lanes busy where a block per row would leave most of a large block idle.
// Needs H % 4 == 0. Launch: grid ceil(T / (blockDim / 32)), block 32..1024.
extern "C" __global__ void rmsnorm_v5_warp_row(const float* __restrict__ x, const float* __restrict__ w,
                                                bf16* __restrict__ out, int T, int H, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= T) return;                                  // a whole warp leaves: shuffles stay full
    rmsnorm_row_float4(x + (long long)row * H, w, out + (long long)row * H, H, eps,
                       threadIdx.x & 31, 32, [](float v) { return warp_sum(v); });
}
