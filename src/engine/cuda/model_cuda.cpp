// engine/cuda/model_cuda.cpp: forward, backward and AdamW of the engine's model on a CUDA device
// (engine/cuda/model_cuda.h). The sequence of layer calls is engine/model.cpp's, call for call, with each
// ops.h function replaced by its engine/cuda/kernels.h twin and the attention op called with CUDA views.
// Everything runs on one stream owned by the model; the host waits only for the step's loss and grad norm.
//
// Head dims other than 64 and 128: the attention op sees every head zero-padded to Kp = cuda_attn_head_dim(K).
// This is exact. The padded coordinates of q, k, v and w are zero, so q.k and w.w are unchanged and each PaTH
// factor H_t = I - beta_t w_t w_t^T is block diagonal (the K x K factor of the unpadded model, the identity on
// the padded coordinates): q_i^T (H_i ... H_{j+1}) k_j is the unpadded logit. The padded columns of v are zero,
// so those of o are zero; their gradients (and those of q, k, w) are dropped. The scale 1 / sqrt(K) is passed
// explicitly (the op's default would be 1 / sqrt(Kp)), and gate_scale with it: the CPU engine's default.
// The padding happens inside the conversions that exist anyway (to_bf16_padded / from_bf16_padded, and
// l2norm_fwd / l2norm_bwd read and write w, dw with rows Kp apart), so it costs no extra pass; with K = Kp
// those are the unpadded calls, bit for bit.
#include "engine/cuda/model_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/cuda/kernels.h"
#include "pathattn/attention.h"

namespace pathattn::engine {

using gpu::check;

namespace {

// A device array that grows on demand (contents are not kept when it grows). Activations are sized by the
// batch's row count N = B * T and reused across steps.
template <typename T>
class DevBuf {
 public:
  DevBuf() = default;
  ~DevBuf() {
    if (p_) cudaFree(p_);
  }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), cap_(o.cap_) {
    o.p_ = nullptr;
    o.cap_ = 0;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf& operator=(DevBuf&&) = delete;
  void ensure(int64_t n) {
    if (n <= cap_) return;
    if (p_) check(cudaFree(p_), "cudaFree");
    p_ = nullptr;
    cap_ = 0;
    check(cudaMalloc(&p_, size_t(n) * sizeof(T)), "cudaMalloc (engine activations)");
    cap_ = n;
  }
  T* get() const { return p_; }
  operator T*() const { return p_; }

 private:
  T* p_ = nullptr;
  int64_t cap_ = 0;
};

using bf16 = __nv_bfloat16;

}  // namespace

void check_cuda_model(const ModelConfig& cfg) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    throw EngineError(std::string("train.device = \"cuda\": no CUDA device is visible (") +
                      (e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none") + ")");
  const int K = cfg.K();
  if (K < 1 || K > kCudaMaxHeadDim) {
    const std::string why = cfg.head_dim > 0 ? "model.head_dim = " + std::to_string(cfg.head_dim)
                                             : "model.head_dim = 0: d_model / n_head = " + std::to_string(cfg.d_model) +
                                                   " / " + std::to_string(cfg.n_head);
    throw EngineError("model.head_dim: the CUDA device supports head dims 1.." + std::to_string(kCudaMaxHeadDim) +
                      "; this model's is " + std::to_string(K) + " (" + why +
                      "). Train it with train.device = \"cpu\" or use more heads");
  }
}

struct CudaModel::Impl {
  struct LayerActs {
    DevBuf<float> x, ln1, rstd1, wlr, wraw, wc, w, wrinv, beta, g, o, lse, xmid, ln2, rstd2, h, m;
    DevBuf<bf16> qb, kb, vb, ob;
  };

  ModelConfig cfg;
  int64_t Kp = 0;  // the attention op's head dim: cuda_attn_head_dim(cfg.K()), equal to K for 64 and 128
  std::vector<ParamInfo> layout;
  ParamOffsets po;
  int64_t total = 0;
  cudaStream_t s = nullptr;
  gpu::Blas blas;

  DevBuf<float> params, grads, adam_m, adam_v;
  int64_t adam_t = 0;

  std::vector<LayerActs> acts;
  DevBuf<float> xfinal, lnf, rstdf, logits;
  DevBuf<int32_t> tok, tgt, rows, start, hit, pred;
  DevBuf<double> loss_row, sums, norm_partial, norm_out;
  // Scratch shared by the layers (forward: fp32 q, k, v before conversion, the conv output, a projection;
  // backward: every gradient of one layer). What the attention op reads or writes (qb, kb, vb, ob, w of the
  // layers; dOb, dqb, dkb, dvb, dw here) has head rows of Kp, every other per-head array rows of K.
  DevBuf<float> q, k, v, ws, tmp, dlogits, dlnf, dx, dm, dh, dln, dO, dq, dk, dv, dw, dbeta, dg, dws, dwraw, dwlr, dz;
  DevBuf<bf16> dOb, dqb, dkb, dvb;
  int64_t nb = 0, nt = 0, count = 0;

  // Sizes every activation buffer for N = B * T rows.
  void ensure(int64_t N) {
    const int64_t C = cfg.d_model, HQ = cfg.n_head, H = cfg.H(), K = cfg.K(), F = cfg.F(), Vc = cfg.vocab_size;
    const int64_t R = cfg.w_rank;
    const bool path = attn_has_path(cfg.attn), gate = attn_has_gate(cfg.attn);
    for (LayerActs& a : acts) {
      for (DevBuf<float>* b : {&a.x, &a.ln1, &a.xmid, &a.ln2}) b->ensure(N * C);
      a.rstd1.ensure(N);
      a.rstd2.ensure(N);
      a.qb.ensure(N * HQ * Kp);
      a.kb.ensure(N * H * Kp);
      a.vb.ensure(N * H * Kp);
      a.ob.ensure(N * HQ * Kp);
      a.o.ensure(N * HQ * K);
      a.lse.ensure(N * HQ);
      a.h.ensure(N * 2 * F);
      a.m.ensure(N * F);
      if (path) {
        if (R > 0) a.wlr.ensure(N * R);
        for (DevBuf<float>* b : {&a.wraw, &a.wc}) b->ensure(N * H * K);
        a.w.ensure(N * H * Kp);
        a.wrinv.ensure(N * H);
        a.beta.ensure(N * H);
      }
      if (gate) a.g.ensure(N * HQ);
    }
    for (DevBuf<float>* b : {&xfinal, &lnf, &tmp, &dlnf, &dx, &dln}) b->ensure(N * C);
    rstdf.ensure(N);
    logits.ensure(N * Vc);
    dlogits.ensure(N * Vc);
    for (DevBuf<int32_t>* b : {&tok, &tgt, &rows, &hit, &pred}) b->ensure(N);
    start.ensure(Vc + 1);
    loss_row.ensure(N);
    q.ensure(N * HQ * K);
    dO.ensure(N * HQ * K);
    dq.ensure(N * HQ * K);
    for (DevBuf<float>* b : {&k, &v, &dk, &dv}) b->ensure(N * H * K);
    dOb.ensure(N * HQ * Kp);
    dqb.ensure(N * HQ * Kp);
    dkb.ensure(N * H * Kp);
    dvb.ensure(N * H * Kp);
    dm.ensure(N * F);
    dh.ensure(N * 2 * F);
    if (path) {
      for (DevBuf<float>* b : {&ws, &dws, &dwraw}) b->ensure(N * H * K);
      dw.ensure(N * H * Kp);
      dbeta.ensure(N * H);
      if (R > 0) dwlr.ensure(N * R);
    }
    if (gate) dg.ensure(N * HQ);
    dz.ensure(N * std::max(H, HQ));
  }

  TensorView view(void* p, DType dt, std::initializer_list<int64_t> shape) const {
    return make_view(p, dt, shape, Device::cuda);
  }

  // The attention call on head rows of Kp (q, k, v, w zero-padded by the conversions before it), with the
  // scales of the true head dim; the backward's parameters follow from it (bwd_params_for).
  PathFwdParams attention_params(const LayerActs& a, int64_t B, int64_t T_) const {
    const int64_t HQ = cfg.n_head, H = cfg.H();
    PathFwdParams p;
    p.scale = 1.0 / std::sqrt(double(cfg.K()));  // the true head dim's (the op's default, bit for bit, at K = Kp)
    p.gate_scale = p.scale;                        // the op's default, which the CPU engine uses
    p.q = view(a.qb, DType::bf16, {B, T_, HQ, Kp});
    p.k = view(a.kb, DType::bf16, {B, T_, H, Kp});
    p.v = view(a.vb, DType::bf16, {B, T_, H, Kp});
    if (attn_has_path(cfg.attn)) {
      p.w = view(a.w, DType::f32, {B, T_, H, Kp});
      p.beta = view(a.beta, DType::f32, {B, T_, H});
    }
    if (attn_has_gate(cfg.attn)) p.g = view(a.g, DType::f32, {B, T_, HQ});
    p.o = view(a.ob, DType::bf16, {B, T_, HQ, Kp});
    p.lse = view(a.lse, DType::f32, {B, T_, HQ});
    p.backend = Backend::cuda;
    p.stream = s;
    return p;
  }

  void attention_fwd(LayerActs& a, int64_t B, int64_t T_) {
    const Status st = path_attn_fwd(attention_params(a, B, T_));
    if (!st.ok()) throw EngineError("attention forward (backend cuda): " + st.message());
  }

  void attention_bwd(LayerActs& a, int64_t B, int64_t T_) {
    const int64_t HQ = cfg.n_head, H = cfg.H();
    PathBwdParams p = bwd_params_for(attention_params(a, B, T_));
    p.do_ = view(dOb, DType::bf16, {B, T_, HQ, Kp});
    p.dq = view(dqb, DType::bf16, {B, T_, HQ, Kp});
    p.dk = view(dkb, DType::bf16, {B, T_, H, Kp});
    p.dv = view(dvb, DType::bf16, {B, T_, H, Kp});
    if (attn_has_path(cfg.attn)) {
      p.dw = view(dw, DType::f32, {B, T_, H, Kp});
      p.dbeta = view(dbeta, DType::f32, {B, T_, H});
    }
    if (attn_has_gate(cfg.attn)) p.dg = view(dg, DType::f32, {B, T_, HQ});
    p.deterministic = true;  // bitwise-reproducible gradients: CUDA runs resume exactly
    const Status st = path_attn_bwd(p);
    if (!st.ok()) throw EngineError("attention backward (backend cuda): " + st.message());
  }

  void sync() { check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }
};

CudaModel::CudaModel(const ModelConfig& cfg, const std::string& matmul) : impl_(std::make_unique<Impl>()) {
  check_cuda_model(cfg);
  Impl& I = *impl_;
  I.cfg = cfg;
  I.Kp = cuda_attn_head_dim(cfg.K());
  I.layout = param_layout(cfg);
  I.po = param_offsets(cfg, I.layout);
  I.total = I.layout.back().offset + I.layout.back().numel;
  check(cudaStreamCreateWithFlags(&I.s, cudaStreamNonBlocking), "cudaStreamCreate");
  if (matmul != "fp32" && matmul != "tf32" && matmul != "bf16")
    throw EngineError("train.matmul: expected fp32, tf32 or bf16, got " + matmul);
  check(cublasCreate(&I.blas.h), "cublasCreate");
  check(cublasSetStream(I.blas.h, I.s), "cublasSetStream");
  // Pinned explicitly: plain fp32 GEMMs unless the config asks for tensor cores.
  check(cublasSetMathMode(I.blas.h, matmul == "tf32" ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  if (matmul == "bf16") I.blas.precision = gpu::GemmPrecision::bf16;
  for (DevBuf<float>* b : {&I.params, &I.grads, &I.adam_m, &I.adam_v}) {
    b->ensure(I.total);
    check(cudaMemsetAsync(b->get(), 0, size_t(I.total) * sizeof(float), I.s), "cudaMemset");
  }
  I.sums.ensure(2);
  I.norm_partial.ensure(gpu::kNormBlocks);
  I.norm_out.ensure(1);
  I.acts.resize(size_t(cfg.n_layer));
  I.sync();
}

CudaModel::~CudaModel() {
  if (!impl_) return;
  cudaStreamSynchronize(impl_->s);
  if (impl_->blas.h) cublasDestroy(impl_->blas.h);
  if (impl_->s) cudaStreamDestroy(impl_->s);
}

const ModelConfig& CudaModel::config() const { return impl_->cfg; }

StepStats CudaModel::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T_, int32_t* pred) {
  Impl& I = *impl_;
  const ModelConfig& cfg = I.cfg;
  const int64_t N = B * T_, C = cfg.d_model, HQ = cfg.n_head, H = cfg.H(), K = cfg.K(), F = cfg.F();
  const int64_t Vc = cfg.vocab_size, R = cfg.w_rank, Kp = I.Kp;
  const bool path = attn_has_path(cfg.attn), gate = attn_has_gate(cfg.attn);
  for (int64_t n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= Vc)
      throw EngineError("model input: token id " + std::to_string(tokens[n]) + " outside the vocab [0, " +
                        std::to_string(Vc) + ")");
  I.nb = B;
  I.nt = T_;
  I.ensure(N);
  const cudaStream_t s = I.s;
  const gpu::Blas& h = I.blas;
  std::vector<int32_t> tg(size_t(N), -1), rows, start;
  if (targets) std::copy(targets, targets + N, tg.begin());
  int64_t count = 0;
  for (int32_t t : tg) count += t >= 0 ? 1 : 0;
  gpu::token_rows(tokens, N, Vc, &rows, &start);
  check(cudaMemcpyAsync(I.tok, tokens, size_t(N) * 4, cudaMemcpyHostToDevice, s), "copy tokens");
  check(cudaMemcpyAsync(I.tgt, tg.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s), "copy targets");
  check(cudaMemcpyAsync(I.rows, rows.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s), "copy token rows");
  check(cudaMemcpyAsync(I.start, start.data(), size_t(Vc + 1) * 4, cudaMemcpyHostToDevice, s), "copy token rows");
  const float* P = I.params;

  gpu::embedding_fwd(I.tok, P + I.po.wte, I.acts[0].x, N, C, s);
  for (int l = 0; l < cfg.n_layer; ++l) {
    Impl::LayerActs& a = I.acts[size_t(l)];
    const BlockOffsets& o = I.po.blocks[size_t(l)];
    gpu::rmsnorm_fwd(a.x, P + o.ln1, a.ln1, a.rstd1, N, C, cfg.norm_eps, s);
    gpu::linear_fwd(h, s, a.ln1, P + o.wq, nullptr, I.q, N, C, HQ * K);
    gpu::linear_fwd(h, s, a.ln1, P + o.wk, nullptr, I.k, N, C, H * K);
    gpu::linear_fwd(h, s, a.ln1, P + o.wv, nullptr, I.v, N, C, H * K);
    if (cfg.attn == AttnKind::rope) {
      gpu::rope_apply(I.q, N, T_, HQ, K, cfg.rope_theta, false, s);
      gpu::rope_apply(I.k, N, T_, H, K, cfg.rope_theta, false, s);
    }
    gpu::to_bf16_padded(I.q, a.qb, N * HQ, K, Kp, s);
    gpu::to_bf16_padded(I.k, a.kb, N * H, K, Kp, s);
    gpu::to_bf16_padded(I.v, a.vb, N * H, K, Kp, s);
    if (path) {
      if (R > 0) {
        gpu::linear_fwd(h, s, a.ln1, P + o.ww1, nullptr, a.wlr, N, C, R);
        gpu::linear_fwd(h, s, a.wlr, P + o.ww2, nullptr, a.wraw, N, R, H * K);
      } else {
        gpu::linear_fwd(h, s, a.ln1, P + o.ww1, nullptr, a.wraw, N, C, H * K);
      }
      gpu::conv3_silu_fwd(a.wraw, P + o.wconv, a.wc, I.ws, N, T_, H * K, s);
      gpu::l2norm_fwd(I.ws, a.w, a.wrinv, N, H, K, 1e-6, s, Kp);
      gpu::linear_fwd(h, s, a.ln1, P + o.wb, P + o.bb, a.beta, N, C, H);
      gpu::beta_fwd(a.beta, a.beta, N * H, s);
    }
    if (gate) {
      gpu::linear_fwd(h, s, a.ln1, P + o.wg, P + o.bg, a.g, N, C, HQ);
      gpu::logsigmoid_fwd(a.g, a.g, N * HQ, s);
    }
    I.attention_fwd(a, B, T_);
    gpu::from_bf16_padded(a.ob, a.o, N * HQ, K, Kp, s);
    gpu::linear_fwd(h, s, a.o, P + o.wo, nullptr, I.tmp, N, HQ * K, C);
    gpu::add(a.x, I.tmp, a.xmid, N * C, s);
    gpu::rmsnorm_fwd(a.xmid, P + o.ln2, a.ln2, a.rstd2, N, C, cfg.norm_eps, s);
    gpu::linear_fwd(h, s, a.ln2, P + o.wfc, nullptr, a.h, N, C, 2 * F);
    gpu::swiglu_fwd(a.h, a.m, N, F, s);
    gpu::linear_fwd(h, s, a.m, P + o.wproj, nullptr, I.tmp, N, F, C);
    float* next = l + 1 < cfg.n_layer ? I.acts[size_t(l) + 1].x.get() : I.xfinal.get();
    gpu::add(a.xmid, I.tmp, next, N * C, s);
  }
  gpu::rmsnorm_fwd(I.xfinal, P + I.po.lnf, I.lnf, I.rstdf, N, C, cfg.norm_eps, s);
  if (cfg.tie_embeddings)
    gpu::gemm(h, false, true, N, Vc, C, 1.0f, I.lnf, C, P + I.po.wte, C, 0.0f, I.logits, Vc);
  else
    gpu::linear_fwd(h, s, I.lnf, P + I.po.head, nullptr, I.logits, N, C, Vc);
  gpu::cross_entropy_fwd(I.logits, I.tgt, I.loss_row, I.hit, pred ? I.pred.get() : nullptr, N, Vc, s);
  gpu::cross_entropy_sum(I.loss_row, I.hit, I.sums, N, s);
  double sums[2] = {0, 0};
  check(cudaMemcpyAsync(sums, I.sums, sizeof sums, cudaMemcpyDeviceToHost, s), "copy loss");
  if (pred) check(cudaMemcpyAsync(pred, I.pred, size_t(N) * 4, cudaMemcpyDeviceToHost, s), "copy predictions");
  I.sync();
  I.count = count;
  StepStats st;
  st.count = count;
  st.correct = int64_t(sums[1]);
  st.loss = count > 0 ? sums[0] / double(count) : 0.0;
  return st;
}

void CudaModel::backward() {
  Impl& I = *impl_;
  const ModelConfig& cfg = I.cfg;
  const int64_t B = I.nb, T_ = I.nt, N = B * T_, C = cfg.d_model, HQ = cfg.n_head, H = cfg.H(), K = cfg.K();
  const int64_t F = cfg.F(), Vc = cfg.vocab_size, R = cfg.w_rank, Kp = I.Kp;
  const bool path = attn_has_path(cfg.attn), gate = attn_has_gate(cfg.attn);
  if (I.count == 0) return;  // no counted row: the loss is the constant 0
  const cudaStream_t s = I.s;
  const gpu::Blas& h = I.blas;
  const float* P = I.params;
  float* G = I.grads;

  gpu::cross_entropy_bwd(I.logits, I.tgt, I.dlogits, N, Vc, 1.0 / double(I.count), s);
  if (cfg.tie_embeddings) {
    gpu::gemm(h, false, false, N, C, Vc, 1.0f, I.dlogits, Vc, P + I.po.wte, C, 0.0f, I.dlnf, C);
    gpu::gemm(h, true, false, Vc, C, N, 1.0f, I.dlogits, Vc, I.lnf, C, 1.0f, G + I.po.wte, C);
  } else {
    gpu::linear_bwd(h, s, I.lnf, P + I.po.head, I.dlogits, I.dlnf, G + I.po.head, nullptr, N, C, Vc, false);
  }
  gpu::rmsnorm_bwd(I.xfinal, P + I.po.lnf, I.rstdf, I.dlnf, I.dx, G + I.po.lnf, N, C, false, s);

  for (int l = cfg.n_layer - 1; l >= 0; --l) {
    Impl::LayerActs& a = I.acts[size_t(l)];
    const BlockOffsets& o = I.po.blocks[size_t(l)];
    // MLP: x_out = x_mid + m Wproj, m = swiglu(rmsnorm(x_mid) Wfc).
    gpu::linear_bwd(h, s, a.m, P + o.wproj, I.dx, I.dm, G + o.wproj, nullptr, N, F, C, false);
    gpu::swiglu_bwd(a.h, I.dm, I.dh, N, F, s);
    gpu::linear_bwd(h, s, a.ln2, P + o.wfc, I.dh, I.dln, G + o.wfc, nullptr, N, C, 2 * F, false);
    gpu::rmsnorm_bwd(a.xmid, P + o.ln2, a.rstd2, I.dln, I.dx, G + o.ln2, N, C, true, s);
    // Attention: x_mid = x + o Wo.
    gpu::linear_bwd(h, s, a.o, P + o.wo, I.dx, I.dO, G + o.wo, nullptr, N, HQ * K, C, false);
    gpu::to_bf16_padded(I.dO, I.dOb, N * HQ, K, Kp, s);
    I.attention_bwd(a, B, T_);
    gpu::from_bf16_padded(I.dqb, I.dq, N * HQ, K, Kp, s);
    gpu::from_bf16_padded(I.dkb, I.dk, N * H, K, Kp, s);
    gpu::from_bf16_padded(I.dvb, I.dv, N * H, K, Kp, s);
    if (cfg.attn == AttnKind::rope) {
      gpu::rope_apply(I.dq, N, T_, HQ, K, cfg.rope_theta, true, s);
      gpu::rope_apply(I.dk, N, T_, H, K, cfg.rope_theta, true, s);
    }
    gpu::linear_bwd(h, s, a.ln1, P + o.wq, I.dq, I.dln, G + o.wq, nullptr, N, C, HQ * K, false);
    gpu::linear_bwd(h, s, a.ln1, P + o.wk, I.dk, I.dln, G + o.wk, nullptr, N, C, H * K, true);
    gpu::linear_bwd(h, s, a.ln1, P + o.wv, I.dv, I.dln, G + o.wv, nullptr, N, C, H * K, true);
    if (path) {
      gpu::l2norm_bwd(a.w, a.wrinv, I.dw, I.dws, N, H, K, s, Kp);
      gpu::conv3_silu_bwd(a.wraw, P + o.wconv, a.wc, I.dws, I.dwraw, G + o.wconv, N, T_, H * K, s);
      if (R > 0) {
        gpu::linear_bwd(h, s, a.wlr, P + o.ww2, I.dwraw, I.dwlr, G + o.ww2, nullptr, N, R, H * K, false);
        gpu::linear_bwd(h, s, a.ln1, P + o.ww1, I.dwlr, I.dln, G + o.ww1, nullptr, N, C, R, true);
      } else {
        gpu::linear_bwd(h, s, a.ln1, P + o.ww1, I.dwraw, I.dln, G + o.ww1, nullptr, N, C, H * K, true);
      }
      gpu::beta_bwd(a.beta, I.dbeta, I.dz, N * H, s);
      gpu::linear_bwd(h, s, a.ln1, P + o.wb, I.dz, I.dln, G + o.wb, G + o.bb, N, C, H, true);
    }
    if (gate) {
      gpu::logsigmoid_bwd(a.g, I.dg, I.dz, N * HQ, s);
      gpu::linear_bwd(h, s, a.ln1, P + o.wg, I.dz, I.dln, G + o.wg, G + o.bg, N, C, HQ, true);
    }
    gpu::rmsnorm_bwd(a.x, P + o.ln1, a.rstd1, I.dln, I.dx, G + o.ln1, N, C, true, s);
  }
  gpu::embedding_bwd(I.rows, I.start, I.dx, G + I.po.wte, Vc, C, s);
  // Surface asynchronous failures at the step that caused them.
  check(cudaGetLastError(), "backward");
}

void CudaModel::zero_grad() {
  check(cudaMemsetAsync(impl_->grads.get(), 0, size_t(impl_->total) * sizeof(float), impl_->s), "zero_grad");
}

double CudaModel::adam_step(const TrainConfig& c, double lr) {
  Impl& I = *impl_;
  gpu::sumsq(I.grads, I.total, I.norm_partial, I.norm_out, I.s);
  double ss = 0;
  check(cudaMemcpyAsync(&ss, I.norm_out, sizeof ss, cudaMemcpyDeviceToHost, I.s), "copy grad norm");
  I.sync();
  const double norm = std::sqrt(ss);
  // The scalars exactly as AdamW<float>::step forms them (engine/optim.cpp).
  const float gscale = (c.grad_clip > 0 && norm > c.grad_clip) ? float(c.grad_clip / norm) : 1.0f;
  I.adam_t += 1;
  const float b1 = float(c.beta1), b2 = float(c.beta2);
  const float bc1 = float(1.0 - std::pow(c.beta1, double(I.adam_t)));
  const float bc2 = float(1.0 - std::pow(c.beta2, double(I.adam_t)));
  const float tlr = float(lr), eps = float(c.adam_eps);
  for (const ParamInfo& pi : I.layout) {
    const float wd = pi.decay ? float(c.weight_decay) : 0.0f;
    gpu::adamw(I.params.get() + pi.offset, I.grads.get() + pi.offset, I.adam_m.get() + pi.offset,
               I.adam_v.get() + pi.offset, pi.numel, gscale, b1, b2, bc1, bc2, tlr, eps, wd, I.s);
  }
  return norm;
}

void CudaModel::upload(const Model<float>& host, const AdamW<float>* opt) {
  Impl& I = *impl_;
  const size_t bytes = size_t(I.total) * sizeof(float);
  if (int64_t(host.params.size()) != I.total) throw EngineError("CudaModel::upload: host model has another layout");
  check(cudaMemcpyAsync(I.params, host.params.data(), bytes, cudaMemcpyHostToDevice, I.s), "upload parameters");
  if (opt) {
    if (int64_t(opt->m.size()) != I.total || int64_t(opt->v.size()) != I.total)
      throw EngineError("CudaModel::upload: AdamW state has another layout");
    check(cudaMemcpyAsync(I.adam_m, opt->m.data(), bytes, cudaMemcpyHostToDevice, I.s), "upload AdamW m");
    check(cudaMemcpyAsync(I.adam_v, opt->v.data(), bytes, cudaMemcpyHostToDevice, I.s), "upload AdamW v");
    I.adam_t = opt->t;
  }
  I.sync();
}

void CudaModel::download(Model<float>& host, AdamW<float>* opt) const {
  Impl& I = *impl_;
  const size_t bytes = size_t(I.total) * sizeof(float);
  host.params.resize(size_t(I.total));
  check(cudaMemcpyAsync(host.params.data(), I.params, bytes, cudaMemcpyDeviceToHost, I.s), "download parameters");
  if (opt) {
    opt->m.resize(size_t(I.total));
    opt->v.resize(size_t(I.total));
    check(cudaMemcpyAsync(opt->m.data(), I.adam_m, bytes, cudaMemcpyDeviceToHost, I.s), "download AdamW m");
    check(cudaMemcpyAsync(opt->v.data(), I.adam_v, bytes, cudaMemcpyDeviceToHost, I.s), "download AdamW v");
    opt->t = I.adam_t;
  }
  I.sync();
}

std::string CudaModel::device_name() const {
  int dev = 0;
  cudaDeviceProp prop{};
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  return prop.name;
}

std::vector<float> CudaModel::grads() const {
  std::vector<float> g(size_t(impl_->total));
  check(cudaMemcpyAsync(g.data(), impl_->grads, g.size() * sizeof(float), cudaMemcpyDeviceToHost, impl_->s),
        "download gradients");
  impl_->sync();
  return g;
}

std::vector<float> CudaModel::logits() const {
  std::vector<float> l(size_t(impl_->nb * impl_->nt * impl_->cfg.vocab_size));
  if (!l.empty()) {
    check(cudaMemcpyAsync(l.data(), impl_->logits, l.size() * sizeof(float), cudaMemcpyDeviceToHost, impl_->s),
          "download logits");
    impl_->sync();
  }
  return l;
}

}  // namespace pathattn::engine
