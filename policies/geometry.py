"""Geometry from RGB: the height of what every camera-view pixel sees, and whether it is a part.

The grasp rule (:mod:`perception.core.rule`) picks grasps that fit well on a good height map
(the ``rule_observed`` bracket and the cells' ``oracle-geom``), and the measured failure of
the learned maps is placement: fingers landing on parts. :class:`policies.networks.GeometryNet`
predicts, in the *camera* view (``perception.core.geometry.network_view``: where a part's edges
are the image's edges, unlike the top-down view, where every part leans away from the camera
and its edges smear):

- ``height``: metres above ``table_z`` of the surface seen at the pixel;
- ``object``: the probability that the pixel sees a part (segmentation label >= ``SEG_FIRST_OBJECT``).

The deployed decode (:func:`perception.core.geometry.camera_heights_to_surface`, torch-free,
shared by the service and the evaluation) lifts each pixel onto its ray at the predicted
height through the serving calibration and keeps the top of every top-down cell: the
surface the rule runs on, ranked by the policy's learned quality.

Trained once on the pretrained base's renders (``sim2real-train-base parts=[geometry]``,
``conf/geometry/default.yaml``) and shipped as ``policies/bases/<name>.pt``; the pipeline's
export puts it into the artifact as ``geometry.onnx`` (``policy.geometry``).
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, IterableDataset

from adaptation.progress import trainer_progress
from conf import to_plain
from perception.core.atomic import atomic_write
from perception.core.calibration import Calibration
from perception.core.geometry import NetworkView, camera_channels, make_view
from perception.core.jsonio import write_json
from perception.core.preprocess import preprocess, to_network_input
from perception.core.progress import progress
from policies.data import sample_nearest, split_by_scene, surface_height_view, view_grids
from policies.loggers import policy_logger
from policies.module import TimedCosineModule
from policies.networks import HEIGHT_MAX, GeometryNet, build_network, height_bin_centres
from policies.weights import load_base
from sim_render.format import SEG_FIRST_OBJECT
from sim_render.reader import SimFrameDataset

__all__ = ["GeometryFrames", "geometry_item", "GeometryModule", "geometry_net", "load_geometry_net", "base_view", "geometry_losses", "geometry_errors", "geometry_view",
           "make_geometry_datasets", "train_geometry", "GEOMETRY_FORMAT"]

log = logging.getLogger(__name__)

GEOMETRY_FORMAT = "sim2real-grasp-geometry-base"


def geometry_view(calib: Calibration, gcfg: dict | DictConfig) -> NetworkView:
    """The camera view the geometry network sees, built on ``calib`` from ``geometry.view_size`` and ``geometry.margin``."""
    return make_view(calib, tuple(int(v) for v in gcfg["view_size"]), "camera", margin=float(gcfg["margin"]))


def base_view(data: dict, calib: Calibration) -> NetworkView:
    """The camera view a geometry file's network sees on ``calib`` (its ``view_size`` and ``margin``)."""
    return geometry_view(calib, {"view_size": data["view_size"], "margin": data["margin"]})


def geometry_net(data: dict) -> GeometryNet:
    """The network of a geometry file's contents (``network`` + ``state_dict``), in eval mode."""
    net = build_network(data["network"], GeometryNet, "geometry.network")
    net.load_state_dict(data["state_dict"])
    return net.eval()


def load_geometry_net(name: str | Path) -> tuple[GeometryNet, dict]:
    """A shipped (or saved) geometry network, in eval mode, and its file's contents
    (:func:`policies.weights.load_base` with :data:`GEOMETRY_FORMAT`: nothing unpickled)."""

    data = load_base(name, GEOMETRY_FORMAT)
    return geometry_net(data), data


def geometry_record(item: dict, calib: Calibration, view: NetworkView) -> dict:
    """One rendered frame as the geometry network's input and targets.

    The image is preprocessed with the nominal calibration (as a user's frame is); the
    height target is the rendered depth back-projected through the camera that actually
    took the frame (:func:`policies.data.surface_height_view`), so a calibration error
    shows up as it would at deployment.

    Returns:
        ``view_rgb`` ``(H, W, 3)`` uint8, ``height`` ``(H, W)`` float16 metres above
        ``table_z`` (NaN where nothing was seen), ``object`` ``(H, W)`` bool.
    """

    rgb = np.asarray(item["rgb"])
    h, w = rgb.shape[:2]
    raw_calib = calib.scaled((w, h))
    view_rgb = preprocess(rgb, calib, view)
    surface = surface_height_view(item["depth"], item["camera"], raw_calib, view) - float(calib.table_z)
    mx, my, _ = view_grids(raw_calib, view)
    seg = sample_nearest(np.asarray(item["seg"], dtype=np.uint8), mx, my)
    return {"view_rgb": view_rgb, "height": surface.astype(np.float16), "object": seg >= SEG_FIRST_OBJECT}


class GeometryFrames(Dataset):
    """Geometry records (:func:`geometry_record`) with the training augmentation.

    Args:
        records: the records.
        augment: ``{"hflip": p, "color": fraction}`` or ``None`` (validation).
        seed: the augmentation's seed.
    """

    def __init__(self, records: Sequence[dict], augment: dict | None = None, seed: int = 0) -> None:
        self.records = list(records)
        self.augment = augment
        self.seed = int(seed)
        self._rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rec = self.records[i]
        rng = None
        if self.augment:
            if self._rng is None:
                info = torch.utils.data.get_worker_info()
                self._rng = np.random.default_rng([self.seed, 0 if info is None else info.id])
            rng = self._rng
        return geometry_item(rec["view_rgb"], rec["height"], rec["object"], self.augment, rng, rec.get("camera"))


def geometry_item(rgb: np.ndarray, height: np.ndarray, obj: np.ndarray, augment: dict | None,
                  rng: np.random.Generator | None, camera: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """One record (:func:`geometry_record`'s arrays) as the network's tensors, augmented from
    ``rng`` when ``augment`` (``{"hflip": p, "color": fraction}``) is given; ``camera``: the
    frame's view's :func:`perception.core.geometry.camera_channels`, passed on as ``camera``."""
    height = height.astype(np.float32)
    if augment:
        assert rng is not None
        if rng.random() < float(augment.get("hflip", 0.0)):
            # A mirrored image is a mirrored world seen by a mirrored camera: heights mirror with it,
            # and so do the camera's maps (each a scalar of the world and the camera).
            rgb, height, obj = rgb[:, ::-1], height[:, ::-1], obj[:, ::-1]
            camera = None if camera is None else camera[:, :, ::-1]
        c = float(augment.get("color", 0.0))
        if c > 0:
            gain = rng.uniform(1 - c, 1 + c, 3)
            offset = rng.uniform(-c, c, 3) * 255.0
            rgb = np.clip(rgb.astype(np.float32) * gain + offset, 0, 255).astype(np.uint8)
    known = np.isfinite(height)
    item = {
        "image": torch.from_numpy(to_network_input(np.ascontiguousarray(rgb))[0]),
        "height_target": torch.from_numpy(np.ascontiguousarray(np.where(known, height, 0.0), dtype=np.float32)),
        "known": torch.from_numpy(np.ascontiguousarray(known)),
        "object_target": torch.from_numpy(np.ascontiguousarray(obj)),
    }
    if camera is not None:
        item["camera"] = torch.from_numpy(np.ascontiguousarray(camera, dtype=np.float32))
    return item


def make_geometry_datasets(
    dataset_dirs: Sequence[str | Path], gcfg: dict, val_fraction: float, seed: int,
) -> tuple[GeometryFrames, GeometryFrames | None, NetworkView, Calibration]:
    """Training and validation geometry frames from rendered folders, split by scene.

    Each folder's frames are seen in the camera view of its own nominal calibration (the
    base's folders are rendered from several camera mounts).

    Returns:
        ``train``, ``val`` (``None`` when empty), the first folder's view and calibration.
    """

    train, val = [], []
    first: tuple[NetworkView, Calibration] | None = None
    for d in dataset_dirs:
        frames = SimFrameDataset(d, fields=("rgb", "depth", "seg"))
        calib = frames.calibration
        view = geometry_view(calib, gcfg)
        camera = camera_channels(calib, view)  # every record of the folder shares its mount's maps
        if first is None:
            first = (view, calib)
        tr_idx, va_idx = split_by_scene(frames, val_fraction, seed)
        val_set = set(int(i) for i in va_idx)
        for i in progress(range(len(frames)), desc=f"geometry frames {Path(d).name}", unit="frame", leave=False):
            rec = {**geometry_record(frames[i], calib, view), "camera": camera}
            (val if i in val_set else train).append(rec)
    assert first is not None
    aug = gcfg.get("augment")
    return (GeometryFrames(train, dict(aug) if aug else None, seed), GeometryFrames(val) if val else None,
            first[0], first[1])


def geometry_losses(out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], loss_cfg: dict) -> dict[str, torch.Tensor]:
    """Height: smooth-L1 (metres, ``beta`` 1 cm) over the pixels with a known height, part
    pixels weighted ``object_weight`` (they are few, and they are what the grasp closes on);
    object: binary cross-entropy over every pixel.

    A network with height bins (``height_bin_logits``) learns them by cross-entropy against a
    soft target, a Gaussian of ``bin_sigma`` bins around the true height (neighbouring heights
    are near answers, not wrong ones), over the same pixels and weights; ``bin_weight`` scales
    it in place of ``height_weight``. ``height_loss`` is then that cross-entropy."""
    known = batch["known"].float()
    obj = batch["object_target"].float()
    w = known * (1.0 + (float(loss_cfg["object_weight"]) - 1.0) * obj)
    if "height_bin_logits" in out:
        logits = out["height_bin_logits"]
        c = height_bin_centres(logits.shape[1]).to(logits.device, logits.dtype)
        sigma = float(loss_cfg["bin_sigma"]) * float(c[1] - c[0])
        h = batch["height_target"].clamp(0.0, HEIGHT_MAX)[:, None]
        target = torch.softmax(-0.5 * ((c.view(1, -1, 1, 1) - h) / sigma) ** 2, dim=1)
        h_err = -(target * F.log_softmax(logits, dim=1)).sum(dim=1)
        height_weight = float(loss_cfg["bin_weight"])
    else:
        h_err = F.smooth_l1_loss(out["height"][:, 0], batch["height_target"], reduction="none", beta=0.01)
        height_weight = float(loss_cfg["height_weight"])
    height_loss = (w * h_err).sum() / w.sum().clamp_min(1.0)
    object_loss = F.binary_cross_entropy_with_logits(out["object_logits"][:, 0], obj)
    loss = height_weight * height_loss + float(loss_cfg["mask_weight"]) * object_loss
    return {"loss": loss, "height_loss": height_loss, "object_loss": object_loss}


class GeometryModule(TimedCosineModule):
    """Trains :class:`GeometryNet` on :class:`GeometryFrames` batches.

    Metrics: ``train/loss``, ``train/height_loss``, ``train/object_loss``; ``val/...`` the same
    plus ``val/height_mae_object_m``, ``val/height_mae_floor_m`` and ``val/object_iou``.
    """

    def __init__(self, network: dict | None = None, loss: dict | None = None, optim: dict | None = None,
                 view: dict | None = None, calibration: dict | None = None, config: dict | None = None,
                 channels_last: bool = False) -> None:
        super().__init__(optim)
        network = dict(network or {})
        self.save_hyperparameters({"network": network, "loss": loss, "optim": optim, "view": view,
                                   "calibration": calibration, "config": config, "channels_last": channels_last})
        self.net = build_network(network, GeometryNet, "geometry.network")
        self.loss_cfg = {"height_weight": 20.0, "mask_weight": 1.0, "object_weight": 4.0, "bin_weight": 1.0,
                         "bin_sigma": 1.0, **(loss or {})}
        self.channels_last = bool(channels_last)

    def on_fit_start(self) -> None:
        if self.channels_last:
            self.net.to(memory_format=torch.channels_last)

    def _image(self, batch: dict) -> torch.Tensor:
        x = batch["image"]
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def _run(self, batch: dict) -> dict[str, torch.Tensor]:
        return self.net(self._image(batch), batch.get("camera"))

    def forward(self, image: torch.Tensor, camera: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return self.net(image, camera)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        losses = geometry_losses(self._run(batch), batch, self.loss_cfg)
        self.log_losses("train", losses, batch["image"].shape[0])
        return losses["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out = self._run(batch)
        n = batch["image"].shape[0]
        self.log_losses("val", geometry_losses(out, batch, self.loss_cfg), n, prog_bar=False)
        known, obj = batch["known"], batch["object_target"]
        err = (out["height"][:, 0] - batch["height_target"]).abs()
        for name, m in (("object", known & obj), ("floor", known & ~obj)):
            self.log(f"val/height_mae_{name}_m", (err * m).sum() / m.sum().clamp_min(1), batch_size=n)
        pred = out["object_logits"][:, 0] > 0
        self.log("val/object_iou", (pred & obj).sum() / (pred | obj).sum().clamp_min(1), batch_size=n)


@torch.no_grad()
def geometry_errors(net: GeometryNet, frames: GeometryFrames, batch_size: int = 32) -> dict[str, float]:
    """Height error of ``net`` on held-out frames: median and p90 of the absolute error,
    metres, on part pixels and on the rest (table, bin, floor), and the part mask's IoU."""
    net.eval()
    errs: dict[str, list[np.ndarray]] = {"object": [], "floor": []}
    inter = union = 0
    for batch in DataLoader(frames, batch_size=batch_size):
        out = net(batch["image"], batch.get("camera"))
        err = (out["height"][:, 0] - batch["height_target"]).abs().numpy()
        known, obj = batch["known"].numpy(), batch["object_target"].numpy()
        errs["object"].append(err[known & obj])
        errs["floor"].append(err[known & ~obj])
        pred = out["object_logits"][:, 0].numpy() > 0
        inter += int((pred & obj).sum())
        union += int((pred | obj).sum())
    res: dict[str, float] = {}
    for k, v in errs.items():
        a = np.concatenate(v) if v else np.zeros(0)
        res[f"{k}_median_m"] = float(np.median(a)) if a.size else math.nan
        res[f"{k}_p90_m"] = float(np.percentile(a, 90)) if a.size else math.nan
        res[f"{k}_pixels"] = int(a.size)
    res["object_iou"] = inter / max(union, 1)
    return res


def train_geometry(
    gcfg: dict | DictConfig, dataset_dirs: Sequence[str | Path], output_dir: str | Path, seed: int = 0,
    logger_cfg: Any = None, fast_dev_run: bool | int = False, datasets: tuple | None = None,
) -> dict:
    """Train the geometry network with a Lightning ``Trainer`` and write ``output_dir/geometry.pt``
    (a ``state_dict`` of :class:`GeometryNet` and the plain config, loadable with ``weights_only``).

    Args:
        gcfg: ``conf/geometry/default.yaml``.
        dataset_dirs: rendered folders (each with its own camera mount).
        datasets: ``(train, val, view, calibration)`` made already, in place of ``dataset_dirs``
            (:func:`policies.geometry_data.geometry_data_datasets`: geometry data streamed from disk).
        output_dir: where the checkpoint, logs and ``geometry.pt`` go.
        seed: data split, augmentation and initialisation seed.
        logger_cfg: the ``logger`` group (CSV by default).
        fast_dev_run: Lightning's smoke-test mode.

    ``geometry.init_from`` (a geometry base) starts from its weights with a fresh optimiser:
    more training on the same renders. ``geometry.checkpoint_every_n_steps`` keeps
    ``output_dir/checkpoints/last.ckpt`` (weights, optimiser, schedule, step) up to date, and a
    run started again on the same ``output_dir`` continues from it (a campaign of many hours:
    give it ``max_steps``, since a time budget's schedule starts again with the run).

    Returns:
        ``path``, ``network``, ``view_size``, ``margin``, ``metrics``, ``errors``
        (:func:`geometry_errors` on the validation frames), ``global_step``, ``train_time_s``,
        ``n_train_frames``, ``n_val_frames``, ``device``.
    """

    g = to_plain(gcfg)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if g.get("num_threads"):
        torch.set_num_threads(int(g["num_threads"]))
    pl.seed_everything(int(seed), workers=True, verbose=False)
    bs = int(g["batch_size"])
    if datasets is None:
        datasets = make_geometry_datasets(dataset_dirs, g, float(g["val_fraction"]), int(seed))
    train_ds, val_ds, view, calib = datasets
    # A streamed set shuffles itself (a new shard order each pass).
    train_loader = DataLoader(train_ds, batch_size=bs, shuffle=not isinstance(train_ds, IterableDataset),
                              num_workers=int(g["loader_workers"]), drop_last=len(train_ds) >= bs)
    val_loader = DataLoader(val_ds, batch_size=bs) if val_ds is not None else None
    module = GeometryModule(
        network=g["network"], loss=g["loss"],
        optim={**g["optim"], "max_steps": int(g["max_steps"]), "max_time_s": g.get("max_time_s")},
        view=view.to_dict(), calibration=calib.to_dict(), config=g, channels_last=bool(g.get("channels_last", False)),
    )
    if g.get("init_from"):

        module.net.load_state_dict(load_base(g["init_from"], GEOMETRY_FORMAT)["state_dict"])
        log.info("geometry: continuing from %s", g["init_from"])
    tlog = policy_logger(logger_cfg, out, {"geometry": g, "seed": int(seed)})

    bar, progress_cbs = trainer_progress("geometry")
    every = g.get("checkpoint_every_n_steps")
    resume = None
    if every:
        ckpt_dir = out / "checkpoints"
        progress_cbs = [*progress_cbs, ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, save_top_k=0,
                                                       every_n_train_steps=int(every))]
        if (ckpt_dir / "last.ckpt").is_file():
            resume = str(ckpt_dir / "last.ckpt")
            log.info("geometry: continuing the run in %s", resume)
    trainer = pl.Trainer(
        default_root_dir=str(out), max_steps=int(g["max_steps"]), max_epochs=-1,
        max_time=datetime.timedelta(seconds=float(g["max_time_s"])) if g.get("max_time_s") else None,
        logger=tlog.logger, accelerator=str(g.get("accelerator", "auto")), devices=1,
        val_check_interval=int(g["val_every_n_steps"]) if val_loader is not None else None,
        check_val_every_n_epoch=None, limit_val_batches=1.0 if val_loader is not None else 0,
        num_sanity_val_steps=0, log_every_n_steps=10, enable_model_summary=False,
        enable_checkpointing=bool(every), enable_progress_bar=bar, callbacks=progress_cbs, fast_dev_run=fast_dev_run,
    )
    t0 = time.perf_counter()
    try:
        trainer.fit(module, train_loader, val_loader, ckpt_path=resume)
    except BaseException:
        tlog.finish(failed=True)
        raise
    train_time = time.perf_counter() - t0
    tlog.finish()
    net = module.net.cpu().eval().to(memory_format=torch.contiguous_format)  # saved and exported as usual
    errors = geometry_errors(net, val_ds) if val_ds is not None else {}
    info = {
        "format": GEOMETRY_FORMAT,
        "network": g["network"], "view_size": list(g["view_size"]), "margin": float(g["margin"]),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "errors": errors, "global_step": int(trainer.global_step), "train_time_s": round(train_time, 1),
        "n_train_frames": len(train_ds), "n_val_frames": 0 if val_ds is None else len(val_ds),
        "device": str(module.device), "config": g,
    }
    path = out / "geometry.pt"
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    atomic_write(path, lambda fh: torch.save({**info, "state_dict": state}, fh))
    write_json(out / "geometry.json", info)
    return {"path": str(path), **info}
