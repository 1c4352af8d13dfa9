"""Where a parallel-jaw grasp fits: the antipodal rule on a top-down height map.

A top-down grasp centred on a cell of a height map, closing along an angle, *fits* when

1. the cell is on a part (its surface stands more than ``object_height`` above the table,
   in a connected patch of at least ``min_object_px`` cells: specks are noise);
2. the fingertips go :data:`GRASP_DEPTH` below the cell's top (at least
   :data:`perception.core.frames.MIN_TIP_CLEARANCE` above the table), and the part's cross-section
   through the cell at that height, measured symmetrically about the cell, plus
   :data:`WIDTH_MARGIN` on each side, fits the gripper's opening;
3. both fingers (thickness x depth of :mod:`perception.core.frames`) land beside the part on
   nothing higher than :data:`ABOVE_TIPS` over the fingertips.

This is the rule the twin's labeller proposes its candidates with and the policy's dense
pseudo-labels use (both import it from here): one set of numbers, stated here. The grasp decode applies it
to the *predicted* surface (``perception.core.decode.DecodeOptions(..., rule=...)``): the
network then only has to see the shape of the bin's contents, a dense regression from
every pixel, while the physics-verified quality map ranks what fits.

Units: metres above the table; grid cells of ``px_m`` metres; angles in the grid's
pixel axes (from ``+u`` towards ``+v``), as the view's angle bins are.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import cv2
import numpy as np

from perception.core.frames import (
    GRIPPER_FINGER_HALF_DEPTH,
    GRIPPER_FINGER_HALF_THICKNESS,
    GRIPPER_MAX_WIDTH,
    MIN_TIP_CLEARANCE,
)

__all__ = [
    "GRASP_DEPTH", "WIDTH_MARGIN", "ABOVE_TIPS", "OBJECT_HEIGHT", "DEFAULT_RULE", "RuleMaps", "rule_options", "object_cells",
    "fitting_grasps", "support_score", "finger_landing", "finger_obstacle", "share_option", "jaw_span",
    "sweep_depth_option", "MAX_SWEEP_DEPTH", "off_centre",
    "CHECK_OPTIONS",
]

#: How deep the fingertips go below the top of the part they close around, metres.
GRASP_DEPTH = 0.025
#: Free space left on each side of the part when opening, metres.
WIDTH_MARGIN = 0.012
#: Height above the fingertips that counts as "in the way", metres.
ABOVE_TIPS = 0.003
#: A surface this far above the table is a part, metres (the bin floor and the table are below).
OBJECT_HEIGHT = 0.008

#: Decode options of the rule (``DecodeOptions(..., rule=...)``; an artifact's ``decode.rule``).
DEFAULT_RULE: dict[str, float] = {
    "object_height": OBJECT_HEIGHT,
    "min_object_px": 8,  # connected part cells; fewer is noise of the predicted surface
    "region_margin": 0.01,  # metres inside the workspace edge where parts are looked for (the bin walls stand at it)
    "support_px": 2,  # the score of a grasp is the share of fitting grasps in its (2r+1)^2 neighbourhood ...
    "bin_weight": 0.5,  # ... and, at this weight, in the neighbouring angle bins
    "quality_power": 1.0,  # score = support * quality ** power (0: the rule alone)
}


def rule_options(rule: Any) -> dict:
    """Validated grasp-rule options: the given keys of :data:`DEFAULT_RULE`, typed as there.

    The one check of the option mapping, for the decode, the artifact's ``decode.rule`` and
    the policy config.

    Raises:
        ValueError: not a mapping, unknown keys, or values that are not finite numbers >= 0.
    """
    if not isinstance(rule, Mapping):
        raise ValueError(f"grasp rule options must be a mapping or null, got {rule!r}")
    unknown = set(rule) - set(DEFAULT_RULE)
    if unknown:
        raise ValueError(f"unknown grasp rule options: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_RULE)}")
    try:
        out = {str(k): type(DEFAULT_RULE[k])(v) for k, v in rule.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"grasp rule options must be numbers: {exc}") from exc
    if not all(math.isfinite(v) and v >= 0 for v in out.values()):
        raise ValueError("grasp rule options must be finite numbers >= 0")
    return out


def share_option(value: Any) -> float:
    """A decode share option (``fingers_clear``: :func:`finger_landing`; ``jaws_on_part``:
    :func:`jaw_span`; ``part_centre``: :func:`off_centre`), checked: a number in ``[0, 1]``.

    The one check of those options, for the artifact's ``decode`` and the policy config.

    Raises:
        ValueError: not a number, or outside ``[0, 1]``.
    """
    try:
        share = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"must be a number: {exc}") from exc
    if not 0.0 <= share <= 1.0:  # NaN fails too
        raise ValueError(f"must be a share in [0, 1] (or null: off), got {value!r}")
    return share


#: The deepest ``sweep_depth`` the decode accepts, metres: the fingers are 0.05 m long.
MAX_SWEEP_DEPTH = 0.05


def sweep_depth_option(value: Any) -> float:
    """The decode's ``sweep_depth`` (metres the fingertips must reach below the part's top
    while coming down clear), checked: a number in ``[0, MAX_SWEEP_DEPTH]``.

    The one check of that option, for the artifact's ``decode`` and the policy config.

    Raises:
        ValueError: not a number, or outside the range.
    """
    try:
        depth = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"must be a number of metres: {exc}") from exc
    if not 0.0 <= depth <= MAX_SWEEP_DEPTH:  # NaN fails too
        raise ValueError(f"must be in [0, {MAX_SWEEP_DEPTH}] m (or null: off), got {value!r}")
    return depth


#: Every re-ranking check of the decode, name to its validator, in the order the errors name them:
#: the one list the artifact, the policy config and the service benchmark read. Three are numbers
#: in [0, 1] (two shares of a footprint, one weight on the quality's scale), one is metres.
CHECK_OPTIONS: dict[str, Any] = {"fingers_clear": share_option, "jaws_on_part": share_option,
                                 "sweep_depth": sweep_depth_option, "part_centre": share_option}


def object_cells(surface: np.ndarray, region: np.ndarray | None = None, object_height: float = OBJECT_HEIGHT,
                 min_object_px: int = 8) -> np.ndarray:
    """``(H, W)`` bool: cells on a part (see the module docstring, item 1).

    Args:
        surface: ``(H, W)`` surface height above the table, metres (NaN: unknown, not a part).
        region: ``(H, W)`` bool, where parts may be (``None``: everywhere).
    """
    s = np.nan_to_num(np.asarray(surface, dtype=np.float32), nan=0.0)
    mask = s > float(object_height)
    if region is not None:
        mask &= np.asarray(region, dtype=bool)
    if int(min_object_px) > 1 and mask.any():
        _, lab, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
        small = stats[:, cv2.CC_STAT_AREA] < int(min_object_px)
        small[0] = True  # the background
        mask &= ~small[lab]
    return mask


@functools.lru_cache(maxsize=8)
def _profile_offsets(angle_bins: int, px_m: float) -> tuple[np.ndarray, np.ndarray]:
    """Cell offsets ``du, dv (A, 3 lanes, O)`` of the cross-section samples: ``O`` steps of
    one cell along the closing line, three lanes across the finger depth."""
    half_span = GRIPPER_MAX_WIDTH / 2 + 2 * GRIPPER_FINGER_HALF_THICKNESS + 0.01
    n = int(np.ceil(half_span / px_m))
    steps = np.arange(-n, n + 1, dtype=np.float64)
    angles = np.arange(angle_bins) * np.pi / angle_bins  # the bin centres (angle_bin_centers, before wrapping)
    along = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    across = np.stack([-along[:, 1], along[:, 0]], axis=1)
    lanes = np.array([-GRIPPER_FINGER_HALF_DEPTH, 0.0, GRIPPER_FINGER_HALF_DEPTH]) / px_m
    pts = steps[None, None, :, None] * along[:, None, None, :] + lanes[None, :, None, None] * across[:, None, None, :]
    return np.rint(pts[..., 0]).astype(np.int64), np.rint(pts[..., 1]).astype(np.int64)


class RuleMaps(NamedTuple):
    """:func:`fitting_grasps` output: ``fits``, ``width`` and ``unseen`` ``(A, H, W)``, ``tip (H, W)``."""

    fits: np.ndarray
    width: np.ndarray
    tip: np.ndarray
    unseen: np.ndarray | None


def fitting_grasps(
    surface: np.ndarray,
    px_m: float,
    angle_bins: int,
    parts: np.ndarray,
    known: np.ndarray | None = None,
) -> RuleMaps:
    """The rule for a grasp centred on every part cell at every angle bin.

    Args:
        surface: ``(H, W)`` surface height above the table, metres (NaN counts as free).
        px_m: cell size, metres (the grid is metric and isotropic: a top-down view).
        angle_bins: ``A``; the angles are the bin centres of
            :func:`perception.core.grasp.angle_bin_centers`.
        parts: ``(H, W)`` bool, :func:`object_cells`.
        known: ``(H, W)`` bool, cells that were seen (unseen ones count as free); when
            given, ``unseen`` says which verdicts rest on one.

    Returns:
        :class:`RuleMaps`: ``fits (A, H, W)`` bool; ``width (A, H, W)`` float32, the
        symmetric opening in metres (where the part is wider than the gripper, the opening
        it would need); ``tip (H, W)`` float32, the fingertip height above the table;
        ``unseen (A, H, W)`` bool or ``None``.
    """
    s = np.nan_to_num(np.asarray(surface, dtype=np.float64), nan=0.0)
    H, W = s.shape
    A = int(angle_bins)
    tip = np.maximum(MIN_TIP_CLEARANCE, s - GRASP_DEPTH).astype(np.float32)
    fits = np.zeros((A, H, W), dtype=bool)
    width = np.zeros((A, H, W), dtype=np.float32)
    unseen_map = None if known is None else np.zeros((A, H, W), dtype=bool)
    cv, cu = np.nonzero(parts)
    if cv.size == 0:
        return RuleMaps(fits, width, tip, unseen_map)
    step = round(float(px_m), 9)  # a grid's spacing from coordinate differences carries rounding noise
    du, dv = _profile_offsets(A, step)
    # Samples outside the grid are free (the view covers the workspace and a margin).
    su = cu[:, None, None, None] + du[None]
    sv = cv[:, None, None, None] + dv[None]  # (cell, bin, lane, offset)
    inside = (su >= 0) & (su < W) & (sv >= 0) & (sv < H)
    h = np.where(inside, s[np.clip(sv, 0, H - 1), np.clip(su, 0, W - 1)], 0.0)
    above = h > (tip[cv, cu].astype(np.float64) + ABOVE_TIPS)[:, None, None, None]
    prof = above[:, :, 1]  # the middle lane, (cell, bin, offset)
    mid = prof.shape[-1] // 2
    left = prof[..., :mid][..., ::-1]
    right = prof[..., mid + 1 :]
    n_left = np.where(left.all(-1), left.shape[-1], left.argmin(-1))
    n_right = np.where(right.all(-1), right.shape[-1], right.argmin(-1))
    w = 2 * (np.maximum(n_left, n_right) * step + step / 2 + WIDTH_MARGIN)
    idx = np.arange(prof.shape[-1]) - mid
    reach = w / 2 + 2 * GRIPPER_FINGER_HALF_THICKNESS
    offsets = np.abs(idx) * step
    landing = (offsets[None, None, :] <= reach[..., None]) & (
        (idx[None, None, :] < -n_left[..., None]) | (idx[None, None, :] > n_right[..., None])
    )
    blocked = (above.any(axis=2) & landing).any(-1)
    ok = prof[..., mid] & (w <= GRIPPER_MAX_WIDTH + 1e-9) & ~blocked  # (cell, bin)
    fits[:, cv, cu] = ok.T
    width[:, cv, cu] = w.T.astype(np.float32)
    if unseen_map is not None:
        seen = np.where(inside, np.asarray(known, dtype=bool)[np.clip(sv, 0, H - 1), np.clip(su, 0, W - 1)], True)
        in_reach = offsets[None, None, :] <= reach[..., None]
        unseen_map[:, cv, cu] = ((~seen.all(axis=2)) & in_reach).any(-1).T
    return RuleMaps(fits, width, tip, unseen_map)


def support_score(fits: np.ndarray, support_px: int = 2, bin_weight: float = 0.5) -> np.ndarray:
    """``(A, H, W)`` float32 in ``[0, 1]``: how much of a grasp's neighbourhood also fits.

    The share of fitting grasps in the ``(2r+1)^2`` cells around it at its angle, plus
    ``bin_weight`` times the same at the two neighbouring angle bins (angles wrap), over
    ``1 + 2 bin_weight``. A grasp deep inside the region where the rule holds survives
    a centimetre of error in the predicted surface or in the robot's placement; one on its
    edge does not. Non-fitting grasps score 0.
    """
    f = np.asarray(fits, dtype=np.float32)
    k = 2 * int(support_px) + 1
    share = np.stack([cv2.blur(p, (k, k), borderType=cv2.BORDER_CONSTANT) for p in f]) if k > 1 else f.copy()
    bw = float(bin_weight)
    score = (share + bw * (np.roll(share, 1, axis=0) + np.roll(share, -1, axis=0))) / (1.0 + 2.0 * bw)
    return np.where(fits, score, 0.0).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _strip_kernels(angle_bins: int, px_m: float, half_along: float, half_across: float) -> tuple[np.ndarray, ...]:
    """Per angle bin, a rectangle ``2 half_along`` metres along the closing line by ``2 half_across``
    across it, as a normalised float32 kernel centred on its centre cell."""
    r = int(np.ceil(math.hypot(half_along, half_across) / px_m)) + 1
    dv, du = np.mgrid[-r : r + 1, -r : r + 1].astype(np.float64) * px_m
    kernels = []
    for a in np.arange(angle_bins) * np.pi / angle_bins:  # the bin centres, as in _profile_offsets
        along = du * math.cos(a) + dv * math.sin(a)
        across = -du * math.sin(a) + dv * math.cos(a)
        k = ((np.abs(along) <= half_along) & (np.abs(across) <= half_across)).astype(np.float32)
        kernels.append(k / max(float(k.sum()), 1.0))
    return tuple(kernels)


def _finger_kernels(angle_bins: int, px_m: float) -> tuple[np.ndarray, ...]:
    """Per angle bin, one finger's footprint (thickness along the closing line x depth across it)."""
    return _strip_kernels(angle_bins, px_m, GRIPPER_FINGER_HALF_THICKNESS, GRIPPER_FINGER_HALF_DEPTH)


def _span_kernels(angle_bins: int, px_m: float) -> tuple[np.ndarray, ...]:
    """Per angle bin, the jaws' depth through the centre: a one-cell strip across the closing
    line, as long as a finger is deep."""
    return _strip_kernels(angle_bins, px_m, px_m / 2, GRIPPER_FINGER_HALF_DEPTH)


def jaw_span(parts: np.ndarray, px_m: float, angle_bins: int) -> np.ndarray:
    """``(A, H, W)`` float32 in ``[0, 1]``: for a top-down grasp centred on every cell at
    every angle bin, the share of the line through its centre across the closing direction,
    as long as the fingers are deep (``2 x GRIPPER_FINGER_HALF_DEPTH``), that lies on
    ``parts`` (``(H, W)`` bool). A grasp whose share is low closes near a part's end or
    beside it (or on a shadow the mask took for part): the jaws' pads meet little of it.
    Cells outside the grid count as not part.
    """
    occ = np.asarray(parts, dtype=np.float32)
    out = np.stack([cv2.filter2D(occ, -1, k, borderType=cv2.BORDER_CONSTANT)
                    for k in _span_kernels(int(angle_bins), round(float(px_m), 9))])
    return np.clip(out, 0.0, 1.0, out=out)  # the filter's sums carry float rounding


def _at_fingers(maps: list[np.ndarray], px_m: float, opening: np.ndarray) -> np.ndarray:
    """``(A, H, W)``: per angle bin, ``maps[a]`` (``(H, W)``, a value per finger centre) read at
    both fingers of a grasp centred on every cell and opened to ``opening`` (``(H, W)`` metres;
    a finger's inner face at half the opening from the centre), the larger of the two.
    Cells outside the grid read 0 (free), as in :func:`fitting_grasps`."""
    H, W = maps[0].shape
    A = len(maps)
    half = np.clip(np.nan_to_num(np.asarray(opening, dtype=np.float64), nan=GRIPPER_MAX_WIDTH), 0.0, GRIPPER_MAX_WIDTH) / 2
    reach = (half + GRIPPER_FINGER_HALF_THICKNESS) / px_m  # cells from the centre to a finger's centre
    # Maps padded with free cells as far as a finger reaches, read by flat index.
    pad = int(np.ceil(float(reach.max()))) + 1
    Wp = W + 2 * pad
    centre = ((np.arange(H)[:, None] + pad) * Wp + np.arange(W)[None, :] + pad).ravel()
    out = np.empty((A, H * W), dtype=np.float32)
    r = reach.ravel()
    for a, ang in enumerate(np.arange(A) * np.pi / A):
        padded = np.pad(maps[a], pad).ravel()
        # The finger's centre, to the nearest cell.
        offset = np.rint(r * math.sin(ang)).astype(np.int64) * Wp + np.rint(r * math.cos(ang)).astype(np.int64)
        np.maximum(padded[centre + offset], padded[centre - offset], out=out[a])
    return out.reshape(A, H, W)


def finger_landing(obstacles: np.ndarray, px_m: float, angle_bins: int, opening: np.ndarray) -> np.ndarray:
    """``(A, H, W)`` float32 in ``[0, 1]``: for a top-down grasp centred on every cell at
    every angle bin, the share of the more covered finger's footprint that lands on
    ``obstacles`` (``(H, W)`` bool: parts, walls) when the gripper comes down opened to
    ``opening`` (``(H, W)`` metres; a finger's inner face at half the opening from the
    centre). Cells outside the grid count as free, as in :func:`fitting_grasps`.

    A finger that comes down on something stops the descent before the jaws reach the
    part (the contact stop of the validation cells' failed attempts): this is item 3 of
    the rule on a mask alone, for a decode that cannot trust the predicted heights.
    """
    occ = np.asarray(obstacles, dtype=np.float32)
    step = round(float(px_m), 9)
    # One share map per angle: the footprint's cover at every cell as a finger's centre.
    cover = [cv2.filter2D(occ, -1, k, borderType=cv2.BORDER_CONSTANT) for k in _finger_kernels(int(angle_bins), step)]
    out = _at_fingers(cover, step, opening)
    return np.clip(out, 0.0, 1.0, out=out)  # the filter's sums carry float rounding


def finger_obstacle(surface: np.ndarray, px_m: float, angle_bins: int, opening: np.ndarray) -> np.ndarray:
    """``(A, H, W)`` float32, metres above the table: for a top-down grasp centred on every
    cell at every angle bin, the highest point of ``surface`` (``(H, W)``; NaN: free) under
    either finger's footprint when the gripper comes down opened to ``opening`` (as in
    :func:`finger_landing`). Fingertips held :data:`ABOVE_TIPS` above it come down clear:
    item 3 of the rule with the fingertip height left free (:func:`perception.core.decode.decode_grasp`'s
    ``sweep_depth``).
    """
    s = np.maximum(np.nan_to_num(np.asarray(surface, dtype=np.float32), nan=0.0), 0.0)
    step = round(float(px_m), 9)
    highest = [cv2.dilate(s, (k > 0).astype(np.uint8), borderType=cv2.BORDER_CONSTANT, borderValue=0.0)
               for k in _finger_kernels(int(angle_bins), step)]
    return _at_fingers(highest, step, opening)


def off_centre(parts: np.ndarray) -> np.ndarray:
    """``(H, W)`` float32 in ``[0, 1]``: how far each cell lies from the centre of the part
    it is on, as a share of that part's reach (0 at the centroid of its connected cells,
    1 at its farthest cell; 1 off every part). A grasp near a part's centre of area lifts
    it with the least torque about the pads, the reason a part held at its end slips or
    swings out (:func:`perception.core.decode.decode_grasp`'s ``part_centre``).
    """
    mask = np.asarray(parts, dtype=bool)
    out = np.ones(mask.shape, dtype=np.float32)
    n, labels, _, centroids = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    if n <= 1:
        return out
    vs, us = np.nonzero(mask)
    lab = labels[vs, us]
    d = np.hypot(us - centroids[lab, 0], vs - centroids[lab, 1])
    reach = np.zeros(n)
    np.maximum.at(reach, lab, d)
    out[vs, us] = (d / np.maximum(reach[lab], 1.0)).astype(np.float32)  # a one-cell part: 0
    return out
