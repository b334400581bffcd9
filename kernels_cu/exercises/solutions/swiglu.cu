// Worked solution of kernels_cu/exercises/swiglu.cu (chapter 07): see the skeleton for the layout.
#include "common.cuh"

extern "C" __global__ void swiglu(const float* __restrict__ gate_up,   // [T, 2I]
                                   bf16* __restrict__ out,               // [T, I]
                                   long long n,                          // T * I
                                   int I) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n; idx += stride) {
        const long long t = idx / I, i = idx % I;
        const float g = gate_up[t * 2 * I + i], u = gate_up[t * 2 * I + I + i];
        out[idx] = f2bf(g / (1.0f + __expf(-g)) * u);
    }
}
