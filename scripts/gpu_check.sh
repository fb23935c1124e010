#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, build the CUDA backend and run
#   - a pp=1 plan and a 4-rank plan (single-GPU multi-rank mode) with --backend cuda,
#   - the numeric check (CPU backend, double precision, against the sequential reference),
#   - simulated vs measured comparisons before and after calibration,
#   - the NCCL mode (one process per GPU) with its transfer check: one process on the pp=1
#     plan, and, where there are N >= 2 GPUs, N processes on a pp=N plan (NCCL's id shared
#     through a file, so no MPI launcher is needed),
#   - cost-model terms measured against their prediction (pipeplan_gpu_terms): unfused
#     attention, and a gradient reduction overlapping GEMMs on its own stream,
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
step "cost-model terms: measured vs predicted"
run "$(dirname "$bin")/pipeplan_gpu_terms" || true
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
step "NCCL, one process per GPU: the pp1 plan in one process, every transfer checked"
run "$bin" execute "$work/pp1.pb" --backend cuda --nccl --check --trace "$work/pp1-nccl.json" || true
[ -f "$work/pp1-nccl.json" ] && run "$bin" compare "$work/pp1-sim.json" "$work/pp1-nccl.json"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "$gpus" -ge 2 ]; then
  step "NCCL: $gpus processes, one per GPU, on a pp=$gpus plan"
  run "$bin" plan configs/gpu_check.yaml --set parallelism.pp="$gpus" --set cluster.gpus_per_node="$gpus" -o "$work/ppn.pb"
  run "$bin" simulate "$work/ppn.pb" --trace "$work/ppn-sim.json"
  for ((p = 1; p < gpus; p++)); do
    "$bin" execute "$work/ppn.pb" --backend cuda --rank "$p" --world "$gpus" --rendezvous "$work" --rendezvous-key "check$$" \
      --check --timeout 120 >"$work/ppn-$p.log" 2>&1 &
  done
  run "$bin" execute "$work/ppn.pb" --backend cuda --rank 0 --world "$gpus" --rendezvous "$work" --rendezvous-key "check$$" \
    --check --timeout 120 --trace "$work/ppn-nccl.json" || true
  wait
  run cat "$work"/ppn-*.log
  [ -f "$work/ppn-nccl.json" ] && run "$bin" compare "$work/ppn-sim.json" "$work/ppn-nccl.json"
else
  step "NCCL with several processes: skipped, this machine has $gpus GPU (NCCL refuses two ranks on one GPU)"
fi
step "numeric check (CPU backend, 4 ranks, against the sequential reference)"
run "$bin" execute "$work/pp4.pb" --backend cpu --local-ranks 4 --check
cp "$work/pp4-sim.json" "$work/pp4-gpu.json" "$work/pp1-sim.json" "$work/pp1-gpu.json" "$out/"
cp "$work"/*-nccl.json "$out/" 2>/dev/null || true
echo "report: $report"
