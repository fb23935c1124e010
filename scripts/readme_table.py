"""Writes (or checks) a generated block of README.md between two HTML-comment markers."""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arguments(description):
    """--bin (the pipeplan binary), --check, --readme: the options of every table script."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "pipeplan"))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    return ap.parse_args()


def update(readme_path, begin, end, text, check, stale_hint):
    """Puts `text` between the markers; with `check`, exits 1 instead if it differs."""
    with open(readme_path) as f:
        readme = f.read()
    if begin not in readme or end not in readme:
        sys.exit(f"{readme_path}: missing the {begin} / {end} markers")
    head, rest = readme.split(begin, 1)
    _, tail = rest.split(end, 1)
    updated = f"{head}{begin}\n{text}{end}{tail}"
    if check:
        if updated != readme:
            sys.exit(f"{os.path.basename(readme_path)} is stale: {stale_hint}")
        return
    tmp = readme_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(updated)
    os.replace(tmp, readme_path)
