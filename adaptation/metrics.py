"""Measuring the translation without downloaded weights.

- :func:`sliced_wasserstein` — distribution distance between two image sets: the sliced
  Wasserstein distance (SWD) of 7x7 patches drawn from each level of a Laplacian pyramid
  (Karras et al. 2018, "Progressive growing of GANs", appendix D). The finest level holds
  texture and sensor noise, the coarsest colour and layout. Unlike the original, patches
  are normalised with the *reference* set's per-channel statistics only, so a global
  colour difference counts. Values are reported x1000, like the original.
- :func:`content_scores` — how well the objects of a frame are still found: the
  segmentation predicted by a *probe* (a small network trained here on raw sim frames
  with strong photometric augmentation, see :func:`train_probe`) against the sim
  segmentation: intersection-over-union of the object class and the fraction of object
  instances still found.

Images are ``(N, 3, H, W)`` float tensors in ``[-1, 1]`` unless stated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adaptation.networks import build
from sim_render.format import SEG_FIRST_OBJECT

__all__ = [
    "N_SEG_CLASSES",
    "OBJECT_CLASS",
    "seg_classes",
    "laplacian_pyramid",
    "sample_patches",
    "sliced_wasserstein",
    "content_scores",
    "photometric_augment",
    "train_probe",
    "predict_classes",
]

#: Classes of the content probe: the dataset's labels up to its first object (table or
#: background, bin, distractor), then every object as one class.
OBJECT_CLASS = SEG_FIRST_OBJECT
N_SEG_CLASSES = OBJECT_CLASS + 1


def seg_classes(seg: torch.Tensor) -> torch.Tensor:
    """Map dataset labels (0 table, 1 bin, 2 distractor, 3+i object i) to the 4 probe classes."""
    return seg.long().clamp(max=OBJECT_CLASS)


# --------------------------------------------------------------------------- distribution distance
_GAUSS = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0]) / 16.0


def _blur(x: torch.Tensor) -> torch.Tensor:
    k = _GAUSS.to(x)
    c = x.shape[1]
    x = F.pad(x, (2, 2, 2, 2), mode="reflect")
    x = F.conv2d(x, k.view(1, 1, 1, 5).expand(c, 1, 1, 5).contiguous(), groups=c)
    return F.conv2d(x, k.view(1, 1, 5, 1).expand(c, 1, 5, 1).contiguous(), groups=c)


def laplacian_pyramid(x: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Laplacian pyramid, finest first; the last level is the Gaussian residual.

    Shape:
        ``(N, C, H, W)`` -> ``levels`` tensors ``(N, C, H / 2**l, W / 2**l)``.
    """
    out = []
    cur = x
    for _ in range(levels - 1):
        down = _blur(cur)[:, :, ::2, ::2]
        up = F.interpolate(down, size=cur.shape[-2:], mode="bilinear", align_corners=False)
        out.append(cur - up)
        cur = down
    out.append(cur)
    return out


def sample_patches(x: torch.Tensor, n_per_image: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """``n_per_image`` random ``size x size`` patches per image as flat descriptors.

    Shape:
        ``(N, C, H, W)`` -> ``(N * n_per_image, C * size * size)``.
    """
    n, c, h, w = x.shape
    if h < size or w < size:
        raise ValueError(f"images of {w}x{h} are smaller than the {size}x{size} patches")
    ys = torch.randint(0, h - size + 1, (n, n_per_image), generator=gen)
    xs = torch.randint(0, w - size + 1, (n, n_per_image), generator=gen)
    ar = torch.arange(size)
    rows = (ys[:, :, None] + ar)[:, :, :, None]  # (n, k, s, 1)
    cols = (xs[:, :, None] + ar)[:, :, None, :]  # (n, k, 1, s)
    idx = torch.arange(n)[:, None, None, None]
    xc = x.detach().float().cpu()
    patches = xc.permute(0, 2, 3, 1)[idx, rows, cols]  # (n, k, s, s, C)
    return patches.reshape(n * n_per_image, size * size * c)


def _swd(a: torch.Tensor, b: torch.Tensor, n_dirs: int, repeats: int, gen: torch.Generator) -> float:
    m = min(len(a), len(b))
    if len(a) > m:
        a = a[torch.randperm(len(a), generator=gen)[:m]]
    if len(b) > m:
        b = b[torch.randperm(len(b), generator=gen)[:m]]
    total = 0.0
    for _ in range(repeats):
        dirs = torch.randn(a.shape[1], n_dirs, generator=gen)
        dirs /= dirs.norm(dim=0, keepdim=True)
        pa, _ = torch.sort(a @ dirs, dim=0)
        pb, _ = torch.sort(b @ dirs, dim=0)
        total += (pa - pb).abs().mean().item()
    return total / repeats


@torch.no_grad()
def sliced_wasserstein(
    x: torch.Tensor,
    ref: torch.Tensor,
    levels: int = 3,
    patch: int = 7,
    patches_per_image: int = 128,
    directions: int = 256,
    repeats: int = 4,
    seed: int = 0,
) -> dict[str, float]:
    """Multi-scale patch SWD between the image sets ``x`` and ``ref`` (x1000).

    Args:
        x: ``(N, 3, H, W)`` images, e.g. adapted frames.
        ref: ``(M, 3, H', W')`` reference images, e.g. held-out real frames.
        levels: Laplacian pyramid levels (finest first).
        patch: patch side in pixels at every level.
        patches_per_image: patches drawn per image and level.
        directions, repeats: random projections per repeat, and repeats.
        seed: fixes patches and projections, so equal inputs give equal values.

    Returns:
        ``{"mean": ..., "level0": ..., ...}``; level 0 is the finest (texture, noise), the
        last the coarsest (colour, layout).
    """
    gen = torch.Generator().manual_seed(seed)
    px = laplacian_pyramid(x.detach().float().cpu(), levels)
    pr = laplacian_pyramid(ref.detach().float().cpu(), levels)
    out: dict[str, float] = {}
    for lvl, (lx, lr) in enumerate(zip(px, pr)):
        size = min(patch, lx.shape[-1], lx.shape[-2], lr.shape[-1], lr.shape[-2])
        dx = sample_patches(lx, patches_per_image, size, gen)
        dr = sample_patches(lr, patches_per_image, size, gen)
        c = lx.shape[1]
        # per-channel statistics of the reference set, applied to both sets
        dr_c = dr.view(len(dr), size * size, c)
        mean = dr_c.mean(dim=(0, 1))
        std = dr_c.std(dim=(0, 1)).clamp_min(1e-3)
        dx = ((dx.view(len(dx), size * size, c) - mean) / std).view(len(dx), -1)
        dr = ((dr_c - mean) / std).view(len(dr), -1)
        out[f"level{lvl}"] = 1e3 * _swd(dx, dr, directions, repeats, gen)
    out["mean"] = float(np.mean([out[f"level{i}"] for i in range(levels)]))
    return out


# --------------------------------------------------------------------------- content score
@torch.no_grad()
def content_scores(pred: torch.Tensor, seg: torch.Tensor, min_pixels: int = 12) -> dict[str, float]:
    """Agreement of predicted classes with the sim segmentation.

    Args:
        pred: ``(N, H, W)`` predicted probe classes (see :data:`N_SEG_CLASSES`).
        seg: ``(N, H, W)`` dataset labels (0 table, 1 bin, 2 distractor, 3+i object i).
        min_pixels: object instances smaller than this are not counted in the recall.

    Returns:
        ``object_iou``: IoU of the grasp-object class over the whole set;
        ``mean_iou``: mean IoU over the classes present;
        ``instance_recall``: fraction of object instances of which at least half the pixels
        are predicted as an object or distractor (an object that vanished or turned into
        table scores 0).
    """
    pred = pred.long().cpu()
    seg = seg.long().cpu()
    cls = seg_classes(seg)
    ious = []
    obj_iou = float("nan")
    for c in range(N_SEG_CLASSES):
        p, t = pred == c, cls == c
        union = (p | t).sum().item()
        if t.sum().item() == 0:
            continue
        iou = (p & t).sum().item() / max(union, 1)
        ious.append(iou)
        if c == OBJECT_CLASS:
            obj_iou = iou
    thing = pred >= 2
    found, total = 0, 0
    for i in range(len(seg)):
        labels = torch.unique(seg[i])
        for lab in labels[labels >= OBJECT_CLASS].tolist():
            m = seg[i] == lab
            n = int(m.sum())
            if n < min_pixels:
                continue
            total += 1
            found += int(thing[i][m].float().mean().item() >= 0.5)
    return {
        "object_iou": obj_iou,
        "mean_iou": float(np.mean(ious)) if ious else float("nan"),
        "instance_recall": found / total if total else float("nan"),
    }


def photometric_augment(x: torch.Tensor, gen: torch.Generator | None = None, strength: float = 1.0) -> torch.Tensor:
    """Strong per-image colour, contrast, blur and noise changes (no geometry).

    Used to train the content probe and the content seg head so that they find objects
    by shape and contrast, not by the sim palette.

    Shape:
        ``(N, 3, H, W)`` in ``[-1, 1]`` -> same.
    """
    n = x.shape[0]
    dev = x.device

    def rnd(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen).to(dev)

    y = (x + 1) / 2
    # random colour mixing (hue rotations, channel swaps in part), per-channel gain and offset
    mix = torch.eye(3, device=dev) + strength * 0.25 * torch.randn(n, 3, 3, generator=gen).to(dev)
    y = torch.einsum("nij,njhw->nihw", mix, y)
    gain = 1 + strength * 0.6 * (rnd(n, 3, 1, 1) - 0.5)
    off = strength * 0.4 * (rnd(n, 3, 1, 1) - 0.5)
    y = y * gain + off
    mean = y.mean(dim=(1, 2, 3), keepdim=True)
    contrast = 1 + strength * 0.8 * (rnd(n, 1, 1, 1) - 0.5)
    y = (y - mean) * contrast + mean
    # saturation, down to grey for some images
    grey = y.mean(dim=1, keepdim=True)
    sat = (1 + strength * 0.8 * (rnd(n, 1, 1, 1) - 0.5)) * (rnd(n, 1, 1, 1) > 0.15 * strength).float()
    y = grey + (y - grey) * sat
    # blur half the images a little, add sensor-like noise
    blur = rnd(n, 1, 1, 1) < 0.5
    y = torch.where(blur, _blur(y), y)
    y = y + strength * 0.06 * rnd(n, 1, 1, 1) * torch.randn(y.shape, generator=gen).to(dev)
    return (y.clamp(0, 1) * 2 - 1).contiguous()


def train_probe(
    images: torch.Tensor,
    seg: torch.Tensor,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 3e-3,
    width: int = 16,
    crop: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Train the content probe: a :class:`~adaptation.networks.SegHead` on raw sim frames.

    Args:
        images: ``(N, 3, H, W)`` sim frames in ``[-1, 1]``.
        seg: ``(N, H, W)`` dataset labels.
        steps, batch_size, lr, width: training length and size.
        crop: side of the random square crops it trains on (``None``: whole frames).
        seed: fixes the initialisation, the batches and the augmentation.

    Returns:
        The probe in eval mode, on ``device``, with ``requires_grad`` off.
    """

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = build("seg_head", "small", n_classes=N_SEG_CLASSES, width=width).to(device)
    opt = torch.optim.Adam(probe.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.15)
    cls_all = seg_classes(seg)
    # class weights: objects are small, weight classes by inverse sqrt frequency
    counts = torch.bincount(cls_all.flatten(), minlength=N_SEG_CLASSES).float().clamp_min(1)
    weights = (counts.sum() / counts).sqrt()
    weights = (weights / weights.mean()).to(device)
    probe.train()
    for _ in range(steps):
        idx = torch.randint(0, len(images), (min(batch_size, len(images)),), generator=gen)
        x = images[idx].to(device)
        y = cls_all[idx].to(device)
        h, w = x.shape[-2:]
        if crop is not None and crop < min(h, w):
            i0 = int(torch.randint(0, (h - crop) // 4 + 1, (1,), generator=gen)) * 4
            j0 = int(torch.randint(0, (w - crop) // 4 + 1, (1,), generator=gen)) * 4
            x, y = x[..., i0 : i0 + crop, j0 : j0 + crop], y[..., i0 : i0 + crop, j0 : j0 + crop]
        if torch.rand(1, generator=gen).item() < 0.5:
            x, y = x.flip(-1), y.flip(-1)
        x = photometric_augment(x, gen)
        loss = F.cross_entropy(probe(x), y, weight=weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    probe.eval()
    for p in probe.parameters():
        p.requires_grad_(False)
    return probe


@torch.no_grad()
def predict_classes(probe: nn.Module, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Probe classes ``(N, H, W)`` of images ``(N, 3, H, W)``, in batches."""
    outs = []
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size]
        dev = next(probe.parameters()).device
        outs.append(probe(x.to(dev)).argmax(1).cpu())
    return torch.cat(outs) if outs else torch.zeros((0,) + tuple(images.shape[-2:]), dtype=torch.long)


def summarize(values: Sequence[float]) -> float:
    """Mean ignoring NaN (NaN when all are NaN)."""
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")
