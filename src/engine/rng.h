// engine/rng.h: the engine's random numbers: a small counter-friendly generator (xoshiro256**, seeded by
// splitmix64) with our own uniform / normal / integer draws, so streams are identical across standard
// libraries and the state fits in four words (saved in checkpoints).
#pragma once

#include <cmath>
#include <cstdint>

namespace pathattn::engine {

inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Mixes several words into one seed (used to derive per-step and per-example streams from a base seed).
inline uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c = 0) {
  uint64_t x = a;
  uint64_t h = splitmix64(x);
  x = h ^ b;
  h = splitmix64(x);
  x = h ^ c;
  return splitmix64(x);
}

class Rng {
 public:
  explicit Rng(uint64_t seed = 1) {
    uint64_t x = seed;
    for (auto& w : s_) w = splitmix64(x);
  }
  uint64_t next() {
    const uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n) (n > 0); rejection-free multiply-shift, bias < 2^-32 for n < 2^32.
  uint64_t below(uint64_t n) { return uint64_t((unsigned __int128)(next()) * n >> 64); }
  // Standard normal by Box-Muller (one value per call; deterministic).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  const uint64_t* state() const { return s_; }
  void set_state(const uint64_t s[4]) {
    for (int i = 0; i < 4; ++i) s_[i] = s[i];
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace pathattn::engine
