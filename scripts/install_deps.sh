#!/usr/bin/env bash
# scripts/install_deps.sh: installs the Debian 12 packages pathattn builds and tests with, skipping those
# already installed (as root, or through sudo). Used by scripts/setup.sh and .ci/run.
set -euo pipefail

# C++: build tools, OpenBLAS (OpenMP build), CLI11, nlohmann-json, Google Test, Google Benchmark.
# Fuzzing (scripts/test.sh's fuzz stage): clang with libFuzzer (libclang-rt) and LLVM's OpenMP runtime.
# Python package (scripts/test_python.sh builds it with pip in a venv): the interpreter, venv and headers.
pkgs=(cmake ninja-build g++ pkg-config libopenblas-openmp-dev libcli11-dev nlohmann-json3-dev libgtest-dev
      libbenchmark-dev clang-14 libclang-rt-14-dev libomp-14-dev python3 python3-venv python3-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install_deps: all ${#pkgs[@]} packages present"
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
