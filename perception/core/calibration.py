"""The contract's calibration file (``docs/robot_cell.md`` section 2).

:class:`Calibration` is loaded and validated here once; every error names the
field that is wrong so a user can fix the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from perception.core.frames import invert_transform
from perception.core.jsonio import read_json, write_json

__all__ = ["Calibration", "CalibrationError", "MIN_WORKSPACE_VISIBLE", "calibration_path", "default_calibration_path",
           "project_points",
           "load_calibration"]

log = logging.getLogger(__name__)

#: The least share of the workspace (at table height) a calibration's camera must see. A real
#: mount may leave a corner of the bin out of the frame; a camera that misses most of the
#: workspace is not looking at the cell (a wrong pose or workspace in the file).
MIN_WORKSPACE_VISIBLE = 0.5


class CalibrationError(ValueError):
    """A calibration file is missing, malformed or describes an impossible cell."""


def default_calibration_path() -> Path:
    """Path of the calibration shipped with the package (a plausible 640x480 cell)."""
    return Path(str(resources.files("perception.core") / "data" / "default_calibration.json"))


def calibration_path(path: str | Path | None = None) -> Path:
    """The calibration file a command's ``calibration=`` names, or the packaged default when it
    names none (``null`` or empty): the one place every command resolves it."""
    return default_calibration_path() if path is None or str(path) == "" else Path(path)


def load_calibration(path: str | Path | None = None) -> Calibration:
    """:func:`calibration_path`'s calibration, loaded and checked (:meth:`Calibration.load`)."""
    return Calibration.load(calibration_path(path))


def _matrix(data: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in data:
        raise CalibrationError(f"calibration field '{name}' is missing")
    try:
        arr = np.asarray(data[name], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise CalibrationError(f"calibration field '{name}' is not numeric: {exc}") from exc
    if arr.shape != shape:
        raise CalibrationError(
            f"calibration field '{name}' has shape {list(arr.shape)}, expected {list(shape)}"
        )
    if not np.all(np.isfinite(arr)):
        raise CalibrationError(f"calibration field '{name}' contains NaN or infinity")
    return arr


def _interval(ws: Any, axis: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in ws[axis])
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationError(
            f"calibration field 'workspace.{axis}' must be a pair [min, max] of numbers"
        ) from exc
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi:
        raise CalibrationError(f"calibration field 'workspace.{axis}' must satisfy min < max")
    return lo, hi


@dataclass(frozen=True, eq=False)
class Calibration:
    """Camera intrinsics, distortion, camera pose and the work cell.

    Attributes:
        image_size: ``(width, height)`` of the frames the camera delivers, pixels.
        K: ``(3, 3)`` OpenCV camera matrix for ``image_size``.
        dist: ``(5,)`` distortion ``k1, k2, p1, p2, k3``.
        T_base_camera: ``(4, 4)`` camera pose in the base frame (maps ``C`` to ``B``).
        table_z: height of the work surface in ``B``, metres.
        workspace_x, workspace_y: the allowed grasp region in ``B``, metres.
    """

    image_size: tuple[int, int]
    K: np.ndarray
    dist: np.ndarray
    T_base_camera: np.ndarray
    table_z: float
    workspace_x: tuple[float, float]
    workspace_y: tuple[float, float]
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Any, check_view: bool = True) -> Calibration:
        """Build and validate a calibration from the contract's JSON structure."""
        if not isinstance(data, dict):
            raise CalibrationError("calibration must be a JSON object")
        if "image_size" not in data:
            raise CalibrationError("calibration field 'image_size' is missing")
        try:
            w, h = (int(v) for v in data["image_size"])
        except (TypeError, ValueError) as exc:
            raise CalibrationError("calibration field 'image_size' must be [width, height]") from exc
        if w <= 0 or h <= 0:
            raise CalibrationError("calibration field 'image_size' must be positive")
        K = _matrix(data, "K", (3, 3))
        if K[0, 0] <= 0 or K[1, 1] <= 0 or K[2, 2] != 1 or K[1, 0] or K[2, 0] or K[2, 1]:
            raise CalibrationError("calibration field 'K' must be [[fx,0,cx],[0,fy,cy],[0,0,1]] with fx, fy > 0")
        dist = _matrix(data, "dist", (5,))
        T = _matrix(data, "T_base_camera", (4, 4))
        R = T[:3, :3]
        if not np.allclose(R @ R.T, np.eye(3), atol=1e-4) or np.linalg.det(R) < 0.999:
            raise CalibrationError("calibration field 'T_base_camera' does not hold a rotation matrix")
        if not np.allclose(T[3], [0, 0, 0, 1]):
            raise CalibrationError("calibration field 'T_base_camera' last row must be [0, 0, 0, 1]")
        if "table_z" not in data:
            raise CalibrationError("calibration field 'table_z' is missing")
        try:
            table_z = float(data["table_z"])
        except (TypeError, ValueError) as exc:
            raise CalibrationError("calibration field 'table_z' must be a number") from exc
        if not math.isfinite(table_z):
            raise CalibrationError(f"calibration field 'table_z' must be a finite number, got {table_z}")
        ws = data.get("workspace")
        if not isinstance(ws, dict):
            raise CalibrationError("calibration field 'workspace' is missing or not an object")
        known = {"image_size", "K", "dist", "T_base_camera", "table_z", "workspace"}
        calib = cls(
            image_size=(w, h),
            K=K,
            dist=dist,
            T_base_camera=T,
            table_z=table_z,
            workspace_x=_interval(ws, "x"),
            workspace_y=_interval(ws, "y"),
            extra={k: v for k, v in data.items() if k not in known},
        )
        if check_view:
            calib.check_workspace_visible()
        return calib

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Load a calibration JSON file; errors name the file and the field."""
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"calibration file not found: {path}")
        try:
            data = read_json(path)
        except OSError as exc:
            raise CalibrationError(f"calibration file {path} cannot be read: {exc}") from exc
        except ValueError as exc:
            raise CalibrationError(f"calibration file {exc}") from exc
        try:
            return cls.from_dict(data)
        except CalibrationError as exc:
            raise CalibrationError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict:
        out = {
            "image_size": [int(self.image_size[0]), int(self.image_size[1])],
            "K": self.K.tolist(),
            "dist": self.dist.tolist(),
            "T_base_camera": self.T_base_camera.tolist(),
            "table_z": float(self.table_z),
            "workspace": {"x": list(self.workspace_x), "y": list(self.workspace_y)},
        }
        out.update(self.extra)
        return out

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict(), indent=2)

    def digest(self) -> str:
        """Stable hash of the calibration's content (for cache keys and artifacts)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ---------------------------------------------------------------- geometry
    @property
    def width(self) -> int:
        return self.image_size[0]

    @property
    def height(self) -> int:
        return self.image_size[1]

    @property
    def T_camera_base(self) -> np.ndarray:
        return invert_transform(self.T_base_camera)

    @property
    def camera_position(self) -> np.ndarray:
        return self.T_base_camera[:3, 3].copy()

    @property
    def workspace_center(self) -> np.ndarray:
        return np.array(
            [sum(self.workspace_x) / 2, sum(self.workspace_y) / 2, self.table_z]
        )

    def narrowed(self, margin: float) -> Calibration:
        """This calibration with the workspace narrowed by ``margin`` metres on every side
        (negative: widened); every other field unchanged."""
        (x0, x1), (y0, y1) = self.workspace_x, self.workspace_y
        m = float(margin)
        return self.replace(workspace_x=(x0 + m, x1 - m), workspace_y=(y0 + m, y1 - m))

    def workspace_corners(self, z: float | None = None) -> np.ndarray:
        """``(4, 3)`` corners of the workspace rectangle at height ``z`` (default table)."""
        z = self.table_z if z is None else z
        (x0, x1), (y0, y1) = self.workspace_x, self.workspace_y
        return np.array([[x0, y0, z], [x1, y0, z], [x1, y1, z], [x0, y1, z]])

    def in_workspace(self, x: float, y: float, tol: float = 0.0) -> bool:
        return (
            self.workspace_x[0] - tol <= x <= self.workspace_x[1] + tol
            and self.workspace_y[0] - tol <= y <= self.workspace_y[1] + tol
        )

    def scaled(self, size: tuple[int, int]) -> Calibration:
        """The same camera delivering frames of ``size = (width, height)``.

        Intrinsics scale with the resolution (pixel centres at integer coordinates,
        so ``c' = (c + 0.5) * s - 0.5``); distortion and pose are unchanged.
        """
        w, h = int(size[0]), int(size[1])
        if (w, h) == tuple(self.image_size):
            return self
        sx, sy = w / self.width, h / self.height
        K = self.K.copy()
        K[0, 0] *= sx
        K[0, 2] = (K[0, 2] + 0.5) * sx - 0.5
        K[1, 1] *= sy
        K[1, 2] = (K[1, 2] + 0.5) * sy - 0.5
        return Calibration(
            image_size=(w, h),
            K=K,
            dist=self.dist.copy(),
            T_base_camera=self.T_base_camera.copy(),
            table_z=self.table_z,
            workspace_x=self.workspace_x,
            workspace_y=self.workspace_y,
            extra=dict(self.extra),
        )

    def replace(self, **changes: Any) -> Calibration:
        values = {
            "image_size": self.image_size,
            "K": self.K,
            "dist": self.dist,
            "T_base_camera": self.T_base_camera,
            "table_z": self.table_z,
            "workspace_x": self.workspace_x,
            "workspace_y": self.workspace_y,
            "extra": self.extra,
        }
        values.update(changes)
        return Calibration(**values)

    def workspace_visible_share(self, n: int = 21) -> float:
        """The share of the workspace at table height that the camera sees: of an ``n x n``
        grid of points on it, those in front of the camera that project inside the image."""
        (x0, x1), (y0, y1) = self.workspace_x, self.workspace_y
        gx, gy = np.meshgrid(np.linspace(x0, x1, n), np.linspace(y0, y1, n))
        pts = np.stack([gx.ravel(), gy.ravel(), np.full(gx.size, self.table_z)], axis=1)
        cam = (self.T_camera_base[:3, :3] @ pts.T).T + self.T_camera_base[:3, 3]
        front = cam[:, 2] > 0.05
        if not front.any():
            return 0.0
        return float(self.in_image(project_points(pts[front], self)).sum()) / len(pts)

    def in_image(self, uv: np.ndarray) -> np.ndarray:
        """``(N,)`` bool: which raw pixels ``uv (N, 2)`` lie inside the image (centres at integers)."""
        uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
        w, h = self.image_size
        return (uv[:, 0] >= 0) & (uv[:, 0] <= w - 1) & (uv[:, 1] >= 0) & (uv[:, 1] <= h - 1)

    def check_workspace_visible(self, min_share: float = MIN_WORKSPACE_VISIBLE) -> float:
        """The share of the workspace in view (:meth:`workspace_visible_share`); raise when it
        is below ``min_share`` or the workspace is behind the camera, warn when part of it is
        out of view (the project never answers a grasp there: the decode keeps to what the
        camera sees)."""
        corners = self.workspace_corners()
        cam = (self.T_camera_base[:3, :3] @ corners.T).T + self.T_camera_base[:3, 3]
        if np.any(cam[:, 2] <= 0.05):
            raise CalibrationError(
                "calibration field 'workspace' lies behind the camera given 'T_base_camera'"
            )
        share = self.workspace_visible_share()
        if share >= 1.0:
            return share
        uv = project_points(corners, self)
        w, h = self.image_size
        where = f"its corners project to {np.round(uv, 1).tolist()} in a {w}x{h} image"
        if share < min_share:
            raise CalibrationError(
                f"calibration field 'workspace' is outside the camera's view: the camera sees {100 * share:.0f}% "
                f"of it (at least {100 * min_share:.0f}% needed); {where}"
            )
        log.warning("calibration: %.1f%% of the workspace is outside the camera's view (%s); no grasp is "
                    "answered where the camera does not see", 100 * (1 - share), where)
        return share


def project_points(points_base: np.ndarray, calib: Calibration) -> np.ndarray:
    """Project base-frame points to raw (distorted) pixels, as ``cv2.projectPoints``.

    Args:
        points_base: ``(N, 3)`` points in ``B``.
        calib: the camera.

    Returns:
        ``(N, 2)`` float64 pixel coordinates ``(u, v)``.
    """
    pts = np.asarray(points_base, dtype=np.float64).reshape(-1, 3)
    T = calib.T_camera_base
    rvec, _ = cv2.Rodrigues(T[:3, :3])
    uv, _ = cv2.projectPoints(pts, rvec, T[:3, 3], calib.K, calib.dist)
    return uv.reshape(-1, 2)
