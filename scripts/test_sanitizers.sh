#!/usr/bin/env bash
# Builds the test suite under AddressSanitizer + UndefinedBehaviorSanitizer into
# build-asan/ and runs it, then the executor's threaded tests under ThreadSanitizer
# (build-tsan/). No CUDA: the GPU code is not what the sanitizers look at. Any report fails
# the run. Called by scripts/test.sh; PIPEPLAN_SANITIZERS=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
# -g1 (line tables): enough for the sanitizers' stack traces, and a faster build than -g.
opt="-O2 -g1 -DNDEBUG"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEPLAN_WITH_CUDA=OFF \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
cmake --build build-asan -j "$(nproc)" --target pipeplan pipeplan_tests
# MPI's and Slurm's own leaks are not ours: leak checking stays off, memory errors do not.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Left out here: the srun test (Slurm's own processes), and the scale runs (k3-scale traces
# and report, the README's examples), whose code paths the small tests cover under the
# sanitizers; they run in the normal suite.
ctest --test-dir build-asan --output-on-failure -j "$(nproc)" \
  -E 'srun_multiprocess_check|readme_examples|k3-scale|report of a large plan'

# Threads: the in-process transport, the runner's abort on a failed rank, the emulated NCCL
# backend's processes-as-threads (RunLocal and friends), the CLI's --local-ranks, and the
# planner's, simulator's and trace writer's threads (tests/test_threads.cc).
tflags="-fsanitize=thread -fno-omit-frame-pointer"
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEPLAN_WITH_CUDA=OFF \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt" -DCMAKE_CXX_FLAGS="$tflags" -DCMAKE_EXE_LINKER_FLAGS="$tflags" >/dev/null
cmake --build build-tsan -j "$(nproc)" --target pipeplan_threaded_tests
# Emulated collectives run many times slower under TSan: their wait limits scale.
PIPEPLAN_TEST_TIMEOUT_SCALE=10 TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  build-tsan/tests/pipeplan_threaded_tests
