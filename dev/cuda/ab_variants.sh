#!/usr/bin/env bash
# dev/cuda/ab_variants.sh: every variant that dev/cuda/build_variants.sh put in DIR (DIR/head, DIR/<name>, each
# with libpathattn_capi.so) against the head on a GPU machine, in two parts:
#   bits: dev/cuda/shape.py --deterministic --dump with the head, --compare with each variant, per configuration
#         of CMP_CONFIGS (shape.py arguments separated by ';'); prints per tensor "bitwise equal" or how far off;
#   times: forward and forward+backward ms per shape of SHAPES (K:T), the libraries in palindromic order (head,
#          v1, .., vn, vn, .., v1, head), so that a drift of the GPU's clock shows as a difference between the two
#          runs of one library. SHAPE_ARGS passes more shape.py options (e.g. "--ws-limit-mib -1"); PROFILE=1
#          also prints each run's [profile] lines (the kernels' own times).
#   dev/cuda/ab_variants.sh gpu-variants [bits|times|both]
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [bits|times|both]" >&2
  exit 2
fi
dir=$1 what=${2:-both}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -f "$dir/head/libpathattn_capi.so" ] || { echo "$dir/head/libpathattn_capi.so missing" >&2; exit 2; }
mapfile -t variants < <(find "$dir" -mindepth 1 -maxdepth 1 -type d ! -name head -printf '%f\n' | sort)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "$what" != times ]; then
  default_configs="--K 128 --T 4096 --tokens 8192 --gate;--K 64 --T 1000 --tokens 3000 --H 8 --gate"
  IFS=';' read -r -a configs <<<"${CMP_CONFIGS:-$default_configs}"
  for cfg in "${configs[@]}"; do
    echo "== bits: $cfg"
    # shellcheck disable=SC2086
    python3 "$here/shape.py" --lib "$dir/head/libpathattn_capi.so" $cfg --deterministic --no-time \
      --dump "$tmp/head.pt" > /dev/null
    for v in "${variants[@]}"; do
      # shellcheck disable=SC2086
      echo "-- $v: $(python3 "$here/shape.py" --lib "$dir/$v/libpathattn_capi.so" $cfg --deterministic --no-time \
        --compare "$tmp/head.pt" 2>&1 | grep -E '^\[compare\]' | sed 's/^\[compare\] //' | tr '\n' ';')"
    done
  done
fi
if [ "$what" != bits ]; then
  order=(head "${variants[@]}")
  for ((i = ${#variants[@]} - 1; i >= 0; i--)); do order+=("${variants[i]}"); done
  order+=(head)
  for kt in ${SHAPES:-128:4096 64:4096 128:16384}; do
    k=${kt%:*} t=${kt#*:}
    for v in "${order[@]}"; do
      # shellcheck disable=SC2086
      out=$(python3 "$here/shape.py" --lib "$dir/$v/libpathattn_capi.so" --K "$k" --T "$t" --check-rows 256 \
        ${SHAPE_ARGS:-} 2>&1 || true)
      printf "K %-3s T %-5s %-36s %s | o rel L2 %s\n" "$k" "$t" "$v" \
        "$(grep -E '^fwd ' <<<"$out" || echo "no timing (failed: rerun shape.py alone)")" \
        "$(grep -oE 'vs fp64 \(first[^)]*\) [0-9.e+-]+' <<<"$out" | awk '{print $NF}')"
      if [ -n "${PROFILE:-}" ]; then grep -E '^\[profile\]' <<<"$out" || true; fi
    done
  done
fi
