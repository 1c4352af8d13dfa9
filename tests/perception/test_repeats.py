"""A grasp that just failed on an unchanged scene is not answered again (perception/core/repeats.py)."""

from __future__ import annotations

import math

import cv2
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perception.core.calibration import project_points
from perception.core.decode import DecodeOptions, decode_grasp
from perception.core.geometry import make_view
from perception.core.grasp import Grasp, normalize_angle
from perception.core.imageio import encode_image
from perception.core.repeats import (
    DEFAULT_REPEATS,
    RepeatGuard,
    frame_fingerprint,
    moved_blocks,
    repeat_options,
)
from perception.core.testing import make_test_frame

RADIUS, YAW = DEFAULT_REPEATS["radius"], math.radians(DEFAULT_REPEATS["yaw_deg"])


def _near(a: Grasp, b: Grasp) -> bool:
    return (math.dist(a.position[:2], b.position[:2]) < RADIUS
            and abs(normalize_angle(a.yaw - b.yaw)) <= YAW + 1e-9)


def _patch(rgb: np.ndarray, calib, xy, value: int, half_px: int = 10) -> np.ndarray:
    """The frame with a square painted where the table point ``xy`` projects."""
    out = rgb.copy()
    u, v = (int(round(c)) for c in project_points(np.array([[xy[0], xy[1], calib.table_z]]), calib)[0])
    cv2.rectangle(out, (u - half_px, v - half_px), (u + half_px, v + half_px), (value,) * 3, -1)
    return out


def _bar(calib, xy, seed: int) -> np.ndarray:
    """A textured frame with a bright 6 x 2 cm bar centred on the table point ``xy``."""
    rgb = make_test_frame(calib, seed=seed)
    corners = np.array([[xy[0] + dx, xy[1] + dy, calib.table_z] for dx, dy in
                        ((-0.03, -0.01), (0.03, -0.01), (0.03, 0.01), (-0.03, 0.01))])
    cv2.fillConvexPoly(rgb, np.round(project_points(corners, calib)).astype(np.int32), (200, 200, 200))
    return rgb


def test_motion_is_measured_in_metres_not_noise_or_exposure(calib):
    """New sensor noise and a global exposure shift are no motion; a part pushed by 2 mm
    moved less than 1 cm, one pushed 3 cm or lifted moved more."""
    guard = RepeatGuard(calib, {})
    g = Grasp(position=(0.5, 0.0, 0.02), yaw=0.0, width=0.05, quality=0.9)
    before = frame_fingerprint(_bar(calib, (0.5, 0.0), seed=0), 8)
    region, per_m = guard._region(g, before.shape)

    def moved_m(rgb):
        return moved_blocks(before, frame_fingerprint(rgb, 8), region, 5.0) / per_m

    assert moved_m(_bar(calib, (0.5, 0.0), seed=1)) == 0.0  # same scene, new noise
    brighter = np.clip(_bar(calib, (0.5, 0.0), seed=1).astype(int) + 20, 0, 255).astype(np.uint8)
    assert moved_m(brighter) == 0.0
    assert moved_m(_bar(calib, (0.502, 0.0), seed=1)) < 0.01
    assert moved_m(_bar(calib, (0.5, 0.03), seed=1)) > 0.01
    assert moved_m(make_test_frame(calib, seed=1)) > 0.01  # the bar was lifted


def test_options_are_validated():
    assert repeat_options({"memory": None, "radius": 0.02})["radius"] == 0.02
    assert repeat_options(None) == DEFAULT_REPEATS
    for bad in ({"memroy": 3}, {"memory": -1}, {"radius": float("nan")}, {"block_px": 0}, {"yaw_deg": "x"},
                {"noise_sigmas": -1}):
        with pytest.raises(ValueError, match="repeats"):
            repeat_options(bad)


def test_guard_forgets_when_the_scene_moved_near_the_grasp_and_after_memory_answers(calib):
    guard = RepeatGuard(calib, {"memory": 3})
    g = Grasp(position=(0.5, 0.0, 0.03), yaw=0.2, width=0.05, quality=0.9)
    scene = make_test_frame(calib, seed=0)
    guard.answered(guard.fingerprint(scene), g)
    assert guard.failed(guard.fingerprint(make_test_frame(calib, seed=1))) == [g]  # unchanged: it failed
    far = _patch(make_test_frame(calib, seed=2), calib, (0.4, 0.12), 220)  # a part appeared 16 cm away
    assert guard.failed(guard.fingerprint(far)) == [g]
    near = _patch(make_test_frame(calib, seed=2), calib, (0.53, 0.0), 220)  # 3 cm away: within its region
    assert guard.failed(guard.fingerprint(near)) == []  # something moved there: forgotten for good
    assert guard.failed(guard.fingerprint(scene)) == []

    guard.answered(guard.fingerprint(scene), g)
    for _ in range(2):
        guard.answered(guard.fingerprint(scene), None)  # null answers count as answers
        assert guard.failed(guard.fingerprint(scene)) == [g]
    guard.answered(guard.fingerprint(scene), None)
    assert guard.failed(guard.fingerprint(scene)) == []  # memory=3 answers later
    off = RepeatGuard(calib, {"memory": 0})
    off.answered(off.fingerprint(scene), g)
    assert off.failed(off.fingerprint(scene)) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["table", "camera"]), n_avoid=st.integers(1, 6),
       threshold=st.sampled_from([0.3, 0.7]), neighbourhood=st.sampled_from([0, 1]))
def test_decode_never_answers_an_avoided_grasp(calib, seed, kind, n_avoid, threshold, neighbourhood):
    """Over random maps and random grasps to avoid (the first ones the decode's own answers,
    so the avoidance is exercised), the answer is never within the default radius and yaw of one,
    and stays inside the workspace at or above the threshold."""
    view = make_view(calib, (40, 32), kind)
    rng = np.random.default_rng(seed)
    q = rng.random((6, 32, 40)).astype(np.float32)
    width = np.full((32, 40), 0.05, np.float32)
    height = (rng.random((32, 40)) * 0.05).astype(np.float32)
    avoid: list[Grasp] = []
    options = DecodeOptions(threshold, neighbourhood_px=neighbourhood)
    for _ in range(n_avoid):
        dec = decode_grasp(q, width, height, calib, view, options, avoid=avoid)
        if dec.grasp is None:
            assert dec.reason
            break
        g = dec.grasp
        assert not any(_near(g, a) for a in avoid)
        assert calib.in_workspace(g.position[0], g.position[1]) and g.quality >= threshold - 1e-6
        avoid.append(g)
    if avoid:  # without the list the first answer comes back: the decode is deterministic
        again = decode_grasp(q, width, height, calib, view, options)
        assert _near(again.grasp, avoid[0])


def test_service_answers_another_grasp_on_an_unchanged_scene(calib, artifact_dir):
    """A real server on loopback: the same scene (new sensor noise each frame) gets a new
    grasp, or null when every good one failed; a change where the grasp was brings it back.
    The memory is in /v1/info and /metrics; repeats.memory=0 answers every frame alike."""
    from perception.robot.service import create_app
    from tests.perception.conftest import ThreadServer

    def ask(url, rgb):
        r = httpx.post(url + "/v1/grasp", content=encode_image(rgb, "png"), headers={"Content-Type": "image/png"},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadServer(create_app(artifact_dir, repeats={"memory": 4}, intra_op_num_threads=1)) as srv:
        first = ask(srv.url, make_test_frame(calib, seed=0))
        assert first["grasp"] is not None
        g0 = Grasp(**{k: first["grasp"][k] for k in ("position", "yaw", "width", "quality")})
        second = ask(srv.url, make_test_frame(calib, seed=1))
        if second["grasp"] is not None:
            assert not _near(Grasp(**second["grasp"]), g0)
        else:
            assert "just failed" in second["reason"]
        info = httpx.get(srv.url + "/v1/info").json()
        assert info["repeats"]["memory"] == 4 and info["repeats"]["remembered"] >= 1
        assert "sim2real_repeats_remembered" in httpx.get(srv.url + "/metrics").text
        moved = _patch(make_test_frame(calib, seed=2), calib, g0.position[:2], 230, half_px=14)
        back = ask(srv.url, moved)
        assert back["grasp"] is not None and _near(Grasp(**back["grasp"]), g0)
    with ThreadServer(create_app(artifact_dir, repeats={"memory": 0}, intra_op_num_threads=1)) as srv:
        answers = [ask(srv.url, make_test_frame(calib, seed=s))["grasp"] for s in range(3)]
        assert all(a is not None for a in answers)
        assert [a["position"] for a in answers[1:]] == [answers[0]["position"]] * 2  # the same grasp each time
        assert [a["yaw"] for a in answers[1:]] == [answers[0]["yaw"]] * 2
        assert httpx.get(srv.url + "/v1/info").json()["repeats"] is None


class _FailingRobot:
    """Executes nothing and reports every grasp failed (a robot stuck on one scene)."""

    name = "failing"

    def __init__(self) -> None:
        self.requests = []

    def execute(self, request):
        from perception.robot.robots import Outcome

        self.requests.append(request)
        return Outcome(False)

    def close(self) -> None:
        pass


def test_loop_hands_over_a_failed_grasp_once_on_an_unchanged_scene(tmp_path, calib, artifact_dir):
    """sim2real-grasp-loop on a replayed camera showing one scene (new noise every frame):
    with a robot reporting failures, no grasp is handed over twice; a dry run (nothing
    executed) hands over the same grasp every step."""
    from perception.core.artifact import PolicyRunner
    from perception.core.imageio import write_image
    from perception.robot.cameras import ReplayCamera, ThreadedCamera
    from perception.robot.loop import GraspLoop, LoopConfig
    from perception.robot.robots import DryRunRobot

    d = tmp_path / "cam"
    for i in range(6):
        write_image(d / f"f_{i:03d}.png", make_test_frame(calib, seed=i))
    runner = PolicyRunner(artifact_dir, intra_op_num_threads=1)
    for robot in (_FailingRobot(), DryRunRobot()):
        cam = ThreadedCamera(ReplayCamera(d, fps=30), max_age=0.5).start()
        try:
            cfg = LoopConfig(rate_hz=100, settle_s=0, max_steps=4, repeats={"memory": 8})
            GraspLoop(cam, runner, robot, None, cfg).run()
        finally:
            cam.close()
        grasps = [r.grasp for r in robot.requests]
        assert grasps
        pairs = [(a, b) for i, a in enumerate(grasps) for b in grasps[i + 1:]]
        if isinstance(robot, DryRunRobot):
            assert len(grasps) == 4 and all(_near(a, b) for a, b in pairs)
        else:
            assert not any(_near(a, b) for a, b in pairs)


def test_bad_settings_stop_both_commands_with_a_message(tmp_path, artifact_dir, capsys):
    """A bad repeats.* is a message and exit 2 at start, in the loop before any camera opens."""
    from perception.robot.loop import main as loop_main
    from perception.robot.service import main as serve_main

    for main, extra in ((loop_main, ["camera=replay:/nonexistent", "robot=dry", f"out_dir={tmp_path}"]),
                        (serve_main, [])):
        with pytest.raises(SystemExit) as e:
            main([f"artifact={artifact_dir}", "repeats.memory=-1", *extra])
        assert e.value.code == 2
        assert "repeats.memory must be >= 0" in capsys.readouterr().err
