#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, build the CUDA backend and run
#   - a pp=1 plan and a 4-rank plan (single-GPU multi-rank mode) with --backend cuda,
#   - the numeric check (CPU backend, double precision, against the sequential reference),
#   - simulated vs measured comparisons before and after calibration,
# writing report.txt and the traces into OUT_DIR. Usage: scripts/gpu_check.sh OUT_DIR
# PIPEPLAN_BIN=path uses an already built binary (for machines without the Debian
# packages); otherwise the script installs what is missing and builds.
set -euo pipefail
out=$(mkdir -p "${1:?usage: scripts/gpu_check.sh OUT_DIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
if [ -z "${PIPEPLAN_BIN:-}" ]; then
  scripts/deps.sh
  scripts/build.sh
  bin=build/pipeplan
else
  bin=$PIPEPLAN_BIN
fi
work=$(mktemp -d)
report="$out/report.txt"
: >"$report"
step() { echo "== $*" | tee -a "$report"; }
run() { "$@" 2>&1 | tee -a "$report"; }

step "device"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for case in pp1 pp4; do
  sets=()
  ranks=1
  if [ "$case" = pp4 ]; then sets=(--set parallelism.pp=4 --set cluster.gpus_per_node=4); ranks=4; fi
  step "$case: plan, simulate, execute on the GPU"
  run "$bin" plan configs/gpu_check.yaml "${sets[@]}" -o "$work/$case.pb"
  run "$bin" simulate "$work/$case.pb" --trace "$work/$case-sim.json"
  run "$bin" execute "$work/$case.pb" --backend cuda --local-ranks "$ranks" --trace "$work/$case-gpu.json"
  step "$case: simulated vs measured"
  run "$bin" compare "$work/$case-sim.json" "$work/$case-gpu.json" --calibrate "$work/$case-cal.yaml"
  run cat "$work/$case-cal.yaml"
  step "$case: after calibration"
  run "$bin" simulate "$work/$case.pb" --calibration "$work/$case-cal.yaml" --trace "$work/$case-sim-cal.json"
  run "$bin" compare "$work/$case-sim-cal.json" "$work/$case-gpu.json"
done
step "numeric check (CPU backend, 4 ranks, against the sequential reference)"
run "$bin" execute "$work/pp4.pb" --backend cpu --local-ranks 4 --check
cp "$work/pp4-sim.json" "$work/pp4-gpu.json" "$work/pp1-gpu.json" "$out/"
echo "report: $report"
