"""Data for the translation: sim frames from a render dataset and a folder of real frames.

Both domains go through the one shared preprocessing function
(:func:`perception.core.preprocess.preprocess`: undistort, crop, resize into the network view),
sim frames with the dataset's nominal calibration, real frames with the user's. The sim
segmentation is mapped through the same remap with nearest-neighbour sampling
(:func:`perception.core.preprocess.preprocess_labels`). Preprocessed frames are held in memory as ``uint8``;
augmentations (random crop, horizontal flip, small colour jitter, with kornia) run after
the batch reaches the training device (:meth:`AdaptDataModule.on_after_batch_transfer`).

Batches are dicts: ``"sim"`` ``(B, 3, H, W)``, ``"seg"`` ``(B, H, W)`` (dataset labels,
0 table, 1 bin, 2 distractor, 3+i object i) and ``"real"`` ``(B, 3, H, W)``; after the
transfer hook the images are float in ``[-1, 1]`` (``IMAGE_MEAN`` / ``IMAGE_STD``) and
``seg`` is ``int64``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kornia.augmentation as KA
import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from adaptation.images import iter_real_frames
from conf import policy_default
from perception.core.calibration import Calibration, load_calibration
from perception.core.geometry import NetworkView, make_view
from perception.core.preprocess import IMAGE_MEAN, IMAGE_STD, preprocess, preprocess_labels
from sim_render.reader import SimFrameDataset

__all__ = [
    "SimDataError",
    "open_sim_dataset",
    "load_sim_view",
    "load_real_view",
    "to_float",
    "to_uint8",
    "UnpairedDataset",
    "ValDataset",
    "AdaptDataModule",
]

log = logging.getLogger(__name__)


class SimDataError(ValueError):
    """The sim dataset folder is missing or cannot be read."""


# --------------------------------------------------------------------------- preprocessing
def open_sim_dataset(sim_dir: str | Path) -> Any:
    """Open a render dataset (``sim_render.reader.SimFrameDataset``) for rgb and seg."""
    root = Path(sim_dir)
    if not root.is_dir():
        raise SimDataError(f"sim dataset folder {root} does not exist; render one with sim2real-render output_dir=DIR")

    return SimFrameDataset(root, fields=("rgb", "seg"), verify=False)


def load_sim_view(ds: Any, view: NetworkView, indices: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Preprocess sim frames and their labels into the view.

    Returns:
        ``(N, H, W, 3)`` uint8 RGB and ``(N, H, W)`` uint8 labels.
    """
    idx = range(len(ds)) if indices is None else indices
    rgbs, segs = [], []
    for i in idx:
        item = ds[i]
        # A table view is warped with the camera that took the frame, as the policy's data is.
        calib = item["camera"] if view.is_table else ds.calibration
        rgbs.append(preprocess(item["rgb"], calib, view))
        segs.append(preprocess_labels(np.asarray(item["seg"]), calib, view).astype(np.uint8))
    W, H = view.size
    if not rgbs:
        return np.zeros((0, H, W, 3), np.uint8), np.zeros((0, H, W), np.uint8)
    return np.stack(rgbs), np.stack(segs)


def load_real_view(real_dir: str | Path, calib: Calibration, view: NetworkView) -> tuple[np.ndarray, list[Path]]:
    """Read, check and preprocess every real frame; ``(N, H, W, 3)`` uint8 and the paths."""
    frames, paths = [], []
    for path, raw in iter_real_frames(real_dir, calib):
        frames.append(preprocess(raw, calib, view))
        paths.append(path)
    return np.stack(frames), paths


def to_float(x: torch.Tensor) -> torch.Tensor:
    """``uint8`` images ``(..., 3, H, W)`` -> float normalised with ``IMAGE_MEAN`` / ``IMAGE_STD``."""
    mean = torch.tensor(IMAGE_MEAN, device=x.device).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD, device=x.device).view(3, 1, 1)
    return (x.float() / 255.0 - mean) / std


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_float`, rounded and clamped to ``uint8``."""
    mean = torch.tensor(IMAGE_MEAN, device=x.device).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD, device=x.device).view(3, 1, 1)
    return ((x * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8)


# --------------------------------------------------------------------------- datasets
def _chw(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


class UnpairedDataset(Dataset):
    """Sim frames (with labels) and real frames, unpaired.

    Item ``i`` holds sim frame ``i mod n_sim`` and real frame ``perm[i mod n_real]``; the
    length is ``max(n_sim, n_real)`` so an epoch visits every frame of both domains. The
    pairing carries no meaning (the CycleGAN losses of the two domains are separate) and is
    independent of the process, so a ``DistributedSampler`` gives each rank distinct pairs.
    """

    def __init__(self, sim: np.ndarray, seg: np.ndarray, real: np.ndarray, seed: int = 0) -> None:
        self.sim, self.seg, self.real = sim, seg, real
        self.real_perm = np.random.default_rng(seed).permutation(len(real))

    def __len__(self) -> int:
        return max(len(self.sim), len(self.real))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = i % len(self.sim)
        r = int(self.real_perm[i % len(self.real)])
        return {"sim": _chw(self.sim[s]), "seg": torch.from_numpy(self.seg[s]), "real": _chw(self.real[r])}


class ValDataset(Dataset):
    """Held-out frames: item ``i`` holds sim frame ``i mod n_sim`` and real frame ``i mod n_real``.

    The length is ``max(n_sim, n_real)``; ``idx`` and the flags ``sim_first`` / ``real_first``
    (this item is the first to hold its sim / real frame) let the metrics use every held-out
    frame exactly once, whatever the order, the process and the padding of a distributed sampler.
    """

    def __init__(self, sim: np.ndarray, seg: np.ndarray, real: np.ndarray) -> None:
        self.sim, self.seg, self.real = sim, seg, real

    def __len__(self) -> int:
        return max(len(self.sim), len(self.real))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, r = i % len(self.sim), i % len(self.real)
        return {
            "sim": _chw(self.sim[s]),
            "seg": torch.from_numpy(self.seg[s]),
            "real": _chw(self.real[r]),
            "idx": torch.tensor(i),
            "sim_first": torch.tensor(i < len(self.sim)),
            "real_first": torch.tensor(i < len(self.real)),
        }


# --------------------------------------------------------------------------- data module
class AdaptDataModule(pl.LightningDataModule):
    """Sim frames + a real-frames folder, a held-out split of both, kornia augmentations.

    Args:
        sim_dir: render dataset folder (randomized profile).
        real_dir: folder of real camera frames (contract section 4).
        calibration: the user's calibration (real frames, the view); ``None`` = packaged default.
        image_size: ``(W, H)`` of the network view the translator works at.
        crop: ``(W, H)`` random training crop (equal to ``image_size`` for none).
        batch_size: per process.
        num_workers: DataLoader workers (0 is best on 2 cores: the data is in memory).
        val_fraction: fraction of real frames held out (at least 1, at most ``val_frames``).
        val_frames: cap on the held-out real frames.
        sim_val_frames: cap on the held-out sim frames (at most a fifth of them).
        flip: random horizontal flips (both domains alike).
        jitter: strength of the colour jitter (brightness, contrast, saturation; hue / 4).
        seed: fixes the splits.
        view: the network view's spec (``{"kind": "table" | "camera", ...}``,
            :func:`perception.core.geometry.make_view`); ``None``: the policy's (``conf/policy/default.yaml``).
    """

    def __init__(
        self,
        sim_dir: str | Path,
        real_dir: str | Path,
        calibration: Calibration | str | Path | None = None,
        image_size: Sequence[int] = (96, 96),
        crop: Sequence[int] | None = None,
        batch_size: int = 4,
        num_workers: int = 0,
        val_fraction: float = 0.2,
        val_frames: int = 64,
        sim_val_frames: int = 64,
        flip: bool = True,
        jitter: float = 0.05,
        seed: int = 0,
        view: dict | None = None,
    ) -> None:
        super().__init__()
        self.calib = calibration if isinstance(calibration, Calibration) else load_calibration(calibration)
        self.sim_dir, self.real_dir = Path(sim_dir), Path(real_dir)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        if self.image_size[0] % 4 or self.image_size[1] % 4:
            raise ValueError(f"image_size {list(self.image_size)} must be multiples of 4 (the generators downsample x4)")
        self.crop = self.image_size if crop is None else (int(crop[0]), int(crop[1]))
        if self.crop[0] > self.image_size[0] or self.crop[1] > self.image_size[1] or self.crop[0] % 4 or self.crop[1] % 4:
            raise ValueError(f"crop {list(self.crop)} must be multiples of 4 and fit in image_size {list(self.image_size)}")
        spec = dict(view or policy_default("view"))  # the policy's view: the translator serves what it consumes
        self.view = make_view(self.calib, self.image_size, str(spec.pop("kind")), **spec)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.val_fraction = float(val_fraction)
        self.val_frames = int(val_frames)
        self.sim_val_frames = int(sim_val_frames)
        self.seed = int(seed)
        self.flip = bool(flip)
        self.jitter = float(jitter)
        self._ready = False
        self._aug: dict[str, torch.nn.Module] | None = None

    # -------------------------------------------------------------- loading
    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        # real frames first: the user's folder is the likelier one to be wrong
        real, paths = load_real_view(self.real_dir, self.calib, self.view)
        ds = open_sim_dataset(self.sim_dir)
        n_sim = len(ds)
        if n_sim == 0:
            raise SimDataError(f"sim dataset {self.sim_dir} holds no frames; render some with sim2real-render")
        if ds.calibration.digest() != self.calib.digest():
            log.warning(
                "the sim dataset %s was rendered from another calibration than the one given; "
                "the view follows the given calibration", self.sim_dir,
            )
        sim, seg = load_sim_view(ds, self.view)
        self.real_paths = paths
        rng = np.random.default_rng(self.seed)
        # held-out real frames: the distance is measured on frames the discriminator never saw
        n_real = len(real)
        if n_real < 2:
            log.warning("real_dir %s holds a single frame; it is used for training and validation", self.real_dir)
            r_tr, r_val = np.arange(n_real), np.arange(n_real)
        else:
            n_val = int(min(self.val_frames, max(1, round(n_real * self.val_fraction)), n_real - 1))
            perm = rng.permutation(n_real)
            r_val, r_tr = np.sort(perm[:n_val]), np.sort(perm[n_val:])
        if n_sim < 2:
            s_tr, s_val = np.arange(n_sim), np.arange(n_sim)
        else:
            n_val = int(min(self.sim_val_frames, max(1, n_sim // 5)))
            perm = rng.permutation(n_sim)
            s_val, s_tr = np.sort(perm[:n_val]), np.sort(perm[n_val:])
        self.sim_train, self.seg_train = sim[s_tr], seg[s_tr]
        self.sim_val, self.seg_val = sim[s_val], seg[s_val]
        self.real_train, self.real_val = real[r_tr], real[r_val]
        self.real_val_paths = [paths[i] for i in r_val]
        self._ready = True
        log.info(
            "adaptation data: %d sim frames (%d held out), %d real frames (%d held out), view %dx%d",
            n_sim, len(s_val), n_real, len(r_val), *self.image_size,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "sim_dir": str(self.sim_dir),
            "real_dir": str(self.real_dir),
            "n_sim_train": int(len(self.sim_train)),
            "n_sim_val": int(len(self.sim_val)),
            "n_real_train": int(len(self.real_train)),
            "n_real_val": int(len(self.real_val)),
            "image_size": list(self.image_size),
            "crop": list(self.crop),
        }

    def train_dataloader(self) -> DataLoader:
        ds = UnpairedDataset(self.sim_train, self.seg_train, self.real_train, seed=self.seed)
        bs = min(self.batch_size, len(ds))
        return DataLoader(
            ds, batch_size=bs, shuffle=True, drop_last=True, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        ds = ValDataset(self.sim_val, self.seg_val, self.real_val)
        return DataLoader(ds, batch_size=max(self.batch_size, 16), shuffle=False, num_workers=0)

    def probe_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Training sim frames ``(N, 3, H, W)`` float and labels ``(N, H, W)`` for the content probe."""
        return to_float(torch.from_numpy(self.sim_train).permute(0, 3, 1, 2)), torch.from_numpy(self.seg_train).long()

    # -------------------------------------------------------------- augmentation
    def _augmenters(self, device: torch.device) -> dict[str, torch.nn.Module]:
        if self._aug is None:
            geo: list[torch.nn.Module] = []
            if self.crop != self.image_size:
                geo.append(KA.RandomCrop((self.crop[1], self.crop[0])))
            if self.flip:
                geo.append(KA.RandomHorizontalFlip())
            j = self.jitter
            self._aug = {
                "geo_sim": KA.AugmentationSequential(*geo, data_keys=["input", "mask"]) if geo else None,
                "geo_real": KA.AugmentationSequential(*geo, data_keys=["input"]) if geo else None,
                "color": KA.ColorJiggle(j, j, j, j / 4, p=1.0) if j > 0 else None,
            }
        return {k: (v.to(device) if v is not None else None) for k, v in self._aug.items()}

    def augment(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Random crop + flip (sim frame and labels alike) and colour jitter, on float batches."""
        aug = self._augmenters(batch["sim"].device)
        sim, real, seg = batch["sim"], batch["real"], batch["seg"]
        if aug["geo_sim"] is not None:
            sim, seg_f = aug["geo_sim"](sim, seg[:, None].float())
            seg = seg_f[:, 0].round().long()
            real = aug["geo_real"](real)
        if aug["color"] is not None:
            sim = aug["color"]((sim + 1) / 2) * 2 - 1
            real = aug["color"]((real + 1) / 2) * 2 - 1
        return {"sim": sim.contiguous(), "seg": seg.contiguous(), "real": real.contiguous()}

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, dict) or "sim" not in batch:
            return batch
        out = {**batch, "sim": to_float(batch["sim"]), "seg": batch["seg"].long(), "real": to_float(batch["real"])}
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            out = {**out, **self.augment(out)}
        return out
