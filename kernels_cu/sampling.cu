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
// The thresholds are found without sorting the vocabulary. The fast path, top-k with k <= THREADS
// (the usual top_k = 20..100, with or without top-p): exp is monotone, so the k-th largest p is
// the p of the k-th largest logit, and the logits need no exp to be ranked. Each thread's largest
// logit over its share of the row is a lower bound of sorts: the k-th largest of the THREADS local
// maxima (a bitonic sort in shared memory) leaves at least k logits at or above it, so every logit
// of the top k is >= it. One more pass gathers those candidates (a few k, usually) into shared
// memory, a bitonic sort of (logit, index) ranks them, and the k-th gives the top-k threshold;
// top-p then walks the kept candidates in descending order, summing in fp64 as the reference does.
// Three passes over the row instead of ~60 (the max and local maxima, the gather, the final draw).
// Otherwise (top-p alone, k > THREADS, more candidates than shared memory holds, or a tie in p
// reaching outside the candidates): a binary search over the 32-bit patterns of p (p lies in
// (0, 1], and for positive floats the order of the patterns is the order of the values; 30 steps)
// finds the largest t with count(p >= t) >= k (or mass >= target), each step one block-wide pass
// over the row (from L2: a 128k-float row is 512 KB).
// Thread layout: one block of THREADS threads per row; threads stride over the vocabulary for the
// reductions; for the final walk each thread owns a contiguous chunk and a block scan finds the chunk.
#include "common.cuh"

// THREADS (threads per block) comes from the launcher, engine/sampling.py, as -DTHREADS=...; the
// default is the same value, so that a plain `nvcc sampling.cu` builds the kernel the engine runs
// (tests/test_kernels_compile.py checks they agree).
#ifndef THREADS
#define THREADS 1024
#endif
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block_sum/block_max reduce whole warps");
static_assert((THREADS & (THREADS - 1)) == 0, "the bitonic sorts take a power of two");

__device__ __forceinline__ float prob_of(float z, float m, float inv_t) { return __expf((z - m) * inv_t); }
__device__ __forceinline__ float prob(const float* row, int i, float m, float inv_t) { return prob_of(row[i], m, inv_t); }

#define CANDIDATES (2 * THREADS)   // shared-memory slots of the top-k fast path: (logit, index) pairs

// Sort key[0..N) (and idx with it, when given) descending by key, ties by ascending idx: a bitonic
// network, N a power of two, the block's threads taking the compare-exchanges of each step.
__device__ void bitonic_sort_desc(float* key, int* idx, int N) {
    for (int size = 2; size <= N; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < N / 2; t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;   // the pair (i, j = i + stride)
                const bool ij_in_order = key[i] > key[j] || (key[i] == key[j] && (idx == nullptr || idx[i] <= idx[j]));
                const bool descending = (i & size) == 0;                    // this half-block's direction
                if (ij_in_order != descending) {
                    const float kt = key[i]; key[i] = key[j]; key[j] = kt;
                    if (idx != nullptr) { const int it = idx[i]; idx[i] = idx[j]; idx[j] = it; }
                }
            }
            __syncthreads();
        }
}

// The top-k fast path: the top-k threshold, and with top_p < 1 the top-p one, written to *thr;
// false (nothing written) where the candidates do not fit or a tie in p may reach past them.
// local_max: this thread's largest logit; cand_z / cand_i: [CANDIDATES] shared memory.
__device__ bool topk_thresholds(const float* row, int V, float m, float inv_t, int k, float tp, float local_max,
                                float* cand_z, int* cand_i, float* scratch, float* thr) {
    __shared__ int count;
    __shared__ float bound, result;
    cand_z[threadIdx.x] = local_max;
    __syncthreads();
    bitonic_sort_desc(cand_z, nullptr, THREADS);
    if (threadIdx.x == 0) { bound = cand_z[k - 1]; count = 0; }   // >= k logits are >= bound
    __syncthreads();
    const float lower = bound;
    float outside = -INFINITY;                           // the largest logit left out of the candidates
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float z = row[i];
        if (z >= lower) {
            const int slot = atomicAdd(&count, 1);
            if (slot < CANDIDATES) { cand_z[slot] = z; cand_i[slot] = i; }
        } else {
            outside = fmaxf(outside, z);
        }
    }
    outside = block_max(outside, scratch);               // (its barriers also publish count)
    const int n = count;
    if (n > CANDIDATES) return false;                    // uniform: every thread read the same count
    for (int s = n + threadIdx.x; s < CANDIDATES; s += blockDim.x) { cand_z[s] = -INFINITY; cand_i[s] = 0x7fffffff; }
    __syncthreads();
    bitonic_sort_desc(cand_z, cand_i, CANDIDATES);
    const float t_k = prob_of(cand_z[k - 1], m, inv_t);
    if (prob_of(outside, m, inv_t) >= t_k) return false; // a logit left out ties the k-th in p: search
    if (tp >= 1.0f) { *thr = t_k; return true; }
    if (threadIdx.x == 0) {                              // the kept candidates are a prefix, p non-increasing
        double total = 0.0;
        int kept = 0;
        for (; kept < n && prob_of(cand_z[kept], m, inv_t) >= t_k; ++kept) total += prob_of(cand_z[kept], m, inv_t);
        const double goal = (double)tp * total;
        double run = 0.0;
        int j = 0;
        for (; j < kept - 1; ++j) {                      // the first j whose running mass reaches the goal
            run += prob_of(cand_z[j], m, inv_t);
            if (run >= goal) break;
        }
        result = prob_of(cand_z[j], m, inv_t);
    }
    __syncthreads();
    *thr = result;
    return true;
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
    __shared__ float cand_z[CANDIDATES];
    __shared__ int cand_i[CANDIDATES];
    const float* row = logits + (long long)blockIdx.x * V;
    const bool greedy = temperature[blockIdx.x] <= 0.0f;
    const float inv_t = greedy ? 1.0f : 1.0f / temperature[blockIdx.x];
    const float u = greedy ? 0.0f : uniform[blockIdx.x];
    const int k = greedy ? 1 : top_k[blockIdx.x];
    const float tp = greedy ? 1.0f : top_p[blockIdx.x];

    float local_max = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) local_max = fmaxf(local_max, row[i]);
    const float m = block_max(local_max, scratch);

    // Greedy keeps exactly the maxima (p == 1); otherwise start from the smallest positive float.
    float thr = greedy ? 1.0f : __uint_as_float(1u);
    const bool use_top_k = !greedy && k > 0 && k < V;
    const bool found = use_top_k && k <= THREADS && topk_thresholds(row, V, m, inv_t, k, tp, local_max, cand_z, cand_i, scratch, &thr);
    if (!found && use_top_k) thr = search_threshold(row, V, m, inv_t, thr, true, (float)k, scratch);
    if (!found && tp < 1.0f) {
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
