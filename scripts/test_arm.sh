#!/usr/bin/env bash
# The core library and its C++ tests (tests/cpp) cross-built for aarch64 and run under
# qemu's user-mode emulator, twice: on a NEON-only CPU (Cortex-A72) and on an SVE2 CPU
# with 256-bit vectors (qemu's "max", sve256=on), every compiled SIMD target of each
# (NEON; SVE2, SVE and NEON) through the tests' per-target loops. Installs what it needs
# from Debian 12's packages (as root, or with sudo): the cross compiler, qemu-user and
# the arm64 builds of Highway and GoogleTest (multiarch). Idempotent: packages already
# there are not touched, and build/arm64 is reused.
#
# Emulation says nothing about speed; see docs/platforms-and-performance.md, "aarch64", for what this covers.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
refresh=0
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  echo "qkv test_arm: adding the arm64 architecture to dpkg (multiarch)"
  $sudo dpkg --add-architecture arm64
  refresh=1  # apt knows no arm64 package until its lists are fetched again
fi
apt_packages=(
  g++-aarch64-linux-gnu  # the cross compiler (GCC 12, with its libgomp and libstdc++)
  qemu-user              # qemu-aarch64: runs the test programs on an x86-64 machine
  libhwy-dev:arm64       # Highway 1.0.3 for aarch64
  libgtest-dev:arm64     # GoogleTest for aarch64
  libgomp1:arm64         # OpenMP's run time where the emulated programs find it
)
missing=()
for package in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]})); then
  echo "qkv test_arm: installing ${missing[*]}"
  refresh=1
fi
if ((refresh)); then $sudo apt-get update -qq; fi
if ((${#missing[@]})); then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

cmake --preset arm64
cmake --build --preset arm64
# The presets set QEMU_CPU (the emulated CPU) and the SIMD targets each run must see.
ctest --preset arm64-neon
ctest --preset arm64-sve
