"""Fixtures for the robot-side tests: a synthetic ONNX artifact and a real HTTP server."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.imageio import encode_image
from perception.core.testing import free_port, make_test_artifact, make_test_frame


@pytest.fixture(scope="session")
def calib() -> Calibration:
    return Calibration.load(default_calibration_path())


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory):
    """Quality peaks at (0.5, 0.05) on the table; bright spots add to it."""
    return make_test_artifact(tmp_path_factory.mktemp("artifact"), gain=1.5)


@pytest.fixture(scope="session")
def frame(calib) -> np.ndarray:
    return make_test_frame(calib)


@pytest.fixture(scope="session")
def png_bytes(frame) -> bytes:
    return encode_image(frame, "png")


@pytest.fixture(scope="session")
def jpeg_bytes(frame) -> bytes:
    return encode_image(frame, "jpeg")


class ThreadServer:
    """The service's own server (perception.robot.server.make_server) in a thread on 127.0.0.1 (a real socket)."""

    def __init__(self, app) -> None:
        from perception.robot.server import ServerLimits, make_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        limits = getattr(app.state, "limits", None) or ServerLimits()
        self.server = make_server(app, "127.0.0.1", self.port, limits, log_level="warning", handle_signals=False)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        self.thread.join(10)


@pytest.fixture(scope="module")
def live_server(artifact_dir):
    """The service with token 's3cret' on a real port (module-scoped)."""
    from perception.robot.service import create_app

    app = create_app(artifact_dir, token="s3cret", max_body_bytes=10 * 1024 * 1024, max_concurrency=2,
                     intra_op_num_threads=1)
    with ThreadServer(app) as srv:
        yield srv
