// GPU track, chapter 03: the embedding gather, written by you.
//     out[t, :] = table[ids[t], :]        (bf16 table row -> fp32 residual stream)
//
// Launch (as the engine launches kernels_cu/embedding.cu): grid = (T), block = (blockDim.x) threads,
// any blockDim.x from 32 to 1024 (the engine uses 128, the checker tries others).
// Who owns what:
//   * block t owns token t: it reads ONE row of the table, row ids[t], and writes row t of out;
//   * thread x of the block owns the columns i = x, x + blockDim.x, x + 2*blockDim.x, ... < H.
//     H is not a multiple of blockDim.x in general (577, 3, ...), so the loop, not the block size,
//     decides which columns exist.
// Why this layout: in each step of the loop, the 32 threads of a warp touch 32 neighbouring
// columns of the same row, so the warp's loads are one contiguous 64-byte piece of memory.
// An id outside [0, V) has no row: never read it (a bad id must not read past the table); write
// NaN into that token's row instead, so the sampler's finite check names the request.
// Indices: a table row starts at row * H; with V * H above 2^31 (Llama 3: 128256 x 2048 = 2.6e8,
// fine, but bigger models are not) compute row offsets in long long.
// Check it with: engine.exercises.ch03.check_embedding_kernel()
#include "common.cuh"   // bf16, bf2f (bf16 -> float), f2bf (float -> bf16)

extern "C" __global__ void embedding_gather(const int* __restrict__ ids,       // [T]
                                             const bf16* __restrict__ table,    // [V, H]
                                             float* __restrict__ out,           // [T, H]
                                             int V, int H) {
    const int t = blockIdx.x;                 // this block's token
    // TODO 1: the table row this token reads (a long long); if it is outside [0, V), fill row t of
    //         out with NaN (__int_as_float(0x7fc00000)) and return.

    // TODO 2: loop over this thread's columns i (start at threadIdx.x, step blockDim.x, stop at H)
    //         and copy table[row * H + i], converted with bf2f, to out[t * H + i].

}
