#!/usr/bin/env bash
# ctest: start a single-node Slurm, run a 4-rank multimodal plan with
# `srun -n 4 pipeplan execute ... --check`, check the result and the merged trace, stop the
# daemons. Exits 77 (ctest: skipped) with the reason when Slurm or MPI is not usable here.
set -u
bin=$1 src=$2
dir=$(mktemp -d)
trap '"$src/scripts/slurm_local.sh" stop "$dir/slurm"; rm -rf "$dir"' EXIT
if ! env=$("$src/scripts/slurm_local.sh" start "$dir/slurm" 2>&1); then
  echo "SKIP: Slurm cannot start on this machine: $env"
  exit 77
fi
eval "$env"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$bin" plan "$src/configs/default.yaml" --set parallelism.pp=4 --set cluster.gpus_per_node=4 -o "$dir/p.pb" || exit 1
out=$(timeout 180 srun --mpi=pmix -n 4 -O "$bin" execute "$dir/p.pb" --check --trace "$dir/measured.json" 2>&1)
echo "$out"
if grep -q "built without" <<<"$out"; then echo "SKIP: pipeplan was built without MPI"; exit 77; fi
grep -q "4 processes" <<<"$out" || { echo "FAIL: not 4 processes"; exit 1; }
grep -q "PASS" <<<"$out" || { echo "FAIL: gradient check"; exit 1; }
# The merged trace holds every op of every rank (srun can exit 0 when a task failed).
"$bin" simulate "$dir/p.pb" --trace "$dir/simulated.json" >/dev/null || exit 1
cmp=$("$bin" compare "$dir/simulated.json" "$dir/measured.json") || exit 1
ops=$("$bin" plan "$src/configs/default.yaml" --set parallelism.pp=4 --set cluster.gpus_per_node=4 | sed -n 's/^ops: //p')
grep -q "$ops matched, 0 only simulated, 0 only measured" <<<"$cmp" || { echo "FAIL: merged trace: $cmp"; exit 1; }
echo "srun: 4 processes, gradient check PASS, merged trace of $ops ops"

# A rank that fails: every rank must stop with a non-zero exit instead of hanging (the
# failed rank names itself and its op), and it leaves its partial trace.
if out=$(timeout 120 srun --mpi=pmix -n 4 -O "$bin" execute "$dir/p.pb" --fault 1 --timeout 5 --trace "$dir/fail.json" 2>&1); then
  echo "FAIL: the failed run exited 0: $out"; exit 1
fi
grep -q "rank 1: r1 .*: injected fault" <<<"$out" || { echo "FAIL: no error naming rank 1: $out"; exit 1; }
ls "$dir"/fail.json.rank1.json >/dev/null 2>&1 || { echo "FAIL: no partial trace"; exit 1; }
echo "srun: a failed rank stops the job (non-zero exit), partial trace written"

# A process that dies (SIGKILL, as a crash or the OOM killer): the job stops with a
# non-zero exit, never a hang. Slurm's PMIx plugin cancels the step when a task dies and
# kills the others at once; each keeps the partial trace it journalled as its ops ended
# (TRACE.rank<r>.json, Chrome's array format, readable by compare).
start=$(date +%s)
if out=$(timeout 120 srun --mpi=pmix -n 4 -O "$bin" execute "$dir/p.pb" --fault 2 --fault-kill --timeout 5 --trace "$dir/kill.json" 2>&1); then
  echo "FAIL: the run with a killed process exited 0: $out"; exit 1
fi
[ $(( $(date +%s) - start )) -lt 100 ] || { echo "FAIL: the killed run took too long: $out"; exit 1; }
grep -q "task 2: Killed" <<<"$out" || { echo "FAIL: task 2 was not the one killed: $out"; exit 1; }
[ ! -e "$dir/kill.json" ] || { echo "FAIL: a merged trace of a killed run"; exit 1; }
ran=0
for r in 0 1 2 3; do
  part="$dir/kill.json.rank$r.json"
  [ -f "$part" ] || { echo "FAIL: rank $r left no partial trace"; exit 1; }
  if cmp=$("$bin" compare "$dir/simulated.json" "$part" 2>&1); then
    grep -q " 0 only measured" <<<"$cmp" || { echo "FAIL: rank $r's partial trace has unknown ops: $cmp"; exit 1; }
    ran=$((ran + $(sed -n 's/^ops *\([0-9]*\) matched,.*/\1/p' <<<"$cmp")))
  else  # killed before its first op ended: a journal with no op
    grep -q "no op in common" <<<"$cmp" || { echo "FAIL: rank $r's partial trace does not read: $cmp"; exit 1; }
  fi
done
[ "$ran" -gt 0 ] || { echo "FAIL: the partial traces hold no op"; exit 1; }
echo "srun: a killed process stops the job (non-zero exit) in $(( $(date +%s) - start )) s; partial traces hold $ran ops"

# --backend cuda under srun: one process per GPU over NCCL (NCCL's id through MPI). Where
# there is no GPU, every process stops with a clear error and a non-zero exit, never a hang.
if nvidia-smi -L >/dev/null 2>&1; then
  echo "srun: a GPU is here; the NCCL run belongs to scripts/gpu_check.sh"
else
  if out=$(timeout 120 srun --mpi=pmix -n 4 -O "$bin" execute "$dir/p.pb" --backend cuda --timeout 10 2>&1); then
    echo "FAIL: --backend cuda without a GPU exited 0: $out"; exit 1
  fi
  grep -Eq "process [0-3]: no CUDA device|built without" <<<"$out" || { echo "FAIL: no clear error: $out"; exit 1; }
  echo "srun: --backend cuda without a GPU: every process stops with a clear error"
fi

# tune sharded over one srun step (2 tasks, each a shard writing its results file; the local
# node has as many CPUs as this machine, 2 in CI), merged by the launching process: the same
# top 3 as a single process.
args=(tune "$src/configs/small_text.yaml" --only parallelism.cp=1 --only training.micro_batch_size=1,2 --top 3)
single=$("$bin" "${args[@]}") || { echo "FAIL: tune: $single"; exit 1; }
sharded=$(timeout 180 "$bin" "${args[@]}" --slurm 2 --results "$dir/tune.jsonl" 2>&1) || { echo "FAIL: tune --slurm: $sharded"; exit 1; }
top() { sed -n '/^top /,/^best:/p' <<<"$1"; }
[ -n "$(top "$single")" ] && [ "$(top "$single")" = "$(top "$sharded")" ] || { echo "FAIL: tune --slurm 2 differs: $sharded"; exit 1; }
for i in 0 1; do [ -s "$dir/tune.jsonl.shard${i}of2" ] || { echo "FAIL: no results of shard $i"; exit 1; }; done
grep -q "shard 1 of 2: " <<<"$sharded" || { echo "FAIL: shard 1 did not report: $sharded"; exit 1; }
echo "tune: 2 shards over srun give the single-process top 3"
