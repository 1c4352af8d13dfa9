"""The refinement's floor: where the last step of ``sim2real-calibrate refine`` settles when it
starts at the true pose, on twin cells (the same cells as ``benchmarks/refine.py``).

    .venv/bin/python benchmarks/refine_floor.py [--cells 16] [--seed 0] [--frames 10] [--workers 2]

For each cell: render its frames from the true camera (``render_cell_frames``, the natural
look), build the edge evidence the fit uses, and then, with the walls' true height and
thickness (as measured, within ``fit.wall_tolerance``):

- each visible wall edge's *bias*: the median offset, in pixels across the line, from the
  true edge to the strongest edge the fit would find there;
- the *drift*: the least-squares step (:func:`perception.core.refine._least_squares`, the
  fit's last step) started at the true pose, with every line and with each class of line
  left out (``silhouette``: a top edge whose adjacent face the camera does not see, so the
  floor or table behind it makes the edge; ``foot``: where a face meets the floor or table;
  ``crease``: a top edge between two faces the camera sees).

The drift is the fit's floor: a correction smaller than it cannot be told from it. Nothing
here is a decision; ``accept.min_correction_sigmas`` is chosen with ``benchmarks/refine.py
--replay`` (``docs/experiments/2026-12-06-refine-corrections-measured-in-sigmas.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

from refine import draw_cell  # noqa: E402  (benchmarks/refine.py: the same cells)

from perception.core import refine as R  # noqa: E402
from perception.core.calibration import Calibration, default_calibration_path  # noqa: E402
from perception.core.imageio import read_image  # noqa: E402

#: Line classes left out in turn (an empty set: every line).
LEAVE_OUT = {"all": (), "no silhouettes": ("silhouette",), "no feet": ("foot",), "creases only": ("silhouette", "foot")}


def line_class(name: str, calib: Calibration, cam: np.ndarray, thickness: float) -> str:
    """``foot``, ``crease`` or ``silhouette`` for a line of :func:`perception.core.refine.wall_lines`."""
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    wall, kind = name.split("/")
    if kind.endswith("foot"):
        return "foot"
    axis = 0 if wall.startswith("x") else 1
    c = {"x_min": x0, "x_max": x1, "y_min": y0, "y_max": y1}[wall]
    inward = 1.0 if wall.endswith("min") else -1.0
    face_seen = (cam[axis] - c) * inward > 0 if kind == "inner_top" else (cam[axis] - (c - inward * thickness)) * inward < 0
    return "crease" if face_seen else "silhouette"


def measure(args: tuple[int, int, int]) -> dict:
    """One cell: its lines' biases and the drift from the truth with each line set."""
    from sim_render.api import render_cell_frames  # lazy: hydra and pybullet (render only)

    seed, cell, frames_n = args
    cv2.setNumThreads(1)
    draw = draw_cell(seed, cell)
    true = Calibration.load(default_calibration_path())
    T, h, t = true.T_base_camera, draw["height"], draw["thickness"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = render_cell_frames(tmp, true, frames_n, h, t, seed=seed * 1000 + cell, natural_surfaces=True)
        frames = [read_image(p) for p in sorted(Path(folder).glob("*.png"))]
    st = R.RefineSettings.defaults(wall_height=h, wall_thickness=t)
    sharp = R._smoothed(R.edge_evidence(frames, true, st.clip_percentile), st.scales_px[-1])
    lines, off = R._edge_offsets(sharp, true, T, h, t, st)
    biases, k = [], 0
    for name, pts, _uv, _n in lines:
        o = off[k:k + len(pts)]
        k += len(pts)
        if np.isfinite(o).any():
            biases.append((line_class(name, true, T[:3, 3], t), float(np.nanmedian(o))))
    lim = np.array([math.radians(st.search_deg)] * 3 + [st.max_shift_m * 1.5] * 3)
    lo, hi = np.r_[-lim, st.height_range[0], st.thickness_range[0]], np.r_[lim, st.height_range[1], st.thickness_range[1]]
    visible, drift = R._visible_lines, {}
    try:
        for label, leave in LEAVE_OUT.items():
            def kept(calib, T_, height, thickness, samples, margin, sep, leave=leave):
                found, edge_on = visible(calib, T_, height, thickness, samples, margin, sep)
                return [ln for ln in found if line_class(ln[0], calib, T_[:3, 3], thickness) not in leave], edge_on
            R._visible_lines = kept
            x = R._least_squares(sharp, true, T, np.array([0, 0, 0, 0, 0, 0, h, t], float), lo, hi, st)
            mm, deg = R.pose_change(T, R.perturb(T, x[:6]))
            drift[label] = (mm * 1e3, deg)
    finally:
        R._visible_lines = visible
    return {"cell": cell, "biases": biases, "drift": drift}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", type=int, default=10)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        cells = list(pool.map(measure, [(args.seed, c, args.frames) for c in range(args.cells)]))
    by_class = defaultdict(list)
    for c in cells:
        for cls, b in c["biases"]:
            by_class[cls].append(abs(b))
    print("| line class | lines | median abs bias px | p90 px |\n|---|---|---|---|")
    for cls in sorted(by_class):
        v = np.asarray(by_class[cls])
        print(f"| {cls} | {len(v)} | {np.median(v):.2f} | {np.percentile(v, 90):.2f} |")
    print("\n| lines used | drift from the truth: median / p90 / max mm | median deg | cells over 2 mm |\n|---|---|---|---|")
    for label in LEAVE_OUT:
        mm = np.asarray([c["drift"][label][0] for c in cells])
        deg = np.asarray([c["drift"][label][1] for c in cells])
        print(f"| {label} | {np.median(mm):.1f} / {np.percentile(mm, 90):.1f} / {mm.max():.1f} | {np.median(deg):.2f} "
              f"| {int((mm > 2).sum())} / {len(mm)} |")
    print(json.dumps({"seed": args.seed, "frames": args.frames, "cells": cells}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
