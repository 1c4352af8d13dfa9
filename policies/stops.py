"""What the robot measured during a grasp (contract section 7) as labels on the geometry network.

An outcome may carry ``contact_stop``, ``fingertip_z`` and ``jaw_width``
(:mod:`perception.core.outcomes`). Each says something about the surface under the gripper,
and no more than that:

- **a stop** (``contact_stop: true`` at ``fingertip_z``): the highest surface under the two
  fingers' footprints stood at ``fingertip_z``. That is a maximum over two footprints, not a
  point: *some* point under the pads is at that height, and *none* is higher;
- **a descent that reached its end** (``contact_stop: false``): nothing under the footprints
  stood above ``fingertip_z`` (or above the answered ``z`` when the robot did not report
  ``fingertip_z``): an upper bound only;
- **the jaws after closing**: ``jaw_width`` above ``part_between_m`` says that a part stood
  between the pads at the fingertips' height; below ``closed_m`` that the jaws swept the
  band between the pads and met nothing above the fingertips.

The geometry network predicts, per camera-view pixel, the height of the surface the pixel sees
(:mod:`policies.geometry`): a point on that pixel's ray. The labels become losses on those
points (:func:`stop_losses`), all in metres above ``table_z``:

- *upper bound* (a stop or a full descent): every predicted point whose ``(x, y)`` lies in a
  footprint (or in the swept band) must be no higher than the measured height (+ tolerance).
  Which points those are is read from the prediction (detached): a predicted point there
  is a claim about that place;
- *the stop itself*: among the pixels whose ray passes through a footprint at the stop's
  height, the highest prediction must reach it (- tolerance). The ray meets the touched
  point, or something higher nearer the camera, so this holds however the scene occludes;
- *a part between the pads*: the pixels whose ray passes between the pads' centres at the
  fingertips' height see a part, at or above that height (the ray enters the part's top or
  side before it gets there). Off by default (``finetune.geometry.between_weight: 0``): the
  part slides along the closing line before the jaws meet it, and the validation cells report
  widths near the full opening for jaws held open by a finger on a part; with it the held-out
  stops' error grew (docs/experiments/2026-12-06-geometry-from-measured-stops.md);
- *the rest of the frame* is held to the network's own answer before the fine-tune, away from
  the gripper's reach (``anchor_weight``): a few hundred labels should move the heights where
  they were measured, not the whole cell's.

:func:`finetune_geometry` trains on them beside the run's sim frames (their ordinary
geometry loss, so that the sim training is not forgotten); :func:`surface_at_stops` is the
check: the rebuilt top-down surface the decode plans on, read under the footprints of
held-out attempts, against what the robot measured.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, Dataset

from adaptation.progress import trainer_progress
from perception.core.atomic import atomic_write
from perception.core.calibration import Calibration
from perception.core.frames import GRIPPER_FINGER_HALF_DEPTH, GRIPPER_FINGER_HALF_THICKNESS, MIN_TIP_CLEARANCE
from perception.core.geometry import NetworkView, base_to_view_pixels, view_rays
from perception.core.imageio import read_image
from perception.core.outcomes import measured
from perception.core.preprocess import preprocess, to_network_input
from policies.geometry import GEOMETRY_FORMAT, GeometryModule, geometry_losses
from policies.networks import HEIGHT_MAX, GeometryNet

__all__ = ["StopLabel", "stop_label", "in_region", "footprint_points", "StopFrames", "stop_losses",
           "GeometryStopModule", "finetune_geometry", "surface_at_stops", "stop_errors"]

log = logging.getLogger(__name__)

#: The sharpness of a bound's smooth hinge (:func:`_hinge`), per logit: it bends over about an eighth
#: of a logit, so a pixel pushed past its bound does not go on far past it.
HINGE_SHARPNESS = 8.0


@dataclass(frozen=True)
class StopLabel:
    """What one attempt's outcome says about the surface under the gripper (metres; heights above ``table_z``).

    The regions are rectangles in ``B``'s ``(x, y)`` around the grasp centre: a point's
    ``along`` coordinate runs on the closing line (``axis``), ``across`` perpendicular to it.
    The fingers' footprints are ``pad_inner <= |along| <= pad_outer``, ``|across| <= half_depth``.

    Attributes:
        centre: ``(x, y)`` of the grasp.
        axis: unit ``(x, y)`` of the closing line (the grasp's yaw).
        pad_inner, pad_outer: the footprints' inner and outer faces from the centre (the opening
            the grasp asked for, half of it, and that plus a finger's thickness).
        half_depth: a finger's half depth across the closing line.
        bound: nothing in the bound region stood above it (``None``: not known).
        swept: the bound region includes the band between the pads (the jaws closed on nothing).
        stop: the highest surface under the footprints stood here (``None``: no stop measured).
        tip: the fingertips' height at the end of the descent (``None``: not known).
        between: half the jaws' opening after closing when a part stood between the pads
            (``None``: no part known between them).
    """

    centre: tuple[float, float]
    axis: tuple[float, float]
    pad_inner: float
    pad_outer: float
    half_depth: float
    bound: float | None
    swept: bool
    stop: float | None
    tip: float | None
    between: float | None

    @property
    def informative(self) -> bool:
        return self.bound is not None or self.between is not None


def stop_label(grasp: Mapping[str, Any], outcome: Mapping[str, Any] | None, table_z: float, part_between_m: float,
               closed_m: float) -> StopLabel | None:
    """The label an attempt's outcome carries (see the module docstring), or ``None`` when it carries none.

    Args:
        grasp: the answered grasp (``position`` ``[x, y, z]`` in ``B``, ``yaw``, ``width``).
        outcome: the reported outcome (its measured fields; absent or ``null`` ones are unknown).
        table_z: the calibration's table height in ``B``.
        part_between_m: a ``jaw_width`` above this says a part stood between the pads.
        closed_m: a ``jaw_width`` below this says the jaws closed on nothing.
    """
    m = measured(outcome)
    if not m:
        return None
    x, y, z = (float(v) for v in grasp["position"])
    yaw, width = float(grasp["yaw"]), float(grasp["width"])
    stop = m.get("contact_stop")
    tip_z = m.get("fingertip_z")
    if tip_z is None and stop is False:
        # The descent reached the answered z (the robot never goes below MIN_TIP_CLEARANCE).
        tip_z = max(z, table_z + MIN_TIP_CLEARANCE)
    tip = None if tip_z is None else float(tip_z) - table_z
    jaw = m.get("jaw_width")
    between = float(jaw) / 2 if jaw is not None and tip is not None and float(jaw) > part_between_m else None
    swept = jaw is not None and tip is not None and float(jaw) < closed_m
    label = StopLabel(centre=(x, y), axis=(float(np.cos(yaw)), float(np.sin(yaw))), pad_inner=width / 2,
                      pad_outer=width / 2 + 2 * GRIPPER_FINGER_HALF_THICKNESS, half_depth=GRIPPER_FINGER_HALF_DEPTH,
                      bound=tip, swept=bool(swept), stop=tip if stop is True else None, tip=tip, between=between)
    return label if label.informative else None


def _along_across(xy: Any, centre: Any, axis: Any) -> tuple[Any, Any]:
    """Coordinates of ``xy (..., 2)`` on the closing line and across it (numpy or torch alike)."""
    dx, dy = xy[..., 0] - centre[..., 0:1], xy[..., 1] - centre[..., 1:2]
    ax, ay = axis[..., 0:1], axis[..., 1:2]
    return dx * ax + dy * ay, dy * ax - dx * ay


def in_region(xy: Any, centre: Any, axis: Any, inner: Any, outer: Any, half_depth: Any) -> Any:
    """Whether ``xy (N, P, 2)`` lies in each item's rectangle band ``inner <= |along| <= outer``,
    ``|across| <= half_depth`` (``centre``, ``axis`` ``(N, 2)``; the rest ``(N, 1)``); numpy or torch."""
    along, across = _along_across(xy, centre, axis)
    a = abs(along)
    return (a >= inner) & (a <= outer) & (abs(across) <= half_depth)


def footprint_points(label: StopLabel, step: float, swept: bool = False) -> np.ndarray:
    """``(N, 2)`` points about ``step`` apart covering both footprints (and the band between them when
    ``swept``): the centres of cells tiling each rectangle."""
    def centres(lo: float, hi: float) -> np.ndarray:  # cells about ``step`` wide tiling [lo, hi], their centres
        n = max(1, int(np.ceil((hi - lo) / step - 1e-9)))
        return lo + (np.arange(n) + 0.5) * (hi - lo) / n

    along = centres(0.0 if swept else label.pad_inner, label.pad_outer)
    along = np.concatenate([along, -along])
    across = centres(-label.half_depth, label.half_depth)
    a, c = np.meshgrid(along, across, indexing="ij")
    ax, ay = label.axis
    return np.stack([label.centre[0] + a.ravel() * ax - c.ravel() * ay,
                     label.centre[1] + a.ravel() * ay + c.ravel() * ax], axis=1)


def _ray_mask(origin: np.ndarray, dirs: np.ndarray, height: float, table_z: float, label: StopLabel,
              inner: float, outer: float, half_depth: float, shape: tuple[int, int]) -> np.ndarray:
    """The view pixels whose ray, at ``height`` above the table, passes through the band."""
    t = (table_z + height - origin[2]) / dirs[:, 2]
    xy = (origin[None, :2] + dirs[:, :2] * t[:, None])[None]
    c, a = np.asarray([label.centre]), np.asarray([label.axis])
    inside = in_region(xy, c, a, np.asarray([[inner]]), np.asarray([[outer]]), np.asarray([[half_depth]]))[0]
    return (inside & (t > 0)).reshape(shape)


class StopFrames(Dataset):
    """Recorded attempts whose outcomes carry a label (:func:`stop_label`), in the geometry network's view.

    Items: ``image`` (the network input), the label's numbers as tensors (``centre``, ``axis``,
    ``pad_inner``, ``pad_outer``, ``half_depth``, ``bound``, ``swept``, ``stop``, ``tip``; NaN where
    unknown), ``stop_mask`` (the pixels whose ray passes through a footprint at the stop's height)
    and ``between_mask`` (those whose ray passes between the pads' centres at the fingertips' height:
    the middle half of the closed opening, the middle half of the pads' depth).
    """

    def __init__(self, attempts: Sequence[dict], calib: Calibration, view: NetworkView, part_between_m: float,
                 closed_m: float, anchor: GeometryNet | None = None, anchor_clearance_m: float = 0.02) -> None:
        self.calib, self.view = calib, view
        origin, dirs = view_rays(calib, view)
        W, H = view.size
        self.items: list[tuple[np.ndarray, StopLabel, np.ndarray, np.ndarray]] = []
        self.anchors: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        camera = None if anchor is None else anchor.camera_maps(calib, view)  # one camera: one set of maps
        for a in attempts:
            label = stop_label(a["grasp"], a.get("outcome"), calib.table_z, part_between_m, closed_m)
            if label is None:
                continue
            none = np.zeros((H, W), bool)
            stop_mask = none if label.stop is None else _ray_mask(
                origin, dirs, label.stop, calib.table_z, label, label.pad_inner, label.pad_outer, label.half_depth, (H, W))
            between_mask = none if label.between is None or label.tip is None else _ray_mask(
                origin, dirs, label.tip, calib.table_z, label, 0.0, label.between / 2, label.half_depth / 2, (H, W))
            view_rgb = preprocess(read_image(Path(a["_dir"]) / a["frame"]), calib, view)
            self.items.append((view_rgb, label, stop_mask, between_mask))
            if anchor is not None:
                self.anchors.append(self._anchor(anchor, camera, view_rgb, label, origin, dirs, anchor_clearance_m))

    def _anchor(self, net: GeometryNet, camera: torch.Tensor | None, view_rgb: np.ndarray, label: StopLabel,
                origin: np.ndarray, dirs: np.ndarray, clearance: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The network's own answer on the frame before the fine-tune (height, part probability), and
        where it holds: every pixel whose ray stays ``clearance`` clear of the gripper's reach (the
        pads' outer faces) at every height up to ``HEIGHT_MAX`` (what the labels speak of is left free)."""
        with torch.no_grad():
            o = net(torch.from_numpy(to_network_input(view_rgb)), camera)
        W, H = self.view.size
        near = np.zeros((H, W), bool)
        reach = label.pad_outer + clearance
        for z in np.linspace(0.0, HEIGHT_MAX, 8):
            near |= _ray_mask(origin, dirs, float(z), self.calib.table_z, label, 0.0, reach, reach, (H, W))
        return (o["height"][0, 0].numpy().astype(np.float32), torch.sigmoid(o["object_logits"][0, 0]).numpy(), ~near)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        view_rgb, lab, stop_mask, between_mask = self.items[i]
        nan = float("nan")

        def num(v: float | None) -> torch.Tensor:
            return torch.tensor(nan if v is None else float(v), dtype=torch.float32)

        return {
            "image": torch.from_numpy(to_network_input(view_rgb)[0]),
            "centre": torch.tensor(lab.centre, dtype=torch.float64), "axis": torch.tensor(lab.axis, dtype=torch.float64),
            "pad_inner": num(lab.pad_inner), "pad_outer": num(lab.pad_outer), "half_depth": num(lab.half_depth),
            "bound": num(lab.bound), "swept": torch.tensor(lab.swept), "stop": num(lab.stop), "tip": num(lab.tip),
            "stop_mask": torch.from_numpy(stop_mask), "between_mask": torch.from_numpy(between_mask),
            **({} if not self.anchors else dict(zip(("anchor_height", "anchor_part", "anchor_mask"),
                                                    map(torch.from_numpy, self.anchors[i])))),
        }


def _height_logit(height: torch.Tensor) -> torch.Tensor:
    """The network's height logit of a height (metres above the table; :class:`GeometryNet`'s sigmoid)."""
    f = (height / HEIGHT_MAX).clamp(1e-4, 1 - 1e-4)
    return torch.log(f) - torch.log1p(-f)


def _hinge(excess: torch.Tensor) -> torch.Tensor:
    """A smooth hinge on a height logit's excess over its bound: about the excess beyond it, near
    0 a fraction of a logit inside it. In logit space, so a bound moves a pixel whose sigmoid is
    flat (a floor pixel the network calls 0 mm has no gradient in metres)."""
    return F.softplus(HINGE_SHARPNESS * excess) / HINGE_SHARPNESS


def stop_losses(out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], origin: torch.Tensor,
                dirs: torch.Tensor, table_z: float, tolerance: float, loss_cfg: Mapping[str, Any], *,
                anchor_weight: float, between_weight: float) -> dict[str, torch.Tensor]:
    """The measured labels' losses on a batch of :class:`StopFrames` (see the module docstring).

    Each bound is a smooth hinge on the height logit (:func:`_hinge`) against the bound's own
    logit, the bound widened by ``tolerance``; the part mask between the pads is the geometry
    loss's BCE with its ``mask_weight``. Each term is the mean over the items that carry it.

    Args:
        out: :class:`GeometryNet`'s outputs (``height``, ``object_logits``, and ``height_logits`` unless
            the height is read from bins).
        origin: ``(3,)`` the camera centre in ``B``; ``dirs`` ``(H*W, 3)`` the view pixels'
            ray directions in ``B`` (:func:`perception.core.geometry.view_rays`), float64.
        tolerance: metres a measured height is trusted to.
        between_weight: x the part-between-the-pads term.
        anchor_weight: x the items' own frames held to the network's answer before the fine-tune
            (``anchor_*``, :class:`StopFrames` with ``anchor``) away from the gripper: the geometry
            loss's terms, so that a few hundred labels on one cell's frames move the heights where
            they were measured and not the whole cell's.

    Returns:
        ``loss`` and its terms ``upper_loss``, ``stop_loss``, ``part_loss``, ``anchor_loss``.
    """
    h = out["height"][:, 0]
    N = h.shape[0]
    zero = h.sum() * 0.0
    hflat = h.reshape(N, -1)
    # A regressed height's logit, or (height bins) the logit of the height read from the bins: the
    # same monotone scale, through the bins' readout.
    logit = (out["height_logits"] if "height_logits" in out else _height_logit(out["height"]))[:, 0].reshape(N, -1)
    # Where each pixel's predicted point is, from the prediction held fixed.
    with torch.no_grad():
        t = (table_z + hflat.double() - origin[2]) / dirs[None, :, 2]
        xy = origin[None, None, :2] + dirs[None, :, :2] * t[..., None]
        inner = torch.where(batch["swept"], torch.zeros_like(batch["pad_inner"]), batch["pad_inner"]).double()
        member = in_region(xy, batch["centre"], batch["axis"], inner[:, None], batch["pad_outer"].double()[:, None],
                           batch["half_depth"].double()[:, None]) & (t > 0)
        member &= torch.isfinite(batch["bound"])[:, None]
    # Upper bound: no predicted point under the fingers above where they went.
    over = _hinge(logit - _height_logit(torch.nan_to_num(batch["bound"], nan=0.0) + tolerance)[:, None])
    m = member.float()
    per_item = (over * m).sum(1) / m.sum(1).clamp_min(1.0)
    has = member.any(1)
    # The highest offender as strongly as the stop's one pixel, the rest on average.
    worst = torch.where(member, over, torch.zeros_like(over)).amax(1)
    upper = (per_item + worst)[has].mean() if has.any() else zero
    # The stop: the highest pixel looking through a footprint at the stop's height reaches it.
    stop_mask = batch["stop_mask"].reshape(N, -1) & torch.isfinite(batch["stop"])[:, None]
    has_stop = stop_mask.any(1)
    if has_stop.any():
        top = torch.where(stop_mask, logit, torch.full_like(logit, -1e4)).amax(1)
        stop = _hinge(_height_logit(torch.nan_to_num(batch["stop"], nan=0.0) - tolerance) - top)[has_stop].mean()
    else:
        stop = zero
    # A part between the pads: the pixels looking between them at the fingertips see a part, at or above them.
    between = batch["between_mask"].reshape(N, -1)
    if between.any() and between_weight > 0:
        logits = out["object_logits"][:, 0].reshape(N, -1)[between]
        tip = _height_logit(torch.nan_to_num(batch["tip"], nan=0.0) - tolerance)[:, None].expand_as(logit)[between]
        part = between_weight * (float(loss_cfg["mask_weight"]) * F.binary_cross_entropy_with_logits(
            logits, torch.ones_like(logits)) + _hinge(tip - logit[between]).mean())
    else:
        part = zero
    # The rest of the frame stays what the network saw before (the labels speak of the gripper's place only).
    anchor = zero
    if "anchor_height" in batch and anchor_weight > 0:
        keep = batch["anchor_mask"].float()
        dh = F.smooth_l1_loss(h, batch["anchor_height"], reduction="none", beta=0.01)
        dp = F.binary_cross_entropy_with_logits(out["object_logits"][:, 0], batch["anchor_part"], reduction="none")
        anchor = anchor_weight * ((float(loss_cfg["height_weight"]) * dh + float(loss_cfg["mask_weight"]) * dp) * keep
                                  ).sum() / keep.sum().clamp_min(1.0)
    return {"loss": upper + stop + part + anchor, "upper_loss": upper, "stop_loss": stop, "part_loss": part,
            "anchor_loss": anchor}


class GeometryStopModule(GeometryModule):
    """:class:`policies.geometry.GeometryModule` fine-tuned on measured labels beside sim frames.

    A training batch is ``{"sim": GeometryFrames batch, "real": StopFrames batch}``; the loss is
    the sim frames' geometry loss plus ``label_weight`` times :func:`stop_losses`.
    """

    def __init__(self, network: dict, loss: dict, optim: dict, view: dict, calibration: dict, label_weight: float,
                 tolerance: float, anchor_weight: float, between_weight: float) -> None:
        super().__init__(network=network, loss=loss, optim=optim, view=view, calibration=calibration)
        self.label_weight, self.tolerance = float(label_weight), float(tolerance)
        self.anchor_weight, self.between_weight = float(anchor_weight), float(between_weight)
        calib = Calibration.from_dict(calibration)
        origin, dirs = view_rays(calib, NetworkView.from_dict(view))
        self.table_z = float(calib.table_z)
        self.register_buffer("ray_origin", torch.from_numpy(origin), persistent=False)
        self.register_buffer("ray_dirs", torch.from_numpy(dirs), persistent=False)
        # The cell's frames are all seen through its calibration: one set of camera maps for the measured labels.
        self.register_buffer("camera", self.net.camera_maps(calib, NetworkView.from_dict(view)), persistent=False)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        sim = geometry_losses(self.net(batch["sim"]["image"], batch["sim"].get("camera")), batch["sim"], self.loss_cfg)
        real = stop_losses(self.net(batch["real"]["image"], self.camera), batch["real"], self.ray_origin, self.ray_dirs,
                           self.table_z, self.tolerance, self.loss_cfg, anchor_weight=self.anchor_weight,
                           between_weight=self.between_weight)
        loss = sim["loss"] + self.label_weight * real["loss"]
        n = batch["real"]["image"].shape[0]
        self.log_losses("train", {"loss": loss, "sim_loss": sim["loss"], **{k: v for k, v in real.items() if k != "loss"}},
                        n)
        return loss


def finetune_geometry(base: dict, stops: StopFrames, sim: Dataset, out: Path, gcfg: Mapping[str, Any], seed: int,
                      logger: Any = False) -> dict:
    """Fine-tune a geometry network (a geometry file's contents) on ``stops`` beside ``sim`` frames and
    write ``out/geometry.pt`` (the shipped format, loadable by name or path as ``policy.geometry``).

    Args:
        gcfg: ``finetune.geometry`` with the budget's ``max_steps`` and ``max_time_s``.

    Returns:
        ``path``, ``global_step``, ``train_time_s``, ``attempts`` (labelled attempts trained on).
    """
    pl.seed_everything(int(seed), workers=True, verbose=False)
    bs = int(gcfg["batch_size"])
    view = stops.view
    module = GeometryStopModule(
        network=base["network"], loss={**dict((base.get("config") or {}).get("loss") or {})},
        optim={**dict(gcfg["optim"]), "max_steps": int(gcfg["max_steps"]), "max_time_s": gcfg.get("max_time_s")},
        view=view.to_dict(), calibration=stops.calib.to_dict(), label_weight=float(gcfg["label_weight"]),
        tolerance=float(gcfg["tolerance_m"]), anchor_weight=float(gcfg["anchor_weight"]),
        between_weight=float(gcfg["between_weight"]))
    module.net.load_state_dict(base["state_dict"])
    loaders = CombinedLoader(
        {"sim": DataLoader(sim, batch_size=bs, shuffle=True, drop_last=len(sim) >= bs),
         "real": DataLoader(stops, batch_size=bs, shuffle=True, drop_last=len(stops) >= bs)}, mode="max_size_cycle")
    bar, callbacks = trainer_progress("geometry fine-tune")
    trainer = pl.Trainer(
        default_root_dir=str(out), max_steps=int(gcfg["max_steps"]), max_epochs=-1,
        max_time=datetime.timedelta(seconds=float(gcfg["max_time_s"])) if gcfg.get("max_time_s") else None,
        logger=logger, accelerator=str(gcfg.get("accelerator", "auto")), devices=1, limit_val_batches=0,
        num_sanity_val_steps=0, log_every_n_steps=5, enable_model_summary=False, enable_checkpointing=False,
        enable_progress_bar=bar, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.fit(module, loaders)
    net = module.net.cpu().eval()
    info = {k: v for k, v in base.items() if k != "state_dict"}
    info.update({"format": GEOMETRY_FORMAT, "finetuned": {
        "from": (base.get("config") or {}).get("name"), "attempts": len(stops), "global_step": int(trainer.global_step),
        "train_time_s": round(time.perf_counter() - t0, 1), "label_weight": float(gcfg["label_weight"])}})
    path = out / "geometry.pt"
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    atomic_write(path, lambda fh: torch.save({**info, "state_dict": state}, fh))
    return {"path": str(path), "global_step": int(trainer.global_step),
            "train_time_s": info["finetuned"]["train_time_s"], "attempts": len(stops)}


def surface_at_stops(surface: np.ndarray, top_view: NetworkView, calib: Calibration, label: StopLabel,
                     step: float) -> float | None:
    """The highest point of a top-down ``surface`` (metres above ``table_z``, the decode's) under the
    label's footprints (and, for a full descent whose jaws closed on nothing, the band between them):
    what the geometry says the fingers would have met; ``None`` when no footprint point lies in the view."""
    pts = footprint_points(label, step, swept=label.swept and label.stop is None)
    uv = np.rint(base_to_view_pixels(np.c_[pts, np.zeros(len(pts))], calib, top_view)).astype(int)
    W, H = top_view.size
    ok = (uv[:, 0] >= 0) & (uv[:, 0] < W) & (uv[:, 1] >= 0) & (uv[:, 1] < H)
    return float(surface[uv[ok, 1], uv[ok, 0]].max()) if ok.any() else None


def stop_errors(highest: Sequence[float], labels: Sequence[StopLabel], tolerance: float) -> dict:
    """The geometry against what the robot measured, on held-out attempts (mm).

    ``highest``: :func:`surface_at_stops` per label. At a stop the error is the predicted highest
    point minus the stop's height (median and p90 of its size); a full descent bounds it, and a
    prediction above the bound (+ ``tolerance``) is a violation.
    """
    err = [1000 * (h - lab.stop) for h, lab in zip(highest, labels) if lab.stop is not None]
    over = [1000 * (h - lab.bound) for h, lab in zip(highest, labels) if lab.stop is None and lab.bound is not None]
    a = np.abs(np.asarray(err))
    return {"stops": len(err), "stop_error_mean_mm": float(a.mean()) if len(a) else None,
            "stop_error_median_mm": float(np.median(a)) if len(a) else None,
            "stop_error_p90_mm": float(np.percentile(a, 90)) if len(a) else None,
            "stop_error_signed_median_mm": float(np.median(err)) if err else None,
            "bounds": len(over), "bound_violations": int(sum(o > 1000 * tolerance for o in over))}
