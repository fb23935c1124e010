#!/usr/bin/env python3
"""Compares the placement policies over a grid of the seed multimodal configs.

For each binary, each point (config x schedule x micro-batch count) is simulated under
`decoupled`, `nested`, `bubble-fill` and `optimus`; the points where every policy builds
are counted where `nested` is slower than `decoupled` or `optimus` and where `bubble-fill`
is slower than `nested` (with the worst ratio), and where `bubble-fill` is not strictly
faster than `nested` although every rank's idle time without the encoder exceeds that
rank's encoder work (in nested's plan: the step less `vision_exposed_s`, less the rank's
busy time other than the encoder's, against its encoder seconds); of those, the points where
nested's critical path has encoder work at its ends alone (one task's forward before the
text, one task's backward after it) are marked: no placement of the same tasks is faster.
Plans that fit the device memory come before those that do not, as the planner compares
them: a slower plan that fits where the other does not is no loss, and one out of memory
where the other fits is counted apart.
Given two binaries (before, after), it also prints each policy's step ratio after /
before: geometric mean, best and worst.

    scripts/policy_grid.py --bin OLD --bin NEW [--schedules 1f1b,interleaved-1f1b,zb-h1]
    scripts/policy_grid.py --bin build/pipeplan --list    also lists the points that lose
        (with two binaries, also each policy's points whose step or fit changed)
    scripts/policy_grid.py --bin build/pipeplan --seeds 2,3,4,5,6
        each point with the images of these data seeds instead of the config's own
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


def points(schedules, seeds):
    for config, counts in CONFIGS:
        for schedule in schedules:
            for m in counts:
                for seed in seeds:
                    sets = [f"training.microbatches={m}", f"schedule.pipeline={schedule}"]
                    if schedule in VIRTUAL:
                        sets.append("parallelism.vp=2")
                    if seed is not None:
                        sets.append(f"data.seed={seed}")
                    yield config, tuple(sets)


def step(binary, config, sets, policy):
    args = [binary, "simulate", os.path.join(ROOT, "configs", config + ".yaml"), "--json",
            "--set", "schedule.modality=" + policy]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    d = json.loads(out.stdout)
    # compared as the planner does: fitting first
    return d["oom"], d["step_time_s"], room(d), ends_only(d)


def room(d):
    """Whether every rank's idle time without the encoder exceeds its encoder seconds
    (None where the binary does not report the busy seconds per module)."""
    if d["vision_exposed_s"] < 0:
        return False
    text_only = d["step_time_s"] - d["vision_exposed_s"]
    for r in d["ranks"]:
        vision = r.get("busy_by_module_s", {}).get("vision")
        if vision is None:
            return None
        if text_only - (r["busy_s"] - vision) <= vision:
            return False
    return True


def ends_only(d):
    """Whether the plan's critical path carries encoder work at its ends alone: at most one
    task's forward before its first text compute op and at most one task's backward after its
    last, nothing of the encoder between. The step is then that forward, the chain of text
    (and generator) ops between, which no placement of the encoder's tasks shortens (but for
    the link contention of the encoder's transfers), and that backward: no placement of the
    same tasks ends sooner."""
    path = [x.split() for x in d.get("critical_path", []) if len(x.split()) > 1]
    text = [i for i, op in enumerate(path) if op[1] in ("F", "B", "I", "W")]
    if not text:
        return False
    # A task by its micro-batch and task number (a gang's shards, "c<shard>", are one task).
    task = lambda op: tuple(w for w in op[2:] if w[0] in "mt" and w[1:].isdigit())
    compute = lambda ops: {task(op) for op in ops if op[1].startswith("vision.")
                           and op[1].split(".")[1] not in ("ALL_GATHER", "REDUCE_SCATTER")
                           and not op[1].split(".")[1].startswith(("SEND", "RECV"))}
    middle = [op for op in path[text[0]:text[-1] + 1] if op[1].startswith("vision.")]
    head, tail = path[:text[0]], path[text[-1] + 1:]
    return (not middle and len(compute(head)) <= 1 and len(compute(tail)) <= 1
            and all(op[1] != "vision.B" for op in head)
            and all(op[1] != "vision.F" for op in tail))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", action="append", required=True, help="pipeplan binary (1 or 2)")
    p.add_argument("--schedules", default="1f1b,interleaved-1f1b,zb-h1")
    p.add_argument("--list", action="store_true", help="list the points that lose")
    p.add_argument("--seeds", help="data seeds, comma-separated (default: the config's)")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    if len(a.bin) > 2:
        sys.exit("policy_grid.py: at most two binaries (before, after)")
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else [None]
    grid = list(points(a.schedules.split(","), seeds))
    jobs = [(b, c, s, pol) for b in a.bin for c, s in grid for pol in POLICIES]
    with ThreadPoolExecutor(a.jobs) as pool:
        steps = dict(zip(jobs, pool.map(lambda j: step(*j), jobs)))
    built = [(c, s) for c, s in grid
             if all(steps[(b, c, s, pol)] for b in a.bin for pol in POLICIES)]
    for b in a.bin:
        print(f"{b}: {len(built)} points where every policy builds")
        for slow, fast in LOSSES:
            lost = [(steps[(b, c, s, slow)][1] / steps[(b, c, s, fast)][1] - 1, c, s)
                    for c, s in built if steps[(b, c, s, slow)][:2] > steps[(b, c, s, fast)][:2]]
            # Out of memory where the other fits: a loss whatever the step.
            oom = [(c, s) for c, s in built
                   if steps[(b, c, s, slow)][0] and not steps[(b, c, s, fast)][0]]
            slower = [x for x in lost if (x[1], x[2]) not in oom]
            worst = max(slower)[0] if slower else 0
            print(f"  {slow} slower than {fast}: {len(slower)} points, worst {100 * worst:.2f} %"
                  f"; out of memory where {fast} fits: {len(oom)}")
            for loss, c, s in sorted(slower, reverse=True) if a.list else []:
                print(f"    {100 * loss:5.2f} %  {c} {' '.join(s)}")
            for c, s in oom if a.list else []:
                print(f"    out of memory  {c} {' '.join(s)}")
        roomy = [(c, s) for c, s in built if steps[(b, c, s, "nested")][2]]
        if any(steps[(b, c, s, "nested")][2] is None for c, s in built):
            print("  (no busy seconds per module in this binary's output: room not counted)")
        same = [(c, s) for c, s in roomy
                if steps[(b, c, s, "bubble-fill")][:2] >= steps[(b, c, s, "nested")][:2]]
        ends = [(c, s) for c, s in same if steps[(b, c, s, "nested")][3]]
        print(f"  bubble-fill not strictly faster than nested where every rank's idle time "
              f"without the encoder exceeds its encoder work: {len(same)} of {len(roomy)} points"
              f"; at {len(ends)} of them nested's critical path has encoder work at its ends "
              f"alone (no placement of the same tasks is faster)")
        for c, s in same if a.list else []:
            mark = "  (encoder at the critical path's ends alone)" if (c, s) in ends else ""
            print(f"    {c} {' '.join(s)}{mark}")
    if len(a.bin) == 2:
        old, new = a.bin
        for pol in POLICIES:
            r = [steps[(new, c, s, pol)][1] / steps[(old, c, s, pol)][1] for c, s in built]
            geo = math.exp(sum(map(math.log, r)) / len(r))
            print(f"{pol}: after / before, geometric mean {geo:.4f}, "
                  f"best {min(r):.3f}, worst {max(r):.3f}")
            for c, s in built if a.list else []:
                before, after = steps[(old, c, s, pol)], steps[(new, c, s, pol)]
                if before[:2] != after[:2]:
                    fits = lambda x: "out of memory" if x[0] else "fits"
                    print(f"    {c} {' '.join(s)}: {before[1]:.4f} s {fits(before)} -> "
                          f"{after[1]:.4f} s {fits(after)}")


if __name__ == "__main__":
    main()
