"""Each command's start-up: the seconds from launch to its first error for a bad value.

A user who mistypes a value waits this long for the message, so a change to the commands'
plumbing (imports, the Hydra wrapper) must not make it slower. The commands run from two
source trees side by side, alternating, each as its console script would (``main()`` of the
entry point in ``pyproject.toml``), with a value that every version refuses before any work:

    .venv/bin/python benchmarks/startup.py --baseline /tmp/base_checkout [--repeats 5]

``--baseline`` is a checkout of the commit to compare with (``git worktree add /tmp/b REV``);
without it only this tree is timed. Prints a row a command (median seconds, and the ratio
this tree / baseline) and, last, one JSON line. Exit 2 when a command did not end with the
expected error (exit 2 and a message), so a broken command never times as a fast one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

#: (command, entry point, arguments refused before any work).
COMMANDS: list[tuple[str, str, list[str]]] = [
    ("sim2real-render", "sim_render.cli:main", ["n_scenes=-1", "output_dir=/tmp/startup_bench"]),
    ("sim2real-pipeline", "policies.pipeline:main", ["budget=tiny", "calibration=/nonexistent.json",
                                                     "output_dir=/tmp/startup_bench"]),
    ("sim2real-adapt", "adaptation.train:main", ["output_dir=/tmp/startup_bench"]),
    ("sim2real-train-policy", "policies.train:main", ["dataset_dirs=[]"]),
    ("sim2real-eval", "policies.evaluate:main", ["artifact=/nonexistent"]),
    ("sim2real-train-base", "policies.base:main", ["parts=[nothing]", "output_dir=/tmp/startup_bench"]),
    ("sim2real-finetune", "policies.finetune:main", ["run_dir=/nonexistent"]),
    ("sim2real-serve", "perception.robot.service:main", ["artifact=/nonexistent"]),
    ("sim2real-calibrate", "perception.robot.calibrate:main", ["refine", "calibration=/nonexistent.json",
                                                               "real_dir=/nonexistent", "out=/tmp/x.json"]),
]


def run_once(tree: Path, entry: str, args: list[str]) -> tuple[float, int, str]:
    module, func = entry.split(":")
    code = f"import sys; sys.argv = ['cmd', *sys.argv[1:]]; from {module} import {func}; sys.exit({func}())"
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "offline"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    trees = {"this": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    times: dict[str, dict[str, list[float]]] = {name: {t: [] for t in trees} for name, _, _ in COMMANDS}
    bad = []
    for _ in range(args.repeats):
        for name, entry, cmd_args in COMMANDS:
            for tree_name, tree in trees.items():  # alternate: both trees see the same machine load
                seconds, code, last = run_once(tree, entry, cmd_args)
                if code != 2 or "error" not in last:
                    bad.append(f"{name} ({tree_name}): exit {code}, {last[:160]}")
                times[name][tree_name].append(seconds)
    print("| command | this tree, s | baseline, s | this / baseline |")
    print("|---|---:|---:|---:|")
    result = {}
    for name, per_tree in times.items():
        med = {t: statistics.median(v) for t, v in per_tree.items()}
        ratio = med["this"] / med["baseline"] if "baseline" in med else None
        result[name] = {**{f"{t}_s": round(v, 3) for t, v in med.items()},
                        "ratio": None if ratio is None else round(ratio, 3)}
        print(f"| {name} | {med['this']:.2f} | {med.get('baseline', float('nan')):.2f} | "
              f"{'n/a' if ratio is None else f'{ratio:.2f}'} |")
    for line in sorted(set(bad)):
        print(f"not the expected error: {line}", file=sys.stderr)
    print(json.dumps({"repeats": args.repeats, "commands": result}))
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
