"""Grasp candidates and their physics-verified labels.

Candidates come from a top-down height map of the scene:

- *heuristic*: a point on an object and the yaw along which the object's cross
  section is narrowest; the fingers straddle that one part (most objects are wider
  than the 0.08 m opening along every axis, so the whole object rarely fits);
- *random*: uniform positions and yaws in the workspace (negatives, and the odd
  lucky success), so the labels are not only what the heuristic believes;
- *perturbed*: a heuristic candidate turned by 30-90 degrees or moved by 1-2.5 cm (the
  fingertip height follows the new point): near misses, the labels that say how sharply
  success falls off around a good grasp, which heuristic candidates (mostly successes)
  and random ones (mostly far from anything) do not.

Each candidate is executed from the scene's saved physics state by the floating
hand; success is what the physics engine says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perception.core.frames import GRIPPER_MAX_WIDTH, MIN_TIP_CLEARANCE
from perception.core.grasp import Grasp
from perception.core.rule import (  # the grasp rule's numbers, stated once
    ABOVE_TIPS,
    GRASP_DEPTH,
    WIDTH_MARGIN,
)
from sim_render.cell import Cell
from sim_render.format import SOURCE_HEURISTIC, SOURCE_PERTURBED, SOURCE_RANDOM
from sim_render.gripper import FINGER_HALF, FloatingHand, GraspTiming

__all__ = [
    "Candidate", "heuristic_candidates", "random_candidates", "perturbed_candidates", "LabelledGrasp", "label_grasps",
]

#: Number of yaws tried per heuristic point.
N_YAWS = 12
#: Sampling step of the cross-section profile, metres.
PROFILE_STEP = 0.003


@dataclass
class Candidate:
    grasp: Grasp
    source: int  # SOURCE_HEURISTIC, SOURCE_RANDOM or SOURCE_PERTURBED (sim_render.format)


@dataclass
class LabelledGrasp:
    grasp: Grasp
    source: int
    success: bool
    lifted_object: int


def _sample_heights(hmap: tuple, pts: np.ndarray) -> np.ndarray:
    """Nearest-cell height at base-frame points ``(..., 2)`` (table height outside)."""
    xs, ys, height, _ = hmap
    res = xs[1] - xs[0]
    ix = np.round((pts[..., 0] - xs[0]) / res).astype(int)
    iy = np.round((pts[..., 1] - ys[0]) / res).astype(int)
    inside = (ix >= 0) & (ix < len(xs)) & (iy >= 0) & (iy < len(ys))
    out = np.full(pts.shape[:-1], height.min())
    out[inside] = height[iy[inside], ix[inside]]
    return out


def heuristic_candidates(cell: Cell, hmap: tuple, n: int, rng: np.random.Generator) -> list[Candidate]:
    """Candidates that close across the narrowest local part of an object."""
    xs, ys, height, body = hmap
    table_z = cell.calib.table_z
    cells = np.argwhere(body >= 0)
    if len(cells) == 0 or n <= 0:
        return []
    # Balance objects: pick an object first, then a point on it.
    owners = body[cells[:, 0], cells[:, 1]]
    objects = np.unique(owners)
    half_span = GRIPPER_MAX_WIDTH / 2 + 2 * FINGER_HALF[0] + 0.01
    offsets = np.arange(-half_span, half_span + 1e-9, PROFILE_STEP)
    mid = len(offsets) // 2
    yaws = np.arange(N_YAWS) * np.pi / N_YAWS
    out: list[Candidate] = []
    for _ in range(8 * n):
        if len(out) >= n:
            break
        obj = rng.choice(objects)
        pick = cells[owners == obj][rng.integers(np.sum(owners == obj))]
        center = np.array([xs[pick[1]], ys[pick[0]]]) + rng.uniform(-0.002, 0.002, 2)
        top = height[pick[0], pick[1]]
        tip_z = max(table_z + MIN_TIP_CLEARANCE, top - GRASP_DEPTH)
        dirs = np.stack([np.cos(yaws), np.sin(yaws)], axis=1)
        normals = np.stack([-dirs[:, 1], dirs[:, 0]], axis=1)
        # Three lanes across the finger depth: the fingers are FINGER_HALF[1] deep each side.
        lanes = np.array([-FINGER_HALF[1], 0.0, FINGER_HALF[1]])
        pts = (
            center[None, None, None, :]
            + offsets[None, None, :, None] * dirs[:, None, None, :]
            + lanes[None, :, None, None] * normals[:, None, None, :]
        )
        above = _sample_heights(hmap, pts) > tip_z + ABOVE_TIPS  # (yaw, lane, offset): above the tips
        prof = above[:, 1]
        blocked = above.any(axis=1)
        best = None
        for k in rng.permutation(N_YAWS):
            row = prof[k]
            if not row[mid]:
                continue
            lo = mid
            while lo > 0 and row[lo - 1]:
                lo -= 1
            hi = mid
            while hi < len(row) - 1 and row[hi + 1]:
                hi += 1
            extent = (hi - lo + 1) * PROFILE_STEP
            width = extent + 2 * WIDTH_MARGIN
            if width > GRIPPER_MAX_WIDTH:
                continue
            # The fingers must land on free space on both sides.
            c_off = (offsets[lo] + offsets[hi]) / 2
            reach = width / 2 + 2 * FINGER_HALF[0]
            outside = (np.abs(offsets - c_off) <= reach) & ((np.arange(len(row)) < lo) | (np.arange(len(row)) > hi))
            if np.any(blocked[k][outside]):
                continue
            if best is None or extent < best[0]:
                best = (extent, k, c_off, width)
        if best is None:
            continue
        _, k, c_off, width = best
        xy = center + c_off * dirs[k]
        out.append(Candidate(Grasp((xy[0], xy[1], tip_z), float(yaws[k]), float(width)), SOURCE_HEURISTIC))
    return out


def random_candidates(cell: Cell, hmap: tuple, n: int, rng: np.random.Generator) -> list[Candidate]:
    """Uniformly random grasps in the workspace at the local surface height."""
    cal = cell.calib
    out = []
    for _ in range(n):
        xy = np.array([rng.uniform(*cal.workspace_x), rng.uniform(*cal.workspace_y)])
        top = float(_sample_heights(hmap, xy[None])[0])
        tip_z = max(cal.table_z + MIN_TIP_CLEARANCE, top - GRASP_DEPTH)
        out.append(Candidate(Grasp((xy[0], xy[1], tip_z), rng.uniform(-np.pi / 2, np.pi / 2),
                                   GRIPPER_MAX_WIDTH), SOURCE_RANDOM))
    return out


def perturbed_candidates(
    cell: Cell, hmap: tuple, base: list[Candidate], n: int, rng: np.random.Generator,
    yaw_range: tuple[float, float] = (np.pi / 6, np.pi / 2), shift_range: tuple[float, float] = (0.01, 0.025),
) -> list[Candidate]:
    """Near misses around heuristic candidates: half turned by ``yaw_range`` radians (same
    point and height), half moved by ``shift_range`` metres in a random direction (same yaw,
    the labeller's height at the new point); the opening is kept."""
    heur = [c for c in base if c.source == SOURCE_HEURISTIC]
    if not heur or n <= 0:
        return []
    table_z = cell.calib.table_z
    out: list[Candidate] = []
    for i in range(n):
        g = heur[int(rng.integers(len(heur)))].grasp
        x, y, z = g.position
        if i % 2 == 0:
            yaw = g.yaw + rng.choice([-1.0, 1.0]) * rng.uniform(*yaw_range)
        else:
            yaw = g.yaw
            a = rng.uniform(-np.pi, np.pi)
            d = rng.uniform(*shift_range)
            x, y = x + d * np.cos(a), y + d * np.sin(a)
            top = float(_sample_heights(hmap, np.array([[x, y]]))[0])
            z = max(table_z + MIN_TIP_CLEARANCE, top - GRASP_DEPTH)
        out.append(Candidate(Grasp((x, y, z), float(yaw), g.width), SOURCE_PERTURBED))
    return out


def label_grasps(
    cell: Cell, hand: FloatingHand, candidates: list[Candidate], force: float, timing: GraspTiming
) -> list[LabelledGrasp]:
    """Execute each candidate from the current physics state; the state is restored after each."""
    c = cell.client
    state = c.saveState()
    out = []
    try:
        for cand in candidates:
            c.restoreState(stateId=state)
            res = hand.execute(cand.grasp, force, timing)
            out.append(LabelledGrasp(cand.grasp, cand.source, res.success, res.lifted_object))
        c.restoreState(stateId=state)
    finally:
        c.removeState(state)
    return out
