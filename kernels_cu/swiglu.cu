// Chapter 07: SwiGLU, out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
// Input: the fp32 output of the fused gate_up projection [T, 2*I] (gate columns, then up columns).
// Output: bf16 [T, I], the input of the down projection. Elementwise: one thread per output value,
// a grid-stride loop; neighbouring threads read neighbouring gate and up values (coalesced).
#include "common.cuh"

extern "C" __global__ void swiglu(const float* __restrict__ gate_up,   // [T, 2I]
                                   bf16* __restrict__ out,               // [T, I]
                                   long long n,                          // T * I
                                   int I) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / I, i = idx % I;
        const float g = gate_up[t * 2 * I + i], u = gate_up[t * 2 * I + I + i];
        out[idx] = f2bf(g / (1.0f + __expf(-g)) * u);
    }
}
