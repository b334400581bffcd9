// The CUDA C of the exercise kernels, for the host C++ compiler (engine/exercises/cuda_cpu).
//
// Force-included (-include) before a learner's kernel, so that the same source that NVRTC compiles
// for the GPU compiles and runs on a CPU: the launch variables (threadIdx, blockIdx, blockDim,
// gridDim), the qualifiers, __syncthreads (a real barrier), the warp shuffles and votes (each one a
// barrier of the warp's 32 lanes), atomics, the math intrinsics and __nv_bfloat16 with
// round-to-nearest-even conversions. __syncthreads() waits for the block's threads that have not
// returned (as GPUs since Volta do). The threads of a block are fibers of one OS thread
// (runtime.cpp): a thread runs until it reaches a barrier, a shuffle or its end, then the next one
// runs, so everything between two barriers is atomic and no atomics or locks are needed. `include/`
// holds empty stand-ins for <cuda_bf16.h> and friends, so `#include "common.cuh"` works unchanged.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#define CUDACPU 1      // a kernel can tell that it runs on the CPU executor (the GPU never defines it)

// ------------------------------------------------------------------------------- qualifiers
#define __global__ __attribute__((visibility("default")))   // only kernels are visible: -fvisibility=hidden
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __constant__
#define __managed__
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One copy per process: blocks run one after another. On ELF systems (Linux) the variables share a
// section, which the executor poisons (0xFF bytes: NaN as a float) before each block, as
// uninitialized shared memory would be; elsewhere they start as zeros and keep the last block's values.
#if defined(__ELF__)
#define __shared__ __attribute__((section("cudacpu_shared"))) static
#else
#define __shared__ static
#endif

// ------------------------------------------------------------------------------- vector types
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(8))) int2 { int x, y; };
struct int3 { int x, y, z; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct float3 { float x, y, z; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(16))) double2 { double x, y; };
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ------------------------------------------------------------------------------- the executor's state
extern "C" {
extern uint3 cudacpu_threadIdx, cudacpu_blockIdx;    // set by the executor before a thread resumes
extern dim3 cudacpu_blockDim, cudacpu_gridDim;
int cudacpu_barrier(int op, int predicate);          // __syncthreads and its _count/_and/_or forms
unsigned long long cudacpu_warp(int op, unsigned mask, unsigned long long bits, int arg, int width);
void cudacpu_trap(const char* what);
}
#define threadIdx cudacpu_threadIdx
#define blockIdx cudacpu_blockIdx
#define blockDim cudacpu_blockDim
#define gridDim cudacpu_gridDim
static constexpr int warpSize = 32;

// A memory clobber on both sides: what a thread wrote before a barrier is read from memory after it.
#define CUDACPU_FENCE() __asm__ __volatile__("" ::: "memory")
inline void __syncthreads() { CUDACPU_FENCE(); cudacpu_barrier(0, 0); CUDACPU_FENCE(); }
inline int __syncthreads_count(int p) { CUDACPU_FENCE(); int r = cudacpu_barrier(1, p != 0); CUDACPU_FENCE(); return r; }
inline int __syncthreads_and(int p) { CUDACPU_FENCE(); int r = cudacpu_barrier(2, p != 0); CUDACPU_FENCE(); return r; }
inline int __syncthreads_or(int p) { CUDACPU_FENCE(); int r = cudacpu_barrier(3, p != 0); CUDACPU_FENCE(); return r; }
inline void __threadfence() { CUDACPU_FENCE(); }
inline void __threadfence_block() { CUDACPU_FENCE(); }
inline void __trap() { cudacpu_trap("__trap()"); }
inline void __nanosleep(unsigned) {}

// ------------------------------------------------------------------------------- warp shuffles and votes
enum { CUDACPU_SHFL = 0, CUDACPU_SHFL_UP, CUDACPU_SHFL_DOWN, CUDACPU_SHFL_XOR, CUDACPU_BALLOT, CUDACPU_SYNCWARP,
       CUDACPU_REDUCE_ADD, CUDACPU_REDUCE_MIN, CUDACPU_REDUCE_MAX };
template <class T> inline T cudacpu_shuffle(int op, unsigned mask, T v, int arg, int width) {
    static_assert(sizeof(T) <= 8, "a warp shuffle moves at most 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    CUDACPU_FENCE();
    bits = cudacpu_warp(op, mask, bits, arg, width);
    CUDACPU_FENCE();
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) { return cudacpu_shuffle(CUDACPU_SHFL, mask, v, src, width); }
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) { return cudacpu_shuffle(CUDACPU_SHFL_UP, mask, v, (int)d, width); }
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) { return cudacpu_shuffle(CUDACPU_SHFL_DOWN, mask, v, (int)d, width); }
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) { return cudacpu_shuffle(CUDACPU_SHFL_XOR, mask, v, lane_mask, width); }
inline unsigned __ballot_sync(unsigned mask, int p) { return (unsigned)cudacpu_warp(CUDACPU_BALLOT, mask, p != 0, 0, 32); }
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return __ballot_sync(mask, p) == __ballot_sync(mask, 1); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { CUDACPU_FENCE(); cudacpu_warp(CUDACPU_SYNCWARP, mask, 0, 0, 32); CUDACPU_FENCE(); }
inline unsigned __activemask() { return 0xffffffffu; }
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) { return (unsigned)cudacpu_warp(CUDACPU_REDUCE_ADD, mask, v, 0, 32); }
inline unsigned __reduce_min_sync(unsigned mask, unsigned v) { return (unsigned)cudacpu_warp(CUDACPU_REDUCE_MIN, mask, v, 0, 32); }
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) { return (unsigned)cudacpu_warp(CUDACPU_REDUCE_MAX, mask, v, 0, 32); }

// ------------------------------------------------------------------------------- atomics
// A thread is never interrupted between two barriers, so a plain read-modify-write is atomic here.
template <class T> inline T cudacpu_rmw(T* p, T v, int op) {
    T old = *p;
    switch (op) {
        case 0: *p = old + v; break;
        case 1: *p = old - v; break;
        case 2: *p = v; break;
        case 3: *p = v < old ? v : old; break;
        case 4: *p = v > old ? v : old; break;
    }
    return old;
}
#define CUDACPU_ATOMICS(T)                                                     \
    inline T atomicAdd(T* p, T v) { return cudacpu_rmw(p, v, 0); }             \
    inline T atomicSub(T* p, T v) { return cudacpu_rmw(p, v, 1); }             \
    inline T atomicExch(T* p, T v) { return cudacpu_rmw(p, v, 2); }            \
    inline T atomicMin(T* p, T v) { return cudacpu_rmw(p, v, 3); }             \
    inline T atomicMax(T* p, T v) { return cudacpu_rmw(p, v, 4); }             \
    inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
CUDACPU_ATOMICS(int)
CUDACPU_ATOMICS(unsigned int)
CUDACPU_ATOMICS(long long)
CUDACPU_ATOMICS(unsigned long long)
inline float atomicAdd(float* p, float v) { return cudacpu_rmw(p, v, 0); }
inline float atomicExch(float* p, float v) { return cudacpu_rmw(p, v, 2); }
inline float atomicMax(float* p, float v) { return cudacpu_rmw(p, v, 4); }
inline float atomicMin(float* p, float v) { return cudacpu_rmw(p, v, 3); }
inline double atomicAdd(double* p, double v) { return cudacpu_rmw(p, v, 0); }
inline int atomicAnd(int* p, int v) { int o = *p; *p = o & v; return o; }
inline int atomicOr(int* p, int v) { int o = *p; *p = o | v; return o; }
inline int atomicXor(int* p, int v) { int o = *p; *p = o ^ v; return o; }
inline unsigned atomicAnd(unsigned* p, unsigned v) { unsigned o = *p; *p = o & v; return o; }
inline unsigned atomicOr(unsigned* p, unsigned v) { unsigned o = *p; *p = o | v; return o; }
inline unsigned atomicXor(unsigned* p, unsigned v) { unsigned o = *p; *p = o ^ v; return o; }
inline unsigned atomicInc(unsigned* p, unsigned v) { unsigned o = *p; *p = o >= v ? 0 : o + 1; return o; }
inline unsigned atomicDec(unsigned* p, unsigned v) { unsigned o = *p; *p = (o == 0 || o > v) ? v : o - 1; return o; }

// ------------------------------------------------------------------------------- math and bits
// by value: decltype(a < b ? a : b) of two lvalues of one type is a reference (to a parameter, dangling)
template <class A, class B> inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1); x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4); x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
inline int __mul24(int a, int b) { return a * b; }
inline unsigned __umul24(unsigned a, unsigned b) { return a * b; }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
// cp.async's shared-memory address (only reached under __CUDA_ARCH__, which the host never defines)
inline unsigned long long __cvta_generic_to_shared(const void* p) { return (unsigned long long)(uintptr_t)p; }

// ------------------------------------------------------------------------------- bf16
// The top 16 bits of an IEEE float; float -> bf16 rounds to nearest, ties to even, as the GPU's
// __float2bfloat16_rn (NaN -> the canonical 0x7FFF, never the all-ones poison of the checker).
inline unsigned short cudacpu_f2bf_rn(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float cudacpu_bf2f(unsigned short b) { unsigned int u = (unsigned int)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
struct __attribute__((aligned(2))) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(cudacpu_f2bf_rn(f)) {}
    __nv_bfloat16(double d) : __x(cudacpu_f2bf_rn((float)d)) {}
    __nv_bfloat16(int i) : __x(cudacpu_f2bf_rn((float)i)) {}
    __nv_bfloat16(unsigned int i) : __x(cudacpu_f2bf_rn((float)i)) {}
    __nv_bfloat16(long long i) : __x(cudacpu_f2bf_rn((float)i)) {}
    operator float() const { return cudacpu_bf2f(__x); }
};
struct __attribute__((aligned(4))) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
inline __nv_bfloat16 cudacpu_bf_bits(unsigned short b) { __nv_bfloat16 h; h.__x = b; return h; }
inline float __bfloat162float(__nv_bfloat16 h) { return cudacpu_bf2f(h.__x); }
inline __nv_bfloat16 __float2bfloat16(float f) { return cudacpu_bf_bits(cudacpu_f2bf_rn(f)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return cudacpu_bf_bits(cudacpu_f2bf_rn(f)); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { unsigned u; std::memcpy(&u, &f, 4); return cudacpu_bf_bits((unsigned short)(u >> 16)); }
inline __nv_bfloat16 __int2bfloat16_rn(int i) { return __float2bfloat16_rn((float)i); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return cudacpu_bf_bits(b); }
inline __nv_bfloat16 __short_as_bfloat16(short b) { return cudacpu_bf_bits((unsigned short)b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return {a, a}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {__bfloat162float(v.x), __bfloat162float(v.y)}; }
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a + (float)b); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a - (float)b); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a * (float)b); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) { return __float2bfloat16_rn(fmaf(a, b, c)); }
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a < (float)b ? b : a; }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)b < (float)a ? b : a; }

// ------------------------------------------------------------------------------- the launch
// The launcher (appended after the kernel by engine/exercises/cuda_cpu) calls the kernel with the
// arguments the checker passes (args[i] points at argument i's bytes) and reports its parameter
// list, so that an argument of the wrong size is named before anything runs.
#include <type_traits>
#include <utility>
template <class... A, std::size_t... I>
inline void cudacpu_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A> inline void cudacpu_invoke(void (*kernel)(A...), void** args) {
    cudacpu_call(kernel, args, std::index_sequence_for<A...>{});
}
template <class T> constexpr int cudacpu_kind() {   // 0 pointer, 1 integer, 2 floating point, 3 other
    return std::is_pointer<T>::value ? 0 : std::is_integral<T>::value ? 1 : std::is_floating_point<T>::value ? 2 : 3;
}
template <class... A> inline int cudacpu_signature(void (*)(A...), int* sizes, int* kinds, int cap) {
    const int s[] = {(int)sizeof(A)..., 0};
    const int k[] = {cudacpu_kind<std::remove_cv_t<A>>()..., 0};
    for (int i = 0; i < (int)sizeof...(A) && i < cap; ++i) { sizes[i] = s[i]; kinds[i] = k[i]; }
    return (int)sizeof...(A);
}
