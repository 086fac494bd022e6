// engine/hf.cpp: export and import between engine checkpoints and the Hugging Face layout of PaTH models
// (engine/hf.h). One table (hf_tensors) lists every Hugging Face tensor with the engine parameter it comes
// from and how; export and import walk it in opposite directions.
#include "engine/hf.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "engine/checkpoint.h"
#include "engine/model.h"
#include "engine/optim.h"
#include "engine/run.h"
#include "engine/tasks.h"

namespace pathattn::engine {

using nlohmann::json;

namespace {

constexpr int kFlaWRank = 32;  // fla's low-rank w projection: hidden -> 32 -> H*K

// One Hugging Face tensor: `eng` holds it as [rows, cols] (row-major); copy = same element order,
// otherwise the Hugging Face tensor is columns [c0, c0 + n) of `eng`, transposed ([n, rows]).
struct HfTensor {
  std::string hf, eng;
  std::vector<int64_t> hf_shape;
  bool copy = false;
  int64_t c0 = 0, n = 0;
};

std::vector<HfTensor> hf_tensors(const ModelConfig& m) {
  const int64_t C = m.d_model, HQ = m.n_head, H = m.H(), K = m.K(), F = m.F(), Vc = m.vocab_size;
  std::vector<HfTensor> t;
  auto copy = [&](std::string hf, std::string eng, std::vector<int64_t> shape) {
    t.push_back({std::move(hf), std::move(eng), std::move(shape), true, 0, 0});
  };
  // eng [rows, cols] -> hf [n, rows] from columns [c0, c0 + n)
  auto tr = [&](std::string hf, std::string eng, int64_t rows, int64_t c0, int64_t n) {
    t.push_back({std::move(hf), std::move(eng), {n, rows}, false, c0, n});
  };
  copy("model.embeddings.weight", "wte", {Vc, C});
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string h = "model.layers." + std::to_string(l) + ".", e = "blocks." + std::to_string(l) + ".";
    copy(h + "attn_norm.weight", e + "ln1", {C});
    tr(h + "attn.q_proj.weight", e + "attn.wq", C, 0, HQ * K);
    tr(h + "attn.k_proj.weight", e + "attn.wk", C, 0, H * K);
    tr(h + "attn.v_proj.weight", e + "attn.wv", C, 0, H * K);
    if (m.w_rank > 0) {
      tr(h + "attn.w_proj.0.weight", e + "attn.ww1", C, 0, m.w_rank);
      tr(h + "attn.w_proj.1.weight", e + "attn.ww2", m.w_rank, 0, H * K);
    } else {
      tr(h + "attn.w_proj.weight", e + "attn.ww", C, 0, H * K);
    }
    copy(h + "attn.w_conv1d.weight", e + "attn.wconv", {H * K, 1, 3});  // tap s reads x[t - 2 + s] in both
    tr(h + "attn.bt_proj.weight", e + "attn.wb", C, 0, H);
    copy(h + "attn.bt_proj.bias", e + "attn.bb", {H});
    if (m.attn == AttnKind::path_fox) {
      tr(h + "attn.g_proj.weight", e + "attn.wg", C, 0, HQ);
      copy(h + "attn.g_proj.bias", e + "attn.bg", {HQ});
    }
    tr(h + "attn.o_proj.weight", e + "attn.wo", HQ * K, 0, C);
    copy(h + "mlp_norm.weight", e + "ln2", {C});
    tr(h + "mlp.gate_proj.weight", e + "mlp.wfc", C, 0, F);  // wfc's first F columns feed silu
    tr(h + "mlp.up_proj.weight", e + "mlp.wfc", C, F, F);
    tr(h + "mlp.down_proj.weight", e + "mlp.wproj", F, 0, C);
  }
  copy("model.norm.weight", "lnf", {C});
  if (!m.tie_embeddings) tr("lm_head.weight", "lm_head", C, 0, Vc);
  return t;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// A value of a BF16 / F16 / F32 / F64 tensor element as double.
double element(const uint8_t* p, const std::string& dt) {
  if (dt == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  if (dt == "F64") {
    double d;
    std::memcpy(&d, p, 8);
    return d;
  }
  const uint16_t h = uint16_t(p[0] | (p[1] << 8));
  if (dt == "BF16") {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // F16: sign, 5-bit exponent, 10-bit mantissa
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0)
    v = std::ldexp(double(m), -24);
  else if (e == 31)
    v = m ? NAN : INFINITY;
  else
    v = std::ldexp(double(m | 1024), e - 25);
  return s ? -v : v;
}

int64_t element_bytes(const std::string& dt) {
  if (dt == "F64") return 8;
  if (dt == "F32") return 4;
  if (dt == "BF16" || dt == "F16") return 2;
  return 0;
}

template <typename T>
int64_t cols_of(const Model<T>& model, const std::string& name) {
  for (const ParamInfo& p : model.layout())
    if (p.name == name) return p.shape.size() > 1 ? p.shape[1] : 1;
  throw EngineError("internal: no engine parameter \"" + name + "\"");
}

template <typename T>
void export_model(Model<T>& model, const std::string& out_dir) {
  const ModelConfig& m = model.config();
  json c = hf_config_of(m);  // checks the model fits the layout first
  std::vector<std::vector<T>> bufs;
  std::vector<StTensor> ts;
  for (const HfTensor& t : hf_tensors(m)) {
    const T* src = model.param(t.eng);
    std::vector<T> b(size_t(numel(t.hf_shape)));
    if (t.copy) {
      std::copy(src, src + b.size(), b.begin());
    } else {
      const int64_t rows = t.hf_shape[1], ecols = cols_of(model, t.eng);
      for (int64_t j = 0; j < t.n; ++j)
        for (int64_t i = 0; i < rows; ++i) b[size_t(j * rows + i)] = src[i * ecols + t.c0 + j];
    }
    bufs.push_back(std::move(b));
    ts.push_back({t.hf, std::is_same_v<T, double> ? "F64" : "F32", t.hf_shape, nullptr,
                  int64_t(bufs.back().size() * sizeof(T))});
  }
  for (size_t i = 0; i < ts.size(); ++i) ts[i].data = bufs[i].data();
  namespace fs = std::filesystem;
  fs::create_directories(out_dir);
  c["torch_dtype"] = std::is_same_v<T, double> ? "float64" : "float32";
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), ts, {{"format", "pt"}});
  const std::string cpath = (fs::path(out_dir) / "config.json").string();
  std::ofstream f(cpath);
  f << c.dump(2) << "\n";
  if (!f) throw EngineError(cpath + ": write failed");
}

template <typename T>
void import_model(const StFile& st, const std::string& where, RunConfig cfg, const std::string& checkpoint) {
  Model<T> model(cfg.model);
  std::set<std::string> used;
  for (const HfTensor& t : hf_tensors(cfg.model)) {
    auto it = st.tensors.find(t.hf);
    if (it == st.tensors.end()) throw EngineError(where + ": tensor \"" + t.hf + "\" is missing");
    const StFile::Entry& e = it->second;
    const int64_t es = element_bytes(e.dtype);
    if (es == 0)
      throw EngineError(where + ": tensor \"" + t.hf + "\" is " + e.dtype + " (expected F32, F64, BF16 or F16)");
    if (e.shape != t.hf_shape) {
      std::string got, want;
      for (int64_t d : e.shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      for (int64_t d : t.hf_shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      throw EngineError(where + ": tensor \"" + t.hf + "\" has shape [" + got + "], config.json implies [" + want +
                        "]");
    }
    used.insert(t.hf);
    const uint8_t* src = st.data.data() + e.begin;
    T* dst = model.param(t.eng);
    const int64_t n = numel(t.hf_shape);
    if (t.copy) {
      for (int64_t i = 0; i < n; ++i) dst[i] = T(element(src + i * es, e.dtype));
    } else {
      const int64_t rows = t.hf_shape[1], ecols = cols_of(model, t.eng);
      for (int64_t j = 0; j < t.n; ++j)
        for (int64_t i = 0; i < rows; ++i) dst[i * ecols + t.c0 + j] = T(element(src + (j * rows + i) * es, e.dtype));
    }
  }
  for (const auto& [name, e] : st.tensors) {
    if (used.count(name)) continue;
    if (name == "lm_head.weight" && cfg.model.tie_embeddings) {
      // a tied head saved anyway: it must be the embeddings
      const StFile::Entry& w = st.tensors.at("model.embeddings.weight");
      if (e.shape == w.shape && e.dtype == w.dtype &&
          std::memcmp(st.data.data() + e.begin, st.data.data() + w.begin, size_t(e.end - e.begin)) == 0)
        continue;
      throw EngineError(where + ": lm_head.weight differs from model.embeddings.weight, but config.json ties them "
                        "(tie_word_embeddings = true)");
    }
    throw EngineError(where + ": tensor \"" + name + "\" has no place in the model config.json describes");
  }
  AdamW<T> opt;
  opt.init(int64_t(model.params.size()));
  save_checkpoint(checkpoint, cfg, model, opt, 0);
}

json key_or(const json& j, const char* k, const json& def) { return j.contains(k) ? j[k] : def; }

}  // namespace

json hf_config_of(const ModelConfig& m) {
  if (!attn_has_path(m.attn))
    throw EngineError(std::string("model.attn: only path and path_fox models have the PaTH Hugging Face layout, got ") +
                      attn_kind_name(m.attn));
  if (m.K() * m.n_head != m.d_model)
    throw EngineError("model.head_dim: the Hugging Face layout has head_dim = d_model / n_head (" +
                      std::to_string(m.d_model / m.n_head) + "), got " + std::to_string(m.K()));
  if (m.w_rank != 0 && m.w_rank != kFlaWRank)
    throw EngineError("model.w_rank: the Hugging Face layout has a rank-32 or a full (0) w projection, got " +
                      std::to_string(m.w_rank));
  const json null_value = nullptr;
  return {{"model_type", "path_attn"},
          {"architectures", {"PaTHForCausalLM"}},
          {"vocab_size", m.vocab_size},
          {"hidden_size", m.d_model},
          {"num_hidden_layers", m.n_layer},
          {"num_heads", m.n_head},
          {"num_kv_heads", m.H()},
          {"hidden_ratio", 4},
          {"intermediate_size", m.F()},
          {"hidden_act", "swish"},
          {"norm_eps", m.norm_eps},
          {"initializer_range", m.init_std},
          {"elementwise_affine", true},
          {"tie_word_embeddings", m.tie_embeddings},
          {"use_forget_gate", m.attn == AttnKind::path_fox},
          {"use_w_shortconv", true},
          {"use_low_rank_w", m.w_rank == kFlaWRank},
          {"use_cache", true},
          {"fuse_norm", true},
          {"fuse_swiglu", true},
          {"fuse_cross_entropy", true},
          {"fuse_linear_cross_entropy", false},
          {"use_l2warp", false},
          {"attnres_block_size", null_value},
          {"pad_token_id", null_value},
          {"bos_token_id", null_value},  // the engine's tasks have no special tokens
          {"eos_token_id", null_value}};
}

ModelConfig model_config_of_hf(const json& hf) {
  const std::string w = "config.json: ";
  auto get_int = [&](const char* k, int def, bool required) -> int {
    if (!hf.contains(k) || hf[k].is_null()) {
      if (required) throw EngineError(w + std::string(k) + " is missing");
      return def;
    }
    if (!hf[k].is_number_integer() || hf[k].get<int64_t>() < 1 || hf[k].get<int64_t>() > (1 << 24))
      throw EngineError(w + std::string(k) + ": expected a positive integer, got " + hf[k].dump());
    return hf[k].get<int>();
  };
  auto get_bool = [&](const char* k, bool def) -> bool {
    const json v = key_or(hf, k, def);
    if (!v.is_boolean()) throw EngineError(w + std::string(k) + ": expected true or false, got " + v.dump());
    return v.get<bool>();
  };
  auto get_num = [&](const char* k, double def) -> double {
    const json v = key_or(hf, k, def);
    if (!v.is_number() || !(v.get<double>() > 0))
      throw EngineError(w + std::string(k) + ": expected a number > 0, got " + v.dump());
    return v.get<double>();
  };
  const json mt = key_or(hf, "model_type", json("(missing)"));
  if (mt != "path_attn") throw EngineError(w + "model_type is " + mt.dump() + ", expected \"path_attn\"");
  if (key_or(hf, "hidden_act", json("swish")) != "swish")
    throw EngineError(w + "hidden_act: the engine's MLP is SwiGLU (\"swish\"), got " + hf["hidden_act"].dump());
  if (!key_or(hf, "attnres_block_size", json(nullptr)).is_null())
    throw EngineError(w + "attnres_block_size: attention residuals have no engine counterpart");
  if (!get_bool("use_w_shortconv", true))
    throw EngineError(w + "use_w_shortconv: the engine's PaTH layer always has the w convolution");
  if (get_bool("use_qk_norm", false)) throw EngineError(w + "use_qk_norm: the engine has no q / k norm");
  ModelConfig m;
  m.d_model = get_int("hidden_size", 0, true);
  m.n_layer = get_int("num_hidden_layers", 0, true);
  m.n_head = get_int("num_heads", 0, true);
  m.n_kv_head = get_int("num_kv_heads", m.n_head, false);
  if (m.d_model % m.n_head != 0 || m.n_head % m.n_kv_head != 0)
    throw EngineError(w + "num_heads: hidden_size must be a multiple of num_heads, itself a multiple of num_kv_heads");
  m.vocab_size = get_int("vocab_size", 32000, false);
  const int ratio = get_int("hidden_ratio", 4, false);
  const int inter = 256 * ((int(int64_t(m.d_model) * ratio * 2 / 3) + 255) / 256);  // fla's default width
  m.mlp_hidden = get_int("intermediate_size", inter, false);
  m.tie_embeddings = get_bool("tie_word_embeddings", false);
  m.attn = get_bool("use_forget_gate", false) ? AttnKind::path_fox : AttnKind::path;
  m.w_rank = get_bool("use_low_rank_w", true) ? kFlaWRank : 0;
  m.norm_eps = get_num("norm_eps", 1e-6);
  m.init_std = get_num("initializer_range", 0.02);
  return m;
}

void export_hf(const std::string& checkpoint, const std::string& out_dir) {
  const CheckpointInfo ck = read_checkpoint(checkpoint);
  const auto task = make_task(ck.config.task);
  const RunConfig cfg = resolve_config(ck.config, *task);
  hf_config_of(cfg.model);  // refuse before any work
  if (ck.dtype == "f64") {
    Model<double> model(cfg.model);
    restore_checkpoint<double>(ck, model, nullptr);
    export_model(model, out_dir);
  } else {
    Model<float> model(cfg.model);
    restore_checkpoint<float>(ck, model, nullptr);
    export_model(model, out_dir);
  }
}

void import_hf(const std::string& hf_dir, const std::string& checkpoint, const RunConfig& base) {
  namespace fs = std::filesystem;
  const std::string cpath = (fs::path(hf_dir) / "config.json").string();
  std::ifstream f(cpath);
  if (!f) throw EngineError(cpath + ": cannot open (expected a Hugging Face model directory)");
  std::stringstream ss;
  ss << f.rdbuf();
  json hf;
  try {
    hf = parse_json_unique(ss.str());
  } catch (const json::exception& e) {
    throw EngineError(cpath + ": not valid JSON: " + e.what());
  }
  if (!hf.is_object()) throw EngineError(cpath + ": expected a JSON object");
  RunConfig cfg = base;
  cfg.model = model_config_of_hf(hf);
  const auto task = make_task(cfg.task);
  cfg = resolve_config(cfg, *task);
  const std::string wpath = (fs::path(hf_dir) / "model.safetensors").string();
  if (!fs::exists(wpath))
    throw EngineError(wpath + ": missing (a sharded checkpoint, model.safetensors.index.json, is not supported)");
  const StFile st = read_safetensors(wpath, /*require_checksum=*/false);
  if (cfg.train.dtype == "f64")
    import_model<double>(st, wpath, cfg, checkpoint);
  else
    import_model<float>(st, wpath, cfg, checkpoint);
}

}  // namespace pathattn::engine
