"""Intel RealSense colour stream through ``pyrealsense2`` (optional; imported only here)."""

from __future__ import annotations

import time

import numpy as np

from perception.robot.cameras.base import Camera, CameraError, Frame

__all__ = ["RealSenseCamera"]


class RealSenseCamera(Camera):
    """The RGB stream of a RealSense camera.

    Args:
        serial: device serial number (``None``: the first camera found).
        size: ``(width, height)`` of the colour stream.
        fps: frame rate.
        timeout_ms: how long ``read`` waits for a frame.

    The calibration must be made for this stream's resolution; the camera's factory
    intrinsics are available from :meth:`factory_intrinsics` as a starting point.
    """

    def __init__(self, serial: str | None = None, size: tuple[int, int] = (640, 480), fps: int = 30,
                 timeout_ms: int = 1000) -> None:
        self.serial = serial
        self.size = (int(size[0]), int(size[1]))
        self.fps = int(fps)
        self.timeout_ms = int(timeout_ms)
        self._pipe = None
        self._profile = None
        self._index = 0
        self.name = f"realsense:{serial or 'first'}"

    @staticmethod
    def _rs():
        try:
            import pyrealsense2 as rs  # lazy: pyrealsense2 (optional dependency: only this camera needs it)
        except ImportError as exc:
            raise CameraError(
                "the RealSense driver needs pyrealsense2: pip install pyrealsense2"
            ) from exc
        return rs

    def open(self) -> None:
        rs = self._rs()
        self.close()
        pipe = rs.pipeline()
        cfg = rs.config()
        if self.serial:
            cfg.enable_device(str(self.serial))
        cfg.enable_stream(rs.stream.color, self.size[0], self.size[1], rs.format.rgb8, self.fps)
        try:
            self._profile = pipe.start(cfg)
        except RuntimeError as exc:
            raise CameraError(f"cannot start RealSense {self.serial or '(first found)'}: {exc}") from exc
        self._pipe = pipe

    @property
    def is_open(self) -> bool:
        return self._pipe is not None

    def read(self) -> Frame:
        if self._pipe is None:
            raise CameraError("RealSense camera is not open")
        try:
            frames = self._pipe.wait_for_frames(self.timeout_ms)
        except RuntimeError as exc:
            raise CameraError(f"RealSense delivered no frame: {exc}") from exc
        color = frames.get_color_frame()
        if not color:
            raise CameraError("RealSense frame set has no colour frame")
        img = np.asanyarray(color.get_data()).copy()
        self._index += 1
        return Frame(image=img, timestamp=time.monotonic(), index=self._index, source=self.name)

    def factory_intrinsics(self) -> dict:
        """``{"K": 3x3, "dist": [5]}`` from the device (Brown-Conrady model)."""
        if self._profile is None:
            raise CameraError("open the camera first")
        rs = self._rs()
        intr = self._profile.get_stream(rs.stream.color).as_video_stream_profile().get_intrinsics()
        K = [[intr.fx, 0.0, intr.ppx], [0.0, intr.fy, intr.ppy], [0.0, 0.0, 1.0]]
        return {"K": K, "dist": list(intr.coeffs)[:5], "image_size": [intr.width, intr.height]}

    def close(self) -> None:
        if self._pipe is not None:
            try:
                self._pipe.stop()
            except RuntimeError:
                pass
            self._pipe = None
