// Chapter 07: greedy decoding, the index of the largest logit of each row (first one on ties,
// like numpy.argmax). One block per row; each thread scans a strided slice keeping (value, index),
// then a shared-memory tree reduction picks the winner. Only the int32 index goes back to the host.
#include "common.cuh"

// THREADS (threads per block) comes from the launcher, engine/ops/argmax.py, as -DTHREADS=...; the
// default is the same value, so that a plain `nvcc argmax.cu` builds the kernel the engine runs
// (tests/test_kernels_compile.py checks they agree).
#ifndef THREADS
#define THREADS 1024
#endif
static_assert(THREADS >= 32 && THREADS <= 1024 && (THREADS & (THREADS - 1)) == 0,
              "the tree reduction halves the block each step: THREADS must be a power of two");

extern "C" __global__ void __launch_bounds__(THREADS) argmax_rows(const float* __restrict__ logits,  // [R, V]
                                        int* __restrict__ out,              // [R]
                                        int V) {
    __shared__ float best_v[THREADS];
    __shared__ int best_i[THREADS];
    const float* row = logits + (long long)blockIdx.x * V;
    float bv = -INFINITY;
    int bi = V;   // sentinel larger than any index
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = row[i];
        if (v > bv) { bv = v; bi = i; }    // strided scan: the first max of this slice wins
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float ov = best_v[threadIdx.x + stride];
            const int oi = best_i[threadIdx.x + stride];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0] < V ? best_i[0] : 0;  // all-NaN row -> 0
}
