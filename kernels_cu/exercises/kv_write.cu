// GPU track, chapter 11: write the new tokens' K and V into the paged cache, written by you.
// The cache of one layer is [num_pages, page_size, Hkv, D] bf16 for K and the same for V. The
// scheduler has already turned each token's (page, offset) into a slot,
//     slot = page_table[seq][pos / page_size] * page_size + pos % page_size,
// so row `slot` of the cache viewed as [num_pages * page_size, Hkv * D] is where token t goes.
// A token's row of qkv (after RoPE, bf16) is [q: q_dim | k: kv_dim | v: kv_dim] values.
//
// Launch (as the engine launches kernels_cu/kv_write.cu): grid = (T), block = (128) threads
// (the checker also tries 32, fewer threads than kv_dim values).
// Who owns what:
//   * block t owns token t: it reads the k and v parts of qkv row t and writes cache row
//     slot_mapping[t] of k_cache and of v_cache;
//   * thread x copies the values i = x, x + blockDim.x, ... < kv_dim of both.
// Nothing else of the cache may change: other slots hold other tokens (the checker poisons the
// whole cache and expects every slot that is not in slot_mapping to keep the poison).
// Check it with: engine.exercises.ch11.check_kv_write_kernel()
#include "common.cuh"   // bf16

extern "C" __global__ void kv_write(const bf16* __restrict__ qkv,           // [T, q_dim + 2*kv_dim]
                                     const int* __restrict__ slot_mapping,    // [T]
                                     bf16* __restrict__ k_cache,              // [pages*page_size, kv_dim]
                                     bf16* __restrict__ v_cache,              // [pages*page_size, kv_dim]
                                     int q_dim, int kv_dim) {
    const int t = blockIdx.x;
    // TODO 1: where token t's k and v start in qkv (its row has q_dim + 2 * kv_dim values),
    //         and its destination row in the caches, slot_mapping[t] * kv_dim (as long long).

    // TODO 2: copy this thread's values i of k and of v.

}
