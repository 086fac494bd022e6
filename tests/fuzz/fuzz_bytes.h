// tests/fuzz/fuzz_bytes.h: the fuzz targets' reader of their input: byte by byte, zeros once it runs out.
#pragma once

#include <cstddef>
#include <cstdint>

struct Bytes {
  const uint8_t* p;
  size_t n, i = 0;
  uint8_t next() { return i < n ? p[i++] : 0; }
  int64_t small(int64_t hi) { return int64_t(next()) % (hi + 1); }  // [0, hi]
};
