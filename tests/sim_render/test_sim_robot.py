"""The sim camera and sim robot behind the robot-side interfaces (PyBullet DIRECT)."""

from __future__ import annotations

import numpy as np

from perception.core.grasp import Grasp
from perception.core.testing import make_test_artifact
from perception.robot.cameras import Camera, ThreadedCamera, open_camera
from perception.robot.loop import load_attempts
from perception.robot.loop import main as loop_main
from perception.robot.robots import GraspRequest, RobotAdapter
from sim_render.sim_robot import SimCamera, SimCell, SimRobot


def test_sim_camera_is_a_camera():
    cam = open_camera("sim:3", fps=None)
    assert isinstance(cam, SimCamera) and isinstance(cam, Camera)
    with ThreadedCamera(cam, max_age=5.0) as t:
        f = t.read(timeout=30)
    assert f.image.shape == (480, 640, 3) and f.image.dtype == np.uint8
    assert f.image.std() > 5  # a rendered scene, not a blank frame


def test_sim_robot_grasps_and_reports():
    cell = SimCell(seed=2)
    robot = cell.robot()
    assert isinstance(robot, SimRobot) and isinstance(robot, RobotAdapter)
    c = cell.cell.client
    before = len(cell.cell.bodies.objects)
    outcomes = []
    table_z = cell.calib.table_z
    for body in list(cell.cell.bodies.objects)[:2]:
        x, y, _ = c.getBasePositionAndOrientation(body)[0]
        top = c.getAABB(body)[1][2]
        # What a robot measures (CONTRACT.md section 7). Nearly closed fingers aimed 1 cm above the table at
        # a part's centre stop on the part: the stop is a surface height, at most the part's top.
        out = robot.execute(GraspRequest(1, Grasp((x, y, table_z + 0.01), 0.0, 0.004)))
        assert out.contact_stop is True and table_z + 0.012 < out.fingertip_z <= top + 0.003, (out, top)
        for yaw in (0.0, np.pi / 2):
            out = robot.execute(GraspRequest(1, Grasp((x, y, 0.01), yaw, 0.08)))
            outcomes.append(out.success)
            assert isinstance(out.success, bool) and "tip_z" in out.detail
            assert 0.0 <= out.jaw_width <= 0.08 and (out.jaw_width > 0.006 or not out.success)
    # Aimed at the bare table beside the bin: the descent reaches its z and the jaws close on nothing.
    x0, y0, _ = cell.calib.workspace_center
    out = robot.execute(GraspRequest(2, Grasp((x0, y0 - 0.3, table_z + 0.02), 0.0, 0.05)))
    assert out.contact_stop is False and abs(out.fingertip_z - (table_z + 0.02)) < 0.003 and out.jaw_width < 0.006
    removed = sum(outcomes)
    assert len(cell.cell.bodies.objects) == before - removed or cell.scenes > 1
    cell.close()


def test_grasp_loop_in_sim(tmp_path):
    art = make_test_artifact(tmp_path / "art")
    out = tmp_path / "attempts"
    assert loop_main([f"artifact={art}", "camera=sim", "robot=sim", f"out_dir={out}", "max_attempts=2",
                      "rate_hz=20", "settle_s=0", "threads=1", "max_frame_age=2.0", "max_decision_age=4.0"]) == 0
    attempts = [a for a in load_attempts(out) if a["grasp"] is not None]
    assert len(attempts) == 2
    assert all(isinstance(a["outcome"]["success"], bool) for a in attempts)
    # The loop records what the sim robot measured, as POST /v1/outcome would store it.
    assert all(isinstance(a["outcome"]["contact_stop"], bool) and isinstance(a["outcome"]["fingertip_z"], float)
               and 0.0 <= a["outcome"]["jaw_width"] <= 0.1 for a in attempts)
