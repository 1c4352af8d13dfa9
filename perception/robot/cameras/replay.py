"""Replay a folder of frames (``*.png`` / ``*.jpg``, sorted by name) as a camera."""

from __future__ import annotations

import time
from pathlib import Path

from perception.core.imageio import ImageDecodeError, read_image
from perception.robot.cameras.base import Camera, CameraError, EndOfStream, Frame

__all__ = ["ReplayCamera", "list_frames"]

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")


def list_frames(folder: str | Path) -> list[Path]:
    """Frame files directly inside ``folder``, sorted by name."""
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in FRAME_SUFFIXES)


class ReplayCamera(Camera):
    """Frames of a folder, in name order.

    Args:
        folder: the folder.
        fps: pace of delivery (``None``: as fast as read).
        loop: start again after the last frame (else :class:`EndOfStream`).
    """

    def __init__(self, folder: str | Path, fps: float | None = None, loop: bool = True) -> None:
        self.folder = Path(folder)
        self.fps = fps
        self.loop = loop
        self._files: list[Path] | None = None
        self._pos = 0
        self._index = 0
        self._next_due = 0.0
        self.name = f"replay:{self.folder}"

    def open(self) -> None:
        if not self.folder.is_dir():
            raise CameraError(f"replay folder {self.folder} not found")
        files = list_frames(self.folder)
        if not files:
            raise CameraError(f"replay folder {self.folder} holds no *.png / *.jpg frames")
        self._files = files
        self._pos = 0
        self._next_due = time.monotonic()

    @property
    def is_open(self) -> bool:
        return self._files is not None

    def read(self) -> Frame:
        if self._files is None:
            raise CameraError(f"{self.name} is not open")
        if self._pos >= len(self._files):
            if not self.loop:
                raise EndOfStream(f"{self.name}: all {len(self._files)} frames replayed")
            self._pos = 0
        if self.fps:
            delay = self._next_due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._next_due = max(self._next_due + 1.0 / self.fps, time.monotonic() - 1.0 / self.fps)
        path = self._files[self._pos]
        self._pos += 1
        try:
            img = read_image(path)
        except ImageDecodeError as exc:
            raise CameraError(str(exc)) from exc
        self._index += 1
        return Frame(image=img, timestamp=time.monotonic(), index=self._index, source=self.name)

    def close(self) -> None:
        self._files = None
