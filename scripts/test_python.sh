#!/usr/bin/env bash
# Builds, installs and tests the Python package (`import qkv`, qkv.torch) on Debian 12,
# as root (or with sudo). Idempotent: what is installed already is left alone, and
# `pip install .` reuses build/python/, so a second run recompiles only what changed.
#
#   bash scripts/test_python.sh              # everything
#   bash scripts/test_python.sh -k gradcheck # extra arguments go to pytest
#
# Python: $PYTHON, else python3 (this machine's CPython, whose pip installs packages;
# for a Debian system Python that refuses pip (PEP 668), point PYTHON at a venv's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # compiler, CMake and the C++ libraries qkv builds against

python="${PYTHON:-python3}"
pip_install=("$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore)

# torch is pinned on purpose: 2.13.0 is the CPU build that lies on this machine's disk.
# An unpinned `torch` would fetch a CUDA build of several GB. qkv itself does not
# depend on torch; only its tests (and qkv.torch users) need it.
"${pip_install[@]}" "torch==2.13.0" "numpy>=1.23" "pytest>=7"
# transformers, for tests/python/test_transformers.py (qkv.transformers), pinned to the
# release those tests were written against: 5.x routes BERT through the attention
# registry too (4.57.1 passes the decoder tests and skips the BERT ones).
"${pip_install[@]}" "transformers==5.24.0"
# NumPy's bfloat16 (qkv reads ml_dtypes.bfloat16 arrays in place; the test is skipped
# without it).
"${pip_install[@]}" "ml_dtypes>=0.4"
# Property-based tests (tests/python/test_properties.py).
"${pip_install[@]}" "hypothesis>=6"
# The build backend and its tools, installed here so that the build below can run
# without an isolated environment (which would move nanobind and force a full rebuild).
"${pip_install[@]}" "scikit-build-core>=0.10" "nanobind>=2.4" "cmake>=3.24" ninja

# QKV_WERROR=ON as in the release preset, and CMake's default compiler (c++; pip would pick
# Python's own, g++, which ccache hashes as another compiler): warnings are errors in CI's
# bindings too, and the library's objects compile with the release build's command lines,
# so ccache has them already.
"${pip_install[@]}" --no-build-isolation --config-settings=cmake.define.QKV_WERROR=ON \
  --config-settings=cmake.define.CMAKE_CXX_COMPILER=c++ .

# From the repository root, `import qkv` finds the installed package (the sources
# live in python/qkv, which is not on sys.path), so the tests test what pip installed.
"$python" -m pytest tests/python -q "$@"
