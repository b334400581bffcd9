// Chapter 17: structured outputs' masks applied on the way to the sampler, in one pass over the logits.
// out[r, t] = logits[r, t] where row r's mask allows token t, else -inf; a row without a constraint
// (slot[r] < 0) is copied as it is. The masks are rows of the runner's table of (constraint, state)
// masks (engine/runtime/structured_outputs.py), one byte per token, gathered by slot: the step reads
// each logit and each mask byte once and writes a float32 copy (the model's logits stay untouched for
// the finite check and the log-probabilities). The NumPy reference is
// engine/ops/logits_processing.py:masked_logits (its `xp is np` branch).
#include "common.cuh"

extern "C" __global__ void masked_copy_rows(const float* __restrict__ logits,          // [R, V]
                                            const unsigned char* __restrict__ table,   // [S, W] bool, W >= V
                                            const int* __restrict__ slot,              // [R] row of table, -1: none
                                            float* __restrict__ out,                   // [R, V]
                                            int V, int W) {
    const long long r = blockIdx.y;                   // one row per grid row, V split over grid columns
    const int s = slot[r];
    const float* in = logits + r * V;
    float* o = out + r * V;
    const unsigned char* allowed = s >= 0 ? table + (long long)s * W : nullptr;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < V; t += gridDim.x * blockDim.x) {
        o[t] = (allowed == nullptr || allowed[t]) ? in[t] : -INFINITY;
    }
}
