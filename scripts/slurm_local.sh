#!/usr/bin/env bash
# A single-node Slurm on this machine, for tests: scripts/slurm_local.sh start DIR | stop DIR.
# start writes DIR/slurm.conf, starts munged (as user munge), slurmctld and slurmd, waits
# until the node is idle and prints `export SLURM_CONF=...`; exit 1 (with the reason on
# stderr) when Slurm cannot start here. stop ends the daemons it started.
set -euo pipefail
cmd=${1:?usage: slurm_local.sh start|stop DIR}
dir=$(mkdir -p "${2:?usage: slurm_local.sh start|stop DIR}" && cd "$2" && pwd)
conf="$dir/slurm.conf"
if [ "$cmd" = stop ]; then
  pids=$(cat "$dir"/*.pid 2>/dev/null | sort -u | tr '\n' ' ')
  [ -n "$pids" ] || exit 0
  kill $pids 2>/dev/null || true
  for _ in $(seq 1 30); do
    alive=$(for p in $pids; do kill -0 "$p" 2>/dev/null && echo "$p"; done || true)
    [ -z "$alive" ] && exit 0
    sleep 0.1
  done
  kill -9 $alive 2>/dev/null || true
  exit 0
fi
for bin in munged slurmctld slurmd srun sinfo; do
  command -v "$bin" >/dev/null || [ -x "/usr/sbin/$bin" ] || { echo "slurm_local: $bin is not installed" >&2; exit 1; }
done
host=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
cat >"$conf" <<CONF
ClusterName=pipeplan
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$((20000 + RANDOM % 20000))
SlurmdPort=$((40000 + RANDOM % 20000))
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF="$conf"
# munge: reuse a working munged, else start one as user munge with the package's key.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || { echo "slurm_local: /etc/munge/munge.key is missing" >&2; exit 1; }
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  runuser -u munge -- /usr/sbin/munged 2>"$dir/log/munged.err" || { echo "slurm_local: munged failed: $(cat "$dir/log/munged.err")" >&2; exit 1; }
  pgrep -x munged >"$dir/munged.pid" || true  # started here: stopped here too
  for _ in $(seq 1 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
(setsid /usr/sbin/slurmctld -D -f "$conf" >"$dir/log/slurmctld.out" 2>&1 & echo $! >"$dir/ctld.pid")
sleep 1
(setsid /usr/sbin/slurmd -D -f "$conf" >"$dir/log/slurmd.out" 2>&1 & echo $! >"$dir/d.pid")
for _ in $(seq 1 50); do
  if timeout 2 sinfo -h -o %T 2>/dev/null | grep -q idle; then echo "export SLURM_CONF=$conf"; exit 0; fi
  sleep 0.2
done
echo "slurm_local: the node did not become idle: $(tail -3 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" 2>/dev/null | tr '\n' ' ')" >&2
"$0" stop "$dir"
exit 1
