"""The fixed camera's empty bin: which frames show nothing new in the bin.

The camera is fixed and calibrated, so the user's own frames, seen through the policy's
top-down view, agree pixel for pixel wherever nothing moved. Their per-pixel median over
many frames is the cell's background (parts move from frame to frame, the bin stays). A
frame that shows a part differs from it in a part-sized patch inside the bin; a frame of
the empty bin differs only by what the light does.

What the light does is large: a lamp or the sun moves the walls' shadows across the floor
and tints the whole bin. So the test compares *chromaticity* (each channel over the pixel's
sum): a shadow darkens a surface and keeps its colour, a part replaces the surface. The
whole bin's median colour shift (the light's colour) is taken out first, pixels too dark to
have a colour are not judged, lines one cell wide (shadow edges) are opened away, and what
remains must be one connected patch of at least :attr:`BackgroundModel.min_part_px` cells.
The two numbers (``conf/pipeline.yaml: background``) were chosen in the twin, on two fixed
looks lit as the randomized profile lights its frames (the lamp anywhere, tinted, traced
shadows): docs/decode.md has the measurement.

A part the colour of the bin floor does not change the chromaticity; the test then says
"unchanged". It is therefore used only to *withhold* an answer the policy itself did not
trust (``decode.answer_on_parts``' fallback below the quality threshold, docs/decode.md),
never to invent one. A bin that changed colour, or a camera that moved over a floor of
many colours, changes many cells: the test then says "changed" and the decode is as
without it.

Units: the policy's view cells; images ``(H, W, 3)`` uint8 RGB in that view.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

__all__ = [
    "BackgroundModel",
    "BackgroundError",
    "fit_background",
    "changed_patch_px",
    "MIN_FRAMES",
    "DARK_LEVEL",
    "GATES",
]

#: :attr:`BackgroundModel.gate` values.
GATES = ("below_threshold", "always")
#: Real frames a background needs: a median over fewer keeps parts that sat still.
MIN_FRAMES = 20
#: Pixels darker than this (0-255 grey) have no colour to compare: deep shadow, not judged.
DARK_LEVEL = 20.0
#: Box size, cells, the chromaticity is smoothed over before it is compared (sensor noise).
_SMOOTH_PX = 3


class BackgroundError(ValueError):
    """Frames that cannot make a background (too few, of different sizes)."""


@dataclass(frozen=True, eq=False)
class BackgroundModel:
    """The empty bin as the fixed camera sees it, in the policy's view.

    Attributes:
        image: ``(H, W, 3)`` uint8 RGB, the per-pixel median of the user's frames.
        threshold: chromaticity change (channel over sum, after the whole bin's shift) that
            counts as changed.
        min_part_px: cells of one connected changed patch that make "a part is there".
        gate: which answers an unchanged frame withholds (:data:`GATES`): ``below_threshold``,
            only ``decode.answer_on_parts``' answer below the quality threshold; ``always``,
            every answer.
    """

    image: np.ndarray
    threshold: float
    min_part_px: int
    gate: str = "below_threshold"

    def __post_init__(self) -> None:
        img = np.asarray(self.image)
        if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
            raise BackgroundError(f"a background image is (H, W, 3) uint8, got {img.shape} {img.dtype}")
        if not (0.0 < float(self.threshold) < 1.0) or int(self.min_part_px) < 1:
            raise BackgroundError(f"threshold in (0, 1) and min_part_px >= 1, got {self.threshold!r}, "
                                  f"{self.min_part_px!r}")
        if self.gate not in GATES:
            raise BackgroundError(f"gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        object.__setattr__(self, "_chroma", _chroma(img.astype(np.float32)))

    def changed_px(self, view_rgb: np.ndarray, region: np.ndarray) -> int:
        """See :func:`changed_patch_px`."""
        return changed_patch_px(view_rgb, self, region)

    def unchanged(self, view_rgb: np.ndarray, region: np.ndarray) -> bool:
        """Whether ``view_rgb`` shows no part-sized change inside ``region``."""
        return self.changed_px(view_rgb, region) < int(self.min_part_px)


def _chroma(rgb: np.ndarray) -> np.ndarray:
    """``(H, W, 3)`` float chromaticity (each channel over the sum), smoothed."""
    c = rgb / (rgb.sum(axis=-1, keepdims=True) + 3.0)
    return cv2.blur(c, (_SMOOTH_PX, _SMOOTH_PX))


def _difference(view_rgb: np.ndarray, background_chroma: np.ndarray, region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-cell chromaticity change ``(H, W)`` with the region's median shift taken out, and
    the ``(H, W)`` bool of cells bright enough to judge."""
    x = np.asarray(view_rgb, dtype=np.float32)
    d = _chroma(x) - background_chroma
    judged = region & (x.mean(axis=-1) >= DARK_LEVEL)
    if judged.any():
        d = d - np.median(d[judged], axis=0)  # the light's colour: the whole bin shifts together
    return np.abs(d).max(axis=-1), judged


def changed_patch_px(view_rgb: np.ndarray, model: BackgroundModel, region: np.ndarray) -> int:
    """Cells of the largest connected patch inside ``region`` whose chromaticity changed
    against the background by more than ``model.threshold`` (lines one cell wide opened away).

    Args:
        view_rgb: ``(H, W, 3)`` uint8 RGB, the frame in the background's view.
        region: ``(H, W)`` bool, where parts are looked for (the bin inside its walls).

    Raises:
        BackgroundError: a frame of another size than the background.
    """
    if np.shape(view_rgb) != model.image.shape:
        raise BackgroundError(f"frame {np.shape(view_rgb)} and background {model.image.shape} differ in size")
    d, judged = _difference(view_rgb, model._chroma, np.asarray(region, dtype=bool))
    mask = ((d > float(model.threshold)) & judged).astype(np.uint8)
    mask = cv2.morphologyEx(mask, cv2.MORPH_OPEN, np.ones((3, 3), np.uint8))
    n, _, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    return int(stats[1:, cv2.CC_STAT_AREA].max()) if n > 1 else 0


def fit_background(views: Iterable[np.ndarray], region: np.ndarray, threshold: float,
                   min_part_px: int, gate: str = "below_threshold") -> tuple[BackgroundModel, dict]:
    """The background of a fixed camera from its frames in the policy's view.

    Args:
        views: ``(H, W, 3)`` uint8 RGB frames, all of one size, at least :data:`MIN_FRAMES`.
        region: ``(H, W)`` bool, where parts are looked for (the bin inside its walls).
        threshold, min_part_px, gate: see :class:`BackgroundModel`.

    Returns:
        The model and what it was made from: ``frames``; ``noise``, the frames' own
        chromaticity change against the median (a robust sigma over every judged cell of
        every frame, parts and shadows included), and ``shown``, the share of the frames on
        which the test sees a part (the user's frames hold parts: a share well under 1 says
        the test is blind to them, and then withholds more answers than it should).

    Raises:
        BackgroundError: fewer than :data:`MIN_FRAMES` frames, or frames of different sizes.
    """
    stack = [np.asarray(v) for v in views]
    if len(stack) < MIN_FRAMES:
        raise BackgroundError(f"a background needs at least {MIN_FRAMES} frames of the fixed camera, got {len(stack)}")
    if len({v.shape for v in stack}) != 1 or stack[0].ndim != 3 or stack[0].shape[2] != 3:
        raise BackgroundError(f"frames must all be (H, W, 3) of one size, got {sorted({v.shape for v in stack})}")
    frames = np.stack(stack).astype(np.float32)
    # The median of each pixel's chromaticity, not the chromaticity of the per-channel median:
    # where a shadow falls on half the frames the channels' medians come from different frames.
    # The image keeps the median brightness, so that it looks like the empty bin.
    chroma = frames / (frames.sum(axis=-1, keepdims=True) + 3.0)
    brightness = np.median(frames.sum(axis=-1), axis=0)
    image = np.clip(np.median(chroma, axis=0) * (brightness[..., None] + 3.0), 0, 255).round().astype(np.uint8)
    region = np.asarray(region, dtype=bool)
    bg_chroma = _chroma(image.astype(np.float32))
    model = BackgroundModel(image=image, threshold=float(threshold), min_part_px=int(min_part_px), gate=gate)
    changes = []
    for v in stack:
        d, judged = _difference(v, bg_chroma, region)
        changes.append(d[judged])
    pooled = np.concatenate(changes)
    noise = float(1.4826 * np.median(pooled)) if pooled.size else 0.0
    shown = float(np.mean([not model.unchanged(v, region) for v in stack]))
    return model, {"frames": len(frames), "noise": noise, "shown": shown}
