"""Camera drivers: a real video file written with cv2.VideoWriter, folders, failures."""

from __future__ import annotations

import threading
import time

import cv2
import numpy as np
import pytest

from perception.core.imageio import write_image
from perception.robot.cameras import (
    Camera,
    CameraError,
    EndOfStream,
    Frame,
    OpenCVCamera,
    ReplayCamera,
    StaleFrameError,
    ThreadedCamera,
    open_camera,
)

W, H = 160, 120


def write_video(path, n=20, fps=20.0):
    vw = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (W, H))
    assert vw.isOpened()
    for i in range(n):
        img = np.zeros((H, W, 3), np.uint8)
        img[:, :, 2] = 200  # red in BGR
        cv2.putText(img, str(i), (10, 60), cv2.FONT_HERSHEY_SIMPLEX, 1.0, (255, 255, 255), 2)
        vw.write(img)
    vw.release()
    return path


@pytest.fixture
def video(tmp_path):
    return write_video(tmp_path / "cam.avi")


def test_video_file_frames(video):
    cam = OpenCVCamera(str(video), realtime=False)
    with cam:
        f = cam.read()
        assert f.image.shape == (H, W, 3) and f.image.dtype == np.uint8
        assert f.image[..., 0].mean() > 150 and f.image[..., 2].mean() < 60  # RGB, not BGR
        n = 1
        with pytest.raises(EndOfStream):
            while True:
                cam.read()
                n += 1
        assert n == 20
    with pytest.raises(CameraError, match="not found"):
        OpenCVCamera(str(video) + ".missing").open()


def test_replay_and_image_sequence(tmp_path):
    for i in range(3):
        write_image(tmp_path / f"frame_{i:04d}.png", np.full((H, W, 3), 10 * i, np.uint8))
    cam = open_camera(f"replay:{tmp_path}", loop=False)
    with cam:
        vals = [int(cam.read().image[0, 0, 0]) for _ in range(3)]
        assert vals == [0, 10, 20]
        with pytest.raises(EndOfStream):
            cam.read()
    seq = open_camera(f"images:{tmp_path}/frame_%04d.png", realtime=False)
    with seq:
        assert int(seq.read().image[0, 0, 0]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CameraError, match="no"):
        ReplayCamera(empty).open()


def test_open_camera_specs(tmp_path, video):
    assert isinstance(open_camera(0), OpenCVCamera)
    assert isinstance(open_camera("/dev/video7"), OpenCVCamera)
    assert isinstance(open_camera(str(video)), OpenCVCamera)
    assert isinstance(open_camera(str(tmp_path)), ReplayCamera)
    with pytest.raises(CameraError, match="replay:"):
        open_camera("nonsense")
    with pytest.raises(CameraError, match="pip install pyrealsense2"):
        open_camera("realsense").open()
    with pytest.raises(CameraError, match="cannot open camera"):
        OpenCVCamera("/dev/video-not-there").open()


def _read_checked(cam: ThreadedCamera, limit: float, timeout: float = 0.1) -> Frame | None:
    """A read that asserts the driver's promise: never a frame older than the limit."""
    try:
        f = cam.read(max_age=limit, timeout=timeout)
    except StaleFrameError:
        return None
    assert time.monotonic() - f.timestamp <= limit + 0.05
    return f


def test_video_file_disappears_and_comes_back(video, tmp_path):
    limit = 0.3
    hidden = tmp_path / "hidden.avi"
    cam = ThreadedCamera(OpenCVCamera(str(video)), max_age=limit, backoff_initial=0.05, backoff_max=0.2)
    with cam:
        assert cam.read(timeout=5).image.shape == (H, W, 3)
        video.rename(hidden)  # the file is removed while it plays
        deadline = time.monotonic() + 6
        stale = False
        while time.monotonic() < deadline:
            if _read_checked(cam, limit) is None:
                stale = True
                break
        assert stale, "a removed video must lead to stale reads"
        with pytest.raises(StaleFrameError, match="reconnecting"):
            cam.read(max_age=limit, timeout=0.3)
        assert cam.state == "reconnecting" and "not found" in cam.last_error
        hidden.rename(video)  # it comes back
        deadline = time.monotonic() + 6
        f = None
        while f is None and time.monotonic() < deadline:
            f = _read_checked(cam, limit, timeout=0.5)
        assert f is not None, cam.status()
        assert cam.reconnects >= 1
        # And it keeps delivering fresh frames (the video loops).
        for _ in range(10):
            assert _read_checked(cam, limit, timeout=1.0) is not None
    assert cam.state == "stopped"


class FlakyCamera(Camera):
    """A device whose reads fail while ``broken`` is set (an unplugged USB camera)."""

    name = "flaky"

    def __init__(self) -> None:
        self.broken = threading.Event()
        self.opened = False
        self.opens = 0
        self.i = 0

    def open(self) -> None:
        if self.broken.is_set():
            raise CameraError("device not found")
        self.opened = True
        self.opens += 1

    @property
    def is_open(self) -> bool:
        return self.opened

    def read(self) -> Frame:
        time.sleep(0.01)
        if self.broken.is_set():
            raise CameraError("VIDIOC_DQBUF: No such device")
        self.i += 1
        return Frame(np.full((4, 4, 3), self.i % 255, np.uint8), time.monotonic(), self.i, self.name)

    def close(self) -> None:
        self.opened = False


def test_device_error_and_recovery():
    dev = FlakyCamera()
    cam = ThreadedCamera(dev, max_age=0.2, backoff_initial=0.02, backoff_max=0.1).start()
    try:
        a = cam.read(timeout=2)
        b = cam.read(timeout=2, fresh=True)
        assert b.index > a.index
        dev.broken.set()
        time.sleep(0.5)
        with pytest.raises(StaleFrameError, match="newest frame is .* old"):
            cam.read(timeout=0.1)
        assert cam.status()["state"] == "reconnecting"
        dev.broken.clear()
        f = cam.read(timeout=3)
        assert time.monotonic() - f.timestamp <= 0.25
        assert dev.opens >= 2 and cam.reconnects >= 1
    finally:
        t0 = time.monotonic()
        cam.close()
        assert time.monotonic() - t0 < 2.0
    assert not dev.is_open
