#!/usr/bin/env bash
# Fuzzes every input format (fuzz/targets.h) with libFuzzer under ASan + UBSan, SECONDS per
# target (default 600), one target after another; TARGETS="config plan_pb" picks some.
#   scripts/fuzz.sh [SECONDS]
# Builds into build-fuzz/ with clang (installed if missing). Seeds: configs/, plans, traces
# and CSV schedules written by that build's pipeplan, a few hand-written manifests and
# calibrations, and tests/fuzz/TARGET/ (past crashes). The corpus grows in
# build-fuzz/corpus/TARGET/ across runs. A crash, hang (> 30 s) or sanitizer report stops
# that target and leaves its input in build-fuzz/crashes/TARGET/; once fixed, copy the input
# into tests/fuzz/TARGET/, where the test suite replays it. Exits 1 if any target failed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
all="config manifest calibration plan_pb plan_json trace torch_csv megatron sweep_csv"
targets=${TARGETS:-$all}
scripts/deps.sh clang-14 libclang-rt-14-dev
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEPLAN_WITH_CUDA=OFF \
  -DPIPEPLAN_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++-14 \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
build_targets=(pipeplan)
for t in $targets; do build_targets+=("pipeplan_fuzz_$t"); done
cmake --build build-fuzz -j "$(nproc)" --target "${build_targets[@]}"

# Seeds, rewritten on every run.
seeds=build-fuzz/seeds
rm -rf "$seeds"
for t in $all; do mkdir -p "$seeds/$t" "build-fuzz/corpus/$t" "build-fuzz/crashes/$t"; done
export ASAN_OPTIONS=detect_leaks=0
pp=build-fuzz/pipeplan
cp configs/*.yaml configs/repro/*.yaml "$seeds/config/"
printf '%s\n' '%set parallelism.pp=2' '%set schedule.modality=bubble-fill' \
  >>"$seeds/config/default.yaml"
cp configs/megatron/* "$seeds/megatron/"
i=0
for cfg in configs/default.yaml configs/small_text.yaml; do
  for set in "" "schedule.pipeline=interleaved-1f1b" "schedule.pipeline=zbv"; do
    i=$((i + 1))
    args=()
    [ -n "$set" ] && args=(--set "$set" --set parallelism.vp=2)
    "$pp" plan "$cfg" "${args[@]}" -o "$seeds/plan_pb/$i.pb" >/dev/null 2>&1 || continue
    "$pp" plan "$cfg" "${args[@]}" -o "$seeds/plan_json/$i.json" >/dev/null 2>&1 || true
    "$pp" plan "$cfg" "${args[@]}" -o "$seeds/torch_csv/$i.csv" >/dev/null 2>&1 || true
    "$pp" simulate "$seeds/plan_pb/$i.pb" --trace "$seeds/trace/$i.json" >/dev/null 2>&1 || true
  done
done
"$pp" sweep configs/small_text.yaml --vary parallelism.pp=2,4 --vary training.micro_batch_size=1,2 \
  -o "$seeds/sweep_csv/1.csv" >/dev/null 2>&1 || true
cat >"$seeds/manifest/1.jsonl" <<'JSONL'
{"id": "a", "text_tokens": 512, "images": [[224, 224], [1024, 768]]}
{"id": 2, "text_tokens": 1500, "videos": [[4, 224, 224]]}
{"id": "c", "text_tokens": 900, "generate": [512, 512]}
{"id": "d", "text_tokens": 1500}
JSONL
cat >"$seeds/calibration/1.yaml" <<'YAML'
# written by pipeplan compare --calibrate
cluster:
  hardware:
    compute_efficiency: 0.55
    attention_efficiency: 0.4
    nvlink_efficiency: 0.8
    kernel_launch_us: 4
YAML
for t in $all; do
  [ -d "tests/fuzz/$t" ] && cp tests/fuzz/"$t"/* "$seeds/$t/" 2>/dev/null || true
done

failed=0
for t in $targets; do
  log="build-fuzz/$t.log"
  echo "fuzzing $t for ${seconds}s (log: $log)"
  if build-fuzz/"pipeplan_fuzz_$t" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=8192 \
      -max_len=65536 -print_final_stats=1 -artifact_prefix="build-fuzz/crashes/$t/" \
      "build-fuzz/corpus/$t" "$seeds/$t" >"$log" 2>&1; then
    runs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
    rate=$(grep -m1 'stat::average_exec_per_sec' "$log" | awk '{print $2}')
    echo "  $t: no crash; $runs inputs, $rate per s, corpus $(ls "build-fuzz/corpus/$t" | wc -l) files"
  else
    failed=1
    echo "  $t: FAILED; see $log and build-fuzz/crashes/$t/"
    grep -m5 -E 'ERROR|SUMMARY|deadly|timeout' "$log" | sed 's/^/    /' || true
  fi
done
exit "$failed"
