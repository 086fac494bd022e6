#!/usr/bin/env bash
# dev/cuda/limit_sweep.sh: forward and forward+backward time of benchmark shapes at several workspace limits, with
# each call's workspace high-water and the slice plans the limit gave (the forward's and the backward's, in sorted
# order), on a GPU machine.
# The limits run in palindromic order (as listed, then reversed), so that a drift of the GPU's clock shows as a
# difference between the two runs of one limit.
#   dev/cuda/limit_sweep.sh build-cuda/libpathattn_capi.so [LIMIT_MIB ...]     (default: 384 512 768 -1; -1: none)
# SHAPES (K:T pairs, default "128:4096 128:8192 64:4096") picks the shapes. A tuning switch is a second build
# (-DPATHATTN_CUDA_DEFINES="-DPATHATTN_CUDA_SUPER_MSV=0", src/cuda/heuristics.h) swept with its own LIB.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 LIB [LIMIT_MIB ...]" >&2
  exit 2
fi
lib=$1
shift
limits=("$@")
[ ${#limits[@]} -gt 0 ] || limits=(384 512 768 -1)
order=("${limits[@]}")
for ((i = ${#limits[@]} - 1; i >= 0; i--)); do order+=("${limits[i]}"); done
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for kt in ${SHAPES:-128:4096 128:8192 64:4096}; do
  k=${kt%:*} t=${kt#*:}
  for lim in "${order[@]}"; do
    # shellcheck disable=SC2086
    out=$(python3 "$here/shape.py" --lib "$lib" --K "$k" --T "$t" --check-rows 16 --ws-limit-mib "$lim" \
      2>&1 || true)
    printf "K %-3s T %-5s limit %-5s %s | %s | %s\n" "$k" "$t" "$lim" \
      "$(grep -E '^fwd ' <<<"$out" || echo "no timing (failed: rerun shape.py alone)")" \
      "$(grep -oE '^workspace high-water [0-9]+ MiB' <<<"$out" | sed 's/^workspace //')" \
      "$(grep -E '^\[slices\]' <<<"$out" | sort -u | sed 's/^\[slices\] //; s/ (limit.*//' | tr '\n' ';')"
  done
done
