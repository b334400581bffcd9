// GPU track, chapter 05: RoPE on the fused QKV projection, written by you.
// For one head vector x of size D at position p, with c = cos[p, i], s = sin[p, i], i < D/2
// (Hugging Face's rotate-half layout: pair i is (x[i], x[i + D/2]), NOT (x[2i], x[2i+1])):
//     y[i]       = x[i] * c - x[i + D/2] * s
//     y[i + D/2] = x[i + D/2] * c + x[i] * s
// A token's row is [q heads | k heads | v heads], n_heads_total = Hq + 2*Hkv heads of D values;
// the first n_rot_heads = Hq + Hkv heads (q and k) rotate, the v heads are copied unchanged.
// Input fp32, output bf16 in the same layout (what attention and the KV cache read).
//
// Launch (as the engine launches kernels_cu/rope.cu): grid = (T), block = (blockDim.x) threads
// (the engine uses 256; the checker also tries 64, smaller than one row's work).
// Who owns what:
//   * block t owns token t, i.e. row t of qkv and of out;
//   * the block's rotation work is a list of n_rot_heads * D/2 pairs: pair j is head h = j / (D/2),
//     index i = j % (D/2). Thread x takes pairs j = x, x + blockDim.x, ... and writes BOTH y[i]
//     and y[i + D/2] of its pair; consecutive threads take consecutive i of a head (coalesced);
//   * then the v heads, (n_heads_total - n_rot_heads) * D values, are copied the same way.
// The angle comes from the token's POSITION, positions[t], not from t: a decode step and a packed
// batch mix tokens at many absolute positions.
// Check it with: engine.exercises.ch05.check_rope_kernel()
#include "common.cuh"   // bf16, f2bf (float -> bf16)

extern "C" __global__ void rope_qkv(const float* __restrict__ qkv,      // [T, (Hq+2Hkv)*D]
                                     const int* __restrict__ positions,  // [T]
                                     const float* __restrict__ cos_tab,  // [P, D/2]
                                     const float* __restrict__ sin_tab,  // [P, D/2]
                                     bf16* __restrict__ out,             // [T, (Hq+2Hkv)*D]
                                     int n_rot_heads, int n_heads_total, int D) {
    const int t = blockIdx.x, half = D / 2;
    const long long row = (long long)t * n_heads_total * D;   // where token t's row starts
    // TODO 1: the cos and sin rows of this token's position (cos_tab + positions[t] * half, ...).

    // TODO 2: loop over this thread's pairs j < n_rot_heads * half: head h, index i, base = row + h * D;
    //         read x1 = qkv[base + i], x2 = qkv[base + i + half]; write both rotated values (f2bf).

    // TODO 3: copy the v heads: the (n_heads_total - n_rot_heads) * D values after the rotated heads.

}
