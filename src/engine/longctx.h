// engine/longctx.h: the long-context text tasks (RULER's niah and vartrack, phonebook lookup, BABILong-style
// babi): byte-level examples of a prompt (haystack with inserted records, then a question) and an answer
// span scored by exact match. Every example is a pure function of (settings, seed, a, b); docs/tasks.md
// specifies each generator byte for byte (python/pathattn/tasks.py reimplements them).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"

namespace pathattn::engine {

class Task;

// One record inserted into the haystack (a needle, an assignment, a story fact).
struct Inserted {
  int64_t offset = 0;  // byte offset of the record in the prompt
  int64_t length = 0;  // bytes (the record ends with a space)
  int64_t slot = 0;    // it stands before haystack sentence `slot` (slot == n_sentences: after the last)
};

// A generated example: the model reads prompt + answer, then `pad` zero bytes bring it to task.seq_len.
// The answer span (every byte of `answer`, its final '\n' included) is the only scored part.
struct TextExample {
  std::string prompt, answer;
  int64_t pad = 0;
  int64_t context_len = 0;    // bytes of the prompt before the question ("\nQ: ...")
  int64_t n_sentences = 0;    // haystack sentences in the context (0 for phonebook)
  std::vector<Inserted> items;  // in prompt order
};

// Whether `name` is one of the long-context text tasks (niah, vartrack, phonebook, babi).
bool is_text_task(const std::string& name);
// The example of Rng(mix_seed(seed, a, b)): training row b of step a is (train.seed, step, b), test
// example i of test set k is (task.data_seed, 500 + k, i). Throws EngineError on bad settings.
TextExample text_example(const TaskConfig& c, uint64_t seed, uint64_t a, uint64_t b);
// The engine task (bytes 0..255 as tokens) for a text task's config; checks the settings once.
std::unique_ptr<Task> make_text_task(const TaskConfig& c);
// The two haystack sources: "filler" (RULER's repeated noise) and "text" (natural prose written for this
// project). Sentences without their separating space.
const std::vector<std::string>& haystack_sentences(const std::string& kind);

}  // namespace pathattn::engine
