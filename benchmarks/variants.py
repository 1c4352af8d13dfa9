"""One artifact, variants of its metadata, the same closed-loop scenes: a paired A/B in a cell.

    .venv/bin/python benchmarks/variants.py --cell ../shared/validation-cell --python CELL_VENV_PYTHON \\
        --work /tmp/variants --run 0:RUN0 --run 1:RUN1 \\
        --variant 'walls={"geometry.walls": {"height": 0.059, "thickness": 0.012}}' \\
        --variant 'rule_first={"decode.rule_first": 0.05}' [--seeds 0 1 2 3 4] [--episodes 30]

``--run K:DIR``: cell seed ``K`` and a folder holding ``calibration.json`` (the cell's, as
``make_real_frames.py --out DIR`` writes it) and ``artifact/`` (e.g. a pipeline's
``output_dir`` run with that calibration). ``--variant NAME=JSON``: keys of ``metadata.json``
as dotted paths (``decode.rule_first``, ``geometry.walls``, ``quality_threshold``) and their
new values (``null`` removes the key); every variant is the run's artifact copied with only
those changed, checked by the loader. A key ``serve:KEY`` is a ``sim2real-serve`` setting
instead (``serve:repeats.radius``: ``repeats.radius=VALUE`` on its command line), the artifact
left as it is. ``base`` (the artifact as it is, served with the defaults) is always measured.
``--other NAME=K:DIR`` (repeatable, one per cell of ``--run``): another run folder's artifact,
as it is, measured on the same scenes as variant NAME (two pipelines that differ in one
setting, paired like any variant).

Each (variant, cell) is served by ``sim2real-serve`` on loopback and driven by the cell's own
``evaluate.py --episodes N --seed S --cell-seed K``: every variant meets the same scenes, so
the differences are paired; they resample whole episodes (4,000 draws). A finished
``WORK/NAME/cellK/seedS.json`` is not run again. The cell is a development proxy: nothing here
imports its code, only the JSON its script writes. About 40 s per 30 episodes on 2 cores.

The last stdout line is one JSON object ``{"variants": {NAME: {"cells": {K: {...}}, "pooled":
{...}}}}``, each ``{...}`` holding ``successes``, ``attempts`` (a "no grasp" answer counts as a failed one, as
in the cell's ``success_rate``), ``no_grasp``, ``rate``, ``wilson``, ``empty_bin_null`` (the
empty bins answered null, and asked, after cleared episodes) and, but for ``base``, ``minus_base`` with its ``interval``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from perception.core.artifact import ArtifactError, load_metadata
from policies.evaluate import wilson_interval as wilson

BIN = Path(sys.executable).parent  # the checkout's console scripts
SERVE = "serve:"  # a variant key with this prefix is a sim2real-serve setting, not the artifact's


def patched(src: Path, dst: Path, changes: dict) -> Path:
    """``src`` copied to ``dst`` with ``changes`` (dotted key -> value; ``None`` removes it) in its
    ``metadata.json``, checked by :func:`load_metadata`."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    meta = json.loads((dst / "metadata.json").read_text())
    for key, value in changes.items():
        *path, last = key.split(".")
        node = meta
        for part in path:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    (dst / "metadata.json").write_text(json.dumps(meta, indent=1))
    load_metadata(dst)  # raises ArtifactError naming the bad field
    return dst


def split_variant(changes: dict) -> tuple[dict, dict]:
    """A variant's ``metadata.json`` changes and its ``sim2real-serve`` settings (``serve:KEY``)."""
    serve = {key.removeprefix(SERVE): v for key, v in changes.items() if key.startswith(SERVE)}
    return {key: v for key, v in changes.items() if not key.startswith(SERVE)}, serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def evaluate(artifact: Path, calibration: Path, cell: Path, python: str, cell_seed: int, seeds: list[int],
             episodes: int, out: Path, serve: dict | None = None) -> None:
    """Serve ``artifact`` (with the ``sim2real-serve`` settings ``serve``) and run the cell's
    evaluation for every seed not finished in ``out``."""
    todo = [s for s in seeds if not (out / f"seed{s}.json").is_file()]
    if not todo:
        return
    out.mkdir(parents=True, exist_ok=True)
    port, token = _free_port(), secrets.token_hex(16)
    with open(out / "serve.log", "ab") as log:
        server = subprocess.Popen([str(BIN / "sim2real-serve"), f"artifact={artifact}", f"calibration={calibration}",
                                   "host=127.0.0.1", f"port={port}", f"token={token}",
                                   *(f"{k}={json.dumps(v)}" for k, v in (serve or {}).items())],
                                  stdout=log, stderr=log)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"sim2real-serve exited {server.returncode}: see {out / 'serve.log'}") from None
                time.sleep(0.5)
        for s in todo:
            tmp = out / f"seed{s}.json.part"
            with open(out / "evaluate.log", "ab") as progress:  # the cell's progress lines
                subprocess.run([python, str(cell / "evaluate.py"), "--url", f"http://127.0.0.1:{port}", "--token",
                                token, "--episodes", str(episodes), "--seed", str(s), "--cell-seed", str(cell_seed),
                                "--out", str(tmp)], check=True, stdout=subprocess.DEVNULL, stderr=progress)
            os.replace(tmp, out / f"seed{s}.json")
            print(f"  {out.parent.name} cell {cell_seed} seed {s} done", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=60)


def read_results(folder: Path, seeds: list[int]) -> tuple[dict, list[int]]:
    """A finished (variant, cell): ``(seed, episode) -> [successes, attempts, no_grasp]`` (an
    attempt answered "no grasp" counts as a failed attempt, as the cell's ``success_rate``
    does), and ``[answered null, asked]`` of the empty bins the cell sent after each cleared
    episode."""
    eps: dict = {}
    empty = [0, 0]
    for s in seeds:
        result = json.loads((folder / f"seed{s}.json").read_text())
        for a in result["attempts"]:
            e = eps.setdefault((s, a["episode"]), [0, 0, 0])
            e[1] += 1
            e[2] += a.get("grasp") is None
            e[0] += a.get("grasp") is not None and a["outcome"] == "success"
        empty[0] += int(result["summary"].get("empty_bin_null", 0))
        empty[1] += int(result["summary"].get("empty_bin_queries", 0))
    return eps, empty


def figures(eps: dict, base: dict | None, rng: np.random.Generator, draws: int = 4000) -> dict:
    a = np.array([eps[k] for k in sorted(eps)])
    k, n = int(a[:, 0].sum()), int(a[:, 1].sum())
    out = {"successes": k, "attempts": n, "no_grasp": int(a[:, 2].sum()), "rate": k / max(n, 1),
           "wilson": list(wilson(k, n))}
    if base is not None:
        keys = sorted(set(eps) & set(base))
        x, y = np.array([eps[q] for q in keys]), np.array([base[q] for q in keys])
        rate = lambda m: m[:, 0].sum() / max(1, m[:, 1].sum())  # noqa: E731
        diffs = []
        for _ in range(draws):
            i = rng.integers(0, len(keys), len(keys))
            diffs.append(rate(x[i]) - rate(y[i]))
        out["minus_base"] = float(rate(x) - rate(y))
        out["interval"] = [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", type=Path, required=True, help="the validation cell's folder (its evaluate.py)")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs the cell's evaluate.py")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--run", action="append", required=True, help="K:DIR (DIR holds calibration.json and artifact/)")
    ap.add_argument("--variant", action="append", default=[], help='NAME={"dotted.key": value, ...}')
    ap.add_argument("--other", action="append", default=[], help="NAME=K:DIR, another run's artifact as it is")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--episodes", type=int, default=30)
    args = ap.parse_args(argv)
    try:
        runs = {int(k): Path(d) for k, d in (r.split(":", 1) for r in args.run)}
        variants = {"base": {}}
        for v in args.variant:
            name, _, spec = v.partition("=")
            if not name or name == "base" or not isinstance(json.loads(spec), dict):
                raise ValueError(f"--variant {v!r}: NAME={{json object}}, NAME not 'base'")
            variants[name] = json.loads(spec)
        others: dict[str, dict[int, Path]] = {}
        for o in args.other:
            name, _, spec = o.partition("=")
            k, _, d = spec.partition(":")
            if not name or name in variants or not d:
                raise ValueError(f"--other {o!r}: NAME=K:DIR, NAME not 'base' nor a --variant's")
            others.setdefault(name, {})[int(k)] = Path(d)
        for name, dirs in others.items():
            if set(dirs) != set(runs):
                raise ValueError(f"--other {name}: one folder for each --run cell {sorted(runs)}, got {sorted(dirs)}")
            variants[name] = {}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k, d in [*runs.items(), *((k, d) for dirs in others.values() for k, d in dirs.items())]:
        if not (d / "calibration.json").is_file() or not (d / "artifact" / "metadata.json").is_file():
            print(f"error: --run or --other {k}:{d} needs {d}/calibration.json and {d}/artifact/", file=sys.stderr)
            return 2
    for name, changes in variants.items():
        for k, d in others.get(name, runs).items():
            folder = args.work / name / f"cell{k}"
            meta, serve = split_variant(changes)
            try:
                art = d / "artifact" if not meta else patched(d / "artifact", folder / "artifact", meta)
            except ArtifactError as exc:
                print(f"error: variant {name}: {exc}", file=sys.stderr)
                return 2
            evaluate(art, d / "calibration.json", args.cell, args.python, k, args.seeds, args.episodes, folder, serve)
    rng = np.random.default_rng(0)
    result: dict = {"variants": {}}
    read = {(name, k): read_results(args.work / name / f"cell{k}", args.seeds) for name in variants for k in runs}
    # Episodes keyed (cell, seed, episode), so that the cells pool.
    episodes = {key: {(key[1], *q): e for q, e in eps.items()} for key, (eps, _) in read.items()}
    for name in variants:
        ref = None if name == "base" else {k: episodes["base", k] for k in runs}
        cells = {k: figures(episodes[name, k], None if ref is None else ref[k], rng) for k in runs}
        pooled = figures({q: e for k in runs for q, e in episodes[name, k].items()},
                         None if ref is None else {q: e for k in runs for q, e in ref[k].items()}, rng)
        for k in runs:
            cells[k]["empty_bin_null"] = read[name, k][1]
        pooled["empty_bin_null"] = [sum(read[name, k][1][i] for k in runs) for i in (0, 1)]
        result["variants"][name] = {"cells": cells, "pooled": pooled}
        d = "" if ref is None else f", {100 * pooled['minus_base']:+.1f} [{100 * pooled['interval'][0]:+.1f}, " \
                                   f"{100 * pooled['interval'][1]:+.1f}] points"
        print(f"{name}: {pooled['successes']}/{pooled['attempts']} = {100 * pooled['rate']:.1f}% "
              f"[{100 * pooled['wilson'][0]:.1f}, {100 * pooled['wilson'][1]:.1f}]{d}; no grasp {pooled['no_grasp']}; "
              f"empty bins answered null {pooled['empty_bin_null'][0]}/{pooled['empty_bin_null'][1]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
