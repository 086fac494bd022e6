// tests/cpp/test_engine_longctx.cpp: the long-context text tasks (engine/longctx.h). Each answer is recomputed
// from the prompt alone by an independent reader, needles sit at the requested depths, no answer leaks into
// the haystack, examples are pure functions of (settings, seed, index) and match the committed reference
// examples (tests/data/longctx_examples.json, which python/tests/test_tasks.py checks the Python port against),
// bad settings name the key, and the evaluation's exact_match counts whole answer spans.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/longctx.h"
#include "engine/model.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "engine_fixtures.h"

namespace pathattn::engine {
namespace {

using test::expect_error;

TaskConfig text_config(const std::string& name, int seq_len, const std::string& haystack = "filler") {
  TaskConfig c;
  c.name = name;
  c.seq_len = seq_len;
  c.haystack = haystack;
  return c;
}

// The settings every property test sweeps: each task and variant, both haystacks, several lengths.
std::vector<TaskConfig> sweep() {
  std::vector<TaskConfig> out;
  for (const char* hay : {"filler", "text"})
    for (int L : {600, 2000}) {
      for (const char* v : {"single", "multikey", "multivalue", "multiquery"}) {
        TaskConfig c = text_config("niah", L, hay);
        c.niah_variant = v;
        out.push_back(c);
      }
      for (int chains : {1, 3}) {
        TaskConfig c = text_config("vartrack", L, hay);
        c.n_chains = chains;
        c.n_hops = chains == 1 ? 4 : 2;
        out.push_back(c);
      }
      for (int t : {1, 2, 3}) {
        TaskConfig c = text_config("babi", L, hay);
        c.babi_task = t;
        c.n_facts = t == 3 && L >= 2000 ? 20 : 12;
        out.push_back(c);
      }
    }
  for (int n : {0, 5}) {
    TaskConfig c = text_config("phonebook", 700);
    c.n_entries = n;
    out.push_back(c);
  }
  return out;
}

std::string label(const TaskConfig& c) {
  return c.name + "/" + c.niah_variant + "/" + c.haystack + "/L" + std::to_string(c.seq_len) + "/qa" +
         std::to_string(c.babi_task) + "/chains" + std::to_string(c.n_chains);
}

// The context with the inserted records cut out: the haystack alone.
std::string haystack_of(const TextExample& ex) {
  std::string h;
  int64_t at = 0;
  for (const Inserted& it : ex.items) {
    h += ex.prompt.substr(size_t(at), size_t(it.offset - at));
    at = it.offset + it.length;
  }
  return h + ex.prompt.substr(size_t(at), size_t(ex.context_len - at));
}

std::string question_of(const TextExample& ex) {
  const std::string tail = ex.prompt.substr(size_t(ex.context_len));
  EXPECT_EQ(tail.rfind("\nQ: ", 0), 0u);
  EXPECT_EQ(tail.substr(tail.size() - 4), "\nA: ");
  return tail.substr(4, tail.size() - 8);
}

std::vector<std::string> split(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t p; (p = s.find(sep, at)) != std::string::npos; at = p + sep.size()) out.push_back(s.substr(at, p - at));
  out.push_back(s.substr(at));
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

// Independent readers: each answers the question from the prompt text alone.
std::string read_niah(const TextExample& ex) {
  static const std::regex needle("The special magic number for ([a-z]+-[a-z]+) is ([0-9]{7})\\. ");
  std::vector<std::pair<std::string, std::string>> kv;
  const std::string ctx = ex.prompt.substr(0, size_t(ex.context_len));
  for (std::sregex_iterator it(ctx.begin(), ctx.end(), needle), end; it != end; ++it)
    kv.push_back({(*it)[1].str(), (*it)[2].str()});
  const std::string q = question_of(ex);
  std::smatch m;
  auto values_of = [&](const std::string& key) {
    std::vector<std::string> v;
    for (const auto& [k, x] : kv)
      if (k == key) v.push_back(x);
    return v;
  };
  if (std::regex_match(q, m, std::regex("What is the special magic number for (.+)\\?"))) {
    const auto v = values_of(m[1].str());
    EXPECT_EQ(v.size(), 1u);
    return v.empty() ? "" : v[0];
  }
  if (std::regex_match(q, m, std::regex("What are all the special magic numbers for (.+)\\?")))
    return join(values_of(m[1].str()));
  if (std::regex_match(q, m, std::regex("What are the special magic numbers for (.+)\\?"))) {
    std::vector<std::string> out;
    for (const std::string& k : split(m[1].str(), ", ")) {
      const auto v = values_of(k);
      EXPECT_EQ(v.size(), 1u) << k;
      out.push_back(v.empty() ? "" : v[0]);
    }
    return join(out);
  }
  ADD_FAILURE() << "unrecognised question: " << q;
  return "";
}

std::string read_vartrack(const TextExample& ex) {
  static const std::regex stmt("VAR ([A-Z]{5}) = ([A-Z]{5}|[0-9]{5})\\. ");
  const std::string ctx = ex.prompt.substr(0, size_t(ex.context_len));
  std::vector<std::string> order;
  std::map<std::string, std::string> rhs;
  for (std::sregex_iterator it(ctx.begin(), ctx.end(), stmt), end; it != end; ++it) {
    EXPECT_EQ(rhs.count((*it)[1].str()), 0u) << "a variable assigned twice";
    order.push_back((*it)[1].str());
    rhs[(*it)[1].str()] = (*it)[2].str();
  }
  std::smatch m;
  const std::string q = question_of(ex);
  EXPECT_TRUE(std::regex_match(q, m, std::regex("Which variables are assigned the value ([0-9]{5})\\?"))) << q;
  std::vector<std::string> out;
  for (const std::string& v : order) {
    std::string x = v;
    for (int hop = 0; rhs.count(x) && hop < 100000; ++hop) x = rhs[x];  // follow to the constant
    if (x == m[1].str()) out.push_back(v);
  }
  return join(out);
}

std::string read_phonebook(const TextExample& ex) {
  std::map<std::string, std::string> book;
  for (const std::string& line : split(ex.prompt.substr(0, size_t(ex.context_len)), "\n")) {
    if (line.empty()) continue;
    const auto p = line.find(": ");
    EXPECT_NE(p, std::string::npos) << line;
    EXPECT_EQ(book.count(line.substr(0, p)), 0u) << "a name listed twice";
    book[line.substr(0, p)] = line.substr(p + 2);
  }
  std::smatch m;
  const std::string q = question_of(ex);
  EXPECT_TRUE(std::regex_match(q, m, std::regex("What is the number of (.+)\\?"))) << q;
  EXPECT_EQ(book.count(m[1].str()), 1u);
  return book[m[1].str()];
}

std::string read_babi(const TextExample& ex) {
  static const std::regex move("(Mary|John|Daniel|Sandra) (went to|moved to|journeyed to|travelled to|went back to) "
                               "the ([a-z]+)\\. ");
  static const std::regex pick("(Mary|John|Daniel|Sandra) (picked up|got|grabbed|took) the ([a-z]+)\\. ");
  static const std::regex drop("(Mary|John|Daniel|Sandra) (dropped|put down|discarded|left) the ([a-z]+)\\. ");
  std::map<std::string, std::string> aloc, holder, oloc;
  std::map<std::string, std::vector<std::string>> hist;
  auto place = [&](const std::string& o, const std::string& l) {
    oloc[o] = l;
    if (hist[o].empty() || hist[o].back() != l) hist[o].push_back(l);
  };
  for (const Inserted& it : ex.items) {
    const std::string f = ex.prompt.substr(size_t(it.offset), size_t(it.length));
    std::smatch m;
    if (std::regex_match(f, m, move)) {
      aloc[m[1]] = m[3];
      for (const auto& [o, h] : holder)
        if (h == m[1].str()) place(o, m[3]);
    } else if (std::regex_match(f, m, pick)) {
      EXPECT_TRUE(aloc.count(m[1])) << "a pick-up by an agent nowhere yet: " << f;
      EXPECT_FALSE(holder.count(m[3])) << "a pick-up of a held object: " << f;
      holder[m[3]] = m[1];
      place(m[3], aloc[m[1]]);
    } else if (std::regex_match(f, m, drop)) {
      EXPECT_EQ(holder[m[3]], m[1].str()) << "a drop of an object not held: " << f;
      holder.erase(m[3]);
    } else {
      ADD_FAILURE() << "unrecognised fact: " << f;
    }
  }
  std::smatch m;
  const std::string q = question_of(ex);
  if (std::regex_match(q, m, std::regex("Where is ([A-Z][a-z]+)\\?"))) return aloc.at(m[1]);
  if (std::regex_match(q, m, std::regex("Where is the ([a-z]+)\\?"))) return oloc.at(m[1]);
  if (std::regex_match(q, m, std::regex("Where was the ([a-z]+) before the ([a-z]+)\\?"))) {
    const auto& h = hist.at(m[1]);
    EXPECT_GE(h.size(), 2u);
    EXPECT_EQ(h.back(), m[2].str());
    EXPECT_EQ(std::count(h.begin(), h.end(), m[2].str()), 1) << "ambiguous: the object was there twice";
    return h[h.size() - 2];
  }
  ADD_FAILURE() << "unrecognised question: " << q;
  return "";
}

std::string read_answer(const TaskConfig& c, const TextExample& ex) {
  if (c.name == "niah") return read_niah(ex);
  if (c.name == "vartrack") return read_vartrack(ex);
  if (c.name == "phonebook") return read_phonebook(ex);
  return read_babi(ex);
}

TEST(EngineLongCtx, EveryAnswerFollowsFromThePrompt) {
  for (const TaskConfig& c : sweep()) {
    for (uint64_t i = 0; i < 40; ++i) {
      const TextExample ex = text_example(c, 7, 500, i);
      SCOPED_TRACE(label(c) + " index " + std::to_string(i));
      ASSERT_EQ(int64_t(ex.prompt.size() + ex.answer.size()) + ex.pad, c.seq_len);
      ASSERT_GE(ex.pad, 0);
      ASSERT_EQ(ex.answer.back(), '\n');
      EXPECT_EQ(read_answer(c, ex) + "\n", ex.answer);
    }
  }
}

// The haystack between the records is whole sentences of the chosen source, in cyclic order; each record
// stands after exactly `slot` of them, and slot = floor(depth * n_sentences) for given depths.
TEST(EngineLongCtx, NeedlesAtTheRequestedDepths) {
  const std::vector<double> depths = {0.0, 0.1, 0.5, 0.77, 1.0};
  for (const char* hay : {"filler", "text"})
    for (int L : {500, 3000}) {
      TaskConfig c = text_config("niah", L, hay);
      c.niah_variant = "multikey";
      c.n_needles = 5;
      c.depths = depths;
      const auto& S = haystack_sentences(hay);
      for (uint64_t i = 0; i < 20; ++i) {
        const TextExample ex = text_example(c, 3, 500, i);
        ASSERT_EQ(ex.items.size(), 5u);
        // Cut the context at the records: the pieces are sentences, counted to each record.
        std::vector<std::string> sents;
        int64_t at = 0;
        std::vector<int64_t> before;  // haystack sentences before each record
        auto take = [&](int64_t end) {
          for (const std::string& s : split(ex.prompt.substr(size_t(at), size_t(end - at)), ". "))
            if (!s.empty()) sents.push_back(s + ".");
        };
        for (const Inserted& it : ex.items) {
          take(it.offset);
          before.push_back(int64_t(sents.size()));
          at = it.offset + it.length;
        }
        take(ex.context_len);
        ASSERT_EQ(int64_t(sents.size()), ex.n_sentences);
        ASSERT_GT(ex.n_sentences, 0);
        const size_t start = size_t(std::find(S.begin(), S.end(), sents[0]) - S.begin());
        ASSERT_LT(start, S.size());
        for (size_t k = 0; k < sents.size(); ++k) ASSERT_EQ(sents[k], S[(start + k) % S.size()]);
        std::multiset<int64_t> want, got;
        for (double d : depths) want.insert(int64_t(std::floor(d * double(ex.n_sentences))));
        for (size_t r = 0; r < ex.items.size(); ++r) {
          EXPECT_EQ(before[r], ex.items[r].slot);
          got.insert(ex.items[r].slot);
        }
        EXPECT_EQ(got, want);
        // The needle at depth 0 opens the context; the one at depth 1 closes it.
        EXPECT_EQ(ex.items.front().offset, 0);
        EXPECT_EQ(ex.items.back().offset + ex.items.back().length, ex.context_len);
      }
    }
}

bool has_upper_word(const std::string& s) {
  for (size_t i = 0; i + 1 < s.size(); ++i)
    if (std::isupper((unsigned char)s[i]) && std::isupper((unsigned char)s[i + 1])) return true;
  return false;
}

// The haystack sources cannot spell a record or an answer: no digits, no hyphenated words (niah keys), no
// upper-case runs (vartrack names), none of babi's names, places or objects.
TEST(EngineLongCtx, HaystackSourcesCannotSpellAnswers) {
  const std::vector<std::string> world = {"mary",    "john",   "daniel", "sandra",   "bathroom", "hallway", "kitchen",
                                          "garden",  "office", "bedroom", "football", "apple",   "milk"};
  for (const char* hay : {"filler", "text"}) {
    const auto& S = haystack_sentences(hay);
    EXPECT_GE(S.size(), 5u);
    std::set<std::string> seen;
    for (const std::string& s : S) {
      EXPECT_TRUE(seen.insert(s).second) << "a sentence repeated: " << s;
      EXPECT_EQ(s.back(), '.') << s;
      EXPECT_EQ(s.find(". "), std::string::npos) << "two sentences in one: " << s;
      EXPECT_EQ(s.find_first_of("0123456789-:?\n\t"), std::string::npos) << s;
      EXPECT_FALSE(has_upper_word(s)) << s;
      for (unsigned char ch : s) EXPECT_TRUE(ch >= 32 && ch < 127) << s;
      std::string low = s;
      for (char& ch : low) ch = char(std::tolower((unsigned char)ch));
      for (const std::string& w : world) EXPECT_EQ(low.find(w), std::string::npos) << w << " in: " << s;
    }
  }
}

TEST(EngineLongCtx, NoAnswerInTheHaystack) {
  for (const TaskConfig& c : sweep()) {
    for (uint64_t i = 0; i < 20; ++i) {
      const TextExample ex = text_example(c, 11, 500, i);
      SCOPED_TRACE(label(c) + " index " + std::to_string(i));
      const std::string hay = haystack_of(ex);
      const std::string ans = ex.answer.substr(0, ex.answer.size() - 1);
      for (const std::string& part : split(ans, ", ")) EXPECT_EQ(hay.find(part), std::string::npos) << part;
      if (c.name == "phonebook") {
        EXPECT_TRUE(hay.empty());
        EXPECT_EQ(ex.prompt.find(ans), ex.prompt.rfind(ans)) << "the number is listed once";
      } else {
        EXPECT_EQ(hay.find_first_of("0123456789"), std::string::npos);
      }
      // Each answer part sits in the records (the needles, statements or facts), nowhere else in the context.
      for (const std::string& part : split(ans, ", ")) {
        const std::string ctx = ex.prompt.substr(0, size_t(ex.context_len));
        for (size_t p = ctx.find(part); p != std::string::npos; p = ctx.find(part, p + 1)) {
          bool inside = false;
          for (const Inserted& it : ex.items) inside = inside || (int64_t(p) >= it.offset && int64_t(p) < it.offset + it.length);
          EXPECT_TRUE(inside) << part << " at " << p;
        }
      }
    }
  }
}

// Same (settings, seed, a, b): same bytes, in every run (the reference file) and through the Task interface.
TEST(EngineLongCtx, PureFunctionOfSettingsSeedAndIndex) {
  for (const TaskConfig& c : sweep()) {
    SCOPED_TRACE(label(c));
    const TextExample a = text_example(c, 5, 9, 2), b = text_example(c, 5, 9, 2), d = text_example(c, 5, 9, 3);
    EXPECT_EQ(a.prompt, b.prompt);
    EXPECT_EQ(a.answer, b.answer);
    EXPECT_NE(a.prompt + a.answer, d.prompt + d.answer);
    TaskConfig tc = c;
    tc.eval_sequences = 3;
    const auto task = make_task(tc);
    EXPECT_EQ(task->vocab_size(), 256);
    ASSERT_EQ(task->model_len(), c.seq_len - 1);
    Batch eb, tb;
    task->eval_batch(0, 0, 3, &eb);
    task->train_batch(42, 17, 2, &tb);
    auto check = [&](const Batch& bt, int64_t row, const TextExample& ex) {
      const std::string s = ex.prompt + ex.answer + std::string(size_t(ex.pad), '\0');
      const int64_t T = bt.T, a0 = int64_t(ex.prompt.size()), a1 = a0 + int64_t(ex.answer.size());
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(bt.tokens[row * T + t], (unsigned char)s[size_t(t)]);
        const int32_t want = (t + 1 >= a0 && t + 1 < a1) ? (unsigned char)s[size_t(t + 1)] : -1;
        ASSERT_EQ(bt.targets[row * T + t], want) << "position " << t;
      }
    };
    for (int64_t i = 0; i < 3; ++i) check(eb, i, text_example(c, c.data_seed, 500, uint64_t(i)));
    check(tb, 1, text_example(c, 42, 17, 1));
  }
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

TEST(EngineLongCtx, MatchesTheReferenceExamples) {
  std::ifstream f(PATHATTN_SOURCE_DIR "/tests/data/longctx_examples.json");
  ASSERT_TRUE(f) << "tests/data/longctx_examples.json";
  const nlohmann::json ref = nlohmann::json::parse(f);
  ASSERT_GE(ref["examples"].size(), 10u);
  for (const auto& k : ref["examples"]) {
    const RunConfig rc = parse_config(nlohmann::json{{"task", k["settings"]}});
    const TextExample ex = text_example(rc.task, k["seed"], k["a"], k["b"]);
    EXPECT_EQ(ex.prompt, k["prompt"].get<std::string>()) << k["settings"].dump();
    EXPECT_EQ(ex.answer, k["answer"].get<std::string>()) << k["settings"].dump();
    EXPECT_EQ(ex.pad, k["pad"].get<int64_t>()) << k["settings"].dump();
  }
  int64_t hashed = 0;
  for (const auto& k : ref["hashes"]) {
    const RunConfig rc = parse_config(nlohmann::json{{"task", k["settings"]}});
    for (size_t i = 0; i < k["fnv1a64"].size(); ++i, ++hashed) {
      const TextExample ex = text_example(rc.task, k["seed"], k["a"], i);
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx",
                    (unsigned long long)fnv1a64(ex.prompt + ex.answer + std::string(size_t(ex.pad), '\0')));
      EXPECT_EQ(std::string(hex), k["fnv1a64"][i].get<std::string>()) << k["settings"].dump() << " index " << i;
    }
  }
  EXPECT_GE(hashed, 300);
}

TEST(EngineLongCtx, BadSettingsNameTheKey) {
  TaskConfig c = text_config("niah", 120);
  expect_error([&] { make_task(c); }, {"task.seq_len", "too short for 1 needle(s)", "need task.seq_len >="});
  c.seq_len = 2000;
  c.niah_variant = "multikey";
  c.n_needles = 200;
  expect_error([&] { make_task(c); }, {"task.seq_len", "200 needle(s)"});
  c = text_config("niah", 2000);
  c.n_needles = 3;
  expect_error([&] { make_task(c); }, {"task.n_needles", "single variant hides one needle"});
  c.niah_variant = "multivalue";
  c.n_needles = 1;
  expect_error([&] { make_task(c); }, {"task.n_needles", "at least 2"});
  c = text_config("niah", 2000);
  c.depths = {0.1, 0.2};
  expect_error([&] { make_task(c); }, {"task.depths", "2 depths for 1 needle"});
  c = text_config("vartrack", 2000);
  c.depths = {0.5};
  expect_error([&] { make_task(c); }, {"task.depths", "only niah"});
  c = text_config("vartrack", 300);
  c.n_chains = 4;
  c.n_hops = 8;
  expect_error([&] { make_task(c); }, {"task.seq_len", "4 chain(s) of 8 hops"});
  c = text_config("babi", 2000);
  c.babi_task = 3;
  c.n_facts = 2;
  expect_error([&] { make_task(c); }, {"task.n_facts", "at least 3"});
  c = text_config("phonebook", 300);
  c.n_entries = 50;
  expect_error([&] { make_task(c); }, {"task.seq_len", "50 entries"});
  c.n_entries = 5000;
  expect_error([&] { make_task(c); }, {"task.n_entries", "distinct names"});
  c = text_config("niah", (1 << 20) + 1);
  expect_error([&] { make_task(c); }, {"task.seq_len", "[2, 1048576]"});
  expect_error([] { parse_config_text(R"({"task": {"depths": [0.5, 1.5]}})", "c.json"); }, {"task.depths", "[0, 1]"});
  expect_error([] { parse_config_text(R"({"task": {"haystack": "essays"}})", "c.json"); }, {"task.haystack", "filler"});
  expect_error([] { parse_config_text(R"({"task": {"babi_task": 4}})", "c.json"); }, {"task.babi_task"});
  expect_error([] { text_example(text_config("a5", 20), 1, 2, 3); }, {"task.name", "not a long-context"});
}

// The new keys survive the config's JSON form (checkpoints and run directories store it).
TEST(EngineLongCtx, ConfigRoundTrip) {
  RunConfig c;
  c.task = text_config("niah", 4096, "text");
  c.task.niah_variant = "multiquery";
  c.task.n_needles = 3;
  c.task.depths = {0.25, 0.75};
  c.task.babi_task = 2;
  c.task.n_facts = 30;
  c.task.n_chains = 5;
  c.task.n_hops = 7;
  c.task.n_entries = 9;
  const RunConfig r = parse_config(config_to_json(c));
  EXPECT_EQ(config_to_json(r), config_to_json(c));
  EXPECT_EQ(r.task.depths, c.task.depths);
}

TEST(EngineLongCtx, ExactMatchCountsWholeSpans) {
  // Rows of 4 positions: all right; one wrong; nothing scored; a wrong unscored position.
  const int32_t targets[] = {-1, 5, 6, -1, /**/ -1, 5, 6, 7, /**/ -1, -1, -1, -1, /**/ 3, -1, -1, -1};
  const int32_t pred[] = {0, 5, 6, 9, /**/ 0, 5, 1, 7, /**/ 1, 2, 3, 4, /**/ 3, 8, 8, 8};
  int64_t scored = 0, exact = 0;
  count_exact(targets, pred, 4, 4, &scored, &exact);
  EXPECT_EQ(scored, 3);
  EXPECT_EQ(exact, 2);
  // The evaluation reports it, as the recount of its own greedy predictions gives it.
  TaskConfig tc = text_config("phonebook", 200);
  tc.eval_sequences = 13;
  const auto task = make_task(tc);
  ModelConfig mc;
  mc.vocab_size = 256;
  mc.d_model = 16;
  mc.n_head = 2;
  Model<double> m(mc);
  m.init(3);
  const nlohmann::json ev = evaluate(m, *task, 4);
  ASSERT_TRUE(ev["test"].contains("exact_match"));
  Batch b;
  task->eval_batch(0, 0, 13, &b);
  std::vector<int32_t> p(size_t(b.B * b.T));
  m.forward(b.tokens.data(), b.targets.data(), b.B, b.T, p.data());
  scored = exact = 0;
  count_exact(b.targets.data(), p.data(), b.B, b.T, &scored, &exact);
  EXPECT_EQ(scored, 13);
  EXPECT_DOUBLE_EQ(ev["test"]["exact_match"].get<double>(), double(exact) / 13.0);
}

}  // namespace
}  // namespace pathattn::engine
