"""Camera drivers behind one interface (:class:`~perception.robot.cameras.base.Camera`).

:func:`open_camera` turns a spec string into a driver:

=====================================  ===============================================
spec                                   driver
=====================================  ===============================================
``0``, ``/dev/video0``                 :class:`OpenCVCamera` on a V4L2 device
``video.mp4``                          :class:`OpenCVCamera` on a video file
``images:dir/frame_%04d.png``          OpenCV image sequence
``gst:v4l2src ! ... ! appsink``        OpenCV with a GStreamer pipeline
``realsense`` / ``realsense:SERIAL``   :class:`RealSenseCamera` (needs ``pyrealsense2``)
``replay:DIR`` or an existing folder   :class:`ReplayCamera`
``sim`` / ``sim:SEED``                 the PyBullet cell's camera (registered by sim_render)
``package.module:Class``               any class implementing :class:`Camera`
=====================================  ===============================================

Drivers that need optional packages (``pyrealsense2``, PyBullet) import them only when used;
drivers of other packages (``sim``) are registered by them (:mod:`perception.robot.plugins`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from perception.robot.cameras.base import Camera, CameraError, EndOfStream, Frame, StaleFrameError
from perception.robot.cameras.opencv import VIDEO_SUFFIXES, OpenCVCamera
from perception.robot.cameras.replay import ReplayCamera, list_frames
from perception.robot.cameras.threaded import ThreadedCamera
from perception.robot.plugins import PluginError, load_registered, registered

__all__ = [
    "Camera", "CameraError", "EndOfStream", "Frame", "StaleFrameError", "OpenCVCamera", "ReplayCamera",
    "ThreadedCamera", "open_camera", "list_frames", "KNOWN_SCHEMES",
]

#: Named drivers of this package loaded lazily ("module:Class"); other packages register
#: theirs (:func:`perception.robot.plugins.registered`).
LAZY_DRIVERS = {"realsense": "perception.robot.cameras.realsense:RealSenseCamera"}
KNOWN_SCHEMES = ("opencv", "video", "images", "gst", "replay", *LAZY_DRIVERS, *sorted(registered("cameras")))


def _load(target: str) -> type:
    mod, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as exc:
        raise CameraError(f"cannot load camera driver {target}: {exc}") from exc


def open_camera(spec: Any, **kwargs: Any) -> Camera:
    """Build (not open) a camera from a spec; ``kwargs`` go to the driver.

    Raises:
        CameraError: an unknown scheme (the message lists the known ones).
    """
    if isinstance(spec, Camera):
        return spec
    if isinstance(spec, int):
        return OpenCVCamera(spec, **kwargs)
    s = str(spec).strip()
    if s.isdigit() or s.startswith("/dev/"):
        return OpenCVCamera(s, **kwargs)
    scheme, sep, rest = s.partition(":")
    if sep and scheme in ("opencv", "video"):
        return OpenCVCamera(int(rest) if rest.isdigit() else rest, **kwargs)
    if sep and scheme == "images":
        return OpenCVCamera(rest, backend="images", **kwargs)
    if sep and scheme == "gst":
        return OpenCVCamera(rest, backend="gstreamer", **kwargs)
    if sep and scheme == "replay":
        return ReplayCamera(rest, **kwargs)
    if scheme in LAZY_DRIVERS or scheme in registered("cameras"):
        try:
            cls = _load(LAZY_DRIVERS[scheme]) if scheme in LAZY_DRIVERS else load_registered("cameras", scheme)
        except PluginError as exc:
            raise CameraError(str(exc)) from exc
        if scheme == "realsense" and rest:
            kwargs.setdefault("serial", rest)
        if scheme == "sim" and rest:
            kwargs.setdefault("seed", int(rest))
        return cls(**kwargs)
    if " ! " in s and "appsink" in s:
        return OpenCVCamera(s, backend="gstreamer", **kwargs)
    p = Path(s)
    if p.is_dir():
        return ReplayCamera(p, **kwargs)
    if p.suffix.lower() in VIDEO_SUFFIXES:
        return OpenCVCamera(s, **kwargs)
    if "%" in s:
        return OpenCVCamera(s, backend="images", **kwargs)
    if sep and "." in scheme and rest.isidentifier():
        cls = _load(s)
        if not (isinstance(cls, type) and issubclass(cls, Camera)):
            raise CameraError(f"{s} is not a perception.robot.cameras.Camera")
        return cls(**kwargs)
    raise CameraError(
        f"unknown camera {s!r}: use a device index or /dev/videoN, a video file, a folder of frames, "
        f"or one of the schemes {', '.join(s + ':' for s in KNOWN_SCHEMES)}"
    )
