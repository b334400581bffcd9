// Chapter 03: embedding gather. out[t, :] = table[ids[t], :]
// Thread layout: one block per token t (gridDim.x = T), threads stride over the hidden dimension
// two values at a time (a bf16x2 is 4 bytes; odd H falls back to one), so a warp reads 128 contiguous bytes of one table
// row: fully coalesced. The row index comes from ids[t], the only indirection.
#include "common.cuh"

extern "C" __global__ void embedding_gather(const int* __restrict__ ids,       // [T]
                                             const bf16* __restrict__ table,    // [V, H]
                                             float* __restrict__ out,           // [T, H] fp32 residual stream
                                             int H) {
    const int t = blockIdx.x;
    const long long row = ids[t];
    if (H & 1) {   // odd rows are not 4-byte aligned: fall back to one value per thread
        for (int i = threadIdx.x; i < H; i += blockDim.x) out[(long long)t * H + i] = bf2f(table[row * H + i]);
        return;
    }
    const __nv_bfloat162* src = reinterpret_cast<const __nv_bfloat162*>(table + row * H);
    float2* dst = reinterpret_cast<float2*>(out + (long long)t * H);
    for (int i = threadIdx.x; i < H / 2; i += blockDim.x) dst[i] = __bfloat1622float2(src[i]);
}
