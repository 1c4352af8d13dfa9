"""The camera interface every driver implements, and the frame it delivers.

A :class:`Camera` is opened, read frame by frame, and closed. Drivers deliver raw RGB
``uint8`` frames (see :mod:`perception.core.frames`) stamped with :func:`time.monotonic` at
capture. :class:`~perception.robot.cameras.threaded.ThreadedCamera` wraps any driver with a
background thread that keeps the newest frame, refuses stale ones and reconnects.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["Frame", "Camera", "CameraError", "EndOfStream", "StaleFrameError"]


class CameraError(RuntimeError):
    """The camera cannot be opened or read (unplugged, missing file, driver error)."""


class EndOfStream(CameraError):
    """A finite source (video file, image sequence, replay folder) has no more frames."""


class StaleFrameError(CameraError):
    """No frame recent enough is available (camera lost, reconnecting, or too slow)."""


@dataclass(frozen=True)
class Frame:
    """One captured frame.

    Attributes:
        image: ``(H, W, 3)`` uint8 RGB, raw (distorted) as the camera delivers it.
        timestamp: :func:`time.monotonic` seconds when it was captured.
        index: running frame number of this camera (since the driver was created).
        source: a short description of the camera.
    """

    image: np.ndarray
    timestamp: float
    index: int
    source: str = ""

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.timestamp


class Camera(abc.ABC):
    """A source of raw RGB frames.

    ``open`` may be called again after ``close`` (reconnecting); ``read`` blocks until the
    next frame and raises :class:`CameraError` (or :class:`EndOfStream`) when it cannot
    deliver one. Cameras are context managers.
    """

    name: str = "camera"

    @abc.abstractmethod
    def open(self) -> None:
        """Open the device; raises :class:`CameraError` with what to check."""

    @abc.abstractmethod
    def read(self) -> Frame:
        """The next frame; raises :class:`CameraError` / :class:`EndOfStream`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the device (idempotent)."""

    @property
    def is_open(self) -> bool:
        return False

    def __enter__(self) -> Camera:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
