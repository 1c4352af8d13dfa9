"""The grasp network: a small fully convolutional encoder-decoder (GG-CNN-style dense maps).

:class:`GraspNet` maps a normalised view image ``(N, 3, H, W)`` (see
:func:`perception.core.preprocess.to_network_input`) to three maps at input resolution:

- ``quality_logits`` ``(N, A, H, W)``: per pixel and image-plane angle bin
  (:func:`perception.core.grasp.angle_bin_centers`), the logit of "a top-down grasp centred
  here, at this angle, succeeds";
- ``width`` ``(N, 1, H, W)``: the opening, metres, in ``[0, GRIPPER_MAX_WIDTH]``;
- ``height`` ``(N, 1, H, W)``: the fingertip height above ``table_z``, metres, in
  ``[0, HEIGHT_MAX]``;
- ``surface`` ``(N, 1, H, W)``: the top of whatever stands at the pixel (the bin's contents
  seen from above), metres above ``table_z``, in ``[0, HEIGHT_MAX]``: what the grasp rule
  of :mod:`perception.core.rule` runs on in the decode.

:class:`GeometryNet` (same trunk, :class:`UNet`) maps a *camera*-view image to the height of
what each pixel sees and a part mask (:mod:`policies.geometry`); :class:`GeometryExport` is
its deployed graph.

Width and heights are bounded by a sigmoid, so the exported graph cannot produce an
opening the gripper lacks or a height far above the bin. :class:`ExportWrapper` applies
the sigmoid to the quality logits for the ONNX artifact (outputs ``quality``, ``width``,
``height``, ``surface``; input ``image``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from perception.core.calibration import Calibration
from perception.core.frames import GRIPPER_MAX_WIDTH
from perception.core.geometry import CAMERA_CHANNELS, NetworkView, camera_channels

__all__ = ["UNet", "GraspNet", "GeometryNet", "PyramidGeometryNet", "GeometryExport", "ExportWrapper", "HEIGHT_MAX",
           "BIN_READOUTS", "BINS_BELOW_TABLE", "bin_height", "height_bin_centres", "count_parameters", "network_kwargs",
           "with_batchnorm_statistics"]

#: Upper bound of the predicted fingertip height above the table, metres (bin walls are 0.06 m,
#: objects rest in the bin; fingertips go below the top of the part they close around).
HEIGHT_MAX = 0.15


def network_kwargs(network: Mapping[str, Any]) -> dict[str, Any]:
    """A network config (``policy.network``, a checkpoint's or a base's ``network``) as keyword
    arguments of :class:`GraspNet` / :class:`GeometryNet` (``dilations`` as a tuple; the
    ``_target_`` that names the class left out, and every key set to ``null``: a config that names
    another class clears the default's keys that way, as Hydra merges the blocks)."""
    kw = {k: v for k, v in dict(network).items() if k != "_target_" and v is not None}
    if "dilations" in kw:
        kw["dilations"] = tuple(kw["dilations"])
    return kw


def configured_class(block: Mapping[str, Any], default: type, what: str) -> type:
    """The class a config block names in ``_target_`` (a dotted path, as Hydra's ``instantiate``
    reads it), which must be ``default`` or a subclass of it; ``default`` without one (the
    checkpoints and bases written before the configs named their class).

    Raises:
        ValueError: a ``_target_`` that does not import, or names another kind of class.
    """
    target = block.get("_target_")
    if target is None:
        return default
    from hydra.utils import get_class  # lazy: Hydra only for a config that names a class

    try:
        cls = get_class(str(target))
    except Exception as exc:  # Hydra wraps the import's own error
        raise ValueError(f"{what}._target_ {target!r} does not name an importable class: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, default)):
        raise ValueError(f"{what}._target_ {target!r} is not a {default.__module__}.{default.__qualname__} "
                         "(or a subclass of it)")
    return cls


def build_network(network: Mapping[str, Any], default: type[nn.Module], what: str = "network") -> nn.Module:
    """The network a config block describes: the class its ``_target_`` names (``default``
    without one), built with the block's other keys."""
    return configured_class(network, default, what)(**network_kwargs(network))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def with_batchnorm_statistics(net: nn.Module, views: torch.Tensor, alpha: float, batch: int) -> nn.Module:
    """A copy of ``net`` in eval mode whose BatchNorm2d running statistics are ``(1 - alpha)``
    times its own plus ``alpha`` times those of ``views`` (AdaBN, Li et al. 2016: a plain
    average over ``batch``-sized batches of the network's input tensors)."""
    target = copy.deepcopy(net)
    norms = [m for m in target.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a plain average over every batch
    target.train()
    with torch.no_grad():
        for i in range(0, len(views), batch):
            target(views[i:i + batch])
    out = copy.deepcopy(net).eval()
    for mine, theirs in zip([m for m in out.modules() if isinstance(m, nn.BatchNorm2d)], norms):
        mine.running_mean.mul_(1 - alpha).add_(alpha * theirs.running_mean)
        mine.running_var.mul_(1 - alpha).add_(alpha * theirs.running_var)
    return out


def _conv(cin: int, cout: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=dilation, dilation=dilation, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class _Residual(nn.Module):
    """Two 3x3 convolutions with a skip; dilation widens the receptive field cheaply."""

    def __init__(self, ch: int, dilation: int) -> None:
        super().__init__()
        self.a = _conv(ch, ch, dilation=dilation)
        self.b = nn.Sequential(
            nn.Conv2d(ch, ch, 3, padding=dilation, dilation=dilation, bias=False), nn.BatchNorm2d(ch)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b(self.a(x)))


class UNet(nn.Module):
    """The shared trunk: a small U-Net (two 2x downsamplings, dilated residual blocks at 1/4)
    ending in a 1x1 head of ``out_channels`` raw maps at input resolution.

    Args:
        out_channels: channels of the head.
        base_channels: channels at full resolution; 2x and 4x at 1/2 and 1/4.
        dilations: dilations of the residual blocks at 1/4 resolution (receptive field).
    """

    def __init__(self, out_channels: int, base_channels: int = 16, dilations: tuple[int, ...] = (2, 4),
                 in_channels: int = 3) -> None:
        super().__init__()
        c = int(base_channels)
        self.stem = nn.Sequential(_conv(int(in_channels), c), _conv(c, c))
        self.down1 = nn.Sequential(_conv(c, 2 * c, stride=2), _conv(2 * c, 2 * c))
        self.down2 = nn.Sequential(_conv(2 * c, 4 * c, stride=2), _conv(4 * c, 4 * c))
        self.mid = nn.Sequential(*[_Residual(4 * c, int(d)) for d in dilations])
        self.up1 = nn.Sequential(_conv(6 * c, 2 * c), _conv(2 * c, 2 * c))
        self.up2 = _conv(3 * c, c)
        self.head = nn.Conv2d(c, int(out_channels), 1)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, in_channels, H, W)`` -> the head's raw ``(N, out_channels, H, W)``."""
        f1 = self.stem(x)
        f2 = self.down1(f1)
        f3 = self.mid(self.down2(f2))
        u = F.interpolate(f3, size=f2.shape[-2:], mode="bilinear", align_corners=False)
        u = self.up1(torch.cat([u, f2], dim=1))
        u = F.interpolate(u, size=f1.shape[-2:], mode="bilinear", align_corners=False)
        u = self.up2(torch.cat([u, f1], dim=1))
        return self.head(u)


class GraspNet(UNet):
    """U-Net-like grasp network (about 0.27M parameters at ``base_channels=16``).

    Args:
        angle_bins: number of image-plane angle bins ``A``.
        base_channels: channels at full resolution; 2x and 4x at 1/2 and 1/4.
        dilations: dilations of the residual blocks at 1/4 resolution (receptive field).

    Shape:
        input ``(N, 3, H, W)`` float32 (any ``H, W``; multiples of 4 avoid resampling
        seams); outputs ``quality_logits (N, A, H, W)``, ``width (N, 1, H, W)`` metres,
        ``height (N, 1, H, W)`` and ``surface (N, 1, H, W)`` metres above the table.
    """

    def __init__(self, angle_bins: int = 12, base_channels: int = 16, dilations: tuple[int, ...] = (2, 4)) -> None:
        super().__init__(int(angle_bins) + 3, base_channels, dilations)
        self.angle_bins = int(angle_bins)
        # Start pessimistic: most pixels are not graspable (stabilises the first steps).
        with torch.no_grad():
            self.head.bias[: self.angle_bins].fill_(-2.0)
            self.head.bias[self.angle_bins :].zero_()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.trunk(x)
        A = self.angle_bins
        return {
            "quality_logits": out[:, :A],
            "width": GRIPPER_MAX_WIDTH * torch.sigmoid(out[:, A : A + 1]),
            "height": HEIGHT_MAX * torch.sigmoid(out[:, A + 1 : A + 2]),
            "surface": HEIGHT_MAX * torch.sigmoid(out[:, A + 2 : A + 3]),
        }


#: How :class:`GeometryNet` reads a height from its bins (``readout``).
BIN_READOUTS = ("mean", "mode")

#: Height bins centred below the table (:func:`height_bin_centres`): the table's height, 0, is then a
#: bin's centre with as many bins either side, so that its target and its readout are not pulled up
#: by the bins' lower end (with the first centre half a bin above 0, table pixels read 3.6 mm).
BINS_BELOW_TABLE = 2


def height_bin_centres(bins: int) -> torch.Tensor:
    """The centres of ``bins`` equal height bins, metres above the table: :data:`BINS_BELOW_TABLE`
    below 0, one at 0 and the last at :data:`HEIGHT_MAX`."""
    step = HEIGHT_MAX / (int(bins) - 1 - BINS_BELOW_TABLE)
    return (torch.arange(int(bins), dtype=torch.float32) - BINS_BELOW_TABLE) * step


def bin_height(logits: torch.Tensor, centres: torch.Tensor, readout: str = "mean") -> torch.Tensor:
    """A height map ``(N, 1, H, W)`` from bin logits ``(N, K, H, W)`` over bin ``centres`` (metres):
    ``mean``, the expectation over every bin; ``mode``, the expectation over the most likely bin
    and its two neighbours, so that a pixel torn between two heights reads one of them, to a
    fraction of a bin. Only ONNX's standard operators (the service runs it as a graph)."""
    p = torch.softmax(logits, dim=1)
    c = centres.view(1, -1, 1, 1).to(p.dtype)
    if readout == "mean":
        h = (p * c).sum(dim=1, keepdim=True)
    else:
        k = torch.arange(logits.shape[1], device=logits.device).view(1, -1, 1, 1)
        w = p * ((k - logits.argmax(dim=1, keepdim=True)).abs() <= 1).to(p.dtype)
        h = (w * c).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True)
    return h.clamp(0.0, HEIGHT_MAX)  # the bins below the table centre its height; no height is below it


class GeometryNet(UNet):
    """Geometry from RGB in the camera view (:mod:`policies.geometry`).

    Shape:
        input ``(N, 3, H, W)`` a camera-view image (``kind="camera"``, where a part's edges
        are the image's edges); outputs ``height (N, 1, H, W)``, metres above the table of
        the surface each pixel sees, in ``[0, HEIGHT_MAX]``, and ``object_logits (N, 1, H, W)``,
        the logit of "this pixel sees a part" (not the table, the bin or the floor);
        ``height_logits`` the height before its sigmoid (a bound on the height can push it
        where the sigmoid is flat: :func:`policies.stops.stop_losses`). With ``height_bins``
        ``K > 0``, ``height_bin_logits (N, K, H, W)`` in place of ``height_logits``: the logits
        of the height falling in each of ``K`` equal bins (:func:`height_bin_centres`), and
        ``height`` read from them (``readout``).

    Args:
        base_channels, dilations: :class:`UNet`'s.
        camera_input: also take the calibrated camera's geometry at every pixel
            (:func:`perception.core.geometry.camera_channels`) beside the image.
        height_bins: 0, the height regressed through a sigmoid; ``K > 0``, classified into ``K``
            bins (trained by cross-entropy, :func:`policies.geometry.geometry_losses`). Why: a
            regression answers the middle of what a pixel may be (a part lying at 30 mm or
            stacked at 80 mm reads 55); the bins say how much the network believes each, and how
            sure it is. Measured, not shipped: read as ``mean``, a part p90 a little lower than the
            regression's; the belief on stacked parts is split, so no readout moves their bias
            (docs/experiments/2026-12-07-geometry-height-in-bins.md).
        readout: how ``height`` is read from the bins: ``mean``, the expectation over all bins;
            ``mode``, the expectation over the most likely bin and its two neighbours (one of the
            answers a split belief holds; worse in the validation cells).
    """

    #: The class's defaults, so that a subclass with a trunk of its own takes the image alone
    #: and regresses its height.
    camera_input = False
    height_bins = 0

    def __init__(self, base_channels: int = 16, dilations: tuple[int, ...] = (2, 4), camera_input: bool = False,
                 height_bins: int = 0, readout: str = "mean") -> None:
        self.camera_input = bool(camera_input)
        self.height_bins = int(height_bins)
        if self.height_bins < 0 or 0 < self.height_bins < BINS_BELOW_TABLE + 3:
            raise ValueError(f"geometry.network.height_bins must be 0 (regression) or at least {BINS_BELOW_TABLE + 3}, "
                             f"got {height_bins}")
        if readout not in BIN_READOUTS:
            raise ValueError(f"geometry.network.readout must be one of {list(BIN_READOUTS)}, got {readout!r}")
        self.readout = readout
        super().__init__(1 + max(self.height_bins, 1), base_channels, dilations,
                         3 + (len(CAMERA_CHANNELS) if self.camera_input else 0))
        with torch.no_grad():
            self.head.bias.fill_(-2.0)  # most pixels see the floor: a low height, not a part
            if self.height_bins:
                self.head.bias[: self.height_bins].zero_()
                self.head.bias[BINS_BELOW_TABLE] = 2.0  # the floor's bin
        if self.height_bins:
            # Bin centres, metres; not in the state dict (they follow from height_bins).
            self.register_buffer("bin_centres", height_bin_centres(self.height_bins), persistent=False)

    def forward(self, x: torch.Tensor, camera: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``x`` the image; ``camera`` the view's :func:`perception.core.geometry.camera_channels`
        ``(N or 1, C, H, W)``, required when the network was built with ``camera_input``."""
        if self.camera_input:
            if camera is None:
                raise ValueError("this geometry network takes the camera's geometry beside the image (camera_input): "
                                 "pass camera=net.camera_maps(calib, view)")
            camera = camera.to(dtype=x.dtype, device=x.device)
            x = torch.cat([x, camera.expand(x.shape[0], -1, -1, -1)], dim=1)
        out = self.trunk(x)
        if self.height_bins:
            logits = out[:, : self.height_bins]
            return {"height": bin_height(logits, self.bin_centres, self.readout), "height_bin_logits": logits,
                    "object_logits": out[:, self.height_bins :]}
        return {"height": HEIGHT_MAX * torch.sigmoid(out[:, :1]), "height_logits": out[:, :1],
                "object_logits": out[:, 1:2]}

    def camera_maps(self, calib: Calibration, view: NetworkView) -> torch.Tensor | None:
        """The ``camera`` :meth:`forward` takes for frames seen through ``calib`` in ``view``:
        ``(1, C, H, W)`` :func:`perception.core.geometry.camera_channels`; ``None`` for a network
        that takes the image alone."""
        return torch.from_numpy(camera_channels(calib, view))[None] if self.camera_input else None


class PyramidGeometryNet(GeometryNet):
    """A :class:`GeometryNet` with a deeper, wider pyramid: ``len(widths) - 1`` 2x downsamplings
    (to 1/16 with the default five widths), dilated residual blocks at the coarsest level and a
    decoder that joins every level's skip (a 1x1 to the level's width, then a 3x3).

    Why: on held-out sim frames and in the validation cells alike, :class:`GeometryNet`'s part
    error is not at the parts' edges (a 2-pixel band and the interior both 9 mm median) but a
    regression to the mean by true height: parts above 50 mm (stacked; a third to a half of the
    part pixels) read 12-45 mm low, and its training loss is within 20% of its validation loss
    (under-fitted rather than short of data). Context and capacity are cheap at 1/8 and 1/16
    (a 10x8 grid at 160x120): with the default widths this net has about 8x the parameters of
    ``GeometryNet(16)`` (2.1M) for about its step time on 2 CPU cores. Same outputs and export as
    :class:`GeometryNet`. Measured, not shipped: from scratch it is no better on held-out sim
    frames than ``GeometryNet(16)`` trained the same way, and worse in the cells
    (``docs/experiments/2026-12-06-a-pyramid-geometry-network.md``).

    Args:
        widths: channels at full resolution, 1/2, 1/4, ...; one level per entry.
        dilations: dilations of the residual blocks at the coarsest level.
    """

    def __init__(self, widths: tuple[int, ...] = (12, 24, 48, 96, 192), dilations: tuple[int, ...] = (1, 2)) -> None:
        nn.Module.__init__(self)  # not UNet's trunk: this one builds its own
        w = [int(c) for c in widths]
        if len(w) < 2:
            raise ValueError(f"geometry.network.widths needs at least two levels, got {list(widths)}")
        self.stem = nn.Sequential(_conv(3, w[0]), _conv(w[0], w[0]))
        self.down = nn.ModuleList(nn.Sequential(_conv(a, b, stride=2), _conv(b, b)) for a, b in zip(w[:-1], w[1:]))
        self.mid = nn.Sequential(*[_Residual(w[-1], int(d)) for d in dilations])
        # Decoder, coarse to fine: level i joins the upsampled level i+1 with its own skip.
        self.up = nn.ModuleList(
            nn.Sequential(nn.Conv2d(w[i + 1] + w[i], w[i], 1, bias=False), nn.BatchNorm2d(w[i]), nn.ReLU(inplace=True),
                          _conv(w[i], w[i]))
            for i in reversed(range(len(w) - 1)))
        self.head = nn.Conv2d(w[0], 2, 1)
        with torch.no_grad():
            self.head.bias.copy_(torch.tensor([-2.0, -2.0]))  # most pixels see the floor

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.stem(x)]
        for down in self.down:
            skips.append(down(skips[-1]))
        u = self.mid(skips.pop())
        for up in self.up:
            skip = skips.pop()
            u = F.interpolate(u, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            u = up(torch.cat([u, skip], dim=1))
        return self.head(u)


class GeometryExport(nn.Module):
    """The deployed geometry graph: ``image -> (height, object)``, object a probability.

    Args:
        net: the network.
        camera: the artifact calibration's :meth:`GeometryNet.camera_maps` (``None`` for a network
            that takes the image alone).
    """

    def __init__(self, net: GeometryNet, camera: torch.Tensor | None = None) -> None:
        super().__init__()
        self.net = net
        # The calibration is the artifact's: its camera's maps are a constant of the graph, whose input stays the image.
        self.register_buffer("camera", camera, persistent=False)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(image, self.camera)
        return out["height"], torch.sigmoid(out["object_logits"])


class ExportWrapper(nn.Module):
    """The deployed graph: ``image -> (quality, width, height, surface)``, quality a probability.

    Args:
        net: the trained network.
        flip_average: also run the horizontally mirrored image and average the two sets of
            maps (mirrored back, angle bin ``b`` read from bin ``-b mod A``): the mirror
            the training augmentation uses, as a test-time ensemble that halves the
            variance of the map an arg-max is taken on. Twice the compute.
    """

    def __init__(self, net: GraspNet, flip_average: bool = False) -> None:
        super().__init__()
        self.net = net
        self.flip_average = bool(flip_average)
        A = int(net.angle_bins)
        self.register_buffer("mirror_bins", torch.tensor([(-b) % A for b in range(A)], dtype=torch.long),
                             persistent=False)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.net(image)
        quality, width, height, surface = torch.sigmoid(out["quality_logits"]), out["width"], out["height"], out["surface"]
        if self.flip_average:
            m = self.net(torch.flip(image, dims=[3]))
            quality_m = torch.flip(torch.sigmoid(m["quality_logits"]), dims=[3]).index_select(1, self.mirror_bins)
            quality = 0.5 * (quality + quality_m)
            width = 0.5 * (width + torch.flip(m["width"], dims=[3]))
            height = 0.5 * (height + torch.flip(m["height"], dims=[3]))
            surface = 0.5 * (surface + torch.flip(m["surface"], dims=[3]))
        return quality, width, height, surface
