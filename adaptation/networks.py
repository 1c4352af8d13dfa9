"""Plain ``nn.Module`` networks of the sim->real translation, registered by name.

Generators map ``(N, 3, H, W)`` images normalised to ``[-1, 1]`` (see
:data:`perception.core.preprocess.IMAGE_MEAN` / ``IMAGE_STD``) to the same layout and range.

- ``resnet9``: the reference CycleGAN generator (Zhu et al. 2017): 64 filters, two
  stride-2 downsamplings, 9 residual blocks, 11.4M parameters.
- ``fast``: the default, sized for a 2-core CPU. It goes to 1/4 resolution in two
  cheap steps (space-to-depth, then a strided convolution), runs depthwise-separable
  residual blocks there, and predicts a *residual on the input*:
  ``y = tanh(atanh(x) + delta)``. An untrained ``fast`` generator is the identity, so
  object outlines pass through at full resolution from the first step (the content
  the grasp policy needs) and the network only learns what differs between the domains.
  Optional per-pixel noise injection lets it imitate sensor noise.

Discriminators are PatchGANs (Isola et al. 2017): ``patch`` (the reference 70x70
receptive field, ``ndf=64, n_layers=3``) and the same class with fewer filters.
``seg_head`` is a small segmentation network used by the content loss and the
content score (:mod:`adaptation.metrics`).

Use :func:`build` with a registry kind and name; unknown names raise with the list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ResnetGenerator",
    "FastGenerator",
    "PatchDiscriminator",
    "SegHead",
    "GENERATORS",
    "DISCRIMINATORS",
    "SEG_HEADS",
    "register",
    "build",
    "build_generator",
    "build_discriminator",
    "count_parameters",
]

GENERATORS: dict[str, Callable[..., nn.Module]] = {}
DISCRIMINATORS: dict[str, Callable[..., nn.Module]] = {}
SEG_HEADS: dict[str, Callable[..., nn.Module]] = {}
_KINDS = {"generator": GENERATORS, "discriminator": DISCRIMINATORS, "seg_head": SEG_HEADS}


def register(kind: str, name: str) -> Callable:
    """Class decorator adding a network to the registry ``kind`` under ``name``."""

    def deco(cls: Callable) -> Callable:
        table = _KINDS[kind]
        if name in table:
            raise ValueError(f"{kind} '{name}' is registered twice")
        table[name] = cls
        return cls

    return deco


def build(kind: str, name: str, **kwargs: Any) -> nn.Module:
    """Instantiate the network ``name`` of ``kind`` (generator, discriminator, seg_head).

    Raises:
        KeyError: for an unknown kind or name, listing the known ones.
    """
    if kind not in _KINDS:
        raise KeyError(f"unknown network kind '{kind}'; known kinds: {sorted(_KINDS)}")
    table = _KINDS[kind]
    if name not in table:
        raise KeyError(f"unknown {kind} '{name}'; known {kind}s: {sorted(table)}")
    return table[name](**kwargs)


def build_generator(name: str, **kwargs: Any) -> nn.Module:
    return build("generator", name, **kwargs)


def build_discriminator(name: str, **kwargs: Any) -> nn.Module:
    return build("discriminator", name, **kwargs)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=False, track_running_stats=False)
    if kind == "instance_affine":
        return nn.InstanceNorm2d(channels, affine=True, track_running_stats=False)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise KeyError(f"unknown norm '{kind}'; known: ['group', 'instance', 'instance_affine', 'none']")


# --------------------------------------------------------------------------- reference generator
class _ResnetBlock(nn.Module):
    def __init__(self, dim: int, norm: str) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(dim, dim, 3, bias=norm == "none"),
            _norm(norm, dim),
            nn.ReLU(True),
            nn.ReflectionPad2d(1),
            nn.Conv2d(dim, dim, 3, bias=norm == "none"),
            _norm(norm, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


@register("generator", "resnet9")
class ResnetGenerator(nn.Module):
    """The reference CycleGAN generator ``c7s1-64, d128, d256, R256 x n_blocks, u128, u64, c7s1-3``.

    Args:
        ngf: filters of the first layer (64 in the reference).
        n_blocks: residual blocks at 1/4 resolution (9 in the reference).
        norm: ``instance`` (the reference) or another :func:`_norm` kind.

    Shape:
        ``(N, 3, H, W) -> (N, 3, H, W)``, ``H`` and ``W`` multiples of 4, values in ``[-1, 1]``.
    """

    def __init__(self, ngf: int = 64, n_blocks: int = 9, norm: str = "instance", in_ch: int = 3, out_ch: int = 3) -> None:
        super().__init__()
        bias = norm == "none"
        layers: list[nn.Module] = [
            nn.ReflectionPad2d(3),
            nn.Conv2d(in_ch, ngf, 7, bias=bias),
            _norm(norm, ngf),
            nn.ReLU(True),
        ]
        ch = ngf
        for _ in range(2):
            layers += [nn.Conv2d(ch, ch * 2, 3, stride=2, padding=1, bias=bias), _norm(norm, ch * 2), nn.ReLU(True)]
            ch *= 2
        layers += [_ResnetBlock(ch, norm) for _ in range(n_blocks)]
        for _ in range(2):
            layers += [
                nn.ConvTranspose2d(ch, ch // 2, 3, stride=2, padding=1, output_padding=1, bias=bias),
                _norm(norm, ch // 2),
                nn.ReLU(True),
            ]
            ch //= 2
        layers += [nn.ReflectionPad2d(3), nn.Conv2d(ch, out_ch, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)
        # outputs of: the stem, each downsampling, the middle residual block
        self._feature_ids = (3, 6, 9, 9 + (n_blocks + 1) // 2)

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Encoder features (for CUT-style PatchNCE): stem, 1/2, 1/4 resolution, mid-blocks."""
        feats = []
        for i, layer in enumerate(self.model):
            x = layer(x)
            if i in self._feature_ids:
                feats.append(x)
            if i >= self._feature_ids[-1]:
                break
        return feats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


# --------------------------------------------------------------------------- fast generator
class _SeparableBlock(nn.Module):
    """Residual ``dw3x3 -> norm -> pw expand -> act -> pw project`` (MobileNetV2-like)."""

    def __init__(self, dim: int, expansion: int, norm: str) -> None:
        super().__init__()
        hidden = dim * expansion
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False)
        self.norm = _norm(norm, dim)
        self.pw1 = nn.Conv2d(dim, hidden, 1)
        self.act = nn.LeakyReLU(0.2, True)
        self.pw2 = nn.Conv2d(hidden, dim, 1)
        nn.init.zeros_(self.pw2.weight)  # each block starts as the identity
        nn.init.zeros_(self.pw2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(self.act(self.pw1(self.norm(self.dw(x)))))


@register("generator", "fast")
class FastGenerator(nn.Module):
    """A residual-on-input generator for CPU training (about 0.1-0.3M parameters).

    ``x (3, H, W)`` -> space-to-depth ``(12, H/2, W/2)`` -> conv3x3 ``ngf`` -> strided conv3x3
    ``2 ngf`` at 1/4 resolution -> ``n_blocks`` separable residual blocks -> bilinear x2 + conv3x3
    ``ngf`` (+ skip from 1/2 res) -> bilinear x2 -> conv3x3 on ``[features, x]`` -> ``delta``;
    ``y = tanh(atanh(x) + delta)``.

    Args:
        ngf: channels at 1/2 resolution (1/4 resolution has ``2 * ngf``).
        n_blocks: separable residual blocks at 1/4 resolution.
        expansion: hidden width factor of the blocks.
        norm: normalisation in the blocks and the encoder.
        noise: learnable per-channel scale of Gaussian noise added at full resolution
            (lets the generator imitate sensor noise; the scale starts at 0).
        residual: predict a residual on the input (True) or a free image (False).

    Shape:
        ``(N, 3, H, W) -> (N, 3, H, W)``, ``H`` and ``W`` multiples of 4, values in ``[-1, 1]``.
    """

    def __init__(
        self,
        ngf: int = 32,
        n_blocks: int = 6,
        expansion: int = 2,
        norm: str = "instance_affine",
        noise: bool = True,
        residual: bool = True,
        out_features: int = 16,
        in_ch: int = 3,
        out_ch: int = 3,
    ) -> None:
        super().__init__()
        self.residual = residual and in_ch == out_ch
        c1, c2 = ngf, ngf * 2
        self.stem = nn.Sequential(
            nn.PixelUnshuffle(2),
            nn.Conv2d(in_ch * 4, c1, 3, padding=1),
            _norm(norm, c1),
            nn.LeakyReLU(0.2, True),
        )
        self.down = nn.Sequential(
            nn.Conv2d(c1, c2, 3, stride=2, padding=1),
            _norm(norm, c2),
            nn.LeakyReLU(0.2, True),
        )
        self.blocks = nn.Sequential(*[_SeparableBlock(c2, expansion, norm) for _ in range(n_blocks)])
        self.up1 = nn.Sequential(
            nn.Conv2d(c2 + c1, c1, 1),
            nn.LeakyReLU(0.2, True),
            nn.Conv2d(c1, c1, 3, padding=1, groups=c1),
        )
        self.up2 = nn.Sequential(
            nn.Conv2d(c1, out_features, 1),
            nn.LeakyReLU(0.2, True),
        )
        self.head = nn.Conv2d(out_features + in_ch, out_ch, 3, padding=1, padding_mode="replicate")
        if self.residual:
            nn.init.normal_(self.head.weight, std=1e-3)
            nn.init.zeros_(self.head.bias)
        self.noise_scale = nn.Parameter(torch.zeros(1, out_features, 1, 1)) if noise else None

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Encoder features ``[1/2 res, 1/4 res, after the blocks]`` (for CUT-style losses)."""
        h1 = self.stem(x)
        h2 = self.down(h1)
        return [h1, h2, self.blocks(h2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.stem(x)
        h = self.blocks(self.down(h1))
        h = F.interpolate(h, size=h1.shape[-2:], mode="bilinear", align_corners=False)
        h = self.up1(torch.cat([h, h1], 1))
        h = F.interpolate(h, size=x.shape[-2:], mode="bilinear", align_corners=False)
        h = self.up2(h)
        if self.noise_scale is not None:
            h = h + self.noise_scale * torch.randn_like(h[:, :1])
        delta = self.head(torch.cat([h, x], 1))
        if self.residual:
            return torch.tanh(torch.atanh(x.clamp(-0.995, 0.995)) + delta)
        return torch.tanh(delta)


# --------------------------------------------------------------------------- discriminators
@register("discriminator", "patch")
class PatchDiscriminator(nn.Module):
    """PatchGAN: a fully convolutional classifier of overlapping patches.

    With ``n_layers=3`` each output sees a 70x70 input patch (the reference); with 2,
    34x34. ``ndf=64`` is the reference; ``ndf=16-32`` is enough on 64-128 px crops.

    Shape:
        ``(N, 3, H, W) -> (N, 1, H', W')`` raw scores (least-squares GAN targets 1 / 0).
    """

    def __init__(self, ndf: int = 64, n_layers: int = 3, norm: str = "instance", in_ch: int = 3) -> None:
        super().__init__()
        bias = norm == "none"
        layers: list[nn.Module] = [nn.Conv2d(in_ch, ndf, 4, stride=2, padding=1), nn.LeakyReLU(0.2, True)]
        mult = 1
        for n in range(1, n_layers):
            prev, mult = mult, min(2**n, 8)
            layers += [
                nn.Conv2d(ndf * prev, ndf * mult, 4, stride=2, padding=1, bias=bias),
                _norm(norm, ndf * mult),
                nn.LeakyReLU(0.2, True),
            ]
        prev, mult = mult, min(2**n_layers, 8)
        layers += [
            nn.Conv2d(ndf * prev, ndf * mult, 4, stride=1, padding=1, bias=bias),
            _norm(norm, ndf * mult),
            nn.LeakyReLU(0.2, True),
            nn.Conv2d(ndf * mult, 1, 4, stride=1, padding=1),
        ]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


# --------------------------------------------------------------------------- segmentation head
@register("seg_head", "small")
class SegHead(nn.Module):
    """A small encoder-decoder predicting per-pixel classes of a frame (about 0.1M parameters).

    It works at 1/2 and 1/4 resolution (objects are 20-40 px across in a 96 px view) and
    upsamples its logits. Classes (see :func:`adaptation.metrics.seg_classes`):
    0 table/background, 1 bin, 2 distractor, 3 grasp object.

    Shape:
        ``(N, 3, H, W) -> (N, n_classes, H, W)`` logits, ``H, W`` multiples of 4.
    """

    def __init__(self, n_classes: int = 4, width: int = 16, in_ch: int = 3) -> None:
        super().__init__()
        w = width
        g = min(4, w)
        self.enc1 = nn.Sequential(
            nn.Conv2d(in_ch, w, 3, stride=2, padding=1), nn.GroupNorm(g, w), nn.ReLU(True),
            nn.Conv2d(w, w, 3, padding=1), nn.GroupNorm(g, w), nn.ReLU(True),
        )
        self.enc2 = nn.Sequential(
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.GroupNorm(g, 2 * w), nn.ReLU(True),
            nn.Conv2d(2 * w, 2 * w, 3, padding=2, dilation=2), nn.GroupNorm(g, 2 * w), nn.ReLU(True),
            nn.Conv2d(2 * w, 2 * w, 3, padding=4, dilation=4), nn.GroupNorm(g, 2 * w), nn.ReLU(True),
        )
        self.dec = nn.Sequential(
            nn.Conv2d(3 * w, w, 3, padding=1), nn.GroupNorm(g, w), nn.ReLU(True), nn.Conv2d(w, n_classes, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        up = F.interpolate(e2, size=e1.shape[-2:], mode="bilinear", align_corners=False)
        logits = self.dec(torch.cat([up, e1], 1))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def receptive_field(n_layers: int) -> int:
    """Receptive field in input pixels of a :class:`PatchDiscriminator` output."""
    rf = 1
    for k, s in [(4, 1), (4, 1)] + [(4, 2)] * n_layers:
        rf = (rf - 1) * s + k
    return rf


def flops_per_pixel(module: nn.Module, size: tuple[int, int] = (64, 64)) -> float:
    """Multiply-accumulates per input pixel of a conv network (counted with hooks)."""
    macs = 0

    def hook(m: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        nonlocal macs
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            k = math.prod(m.kernel_size) * m.in_channels // m.groups
            n = out.numel() if isinstance(m, nn.Conv2d) else inp[0].numel() // m.in_channels * m.out_channels
            macs += k * n

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        with torch.no_grad():
            module.eval()
            module(torch.zeros(1, 3, size[1], size[0]))
    finally:
        for h in handles:
            h.remove()
    return macs / (size[0] * size[1])
