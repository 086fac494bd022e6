#!/usr/bin/env bash
# dev/cuda/build_variants.sh: builds the C ABI library (and test_cuda) once per patch, for A / B runs on a GPU
# machine. For each PATCH: apply it to the working tree, build the targets in BUILD_DIR, copy
# libpathattn_capi.so and test_cuda into OUT_DIR/<patch name>/, then reverse the patch; the head's own build goes
# to OUT_DIR/head/. The tree must have no uncommitted changes to the files the patches touch.
#   dev/cuda/build_variants.sh build-cuda gpu-variants dev/cuda/patches/super_bwd_prefetch.patch [...]
# A patch may carry macro settings after a colon, PATCH:MACRO=VALUE[,MACRO=VALUE]: each `#define MACRO ...` line
# of the files it touches is set to VALUE for that build (the diagnostic switches of far_diag.patch; the variant
# goes to OUT_DIR/<patch name>_MACRO_VALUE[_...]/):
#   dev/cuda/build_variants.sh build-cuda diag dev/cuda/patches/far_diag.patch:PA_FAR_DIAG=4 \
#     dev/cuda/patches/far_diag.patch:PA_QF_DIAG=1,PA_KF_DIAG=1
# Patches joined by '+' build as one variant, applied in that order (OUT_DIR/<name>+<name>/):
#   dev/cuda/build_variants.sh build-cuda gpu-variants dev/cuda/patches/a.patch+dev/cuda/patches/b.patch
# Then on the GPU machine: dev/cuda/ab_shapes.sh gpu-variants/head/libpathattn_capi.so gpu-variants/NAME/... or
# python3 dev/cuda/timeline.py --lib gpu-variants/NAME/libpathattn_capi.so (per-kernel totals of one call), or
# (diagnostic builds, whose results are wrong) the one-slice [profile] split of dev/cuda/shape.py --ws-limit-mib -1.
# Whether a variant computes the same bits: dev/cuda/shape.py --deterministic --dump head.pt with the head's library,
# then --deterministic --compare head.pt with the variant's (same shape arguments). dev/cuda/ab_variants.sh OUT_DIR
# runs that check and the palindromic timings for every variant in OUT_DIR. Where the GPU's speed drifts between
# processes, dev/cuda/ab_interleaved.py times the variants in one process, taking turns round by round.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR [PATCH[:MACRO=VALUE,...] ...]" >&2
  exit 2
fi
build=$1 out=$2
shift 2
cd "$(dirname "$0")/../.."
collect() {  # $1: variant name
  cmake --build "$build" -j "$(nproc)" --target pathattn_capi test_cuda
  mkdir -p "$out/$1"
  cp "$build/libpathattn_capi.so" "$out/$1/"
  test_bin=$(find "$build" -name test_cuda -type f -perm -u+x | head -1)
  [ -n "$test_bin" ] && cp "$test_bin" "$out/$1/"
  echo "built $out/$1"
}
restore() {  # the touched files as the patches left them, then the patches reversed, the last first
  for f in "${touched[@]}"; do cp "$originals/$f" "$f"; done
  for ((i = ${#patches[@]} - 1; i >= 0; i--)); do git apply -R "${patches[i]}"; done
  rm -rf "$originals"
}
collect head
for arg in "$@"; do
  spec=${arg%%:*} settings=""
  [ "$arg" != "$spec" ] && settings=${arg#*:}
  IFS=+ read -r -a patches <<<"$spec"
  name="" touched=() applied=()
  for patch in "${patches[@]}"; do
    name="${name:+$name+}$(basename "$patch" .patch)"
    mapfile -t -O "${#touched[@]}" touched < <(git apply --numstat "$patch" | cut -f3)
    if ! git apply "$patch"; then  # the ones applied before it reversed, the tree left as it was
      for ((i = ${#applied[@]} - 1; i >= 0; i--)); do git apply -R "${applied[i]}"; done
      exit 1
    fi
    applied+=("$patch")
  done
  mapfile -t touched < <(printf '%s\n' "${touched[@]}" | sort -u)
  # Reversing the patch needs the files as it left them: restore puts back copies taken before the settings.
  originals=$(mktemp -d)
  for f in "${touched[@]}"; do mkdir -p "$originals/$(dirname "$f")" && cp "$f" "$originals/$f"; done
  trap restore EXIT
  for kv in ${settings//,/ }; do
    sed -i "s/^#define ${kv%%=*} .*/#define ${kv%%=*} ${kv#*=}/" "${touched[@]}"
    name="${name}_${kv%%=*}_${kv#*=}"
  done
  collect "$name"
  restore
  trap - EXIT
done
cmake --build "$build" -j "$(nproc)" --target pathattn_capi test_cuda > /dev/null  # back to the head's build
