// core/validate.cpp: argument validation for every entry point (docs/spec.md). Each failure returns
// invalid_argument (or unsupported / unavailable) with a message naming the argument and what was expected.
#include <cmath>
#include <sstream>

#include "core/convert.h"
#include "core/problem.h"

namespace pathattn {

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "unknown";
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::automatic: return "automatic";
    case Backend::oracle: return "oracle";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "unknown";
}

int64_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::bf16: case DType::f16: return 2;
  }
  return 0;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t st = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.stride[d] = st;
    st *= v.shape[d];
  }
  return v;
}

}  // namespace pathattn

namespace pathattn::core {
namespace {

Status bad(const std::string& m) { return Status(Status::Code::invalid_argument, m); }

// More threads than any machine we target has cores: an OpenMP team that large fails to start or thrashes.
constexpr int kMaxThreads = 1024;

bool is_float(DType d) { return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16; }

// w, beta and g may each have any float dtype, independently of q and of each other (the backends read them
// into their compute type); their gradients come back in the same dtype.
Status param_dtype_check(const char* name, const TensorView& x) {
  if (is_float(x.dtype)) return Status::Ok();
  return bad(std::string(name) + ": expected dtype bfloat16, float16, float32 or float64, got " + dtype_name(x.dtype));
}

}  // namespace

std::string shape_str(const TensorView& x) {
  std::ostringstream s;
  s << "[";
  const int nd = x.ndim < 0 ? 0 : (x.ndim > 4 ? 4 : x.ndim);  // a bad ndim must not index past shape[4]
  for (int i = 0; i < nd; ++i) s << (i ? ", " : "") << x.shape[i];
  s << "]";
  return s.str();
}

// shape[i] < 0 means "any size" for that dimension.
Status tensor_check(const char* name, const TensorView& x, int ndim, const int64_t* shape,
                    const char* dims_doc) {
  if (!x.present()) return bad(std::string(name) + ": required but absent");
  if (x.ndim != ndim) {  // before numel(), which would read past shape[] for ndim > 4
    std::ostringstream s;
    s << name << ": expected " << ndim << " dimensions " << dims_doc << ", got " << x.ndim << " "
      << shape_str(x);
    return bad(s.str());
  }
  if (x.data == nullptr && x.numel() != 0) return bad(std::string(name) + ": data pointer is null");
  for (int i = 0; i < ndim; ++i) {
    if (x.shape[i] < 0) return bad(std::string(name) + ": negative size in shape " + shape_str(x));
    if (shape[i] >= 0 && x.shape[i] != shape[i]) {
      std::ostringstream s;
      s << name << ": expected shape " << dims_doc << " = [";
      for (int j = 0; j < ndim; ++j) {
        s << (j ? ", " : "");
        if (shape[j] >= 0) s << shape[j]; else s << "*";
      }
      s << "], got " << shape_str(x);
      return bad(s.str());
    }
  }
  // An empty tensor (numpy gives zero-size dimensions stride 0) has no element whose layout could matter.
  if (ndim > 0 && x.shape[ndim - 1] > 1 && x.stride[ndim - 1] != 1 && x.numel() != 0) {
    std::ostringstream s;
    s << name << ": the last dimension must be contiguous (stride 1), got stride " << x.stride[ndim - 1];
    return bad(s.str());
  }
  return Status::Ok();
}

Status dtype_check(const char* name, const TensorView& x, DType expected) {
  if (x.dtype != expected) {
    return bad(std::string(name) + ": expected dtype " + dtype_name(expected) + ", got " + dtype_name(x.dtype));
  }
  return Status::Ok();
}

Status check_seqs(const TensorView& cu, int64_t B, int64_t T, std::vector<Seq>* seqs, int64_t* num_seqs) {
  seqs->clear();
  if (cu.present()) {
    if (cu.ndim != 1) return bad("cu_seqlens: expected 1 dimension [N + 1], got " + std::to_string(cu.ndim) + " " + shape_str(cu));
    if (cu.dtype != DType::i32 && cu.dtype != DType::i64) return bad(std::string("cu_seqlens: expected dtype int32 or int64, got ") + dtype_name(cu.dtype));
    if (cu.device != Device::cpu) return bad("cu_seqlens: must be in host memory");
    if (cu.shape[0] < 2) return bad("cu_seqlens: expected at least 2 entries [0, ..., T], got " + shape_str(cu));
    if (cu.data == nullptr) return bad("cu_seqlens: data pointer is null");
    if (B != 1) return bad("cu_seqlens: requires batch size B == 1 (sequences packed along T), got B = " + std::to_string(B));
    const int64_t n1 = cu.shape[0];
    auto at = [&](int64_t i) { return load_elem<int64_t>(cu.data, cu.dtype, i * cu.stride[0]); };
    if (at(0) != 0) return bad("cu_seqlens: the first entry must be 0, got " + std::to_string(at(0)));
    for (int64_t i = 1; i < n1; ++i) {
      int64_t a = at(i - 1), b = at(i);
      if (b < a) return bad("cu_seqlens: must be non-decreasing, but entry " + std::to_string(i) + " = " + std::to_string(b) + " < entry " + std::to_string(i - 1) + " = " + std::to_string(a));
      if (b - a > 0) seqs->push_back({0, a, b - a});
    }
    if (at(n1 - 1) != T) return bad("cu_seqlens: the last entry must equal T = " + std::to_string(T) + ", got " + std::to_string(at(n1 - 1)));
    *num_seqs = n1 - 1;
  } else {
    *num_seqs = B;
    if (T > 0) for (int64_t b = 0; b < B; ++b) seqs->push_back({b, 0, T});
  }
  return Status::Ok();
}

namespace {

// Validating mode: the first non-finite element of x [B, T, heads, D] (rank 4) or [B, T, heads] (rank 3).
Status scan_finite(const char* name, const TensorView& x, const Problem& pr, int64_t heads, int64_t D) {
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t t = 0; t < pr.T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < D; ++d) {
          int64_t off = offset3(x, b, t, h) + (x.ndim == 4 ? d : 0);
          double val = load_elem<double>(x.data, x.dtype, off);
          if (!std::isfinite(val)) {
            std::ostringstream s;
            s << name << ": non-finite value " << val << " at [" << b << ", " << t << ", " << h;
            if (x.ndim == 4) s << ", " << d;
            s << "]";
            return bad(s.str());
          }
        }
  return Status::Ok();
}

Status unavailable_cuda(Backend be) {
#ifndef PATHATTN_WITH_CUDA
  if (be == Backend::cuda) {
    return Status(Status::Code::unavailable, "backend: cuda was requested but this build of pathattn has no CUDA backend (configure with -DPATHATTN_CUDA=ON)");
  }
#else
  (void)be;
#endif
  return Status::Ok();
}

// The part of validation shared by forward and backward: inputs, options, sequences.
Status check_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& w,
                    const TensorView& beta, const TensorView& g, const TensorView& cu, double scale,
                    double gate_scale, Backend backend, int num_threads, int chunk_size, Problem* pr) {
  if (!q.present()) return bad("q: required but absent");
  if (q.ndim != 4) return bad("q: expected 4 dimensions [B, T, HQ, K], got " + std::to_string(q.ndim) + " " + shape_str(q));
  if (!is_float(q.dtype)) return bad(std::string("q: expected dtype bfloat16, float16 or float32, got ") + dtype_name(q.dtype));
  pr->B = q.shape[0];
  pr->T = q.shape[1];
  pr->HQ = q.shape[2];
  pr->K = q.shape[3];
  int64_t qs[4] = {-1, -1, -1, -1};
  PA_TRY(tensor_check("q", q, 4, qs, "[B, T, HQ, K]"));
  if (!k.present()) return bad("k: required but absent");
  if (k.ndim != 4) return bad("k: expected 4 dimensions [B, T, H, K], got " + std::to_string(k.ndim) + " " + shape_str(k));
  pr->H = k.shape[2];
  int64_t ks[4] = {pr->B, pr->T, pr->H, pr->K};
  PA_TRY(tensor_check("k", k, 4, ks, "[B, T, H, K]"));
  PA_TRY(dtype_check("k", k, q.dtype));
  if (!v.present()) return bad("v: required but absent");
  if (v.ndim != 4) return bad("v: expected 4 dimensions [B, T, H, V], got " + std::to_string(v.ndim) + " " + shape_str(v));
  pr->V = v.shape[3];
  int64_t vs[4] = {pr->B, pr->T, pr->H, -1};
  PA_TRY(tensor_check("v", v, 4, vs, "[B, T, H, V]"));
  PA_TRY(dtype_check("v", v, q.dtype));
  if (pr->H == 0 || pr->HQ % pr->H != 0) {
    std::ostringstream s;
    s << "q: the number of query heads HQ = " << pr->HQ << " must be a positive multiple of the number of kv heads H = " << pr->H << " (k.shape[2])";
    return bad(s.str());
  }
  pr->group = pr->HQ / pr->H;
  pr->f64 = q.dtype == DType::f64;

  if (w.present() != beta.present()) return bad(std::string(w.present() ? "beta" : "w") + ": w and beta must be given together (both absent means plain attention)");
  pr->path = w.present();
  if (pr->path) {
    PA_TRY(tensor_check("w", w, 4, ks, "[B, T, H, K]"));
    PA_TRY(param_dtype_check("w", w));
    int64_t bs[3] = {pr->B, pr->T, pr->H};
    PA_TRY(tensor_check("beta", beta, 3, bs, "[B, T, H]"));
    PA_TRY(param_dtype_check("beta", beta));
  }
  pr->gate = g.present();
  if (pr->gate) {
    int64_t gs[3] = {pr->B, pr->T, pr->HQ};
    PA_TRY(tensor_check("g", g, 3, gs, "[B, T, HQ]"));
    PA_TRY(param_dtype_check("g", g));
  }

  // Backend and devices.
  Backend be = backend;
  if (be == Backend::automatic) be = q.device == Device::cuda ? Backend::cuda : Backend::cpu;
  pr->backend = be;
  PA_TRY(unavailable_cuda(be));  // before the device checks: a missing backend is the real reason
  const Device dev = be == Backend::cuda ? Device::cuda : Device::cpu;
  const TensorView* all[] = {&q, &k, &v, &w, &beta, &g};
  const char* names[] = {"q", "k", "v", "w", "beta", "g"};
  for (int i = 0; i < 6; ++i) {
    if (all[i]->present() && all[i]->device != dev) {
      return bad(std::string(names[i]) + ": tensor is on the " + (all[i]->device == Device::cuda ? "cuda" : "cpu") +
                 " device but backend " + backend_name(be) + " needs " + (dev == Device::cuda ? "cuda" : "cpu") + " tensors");
    }
  }
  if (be == Backend::cuda && pr->f64) return bad("q: float64 inputs are supported by the oracle and cpu backends only");
  if (be == Backend::cuda) {
    for (int i = 3; i < 6; ++i) {
      if (all[i]->present() && all[i]->dtype == DType::f64) {
        return bad(std::string(names[i]) + ": expected dtype bfloat16, float16 or float32 on the cuda backend, got float64 (float64 is for the oracle and cpu backends)");
      }
    }
  }
  if (be != Backend::cuda) {
    if (pr->K % 8 != 0 || pr->K < 8 || pr->K > 256) {
      return Status(Status::Code::unsupported, "q: head dim K = " + std::to_string(pr->K) + " is not supported: expected a multiple of 8 in [8, 256]");
    }
    if (pr->V % 8 != 0 || pr->V < 8 || pr->V > 256) {
      return Status(Status::Code::unsupported, "v: head dim V = " + std::to_string(pr->V) + " is not supported: expected a multiple of 8 in [8, 256]");
    }
  }

  // Scalars and options.
  if (!std::isnan(scale) && !std::isfinite(scale)) return bad("scale: must be finite (or kDefaultScale)");
  if (!std::isnan(gate_scale) && !std::isfinite(gate_scale)) return bad("gate_scale: must be finite (or kDefaultScale)");
  pr->scale = std::isnan(scale) ? 1.0 / std::sqrt(double(pr->K)) : scale;
  pr->gate_scale = std::isnan(gate_scale) ? pr->scale : gate_scale;
  if (num_threads < 0 || num_threads > kMaxThreads) {
    return bad("num_threads: expected 0 (default) to " + std::to_string(kMaxThreads) + ", got " + std::to_string(num_threads));
  }
  if (chunk_size != 0 && (chunk_size % 8 != 0 || chunk_size < 8 || chunk_size > 1024)) {
    return bad("chunk_size: expected 0 (default) or a multiple of 8 in [8, 1024], got " + std::to_string(chunk_size));
  }

  // Sequences.
  return check_seqs(cu, pr->B, pr->T, &pr->seqs, &pr->num_seqs);
}

Status check_output(const char* name, const TensorView& x, int ndim, const int64_t* shape, const char* doc,
                    DType dt, Device dev) {
  PA_TRY(tensor_check(name, x, ndim, shape, doc));
  PA_TRY(dtype_check(name, x, dt));
  if (x.device != dev) return bad(std::string(name) + ": output is on the wrong device for this backend");
  return Status::Ok();
}

}  // namespace

Status check_fwd(const PathFwdParams& p, Problem* pr) {
  PA_TRY(check_inputs(p.q, p.k, p.v, p.w, p.beta, p.g, p.cu_seqlens, p.scale, p.gate_scale, p.backend,
                      p.num_threads, p.chunk_size, pr));
  const Device dev = pr->backend == Backend::cuda ? Device::cuda : Device::cpu;
  int64_t os[4] = {pr->B, pr->T, pr->HQ, pr->V};
  if (!p.o.present()) return bad("o: required output [B, T, HQ, V] is absent");
  PA_TRY(check_output("o", p.o, 4, os, "[B, T, HQ, V]", p.v.dtype, dev));
  if (p.lse.present()) {
    int64_t ls[3] = {pr->B, pr->T, pr->HQ};
    PA_TRY(check_output("lse", p.lse, 3, ls, "[B, T, HQ]", pr->f64 ? DType::f64 : DType::f32, dev));
  }
  if (p.validate) PA_TRY(check_values(*pr, p.q, p.k, p.v, p.w, p.beta, p.g));
  return Status::Ok();
}

Status check_fwd_inputs(const PathFwdParams& p, Problem* pr) {
  return check_inputs(p.q, p.k, p.v, p.w, p.beta, p.g, p.cu_seqlens, p.scale, p.gate_scale, p.backend,
                      p.num_threads, p.chunk_size, pr);
}

Status check_bwd(const PathBwdParams& p, Problem* pr) {
  PA_TRY(check_inputs(p.q, p.k, p.v, p.w, p.beta, p.g, p.cu_seqlens, p.scale, p.gate_scale, p.backend,
                      p.num_threads, p.chunk_size, pr));
  const Device dev = pr->backend == Backend::cuda ? Device::cuda : Device::cpu;
  const DType fdt = pr->f64 ? DType::f64 : DType::f32;
  int64_t os[4] = {pr->B, pr->T, pr->HQ, pr->V};
  int64_t ls[3] = {pr->B, pr->T, pr->HQ};
  int64_t qs[4] = {pr->B, pr->T, pr->HQ, pr->K};
  int64_t ks[4] = {pr->B, pr->T, pr->H, pr->K};
  int64_t vs[4] = {pr->B, pr->T, pr->H, pr->V};
  int64_t bs[3] = {pr->B, pr->T, pr->H};
  PA_TRY(check_output("o", p.o, 4, os, "[B, T, HQ, V]", p.v.dtype, dev));
  PA_TRY(check_output("lse", p.lse, 3, ls, "[B, T, HQ]", fdt, dev));
  PA_TRY(check_output("do", p.do_, 4, os, "[B, T, HQ, V]", p.v.dtype, dev));
  PA_TRY(check_output("dq", p.dq, 4, qs, "[B, T, HQ, K]", p.q.dtype, dev));
  PA_TRY(check_output("dk", p.dk, 4, ks, "[B, T, H, K]", p.q.dtype, dev));
  PA_TRY(check_output("dv", p.dv, 4, vs, "[B, T, H, V]", p.q.dtype, dev));
  if (pr->path) {
    PA_TRY(check_output("dw", p.dw, 4, ks, "[B, T, H, K]", p.w.dtype, dev));
    PA_TRY(check_output("dbeta", p.dbeta, 3, bs, "[B, T, H]", p.beta.dtype, dev));
  } else if (p.dw.present() || p.dbeta.present()) {
    return bad(std::string(p.dw.present() ? "dw" : "dbeta") + ": given, but w and beta are absent (plain attention has no such gradient)");
  }
  if (pr->gate) {
    PA_TRY(check_output("dg", p.dg, 3, ls, "[B, T, HQ]", p.g.dtype, dev));
  } else if (p.dg.present()) {
    return bad("dg: given, but g is absent");
  }
  if (p.validate) {
    PA_TRY(check_values(*pr, p.q, p.k, p.v, p.w, p.beta, p.g));
    PA_TRY(scan_finite("do", p.do_, *pr, pr->HQ, pr->V));  // the output gradient is an input here too
  }
  return Status::Ok();
}

Status check_cache(const DecodeCache& c, const Problem& pr, int64_t num_seqs, bool need_room) {
  const DType fdt = pr.f64 ? DType::f64 : DType::f32;
  const Device dev = pr.backend == Backend::cuda ? Device::cuda : Device::cpu;
  if (!c.kc.present()) return bad("cache.kc: required [N, H, C, K] but absent");
  const int64_t cap = c.kc.ndim == 4 ? c.kc.shape[2] : -1;
  int64_t ks[4] = {num_seqs, pr.H, cap, pr.K};
  int64_t vs[4] = {num_seqs, pr.H, cap, pr.V};
  int64_t gs[3] = {num_seqs, pr.HQ, cap};
  int64_t ls[1] = {num_seqs};
  PA_TRY(check_output("cache.kc", c.kc, 4, ks, "[N, H, C, K]", fdt, dev));
  PA_TRY(check_output("cache.vc", c.vc, 4, vs, "[N, H, C, V]", fdt, dev));
  if (pr.gate) {
    PA_TRY(check_output("cache.gc", c.gc, 3, gs, "[N, HQ, C]", DType::f64, dev));
  } else if (c.gc.present()) {
    return bad("cache.gc: the cache has a gate slot but g is absent (pass g, or build the cache without gc)");
  }
  PA_TRY(tensor_check("cache.lengths", c.lengths, 1, ls, "[N]"));
  PA_TRY(dtype_check("cache.lengths", c.lengths, DType::i64));
  if (c.lengths.device != Device::cpu) return bad("cache.lengths: must be in host memory");
  if (need_room) {
    const int64_t* len = static_cast<const int64_t*>(c.lengths.data);
    for (int64_t n = 0; n < num_seqs; ++n) {
      int64_t l = len[n * c.lengths.stride[0]];
      if (l < 0 || l >= cap) {
        return bad("cache.lengths: slot " + std::to_string(n) + " holds " + std::to_string(l) + " tokens; expected 0 <= length < capacity C = " + std::to_string(cap));
      }
    }
  }
  return Status::Ok();
}

Status check_values(const Problem& pr, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& w, const TensorView& beta, const TensorView& g) {
  if (pr.backend == Backend::cuda) return Status(Status::Code::unsupported, "validate: the validating mode is implemented for host tensors only");
  PA_TRY(scan_finite("q", q, pr, pr.HQ, pr.K));
  PA_TRY(scan_finite("k", k, pr, pr.H, pr.K));
  PA_TRY(scan_finite("v", v, pr, pr.H, pr.V));
  if (pr.gate) PA_TRY(scan_finite("g", g, pr, pr.HQ, 1));
  if (pr.path) {
    PA_TRY(scan_finite("w", w, pr, pr.H, pr.K));
    PA_TRY(scan_finite("beta", beta, pr, pr.H, 1));
    for (int64_t b = 0; b < pr.B; ++b)
      for (int64_t t = 0; t < pr.T; ++t)
        for (int64_t h = 0; h < pr.H; ++h) {
          double bt = load_elem<double>(beta.data, beta.dtype, offset3(beta, b, t, h));
          if (bt < 0.0 || bt > 2.0) {
            std::ostringstream s;
            s << "beta: value " << bt << " at [" << b << ", " << t << ", " << h << "] is outside [0, 2]";
            return bad(s.str());
          }
          double n2 = 0;
          for (int64_t d = 0; d < pr.K; ++d) {
            double x = load_elem<double>(w.data, w.dtype, offset3(w, b, t, h) + d);
            n2 += x * x;
          }
          if (std::fabs(std::sqrt(n2) - 1.0) > 1e-2) {
            std::ostringstream s;
            s << "w: row [" << b << ", " << t << ", " << h << "] has norm " << std::sqrt(n2) << ", expected 1 (within 1e-2)";
            return bad(s.str());
          }
        }
  }
  return Status::Ok();
}

}  // namespace pathattn::core
