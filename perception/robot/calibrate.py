"""``sim2real-calibrate``: camera intrinsics and the eye-to-hand camera pose.

- ``sim2real-calibrate intrinsics images=DIR board.cols=9 board.rows=6 board.square=0.025 out=FILE``:
  checkerboard (or ``board.kind=charuco``) images -> ``K``, ``dist`` and the RMS reprojection
  error (``cv2.calibrateCamera``).
- ``sim2real-calibrate handeye calibration=FILE poses=FILE images=DIR out=FILE``: robot poses of a
  checkerboard held by the gripper plus the camera's view of it -> ``T_base_camera``
  (``cv2.calibrateHandEye`` for an eye-to-hand camera).
- ``sim2real-calibrate refine calibration=FILE real_dir=DIR out=FILE``: unlabeled frames of the
  cell -> ``T_base_camera`` refined on the bin's walls (:mod:`perception.core.refine`), the wall
  height and thickness fitted with it; a correction over 2 cm or 2 degrees, or no walls
  found, is refused (exit 2, no file written). A picture of the fit goes beside ``out``.

All three write the contract's calibration JSON; fields a step does not measure come from
``base`` (intrinsics) or ``calibration`` (hand-eye), and a ``calibration_report`` records
how good the fit was. :func:`render_board` draws synthetic board images with a known
ground truth (tests and dry runs).

Board convention: ``board.cols`` x ``board.rows`` *inner* corners, squares of ``board.square``
metres; the board frame has its origin at the first inner corner, ``x`` along the columns,
``y`` along the rows, and the square diagonal to the origin (towards ``-x, -y``) is black,
which fixes the corner order of symmetric boards.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from perception.core.atomic import atomic_write_bytes
from perception.core.calibration import Calibration, CalibrationError, calibration_path
from perception.core.cli import CliError, compose_config, setup_logging
from perception.core.frames import invert_transform, rotation_angle
from perception.core.imageio import ImageDecodeError, read_image
from perception.core.refine import (
    AcceptSettings,
    RefineError,
    RefineSettings,
    bin_inside,
    draw_fit,
    frame_picks,
    refine_pose,
    undistorted_median,
    workspace_shift_mm,
)
from perception.robot.cameras.replay import list_frames

__all__ = [
    "Board",
    "CalibrationFitError",
    "detect_board",
    "detect_board_ids",
    "board_pose",
    "calibrate_intrinsics",
    "calibrate_handeye",
    "render_board",
    "main",
]

log = logging.getLogger("sim2real.calibrate")

HANDEYE_METHODS = {
    "tsai": cv2.CALIB_HAND_EYE_TSAI,
    "park": cv2.CALIB_HAND_EYE_PARK,
    "horaud": cv2.CALIB_HAND_EYE_HORAUD,
    "andreff": cv2.CALIB_HAND_EYE_ANDREFF,
    "daniilidis": cv2.CALIB_HAND_EYE_DANIILIDIS,
}


class CalibrationFitError(RuntimeError):
    """Not enough usable views, or a fit that failed."""


@dataclass(frozen=True)
class Board:
    """A calibration board: ``cols`` x ``rows`` *inner* corners, ``square`` metres.

    ``kind`` is ``"checkerboard"`` or ``"charuco"`` (ArUco markers of ``marker`` metres from
    ``dictionary`` in the white squares, so partly visible boards still give corners
    with known identities). Corner ``k`` of :meth:`object_points` is ChArUco id ``k``.
    """

    cols: int = 9
    rows: int = 6
    square: float = 0.025
    kind: str = "checkerboard"
    marker: float = 0.018
    dictionary: str = "DICT_4X4_50"

    def __post_init__(self) -> None:
        if self.kind not in ("checkerboard", "charuco"):
            raise ValueError(f"unknown board kind {self.kind!r}; known: checkerboard, charuco")
        if self.kind == "charuco" and not 0 < self.marker < self.square:
            raise ValueError("board.marker must be smaller than board.square")

    @property
    def pattern(self) -> tuple[int, int]:
        return (self.cols, self.rows)

    def charuco(self):
        """The OpenCV ``CharucoBoard`` (``cols + 1`` x ``rows + 1`` squares)."""
        d = cv2.aruco.getPredefinedDictionary(getattr(cv2.aruco, self.dictionary))
        return cv2.aruco.CharucoBoard((self.cols + 1, self.rows + 1), self.square, self.marker, d)

    def object_points(self) -> np.ndarray:
        """``(cols*rows, 3)`` corner positions in the board frame, OpenCV's order (row-major)."""
        j, i = np.mgrid[0 : self.rows, 0 : self.cols]
        return np.stack([i.ravel() * self.square, j.ravel() * self.square, np.zeros(i.size)], axis=1)


# ------------------------------------------------------------------ detection
#: Corners further than max(OUTLIER_MIN_PX, OUTLIER_RMS_FACTOR * first RMS) from the
#: first intrinsics fit are dropped before the second fit.
OUTLIER_MIN_PX = 0.5
OUTLIER_RMS_FACTOR = 3.0
#: ChArUco views with fewer corners than this are skipped.
MIN_CHARUCO_CORNERS = 8
#: Half window of the sub-pixel refinement of ChArUco corners, pixels.
CHARUCO_SUBPIX = 2


def detect_board(rgb: np.ndarray, board: Board) -> np.ndarray | None:
    """Sub-pixel inner corners ``(N, 2)`` in OpenCV's order, or ``None`` if not found.

    For a ChArUco board use :func:`detect_board_ids` (a view may show only some corners).
    """
    found = detect_board_ids(rgb, board)
    if found is None:
        return None
    corners, ids = found
    if board.kind == "charuco":
        full = np.full((board.cols * board.rows, 2), np.nan)
        full[ids] = corners
        return full if np.isfinite(full).all() else None
    return corners


def detect_board_ids(rgb: np.ndarray, board: Board) -> tuple[np.ndarray, np.ndarray] | None:
    """Detected corners ``(N, 2)`` and their ids ``(N,)`` (indices into :meth:`Board.object_points`)."""
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY) if rgb.ndim == 3 else rgb
    if board.kind == "charuco":
        corners, ids, _, _ = cv2.aruco.CharucoDetector(board.charuco()).detectBoard(gray)
        if ids is None or len(ids) < MIN_CHARUCO_CORNERS:
            return None
        # The detector interpolates corners from the markers; refine them on the image.
        corners = cv2.cornerSubPix(gray, corners.reshape(-1, 1, 2).astype(np.float32), (CHARUCO_SUBPIX, CHARUCO_SUBPIX),
                                   (-1, -1), (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, 50, 1e-3))
        return corners.reshape(-1, 2).astype(np.float64), ids.ravel().astype(np.int64)
    corners = _detect_checkerboard(gray, board)
    if corners is None:
        return None
    return corners, np.arange(len(corners))


def _detect_checkerboard(gray: np.ndarray, board: Board) -> np.ndarray | None:
    ok, corners = cv2.findChessboardCornersSB(gray, board.pattern, flags=cv2.CALIB_CB_ACCURACY)
    if not ok:
        ok, corners = cv2.findChessboardCorners(
            gray, board.pattern, flags=cv2.CALIB_CB_ADAPTIVE_THRESH | cv2.CALIB_CB_NORMALIZE_IMAGE
        )
        if not ok:
            return None
        corners = cv2.cornerSubPix(
            gray, corners, (5, 5), (-1, -1), (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, 50, 1e-3)
        )
    return corners.reshape(-1, 2).astype(np.float64)


def _pose(obj: np.ndarray, img: np.ndarray, K: np.ndarray, dist: np.ndarray) -> np.ndarray:
    ok, rvec, tvec = cv2.solvePnP(obj, img, K, dist, flags=cv2.SOLVEPNP_ITERATIVE)
    if not ok:
        raise CalibrationFitError("solvePnP failed")
    T = np.eye(4)
    T[:3, :3] = cv2.Rodrigues(rvec)[0]
    T[:3, 3] = tvec.ravel()
    return T


def board_pose(rgb: np.ndarray, corners: np.ndarray, board: Board, K: np.ndarray, dist: np.ndarray,
               ids: np.ndarray | None = None) -> np.ndarray:
    """``T_camera_board`` from detected corners, with the corner order made canonical.

    A checkerboard looks the same turned by a half turn; the black square diagonal to
    the origin decides which corner is the origin. ChArUco corners carry their ids.
    """
    if board.kind == "charuco":
        ids = np.arange(len(corners)) if ids is None else ids
        return _pose(board.object_points()[ids], corners, K, dist)
    obj = board.object_points()
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY) if rgb.ndim == 3 else rgb
    best = None
    for cand in (corners, corners[::-1].copy()):
        T = _pose(obj, cand, K, dist)
        probe = np.array([[-0.5 * board.square, -0.5 * board.square, 0.0]])
        uv, _ = cv2.projectPoints(probe, cv2.Rodrigues(T[:3, :3])[0], T[:3, 3], K, dist)
        u, v = np.round(uv.ravel()).astype(int)
        if 0 <= v < gray.shape[0] and 0 <= u < gray.shape[1]:
            val = float(gray[max(0, v - 1) : v + 2, max(0, u - 1) : u + 2].mean())
            if best is None or val < best[0]:
                best = (val, T)
    if best is None:
        raise CalibrationFitError("the board's origin square is outside the image")
    return best[1]


# ---------------------------------------------------------------- intrinsics
def calibrate_intrinsics(images: list[np.ndarray], board: Board, min_views: int = 5) -> dict:
    """``K``, ``dist``, ``image_size`` and the RMS reprojection error from board images.

    Returns:
        ``{"image_size", "K", "dist", "rms_px", "per_view_rms_px", "used", "skipped"}``.

    Raises:
        CalibrationFitError: fewer than ``min_views`` images with the whole board, or
            images of different sizes.
    """
    sizes = {im.shape[1::-1] for im in images}
    if len(sizes) != 1:
        raise CalibrationFitError(f"images have different sizes {sorted(sizes)}: use one camera mode")
    size = sizes.pop()
    obj_pts, img_pts, used, skipped = [], [], [], []
    all_obj = board.object_points()
    for i, im in enumerate(images):
        found = detect_board_ids(im, board)
        if found is None:
            skipped.append(i)
            continue
        c, ids = found
        obj_pts.append(all_obj[ids].astype(np.float32))
        img_pts.append(c.astype(np.float32).reshape(-1, 1, 2))
        used.append(i)
    if len(used) < min_views:
        raise CalibrationFitError(
            f"the {board.cols}x{board.rows} {board.kind} was found in {len(used)} of {len(images)} images; "
            f"need at least {min_views} (check board.cols/board.rows count inner corners)"
        )
    rms, K, dist, rvecs, tvecs = cv2.calibrateCamera(obj_pts, img_pts, size, None, None)
    # One robust pass: drop corners far off the first fit (mis-refined corners at the
    # image border or under glare) and fit again.
    removed = 0
    limit = max(OUTLIER_MIN_PX, OUTLIER_RMS_FACTOR * rms)
    for v, (o, p, r, t) in enumerate(zip(obj_pts, img_pts, rvecs, tvecs)):
        proj, _ = cv2.projectPoints(o, r, t, K, dist)
        keep = np.linalg.norm((proj - p).reshape(-1, 2), axis=1) <= limit
        if not keep.all() and keep.sum() >= 6:
            removed += int((~keep).sum())
            obj_pts[v], img_pts[v] = o[keep], p[keep]
    if removed:
        rms, K, dist, rvecs, tvecs = cv2.calibrateCamera(obj_pts, img_pts, size, None, None)
    per_view = []
    for o, p, r, t in zip(obj_pts, img_pts, rvecs, tvecs):
        proj, _ = cv2.projectPoints(o, r, t, K, dist)
        per_view.append(float(np.sqrt(np.mean(np.sum((proj - p) ** 2, axis=2)))))
    return {
        "image_size": [int(size[0]), int(size[1])],
        "K": K.tolist(),
        "dist": dist.ravel()[:5].tolist(),
        "rms_px": float(rms),
        "per_view_rms_px": per_view,
        "used": used,
        "skipped": skipped,
        "outlier_corners": removed,
    }


# ------------------------------------------------------------------ hand-eye
def calibrate_handeye(
    T_base_gripper: list[np.ndarray],
    T_camera_target: list[np.ndarray],
    method: str = "park",
) -> dict:
    """Eye-to-hand: a fixed camera sees a target held by the gripper -> ``T_base_camera``.

    Args:
        T_base_gripper: gripper poses in ``B`` reported by the robot, ``(4, 4)`` each.
        T_camera_target: the target's pose seen by the camera for the same moments.
        method: ``tsai``, ``park``, ``horaud``, ``andreff`` or ``daniilidis``.

    Returns:
        ``{"T_base_camera", "T_gripper_target", "spread_mm", "spread_deg", "n"}``: the
        spreads measure how consistently the target sits in the gripper across views.
    """
    if method not in HANDEYE_METHODS:
        raise ValueError(f"unknown hand-eye method {method!r}; known: {sorted(HANDEYE_METHODS)}")
    n = len(T_base_gripper)
    if n != len(T_camera_target) or n < 3:
        raise CalibrationFitError(f"need at least 3 pose/detection pairs, got {n} and {len(T_camera_target)}")
    if hasattr(cv2, "calibrateHandEye"):
        # Eye-to-hand: pass base->gripper (the inverse poses); OpenCV then returns camera->base.
        T_gb = [invert_transform(T) for T in T_base_gripper]
        R_cam2base, t_cam2base = cv2.calibrateHandEye(
            [T[:3, :3] for T in T_gb], [T[:3, 3] for T in T_gb],
            [T[:3, :3] for T in T_camera_target], [T[:3, 3] for T in T_camera_target],
            method=HANDEYE_METHODS[method],
        )
        T_bc = np.eye(4)
        T_bc[:3, :3] = R_cam2base
        T_bc[:3, 3] = np.asarray(t_cam2base).ravel()
    else:  # some OpenCV 5 wheels ship without the hand-eye solvers
        log.info("cv2.calibrateHandEye is not available in this OpenCV; using the built-in Park-Martin solver")
        T_bc = _park_martin_eye_to_hand(T_base_gripper, T_camera_target)
    # Orthonormalise (the solvers return a nearly-rotation matrix).
    U, _, Vt = np.linalg.svd(T_bc[:3, :3])
    T_bc[:3, :3] = U @ Vt
    T_gt = [invert_transform(Tbg) @ T_bc @ Tct for Tbg, Tct in zip(T_base_gripper, T_camera_target)]
    ts = np.array([T[:3, 3] for T in T_gt])
    mean_t = ts.mean(axis=0)
    R0 = T_gt[0][:3, :3]
    spread_deg = max(math.degrees(rotation_angle(R0, T[:3, :3])) for T in T_gt)
    T_mean = np.eye(4)
    T_mean[:3, :3] = R0
    T_mean[:3, 3] = mean_t
    return {
        "T_base_camera": T_bc,
        "T_gripper_target": T_mean,
        "spread_mm": float(1000 * np.sqrt(np.mean(np.sum((ts - mean_t) ** 2, axis=1)))),
        "spread_deg": float(spread_deg),
        "n": n,
    }


def _log_rotation(R: np.ndarray) -> np.ndarray:
    return cv2.Rodrigues(np.asarray(R, dtype=np.float64))[0].ravel()


def _park_martin_eye_to_hand(T_base_gripper: list[np.ndarray], T_camera_target: list[np.ndarray]) -> np.ndarray:
    """Park & Martin (1994) on all view pairs for ``A X = X B`` with ``X = T_base_camera``,
    ``A = T_bg_j inv(T_bg_i)`` and ``B = T_ct_j inv(T_ct_i)`` (eye-to-hand)."""
    alphas, betas, As, Bs = [], [], [], []
    n = len(T_base_gripper)
    for i in range(n):
        for j in range(i + 1, n):
            A = T_base_gripper[j] @ invert_transform(T_base_gripper[i])
            B = T_camera_target[j] @ invert_transform(T_camera_target[i])
            a, b = _log_rotation(A[:3, :3]), _log_rotation(B[:3, :3])
            if np.linalg.norm(a) < 1e-3:  # (almost) pure translation: no rotation information
                continue
            alphas.append(a)
            betas.append(b)
            As.append(A)
            Bs.append(B)
    if len(alphas) < 2:
        raise CalibrationFitError("the gripper poses must differ in rotation about at least two axes")
    H = np.einsum("ni,nj->ij", np.asarray(betas), np.asarray(alphas))  # sum of b a^T
    U, _, Vt = np.linalg.svd(H)
    D = np.diag([1.0, 1.0, np.sign(np.linalg.det(Vt.T @ U.T))])
    R = Vt.T @ D @ U.T  # minimises sum |a - R b|^2
    C = np.concatenate([A[:3, :3] - np.eye(3) for A in As])
    d = np.concatenate([R @ B[:3, 3] - A[:3, 3] for A, B in zip(As, Bs)])
    t = np.linalg.lstsq(C, d, rcond=None)[0]
    T = np.eye(4)
    T[:3, :3] = R
    T[:3, 3] = t
    return T


def _pose_from_entry(entry: dict, key: str) -> np.ndarray:
    if key in entry:
        T = np.asarray(entry[key], dtype=np.float64)
        if T.shape != (4, 4):
            raise CalibrationFitError(f"{key} must be a 4x4 matrix")
        return T
    if "position" in entry and "quaternion" in entry:
        x, y, z, w = (float(v) for v in entry["quaternion"])  # xyzw, as PyBullet
        n = math.sqrt(x * x + y * y + z * z + w * w)
        x, y, z, w = x / n, y / n, z / n, w / n
        R = np.array([
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ])
        T = np.eye(4)
        T[:3, :3] = R
        T[:3, 3] = [float(v) for v in entry["position"]]
        return T
    raise CalibrationFitError(f"pose entry needs '{key}' (4x4) or 'position' + 'quaternion' (xyzw)")


# ------------------------------------------------------------ synthetic data
_UNDISTORT_CACHE: dict = {}


def _undistort_map(K: np.ndarray, dist: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    key = (K.tobytes(), np.asarray(dist, np.float64).tobytes(), tuple(size))
    if key not in _UNDISTORT_CACHE:
        w, h = size
        vv, uu = np.mgrid[0:h, 0:w].astype(np.float64)
        pts = np.stack([uu.ravel(), vv.ravel()], axis=1).reshape(-1, 1, 2)
        crit = (cv2.TERM_CRITERIA_COUNT | cv2.TERM_CRITERIA_EPS, 30, 1e-9)
        d = np.asarray(dist, np.float64)
        if hasattr(cv2, "undistortPointsIter"):  # OpenCV 4
            xy = cv2.undistortPointsIter(pts, K, d, None, K, crit)
        else:  # OpenCV 5 folded it into undistortPoints
            xy = cv2.undistortPoints(pts, K, d, R=None, P=K, criteria=crit)
        xy = xy.reshape(h, w, 2).astype(np.float32)
        _UNDISTORT_CACHE.clear()
        _UNDISTORT_CACHE[key] = (xy[..., 0], xy[..., 1])
    return _UNDISTORT_CACHE[key]


def render_board(
    board: Board,
    K: np.ndarray,
    dist: np.ndarray,
    size: tuple[int, int],
    T_camera_board: np.ndarray,
    background: int = 128,
    noise: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """A raw (distorted) RGB image of the board seen by a camera with a known ground truth.

    The board is drawn through the exact pinhole model at twice the resolution, then
    distorted with ``dist`` and averaged down, so corners carry sub-pixel information.
    """
    pps, margin = 40, 1  # texels per square, white border in squares
    nx, ny = board.cols + 1 + 2 * margin, board.rows + 1 + 2 * margin
    if board.kind == "charuco":
        inner = board.charuco().generateImage(((board.cols + 1) * pps, (board.rows + 1) * pps), marginSize=0,
                                              borderBits=1)
        inner = np.where(inner > 127, 235, 20).astype(np.uint8)
        tex = cv2.copyMakeBorder(inner, margin * pps, margin * pps, margin * pps, margin * pps,
                                 cv2.BORDER_CONSTANT, value=235)
    else:
        sq = np.indices((ny, nx)).sum(axis=0)
        tex = np.where(((sq - 2 * margin) % 2 == 0), 20, 235).astype(np.uint8)
        tex[:margin, :] = tex[-margin:, :] = 235
        tex[:, :margin] = tex[:, -margin:] = 235
        tex = cv2.resize(tex, (nx * pps, ny * pps), interpolation=cv2.INTER_NEAREST)
    s = board.square
    A = np.array([[s / pps, 0, (0.5 / pps - 1 - margin) * s], [0, s / pps, (0.5 / pps - 1 - margin) * s], [0, 0, 1]])
    Hb = T_camera_board[:3, [0, 1, 3]]
    S = np.array([[2.0, 0, 0.5], [0, 2.0, 0.5], [0, 0, 1]])
    M = S @ K @ Hb @ A
    w, h = size
    ideal = cv2.warpPerspective(tex, M, (2 * w, 2 * h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                                borderValue=background)
    mx, my = _undistort_map(np.asarray(K, np.float64), dist, size)
    mx2 = cv2.resize(mx, (2 * w, 2 * h), interpolation=cv2.INTER_LINEAR)
    my2 = cv2.resize(my, (2 * w, 2 * h), interpolation=cv2.INTER_LINEAR)
    # The map is sampled at pixel centres: resized maps give raw coordinates of half-pixels.
    mx2, my2 = (mx2 + 0.5) * 2 - 0.5, (my2 + 0.5) * 2 - 0.5
    raw2 = cv2.remap(ideal, mx2.astype(np.float32), my2.astype(np.float32), cv2.INTER_LINEAR,
                     borderMode=cv2.BORDER_CONSTANT, borderValue=background)
    img = cv2.resize(raw2, (w, h), interpolation=cv2.INTER_AREA).astype(np.float32)
    if noise > 0:
        img += np.random.default_rng(seed).normal(0, noise, img.shape)
    gray = np.clip(img, 0, 255).astype(np.uint8)
    return np.repeat(gray[:, :, None], 3, axis=2)


# ----------------------------------------------------------------------- CLI
def _image_files(folder: Path, what: str = "image folder") -> list[Path]:
    if not folder.is_dir():
        raise CalibrationFitError(f"{what} {folder} not found")
    files = list_frames(folder)
    if not files:
        raise CalibrationFitError(f"no *.png / *.jpg images in {folder}")
    return files


def _load_images(folder: Path) -> tuple[list[Path], list[np.ndarray]]:
    files = _image_files(folder)
    return files, [read_image(p) for p in files]


def _check_size(name: str, rgb: np.ndarray, calib: Calibration) -> None:
    if tuple(rgb.shape[1::-1]) != tuple(calib.image_size):
        raise CalibrationFitError(f"{name} is {rgb.shape[1]}x{rgb.shape[0]}, the calibration is "
                                  f"{calib.image_size[0]}x{calib.image_size[1]}")


def _board(cfg) -> Board:
    b = cfg.board
    return Board(cols=int(b.cols), rows=int(b.rows), square=float(b.square), kind=str(b.get("kind", "checkerboard")),
                 marker=float(b.get("marker", 0.018)), dictionary=str(b.get("dictionary", "DICT_4X4_50")))


def _run_intrinsics(cfg) -> dict:
    board = _board(cfg)
    files, images = _load_images(Path(cfg.images))
    res = calibrate_intrinsics(images, board, min_views=int(cfg.min_views))
    base_path = calibration_path(cfg.base)
    base = Calibration.load(base_path).to_dict()
    if tuple(base["image_size"]) != tuple(res["image_size"]):
        log.warning("base calibration %s is for %s frames, these images are %s: keep its pose and workspace "
                    "but run `sim2real-calibrate handeye` next", base_path, base["image_size"], res["image_size"])
    base.update(image_size=res["image_size"], K=res["K"], dist=res["dist"])
    report = dict(base.get("calibration_report") or {})
    report["intrinsics"] = {
        "rms_px": res["rms_px"], "per_view_rms_px": res["per_view_rms_px"], "outlier_corners": res["outlier_corners"],
        "images": [files[i].name for i in res["used"]], "skipped": [files[i].name for i in res["skipped"]],
        "board": {"cols": board.cols, "rows": board.rows, "square": board.square},
    }
    base["calibration_report"] = report
    calib = Calibration.from_dict(base, check_view=False)
    calib.save(cfg.out)
    print(f"intrinsics from {len(res['used'])} of {len(images)} images: RMS reprojection error "
          f"{res['rms_px']:.3f} px; fx={res['K'][0][0]:.1f} fy={res['K'][1][1]:.1f} "
          f"cx={res['K'][0][2]:.1f} cy={res['K'][1][2]:.1f}; wrote {cfg.out}")
    if res["skipped"]:
        print(f"board not found in: {', '.join(files[i].name for i in res['skipped'])}")
    return res


def _run_handeye(cfg) -> dict:
    if not cfg.calibration:
        raise CalibrationFitError("calibration=FILE (with this camera's K and dist) is required")
    calib = Calibration.from_dict(json.loads(Path(cfg.calibration).read_text()), check_view=False)
    poses_path = Path(cfg.poses)
    try:
        entries = json.loads(poses_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationFitError(f"cannot read poses file {poses_path}: {exc}") from exc
    if isinstance(entries, dict):
        entries = entries.get("poses", [])
    board = _board(cfg)
    img_dir = Path(cfg.images) if cfg.images else poses_path.parent
    T_bg, T_ct, used, skipped = [], [], [], []
    for i, e in enumerate(entries):
        name = e.get("image", f"#{i}")
        if "T_camera_target" in e:
            T_ct.append(_pose_from_entry(e, "T_camera_target"))
        else:
            rgb = read_image(img_dir / e["image"])
            _check_size(name, rgb, calib)
            found = detect_board_ids(rgb, board)
            if found is None:
                skipped.append(name)
                continue
            T_ct.append(board_pose(rgb, found[0], board, calib.K, calib.dist, ids=found[1]))
        T_bg.append(_pose_from_entry(e, "T_base_gripper"))
        used.append(name)
    res = calibrate_handeye(T_bg, T_ct, method=str(cfg.method))
    data = calib.to_dict()
    data["T_base_camera"] = res["T_base_camera"].tolist()
    report = dict(data.get("calibration_report") or {})
    report["handeye"] = {
        "method": str(cfg.method), "views": used, "skipped": skipped,
        "target_spread_mm": res["spread_mm"], "target_spread_deg": res["spread_deg"],
        "T_gripper_target": res["T_gripper_target"].tolist(),
    }
    data["calibration_report"] = report
    try:
        out = Calibration.from_dict(data)
    except CalibrationError as exc:
        raise CalibrationFitError(f"the fitted pose does not see the workspace: {exc}") from exc
    out.save(cfg.out)
    p = res["T_base_camera"][:3, 3]
    print(f"T_base_camera from {len(used)} views ({len(skipped)} skipped): camera at "
          f"[{p[0]:.3f}, {p[1]:.3f}, {p[2]:.3f}] m; target spread in the gripper {res['spread_mm']:.1f} mm, "
          f"{res['spread_deg']:.2f} deg; wrote {cfg.out}")
    return res


def _sees_less(calib: Calibration, refined: Calibration, thickness: float, placement: str) -> str | None:
    """What the refined pose sees less of than the calibration (a phrase), or None.

    A fit that slides along the walls' edges moves the workspace in the frame; one that takes
    more of the bin's inside (where the parts lie) out of view than the calibration did is
    more likely that slide than the camera's error. Not the whole workspace: where the walls
    stand inside it (``fit.wall_placement: outer``) its edges are the walls' outer faces, at
    the image's border in the validation cells, and a right correction there put a sliver of
    wall out of view.
    """
    inside_given, inside_refined = bin_inside(calib, thickness, placement), bin_inside(refined, thickness, placement)
    before, after = inside_given.workspace_visible_share(), inside_refined.workspace_visible_share()
    if after >= before:
        return None
    where = "the workspace" if inside_given is calib else "the bin's inside"
    return f"{100 * after:.1f}% of {where} where the calibration sees {100 * before:.1f}%"


def _run_refine(cfg) -> dict:
    """Refine ``T_base_camera`` on the bin's walls; write the refined pose when the fit's
    evidence is strong, the calibration as given otherwise (with the reason, in the
    output and in ``calibration_report.refine``), so that the next command always has a
    file to read. Bad input (no frames, frames of another size) is exit 2, nothing written.
    """
    cal_path, out = Path(cfg.calibration), Path(cfg.out)
    if out.resolve() == cal_path.resolve():
        raise CalibrationFitError(f"out={out} would overwrite the calibration it refines: write a new file")
    calib = Calibration.load(cal_path)
    try:
        settings, accept = RefineSettings.from_config(cfg.fit), AcceptSettings.from_config(cfg.accept)
    except RefineError as exc:
        raise CalibrationFitError(str(exc)) from exc
    files = _image_files(Path(cfg.real_dir), "real_dir")
    picks = frame_picks(len(files), settings.max_frames)
    frames = []
    for i in picks:
        rgb = read_image(files[i])
        _check_size(files[i].name, rgb, calib)
        frames.append(rgb)
    log.info("refining T_base_camera from the bin's walls in %d of %d frames", len(frames), len(files))
    res = refine_pose(frames, calib, settings, accept)
    data = calib.to_dict()
    moved = f"the fit ({res.shift_m * 1e3:.1f} mm, {res.rotation_deg:.2f} deg from the calibration)"
    if res.accepted:
        data["T_base_camera"] = res.refined_pose.tolist()
        shift, turn = res.correction()
        would_write = f"the pose it would write ({shift * 1e3:.1f} mm, {turn:.2f} deg from the calibration)"
        try:
            refined = Calibration.from_dict(data)
        except CalibrationError as exc:
            res.accepted, res.reason = False, f"{would_write} would not see the workspace: {exc}"
        else:
            less = _sees_less(calib, refined, res.wall_thickness, res.wall_placement)
            if less:
                res.accepted, res.reason = False, (
                    f"{would_write} would see {less}; if the fit is right, the camera or the workspace must move")
    data["T_base_camera"] = res.written_pose.tolist()
    report = dict(data.get("calibration_report") or {})
    report["refine"] = {**res.report(), "frames": [files[i].name for i in picks], "from": str(cal_path)}
    data["calibration_report"] = report
    written = Calibration.from_dict(data)
    picture = out.with_suffix(".png")
    img = draw_fit(undistorted_median(frames, calib), calib, calib.T_base_camera, res)
    ok, png = cv2.imencode(".png", img[:, :, ::-1])
    written.save(out)
    if ok:
        atomic_write_bytes(picture, png.tobytes())
    walls = (f"walls {res.wall_height * 1e3:.0f} mm high, {res.wall_thickness * 1e3:.0f} mm thick; edge contrast "
             f"{res.contrast_before:.2f} -> {res.contrast:.2f}")
    if res.accepted:
        shift, turn = res.correction()
        distance = "" if accept.write_distance else (
            f"; the camera's distance to the bin left as given, the fit's {res.sight_move_m * 1e3:+.1f} mm along "
            "the line of sight not written")
        print(f"refined T_base_camera from {len(frames)} frames: corrected by {shift * 1e3:.1f} mm and "
              f"{turn:.2f} deg (what the camera sees in the workspace moves "
              f"{workspace_shift_mm(calib, calib.T_base_camera, res.refined_pose):.1f} mm{distance}); {walls}; "
              f"wrote {out} and {picture} "
              "(red: the walls where the old calibration put them, green: refined)")
    else:
        log.warning("calibration kept as given: %s", res.reason)
        print(f"kept T_base_camera as given (correction zero): {res.reason}. {moved[0].upper() + moved[1:]} was not "
              f"written; {walls}; wrote {out} and {picture} (red: the walls where the calibration puts them, "
              "yellow: the fit not written)")
    return res.report()


def _is_missing(cfg, key: str) -> bool:
    from omegaconf import OmegaConf  # lazy: omegaconf (robot floor's --help path)

    return OmegaConf.is_missing(cfg, key)


SUBCOMMANDS = {
    "intrinsics": ("calibrate_intrinsics", _run_intrinsics),
    "handeye": ("calibrate_handeye", _run_handeye),
    "refine": ("calibrate_refine", _run_refine),
}


def main(argv: list[str] | None = None) -> int:
    """``sim2real-calibrate intrinsics|handeye|refine key=value ...``."""
    prog = "sim2real-calibrate"
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        raise CliError(prog, f"first argument must be one of {sorted(SUBCOMMANDS)}; see {prog} --help")
    name, run = SUBCOMMANDS[argv[0]]
    cfg = compose_config(name, argv[1:], f"{prog} {argv[0]}", __doc__ or "")
    from omegaconf.errors import MissingMandatoryValue  # lazy: omegaconf (robot floor's --help path)

    setup_logging("info")
    missing = [k for k in cfg if k not in ("board", "fit", "accept") and _is_missing(cfg, k)]
    if missing:
        raise CliError(prog, f"required: {', '.join(k + '=...' for k in missing)}; see {prog} {argv[0]} --help")
    if not cfg.out:
        raise CliError(prog, "out=FILE is required")
    try:
        run(cfg)
    except (CalibrationFitError, CalibrationError, ImageDecodeError, ValueError, MissingMandatoryValue) as exc:
        raise CliError(prog, str(exc)) from exc
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
