#!/usr/bin/env bash
# Install what is missing, build, run the whole test suite, then again under ASan + UBSan
# (PIPEPLAN_SANITIZERS=0 skips that second run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
# The same suite under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/).
[ "${PIPEPLAN_SANITIZERS:-1}" = 0 ] || scripts/test_sanitizers.sh
