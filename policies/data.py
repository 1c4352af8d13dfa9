"""Training frames for the grasp policy: rendered sim frames mapped into the network view,
with dense grasp-map targets built from the physics-verified labels.

Two kinds of view (:class:`perception.core.geometry.NetworkView`):

- ``table`` (the policy's default): every frame is warped top-down with the calibration of
  the camera that rendered it (a calibrated camera, as at deployment); a view pixel is a
  base-frame ``(x, y)``, so labels go in by their base position and yaw, and the dense
  targets come from the depth rebuilt top-down (:func:`table_view_surface`);
- ``camera``: every frame goes through :func:`perception.core.preprocess.preprocess` with the
  **nominal** calibration (the renderer's camera jitter then models calibration error).
  Labels live in raw pixels of the jittered camera, i.e. on the image content, so they
  are mapped into the view with the same nominal calibration
  (:func:`perception.core.geometry.raw_to_view_pixels`), fingertips included, which gives the
  view-image angle and opening of each grasp.

Targets of one frame (view ``H x W``, ``A`` angle bins, see :func:`build_targets`):

- ``quality_target``/``quality_weight`` ``(A, H, W)``: at every labelled grasp (a disk of
  ``label_radius`` view pixels around its centre, its angle bin) the success rate of the
  labels there, weight 1; elsewhere weight 0;
- ``dense_negative`` ``(H, W)``: table and bin pixels (seg labels ``dense_negative_labels``),
  negatives for every bin (weighted by the module's ``dense_negative_weight``);
- ``height_target``/``height_weight`` ``(H, W)``: fingertip height above the table, metres:
  dense from the depth image (surface height minus the labeller's
  :data:`perception.core.rule.GRASP_DEPTH`, at least the table clearance), and the labelled
  grasp's own ``z`` on the label disks (weight ``label_height_weight``);
- ``surface_target``/``surface_weight`` ``(H, W)``: the surface seen there, metres above the
  table (the decode's grasp rule runs on the predicted one), weighted like the heights;
- ``width_target``/``width_mask`` ``(H, W)``: the opening in metres of successful labels.

An optional ``translator`` (a callable ``(N, H, W, 3) uint8 -> (N, H, W, 3) uint8`` on view
images, e.g. :class:`adaptation.translate.Translator`) turns sim frames into adapted frames
on the fly; with ``cache=True`` each frame is translated once (a frozen generator gives the
same output every epoch).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from conf import policy_default, with_policy_defaults
from perception.core.calibration import Calibration
from perception.core.frames import MIN_TIP_CLEARANCE, transform_points
from perception.core.geometry import (
    NetworkView,
    base_to_view_pixels,
    make_view,
    raw_pixels_to_rays,
    raw_to_view_pixels,
    top_down_max,
)
from perception.core.grasp import angle_to_bin, base_grasp_to_view, normalize_angle
from perception.core.preprocess import preprocess, to_network_input, view_maps
from perception.core.rule import GRASP_DEPTH
from policies.geometric import (
    depth_points,
    geometric_grasps,
    geometric_view_labels,
    height_grid,
    ray_grasp_heights,
    splat_view_labels,
)
from sim_render.format import SEG_FIRST_OBJECT
from sim_render.reader import SimFrameDataset
from sim_render.shard_io import read_shard_meta

__all__ = [
    "sample_nearest",
    "augment_item",
    "PolicyFrames",
    "build_targets",
    "view_grids",
    "surface_height_view",
    "table_view_surface",
    "labels_to_view",
    "make_policy_datasets",
    "split_by_scene",
]

log = logging.getLogger(__name__)

#: What a dataset calls to adapt its frames: ``(N, H, W, 3) uint8`` sim -> adapted (e.g. an
#: :class:`adaptation.translate.Translator`, the picklable one the loaders use).
TranslateFn = Callable[[np.ndarray], np.ndarray]


# ----------------------------------------------------------------------------- geometry
def view_grids(raw_calib: Calibration, view: NetworkView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw pixel coordinates of every view pixel, as :func:`preprocess` samples them.

    Args:
        raw_calib: the calibration the frame is preprocessed with, scaled to its size.
        view: the network view.

    Returns:
        ``map_x``, ``map_y`` ``(H, W)`` float32 raw pixel coordinates and ``valid`` ``(H, W)``
        bool (inside the raw frame).
    """
    mx, my = view_maps(raw_calib, view)
    w, h = raw_calib.image_size
    valid = (mx >= -0.5) & (mx <= w - 0.5) & (my >= -0.5) & (my <= h - 0.5)
    return mx, my, valid


def sample_nearest(arr: np.ndarray, mx: np.ndarray, my: np.ndarray) -> np.ndarray:
    """``arr`` sampled at the maps ``mx``, ``my`` (from :func:`view_maps`) without blending
    (labels stay labels); 0 outside."""
    return cv2.remap(arr, mx, my, cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT, borderValue=0)


def surface_height_view(
    depth: np.ndarray, camera: Calibration, raw_calib: Calibration, view: NetworkView
) -> np.ndarray:
    """Height in ``B`` of the surface seen at every view pixel (NaN where unknown).

    The depth of the raw frame (metres along the *actual* camera's ``z``) is sampled at
    the raw pixel each view pixel comes from (nominal calibration, as the image), and
    back-projected through the actual (jittered) camera that rendered it.

    Shape:
        ``depth`` ``(h, w)`` raw; returns ``(H, W)`` view.
    """
    mx, my, valid = view_grids(raw_calib, view)
    d = sample_nearest(np.asarray(depth, dtype=np.float32), mx, my)
    ok = valid & (d > 0) & np.isfinite(d)
    out = np.full(d.shape, np.nan, dtype=np.float32)
    if not ok.any():
        return out
    # Snap to the sampled raw pixel, then undistort it with the camera that rendered it.
    uv = np.stack([np.rint(mx[ok]), np.rint(my[ok])], axis=1).astype(np.float64)
    rays = raw_pixels_to_rays(uv, camera)
    pts = transform_points(camera.T_base_camera, rays * d[ok].astype(np.float64)[:, None])
    out[ok] = pts[:, 2]
    return out


def table_view_surface(
    depth: np.ndarray, seg: np.ndarray, camera: Calibration, view: NetworkView, fill_iterations: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-down surface of a ``kind="table"`` view from one depth frame.

    Every raw pixel is back-projected through the camera that took it and binned into the
    view pixel under it; each view pixel keeps the highest point (an orthographic height
    map, the same rebuild as :func:`policies.geometric.height_grid` on the view's grid).
    Cells nobody saw (behind tall parts) stay unknown, except single-cell gaps between
    pixel footprints, which take their highest neighbour (``fill_iterations`` times).

    Returns:
        ``surface_z`` ``(H, W)`` float32 height in ``B`` (NaN unknown), ``top_label``
        ``(H, W)`` uint8 segmentation label of that highest point, ``known`` ``(H, W)`` bool.
    """

    W, H = view.size
    pts, lab = depth_points(np.asarray(depth), seg, camera)
    uv = np.rint(base_to_view_pixels(pts, camera, view)).astype(np.int64)
    inside = (uv[:, 0] >= 0) & (uv[:, 0] < W) & (uv[:, 1] >= 0) & (uv[:, 1] < H)
    height, top = top_down_max(uv[inside, 0], uv[inside, 1], pts[inside, 2], lab[inside], (H, W), fill_iterations)
    known = np.isfinite(height)
    return np.where(known, height, np.nan).astype(np.float32), top, known


def labels_to_view(
    grasps: dict[str, np.ndarray], raw_calib: Calibration, view: NetworkView
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Label centres, image-plane angles and openings in view pixels, from their raw pixels.

    The fingertips (raw pixel centre +- half the raw opening along the raw angle) are
    mapped too, so the angle and opening are those of the view image. A table view places
    each on the plane at the label's own fingertip height (``grasps["position"]``).

    Returns:
        ``uv (G, 2)``, ``angle (G,)`` radians in ``(-pi/2, pi/2]``, ``width_px (G,)``.
    """
    uv_raw = np.asarray(grasps["pixel"], dtype=np.float64).reshape(-1, 2)
    G = len(uv_raw)
    if G == 0:
        return np.zeros((0, 2)), np.zeros(0), np.zeros(0)
    a = np.asarray(grasps["image_angle"], dtype=np.float64)
    half = 0.5 * np.asarray(grasps["image_width"], dtype=np.float64)
    d = np.stack([np.cos(a), np.sin(a)], axis=1) * half[:, None]
    z = None
    if view.is_table:
        z = np.tile(np.asarray(grasps["position"], dtype=np.float64).reshape(-1, 3)[:, 2], 3)
    pts = raw_to_view_pixels(np.concatenate([uv_raw, uv_raw - d, uv_raw + d]), raw_calib, view, z)
    c, t0, t1 = pts[:G], pts[G : 2 * G], pts[2 * G :]
    line = t1 - t0
    angle = normalize_angle(np.arctan2(line[:, 1], line[:, 0]))
    return c, np.asarray(angle), np.linalg.norm(line, axis=1)


# ----------------------------------------------------------------------------- targets
def _disk_offsets(radius: float) -> np.ndarray:
    r = int(np.floor(radius))
    dv, du = np.mgrid[-r : r + 1, -r : r + 1]
    keep = du**2 + dv**2 <= radius**2 + 1e-9
    return np.stack([du[keep], dv[keep]], axis=1)


def build_targets(
    seg_view: np.ndarray,
    valid: np.ndarray,
    surface_z: np.ndarray,
    label_uv: np.ndarray,
    label_angle: np.ndarray,
    label_success: np.ndarray,
    label_width: np.ndarray,
    label_z: np.ndarray,
    table_z: float,
    angle_bins: int,
    targets: dict | None = None,
    geometric: dict | None = None,
    grasp_height: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Dense targets of one frame in the view.

    Args:
        seg_view: ``(H, W)`` uint8 segmentation in the view.
        valid: ``(H, W)`` bool, view pixels that come from inside the raw frame.
        surface_z: ``(H, W)`` surface height in ``B`` (NaN unknown).
        label_uv: ``(G, 2)`` label centres in view pixels.
        label_angle: ``(G,)`` view-image angles.
        label_success: ``(G,)`` bool.
        label_width: ``(G,)`` opening, metres.
        label_z: ``(G,)`` fingertip height in ``B``, metres.
        table_z: the table height.
        angle_bins: ``A``.
        targets: options (keys of ``targets`` in ``conf/policy/default.yaml``, its values for those not given).
        geometric: dense pseudo-labels (:func:`policies.geometric.splat_view_labels`), used
            with weight ``geometric_weight`` on entries without a physics label.
        grasp_height: ``(H, W)`` dense fingertip height above the table
            (:func:`policies.geometric.ray_grasp_heights`; NaN unknown); when given it is the
            dense height target instead of ``surface_z - GRASP_DEPTH``, and with
            ``stability_tol > 0`` successes on pixels where it jumps count as failures.

    Returns:
        ``quality_target``, ``quality_weight`` ``(A, H, W)`` float32; ``dense_negative``,
        ``width_mask``, ``object_mask`` ``(H, W)`` bool; ``width_target``, ``height_target``,
        ``height_weight``, ``surface_target`` (the surface above the table, metres),
        ``surface_weight`` ``(H, W)`` float32.
    """
    opt = with_policy_defaults("targets", targets)
    A = int(angle_bins)
    seg_view = np.asarray(seg_view)
    object_mask = (seg_view >= SEG_FIRST_OBJECT) & valid
    dense_negative = np.isin(seg_view, list(opt["dense_negative_labels"])) & valid
    out = _dense_heights(valid, surface_z, table_z, grasp_height, object_mask, opt)
    acc = _splat_labels(seg_view.shape, A, label_uv, label_angle, label_success, label_width, label_z, table_z,
                        grasp_height, opt)

    labelled = acc["q_cnt"] > 0
    quality_target = np.where(labelled, acc["q_sum"] / np.maximum(acc["q_cnt"], 1.0), 0.0).astype(np.float32)
    quality_weight = labelled.astype(np.float32)
    spread = (acc["spread_w"] > 0) & ~labelled
    if spread.any():
        # Neighbouring bins only ever get the softer evidence, never override a label.
        quality_target[spread] = acc["spread_pos"][spread] / acc["spread_w"][spread]
        quality_weight[spread] = float(opt["angle_spread_weight"])
    zl = acc["z_cnt"] > 0
    out["height_target"][zl] = np.maximum(acc["z_sum"][zl] / acc["z_cnt"][zl], MIN_TIP_CLEARANCE)
    out["height_weight"][zl] = float(opt["label_height_weight"])
    width_mask = acc["w_cnt"] > 0
    width_target = np.where(width_mask, acc["w_sum"] / np.maximum(acc["w_cnt"], 1.0), 0.0).astype(np.float32)
    gw = float(opt["geometric_weight"])
    if geometric is not None and gw > 0 and len(geometric["index"]):
        idx = np.asarray(geometric["index"], dtype=np.int64)
        free = quality_weight.reshape(-1)[idx] == 0
        idx = idx[free]
        quality_target.reshape(-1)[idx] = np.asarray(geometric["target"])[free]
        quality_weight.reshape(-1)[idx] = gw * np.asarray(geometric["weight"])[free]
        gm = np.asarray(geometric["mask"]) & ~width_mask
        width_target[gm] = np.asarray(geometric["width"])[gm]
        width_mask = width_mask | gm
    return {
        "quality_target": quality_target,
        "quality_weight": quality_weight,
        "dense_negative": dense_negative,
        "width_target": width_target,
        "width_mask": width_mask,
        "height_target": out["height_target"],
        "height_weight": out["height_weight"],
        "surface_target": out["surface_target"],
        "surface_weight": out["surface_weight"],
        "object_mask": object_mask,
    }


def _dense_heights(valid: np.ndarray, surface_z: np.ndarray, table_z: float, grasp_height: np.ndarray | None,
                   object_mask: np.ndarray, opt: dict) -> dict[str, np.ndarray]:
    """The dense fingertip height (``grasp_height``, else the surface less the grasp depth) and
    the surface above the table (what the decode's grasp rule runs on), with their weights."""
    if grasp_height is not None:
        known = np.isfinite(grasp_height) & valid
        height_target = np.where(known, np.maximum(np.nan_to_num(grasp_height), MIN_TIP_CLEARANCE), 0.0)
    else:
        known = np.isfinite(surface_z) & valid
        height_target = np.where(
            known, np.maximum(np.nan_to_num(surface_z) - table_z - GRASP_DEPTH, MIN_TIP_CLEARANCE), 0.0
        )
    height_weight = known.astype(np.float32)
    height_weight[object_mask & known] = float(opt["object_height_weight"])
    seen = np.isfinite(surface_z) & valid
    surface_target = np.where(seen, np.maximum(np.nan_to_num(surface_z) - table_z, 0.0), 0.0).astype(np.float32)
    surface_weight = seen.astype(np.float32)
    surface_weight[object_mask & seen] = float(opt["object_height_weight"])
    return {"height_target": height_target.astype(np.float32), "height_weight": height_weight,
            "surface_target": surface_target, "surface_weight": surface_weight}


def _splat_labels(shape: tuple[int, int], A: int, label_uv: np.ndarray, label_angle: np.ndarray,
                  label_success: np.ndarray, label_width: np.ndarray, label_z: np.ndarray, table_z: float,
                  grasp_height: np.ndarray | None, opt: dict) -> dict[str, np.ndarray]:
    """Sums and counts of the labels over each label's disk of view pixels: quality per angle
    bin (and the neighbouring bins' softer evidence), the fingertip height at the label's own
    pixel, the opening of the successes."""
    H, W = shape
    acc = {k: np.zeros((A, H, W), dtype=np.float32) for k in ("q_sum", "q_cnt", "spread_w", "spread_pos")}
    acc.update({k: np.zeros((H, W), dtype=np.float32) for k in ("w_sum", "w_cnt", "z_sum", "z_cnt")})
    uv = np.asarray(label_uv, dtype=np.float64).reshape(-1, 2)
    if not len(uv):
        return acc
    offs = _disk_offsets(float(opt["label_radius"]))
    centre = np.rint(uv).astype(np.int64)
    bins = angle_to_bin(np.asarray(label_angle, dtype=np.float64), A)
    succ = np.asarray(label_success, dtype=bool)
    # (G, K) pixels of each label's disk
    pu = centre[:, None, 0] + offs[None, :, 0]
    pv = centre[:, None, 1] + offs[None, :, 1]
    inside = (pu >= 0) & (pu < W) & (pv >= 0) & (pv < H) & np.isfinite(uv).all(axis=1)[:, None]
    g_idx = np.broadcast_to(np.arange(len(uv))[:, None], pu.shape)[inside]
    pu, pv = pu[inside], pv[inside]
    b = bins[g_idx]
    s = succ[g_idx].astype(np.float32)
    tol = float(opt["stability_tol"])
    if tol > 0 and grasp_height is not None:
        # A pixel whose neighbours' grasp heights differ by more than tol is fragile: one
        # pixel of error moves the back-projected grasp by centimetres (oblique camera).
        gh = np.where(np.isfinite(grasp_height), grasp_height, 0.0).astype(np.float32)
        k3 = np.ones((3, 3), np.uint8)
        spread = cv2.dilate(gh, k3) - cv2.erode(gh, k3)
        s = s * (spread[pv, pu] <= tol)
    np.add.at(acc["q_sum"], (b, pv, pu), s)
    np.add.at(acc["q_cnt"], (b, pv, pu), 1.0)
    k = int(opt["angle_spread"])
    for dk in range(-k, k + 1):
        if dk == 0:
            continue
        bb = np.mod(b + dk, A)
        np.add.at(acc["spread_pos"], (bb, pv, pu), s)
        np.add.at(acc["spread_w"], (bb, pv, pu), 1.0)
    # The labelled fingertip height holds at the label's own pixel (its neighbours' rays
    # meet the part at other heights: the dense target covers them).
    at_centre = (pu == centre[g_idx, 0]) & (pv == centre[g_idx, 1])
    np.add.at(acc["z_sum"], (pv[at_centre], pu[at_centre]),
              np.asarray(label_z, dtype=np.float32)[g_idx][at_centre] - table_z)
    np.add.at(acc["z_cnt"], (pv[at_centre], pu[at_centre]), 1.0)
    ok = s > 0
    np.add.at(acc["w_sum"], (pv[ok], pu[ok]), np.asarray(label_width, dtype=np.float32)[g_idx][ok])
    np.add.at(acc["w_cnt"], (pv[ok], pu[ok]), 1.0)
    return acc


# ----------------------------------------------------------------------------- augmentation
def _shift(a: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """Translate the last two axes by ``(dx, dy)`` pixels, filling with zeros."""
    out = np.zeros_like(a)
    H, W = a.shape[-2:]
    ys, yd = (slice(0, H - dy), slice(dy, H)) if dy >= 0 else (slice(-dy, H), slice(0, H + dy))
    xs, xd = (slice(0, W - dx), slice(dx, W)) if dx >= 0 else (slice(-dx, W), slice(0, W + dx))
    out[..., yd, xd] = a[..., ys, xs]
    return out


def augment_item(
    view_rgb: np.ndarray, targets: dict[str, np.ndarray], rng: np.random.Generator, augment: dict | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Random training augmentation of one frame and its targets (``augment`` in ``conf/policy/default.yaml``).

    - horizontal flip: the image and every map are mirrored and angle bin ``b`` becomes
      ``-b mod A`` (an image-plane angle ``a`` becomes ``-a``); a mirrored cell seen by a
      mirrored camera is a physically valid scene, heights and widths are unchanged;
    - shift: image and maps move together by up to ``shift_px`` pixels (zero weight where
      nothing is known), like a small error of the camera's pose;
    - colour: per-channel gain and offset.

    Shapes: ``view_rgb (H, W, 3)`` uint8; targets as :func:`build_targets` returns them.
    """
    opt = with_policy_defaults("augment", augment)
    img = view_rgb
    t = dict(targets)
    if rng.random() < float(opt["hflip"]):
        img = img[:, ::-1]
        for k, v in t.items():
            t[k] = v[..., ::-1]
        A = t["quality_target"].shape[0]
        perm = np.mod(-np.arange(A), A)
        t["quality_target"] = t["quality_target"][perm]
        t["quality_weight"] = t["quality_weight"][perm]
    s = int(opt["shift_px"])
    if s > 0:
        dx, dy = (int(v) for v in rng.integers(-s, s + 1, 2))
        if dx or dy:
            img = _shift(np.moveaxis(img, 2, 0), dx, dy)
            img = np.moveaxis(img, 0, 2)
            t = {k: _shift(v, dx, dy) for k, v in t.items()}
    c = float(opt["color"])
    if c > 0:
        gain = 1.0 + rng.uniform(-c, c, 3)
        offset = 255.0 * rng.uniform(-c, c, 3) / 2
        img = np.clip(img.astype(np.float32) * gain + offset, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(img), {k: np.ascontiguousarray(v) for k, v in t.items()}


# ----------------------------------------------------------------------------- dataset
def translated_frame(index: int, fraction: float) -> bool:
    """Whether frame ``index`` is one of the ``fraction`` that a translator adapts.

    A fixed, well-spread subset (a multiplicative hash of the index), the same in every
    epoch and every worker, so cached frames stay valid.
    """
    if fraction >= 1.0:
        return True
    return ((int(index) * 2654435761) % 2**32) / 2**32 < float(fraction)


class PolicyFrames(Dataset):
    """Sim frames in the network view with grasp-map targets (one item per frame).

    Args:
        root: a rendered dataset folder, or an opened
            :class:`sim_render.reader.SimFrameDataset`.
        view: the network view; ``None`` builds the config's (``view`` and ``view_size`` in
            ``conf/policy/default.yaml``) on the dataset's nominal calibration.
        view_size: ``(W, H)`` when ``view`` is None (``None``: the config's).
        angle_bins: ``A`` (``None``: the config's).
        translator: optional ``(N, H, W, 3) uint8 -> (N, H, W, 3) uint8`` applied to view
            images (sim -> adapted).
        targets: target options (the config's ``targets`` for those not given).
        indices: the subset of frames to use (``None``: all).
        cache: keep each frame's preprocessed, translated image and compact labels in
            memory after the first read (about 100 KB per frame at 128x128).
        augment: training augmentation (``augment`` keys, the config's values for those not given; ``None``: none).
        seed: seed of the augmentation's random stream (per worker, per epoch it differs).
        translate_fraction: with a translator, the share of frames it translates (a fixed
            subset, by frame index); the others stay as rendered, so the policy sees both the
            adapted look and the randomized looks around it.

    Item:
        ``image`` ``(3, H, W)`` float32 normalised (:func:`to_network_input`); ``view_rgb``
        ``(H, W, 3)`` uint8; the :func:`build_targets` maps as tensors; ``index`` int.
    """

    def __init__(
        self,
        root: str | Path | Any,
        view: NetworkView | None = None,
        view_size: Sequence[int] | None = None,
        angle_bins: int | None = None,
        translator: TranslateFn | None = None,
        targets: dict | None = None,
        indices: Sequence[int] | None = None,
        cache: bool = True,
        augment: dict | None = None,
        seed: int = 0,
        translate_fraction: float = 1.0,
    ) -> None:
        if not 0.0 <= float(translate_fraction) <= 1.0:
            raise ValueError(f"translate_fraction must be in [0, 1], got {translate_fraction}")
        self.translate_fraction = float(translate_fraction)

        self.frames = root if isinstance(root, SimFrameDataset) else SimFrameDataset(root)
        self.calibration: Calibration = self.frames.calibration
        self.view = view if view is not None else _spec_view(self.calibration, None, view_size)
        self.angle_bins = int(policy_default("angle_bins") if angle_bins is None else angle_bins)
        self.translator = translator
        self.targets = with_policy_defaults("targets", targets)
        self.indices = np.arange(len(self.frames)) if indices is None else np.asarray(indices, dtype=np.int64)
        self.cache = bool(cache)
        self._cache: dict[int, dict] = {}
        self.augment = None if augment is None else with_policy_defaults("augment", augment)
        self._seed = int(seed)
        self._rng: np.random.Generator | None = None
        self._rng_key: tuple | None = None

    def _augment_rng(self) -> np.random.Generator:
        # One stream per process: DataLoader workers get their own (torch seeds them apart).
        key = (os.getpid(), torch.initial_seed())
        if self._rng is None or self._rng_key != key:
            self._rng = np.random.default_rng([self._seed, key[1] % (2**32)])
            self._rng_key = key
        return self._rng

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache"] = {}
        state["_rng"], state["_rng_key"] = None, None
        return state

    def compact(self, i: int) -> dict:
        """The cached per-frame record: view image and view-space labels and maps."""
        j = int(self.indices[i])
        rec = self._cache.get(j)
        if rec is not None:
            return rec
        item = self.frames[j]
        rec = self._compact_table(item, j) if self.view.is_table else self._compact_camera(item, j)
        if self.cache:
            self._cache[j] = rec
        return rec

    def _translate(self, view_rgb: np.ndarray, j: int) -> np.ndarray:
        if self.translator is None or not translated_frame(j, self.translate_fraction):
            return view_rgb
        return np.asarray(self.translator(view_rgb[None]), dtype=np.uint8)[0]

    def _compact_camera(self, item: dict, j: int) -> dict:
        """:meth:`compact` for a camera (``kind="camera"``) view: the nominal calibration."""
        rgb = np.asarray(item["rgb"])
        h, w = rgb.shape[:2]
        raw_calib = self.calibration.scaled((w, h))
        view_rgb = self._translate(preprocess(rgb, self.calibration, self.view), j)
        mx, my, valid = view_grids(raw_calib, self.view)
        seg_view = sample_nearest(np.asarray(item["seg"], dtype=np.uint8), mx, my)
        surface = surface_height_view(item["depth"], item["camera"], raw_calib, self.view)
        g = item["grasps"]
        uv, angle, _ = labels_to_view(g, raw_calib, self.view)
        geometric, grasp_height, grid = None, None, None
        use_geo = float(self.targets["geometric_weight"]) > 0
        if use_geo or self.targets["height_target"] == "ray":
            grid = height_grid(np.asarray(item["depth"]), np.asarray(item["seg"]), item["camera"])
        if self.targets["height_target"] == "ray":
            grasp_height = ray_grasp_heights(grid, item["camera"], raw_calib, self.view, self.calibration.table_z)
        if use_geo:
            gg = geometric_grasps(*grid, self.calibration.table_z, self.angle_bins,
                                  max_cells=int(self.targets["geometric_max_cells"]),
                                  rng=np.random.default_rng(j))
            geometric = splat_view_labels(geometric_view_labels(gg, item["camera"], raw_calib, self.view), self.view,
                                          self.angle_bins)
            geometric = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in geometric.items()}
        return _record(view_rgb, seg_view, valid, surface, uv, angle, g, item["scene"], geometric, grasp_height)

    def _compact_table(self, item: dict, j: int) -> dict:
        """:meth:`compact` for a top-down (``kind="table"``) view.

        The frame is warped with the calibration of the camera that took it, as a user's
        calibrated camera is at deployment; a view pixel is then a base-frame ``(x, y)``,
        so labels go in by their base-frame position and yaw, and the dense targets come
        from the depth rebuilt top-down (:func:`table_view_surface`): the fingertip height
        of a cell is the labeller's rule on its top, table and bin cells are negatives.
        """
        if float(self.targets["geometric_weight"]) > 0:
            raise ValueError("targets.geometric_weight > 0 needs a camera view (policy.view.kind=camera)")
        camera: Calibration = item["camera"]
        view_rgb = self._translate(preprocess(np.asarray(item["rgb"]), camera, self.view), j)
        surface, top_label, known = table_view_surface(np.asarray(item["depth"]), np.asarray(item["seg"]), camera,
                                                       self.view)
        g = item["grasps"]
        pos = np.asarray(g["position"], dtype=np.float64).reshape(-1, 3)
        uv, angle, _ = base_grasp_to_view(pos, np.asarray(g["yaw"], dtype=np.float64).reshape(-1),
                                          np.asarray(g["width"], dtype=np.float64).reshape(-1), camera, self.view)
        return _record(view_rgb, top_label, known, surface, uv, angle, g, item["scene"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rec = self.compact(i)
        t = build_targets(
            rec["seg_view"], rec["valid"], rec["surface_z"].astype(np.float32), rec["label_uv"],
            rec["label_angle"], rec["label_success"], rec["label_width"], rec["label_z"],
            self.calibration.table_z, self.angle_bins, self.targets, rec.get("geometric"),
            None if rec.get("grasp_height") is None else rec["grasp_height"].astype(np.float32),
        )
        view_rgb = rec["view_rgb"]
        if self.augment is not None:
            view_rgb, t = augment_item(view_rgb, t, self._augment_rng(), self.augment)
        out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()}
        out["image"] = torch.from_numpy(to_network_input(view_rgb)[0])
        out["view_rgb"] = torch.from_numpy(np.ascontiguousarray(view_rgb))
        out["index"] = torch.tensor(int(self.indices[i]))
        out["real"] = torch.tensor(0.0)  # 1 for recorded real attempts (policies.finetune.RealAttempts)
        return out


def _record(
    view_rgb: np.ndarray, seg_view: np.ndarray, valid: np.ndarray, surface: np.ndarray, uv: np.ndarray,
    angle: np.ndarray, grasps: dict, scene: Any, geometric: dict | None = None, grasp_height: np.ndarray | None = None,
) -> dict:
    """The compact cached record of one frame (heights kept as float16: ~0.1 mm here)."""
    return {
        "geometric": geometric,
        "grasp_height": None if grasp_height is None else grasp_height.astype(np.float16),
        "view_rgb": view_rgb,
        "seg_view": seg_view,
        "valid": valid,
        "surface_z": surface.astype(np.float16),
        "label_uv": np.asarray(uv, dtype=np.float32),
        "label_angle": np.asarray(angle, dtype=np.float32),
        "label_success": np.asarray(grasps["success"], dtype=bool),
        "label_width": np.asarray(grasps["width"], dtype=np.float32),
        "label_z": np.asarray(grasps["position"], dtype=np.float32).reshape(-1, 3)[:, 2].copy(),
        "scene": int(scene),
    }


def split_by_scene(frames: Any, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train/val frame indices of a :class:`SimFrameDataset`, split by scene (frames of one
    scene share their labels, so they never straddle the split).

    At least one scene goes to validation when ``val_fraction > 0`` and there are two or more.
    """
    scenes = np.array([int(s) for s in _frame_scenes(frames)])
    uniq = np.unique(scenes)
    n_val = int(round(val_fraction * len(uniq)))
    if val_fraction > 0 and len(uniq) > 1:
        n_val = min(max(n_val, 1), len(uniq) - 1)
    else:
        n_val = 0
    rng = np.random.default_rng(seed)
    val_scenes = set(rng.permutation(uniq)[:n_val].tolist())
    is_val = np.array([s in val_scenes for s in scenes], dtype=bool)
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def _frame_scenes(frames: Any) -> list[int]:
    """Scene index of every frame, from the shard metadata (no image decoding)."""

    out: list[int] = []
    for entry in frames.manifest["shards"]:
        meta = read_shard_meta(frames.root / "shards" / f"{entry['name']}.npz")
        out.extend(int(f["scene"]) for f in meta["frames"])
    if len(out) != len(frames):
        raise ValueError(f"shard metadata of {frames.root} lists {len(out)} frames, the manifest {len(frames)}")
    return out


def _spec_view(calib: Calibration, spec: dict | None, view_size: Sequence[int] | None) -> NetworkView:
    """The view a spec ``{"kind", **kw}`` and a size describe on ``calib``; what is not given
    (``None``, or a spec without ``kind``) is the config's (``conf/policy/default.yaml``)."""
    spec = dict(spec) if spec and "kind" in spec else with_policy_defaults("view", spec)
    size = policy_default("view_size") if view_size is None else view_size
    return make_view(calib, tuple(int(v) for v in size), str(spec.pop("kind")), **spec)


def make_policy_datasets(
    dataset_dirs: Sequence[str | Path],
    view: NetworkView | dict | None,
    view_size: Sequence[int],
    angle_bins: int,
    translator: TranslateFn | None = None,
    targets: dict | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    cache: bool = True,
    augment: dict | None = None,
    translate_fraction: float = 1.0,
    mixed_calibrations: bool = False,
) -> tuple[Dataset, Dataset | None, NetworkView, Calibration]:
    """Train and validation datasets over one or more rendered dataset folders.

    All folders must share the nominal calibration (the view is built from it), unless
    ``mixed_calibrations``: then each folder's frames are seen in the view built on its own
    calibration (a view spec is needed; the pretrained base trains on several camera mounts
    this way). ``augment`` applies to the training frames only; ``translate_fraction`` see
    :class:`PolicyFrames`.

    Args:
        view: a :class:`NetworkView`, or a spec ``{"kind": "table" | "camera", **kw}`` that
            :func:`perception.core.geometry.make_view` builds on the nominal calibration with
            ``view_size`` (``None``: the config's ``view``, ``conf/policy/default.yaml``).

    Returns:
        ``train``, ``val`` (``None`` when empty), the view, the nominal calibration (with
        ``mixed_calibrations``: the first folder's).
    """

    if not dataset_dirs:
        raise ValueError("no dataset folders given: render one with sim2real-render first")
    if mixed_calibrations and isinstance(view, NetworkView):
        raise ValueError("mixed_calibrations needs a view spec, not a built view: each folder's view is built on its camera")
    train_parts, val_parts = [], []
    calib = first_view = None
    from_spec = not isinstance(view, NetworkView)
    spec = view if from_spec else None
    for d in dataset_dirs:
        frames = SimFrameDataset(d)
        if calib is None or mixed_calibrations:
            if calib is None:
                calib = frames.calibration
            if from_spec:
                view = _spec_view(frames.calibration, spec, view_size)
            if first_view is None:
                first_view = view
        elif not np.allclose(frames.calibration.T_base_camera, calib.T_base_camera, rtol=0, atol=1e-6) or not np.allclose(
            frames.calibration.K, calib.K, rtol=0, atol=1e-6
        ):  # 1e-6: the same calibration written at another precision is the same camera
            raise ValueError(f"dataset {d} was rendered for another calibration than {dataset_dirs[0]}")
        tr, va = split_by_scene(frames, val_fraction, seed)
        kw = dict(view=view, angle_bins=angle_bins, translator=translator, targets=targets, cache=cache,
                  translate_fraction=translate_fraction)
        train_parts.append(PolicyFrames(frames, indices=tr, augment=augment, seed=seed + len(train_parts), **kw))
        if len(va):
            val_parts.append(PolicyFrames(frames, indices=va, **kw))
    train = train_parts[0] if len(train_parts) == 1 else ConcatDataset(train_parts)
    val = None if not val_parts else (val_parts[0] if len(val_parts) == 1 else ConcatDataset(val_parts))
    assert first_view is not None and calib is not None
    return train, val, first_view, calib
