#!/usr/bin/env python3
"""Keeps the README's table of what `training.memory: auto` finds on the seed configs true.

For each seed config and policy below it simulates the config as written and again under
`memory: auto` (recompute and FP8 storage allowed) started from no recompute, and writes the
comparison between the README's `memory-auto:begin` / `memory-auto:end` markers.

    scripts/memory_table.py [--bin build/pipeplan]          rewrite the table in README.md
    scripts/memory_table.py --check [--bin build/pipeplan]  fail if the table is stale
"""
import json
import os
import subprocess
import sys

from readme_table import arguments, update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- memory-auto:begin -->", "<!-- memory-auto:end -->"
CASES = [(config, policy)
         for config in ("default", "qwen3_30b_a3b_vit", "qwen3_30b_a3b_vit_mmdit20b")
         for policy in ("nested", "bubble-fill")]
AUTO = ["training.memory=auto", "training.memory_policies=[recompute, fp8]",
        "training.recompute=none", "model.vision.recompute=none"]
GiB = 2.0 ** 30


def simulate(binary, config, sets):
    args = [binary, "simulate", os.path.join(ROOT, "configs", config + ".yaml"), "--json"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{config}: pipeplan simulate failed:\n{out.stderr}")
    return json.loads(out.stdout)


def modes(ranks):
    """'none x4' when every rank has the same mode, else the list."""
    if len(set(ranks)) == 1:
        return f"{ranks[0]} x{len(ranks)}"
    return ", ".join(ranks)


def table(binary):
    rows, gains = [], []
    for config, policy in CASES:
        with open(os.path.join(ROOT, "configs", config + ".yaml")) as f:
            generator = "generator:" in f.read()
        base = simulate(binary, config, [f"schedule.modality={policy}"])
        auto = simulate(binary, config, [f"schedule.modality={policy}", *AUTO] +
                        (["model.generator.recompute=none"] if generator else []))
        m = auto["memory_auto"]
        chosen = "; ".join([modes(m["by_pp_rank"]), m["vision"]] +
                           ([m["generator"]] if generator else []))
        gains.append(1 - auto["step_time_s"] / base["step_time_s"])
        rows.append(f"| {config} | {policy} | {base['step_time_s']:.3f} s, "
                    f"{base['peak_memory_bytes'] / GiB:.1f} GiB | {auto['step_time_s']:.3f} s, "
                    f"{auto['peak_memory_bytes'] / GiB:.1f} GiB | {chosen} | "
                    f"{m['plans_simulated']} |")
    lines = [
        (f"`memory: auto` finds plans {100 * min(gains):.1f}-{100 * max(gains):.1f} % faster "
         "than the configs' hand-set modes:" if min(gains) >= 0 else
         f"`memory: auto` finds plans from {-100 * min(gains):.1f} % slower to "
         f"{100 * max(gains):.1f} % faster than the configs' hand-set modes:"), "",
        "| config | policy | as configured: step, peak | `memory: auto`: step, peak | chosen "
        "(LLM by pp rank; encoder; generator) | plans |",
        "|---|---|---|---|---|---|", *rows]
    return "\n".join(lines) + "\n"


def main():
    args = arguments(__doc__.splitlines()[0])
    text = table(args.bin)
    update(args.readme, BEGIN, END, text, args.check,
           "the memory: auto table; run scripts/memory_table.py")
    print(text, end="")


if __name__ == "__main__":
    main()
