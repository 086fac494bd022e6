#!/usr/bin/env bash
# dev/cuda/ab_shapes.sh: forward and forward+backward times of two builds of the C ABI library on benchmark
# shapes, in the order A B B A per shape (so that a drift of the GPU's clock shows as A != A), through
# dev/cuda/shape.py (which also checks the output against fp64). For a kernel change: build the library
# before and after, then
#   dev/cuda/ab_shapes.sh before/libpathattn_capi.so after/libpathattn_capi.so [K:T ...]
# Shapes default to 128:1024 128:16384 64:1024 64:16384. SHAPE_ARGS passes more shape.py options
# (e.g. SHAPE_ARGS="--ws-limit-mib -1" for one slice per call, the kernels' own times).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 LIB_A LIB_B [K:T ...]" >&2
  exit 2
fi
a=$1 b=$2
shift 2
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(128:1024 128:16384 64:1024 64:16384)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for kt in "${shapes[@]}"; do
  k=${kt%:*} t=${kt#*:}
  for lib in "$a" "$b" "$b" "$a"; do
    out=$(python3 "$here/shape.py" --lib "$lib" --K "$k" --T "$t" ${SHAPE_ARGS:-} 2>&1 || true)
    time=$(grep -E "^fwd " <<<"$out" || echo "no timing (failed: rerun shape.py alone)")
    err=$(grep -oE "o rel L2 vs fp64[^)]*\) [0-9.e+-]+" <<<"$out" | awk '{print $NF}' || true)
    printf "K %-3s T %-5s %-40s %s | o rel L2 %s\n" "$k" "$t" "$lib" "$time" "${err:-?}"
  done
done
