#!/usr/bin/env bash
# dev/cuda/build_variants.sh: builds the C ABI library (and test_cuda) once per patch, for A / B runs on a GPU
# machine. For each PATCH: apply it to the working tree, build the targets in BUILD_DIR, copy
# libpathattn_capi.so and test_cuda into OUT_DIR/<patch name>/, then reverse the patch; the head's own build goes
# to OUT_DIR/head/. The tree must have no uncommitted changes to the files the patches touch.
#   dev/cuda/build_variants.sh build-cuda gpu-variants dev/cuda/patches/super_bwd_prefetch.patch [...]
# Then on the GPU machine: dev/cuda/ab_shapes.sh gpu-variants/head/libpathattn_capi.so gpu-variants/NAME/... or
# python3 dev/cuda/timeline.py --lib gpu-variants/NAME/libpathattn_capi.so (per-kernel totals of one call).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR [PATCH ...]" >&2
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
collect head
for patch in "$@"; do
  name=$(basename "$patch" .patch)
  git apply "$patch"
  trap 'git apply -R "$patch"' EXIT
  collect "$name"
  git apply -R "$patch"
  trap - EXIT
done
cmake --build "$build" -j "$(nproc)" --target pathattn_capi test_cuda > /dev/null  # back to the head's build
