#!/usr/bin/env bash
# scripts/setup.sh: sets up a fresh Debian 12 machine for pathattn: installs the packages
# (scripts/install_deps.sh) and builds everything in Release into build/ (library, `pathattn`, tests).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh
jobs=${PATHATTN_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
echo "setup: built build/apps/pathattn ($(./build/apps/pathattn --version))"
