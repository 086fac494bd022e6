// engine/convert.cpp: checkpoint conversion between attention kinds (engine/convert.h).
#include "engine/convert.h"

#include <cmath>
#include <cstring>
#include <set>

#include "engine/checkpoint.h"
#include "engine/model.h"
#include "engine/optim.h"

namespace pathattn::engine {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

template <typename T>
ConvertResult convert_typed(const CheckpointInfo& ck, const std::string& in, const std::string& out,
                            const RunConfig& dst, const ConvertOptions& opt) {
  ConvertResult res;
  res.config = dst;
  Model<T> model(dst.model);
  model.init(opt.seed != 0 ? opt.seed : dst.train.seed);
  const std::string dt = std::is_same_v<T, double> ? "F64" : "F32";
  std::set<std::string> used;
  for (const ParamInfo& p : model.layout()) {
    T* x = model.params.data() + p.offset;
    auto it = ck.file.tensors.find(p.name);
    if (it != ck.file.tensors.end()) {
      const StFile::Entry& e = it->second;
      if (e.shape != p.shape)
        throw EngineError("convert: tensor \"" + p.name + "\" has shape " + shape_text(e.shape) + " in " + in +
                          " but " + shape_text(p.shape) + " in the target model (a --set changed its size?)");
      if (e.dtype != dt) throw EngineError("convert: tensor \"" + p.name + "\" is " + e.dtype + ", expected " + dt);
      std::memcpy(x, ck.file.data.data() + e.begin, size_t(e.end - e.begin));
      used.insert(p.name);
      res.carried.push_back(p.name);
      continue;
    }
    // New tensors: beta and gate start input-independent at the chosen biases; w and conv keep the draw.
    if (ends_with(p.name, "attn.wb") || ends_with(p.name, "attn.wg")) {
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(0);
    } else if (ends_with(p.name, "attn.bb")) {
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(opt.beta_bias);
    } else if (ends_with(p.name, "attn.bg")) {
      for (int64_t i = 0; i < p.numel; ++i) x[i] = T(opt.gate_bias);
    }
    res.initialised.push_back(p.name);
  }
  for (const auto& [name, e] : ck.file.tensors)
    if (name.rfind("optim.", 0) != 0 && !used.count(name)) res.dropped.push_back(name);
  AdamW<T> adam;
  adam.init(int64_t(model.params.size()));
  nlohmann::json from = {{"checkpoint", in}, {"attn", attn_kind_name(ck.config.model.attn)}, {"step", ck.step},
                         {"beta_bias", opt.beta_bias}, {"gate_bias", opt.gate_bias}};
  save_checkpoint(out, dst, model, adam, 0, {{"converted_from", from.dump()}});
  return res;
}

}  // namespace

ConvertResult convert_checkpoint(const std::string& in, const std::string& out, const ConvertOptions& opt) {
  if (out.empty()) throw EngineError("--out: give the converted checkpoint's path");
  if (out == in) throw EngineError("--out: must differ from the input checkpoint " + in);
  if (!std::isfinite(opt.beta_bias)) throw EngineError("--beta-bias: expected a finite number");
  if (!std::isfinite(opt.gate_bias)) throw EngineError("--gate-bias: expected a finite number");
  const CheckpointInfo ck = read_checkpoint(in);
  RunConfig dst = ck.config;
  try {
    dst.model.attn = parse_attn_kind(opt.attn);
  } catch (const EngineError& e) {
    throw EngineError(std::string("--attn: ") + e.what());
  }
  if (!opt.overlay.is_null()) dst = overlay_config(dst, opt.overlay);
  validate_config(dst);
  return ck.dtype == "f64" ? convert_typed<double>(ck, in, out, dst, opt)
                           : convert_typed<float>(ck, in, out, dst, opt);
}

}  // namespace pathattn::engine
