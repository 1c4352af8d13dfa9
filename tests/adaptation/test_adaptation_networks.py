"""Networks: the registry, shapes, the fast generator's identity start and its size."""

from __future__ import annotations

import pytest
import torch

from adaptation.networks import GENERATORS, build, count_parameters, receptive_field


def test_unknown_name_lists_known_ones():
    with pytest.raises(KeyError, match=r"unknown generator 'nope'.*fast.*resnet9"):
        build("generator", "nope")
    with pytest.raises(KeyError, match="known kinds"):
        build("gizmo", "fast")


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generator_shape_and_range(name):
    torch.manual_seed(0)
    kw = {"ngf": 8, "n_blocks": 1} if name == "resnet9" else {}
    g = build("generator", name, **kw)
    x = torch.rand(2, 3, 32, 48) * 2 - 1
    y = g(x)
    assert y.shape == x.shape
    assert torch.isfinite(y).all() and y.abs().max() <= 1


def test_fast_generator_starts_as_identity_and_is_small():
    g = build("generator", "fast")
    x = torch.rand(2, 3, 64, 64) * 1.8 - 0.9
    with torch.no_grad():
        y = g(x)
    assert (y - x).abs().max() < 0.05
    assert 0.05e6 < count_parameters(g) < 0.4e6
    assert count_parameters(build("generator", "resnet9")) > 11e6


def test_patch_discriminator_output():
    d = build("discriminator", "patch", ndf=16, n_layers=3)
    out = d(torch.zeros(2, 3, 64, 64))
    assert out.shape == (2, 1, 6, 6)
    assert receptive_field(3) == 70


def test_seg_head_shape():
    h = build("seg_head", "small", n_classes=4)
    assert h(torch.zeros(1, 3, 32, 40)).shape == (1, 4, 32, 40)
