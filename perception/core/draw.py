"""Pictures people would rather look at than read: grasps drawn on frames, panels."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

__all__ = ["SUCCESS_COLOR", "FAILURE_COLOR", "caption_image", "draw_grasp", "draw_grasps", "panel", "label_image"]

SUCCESS_COLOR = (40, 220, 60)
FAILURE_COLOR = (230, 50, 40)


def draw_grasp(
    img: np.ndarray,
    pixel: Sequence[float],
    angle: float,
    width_px: float,
    color: tuple[int, int, int] = SUCCESS_COLOR,
    thickness: int = 1,
) -> np.ndarray:
    """Draw one grasp in place: the line between the fingertips and two jaw ticks.

    Args:
        img: ``(H, W, 3)`` uint8 RGB, modified in place and returned.
        pixel: grasp centre ``(u, v)`` in this image's pixels.
        angle: image-plane angle of the fingertip line, radians.
        width_px: opening in this image's pixels.
    """
    u, v = float(pixel[0]), float(pixel[1])
    d = np.array([np.cos(angle), np.sin(angle)]) * width_px / 2
    n = np.array([-d[1], d[0]]) / max(np.linalg.norm(d), 1e-6) * max(2.0, width_px / 6)
    a = np.array([u, v]) - d
    b = np.array([u, v]) + d
    shift = 4  # sub-pixel precision for cv2 drawing

    def pt(x: np.ndarray) -> tuple[int, int]:
        return int(round(x[0] * (1 << shift))), int(round(x[1] * (1 << shift)))

    cv2.line(img, pt(a), pt(b), color, thickness, cv2.LINE_AA, shift)
    for end in (a, b):
        cv2.line(img, pt(end - n), pt(end + n), color, thickness + 1, cv2.LINE_AA, shift)
    cv2.circle(img, pt(np.array([u, v])), 2 << shift, color, -1, cv2.LINE_AA, shift)
    return img


def draw_grasps(
    img: np.ndarray,
    pixels: np.ndarray,
    angles: np.ndarray,
    widths_px: np.ndarray,
    success: np.ndarray | None = None,
    thickness: int = 1,
) -> np.ndarray:
    """Copy of ``img`` with grasps drawn: green where ``success``, red otherwise."""
    out = np.ascontiguousarray(img).copy()
    for k in range(len(pixels)):
        ok = True if success is None else bool(success[k])
        draw_grasp(out, pixels[k], float(angles[k]), float(widths_px[k]),
                   SUCCESS_COLOR if ok else FAILURE_COLOR, thickness)
    return out


#: Captions' font and size: Hershey Duplex at 0.6 draws letters about 13 px tall, read at
#: 100% without zooming (Simplex at 0.4, about 9 px of one-pixel strokes, could not be).
CAPTION_FONT, CAPTION_SCALE = cv2.FONT_HERSHEY_DUPLEX, 0.6


def label_image(img: np.ndarray, text: str) -> np.ndarray:
    """Copy of ``img`` with a caption bar on top."""
    h, w = img.shape[:2]
    bar_h = int(round(44 * CAPTION_SCALE))
    bar = np.full((bar_h, w, 3), 255, dtype=np.uint8)
    cv2.putText(bar, text, (4, bar_h - int(round(12 * CAPTION_SCALE))), CAPTION_FONT, CAPTION_SCALE, (0, 0, 0), 1,
                cv2.LINE_AA)
    return np.concatenate([bar, img], axis=0)


def panel(rows: Sequence[Sequence[np.ndarray]], pad: int = 4,
          labels: Sequence[Sequence[str]] | None = None) -> np.ndarray:
    """Tile images (all RGB uint8) into a grid, each resized to the largest tile's size.

    ``labels`` (the same shape as ``rows``): a caption bar put on each tile after it is
    resized, so every caption is drawn at its readable size (one drawn on a small tile
    and scaled up blurs; one on a large tile scaled down shrinks out of reading).
    """
    h, w = max((im.shape[:2] for row in rows for im in row), key=lambda s: s[0] * s[1])
    tiles = []
    for i, row in enumerate(rows):
        out_row = []
        for j, im in enumerate(row):
            if im.shape[:2] != (h, w):
                shrink = im.shape[0] > h
                im = cv2.resize(im, (w, h), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
            out_row.append(label_image(im, labels[i][j]) if labels is not None else im)
        tiles.append(out_row)
    th, tw = tiles[0][0].shape[:2]
    ncol = max(len(r) for r in tiles)
    out = np.full((len(tiles) * (th + pad) + pad, ncol * (tw + pad) + pad, 3), 255, dtype=np.uint8)
    for i, row in enumerate(tiles):
        for j, im in enumerate(row):
            y, x = pad + i * (th + pad), pad + j * (tw + pad)
            out[y : y + th, x : x + tw] = im
    return out


def caption_image(img: np.ndarray, text: str, scale: float = CAPTION_SCALE) -> np.ndarray:
    """Copy of ``img`` with ``text`` word-wrapped in a white bar below it (a figure's legend)."""
    h, w = img.shape[:2]
    font, line_h = CAPTION_FONT, int(round(40 * scale))
    lines, cur = [], ""
    for word in text.split():
        trial = f"{cur} {word}".strip()
        if cv2.getTextSize(trial, font, scale, 1)[0][0] > w - 8 and cur:
            lines.append(cur)
            cur = word
        else:
            cur = trial
    lines.append(cur)
    bar = np.full((line_h * len(lines) + 8, w, 3), 255, dtype=np.uint8)
    for i, line in enumerate(lines):
        cv2.putText(bar, line, (4, 4 + line_h * (i + 1) - line_h // 4), font, scale, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([img, bar], axis=0)
