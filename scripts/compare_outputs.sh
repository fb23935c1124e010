#!/usr/bin/env bash
# Checks that two pipeplan binaries give identical results: for every config in configs/
# (and configs/repro/), the plan file (.pb and .json) and the `simulate --json` report
# must be byte-identical. Used to show that an optimisation changes no result:
#
#   git worktree add /tmp/before <old commit> && (cd /tmp/before && scripts/build.sh)
#   scripts/compare_outputs.sh /tmp/before/build/pipeplan build/pipeplan
#
# Exit 0 when every output matches, 1 (with the differing files named) otherwise.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 OLD_PIPEPLAN NEW_PIPEPLAN" >&2
  exit 2
fi
old=$1
new=$2
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run() {  # run BINARY OUTDIR CONFIG
  local bin=$1 dir=$2 cfg=$3 name
  name=$(basename "$cfg" .yaml)
  mkdir -p "$dir"
  "$bin" plan "$cfg" -o "$dir/$name.pb" > /dev/null 2>&1 || echo "plan failed: $?" > "$dir/$name.pb"
  "$bin" plan "$cfg" -o "$dir/$name.json" > /dev/null 2>&1 || echo "plan failed: $?" > "$dir/$name.json"
  "$bin" simulate "$cfg" --json > "$dir/$name.sim.json" 2>&1 || echo "simulate failed: $?" >> "$dir/$name.sim.json"
}

fail=0
count=0
for cfg in configs/*.yaml configs/repro/*.yaml; do
  run "$old" "$work/old" "$cfg"
  run "$new" "$work/new" "$cfg"
  name=$(basename "$cfg" .yaml)
  for ext in pb json sim.json; do
    count=$((count + 1))
    if ! cmp -s "$work/old/$name.$ext" "$work/new/$name.$ext"; then
      echo "differs: $cfg ($ext)"
      fail=1
    fi
  done
done
if [ $fail = 0 ]; then
  echo "identical: $count outputs of $(ls configs/*.yaml configs/repro/*.yaml | wc -l) configs"
fi
exit $fail
