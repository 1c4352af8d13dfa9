"""Debug overlays on raw frames: the workspace and a decoded grasp, and contact sheets.

Pixel coordinates come from :func:`perception.core.geometry.project_points`, so what is drawn
is exactly where the robot will go.
"""

from __future__ import annotations

import cv2
import numpy as np

from perception.core.calibration import Calibration, project_points
from perception.core.decode import DecodedGrasp

__all__ = ["draw_decoded", "contact_sheet"]


def draw_decoded(raw_rgb: np.ndarray, decoded: DecodedGrasp, calib: Calibration) -> np.ndarray:
    """A copy of the raw frame with the workspace (blue), the grasp's fingertip line
    (green), its centre and a caption, or the reason when there is no grasp (red)."""
    img = np.ascontiguousarray(raw_rgb).copy()
    h, w = img.shape[:2]
    cal = calib.scaled((w, h))
    ws = project_points(cal.workspace_corners(), cal)
    cv2.polylines(img, [np.round(ws).astype(np.int32).reshape(-1, 1, 2)], True, (60, 120, 255), 1, cv2.LINE_AA)
    g = decoded.grasp
    if g is None:
        _text(img, (decoded.reason or "no grasp")[:90], (255, 60, 60))
        return img
    tips = project_points(g.fingertips(), cal)
    centre = project_points(np.asarray([g.position]), cal)[0]
    a, b = (tuple(int(round(c)) for c in p) for p in tips)
    cv2.line(img, a, b, (40, 220, 40), 2, cv2.LINE_AA)
    for p in (a, b):
        cv2.circle(img, p, 4, (40, 220, 40), -1, cv2.LINE_AA)
    cv2.drawMarker(img, tuple(int(round(v)) for v in centre), (255, 255, 0), cv2.MARKER_CROSS, 10, 1, cv2.LINE_AA)
    text = (f"q={g.quality:.2f} x={g.position[0]:.3f} y={g.position[1]:.3f} z={g.position[2]:.3f} "
            f"yaw={np.degrees(g.yaw):.0f}deg w={100 * g.width:.1f}cm")
    _text(img, text, (255, 255, 0))
    return img


def _text(img: np.ndarray, text: str, color: tuple[int, int, int]) -> None:
    """``text`` at the top left on a darkened band, so it reads on any floor; its size grows
    with the frame (0.42 fills a 320 px frame's width with a grasp's line, 0.6 at 640 px).
    (Not a thick black copy beneath: Hershey glyphs advance with their thickness, so the
    two copies drift apart along the line.)"""
    font, scale = cv2.FONT_HERSHEY_SIMPLEX, float(np.clip(0.42 * img.shape[1] / 320, 0.42, 0.6))
    (tw, th), base = cv2.getTextSize(text, font, scale, 1)
    x, y = 8, int(round(20 * scale / 0.42))
    band = img[max(y - th - 4, 0):y + base + 2, max(x - 4, 0):x + tw + 4]
    band[:] = (band * 0.35).astype(img.dtype)
    cv2.putText(img, text, (x, y), font, scale, color, 1, cv2.LINE_AA)


def contact_sheet(images: list[np.ndarray], columns: int = 8, thumb_width: int = 160) -> np.ndarray:
    """Tile RGB images into one RGB image of thumbnails (row-major)."""
    if not images:
        return np.zeros((thumb_width * 3 // 4, thumb_width, 3), dtype=np.uint8)
    h0, w0 = images[0].shape[:2]
    tw, th = thumb_width, max(1, int(round(thumb_width * h0 / w0)))
    cols = max(1, min(columns, len(images)))
    rows = (len(images) + cols - 1) // cols
    sheet = np.zeros((rows * th, cols * tw, 3), dtype=np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        sheet[r * th:(r + 1) * th, c * tw:(c + 1) * tw] = cv2.resize(im, (tw, th), interpolation=cv2.INTER_AREA)
    return sheet
