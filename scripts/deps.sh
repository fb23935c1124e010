#!/usr/bin/env bash
# Installs the Debian packages pipeplan needs, only those that are missing; arguments name
# more packages a script needs besides (scripts/fuzz.sh: clang and its fuzzer runtime).
set -euo pipefail
pkgs=("$@"
      cmake g++ make libcli11-dev libfmt-dev nlohmann-json3-dev libboost-graph-dev
      libprotobuf-dev protobuf-compiler doctest-dev libyaml-cpp-dev libbenchmark-dev zlib1g-dev
      libopenmpi-dev openmpi-bin slurm-wlm munge  # multi-process runs and their test
      python3                                     # scripts/repro.py (a test runs it)
      chromium)                                   # the HTML report's browser test
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
