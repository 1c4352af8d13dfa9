"""Rendering the calibrated camera in PyBullet (the twin's visual sensor).

PyBullet renders an ideal pinhole image; the real camera delivers raw, distorted
frames. :func:`render_camera` therefore renders a pinhole image with the camera's
focal length over a field of view large enough to cover every raw pixel's ray, and
:func:`distort_image` resamples it into the raw frame with one ``cv2.remap``: for
each raw pixel, its coordinate is undistorted with the calibration's ``K``/``dist``
into a normalised ray and projected with the pinhole ``K``.

Conventions (see :mod:`perception.core.frames`): the camera frame is OpenCV's (``x``
right, ``y`` down, ``z`` forward); OpenGL's eye frame is ``x`` right, ``y`` up, ``z``
backward. Pixel centres are at integer coordinates.

Outputs are at ``camera.image_size``: ``rgb`` uint8 ``(H, W, 3)`` RGB, ``depth``
float32 ``(H, W)`` metres along the camera's ``z`` axis, ``seg_raw`` int32 ``(H, W)``
PyBullet body unique id (``-1`` background).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import pybullet as p

from perception.core.calibration import Calibration
from perception.core.geometry import undistort_points

__all__ = [
    "RENDERERS",
    "NEAR_M",
    "FAR_M",
    "PIXEL_CENTRE_OFFSET",
    "TINY_SAMPLE_OFFSET",
    "PinholePlan",
    "view_matrix",
    "projection_matrix",
    "zbuffer_to_depth",
    "undistort_pixels",
    "pinhole_plan",
    "distort_image",
    "render_camera",
    "setup_renderer",
    "raw_getcamera_fps",
]

#: Renderer names accepted by :func:`render_camera` (``renderer`` in ``conf/render``).
RENDERERS = ("tiny", "egl")
#: Near clip plane, metres: well in front of the closest surface of a 0.3-2 m cell.
NEAR_M = 0.05
#: Far clip plane, metres: beyond anything in the cell; background depth reads this.
FAR_M = 4.0
#: Where OpenGL samples pixel ``(u, v)``: its centre, ``(u + 0.5, v + 0.5)`` from the
#: top-left corner of the image.
PIXEL_CENTRE_OFFSET = (0.5, 0.5)
#: Where TinyRenderer samples pixel ``(u, v)``: it rasterises at integer viewport
#: coordinates counted from the bottom row, i.e. ``(u, v + 1)`` from the top-left
#: corner (measured: without this the image is shifted by half a pixel).
TINY_SAMPLE_OFFSET = (0.0, 1.0)

# OpenCV camera frame -> OpenGL eye frame: flip y (down -> up) and z (forward -> back).
_GL_FROM_CV = np.diag([1.0, -1.0, -1.0, 1.0])
# The distortion map is exact on a grid with this spacing (px) and bilinear in between:
# the map bends slowly (measured: < 0.05 px error for |k1| <= 0.4 from 128 to 640 px
# wide, 0.005 px for the default lens), and a per-frame jittered camera stays cheap
# (~W*H/16 undistorted points instead of W*H).
_MAP_GRID_STEP = 4
# Extra pinhole pixels around the rays the raw image needs (rounded outwards), so
# bilinear sampling at the extreme rays has both neighbours inside the render.
_MAP_PAD_PX = 1
_PLAN_CACHE_SIZE = 64
# Full-resolution maps are large (8 bytes per pixel each): keep only a few cameras.
_MAP_CACHE_SIZE = 8
# Ideal-pixel value standing in for rays the undistortion could not resolve; far
# outside any render, so those raw pixels take the border colour.
_NOT_CONVERGED_PX = 1.0e6


# ---------------------------------------------------------------------- matrices
def view_matrix(T_base_camera: np.ndarray) -> list[float]:
    """PyBullet view matrix (column-major, 16 floats) of an OpenCV camera pose.

    Args:
        T_base_camera: ``(4, 4)`` camera pose in the base frame (maps ``C`` to ``B``).

    Returns:
        The OpenGL world-to-eye transform, flattened column-major.
    """
    T = np.asarray(T_base_camera, dtype=np.float64)
    R, t = T[:3, :3], T[:3, 3]
    T_camera_base = np.eye(4)
    T_camera_base[:3, :3] = R.T
    T_camera_base[:3, 3] = -R.T @ t
    return (_GL_FROM_CV @ T_camera_base).flatten(order="F").tolist()


def projection_matrix(
    K: np.ndarray,
    size: tuple[int, int],
    near: float = NEAR_M,
    far: float = FAR_M,
    sample_offset: tuple[float, float] = PIXEL_CENTRE_OFFSET,
) -> list[float]:
    """PyBullet projection matrix (column-major) reproducing the pinhole ``K``.

    The frustum is off-centre where the principal point is, so that the pixel the
    renderer writes at column ``u``, row ``v`` shows the ray ``u = fx X / Z + cx``,
    ``v = fy Y / Z + cy`` of OpenCV's pinhole model.

    Args:
        K: ``(3, 3)`` pinhole camera matrix (no skew).
        size: ``(width, height)`` of the rendered image, pixels.
        near, far: clip planes, metres.
        sample_offset: where the renderer samples pixel ``(u, v)``, measured in
            pixels from the image's left and top edges as ``(u + ox, v + oy)``:
            ``(0.5, 0.5)`` for OpenGL (pixel centres), see :data:`TINY_SAMPLE_OFFSET`.

    Returns:
        16 floats, column-major.
    """
    w, h = size
    fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    ox, oy = sample_offset
    P = np.zeros((4, 4))
    P[0, 0] = 2.0 * fx / w
    P[0, 2] = 1.0 - 2.0 * (cx + ox) / w
    P[1, 1] = 2.0 * fy / h
    P[1, 2] = 2.0 * (cy + oy) / h - 1.0
    P[2, 2] = -(far + near) / (far - near)
    P[2, 3] = -2.0 * far * near / (far - near)
    P[3, 2] = -1.0
    return P.flatten(order="F").tolist()


def zbuffer_to_depth(zbuf: np.ndarray, near: float = NEAR_M, far: float = FAR_M) -> np.ndarray:
    """Metric depth along the camera's ``z`` from PyBullet's ``[0, 1]`` z-buffer.

    Args:
        zbuf: ``(H, W)`` z-buffer values.
        near, far: the clip planes the image was rendered with, metres.

    Returns:
        ``(H, W)`` float32 depth in metres (``far`` where nothing was drawn).
    """
    z = np.asarray(zbuf, dtype=np.float32)
    return (far * near / (far - (far - near) * z)).astype(np.float32, copy=False)


# ---------------------------------------------------------------- distortion maps
def undistort_pixels(uv: np.ndarray, K: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """Raw (distorted) pixels to normalised undistorted coordinates ``x/z, y/z`` ``(N, 2)``."""
    src = np.ascontiguousarray(np.asarray(uv, dtype=np.float64).reshape(-1, 1, 2))
    return undistort_points(src, np.asarray(K, dtype=np.float64), np.asarray(dist, dtype=np.float64)).reshape(-1, 2)


@dataclass(frozen=True, eq=False)
class PinholePlan:
    """The pinhole image rendered for one calibrated camera.

    Attributes:
        K: ``(3, 3)`` matrix of the pinhole image: the camera's focal lengths, its
            principal point shifted into the enlarged image.
        size: ``(width, height)`` of the pinhole image, pixels.
        clipped: True when ``margin`` was too small to cover every raw pixel's ray
            (those raw pixels repeat the pinhole image's border).
    """

    K: np.ndarray
    size: tuple[int, int]
    clipped: bool


def _camera_key(camera: Calibration) -> tuple[tuple[int, int], bytes, bytes]:
    """Hashable identity of what the distortion map depends on (size, K, dist)."""
    return (
        (int(camera.image_size[0]), int(camera.image_size[1])),
        np.ascontiguousarray(camera.K, dtype=np.float64).tobytes(),
        np.ascontiguousarray(camera.dist, dtype=np.float64).tobytes(),
    )


@functools.lru_cache(maxsize=_MAP_CACHE_SIZE)
def _ideal_map(size: tuple[int, int], K: bytes, dist: bytes) -> tuple[np.ndarray, bool]:
    """Each raw pixel's ray projected with the camera's own ``K`` and no distortion.

    Exact on a grid every ``_MAP_GRID_STEP`` px (plus one node beyond each border),
    bilinear in between via ``cv2.resize``, whose sample positions line up with it.
    Depends only on ``K`` and ``dist``: the pose does not enter.

    Returns:
        ``(H, W, 2)`` float32 ideal pixel coordinates (a far-away sentinel where the
        undistortion did not converge) and whether all of them converged.
    """
    w, h = size
    K_arr = np.frombuffer(K, dtype=np.float64).reshape(3, 3)
    s = _MAP_GRID_STEP
    nu, nv = math.ceil(w / s) + 2, math.ceil(h / s) + 2
    # Resizing by the integer factor s samples destination pixel x at source
    # coordinate (x + 0.5) / s - 0.5, so grid node k must sit at (k + 0.5) s - 0.5;
    # the extra node before and after the image keeps resize from clamping.
    gu = (np.arange(nu) + 0.5) * s - 0.5 - s
    gv = (np.arange(nv) + 0.5) * s - 0.5 - s
    uu, vv = np.meshgrid(gu, gv)
    xy = undistort_pixels(
        np.stack([uu.ravel(), vv.ravel()], axis=1), K_arr, np.frombuffer(dist, dtype=np.float64)
    )
    grid = np.empty((nv, nu, 2))
    grid[..., 0] = (xy[:, 0] * K_arr[0, 0] + K_arr[0, 2]).reshape(nv, nu)
    grid[..., 1] = (xy[:, 1] * K_arr[1, 1] + K_arr[1, 2]).reshape(nv, nu)
    finite = bool(np.isfinite(grid).all())
    if not finite:
        grid = np.where(np.isfinite(grid), grid, _NOT_CONVERGED_PX)
    full = cv2.resize(grid, (nu * s, nv * s), interpolation=cv2.INTER_LINEAR)[s : s + h, s : s + w]
    out = full.astype(np.float32)
    out.setflags(write=False)
    return out, finite


@functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)
def _cached_plan(size: tuple[int, int], K: bytes, dist: bytes, margin: float) -> PinholePlan:
    """:func:`pinhole_plan` for a camera given by :func:`_camera_key`."""
    w, h = size
    m, finite = _ideal_map(size, K, dist)
    # A lens maps the raw image's border to the border of what it sees, so the
    # extreme rays are on the border (and scanning W*H pixels would cost ms per frame).
    border = np.concatenate([m[0], m[-1], m[:, 0], m[:, -1]])
    border = border[np.abs(border).max(axis=1) < _NOT_CONVERGED_PX / 2]
    # Only the rays the raw image needs (plus a pad) are rendered, never more than
    # `margin` of the raw size beyond each side.
    lo_allowed = np.array([-margin * w, -margin * h])
    hi_allowed = np.array([(w - 1) + margin * w, (h - 1) + margin * h])
    if len(border):
        need_lo = border.min(axis=0) - _MAP_PAD_PX
        need_hi = border.max(axis=0) + _MAP_PAD_PX
    else:
        need_lo, need_hi = lo_allowed, hi_allowed
    lo = np.floor(np.maximum(need_lo, lo_allowed))
    hi = np.ceil(np.minimum(need_hi, hi_allowed))
    clipped = bool(np.any(need_lo < lo_allowed) or np.any(need_hi > hi_allowed) or not finite)
    K_pin = np.frombuffer(K, dtype=np.float64).reshape(3, 3).copy()
    K_pin[0, 2] -= lo[0]
    K_pin[1, 2] -= lo[1]
    K_pin.setflags(write=False)
    return PinholePlan(K=K_pin, size=(int(hi[0] - lo[0]) + 1, int(hi[1] - lo[1]) + 1), clipped=clipped)


def pinhole_plan(camera: Calibration, margin: float) -> PinholePlan:
    """The pinhole image to render for ``camera`` (cached per camera).

    Only the field of view the distortion needs is rendered (a lens whose raw
    frame sees less than its pinhole costs no extra pixels); ``margin`` caps it.

    Args:
        camera: the (scaled, possibly jittered) calibration.
        margin: largest extra field of view, fraction of the image width/height on
            each side.

    Returns:
        The :class:`PinholePlan`.
    """
    if margin < 0:
        raise ValueError(f"render margin must be >= 0, got {margin}")
    plan = _cached_plan(*_camera_key(camera), float(margin))
    if plan.clipped:
        warnings.warn(
            f"render_margin={margin} does not cover the lens distortion of this camera: "
            "raw pixels near the border repeat the edge of the render; raise render_margin",
            stacklevel=3,
        )
    return plan


@functools.lru_cache(maxsize=_MAP_CACHE_SIZE)
def _remap_maps(
    size: tuple[int, int], K: bytes, dist: bytes, pinhole_K: bytes
) -> tuple[np.ndarray, np.ndarray]:
    """``cv2.remap`` maps from the pinhole image with ``pinhole_K`` to the raw frame."""
    m, _ = _ideal_map(size, K, dist)
    K_arr = np.frombuffer(K, dtype=np.float64).reshape(3, 3)
    Kp = np.frombuffer(pinhole_K, dtype=np.float64).reshape(3, 3)
    maps = []
    for i in range(2):  # x with (fx, cx), y with (fy, cy)
        scale = Kp[i, i] / K_arr[i, i]
        offset = Kp[i, 2] - K_arr[i, 2] * scale
        axis = m[..., i] * np.float32(scale) + np.float32(offset)
        axis.setflags(write=False)
        maps.append(axis)
    return maps[0], maps[1]


def distort_image(
    img: np.ndarray,
    pinhole_K: np.ndarray,
    pinhole_size: tuple[int, int],
    camera: Calibration,
    interpolation: int,
) -> np.ndarray:
    """Resample a pinhole image into the raw (distorted) frame of ``camera``.

    For each raw pixel the map undistorts its coordinate with ``camera.K`` and
    ``camera.dist`` into a normalised ray and projects that with ``pinhole_K``; the
    maps are cached per camera.

    Args:
        img: ``(h, w[, C])`` pinhole image of size ``pinhole_size`` rendered from the
            camera's pose with ``pinhole_K``; uint8, float32 or int32.
        pinhole_K: ``(3, 3)`` matrix of ``img``.
        pinhole_size: ``(w, h)`` of ``img``.
        camera: the raw camera (``K``, ``dist``, ``image_size``).
        interpolation: ``cv2.INTER_LINEAR`` for colour, ``cv2.INTER_NEAREST`` for
            depth and segmentation.

    Returns:
        ``(H, W[, C])`` image at ``camera.image_size``, same dtype as ``img``. Raw
        pixels whose ray falls outside ``img`` repeat its border.
    """
    if tuple(img.shape[1::-1]) != tuple(int(v) for v in pinhole_size):
        raise ValueError(
            f"image is {img.shape[1]}x{img.shape[0]}, expected pinhole size {tuple(pinhole_size)}"
        )
    map_x, map_y = _remap_maps(
        *_camera_key(camera), np.ascontiguousarray(pinhole_K, dtype=np.float64).tobytes()
    )
    if img.dtype == np.int32:
        # OpenCV cannot remap int32; body ids are small integers, exact in float32.
        out = cv2.remap(img.astype(np.float32), map_x, map_y, interpolation, borderMode=cv2.BORDER_REPLICATE)
        return out.astype(np.int32)
    return cv2.remap(img, map_x, map_y, interpolation, borderMode=cv2.BORDER_REPLICATE)


# ---------------------------------------------------------------------- renderers
# Per physics client: the eglRenderer plugin id (or None once loading has failed).
_EGL_PLUGINS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def setup_renderer(client: Any, renderer: str) -> int:
    """Prepare ``renderer`` on a client and return its ``getCameraImage`` flag.

    ``"egl"`` loads PyBullet's eglRenderer plugin once per client. The plugin only
    sees bodies created after it was loaded, so call this right after connecting,
    before building the scene; called later (as :func:`render_camera` does), it
    warns and keeps TinyRenderer for that client rather than render an empty scene.
    When loading fails it also warns and falls back to TinyRenderer (``"tiny"``),
    which needs no GPU.

    Args:
        client: a ``BulletClient`` (or the ``pybullet`` module).
        renderer: ``"tiny"`` or ``"egl"``.

    Returns:
        ``p.ER_TINY_RENDERER`` or ``p.ER_BULLET_HARDWARE_OPENGL``.

    Raises:
        ValueError: for an unknown renderer name.
    """
    if renderer == "tiny":
        return p.ER_TINY_RENDERER
    if renderer != "egl":
        raise ValueError(f"unknown renderer '{renderer}'; known: {list(RENDERERS)}")
    if client not in _EGL_PLUGINS:
        plugin_id: int | None = None
        spec = importlib.util.find_spec("eglRenderer")
        if client.getNumBodies() > 0:
            reason = "the scene was built before setup_renderer(client, 'egl') loaded the plugin"
        elif spec is None or not spec.origin:
            reason = "the eglRenderer module of pybullet is not installed"
        else:
            plugin_id = client.loadPlugin(spec.origin, "_eglRendererPlugin")
            reason = "loadPlugin failed (no EGL-capable driver?)"
            if plugin_id < 0:
                plugin_id = None
        if plugin_id is None:
            warnings.warn(f"EGL rendering unavailable ({reason}); falling back to TinyRenderer", stacklevel=2)
        _EGL_PLUGINS[client] = plugin_id
    return p.ER_TINY_RENDERER if _EGL_PLUGINS[client] is None else p.ER_BULLET_HARDWARE_OPENGL


def _sample_offset(flag: int) -> tuple[float, float]:
    """Pixel sampling position of a ``getCameraImage`` renderer (see :func:`projection_matrix`)."""
    return TINY_SAMPLE_OFFSET if flag == p.ER_TINY_RENDERER else PIXEL_CENTRE_OFFSET


def render_camera(
    client: Any,
    camera: Calibration,
    margin: float,
    renderer: str = "tiny",
    lighting: dict | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Render the raw (distorted) frame of a calibrated camera.

    Args:
        client: a ``BulletClient`` (or the ``pybullet`` module) holding the scene.
        camera: the calibration at the render size (``calib.scaled((w, h))``),
            possibly jittered.
        margin: largest extra field of view rendered before distortion, fraction of
            the image size on each side (``render_margin`` in ``conf/render``).
        renderer: ``"tiny"`` (TinyRenderer, CPU) or ``"egl"`` (falls back to tiny).
        lighting: optional ``getCameraImage`` light keywords, as drawn by
            :func:`sim_render.randomization.sample_lighting`.

    Returns:
        ``rgb`` uint8 ``(H, W, 3)``, ``depth`` float32 ``(H, W)`` metres along the
        camera's ``z``, ``seg_raw`` int32 ``(H, W)`` body unique id (``-1`` background),
        with ``(W, H) = camera.image_size``.
    """
    plan = pinhole_plan(camera, margin)
    w, h = plan.size
    flag = setup_renderer(client, renderer)
    _, _, rgba, zbuf, seg = client.getCameraImage(
        w,
        h,
        viewMatrix=view_matrix(camera.T_base_camera),
        projectionMatrix=projection_matrix(plan.K, plan.size, sample_offset=_sample_offset(flag)),
        renderer=flag,
        **(lighting or {}),
    )
    # Without numpy support PyBullet returns flat sequences.
    rgba = np.asarray(rgba, dtype=np.uint8).reshape(h, w, 4)
    rgb = cv2.cvtColor(rgba, cv2.COLOR_RGBA2RGB)
    depth = zbuffer_to_depth(np.asarray(zbuf, dtype=np.float32).reshape(h, w))
    seg = np.asarray(seg, dtype=np.int32).reshape(h, w)
    rgb_raw = distort_image(rgb, plan.K, plan.size, camera, cv2.INTER_LINEAR)
    # Depth and ids share one nearest-neighbour remap (ids are exact in float32).
    ds = distort_image(
        np.dstack([depth, seg.astype(np.float32)]), plan.K, plan.size, camera, cv2.INTER_NEAREST
    )
    return rgb_raw, np.ascontiguousarray(ds[..., 0]), ds[..., 1].astype(np.int32)


def raw_getcamera_fps(
    client: Any, camera: Calibration, n: int = 20, renderer: str = "tiny", lighting: dict | None = None
) -> float:
    """Frames per second of a bare ``getCameraImage`` at ``camera.image_size``.

    The baseline for :func:`render_camera`'s overhead: same pose and intrinsics,
    no enlarged field of view, no distortion.

    Args:
        client: the ``BulletClient`` holding the scene.
        camera: the calibration at the render size.
        n: frames to time (after one warm-up frame).
        renderer, lighting: as for :func:`render_camera`.

    Returns:
        Frames per second.
    """
    w, h = camera.image_size
    flag = setup_renderer(client, renderer)
    kwargs = dict(
        viewMatrix=view_matrix(camera.T_base_camera),
        projectionMatrix=projection_matrix(camera.K, (w, h), sample_offset=_sample_offset(flag)),
        renderer=flag,
        **(lighting or {}),
    )
    client.getCameraImage(w, h, **kwargs)
    t0 = time.perf_counter()
    for _ in range(n):
        client.getCameraImage(w, h, **kwargs)
    return n / (time.perf_counter() - t0)
