// engine/config.cpp: strict JSON parsing of run configs (nlohmann-json), and the config's JSON form.
// Every key is read through Section, which records the keys it saw so unknown keys are reported by name.
#include "engine/config.h"

#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

namespace pathattn::engine {

using nlohmann::json;

const char* attn_kind_name(AttnKind k) {
  switch (k) {
    case AttnKind::path: return "path";
    case AttnKind::path_fox: return "path-fox";
    case AttnKind::fox: return "fox";
    case AttnKind::rope: return "rope";
    case AttnKind::nope: return "nope";
  }
  return "?";
}

AttnKind parse_attn_kind(const std::string& s) {
  for (AttnKind k : {AttnKind::path, AttnKind::path_fox, AttnKind::fox, AttnKind::rope, AttnKind::nope})
    if (s == attn_kind_name(k)) return k;
  throw EngineError("model.attn: expected one of path, path-fox, fox, rope, nope; got \"" + s + "\"");
}

namespace {

// Reads the keys of one JSON object section, checking types; finish() rejects keys never read.
class Section {
 public:
  Section(const json& j, std::string name) : j_(j), name_(std::move(name)) {
    if (!j_.is_object()) throw EngineError(name_ + ": expected a JSON object, got " + std::string(j_.type_name()));
  }
  void get(const char* key, int* out, int64_t lo, int64_t hi) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    if (!v.is_number_integer()) fail(key, "an integer", v);
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) fail(key, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", v);
    *out = int(x);
  }
  void get(const char* key, uint64_t* out) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      fail(key, "a non-negative integer", v);
    *out = v.get<uint64_t>();
  }
  void get(const char* key, double* out, double lo, double hi, bool lo_open = false) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    if (!v.is_number()) fail(key, "a number", v);
    const double x = v.get<double>();
    if (!(x <= hi) || (lo_open ? !(x > lo) : !(x >= lo))) {
      std::ostringstream r;
      r << "a number in " << (lo_open ? "(" : "[") << lo << ", " << hi << "]";
      fail(key, r.str(), v);
    }
    *out = x;
  }
  void get(const char* key, bool* out) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    if (!v.is_boolean()) fail(key, "true or false", v);
    *out = v.get<bool>();
  }
  void get(const char* key, std::string* out, std::initializer_list<const char*> allowed) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    std::string list;
    for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    if (!v.is_string()) fail(key, "a string (one of " + list + ")", v);
    const std::string s = v.get<std::string>();
    bool ok = allowed.size() == 0;
    for (const char* a : allowed) ok = ok || s == a;
    if (!ok) fail(key, "one of " + list, v);
    *out = s;
  }
  void get(const char* key, std::vector<double>* out, double lo, double hi) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    std::ostringstream r;
    r << "an array of numbers in [" << lo << ", " << hi << "]";
    if (!v.is_array()) fail(key, r.str(), v);
    out->clear();
    for (const json& e : v) {
      if (!e.is_number() || !(e.get<double>() >= lo && e.get<double>() <= hi)) fail(key, r.str(), v);
      out->push_back(e.get<double>());
    }
  }
  void get(const char* key, std::vector<std::string>* out) {
    if (!find(key)) return;
    const json& v = j_.at(key);
    if (!v.is_array()) fail(key, "an array of strings", v);
    out->clear();
    for (const json& e : v) {
      if (!e.is_string()) fail(key, "an array of strings", v);
      out->push_back(e.get<std::string>());
    }
  }
  // The value of `key` as given (nullptr when absent), for keys with a structure of their own.
  const json* raw(const char* key) { return find(key) ? &j_.at(key) : nullptr; }
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!seen_.count(it.key())) throw EngineError(name_ + "." + it.key() + ": unknown key");
  }
  [[noreturn]] void fail(const char* key, const std::string& expected, const json& got) const {
    // replace: a string value from --set need not be UTF-8, and the message must not fail on it.
    std::string g = got.dump(-1, ' ', false, json::error_handler_t::replace);
    if (g.size() > 60) g = g.substr(0, 57) + "...";
    throw EngineError(name_ + "." + key + ": expected " + expected + ", got " + g);
  }

 private:
  bool find(const char* key) {
    seen_.insert(key);
    return j_.contains(key);
  }
  const json& j_;
  std::string name_;
  std::set<std::string> seen_;
};

void read_model(const json& j, ModelConfig* m) {
  Section s(j, "model");
  std::string attn = attn_kind_name(m->attn);
  s.get("attn", &attn, {"path", "path-fox", "fox", "rope", "nope"});
  m->attn = parse_attn_kind(attn);
  s.get("vocab_size", &m->vocab_size, 0, 1 << 20);
  s.get("d_model", &m->d_model, 8, 1 << 14);
  s.get("n_layer", &m->n_layer, 1, 256);
  s.get("n_head", &m->n_head, 1, 256);
  s.get("n_kv_head", &m->n_kv_head, 0, 256);
  s.get("head_dim", &m->head_dim, 0, 256);
  s.get("mlp_hidden", &m->mlp_hidden, 0, 1 << 16);
  s.get("tie_embeddings", &m->tie_embeddings);
  s.get("w_rank", &m->w_rank, 0, 4096);
  s.get("rope_theta", &m->rope_theta, 1.0, 1e9);
  s.get("norm_eps", &m->norm_eps, 0.0, 1.0, true);
  s.get("init_std", &m->init_std, 0.0, 10.0, true);
  s.get("gate_bias_init", &m->gate_bias_init, -100.0, 100.0);
  s.finish();
}

// The task keys of one section: the task itself, or (component = true) one entry of its mixture list.
void read_task_keys(Section& s, TaskConfig* t, bool component) {
  if (component)
    s.get("name", &t->name, {"flipflop", "a5", "mqrar", "bytes", "niah", "vartrack", "phonebook", "babi"});
  else
    s.get("name", &t->name, {"flipflop", "a5", "mqrar", "bytes", "niah", "vartrack", "phonebook", "babi", "mixture"});
  s.get("seq_len", &t->seq_len, 0, 1 << 20);
  s.get("p_train", &t->p_train, 0.0, 1.0);
  s.get("loss_on", &t->loss_on, {"read", "all"});
  s.get("eval_id", &t->eval_id, 0, 1 << 24);
  s.get("eval_sparse", &t->eval_sparse, 0, 1 << 24);
  s.get("eval_dense", &t->eval_dense, 0, 1 << 24);
  s.get("eval_sequences", &t->eval_sequences, 0, 1 << 24);
  s.get("min_len", &t->min_len, 0, 1 << 20);
  s.get("curriculum_steps", &t->curriculum_steps, 0, 1 << 30);
  s.get("n_back", &t->n_back, 1, 64);
  s.get("n_keys", &t->n_keys, 1, 4096);
  s.get("n_values", &t->n_values, 2, 4096);
  s.get("query_prob", &t->query_prob, 0.0, 1.0, true);
  s.get("files", &t->files);
  s.get("val_files", &t->val_files);
  s.get("val_fraction", &t->val_fraction, 0.0, 0.9, true);
  s.get("haystack", &t->haystack, {"filler", "text"});
  s.get("niah_variant", &t->niah_variant, {"single", "multikey", "multivalue", "multiquery"});
  s.get("n_needles", &t->n_needles, 0, 1024);
  s.get("depths", &t->depths, 0.0, 1.0);
  s.get("n_chains", &t->n_chains, 1, 1024);
  s.get("n_hops", &t->n_hops, 1, 1024);
  s.get("n_entries", &t->n_entries, 0, 1 << 20);
  s.get("babi_task", &t->babi_task, 1, 3);
  s.get("n_facts", &t->n_facts, 1, 1 << 20);
  s.get("data_seed", &t->data_seed);
  if (component) return;
  const json* mix = s.raw("mixture");
  if (!mix) return;
  if (!mix->is_array()) s.fail("mixture", "an array of task objects", *mix);
  t->mixture.clear();
  for (size_t i = 0; i < mix->size(); ++i) {
    const std::string where = "task.mixture[" + std::to_string(i) + "]";
    const json& e = (*mix)[i];
    if (!e.is_object()) throw EngineError(where + ": expected a JSON object of task keys, got " + e.type_name());
    MixtureComponent m;
    Section cs(e, where);
    cs.get("weight", &m.weight, 0.0, 1e9);
    cs.get("label", &m.label, {});
    TaskConfig probe;  // checks the keys and values now, so a bad component fails where the config is read
    read_task_keys(cs, &probe, true);
    cs.finish();
    if (!e.contains("name")) throw EngineError(where + ".name: each component names its task");
    json keys = e;
    keys.erase("weight");
    keys.erase("label");
    m.overrides = keys.dump();
    t->mixture.push_back(m);
  }
}

void read_task(const json& j, TaskConfig* t) {
  Section s(j, "task");
  read_task_keys(s, t, false);
  s.finish();
}

void read_train(const json& j, TrainConfig* t) {
  Section s(j, "train");
  s.get("steps", &t->steps, 0, 1 << 30);
  s.get("batch_size", &t->batch_size, 1, 1 << 20);
  s.get("lr", &t->lr, 0.0, 10.0, true);
  s.get("min_lr_ratio", &t->min_lr_ratio, 0.0, 1.0);
  s.get("warmup_steps", &t->warmup_steps, 0, 1 << 30);
  s.get("weight_decay", &t->weight_decay, 0.0, 10.0);
  s.get("beta1", &t->beta1, 0.0, 1.0);
  s.get("beta2", &t->beta2, 0.0, 1.0);
  s.get("adam_eps", &t->adam_eps, 0.0, 1.0, true);
  s.get("grad_clip", &t->grad_clip, 0.0, 1e9);
  s.get("seed", &t->seed);
  s.get("dtype", &t->dtype, {"f32", "f64"});
  s.get("backend", &t->backend, {"cpu", "oracle"});
  s.get("device", &t->device, {"cpu", "cuda"});
  s.get("matmul", &t->matmul, {"fp32", "tf32", "bf16"});
  bool tf32 = false;  // the key before train.matmul (checkpoints carry their configs): true reads as "tf32"
  s.get("tf32", &tf32);
  if (tf32) t->matmul = "tf32";
  s.get("threads", &t->threads, 0, 1024);
  s.get("eval_every", &t->eval_every, 0, 1 << 30);
  s.get("checkpoint_every", &t->checkpoint_every, 0, 1 << 30);
  s.get("log_every", &t->log_every, 1, 1 << 30);
  s.finish();
}

void apply(const json& j, RunConfig* c) {
  if (!j.is_object()) throw EngineError("config: expected a JSON object at the top level");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "model") read_model(it.value(), &c->model);
    else if (it.key() == "task") read_task(it.value(), &c->task);
    else if (it.key() == "train") read_train(it.value(), &c->train);
    else throw EngineError("config." + it.key() + ": unknown section (expected model, task, train)");
  }
}

}  // namespace

json parse_json_unique(const std::string& text) {
  struct Frame {
    std::set<std::string> keys;
    std::string path;
    bool object;
  };
  std::vector<Frame> stack;
  std::string key, dup;
  auto child = [&] {  // the path of the value about to start
    if (stack.empty()) return std::string();
    const Frame& f = stack.back();
    return f.object ? (f.path.empty() ? key : f.path + "." + key) : f.path + "[]";
  };
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start: stack.push_back({{}, child(), true}); break;
      case json::parse_event_t::array_start: stack.push_back({{}, child(), false}); break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key:
        key = parsed.get<std::string>();
        if (!stack.empty() && !stack.back().keys.insert(key).second && dup.empty()) dup = child();
        break;
      default: break;
    }
    return true;
  };
  json j = json::parse(text, cb);
  if (!dup.empty()) throw EngineError("duplicate key \"" + dup + "\"");
  return j;
}

// The "--set" overlay (config.h); the section and key are checked when the overlay is applied.
json overlay_from_sets(const std::vector<std::string>& sets) {
  json o = json::object();
  for (const std::string& s : sets) {
    const auto eq = s.find('='), dot = s.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq)
      throw EngineError("--set " + s + ": expected section.key=value (e.g. train.steps=200)");
    const std::string sec = s.substr(0, dot), key = s.substr(dot + 1, eq - dot - 1), val = s.substr(eq + 1);
    json v;
    try {
      v = parse_json_unique(val);
    } catch (const json::exception&) {  // not JSON (or a number beyond double's range): the text itself
      v = val;
    } catch (const EngineError& e) {
      throw EngineError("--set " + s + ": " + e.what());
    }
    if (v.is_string()) {
      try {
        (void)v.dump();  // configs are written as JSON (config.json, checkpoints): strings must be UTF-8
      } catch (const json::type_error&) {
        throw EngineError("--set " + sec + "." + key + ": the value is not valid UTF-8");
      }
    }
    if (o.contains(sec) && o[sec].contains(key))  // the later one would win silently
      throw EngineError("--set " + sec + "." + key + ": given more than once");
    o[sec][key] = v;
  }
  return o;
}

RunConfig parse_config(const json& j) {
  RunConfig c;
  apply(j, &c);
  return c;
}

RunConfig overlay_config(const RunConfig& base, const json& overlay) {
  RunConfig c = base;
  apply(overlay, &c);
  return c;
}

RunConfig parse_config_text(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = parse_json_unique(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number beyond double's range
    throw EngineError(origin + ": not valid JSON: " + e.what());
  } catch (const EngineError& e) {
    throw EngineError(origin + ": " + e.what());
  }
  try {
    return parse_config(j);
  } catch (const EngineError& e) {
    throw EngineError(origin + ": " + e.what());
  }
}

RunConfig load_config_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw EngineError(path + ": cannot open config file");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config_text(ss.str(), path);
}

json config_to_json(const RunConfig& c) {
  const ModelConfig& m = c.model;
  const TaskConfig& t = c.task;
  const TrainConfig& r = c.train;
  json j;
  j["model"] = {{"attn", attn_kind_name(m.attn)}, {"vocab_size", m.vocab_size}, {"d_model", m.d_model},
                {"n_layer", m.n_layer}, {"n_head", m.n_head}, {"n_kv_head", m.n_kv_head},
                {"head_dim", m.head_dim}, {"mlp_hidden", m.mlp_hidden}, {"tie_embeddings", m.tie_embeddings},
                {"w_rank", m.w_rank}, {"rope_theta", m.rope_theta}, {"norm_eps", m.norm_eps},
                {"init_std", m.init_std}, {"gate_bias_init", m.gate_bias_init}};
  j["task"] = {{"name", t.name}, {"seq_len", t.seq_len}, {"p_train", t.p_train}, {"loss_on", t.loss_on},
               {"eval_id", t.eval_id}, {"eval_sparse", t.eval_sparse}, {"eval_dense", t.eval_dense},
               {"eval_sequences", t.eval_sequences}, {"min_len", t.min_len},
               {"curriculum_steps", t.curriculum_steps}, {"n_back", t.n_back}, {"n_keys", t.n_keys},
               {"n_values", t.n_values}, {"query_prob", t.query_prob}, {"files", t.files},
               {"val_files", t.val_files},
               {"val_fraction", t.val_fraction}, {"haystack", t.haystack}, {"niah_variant", t.niah_variant},
               {"n_needles", t.n_needles}, {"depths", t.depths}, {"n_chains", t.n_chains}, {"n_hops", t.n_hops},
               {"n_entries", t.n_entries}, {"babi_task", t.babi_task}, {"n_facts", t.n_facts},
               {"data_seed", t.data_seed}};
  json mix = json::array();
  for (const MixtureComponent& m : t.mixture) {
    json e = json::parse(m.overrides);
    e["weight"] = m.weight;
    if (!m.label.empty()) e["label"] = m.label;
    mix.push_back(e);
  }
  j["task"]["mixture"] = mix;
  j["train"] = {{"steps", r.steps}, {"batch_size", r.batch_size}, {"lr", r.lr}, {"min_lr_ratio", r.min_lr_ratio},
                {"warmup_steps", r.warmup_steps}, {"weight_decay", r.weight_decay}, {"beta1", r.beta1},
                {"beta2", r.beta2}, {"adam_eps", r.adam_eps}, {"grad_clip", r.grad_clip}, {"seed", r.seed},
                {"dtype", r.dtype}, {"backend", r.backend}, {"device", r.device},
                {"matmul", r.matmul}, {"threads", r.threads},
                {"eval_every", r.eval_every}, {"checkpoint_every", r.checkpoint_every},
                {"log_every", r.log_every}};
  return j;
}

TaskConfig mixture_component(const TaskConfig& mix, size_t i) {
  const std::string where = "task.mixture[" + std::to_string(i) + "]";
  if (i >= mix.mixture.size())
    throw EngineError(where + ": the mixture has " + std::to_string(mix.mixture.size()) + " components");
  TaskConfig c = mix;
  c.mixture.clear();
  const json o = json::parse(mix.mixture[i].overrides);
  Section s(o, where);
  read_task_keys(s, &c, true);
  s.finish();
  return c;
}

std::string mixture_label(const TaskConfig& mix, size_t i) {
  if (i < mix.mixture.size() && !mix.mixture[i].label.empty()) return mix.mixture[i].label;
  const TaskConfig c = mixture_component(mix, i);
  if (c.name == "niah") return "niah_" + c.niah_variant;
  if (c.name == "babi") return "babi_qa" + std::to_string(c.babi_task);
  return c.name;
}

void validate_config(const RunConfig& c) {
  const ModelConfig& m = c.model;
  if (m.vocab_size < 2) throw EngineError("model.vocab_size: expected >= 2 (0 takes the task's vocab)");
  if (m.head_dim == 0 && m.d_model % m.n_head != 0)
    throw EngineError("model.d_model: must be a multiple of model.n_head when model.head_dim is 0");
  if (m.K() % 8 != 0 || m.K() > 256)
    throw EngineError("model.head_dim: the attention op needs a multiple of 8 up to 256, got " +
                      std::to_string(m.K()));
  if (m.n_head % m.H() != 0)
    throw EngineError("model.n_kv_head: must divide model.n_head (" + std::to_string(m.n_head) + ")");
  if (m.attn == AttnKind::rope && m.K() % 2 != 0) throw EngineError("model.head_dim: rope needs an even head dim");
  if (c.task.seq_len < 1) throw EngineError("task.seq_len: expected >= 1");
}

}  // namespace pathattn::engine
