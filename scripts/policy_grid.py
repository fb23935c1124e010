#!/usr/bin/env python3
"""Compares the placement policies over a grid of the seed multimodal configs.

For each binary, each point (config x schedule x micro-batch count) is simulated under
`decoupled`, `nested`, `bubble-fill` and `optimus`; the points where every policy builds
are counted where `nested` is slower than `decoupled` or `optimus` and where `bubble-fill`
is slower than `nested` (with the worst ratio). Given two binaries (before, after), it
also prints each policy's step ratio after / before: geometric mean, best and worst.

    scripts/policy_grid.py --bin OLD --bin NEW [--schedules 1f1b,interleaved-1f1b,zb-h1]
    scripts/policy_grid.py --bin build/pipeplan --list    also lists the points that lose
"""
import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [("default", (8, 16, 32, 64)), ("qwen3_30b_a3b_vit", (8, 16, 32, 64)),
           ("qwen3_30b_a3b_vit_mmdit20b", (4, 8, 16))]
POLICIES = ("decoupled", "nested", "bubble-fill", "optimus")
VIRTUAL = {"interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"}  # need vp 2
# (slower policy, faster policy it is compared with)
LOSSES = (("nested", "decoupled"), ("nested", "optimus"), ("bubble-fill", "nested"))


def points(schedules):
    for config, counts in CONFIGS:
        for schedule in schedules:
            for m in counts:
                sets = [f"training.microbatches={m}", f"schedule.pipeline={schedule}"]
                if schedule in VIRTUAL:
                    sets.append("parallelism.vp=2")
                yield config, tuple(sets)


def step(binary, config, sets, policy):
    args = [binary, "simulate", os.path.join(ROOT, "configs", config + ".yaml"), "--json",
            "--set", "schedule.modality=" + policy]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True)
    return json.loads(out.stdout)["step_time_s"] if out.returncode == 0 else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", action="append", required=True, help="pipeplan binary (1 or 2)")
    p.add_argument("--schedules", default="1f1b,interleaved-1f1b,zb-h1")
    p.add_argument("--list", action="store_true", help="list the points that lose")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    if len(a.bin) > 2:
        sys.exit("policy_grid.py: at most two binaries (before, after)")
    grid = list(points(a.schedules.split(",")))
    jobs = [(b, c, s, pol) for b in a.bin for c, s in grid for pol in POLICIES]
    with ThreadPoolExecutor(a.jobs) as pool:
        steps = dict(zip(jobs, pool.map(lambda j: step(*j), jobs)))
    built = [(c, s) for c, s in grid
             if all(steps[(b, c, s, pol)] for b in a.bin for pol in POLICIES)]
    for b in a.bin:
        print(f"{b}: {len(built)} points where every policy builds")
        for slow, fast in LOSSES:
            lost = [(steps[(b, c, s, slow)] / steps[(b, c, s, fast)] - 1, c, s)
                    for c, s in built if steps[(b, c, s, slow)] > steps[(b, c, s, fast)]]
            worst = max(lost)[0] if lost else 0
            print(f"  {slow} slower than {fast}: {len(lost)} points, worst {100 * worst:.2f} %")
            for loss, c, s in sorted(lost, reverse=True) if a.list else []:
                print(f"    {100 * loss:5.2f} %  {c} {' '.join(s)}")
    if len(a.bin) == 2:
        old, new = a.bin
        for pol in POLICIES:
            r = [steps[(new, c, s, pol)] / steps[(old, c, s, pol)] for c, s in built]
            geo = math.exp(sum(map(math.log, r)) / len(r))
            print(f"{pol}: after / before, geometric mean {geo:.4f}, "
                  f"best {min(r):.3f}, worst {max(r):.3f}")


if __name__ == "__main__":
    main()
