"""A synthetic stand-in for the render dataset (used only while ``sim_render`` cannot render).

Frames are drawn with OpenCV through the calibrated camera (distortion included): a table,
the bin's walls and 1-4 bar-shaped objects, with labels like the renderer's (0 table,
1 bin, 2 distractor, 3+i object i). ``style="real"`` draws the same kind of scene with another
palette, blur, sensor noise and JPEG, so there is a domain gap to translate across.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from perception.core.calibration import Calibration, default_calibration_path, project_points

WALL_H = 0.06


def _poly(points: np.ndarray, calib: Calibration, n: int = 8) -> np.ndarray:
    """Project a closed 3D polygon with its edges subdivided (so distortion bends them)."""
    pts = []
    for a, b in zip(points, np.roll(points, -1, axis=0)):
        for t in np.linspace(0, 1, n, endpoint=False):
            pts.append(a + (b - a) * t)
    uv = project_points(np.asarray(pts), calib)
    return np.round(uv * 8).astype(np.int32)  # 3 fractional bits for fillPoly


def _fill(img: np.ndarray, seg: np.ndarray, poly: np.ndarray, color, label: int) -> None:
    cv2.fillPoly(img, [poly], color, lineType=cv2.LINE_AA, shift=3)
    cv2.fillPoly(seg, [poly], int(label), lineType=cv2.LINE_8, shift=3)


def draw_scene(calib: Calibration, rng: np.random.Generator, style: str = "sim") -> tuple[np.ndarray, np.ndarray]:
    """One frame ``(H, W, 3)`` uint8 RGB and labels ``(H, W)`` uint8 at ``calib.image_size``."""
    W, H = calib.image_size
    real = style == "real"
    if real:
        table = np.array([150, 140, 125]) + rng.integers(-10, 10, 3)
        wall = np.array([70, 90, 150]) + rng.integers(-10, 10, 3)
    else:
        table = rng.integers(40, 220, 3)
        wall = rng.integers(40, 220, 3)
    img = np.empty((H, W, 3), np.uint8)
    img[:] = table
    if real:  # a soft light gradient
        yy = np.linspace(-1, 1, H)[:, None, None]
        img = np.clip(img.astype(np.float32) * (1 + 0.12 * yy), 0, 255).astype(np.uint8)
    seg = np.zeros((H, W), np.uint8)
    (x0, x1), (y0, y1), z = calib.workspace_x, calib.workspace_y, calib.table_z
    t = 0.01
    walls = [
        ((x0 - t, y0 - t), (x1 + t, y0 - t)),
        ((x1 + t, y0 - t), (x1 + t, y1 + t)),
        ((x1 + t, y1 + t), (x0 - t, y1 + t)),
        ((x0 - t, y1 + t), (x0 - t, y0 - t)),
    ]
    for i, ((ax, ay), (bx, by)) in enumerate(walls):
        quad = np.array([[ax, ay, z], [bx, by, z], [bx, by, z + WALL_H], [ax, ay, z + WALL_H]])
        shade = 0.75 + 0.08 * i
        _fill(img, seg, _poly(quad, calib), tuple(int(c * shade) for c in wall), 1)
    n_obj = int(rng.integers(1, 5))
    items = []
    for k in range(n_obj + 1):
        cx = rng.uniform(x0 + 0.05, x1 - 0.05)
        cy = rng.uniform(y0 + 0.05, y1 - 0.05)
        items.append((cx, k))
    items.sort(key=lambda it: -it[0])  # far first (the camera looks from +x)
    for _, k in items:
        distractor = k == n_obj
        cx = rng.uniform(x0 + 0.05, x1 - 0.05)
        cy = rng.uniform(y0 + 0.05, y1 - 0.05)
        yaw = rng.uniform(0, np.pi)
        length = rng.uniform(0.03, 0.05) if distractor else rng.uniform(0.09, 0.12)
        width = rng.uniform(0.02, 0.03)
        h = rng.uniform(0.015, 0.03)
        c, s = np.cos(yaw), np.sin(yaw)
        corners = np.array([[-length / 2, -width / 2], [length / 2, -width / 2], [length / 2, width / 2], [-length / 2, width / 2]])
        xy = corners @ np.array([[c, s], [-s, c]]) + [cx, cy]
        top = np.c_[xy, np.full(4, z + h)]
        col = rng.integers(30, 240, 3) if not real else np.array([200, 60, 40]) * rng.uniform(0.6, 1.2, 3)
        col = np.clip(col, 0, 255)
        label = 2 if distractor else 3 + k
        side = np.array([top[0], top[1], [*xy[1], z], [*xy[0], z]])
        _fill(img, seg, _poly(side, calib), tuple(int(v * 0.6) for v in col), label)
        _fill(img, seg, _poly(top, calib), tuple(int(v) for v in col), label)
    if real:
        img = cv2.GaussianBlur(img, (5, 5), 1.2)
        img = np.clip(img.astype(np.float32) + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        ok, buf = cv2.imencode(".jpg", img[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 70])
        img = cv2.imdecode(buf, cv2.IMREAD_COLOR)[:, :, ::-1]
    return np.ascontiguousarray(img), seg


def write_sim_dataset(out_dir: Path, n_frames: int = 8, seed: int = 0, scale: float = 0.5) -> Path:
    """Synthetic sim frames at ``scale`` x the calibration size, in ``out_dir/frames.npz``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    calib = Calibration.load(default_calibration_path())
    size = (int(calib.width * scale), int(calib.height * scale))
    cal_s = calib.scaled(size)
    rng = np.random.default_rng(seed)
    rgbs, segs = zip(*(draw_scene(cal_s, rng, "sim") for _ in range(n_frames)))
    np.savez(out_dir / "frames.npz", rgb=np.stack(rgbs), seg=np.stack(segs))
    calib.save(out_dir / "calibration.json")
    (out_dir / "manifest.json").write_text(json.dumps({"profile": "synthetic", "n_frames": n_frames}))
    return out_dir


def write_real_frames(out_dir: Path, n_frames: int = 8, seed: int = 1) -> Path:
    """Synthetic 'real' PNG frames at the calibration's image_size."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    calib = Calibration.load(default_calibration_path())
    rng = np.random.default_rng(seed)
    for i in range(n_frames):
        img, _ = draw_scene(calib, rng, "real")
        cv2.imwrite(str(out_dir / f"frame_{i:05d}.png"), img[:, :, ::-1])
    return out_dir


class SyntheticFrameDataset:
    """The ``sim_render.reader.SimFrameDataset`` interface over :func:`write_sim_dataset` output."""

    def __init__(self, root, fields=("rgb", "seg"), verify: bool = False) -> None:
        root = Path(root)
        data = np.load(root / "frames.npz")
        self._arrays = {k: data[k] for k in ("rgb", "seg")}
        self.fields = tuple(fields)
        self.calibration = Calibration.load(root / "calibration.json")
        self.manifest = json.loads((root / "manifest.json").read_text())

    def __len__(self) -> int:
        return len(self._arrays["rgb"])

    def __getitem__(self, i: int) -> dict:
        return {k: self._arrays[k][i] for k in self.fields if k in self._arrays}
