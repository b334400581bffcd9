// Chapter 08: sampling the next token on the GPU, so the logits never leave the device.
//
// Per row, with p_i = exp((z_i - max z) / T) (unnormalized softmax at temperature T):
//   1. top-k keeps the tokens with p_i >= t_k, t_k = the k-th largest p (ties kept, like HF);
//   2. top-p keeps, among those, the tokens with p_i >= t_p, t_p = the largest threshold whose
//      kept mass is still >= top_p * (mass kept by top-k);
//   3. draw: with the row's uniform u, walk the kept tokens in index order and return the first
//      whose running mass exceeds u * (kept mass) (inverse CDF). engine/sampling.py's NumPy
//      reference does exactly this, so both backends pick the same token for the same u.
// Temperature 0 is greedy: the row keeps only the maximal logits and draws with u = 0, which
// returns the first of them (numpy.argmax's choice).
//
// The thresholds are found without sorting the vocabulary: p lies in (0, 1], and for positive
// floats the order of the bit patterns is the order of the values, so a binary search over the
// 32-bit patterns (30 steps) finds the largest t with count(p >= t) >= k (or mass >= target),
// each step being one block-wide pass over the row (from L2: a 128k-float row is 512 KB).
// Thread layout: one block of 1024 threads per row; threads stride over the vocabulary for the
// reductions; for the final walk each thread owns a contiguous chunk and a block scan finds the chunk.
#include "common.cuh"

// THREADS (threads per block) comes from the launcher, engine/sampling.py, as -DTHREADS=...; the
// default is the same value, so that a plain `nvcc sampling.cu` builds the kernel the engine runs
// (tests/test_kernels_compile.py checks they agree).
#ifndef THREADS
#define THREADS 1024
#endif
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block_sum/block_max reduce whole warps");

__device__ __forceinline__ float prob(const float* row, int i, float m, float inv_t) {
    return __expf((row[i] - m) * inv_t);
}

// Largest threshold t in (0, 1] with stat(t) >= goal, where stat is count (count_mode) or mass
// of {p >= max(t, floor_t)}; stat is non-increasing in t, and stat(floor_t) >= goal holds.
__device__ float search_threshold(const float* row, int V, float m, float inv_t, float floor_t,
                                  bool count_mode, float goal, float* scratch) {
    unsigned lo = __float_as_uint(floor_t), hi = __float_as_uint(1.0f);   // stat(lo) >= goal
    while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        const float t = __uint_as_float(mid);
        float acc = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float p = prob(row, i, m, inv_t);
            if (p >= t) acc += count_mode ? 1.0f : p;
        }
        if (block_sum(acc, scratch) >= goal) lo = mid; else hi = mid - 1;
    }
    return __uint_as_float(lo);
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_rows(const float* __restrict__ logits,        // [R, V]
            const float* __restrict__ temperature,   // [R]  (0 = greedy)
            const int* __restrict__ top_k,           // [R]  (0 = off)
            const float* __restrict__ top_p,         // [R]  (1 = off)
            const float* __restrict__ uniform,       // [R]  in [0, 1)
            int* __restrict__ out,                   // [R]
            int V) {
    __shared__ float scratch[32];
    __shared__ float chunk_mass[THREADS];
    const float* row = logits + (long long)blockIdx.x * V;
    const bool greedy = temperature[blockIdx.x] <= 0.0f;
    const float inv_t = greedy ? 1.0f : 1.0f / temperature[blockIdx.x];
    const float u = greedy ? 0.0f : uniform[blockIdx.x];
    const int k = greedy ? 1 : top_k[blockIdx.x];
    const float tp = greedy ? 1.0f : top_p[blockIdx.x];

    float m = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, row[i]);
    m = block_max(m, scratch);

    // Greedy keeps exactly the maxima (p == 1); otherwise start from the smallest positive float.
    float thr = greedy ? 1.0f : __uint_as_float(1u);
    if (!greedy && k > 0 && k < V) thr = search_threshold(row, V, m, inv_t, thr, true, (float)k, scratch);
    if (tp < 1.0f) {
        float mass = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float p = prob(row, i, m, inv_t);
            if (p >= thr) mass += p;
        }
        mass = block_sum(mass, scratch);
        thr = search_threshold(row, V, m, inv_t, thr, false, tp * mass, scratch);
    }

    // Inverse CDF over the kept tokens in index order: chunk sums, a scan, then one chunk's walk.
    const int chunk = (V + THREADS - 1) / THREADS;
    const int begin = min(V, threadIdx.x * chunk), end = min(V, begin + chunk);
    float local = 0.0f;
    for (int i = begin; i < end; ++i) {
        const float p = prob(row, i, m, inv_t);
        if (p >= thr) local += p;
    }
    chunk_mass[threadIdx.x] = local;
    __syncthreads();
    for (int offset = 1; offset < THREADS; offset <<= 1) {      // inclusive Hillis-Steele scan
        const float add = threadIdx.x >= offset ? chunk_mass[threadIdx.x - offset] : 0.0f;
        __syncthreads();
        chunk_mass[threadIdx.x] += add;
        __syncthreads();
    }
    const float total = chunk_mass[THREADS - 1];
    const float target = u * total;
    const float before = threadIdx.x ? chunk_mass[threadIdx.x - 1] : 0.0f;
    __shared__ int picked;
    if (threadIdx.x == 0) picked = -1;
    __syncthreads();
    if (local > 0.0f && target >= before && target < chunk_mass[threadIdx.x]) {
        float run = before;
        int last_kept = -1;
        for (int i = begin; i < end; ++i) {
            const float p = prob(row, i, m, inv_t);
            if (p < thr) continue;
            last_kept = i;
            run += p;
            if (run > target) break;
        }
        atomicMax(&picked, last_kept);   // exactly one chunk matches; max() only guards rounding
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (picked < 0) {                // rounding pushed target to the very end: take the last kept
            for (int i = V - 1; i >= 0; --i)
                if (prob(row, i, m, inv_t) >= thr) { picked = i; break; }
        }
        out[blockIdx.x] = picked;
    }
}
