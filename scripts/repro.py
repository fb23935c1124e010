#!/usr/bin/env python3
"""Reproduces published training runs and keeps the README's table of them true.

Every configs/repro/*.yaml names its source and the published number in its header:
    # source: <paper>               (continued on lines starting with '#   ')
    # row: <table and row>
    # published: <metric> <value>   (a field of `pipeplan simulate --json`)
This script simulates each config, compares the prediction with the published number and
writes the table between the README's `repro:begin` / `repro:end` markers.

    scripts/repro.py [--bin build/pipeplan]          rewrite the table in README.md
    scripts/repro.py --check [--bin build/pipeplan]  fail if the table is stale or a group
                                                     misses its error bound
Groups are the file-name prefix before the first '_' (one paper each); a group passes when
its mean absolute error is at most 10 % and no row is off by more than 20 %.
"""
import glob
import json
import os
import subprocess
import sys

from readme_table import arguments, update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- repro:begin -->", "<!-- repro:end -->"
MAE_BOUND, MAX_BOUND = 0.10, 0.20
UNITS = {"model_tflops_per_gpu": ("model TFLOP/s per GPU (eq. 3)", 1, "{:.1f}"),
         "megatron_mfu": ("Megatron MFU", 100, "{:.1f} %")}


def header(path):
    source, row, published = [], None, None
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            text = line[1:].strip()
            if text.startswith("source:"):
                source.append(text[len("source:"):].strip())
            elif source and line.startswith("#   "):
                source.append(text)
            elif text.startswith("row:"):
                row = text[len("row:"):].strip()
            elif text.startswith("published:"):
                metric, value = text[len("published:"):].split()
                published = (metric, float(value))
    if not source or not row or not published:
        sys.exit(f"{path}: the header needs '# source:', '# row:' and "
                 "'# published: <metric> <value>'")
    if published[0] not in UNITS:
        sys.exit(f"{path}: unknown metric '{published[0]}' (known: {', '.join(UNITS)})")
    return " ".join(source), row, published


def predict(binary, path, metric):
    out = subprocess.run([binary, "simulate", path, "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{path}: pipeplan simulate failed:\n{out.stderr}")
    return json.loads(out.stdout)[metric]


def table(binary):
    rows, groups, sources = [], {}, {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "repro", "*.yaml"))):
        name = os.path.relpath(path, ROOT)
        source, row, (metric, published) = header(path)
        predicted = predict(binary, path, metric)
        error = predicted / published - 1
        group = os.path.basename(path).split("_")[0]
        groups.setdefault(group, []).append(abs(error))
        sources.setdefault(group, source)
        label, scale, fmt = UNITS[metric]
        rows.append(f"| `{name}` | {row} | {label} | {fmt.format(published * scale)} | "
                    f"{fmt.format(predicted * scale)} | {100 * error:+.1f} % |")
    lines = ["| config | row | metric | published | predicted | error |",
             "|---|---|---|---|---|---|", *rows, ""]
    failures = []
    for group, errors in groups.items():
        mae, worst = sum(errors) / len(errors), max(errors)
        lines.append(f"- `{group}`: {sources[group]}. {len(errors)} runs, mean absolute error "
                     f"{100 * mae:.1f} %, largest {100 * worst:.1f} %.")
        if mae > MAE_BOUND or worst > MAX_BOUND:
            failures.append(f"{group}: mean absolute error {100 * mae:.1f} % (bound "
                            f"{100 * MAE_BOUND:.0f} %), largest {100 * worst:.1f} % (bound "
                            f"{100 * MAX_BOUND:.0f} %)")
    return "\n".join(lines) + "\n", failures


def main():
    args = arguments(__doc__.splitlines()[0])
    text, failures = table(args.bin)
    update(args.readme, BEGIN, END, text, args.check,
           "the reproduction table; run scripts/repro.py")
    if args.check and failures:
        sys.exit("published runs not reproduced:\n  " + "\n  ".join(failures))
    print(text, end="")
    if not args.check:
        for failure in failures:
            print(f"warning: {failure}", file=sys.stderr)


if __name__ == "__main__":
    main()
