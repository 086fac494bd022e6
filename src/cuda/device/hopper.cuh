// cuda/device/hopper.cuh: sm_90a device helpers: wgmma (warpgroup MMA with A from registers, B from shared memory
// through a matrix descriptor), TMA tile loads (cp.async.bulk.tensor) and the mbarriers they complete. Only
// the sm_90a device pass compiles their bodies (PA_SM90A); kernels that use them guard their own bodies the
// same way, so the library still builds for sm_80 (where those kernels are empty and never launched).
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; no driver library is linked for it)

#include <type_traits>

#include "cuda/device/common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PA_SM90A 1
#endif

namespace pathattn::cuda {

// ---- Shared-memory matrix descriptors (PTX ISA, "Matrix Descriptor Format"): start address, leading and
// stride byte offsets (>> 4), and the swizzle mode in bits 62-63 (1 = 128-byte swizzle).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) | (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* p, uint32_t lbo, uint32_t sbo) {
  return smem_desc(p, lbo, sbo) | (uint64_t(1) << 62);
}
// The first 1024-byte aligned address at or after p (shared memory): 128-byte swizzled tiles start there.
__device__ __forceinline__ uint8_t* align1k(uint8_t* p) { return p + ((1024u - (smem_u32(p) & 1023u)) & 1023u); }

// ---- wgmma ordering.
__device__ __forceinline__ void wg_fence() {
#ifdef PA_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#ifdef PA_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N of this warpgroup's committed wgmma groups are pending (groups complete in order).
template <int N>
__device__ __forceinline__ void wg_wait() {
#ifdef PA_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// This thread's lane from the special register, read where it is called (volatile): offsets derived from it are
// recomputed there instead of being hoisted out of loops and held in registers.
__device__ __forceinline__ uint32_t lane_id() {
  uint32_t l;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
  return l;
}
// Shared memory written through the generic proxy (cp.async, stores) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_async_smem() {
#ifdef PA_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Ties registers a wgmma writes (fp32 accumulators) or reads while in flight (uint32 A fragments) to this point
// (after a wait, before a fence): the compiler may not move their reads or writes across it.
template <typename E, int N>
__device__ __forceinline__ void fence_regs(E (&d)[N][4]) {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, uint32_t>, "fence_regs: fp32 or 32-bit registers");
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<E, float>) asm volatile("" : "+f"(d[i][e])::"memory");
      else asm volatile("" : "+r"(d[i][e])::"memory");
    }
}
// The same for several register arrays, in the order given.
template <class A, class B, class... R>
__device__ __forceinline__ void fence_regs(A& a, B& b, R&... rest) {
  fence_regs(a);
  fence_regs(b, rest...);
}

// ---- wgmma products. d (the warpgroup's 64 x N fp32 tile; this warp's 16 rows in the mma.sync C layout, N / 8
// n-blocks) += A B, A = this warp's 16 x 16 fragment of element type E in registers (the m16n8k16 A layout), B
// (16 x N, type E) from the descriptor db; TNSPB = 1 reads B stored N-contiguous ([k][n]). acc = 0 ignores d's
// old values (no instruction has to zero it first). The accumulator operands are spelled out for each N.
#define PA_WG_D8(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define PA_WG_D32 PA_WG_D8(0), PA_WG_D8(1), PA_WG_D8(2), PA_WG_D8(3)
#define PA_WG_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define PA_WG_D64 PA_WG_D8(0), PA_WG_D8(1), PA_WG_D8(2), PA_WG_D8(3), PA_WG_D8(4), PA_WG_D8(5), PA_WG_D8(6), PA_WG_D8(7)
#define PA_WG_D128                                                                                              \
  PA_WG_D64, PA_WG_D8(8), PA_WG_D8(9), PA_WG_D8(10), PA_WG_D8(11), PA_WG_D8(12), PA_WG_D8(13), PA_WG_D8(14), \
      PA_WG_D8(15)
#define PA_WG_R32                                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PA_WG_R64                                                                                                   \
  PA_WG_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, " \
            "%52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// One wgmma: shape (m64nNk16), the accumulator registers' operand list and the rest of the PTX after the
// accumulators; the element type's name (f16 or bf16 for E) is spliced in. Output / input lists are given in
// parentheses (they hold commas).
#define PA_UNPAREN(...) __VA_ARGS__
#define PA_WG_MMA(E, pred, shape, dregs, tail, outs, ins)                                                    \
  do {                                                                                                       \
    if constexpr (std::is_same_v<E, __half>)                                                                 \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " pred ", 0;\nwgmma.mma_async.sync.aligned." shape    \
                   ".f32.f16.f16 {" dregs "}, " tail ";\n}\n"                                               \
                   : PA_UNPAREN outs                                                                         \
                   : PA_UNPAREN ins);                                                                        \
    else                                                                                                     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " pred ", 0;\nwgmma.mma_async.sync.aligned." shape    \
                   ".f32.bf16.bf16 {" dregs "}, " tail ";\n}\n"                                             \
                   : PA_UNPAREN outs                                                                         \
                   : PA_UNPAREN ins);                                                                        \
  } while (0)

template <typename E, int TNSPB>
__device__ __forceinline__ void wg_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int acc = 1) {
#ifdef PA_SM90A
  PA_WG_MMA(E, "%37", "m64n64k16", PA_WG_R32, "{%32, %33, %34, %35}, %36, p, 1, 1, %38", (PA_WG_D64),
            ("r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TNSPB)));
#endif
}
template <typename E, int TNSPB>
__device__ __forceinline__ void wg_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, int acc = 1) {
#ifdef PA_SM90A
  PA_WG_MMA(E, "%69", "m64n128k16", PA_WG_R64, "{%64, %65, %66, %67}, %68, p, 1, 1, %70", (PA_WG_D128),
            ("r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TNSPB)));
#endif
}
// d (64 x 64) += A B with both operands from shared memory through descriptors (A 64 x 16, K-major unless
// TNSPA; B as in wg_rs).
template <typename E, int TNSPA, int TNSPB>
__device__ __forceinline__ void wg_ss(float (&d)[8][4], uint64_t da, uint64_t db, int acc = 1) {
#ifdef PA_SM90A
  PA_WG_MMA(E, "%34", "m64n64k16", PA_WG_R32, "%32, %33, p, 1, 1, %35, %36", (PA_WG_D64),
            ("l"(da), "l"(db), "r"(acc), "n"(TNSPA), "n"(TNSPB)));
#endif
}
// d (64 x 32) += A B, both from shared memory (as wg_ss).
template <typename E, int TNSPA, int TNSPB>
__device__ __forceinline__ void wg_ss(float (&d)[4][4], uint64_t da, uint64_t db, int acc = 1) {
#ifdef PA_SM90A
  PA_WG_MMA(E, "%18", "m64n32k16", PA_WG_R16, "%16, %17, p, 1, 1, %19, %20", (PA_WG_D32),
            ("l"(da), "l"(db), "r"(acc), "n"(TNSPA), "n"(TNSPB)));
#endif
}
#undef PA_WG_MMA
#undef PA_UNPAREN
#undef PA_WG_D32
#undef PA_WG_R16
#undef PA_WG_D8
#undef PA_WG_D64
#undef PA_WG_D128
#undef PA_WG_R32
#undef PA_WG_R64

// A warp's 16 x (16 KT) fp32 tile in the C layout (2 KT n-tiles) packed as KT k-steps of m16n8k16 A fragments of
// element type E (the layout wgmma takes its register A operand in), as warp_mma_rs packs its source.
template <typename E, int KT>
__device__ __forceinline__ void pack_frags(uint32_t (&a)[KT][4], const float (&s)[2 * KT][4]) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    a[kt][0] = Pack2<E>::pack(s[2 * kt][0], s[2 * kt][1]);
    a[kt][1] = Pack2<E>::pack(s[2 * kt][2], s[2 * kt][3]);
    a[kt][2] = Pack2<E>::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
    a[kt][3] = Pack2<E>::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]);
  }
}

// A warp's 16 rows x (16 KT) columns of a row-major 16-bit matrix (row0 = its first row, ld elements apart) as
// KT k-steps of m16n8k16 A fragments, straight from global memory (two elements a 32-bit load); rows from
// `valid` on read as zeros. Each lane reads the elements store_tile (common.cuh) writes from the same lane's
// C-layout registers.
template <typename E, int KT>
__device__ __forceinline__ void load_frags(uint32_t (&f)[KT][4], const E* row0, int64_t ld, int valid = 16) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t* r0 = reinterpret_cast<const uint32_t*>(row0 + g * ld);
  const uint32_t* r1 = reinterpret_cast<const uint32_t*>(row0 + (g + 8) * ld);
  const bool ok0 = g < valid, ok1 = g + 8 < valid;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    f[kt][0] = ok0 ? r0[8 * kt + t] : 0u;
    f[kt][1] = ok1 ? r1[8 * kt + t] : 0u;
    f[kt][2] = ok0 ? r0[8 * kt + 4 + t] : 0u;
    f[kt][3] = ok1 ? r1[8 * kt + 4 + t] : 0u;
  }
}

// x <- x PS (kTransposed: x PS^T) for a warpgroup's 64 x K fp32 tile (this warp's 16 rows, C layout) and a K x K
// fp16 product PS in shared memory as TMA writes it (column blocks of K rows x 64, 128-byte swizzle): fp16
// operands, fp32 accumulation. kRowScale first scales each row by a power of two into [-1, 1) and back after
// (operands that may lie far below fp16's range, such as gradients, keep fp16's relative precision, as tf32
// would). The caller waits for PS to land before and releases it after.
template <int K, bool kTransposed, bool kRowScale>
__device__ __forceinline__ void ps_product(float (&x)[K / 8][4], const __half* PSs) {
  float up[2] = {1.f, 1.f};
  if constexpr (kRowScale) row_scale_down(x, up);
  uint32_t a[K / 16][4];
  pack_frags<__half, K / 16>(a, x);
  fence_regs(a);
  wg_fence();
  const char* base = reinterpret_cast<const char*>(PSs);
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt) {
    // x PS: B[k][n] = PS[k][n], N-major (k-steps of 16 rows, column blocks K rows apart); x PS^T: B[k][n] =
    // PS[n][k], K-major (k-steps of 32 bytes within a column block).
    const uint64_t db = kTransposed ? smem_desc_sw128(base + (kt / 4) * K * 128 + (kt % 4) * 32, 16, 1024)
                                    : smem_desc_sw128(base + kt * 16 * 128, K * 128, 1024);
    if constexpr (kTransposed) wg_rs<__half, 0>(x, a[kt], db, kt > 0);
    else wg_rs<__half, 1>(x, a[kt], db, kt > 0);
  }
  wg_commit();
  wg_wait<0>();
  fence_regs(x);
  if constexpr (kRowScale) row_scale_up(x, up);
}

// The backward's far kernels' 128 x K fp32 tile (256 threads; warp w's rows 16 w .. in the C layout) staged in
// shared memory in the 16-bit type T for a wgmma over its rows (dPS: the query side's gbar, the key side's h),
// scaled by one power of two for the tile (its largest entry into [0.5, 1)), as column blocks of 128 rows x 64
// with the 128-byte swizzle (as TMA writes them). `red` holds the 8 warps' maxima. Begins with a CTA barrier
// (every warp is past the callers' earlier reads of dst), ends with the stores made visible to wgmma (a barrier
// is still needed before one reads another warp's rows). Returns the scale back.
template <typename T, int K>
__device__ __forceinline__ float stage_tile_scaled(const float (&x)[K / 8][4], T* dst, float* red) {
  constexpr int kRows = 128;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int ex = scale_exp(block_max<kRows / 16>(lane_abs_max(x), red));
  const float down = ldexpf(1.f, -ex);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = 16 * warp + g + 8 * hr;  // row within the tile
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      const int c = 8 * nt + 2 * t4, cc = c % 64;
      T* d = dst + (c / 64) * kRows * 64 + r * 64 + ((((cc >> 3) ^ (r & 7)) << 3) | (cc & 7));
      *reinterpret_cast<uint32_t*>(d) = Pack2<T>::pack(x[nt][2 * hr] * down, x[nt][2 * hr + 1] * down);
    }
  }
  fence_async_smem();
  return ldexpf(1.f, ex);
}

// d (64 x 64) = A^T B summed over rows 16 k0 .. 16 (k0 + nks) - 1 of two 128-row tiles in shared memory
// (column blocks of 128 rows x 64, 128-byte swizzle, as stage_tile_scaled and TMA write them): A's column block
// ma gives d's rows (M-major), B's column block nb its columns (N-major). The far kernels' dPS products, issued,
// committed and waited for.
template <typename T>
__device__ __forceinline__ void wg_rows_outer(float (&d)[8][4], const T* A, int ma, const T* B, int nb, int k0,
                                              int nks) {
  constexpr int kRows = 128;
  const char* a = reinterpret_cast<const char*>(A + ma * kRows * 64);
  const char* b = reinterpret_cast<const char*>(B + nb * kRows * 64);
  wg_fence();
#pragma unroll
  for (int k = 0; k < nks; ++k)
    wg_ss<T, 1, 1>(d, smem_desc_sw128(a + (k0 + k) * 16 * 128, kRows * 128, 1024),
                   smem_desc_sw128(b + (k0 + k) * 16 * 128, kRows * 128, 1024), k > 0);
  wg_commit();
  wg_wait<0>();
  fence_regs(d);
}

// A warp's 16 rows (from row0) x (16 KT) columns of a 16-bit tile in shared memory as TMA writes it (column blocks
// of `rows` rows x 64, 128-byte swizzle, 1024-byte aligned) as KT m16n8k16 A fragments, by ldmatrix.
template <int KT>
__device__ __forceinline__ void frags_from_sw128(uint32_t (&f)[KT][4], const void* tile, int rows, int row0) {
  const int lane = threadIdx.x & 31, r = row0 + (lane & 15), hi = lane >> 4;
  const char* base = static_cast<const char*>(tile) + r * 128;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    const int col = 16 * kt + 8 * hi;  // lanes 16-31 address the k-step's second 8 columns
    ldsm_x4(f[kt], base + (col / 64) * rows * 128 + ((((col % 64) >> 3) ^ (r & 7)) << 4));
  }
}

// ---- mbarriers and TMA.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#ifdef PA_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_init_fence() {
#ifdef PA_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef PA_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef PA_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#endif
}
// Waits for the phase of `bar` with parity `parity`; after about 2^26 polls calls on_timeout() and returns
// (the default traps: an error the host sees, not a hang).
struct TrapOnTimeout {
  __device__ void operator()() const { __trap(); }
};
template <class OnTimeout = TrapOnTimeout>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, OnTimeout on_timeout = {}) {
#ifdef PA_SM90A
  for (uint32_t spins = 0;; ++spins) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (spins > (1u << 26)) {
      on_timeout();
      return;
    }
  }
#endif
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into shared memory at dst,
// completing `bar`'s transaction bytes.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef PA_SM90A
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
#endif
}
// One TMA box of an N-dimensional tensor map (coordinates innermost first) into shared memory at dst,
// completing `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
#ifdef PA_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int x, int y, int z, uint64_t* bar) {
#ifdef PA_SM90A
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(smem_u32(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int x, int y, int z, int w,
                                         uint64_t* bar) {
#ifdef PA_SM90A
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(smem_u32(bar))
      : "memory");
#endif
}
// One box of fp32 shared memory added into a 4-dimensional fp32 tensor map's elements by TMA (element-wise
// atomic adds in L2; coordinates innermost first; elements outside the tensor skipped), in this thread's bulk
// group (bwd_k_far's dq through map_tokens_paired). The shared memory must have been made visible to the async
// proxy (fence_async_smem) first.
__device__ __forceinline__ void tma_reduce_add(const CUtensorMap* map, const void* src, int x, int y, int z, int w) {
#ifdef PA_SM90A
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
               " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(x), "r"(y), "r"(z), "r"(w)
               : "memory");
#endif
}
// This thread's bulk operations so far as one group.
__device__ __forceinline__ void bulk_commit() {
#ifdef PA_SM90A
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's bulk groups have read their shared memory (kRead) or completed, but the newest N.
template <int N, bool kRead>
__device__ __forceinline__ void bulk_wait() {
#ifdef PA_SM90A
  if constexpr (kRead)
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The superblock products' pipeline of the backward's far kernels: one buffer PSs ([K][K] fp16 as column blocks
// of K x 64), filled by one thread once every warp released the previous product, applied by every warp
// (ps_product) and released. `n` counts the products applied (every thread counts the same).
struct PsPipe {
  uint64_t* full;   // one arrival (the loading thread's expect_tx)
  uint64_t* empty;  // one arrival a warp
  __half* buf;
  uint32_t n = 0;
  __device__ void init(int warps) {
    mbar_init(full, 1);
    mbar_init(empty, warps);
  }
  // One thread: rows [row, row + K) of `map` (the products as a [nsuper H K][K] matrix) into buf.
  template <int K>
  __device__ void load(const CUtensorMap* map, int row) {
    if (n > 0) mbar_wait(empty, (n - 1) & 1);
    mbar_expect_tx(full, uint32_t(K * K * 2));
#pragma unroll 1
    for (int j = 0; j < K / 64; ++j) tma_load(buf + j * K * 64, map, 64 * j, row, full);
  }
  // x <- x PS (or x PS^T): waits for the product, applies it, releases it.
  template <int K, bool kTransposed, bool kRowScale>
  __device__ void apply(float (&x)[K / 8][4]) {
    mbar_wait(full, n & 1);
    ps_product<K, kTransposed, kRowScale>(x, buf);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty);
    ++n;
  }
};

}  // namespace pathattn::cuda
