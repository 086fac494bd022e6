// cuda/kernels/paged_prefill.cu: prefill into the paged cache (include/pathattn/paged.h): the dense fp32 prefill
// (kernels/decode.cu) into temporaries, then a scatter into the slots' pages; and the host copy the validating
// mode reads the metadata with.
#include <algorithm>
#include <vector>

#include "cuda/kernels/paged_common.cuh"

namespace pathattn::cuda {
namespace {

// ------------------------------------------------------------------------------------------------------
// Prefill's scatter: grid (num_seqs * H), the dense fp32 prefill's rows of sequence i into slot slots[i]'s pages.
struct ScatterArgs {
  const float *kc, *vc;
  const double* gc;
  int64_t kc_s[3], vc_s[3], gc_s[3];
  const int2* seqs;  // (slot, length)
};

template <typename KT, typename VT>
__global__ void paged_scatter_kernel(PagedArgs a, ScatterArgs s) {
  const int i = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int n = s.seqs[i].x, len = s.seqs[i].y;
  for (int64_t x = threadIdx.x; x < int64_t(len) * a.K; x += blockDim.x) {
    const int64_t j = x / a.K, e = x % a.K;
    key_row<KT>(a, n, h, j)[e] = from_f<KT>(s.kc[i * s.kc_s[0] + h * s.kc_s[1] + j * s.kc_s[2] + e]);
  }
  for (int64_t x = threadIdx.x; x < int64_t(len) * a.V; x += blockDim.x) {
    const int64_t j = x / a.V, e = x % a.V;
    value_row<VT>(a, n, h, j)[e] = from_f<VT>(s.vc[i * s.vc_s[0] + h * s.vc_s[1] + j * s.vc_s[2] + e]);
  }
  if (a.gate) {
    for (int64_t x = threadIdx.x; x < int64_t(len) * a.G; x += blockDim.x) {
      const int64_t j = x / a.G;
      const int hq = h * a.G + int(x % a.G);
      *gate_cell(a, n, hq, j) = s.gc[i * s.gc_s[0] + hq * s.gc_s[1] + j * s.gc_s[2]];
    }
  }
  if (h == 0 && threadIdx.x == 0) {
    a.len[n] = len;
    a.fl[n] = len;
  }
}

}  // namespace

Status copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  PA_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  PA_CU(cudaStreamSynchronize(s));
  return Status::Ok();
}
// Sequences go through the dense prefill's walk in groups whose fp32 temporaries stay under this many bytes (at
// least one sequence a group), so a prefill's extra memory stays bounded whatever the batch; the forward runs once.
constexpr int64_t kPrefillTempBytes = int64_t(512) << 20;

Status paged_prefill(const PathPagedPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs,
                     const std::vector<int32_t>& slots) {
  PA_TRY(check_paged_support(pr, p.fwd.q, p.cache));
  cudaStream_t s = static_cast<cudaStream_t>(p.fwd.stream);
  if (!pr.seqs.empty()) PA_TRY(fwd(p.fwd, pr));  // o and lse, once for every sequence
  core::Problem walk = pr;
  walk.seqs.clear();  // the dense prefill below then fills its cache only (kernels/decode.cu)
  PagedArgs a{};
  fill_cache_args(p.cache, pr, &a);
  const bool f16 = p.cache.k_pages.dtype == DType::f16, vh = p.fwd.v.dtype == DType::f16;
  const int64_t per_row = pr.H * (pr.K + pr.V) * 4 + (pr.gate ? pr.HQ * 8 : 0);  // temporary bytes a token
  for (size_t g0 = 0; g0 < seqs.size();) {
    size_t g1 = g0;
    int64_t C = 1;
    while (g1 < seqs.size() &&
           (g1 == g0 || int64_t(g1 + 1 - g0) * std::max(C, seqs[g1].len) * per_row <= kPrefillTempBytes)) {
      C = std::max(C, seqs[g1].len);
      ++g1;
    }
    const std::vector<core::Seq> group(seqs.begin() + g0, seqs.begin() + g1);
    const int64_t ng = int64_t(group.size());
    Workspace ws(s);
    float *kc = nullptr, *vc = nullptr;
    double* gc = nullptr;
    PA_CU(ws.alloc(&kc, size_t(ng * pr.H * C * pr.K)));
    PA_CU(ws.alloc(&vc, size_t(ng * pr.H * C * pr.V)));
    if (pr.gate) PA_CU(ws.alloc(&gc, size_t(ng * pr.HQ * C)));
    std::vector<int64_t> host_len(size_t(ng), 0);
    PathPrefillParams d;
    d.fwd = p.fwd;
    d.cache.kc = make_view(kc, DType::f32, {ng, pr.H, C, pr.K}, Device::cuda);
    d.cache.vc = make_view(vc, DType::f32, {ng, pr.H, C, pr.V}, Device::cuda);
    if (pr.gate) d.cache.gc = make_view(gc, DType::f64, {ng, pr.HQ, C}, Device::cuda);
    d.cache.lengths = make_view(host_len.data(), DType::i64, {ng});
    PA_TRY(prefill(d, walk, group));
    ScatterArgs sa{};
    sa.kc = kc;
    sa.vc = vc;
    sa.gc = gc;
    strides3(d.cache.kc, sa.kc_s);
    strides3(d.cache.vc, sa.vc_s);
    if (pr.gate) strides3(d.cache.gc, sa.gc_s);
    std::vector<int2> table(static_cast<size_t>(ng));
    for (int64_t i = 0; i < ng; ++i) table[size_t(i)] = make_int2(slots[g0 + size_t(i)], int(group[size_t(i)].len));
    int2* dseqs = nullptr;
    PA_CU(ws.alloc(&dseqs, table.size()));
    PA_CU(ws.upload(dseqs, table.data(), table.size() * sizeof(int2)));
    sa.seqs = dseqs;
    const unsigned grid = unsigned(ng * pr.H);
    if (f16 && vh) paged_scatter_kernel<__half, __half><<<grid, 256, 0, s>>>(a, sa);
    else if (f16) paged_scatter_kernel<__half, __nv_bfloat16><<<grid, 256, 0, s>>>(a, sa);
    else if (vh) paged_scatter_kernel<float, __half><<<grid, 256, 0, s>>>(a, sa);
    else paged_scatter_kernel<float, __nv_bfloat16><<<grid, 256, 0, s>>>(a, sa);
    PA_CU(cudaGetLastError());
    // The host copy of the (slot, length) table must outlive the upload: wait for it.
    PA_CU(cudaStreamSynchronize(s));
    g0 = g1;
  }
  return Status::Ok();
}

}  // namespace pathattn::cuda
