// Chapter 00: the first kernels. Loaded with engine.backend.load_kernel("hello", "<name>").
//
// A kernel is a function that every GPU thread runs at once. The launch picks a grid of blocks
// and a number of threads per block, e.g. grid=(120,), block=(256,): 30720 threads. Each thread
// knows where it sits (blockIdx.x, threadIdx.x) and derives the element(s) it owns from that.
//
// Grid-stride loop: thread t handles elements t, t + stride, t + 2*stride, ... where stride is
// the total number of threads in the grid. So one launch shape works for any n, threads never
// read past the end (i < n), and neighbouring threads touch neighbouring addresses in every
// pass (coalesced loads: one 128-byte transaction serves a whole warp of 32 threads).
//
//   n = 10, 2 blocks x 4 threads (stride 8):   element: 0 1 2 3 4 5 6 7 | 8 9
//                                              thread:  0 1 2 3 4 5 6 7 | 0 1
//
// extern "C" keeps the names unmangled so that CuPy finds them by name.

// y[i] = a * x[i] + b for i < n, in float32. fmaf rounds once, like the GPU's fused multiply-add;
// NumPy's a * x + b rounds twice, so the two may differ in the last bit.
extern "C" __global__ void axpb(const float* __restrict__ x,  // [n]
                                float* __restrict__ y,        // [n]
                                float a, float b, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = fmaf(a, x[i], b);
    }
}

// bf16 bits -> float32: a bf16 number is the top 16 bits of a float32, so widening is a shift.
// This is exactly what engine.backend.bf16_to_f32 does on the host.
extern "C" __global__ void bf16_bits_to_f32(const unsigned short* __restrict__ bits,  // [n]
                                            float* __restrict__ out,                  // [n]
                                            long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = __uint_as_float((unsigned int)bits[i] << 16);
    }
}
