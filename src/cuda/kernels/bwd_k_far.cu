// cuda/kernels/bwd_k_far.cu: the key side's far part of the backward on Hopper (sm_90a). For a key tile (the two chunks
// of a superblock pair, 128 keys, a warpgroup each) of a kv head, the queries of every later superblock a meet the
// keys moved to a's start, kt_a = ks PS_{sbk+1}^T ... PS_{a-1}^T, with qhat. Per tile:
//   pass 1 (left to right) carries kt across the later superblocks (fp16 operands as bwd_k), parking each state;
//   pass 2 (right to left), per later superblock a, the far loop of dev/cuda/far_bwd.cu with kt_a resident: per
//          (query chunk, query head) S^T = kt_a qhat^T, dP^T = v dO^T, dv += P^T dO, h += scale dS^T qhat, and
//          between superblocks h <- h PS_a.
// h at the own superblock's end is dks, from which bwd_k (p.kfar) continues. With kFuse (not deterministic) it
// also takes the query side's far part: dq = dS kt_a into dqt by TMA reductions, and at each crossing
// dPS_a += h^T kt_a (h staged with one power-of-two scale a tile), before bwd_q's last launch (docs/cuda.md).
// Tiles: 128-byte swizzled TMA boxes, three query stages with full / empty mbarriers, the rows' softmax scalars
// (lsd) one bulk copy a stage. Gate: the query terms through lsd, the keys' from G; dS sums only with kFuse.
// The tile's phases are KfTile's members (bwd_k_far_tile.cuh); this file holds the kernel and its launchers.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/device/hopper.cuh"
#include "cuda/kernels/bwd_k_far_tile.cuh"
#include "cuda/launchers.h"
#include "cuda/tensor_map.h"

namespace pathattn::cuda {
namespace {

// The kernel: the CTA's state as locals, then per tile its coordinates, pass 1, pass 2 (KfTile) and the store of
// dks and dv.
template <typename T, int K, bool kGate, bool kFuse>
__global__ void __launch_bounds__(kKfThreads, 1) bwd_k_far_kernel(const __grid_constant__ KernelParams p,
                                                                  const __grid_constant__ KfMaps mp, int nitems) {
#ifdef PA_SM90A
  constexpr int V = K, kKfStages = KfSmem<K, kFuse>::stages, kWarps = kKfThreads / 32;
  extern __shared__ __align__(16) uint8_t smem[];
  T* Kt = reinterpret_cast<T*>(align1k(smem));  // [128 keys][K] as KB column blocks of 128 x 64
  T* Vt = Kt + kKfKeys * K;
  T* Qs = Vt + kKfKeys * V;                      // [stage][64][K] as column blocks of 64 x 64
  T* Ds = Qs + kKfStages * kChunk * K;           // [stage][64][V]
  __half* PSs = reinterpret_cast<__half*>(Ds + kKfStages * kChunk * V);  // [K][K] as column blocks of K x 64
  T* Dss = reinterpret_cast<T*>(PSs + K * K);  // kFuse: [2][128 keys][64 query rows] (dS^T); h at crossings
  float2* Ls = reinterpret_cast<float2*>(reinterpret_cast<uint8_t*>(Dss) + KfSmem<K, kFuse>::ds);  // [stage][64]
  uint64_t* full = reinterpret_cast<uint64_t*>(Ls + kKfStages * kChunk);
  uint64_t* empty = full + kKfStages;
  uint64_t* kv_full = empty + kKfStages;  // the tile's v (with its first Kt)
  uint64_t* kt_full = kv_full + 1;
  uint64_t* kt_empty = kt_full + 1;
  PsPipe ps{kt_empty + 1, kt_empty + 2, PSs};
  __shared__ float hred[kWarps];  // kFuse: the warps' largest |h| at a crossing
  // This CTA's first parked row, read from shared memory where used (held in a register from a global load it
  // cost the fused kernel at K = 128 12 / 12 bytes of spills).
  __shared__ int park_row0_s;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kKfStages; ++st) {
      mbar_init(&full[st], 1);
      mbar_init(&empty[st], kWarps);
    }
    mbar_init(kv_full, 1);
    mbar_init(kt_full, 1);
    mbar_init(kt_empty, kWarps);
    ps.init(kWarps);
    mbar_init_fence();
    park_row0_s = mp.park_first[blockIdx.x] * kKfKeys;
  }
  __syncthreads();

  // Without kFuse warp comes through a shuffle, so that the compiler knows it (and wg) warp-uniform and keeps what
  // derives from them, the wgmma descriptors among it, in uniform registers: ptxas at K = 128 0 / 0 bytes spilled
  // (was 64 / 172), with the gate 8 / 8 (was 152 / 272). With kFuse the same costs spills; there only the dq
  // product's descriptors take it (issue_dq).
  const int warp = kFuse ? int(threadIdx.x >> 5) : uniform_warp_id(), lane = threadIdx.x & 31, g = lane >> 2,
            t4 = lane & 3, wg = warp >> 2;
  const float sl2 = p.scale * 1.4426950408889634f, gl2 = kGate ? p.gate_scale * 1.4426950408889634f : 0.f;
  // Descriptor bases (>> 4 offsets per k-step added at the call): A = this warpgroup's 64 keys of Kt / Vt
  // (K-major, column blocks 128 rows apart).
  const uint64_t ka = smem_desc_sw128(reinterpret_cast<const char*>(Kt) + wg * kChunk * 128, 16, 1024);
  const uint64_t va = smem_desc_sw128(reinterpret_cast<const char*>(Vt) + wg * kChunk * 128, 16, 1024);
  // Running counts of this CTA's barrier uses (every thread counts the same; phases are their parities).
  uint32_t n_q = 0;   // query items loaded (stage n_q % 3)
  uint32_t n_kv = 0;  // tiles (kv_full)
  uint32_t n_kt = 0;  // key-state loads (kt_full), and Kt releases (kt_empty) before each but a tile's first
  const KfCta<T> cta{Kt, Vt, Qs, Ds, Dss, Ls, full, empty, kv_full, kt_full, kt_empty, ps, hred, park_row0_s,
                     warp, lane, g, t4, wg, sl2, gl2, n_q, n_kv, n_kt, ka, va};

  // Items are most work first; a CTA that finishes takes the earliest item not yet taken (not every gridDim.x-th:
  // tiles differ from one to ~T/512 superblocks of work).
  __shared__ int next_item;
  for (int it = blockIdx.x; it < nitems; it = take_item(mp.next, &next_item, int(gridDim.x))) {
    const int h = it % p.H;
    const ChunkDesc ch = p.chunks[mp.tiles[it / p.H]];
    const int kc = ch.c, sbk = kc / p.sc;
    // Double blocks (p.far_half): a tile of an odd half starts from the chains' ks and leaves dks there, the
    // queries of an even half are the chains' qhat and add into their dqt (no transform).
    const bool odd_keys = p.far_half > 0 && (kc / p.far_half) % 2 != 0;
    // (p.far_adj: the tile's adjacent superblock alone, no crossing.)
    const int last = min((ch.len + kChunk - 1) / kChunk - 1, p.far_adj ? (sbk + 2) * p.sc - 1 : INT_MAX),
              last_sb = last / p.sc;
    const int n1 = last_sb - sbk - 1;  // superblock crossings of pass 1 (and of pass 2)
    const int64_t seq_tok0 = ch.b * p.T + ch.t0, tokk0 = seq_tok0 + int64_t(kc) * kChunk;
    // Query items of pass 2: superblocks last_sb .. sbk + 1, chunks from the last, heads of the group.
    const int n_last = last - last_sb * p.sc + 1;
    const int nit = (n_last + p.sc * (last_sb - sbk - 1)) * p.group;
    float s[8][4], dp[8][4], dv[V / 8][4], hk[K / 8][4], dq[K / 16][4];
    uint32_t pa[4][4], dsa[4][4];
    const KfPos pos{h, ch, kc, sbk, odd_keys, last, last_sb, n1, seq_tok0, tokk0, n_last, nit};
    KfTile<T, K, kGate, kFuse> tile(p, mp, cta, pos, s, dp, dv, hk, pa, dsa, dq);
    tile.begin();
    tile.pass1();
    tile.pass2();

    // dks (h at the own superblock's end) and the far part of dv, this warp's 16 keys (rows of full chunks); here,
    // not a KfTile member (as one, ptxas compiled its branches otherwise: 4180 instructions, not 4400, at K = 128).
    // p.far_half: the keys of an even half took their adjacent superblock's part in the launch before.
    const bool dv_add = p.far_half > 0 && !odd_keys;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t row = (tokk0 + 16 * warp + g + 8 * hr) * p.H + h;
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) {
        *reinterpret_cast<float2*>((odd_keys ? p.far1_dks : p.dks) + row * K + 8 * nt + 2 * t4) =
            make_float2(hk[nt][2 * hr], hk[nt][2 * hr + 1]);
        float2* dvr = reinterpret_cast<float2*>(p.dvk + row * V + 8 * nt + 2 * t4);
        const float2 x = make_float2(dv[nt][2 * hr], dv[nt][2 * hr + 1]);
        // dvk is dvdiag (MHA): added to bwd_q's diagonal part without waiting for it (a reduction, no load; the
        // one add to each element, so the result is deterministic). kFuse runs before bwd_q's last launch, which
        // adds its part to this one.
        if (!kFuse && p.dvk_merged()) {
          atomicAdd(dvr, x);
        } else if (dv_add) {
          const float2 o = *dvr;
          *dvr = make_float2(o.x + x.x, o.y + x.y);
        } else {
          *dvr = x;
        }
      }
    }
  }
  if constexpr (kFuse) {
    if ((threadIdx.x & 127) == 0) bulk_wait<0, false>();  // dq's last reductions done before the CTA's memory goes
  }
#endif
}

template <typename T, int K>
cudaError_t far_t(const KernelParams& p, const KfMaps& mp, int nitems, int grid, cudaStream_t s) {
  if (p.kfuse && p.gate)
    return launch_with_smem(bwd_k_far_kernel<T, K, true, true>, dim3(unsigned(grid)), kKfThreads,
                            KfSmem<K, true>::bytes, s, p, mp, nitems);
  if (p.kfuse)
    return launch_with_smem(bwd_k_far_kernel<T, K, false, true>, dim3(unsigned(grid)), kKfThreads,
                            KfSmem<K, true>::bytes, s, p, mp, nitems);
  if (p.gate)
    return launch_with_smem(bwd_k_far_kernel<T, K, true, false>, dim3(unsigned(grid)), kKfThreads,
                            KfSmem<K, false>::bytes, s, p, mp, nitems);
  return launch_with_smem(bwd_k_far_kernel<T, K, false, false>, dim3(unsigned(grid)), kKfThreads,
                          KfSmem<K, false>::bytes, s, p, mp, nitems);
}

}  // namespace

bool bwd_k_far_usable(const KernelParams& p) {
  if (!p.path || (p.gate && !p.dgq) || p.K != p.V || (p.K != 64 && p.K != 128)) return false;
  if (!tma_aligned(p.v, p.v_s) || !tma_aligned(p.dout, p.do_s)) return false;
  if (int64_t(p.B) * p.T >= (int64_t(1) << 31) || int64_t(p.B) * p.T * p.HQ * p.K >= (int64_t(1) << 40)) return false;
  return far_device_ok(KfSmem<128, false>::bytes);
}

bool bwd_k_far_fusable(const KernelParams& p) {
  if (p.deterministic || !bwd_k_far_usable(p) || !far_device_ok(KfSmem<128, true>::bytes)) return false;
  // dq's paired-row map overlaps two of its dimensions: where a driver would refuse to encode it, the two far
  // kernels run instead. Encoding only checks the parameters: v's address (16-byte aligned, as usable checked)
  // stands in for dqt's, not allocated yet.
  CUtensorMap probe;
  return map_tokens_paired(&probe, static_cast<const float*>(p.v), p.K, p.HQ, int64_t(p.B) * p.T);
}


size_t bwd_k_far_park_elems(int64_t park_slots, int K) { return size_t(park_slots) * kKfKeys * K; }

cudaError_t launch_bwd_k_far(const KernelParams& p, const int32_t* tiles, int ntiles, float2* lsd,
                             const int32_t* park_first, int64_t park_slots, int grid, int* next, int dtype,
                             cudaStream_t s) {
  if (ntiles == 0) return cudaSuccess;
  const CUtensorMapDataType dt = dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  KfMaps mp{};
  mp.tiles = tiles;
  mp.next = next;
  mp.lsd = lsd;
  mp.park_first = park_first;
  const int64_t NT = int64_t(p.B) * p.T;
  if (!map_tokens(&mp.ks, dt, p.ks, p.K, p.H, NT, kKfKeys) ||
      !map_bthd(&mp.v, dt, p.v, p.v_s, p.V, p.H, p.T, p.B, kKfKeys) ||
      !map_matrix(&mp.park, dt, p.scratch, p.K, park_slots * kKfKeys, kKfKeys) ||
      !map_tokens(&mp.qhat, dt, p.qhat, p.K, p.HQ, NT, kChunk) ||
      !map_bthd(&mp.dout, dt, p.dout, p.do_s, p.V, p.HQ, p.T, p.B, kChunk) ||
      !map_matrix(&mp.ps, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p.ps, p.K, int64_t(p.nsuper) * p.H * p.K, p.K) ||
      (p.kfuse && !map_tokens_paired(&mp.dqt, p.dqt, p.K, p.HQ, NT)))
    return cudaErrorInvalidValue;
  mp.ks1 = mp.ks;
  mp.qhat1 = mp.qhat;
  mp.dqt1 = mp.dqt;
  if (p.far_half > 0 && (!map_tokens(&mp.ks1, dt, p.far1_ks, p.K, p.H, NT, kKfKeys) ||
                         !map_tokens(&mp.qhat1, dt, p.far1_qhat, p.K, p.HQ, NT, kChunk) ||
                         !map_tokens_paired(&mp.dqt1, p.far1_dqt, p.K, p.HQ, NT)))
    return cudaErrorInvalidValue;
  const int nitems = ntiles * p.H;
  if (dtype == 0) return p.K == 64 ? far_t<__half, 64>(p, mp, nitems, grid, s) : far_t<__half, 128>(p, mp, nitems, grid, s);
  return p.K == 64 ? far_t<__nv_bfloat16, 64>(p, mp, nitems, grid, s)
                   : far_t<__nv_bfloat16, 128>(p, mp, nitems, grid, s);
}

}  // namespace pathattn::cuda
