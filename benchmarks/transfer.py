"""Transfer to a cell the project never trained in: the validation cell's whole loop, as a table.

    .venv/bin/python benchmarks/transfer.py --cell ../shared/validation-cell --work /tmp/transfer \
        [--checkout .] [--cells 0 1] [--budget small] [--adaptations cyclegan none] \
        [--no-baselines] [--episodes 30] [--write]
    .venv/bin/python benchmarks/transfer.py --summaries /tmp/transfer/cell0 /tmp/transfer/cell1 \
        [--before /tmp/old/cell0 /tmp/old/cell1] [--write]

For each cell seed it runs the cell's ``run_all.sh CHECKOUT WORK/cellN BUDGET`` (which
installs the checkout the way the README says, runs ``sim2real-pipeline`` per adaptation
setting, serves each artifact and drives the closed-loop evaluation through the contract,
then the cell's reference policies), one cell after the other: two heavy jobs side by
side would measure neither. ``--summaries`` builds the table from finished runs instead.

The cell is a development proxy, not the acceptance test: nothing here imports or reads
its code, only the JSON its scripts print. Every rate comes with its attempts and a
Wilson 95% interval; ``cyclegan - none`` is pooled over the cells, with a Newcombe
(Wilson-based) interval of the difference. ``--write`` puts the table into
``docs/results.md``, block ``transfer`` (``benchmarks/results_doc.py``).

Not part of ``.ci/run``: a ``budget=small`` cell takes about 20 minutes per adaptation
setting on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from policies.evaluate import newcombe_interval as newcombe
from policies.evaluate import wilson_interval as wilson

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

from results_doc import ResultsDocError, write_block  # noqa: E402  (benchmarks/results_doc.py)


def run_cell(cell: Path, checkout: Path, work: Path, seed: int, args: argparse.Namespace, first: Path | None) -> Path:
    """One cell's ``run_all.sh``; later cells reuse the first cell's project venv."""
    out = work / f"cell{seed}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CELL_SEED=str(seed), ADAPTATIONS=" ".join(args.adaptations),
               BASELINES="1" if args.baselines else "0", EPISODES=str(args.episodes))
    if first is not None and (first / "venv" / "bin" / "python").exists() and not (out / "venv").exists():
        (out / "venv").symlink_to(first / "venv")  # an editable install of the same checkout
        env["INSTALL"] = "0"
    cmd = ["bash", str(cell / "run_all.sh"), str(checkout), str(out), args.budget]
    print(f"[transfer] cell {seed}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(out / "run_all.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if not (out / "summary.json").exists():
        raise SystemExit(f"cell {seed}: run_all.sh wrote no summary.json (see {out / 'run_all.log'})")
    return out


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows_of(run: Path) -> tuple[int | None, list[dict]]:
    """Table rows of one finished cell run (its ``summary.json``)."""
    s = _load(run / "summary.json")
    if s is None:
        raise SystemExit(f"{run}: no readable summary.json")
    seed = None
    frames = s.get("frames") or {}
    if isinstance(frames, dict):
        seed = frames.get("cell_seed", frames.get("cell"))
    rows = []
    for name, r in (s.get("runs") or {}).items():
        ev = r.get("evaluate") or {}
        pipe = r.get("pipeline") or {}
        rows.append({
            "policy": name, "attempts": ev.get("attempts") or 0, "successes": ev.get("successes") or 0,
            "null": ev.get("null_answers"), "empty": _empty_bin(run / f"eval_{name}.json"),
            "seconds": pipe.get("seconds"), "rc": pipe.get("rc"),
        })
    for name, ev in (s.get("reference_policies") or {}).items():
        rows.append({"policy": name, "attempts": ev.get("attempts") or 0, "successes": ev.get("successes") or 0,
                     "null": None, "empty": None, "seconds": None, "rc": None})
    return seed, rows


def _empty_bin(path: Path) -> tuple[int, int] | None:
    """(null answers, queries) on the empty bin, sent once after each cleared episode."""
    ev = _load(path)
    summary = (ev or {}).get("summary") or {}
    if "empty_bin_queries" not in summary:
        return None
    return int(summary.get("empty_bin_null") or 0), int(summary["empty_bin_queries"])


def _fmt_rate(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {100 * k / max(n, 1):.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def table(runs: list[Path]) -> str:
    lines = ["| cell | policy | success / attempts [Wilson 95%] | null answers | empty bin answered null | pipeline s |",
             "|---|---|---|---|---|---|"]
    pooled: dict[str, list[int]] = {}
    for run in runs:
        seed, rows = rows_of(run)
        label = run.name if seed is None else f"{seed} (`{run.name}`)"
        for r in rows:
            empty = "" if r["empty"] is None else f"{r['empty'][0]}/{r['empty'][1]}"
            secs = "" if r["seconds"] is None else f"{float(r['seconds']):.0f}" + ("" if r["rc"] == 0 else f" (rc {r['rc']})")
            null = "" if r["null"] is None else str(r["null"])
            lines.append(f"| {label} | {r['policy']} | {_fmt_rate(r['successes'], r['attempts'])} | {null} | {empty} | {secs} |")
            acc = pooled.setdefault(r["policy"], [0, 0])
            acc[0] += r["successes"]
            acc[1] += r["attempts"]
    distinct = len({rows_of(r)[0] for r in runs}) == len(runs)  # pool distinct cells only
    if len(runs) > 1 and distinct:
        for name, (k, n) in pooled.items():
            lines.append(f"| pooled | {name} | {_fmt_rate(k, n)} | | | |")
    if distinct and "cyclegan" in pooled and "none" in pooled:
        d, lo, hi = newcombe(*pooled["cyclegan"], *pooled["none"])
        lines.append(f"\n`cyclegan - none`, pooled: {100 * d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}] (Newcombe 95%)")
    return "\n".join(lines)


def pooled_counts(runs: list[Path]) -> dict[str, tuple[int, int]]:
    """Successes and attempts per policy, summed over runs."""
    out: dict[str, list[int]] = {}
    for run in runs:
        for r in rows_of(run)[1]:
            acc = out.setdefault(r["policy"], [0, 0])
            acc[0] += r["successes"]
            acc[1] += r["attempts"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def change_table(before: list[Path], after: list[Path]) -> str:
    """After minus before, per policy, pooled over the cells (same cells, same evaluation seeds)."""
    b, a = pooled_counts(before), pooled_counts(after)
    lines = ["| policy | before | after | after - before [Newcombe 95%] |", "|---|---|---|---|"]
    for name in a:
        if name in b:
            d, lo, hi = newcombe(*a[name], *b[name])
            lines.append(f"| {name} | {_fmt_rate(*b[name])} | {_fmt_rate(*a[name])} | "
                         f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", type=Path, help="the validation cell's folder (holds run_all.sh)")
    ap.add_argument("--work", type=Path, help="where each cell's run goes (WORK/cellN)")
    ap.add_argument("--checkout", type=Path, default=ROOT, help="the project checkout to install and run")
    ap.add_argument("--cells", type=int, nargs="+", default=[0, 1], help="cell seeds (develop on 0-2)")
    ap.add_argument("--budget", default="small", choices=["tiny", "small", "full"])
    ap.add_argument("--adaptations", nargs="+", default=["cyclegan", "none"])
    ap.add_argument("--no-baselines", dest="baselines", action="store_false", help="skip oracle, oracle-geom, random")
    ap.add_argument("--episodes", type=int, default=30)
    ap.add_argument("--summaries", type=Path, nargs="+", help="finished runs (folders with summary.json): no run")
    ap.add_argument("--before", type=Path, nargs="+", help="finished runs of the same cells before a change: "
                    "adds the pooled change per policy")
    ap.add_argument("--write", action="store_true", help="put the table into docs/results.md (block transfer)")
    args = ap.parse_args()
    if args.summaries:
        runs = list(args.summaries)
    else:
        if args.cell is None or args.work is None:
            ap.error("--cell and --work are needed to run (or give --summaries)")
        if not (args.cell / "run_all.sh").exists():
            ap.error(f"{args.cell} has no run_all.sh: pass the validation cell's folder")
        if any(ch in str(args.work.resolve()) for ch in " ,="):
            ap.error("--work must not contain spaces, commas or '=' (paths travel as Hydra overrides)")
        runs, first = [], None
        for seed in args.cells:
            runs.append(run_cell(args.cell.resolve(), args.checkout.resolve(), args.work.resolve(), seed, args, first))
            first = first or runs[0]
    text = table(runs)
    if args.before:
        text = ("Before:\n\n" + table(list(args.before)) + "\n\nAfter:\n\n" + text + "\n\nChange, pooled over the cells:\n\n"
                + change_table(list(args.before), runs))
    print(text)
    if args.write:
        try:
            write_block("transfer", text, "python benchmarks/transfer.py " + " ".join(sys.argv[1:]))
        except ResultsDocError as exc:
            ap.error(str(exc))  # exit 2: the page lacks its block (the table is printed above)


if __name__ == "__main__":
    main()
