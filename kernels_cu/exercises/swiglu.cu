// GPU track, chapter 07: SwiGLU, written by you.
//     out[t, i] = silu(gate[t, i]) * up[t, i],   silu(g) = g / (1 + exp(-g))
// The input is the fp32 output of the fused gate_up projection, [T, 2I]: row t holds the I gate
// values, THEN the I up values (gate[t, i] = gate_up[t * 2I + i], up[t, i] = gate_up[t * 2I + I + i]).
// The output is bf16 [T, I], the input of the down projection.
//
// Launch (as the engine launches kernels_cu/swiglu.cu): block = (256) threads,
// grid = (min(ceil(n / 256), 65535)) blocks for n = T * I outputs. The grid is capped, so a large
// tensor has more elements than threads (the checker also caps it much lower).
// Who owns what: elementwise, one output element idx = t * I + i at a time. Thread g of the grid
// (g = blockIdx.x * blockDim.x + threadIdx.x) owns idx = g, g + gridDim.x * blockDim.x, ... < n
// (a grid-stride loop). Neighbouring threads own neighbouring idx: coalesced reads and writes.
// n does not fit an int for big batches (T * I = 2047 * 8192 > 16M is fine, 65536 * 65536 is not):
// keep idx in long long.
// Check it with: engine.exercises.ch07.check_swiglu_kernel()
#include "common.cuh"   // bf16, f2bf (float -> bf16)

extern "C" __global__ void swiglu(const float* __restrict__ gate_up,   // [T, 2I]
                                   bf16* __restrict__ out,               // [T, I]
                                   long long n,                          // T * I
                                   int I) {
    // TODO: a grid-stride loop over idx < n. For each idx: t = idx / I, i = idx % I,
    //       read g and u from row t of gate_up, write out[idx] = f2bf(silu(g) * u)
    //       (__expf is the fast exponential).

}
