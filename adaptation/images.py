"""Reading the user's folder of real camera frames (``docs/robot_cell.md`` section 4).

A folder of ``*.png`` / ``*.jpg`` frames at the calibration's ``image_size``, no labels.
An empty folder, an unreadable file or a frame of the wrong size stops with a
:class:`RealFramesError` that names the folder or the file and says what to do.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import cv2
import numpy as np

from perception.core.calibration import Calibration
from perception.core.preprocess import PreprocessError, ensure_rgb8

__all__ = ["RealFramesError", "IMAGE_SUFFIXES", "list_real_frames", "read_rgb", "read_real_frame", "iter_real_frames",
           "load_real_frames", "RealFrames"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class RealFramesError(ValueError):
    """The real-frames folder is missing, empty, or holds a frame that cannot be used."""


def list_real_frames(real_dir: str | Path) -> list[Path]:
    """Sorted ``*.png`` / ``*.jpg`` / ``*.jpeg`` files of ``real_dir`` (not recursive).

    Raises:
        RealFramesError: the folder does not exist, is not a folder, or holds no frames.
    """
    d = Path(real_dir)
    if not d.exists():
        raise RealFramesError(f"real frames folder {d} does not exist; pass real_dir=DIR with your camera frames")
    if not d.is_dir():
        raise RealFramesError(f"real_dir {d} is not a folder; pass the folder that holds the *.png / *.jpg frames")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise RealFramesError(
            f"real frames folder {d} holds no *.png or *.jpg frames; capture a few hundred frames "
            "from the calibrated camera into it"
        )
    return files


def read_rgb(path: str | Path) -> np.ndarray:
    """Decode one image file to ``(H, W, 3)`` uint8 RGB (grey, RGBA and 16-bit converted).

    Raises:
        RealFramesError: the file cannot be read or decoded.
    """
    path = Path(path)
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as exc:
        raise RealFramesError(f"real frame {path} cannot be read: {exc}") from exc
    img = cv2.imdecode(data, cv2.IMREAD_UNCHANGED) if data.size else None
    if img is None:
        raise RealFramesError(f"real frame {path} is not a readable PNG or JPEG image; remove or replace it")
    if img.ndim == 3 and img.shape[2] == 3:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    elif img.ndim == 3 and img.shape[2] == 4:
        img = cv2.cvtColor(img, cv2.COLOR_BGRA2RGBA)
    try:
        return ensure_rgb8(img)
    except PreprocessError as exc:
        raise RealFramesError(f"real frame {path}: {exc}") from exc


def read_real_frame(path: str | Path, calib: Calibration) -> np.ndarray:
    """One real frame as raw RGB, checked against ``calib.image_size``.

    Raises:
        RealFramesError: see :func:`read_rgb`; a frame whose size differs from ``calib.image_size``.
    """
    W, H = calib.image_size
    img = read_rgb(path)
    h, w = img.shape[:2]
    if (w, h) != (W, H):
        raise RealFramesError(
            f"real frame {path} is {w}x{h} but the calibration's image_size is {W}x{H}; "
            "frames must come from the calibrated camera at its native size"
        )
    return img


def iter_real_frames(real_dir: str | Path, calib: Calibration) -> Iterator[tuple[Path, np.ndarray]]:
    """Yield ``(path, raw RGB frame)`` for every frame of ``real_dir``, checked one by one.

    Raises:
        RealFramesError: see :func:`list_real_frames` and :func:`read_real_frame`.
    """
    for path in list_real_frames(real_dir):
        yield path, read_real_frame(path, calib)


def load_real_frames(real_dir: str | Path, calib: Calibration) -> list[np.ndarray]:
    """All frames of ``real_dir`` as raw ``(H, W, 3)`` uint8 RGB, in file-name order.

    Raises:
        RealFramesError: empty or missing folder, unreadable file, wrong size (naming it).
    """
    return [img for _, img in iter_real_frames(real_dir, calib)]


class RealFrames(Sequence):
    """The frames of ``real_dir`` in file-name order (as :func:`load_real_frames`), each read and
    checked when it is indexed: for a caller that uses a few of many frames without holding
    them all in memory.

    Raises:
        RealFramesError: at construction, see :func:`list_real_frames`; on indexing, see
            :func:`read_real_frame`.
    """

    def __init__(self, real_dir: str | Path, calib: Calibration) -> None:
        self.paths = list_real_frames(real_dir)
        self.calib = calib

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> np.ndarray:
        return read_real_frame(self.paths[i], self.calib)
