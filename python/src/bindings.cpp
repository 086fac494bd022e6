// python/src/bindings.cpp: the extension module pathattn._pathattn, a thin nanobind layer over the C++ API.
// Arrays arrive through DLPack or the buffer protocol (numpy; torch CPU and CUDA tensors) and are wrapped,
// never copied, in pathattn::TensorView; outputs are allocated by the Python package and passed in. Every
// call releases the GIL while the op runs. A non-ok Status becomes a Python exception (see raise_status).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "pathattn/pathattn.h"

namespace nb = nanobind;
using namespace pathattn;

namespace {

using InArray = nb::ndarray<nb::ro>;  // read-only input: read-only numpy arrays are accepted too
using OutArray = nb::ndarray<>;       // written by the op: must be writable
using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

// C++ exception types that nanobind translates to the Python exception classes registered in the module
// (pathattn.BackendUnavailableError derives from RuntimeError, pathattn.UnsupportedError from
// NotImplementedError), so callers can catch either the specific or the builtin class.
struct UnavailableError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct UnsupportedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// invalid_argument -> ValueError, or TypeError when the message is about a dtype ("x: expected dtype ...");
// unsupported -> UnsupportedError (NotImplementedError); unavailable -> BackendUnavailableError
// (RuntimeError); internal -> RuntimeError. The C++ message already names the argument.
void raise_status(const Status& s) {
  if (s.ok()) return;
  const std::string& m = s.message();
  switch (s.code()) {
    case Status::Code::invalid_argument:
      if (m.find(": expected dtype") != std::string::npos) throw nb::type_error(m.c_str());
      throw nb::value_error(m.c_str());
    case Status::Code::unsupported: throw UnsupportedError(m);
    case Status::Code::unavailable: throw UnavailableError(m);
    default: throw std::runtime_error("pathattn internal error: " + m);
  }
}

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  std::string base;
  switch (nb::dlpack::dtype_code(dt.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: base = "code" + std::to_string(int(dt.code)) + "_"; break;
  }
  std::string s = base + std::to_string(int(dt.bits));
  if (dt.lanes != 1) s += "x" + std::to_string(int(dt.lanes));
  return s;
}

DType to_dtype(const char* name, nb::dlpack::dtype dt) {
  using C = nb::dlpack::dtype_code;
  if (std::string(name) == "cu_seqlens") {  // the one integer input: its own list of dtypes
    if (dt.lanes == 1 && dt.code == uint8_t(C::Int) && dt.bits == 32) return DType::i32;
    if (dt.lanes == 1 && dt.code == uint8_t(C::Int) && dt.bits == 64) return DType::i64;
    throw nb::type_error(("cu_seqlens: expected dtype int32 or int64, got " + dlpack_dtype_name(dt)).c_str());
  }
  if (dt.lanes == 1) {
    if (dt.code == uint8_t(C::Float) && dt.bits == 32) return DType::f32;
    if (dt.code == uint8_t(C::Float) && dt.bits == 64) return DType::f64;
    if (dt.code == uint8_t(C::Float) && dt.bits == 16) return DType::f16;
    if (dt.code == uint8_t(C::Bfloat) && dt.bits == 16) return DType::bf16;
    if (dt.code == uint8_t(C::Int) && dt.bits == 32) return DType::i32;
    if (dt.code == uint8_t(C::Int) && dt.bits == 64) return DType::i64;
  }
  throw nb::type_error((std::string(name) +
                        ": expected dtype float32, float64, bfloat16, float16, int32 or int64, got " +
                        dlpack_dtype_name(dt)).c_str());
}

Device to_device(const char* name, int device_type) {
  switch (device_type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory: readable from the CPU
      return Device::cpu;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return Device::cuda;
    default:
      throw nb::value_error((std::string(name) + ": arrays on DLPack device type " +
                             std::to_string(device_type) + " are not supported (expected cpu or cuda)").c_str());
  }
}

// Wraps an array in a TensorView: same memory, shape and strides (DLPack strides are in elements, as in
// TensorView). Only the rank is checked here; everything else is the C++ validation's job.
template <class Array>
TensorView view_of(const char* name, const Array& a) {
  TensorView v;
  if (a.ndim() > 4) {
    throw nb::value_error((std::string(name) + ": expected at most 4 dimensions, got " +
                           std::to_string(a.ndim())).c_str());
  }
  v.data = static_cast<char*>(a.data_handle()) + a.byte_offset();
  v.dtype = to_dtype(name, a.dtype());
  v.device = to_device(name, a.device_type());
  v.ndim = int(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = int64_t(a.shape(i));
    v.stride[i] = a.stride(i);
  }
  return v;
}

template <class Array>
TensorView opt_view(const char* name, const std::optional<Array>& a) {
  return a ? view_of(name, *a) : TensorView{};
}

Backend to_backend(int b) {
  if (b < 0 || b > 3) {
    throw nb::value_error(("backend: expected 0 (automatic), 1 (oracle), 2 (cpu) or 3 (cuda), got " +
                           std::to_string(b)).c_str());
  }
  return Backend(b);
}

void* to_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

// The workspace limit of every forward / backward call from Python (PathFwdParams::workspace_limit; 0 = the
// library's default): process-wide, set with set_workspace_limit.
std::atomic<int64_t> g_workspace_limit{0};

// Fields every params struct (forward, backward, decode) has. The scale arguments use NaN for "default"
// (kDefaultScale), which Python passes as float('nan').
template <typename P>
void set_common(P& p, const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
                const OptIn& g, double scale, double gate_scale, int backend, int num_threads, uintptr_t stream) {
  p.q = view_of("q", q);
  p.k = view_of("k", k);
  p.v = view_of("v", v);
  p.w = opt_view("w", w);
  p.beta = opt_view("beta", beta);
  p.g = opt_view("g", g);
  p.scale = scale;
  p.gate_scale = gate_scale;
  p.backend = to_backend(backend);
  p.num_threads = num_threads;
  p.stream = to_stream(stream);
}

// Runs an entry point without the GIL, then turns a failed Status into the matching Python exception.
template <typename P>
void run_released(Status (*entry)(const P&), const P& p) {
  Status st;
  {
    nb::gil_scoped_release release;
    st = entry(p);
  }
  raise_status(st);
}

PathFwdParams fwd_params(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
                         const OptIn& g, const OptIn& cu_seqlens, OutArray& o, OptOut& lse, double scale,
                         double gate_scale, int backend, int num_threads, int chunk_size, bool validate,
                         uintptr_t stream) {
  PathFwdParams p;
  set_common(p, q, k, v, w, beta, g, scale, gate_scale, backend, num_threads, stream);
  p.cu_seqlens = opt_view("cu_seqlens", cu_seqlens);
  p.o = view_of("o", o);
  p.lse = opt_view("lse", lse);
  p.chunk_size = chunk_size;
  p.validate = validate;
  p.workspace_limit = g_workspace_limit.load();
  return p;
}

// The forward's checks of inputs and options (path_attn_check_inputs), made before the Python side allocates
// any output, so a bad argument is reported as such and not as a failed allocation of an enormous output.
void check_inputs(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
                  const OptIn& g, const OptIn& cu_seqlens, double scale, double gate_scale, int backend,
                  int chunk_size) {
  PathFwdParams p;
  set_common(p, q, k, v, w, beta, g, scale, gate_scale, backend, 0, 0);
  p.cu_seqlens = opt_view("cu_seqlens", cu_seqlens);
  p.chunk_size = chunk_size;
  raise_status(path_attn_check_inputs(p));
}

void fwd(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
         const OptIn& g, const OptIn& cu_seqlens, OutArray& o, OptOut& lse, double scale, double gate_scale,
         int backend, int num_threads, int chunk_size, bool validate, uintptr_t stream) {
  run_released(path_attn_fwd, fwd_params(q, k, v, w, beta, g, cu_seqlens, o, lse, scale, gate_scale, backend,
                                         num_threads, chunk_size, validate, stream));
}

void bwd(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
         const OptIn& g, const OptIn& cu_seqlens, const InArray& o, const InArray& lse, const InArray& do_,
         OutArray& dq, OutArray& dk, OutArray& dv, OptOut& dw, OptOut& dbeta, OptOut& dg, double scale,
         double gate_scale, int backend, int num_threads, int chunk_size, bool deterministic, bool validate,
         uintptr_t stream) {
  PathBwdParams p;
  set_common(p, q, k, v, w, beta, g, scale, gate_scale, backend, num_threads, stream);
  p.cu_seqlens = opt_view("cu_seqlens", cu_seqlens);
  p.o = view_of("o", o);
  p.lse = view_of("lse", lse);
  p.do_ = view_of("do", do_);
  p.dq = view_of("dq", dq);
  p.dk = view_of("dk", dk);
  p.dv = view_of("dv", dv);
  p.dw = opt_view("dw", dw);
  p.dbeta = opt_view("dbeta", dbeta);
  p.dg = opt_view("dg", dg);
  p.chunk_size = chunk_size;
  p.deterministic = deterministic;
  p.validate = validate;
  p.workspace_limit = g_workspace_limit.load();
  run_released(path_attn_bwd, p);
}

DecodeCache cache_of(OutArray& kc, OutArray& vc, OptOut& gc, OutArray& lengths) {
  DecodeCache c;
  c.kc = view_of("cache.kc", kc);
  c.vc = view_of("cache.vc", vc);
  c.gc = opt_view("cache.gc", gc);
  c.lengths = view_of("cache.lengths", lengths);
  return c;
}

void prefill(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
             const OptIn& g, const OptIn& cu_seqlens, OutArray& o, OptOut& lse, OutArray& kc, OutArray& vc,
             OptOut& gc, OutArray& lengths, double scale, double gate_scale, int backend, int num_threads,
             int chunk_size, bool validate, uintptr_t stream) {
  PathPrefillParams p;
  p.fwd = fwd_params(q, k, v, w, beta, g, cu_seqlens, o, lse, scale, gate_scale, backend, num_threads, chunk_size,
                     validate, stream);
  p.cache = cache_of(kc, vc, gc, lengths);
  run_released(path_attn_prefill, p);
}

void decode(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
            const OptIn& g, OutArray& o, OptOut& lse, OutArray& kc, OutArray& vc, OptOut& gc, OutArray& lengths,
            double scale, double gate_scale, int backend, int num_threads, uintptr_t stream) {
  PathDecodeParams p;
  set_common(p, q, k, v, w, beta, g, scale, gate_scale, backend, num_threads, stream);
  p.o = view_of("o", o);
  p.lse = opt_view("lse", lse);
  p.cache = cache_of(kc, vc, gc, lengths);
  run_released(path_attn_decode, p);
}

// The paged cache's views (pathattn/paged.h), all written by the ops; the optional ones are absent without a gate
// (g_pages) or without w (pend_w, pend_beta).
PagedCache paged_cache_of(OutArray& k_pages, OutArray& v_pages, OptOut& g_pages, OutArray& block_table,
                          OutArray& lengths, OutArray& flushed, OptOut& pend_k, OptOut& pend_w,
                          OptOut& pend_beta) {
  PagedCache c;
  c.k_pages = view_of("cache.k_pages", k_pages);
  c.v_pages = view_of("cache.v_pages", v_pages);
  c.g_pages = opt_view("cache.g_pages", g_pages);
  c.block_table = view_of("cache.block_table", block_table);
  c.lengths = view_of("cache.lengths", lengths);
  c.flushed = view_of("cache.flushed", flushed);
  c.pend_k = opt_view("cache.pend_k", pend_k);
  c.pend_w = opt_view("cache.pend_w", pend_w);
  c.pend_beta = opt_view("cache.pend_beta", pend_beta);
  return c;
}

// Prefill into chosen slots of a paged cache: the forward's o (and lse), the sequences' keys, values and gate
// sums scattered into the slots' pages. slots [num_seqs] i32 in host memory, or None for slot n = sequence n.
void paged_prefill(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
                   const OptIn& g, const OptIn& cu_seqlens, OutArray& o, OptOut& lse, OutArray& k_pages,
                   OutArray& v_pages, OptOut& g_pages, OutArray& block_table, OutArray& lengths, OutArray& flushed,
                   OptOut& pend_k, OptOut& pend_w, OptOut& pend_beta, const OptIn& slots, double scale,
                   double gate_scale, int backend, int num_threads, int chunk_size, bool validate,
                   uintptr_t stream) {
  PathPagedPrefillParams p;
  p.fwd = fwd_params(q, k, v, w, beta, g, cu_seqlens, o, lse, scale, gate_scale, backend, num_threads, chunk_size,
                     validate, stream);
  p.cache = paged_cache_of(k_pages, v_pages, g_pages, block_table, lengths, flushed, pend_k, pend_w, pend_beta);
  p.slots = opt_view("slots", slots);
  run_released(path_attn_paged_prefill, p);
}

// T tokens for every slot of a paged cache (q [N, T, HQ, K]). validate: the metadata is read and checked first
// (on the host; for CUDA a copy and a wait on the stream); off for a step captured in a CUDA graph.
void paged_decode(const InArray& q, const InArray& k, const InArray& v, const OptIn& w, const OptIn& beta,
                  const OptIn& g, OutArray& o, OptOut& lse, OutArray& k_pages, OutArray& v_pages, OptOut& g_pages,
                  OutArray& block_table, OutArray& lengths, OutArray& flushed, OptOut& pend_k, OptOut& pend_w,
                  OptOut& pend_beta, double scale, double gate_scale, bool validate, int backend, int num_threads,
                  uintptr_t stream) {
  PathPagedDecodeParams p;
  set_common(p, q, k, v, w, beta, g, scale, gate_scale, backend, num_threads, stream);
  p.o = view_of("o", o);
  p.lse = opt_view("lse", lse);
  p.cache = paged_cache_of(k_pages, v_pages, g_pages, block_table, lengths, flushed, pend_k, pend_w, pend_beta);
  p.validate = validate;
  run_released(path_attn_paged_decode, p);
}

// The w preparation op (pathattn/w_conv_norm.h): out [B, T, D] from x, the optional convolution weight [D, W] and
// bias [D], per-head L2 norm over head_dim channels.
void wcn_fwd(const InArray& x, const OptIn& weight, const OptIn& bias, const OptIn& cu_seqlens, OutArray& out,
             int64_t head_dim, bool activation, double eps, int backend, int num_threads, uintptr_t stream) {
  WConvNormFwdParams p;
  p.x = view_of("x", x);
  p.weight = opt_view("weight", weight);
  p.bias = opt_view("bias", bias);
  p.cu_seqlens = opt_view("cu_seqlens", cu_seqlens);
  p.out = view_of("out", out);
  p.head_dim = head_dim;
  p.activation = activation;
  p.eps = eps;
  p.backend = to_backend(backend);
  p.num_threads = num_threads;
  p.stream = to_stream(stream);
  run_released(pathattn::w_conv_norm_fwd, p);
}

void wcn_bwd(const InArray& x, const OptIn& weight, const OptIn& bias, const OptIn& cu_seqlens,
             const InArray& dout, OutArray& dx, OptOut& dweight, OptOut& dbias, int64_t head_dim,
             bool activation, double eps, int backend, int num_threads, uintptr_t stream) {
  WConvNormBwdParams p;
  p.x = view_of("x", x);
  p.weight = opt_view("weight", weight);
  p.bias = opt_view("bias", bias);
  p.cu_seqlens = opt_view("cu_seqlens", cu_seqlens);
  p.dout = view_of("dout", dout);
  p.dx = view_of("dx", dx);
  p.dweight = opt_view("dweight", dweight);
  p.dbias = opt_view("dbias", dbias);
  p.head_dim = head_dim;
  p.activation = activation;
  p.eps = eps;
  p.backend = to_backend(backend);
  p.num_threads = num_threads;
  p.stream = to_stream(stream);
  run_released(pathattn::w_conv_norm_bwd, p);
}

// Describes how an array arrives on the C++ side (data address, dtype, device, shape, strides), so the
// tests can check that nothing was copied on the way in.
nb::dict describe(const InArray& a) {
  TensorView v = view_of("array", a);
  nb::dict d;
  d["data"] = reinterpret_cast<uintptr_t>(v.data);
  d["dtype"] = std::string(dtype_name(v.dtype));
  d["device"] = std::string(v.device == Device::cuda ? "cuda" : "cpu");
  nb::list shape, stride;
  for (int i = 0; i < v.ndim; ++i) {
    shape.append(v.shape[i]);
    stride.append(v.stride[i]);
  }
  d["shape"] = nb::tuple(shape);
  d["stride"] = nb::tuple(stride);
  return d;
}

}  // namespace

NB_MODULE(_pathattn, m) {
  m.doc() = "pathattn C++ bindings (internal: use the pathattn package's functions)";
  nb::exception<UnavailableError>(m, "BackendUnavailableError", PyExc_RuntimeError);
  nb::exception<UnsupportedError>(m, "UnsupportedError", PyExc_NotImplementedError);

  m.def("fwd", &fwd, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(), nb::arg("beta").none(),
        nb::arg("g").none(), nb::arg("cu_seqlens").none(), nb::arg("o"), nb::arg("lse").none(),
        nb::arg("scale"), nb::arg("gate_scale"), nb::arg("backend"), nb::arg("num_threads"),
        nb::arg("chunk_size"), nb::arg("validate"), nb::arg("stream"),
        "Forward: writes o [B,T,HQ,V] (and lse [B,T,HQ] when given).");
  m.def("check_inputs", &check_inputs, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(),
        nb::arg("beta").none(), nb::arg("g").none(), nb::arg("cu_seqlens").none(), nb::arg("scale"),
        nb::arg("gate_scale"), nb::arg("backend"), nb::arg("chunk_size"),
        "The forward's checks of its inputs and options, before any output is allocated.");
  m.def("bwd", &bwd, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(), nb::arg("beta").none(),
        nb::arg("g").none(), nb::arg("cu_seqlens").none(), nb::arg("o"), nb::arg("lse"), nb::arg("do"),
        nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("dw").none(), nb::arg("dbeta").none(),
        nb::arg("dg").none(), nb::arg("scale"), nb::arg("gate_scale"), nb::arg("backend"),
        nb::arg("num_threads"), nb::arg("chunk_size"), nb::arg("deterministic"), nb::arg("validate"),
        nb::arg("stream"), "Backward: writes every gradient array given.");
  m.def("prefill", &prefill, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(),
        nb::arg("beta").none(), nb::arg("g").none(), nb::arg("cu_seqlens").none(), nb::arg("o"),
        nb::arg("lse").none(), nb::arg("kc"), nb::arg("vc"), nb::arg("gc").none(), nb::arg("lengths"),
        nb::arg("scale"), nb::arg("gate_scale"), nb::arg("backend"), nb::arg("num_threads"),
        nb::arg("chunk_size"), nb::arg("validate"), nb::arg("stream"),
        "Prefill: forward over a prompt, filling the decode cache (kc, vc, gc, lengths).");
  m.def("decode", &decode, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(),
        nb::arg("beta").none(), nb::arg("g").none(), nb::arg("o"), nb::arg("lse").none(), nb::arg("kc"),
        nb::arg("vc"), nb::arg("gc").none(), nb::arg("lengths"), nb::arg("scale"), nb::arg("gate_scale"),
        nb::arg("backend"), nb::arg("num_threads"), nb::arg("stream"),
        "One decode step for every cache slot (updates the cache in place).");
  m.def("paged_prefill", &paged_prefill, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(),
        nb::arg("beta").none(), nb::arg("g").none(), nb::arg("cu_seqlens").none(), nb::arg("o"),
        nb::arg("lse").none(), nb::arg("k_pages"), nb::arg("v_pages"), nb::arg("g_pages").none(),
        nb::arg("block_table"), nb::arg("lengths"), nb::arg("flushed"), nb::arg("pend_k").none(),
        nb::arg("pend_w").none(), nb::arg("pend_beta").none(), nb::arg("slots").none(), nb::arg("scale"),
        nb::arg("gate_scale"), nb::arg("backend"), nb::arg("num_threads"), nb::arg("chunk_size"),
        nb::arg("validate"), nb::arg("stream"),
        "Paged prefill: forward over prompts, each written into its slot of the paged cache.");
  m.def("paged_decode", &paged_decode, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("w").none(),
        nb::arg("beta").none(), nb::arg("g").none(), nb::arg("o"), nb::arg("lse").none(), nb::arg("k_pages"),
        nb::arg("v_pages"), nb::arg("g_pages").none(), nb::arg("block_table"), nb::arg("lengths"),
        nb::arg("flushed"), nb::arg("pend_k").none(), nb::arg("pend_w").none(), nb::arg("pend_beta").none(),
        nb::arg("scale"), nb::arg("gate_scale"), nb::arg("validate"), nb::arg("backend"), nb::arg("num_threads"),
        nb::arg("stream"), "T tokens for every slot of the paged cache (updates the cache in place).");
  m.def("w_conv_norm_fwd", &wcn_fwd, nb::arg("x"), nb::arg("weight").none(), nb::arg("bias").none(),
        nb::arg("cu_seqlens").none(), nb::arg("out"), nb::arg("head_dim"), nb::arg("activation"), nb::arg("eps"),
        nb::arg("backend"), nb::arg("num_threads"), nb::arg("stream"),
        "w preparation forward: short convolution, SiLU, per-head L2 norm into out [B,T,D].");
  m.def("w_conv_norm_bwd", &wcn_bwd, nb::arg("x"), nb::arg("weight").none(), nb::arg("bias").none(),
        nb::arg("cu_seqlens").none(), nb::arg("dout"), nb::arg("dx"), nb::arg("dweight").none(),
        nb::arg("dbias").none(), nb::arg("head_dim"), nb::arg("activation"), nb::arg("eps"), nb::arg("backend"),
        nb::arg("num_threads"), nb::arg("stream"), "w preparation backward: writes dx (and dweight, dbias when given).");
  m.def("set_workspace_limit", [](int64_t nbytes) { g_workspace_limit.store(nbytes); }, nb::arg("nbytes"),
        "Sets the workspace limit (bytes) of the CUDA backend's forward / backward calls that follow, process-wide: "
        "0 = the library's default, < 0 = none.");
  m.def("workspace_limit", []() { return g_workspace_limit.load(); }, "The workspace limit set_workspace_limit set.");
  m.def("build_info", &build_info, "Backends compiled into this build, e.g. 'oracle cpu'.");
  m.def("describe", &describe, nb::arg("array"),
        "How an array is seen by the C++ side: data address, dtype, device, shape, strides (in elements).");
  m.attr("DEFAULT_SCALE") = std::nan("");
  m.attr("PAGED_MAX_PENDING") = kPagedMaxPending;
}
