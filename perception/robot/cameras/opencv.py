"""OpenCV ``VideoCapture`` driver: a device index or path (V4L2), a video file, an image
sequence (``frame_%04d.png``) or a GStreamer pipeline string."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import cv2
import numpy as np

from perception.core.imageio import to_rgb
from perception.robot.cameras.base import Camera, CameraError, EndOfStream, Frame

__all__ = ["OpenCVCamera"]

VIDEO_SUFFIXES = {".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v", ".mjpeg", ".mjpg"}


class OpenCVCamera(Camera):
    """Frames from ``cv2.VideoCapture``.

    Args:
        source: a device index (``0``), a device path (``/dev/video0``), a video file, an
            image-sequence pattern (``dir/frame_%04d.png``) or a GStreamer pipeline
            (ending in ``appsink``).
        backend: ``"auto"``, ``"v4l2"``, ``"gstreamer"``, ``"ffmpeg"`` or ``"images"``;
            ``auto`` picks V4L2 for devices, GStreamer for pipelines.
        size: requested ``(width, height)`` for devices (``None``: the device's default).
        fps: requested rate for devices; for files, the pace (``None``: the file's own).
        realtime: deliver file frames at their frame rate instead of as fast as possible.
    """

    def __init__(
        self,
        source: int | str,
        backend: str = "auto",
        size: tuple[int, int] | None = None,
        fps: float | None = None,
        realtime: bool = True,
    ) -> None:
        self.source = source
        self.backend = backend
        self.size = tuple(size) if size else None
        self.fps = fps
        self.realtime = realtime
        self._cap: cv2.VideoCapture | None = None
        self._index = 0
        self._next_due = 0.0
        self._period = 0.0
        self._lock = threading.Lock()
        self.name = str(source)

    # ------------------------------------------------------------------ kinds
    @property
    def kind(self) -> str:
        s = self.source
        if isinstance(s, int) or (isinstance(s, str) and s.isdigit()):
            return "device"
        s = str(s)
        if s.startswith("/dev/"):
            return "device"
        if "!" in s and "appsink" in s:
            return "gstreamer"
        if "%" in s:
            return "images"
        return "file"

    def _api(self) -> int:
        b = self.backend.lower()
        if b == "auto":
            b = {"device": "v4l2", "gstreamer": "gstreamer", "images": "images", "file": "any"}[self.kind]
        return {"v4l2": cv2.CAP_V4L2, "gstreamer": cv2.CAP_GSTREAMER, "ffmpeg": cv2.CAP_FFMPEG,
                "images": cv2.CAP_IMAGES, "any": cv2.CAP_ANY}[b]

    def open(self) -> None:
        self.close()
        kind = self.kind
        src: int | str = int(self.source) if kind == "device" and str(self.source).isdigit() else str(self.source)
        if kind == "file" and not Path(str(src)).is_file():
            raise CameraError(f"video file {src} not found")
        cap = cv2.VideoCapture(src, self._api())
        if not cap.isOpened() and self.backend == "auto" and kind == "device":
            cap = cv2.VideoCapture(src, cv2.CAP_ANY)
        if not cap.isOpened():
            cap.release()
            hint = {
                "device": "is the camera plugged in and not used by another program (check `v4l2-ctl --list-devices`)?",
                "gstreamer": "is OpenCV built with GStreamer and does the pipeline end in appsink?",
                "images": "does the pattern match files (e.g. frame_%04d.png starting at 0)?",
                "file": "is it a video OpenCV's FFmpeg can read?",
            }[kind]
            raise CameraError(f"cannot open camera {self.source!r}: {hint}")
        if kind == "device":
            if self.size:
                cap.set(cv2.CAP_PROP_FRAME_WIDTH, self.size[0])
                cap.set(cv2.CAP_PROP_FRAME_HEIGHT, self.size[1])
            if self.fps:
                cap.set(cv2.CAP_PROP_FPS, float(self.fps))
            cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        file_fps = cap.get(cv2.CAP_PROP_FPS) or 0.0
        rate = self.fps or (file_fps if 0 < file_fps < 1000 else 30.0)
        self._period = 1.0 / rate if (kind in ("file", "images") and self.realtime) else 0.0
        self._next_due = time.monotonic()
        self._cap = cap

    @property
    def is_open(self) -> bool:
        return self._cap is not None

    def read(self) -> Frame:
        with self._lock:
            cap = self._cap
            if cap is None:
                raise CameraError(f"camera {self.source!r} is not open")
            if self._period:
                delay = self._next_due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self._next_due = max(self._next_due + self._period, time.monotonic() - self._period)
            try:
                ok, img = cap.read()
            except cv2.error as exc:
                raise CameraError(f"camera {self.source!r} read failed: {exc}") from exc
            if not ok or img is None:
                if self.kind in ("file", "images"):
                    raise EndOfStream(f"{self.source!r}: end of stream")
                raise CameraError(f"camera {self.source!r} delivered no frame (unplugged?)")
            ts = time.monotonic()
            self._index += 1
            return Frame(image=to_rgb(np.asarray(img)), timestamp=ts, index=self._index, source=self.name)

    def close(self) -> None:
        with self._lock:
            if self._cap is not None:
                self._cap.release()
                self._cap = None
