// engine/model.cpp: forward and backward of the decoder-only transformer (engine/model.h). Each block:
//   x_mid = x + Wo attn(rmsnorm(x)),  x_out = x_mid + Wproj swiglu(Wfc rmsnorm(x_mid)).
// The attention of a block is the library's op (path_attn_fwd / path_attn_bwd): PaTH / PaTH-FoX with w and
// beta from docs/spec.md, FoX with the gate only, RoPE / NoPE as plain causal attention. Inference:
// prefill (the forward with path_attn_prefill filling a cache per layer) and decode_step (one token, the
// attention by path_attn_decode), sharing the per-token block code with the forward.
#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu/blas.h"
#include "engine/rng.h"
#include "pathattn/attention.h"

namespace pathattn::engine {

std::vector<ParamInfo> param_layout(const ModelConfig& m) {
  std::vector<ParamInfo> L;
  int64_t off = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool decay) {
    ParamInfo p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = 1;
    for (int64_t s : p.shape) p.numel *= s;
    p.offset = off;
    p.decay = decay;
    off += p.numel;
    L.push_back(std::move(p));
  };
  const int64_t C = m.d_model, HQ = m.n_head, H = m.H(), K = m.K(), F = m.F(), Vc = m.vocab_size;
  add("wte", {Vc, C}, true);
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    add(b + "ln1", {C}, false);
    add(b + "attn.wq", {C, HQ * K}, true);
    add(b + "attn.wk", {C, H * K}, true);
    add(b + "attn.wv", {C, H * K}, true);
    add(b + "attn.wo", {HQ * K, C}, true);
    if (attn_has_path(m.attn)) {
      if (m.w_rank > 0) {
        add(b + "attn.ww1", {C, m.w_rank}, true);
        add(b + "attn.ww2", {m.w_rank, H * K}, true);
      } else {
        add(b + "attn.ww", {C, H * K}, true);
      }
      add(b + "attn.wconv", {H * K, 3}, false);
      add(b + "attn.wb", {C, H}, true);
      add(b + "attn.bb", {H}, false);
    }
    if (attn_has_gate(m.attn)) {
      add(b + "attn.wg", {C, HQ}, true);
      add(b + "attn.bg", {HQ}, false);
    }
    add(b + "ln2", {C}, false);
    add(b + "mlp.wfc", {C, 2 * F}, true);
    add(b + "mlp.wproj", {F, C}, true);
  }
  add("lnf", {C}, false);
  if (!m.tie_embeddings) add("lm_head", {C, Vc}, true);
  return L;
}

double train_flops_per_token(const ModelConfig& m, int64_t T) {
  double weights = 0;
  for (const ParamInfo& p : param_layout(m)) {
    const bool matrix = p.shape.size() == 2 && p.name.find("wconv") == std::string::npos;  // the conv is per channel
    const bool lookup_only = p.name == "wte" && !m.tie_embeddings;                        // then lm_head is the head
    if (matrix && !lookup_only) weights += double(p.numel);
  }
  return 6.0 * weights + 6.0 * double(m.n_layer) * double(m.n_head) * double(m.K()) * double(T);
}

ParamOffsets param_offsets(const ModelConfig& m, const std::vector<ParamInfo>& layout) {
  auto off = [&](const std::string& n) -> int64_t {
    for (const auto& p : layout)
      if (p.name == n) return p.offset;
    return -1;
  };
  ParamOffsets po;
  po.wte = off("wte");
  po.lnf = off("lnf");
  po.head = off("lm_head");
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    BlockOffsets o;
    o.ln1 = off(b + "ln1");
    o.wq = off(b + "attn.wq");
    o.wk = off(b + "attn.wk");
    o.wv = off(b + "attn.wv");
    o.wo = off(b + "attn.wo");
    o.ww1 = m.w_rank > 0 ? off(b + "attn.ww1") : off(b + "attn.ww");
    o.ww2 = off(b + "attn.ww2");
    o.wconv = off(b + "attn.wconv");
    o.wb = off(b + "attn.wb");
    o.bb = off(b + "attn.bb");
    o.wg = off(b + "attn.wg");
    o.bg = off(b + "attn.bg");
    o.ln2 = off(b + "ln2");
    o.wfc = off(b + "mlp.wfc");
    o.wproj = off(b + "mlp.wproj");
    po.blocks.push_back(o);
  }
  return po;
}

template <typename T>
Model<T>::Model(const ModelConfig& cfg) : cfg_(cfg), layout_(param_layout(cfg)) {
  const int64_t total = layout_.back().offset + layout_.back().numel;
  params.assign(total, T(0));
  grads.assign(total, T(0));
  const ParamOffsets po = param_offsets(cfg, layout_);
  off_wte_ = po.wte;
  off_lnf_ = po.lnf;
  off_head_ = po.head;
  lo_ = po.blocks;
}

template <typename T>
T* Model<T>::param(const std::string& name) {
  for (const auto& p : layout_)
    if (p.name == name) return params.data() + p.offset;
  return nullptr;
}

template <typename T>
T* Model<T>::grad(const std::string& name) {
  for (const auto& p : layout_)
    if (p.name == name) return grads.data() + p.offset;
  return nullptr;
}

template <typename T>
void Model<T>::init(uint64_t seed) {
  Rng rng(seed);
  const double resid_scale = 1.0 / std::sqrt(2.0 * cfg_.n_layer);
  for (const auto& p : layout_) {
    T* x = params.data() + p.offset;
    const std::string& n = p.name;
    auto ends = [&](const char* s) {
      const std::string t(s);
      return n.size() >= t.size() && n.compare(n.size() - t.size(), t.size(), t) == 0;
    };
    if (ends("ln1") || ends("ln2") || n == "lnf") {
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(1);
    } else if (ends("attn.bb")) {
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(0);
    } else if (ends("attn.bg")) {
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(cfg_.gate_bias_init);
    } else if (ends("attn.wconv")) {
      const double bound = 1.0 / std::sqrt(3.0);
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T((2.0 * rng.uniform() - 1.0) * bound);
    } else {
      const double sd = cfg_.init_std * ((ends("attn.wo") || ends("mlp.wproj")) ? resid_scale : 1.0);
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(rng.normal() * sd);
    }
  }
}

template <typename T>
void Model<T>::zero_grad() {
  std::fill(grads.begin(), grads.end(), T(0));
}

namespace {
template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}
}  // namespace

template <typename T>
DecodeCache Model<T>::cache_view(LayerCache& c) {
  const int64_t HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K();
  constexpr DType dt = dtype_of<T>();
  DecodeCache v;
  v.kc = make_view(c.kc.data(), dt, {1, H, c.capacity, K});
  v.vc = make_view(c.vc.data(), dt, {1, H, c.capacity, K});
  if (attn_has_gate(cfg_.attn)) v.gc = make_view(c.gc.data(), DType::f64, {1, HQ, c.capacity});
  v.lengths = make_view(&c.len, DType::i64, {1});
  return v;
}

template <typename T>
PathFwdParams Model<T>::attention_params(LayerActs& a, int64_t B, int64_t T_) {
  const int64_t HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K();
  constexpr DType dt = dtype_of<T>();
  PathFwdParams p;
  p.q = make_view(a.q.data(), dt, {B, T_, HQ, K});
  p.k = make_view(a.k.data(), dt, {B, T_, H, K});
  p.v = make_view(a.v.data(), dt, {B, T_, H, K});
  if (attn_has_path(cfg_.attn)) {
    p.w = make_view(a.w.data(), dt, {B, T_, H, K});
    p.beta = make_view(a.beta.data(), dt, {B, T_, H});
  }
  if (attn_has_gate(cfg_.attn)) p.g = make_view(a.g.data(), dt, {B, T_, HQ});
  p.o = make_view(a.o.data(), dt, {B, T_, HQ, K});
  p.lse = make_view(a.lse.data(), dt, {B, T_, HQ});
  p.backend = backend;
  p.num_threads = threads;
  return p;
}

template <typename T>
void Model<T>::attention_fwd(LayerActs& a, int64_t B, int64_t T_, LayerCache* cache) {
  const PathFwdParams p = attention_params(a, B, T_);
  Status s;
  if (cache) {
    PathPrefillParams pp;
    pp.fwd = p;
    pp.cache = cache_view(*cache);
    s = path_attn_prefill(pp);
  } else {
    s = path_attn_fwd(p);
  }
  if (!s.ok())
    throw EngineError(std::string(cache ? "attention prefill" : "attention forward") + " (backend " +
                      backend_name(backend) + "): " + s.message());
}

template <typename T>
void Model<T>::attention_decode(LayerActs& a, LayerCache& c) {
  const int64_t HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K();
  constexpr DType dt = dtype_of<T>();
  PathDecodeParams p;
  p.q = make_view(a.q.data(), dt, {1, 1, HQ, K});
  p.k = make_view(a.k.data(), dt, {1, 1, H, K});
  p.v = make_view(a.v.data(), dt, {1, 1, H, K});
  if (attn_has_path(cfg_.attn)) {
    p.w = make_view(a.w.data(), dt, {1, 1, H, K});
    p.beta = make_view(a.beta.data(), dt, {1, 1, H});
  }
  if (attn_has_gate(cfg_.attn)) p.g = make_view(a.g.data(), dt, {1, 1, HQ});
  a.o.resize(HQ * K);
  a.lse.resize(HQ);
  p.o = make_view(a.o.data(), dt, {1, 1, HQ, K});
  p.lse = make_view(a.lse.data(), dt, {1, 1, HQ});
  p.cache = cache_view(c);
  p.backend = backend;
  p.num_threads = threads;
  const Status s = path_attn_decode(p);
  if (!s.ok())
    throw EngineError(std::string("attention decode (backend ") + backend_name(backend) + "): " + s.message());
}

template <typename T>
void Model<T>::attention_bwd(LayerActs& a, const std::vector<T>& dO, std::vector<T>& dq, std::vector<T>& dk,
                             std::vector<T>& dv, std::vector<T>& dw, std::vector<T>& dbeta, std::vector<T>& dg,
                             int64_t B, int64_t T_) {
  const int64_t HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K();
  constexpr DType dt = dtype_of<T>();
  PathBwdParams p = bwd_params_for(attention_params(a, B, T_));
  p.do_ = make_view(const_cast<T*>(dO.data()), dt, {B, T_, HQ, K});
  p.dq = make_view(dq.data(), dt, {B, T_, HQ, K});
  p.dk = make_view(dk.data(), dt, {B, T_, H, K});
  p.dv = make_view(dv.data(), dt, {B, T_, H, K});
  if (attn_has_path(cfg_.attn)) {
    p.dw = make_view(dw.data(), dt, {B, T_, H, K});
    p.dbeta = make_view(dbeta.data(), dt, {B, T_, H});
  }
  if (attn_has_gate(cfg_.attn)) p.dg = make_view(dg.data(), dt, {B, T_, HQ});
  const Status s = path_attn_bwd(p);
  if (!s.ok())
    throw EngineError(std::string("attention backward (backend ") + backend_name(backend) + "): " + s.message());
}

template <typename T>
void Model<T>::block_inputs(LayerActs& a, const BlockOffsets& o, int64_t N) {
  const int64_t C = cfg_.d_model, HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K(), R = cfg_.w_rank;
  const T* P = params.data();
  a.ln1.resize(N * C);
  a.rstd1.resize(N);
  rmsnorm_fwd(a.x.data(), P + o.ln1, a.ln1.data(), a.rstd1.data(), N, C, cfg_.norm_eps);
  a.q.resize(N * HQ * K);
  a.k.resize(N * H * K);
  a.v.resize(N * H * K);
  linear_fwd(a.ln1.data(), P + o.wq, (const T*)nullptr, a.q.data(), N, C, HQ * K);
  linear_fwd(a.ln1.data(), P + o.wk, (const T*)nullptr, a.k.data(), N, C, H * K);
  linear_fwd(a.ln1.data(), P + o.wv, (const T*)nullptr, a.v.data(), N, C, H * K);
  if (attn_has_path(cfg_.attn)) {
    a.wraw.resize(N * H * K);
    if (R > 0) {
      a.wlr.resize(N * R);
      linear_fwd(a.ln1.data(), P + o.ww1, (const T*)nullptr, a.wlr.data(), N, C, R);
      linear_fwd(a.wlr.data(), P + o.ww2, (const T*)nullptr, a.wraw.data(), N, R, H * K);
    } else {
      linear_fwd(a.ln1.data(), P + o.ww1, (const T*)nullptr, a.wraw.data(), N, C, H * K);
    }
    a.beta.resize(N * H);
    linear_fwd(a.ln1.data(), P + o.wb, P + o.bb, a.beta.data(), N, C, H);
    beta_fwd(a.beta.data(), a.beta.data(), N * H);
  }
  if (attn_has_gate(cfg_.attn)) {
    a.g.resize(N * HQ);
    linear_fwd(a.ln1.data(), P + o.wg, P + o.bg, a.g.data(), N, C, HQ);
    logsigmoid_fwd(a.g.data(), a.g.data(), N * HQ);
  }
}

template <typename T>
void Model<T>::block_output(LayerActs& a, const BlockOffsets& o, int64_t N, std::vector<T>& x) {
  const int64_t C = cfg_.d_model, HQ = cfg_.n_head, K = cfg_.K(), F = cfg_.F();
  const T* P = params.data();
  a.xmid = a.x;
  std::vector<T> tmp(N * C);
  linear_fwd(a.o.data(), P + o.wo, (const T*)nullptr, tmp.data(), N, HQ * K, C);
  add_inplace(a.xmid.data(), tmp.data(), N * C);
  a.ln2.resize(N * C);
  a.rstd2.resize(N);
  rmsnorm_fwd(a.xmid.data(), P + o.ln2, a.ln2.data(), a.rstd2.data(), N, C, cfg_.norm_eps);
  a.h.resize(N * 2 * F);
  a.m.resize(N * F);
  linear_fwd(a.ln2.data(), P + o.wfc, (const T*)nullptr, a.h.data(), N, C, 2 * F);
  swiglu_fwd(a.h.data(), a.m.data(), N, F);
  x = a.xmid;
  linear_fwd(a.m.data(), P + o.wproj, (const T*)nullptr, tmp.data(), N, F, C);
  add_inplace(x.data(), tmp.data(), N * C);
}

template <typename T>
void Model<T>::head_fwd(const T* x, std::vector<T>& ln, std::vector<T>& rstd, std::vector<T>& logits, int64_t N) {
  const int64_t C = cfg_.d_model, Vc = cfg_.vocab_size;
  const T* P = params.data();
  ln.resize(N * C);
  rstd.resize(N);
  rmsnorm_fwd(x, P + off_lnf_, ln.data(), rstd.data(), N, C, cfg_.norm_eps);
  logits.resize(N * Vc);
  if (cfg_.tie_embeddings)
    cpu::gemm(false, true, N, Vc, C, T(1), ln.data(), C, P + off_wte_, C, T(0), logits.data(), Vc);
  else
    linear_fwd(ln.data(), P + off_head_, (const T*)nullptr, logits.data(), N, C, Vc);
}

template <typename T>
StepStats Model<T>::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T_, int32_t* pred) {
  return forward_impl(tokens, targets, B, T_, pred, nullptr);
}

template <typename T>
StepStats Model<T>::forward_impl(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T_,
                                 int32_t* pred, std::vector<LayerCache>* caches) {
  const int64_t N = B * T_, C = cfg_.d_model, HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K();
  const int64_t Vc = cfg_.vocab_size;
  for (int64_t n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= Vc)
      throw EngineError("model input: token id " + std::to_string(tokens[n]) + " outside the vocab [0, " +
                        std::to_string(Vc) + ")");
  nb_ = B;
  nt_ = T_;
  tokens_.assign(tokens, tokens + N);
  targets_.assign(N, -1);
  if (targets) targets_.assign(targets, targets + N);
  acts_.resize(cfg_.n_layer);
  const T* P = params.data();

  std::vector<T> x(N * C);
  embedding_fwd(tokens, P + off_wte_, x.data(), N, C);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    LayerActs& a = acts_[l];
    const BlockOffsets& o = lo_[l];
    a.x = x;
    block_inputs(a, o, N);
    if (cfg_.attn == AttnKind::rope) {
      rope_apply(a.q.data(), N, T_, HQ, K, cfg_.rope_theta, false);
      rope_apply(a.k.data(), N, T_, H, K, cfg_.rope_theta, false);
    }
    if (attn_has_path(cfg_.attn)) {
      a.wc.resize(N * H * K);
      a.ws.resize(N * H * K);
      a.w.resize(N * H * K);
      a.wrinv.resize(N * H);
      conv3_silu_fwd(a.wraw.data(), P + o.wconv, a.wc.data(), a.ws.data(), N, T_, H * K);
      l2norm_fwd(a.ws.data(), a.w.data(), a.wrinv.data(), N, H, K, 1e-6);
    }
    a.o.resize(N * HQ * K);
    a.lse.resize(N * HQ);
    attention_fwd(a, B, T_, caches ? &(*caches)[l] : nullptr);
    block_output(a, o, N, x);
  }
  xfinal_ = x;
  head_fwd(xfinal_.data(), lnf_, rstdf_, logits_, N);
  const CeStats ce = cross_entropy(logits_.data(), targets_.data(), (T*)nullptr, pred, N, Vc, 1.0);
  count_ = ce.count;
  StepStats st;
  st.count = ce.count;
  st.correct = ce.correct;
  st.loss = ce.count > 0 ? ce.loss_sum / double(ce.count) : 0.0;
  return st;
}

template <typename T>
const T* Model<T>::prefill(const int32_t* tokens, int64_t T_, int64_t capacity) {
  const int64_t HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K(), D = H * K, Vc = cfg_.vocab_size;
  if (T_ < 1 || capacity < T_)
    throw EngineError("prefill: expected 1 <= prompt length <= capacity, got " + std::to_string(T_) + " tokens and "
                      "capacity " + std::to_string(capacity));
  caches_.assign(cfg_.n_layer, LayerCache());
  dec_len_ = 0;
  for (LayerCache& c : caches_) {
    c.capacity = capacity;
    c.kc.assign(H * capacity * K, T(0));
    c.vc.assign(H * capacity * K, T(0));
    if (attn_has_gate(cfg_.attn)) c.gc.assign(HQ * capacity, 0.0);
  }
  forward_impl(tokens, nullptr, 1, T_, nullptr, &caches_);
  if (attn_has_path(cfg_.attn)) {
    for (int l = 0; l < cfg_.n_layer; ++l) {  // the conv of the next token reads the last two raw w rows
      const std::vector<T>& wraw = acts_[l].wraw;
      caches_[l].wprev.assign(wraw.begin() + std::max<int64_t>(0, T_ - 2) * D, wraw.begin() + T_ * D);
    }
  }
  dec_len_ = T_;
  return logits_.data() + (T_ - 1) * Vc;
}

template <typename T>
const T* Model<T>::decode_step(int32_t token) {
  const int64_t C = cfg_.d_model, HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K(), D = H * K, Vc = cfg_.vocab_size;
  if (caches_.empty()) throw EngineError("decode_step: no prefill before the first step");
  if (dec_len_ >= caches_[0].capacity)
    throw EngineError("decode_step: the cache is full (" + std::to_string(dec_len_) + " tokens, the capacity given "
                      "to prefill)");
  if (token < 0 || token >= Vc)
    throw EngineError("model input: token id " + std::to_string(token) + " outside the vocab [0, " +
                      std::to_string(Vc) + ")");
  const T* P = params.data();
  LayerActs& a = step_;
  step_x_.resize(C);
  embedding_fwd(&token, P + off_wte_, step_x_.data(), 1, C);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    const BlockOffsets& o = lo_[l];
    LayerCache& c = caches_[l];
    a.x = step_x_;
    block_inputs(a, o, 1);
    if (cfg_.attn == AttnKind::rope) {
      rope_apply_at(a.q.data(), 1, 1, dec_len_, HQ, K, cfg_.rope_theta, false);
      rope_apply_at(a.k.data(), 1, 1, dec_len_, H, K, cfg_.rope_theta, false);
    }
    if (attn_has_path(cfg_.attn)) {
      // The forward's conv over the window [last <= 2 rows, this row] (as one sequence of nw rows): its last
      // row sees exactly the taps position dec_len_ sees in a full forward.
      c.wprev.insert(c.wprev.end(), a.wraw.begin(), a.wraw.begin() + D);
      const int64_t nw = int64_t(c.wprev.size()) / D;
      a.wc.resize(nw * D);
      a.ws.resize(nw * D);
      a.w.resize(D);
      a.wrinv.resize(H);
      conv3_silu_fwd(c.wprev.data(), P + o.wconv, a.wc.data(), a.ws.data(), nw, nw, D);
      l2norm_fwd(a.ws.data() + (nw - 1) * D, a.w.data(), a.wrinv.data(), 1, H, K, 1e-6);
      if (nw == 3) c.wprev.erase(c.wprev.begin(), c.wprev.begin() + D);
    }
    attention_decode(a, c);
    block_output(a, o, 1, step_x_);
  }
  ++dec_len_;
  head_fwd(step_x_.data(), step_lnf_, step_rstdf_, step_logits_, 1);
  return step_logits_.data();
}

template <typename T>
void Model<T>::backward() {
  const int64_t B = nb_, T_ = nt_, N = B * T_, C = cfg_.d_model, HQ = cfg_.n_head, H = cfg_.H(), K = cfg_.K();
  const int64_t F = cfg_.F(), Vc = cfg_.vocab_size, R = cfg_.w_rank;
  const bool path = attn_has_path(cfg_.attn), gate = attn_has_gate(cfg_.attn);
  if (count_ == 0) return;  // no counted row: the loss is the constant 0
  const T* P = params.data();
  T* G = grads.data();

  std::vector<T> dlogits(N * Vc);
  cross_entropy(logits_.data(), targets_.data(), dlogits.data(), (int32_t*)nullptr, N, Vc, 1.0 / double(count_));
  std::vector<T> dlnf(N * C), dx(N * C);
  if (cfg_.tie_embeddings) {
    cpu::gemm(false, false, N, C, Vc, T(1), dlogits.data(), Vc, P + off_wte_, C, T(0), dlnf.data(), C);
    cpu::gemm(true, false, Vc, C, N, T(1), dlogits.data(), Vc, lnf_.data(), C, T(1), G + off_wte_, C);
  } else {
    linear_bwd(lnf_.data(), P + off_head_, dlogits.data(), dlnf.data(), G + off_head_, (T*)nullptr, N, C, Vc,
               false);
  }
  rmsnorm_bwd(xfinal_.data(), P + off_lnf_, rstdf_.data(), dlnf.data(), dx.data(), G + off_lnf_, N, C, false);

  std::vector<T> dm(N * F), dh(N * 2 * F), dln(N * C), dO(N * HQ * K), dq(N * HQ * K), dk(N * H * K),
      dv(N * H * K), dw(path ? N * H * K : 0), dbeta(path ? N * H : 0), dg(gate ? N * HQ : 0);
  std::vector<T> dws, dwraw, dwlr, dz;
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    LayerActs& a = acts_[l];
    const BlockOffsets& o = lo_[l];
    // MLP: x_out = x_mid + m Wproj, m = swiglu(rmsnorm(x_mid) Wfc).
    linear_bwd(a.m.data(), P + o.wproj, dx.data(), dm.data(), G + o.wproj, (T*)nullptr, N, F, C, false);
    swiglu_bwd(a.h.data(), dm.data(), dh.data(), N, F);
    linear_bwd(a.ln2.data(), P + o.wfc, dh.data(), dln.data(), G + o.wfc, (T*)nullptr, N, C, 2 * F, false);
    rmsnorm_bwd(a.xmid.data(), P + o.ln2, a.rstd2.data(), dln.data(), dx.data(), G + o.ln2, N, C, true);
    // Attention: x_mid = x + o Wo.
    linear_bwd(a.o.data(), P + o.wo, dx.data(), dO.data(), G + o.wo, (T*)nullptr, N, HQ * K, C, false);
    attention_bwd(a, dO, dq, dk, dv, dw, dbeta, dg, B, T_);
    if (cfg_.attn == AttnKind::rope) {
      rope_apply(dq.data(), N, T_, HQ, K, cfg_.rope_theta, true);
      rope_apply(dk.data(), N, T_, H, K, cfg_.rope_theta, true);
    }
    linear_bwd(a.ln1.data(), P + o.wq, dq.data(), dln.data(), G + o.wq, (T*)nullptr, N, C, HQ * K, false);
    linear_bwd(a.ln1.data(), P + o.wk, dk.data(), dln.data(), G + o.wk, (T*)nullptr, N, C, H * K, true);
    linear_bwd(a.ln1.data(), P + o.wv, dv.data(), dln.data(), G + o.wv, (T*)nullptr, N, C, H * K, true);
    if (path) {
      dws.resize(N * H * K);
      dwraw.resize(N * H * K);
      l2norm_bwd(a.w.data(), a.wrinv.data(), dw.data(), dws.data(), N, H, K);
      conv3_silu_bwd(a.wraw.data(), P + o.wconv, a.wc.data(), dws.data(), dwraw.data(), G + o.wconv, N, T_, H * K);
      if (R > 0) {
        dwlr.resize(N * R);
        linear_bwd(a.wlr.data(), P + o.ww2, dwraw.data(), dwlr.data(), G + o.ww2, (T*)nullptr, N, R, H * K, false);
        linear_bwd(a.ln1.data(), P + o.ww1, dwlr.data(), dln.data(), G + o.ww1, (T*)nullptr, N, C, R, true);
      } else {
        linear_bwd(a.ln1.data(), P + o.ww1, dwraw.data(), dln.data(), G + o.ww1, (T*)nullptr, N, C, H * K, true);
      }
      dz.resize(N * H);
      beta_bwd(a.beta.data(), dbeta.data(), dz.data(), N * H);
      linear_bwd(a.ln1.data(), P + o.wb, dz.data(), dln.data(), G + o.wb, G + o.bb, N, C, H, true);
    }
    if (gate) {
      dz.resize(N * HQ);
      logsigmoid_bwd(a.g.data(), dg.data(), dz.data(), N * HQ);
      linear_bwd(a.ln1.data(), P + o.wg, dz.data(), dln.data(), G + o.wg, G + o.bg, N, C, HQ, true);
    }
    rmsnorm_bwd(a.x.data(), P + o.ln1, a.rstd1.data(), dln.data(), dx.data(), G + o.ln1, N, C, true);
  }
  embedding_bwd(tokens_.data(), dx.data(), G + off_wte_, N, C);
}

template class Model<float>;
template class Model<double>;

}  // namespace pathattn::engine
