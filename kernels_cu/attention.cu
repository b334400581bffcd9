// Chapter 06: the fused scale + causal mask + softmax of prefill attention.
// The scores S = Q K^T come from cuBLAS (fp32, one [T, T] matrix per query head); this kernel
// turns each row into probabilities P (bf16, the operand of the next GEMM P V):
//   P[t, s] = exp(scale*S[t, s] - m) / sum_s' exp(scale*S[t, s'] - m)   for s <= t, else 0.
// Thread layout: one block per (head, query row); threads stride over the keys of that row
// (coalesced), two block reductions (max, then sum), then the write pass. Row t of head h is
// blockIdx.x = h * T + t.
// causal_softmax_naive is the first rung of the ladder (kernel_bench times both): one THREAD per
// (head, query row) makes three serial passes over its row (max, sum, write). Neighbouring threads
// read rows T floats apart (no coalescing), and row t costs t steps, so the last rows set the time.
#include "common.cuh"

// Naive rung: thread i owns row i = h * T + t. Launch with ceil(H * T / threads) blocks.
extern "C" __global__ void causal_softmax_naive(const float* __restrict__ scores,  // [H, T, T]
                                                 bf16* __restrict__ probs,          // [H, T, T]
                                                 int n_rows, int T, float scale) {  // n_rows = H * T
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n_rows) return;
    const int t = row % T;
    const float* s = scores + (long long)row * T;
    bf16* p = probs + (long long)row * T;
    float m = -INFINITY;
    for (int j = 0; j <= t; ++j) m = fmaxf(m, s[j] * scale);
    float sum = 0.0f;
    for (int j = 0; j <= t; ++j) sum += __expf(s[j] * scale - m);
    const float inv = 1.0f / sum;
    for (int j = 0; j < T; ++j) p[j] = f2bf(j <= t ? __expf(s[j] * scale - m) * inv : 0.0f);
}

extern "C" __global__ void causal_softmax(const float* __restrict__ scores,  // [H, T, T]
                                           bf16* __restrict__ probs,          // [H, T, T]
                                           int T, float scale) {
    __shared__ float scratch[32];
    const int t = blockIdx.x % T;
    const long long base = (long long)blockIdx.x * T;
    const int n_valid = t + 1;                       // causal: keys 0..t
    float m = -INFINITY;
    for (int s = threadIdx.x; s < n_valid; s += blockDim.x) m = fmaxf(m, scores[base + s]);
    m = block_max(m, scratch) * scale;
    float sum = 0.0f;
    for (int s = threadIdx.x; s < n_valid; s += blockDim.x) sum += __expf(scores[base + s] * scale - m);
    const float inv = 1.0f / block_sum(sum, scratch);
    for (int s = threadIdx.x; s < T; s += blockDim.x)
        probs[base + s] = f2bf(s < n_valid ? __expf(scores[base + s] * scale - m) * inv : 0.0f);
}
