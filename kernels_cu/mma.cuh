// Tensor-core helpers shared by the attention kernels (sm_80+): ldmatrix, mma.sync m16n8k16 with bf16
// operands and fp32 accumulators, bf16 packing. Fragment layouts are drawn in flash_attention.cu.
#pragma once
#include "common.cuh"

// Element offset of 16-byte chunk c of row r in a [rows][D] bf16 tile. The chunk index is XOR-swizzled
// with the row so that the 8 row addresses of one ldmatrix phase (same chunk, 8 consecutive rows)
// land in 8 different 16-byte bank groups: no bank conflicts, no padding.
template <int D>
__device__ __forceinline__ int tile_offset(int r, int c) {
    constexpr int chunks = D / 8;
    if constexpr (chunks >= 8) return r * D + ((c ^ (r & 7)) << 3);
    else return r * D + ((c ^ ((r / (8 / chunks)) & (chunks - 1))) << 3);
}

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned smem_addr(const bf16* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// Four 8x8 bf16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// c[16x8] += a[16x16] b[16x8], bf16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {     // lo -> bits 0..15
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}
#endif
