"""The twin check on a texture family the policy never saw (issue 11, section 2).

    python benchmarks/held_out_family.py --family cells --held-out ART_H --reference ART_ALL \
        [--calibration FILE] [--episodes 100] [--seed 0] [--json OUT]

``ART_H`` is an artifact trained with ``render.surface_textures.held_out=[FAMILY]``,
``ART_ALL`` one trained the same way with every family. Both run the twin's closed loop
(``policies.evaluate.evaluate``, held-out objects, the same episodes) in two domains built
from the ``randomized`` profile, with every surface textured (table, bin and its floor;
objects as the profile draws them):

- ``only FAMILY``: the textures come from the held-out family alone;
- ``the others``: from every other family.

A policy that generalises keeps its success rate on the family it never saw: the table
prints each rate with its Wilson interval and the differences (Newcombe) between domains
and between the two artifacts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from perception.core.calibration import Calibration  # noqa: E402
from policies.eval_adapters import OnnxPolicy  # noqa: E402
from policies.evaluate import evaluate, load_profile, newcombe_interval, wilson_interval  # noqa: E402

FAMILIES = ("spectral", "dead_leaves", "cells", "speckle", "strokes")


def domain(family: str, only: bool) -> object:
    held = [f for f in FAMILIES if f != family] if only else [family]
    return load_profile("randomized", [
        f"render.surface_textures.held_out=[{','.join(held)}]",
        "render.surface_textures.table.prob=1.0", "render.surface_textures.bin.prob=1.0",
        "render.surface_textures.floor.prob=1.0",
        f"render.name=randomized_{'only_' + family if only else 'without_' + family}",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, choices=FAMILIES)
    ap.add_argument("--held-out", required=True, help="artifact trained without the family")
    ap.add_argument("--reference", required=True, help="artifact trained with every family")
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: the held-out artifact's)")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    calib = Calibration.load(args.calibration) if args.calibration else None
    rows = {}
    for name, art in (("held out", args.held_out), ("reference", args.reference)):
        policy = OnnxPolicy(art, calib, intra_op_num_threads=1)
        cal = calib or policy.calibration
        for only in (True, False):
            key = f"only {args.family}" if only else "the others"
            r = evaluate(policy, domain(args.family, only), cal, args.episodes, args.seed, keep_episodes=False)
            rows[(name, key)] = (int(r["successes"]), int(r["attempts"]))
            print(f"{name:9s} {key:14s} {r['successes']}/{r['attempts']}", file=sys.stderr, flush=True)
    print("| artifact | domain | success / attempts [Wilson 95%] |\n|---|---|---|")
    for (name, key), (s, n) in rows.items():
        lo, hi = wilson_interval(s, n)
        print(f"| {name} | {key} | {s}/{n} = {100 * s / max(n, 1):.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] |")
    only, others = f"only {args.family}", "the others"
    for label, a, b in ((f"held out: {only} minus the others", ("held out", only), ("held out", others)),
                        (f"{only}: held out minus reference", ("held out", only), ("reference", only)),
                        ("the others: held out minus reference", ("held out", others), ("reference", others))):
        d, lo, hi = (100 * v for v in newcombe_interval(*rows[a], *rows[b]))
        print(f"- {label}: {d:+.1f} points [{lo:+.1f}, {hi:+.1f}]")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in rows.items()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
