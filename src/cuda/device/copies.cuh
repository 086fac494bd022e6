// cuda/device/copies.cuh: global -> shared copies: cp.async, 4-element vector loads and stores, and the staging
// of 64-row tiles of strided sources.
#pragma once

#include "cuda/device/mma.cuh"

namespace pathattn::cuda {

// cp.async: 16-byte global -> shared copies; src_bytes = 0 zero-fills (rows past a sequence's end).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Waits until at most N of this thread's most recent commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies 64 x D elements (2-byte type) of a row-strided global tile into shared memory [64][D + 8] with
// 16-byte cp.async (not committed); rows >= nvalid are zero-filled. `stride` is the global row stride in
// elements. For the 128-thread scan kernels: each thread keeps one 16-byte column and steps 128 / (D / 8)
// rows at a time, so the addresses are a few adds (no divisions or 64-bit multiplies per element). `tid` (0 ..
// 127) is the copying thread's index: a larger block may split its tiles between groups of 128 threads.
inline constexpr int kTileThreads = 128;
template <int D, typename E>
__device__ __forceinline__ void load_tile_async(E* dst, const E* src, int64_t stride, int nvalid,
                                                int tid = threadIdx.x) {
  constexpr int kVec = 8, kPerRow = D / kVec, kRowStep = kTileThreads / kPerRow;
  static_assert(kTileThreads % kPerRow == 0 && 64 % kRowStep == 0, "load_tile_async: tile shape");
  const int r0 = tid / kPerRow, c = (tid % kPerRow) * kVec;
  const E* s = src + r0 * stride + c;
  E* d = dst + r0 * (D + 8) + c;
  const int64_t sstep = kRowStep * stride;
#pragma unroll
  for (int i = 0; i < 64 / kRowStep; ++i) {
    const bool ok = r0 + i * kRowStep < nvalid;
    cp_async16(d + i * kRowStep * (D + 8), ok ? s : src, ok);
    s += sstep;
  }
}

// A chunk's fp16 W and W2 tiles (the w16 and w2h rows of kv head h from token tok) into two [64][K + 8] tiles by
// cp.async (the scan kernels' 128 threads), committed as one group.
template <int K, class P>
__device__ __forceinline__ void load_chunk_w_async(const P& p, int64_t tok, int h, __half* Wd, __half* W2d) {
  load_tile_async<K>(Wd, p.w16 + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
  load_tile_async<K>(W2d, p.w2h + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
  cp_async_commit();
}

// Four consecutive elements at p as floats: one 8-byte (16-bit types) or 16-byte (fp32) load when vec (p
// aligned to that), else four scalar loads.
__device__ __forceinline__ float4 load4(const float* p, bool vec) {
  return vec ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
}
template <typename E>
__device__ __forceinline__ float4 load4(const E* p, bool vec) {
  if (vec) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const E* e = reinterpret_cast<const E*>(&u);
    return make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
  }
  return make_float4(to_f(p[0]), to_f(p[1]), to_f(p[2]), to_f(p[3]));
}
// Whether every 4-element group of rows base + i s0 + j s1 + k s2 (+ 4 m) is aligned for load4's vector load.
template <typename E>
__host__ __device__ __forceinline__ bool vec4_ok(const E* base, int64_t s0, int64_t s1, int64_t s2) {
  constexpr int64_t kBytes = 4 * sizeof(E);
  return reinterpret_cast<uintptr_t>(base) % kBytes == 0 && (s0 * int64_t(sizeof(E))) % kBytes == 0 &&
         (s1 * int64_t(sizeof(E))) % kBytes == 0 && (s2 * int64_t(sizeof(E))) % kBytes == 0;
}
// 4 floats into shared memory: as 4 values of E (two packed 32-bit stores; dst 8-byte aligned) or fp32
// (one 16-byte store; dst 16-byte aligned).
template <typename E>
__device__ __forceinline__ void store4(E* dst, float4 v) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(Pack2<E>::pack(v.x, v.y), Pack2<E>::pack(v.z, v.w));
}
__device__ __forceinline__ void store4(float* dst, float4 v) { *reinterpret_cast<float4*>(dst) = v; }

// Stages 64 x D tiles of one or two row-strided global sources into shared memory, 4 elements per step, every
// load of a thread issued before its first store (so their latencies overlap). Row r of source i starts at
// src_i + off_i(r) (D contiguous elements); rows >= nvalid (and all of a null source) are zero; dst_i has
// leading dim ld_i (a multiple of 4). Returns whether this thread loaded a non-finite value (finite.cuh).
template <typename E>
struct TileSrc {
  const E* src;  // null: zeros
  int64_t s0, s1, s2;  // the row's offset is i0 s0 + i1 s1 + i2 s2 (elements)
  bool vec;
};
template <int D, typename E1, typename D1, typename E2, typename D2>
__device__ __forceinline__ bool stage_tiles4(const TileSrc<E1>& a, int64_t a0, int64_t a2, D1* da, int lda,
                                             const TileSrc<E2>& b, int64_t b0, int64_t b2, D2* db, int ldb,
                                             int64_t row0, int nvalid) {
  constexpr int kG = 64 * D / 4 / kTcThreads;
  static_assert(kG >= 1 && (64 * D / 4) % kTcThreads == 0, "stage_tiles4: tile shape");
  float4 va[kG], vb[kG];
  const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    const int idx = threadIdx.x + i * kTcThreads, r = idx / (D / 4), d = 4 * (idx % (D / 4));
    const bool ok = r < nvalid;
    va[i] = ok && a.src ? load4(a.src + a0 * a.s0 + (row0 + r) * a.s1 + a2 * a.s2 + d, a.vec) : z;
    vb[i] = ok && b.src ? load4(b.src + b0 * b.s0 + (row0 + r) * b.s1 + b2 * b.s2 + d, b.vec) : z;
  }
  bool bad = false;
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    const int idx = threadIdx.x + i * kTcThreads, r = idx / (D / 4), d = 4 * (idx % (D / 4));
    store4(da + r * lda + d, va[i]);
    if (db) store4(db + r * ldb + d, vb[i]);
    bad |= !(isfinite(va[i].x + va[i].y + va[i].z + va[i].w) && isfinite(vb[i].x + vb[i].y + vb[i].z + vb[i].w));
  }
  return bad;
}
// A workspace tensor [token][H][D] (contiguous, 16-byte aligned rows) as a TileSrc: rows are tokens, i2 the head.
template <int D, typename E>
__device__ __forceinline__ TileSrc<E> ws_src(const E* base, int H) {
  return TileSrc<E>{base, 0, int64_t(H) * D, D, true};
}
template <int D, typename E1, typename D1>
__device__ __forceinline__ bool stage_tile4(const TileSrc<E1>& a, int64_t a0, int64_t a2, D1* da, int lda,
                                            int64_t row0, int nvalid) {
  return stage_tiles4<D>(a, a0, a2, da, lda, TileSrc<float>{nullptr, 0, 0, 0, false}, 0, 0, static_cast<float*>(nullptr), 0,
                  row0, nvalid);
}
// Whether rows base + i s0 + j s1 + k s2 start 16-byte aligned (cp.async's 16-byte copies).
template <typename E>
__host__ __device__ __forceinline__ bool vec16_ok(const E* base, int64_t s0, int64_t s1, int64_t s2) {
  const int64_t e = sizeof(E);
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (s0 * e) % 16 == 0 && (s1 * e) % 16 == 0 &&
         (s2 * e) % 16 == 0;
}
// The same 64 x D tile as stage_tile4, without conversion (dst of the source's type, leading dim ld with 16-byte
// rows), by 16-byte cp.async (not committed: the caller commits and waits) where `async` (the source's rows
// 16-byte aligned, vec16_ok, and the source not null); otherwise by stage_tile4 at once. Either way the copy
// is visible to the block after the caller's wait and barrier. Rows >= nvalid are zero.
template <int D, typename E>
__device__ __forceinline__ void stage_tile_async(const TileSrc<E>& a, int64_t a0, int64_t a2, E* dst, int ld,
                                                 int64_t row0, int nvalid, bool async) {
  if (!async || a.src == nullptr) {
    stage_tile4<D>(a, a0, a2, dst, ld, row0, nvalid);
    return;
  }
  constexpr int kV = 16 / int(sizeof(E)), kPerRow = D / kV, kN = 64 * kPerRow / kTcThreads;
  static_assert(kN >= 1 && (64 * kPerRow) % kTcThreads == 0, "stage_tile_async: tile shape");
  const E* base = a.src + a0 * a.s0 + row0 * a.s1 + a2 * a.s2;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = threadIdx.x + i * kTcThreads, r = idx / kPerRow, d = kV * (idx % kPerRow);
    const bool ok = r < nvalid;
    cp_async16(dst + r * ld + d, ok ? base + r * a.s1 + d : base, ok);
  }
}

// A chunk's k rows (16-bit type T, into Ks, leading dim lt) and w rows (W: p.w's element type, converted to fp32
// into Wf, leading dim lw) of kv head h, rows from position pos0 of batch row b; rows >= nq and (without the
// transport) w are zero. With `async`, by stage_tile_async (not committed), each tile whose rows allow it (a 16-bit
// w is converted on the way, so it is staged at once). Without it, returns whether this thread loaded a
// non-finite value.
template <int K, typename W, class P, typename T>
__device__ __forceinline__ bool stage_chunk_kw_as(const P& p, int64_t b, int64_t pos0, int h, int nq, T* Ks, int lt,
                                                  float* Wf, int lw, bool async) {
  const T* kp = static_cast<const T*>(p.k);
  const W* wp = p.path ? static_cast<const W*>(p.w) : nullptr;
  const TileSrc<T> ks{kp, p.k_s[0], p.k_s[1], p.k_s[2], vec4_ok(kp, p.k_s[0], p.k_s[1], p.k_s[2])};
  const TileSrc<W> ws{wp, p.w_s[0], p.w_s[1], p.w_s[2], vec4_ok(wp, p.w_s[0], p.w_s[1], p.w_s[2])};
  if (async) {
    stage_tile_async<K>(ks, b, h, Ks, lt, pos0, nq, vec16_ok(kp, p.k_s[0], p.k_s[1], p.k_s[2]));
    if constexpr (std::is_same_v<W, float>)
      stage_tile_async<K>(ws, b, h, Wf, lw, pos0, nq, vec16_ok(wp, p.w_s[0], p.w_s[1], p.w_s[2]));
    else
      stage_tile4<K>(ws, b, h, Wf, lw, pos0, nq);
    return false;  // not checked
  }
  return stage_tiles4<K>(ks, b, h, Ks, lt, ws, b, h, Wf, lw, pos0, nq);
}
template <int K, class P, typename T>
__device__ __forceinline__ bool stage_chunk_kw(const P& p, int64_t b, int64_t pos0, int h, int nq, T* Ks, int lt,
                                               float* Wf, int lw, bool async = false) {
  if (p.w_dt == ParamDt::bf16) return stage_chunk_kw_as<K, __nv_bfloat16>(p, b, pos0, h, nq, Ks, lt, Wf, lw, async);
  if (p.w_dt == ParamDt::f16) return stage_chunk_kw_as<K, __half>(p, b, pos0, h, nq, Ks, lt, Wf, lw, async);
  return stage_chunk_kw_as<K, float>(p, b, pos0, h, nq, Ks, lt, Wf, lw, async);
}

// One warp: acc (a 16 x 8 C fragment) += A B over an inner dimension KD, both operands fp32 in shared memory
// (A row-major from its tile's top-left, ld lda; B row-major [k][n] from its tile's top-left, ld ldb), in
// split tf32 (head * head + head * tail + tail * head): about fp32 accuracy.

// Zeroes n floats at dst (16-byte aligned, n a multiple of 4) with the threads [0, nthreads) of a block.
__device__ __forceinline__ void zero_f32(float* dst, int n, int tid, int nthreads) {
  for (int i = 4 * tid; i < n; i += 4 * nthreads) *reinterpret_cast<float4*>(dst + i) = make_float4(0.f, 0.f, 0.f, 0.f);
}

}  // namespace pathattn::cuda
