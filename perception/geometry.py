"""Pixel <-> base-frame geometry through the calibrated camera (numpy + OpenCV).

Two pixel spaces exist:

- **raw** pixels: the camera's own, distorted frames at ``calib.image_size`` (or a
  scaled copy of the calibration for smaller frames). ``pixel`` in the HTTP API is raw.
- **view** pixels: the undistorted, cropped and resized image the network sees,
  a virtual pinhole camera :class:`NetworkView` with the real camera's pose and the
  matrix ``K`` chosen so that the workspace fills it (see :func:`network_view`).
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from perception.calibration import Calibration
from perception.frames import transform_points

__all__ = [
    "NetworkView",
    "undistort_points",
    "network_view",
    "project_points",
    "raw_pixels_to_rays",
    "rays_to_plane",
    "raw_pixel_to_base",
    "view_pixels_to_base",
    "base_to_view_pixels",
    "raw_to_view_pixels",
    "view_to_raw_pixels",
]


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


#: Iterations of the point undistortion (the default 5 leaves ~0.1 px at the corners).
UNDISTORT_CRITERIA = (cv2.TERM_CRITERIA_COUNT | cv2.TERM_CRITERIA_EPS, 40, 1e-10)


def undistort_points(uv: np.ndarray, K: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """Normalised undistorted coordinates, iterated to convergence (OpenCV 4 and 5)."""
    if hasattr(cv2, "undistortPointsIter"):  # OpenCV 4.x
        return cv2.undistortPointsIter(uv, K, dist, None, None, UNDISTORT_CRITERIA)
    return cv2.undistortPoints(uv, K, dist, None, None, criteria=UNDISTORT_CRITERIA)


def raw_pixels_to_rays(uv: np.ndarray, calib: Calibration) -> np.ndarray:
    """Undistort raw pixels into unit-depth rays in the camera frame ``(N, 3)``."""
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 1, 2)
    xy = undistort_points(uv, calib.K, calib.dist).reshape(-1, 2)
    return np.concatenate([xy, np.ones((len(xy), 1))], axis=1)


def rays_to_plane(rays_cam: np.ndarray, calib: Calibration, z: np.ndarray | float) -> np.ndarray:
    """Intersect camera-frame rays with the horizontal plane ``z`` (in ``B``).

    Args:
        rays_cam: ``(N, 3)`` ray directions in ``C``.
        calib: gives the camera pose.
        z: plane height(s) in ``B``, scalar or ``(N,)``.

    Returns:
        ``(N, 3)`` base-frame points; NaN where a ray does not meet the plane ahead.
    """
    R = calib.T_base_camera[:3, :3]
    origin = calib.T_base_camera[:3, 3]
    d = np.asarray(rays_cam, dtype=np.float64).reshape(-1, 3) @ R.T
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), (len(d),))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (z - origin[2]) / d[:, 2]
    t = np.where(t > 0, t, np.nan)
    return origin + d * t[:, None]


def raw_pixel_to_base(uv: np.ndarray, calib: Calibration, z: np.ndarray | float) -> np.ndarray:
    """Back-project raw pixels onto the plane at height ``z`` in ``B`` ``(N, 3)``."""
    return rays_to_plane(raw_pixels_to_rays(uv, calib), calib, z)


@dataclass(frozen=True)
class NetworkView:
    """The virtual undistorted pinhole camera whose image the network sees.

    Attributes:
        K: ``(3, 3)`` camera matrix of the view.
        size: ``(width, height)`` in pixels.
    """

    K: np.ndarray
    size: tuple[int, int]

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]

    def to_dict(self) -> dict:
        return {"K": self.K.tolist(), "size": list(self.size)}

    @classmethod
    def from_dict(cls, d: dict) -> NetworkView:
        return cls(K=np.asarray(d["K"], dtype=np.float64), size=(int(d["size"][0]), int(d["size"][1])))


def network_view(
    calib: Calibration,
    size: tuple[int, int],
    margin: float = 0.03,
    max_height: float = 0.12,
) -> NetworkView:
    """The view that frames the workspace (plus ``margin`` metres) in ``size`` pixels.

    The box spans the workspace from the table up to ``max_height`` above it, so
    the tops of objects near the far edge stay in view. Pixels are square.
    """
    x0, x1 = calib.workspace_x
    y0, y1 = calib.workspace_y
    zs = (calib.table_z, calib.table_z + max_height)
    corners = np.array(
        [[x, y, z] for x in (x0 - margin, x1 + margin) for y in (y0 - margin, y1 + margin) for z in zs]
    )
    cam = transform_points(calib.T_camera_base, corners)
    xy = cam[:, :2] / cam[:, 2:3]
    lo, hi = xy.min(axis=0), xy.max(axis=0)
    w, h = int(size[0]), int(size[1])
    f = min(w / (hi[0] - lo[0]), h / (hi[1] - lo[1]))
    mid = (lo + hi) / 2
    K = np.array(
        [[f, 0.0, (w - 1) / 2 - f * mid[0]], [0.0, f, (h - 1) / 2 - f * mid[1]], [0.0, 0.0, 1.0]]
    )
    return NetworkView(K=K, size=(w, h))


def base_to_view_pixels(points_base: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Project base-frame points into view pixels ``(N, 2)`` (no distortion)."""
    cam = transform_points(calib.T_camera_base, points_base)
    uvw = cam @ view.K.T
    return uvw[:, :2] / uvw[:, 2:3]


def view_pixels_to_base(
    uv: np.ndarray, calib: Calibration, view: NetworkView, z: np.ndarray | float
) -> np.ndarray:
    """Back-project view pixels onto the plane(s) at height ``z`` in ``B`` ``(N, 3)``."""
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
    Kinv = np.linalg.inv(view.K)
    rays = np.concatenate([uv, np.ones((len(uv), 1))], axis=1) @ Kinv.T
    return rays_to_plane(rays, calib, z)


def raw_to_view_pixels(uv: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Map raw (distorted) pixels of ``calib``'s frames to view pixels ``(N, 2)``."""
    rays = raw_pixels_to_rays(uv, calib)
    uvw = rays @ view.K.T
    return uvw[:, :2] / uvw[:, 2:3]


def view_to_raw_pixels(uv: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Map view pixels to raw (distorted) pixels of ``calib``'s frames ``(N, 2)``."""
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
    rays = np.concatenate([uv, np.ones((len(uv), 1))], axis=1) @ np.linalg.inv(view.K).T
    out, _ = cv2.projectPoints(rays, np.zeros(3), np.zeros(3), calib.K, calib.dist)
    return out.reshape(-1, 2)
