#!/usr/bin/env bash
# Installs everything qkv needs to build and test on Debian 12 (run as root, or with
# sudo available). Idempotent: packages already present are not touched, and apt's
# package lists are only refreshed when something is missing.
set -euo pipefail

apt_packages=(
  g++ make ninja-build pkg-config
  ccache                      # compiler cache: CI and rebuilds compile only what changed
  libgtest-dev libgmock-dev   # GoogleTest
  libhwy-dev                  # Google Highway: SIMD with runtime dispatch
  libcli11-dev                # CLI11: the qkv command line
  gnuplot-nox                 # qkv explain --plot
  libopenblas-dev             # OpenBLAS: qkv::nn's GEMMs
  libopenmpi-dev openmpi-bin  # OpenMPI: qkv::dist (ring attention) and its mpiexec tests
  nlohmann-json3-dev          # nlohmann/json: safetensors headers (qkv::nn checkpoints)
)
missing=()
for package in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
# CMake ≥ 3.25 for presets v6: Debian 12's is 3.25; a newer one on PATH is fine too.
command -v cmake >/dev/null 2>&1 || missing+=(cmake)

if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "qkv setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
