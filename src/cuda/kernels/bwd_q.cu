// cuda/kernels/bwd_q.cu: the query-side backward pass. Per (query chunk qc, query head), two-level as the forward:
//   pass 1 (right to left) recomputes qt_kc, the queries moved to the end of key chunk kc, for the chunks of
//          the query's own superblock, then qhat (queries at their superblock's start, written for the key
//          side) and qt_sb at the end of every earlier superblock sb (dense PS steps); all parked (fp16) in
//          this CTA's scratch (scratch_slots x C x K per CTA, persistent grid: linear in T);
//   diagonal: P from A_loc and lse, dA_loc = scale dS (written over A_loc), dv_diag = P^T dO, gate terms;
//   pass 2 (left to right) runs the transport adjoint: over far superblocks, gbar <- gbar PS_sb^T with
//          dPS_sb += qt_sb^T gbar, plus scale dS ks for the superblock's keys (moved to its end); then over
//          the own superblock's chunks, dP_kc += qt_kc^T gbar, gbar <- gbar P_kc^T, plus scale dS k~;
//          finally dq~ = gbar. The chains take gbar in fp16 with each row scaled by a power of two (gradients can
//          be far below fp16's range: warp_chunk_step), dP / dPS in fp16 with one power of two for the tile.
// With p.qfar (bwd_q_far.cu does the far superblocks on Hopper) it runs twice: qfar = 1 writes qhat and stops;
// qfar = 2 (after bwd_q_far) parks only the own superblock's states and starts pass 2's chain there from dqt.
// With p.kfuse bwd_k_far takes bwd_q_far's part (dq into dqt, zeroed here by the qhat launch), between the two.
// The last launch is the last reader of qtl (fp16): once a warp has read its rows it leaves q~ there in the input
// type, which bwd_k loads by cp.async as its score operand.
// dP / dPS are per-(chunk / superblock, kv head) K x K sums over query chunks and heads: fp32 reductions, or,
// in deterministic mode, plain adds in the order of the items (a ticket per sum: an item waits until every
// earlier item adding into the same sum has added; the grid is persistent and takes items in order, so the
// earliest unfinished item never waits).
// gbar lives in registers (a warp's 16 query rows, C layout; the chain steps take it as the A operand through
// warp_chunk_step / warp_ps_step) and is staged in shared memory only for the dP / dPS outer products, which sum
// over all rows;
// the staging tile lies over the key / value tiles (free at the outer products), the diagonal's dS tile over
// W / W2, and the query snapshot is converted to the input type in place after its outer product: about
// 106 KB of shared memory at K = V = 128, two CTAs per SM. At K = V = 64 two more tiles (55 -> 73 KB, still three
// CTAs per SM) let the own superblock's pass 2 load each step's query snapshot during the step before and its keys,
// values, W and W2 under its outer product (BwdQSmem::pf).
#include "cuda/device/common.cuh"
#include "cuda/kernels/bwd_q_item.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

template <typename T, int K, int V, bool kDetCols, bool kPlain>
__global__ void __launch_bounds__(kBwdThreads, K == 64 ? 3 : 2) bwd_q_kernel(KernelParams p, int nitems,
                                                                             int* next_item) {
  extern __shared__ __align__(16) uint8_t smem[];
  BwdQ<T, K, V, kDetCols, kPlain> w;
  w.carve(smem);
  __half* scratch = p.scratch + size_t(blockIdx.x) * p.scratch_slots * kChunk * K;
  // Items (most work first) are started in order from a counter as CTAs free up: a slice of one kv head has a
  // few items a CTA, of unequal work, which a fixed stride over the grid balances badly. In deterministic mode
  // the counter follows the tickets, and the order is what keeps them from deadlocking: the earliest unfinished
  // item has started on a resident CTA and waits for nobody, whatever number of this grid's CTAs the device
  // holds at once.
  __shared__ int next;
  int* counter = p.deterministic ? p.tickets + int64_t(p.nchunks + p.nsuper) * p.H : next_item;
  for (;;) {
    const int it = take_item(counter, &next, 0);
    if (it >= nitems) return;
    w.run(p, p.order[it / p.HQ], it % p.HQ, scratch);
  }
}

template <typename T, int K, int V, bool kDetCols = false, bool kPlain = false>
cudaError_t set_attr() {
  return cudaFuncSetAttribute(bwd_q_kernel<T, K, V, kDetCols, kPlain>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(BwdQSmem<K, V>::bytes));
}

template <typename T, int K, int V, bool kDetCols, bool kPlain>
cudaError_t run_kernel(const KernelParams& p, int grid, int nitems, int* next, cudaStream_t s) {
  cudaError_t e = set_attr<T, K, V, kDetCols, kPlain>();
  if (e != cudaSuccess) return e;
  bwd_q_kernel<T, K, V, kDetCols, kPlain><<<grid, kBwdThreads, BwdQSmem<K, V>::bytes, s>>>(p, nitems, next);
  return cudaGetLastError();
}

template <typename T, int K, int V>
cudaError_t run_t(const KernelParams& p, int grid, int nitems, int* next, cudaStream_t s) {
  const bool det = p.deterministic && p.dgq;
  if (!p.path)
    return det ? run_kernel<T, K, V, true, true>(p, grid, nitems, next, s)
               : run_kernel<T, K, V, false, true>(p, grid, nitems, next, s);
  return det ? run_kernel<T, K, V, true, false>(p, grid, nitems, next, s)
             : run_kernel<T, K, V, false, false>(p, grid, nitems, next, s);
}

// The CTAs of the default variant that fit at once (the ordered variant has the same launch bounds and shared
// memory; a persistent grid larger than what fits would only queue).
template <typename T, int K, int V>
int grid_t() {
  if (set_attr<T, K, V>() != cudaSuccess) return 0;
  int nb = 0, sms = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, bwd_q_kernel<T, K, V, false, false>, kBwdThreads,
                                                BwdQSmem<K, V>::bytes);
  device_attr(cudaDevAttrMultiProcessorCount, &sms);
  return nb * sms;
}

#define PA_DISPATCH_KV(FN, ...)                                                   \
  (p.K == 64 ? (p.V == 64 ? FN<T, 64, 64>(__VA_ARGS__) : FN<T, 64, 128>(__VA_ARGS__)) \
             : (p.V == 64 ? FN<T, 128, 64>(__VA_ARGS__) : FN<T, 128, 128>(__VA_ARGS__)))

template <typename T>
cudaError_t dispatch(const KernelParams& p, int grid, int nitems, int* next, cudaStream_t s) {
  return PA_DISPATCH_KV(run_t, p, grid, nitems, next, s);
}
template <typename T>
int grid_dispatch(const KernelParams& p) {
  return PA_DISPATCH_KV(grid_t);
}

}  // namespace

size_t smem_bwd_q(int K, int V) {
  return K == 64 ? (V == 64 ? BwdQSmem<64, 64>::bytes : BwdQSmem<64, 128>::bytes)
                 : (V == 64 ? BwdQSmem<128, 64>::bytes : BwdQSmem<128, 128>::bytes);
}

cudaError_t launch_bwd_q(const KernelParams& p, int dtype, int grid, int nitems, int* next, cudaStream_t s) {
  return dtype == 0 ? dispatch<__half>(p, grid, nitems, next, s) : dispatch<__nv_bfloat16>(p, grid, nitems, next, s);
}

int bwd_q_max_grid(const KernelParams& p, int dtype) {
  return dtype == 0 ? grid_dispatch<__half>(p) : grid_dispatch<__nv_bfloat16>(p);
}

size_t bwd_q_colscr_elems(int grid, int sc) { return size_t(grid) * colscr_per_cta(sc); }

}  // namespace pathattn::cuda
