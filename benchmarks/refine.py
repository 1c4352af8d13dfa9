"""``sim2real-calibrate refine`` over many twin cells: how often it recovers the camera,
keeps the calibration as given, or writes a pose farther from the truth.

    .venv/bin/python benchmarks/refine.py [--cells 64] [--frames 10] [--seed 0] [--workers 2]
        [--out outputs/bench_refine] [--look natural|target] [--measured-walls] [--bin-inset-mm D]
        [--placement outer|inner] [--bin-placement outer|inner]
        [--replay [--seed S ...] [--accept KEY=VALUE] [--write]]
    .venv/bin/python benchmarks/refine.py --cell DIR [--cell DIR ...] [--measured-walls] [--placement P]

Each cell draws a wall height (20-60 mm, the contract's range) and thickness (3-30 mm)
and renders ``--frames`` frames from the packaged calibration's camera exactly. The
``natural`` look (default): natural-image textures on table and bin, traced cast
shadows, one lamp and look for the whole cell, 2-4 parts in the bin changing between
frames (``sim_render.api.render_cell_frames``). An error is injected in random
directions into the calibration handed to the fit: 0-20 mm and 0-1 degree drawn
uniformly, except every eighth cell, whose calibration is right (0-2 mm, 0-0.1 degree).

``--measured-walls`` hands the fit the walls' height and thickness as a user with a ruler
would (``fit.wall_height`` and ``fit.wall_thickness``): each reading off the truth by up to
MEASURE_MM (uniform, the cell's own stream), searched within ``fit.wall_tolerance``. Its fits
go to their own file (``..._walls.jsonl``), so the same cells can be compared with and without.
``--placement`` is the fit's ``fit.wall_placement`` (default: the packaged one, ``outer``):
where the walls stand on the workspace edges it is told. The twin builds the bin it is
handed with the inner faces on the edges, so for ``outer`` each cell's bin is rendered its
walls' thickness inside the workspace (the outer faces on the edges).
``--bin-placement`` renders the bin the other way than the fit assumes (a user who left the
placement at its default on a bin that stands the other way); default: as ``--placement``.
``--bin-inset-mm D`` renders the bin's walls D mm further inside the workspace edges than
the placement says (a bin off the convention, or a workspace measured a little wide;
negative: outside), the same cells otherwise. Each combination's fits go to a file of their
own (``..._insetDmm``, ``..._fitP_binQ``; the inner placement on both sides, which the
series before ``wall_placement`` existed used, has no suffix).

A cell is judged on the pose the command writes when it accepts the fit: the fit less its
move along the line of sight (``without_sight_move``), computed from the stored fit, so
fits stored before that change are judged as the command writes them now. It ends as one of:
- recovered: the camera centre written is at most half as far from the truth as the
  given one (and the pose is not wrong);
- kept: the calibration written as given (the fit's evidence was not strong enough);
- improved: written, nearer the truth, but not by half;
- wrong: written, and the camera centre farther from the truth than the given one, or
  the camera turned more than ANGLE_SLACK_DEG further from it (0.1 degree moves the
  image about a millimetre's worth at the workspace: the fit's own tolerance).

Every fit is stored, with what the decision weighs (``RefineResult.evidence``), one JSON
line a cell in ``--out/<look>_seed<S>_f<F>.jsonl``; a stopped run continues from it.
``--replay`` fits nothing: it judges the stored fits again with the decision rule in
``conf/calibrate_refine.yaml`` (``accept``) and prints the same table, which is how the
rule is chosen on one seed's cells and checked on another's. With ``--replay``, ``--seed``
takes several seeds (their sum is printed last) and ``--write`` puts that sum into
``docs/results.md``, block ``refine`` (``benchmarks/results_doc.py``).

``--cell DIR`` measures the command on a cell whose frames carry true labels (a folder
with ``calibration.json``, ``real/`` and ``geometry/NNNNN.npz`` holding a ``label`` map,
3 for the bin's walls, 4 for parts, pixel for pixel with the frame): it runs
``sim2real-calibrate refine`` as a user would and projects the walls through the given
and the written calibration onto the undistorted
frames, against the true wall pixels (parts' pixels left out): IoU, and the symmetric
mean distance between the two masks' boundaries in pixels, each pose with the wall
thickness its mask fits best and the true height (the labels' heights); the fit itself,
written or not, is measured too. The labels measure; the command never sees them, except
that ``--cell DIR --measured-walls`` hands it the walls' height and thickness as a ruler
would read them (:func:`ruler_walls`, from the labels), as the README's step 3 does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

from results_doc import ResultsDocError, write_block  # noqa: E402  (benchmarks/results_doc.py)

from perception.core.calibration import Calibration, default_calibration_path  # noqa: E402
from perception.core.geometry import raw_pixel_to_base  # noqa: E402
from perception.core.imageio import read_image  # noqa: E402
from perception.core.refine import (  # noqa: E402
    PLACEMENTS,
    AcceptSettings,
    RefineError,
    RefineSettings,
    bin_inside,
    decide,
    perturb,
    pose_change,
    refine_pose,
    without_sight_move,
    workspace_shift_mm,
)
from perception.robot.calibrate import main as calibrate  # noqa: E402
from policies.evaluate import wilson_interval  # noqa: E402

#: Every RIGHT_EVERY-th cell's calibration is right: at most these errors.
RIGHT_EVERY, RIGHT_MM, RIGHT_DEG = 8, 2.0, 0.1
#: The other cells' errors are drawn up to these.
MAX_MM, MAX_DEG = 20.0, 1.0
#: What the current rule reads from a stored fit's evidence beyond the first series' keys.
EVIDENCE_KEYS = frozenset({"correction_sigmas", "workspace_shift_mm", "halves_workspace_mm"})
#: A written pose may turn this much further from the truth than the given one and not be wrong.
ANGLE_SLACK_DEG = 0.1
#: ``--measured-walls``: a ruler's reading of the walls is off by up to this much (mm).
MEASURE_MM = 1.0


def _unit(rng: np.random.Generator) -> np.ndarray:
    v = rng.normal(size=3)
    return v / np.linalg.norm(v)


def draw_cell(seed: int, cell: int) -> dict:
    """The cell's walls and the error injected into its calibration (its own stream)."""
    rng = np.random.default_rng([seed, cell])
    right = cell % RIGHT_EVERY == 0
    mm, deg = (RIGHT_MM, RIGHT_DEG) if right else (MAX_MM, MAX_DEG)
    return {
        "cell": cell, "right": right,
        "height": float(rng.uniform(0.02, 0.06)), "thickness": float(rng.uniform(0.003, 0.03)),
        "x": np.r_[_unit(rng) * math.radians(rng.uniform(0, deg)), _unit(rng) * rng.uniform(0, mm) * 1e-3].tolist(),
    }


def measured_walls(seed: int, draw: dict) -> dict:
    """The walls as a user measured them: the truth off by up to MEASURE_MM each (a stream of
    the cell's own, apart from ``draw_cell``'s, so the cells stay those of the unmeasured run)."""
    rng = np.random.default_rng([seed, draw["cell"], 1])
    off = rng.uniform(-MEASURE_MM, MEASURE_MM, size=2) * 1e-3
    return {"wall_height": float(draw["height"] + off[0]), "wall_thickness": float(max(draw["thickness"] + off[1], 0.0))}


def settings(seed: int, draw: dict, measured: bool, placement: str = "inner") -> RefineSettings:
    """The fit's settings for a cell: the packaged ones, with the measured walls if asked and
    the walls' placement (a record stored before placements existed: ``inner``)."""
    walls = measured_walls(seed, draw) if measured else {}
    return RefineSettings.defaults(**walls, wall_placement=placement)


def fit_cell(args: tuple[dict, int, int, str, bool, float, str, str]) -> dict:
    """Render one cell, fit it, return everything the table and a replay need."""
    from sim_render.api import render_cell_frames  # lazy: hydra via sim_render.api

    cv2.setNumThreads(1)
    draw, frames_n, seed, look, measured, inset_mm, placement, bin_placement = args
    true = Calibration.load(default_calibration_path())
    given = true.replace(T_base_camera=perturb(true.T_base_camera, np.asarray(draw["x"])))
    # The twin stands the inner faces on the edges it is handed: for a bin whose outer faces
    # stand on the workspace edges it is handed the bin's inside; --bin-inset-mm moves the
    # bin that much further in.
    bin_cell = true.narrowed(inset_mm * 1e-3 + (draw["thickness"] if bin_placement == "outer" else 0.0))
    with tempfile.TemporaryDirectory() as tmp:
        folder = render_cell_frames(tmp, bin_cell, frames_n, draw["height"], draw["thickness"],
                                    seed=seed * 1000 + draw["cell"], natural_surfaces=look == "natural")
        frames = [read_image(p) for p in sorted(Path(folder).glob("*.png"))]
    t0 = time.perf_counter()
    res = refine_pose(frames, given, settings(seed, draw, measured, placement))
    before = pose_change(true.T_base_camera, given.T_base_camera)
    fit = pose_change(true.T_base_camera, res.T_base_camera)  # the fit; what is judged is written_pose(rec)
    return {**draw, "before_mm": before[0] * 1e3, "before_deg": before[1], "fit_mm": fit[0] * 1e3, "fit_deg": fit[1],
            "fit_height": res.wall_height, "fit_thickness": res.wall_thickness, "evidence": res.evidence,
            "fit_T_base_camera": res.T_base_camera.tolist(), "measured": measured,
            "placement": placement, "bin_placement": bin_placement,
            "seconds": time.perf_counter() - t0}


def workspace_error_mm(true: Calibration, T: np.ndarray) -> float:
    """How far from the truth a camera at pose ``T`` puts what it sees in the workspace (mm):
    :func:`perception.core.refine.workspace_shift_mm` from the true pose. This is the error a
    grasp found at a pixel would carry; a slide along the turn-and-move ridge, which moves
    the camera centre far, moves it little (the pose error alone reads it as wrong)."""
    return workspace_shift_mm(true, true.T_base_camera, T)


def written_pose(rec: dict, true: Calibration, acc: AcceptSettings) -> np.ndarray:
    """The pose the command writes when it accepts a stored fit: the fit less its move along
    the line of sight (:func:`perception.core.refine.without_sight_move`) unless
    ``accept.write_distance``, computed here so that fits stored before that choice existed
    are judged as the command writes them now."""
    fit = np.asarray(rec["fit_T_base_camera"])
    if acc.write_distance:
        return fit
    return without_sight_move(true, perturb(true.T_base_camera, np.asarray(rec["x"])), fit)[0]


def workspace_outcome(rec: dict, accepted: bool, true: Calibration,
                      acc: AcceptSettings) -> tuple[str | None, float, float | None]:
    """(outcome, given, written) by the workspace error against the true calibration ``true``:
    the outcome as :func:`outcome`'s, with ``workspace_error_mm`` for the distance; None for a
    stored fit without its pose."""
    given = workspace_error_mm(true, perturb(true.T_base_camera, np.asarray(rec["x"])))
    if "fit_T_base_camera" not in rec:
        return None, given, None
    fit = workspace_error_mm(true, written_pose(rec, true, acc))
    if not accepted:
        return "kept", given, fit
    return ("wrong" if fit > given else "recovered" if fit <= given / 2 else "improved"), given, fit


def written_error(rec: dict, true: Calibration, acc: AcceptSettings) -> tuple[float, float]:
    """(mm, deg): how far the pose written on acceptance is from the truth (the camera centre,
    the turn); a stored fit without its pose is judged by the fit's own errors."""
    if "fit_T_base_camera" not in rec:
        return rec["fit_mm"], rec["fit_deg"]
    shift, turn = pose_change(true.T_base_camera, written_pose(rec, true, acc))
    return shift * 1e3, turn


def outcome(rec: dict, st: RefineSettings, acc: AcceptSettings, written: tuple[float, float]) -> tuple[str, str]:
    """(outcome, the decision's reason) of a stored fit under the current rule, judged on the
    pose it writes (``written``: :func:`written_error`)."""
    accepted, reason = decide(rec["evidence"], st, acc)  # the contrast and correction limits: the same with measured walls
    if not accepted:
        return "kept", reason
    mm, deg = written
    if mm > rec["before_mm"] or deg > rec["before_deg"] + ANGLE_SLACK_DEG:
        return "wrong", reason
    if mm <= rec["before_mm"] / 2:
        return "recovered", reason
    return "improved", reason


def table(records: list[dict], seed: int, acc: AcceptSettings) -> dict:
    """Print a row a cell and the counts; return the counts (pose error and workspace error)."""
    print("| cell | wall mm (h / t) | given mm / deg | written mm / deg | outcome | workspace error given / written mm "
          "| by workspace error | rival share | halves mm / deg / workspace mm | sigma mm | sigmas spanned | workspace shift mm | gain "
          "| why kept |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    kinds = ("recovered", "kept", "improved", "wrong")
    counts, big = dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0)
    ws_counts, ws_big = dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0)
    right = {"kept": 0, "within_1mm": 0, "other": 0}
    centre_wrong = 0  # written with the camera centre farther from the truth (the angle aside)
    true = Calibration.load(default_calibration_path())  # every cell's camera (fit_cell)
    for rec in sorted(records, key=lambda r: r["cell"]):
        mm, deg = written_error(rec, true, acc)
        out, reason = outcome(rec, settings(seed, rec, rec.get("measured", False), rec.get("placement", "inner")), acc,
                              (mm, deg))
        ws_out, ws_given, ws_fit = workspace_outcome(rec, out != "kept", true, acc)
        e = rec["evidence"]
        counts[out] += 1
        centre_wrong += out != "kept" and mm > rec["before_mm"]
        if rec["before_mm"] >= 5.0:
            big[out] += 1
        if ws_out is not None:
            ws_counts[ws_out] += 1
            if ws_given >= 5.0:
                ws_big[ws_out] += 1
        if rec["right"]:
            key = "kept" if out == "kept" else "within_1mm" if mm <= 1.0 else "other"
            right[key] += 1
        fit_ws = "n/a" if ws_fit is None else f"{ws_fit:.1f}"
        print(f"| {rec['cell']}{' (right)' if rec['right'] else ''} | {rec['height'] * 1e3:.0f} / "
              f"{rec['thickness'] * 1e3:.1f} | {rec['before_mm']:.1f} / {rec['before_deg']:.2f} | {mm:.1f} / "
              f"{deg:.2f} | {out} | {ws_given:.1f} / {fit_ws} | {ws_out or 'n/a'} | "
              f"{e['rival_share']:.3f} | {e['halves_mm']:.1f} / {e['halves_deg']:.2f} / "
              f"{e['halves_workspace_mm']:.2f} | "
              f"{e['sigma_mm']:.1f} | {e['correction_sigmas']:.1f} | "
              f"{e['workspace_shift_mm']:.1f} | {e['explained'] - e['explained_given']:.2f} | "
              f"{reason.split(':')[0] if out == 'kept' else ''} |")
    n, n_big = len(records), sum(big.values())
    n_ws, n_ws_big = sum(ws_counts.values()), sum(ws_big.values())
    summary = {"cells": n, **counts, "wrong_by_centre": centre_wrong, "big_error_cells": n_big, "big_recovered": big["recovered"],
               "right_cells": sum(right.values()), **{f"right_{k}": v for k, v in right.items()},
               "workspace": {"cells": n_ws, **ws_counts, "big_error_cells": n_ws_big,
                             "big_recovered": ws_big["recovered"]}}
    print()
    print(f"{counts['recovered']}/{n} recovered, {counts['kept']}/{n} kept as given, {counts['improved']}/{n} improved "
          f"(not halved), {counts['wrong']}/{n} written wrong ({centre_wrong} by the camera centre alone); of the "
          f"{n_big} cells given >= 5 mm off: "
          f"{big['recovered']} recovered ({100 * big['recovered'] / max(n_big, 1):.0f}%); of the "
          f"{sum(right.values())} right calibrations: {right['kept']} kept, {right['within_1mm']} written within 1 mm, "
          f"{right['other']} written further")
    if n_ws:
        print(f"by the workspace error ({n_ws} fits with their pose): {ws_counts['recovered']} recovered, "
              f"{ws_counts['improved']} improved, {ws_counts['wrong']} written wrong; of the {n_ws_big} cells whose "
              f"given calibration is >= 5 mm off in the workspace: {ws_big['recovered']} recovered "
              f"({100 * ws_big['recovered'] / max(n_ws_big, 1):.0f}%)")
    return summary


def wall_mask(calib: Calibration, T: np.ndarray, height: float, thickness: float, placement: str) -> np.ndarray:
    """The bin's walls as boxes (standing on the workspace edges as ``placement`` says:
    :func:`perception.core.refine.bin_inside`) projected through the pinhole ``calib.K`` at
    pose ``T``: a boolean mask of the undistorted image."""
    t = max(thickness, 0.002)
    inside = bin_inside(calib, t, placement)
    (x0, x1), (y0, y1) = inside.workspace_x, inside.workspace_y
    z0, z1 = calib.table_z, calib.table_z + height
    boxes = [((x0 - t, x0), (y0 - t, y1 + t)), ((x1, x1 + t), (y0 - t, y1 + t)),
             ((x0 - t, x1 + t), (y0 - t, y0)), ((x0 - t, x1 + t), (y1, y1 + t))]
    w, h = calib.image_size
    mask = np.zeros((h, w), np.uint8)
    for (a0, a1), (b0, b1) in boxes:
        corners = np.array([[a, b, z] for a in (a0, a1) for b in (b0, b1) for z in (z0, z1)])
        pc = (corners - T[:3, 3]) @ T[:3, :3]
        uv = (pc[:, :2] / pc[:, 2:3]) @ calib.K[:2, :2].T + calib.K[:2, 2]
        cv2.fillConvexPoly(mask, cv2.convexHull(np.round(uv * 16).astype(np.int32)), 1, cv2.LINE_8, 4)
    return mask.astype(bool)


def _boundary_px(a: np.ndarray, b: np.ndarray, valid: np.ndarray) -> float:
    """Symmetric mean distance (px) between the boundaries of masks ``a`` and ``b``."""
    def edge(m):
        m8 = m.astype(np.uint8)
        return (m8 - cv2.erode(m8, np.ones((3, 3), np.uint8))).astype(bool) & valid

    ea, eb = edge(a), edge(b)
    if not ea.any() or not eb.any():
        return math.inf
    da = cv2.distanceTransform((~eb).astype(np.uint8), cv2.DIST_L2, 3)
    db = cv2.distanceTransform((~ea).astype(np.uint8), cv2.DIST_L2, 3)
    return float((da[ea].mean() + db[eb].mean()) / 2)


def ruler_walls(given: Calibration, labels: list) -> tuple[float, float]:
    """The walls' height and thickness (m) as a user's ruler would read them, taken from a
    labelled cell's true per-pixel heights: the height is the wall pixels' top (99th
    percentile); the thickness, how wide the wall's top surface is across each wall, its
    pixels cast through the given calibration onto the top's plane (2nd to 98th percentile
    across the wall, the median of the four walls: a camera error of a few mm blurs it like
    a ruler's reading), wherever the walls stand on the workspace edges."""
    h = float(np.nanmax([np.nanpercentile(g["height"][g["label"] == 3].astype(float), 99) for g in labels]))
    (x0, x1), (y0, y1) = given.workspace_x, given.workspace_y
    points = []
    for g in labels:
        top = (g["label"] == 3) & (g["height"].astype(float) >= h - 0.003)
        v, u = np.nonzero(top)
        if len(u):
            points.append(raw_pixel_to_base(np.stack([u, v], axis=1).astype(float), given, given.table_z + h)[:, :2])
    if not points:
        return h, 0.0
    p = np.concatenate(points)
    # Each top pixel belongs to the wall whose edge it is nearest; a corner's pixels, to
    # both walls' spans, are few against a wall's length.
    gaps = np.abs(np.stack([p[:, 0] - x0, p[:, 0] - x1, p[:, 1] - y0, p[:, 1] - y1], axis=1))
    nearest = np.argmin(gaps, axis=1)
    widths = []
    for k in range(4):
        across = p[nearest == k, k // 2]
        if len(across) >= 50:
            widths.append(float(np.percentile(across, 98) - np.percentile(across, 2)))
    return h, float(np.median(widths)) if widths else 0.0


def measure_cell(folder: Path, measured: bool = False, placement: str = "outer") -> dict:
    """Refine on a labelled cell's frames; the walls of the given and the written calibration
    against the true wall pixels. ``measured``: the walls given as a ruler reads them
    (:func:`ruler_walls`), as the README's step 3 does."""
    cal_path, real, geometry = folder / "calibration.json", folder / "real", folder / "geometry"
    if not (cal_path.is_file() and real.is_dir() and geometry.is_dir()):
        raise SystemExit(f"--cell {folder}: not a labelled cell (needs calibration.json, real/ and geometry/)")
    given = Calibration.load(cal_path)
    labels = [np.load(npz) for npz in sorted(geometry.glob("*.npz"))]
    # The walls' true height from the labels' own heights; the thickness, which the labels
    # do not give directly, is the one each pose's mask fits best (fair to both poses).
    h, ruler_t = ruler_walls(given, labels)
    walls = [f"fit.wall_height={h:.4f}", f"fit.wall_thickness={ruler_t:.4f}"] if measured else []
    walls.append(f"fit.wall_placement={placement}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "refined.json"
        t0 = time.perf_counter()
        calibrate(["refine", f"calibration={cal_path}", f"real_dir={real}", f"out={out}", *walls])
        seconds = time.perf_counter() - t0
        written = Calibration.load(out)
        report = json.loads(out.read_text())["calibration_report"]["refine"]
    w, hh = given.image_size
    maps = cv2.initUndistortRectifyMap(given.K, given.dist, None, given.K, (w, hh), cv2.CV_32FC1)
    label_maps = [cv2.remap(g["label"], maps[0], maps[1], cv2.INTER_NEAREST) for g in labels]
    poses = {"given": given.T_base_camera, "written": written.T_base_camera,
             "fit": np.asarray(report["fit_T_base_camera"])}
    result = {"cell": str(folder), "written": report["written"], "reason": report["reason"],
              "fit_correction_mm": report["fit_correction_mm"], "fit_correction_deg": report["fit_correction_deg"],
              "fit_wall_mm": [round(report["wall_height_m"] * 1e3, 1), round(report["wall_thickness_m"] * 1e3, 1)],
              "true_wall_height_mm": round(h * 1e3, 1), "ruler_thickness_mm": round(ruler_t * 1e3, 1),
              "measured_walls": measured, "placement": placement, "frames": len(labels), "seconds": round(seconds)}
    for k, T in poses.items():
        best = (-1.0, 0.0, None)
        for t in np.arange(0.002, 0.0401, 0.002):
            mask = wall_mask(given, T, h, float(t), placement)
            inter = union = 0
            for label in label_maps:
                valid = label != 4  # a part in front of a wall hides it: neither mask is judged there
                inter += int((mask & (label == 3)).sum())
                union += int(((mask & valid) | (label == 3)).sum())
            if inter / max(union, 1) > best[0]:
                best = (inter / max(union, 1), float(t), mask)
        iou, t, mask = best
        edges = [_boundary_px(mask & (label != 4), label == 3, label != 4) for label in label_maps]
        result[f"{k}_wall_iou"] = round(iou, 4)
        result[f"{k}_wall_edge_px"] = round(float(np.median(edges)), 3)
        result[f"{k}_best_thickness_mm"] = round(t * 1e3, 1)
    print(f"| {folder.name} | {report['written']} | {report['fit_correction_mm']:.1f} / "
          f"{report['fit_correction_deg']:.2f} | {result['given_wall_iou']:.3f} / {result['written_wall_iou']:.3f} / "
          f"{result['fit_wall_iou']:.3f} | {result['given_wall_edge_px']:.2f} / {result['written_wall_edge_px']:.2f} / "
          f"{result['fit_wall_edge_px']:.2f} | {report['reason'][:90]} |", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", type=int, default=64)
    ap.add_argument("--frames", type=int, default=10)
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="the cells' seed; with --replay several, judged together (one summary over all)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--look", choices=("natural", "target"), default="natural")
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_refine"))
    ap.add_argument("--measured-walls", action="store_true",
                    help="give the fit the walls' height and thickness, each read within 1 mm of the truth")
    ap.add_argument("--bin-inset-mm", type=float, default=0.0,
                    help="render the bin's walls this far inside the workspace edges the fit is told (a bin off "
                         "the convention, or a workspace measured a little wide); its fits go to their own file")
    packaged = RefineSettings.defaults().wall_placement
    ap.add_argument("--placement", choices=PLACEMENTS, default=packaged,
                    help=f"the fit's fit.wall_placement (default {packaged}, the packaged one); the twin's bin is "
                         "rendered so")
    ap.add_argument("--bin-placement", choices=PLACEMENTS, default=None,
                    help="render the bin standing this way instead (default: as --placement)")
    ap.add_argument("--replay", action="store_true", help="judge the stored fits again; fit nothing")
    ap.add_argument("--accept", action="append", default=[], metavar="KEY=VALUE",
                    help="judge with this accept setting instead of the packaged one (repeatable): a replay "
                         "tries a rule without editing conf/calibrate_refine.yaml")
    ap.add_argument("--write", action="store_true",
                    help="with --replay: put the summary into docs/results.md (block refine; benchmarks/results_doc.py)")
    ap.add_argument("--cell", type=Path, action="append", default=[], metavar="DIR",
                    help="a labelled cell's folder (repeatable): refine there, walls against the true wall pixels")
    args = ap.parse_args()
    args.bin_placement = args.bin_placement or args.placement
    if args.cell and (args.accept or args.bin_placement != args.placement):
        ap.error("--accept and --bin-placement belong to twin cells; with --cell the command runs as a user runs it "
                 "on the cell's own bin")
    if args.cell:
        print("| cell | written | fit mm / deg | wall IoU given / written / fit | wall edge px given / written / fit "
              "| reason |")
        print("|---|---|---|---|---|---|")
        cells = [measure_cell(folder, args.measured_walls, args.placement) for folder in args.cell]
        print(json.dumps({"cells": cells}))
        return 0
    cell = Calibration.load(default_calibration_path())
    side_mm = 1e3 * min(cell.workspace_x[1] - cell.workspace_x[0], cell.workspace_y[1] - cell.workspace_y[0])
    if not abs(args.bin_inset_mm) < side_mm / 4:
        ap.error(f"--bin-inset-mm {args.bin_inset_mm:g}: the bin must stay a bin (|D| < {side_mm / 4:g} mm, a quarter "
                 "of the workspace's shorter side)")
    if len(args.seed) > 1 and not args.replay:
        ap.error("several --seed values judge stored fits together: add --replay (fit one seed at a time)")
    if args.write and not args.replay:
        ap.error("--write puts a replay's summary into docs/results.md: add --replay")
    try:
        acc = AcceptSettings.defaults(**{k: _setting(v) for k, v in (kv.split("=", 1) for kv in args.accept)})
    except (ValueError, RefineError) as exc:
        ap.error(f"--accept: {exc}")
    summaries = [judge_seed(args, seed, acc) for seed in args.seed]
    total = add_up(summaries)
    if len(summaries) > 1:
        print(f"\nall {len(summaries)} seeds: {total['cells']} cells, {total['kept']} kept, {total['wrong']} written wrong "
              f"by the pose ({total['wrong_by_centre']} by the centre), {total['workspace']['wrong']} by the workspace")
        print(json.dumps({"look": args.look, "seeds": args.seed, "frames": args.frames, **total}))
    if args.write:
        command = "python benchmarks/refine.py " + " ".join(sys.argv[1:])
        try:
            write_block("refine", results_table(total, args), command)
        except ResultsDocError as exc:
            ap.error(str(exc))
    return 0


def _setting(text: str) -> float | bool:
    """An ``--accept`` value: true / false, or a number."""
    word = text.strip().lower()
    return word == "true" if word in ("true", "false") else float(text)


def add_up(summaries: list[dict]) -> dict:
    """The seeds' summaries summed, key by key (the workspace's too)."""
    total: dict = {}
    for s in summaries:
        for k, v in s.items():
            if isinstance(v, dict):
                total[k] = add_up([total.get(k, {}), v])
            elif isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
    return total


def results_table(total: dict, args: argparse.Namespace) -> str:
    """The summary as ``docs/results.md`` shows it (counts with a Wilson 95% interval on the recovered share)."""
    ws = total["workspace"]
    written = ws["cells"] - ws["kept"]
    lo, hi = wilson_interval(ws["big_recovered"], ws["big_error_cells"])
    share = ws["big_recovered"] / max(1, ws["big_error_cells"])
    walls = "walls measured within 1 mm" if args.measured_walls else "walls fitted"
    walls += f", the walls' {args.placement} faces on the workspace edges"
    if args.bin_placement != args.placement:
        walls += f", the bin's {args.bin_placement} faces there"
    if args.bin_inset_mm:
        walls += f", the bin {args.bin_inset_mm:g} mm further inside"
    return "\n".join([
        f"Twin cells of the `{args.look}` look, seeds {', '.join(map(str, args.seed))}, {args.frames} frames a cell, "
        f"{walls}; the decision rule of `conf/calibrate_refine.yaml`.", "",
        "| cells | kept as given | written, workspace nearer the truth | written, workspace farther "
        "| recovered (workspace error halved), of those >= 5 mm off | written wrong by the pose (by the centre) |",
        "|---|---|---|---|---|---|",
        f"| {ws['cells']} | {ws['kept']} | {written - ws['wrong']} | {ws['wrong']} | {ws['big_recovered']} / "
        f"{ws['big_error_cells']} = {100 * share:.1f}% [{100 * lo:.0f}, {100 * hi:.0f}] | {total['wrong']} "
        f"({total['wrong_by_centre']}) |",
    ])


def judge_seed(args: argparse.Namespace, seed: int, acc: AcceptSettings) -> dict:
    """One seed's cells: fitted (those not stored yet) unless ``--replay``, judged, printed; its summary."""
    inset = f"_inset{args.bin_inset_mm:g}mm" if args.bin_inset_mm else ""
    if (args.placement, args.bin_placement) != ("inner", "inner"):  # the series before placements: no suffix
        inset += f"_fit{args.placement}_bin{args.bin_placement}"
    path = args.out / f"{args.look}_seed{seed}_f{args.frames}{'_walls' if args.measured_walls else ''}{inset}.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["cell"]] = rec
    stale = sorted(c for c, rec in done.items() if not EVIDENCE_KEYS <= rec["evidence"].keys())
    if stale:
        raise SystemExit(f"{path}: cells {stale} were fitted before the fit reported "
                         f"{' and '.join(sorted(EVIDENCE_KEYS))}, which the rule weighs: move the file aside "
                         "and fit them again")
    todo = [draw_cell(seed, c) for c in range(args.cells) if c not in done]
    if args.replay:
        if todo:
            print(f"{path}: {len(todo)} of {args.cells} cells not fitted yet; judging the {len(done)} stored",
                  file=sys.stderr)
    elif todo:
        args.out.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(f"fitting {len(todo)} cells ({len(done)} stored in {path}) on {args.workers} worker(s)", file=sys.stderr)
        with ProcessPoolExecutor(max_workers=args.workers) as pool, path.open("a") as fh:
            jobs = [(d, args.frames, seed, args.look, args.measured_walls, args.bin_inset_mm, args.placement,
                     args.bin_placement) for d in todo]
            for k, rec in enumerate(pool.map(fit_cell, jobs), 1):
                fh.write(json.dumps(rec) + "\n")
                fh.flush()  # a line a cell: a stopped run loses at most the cells in flight
                done[rec["cell"]] = rec
                print(f"cell {rec['cell']} fitted ({k}/{len(todo)}, {rec['seconds']:.0f} s)", file=sys.stderr)
    records = [done[c] for c in range(args.cells) if c in done]
    summary = table(records, seed, acc)
    print(json.dumps({"look": args.look, "seed": seed, "frames": args.frames, **summary}))
    return {"cells": len(records), **summary}


if __name__ == "__main__":
    sys.exit(main())
