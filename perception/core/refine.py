"""Refine the camera pose from the bin's walls in unlabeled frames (contract section 5).

Every frame of the cell shows known geometry: the bin's walls stand on the workspace
edges (contract section 3), by default their outer faces on the edges, the walls inside
the workspace, as the contract's section 5 words it for this command ("the bin's outer
walls stand on the workspace edges") and as the validation cells build it;
``fit.wall_placement: inner`` stands their inner faces there instead (a workspace that is
the bin's inside; the twin's bin, ``sim_render/cell.py``):
docs/experiments/2026-12-06-refine-walls-outer-faces-on-the-edges.md. The walls are
vertical, of one unknown height up to 0.06 m and one unknown thickness. Their straight
edges (the foot of every face the camera can see, the top's inner and outer edges) are
fitted by moving ``T_base_camera`` (and the walls' height and thickness) until the
edges' projections lie on the frames' strongest persistent edges.

Why edges, not corners or a learned detector: the walls' lines are long, so a few
hundred samples along each one average the texture of the floor and walls away; objects
move between frames while the walls stay, so the edge evidence is averaged over frames
(each frame's gradients clipped, so one object edge cannot outvote the walls); and no
correspondence is needed, which is what a cluttered, textured bin would make fragile.

The fit (:func:`refine_pose`): starts at the calibration itself and at the best peaks of
a coarse table over the two rotations that move the whole image; from each, Nelder-Mead
on less and less smoothed evidence (the walls at a start thickness, :func:`_start_thickness`,
with a prior towards a small correction),
the thickness from the edges it moves, then Gauss-Newton on every sample point's distance to
its edge; the fit that lays the most edge strength on its lines wins. What is written when
the fit is strong enough (:func:`decide`) is its turn and its sideways move; its move along
the line of sight to the bin is left as given (:func:`without_sight_move`). Measured in the twin:
``docs/benchmarks.md``, "Camera refinement" (12 of 16 cells recovered; a wall a few
millimetres thick, and tall walls just over the tolerance, are where it fails). Units:
metres and radians in the API, millimetres and degrees in reports.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from perception.core.calibration import Calibration
from perception.core.frames import rotation_angle

__all__ = [
    "RefineError", "RefineSettings", "AcceptSettings", "RefineResult", "decide", "edge_evidence", "wall_lines", "refine_pose", "pose_change",
    "undistorted_median", "draw_fit", "bin_inside", "PLACEMENTS", "frame_picks", "measure_walls",
]


log = logging.getLogger("sim2real.calibrate")


class RefineError(ValueError):
    """No walls found, or a correction beyond what a calibration error can be."""


#: Where the walls stand on the workspace edges (``fit.wall_placement``): ``outer``, their
#: outer faces on the edges and the walls inside the workspace (the contract's section 5);
#: ``inner``, their inner faces there, the walls outside it (the workspace is the bin's
#: inside, as the twin builds it: ``sim_render/cell.py``).
PLACEMENTS = ("outer", "inner")


@dataclass(frozen=True)
class RefineSettings:
    """Settings of the fit: the ``fit`` block of ``conf/calibrate_refine.yaml`` (units there)."""

    max_frames: int
    search_deg: float
    search_step_deg: float
    height_range: tuple[float, float]
    thickness_range: tuple[float, float]
    height_step: float
    scales_px: tuple[float, ...]
    samples_per_edge: int
    clip_percentile: float
    min_contrast: float
    min_separation_px: float
    reach_px: float
    gauss_newton_iters: int
    hypotheses: int
    start_heights: int
    line_bias_px: float
    peak_spacing: int
    restarts: int
    max_shift_m: float
    max_rotation_deg: float
    prior_weight: float
    wall_height: float | None
    wall_thickness: float | None
    wall_tolerance: float
    wall_placement: str

    @classmethod
    def from_config(cls, fit: Any) -> RefineSettings:
        """From the config's ``fit`` block (a mapping); unknown or missing keys are refused.

        A measured ``wall_height`` or ``wall_thickness`` narrows ``height_range`` or
        ``thickness_range`` to the measurement +- ``wall_tolerance``: the fit's failures on
        twin cells were almost all a wall height or thickness fitted far from the truth
        (``docs/benchmarks.md``), and two ruler readings take that freedom away.
        """
        fit = _exact_keys(cls, fit, "fit")
        st = cls(**{k: tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v for k, v in fit.items()})
        if st.height_range[0] <= 0 or st.height_range[1] > 0.06 or st.height_range[0] > st.height_range[1]:
            raise RefineError("fit.height_range must lie within (0, 0.06] m (the contract bounds the walls)")
        if not (0 <= st.thickness_range[0] <= st.thickness_range[1]):
            raise RefineError("fit.thickness_range must be [min, max] with 0 <= min <= max")
        if not (isinstance(st.wall_tolerance, (int, float)) and 0 <= st.wall_tolerance <= 0.01):
            raise RefineError(f"fit.wall_tolerance must be within [0, 0.01] m, got {st.wall_tolerance!r}")
        tol = float(st.wall_tolerance)
        if st.wall_height is not None:
            h = st.wall_height
            if not (isinstance(h, (int, float)) and 0 < h <= 0.06):
                raise RefineError(f"fit.wall_height must be in metres within (0, 0.06] (the contract bounds the "
                                  f"walls), got {h!r}; null: fitted within fit.height_range")
            st = replace(st, height_range=(max(float(h) - tol, 1e-3), min(float(h) + tol, 0.06)))
        if st.wall_thickness is not None:
            t = st.wall_thickness
            if not (isinstance(t, (int, float)) and 0 <= t <= 0.05):
                raise RefineError(f"fit.wall_thickness must be in metres within [0, 0.05], got {t!r}; "
                                  "null: fitted within fit.thickness_range")
            st = replace(st, thickness_range=(max(float(t) - tol, 0.0), float(t) + tol))
        if st.wall_placement not in PLACEMENTS:
            raise RefineError(f"fit.wall_placement must be one of {list(PLACEMENTS)}, got {st.wall_placement!r}: "
                              "outer (the walls' outer faces on the workspace edges, contract section 5) or "
                              "inner (their inner faces there: the workspace is the bin's inside)")
        if st.max_frames < 1 or st.samples_per_edge < 8 or not st.scales_px:
            raise RefineError("fit.max_frames >= 1, fit.samples_per_edge >= 8 and one fit.scales_px at least")
        if not st.prior_weight >= 0:
            raise RefineError("fit.prior_weight must be >= 0 (0: no prior on the correction)")
        return st

    @classmethod
    def defaults(cls, **changes: Any) -> RefineSettings:
        """The packaged ``conf/calibrate_refine.yaml`` settings, with ``changes``."""
        return cls.from_config({**_packaged("fit"), **changes})


def _exact_keys(cls: type, block: Any, name: str) -> dict:
    """``block`` as a dict holding exactly ``cls``'s fields; otherwise a RefineError naming the rest."""
    block, names = dict(block), {f.name for f in fields(cls)}
    if set(block) != names:
        raise RefineError(f"{name} settings: unknown {sorted(set(block) - names)}, missing {sorted(names - set(block))}")
    return block


def _packaged(block: str) -> dict:
    """One block of the packaged ``conf/calibrate_refine.yaml`` (the one source of the defaults)."""
    from omegaconf import OmegaConf  # lazy: omegaconf (robot floor: sim2real-calibrate imports this module)

    path = Path(str(resources.files("conf") / "calibrate_refine.yaml"))
    return OmegaConf.to_container(OmegaConf.load(path)[block], resolve=True)


@dataclass(frozen=True)
class AcceptSettings:
    """When a fit replaces the calibration: the ``accept`` block of ``conf/calibrate_refine.yaml``."""

    same_pose_mm: float
    same_pose_deg: float
    min_correction_mm: float
    min_correction_deg: float
    max_rival_share: float
    max_sigma_mm: float
    max_sigma_mm_measured: float
    min_correction_sigmas: float
    max_halves_workspace_mm: float
    write_distance: bool

    @classmethod
    def from_config(cls, block: Any) -> AcceptSettings:
        """From the config's ``accept`` block (a mapping); unknown or missing keys are refused."""
        block = _exact_keys(cls, block, "accept")
        write_distance = block.pop("write_distance")
        if not isinstance(write_distance, bool):
            raise RefineError(f"accept.write_distance must be true or false, got {write_distance!r}")
        bad = [k for k, v in block.items() if isinstance(v, bool) or not (isinstance(v, (int, float)) and v >= 0)]
        if bad:
            raise RefineError(f"accept settings must be numbers >= 0: {bad}")
        return cls(**{k: float(v) for k, v in block.items()}, write_distance=write_distance)

    @classmethod
    def defaults(cls, **changes: Any) -> AcceptSettings:
        """The packaged ``conf/calibrate_refine.yaml`` settings, with ``changes``."""
        return cls.from_config({**_packaged("accept"), **changes})


@dataclass
class RefineResult:
    T_base_camera: np.ndarray            # the fit (written only when accepted)
    wall_height: float
    wall_thickness: float
    contrast: float                      # edge strength on the fitted edges over the image's typical
    contrast_before: float
    shift_m: float                       # how far the fit moves the camera centre
    rotation_deg: float                  # how far the fit turns the camera
    edges_used: list[str] = field(default_factory=list)
    T_given: np.ndarray | None = None    # the calibration's pose
    accepted: bool = True                # whether the fit replaces it (:func:`decide`)
    reason: str = ""
    evidence: dict = field(default_factory=dict)
    T_refined: np.ndarray | None = None  # the fit less its move along the line of sight (:func:`without_sight_move`)
    sight_move_m: float = 0.0            # that move, left out (+: towards the bin)
    wall_placement: str = "inner"        # where the model stood the walls (:data:`PLACEMENTS`)

    @property
    def refined_pose(self) -> np.ndarray:
        """The pose written when the fit is accepted (:func:`without_sight_move`)."""
        return self.T_base_camera if self.T_refined is None else self.T_refined

    @property
    def written_pose(self) -> np.ndarray:
        """The pose to write: the refined pose when accepted, the calibration's as given otherwise."""
        return self.refined_pose if self.accepted or self.T_given is None else self.T_given

    def correction(self) -> tuple[float, float]:
        """(m, deg): how far the refined pose moves and turns the camera from the calibration."""
        return (self.shift_m, self.rotation_deg) if self.T_given is None else pose_change(self.T_given, self.refined_pose)

    def report(self) -> dict:
        shift, turn = self.correction()
        return {
            "written": "refined" if self.accepted else "as given",
            "reason": self.reason,
            "correction_mm": round(shift * 1e3, 3) if self.accepted else 0.0,
            "correction_deg": round(turn, 4) if self.accepted else 0.0,
            "fit_correction_mm": round(self.shift_m * 1e3, 3),
            "fit_correction_deg": round(self.rotation_deg, 4),
            "sight_move_mm": round(self.sight_move_m * 1e3, 3),  # the fit's, not written (without_sight_move)
            "fit_T_base_camera": np.round(self.T_base_camera, 9).tolist(),  # the fit, written or not
            "wall_height_m": round(self.wall_height, 4),
            "wall_thickness_m": round(self.wall_thickness, 4),
            "wall_placement": self.wall_placement,
            "edge_contrast": round(self.contrast, 3),
            "edge_contrast_before": round(self.contrast_before, 3),
            "edges": self.edges_used,
            "evidence": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.evidence.items()},
        }


# ------------------------------------------------------------------ geometry
def _rodrigues(w: np.ndarray) -> np.ndarray:
    return cv2.Rodrigues(np.asarray(w, dtype=np.float64).reshape(3, 1))[0]


def perturb(T: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``T_base_camera`` moved by ``x = [wx, wy, wz, tx, ty, tz]``.

    The rotation (radians) turns the camera about its own axes; the translation (metres)
    moves its centre in the base frame, so the two read as what a user would adjust.
    """
    out = np.array(T, dtype=np.float64, copy=True)
    out[:3, :3] = T[:3, :3] @ _rodrigues(x[:3])
    out[:3, 3] = T[:3, 3] + np.asarray(x[3:6], dtype=np.float64)
    return out


def pose_change(T_a: np.ndarray, T_b: np.ndarray) -> tuple[float, float]:
    """(camera centre distance in metres, rotation angle in degrees) between two poses."""
    return float(np.linalg.norm(T_a[:3, 3] - T_b[:3, 3])), math.degrees(rotation_angle(T_a[:3, :3], T_b[:3, :3]))


def bin_inside(calib: Calibration, thickness: float, placement: str) -> Calibration:
    """``calib`` with the workspace narrowed to the bin's inside: by ``thickness`` on every
    side where the walls' outer faces stand on the edges (``placement`` ``outer``), as it is
    where their inner faces do (``inner``)."""
    if placement == "inner" or thickness == 0:
        return calib
    return calib.narrowed(thickness)


def wall_lines(
    calib: Calibration, height: float, thickness: float, camera: np.ndarray | None = None,
    placement: str = "inner",
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The walls' straight edges the camera can see, in the base frame: ``(name, start, end)``.

    Each wall's inner face stands on a workspace edge (``placement`` ``inner``) or
    ``thickness`` inside it (``outer``: the outer face on the edge); the outer face is
    ``thickness`` beyond the inner (no outer edges for a thickness of 0). The top's edges
    always show (the camera is above the walls); the foot of a face only where the camera
    is on that face's side.
    """
    inside = bin_inside(calib, thickness, placement)
    (x0, x1), (y0, y1) = inside.workspace_x, inside.workspace_y
    z0, z1 = calib.table_z, calib.table_z + height
    cam = calib.camera_position if camera is None else camera
    walls = [  # name, axis, coordinate, inward sign, the other axis' span
        ("x_min", 0, x0, +1, (y0, y1)),
        ("x_max", 0, x1, -1, (y0, y1)),
        ("y_min", 1, y0, +1, (x0, x1)),
        ("y_max", 1, y1, -1, (x0, x1)),
    ]
    out = []
    for name, axis, c, inward, (a, b) in walls:
        def point(s: float, z: float, c: float, axis: int = axis) -> np.ndarray:
            return np.array([c, s, z]) if axis == 0 else np.array([s, c, z])

        outer, t = c - inward * thickness, thickness
        inside = (cam[axis] - c) * inward > 0
        if inside:
            out.append((f"{name}/inner_foot", point(a, z0, c), point(b, z0, c)))
        out.append((f"{name}/inner_top", point(a, z1, c), point(b, z1, c)))
        if thickness > 0:
            out.append((f"{name}/outer_top", point(a - t, z1, outer), point(b + t, z1, outer)))
        if thickness > 0 and (cam[axis] - outer) * inward < 0:
            out.append((f"{name}/outer_foot", point(a - t, z0, outer), point(b + t, z0, outer)))
    return out


def _occluded(points: np.ndarray, cam: np.ndarray, calib: Calibration, height: float) -> np.ndarray:
    """Points hidden behind a wall (thin walls at the inner faces, ``calib``'s workspace
    edges: :func:`bin_inside`) from ``cam``."""
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    z0, z1 = calib.table_z, calib.table_z + height
    hidden = np.zeros(len(points), dtype=bool)
    d = points - cam
    for axis, c, (lo, hi) in ((0, x0, (y0, y1)), (0, x1, (y0, y1)), (1, y0, (x0, x1)), (1, y1, (x0, x1))):
        with np.errstate(divide="ignore", invalid="ignore"):
            s = (c - cam[axis]) / d[:, axis]
        hit = cam + s[:, None] * d
        other = 1 - axis
        # Strictly between the camera and the point: a point on this wall is not hidden by it.
        hidden |= (s > 1e-6) & (s < 1 - 1e-4) & (hit[:, other] >= lo) & (hit[:, other] <= hi) & \
                  (hit[:, 2] >= z0) & (hit[:, 2] <= z1)
    return hidden


# ------------------------------------------------------------------ evidence
def edge_evidence(frames: list[np.ndarray], calib: Calibration, clip_percentile: float) -> np.ndarray:
    """Per-pixel structure tensor ``(H, W, 3)`` (gxx, gyy, gxy) averaged over undistorted frames.

    Each frame's gradients are normalised by their clip percentile and clipped there, so
    a bright frame or one strong object edge weighs no more than the walls do.
    """
    K, dist = calib.K, calib.dist
    w, h = calib.image_size
    maps = cv2.initUndistortRectifyMap(K, dist, None, K, (w, h), cv2.CV_32FC1)
    acc = np.zeros((h, w, 3), dtype=np.float64)
    for rgb in frames:
        gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY).astype(np.float32)
        gray = cv2.remap(gray, maps[0], maps[1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        gx = cv2.Scharr(gray, cv2.CV_32F, 1, 0)
        gy = cv2.Scharr(gray, cv2.CV_32F, 0, 1)
        mag = np.sqrt(gx * gx + gy * gy)
        cap = float(np.percentile(mag, clip_percentile)) + 1e-6
        scale = np.minimum(1.0, cap / (mag + 1e-6)) / cap
        gx, gy = gx * scale, gy * scale
        acc[..., 0] += gx * gx
        acc[..., 1] += gy * gy
        acc[..., 2] += gx * gy
    return (acc / max(1, len(frames))).astype(np.float32)


def _bilinear(img: np.ndarray, uv: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    u = np.clip(uv[:, 0], 0, w - 1.001)
    v = np.clip(uv[:, 1], 0, h - 1.001)
    u0, v0 = np.floor(u).astype(np.int64), np.floor(v).astype(np.int64)
    du, dv = (u - u0)[:, None], (v - v0)[:, None]
    a, b = img[v0, u0], img[v0, u0 + 1]
    c, d = img[v0 + 1, u0], img[v0 + 1, u0 + 1]
    return (a * (1 - du) + b * du) * (1 - dv) + (c * (1 - du) + d * du) * dv


def _visible_lines(calib: Calibration, T: np.ndarray, height: float, thickness: float, samples: int,
                   margin_px: float, min_separation_px: float,
                   placement: str) -> tuple[list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], int]:
    """The wall edges' sample points that are seen: ``(name, points in B, pixels, unit normal)``,
    and how many lines were left out as seen edge-on.

    The corners belong to two walls and are skipped; a point behind a wall, outside the
    image or in front of no camera is dropped, and so is a line with under a quarter of
    its points left. An inner face seen at a grazing angle puts its foot and top within
    ``min_separation_px`` of each other, where neither can be told apart: its foot goes.
    So does a wall's outer top edge where it runs that close beside the inner one.
    """
    w, h = calib.image_size
    s = np.linspace(0.02, 0.98, samples)
    cam = T[:3, 3]
    out, mids = [], {}
    inside = bin_inside(calib, thickness, placement)
    for name, a, b in wall_lines(inside, height, thickness, cam):
        pts = a[None] + s[:, None] * (b - a)[None]
        if np.any((pts - cam) @ T[:3, 2] <= 0.05):
            continue
        mids[name] = _project(T, calib.K, ((a + b) / 2)[None])[0]
        pts = pts[~_occluded(pts, cam, inside, height)]
        uv = _project(T, calib.K, pts)
        keep = (uv[:, 0] > margin_px) & (uv[:, 0] < w - 1 - margin_px) & \
               (uv[:, 1] > margin_px) & (uv[:, 1] < h - 1 - margin_px)
        if keep.sum() < samples // 4:
            continue
        d = _project(T, calib.K, b[None])[0] - _project(T, calib.K, a[None])[0]
        n = np.array([-d[1], d[0]]) / (np.linalg.norm(d) + 1e-12)
        out.append((name, pts[keep], uv[keep], n))
    grazing = set()
    for name, _pts, _uv, n in out:
        wall, kind = name.split("/")
        top = mids.get(f"{wall}/inner_top")
        if kind in ("inner_foot", "outer_top") and top is not None and abs(float((top - mids[name]) @ n)) < min_separation_px:
            grazing.add(name)
    return [line for line in out if line[0] not in grazing], len(grazing)


def _strength(evidence: np.ndarray, uv: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Edge strength across ``n`` (the structure tensor's projection) at ``uv``."""
    m = _bilinear(evidence, uv)
    return np.sqrt(np.maximum(m[..., 0] * n[0] ** 2 + m[..., 1] * n[1] ** 2 + 2 * m[..., 2] * n[0] * n[1], 0))


class _Objective:
    """Edge strength along the projected wall edges, in units of the image's typical edge.

    ``mean``: the mean over the lines (the fit's target while the pose is found: every
    line counts alike). ``excess``: the strength above typical summed over the lines
    (choosing between fits: one that lays more lines on edges is better). ``lines``:
    ``all``, the inner faces' edges alone (``inner``: what the search fits), or the edges the
    thickness moves alone (``thickness``: the outer face's where the inner faces stand on the
    edges, the inner face's where the outer faces do). A line left out as seen edge-on
    counts as a typical edge, so no fit wins by hiding lines.
    """

    def __init__(self, evidence: np.ndarray, calib: Calibration, st: RefineSettings, samples: int,
                 total: str = "mean", lines: str = "all") -> None:
        self.ev, self.calib, self.st, self.samples = evidence, calib, st, samples
        self.total, self.lines = total, lines
        self.typical = float(np.median(np.sqrt(np.maximum(evidence[..., 0] + evidence[..., 1], 0)))) + 1e-9

    def __call__(self, T: np.ndarray, height: float, thickness: float, detail: bool = False):
        lines, edge_on = _visible_lines(self.calib, T, height, thickness, self.samples, 2.0, self.st.min_separation_px,
                                        self.st.wall_placement)
        if self.lines == "thickness":
            moved = "/outer" if self.st.wall_placement == "inner" else "/inner"
            lines, edge_on = [line for line in lines if moved in line[0]], 0
        elif self.lines == "inner":
            lines = [line for line in lines if "/inner" in line[0]]
        scores = [float(_strength(self.ev, uv, n).mean()) / self.typical for _name, _pts, uv, n in lines]
        scores += [1.0] * edge_on
        if self.total == "excess":
            total = float(np.sum(np.maximum(np.asarray(scores) - 1.0, 0.0)))
        else:
            total = float(np.mean(scores)) if scores else 0.0
        return (total, [line[0] for line in lines]) if detail else total


def _smoothed(evidence: np.ndarray, sigma: float) -> np.ndarray:
    return cv2.GaussianBlur(evidence, (0, 0), sigma) if sigma > 0 else evidence


def _nelder_mead(f, x0: np.ndarray, steps: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 iters: int = 400, tol: float = 1e-5) -> tuple[np.ndarray, float]:
    """Maximise ``f`` within ``[lo, hi]`` by Nelder-Mead (adaptive coefficients, Gao and Han 2012).

    A simplex follows the narrow ridges a camera pose has (turning the camera and
    moving it sideways shift the image alike), where a search along the axes stalls.
    """
    n = len(x0)
    alpha, gamma, rho, sigma = 1.0, 1.0 + 2.0 / n, 0.75 - 1.0 / (2 * n), 1.0 - 1.0 / n

    def g(x: np.ndarray) -> float:
        return -f(np.clip(x, lo, hi))

    pts = [np.asarray(x0, dtype=np.float64)]
    for i in range(n):
        p = pts[0].copy()
        p[i] += steps[i]
        pts.append(p)
    vals = [g(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[k] for k in order], [vals[k] for k in order]
        if abs(vals[-1] - vals[0]) <= tol * (abs(vals[0]) + 1e-12):
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + alpha * (centroid - pts[-1])
        fr = g(xr)
        if fr < vals[0]:
            xe = centroid + gamma * (xr - centroid)
            fe = g(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            outside = fr < vals[-1]
            xc = centroid + rho * ((xr if outside else pts[-1]) - centroid)
            fc = g(xc)
            if fc < (fr if outside else vals[-1]):
                pts[-1], vals[-1] = xc, fc
            else:  # shrink towards the best
                pts = [pts[0]] + [pts[0] + sigma * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [g(p) for p in pts[1:]]
    k = int(np.argmin(vals))
    return np.clip(pts[k], lo, hi), -vals[k]


def _project(T: np.ndarray, K: np.ndarray, pts: np.ndarray) -> np.ndarray:
    pc = (pts - T[:3, 3]) @ T[:3, :3]
    return (pc[:, :2] / pc[:, 2:3]) @ K[:2, :2].T + K[:2, 2]


def _edge_offsets(evidence: np.ndarray, calib: Calibration, T: np.ndarray, height: float, thickness: float,
                  st: RefineSettings) -> tuple[list, np.ndarray]:
    """Where the strongest edge lies across each visible sample point, px along the line's normal.

    Returns the sampled lines (``(name, points, pixels, normal)``) and the offsets (NaN
    where the strongest edge within ``reach_px`` is at the end of the reach: the slope of
    an edge further out, not an edge found).
    """
    steps = np.arange(-st.reach_px, st.reach_px + 1e-9, 0.5)
    lines, _edge_on = _visible_lines(calib, T, height, thickness, st.samples_per_edge, st.reach_px + 2,
                                     st.min_separation_px, st.wall_placement)
    offsets = []
    for _name, _pts, uv, n in lines:
        prof = np.stack([_strength(evidence, uv + o * n, n) for o in steps], axis=1)
        top = np.argmax(prof, axis=1)
        k = np.clip(top, 1, len(steps) - 2)
        rows = np.arange(len(k))
        y0, y1, y2 = prof[rows, k - 1], prof[rows, k], prof[rows, k + 1]
        denom = y0 - 2 * y1 + y2
        safe = np.where(denom < -1e-12, denom, -1.0)
        sub = np.where(denom < -1e-12, 0.5 * (y0 - y2) / safe, 0.0)
        off = steps[k] + np.clip(sub, -0.5, 0.5) * (steps[1] - steps[0])
        off[(top == 0) | (top == len(steps) - 1)] = np.nan
        offsets.append(off)
    return lines, (np.concatenate(offsets) if offsets else np.zeros(0))


def _normal_equations(evidence: np.ndarray, calib: Calibration, T0: np.ndarray, x: np.ndarray,
                      st: RefineSettings) -> tuple[np.ndarray, np.ndarray, float, int] | None:
    """Gauss-Newton's weighted normal equations ``(A, b)`` at ``x``, the residuals' robust
    scale (px) and how many lines they come from; None with under 20 edges found.

    The residual is each sample point's offset to its edge (Huber weights); moving the
    model by dx changes it by -J dx.
    """
    eps = 1e-5
    T = perturb(T0, x[:6])
    lines, off = _edge_offsets(evidence, calib, T, x[6], x[7], st)
    good = np.isfinite(off)
    if good.sum() < 20:
        return None
    J = np.zeros((len(off), 8))
    for i in range(8):
        y = x.copy()
        y[i] += eps
        Ty = perturb(T0, y[:6])
        col = []
        for (name, pts, uv, n) in lines:
            moved = _moved_points(name, pts, x, y, st.wall_placement)
            col.append((_project(Ty, calib.K, moved) - uv) @ n / eps)
        J[:, i] = np.concatenate(col)
    r, Jg = off[good], J[good]
    scale = 1.4826 * np.median(np.abs(r - np.median(r))) + 1e-3
    wgt = np.minimum(1.0, 1.5 * scale / (np.abs(r) + 1e-12))  # Huber
    # A whole line off by a pixel is a model fault (a face seen nearly edge-on, a
    # shadow along an edge), not noise: such a line weighs less, by its median offset.
    line_of = np.concatenate([np.full(len(line[1]), k) for k, line in enumerate(lines)])[good]
    for k in range(len(lines)):
        on = line_of == k
        if on.any():
            wgt[on] /= 1.0 + (np.median(r[on]) / st.line_bias_px) ** 2
    A = Jg.T @ (Jg * wgt[:, None])
    A += np.eye(8) * 1e-9 * np.trace(A)  # the thickness is unseen when no face it moves shows
    return A, Jg.T @ (wgt * r), float(scale), len(np.unique(line_of))


def _least_squares(evidence: np.ndarray, calib: Calibration, T0: np.ndarray, x: np.ndarray, lo: np.ndarray,
                   hi: np.ndarray, st: RefineSettings) -> np.ndarray:
    """Gauss-Newton on the sample points' distances to their edges (Huber weights).

    The mean-strength score is flat near its top; the distances are not.
    """
    for _it in range(st.gauss_newton_iters):
        eq = _normal_equations(evidence, calib, T0, x, st)
        if eq is None:
            break
        A, b, _scale, _lines = eq
        dx = np.linalg.solve(A, b)
        x = np.clip(x + dx, lo, hi)
        if np.all(np.abs(dx) < 1e-6):
            break
    return x


def _pose_sigma(evidence: np.ndarray, calib: Calibration, T0: np.ndarray, x: np.ndarray,
                st: RefineSettings) -> tuple[float, float, np.ndarray | None]:
    """The fit's 1-sigma uncertainty along its weakest direction: (camera centre, m; turn,
    deg), and the pose's covariance (6 x 6, in ``perturb``'s ``x``: radians, metres; the
    wall height and thickness marginalised out), None where too few edges were found.

    A line's points are not independent (its own bias, a few tenths of a pixel, moves
    them together), so the covariance counts each line as one measurement: the
    points' covariance scaled by points per line. The weakest direction is the ridge
    along which a camera turns and moves at once with little change in the image.
    """
    eq = _normal_equations(evidence, calib, T0, x, st)
    if eq is None:
        return math.inf, math.inf, None
    A, _b, scale, n_lines = eq
    var = scale ** 2 * st.samples_per_edge
    cov = np.linalg.pinv(A[:6, :6]) * var  # the walls' height and thickness held at the fit's
    shift = math.sqrt(max(float(np.linalg.eigvalsh(cov[3:, 3:]).max()), 0.0))
    turn = math.degrees(math.sqrt(max(float(np.linalg.eigvalsh(cov[:3, :3]).max()), 0.0)))
    return shift, turn, np.linalg.pinv(A)[:6, :6] * var


def correction_sigmas(x: np.ndarray, cov: np.ndarray | None) -> float:
    """How many of the fit's own standard deviations the correction ``x`` (``perturb``'s, from
    the calibration to the fit) spans, in every direction at once: its Mahalanobis length
    under the fit's covariance ``cov``. A correction along the turn-and-move ridge, where
    the walls say little, counts little; a turn that moves the whole image counts fully."""
    if cov is None:
        return 0.0
    x = np.asarray(x, dtype=np.float64)
    return math.sqrt(max(float(x @ np.linalg.pinv(cov) @ x), 0.0))


#: The workspace's points for :func:`workspace_shift_mm`: a grid this many points a side over
#: the workspace, at these heights above the table (m: the table, and where parts' tops are).
WORKSPACE_GRID, WORKSPACE_HEIGHTS = 15, (0.0, 0.04)


def workspace_shift_mm(calib: Calibration, T_ref: np.ndarray, T: np.ndarray) -> float:
    """How far a camera at pose ``T`` puts what a camera at ``T_ref`` sees in the workspace (mm).

    Each point of a grid over ``calib``'s workspace (:data:`WORKSPACE_HEIGHTS`) is projected
    through ``T_ref``, and the pixel cast back through ``T`` onto the point's own height;
    the median distance to the point. With ``T_ref`` the true pose this is the error a grasp
    found at that pixel would carry; a slide along the turn-and-move ridge, which moves
    the camera centre far, moves it little.
    """
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    gx, gy = np.meshgrid(np.linspace(x0, x1, WORKSPACE_GRID), np.linspace(y0, y1, WORKSPACE_GRID))
    errors = []
    for dz in WORKSPACE_HEIGHTS:
        z = calib.table_z + dz
        points = np.stack([gx.ravel(), gy.ravel(), np.full(gx.size, z)], axis=1)
        rays = (points - T_ref[:3, 3]) @ T_ref[:3, :3]      # camera frame of T_ref
        rays_b = rays @ T[:3, :3].T                          # the same pixels' rays, from pose T
        s = (z - T[2, 3]) / rays_b[:, 2]
        errors.append(np.linalg.norm(T[:3, 3] + rays_b * s[:, None] - points, axis=1))
    return float(np.median(np.concatenate(errors)) * 1e3)


def without_sight_move(calib: Calibration, T_given: np.ndarray, T: np.ndarray) -> tuple[np.ndarray, float]:
    """The pose ``T`` less its move along the given camera's line of sight to the workspace's
    centre (on the table), and that move (m, +: towards the bin).

    The walls fix the camera's turn and its sideways place, but a camera a centimetre or two
    nearer the bin sees nearly what a camera at the right distance sees of a bin a few mm
    larger: the fit cannot tell its distance from the bin's size, and the workspace a user
    gives is the bin's size only as well as the bin was placed and measured. In twin cells
    whose bin stood 3 mm inside the workspace edges the fits slid the camera 12-20 mm along
    that line, and in the validation cells 14-21 mm; the distance is therefore left as
    given (``accept.write_distance: false``; docs/experiments/2026-12-06-refine-distance-left-as-given.md).
    """
    sight = calib.workspace_center - T_given[:3, 3]
    sight /= np.linalg.norm(sight)
    move = float((T[:3, 3] - T_given[:3, 3]) @ sight)
    out = np.array(T, dtype=np.float64, copy=True)
    out[:3, 3] -= move * sight
    return out, move


def _moved_points(name: str, pts: np.ndarray, x: np.ndarray, y: np.ndarray, placement: str) -> np.ndarray:
    """The same sample points on the walls of height ``y[6]`` and thickness ``y[7]``: a
    thicker wall moves its outer face out where the inner face stands on the edge, and its
    inner face in where the outer face does."""
    moved = pts.copy()
    wall, kind = name.split("/")
    if kind.endswith("top"):
        moved[:, 2] += y[6] - x[6]
    axis = 0 if wall.startswith("x") else 1
    inward = 1.0 if wall.endswith("min") else -1.0
    if placement == "inner" and kind.startswith("outer"):
        moved[:, axis] -= inward * (y[7] - x[7])
    elif placement == "outer" and kind.startswith("inner"):
        moved[:, axis] += inward * (y[7] - x[7])
    return moved


def _starts(coarsest: np.ndarray, calib: Calibration, T0: np.ndarray, st: RefineSettings) -> list[np.ndarray]:
    """Where the fine fit starts: the calibration itself with a few wall heights (its error
    is usually small), then the best few peaks, apart from each other, of a coarse table
    over the two rotations that move the whole image (they stand in for the sideways
    moves too) and the wall height, on heavily smoothed evidence, inner edges only. A
    textured floor or a wall's two top edges can make a wrong peak the highest there.
    """
    (h_lo, h_hi), span = st.height_range, math.radians(st.search_deg)
    coarse = _Objective(coarsest, calib, st, max(40, st.samples_per_edge // 4), lines="inner")
    grid = np.arange(-span, span + 1e-9, math.radians(st.search_step_deg))
    heights = np.arange(h_lo, h_hi + 1e-9, st.height_step)
    t0 = _start_thickness(st, coarsest, calib, T0, heights)
    table = np.array([[[coarse(perturb(T0, np.array([wx, wy, 0, 0, 0, 0])), h, t0) for h in heights]
                       for wy in grid] for wx in grid])
    starts = [np.array([0, 0, 0, 0, 0, 0, h, t0]) for h in np.linspace(h_lo, h_hi, st.start_heights)]
    flat = table.max(axis=2)
    taken = np.zeros_like(flat, dtype=bool)
    gap = st.peak_spacing
    for idx in np.argsort(flat, axis=None)[::-1]:
        if len(starts) >= st.start_heights + st.hypotheses:
            break
        a, b = np.unravel_index(idx, flat.shape)
        if not taken[a, b]:
            starts.append(np.array([grid[a], grid[b], 0, 0, 0, 0, heights[int(np.argmax(table[a, b]))], t0]))
            taken[max(0, a - gap):a + gap + 1, max(0, b - gap):b + gap + 1] = True
    return starts


def _start_thickness(st: RefineSettings, coarsest: np.ndarray, calib: Calibration, T0: np.ndarray,
                     heights: np.ndarray) -> float:
    """The wall thickness the search holds while it finds the pose. Where the inner faces
    stand on the edges, 0: the inner edges alone, which the thickness does not move. Where
    the outer faces do, the inner faces lie a thickness inside: the measurement, when the
    walls were measured; otherwise the thickness (and, of ``heights``, the coarse search's
    wall heights, the height) whose edges, all of them, lie best on the heavily smoothed
    evidence at the given pose, in 1 mm steps. A thickness near 0 lays the inner top on the
    outer one and the inner foot on no edge, so the mean over the lines prefers the true one;
    the given pose's few millimetres of error blur it alike on every thickness."""
    if st.wall_placement == "inner":
        return 0.0
    t_lo, t_hi = st.thickness_range
    if st.wall_thickness is not None or t_hi - t_lo <= 0.002:
        return float(np.mean(st.thickness_range))
    every = _Objective(coarsest, calib, st, max(40, st.samples_per_edge // 4))
    thicknesses = np.arange(max(t_lo, 0.001), t_hi + 1e-9, 0.001)
    scores = [max(every(T0, h, t) for h in heights) for t in thicknesses]
    return float(thicknesses[int(np.argmax(scores))])


def _prior(z: np.ndarray, st: RefineSettings) -> float:
    """The search's prior on the correction: ``prior_weight`` times the squared shift and
    turn in units of the largest correction the command accepts.

    A wall about 1 cm thick has its top's inner and outer edges a few pixels apart, and the
    camera can turn and move at once along a ridge where the image barely changes: there
    the search can lock the inner edge onto the outer one some 3 cm and 2 degrees away,
    where the edges fit almost as well. A calibration is off by millimetres, so the search
    leans towards small corrections; the least-squares step after it and the choice between
    fits have no prior, so a correction the edges do support is not shrunk.
    """
    return st.prior_weight * ((float(np.linalg.norm(z[3:6])) / st.max_shift_m) ** 2
                              + (math.degrees(float(np.linalg.norm(z[:3]))) / st.max_rotation_deg) ** 2)


def _fit_from(start: np.ndarray, fine: list[_Objective], moved: _Objective, sharp: np.ndarray,
              calib: Calibration, T0: np.ndarray, st: RefineSettings) -> np.ndarray:
    """One start through less and less smoothed evidence (``fine``: the walls at the start
    thickness, :func:`_start_thickness`; Nelder-Mead), then the thickness from the edges it
    moves alone (``moved``), then least squares on all of them (on ``sharp``, the least
    smoothed evidence)."""
    (h_lo, h_hi), (t_lo, t_hi) = st.height_range, st.thickness_range
    lim = np.array([math.radians(st.search_deg)] * 3 + [st.max_shift_m * 1.5] * 3)
    t_start = float(start[7])  # :func:`_start_thickness`, held while the pose is found
    lo, hi = np.r_[-lim, h_lo, t_start], np.r_[lim, h_hi, t_start]
    y, steps = start, np.array([math.radians(0.2)] * 3 + [0.004] * 3 + [0.004, 0.004])
    for obj in fine:
        for _restart in range(st.restarts):  # a fresh simplex escapes one that collapsed on a ridge
            y, _val = _nelder_mead(lambda z, obj=obj: obj(perturb(T0, z[:6]), z[6], z[7]) - _prior(z, st),
                                   y, steps, lo, hi)
        steps = steps * 0.5
    if t_hi > 0:
        T = perturb(T0, y[:6])
        cands = np.arange(max(t_lo, 0.001), t_hi + 1e-9, 0.0005)
        vals = [moved(T, y[6], t) for t in cands]
        # No outer face found (inner placement): walls too thin to show one, thickness 0.
        # The inner faces (outer placement) always show; without an edge the start stays.
        y[7] = cands[int(np.argmax(vals))] if max(vals) >= st.min_contrast - 1.0 else t_start
        lo[7], hi[7] = (t_lo, t_hi) if y[7] > 0 else (0.0, 0.0)
    return _least_squares(sharp, calib, T0, y, lo, hi, st)


def refine_pose(frames: list[np.ndarray], calib: Calibration, settings: RefineSettings | None = None,
                accept: AcceptSettings | None = None) -> RefineResult:
    """Fit ``T_base_camera``, the wall height and thickness to the walls seen in ``frames``,
    and judge whether the fit is strong enough to replace the calibration (:func:`decide`).

    Every start is fitted to the end; the fit that explains the most edge (summed over
    every line, so none wins by leaving lines out) is the answer. Besides it, the fit
    records what :func:`decide` weighs (:attr:`RefineResult.evidence`): whether a distant
    fit explains almost as much edge, the fit's uncertainty and how many of its standard
    deviations the correction spans, and how far apart the fits on the two halves of the
    frames put the workspace; besides, for the report, how much more edge it explains than
    the calibration.

    Raises:
        RefineError: no frames.
    """
    st = settings or RefineSettings.defaults()
    acc = accept or AcceptSettings.defaults()
    if not frames:
        raise RefineError("no frames to refine from")
    T0 = calib.T_base_camera.copy()
    evidence = edge_evidence(frames, calib, st.clip_percentile)
    # Each smoothing once, shared by every start.
    blurred = [_smoothed(evidence, sigma) for sigma in st.scales_px]
    fine = [_Objective(b, calib, st, st.samples_per_edge, lines="inner") for b in blurred]
    moved = _Objective(blurred[-1], calib, st, st.samples_per_edge, total="excess", lines="thickness")
    explained = _Objective(blurred[-1], calib, st, st.samples_per_edge, total="excess")
    starts = _starts(blurred[0], calib, T0, st)
    fits, t0 = [], time.monotonic()
    for k, start in enumerate(starts):  # about 3-5 s each on one core (the progress a user sees)
        fits.append(_fit_from(start, fine, moved, blurred[-1], calib, T0, st))
        log.info("fit %d/%d done (%.0f s)", k + 1, len(starts), time.monotonic() - t0)
    scores = [explained(perturb(T0, y[:6]), y[6], y[7]) for y in fits]
    best = int(np.argmax(scores))
    x = fits[best]
    final = _Objective(evidence, calib, st, st.samples_per_edge)
    T = perturb(T0, x[:6])
    contrast, names = final(T, float(x[6]), float(x[7]), detail=True)
    before = final(T0, float(x[6]), float(x[7]))
    shift, angle = pose_change(T0, T)
    record = _evidence(frames, blurred[-1], calib, st, acc, T0, fits, scores, best, explained(T0, x[6], x[7]))
    record.update(contrast=float(contrast), contrast_before=float(before), correction_mm=shift * 1e3,
                  correction_deg=angle)
    accepted, reason = decide(record, st, acc)
    refined, sight_move = (T, 0.0) if acc.write_distance else without_sight_move(calib, T0, T)
    return RefineResult(T, float(x[6]), float(x[7]), float(contrast), float(before), shift, angle, names,
                        T_given=T0, accepted=accepted, reason=reason, evidence=record, T_refined=refined,
                        sight_move_m=sight_move, wall_placement=st.wall_placement)


def _evidence(frames: list[np.ndarray], sharp: np.ndarray, calib: Calibration, st: RefineSettings, acc: AcceptSettings,
              T0: np.ndarray, fits: list[np.ndarray], scores: list[float], best: int,
              explained_given: float) -> dict:
    """What :func:`decide` weighs, as plain numbers (units in the keys; a report keeps them)."""
    x = fits[best]
    T = perturb(T0, x[:6])
    # A distant fit that explains almost as much edge: the walls allow two poses.
    rivals = [s for y, s in zip(fits, scores)
              if _apart(pose_change(perturb(T0, y[:6]), T), acc)]
    agree = sum(not _apart(pose_change(perturb(T0, y[:6]), T), acc) for y in fits)
    sigma_m, sigma_deg, cov = _pose_sigma(sharp, calib, T0, x, st)
    # The same last step on each half of the frames, from the answer: how far noise moves it.
    lim = np.array([math.radians(st.search_deg)] * 3 + [st.max_shift_m * 1.5] * 3)
    t_lo, t_hi = st.thickness_range if x[7] > 0 else (0.0, 0.0)
    lo, hi = np.r_[-lim, st.height_range[0], t_lo], np.r_[lim, st.height_range[1], t_hi]
    halves = []
    for part in (frames[0::2], frames[1::2]):
        ev = _smoothed(edge_evidence(part, calib, st.clip_percentile), st.scales_px[-1]) if part else sharp
        halves.append(perturb(T0, _least_squares(ev, calib, T0, x.copy(), lo, hi, st)[:6]))
    halves_m, halves_deg = pose_change(*halves)
    best_score = scores[best]
    return {
        "explained": float(best_score),
        "explained_given": float(explained_given),
        "rival_share": float(max(rivals) / best_score) if rivals and best_score > 0 else 0.0,
        "starts": len(fits),
        "starts_agreeing": int(agree),
        "sigma_mm": sigma_m * 1e3,
        "sigma_deg": sigma_deg,
        "correction_sigmas": correction_sigmas(x[:6], cov),
        "workspace_shift_mm": workspace_shift_mm(calib, T0, T),
        "halves_mm": halves_m * 1e3,
        "halves_deg": halves_deg,
        "halves_workspace_mm": workspace_shift_mm(calib, *halves),
        "wall_height_m": float(x[6]),
        "wall_thickness_m": float(x[7]),
    }


def _apart(change: tuple[float, float], acc: AcceptSettings) -> bool:
    return change[0] * 1e3 > acc.same_pose_mm or change[1] > acc.same_pose_deg


def decide(evidence: dict, st: RefineSettings, acc: AcceptSettings) -> tuple[bool, str]:
    """Whether the fit replaces the calibration, and why (a pure function of the fit's
    :attr:`RefineResult.evidence`, so a benchmark can replay it on stored fits).

    The calibration is kept as given unless every test passes: a calibration slightly
    off does less harm than a pose that slid along the walls' edges (the rule and the
    cells it was chosen and checked on: ``docs/benchmarks.md``, "Camera refinement").
    """
    e = evidence
    if e["contrast"] < st.min_contrast:
        return False, (f"no bin walls found: the best fit's edges are {e['contrast']:.2f}x the image's typical edge "
                       f"(at least {st.min_contrast} needed); are the bin's walls in view and the workspace right?")
    if e["correction_mm"] > st.max_shift_m * 1e3 or e["correction_deg"] > st.max_rotation_deg:
        return False, (f"the walls fit {e['correction_mm']:.1f} mm / {e['correction_deg']:.2f} deg away from the "
                       f"calibration, beyond {st.max_shift_m * 1e3:.0f} mm / {st.max_rotation_deg:.0f} deg: "
                       "recalibrate (sim2real-calibrate handeye) rather than refine")
    if e["correction_mm"] < acc.min_correction_mm and e["correction_deg"] < acc.min_correction_deg:
        return False, (f"the calibration already fits the walls: the fit moves it only {e['correction_mm']:.1f} mm / "
                       f"{e['correction_deg']:.2f} deg (under {acc.min_correction_mm} mm and "
                       f"{acc.min_correction_deg} deg, within the fit's own noise)")
    if e["rival_share"] > acc.max_rival_share:
        return False, (f"the walls allow two poses: a fit elsewhere explains {100 * e['rival_share']:.1f}% as much "
                       f"edge (more than {100 * acc.max_rival_share:.1f}%)")
    # With the walls measured, a slide along the turn-and-move ridge barely moves the workspace
    # in the image (docs/benchmarks.md, "the workspace error"), so looser limits apply.
    measured = st.wall_height is not None and st.wall_thickness is not None
    max_sigma = acc.max_sigma_mm_measured if measured else acc.max_sigma_mm
    if e["sigma_mm"] > max_sigma:
        return False, (f"the walls leave the camera loose: {e['sigma_mm']:.1f} mm of uncertainty along the direction "
                       f"in which it can turn and move at once (over {max_sigma} mm"
                       f"{' with the walls measured' if measured else ''})")
    # The fit's own floor: started at the true pose it settles some 4 mm away along the ridge
    # (each line's bias of a fraction of a pixel, amplified), where the walls say little.
    # The correction is measured against the fit's covariance in every direction at once,
    # so a slide along the ridge counts little and a turn that moves the whole image counts
    # fully (docs/experiments/2026-12-06-refine-corrections-measured-in-sigmas.md).
    if e["correction_sigmas"] < acc.min_correction_sigmas:
        return False, (f"the correction is within the fit's own uncertainty: it spans {e['correction_sigmas']:.1f} of "
                       f"the fit's standard deviations (at least {acc.min_correction_sigmas:g} needed) and moves what "
                       f"the camera sees in the workspace by {e['workspace_shift_mm']:.1f} mm; the calibration may "
                       "already be as close as the walls can tell")
    # Repeatable where it matters: the two halves' fits may slide apart along the ridge (the
    # camera centre mm apart) and still put the workspace in the same place, which is what a
    # grasp needs (docs/experiments/2026-12-06-refine-halves-measured-in-the-workspace.md).
    if e["halves_workspace_mm"] > acc.max_halves_workspace_mm:
        return False, (f"the fit is not repeatable: fits on the two halves of the frames put what the camera sees "
                       f"in the workspace {e['halves_workspace_mm']:.1f} mm apart (over "
                       f"{acc.max_halves_workspace_mm:g} mm; the camera {e['halves_mm']:.1f} mm / "
                       f"{e['halves_deg']:.2f} deg apart)")
    return True, (f"the walls fit {e['correction_mm']:.1f} mm / {e['correction_deg']:.2f} deg from the calibration "
                  f"(what the camera sees in the workspace moves {e['workspace_shift_mm']:.1f} mm), repeatably "
                  f"(the halves of the frames put it {e['halves_workspace_mm']:.1f} mm apart)")


# ------------------------------------------------------------------ picture
def undistorted_median(frames: list[np.ndarray], calib: Calibration) -> np.ndarray:
    """The frames' per-pixel median, undistorted (objects that move fade; the walls stay)."""
    K, dist = calib.K, calib.dist
    return cv2.undistort(np.median(np.stack(frames), axis=0).astype(np.uint8), K, dist, None, K)


def draw_fit(image: np.ndarray, calib: Calibration, before: np.ndarray, result: RefineResult) -> np.ndarray:
    """The wall edges on an undistorted frame: red where the calibration put them, green
    where the written pose puts them (the fit less its move along the line of sight, so a
    bin off the workspace's size shows as a small, even gap), or yellow where the fit not
    written would have."""
    out = image.copy()
    after = (60, 255, 60) if result.accepted else (255, 220, 0)
    for T, color in ((before, (255, 60, 60)), (result.refined_pose if result.accepted else result.T_base_camera, after)):
        for _name, a, b in wall_lines(calib, result.wall_height, result.wall_thickness, T[:3, 3], result.wall_placement):
            pa, pb = _project(T, calib.K, np.stack([a, b]))
            cv2.line(out, tuple(int(round(v)) for v in pa), tuple(int(round(v)) for v in pb), color, 1, cv2.LINE_AA)
    return out


# ------------------------------------------------------------------ the walls alone
def frame_picks(n_frames: int, max_frames: int) -> np.ndarray:
    """Indices of at most ``max_frames`` of ``n_frames`` frames, evenly spaced over them
    (consecutive frames of one scene add little): the frames the fit sees."""
    return np.unique(np.linspace(0, n_frames - 1, min(n_frames, max_frames)).round().astype(int))


def measure_walls(frames: list[np.ndarray], calib: Calibration,
                  settings: RefineSettings | None = None) -> tuple[float, float] | None:
    """The bin's walls, ``(height, thickness)`` in metres, as :func:`refine_pose` fits them
    with the pose (whether or not it would write the pose); ``None`` when it finds no walls
    (their edges under ``min_contrast``) or the model stands them outside the workspace
    (``wall_placement: inner``: the workspace is the bin's inside, no wall stands in it).
    On validation cells 0, 1 and 4 it reads walls 12 mm thick and 58-59 mm high (12-13 and
    60 mm built): about 30 s for 40 frames on 2 cores with the command's search, 10 s with one
    start (``hypotheses=1, start_heights=1, restarts=1``, the pipeline's), the same walls within 0.2 mm."""
    st = settings or RefineSettings.defaults()
    if st.wall_placement != "outer":
        return None
    res = refine_pose(frames, calib, st)
    if res.evidence["contrast"] < st.min_contrast or res.wall_thickness <= 0.0 or res.wall_height <= 0.0:
        return None
    return float(res.wall_height), float(res.wall_thickness)
