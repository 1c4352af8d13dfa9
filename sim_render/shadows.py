"""Cast shadows traced from every pixel's surface point towards the light.

Why: PyBullet's TinyRenderer takes little light out of a shadow (in the project's renders a
part's shadow on the bin floor is hardly visible, whatever ``lighting.ambient`` is drawn),
while under one lamp in a room a point the lamp cannot see keeps only the room's indirect
light, a tenth to about half of what a lit point gets. A policy that never saw a dark cast
shadow has no reason to tell one from a dark part. Here each rendered pixel's surface point
is rebuilt from the depth and the camera that rendered it, a ray is cast from it towards the
frame's light (``lighting.lightDirection``, a distant lamp), and where another body stands in
the way the pixel keeps ``light_left`` of its colour. The mask is traced on a coarser grid
(``resolution``) and blurred by ``penumbra`` px: a lamp is not a point, and the edge of its
shadow is soft.

A body does not shadow itself here: the renderer already shades the faces that look away
from the light with its ambient term alone, and compounds' self-shadows are left to it.

Randomization (``lighting.cast_shadow`` in ``conf/render/*.yaml``; a profile without it
renders as before): ``prob`` (per frame), ``light_left`` (fraction of the light a shadowed
point keeps), ``penumbra`` (px at the render size), ``resolution`` (fraction of the render
size the rays are cast at) and ``max_rise`` (metres above a point that a caster can stand:
the parts and the walls, never the parked gripper). A frame's stored ``cast_shadow``
parameters, with its ``lighting.lightDirection`` and the profile's ``resolution`` and
``max_rise``, replay it (:func:`cast_shadow_mask` then :func:`apply_cast_shadow`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import cv2
import numpy as np
import pybullet as p

from perception.core.calibration import Calibration
from perception.core.geometry import raw_pixels_to_rays
from sim_render.sensor import draw_range

__all__ = ["sample_cast_shadow", "cast_shadow_mask", "apply_cast_shadow", "validate_cast_shadow"]

#: Metres a shadow ray starts off its surface point along the light, so that it does not hit
#: the surface it leaves (the depth buffer's quantisation is about a millimetre at 1 m).
RAY_START_OFFSET = 0.004
#: Metres a body's box is widened by before a ray is tested against it (Bullet's boxes already
#: include its collision margin; this covers rounding).
BOX_PAD = 0.001


def sample_cast_shadow(rng: np.random.Generator, cfg: Mapping | None) -> dict | None:
    """Draw a frame's cast shadow, or ``None`` (no section, or not drawn this frame).

    A profile without ``lighting.cast_shadow``, or with ``prob: 0``, draws nothing from
    ``rng``, so its other draws stay as they were.
    """
    if cfg is None or float(cfg["prob"]) <= 0.0:  # off: the frame's other draws as before
        return None
    on = rng.random() < float(cfg["prob"])
    light_left = draw_range(rng, cfg["light_left"])
    penumbra = draw_range(rng, cfg["penumbra"])
    if not on:
        return None
    return {"light_left": float(light_left), "penumbra_px": float(penumbra)}


def cast_shadow_mask(
    client: Any,
    depth: np.ndarray,
    seg_raw: np.ndarray,
    camera: Calibration,
    light_direction: np.ndarray,
    resolution: float,
    max_rise: float,
) -> np.ndarray:
    """``(H, W)`` float32, 1 where another body stands between the pixel's surface point and the light.

    Args:
        client: the ``BulletClient`` holding the scene as it was rendered.
        depth: ``(H, W)`` metres along the camera's ``z`` (non-finite or <= 0: nothing seen).
        seg_raw: ``(H, W)`` body id of each pixel (``-1``: nothing).
        camera: the camera the frame was rendered with, at ``(W, H)``.
        light_direction: unit vector towards the light, base frame.
        resolution: fraction of ``(W, H)`` the rays are cast at (the mask is resized up).
        max_rise: metres above a surface point a ray is followed.
    """
    h, w = depth.shape
    step = max(1, int(round(1.0 / float(resolution))))
    vs, us = np.arange(step // 2, h, step), np.arange(step // 2, w, step)
    uu, vv = np.meshgrid(us, vs)
    d = depth[vv, uu].astype(np.float64).ravel()
    own = seg_raw[vv, uu].ravel()
    seen = np.isfinite(d) & (d > 0) & (own >= 0)
    L = np.asarray(light_direction, dtype=np.float64)
    L = L / np.linalg.norm(L)
    shadow = np.zeros(d.size, dtype=np.float32)
    if seen.any() and L[2] > 1e-3:
        rays = raw_pixels_to_rays(np.stack([uu.ravel()[seen], vv.ravel()[seen]], axis=1), camera)
        T = camera.T_base_camera
        pts = (rays * d[seen, None]) @ T[:3, :3].T + T[:3, 3]
        starts = pts + RAY_START_OFFSET * L
        ends = pts + (float(max_rise) / L[2]) * L
        hit = np.full(len(pts), -1, dtype=np.int64)
        # Only a ray that enters another body's box can be stopped by another body: the rest
        # are not cast (the mask is the same; on the project's scenes most rays are skipped).
        cast = np.flatnonzero(_may_hit_other(client, starts, ends, own[seen]))
        # PyBullet answers at most MAX_RAY_INTERSECTION_BATCH_SIZE - 1 rays a call (it drops the rest).
        batch = p.MAX_RAY_INTERSECTION_BATCH_SIZE - 1
        for s in range(0, len(cast), batch):
            idx = cast[s : s + batch]
            res = client.rayTestBatch(starts[idx].tolist(), ends[idx].tolist())
            if len(res) != len(idx):
                raise RuntimeError(f"rayTestBatch answered {len(res)} of {len(idx)} shadow rays")
            hit[idx] = [r[0] for r in res]
        shadow[np.flatnonzero(seen)] = ((hit >= 0) & (hit != own[seen])).astype(np.float32)
    coarse = shadow.reshape(len(vs), len(us))
    return cv2.resize(coarse, (w, h), interpolation=cv2.INTER_LINEAR)


def _body_boxes(client: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every link's axis-aligned box in the scene: ``(M,)`` body ids, ``(M, 3)`` lows, ``(M, 3)`` highs."""
    ids, lows, highs = [], [], []
    for i in range(client.getNumBodies()):
        body = client.getBodyUniqueId(i)
        for link in range(-1, client.getNumJoints(body)):
            lo, hi = client.getAABB(body, link)
            ids.append(body)
            lows.append(lo)
            highs.append(hi)
    return np.asarray(ids, dtype=np.int64), np.asarray(lows, dtype=np.float64), np.asarray(highs, dtype=np.float64)


def _may_hit_other(client: Any, starts: np.ndarray, ends: np.ndarray, own: np.ndarray) -> np.ndarray:
    """``(N,)`` bool: the segment ``starts -> ends`` crosses the box of a body other than ``own``.

    A conservative test (slabs against each link's box, widened by ``BOX_PAD``): a segment it
    rejects cannot hit another body, so casting only the accepted ones leaves the mask as it is.
    """
    ids, lows, highs = _body_boxes(client)
    # Boxes clear of every segment's own box (the parked gripper, the far table) cannot be met.
    seg_lo, seg_hi = np.minimum(starts, ends).min(axis=0), np.maximum(starts, ends).max(axis=0)
    near = np.all((lows - BOX_PAD <= seg_hi) & (highs + BOX_PAD >= seg_lo), axis=1)
    ids, lows, highs = ids[near], lows[near] - BOX_PAD, highs[near] + BOX_PAD
    if len(ids) == 0:
        return np.zeros(len(starts), dtype=bool)
    d = ends - starts
    d = np.where(np.abs(d) < 1e-9, 1e-9, d)  # a slab parallel to the ray: a huge t, as it should be
    t_in = np.zeros((len(starts), len(ids)))
    t_out = np.ones((len(starts), len(ids)))
    for axis in range(3):  # the segment's t in [0, 1] inside each box's slab, one axis at a time
        inv, start = 1.0 / d[:, axis, None], starts[:, axis, None]
        t1, t2 = (lows[None, :, axis] - start) * inv, (highs[None, :, axis] - start) * inv
        np.maximum(t_in, np.minimum(t1, t2), out=t_in)
        np.minimum(t_out, np.maximum(t1, t2), out=t_out)
    crosses = (t_in <= t_out) & (ids[None, :] != own[:, None])
    return crosses.any(axis=1)


def apply_cast_shadow(rgb: np.ndarray, mask: np.ndarray, drawn: Mapping) -> np.ndarray:
    """``rgb`` darkened to ``light_left`` where ``mask`` is 1, its edge blurred by ``penumbra_px``."""
    m = mask.astype(np.float32)
    sigma = float(drawn["penumbra_px"])
    if sigma > 0:
        m = cv2.GaussianBlur(m, (0, 0), sigma)
    gain = 1.0 - np.clip(m, 0.0, 1.0) * (1.0 - float(drawn["light_left"]))
    return np.clip(rgb.astype(np.float32) * gain[..., None] + 0.5, 0, 255).astype(np.uint8)


def validate_cast_shadow(cfg: Mapping) -> list[str]:
    """Problems of a ``lighting.cast_shadow`` section (empty: valid)."""
    problems = []
    for key in ("prob", "light_left", "penumbra", "resolution", "max_rise"):
        if key not in cfg:
            problems.append(f"lighting.cast_shadow.{key} is missing")
    if problems:
        return problems

    def number(key: str) -> float:
        try:
            return float(cfg[key])
        except (TypeError, ValueError):
            return math.nan  # fails every range check below, named there

    if not 0.0 <= number("prob") <= 1.0:
        problems.append("lighting.cast_shadow.prob must be a probability in [0, 1]")
    for key, lo, hi in (("light_left", 0.0, 1.0), ("penumbra", 0.0, None)):
        try:
            a, b = (float(v) for v in cfg[key])
        except (TypeError, ValueError):
            problems.append(f"lighting.cast_shadow.{key} must be a range [lo, hi]")
            continue
        if not (lo <= a <= b and (hi is None or b <= hi)):
            problems.append(f"lighting.cast_shadow.{key} must be a range [lo, hi] within "
                            f"[{lo}, {'inf' if hi is None else hi}], got {list(cfg[key])}")
    if not 0.0 < number("resolution") <= 1.0:
        problems.append("lighting.cast_shadow.resolution must be in (0, 1]")
    if not number("max_rise") > 0.0:
        problems.append("lighting.cast_shadow.max_rise must be > 0 m")
    return problems
