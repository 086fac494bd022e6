// engine/checkpoint.cpp: safetensors writer / reader with atomic replacement and strict validation, and the
// engine checkpoint built on it (engine/checkpoint.h).
#include "engine/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace pathattn::engine {

using nlohmann::json;

namespace {

uint64_t fnv1a64(const uint8_t* p, int64_t n, uint64_t h = 0xcbf29ce484222325ull) {
  for (int64_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)x);
  return buf;
}

int64_t dtype_bytes(const std::string& dt) {
  if (dt == "F32") return 4;
  if (dt == "F64" || dt == "I64") return 8;
  if (dt == "BF16" || dt == "F16") return 2;
  return 0;
}

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw EngineError(path + ": write failed: " + std::strerror(errno));
    }
    c += w;
    n -= size_t(w);
  }
}

// A decimal integer, the whole string (std::stoll would take "12abc" or " 12").
bool parse_int64(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  int64_t x = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    x = x * 10 + (s[i] - '0');
  }
  *out = s[0] == '-' ? -x : x;
  return true;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  int64_t off = 0;
  uint64_t sum = 0xcbf29ce484222325ull;
  for (const StTensor& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.nbytes}}};
    off += t.nbytes;
    sum = fnv1a64(static_cast<const uint8_t*>(t.data), t.nbytes, sum);
  }
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["data_fnv1a64"] = hex64(sum);
  h["__metadata__"] = meta;
  std::string header = h.dump();
  while (header.size() % 8 != 0) header.push_back(' ');  // align the data section (allowed padding)
  const uint64_t hlen = header.size();
  uint8_t len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = uint8_t(hlen >> (8 * i));

  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw EngineError(tmp + ": cannot create: " + std::strerror(errno));
  try {
    write_all(fd, len_le, 8, tmp);
    write_all(fd, header.data(), header.size(), tmp);
    for (const StTensor& t : tensors) write_all(fd, t.data, size_t(t.nbytes), tmp);
    if (::fsync(fd) != 0) throw EngineError(tmp + ": fsync failed: " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw EngineError(tmp + ": close failed: " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw EngineError(path + ": rename failed: " + std::strerror(errno));
  }
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

StFile read_safetensors(const std::string& path, bool require_checksum) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw EngineError(path + ": cannot open checkpoint file");
  const int64_t size = int64_t(f.tellg());
  f.seekg(0);
  const std::string bad = path + ": not a valid safetensors file: ";
  if (size < 8) throw EngineError(bad + "only " + std::to_string(size) + " bytes (truncated or empty)");
  uint8_t len_le[8];
  f.read(reinterpret_cast<char*>(len_le), 8);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(len_le[i]) << (8 * i);
  if (hlen == 0 || hlen > uint64_t(size - 8) || hlen > (uint64_t(100) << 20))
    throw EngineError(bad + "header length " + std::to_string(hlen) + " does not fit a file of " +
                      std::to_string(size) + " bytes (truncated, corrupt, or a different format)");
  std::string header(hlen, '\0');
  f.read(header.data(), std::streamsize(hlen));
  json h;
  try {
    h = parse_json_unique(header);
  } catch (const json::exception& e) {
    throw EngineError(bad + "header is not valid JSON (corrupt file?)");
  } catch (const EngineError& e) {
    throw EngineError(bad + "header has a " + e.what());
  }
  if (!h.is_object()) throw EngineError(bad + "header is not a JSON object");
  StFile out;
  const int64_t data_size = size - 8 - int64_t(hlen);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) throw EngineError(bad + "__metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string()) throw EngineError(bad + "__metadata__." + m.key() + " is not a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = bad + "tensor \"" + name + "\": ";
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      throw EngineError(where + "needs dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) throw EngineError(where + "dtype is not a string");
    StFile::Entry en;
    en.dtype = e["dtype"].get<std::string>();
    const int64_t es = dtype_bytes(en.dtype);
    if (es == 0) throw EngineError(where + "unsupported dtype " + en.dtype + " (expected F32, F64, I64, BF16 or F16)");
    if (!e["shape"].is_array()) throw EngineError(where + "shape is not an array");
    int64_t numel = 1;
    for (const json& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t(1) << 40))
        throw EngineError(where + "shape has an invalid dimension");
      en.shape.push_back(d.get<int64_t>());
      numel *= en.shape.back();
      if (numel > (int64_t(1) << 40)) throw EngineError(where + "shape is too large");
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_integer() || !off[1].is_number_integer())
      throw EngineError(where + "data_offsets must be [begin, end]");
    en.begin = off[0].get<int64_t>();
    en.end = off[1].get<int64_t>();
    if (en.begin < 0 || en.end < en.begin || en.end > data_size)
      throw EngineError(where + "data_offsets [" + std::to_string(en.begin) + ", " + std::to_string(en.end) +
                        "] outside the " + std::to_string(data_size) + "-byte data section (truncated file?)");
    if (en.end - en.begin != numel * es)
      throw EngineError(where + "data_offsets span " + std::to_string(en.end - en.begin) + " bytes, shape " +
                        shape_str(en.shape) + " of " + en.dtype + " needs " + std::to_string(numel * es));
    ranges.push_back({en.begin, en.end});
    out.tensors[name] = std::move(en);
  }
  std::sort(ranges.begin(), ranges.end());
  int64_t pos = 0;
  for (const auto& [b, e] : ranges) {
    if (b != pos) throw EngineError(bad + "tensor data overlaps or leaves a gap at byte " + std::to_string(pos));
    pos = e;
  }
  if (pos != data_size)
    throw EngineError(bad + "the data section has " + std::to_string(data_size - pos) +
                      " trailing bytes no tensor covers");
  out.data.resize(size_t(data_size));
  f.read(reinterpret_cast<char*>(out.data.data()), std::streamsize(data_size));
  if (!f) throw EngineError(bad + "could not read the data section");
  // Required: a file without it could be edited freely. The checksum runs over the data section in order.
  auto it = out.metadata.find("data_fnv1a64");
  if (it == out.metadata.end() && !require_checksum) return out;
  if (it == out.metadata.end())
    throw EngineError(bad + "__metadata__ lacks the data checksum \"data_fnv1a64\" (every file we write has one)");
  if (hex64(fnv1a64(out.data.data(), data_size)) != it->second)
    throw EngineError(path + ": checkpoint is corrupt: tensor data checksum mismatch");
  return out;
}

template <typename T>
void save_checkpoint(const std::string& path, const RunConfig& cfg, const Model<T>& model, const AdamW<T>& opt,
                     int64_t step, const std::map<std::string, std::string>& extra) {
  const std::string dt = std::is_same_v<T, double> ? "F64" : "F32";
  std::vector<StTensor> ts;
  for (const char* prefix : {"", "optim.m.", "optim.v."}) {
    const std::vector<T>& src = prefix[0] == 0 ? model.params : (prefix[6] == 'm' ? opt.m : opt.v);
    for (const ParamInfo& p : model.layout())
      ts.push_back({prefix + p.name, dt, p.shape, src.data() + p.offset, p.numel * int64_t(sizeof(T))});
  }
  std::map<std::string, std::string> meta = extra;
  meta["format"] = kCheckpointFormat;
  meta["version"] = "1";
  meta["config"] = config_to_json(cfg).dump();
  meta["step"] = std::to_string(step);
  meta["dtype"] = std::is_same_v<T, double> ? "f64" : "f32";
  meta["adam_t"] = std::to_string(opt.t);
  write_safetensors(path, ts, meta);
}

CheckpointInfo read_checkpoint(const std::string& path) {
  CheckpointInfo info;
  info.file = read_safetensors(path);
  const auto& md = info.file.metadata;
  auto fmt = md.find("format");
  if (fmt == md.end() || fmt->second != kCheckpointFormat)
    throw EngineError(path + ": a safetensors file, but not a pathattn-engine checkpoint (metadata \"format\" is " +
                      (fmt == md.end() ? std::string("missing") : "\"" + fmt->second + "\"") + ")");
  for (const char* k : {"version", "config", "step", "dtype", "adam_t"})
    if (!md.count(k)) throw EngineError(path + ": checkpoint metadata lacks \"" + std::string(k) + "\"");
  if (md.at("version") != "1")
    throw EngineError(path + ": checkpoint version " + md.at("version") + " is not supported (expected 1)");
  info.config = parse_config_text(md.at("config"), path + " (embedded config)");
  // The counters after the checksum: the checksum covers tensor bytes only, not the header.
  if (!parse_int64(md.at("step"), &info.step))
    throw EngineError(path + ": checkpoint metadata \"step\" is not an integer: \"" + md.at("step") + "\"");
  if (info.step < 0 || info.step > info.config.train.steps)
    throw EngineError(path + ": checkpoint metadata \"step\" = " + std::to_string(info.step) +
                      " is outside [0, train.steps = " + std::to_string(info.config.train.steps) + "]");
  int64_t adam_t = 0;
  if (!parse_int64(md.at("adam_t"), &adam_t))
    throw EngineError(path + ": checkpoint metadata \"adam_t\" is not an integer: \"" + md.at("adam_t") + "\"");
  if (adam_t != info.step)  // one optimizer step per training step, from 0
    throw EngineError(path + ": checkpoint metadata \"adam_t\" = " + std::to_string(adam_t) +
                      " differs from \"step\" = " + std::to_string(info.step));
  info.dtype = md.at("dtype");
  if (info.dtype != "f32" && info.dtype != "f64") throw EngineError(path + ": checkpoint dtype must be f32 or f64");
  return info;
}

template <typename T>
void restore_checkpoint(const CheckpointInfo& info, Model<T>& model, AdamW<T>* opt) {
  const std::string dt = std::is_same_v<T, double> ? "F64" : "F32";
  auto load = [&](const std::string& name, const ParamInfo& p, T* dst) {
    auto it = info.file.tensors.find(name);
    if (it == info.file.tensors.end()) throw EngineError("checkpoint: tensor \"" + name + "\" is missing");
    const StFile::Entry& e = it->second;
    if (e.dtype != dt) throw EngineError("checkpoint: tensor \"" + name + "\" is " + e.dtype + ", expected " + dt);
    if (e.shape != p.shape)
      throw EngineError("checkpoint: tensor \"" + name + "\" has shape " + shape_str(e.shape) +
                        ", the model expects " + shape_str(p.shape));
    std::memcpy(dst, info.file.data.data() + e.begin, size_t(e.end - e.begin));
  };
  // The file's tensors must be exactly the model's parameters and their two AdamW moments: an extra one
  // means another model (e.g. a PaTH checkpoint whose config was relabelled rope has w projections).
  std::set<std::string> expected;
  for (const ParamInfo& p : model.layout())
    for (const char* prefix : {"", "optim.m.", "optim.v."}) expected.insert(prefix + p.name);
  for (const auto& [name, e] : info.file.tensors)
    if (!expected.count(name))
      throw EngineError("checkpoint: tensor \"" + name + "\" is not part of the model its config describes (model.attn = " +
                        attn_kind_name(model.config().attn) + ", " + std::to_string(model.config().n_layer) +
                        " layers): the config does not match the tensors");
  for (const ParamInfo& p : model.layout()) load(p.name, p, model.params.data() + p.offset);
  if (opt) {
    opt->init(int64_t(model.params.size()));
    for (const ParamInfo& p : model.layout()) {
      load("optim.m." + p.name, p, opt->m.data() + p.offset);
      load("optim.v." + p.name, p, opt->v.data() + p.offset);
    }
    int64_t t = 0;
    if (!parse_int64(info.file.metadata.at("adam_t"), &t) || t < 0)
      throw EngineError("checkpoint: metadata \"adam_t\" is not a non-negative integer");
    opt->t = t;
  }
}

template void save_checkpoint<float>(const std::string&, const RunConfig&, const Model<float>&, const AdamW<float>&,
                                     int64_t, const std::map<std::string, std::string>&);
template void save_checkpoint<double>(const std::string&, const RunConfig&, const Model<double>&,
                                      const AdamW<double>&, int64_t, const std::map<std::string, std::string>&);
template void restore_checkpoint<float>(const CheckpointInfo&, Model<float>&, AdamW<float>*);
template void restore_checkpoint<double>(const CheckpointInfo&, Model<double>&, AdamW<double>*);

}  // namespace pathattn::engine
