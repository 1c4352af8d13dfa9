"""Dense geometric pseudo-labels: the labeller's grasp rule evaluated everywhere on the objects.

The physics-verified labels are sparse (about 30 grasps per scene) and mostly say *where*
grasps succeed, rarely *at which angles they fail*. The labeller's candidates come from a
geometric rule (:func:`sim_render.labels.heuristic_candidates`): close across a part whose
cross-section is narrower than the opening, with free space where the fingers land. This
module evaluates the same rule densely, for every top-down cell of the objects and every
yaw, on a height map rebuilt from the frame's depth image, and returns the verdicts as
pseudo-labels (weighted below the physics labels, which override them):

1. :func:`height_grid`: the depth image back-projected through the camera that took it,
   max-pooled into a top-down grid (cells nobody saw are *unknown*, not empty);
2. :func:`geometric_grasps`: for each object cell and yaw, a grasp centred on the cell at
   the labeller's fingertip height (the cell's top minus ``GRASP_DEPTH``) with the opening
   symmetric about the cell: *positive* when the part under the centre is narrower than
   the opening allows and both finger landing zones are free, *negative* when the part is
   too wide or a finger lands on something; cells the camera did not see (the shadow
   behind a part) count as free and make the verdict *uncertain* (weighted lower);
3. :func:`geometric_view_labels`: the grasps projected into the network view (through the
   real camera to raw pixels, then the nominal calibration, like the physics labels).
"""

from __future__ import annotations

import cv2
import numpy as np

from perception.core.calibration import Calibration
from perception.core.frames import GRIPPER_MAX_WIDTH, MIN_TIP_CLEARANCE, transform_points
from perception.core.geometry import (
    NetworkView,
    project_points,
    raw_pixels_to_rays,
    raw_to_view_pixels,
    top_down_max,
)
from perception.core.grasp import angle_to_bin, normalize_angle
from perception.core.rule import ABOVE_TIPS, GRASP_DEPTH, fitting_grasps
from sim_render.format import SEG_FIRST_OBJECT

__all__ = [
    "depth_points", "height_grid", "geometric_grasps", "geometric_view_labels", "splat_view_labels",
    "ray_grasp_heights",
]

#: Margin of the grid around the workspace, metres (the bin walls are in it).
GRID_MARGIN = 0.06


def depth_points(depth: np.ndarray, seg: np.ndarray, camera: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """The depth frame's pixels as base-frame points ``(N, 3)`` and their labels ``(N,)``.

    Args:
        depth: ``(h, w)`` metres along the camera's ``z`` (0 = nothing).
        seg: ``(h, w)`` segmentation labels.
        camera: the camera that took the frame, at ``(w, h)``.
    """
    h, w = depth.shape
    vv, uu = np.mgrid[0:h, 0:w]
    ok = (depth > 0) & np.isfinite(depth)
    rays = raw_pixels_to_rays(np.stack([uu[ok], vv[ok]], axis=1), camera)
    pts = transform_points(camera.T_base_camera, rays * depth[ok].astype(np.float64)[:, None])
    return pts, np.asarray(seg)[ok]


def height_grid(
    depth: np.ndarray, seg: np.ndarray, camera: Calibration, resolution: float = 0.004, fill_iterations: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Top-down height grid over the workspace (plus :data:`GRID_MARGIN`) from one depth frame.

    Args:
        depth: ``(h, w)`` metres along the camera's ``z`` (0 = nothing).
        seg: ``(h, w)`` segmentation labels (objects are ``>= SEG_FIRST_OBJECT``).
        camera: the camera that took the frame, at ``(w, h)``.
        resolution: cell size, metres.
        fill_iterations: see :func:`top_down_max`.

    Returns:
        ``xs (nx,)``, ``ys (ny,)`` cell centres; ``height (ny, nx)`` the highest point seen
        in each cell (``-inf`` where nothing was seen); ``known (ny, nx)``; ``is_object
        (ny, nx)`` whether that highest point is on an object.
    """
    (x0, x1), (y0, y1) = camera.workspace_x, camera.workspace_y
    xs = np.arange(x0 - GRID_MARGIN + resolution / 2, x1 + GRID_MARGIN, resolution)
    ys = np.arange(y0 - GRID_MARGIN + resolution / 2, y1 + GRID_MARGIN, resolution)
    pts, lab = depth_points(depth, seg, camera)
    ix = np.floor((pts[:, 0] - xs[0] + resolution / 2) / resolution).astype(np.int64)
    iy = np.floor((pts[:, 1] - ys[0] + resolution / 2) / resolution).astype(np.int64)
    inside = (ix >= 0) & (ix < len(xs)) & (iy >= 0) & (iy < len(ys))
    height, top_label = top_down_max(ix[inside], iy[inside], pts[inside, 2], lab[inside], (len(ys), len(xs)),
                                     fill_iterations)
    known = np.isfinite(height)
    return xs, ys, height, known, known & (top_label >= SEG_FIRST_OBJECT)


def geometric_grasps(
    xs: np.ndarray,
    ys: np.ndarray,
    height: np.ndarray,
    known: np.ndarray,
    is_object: np.ndarray,
    table_z: float,
    n_yaws: int = 12,
    max_cells: int | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
    """The labeller's rule (:func:`perception.core.rule.fitting_grasps`) for a grasp centred on
    every object cell at every yaw.

    Unseen cells (the camera's shadow behind a part) count as free; a verdict that rests
    on one is flagged uncertain.

    Returns:
        ``position (K, 3)`` grasp centres at the fingertip height, ``yaw (K,)``, ``width
        (K,)`` the symmetric opening (metres), ``success (K,)`` bool, ``certain (K,)`` bool,
        for the ``K`` (object cell, yaw) pairs whose cell stands above the fingertips.
    """
    res = float(xs[1] - xs[0])
    cells = np.argwhere(is_object)
    if max_cells is not None and len(cells) > max_cells:
        cells = cells[(rng or np.random.default_rng(0)).choice(len(cells), max_cells, replace=False)]
    if len(cells) == 0:
        return {"position": np.zeros((0, 3)), "yaw": np.zeros(0), "width": np.zeros(0), "success": np.zeros(0, bool),
                "certain": np.zeros(0, bool)}
    known = np.asarray(known, dtype=bool)
    surface = np.where(known, np.asarray(height, dtype=np.float64) - table_z, 0.0)  # unseen: free
    parts = np.zeros(surface.shape, dtype=bool)
    parts[cells[:, 0], cells[:, 1]] = True
    # The grid's axes are x (columns) and y (rows): an angle in its pixels is a yaw.
    fits, width, tip, unseen = fitting_grasps(surface, res, int(n_yaws), parts, known)
    keep = surface[cells[:, 0], cells[:, 1]] > tip[cells[:, 0], cells[:, 1]] + ABOVE_TIPS
    cy, cx = cells[keep, 0], cells[keep, 1]
    K = int(n_yaws)
    ci = np.repeat(np.arange(len(cy)), K)
    ki = np.tile(np.arange(K), len(cy))
    yaws = np.arange(K) * np.pi / K
    pos = np.stack([xs[cx[ci]], ys[cy[ci]], table_z + tip[cy[ci], cx[ci]].astype(np.float64)], axis=1)
    return {
        "position": pos,
        "yaw": normalize_angle(yaws[ki]),
        "width": np.minimum(width[ki, cy[ci], cx[ci]], GRIPPER_MAX_WIDTH).astype(np.float64),
        "success": fits[ki, cy[ci], cx[ci]],
        "certain": ~unseen[ki, cy[ci], cx[ci]],
    }


def geometric_view_labels(
    grasps: dict[str, np.ndarray], camera: Calibration, raw_calib: Calibration, view: NetworkView
) -> dict[str, np.ndarray]:
    """Grasps (base frame) as view-pixel labels, projected like the physics labels.

    Centre and a short segment along the yaw go through the camera that took the frame
    (raw pixels), then into the view with the nominal calibration ``raw_calib``.

    Returns:
        ``uv (K, 2)``, ``angle (K,)`` view-image angle, plus ``width``, ``z`` and ``success``.
    """
    pos = np.asarray(grasps["position"], dtype=np.float64).reshape(-1, 3)
    K = len(pos)
    if K == 0:
        return {"uv": np.zeros((0, 2)), "angle": np.zeros(0), "width": np.zeros(0), "z": np.zeros(0),
                "success": np.zeros(0, bool), "certain": np.zeros(0, bool)}
    d = 0.01 * np.stack([np.cos(grasps["yaw"]), np.sin(grasps["yaw"]), np.zeros(K)], axis=1)
    raw = project_points(np.concatenate([pos, pos - d, pos + d]), camera)
    uv = raw_to_view_pixels(raw, raw_calib, view)
    c, a, b = uv[:K], uv[K : 2 * K], uv[2 * K :]
    line = b - a
    return {
        "uv": c,
        "angle": np.asarray(normalize_angle(np.arctan2(line[:, 1], line[:, 0]))),
        "width": np.asarray(grasps["width"]),
        "z": pos[:, 2],
        "success": np.asarray(grasps["success"], dtype=bool),
        "certain": np.asarray(grasps.get("certain", np.ones(K, bool)), dtype=bool),
    }


def splat_view_labels(
    labels: dict[str, np.ndarray], view: NetworkView, angle_bins: int, uncertain_weight: float = 0.5
) -> dict[str, np.ndarray]:
    """Average labels falling on the same (bin, view pixel) into compact arrays.

    Uncertain labels count ``uncertain_weight`` in the average and in the weight.

    Returns:
        ``index (M,)`` flat ``(bin, v, u)`` index into ``(A, H, W)``, ``target (M,)`` weighted
        success rate, ``weight (M,)`` mean label weight in ``(0, 1]``; ``width``/``z`` ``(H, W)``
        float32 over positive labels and their ``mask (H, W)``.
    """
    W, H = view.size
    A = int(angle_bins)
    uvf = np.asarray(labels["uv"], dtype=np.float64).reshape(-1, 2)
    finite = np.isfinite(uvf).all(1)
    uv = np.rint(np.where(finite[:, None], uvf, -1)).astype(np.int64)
    ok = finite & (uv[:, 0] >= 0) & (uv[:, 0] < W) & (uv[:, 1] >= 0) & (uv[:, 1] < H)
    u, v = uv[ok, 0], uv[ok, 1]
    b = angle_to_bin(labels["angle"][ok], A)
    s = labels["success"][ok].astype(np.float64)
    w = np.where(labels["certain"][ok], 1.0, float(uncertain_weight))
    flat = (b * H + v) * W + u
    uniq, inv = np.unique(flat, return_inverse=True)
    wsum = np.bincount(inv, weights=w, minlength=len(uniq))
    pos = np.bincount(inv, weights=w * s, minlength=len(uniq))
    cnt = np.bincount(inv, minlength=len(uniq))
    width = np.zeros((H, W), np.float64)
    z = np.zeros((H, W), np.float64)
    wc = np.zeros((H, W), np.float64)
    okp = s > 0
    np.add.at(width, (v[okp], u[okp]), labels["width"][ok][okp])
    np.add.at(z, (v[okp], u[okp]), labels["z"][ok][okp])
    np.add.at(wc, (v[okp], u[okp]), 1.0)
    mask = wc > 0
    return {
        "index": uniq.astype(np.int32),
        "target": (pos / np.maximum(wsum, 1e-9)).astype(np.float32),
        "weight": (wsum / np.maximum(cnt, 1)).astype(np.float32),
        "width": np.where(mask, width / np.maximum(wc, 1), 0).astype(np.float32),
        "z": np.where(mask, z / np.maximum(wc, 1), 0).astype(np.float32),
        "mask": mask,
    }


def ray_grasp_heights(
    grid: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    camera: Calibration,
    raw_calib: Calibration,
    view: NetworkView,
    table_z: float,
    z_max: float = 0.15,
    z_step: float = 0.002,
) -> np.ndarray:
    """Fingertip height of the labeller's grasp whose centre projects onto each view pixel.

    The decode back-projects a pixel onto the plane at the predicted fingertip height, so
    the height a pixel must carry is the ``z`` at which its ray meets the labeller's rule
    ``z = max(table + clearance, top(x, y) - GRASP_DEPTH)``: the ray is followed down from
    ``z_max`` and the first such ``z`` is taken. On a bar seen obliquely this is the point
    inside the bar ``GRASP_DEPTH`` below its top, whose projection lies near the bar's edge
    facing the camera: the surface seen at the pixel would be the wrong answer there.

    Args:
        grid: :func:`height_grid` output (unseen cells count as the table).
        camera: the camera that took the frame (raw pixels at its size).
        raw_calib: the nominal calibration at the same size (how the view was made).
        view: the network view.
        table_z: the table height.

    Returns:
        ``(H, W)`` fingertip heights above ``table_z`` (NaN outside the raw frame).
    """

    xs, ys, height, known, _ = grid
    res = float(xs[1] - xs[0])
    top = np.where(known, height, table_z)
    W, H = view.size
    vv, uu = np.mgrid[0:H, 0:W]
    uv_view = np.stack([uu.ravel(), vv.ravel()], axis=1).astype(np.float64)
    # view pixel -> raw pixel (nominal, as preprocess samples) -> ray of the real camera
    rays_nominal = np.concatenate([uv_view, np.ones((len(uv_view), 1))], axis=1) @ np.linalg.inv(view.K).T
    raw, _ = cv2.projectPoints(rays_nominal, np.zeros(3), np.zeros(3), raw_calib.K, raw_calib.dist)
    raw = raw.reshape(-1, 2)
    w, h = raw_calib.image_size
    inside = (raw[:, 0] >= -0.5) & (raw[:, 0] <= w - 0.5) & (raw[:, 1] >= -0.5) & (raw[:, 1] <= h - 0.5)
    d = raw_pixels_to_rays(raw, camera) @ camera.T_base_camera[:3, :3].T
    o = camera.T_base_camera[:3, 3]
    zs = table_z + np.arange(z_max, MIN_TIP_CLEARANCE - 1e-9, -z_step)  # descending
    t = (zs[None, :] - o[2]) / d[:, 2:3]  # (P, Z)
    x = o[0] + t * d[:, 0:1]
    y = o[1] + t * d[:, 1:2]
    ix = np.rint((x - xs[0]) / res).astype(np.int64)
    iy = np.rint((y - ys[0]) / res).astype(np.int64)
    ok = (ix >= 0) & (ix < len(xs)) & (iy >= 0) & (iy < len(ys))
    tops = np.where(ok, top[np.clip(iy, 0, len(ys) - 1), np.clip(ix, 0, len(xs) - 1)], table_z)
    rule = np.maximum(table_z + MIN_TIP_CLEARANCE, tops - GRASP_DEPTH)
    hit = rule >= zs[None, :] - 1e-9
    first = np.where(hit.any(axis=1), hit.argmax(axis=1), len(zs) - 1)
    z = zs[first] - table_z
    z = np.where(inside, z, np.nan)
    return z.reshape(H, W).astype(np.float32)
