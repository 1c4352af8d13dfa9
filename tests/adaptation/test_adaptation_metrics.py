"""The distribution distance and the content score behave as measures should."""

from __future__ import annotations

import torch

from adaptation.metrics import content_scores, sliced_wasserstein
from adaptation.module import content_mask, masked_pmse


def _images(seed, n=8, shift=0.0, noise=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 1, 1, generator=g) * 0.5 - 0.25
    x = x + torch.linspace(-0.5, 0.5, 32).view(1, 1, 32, 1)  # a shared layout
    x = x.expand(n, 3, 32, 32).clone()
    x[:, :, 10:20, 10:20] += 0.4
    x += noise * torch.randn(x.shape, generator=g)
    x[:, 0] += shift
    return x.clamp(-1, 1)


def test_swd_small_on_same_distribution_and_grows_with_differences():
    ref = _images(0)
    kw = {"patches_per_image": 32, "directions": 64, "repeats": 1}
    same = sliced_wasserstein(ref, ref, **kw)  # different random patches: the noise floor
    near = sliced_wasserstein(_images(1), ref, **kw)
    colour = sliced_wasserstein(_images(1, shift=0.5), ref, **kw)
    noisy = sliced_wasserstein(_images(1, noise=0.1), ref, **kw)
    assert same["mean"] <= near["mean"]
    assert colour["level2"] > 3 * near["level2"]  # colour lives in the coarsest level
    assert noisy["level0"] > 3 * near["level0"]  # sensor noise in the finest
    assert sliced_wasserstein(_images(1), ref, **kw) == near  # deterministic


def _scene():
    seg = torch.zeros(1, 24, 24, dtype=torch.long)
    seg[0, :2] = 1  # bin wall
    seg[0, 4:10, 4:10] = 3  # object 0
    seg[0, 14:20, 14:20] = 4  # object 1
    seg[0, 4:8, 16:20] = 2  # distractor
    return seg


def test_content_scores_perfect_and_vanished():
    seg = _scene()
    perfect = seg.clamp(max=3)
    s = content_scores(perfect, seg)
    assert s["object_iou"] == 1.0 and s["instance_recall"] == 1.0 and s["mean_iou"] == 1.0
    vanished = perfect.clone()
    vanished[0, 14:20, 14:20] = 0
    s = content_scores(vanished, seg)
    assert s["instance_recall"] == 0.5 and s["object_iou"] == 0.5


def test_masked_pmse_allows_recolouring_not_erasing():
    seg = _scene()
    sim = torch.full((1, 3, 24, 24), -0.5)
    sim[:, :, 4:10, 4:10] = 0.6
    sim[:, :, 14:20, 14:20] = 0.3
    mask = content_mask(seg, dilate=2)
    recoloured = sim + torch.tensor([0.2, -0.1, 0.05]).view(1, 3, 1, 1)
    erased = sim.clone()
    erased[:, :, 14:20, 14:20] = -0.5
    assert masked_pmse(recoloured, sim, mask) < 1e-6
    assert masked_pmse(erased, sim, mask) > 0.05
