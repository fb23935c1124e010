#!/usr/bin/env python3
"""Runs the README's shell examples and checks that each prints what the README shows.

An example is a line `$ COMMAND` inside a fenced block; its expected output is the lines
that follow, up to the next `$` line or the end of the block. Commands run with bash from
the repository root, `build/pipeplan` replaced by --bin. Skipped: examples that need a
GPU, a Slurm allocation or files only a GPU run writes. On lines that report measured wall
time ("measured") or a rounding-level error of the CPU executor's check ("relative error":
threads sum gradients in any order), numbers and the module named may differ; everything
else must match exactly. Exits 1 with a diff for each example that does not; with
--update, writes what each such example prints now into the README instead (not for
examples with "..." or measured lines: those are shown and left to be edited by hand).
"""
import argparse
import difflib
import os
import re
import subprocess
import sys

SKIP = [r"\bsrun\b", r"slurm_local\.sh", r"gpu_check\.sh", r"compare /tmp/gpu/", r"--backend cuda"]


def examples(lines):
    """Yields (command, expected output lines, index of the first output line)."""
    block, cmd, out, first = False, None, [], 0
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if block and cmd is not None:
                yield cmd, out, first
            block, cmd, out = not block, None, []
            continue
        if not block:
            continue
        if line.startswith("$ "):
            if cmd is not None:
                yield cmd, out, first
            cmd, out, first = line[2:], [], i + 1
        elif cmd is not None:
            out.append(line)


def normalise(lines):
    # A "..." line in the README stands for lines left out: compare only what precedes it.
    if "..." in lines:
        lines = lines[: lines.index("...")]
    def loose(l):
        l = re.sub(r"\d[\d.]*(e[+-]?\d+)?", "#", l)
        return re.sub(r"\((text|vision|generator),", "(#,", l)
    return [loose(l) if "measured" in l or "relative error" in l else l.rstrip() for l in lines]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--readme", default=os.path.join(os.path.dirname(__file__), "..", "README.md"))
    ap.add_argument("--update", action="store_true", help="write the new outputs into the README")
    a = ap.parse_args()
    root = os.path.dirname(os.path.abspath(a.readme))
    lines = open(a.readme, encoding="utf-8").read().splitlines()
    failed = ran = skipped = 0
    updates = []  # (first line, old length, new lines), applied last to first
    for cmd, expected, first in examples(lines):
        shown = re.sub(r"\s+#\s.*$", "", cmd)  # a trailing comment is not part of the command
        if any(re.search(p, shown) for p in SKIP):
            skipped += 1
            continue
        run = shown.replace("build/pipeplan", a.bin)
        r = subprocess.run(["bash", "-o", "pipefail", "-c", run], cwd=root, capture_output=True,
                           text=True)
        ran += 1
        got = (r.stdout + r.stderr).splitlines()
        want = normalise(expected)
        got = normalise(got)[: len(want)] if "..." in expected else normalise(got)
        if got != want:
            exact = "..." not in expected and want == [l.rstrip() for l in expected]
            if a.update and exact:
                updates.append((first, len(expected), [l.rstrip() for l in got]))
                continue
            failed += 1
            print(f"README example differs: $ {cmd}")
            sys.stdout.writelines(difflib.unified_diff([w + "\n" for w in want],
                                                       [g + "\n" for g in got], "README", "now"))
    for first, n, new in reversed(updates):
        lines[first:first + n] = new
    if updates:
        tmp = a.readme + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, a.readme)
    print(f"{ran} README examples run, {failed} differ, {len(updates)} updated, "
          f"{skipped} skipped (GPU or Slurm)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
