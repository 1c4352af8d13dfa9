"""sim2real-grasp-loop's hand-off and safety settings (issue 12), with a real HTTP
controller on loopback, real frame files and the real command."""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from perception.core.imageio import write_image
from perception.core.testing import make_test_frame, send_json
from perception.robot.loop import EXIT_STOPPED_FOR_SAFETY, load_attempts
from perception.robot.loop import main as loop_main


class SlowController(BaseHTTPRequestHandler):
    """Takes ``motion_s`` per grasp; counts grasps in motion at once; GET /idle says whether it moves."""

    motion_s = 1.2
    lock = threading.Lock()
    moving = 0
    max_moving = 0
    grasps = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        cls = type(self)
        with cls.lock:
            cls.moving += 1
            cls.grasps += 1
            cls.max_moving = max(cls.max_moving, cls.moving)
        time.sleep(cls.motion_s)
        with cls.lock:
            cls.moving -= 1
        try:
            send_json(self, {"success": False})
        except OSError:  # the loop gave up waiting: the motion ran anyway
            pass

    def do_GET(self):  # noqa: N802
        send_json(self, {"idle": type(self).moving == 0})

    def log_message(self, *args):
        pass


@pytest.fixture
def controller():
    SlowController.moving = SlowController.max_moving = SlowController.grasps = 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), SlowController)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture
def frames_dir(tmp_path, calib):
    d = tmp_path / "cam"
    for i, (x, y) in enumerate([(0.42, -0.08), (0.58, 0.1), (0.5, 0.0), (0.4, 0.12)]):
        write_image(d / f"f_{i:03d}.png", make_test_frame(calib, spot_xy=(x, y), seed=i))
    return d


def _loop(artifact_dir, camera_dir, out, *args):
    return loop_main([f"artifact={artifact_dir}", f"camera=replay:{camera_dir}", f"out_dir={out}", "rate_hz=50",
                      "settle_s=0", "threads=1", "repeats.memory=0", *args])


@pytest.mark.slow  # real 1.2 s motions, four of them
def test_a_slow_robot_is_never_sent_a_second_grasp(tmp_path, artifact_dir, frames_dir, controller, capsys):
    # The controller takes 1.2 s, the loop waits 0.3 s: it may still be moving. The replay is paced
    # (camera_fps): read as fast as PNGs decode, its 4 files can cycle in the loop's own 20 ms, and
    # every step then gets the same file, "pixel-identical" to the last (a flake seen at d10588b).
    paced = "camera_fps=70"
    rc = _loop(artifact_dir, frames_dir, tmp_path / "a", f"robot={controller}/grasp", "robot_timeout=0.3",
               "max_attempts=3", paced)
    assert rc == EXIT_STOPPED_FOR_SAFETY
    err = capsys.readouterr().err
    assert "attempt 1" in err and "did not confirm" in err
    time.sleep(1.2)
    assert SlowController.grasps == 1 and SlowController.max_moving == 1
    # With an idle endpoint the loop waits for the motion to end, then goes on: no overlap.
    rc = _loop(artifact_dir, frames_dir, tmp_path / "b", f"robot={controller}/grasp", "robot_timeout=0.3",
               f"robot_idle_url={controller}/idle", "robot_idle_timeout=5", "max_attempts=3", paced)
    assert rc == 0
    assert SlowController.grasps == 1 + 3 and SlowController.max_moving == 1


def test_a_frozen_camera_is_noticed(tmp_path, artifact_dir, frames_dir, capsys):
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    for i in range(4):  # the same image with fresh timestamps: a driver returning its last buffer
        shutil.copy(frames_dir / "f_000.png", frozen / f"f_{i:03d}.png")
    rc = _loop(artifact_dir, frozen, tmp_path / "a", "robot=dry", "max_failed_steps=3", "max_steps=20")
    assert rc == EXIT_STOPPED_FOR_SAFETY
    assert "pixel-identical" in capsys.readouterr().err
    grasps = [a for a in load_attempts(tmp_path / "a") if a["grasp"] is not None]
    assert len(grasps) == 1  # the first frame only; the frozen ones never reach the robot
    summary = json.loads((tmp_path / "a" / "last_session.json").read_text())
    assert summary["stopped_by"] == "failed_steps" and summary["failed_steps"] == 3


def test_a_frame_of_another_size_is_one_failed_step(tmp_path, artifact_dir, frames_dir, calib, caplog):
    mixed = tmp_path / "mixed"
    shutil.copytree(frames_dir, mixed)
    for name in ("f_001.png", "f_002.png", "f_003.png"):  # 640x360: another camera mode
        write_image(mixed / name, make_test_frame(calib)[:360])
    # The replay runs as fast as it reads, so which frame a step gets is chance: 3 of 4 are wrong.
    rc = _loop(artifact_dir, mixed, tmp_path / "a", "robot=dry", "max_steps=8")
    assert rc == 0  # the loop went on
    assert "the calibration wants (480, 640, 3)" in caplog.text
    summary = json.loads((tmp_path / "a" / "last_session.json").read_text())
    # A looping 4-frame replay may also hand the loop the same file twice in a row (pixel-identical).
    assert summary["failed_steps"] >= 1 and summary["steps"] == 8
    assert summary["attempts"] == summary["steps"] - summary["failed_steps"]


@pytest.mark.parametrize("override,key", [
    ("workspace_margin=-0.5", "workspace_margin"), ("max_failed_steps=0", "max_failed_steps"),
    ("quality_threshold=2", "quality_threshold"), ("rate_hz=abc", "rate_hz"), ("robot_timeout=0", "robot_timeout"),
    ("max_frame_age=nan", "max_frame_age"),
])
def test_bad_settings_stop_before_anything_opens(tmp_path, artifact_dir, override, key, capsys):
    with pytest.raises(SystemExit) as exc:
        loop_main([f"artifact={artifact_dir}", f"camera=replay:{tmp_path / 'none'}", "robot=dry", "out_dir=null",
                   override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err
