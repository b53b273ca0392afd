// Tensor-core building blocks (sm_80+): mma.sync, ldmatrix and cp.async as inline PTX, and the
// fragment loaders the tensor-core kernels (moe_tc.cu, flash_attention.cu) share.
//
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: a warp multiplies A [16 x 16] (row) by
// B [16 x 8] (col) into an fp32 accumulator [16 x 8]. Lane l, group g = l / 4, t = l % 4 holds
// (PTX ISA, "Matrix fragments for mma.m16n8k16"; the low half of a register is the lower element):
//   A: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B: b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C: c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// The loaders below take tiles in shared memory whose rows are 16-byte aligned; a row stride of
// (a multiple of 64 bytes) + 16 keeps the 8 rows an ldmatrix phase reads in distinct banks.
// tests/cusim executes these instructions with exactly this layout (include/cusim_ptx.h).
#pragma once

#include "common.cuh"

typedef unsigned int u32;

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// c += A * B, bf16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += A * B with float8_e4m3 inputs (m16n8k32: 4 bytes per register; A rows g, g+8 at columns
// 4t.. and 16+4t.., B column g at rows 4t.. and 16+4t..), fp32 accumulation. sm_89+ only: on older
// devices it traps (the host launches the kernels that use it on sm_89+ only).
__device__ __forceinline__ void mma_e4m3(float c[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    (void)c, (void)a, (void)b;
    __trap();
#endif
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, r[i] gets row g,
// columns 2t and 2t+1 of it (.trans: column g, rows 2t and 2t+1).
__device__ __forceinline__ void ldsm_x4(u32 r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// A fragment of the 16 x 16 block at `tile` (row-major, `stride` elements per row).
__device__ __forceinline__ void load_a(u32 a[4], const bf16* tile, int stride) {
    const int lane = threadIdx.x % WARP_SIZE;  // rows 0-15 (matrices 0, 1), then columns 8-15 (2, 3)
    ldsm_x4(a, tile + (lane % 16) * stride + (lane / 16) * 8);
}

// B fragments of two n8 tiles from rows n (16 of them, row-major [n][k]: k contiguous, the
// weight layout [out, in]): b0 for rows 0-7, b1 for rows 8-15, k 0-15 of `tile`.
__device__ __forceinline__ void load_b_nk(u32 b0[2], u32 b1[2], const bf16* tile, int stride) {
    const int lane = threadIdx.x % WARP_SIZE;  // matrix m = lane / 8: rows 8 * (m / 2), columns 8 * (m % 2)
    u32 r[4];
    ldsm_x4(r, tile + (lane % 8 + 8 * (lane / 16)) * stride + 8 * ((lane / 8) % 2));
    b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

// B fragments of two n8 tiles from a k-major tile ([k][n]: n contiguous, e.g. V [key][dim]):
// k 0-15, n 0-7 into b0 and n 8-15 into b1.
__device__ __forceinline__ void load_b_kn(u32 b0[2], u32 b1[2], const bf16* tile, int stride) {
    const int lane = threadIdx.x % WARP_SIZE;  // matrix m: k rows 8 * (m % 2), n columns 8 * (m / 2)
    u32 r[4];
    ldsm_x4_trans(r, tile + (lane % 8 + 8 * ((lane / 8) % 2)) * stride + 8 * (lane / 16));
    b0[0] = r[0];  // k 0-7 and 8-15 of n 0-7, then of n 8-15
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
}

// Two floats as one register of bf16 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

// 16 bytes global -> shared, asynchronously; `valid` false writes zeros and reads nothing (src
// must still be a mapped address). Visible after cp_async_wait<n> and a barrier.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
