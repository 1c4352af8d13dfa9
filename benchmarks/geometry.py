"""The geometry network's height error on a cell's own labelled frames and on held-out sim frames.

    .venv/bin/python benchmarks/geometry.py [--geometry geometry_base_v2 | --artifact ART [--precision auto]]
        [--cell DIR ...] [--sim N] [--panel FILE] [--real DIR --calibration FILE] [--write]

``--cell DIR`` (repeatable) is a folder made by the validation cell's
``make_real_frames.py --out DIR --geometry DIR/geometry``: ``calibration.json``, the frames
``real/NNNNN.png`` (or ``.jpg``) and their true geometry ``geometry/NNNNN.npz`` (``height``,
metres above ``table_z`` of the first surface each raw pixel sees, NaN where none; ``label``,
0 nothing, 1 table, 2 bin floor, 3 bin wall, 4 part), pixel for pixel with the raw frame.
The labels are for measuring only: nothing trains on them.

The network runs on each frame as the service runs it on the cell's calibration: with
``--geometry NAME`` (a shipped geometry network or a ``.pt``; default ``geometry_base_v2``,
the pipeline's) in torch on the camera view built on that calibration; with ``--artifact ART``
the artifact's geometry graph through :class:`perception.core.artifact.PolicyRunner` (int8 on
a CPU when the artifact has it, as ``sim2real-serve``; ``--precision fp32``: the float graph).
The labels are taken into the same view with nearest-neighbour sampling through the cell's
calibration (:func:`perception.core.preprocess.preprocess_labels`). Per cell and pooled over every cell's
pixels (:func:`scores`):

- ``part_median_mm``, ``part_p90_mm``, ``part_within_5mm`` (a fraction): the absolute height
  error on part pixels (label 4 in the view); ``rest_p90_mm`` on table, bin floor and walls;
- ``part_iou``: the predicted part mask (thresholded as the service thresholds it) against label 4;
- ``topdown_edge_median_mm``, ``topdown_edge_p90_mm``: the top-down surface is rebuilt from
  the true and from the predicted heights the same way
  (:class:`perception.core.geometry.SurfaceRebuild`, on the policy's top-down grid); the
  distance from every true part-edge cell to the nearest predicted one and from every
  predicted one to the nearest true one, pooled (a map full of edges does not score well;
  with no edge on one side, the other side's cells count the grid's diagonal);
- ``frames``.

``--sim N`` (``--scenes N`` is the old spelling; 0 by default since ``--cell``) adds the same
figures under ``"sim"`` on N freshly rendered scenes (the pipeline's default randomization,
the packaged calibration, scene seeds from 3,000,000: nobody trains on them). The last line
of stdout is one JSON object ``{"cells": {DIR: {...}}, "pooled": {...}[, "sim": {...}]}``.
``--write`` (with ``--cell``) also puts the table into ``docs/results.md``, block ``geometry``
(``benchmarks/results_doc.py``).
``--panel FILE`` draws, for two frames of each cell, the camera view, the true height, the
predicted height and the error. ``--real DIR`` (a folder of unlabelled photos, with
``--calibration``) draws the view, the predicted part mask and height instead (to ``--panel``,
default ``docs/images/geometry_real.png``). Exit 2 with a message for a folder that is not a
cell or an artifact that cannot run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

from results_doc import ResultsDocError, write_block  # noqa: E402  (benchmarks/results_doc.py)

from perception.core.artifact import ArtifactError, PolicyRunner, load_metadata  # noqa: E402
from perception.core.calibration import Calibration, CalibrationError, default_calibration_path  # noqa: E402
from perception.core.geometry import NetworkView, SurfaceRebuild, make_view  # noqa: E402
from perception.core.imageio import ImageDecodeError, read_image  # noqa: E402
from perception.core.preprocess import preprocess, preprocess_labels, to_network_input  # noqa: E402
from perception.core.rule import DEFAULT_RULE, OBJECT_HEIGHT  # noqa: E402
from policies.networks import HEIGHT_MAX  # noqa: E402
from policies.weights import BaseError  # noqa: E402
from sim_render.reader import SimFrameDataset  # noqa: E402

HELD_OUT_SEED = 3_000_000
#: ``label`` values of a cell's geometry files.
NOTHING, TABLE, BIN_FLOOR, BIN_WALL, PART = 0, 1, 2, 3, 4
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")
WITHIN_M = 0.005
PANEL_FRAMES = 2  # per cell
PANEL_ERROR_MAX = 0.03  # m: the panel's error colour scale


class CellError(ValueError):
    """A folder that is not a labelled cell, or a geometry that cannot run on it."""


# ----------------------------------------------------------------------------------- metrics
@dataclass
class FrameMeasure:
    """What one frame adds to the figures (pooled by :func:`scores`)."""

    part_err: np.ndarray  # m, absolute height error on part pixels
    rest_err: np.ndarray  # m, on table, bin floor and wall pixels
    inter: int  # part mask intersection, pixels
    union: int
    edge_mm: np.ndarray  # top-down part-edge distances, both ways


def part_edges(on_part: np.ndarray) -> np.ndarray:
    """Cells of a top-down part mask with a non-part cell among their 8 neighbours."""
    m = np.asarray(on_part, dtype=np.uint8)
    return (m > 0) & (cv2.erode(m, np.ones((3, 3), np.uint8)) == 0)


def edge_distances_mm(true_top: np.ndarray, pred_top: np.ndarray, cell_mm: float) -> np.ndarray:
    """Distances (mm) from every true part-edge cell to the nearest predicted one, and from every
    predicted one to the nearest true one; with no edge on one side, the other's count the
    grid's diagonal."""
    te, pe = part_edges(true_top), part_edges(pred_top)
    far = math.hypot(*te.shape) * cell_mm

    def to(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        if not src.any():
            return np.zeros(0)
        if not dst.any():
            return np.full(int(src.sum()), far)
        d = cv2.distanceTransform((~dst).astype(np.uint8), cv2.DIST_L2, cv2.DIST_MASK_PRECISE)
        return d[src].astype(np.float64) * cell_mm

    return np.concatenate([to(te, pe), to(pe, te)])


def measure_frame(
    true_height: np.ndarray, pred_height: np.ndarray, true_part: np.ndarray, pred_part: np.ndarray,
    rest: np.ndarray, rebuild: SurfaceRebuild,
) -> FrameMeasure:
    """One frame's errors, the same for a cell's frame and a sim frame.

    Args:
        true_height, pred_height: ``(H, W)`` metres above ``table_z`` in the geometry's camera
            view (true: NaN where unknown).
        true_part, pred_part: ``(H, W)`` bool part masks (predicted: thresholded).
        rest: ``(H, W)`` bool, the non-part pixels measured (table, bin floor, walls).
        rebuild: the top-down rebuild the service makes on this frame's calibration.
    """
    th = np.asarray(true_height, dtype=np.float64)
    ph = np.asarray(pred_height, dtype=np.float64)
    known = np.isfinite(th)
    err = np.abs(ph - th)
    _, true_top = rebuild(th, true_part & known)
    _, pred_top = rebuild(ph, pred_part)
    k = rebuild.top_view.K
    cell_mm = 1000.0 / math.hypot(k[0, 0], k[0, 1])
    return FrameMeasure(part_err=err[known & true_part], rest_err=err[known & rest],
                        inter=int((pred_part & true_part).sum()), union=int((pred_part | true_part).sum()),
                        edge_mm=edge_distances_mm(true_top, pred_top, cell_mm))


def scores(measures: Sequence[FrameMeasure]) -> dict:
    """The figures of a set of frames, their pixels pooled (lengths in mm, ``None`` where nothing was measured)."""

    def cat(key: str) -> np.ndarray:
        arrays = [getattr(m, key) for m in measures]
        return np.concatenate(arrays) if arrays else np.zeros(0)

    def q(a: np.ndarray, p: float, scale: float = 1000.0) -> float | None:
        return round(float(np.percentile(a, p)) * scale, 3) if a.size else None

    part, rest, edges = cat("part_err"), cat("rest_err"), cat("edge_mm")
    union = sum(m.union for m in measures)
    return {
        "part_median_mm": q(part, 50), "part_p90_mm": q(part, 90),
        "part_within_5mm": round(float(np.mean(part <= WITHIN_M)), 4) if part.size else None,
        "part_iou": round(sum(m.inter for m in measures) / union, 4) if union else None,
        "rest_median_mm": q(rest, 50), "rest_p90_mm": q(rest, 90),
        "topdown_edge_median_mm": q(edges, 50, 1.0), "topdown_edge_p90_mm": q(edges, 90, 1.0),
        "frames": len(measures), "part_pixels": int(part.size), "rest_pixels": int(rest.size),
    }


# ------------------------------------------------------------------------------ geometries
class TorchGeometry:
    """A geometry network in torch, on the camera view and the policy's top-down view that the
    pipeline would build on the frame's calibration (``conf/policy/default.yaml``), with the
    export's decode numbers (``policies/export.py``)."""

    def __init__(self, name: str | Path) -> None:
        from omegaconf import OmegaConf  # lazy: omegaconf (only this step needs it)

        from policies.geometry import load_geometry_net  # lazy: lightning via policies.geometry

        try:
            self.net, self.data = load_geometry_net(name)
        except (BaseError, FileNotFoundError) as exc:
            raise CellError(str(exc)) from exc
        pcfg = OmegaConf.load(ROOT / "conf" / "policy" / "default.yaml")
        self.top_size = tuple(int(v) for v in pcfg.view_size)
        self.top_kw = {"margin": float(pcfg.view.margin), "plane_height": float(pcfg.view.plane_height)}
        opts = {"part_threshold": 0.5, "interior_margin": DEFAULT_RULE["region_margin"], "floor_height": 0.9 * OBJECT_HEIGHT,
                **{k: v for k, v in OmegaConf.to_container(pcfg.geometry_decode).items() if v is not None}}
        self.part_threshold = float(opts["part_threshold"])
        self.interior_margin, self.floor_height = float(opts["interior_margin"]), float(opts["floor_height"])
        self.name = f"{name} (torch)"
        self._rebuilds: dict[str, SurfaceRebuild] = {}
        self._cameras: dict[str, torch.Tensor | None] = {}  # the network's camera maps, by calibration

    def view(self, calib: Calibration) -> NetworkView:
        from policies.geometry import geometry_view  # lazy: lightning via policies.geometry

        return geometry_view(calib, self.data)

    def rebuild(self, calib: Calibration) -> SurfaceRebuild:
        key = calib.digest()
        if key not in self._rebuilds:
            top = make_view(calib, self.top_size, "table", **self.top_kw)
            self._rebuilds[key] = SurfaceRebuild(calib, self.view(calib), top, self.interior_margin, self.floor_height)
        return self._rebuilds[key]

    @torch.no_grad()
    def predict(self, raw_rgb: np.ndarray, calib: Calibration) -> tuple[np.ndarray, np.ndarray]:
        """``height`` (m) and part probability ``(H, W)`` in :meth:`view`."""
        view = self.view(calib)
        key = calib.digest()
        if key not in self._cameras:
            self._cameras[key] = self.net.camera_maps(calib, view)
        o = self.net(torch.from_numpy(to_network_input(preprocess(raw_rgb, calib, view))), self._cameras[key])
        return o["height"][0, 0].numpy(), torch.sigmoid(o["object_logits"][0, 0]).numpy()


class ArtifactGeometry:
    """An artifact's geometry graph as the service runs it (:class:`PolicyRunner`, default
    precision: int8 on a CPU when the artifact has it) on the frame's calibration."""

    def __init__(self, path: str | Path, precision: str = "auto") -> None:
        try:
            self.meta = load_metadata(path)
        except ArtifactError as exc:
            raise CellError(f"--artifact {path}: {exc}") from exc
        if self.meta.geometry is None:
            raise CellError(f"--artifact {path} has no geometry graph (metadata.json: geometry); export it with "
                            "policy.geometry=NAME")
        self.g = self.meta.geometry
        self.part_threshold = self.g.part_threshold
        self.precision = precision
        self._runners: dict[str, tuple[object, SurfaceRebuild]] = {}
        self.name = f"artifact {path}"

    def _runner(self, calib: Calibration):
        key = calib.digest()
        if key not in self._runners:
            try:
                runner = PolicyRunner(self.meta.path, calibration=calib, meta=self.meta, precision=self.precision)
            except ArtifactError as exc:
                raise CellError(f"the artifact {self.meta.path} cannot serve this calibration: {exc}") from exc
            rebuild = SurfaceRebuild(calib, self.g.view, runner.view, self.g.interior_margin, self.g.floor_height,
                                     walls=self.g.walls)
            self._runners[key] = (runner, rebuild)
            base = (self.meta.raw.get("geometry") or {}).get("base") or {}
            self.name = f"artifact {self.meta.path} ({base.get('name', 'geometry')}, {runner.precision})"
        return self._runners[key]

    def view(self, calib: Calibration) -> NetworkView:
        return self.g.view

    def rebuild(self, calib: Calibration) -> SurfaceRebuild:
        return self._runner(calib)[1]

    def predict(self, raw_rgb: np.ndarray, calib: Calibration) -> tuple[np.ndarray, np.ndarray]:
        return self._runner(calib)[0].geometry_maps(raw_rgb)


# ----------------------------------------------------------------------------------- cells
@dataclass
class Cell:
    """A labelled cell folder: its calibration and (frame, labels) file pairs."""

    path: Path
    calib: Calibration
    pairs: list[tuple[Path, Path]]


def load_cell(path: str | Path) -> Cell:
    """Check a ``--cell`` folder and list its frames with their label files.

    Raises:
        CellError: a folder without ``calibration.json``, ``real/`` or ``geometry/``, without
            frames, or with a frame whose label file is missing.
    """
    d = Path(path)
    if not d.is_dir():
        raise CellError(f"--cell {d}: not a folder")
    missing = [n for n in ("calibration.json", "real", "geometry") if not (d / n).exists()]
    if missing:
        raise CellError(f"--cell {d} is not a labelled cell: it has no {', '.join(missing)} (a cell is a folder "
                        "made by make_real_frames.py --out DIR --geometry DIR/geometry)")
    try:
        calib = Calibration.load(d / "calibration.json")
    except (CalibrationError, OSError, ValueError) as exc:
        raise CellError(f"--cell {d}: {exc}") from exc
    frames = sorted(p for p in (d / "real").iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not frames:
        raise CellError(f"--cell {d}: no PNG or JPEG frames in {d / 'real'}")
    pairs = [(f, d / "geometry" / f"{f.stem}.npz") for f in frames]
    lacking = [f.name for f, g in pairs if not g.is_file()]
    if lacking:
        raise CellError(f"--cell {d}: no label file geometry/NAME.npz for {len(lacking)} frame(s), e.g. "
                        f"real/{lacking[0]}")
    return Cell(d, calib, pairs)


def read_labels(path: Path, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``height`` float32 and ``label`` uint8 of a label file, checked against the frame's ``shape``."""
    try:
        with np.load(path) as z:
            height, label = np.asarray(z["height"], dtype=np.float32), np.asarray(z["label"], dtype=np.uint8)
    except (OSError, KeyError, ValueError) as exc:
        raise CellError(f"{path}: not a label file with 'height' and 'label' ({exc})") from exc
    if height.shape != shape or label.shape != shape:
        raise CellError(f"{path}: height {height.shape} and label {label.shape} must be the frame's {shape}")
    return height, label


def cell_truth(height: np.ndarray, label: np.ndarray, calib: Calibration, view: NetworkView
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw labels in the network's view, nearest-neighbour through ``calib`` (the sampling the service's
    :func:`preprocess` makes of the frame): ``height`` (NaN where unknown or outside the frame),
    ``part`` and ``rest`` masks."""
    lab = preprocess_labels(label, calib, view)  # outside the frame: 0, nothing
    h = preprocess_labels(height, calib, view)
    h[lab == NOTHING] = np.nan
    return h, lab == PART, np.isin(lab, (TABLE, BIN_FLOOR, BIN_WALL))


def measure_cell(geom, cell: Cell, panel_rows: list | None = None) -> list[FrameMeasure]:
    """Every frame of ``cell`` measured with ``geom``; the first :data:`PANEL_FRAMES` drawn into ``panel_rows``."""

    out = []
    view, rebuild = geom.view(cell.calib), geom.rebuild(cell.calib)
    for i, (frame, labels) in enumerate(cell.pairs):
        try:
            raw = read_image(frame)
        except ImageDecodeError as exc:
            raise CellError(str(exc)) from exc
        true_h, true_part, rest = cell_truth(*read_labels(labels, raw.shape[:2]), cell.calib, view)
        pred_h, part_p = geom.predict(raw, cell.calib)
        out.append(measure_frame(true_h, pred_h, true_part, part_p >= geom.part_threshold, rest, rebuild))
        if panel_rows is not None and i < PANEL_FRAMES:
            panel_rows.append(panel_row(preprocess(raw, cell.calib, view), true_h, pred_h,
                                        f"{cell.path.name} {frame.name}"))
    return out


def held_out_sim(geom, scenes: int) -> dict:
    """:func:`scores` on ``scenes`` freshly rendered scenes (targets: :func:`policies.geometry.geometry_record`)."""
    from policies.geometry import geometry_record  # lazy: lightning via policies.geometry
    from sim_render.api import compose_config, render_dataset  # lazy: hydra via sim_render.api

    overrides = list(compose_config("base", []).randomization.overrides or [])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "held_out"
        render_dataset(root, scenes, "randomized", HELD_OUT_SEED, overrides=overrides, workers=1)
        frames = SimFrameDataset(root, fields=("rgb", "depth", "seg"))
        calib = frames.calibration
        view, rebuild = geom.view(calib), geom.rebuild(calib)
        measures = []
        for i in range(len(frames)):
            item = frames[i]
            rec = geometry_record(item, calib, view)
            true_h = rec["height"].astype(np.float32)
            pred_h, part_p = geom.predict(np.asarray(item["rgb"]), calib)
            measures.append(measure_frame(true_h, pred_h, rec["object"], part_p >= geom.part_threshold,
                                          np.isfinite(true_h) & ~rec["object"], rebuild))
    return {**scores(measures), "scenes": scenes}


# ----------------------------------------------------------------------------------- panels
def _colour(a: np.ndarray, vmax: float, cmap: int) -> np.ndarray:
    known = np.isfinite(a)
    img = cv2.applyColorMap(np.clip(np.where(known, a, 0) / vmax * 255, 0, 255).astype(np.uint8), cmap)[:, :, ::-1]
    img[~known] = 0
    return img


def panel_row(view_rgb: np.ndarray, true_h: np.ndarray, pred_h: np.ndarray, title: str) -> np.ndarray:
    """Camera view | true height | predicted height (0 to ``HEIGHT_MAX``) | absolute error (0 to 3 cm); black: unknown."""
    tiles = [view_rgb.copy(), _colour(true_h, HEIGHT_MAX, cv2.COLORMAP_VIRIDIS),
             _colour(pred_h, HEIGHT_MAX, cv2.COLORMAP_VIRIDIS),
             _colour(np.abs(pred_h - true_h), PANEL_ERROR_MAX, cv2.COLORMAP_INFERNO)]
    row = np.concatenate(tiles, axis=1)
    row = cv2.resize(row, (row.shape[1] * 2, row.shape[0] * 2), interpolation=cv2.INTER_NEAREST)
    w = row.shape[1] // 4
    for j, text in enumerate((title, "true height", "predicted height", "error 0-30 mm")):
        cv2.putText(row, text, (j * w + 4, 14), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1, cv2.LINE_AA)
    return row


def write_panel(rows: list[np.ndarray], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(out), np.concatenate(rows, axis=0)[:, :, ::-1])


def real_panel(geom, real_dir: Path, calib: Calibration, out: Path, n: int = 4) -> None:
    """For ``n`` unlabelled photos: the camera view, the predicted part mask over it, the predicted height."""
    if not real_dir.is_dir():
        raise CellError(f"--real {real_dir}: not a folder")
    files = sorted(p for p in real_dir.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)[:n]
    if not files:
        raise CellError(f"no PNG or JPEG frames in {real_dir}")
    view = geom.view(calib)
    rows = []
    for f in files:
        raw = read_image(f)
        rgb = preprocess(raw, calib, view)
        height, part_p = geom.predict(raw, calib)
        part = part_p >= geom.part_threshold
        mask = rgb.copy()
        mask[part] = (0.5 * mask[part] + [0, 127, 0]).astype(np.uint8)
        rows.append(np.concatenate([rgb, mask, _colour(height, HEIGHT_MAX, cv2.COLORMAP_VIRIDIS)], axis=1))
    img = np.concatenate(rows, axis=0)
    write_panel([cv2.resize(img, (img.shape[1] * 2, img.shape[0] * 2), interpolation=cv2.INTER_NEAREST)], out)
    print(f"panel: {out} (camera view | predicted parts in green | predicted height, 0 to {HEIGHT_MAX * 100:.0f} cm)")


# ------------------------------------------------------------------------------------- main
def _line(where: str, s: dict) -> str:
    if not s["part_pixels"]:
        return f"{where}: {s['frames']} frames, no part pixels"
    return (f"{where}: {s['frames']} frames: parts {s['part_median_mm']:.1f} / {s['part_p90_mm']:.1f} mm median / p90, "
            f"{s['part_within_5mm']:.0%} within 5 mm, IoU {s['part_iou']:.2f}; rest p90 {s['rest_p90_mm']:.1f} mm; "
            f"top-down part edges {s['topdown_edge_median_mm']} / {s['topdown_edge_p90_mm']} mm")


def make_geometry(args: argparse.Namespace):
    """The geometry ``--artifact`` or ``--geometry`` names (default ``geometry_base_v2``)."""
    return ArtifactGeometry(args.artifact, args.precision) if args.artifact else TorchGeometry(args.geometry or "geometry_base_v2")


def run(args: argparse.Namespace, geom=None, cells: list[Cell] | None = None) -> dict:
    """The measurement :func:`main` prints (``geom``: a geometry with ``view``, ``rebuild``, ``predict``
    and ``part_threshold``, instead of ``--geometry`` / ``--artifact``; ``cells``: ``args.cell``
    loaded already)."""
    if cells is None:
        cells = [load_cell(d) for d in args.cell]  # every folder checked before anything runs
    if args.real is not None and cells and args.panel is not None:
        raise CellError("--panel draws either the cells' panel or --real's: give one of --cell, --real")
    if geom is None:
        geom = make_geometry(args)
    result: dict = {"cells": {}}
    rows: list[np.ndarray] | None = [] if args.panel is not None and cells else None
    pooled: list[FrameMeasure] = []
    for d, cell in zip(args.cell, cells):
        t0 = time.perf_counter()
        measures = measure_cell(geom, cell, rows)
        pooled += measures
        result["cells"][str(d)] = scores(measures)
        print(_line(str(d), result["cells"][str(d)]) + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    result["pooled"] = scores(pooled)
    if len(cells) > 1:
        print(_line("pooled", result["pooled"]))
    if args.sim > 0:
        t0 = time.perf_counter()
        result["sim"] = held_out_sim(geom, args.sim)
        print(_line(f"held-out sim, {args.sim} scenes", result["sim"]) + f" ({time.perf_counter() - t0:.0f} s)")
    if rows:
        write_panel(rows, args.panel)
        print(f"panel: {args.panel} (camera view | true height | predicted height, 0 to {HEIGHT_MAX * 100:.0f} cm | "
              f"error, 0 to {PANEL_ERROR_MAX * 1000:.0f} mm; black: no label)")
    if args.real is not None:
        calib = Calibration.load(args.calibration or default_calibration_path())
        real_panel(geom, args.real, calib, args.panel or ROOT / "docs" / "images" / "geometry_real.png")
    print(f"geometry: {geom.name}")
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--geometry", default=None, help="a shipped geometry network or a .pt path (default geometry_base_v2)")
    which.add_argument("--artifact", type=Path, default=None,
                       help="a pipeline artifact: its geometry graph as sim2real-serve runs it, int8 included")
    ap.add_argument("--precision", choices=("auto", "fp32", "int8"), default="auto",
                    help="with --artifact: the graphs to run (auto: as sim2real-serve, int8 on a CPU when the artifact has it)")
    ap.add_argument("--cell", type=Path, action="append", default=[],
                    help="a labelled cell folder (calibration.json, real/, geometry/); repeatable")
    ap.add_argument("--sim", "--scenes", dest="sim", type=int, default=0, help="held-out sim scenes (0: none)")
    ap.add_argument("--panel", type=Path, default=None, help="draw a panel to this file")
    ap.add_argument("--real", type=Path, help="a folder of unlabelled photos to draw the network on")
    ap.add_argument("--calibration", type=Path, default=None, help="their camera's calibration (with --real)")
    ap.add_argument("--write", action="store_true",
                    help="put the table into docs/results.md (block geometry; benchmarks/results_doc.py)")
    return ap


def results_table(result: dict, name: str) -> str:
    """The measured figures as ``docs/results.md`` shows them: a row a cell, pooled, held-out sim."""
    lines = [f"Network: {name}.", "",
             "| frames | part pixels: median / p90 | within 5 mm | part mask IoU | table, floor, walls: p90 |",
             "|---|---|---|---|---|"]
    rows = [(Path(d).name, s) for d, s in result["cells"].items()]
    if len(result["cells"]) > 1:
        rows.append(("pooled", result["pooled"]))
    if "sim" in result:
        rows.append(("held-out sim", result["sim"]))
    for where, s in rows:
        if not s["part_pixels"]:
            lines.append(f"| {where} ({s['frames']}) | no part pixels | | | |")
            continue
        lines.append(f"| {where} ({s['frames']}) | {s['part_median_mm']:.1f} / {s['part_p90_mm']:.1f} mm | "
                     f"{s['part_within_5mm']:.0%} | {s['part_iou']:.2f} | {s['rest_p90_mm']:.1f} mm |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.cell and args.sim <= 0 and args.real is None:
        print("geometry.py: nothing to measure: give --cell DIR, --sim N or --real DIR", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    if args.write and not args.cell:
        print("geometry.py: --write puts the cells' table into docs/results.md: give --cell DIR", file=sys.stderr)
        return 2
    try:
        cells = [load_cell(d) for d in args.cell]  # every folder checked before anything runs
        geom = make_geometry(args)
        result = run(args, geom, cells)
        if args.write:
            write_block("geometry", results_table(result, geom.name),
                        "python benchmarks/geometry.py " + " ".join(sys.argv[1:] if argv is None else argv))
    except (CellError, ResultsDocError) as exc:
        print(f"geometry.py: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
