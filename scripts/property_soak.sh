#!/usr/bin/env bash
# A long run of the property tests (tests/python/test_properties.py): fresh random
# examples (seeded, so a failure can be replayed with the seed printed below) instead of
# CI's fixed ones, many more of them.
#
#   bash scripts/property_soak.sh              # 30 minutes
#   SOAK_MINUTES=5 bash scripts/property_soak.sh -k cache
#
# Runs rounds of QKV_HYPOTHESIS_EXAMPLES examples per test (default 500), each round with
# a new seed, until the time is up (a round started is finished); prints each round's seed and test counts, and stops at
# the first failure (replay: QKV_HYPOTHESIS_SEED=<seed> QKV_HYPOTHESIS_EXAMPLES=<n> pytest
# tests/python/test_properties.py). Uses the installed qkv (scripts/test_python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
minutes="${SOAK_MINUTES:-30}"
export QKV_HYPOTHESIS_EXAMPLES="${QKV_HYPOTHESIS_EXAMPLES:-500}"
deadline=$(( $(date +%s) + minutes * 60 ))
round=0
while (( $(date +%s) < deadline )); do
  round=$(( round + 1 ))
  seed="${SOAK_SEED:-$(( $(date +%s) % 1000000 + round ))}"
  remaining=$(( deadline - $(date +%s) ))
  echo "property_soak: round $round, seed $seed, $QKV_HYPOTHESIS_EXAMPLES examples per test, ${remaining}s left"
  # A round always runs to its end (a failure needs its shrinking and report), so the
  # last one may end past the deadline: size rounds with QKV_HYPOTHESIS_EXAMPLES.
  status=0
  QKV_HYPOTHESIS_SEED="$seed" "$python" -m pytest tests/python/test_properties.py -q \
    -p no:cacheprovider --hypothesis-show-statistics "$@" || status=$?
  if (( status != 0 )); then
    echo "property_soak: FAILED in round $round; replay with QKV_HYPOTHESIS_SEED=$seed"
    exit "$status"
  fi
done
echo "property_soak: $round rounds, no failure"
