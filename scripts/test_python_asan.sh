#!/usr/bin/env bash
# The property tests (tests/python/test_properties.py) against a build of the Python
# module with AddressSanitizer and UndefinedBehaviorSanitizer (QKV_SANITIZE=ON): every
# randomized call then also checks for out-of-bounds access, use after free and
# undefined behaviour in the library and the bindings. The interpreter itself is not
# instrumented, so g++'s ASan runtime is preloaded (LD_PRELOAD) before anything else.
#
#   bash scripts/test_python_asan.sh                  # build (incremental) and run
#   bash scripts/test_python_asan.sh -k cache         # extra arguments go to pytest
#
# Own build directory and virtual environment (build/python-asan/), so the ordinary
# install (scripts/test_python.sh) is left alone. Leak detection is off: CPython and
# torch keep allocations alive until exit by design. A finding aborts the run with the
# sanitizer's report (halt_on_error, -fno-sanitize-recover).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/build/python-asan"
venv="$root/venv"
python="${PYTHON:-python3}"
if [[ ! -x "$venv/bin/python" ]]; then
  # System site packages: torch, numpy, pytest, hypothesis, nanobind and scikit-build-core
  # come from the machine (scripts/test_python.sh installs them).
  "$python" -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps \
  -C build-dir="$root/{wheel_tag}" \
  -C cmake.build-type=RelWithDebInfo \
  -C cmake.define.QKV_SANITIZE=ON \
  -C cmake.define.QKV_BUILD_CLI=OFF \
  .

runtime="$(g++ -print-file-name=libasan.so)"
ubsan="$(g++ -print-file-name=libubsan.so)"
if [[ ! -e "$runtime" ]]; then
  echo "test_python_asan.sh: g++ has no libasan.so ($runtime)" >&2
  exit 1
fi
export LD_PRELOAD="$runtime:$ubsan"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# Fewer examples than CI by default: every call runs ~3x slower instrumented.
export QKV_HYPOTHESIS_EXAMPLES="${QKV_HYPOTHESIS_EXAMPLES:-40}"
cd tests/python  # import the installed (instrumented) qkv, not python/qkv
exec "$venv/bin/python" -m pytest test_properties.py -q -p no:cacheprovider "$@"
