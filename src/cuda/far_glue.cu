// cuda/far_glue.cu: the two-size backward's glue on Hopper (sm_90a). The chains (bwd_q, bwd_k, super_bwd) run on
// superblocks s of sc chunks; the fused far kernel runs twice: once on the adjacent superblock alone (the keys of
// an even superblock 2m with the queries of 2m + 1, no crossing) and once on double blocks m = {2m, 2m + 1}
// (kernel params p2: sc2 = 2 sc), whose inputs and gradients are the single blocks' through
//   PS2_m = PS_{2m+1} PS_{2m}, ks2 = ks PS_{2m+1}^T (keys of 2m), qhat2 = qhat PS_{2m} (queries of 2m + 1);
// the keys of 2m + 1 and the queries of 2m are the chains' own (the far kernel reads ks / qhat and writes dks /
// dqt for them: KernelParams::far1_*). glue_fwd builds PS2, ks2, qhat2 (and zeroes dqt2 and dps2, which the far
// kernel adds into); glue_bwd takes the adjoints back: dPS_{2m+1} += dPS2 PS_{2m}^T + dks2^T ks (keys of 2m),
// dPS_{2m} += PS_{2m+1}^T dPS2 + qhat^T dqt2 (queries of 2m + 1), dks += dks2 PS_{2m+1}, dqt += dqt2 PS_{2m}^T. Conventions as bwd_k_far.cu: PS_s = P_last ... P_first, keys move forward
// as k <- k PS^T, queries back as q <- q PS. One CTA (two warpgroups) a job: a 128-row tile of one (double
// block, kv head), with the products of hopper.cuh's ps_product (fp16 operands, fp32 accumulation) and the far
// kernels' staged outer products for the dPS sums.
#include <cstdint>

#include "cuda/hopper.cuh"
#include "cuda/launchers.h"
#include "cuda/tensor_map.h"

namespace pathattn::cuda {
namespace {

constexpr int kGlThreads = 256;
constexpr int kGlRows = 128;

template <int K>
struct GlSmem {
  static constexpr size_t ps = size_t(K) * K * 2, tile = size_t(kGlRows) * K * 2;
  static constexpr size_t bytes = 1024 + ps + 2 * tile;
};

// The K x K fp16 product at src (row-major) into shared memory as TMA writes it (column blocks of K rows x 64,
// 128-byte swizzle), visible to wgmma after the barrier.
template <int K>
__device__ __forceinline__ void stage_ps(__half* dst, const __half* src) {
  for (int i = threadIdx.x; i < K * K / 8; i += kGlThreads) {
    const int r = i / (K / 8), cc = i % (K / 8), c = 8 * cc;
    const uint4 v = *reinterpret_cast<const uint4*>(src + int64_t(r) * K + c);
    *reinterpret_cast<uint4*>(dst + (c / 64) * K * 64 + r * 64 + (((cc & 7) ^ (r & 7)) << 3)) = v;
  }
  fence_async_smem();
  __syncthreads();
}

// A CTA's 128-row tile in the C layout of its warps (rows 16 warp + g, + 8), rows from `valid` on zero.
template <typename E, int K>
__device__ __forceinline__ void load_rows(float (&x)[K / 8][4], const E* base, int64_t ld, int valid) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, w = threadIdx.x >> 5;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = 16 * w + g + 8 * hr;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      float a = 0.f, b = 0.f;
      if (r < valid) {
        a = to_f(base[r * ld + 8 * nt + 2 * t4]);
        b = to_f(base[r * ld + 8 * nt + 2 * t4 + 1]);
      }
      x[nt][2 * hr] = a;
      x[nt][2 * hr + 1] = b;
    }
  }
}
// The same tile from the transpose of a K x K fp32 matrix: row r is column r.
template <int K>
__device__ __forceinline__ void load_rows_t(float (&x)[K / 8][4], const float* m) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, w = threadIdx.x >> 5;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = 16 * w + g + 8 * hr;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      x[nt][2 * hr] = r < K ? m[(8 * nt + 2 * t4) * K + r] : 0.f;
      x[nt][2 * hr + 1] = r < K ? m[(8 * nt + 2 * t4 + 1) * K + r] : 0.f;
    }
  }
}
// kMode 0: store (16-bit E or fp32); 1: add into fp32 (read-modify-write: the row's one writer); rows < valid.
template <int kMode, typename E, int K>
__device__ __forceinline__ void put_rows(const float (&x)[K / 8][4], E* base, int64_t ld, int valid) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, w = threadIdx.x >> 5;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = 16 * w + g + 8 * hr;
    if (r >= valid) continue;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      E* d = base + r * ld + 8 * nt + 2 * t4;
      if constexpr (sizeof(E) == 2) {
        *reinterpret_cast<uint32_t*>(d) = Pack2<E>::pack(x[nt][2 * hr], x[nt][2 * hr + 1]);
      } else if constexpr (kMode == 0) {
        *reinterpret_cast<float2*>(d) = make_float2(x[nt][2 * hr], x[nt][2 * hr + 1]);
      } else {
        float2 o = *reinterpret_cast<float2*>(d);
        o.x += x[nt][2 * hr];
        o.y += x[nt][2 * hr + 1];
        *reinterpret_cast<float2*>(d) = o;
      }
    }
  }
}

// dst (K x K fp32) += a^T b over the tile's 128 rows, both staged in T with a power-of-two scale each (the far
// kernels' add_dps): vector reductions.
template <typename T, int K>
__device__ __forceinline__ void add_outer(const float (&a)[K / 8][4], const float (&b)[K / 8][4], T* As, T* Bs,
                                          float* red, float* dst) {
  const float ua = stage_tile_scaled<T, K>(a, As, red);
  __syncthreads();  // every warp has read red
  const float ub = stage_tile_scaled<T, K>(b, Bs, red);
  __syncthreads();  // every warp's rows of both tiles
  const int warp = threadIdx.x >> 5, wg = warp >> 2;
  const int mb = K == 128 ? wg : 0, k0 = K == 128 ? 0 : 4 * wg;
  constexpr int nks = K == 128 ? 8 : 4;
#pragma unroll 1
  for (int nh = 0; nh < K / 64; ++nh) {
    float d[8][4];
    wg_rows_outer<T>(d, As, mb, Bs, nh, k0, nks);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) red_add_frag_v4(dst, K, mb * 64 + 16 * (warp & 3), nh * 64 + 8 * nt, d[nt], ua * ub);
  }
  __syncthreads();  // the staged tiles are free again
}

// This CTA's job: its double block m (from the chunk table entry of the block's first chunk, items[blockIdx.x]:
// one a double block that is not alone in its sequence), kv head blockIdx.z, job blockIdx.y.
struct Block {
  int64_t tok0;     // the sequence's first token row (b T + t0)
  int64_t sb_rows;  // rows of a superblock of p
  int len, last_sb, last2, m, se, so;  // so = se + 1 = 2 m + 1
  int sfirst, sfirst2, h, job, tiles;  // tiles: 128-row tiles a superblock
};
#ifdef PA_SM90A
__device__ __forceinline__ Block block_of(const KernelParams& p, const KernelParams& p2, const int32_t* items) {
  const int ci = items[blockIdx.x];
  const ChunkDesc ch = p.chunks[ci];
  Block b;
  b.tok0 = ch.b * p.T + ch.t0;
  b.sb_rows = int64_t(p.sc) * kChunk;
  b.len = ch.len;
  const int last = (ch.len + kChunk - 1) / kChunk - 1;
  b.last_sb = last / p.sc;
  b.last2 = last / p2.sc;
  b.m = ch.c / p2.sc;
  b.se = 2 * b.m;
  b.so = b.se + 1;
  b.sfirst = ch.sfirst;
  b.sfirst2 = p2.chunks[ci].sfirst;
  b.h = int(blockIdx.z);
  b.job = int(blockIdx.y);
  b.tiles = p.sc / 2;
  return b;
}
// The K x K matrix of superblock s of bk's sequence and head in a [nsuper H K][K] array (ps, dps).
template <int K, typename E>
__device__ __forceinline__ E* super_mat(E* base, const KernelParams& p, const Block& bk, int s) {
  return base + (int64_t(bk.sfirst + s) * p.H + bk.h) * K * K;
}
// Query tile jq (of the jobs after the first `skip`) of the odd half: its first row's offset in a [NT][HQ][K]
// array and its rows within the sequence (0 where the tile or the odd half lies past the sequence's end).
struct QueryTile {
  int64_t at;
  int rows;
};
template <int K>
__device__ __forceinline__ QueryTile odd_query_tile(const KernelParams& p, const Block& bk, int skip) {
  const int jq = bk.job - skip, hq = bk.h * p.group + jq / bk.tiles;
  const int po = int(bk.so * bk.sb_rows) + (jq % bk.tiles) * kGlRows;
  const int rows = bk.so > bk.last_sb ? 0 : min(max(bk.len - po, 0), kGlRows);
  return {((bk.tok0 + po) * p.HQ + hq) * K, rows};
}
#endif

// Jobs (blockIdx.y): 0 PS2 (and dps2 zeroed); 1 .. tiles the key tiles; then the query tiles of each head of the
// group. tiles = sc / 2 128-row tiles a superblock.
template <typename T, int K>
__global__ void __launch_bounds__(kGlThreads, 1) glue_fwd_kernel(const __grid_constant__ KernelParams p,
                                                                 const __grid_constant__ KernelParams p2,
                                                                 const int32_t* items) {
#ifdef PA_SM90A
  extern __shared__ __align__(16) uint8_t smem[];
  __half* PSs = reinterpret_cast<__half*>(align1k(smem));
  const Block bk = block_of(p, p2, items);
  const int h = bk.h;
  float x[K / 8][4];
  if (bk.job == 0) {
    if (bk.m < 1 || bk.m >= bk.last2) return;
    stage_ps<K>(PSs, super_mat<K>(p.ps, p, bk, bk.se));
    load_rows<__half, K>(x, super_mat<K>(p.ps, p, bk, bk.so), K, K);
    ps_product<K, false, false>(x, PSs);  // PS_{2m+1} PS_{2m}
    const int64_t at = (int64_t(bk.sfirst2 + bk.m) * p.H + h) * K * K;
    put_rows<0, __half, K>(x, p2.ps + at, K, K);
    for (int i = threadIdx.x; i < K * K / 4; i += kGlThreads)
      reinterpret_cast<float4*>(p2.dps + at)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  } else if (bk.job <= bk.tiles) {
    if (bk.m >= bk.last2) return;  // (then the even half is whole)
    const int64_t te = bk.tok0 + bk.se * bk.sb_rows + int64_t(bk.job - 1) * kGlRows, ld = int64_t(p.H) * K;
    stage_ps<K>(PSs, super_mat<K>(p.ps, p, bk, bk.so));
    load_rows<T, K>(x, static_cast<const T*>(p.ks) + (te * p.H + h) * K, ld, kGlRows);
    ps_product<K, true, false>(x, PSs);  // ks PS_{2m+1}^T
    put_rows<0, T, K>(x, static_cast<T*>(p2.ks) + (te * p.H + h) * K, ld, kGlRows);
  } else {
    const QueryTile qt = odd_query_tile<K>(p, bk, 1 + bk.tiles);
    if (bk.m < 1 || qt.rows == 0) return;
    const int64_t ld = int64_t(p.HQ) * K;
    float z[K / 8][4];
    zero_acc(z);
    stage_ps<K>(PSs, super_mat<K>(p.ps, p, bk, bk.se));
    load_rows<T, K>(x, static_cast<const T*>(p.qhat) + qt.at, ld, qt.rows);
    ps_product<K, false, false>(x, PSs);  // qhat PS_{2m}
    put_rows<0, T, K>(x, static_cast<T*>(p2.qhat) + qt.at, ld, qt.rows);
    put_rows<0, float, K>(z, p2.dqt + qt.at, ld, qt.rows);
  }
#endif
}

// Jobs: 0 dPS_{2m+1} += dPS2 PS_{2m}^T; 1 dPS_{2m} += PS_{2m+1}^T dPS2; 2 .. tiles + 1 the key tiles; then the
// query tiles of each head of the group.
template <typename T, int K>
__global__ void __launch_bounds__(kGlThreads, 1) glue_bwd_kernel(const __grid_constant__ KernelParams p,
                                                                 const __grid_constant__ KernelParams p2,
                                                                 const int32_t* items) {
#ifdef PA_SM90A
  extern __shared__ __align__(16) uint8_t smem[];
  __half* PSs = reinterpret_cast<__half*>(align1k(smem));
  T* As = reinterpret_cast<T*>(PSs + K * K);
  T* Bs = As + kGlRows * K;
  __shared__ float red[kGlThreads / 32];
  const Block bk = block_of(p, p2, items);
  const int h = bk.h, se = bk.se, so = bk.so, warp = threadIdx.x >> 5;
  auto ps_of = [&](int s) { return super_mat<K>(p.ps, p, bk, s); };
  auto dps_of = [&](int s) { return super_mat<K>(p.dps, p, bk, s); };
  float x[K / 8][4];
  if (bk.job < 2) {
    if (bk.m < 1 || bk.m >= bk.last2) return;
    const float* d2 = p2.dps + (int64_t(bk.sfirst2 + bk.m) * p.H + h) * K * K;
    if (bk.job == 0) {
      stage_ps<K>(PSs, ps_of(se));
      load_rows<float, K>(x, d2, K, K);
      ps_product<K, true, true>(x, PSs);  // dPS2 PS_{2m}^T
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) red_add_frag_v4<true>(dps_of(so), K, 16 * warp, 8 * nt, x[nt], 1.f, K);
    } else {
      stage_ps<K>(PSs, ps_of(so));
      load_rows_t<K>(x, d2);
      ps_product<K, false, true>(x, PSs);  // dPS2^T PS_{2m+1} = (PS_{2m+1}^T dPS2)^T
      const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
      float* dst = dps_of(se);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 16 * warp + g + 8 * hr;
        if (r >= K) continue;
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt) {
          atomicAdd(dst + (8 * nt + 2 * t4) * K + r, x[nt][2 * hr]);
          atomicAdd(dst + (8 * nt + 2 * t4 + 1) * K + r, x[nt][2 * hr + 1]);
        }
      }
    }
  } else if (bk.job < 2 + bk.tiles) {
    if (bk.m >= bk.last2) return;
    const int64_t te = bk.tok0 + se * bk.sb_rows + int64_t(bk.job - 2) * kGlRows, ld = int64_t(p.H) * K;
    stage_ps<K>(PSs, ps_of(so));
    float y[K / 8][4];
    load_rows<float, K>(x, p2.dks + (te * p.H + h) * K, ld, kGlRows);
    load_rows<T, K>(y, static_cast<const T*>(p.ks) + (te * p.H + h) * K, ld, kGlRows);
    add_outer<T, K>(x, y, As, Bs, red, dps_of(so));  // dks2^T ks
    ps_product<K, false, true>(x, PSs);  // dks2 PS_{2m+1}
    put_rows<1, float, K>(x, p.dks + (te * p.H + h) * K, ld, kGlRows);
  } else {
    const QueryTile qt = odd_query_tile<K>(p, bk, 2 + bk.tiles);
    if (bk.m < 1 || qt.rows == 0) return;
    const int64_t ld = int64_t(p.HQ) * K;
    stage_ps<K>(PSs, ps_of(se));
    float y[K / 8][4];
    load_rows<float, K>(x, p2.dqt + qt.at, ld, qt.rows);
    load_rows<T, K>(y, static_cast<const T*>(p.qhat) + qt.at, ld, qt.rows);
    add_outer<T, K>(y, x, As, Bs, red, dps_of(se));  // qhat^T dqt2
    ps_product<K, true, true>(x, PSs);  // dqt2 PS_{2m}^T
    put_rows<1, float, K>(x, p.dqt + qt.at, ld, qt.rows);
  }
#endif
}

template <typename T>
cudaError_t glue_t(bool bwd, const KernelParams& p, const KernelParams& p2, const int32_t* items, int nitems,
                   cudaStream_t s) {
  const int tiles = p.sc / 2;
  const dim3 grid(unsigned(nitems), unsigned((bwd ? 2 : 1) + tiles + tiles * p.group), unsigned(p.H));
  if (bwd)
    return launch_with_smem(glue_bwd_kernel<T, 128>, grid, kGlThreads, GlSmem<128>::bytes, s, p, p2, items);
  return launch_with_smem(glue_fwd_kernel<T, 128>, grid, kGlThreads, GlSmem<128>::bytes, s, p, p2, items);
}

}  // namespace

bool far_glue_usable(const KernelParams& p) {
  return p.K == 128 && p.V == 128 && p.sc % 2 == 0 && far_device_ok(GlSmem<128>::bytes);
}

cudaError_t launch_far_glue(bool bwd, const KernelParams& p, const KernelParams& p2, const int32_t* items,
                            int nitems, int dtype, cudaStream_t s) {
  if (nitems == 0) return cudaSuccess;
  if (p.K != 128 || p2.sc != 2 * p.sc) return cudaErrorInvalidValue;
  return dtype == 0 ? glue_t<__half>(bwd, p, p2, items, nitems, s) : glue_t<__nv_bfloat16>(bwd, p, p2, items, nitems, s);
}

}  // namespace pathattn::cuda
