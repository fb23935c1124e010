#!/usr/bin/env bash
# The main job: install what is missing, build, plan and simulate the default config.
# Outputs: traces/default.pb (plan), traces/default.json (Chrome trace).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
mkdir -p traces
build/pipeplan plan configs/default.yaml -o traces/default.pb
build/pipeplan simulate traces/default.pb --trace traces/default.json
