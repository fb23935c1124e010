#!/usr/bin/env bash
# Builds the test suite under AddressSanitizer + UndefinedBehaviorSanitizer into
# build-asan/ (no CUDA: the GPU code is not what the sanitizers look at) and runs it.
# Any report fails the run. Called by scripts/test.sh; PIPEPLAN_SANITIZERS=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEPLAN_WITH_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
cmake --build build-asan -j "$(nproc)" --target pipeplan pipeplan_tests
# MPI's and Slurm's own leaks are not ours: leak checking stays off, memory errors do not.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -E srun_multiprocess_check
