// Appendix (linear attention): Qwen3.5's Gated DeltaNet layers, fp32 throughout (the state sums a
// whole sequence of updates: it is never rounded to bf16). NumPy references: engine/ops/gated_delta.py.
//
// Every kernel takes a batch of S sequences packed one after another (cu_seqlens [S + 1], each with at
// least one token) and each sequence's slot in a pool of recurrent states (slots [S]):
//   conv pool  [slots, K-1, C]        the last K-1 inputs of the causal conv (oldest first)
//   delta pool [slots, Hv, Dk, Dv]    the delta-rule state of each value head
// A state is read from state_in and written to state_out; the two may be the same buffer (in place):
// every element is read and then written by the one thread that owns it, and by no other.
//
//   gdn_gates            one thread per (token, head): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
//   causal_conv1d_silu   one thread per (sequence, channel), walking its tokens with a window of K-1
//                        inputs in registers; neighbouring threads read neighbouring channels (coalesced)
//   gated_delta_recurrent  one block per (value head, sequence), one thread per column j of the state
//                        S [Dk, Dv] (decode: one token; any length works, token after token). The
//                        block normalises q and k (block_sum) into shared memory; thread j decays,
//                        corrects and reads its column: S[:, j] <- e^g S[:, j] + k beta (v_j - k.S[:, j])
//   gated_delta_chunked  one block per (value head, sequence), the prefill: per chunk of GDN_CHUNK tokens
//                        the [C, C] matrices (A: beta_i k_i.k_j e^(G_i - G_j), P: q_i.k_j e^(G_i - G_j))
//                        and the forward substitution (I + A) [U | W] = [beta v | beta k e^G], one column
//                        of the right-hand side per thread; then, one state column per thread,
//                        v_new = U - W S, o = e^G Q S + P v_new, S <- e^(G_last) S + (K e^(G_last - G))^T v_new.
//                        The tiles live in static shared memory (~34 KB at Dk = Dv = 128, C = 16).
//   gated_rmsnorm_silu   one warp per (token, value head): the mixer's output gate,
//                        rmsnorm(o) * w * silu(z), written bf16 for out_proj
//   attention_output_gate  the full-attention layers' gate: attn * sigmoid(gate), bf16 for o_proj
// This is the first, readable rung: the products are plain loops, not tensor-core tiles.
#include "common.cuh"

#ifndef GDN_MAX_D
#define GDN_MAX_D 128         // the largest key / value head dimension (Qwen3.5: 128)
#endif
#ifndef GDN_CHUNK
#define GDN_CHUNK 16          // tokens per chunk of gated_delta_chunked
#endif
#ifndef CONV_MAX_K
#define CONV_MAX_K 8          // the widest causal convolution (Qwen3.5: 4)
#endif

#define L2_EPS 1e-6f          // x / sqrt(sum(x^2) + eps), as transformers and the FLA library

extern "C" __global__ void gdn_gates(const float* __restrict__ proj,     // [T, ld]: a at a_col.., b at b_col..
                                     long long ld, int a_col, int b_col,
                                     const float* __restrict__ A_log,    // [Hv]
                                     const float* __restrict__ dt_bias,  // [Hv]
                                     float* __restrict__ g,              // [T, Hv]
                                     float* __restrict__ beta,           // [T, Hv]
                                     int T, int Hv) {
    const long long n = (long long)T * Hv;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / Hv;
        const int h = (int)(idx % Hv);
        const float a = proj[t * ld + a_col + h] + dt_bias[h];
        const float softplus = a > 20.0f ? a : log1pf(expf(a));           // linear above 20, like torch
        g[idx] = -expf(A_log[h]) * softplus;
        beta[idx] = 1.0f / (1.0f + expf(-proj[t * ld + b_col + h]));
    }
}

extern "C" __global__ void causal_conv1d_silu(const float* __restrict__ x,   // [T, ldx]: channels 0..C-1
                                              long long ldx,
                                              const float* __restrict__ w,   // [C, K], oldest tap first
                                              const float* state_in,         // conv pool [slots, K-1, C]
                                              float* state_out,              // (may be state_in)
                                              const int* __restrict__ slots, // [S]
                                              const int* __restrict__ cu_seqlens,  // [S + 1]
                                              float* __restrict__ out,       // [T, C] silu(conv)
                                              int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= C) return;
    float window[CONV_MAX_K];         // the K-1 inputs before the current token, oldest first
    float taps[CONV_MAX_K];
    const long long base = (long long)slots[s] * (K - 1) * C;
    for (int j = 0; j < K - 1; ++j) window[j] = state_in[base + (long long)j * C + c];
    for (int j = 0; j < K; ++j) taps[j] = w[(long long)c * K + j];
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        const float xt = x[(long long)t * ldx + c];
        float acc = 0.0f;
        for (int j = 0; j < K - 1; ++j) acc += taps[j] * window[j];
        acc += taps[K - 1] * xt;                                           // the current token: the last tap
        out[(long long)t * C + c] = acc / (1.0f + expf(-acc));
        for (int j = 0; j + 1 < K - 1; ++j) window[j] = window[j + 1];
        if (K > 1) window[K - 2] = xt;
    }
    for (int j = 0; j < K - 1; ++j) state_out[base + (long long)j * C + c] = window[j];
}

// q and k of key head kh at token t, L2-normalised (q also times 1/sqrt(Dk)), into shared memory.
__device__ void load_qk(const float* __restrict__ qkv, long long ld, int t, int kh, int Hk, int Dk,
                        float* q, float* k, float* scratch) {
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        const float qi = qkv[(long long)t * ld + (long long)kh * Dk + i];
        const float ki = qkv[(long long)t * ld + (long long)(Hk + kh) * Dk + i];
        q[i] = qi;
        k[i] = ki;
        sq += qi * qi;
        sk += ki * ki;
    }
    sq = block_sum(sq, scratch);      // (its barriers also publish q and k)
    sk = block_sum(sk, scratch);
    const float qs = rsqrtf(sq + L2_EPS) * rsqrtf((float)Dk), ks = rsqrtf(sk + L2_EPS);
    __syncthreads();
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        q[i] *= qs;
        k[i] *= ks;
    }
    __syncthreads();
}

extern "C" __global__ void gated_delta_recurrent(const float* __restrict__ qkv,   // [T, ld]: q | k | v heads
                                                 long long ld,
                                                 const float* __restrict__ g,     // [T, Hv]
                                                 const float* __restrict__ beta,  // [T, Hv]
                                                 const float* state_in,           // [slots, Hv, Dk, Dv]
                                                 float* state_out,                // (may be state_in)
                                                 const int* __restrict__ slots,
                                                 const int* __restrict__ cu_seqlens,
                                                 float* __restrict__ out,         // [T, Hv * Dv]
                                                 int Hk, int Hv, int Dk, int Dv) {
    const int h = blockIdx.x, s = blockIdx.y, kh = h / (Hv / Hk);
    __shared__ float q[GDN_MAX_D], k[GDN_MAX_D], scratch[32];
    const long long st = ((long long)slots[s] * Hv + h) * Dk * Dv;
    const float* S = state_in + st;   // the first token reads state_in, every later one state_out
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        load_qk(qkv, ld, t, kh, Hk, Dk, q, k, scratch);
        const float decay = expf(g[(long long)t * Hv + h]), b = beta[(long long)t * Hv + h];
        for (int j = threadIdx.x; j < Dv; j += blockDim.x) {
            float predicted = 0.0f;                                        // k . (decayed S)[:, j]
            for (int i = 0; i < Dk; ++i) predicted += k[i] * (S[(long long)i * Dv + j] * decay);
            const float v = qkv[(long long)t * ld + (long long)2 * Hk * Dk + (long long)h * Dv + j];
            const float delta = (v - predicted) * b;
            float o = 0.0f;
            for (int i = 0; i < Dk; ++i) {
                const float sij = S[(long long)i * Dv + j] * decay + k[i] * delta;
                state_out[st + (long long)i * Dv + j] = sij;
                o += q[i] * sij;
            }
            out[(long long)t * Hv * Dv + (long long)h * Dv + j] = o;
        }
        S = state_out + st;
        __syncthreads();              // the next token's q and k overwrite shared memory
    }
}

extern "C" __global__ void gated_delta_chunked(const float* __restrict__ qkv,   // [T, ld]: q | k | v heads
                                               long long ld,
                                               const float* __restrict__ g,     // [T, Hv]
                                               const float* __restrict__ beta,  // [T, Hv]
                                               const float* state_in,           // [slots, Hv, Dk, Dv]
                                               float* state_out,                // (may be state_in)
                                               const int* __restrict__ slots,
                                               const int* __restrict__ cu_seqlens,
                                               float* __restrict__ out,         // [T, Hv * Dv]
                                               int Hk, int Hv, int Dk, int Dv) {
    const int h = blockIdx.x, s = blockIdx.y, kh = h / (Hv / Hk);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    __shared__ float Q[GDN_CHUNK][GDN_MAX_D], K[GDN_CHUNK][GDN_MAX_D];   // normalised (Q also scaled)
    __shared__ float U[GDN_CHUNK][GDN_MAX_D], W[GDN_CHUNK][GDN_MAX_D];   // the solved right-hand sides
    __shared__ float A[GDN_CHUNK][GDN_CHUNK], P[GDN_CHUNK][GDN_CHUNK];
    __shared__ float G[GDN_CHUNK], B[GDN_CHUNK];                         // cumulative log decay, beta
    const long long st = ((long long)slots[s] * Hv + h) * Dk * Dv;
    const float* S = state_in + st;
    const int t1 = cu_seqlens[s + 1];
    for (int c0 = cu_seqlens[s]; c0 < t1; c0 += GDN_CHUNK) {
        const int n = min(GDN_CHUNK, t1 - c0);
        // 1. the chunk's q, k (a warp per token: load, normalise), beta and cumulative decay
        for (int r = warp; r < n; r += n_warps) {
            const long long row = (long long)(c0 + r) * ld;
            float sq = 0.0f, sk = 0.0f;
            for (int i = lane; i < Dk; i += 32) {
                Q[r][i] = qkv[row + (long long)kh * Dk + i];
                K[r][i] = qkv[row + (long long)(Hk + kh) * Dk + i];
                sq += Q[r][i] * Q[r][i];
                sk += K[r][i] * K[r][i];
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            const float qs = rsqrtf(sq + L2_EPS) * rsqrtf((float)Dk), ks = rsqrtf(sk + L2_EPS);
            for (int i = lane; i < Dk; i += 32) {     // each lane rescales what it loaded
                Q[r][i] *= qs;
                K[r][i] *= ks;
            }
        }
        if (threadIdx.x == 0) {
            float running = 0.0f;
            for (int r = 0; r < n; ++r) {
                running += g[(long long)(c0 + r) * Hv + h];
                G[r] = running;
                B[r] = beta[(long long)(c0 + r) * Hv + h];
            }
        }
        __syncthreads();
        // 2. A (strictly below the diagonal) and P (on and below it); above it nothing is read
        for (int e = threadIdx.x; e < n * n; e += blockDim.x) {
            const int i = e / n, j = e % n;
            if (j > i) continue;
            float kk = 0.0f, qk = 0.0f;
            for (int d = 0; d < Dk; ++d) {
                kk += K[i][d] * K[j][d];
                qk += Q[i][d] * K[j][d];
            }
            const float decay = expf(G[i] - G[j]);                         // <= 1: j <= i
            A[i][j] = j < i ? B[i] * kk * decay : 0.0f;
            P[i][j] = qk * decay;
        }
        __syncthreads();
        // 3. forward substitution, one column of [beta v | beta k e^G] per thread: row i needs rows < i
        for (int col = threadIdx.x; col < Dv + Dk; col += blockDim.x) {
            const bool is_v = col < Dv;
            float(*X)[GDN_MAX_D] = is_v ? U : W;
            const int x = is_v ? col : col - Dv;
            for (int i = 0; i < n; ++i) {
                float rhs = is_v ? B[i] * qkv[(long long)(c0 + i) * ld + (long long)2 * Hk * Dk + (long long)h * Dv + x]
                                 : B[i] * K[i][x] * expf(G[i]);
                for (int j = 0; j < i; ++j) rhs -= A[i][j] * X[j][x];
                X[i][x] = rhs;
            }
        }
        __syncthreads();
        // 4. one state column per thread: the chunk's outputs and the state it leaves
        const float last = G[n - 1];
        for (int j = threadIdx.x; j < Dv; j += blockDim.x) {
            for (int r = 0; r < n; ++r) {                                  // v_new = U - W S
                float ws = 0.0f;
                for (int i = 0; i < Dk; ++i) ws += W[r][i] * S[(long long)i * Dv + j];
                U[r][j] -= ws;
            }
            for (int r = 0; r < n; ++r) {                                  // o = e^G Q S + P v_new
                float qs = 0.0f;
                for (int i = 0; i < Dk; ++i) qs += Q[r][i] * S[(long long)i * Dv + j];
                float o = qs * expf(G[r]);
                for (int u = 0; u <= r; ++u) o += P[r][u] * U[u][j];
                out[(long long)(c0 + r) * Hv * Dv + (long long)h * Dv + j] = o;
            }
            for (int i = 0; i < Dk; ++i) {                                 // S <- e^G_last S + K~^T v_new
                float acc = S[(long long)i * Dv + j] * expf(last);
                for (int r = 0; r < n; ++r) acc += K[r][i] * expf(last - G[r]) * U[r][j];
                state_out[st + (long long)i * Dv + j] = acc;
            }
        }
        S = state_out + st;
        __syncthreads();              // the next chunk overwrites the tiles
    }
}

// The mixer's output: y = o * rsqrt(mean(o^2) + eps) * w * silu(z) per value head (Qwen3.5's
// RMSNormGated: normalise, then gate). One warp per (token, head), strided over the grid's warps.
extern "C" __global__ void gated_rmsnorm_silu(const float* __restrict__ o,     // [T, Hv * Dv]
                                              const float* __restrict__ z,     // [T, ldz]: head h at h * Dv
                                              long long ldz,
                                              const float* __restrict__ w,     // [Dv]
                                              bf16* __restrict__ y,            // [T, Hv * Dv]
                                              int T, int Hv, int Dv, float eps) {
    const int lane = threadIdx.x & 31;
    const long long n = (long long)T * Hv, warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long idx = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); idx < n; idx += warps) {
        const long long t = idx / Hv;
        const int h = (int)(idx % Hv);
        const float* x = o + idx * Dv;                  // row t, head h: o is [T, Hv, Dv] contiguous
        const float* zh = z + t * ldz + (long long)h * Dv;
        float ss = 0.0f;
        for (int d = lane; d < Dv; d += 32) ss += x[d] * x[d];
        const float scale = rsqrtf(warp_sum(ss) / Dv + eps);
        for (int d = lane; d < Dv; d += 32) {
            const float zd = zh[d];
            y[idx * Dv + d] = f2bf(x[d] * scale * w[d] * (zd / (1.0f + expf(-zd))));
        }
    }
}

// The full-attention layers' output gate: y = attn * sigmoid(gate), elementwise, bf16 in and out.
extern "C" __global__ void attention_output_gate(const bf16* __restrict__ attn,   // [T, n]
                                                 const float* __restrict__ gate,  // [T, ldg]: columns 0..n-1
                                                 long long ldg,
                                                 bf16* __restrict__ y,            // [T, n]
                                                 int T, int n) {
    const long long total = (long long)T * n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const float gv = gate[(idx / n) * ldg + idx % n];
        y[idx] = f2bf(bf2f(attn[idx]) / (1.0f + expf(-gv)));
    }
}
