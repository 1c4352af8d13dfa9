"""The one preprocessing function shared by training and serving.

:func:`preprocess` undistorts, crops and resizes (camera view) or warps top-down (table
view) a raw RGB frame into the :class:`~perception.core.geometry.NetworkView` in a single
``cv2.remap``. Training applies it to sim and real frames before any augmentation; the
service applies it to every request. :func:`to_network_input` then gives the float tensor layout.
"""

from __future__ import annotations

import functools

import cv2
import numpy as np

from perception.core.calibration import Calibration
from perception.core.geometry import NetworkView

__all__ = [
    "PreprocessError",
    "preprocess",
    "preprocess_labels",
    "view_maps",
    "to_network_input",
    "ensure_rgb8",
    "IMAGE_MEAN",
    "IMAGE_STD",
]

#: Per-channel normalisation of network inputs (RGB, values in [0, 1] before it).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


class PreprocessError(ValueError):
    """A frame that cannot be turned into a network input (wrong size, layout)."""


def ensure_rgb8(image: np.ndarray) -> np.ndarray:
    """Convert grayscale, RGBA and 16-bit images to ``uint8`` RGB ``(H, W, 3)``.

    Raises:
        PreprocessError: for layouts that are not images.
    """
    img = np.asarray(image)
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise PreprocessError(f"unsupported image dtype {img.dtype}; expected uint8 or uint16")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    elif img.ndim == 3 and img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    elif img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]
    elif not (img.ndim == 3 and img.shape[2] == 3):
        raise PreprocessError(f"unsupported image shape {img.shape}; expected (H, W[, 1|3|4])")
    return np.ascontiguousarray(img)


@functools.lru_cache(maxsize=16)
def _cached_maps(K: bytes, dist: bytes, Kv: bytes, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return cv2.initUndistortRectifyMap(
        np.frombuffer(K, dtype=np.float64).reshape(3, 3),
        np.frombuffer(dist, dtype=np.float64),
        None,
        np.frombuffer(Kv, dtype=np.float64).reshape(3, 3),
        size,
        cv2.CV_32FC1,
    )


@functools.lru_cache(maxsize=16)
def _cached_table_maps(
    K: bytes, dist: bytes, T_camera_base: bytes, Kv: bytes, size: tuple[int, int], plane_z: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """Raw pixels of a table view's plane points (``cv2.projectPoints``) and the median raw
    step between neighbouring view pixels (for the anti-alias blur)."""
    W, H = size
    vv, uu = np.mgrid[0:H, 0:W]
    A = np.frombuffer(Kv, dtype=np.float64).reshape(3, 3)
    uv = np.stack([uu.ravel(), vv.ravel()], axis=1).astype(np.float64)
    xy = (uv - A[:2, 2]) @ np.linalg.inv(A[:2, :2]).T
    pts = np.concatenate([xy, np.full((len(xy), 1), plane_z)], axis=1)
    T = np.frombuffer(T_camera_base, dtype=np.float64).reshape(4, 4)
    rvec, _ = cv2.Rodrigues(T[:3, :3])
    raw, _ = cv2.projectPoints(pts, rvec, T[:3, 3], np.frombuffer(K, dtype=np.float64).reshape(3, 3),
                               np.frombuffer(dist, dtype=np.float64))
    m = raw.reshape(H, W, 2).astype(np.float32)
    m1, m2 = np.ascontiguousarray(m[..., 0]), np.ascontiguousarray(m[..., 1])
    step = np.hypot(np.diff(m1, axis=1), np.diff(m2, axis=1))
    return m1, m2, float(np.median(step)) if step.size else 1.0


def _table_maps(raw_calib: Calibration, view: NetworkView) -> tuple[np.ndarray, np.ndarray, float]:
    # A table view depends on the camera's pose too: the key holds it.
    return _cached_table_maps(
        np.asarray(raw_calib.K, dtype=np.float64).tobytes(),
        np.asarray(raw_calib.dist, dtype=np.float64).tobytes(),
        np.asarray(raw_calib.T_camera_base, dtype=np.float64).tobytes(),
        np.asarray(view.K, dtype=np.float64).tobytes(),
        (int(view.size[0]), int(view.size[1])),
        float(view.plane_z),
    )


def view_maps(raw_calib: Calibration, view: NetworkView) -> tuple[np.ndarray, np.ndarray]:
    """Raw pixel coordinates sampled for every view pixel (cached per camera and view).

    Args:
        raw_calib: the calibration scaled to the raw frame's size.
        view: the network view.

    Returns:
        ``map_x``, ``map_y``: ``(view.height, view.width)`` float32, for ``cv2.remap``.
    """
    if view.is_table:
        return _table_maps(raw_calib, view)[:2]
    return _cached_maps(
        np.asarray(raw_calib.K, dtype=np.float64).tobytes(),
        np.asarray(raw_calib.dist, dtype=np.float64).tobytes(),
        np.asarray(view.K, dtype=np.float64).tobytes(),
        (int(view.size[0]), int(view.size[1])),
    )


def _raw_calibration(shape: tuple[int, ...], calib: Calibration) -> Calibration:
    h, w = shape[:2]
    W, H = calib.image_size
    if abs(w * H - h * W) > max(W, H):
        raise PreprocessError(
            f"frame is {w}x{h} but the calibration's image_size is {W}x{H} (aspect ratio differs)"
        )
    return calib.scaled((w, h))


def preprocess_labels(labels: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Map a raw per-pixel label image (segmentation, depth) into the view like :func:`preprocess`.

    The same remap with nearest-neighbour sampling, so labels stay labels; view pixels
    outside the raw frame become 0.

    Args:
        labels: ``(h, w)`` array at ``calib.image_size`` or any size of the same aspect ratio.

    Returns:
        ``(view.height, view.width)``, same dtype.
    """
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise PreprocessError(f"label image must be (H, W), got shape {labels.shape}")
    m1, m2 = view_maps(_raw_calibration(labels.shape, calib), view)
    src = labels if labels.dtype in (np.uint8, np.uint16, np.int16, np.float32) else labels.astype(np.float32)
    out = cv2.remap(src, m1, m2, cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    return out.astype(labels.dtype)


def preprocess(image: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Undistort, crop and resize a raw RGB frame into the network view.

    Frames may come at ``calib.image_size`` or at any size with the same aspect
    ratio (sim frames are rendered smaller); intrinsics are scaled to match.

    Args:
        image: raw frame ``(H, W, 3)`` uint8 RGB (other layouts via :func:`ensure_rgb8`).
        calib: the camera that took it (its calibration).
        view: the network's view.

    Returns:
        ``(view.height, view.width, 3)`` uint8 RGB.
    """
    img = ensure_rgb8(image)
    cal = _raw_calibration(img.shape, calib)
    if view.is_table:
        m1, m2, scale = _table_maps(cal, view)
    else:
        m1, m2 = view_maps(cal, view)
        scale = cal.K[0, 0] / view.K[0, 0]
    # Area-like quality when shrinking a lot: blur a little first so remap does not alias.
    if scale > 2.0:
        k = int(2 * round(scale / 2) + 1)
        img = cv2.GaussianBlur(img, (k, k), 0)
    return cv2.remap(img, m1, m2, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0)


def to_network_input(
    view_rgb: np.ndarray,
    mean: tuple[float, float, float] = IMAGE_MEAN,
    std: tuple[float, float, float] = IMAGE_STD,
) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB or a batch ``(N, H, W, 3)`` -> ``(N, 3, H, W)`` float32.

    ``mean``/``std`` are per channel on values in [0, 1] (an artifact stores its own).
    """
    x = np.asarray(view_rgb, dtype=np.float32)
    if x.ndim == 3:
        x = x[None]
    x = x.transpose(0, 3, 1, 2) / 255.0
    m = np.asarray(mean, dtype=np.float32)[None, :, None, None]
    s = np.asarray(std, dtype=np.float32)[None, :, None, None]
    return np.ascontiguousarray((x - m) / s, dtype=np.float32)
