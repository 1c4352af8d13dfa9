"""A picture of a dataset: frames of several profiles with their grasp labels drawn."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

from perception.core.atomic import atomic_write_bytes
from perception.core.draw import draw_grasps, label_image, panel

__all__ = ["labelled_frame", "dataset_panel", "save_png"]


def save_png(path: str | Path, rgb: np.ndarray) -> Path:
    """Write an RGB image as PNG, atomically."""
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(rgb[:, :, ::-1]))
    if not ok:
        raise OSError(f"could not encode {path}")
    atomic_write_bytes(Path(path), buf.tobytes())
    return Path(path)


def labelled_frame(item: dict, caption: str = "") -> np.ndarray:
    """A raw frame with its executed grasps: green succeeded, red failed."""
    g = item["grasps"]
    img = draw_grasps(item["rgb"], g["pixel"], g["image_angle"], g["image_width"], g["success"])
    if caption:
        n_ok = int(np.sum(g["success"]))
        img = label_image(img, f"{caption}  {n_ok}/{len(g['success'])} ok")
    return img


def dataset_panel(dataset_dirs: Sequence[str | Path], per_row: int = 4) -> np.ndarray:
    """One row per dataset (e.g. randomized, canonical, target) of labelled frames."""
    from sim_render.reader import SimFrameDataset  # lazy: torch via reader (panel only)

    rows = []
    for d in dataset_dirs:
        ds = SimFrameDataset(d)
        name = ds.manifest.get("profile", Path(d).name)
        rows.append([labelled_frame(ds[i], f"{name} #{i}") for i in range(min(per_row, len(ds)))])
    return panel(rows)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m sim_render.panel OUT.png DATASET_DIR [DATASET_DIR ...]``: one row per dataset."""

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m sim_render.panel OUT.png DATASET_DIR [DATASET_DIR ...]", file=sys.stderr)
        sys.exit(2)
    print(save_png(args[0], dataset_panel(args[1:])))


if __name__ == "__main__":
    main()
