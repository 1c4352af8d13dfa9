"""The contract's grasp (section 3) and its image-plane encoding.

A base-frame grasp is ``position`` (fingertip midpoint, metres in ``B``), ``yaw``,
``width`` and ``quality``. The network works in view pixels with an image-plane
angle and a width in pixels; :func:`view_grasp_to_base` and
:func:`base_grasp_to_view` convert through the calibration, one way each.
The angle is encoded as ``(cos 2a, sin 2a)`` (GG-CNN), since a parallel-jaw grasp
is symmetric under a half turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from perception.core.calibration import Calibration
from perception.core.frames import GRIPPER_MAX_WIDTH, MIN_TIP_CLEARANCE
from perception.core.geometry import NetworkView, base_to_view_pixels, view_pixels_to_base

__all__ = [
    "Grasp",
    "normalize_angle",
    "encode_angle",
    "decode_angle",
    "angle_bin_centers",
    "angle_to_bin",
    "view_grasp_to_base",
    "base_grasp_to_view",
]


def normalize_angle(a: np.ndarray | float) -> np.ndarray | float:
    """Normalise an undirected line angle into ``(-pi/2, pi/2]``."""
    out = np.pi / 2 - np.mod(np.pi / 2 - np.asarray(a, dtype=np.float64), np.pi)
    return float(out) if np.ndim(out) == 0 else out


def encode_angle(a: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """``(cos 2a, sin 2a)``: continuous and equal for ``a`` and ``a + pi``."""
    a = np.asarray(a, dtype=np.float64)
    return np.cos(2 * a), np.sin(2 * a)


def decode_angle(cos2: np.ndarray | float, sin2: np.ndarray | float) -> np.ndarray | float:
    """Inverse of :func:`encode_angle`, normalised into ``(-pi/2, pi/2]``."""
    return normalize_angle(0.5 * np.arctan2(sin2, cos2))


def angle_bin_centers(n_bins: int) -> np.ndarray:
    """Centres of ``n_bins`` equal bins over ``(-pi/2, pi/2]``; bin 0 is centred on 0."""
    return normalize_angle(np.arange(n_bins) * np.pi / n_bins)


def angle_to_bin(a: np.ndarray | float, n_bins: int) -> np.ndarray:
    """Index of the nearest bin centre (see :func:`angle_bin_centers`)."""
    return np.mod(np.round(np.asarray(a) / (np.pi / n_bins)).astype(np.int64), n_bins)


@dataclass
class Grasp:
    """A top-down grasp in the base frame (contract section 3)."""

    position: tuple[float, float, float]
    yaw: float
    width: float
    quality: float = 1.0

    def __post_init__(self) -> None:
        self.position = tuple(float(v) for v in self.position)
        self.yaw = float(normalize_angle(self.yaw))
        self.width = float(min(max(self.width, 0.0), GRIPPER_MAX_WIDTH))
        self.quality = float(min(max(self.quality, 0.0), 1.0))

    def to_dict(self) -> dict:
        return {
            "position": list(self.position),
            "yaw": self.yaw,
            "width": self.width,
            "quality": self.quality,
        }

    def fingertips(self) -> np.ndarray:
        """``(2, 3)`` fingertip positions when the gripper is open to ``width``."""
        d = 0.5 * self.width * np.array([math.cos(self.yaw), math.sin(self.yaw), 0.0])
        p = np.asarray(self.position)
        return np.stack([p - d, p + d])


def view_grasp_to_base(
    uv: np.ndarray,
    angle: np.ndarray,
    width_px: np.ndarray,
    z: np.ndarray,
    calib: Calibration,
    view: NetworkView,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Convert image-plane grasps in view pixels to base-frame grasps.

    The centre and both projected fingertips are back-projected onto the plane at
    the fingertip height ``z``; the fingertip line gives yaw and width.

    Args:
        uv: ``(N, 2)`` view pixels of grasp centres.
        angle: ``(N,)`` image-plane angles, radians.
        width_px: ``(N,)`` opening in view pixels.
        z: ``(N,)`` fingertip heights in ``B`` (clamped to the table clearance).

    Returns:
        ``position (N, 3)``, ``yaw (N,)``, ``width (N,)`` metres (clipped to the gripper).
    """
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
    n = len(uv)
    angle = np.broadcast_to(np.asarray(angle, dtype=np.float64), (n,))
    half = 0.5 * np.broadcast_to(np.asarray(width_px, dtype=np.float64), (n,))
    z = np.maximum(np.broadcast_to(np.asarray(z, dtype=np.float64), (n,)), calib.table_z + MIN_TIP_CLEARANCE)
    d = np.stack([np.cos(angle), np.sin(angle)], axis=1) * half[:, None]
    center = view_pixels_to_base(uv, calib, view, z)
    a = view_pixels_to_base(uv - d, calib, view, z)
    b = view_pixels_to_base(uv + d, calib, view, z)
    line = b - a
    yaw = normalize_angle(np.arctan2(line[:, 1], line[:, 0]))
    width = np.clip(np.linalg.norm(line[:, :2], axis=1), 0.0, GRIPPER_MAX_WIDTH)
    return center, np.asarray(yaw), width


def base_grasp_to_view(
    position: np.ndarray,
    yaw: np.ndarray,
    width: np.ndarray,
    calib: Calibration,
    view: NetworkView,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Project base-frame grasps into view pixels: centre ``(N, 2)``, angle, width in px."""
    position = np.asarray(position, dtype=np.float64).reshape(-1, 3)
    n = len(position)
    yaw = np.broadcast_to(np.asarray(yaw, dtype=np.float64), (n,))
    half = 0.5 * np.broadcast_to(np.asarray(width, dtype=np.float64), (n,))
    d = np.stack([np.cos(yaw), np.sin(yaw), np.zeros(n)], axis=1) * half[:, None]
    uv = base_to_view_pixels(position, calib, view)
    pa = base_to_view_pixels(position - d, calib, view)
    pb = base_to_view_pixels(position + d, calib, view)
    line = pb - pa
    angle = normalize_angle(np.arctan2(line[:, 1], line[:, 0]))
    return uv, np.asarray(angle), np.linalg.norm(line, axis=1)
