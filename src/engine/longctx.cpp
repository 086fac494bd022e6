// engine/longctx.cpp: generators of the long-context text tasks niah, vartrack, phonebook and babi
// (engine/longctx.h; docs/tasks.md specifies every draw, python/pathattn/tasks.py repeats them byte for byte).
#include "engine/longctx.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "engine/rng.h"
#include "engine/tasks.h"

namespace pathattn::engine {

namespace {

constexpr int64_t kMaxLen = int64_t(1) << 20;  // task.seq_len's ceiling (the config's range)

// RULER's noise haystack, one sentence per entry.
const char* const kFiller[] = {"The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                               "There and back again."};

// Natural prose written for this project: one sentence per line; no digits, hyphens, colons, question
// marks, upper-case words, nor any name, place or object of the babi task (tests check all of this).
const char* const kProse = R"(The town sits where the river bends toward the sea, and most mornings begin with fog.
Fishing boats leave the harbor before dawn and return when the tide turns.
Along the main street there is a bakery, a small library and a shop that sells rope and nails.
The baker opens her doors early, and the smell of warm bread drifts down to the water.
Children walk to school along the old stone wall, counting the gulls that sit on it.
In winter the wind comes from the north and rattles every loose shutter in town.
In summer the hills behind the town turn yellow, and the evenings stay light until late.
The library keeps maps of the coast drawn by sailors who once lived here.
Some of those maps show islands that nobody has been able to find since.
An old lighthouse stands on the point, though its lamp has been dark for many years.
People still climb its stairs to watch storms roll in over the gray water.
The ferry crosses the bay twice a day when the weather allows it.
Farmers from the valley bring cheese, eggs and onions to the market every week.
The market fills the square with voices, carts and the barking of dogs.
A blacksmith works at the edge of town, and the ring of his hammer carries far.
He mends gates, shoes horses and sometimes makes small iron birds for the children.
The church bell is cracked, so it gives a dull note instead of a clear one.
Nobody wants to replace it, because the town has grown fond of the sound.
When the rain is heavy, the river rises and floods the lowest fields.
The water leaves behind dark soil that makes the next harvest rich.
A narrow bridge of wood and stone joins the two halves of the town.
Carts must wait their turn to cross, and drivers often talk while they wait.
Stories travel quickly here, and most of them grow a little on the way.
The schoolteacher collects these stories in a thick notebook with a green cover.
She says that one day she will write a history of the whole coast.
Her students doubt it, since the notebook only ever gets thicker.
On clear nights the sky above the bay is full of stars.
Old sailors can name most of them and tell which ones guide a boat home.
Younger people prefer to watch the lights of passing ships far out at sea.
The hills hold a forest of pine and oak where deer move quietly in the shade.
Hunters are rare now, and the deer have grown bold enough to visit the orchards.
The orchards grow pears and plums, and the fruit is sold in baskets at the square.
A painter rents a room above the bakery and paints the harbor in every season.
His pictures hang in the inn, where travelers stop to rest their horses.
The innkeeper serves fish soup, dark bread and a sharp cheese from the valley.
Travelers often stay longer than they planned, waiting for the roads to dry.
The road over the pass is steep, and snow closes it for weeks at a time.
When it opens again, the first wagon through is greeted with cheers.
Traders bring cloth, salt, tools and news from the cities beyond the mountains.
The news is usually old by the time it arrives, but people read it anyway.
Gulls follow the boats into the harbor and fight over scraps on the docks.
Cats wait patiently nearby, hoping to catch a gull that is careless.
The tide pools below the cliffs are full of crabs, shells and bright weed.
Children spend whole afternoons there, turning over stones to see what hides beneath.
Every autumn the town holds a festival to thank the sea for its fish.
Lanterns are hung along the harbor wall, and music plays until midnight.
The oldest boat in the harbor is painted blue and has a crooked mast.
Its owner refuses to sell it, saying it knows the way home by itself.
The mill by the river grinds grain for the bakery and for the farms.
Its wheel turns slowly, and in dry summers it sometimes stops altogether.
Then the miller sits on the bank and waits for rain, whistling to himself.
Letters arrive once a week with the ferry and are sorted at the inn.
A letter from far away is an event, and its news is shared by everyone.
The weather is the most common topic of talk, followed closely by fish.
Nobody here trusts a calm sea, since storms can come without warning.
Still, most people would not trade the town for any city in the world.)";

// niah keys are "adjective-noun"; phonebook names are "First Last".
const std::vector<std::string> kAdjectives = {
    "amber", "bold",  "brave", "bright", "calm",  "clever", "crisp",  "dark",   "eager", "early", "fair",
    "fancy", "gentle", "glad", "grand",  "happy", "humble", "jolly",  "keen",   "kind",  "lively", "lucky",
    "merry", "noble", "proud", "quiet",  "rapid", "silent", "steady", "swift",  "tidy",  "witty"};
const std::vector<std::string> kNouns = {
    "badger", "beetle", "canyon", "cedar",  "comet", "copper", "falcon", "ferret",  "glacier", "harbor", "heron",
    "island", "lantern", "maple", "meadow", "otter", "panther", "pebble", "pigeon", "quartz",  "raven",  "river",
    "saddle", "salmon", "spruce", "summit", "thistle", "tiger", "tulip",  "walnut", "willow",  "zebra"};
const std::vector<std::string> kFirst = {
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Grace", "Hugo", "Irene", "Jonas", "Karin",
    "Louis", "Maya",  "Nadia", "Oscar",  "Paula", "Quinn", "Rosa",  "Simon", "Tara",  "Umar",  "Vera",
    "Walter", "Xenia", "Yusuf", "Zoe",   "Anton", "Beatrix", "Cyril", "Delia", "Emil", "Fiona"};
const std::vector<std::string> kLast = {
    "Abbott", "Baxter", "Castillo", "Dunn", "Eriksen", "Fischer", "Garcia", "Holm",  "Ivanova", "Jensen", "Kowalski",
    "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quist", "Romano", "Sato", "Tanaka", "Ullmann", "Varga",
    "Weber", "Xu", "Yilmaz", "Zeller", "Alvarez", "Brennan", "Chen", "Duarte", "Engel", "Ferreira"};

// babi's world (the words of bAbI tasks 1 to 3).
const std::vector<std::string> kAgents = {"Mary", "John", "Daniel", "Sandra"};
const std::vector<std::string> kPlaces = {"bathroom", "hallway", "kitchen", "garden", "office", "bedroom"};
const std::vector<std::string> kObjects = {"football", "apple", "milk"};
const std::vector<std::string> kMoveVerbs = {"went to the", "moved to the", "journeyed to the", "travelled to the",
                                             "went back to the"};
const std::vector<std::string> kPickVerbs = {"picked up the", "got the", "grabbed the", "took the"};
const std::vector<std::string> kDropVerbs = {"dropped the", "put down the", "discarded the", "left the"};

size_t longest(const std::vector<std::string>& v) {
  size_t m = 0;
  for (const auto& s : v) m = std::max(m, s.size());
  return m;
}
std::string longest_word(const std::vector<std::string>& v) {
  for (const auto& s : v)
    if (s.size() == longest(v)) return s;
  return "";
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// The record and question texts of each task (one place, so the worst-case length checks use them too).
std::string niah_needle(const std::string& key, const std::string& value) {
  return "The special magic number for " + key + " is " + value + ". ";
}
std::string niah_question(const std::string& variant, const std::vector<std::string>& keys) {
  if (variant == "multivalue") return "What are all the special magic numbers for " + keys[0] + "?";
  if (variant == "multiquery") return "What are the special magic numbers for " + join(keys, ", ") + "?";
  return "What is the special magic number for " + keys[0] + "?";
}
std::string vt_statement(const std::string& name, const std::string& rhs) { return "VAR " + name + " = " + rhs + ". "; }
std::string vt_question(const std::string& value) { return "Which variables are assigned the value " + value + "?"; }
std::string pb_entry(const std::string& name, const std::string& number) { return name + ": " + number + "\n"; }
std::string pb_question(const std::string& name) { return "What is the number of " + name + "?"; }

// Bytes of "\nQ: question\nA: " + answer + "\n".
int64_t qa_bytes(const std::string& q, const std::string& a) { return int64_t(q.size() + a.size()) + 9; }

// Draws a number in [lo, lo + span) not in `used` (rejection), and records it.
uint64_t draw_distinct(Rng& rng, uint64_t lo, uint64_t span, std::set<uint64_t>* used) {
  for (;;) {
    const uint64_t v = lo + rng.below(span);
    if (used->insert(v).second) return v;
  }
}

std::string digits7_phone(uint64_t v) {
  const std::string s = std::to_string(v);
  return s.substr(0, 3) + "-" + s.substr(3);
}

// Lays out the context: haystack sentences from `start` (cyclic) while they fit in `budget` bytes (each
// followed by one space), the records inserted before sentence slots[i] (records of one slot in index
// order). Returns the bytes of the budget left unused (they become padding after the answer).
int64_t lay_out(const std::vector<std::string>& S, uint64_t start, int64_t budget, Rng& rng,
                const std::vector<std::string>& recs, const std::vector<double>* depths, bool ordered,
                TextExample* ex) {
  std::vector<size_t> sent;
  int64_t used = 0;
  for (size_t i = size_t(start); used + int64_t(S[i].size()) + 1 <= budget; i = (i + 1) % S.size()) {
    sent.push_back(i);
    used += int64_t(S[i].size()) + 1;
  }
  const int64_t ns = int64_t(sent.size());
  // Slots: given depths give floor(d * ns); otherwise uniform draws in [0, ns], sorted when the records
  // must keep their order (vartrack chains, babi stories).
  std::vector<int64_t> slot(recs.size());
  for (size_t i = 0; i < recs.size(); ++i) {
    if (depths && !depths->empty()) {
      const double d = (*depths)[i % depths->size()];
      slot[i] = std::min<int64_t>(ns, int64_t(std::floor(d * double(ns))));
    } else {
      slot[i] = int64_t(rng.below(uint64_t(ns + 1)));
    }
  }
  if (ordered) std::sort(slot.begin(), slot.end());
  std::vector<size_t> order(recs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return slot[a] < slot[b]; });
  std::string& p = ex->prompt;
  size_t r = 0;
  for (int64_t k = 0; k <= ns; ++k) {
    for (; r < order.size() && slot[order[r]] == k; ++r) {
      ex->items.push_back({int64_t(p.size()), int64_t(recs[order[r]].size()), k});
      p += recs[order[r]];
    }
    if (k < ns) p += S[sent[size_t(k)]] + " ";
  }
  ex->n_sentences = ns;
  ex->context_len = int64_t(p.size());
  return budget - used;
}

void finish(const std::string& q, const std::string& a, int64_t pad, TextExample* ex) {
  ex->prompt += "\nQ: " + q + "\nA: ";
  ex->answer = a + "\n";
  ex->pad = pad;
}

int seq_len(const TaskConfig& c) { return c.seq_len > 0 ? c.seq_len : default_seq_len(c.name); }

int niah_needles(const TaskConfig& c) { return c.n_needles > 0 ? c.n_needles : (c.niah_variant == "single" ? 1 : 4); }

// The longest haystack sentence plus its space: the context must hold at least one.
int64_t min_haystack(const TaskConfig& c) { return int64_t(longest(haystack_sentences(c.haystack))) + 1; }

// Worst-case bytes of everything but the haystack (records, question, answer) for the settings.
int64_t worst_fixed(const TaskConfig& c) {
  if (c.name == "niah") {
    const int n = niah_needles(c);
    const std::string key = longest_word(kAdjectives) + "-" + longest_word(kNouns), val = "9999999";
    const std::vector<std::string> keys(size_t(c.niah_variant == "multiquery" ? n : 1), key);
    const std::vector<std::string> vals(size_t(c.niah_variant == "multivalue" || c.niah_variant == "multiquery" ? n : 1), val);
    return int64_t(n) * int64_t(niah_needle(key, val).size()) + qa_bytes(niah_question(c.niah_variant, keys), join(vals, ", "));
  }
  if (c.name == "vartrack") {
    const int vars = c.n_hops + 1;
    return int64_t(c.n_chains) * vars * int64_t(vt_statement("XXXXX", "99999").size()) +
           qa_bytes(vt_question("99999"), join(std::vector<std::string>(size_t(vars), "XXXXX"), ", "));
  }
  if (c.name == "babi") {
    const int64_t fact = int64_t(longest(kAgents) + std::max(longest(kMoveVerbs), std::max(longest(kPickVerbs), longest(kDropVerbs))) +
                                 std::max(longest(kPlaces), longest(kObjects)) + 4);
    const std::string q = "Where was the " + longest_word(kObjects) + " before the " + longest_word(kPlaces) + "?";
    return int64_t(c.n_facts) * fact + qa_bytes(q, longest_word(kPlaces));
  }
  // phonebook: the entries (at least one) and the question
  const std::string name = longest_word(kFirst) + " " + longest_word(kLast);
  return int64_t(std::max(c.n_entries, 1)) * int64_t(pb_entry(name, "999-9999").size()) +
         qa_bytes(pb_question(name), "999-9999");
}

void check_settings(const TaskConfig& c) {
  const int64_t L = seq_len(c);
  if (L < 2 || L > kMaxLen)
    throw EngineError("task.seq_len: " + c.name + " needs a length in [2, " + std::to_string(kMaxLen) + "], got " +
                      std::to_string(L));
  if (!c.depths.empty() && c.name != "niah")
    throw EngineError("task.depths: only niah places its needles at given depths (got " + c.name + ")");
  if (c.name == "niah") {
    const int n = niah_needles(c);
    if (c.niah_variant == "single" && n != 1)
      throw EngineError("task.n_needles: the single variant hides one needle, got " + std::to_string(n));
    if (c.niah_variant != "single" && n < 2)
      throw EngineError("task.n_needles: the " + c.niah_variant + " variant needs at least 2 needles, got " +
                        std::to_string(n));
    if (int64_t(c.depths.size()) > n)
      throw EngineError("task.depths: " + std::to_string(c.depths.size()) + " depths for " + std::to_string(n) +
                        " needle(s)");
  }
  if (c.name == "vartrack" && int64_t(c.n_chains) > 90000)
    throw EngineError("task.n_chains: at most 90000 (one distinct five-digit value per chain)");
  if (c.name == "phonebook" && c.n_entries > int(kFirst.size() * kLast.size()))
    throw EngineError("task.n_entries: at most " + std::to_string(kFirst.size() * kLast.size()) +
                      " distinct names, got " + std::to_string(c.n_entries));
  if (c.name == "babi") {
    const int need = c.babi_task;  // qa1: a move; qa2: a move and a pick-up; qa3: a move, a pick-up, a move
    if (c.n_facts < need)
      throw EngineError("task.n_facts: babi task " + std::to_string(c.babi_task) + " needs at least " +
                        std::to_string(need) + " facts, got " + std::to_string(c.n_facts));
  }
  const int64_t fixed = worst_fixed(c);
  const int64_t hay = c.name == "phonebook" ? 0 : min_haystack(c);
  if (fixed + hay > L) {
    std::string what = c.name == "niah"       ? std::to_string(niah_needles(c)) + " needle(s)"
                       : c.name == "vartrack" ? std::to_string(c.n_chains) + " chain(s) of " + std::to_string(c.n_hops) + " hops"
                       : c.name == "babi"     ? std::to_string(c.n_facts) + " facts"
                                              : std::to_string(std::max(c.n_entries, 1)) + " entries";
    throw EngineError("task.seq_len: " + std::to_string(L) + " bytes are too short for " + what + ": the records, " +
                      "question and answer take up to " + std::to_string(fixed) + " bytes" +
                      (hay ? " and the haystack needs at least one sentence (" + std::to_string(hay) + " bytes)" : "") +
                      "; need task.seq_len >= " + std::to_string(fixed + hay));
  }
}

// ---------------------------------------------------------------------------------------------------
TextExample gen_niah(const TaskConfig& c, Rng& rng) {
  const int n = niah_needles(c);
  const int64_t L = seq_len(c);
  const bool multivalue = c.niah_variant == "multivalue";
  std::set<uint64_t> used_keys, used_vals;
  std::vector<std::string> keys, vals, recs;
  for (int i = 0; i < n; ++i) {
    if (!multivalue || i == 0) {
      for (;;) {
        const uint64_t a = rng.below(kAdjectives.size()), b = rng.below(kNouns.size());
        if (used_keys.insert(a * kNouns.size() + b).second) {
          keys.push_back(kAdjectives[a] + "-" + kNouns[b]);
          break;
        }
      }
    }
    vals.push_back(std::to_string(draw_distinct(rng, 1000000, 9000000, &used_vals)));
    recs.push_back(niah_needle(keys.back(), vals.back()));
  }
  size_t asked = 0;
  if (c.niah_variant == "multikey") asked = size_t(rng.below(uint64_t(n)));
  std::vector<std::string> qkeys = c.niah_variant == "multiquery" ? keys : std::vector<std::string>{keys[asked]};
  const std::string q = niah_question(c.niah_variant, qkeys);
  const std::string a_len = (c.niah_variant == "multivalue" || c.niah_variant == "multiquery") ? join(vals, ", ") : vals[asked];
  int64_t rec_bytes = 0;
  for (const auto& r : recs) rec_bytes += int64_t(r.size());
  const auto& S = haystack_sentences(c.haystack);
  const uint64_t start = rng.below(S.size());
  TextExample ex;
  const int64_t pad = lay_out(S, start, L - rec_bytes - qa_bytes(q, a_len), rng, recs, &c.depths, false, &ex);
  std::string a = a_len;
  if (multivalue) {  // the values in the order the context gives them
    std::vector<std::string> in_order;
    for (const Inserted& it : ex.items) {
      const std::string rec = ex.prompt.substr(size_t(it.offset), size_t(it.length));
      in_order.push_back(rec.substr(rec.size() - 9, 7));
    }
    a = join(in_order, ", ");
  }
  finish(q, a, pad, &ex);
  return ex;
}

TextExample gen_vartrack(const TaskConfig& c, Rng& rng) {
  const int64_t L = seq_len(c);
  const int vars = c.n_hops + 1;
  std::set<std::string> used_names;
  std::set<uint64_t> used_vals;
  std::vector<std::vector<std::string>> chains(size_t(c.n_chains));
  std::vector<std::string> names0;
  for (int ch = 0; ch < c.n_chains; ++ch) {
    std::vector<std::string> names;
    for (int v = 0; v < vars; ++v) {
      for (;;) {
        std::string s(5, 'A');
        for (char& x : s) x = char('A' + rng.below(26));
        if (used_names.insert(s).second) {
          names.push_back(s);
          break;
        }
      }
    }
    const std::string value = std::to_string(draw_distinct(rng, 10000, 90000, &used_vals));
    chains[size_t(ch)].push_back(vt_statement(names[0], value));
    for (int v = 1; v < vars; ++v) chains[size_t(ch)].push_back(vt_statement(names[size_t(v)], names[size_t(v - 1)]));
    if (ch == 0) names0 = names, names0.push_back(value);
  }
  // Interleave: repeatedly the next statement of a uniform chain among those with statements left.
  std::vector<std::string> recs;
  std::vector<size_t> next(chains.size(), 0), live(chains.size());
  for (size_t i = 0; i < live.size(); ++i) live[i] = i;
  while (!live.empty()) {
    const size_t j = size_t(rng.below(live.size()));
    const size_t ch = live[j];
    recs.push_back(chains[ch][next[ch]++]);
    if (next[ch] == chains[ch].size()) live.erase(live.begin() + int64_t(j));
  }
  const std::string value = names0.back();
  names0.pop_back();
  const std::string q = vt_question(value), a = join(names0, ", ");
  int64_t rec_bytes = 0;
  for (const auto& r : recs) rec_bytes += int64_t(r.size());
  const auto& S = haystack_sentences(c.haystack);
  const uint64_t start = rng.below(S.size());
  TextExample ex;
  const int64_t pad = lay_out(S, start, L - rec_bytes - qa_bytes(q, a), rng, recs, nullptr, true, &ex);
  finish(q, a, pad, &ex);
  return ex;
}

TextExample gen_phonebook(const TaskConfig& c, Rng& rng) {
  const int64_t L = seq_len(c);
  const std::string wname = longest_word(kFirst) + " " + longest_word(kLast);
  const int64_t room = L - qa_bytes(pb_question(wname), "999-9999");  // for the entries
  const uint64_t pool = kFirst.size() * kLast.size();
  std::set<uint64_t> used_names, used_nums;
  std::vector<std::string> names, nums;
  TextExample ex;
  for (int64_t used = 0;;) {
    if (c.n_entries > 0 && int64_t(names.size()) == c.n_entries) break;
    if (used_names.size() == pool) break;
    uint64_t id;
    do id = rng.below(kFirst.size()) * kLast.size() + rng.below(kLast.size());
    while (!used_names.insert(id).second);
    const std::string name = kFirst[id / kLast.size()] + " " + kLast[id % kLast.size()];
    const std::string num = digits7_phone(draw_distinct(rng, 1000000, 9000000, &used_nums));
    const std::string e = pb_entry(name, num);
    if (c.n_entries == 0 && used + int64_t(e.size()) > room) break;  // fill mode: the first that does not fit ends it
    ex.items.push_back({int64_t(ex.prompt.size()), int64_t(e.size()), int64_t(names.size())});
    ex.prompt += e;
    used += int64_t(e.size());
    names.push_back(name);
    nums.push_back(num);
  }
  const size_t q = size_t(rng.below(names.size()));
  ex.context_len = int64_t(ex.prompt.size());
  const std::string qs = pb_question(names[q]);
  finish(qs, nums[q], L - ex.context_len - qa_bytes(qs, nums[q]), &ex);
  return ex;
}

// bAbI world simulation (tasks 1 to 3); returns false when the story admits no question of the task.
bool babi_story(const TaskConfig& c, Rng& rng, std::vector<std::string>* facts, std::string* q, std::string* a) {
  const size_t NA = kAgents.size(), NO = kObjects.size();
  std::vector<int> aloc(NA, -1), holder(NO, -1), oloc(NO, -1);
  std::vector<std::vector<int>> hist(NO);
  auto set_loc = [&](size_t o, int l) {
    oloc[o] = l;
    if (hist[o].empty() || hist[o].back() != l) hist[o].push_back(l);
  };
  facts->clear();
  for (int f = 0; f < c.n_facts; ++f) {
    const size_t ag = size_t(rng.below(NA));
    int kind = 0;  // 0 move, 1 pick up, 2 drop
    size_t obj = 0;
    if (c.babi_task >= 2) {
      const uint64_t r = rng.below(10);
      std::vector<size_t> cand;
      if (r == 6 || r == 7) {
        for (size_t o = 0; o < NO; ++o)
          if (holder[o] < 0 && aloc[ag] >= 0 && (oloc[o] < 0 || oloc[o] == aloc[ag])) cand.push_back(o);
        if (!cand.empty()) kind = 1;
      } else if (r >= 8) {
        for (size_t o = 0; o < NO; ++o)
          if (holder[o] == int(ag)) cand.push_back(o);
        if (!cand.empty()) kind = 2;
      }
      if (kind) obj = cand[size_t(rng.below(cand.size()))];
    }
    if (kind == 0) {
      int l;
      if (aloc[ag] < 0) l = int(rng.below(kPlaces.size()));
      else {
        l = int(rng.below(kPlaces.size() - 1));
        if (l >= aloc[ag]) ++l;
      }
      const size_t v = size_t(rng.below(kMoveVerbs.size()));
      facts->push_back(kAgents[ag] + " " + kMoveVerbs[v] + " " + kPlaces[size_t(l)] + ". ");
      aloc[ag] = l;
      for (size_t o = 0; o < NO; ++o)
        if (holder[o] == int(ag)) set_loc(o, l);
    } else if (kind == 1) {
      const size_t v = size_t(rng.below(kPickVerbs.size()));
      facts->push_back(kAgents[ag] + " " + kPickVerbs[v] + " " + kObjects[obj] + ". ");
      holder[obj] = int(ag);
      set_loc(obj, aloc[ag]);
    } else {
      const size_t v = size_t(rng.below(kDropVerbs.size()));
      facts->push_back(kAgents[ag] + " " + kDropVerbs[v] + " " + kObjects[obj] + ". ");
      holder[obj] = -1;
    }
  }
  std::vector<size_t> cand;
  if (c.babi_task == 1) {
    for (size_t i = 0; i < NA; ++i)
      if (aloc[i] >= 0) cand.push_back(i);
  } else {
    for (size_t o = 0; o < NO; ++o) {
      const auto& h = hist[o];
      if (c.babi_task == 2 ? oloc[o] >= 0
                           : h.size() >= 2 && std::find(h.begin(), h.end() - 1, h.back()) == h.end() - 1)
        cand.push_back(o);
    }
  }
  if (cand.empty()) return false;
  const size_t x = cand[size_t(rng.below(cand.size()))];
  if (c.babi_task == 1) {
    *q = "Where is " + kAgents[x] + "?";
    *a = kPlaces[size_t(aloc[x])];
  } else if (c.babi_task == 2) {
    *q = "Where is the " + kObjects[x] + "?";
    *a = kPlaces[size_t(oloc[x])];
  } else {
    const auto& h = hist[x];
    *q = "Where was the " + kObjects[x] + " before the " + kPlaces[size_t(h.back())] + "?";
    *a = kPlaces[size_t(h[h.size() - 2])];
  }
  return true;
}

constexpr int kBabiAttempts = 1000;

TextExample gen_babi(const TaskConfig& c, Rng& rng) {
  const int64_t L = seq_len(c);
  std::vector<std::string> facts;
  std::string q, a;
  int attempt = 0;
  while (!babi_story(c, rng, &facts, &q, &a))
    if (++attempt == kBabiAttempts)
      throw EngineError("task.n_facts: " + std::to_string(kBabiAttempts) + " stories of " + std::to_string(c.n_facts) +
                        " facts gave no question of babi task " + std::to_string(c.babi_task) + "; use more facts");
  int64_t rec_bytes = 0;
  for (const auto& r : facts) rec_bytes += int64_t(r.size());
  const auto& S = haystack_sentences(c.haystack);
  const uint64_t start = rng.below(S.size());
  TextExample ex;
  const int64_t pad = lay_out(S, start, L - rec_bytes - qa_bytes(q, a), rng, facts, nullptr, true, &ex);
  finish(q, a, pad, &ex);
  return ex;
}

TextExample generate(const TaskConfig& c, Rng& rng) {
  if (c.name == "niah") return gen_niah(c, rng);
  if (c.name == "vartrack") return gen_vartrack(c, rng);
  if (c.name == "phonebook") return gen_phonebook(c, rng);
  return gen_babi(c, rng);
}

// ---------------------------------------------------------------------------------------------------
// The engine task: tokens are the bytes of prompt + answer + padding; the model reads positions 0..L-2 and
// predicts the next byte; only the answer span is scored (its first byte is predicted from the prompt's
// last). With every scored position right under teacher forcing, greedy decoding reproduces the answer
// exactly, so the evaluation's exact_match is the greedy exact-match score.
class TextTask final : public Task {
 public:
  explicit TextTask(const TaskConfig& c) : c_(c), L_(seq_len(c)) { check_settings(c_); }
  std::string name() const override { return c_.name; }
  int vocab_size() const override { return 256; }
  int64_t model_len() const override { return L_ - 1; }
  bool reports_exact_match() const override { return true; }
  std::string token_str(int32_t t) const override { return std::string(1, char(t)); }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> out;
    for (unsigned char ch : text) out.push_back(ch);
    return out;
  }
  void train_example(Rng& rng, int64_t, int32_t* tok, int32_t* tgt) const override { write(generate(c_, rng), tok, tgt); }
  std::vector<EvalSet> eval_sets() const override { return {{"test", c_.eval_sequences}}; }
  void eval_example(int set, int64_t index, int32_t* tok, int32_t* tgt) const override {
    Rng rng(mix_seed(c_.data_seed, 500 + uint64_t(set), uint64_t(index)));
    write(generate(c_, rng), tok, tgt);
  }
  void write(const TextExample& ex, int32_t* tok, int32_t* tgt) const {
    const std::string s = ex.prompt + ex.answer + std::string(size_t(ex.pad), '\0');
    const int64_t a0 = int64_t(ex.prompt.size()), a1 = a0 + int64_t(ex.answer.size());
    for (int64_t t = 0; t + 1 < L_; ++t) {
      tok[t] = int32_t((unsigned char)s[size_t(t)]);
      tgt[t] = (t + 1 >= a0 && t + 1 < a1) ? int32_t((unsigned char)s[size_t(t + 1)]) : -1;
    }
  }

 private:
  TaskConfig c_;
  int64_t L_;
};

}  // namespace

const std::vector<std::string>& haystack_sentences(const std::string& kind) {
  static const std::vector<std::string> filler(std::begin(kFiller), std::end(kFiller));
  static const std::vector<std::string> prose = [] {
    std::vector<std::string> v;
    std::istringstream in(kProse);
    for (std::string line; std::getline(in, line);) v.push_back(line);
    return v;
  }();
  if (kind == "filler") return filler;
  if (kind == "text") return prose;
  throw EngineError("task.haystack: expected filler or text, got \"" + kind + "\"");
}

bool is_text_task(const std::string& name) {
  return name == "niah" || name == "vartrack" || name == "phonebook" || name == "babi";
}

TextExample text_example(const TaskConfig& c, uint64_t seed, uint64_t a, uint64_t b) {
  if (!is_text_task(c.name)) throw EngineError("task.name: \"" + c.name + "\" is not a long-context text task");
  check_settings(c);
  Rng rng(mix_seed(seed, a, b));
  return generate(c, rng);
}

std::unique_ptr<Task> make_text_task(const TaskConfig& c) { return std::make_unique<TextTask>(c); }

}  // namespace pathattn::engine
