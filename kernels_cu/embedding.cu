// Chapter 03: embedding gather. out[t, :] = table[ids[t], :]
// Thread layout: one block per token t (gridDim.x = T), threads stride over the hidden dimension
// two values at a time (a bf16x2 is 4 bytes; odd H falls back to one), so a warp reads 128 contiguous bytes of one table
// row: fully coalesced. The row index comes from ids[t], the only indirection.
// An id outside [0, V) is never dereferenced: its output row is NaN, which the sampler's
// finite check turns into an error naming the request (the launcher refuses host ids up front).
#include "common.cuh"

extern "C" __global__ void embedding_gather(const int* __restrict__ ids,       // [T]
                                             const bf16* __restrict__ table,    // [V, H]
                                             float* __restrict__ out,           // [T, H] fp32 residual stream
                                             int V, int H) {
    const int t = blockIdx.x;
    const int id = ids[t];
    float* dst_row = out + (long long)t * H;
    if (id < 0 || id >= V) {   // no such row: poison the token instead of reading past the table
        for (int i = threadIdx.x; i < H; i += blockDim.x) dst_row[i] = __int_as_float(0x7fc00000);
        return;
    }
    const long long row = id;
    if (H & 1) {   // odd rows are not 4-byte aligned: fall back to one value per thread
        for (int i = threadIdx.x; i < H; i += blockDim.x) dst_row[i] = bf2f(table[row * H + i]);
        return;
    }
    const __nv_bfloat162* src = reinterpret_cast<const __nv_bfloat162*>(table + row * H);
    float2* dst = reinterpret_cast<float2*>(dst_row);
    for (int i = threadIdx.x; i < H / 2; i += blockDim.x) dst[i] = __bfloat1622float2(src[i]);
}
