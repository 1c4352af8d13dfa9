"""sim2real-calibrate on synthetic board images rendered with a known ground truth.

Tolerances (stated here, checked below):
- intrinsics: fx, fy within 0.5 %, cx, cy within 2 px, RMS reprojection error < 0.3 px, and
  the fitted model maps rays to pixels within 0.5 px (checkerboard) or 1.0 px (ChArUco, whose
  corners are interpolated from the markers) of the truth over the central 80 % of the image;
- hand-eye: camera position within 5 mm, orientation within 0.3 deg.
"""

from __future__ import annotations

import json
import math

import cv2
import numpy as np
import pytest

from perception.core.calibration import Calibration
from perception.core.frames import invert_transform
from perception.core.imageio import write_image
from perception.robot.calibrate import Board, board_pose, detect_board, main, render_board

BOARD = Board(9, 6, 0.03)
BOARD_ARGS = ["board.cols=9", "board.rows=6", "board.square=0.03"]


def _rand_view(rng, K, dist):
    while True:
        rv = np.array([rng.uniform(-0.8, 0.8), rng.uniform(-0.8, 0.8), rng.uniform(-0.4, 0.4)])
        z = rng.uniform(0.35, 0.7)
        t = np.array([rng.uniform(-0.62, 0.2) * z, rng.uniform(-0.5, 0.2) * z, z])
        uv, _ = cv2.projectPoints(BOARD.object_points(), rv, t, K, dist)
        uv = uv.reshape(-1, 2)
        if uv.min() > 15 and uv[:, 0].max() < 625 and uv[:, 1].max() < 465:
            T = np.eye(4)
            T[:3, :3] = cv2.Rodrigues(rv)[0]
            T[:3, 3] = t
            return T


@pytest.mark.parametrize("kind", ["checkerboard", "charuco"])
def test_intrinsics_recovers_ground_truth(tmp_path, calib, capsys, kind):
    board = Board(9, 6, 0.03, kind=kind, marker=0.022)
    K = np.array([[600.0, 0, 322.0], [0, 605.0, 236.0], [0, 0, 1]])
    dist = np.array([0.09, -0.21, 0.0012, -0.0007, 0.08])
    rng = np.random.default_rng(1)
    img_dir = tmp_path / "board"
    for i in range(15):
        write_image(img_dir / f"view_{i:02d}.png", render_board(board, K, dist, (640, 480), _rand_view(rng, K, dist), seed=i))
    write_image(img_dir / "view_99_blank.png", np.full((480, 640, 3), 128, np.uint8))  # no board: skipped
    out = tmp_path / "calibration.json"
    args = [*BOARD_ARGS, f"board.kind={kind}", "board.marker=0.022"]
    assert main(["intrinsics", f"images={img_dir}", *args, f"out={out}"]) == 0
    assert "RMS reprojection error" in capsys.readouterr().out
    data = json.loads(out.read_text())
    res = Calibration.from_dict(data, check_view=False)
    Ke, de = res.K, res.dist
    assert Ke[0, 0] == pytest.approx(600.0, rel=0.005) and Ke[1, 1] == pytest.approx(605.0, rel=0.005)
    assert abs(Ke[0, 2] - 322.0) < 2 and abs(Ke[1, 2] - 236.0) < 2
    rep = data["calibration_report"]["intrinsics"]
    assert rep["rms_px"] < 0.3 and rep["skipped"] == ["view_99_blank.png"]
    vv, uu = np.mgrid[48:433:16, 64:577:16]
    pts = np.stack([uu.ravel(), vv.ravel()], 1).astype(np.float64).reshape(-1, 1, 2)
    rays = cv2.undistortPoints(pts, K, dist).reshape(-1, 2)
    proj, _ = cv2.projectPoints(np.c_[rays, np.ones(len(rays))], np.zeros(3), np.zeros(3), Ke, de)
    assert np.abs(proj.reshape(-1, 2) - pts.reshape(-1, 2)).max() < (0.5 if kind == "checkerboard" else 1.0)
    # Pose, table and workspace come from the base calibration (the packaged default).
    np.testing.assert_allclose(res.T_base_camera, calib.T_base_camera)


def _look_at_pose(p, cam_pos, rng, tilt=0.45):
    z = p - cam_pos
    z /= np.linalg.norm(z)
    x = np.cross([0.0, 0.0, 1.0], z)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    R = np.stack([x, y, z], axis=1) @ cv2.Rodrigues(rng.uniform(-tilt, tilt, 3))[0]
    T = np.eye(4)
    T[:3, :3] = R
    T[:3, 3] = p - R @ np.array([4 * BOARD.square, 2.5 * BOARD.square, 0.0])  # board centre at p
    return T


def test_handeye_recovers_camera_pose(tmp_path, calib):
    T_bc = calib.T_base_camera
    T_cb = invert_transform(T_bc)
    T_gripper_target = np.eye(4)
    T_gripper_target[:3, :3] = cv2.Rodrigues(np.array([0.3, -0.2, 0.5]))[0]
    T_gripper_target[:3, 3] = [0.02, -0.03, 0.11]
    rng = np.random.default_rng(3)
    entries, n = [], 0
    while n < 12:
        p = np.array([rng.uniform(0.38, 0.62), rng.uniform(-0.12, 0.12), rng.uniform(0.08, 0.3)])
        T_bt = _look_at_pose(p, T_bc[:3, 3], rng)
        T_ct = T_cb @ T_bt
        uv, _ = cv2.projectPoints(BOARD.object_points(), cv2.Rodrigues(T_ct[:3, :3])[0], T_ct[:3, 3], calib.K, calib.dist)
        if uv.min() < 15 or uv[..., 0].max() > 625 or uv[..., 1].max() > 465:
            continue
        img = render_board(BOARD, calib.K, calib.dist, calib.image_size, T_ct, seed=n)
        write_image(tmp_path / f"pose_{n:02d}.png", img)
        T_bg = T_bt @ invert_transform(T_gripper_target)
        if n % 2:
            entries.append({"image": f"pose_{n:02d}.png", "T_base_gripper": T_bg.tolist()})
        else:  # the same pose as position + xyzw quaternion
            q = _quat_xyzw(T_bg[:3, :3])
            entries.append({"image": f"pose_{n:02d}.png", "position": T_bg[:3, 3].tolist(), "quaternion": q})
        n += 1
    (tmp_path / "poses.json").write_text(json.dumps(entries))
    start = tmp_path / "start.json"
    T0 = T_bc.copy()
    T0[:3, 3] += [0.05, -0.04, 0.03]  # the input pose is wrong; the fit must not depend on it
    calib.replace(T_base_camera=T0).save(start)
    out = tmp_path / "calibration.json"
    assert main(["handeye", f"calibration={start}", f"poses={tmp_path / 'poses.json'}", *BOARD_ARGS, f"out={out}"]) == 0
    res = Calibration.load(out)
    err_mm = 1000 * np.linalg.norm(res.T_base_camera[:3, 3] - T_bc[:3, 3])
    R = res.T_base_camera[:3, :3].T @ T_bc[:3, :3]
    err_deg = math.degrees(math.acos(min(1.0, (np.trace(R) - 1) / 2)))
    assert err_mm < 5.0 and err_deg < 0.3, (err_mm, err_deg)
    np.testing.assert_allclose(res.K, calib.K)
    rep = json.loads(out.read_text())["calibration_report"]["handeye"]
    assert rep["target_spread_mm"] < 5 and len(rep["views"]) == 12


def _quat_xyzw(R):
    w = math.sqrt(max(0.0, 1 + R[0, 0] + R[1, 1] + R[2, 2])) / 2
    x = math.copysign(math.sqrt(max(0.0, 1 + R[0, 0] - R[1, 1] - R[2, 2])) / 2, R[2, 1] - R[1, 2])
    y = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] + R[1, 1] - R[2, 2])) / 2, R[0, 2] - R[2, 0])
    z = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] - R[1, 1] + R[2, 2])) / 2, R[1, 0] - R[0, 1])
    return [x, y, z, w]


def test_checkerboard_corner_order_is_canonical(calib):
    """A board turned by (almost) a half turn is still found with its own origin."""
    K, dist = calib.K, calib.dist
    T = np.eye(4)
    T[:3, :3] = cv2.Rodrigues(np.array([0.3, -0.2, 0.4]))[0] @ cv2.Rodrigues(np.array([0, 0, 0.97 * np.pi]))[0]
    T[:3, 3] = [0.05, 0.02, 0.6]
    img = render_board(BOARD, K, dist, calib.image_size, T)
    corners = detect_board(img, BOARD)
    Te = board_pose(img, corners, BOARD, K, dist)
    assert np.abs(Te[:3, 3] - T[:3, 3]).max() < 0.002
    assert np.abs(Te[:3, :3] - T[:3, :3]).max() < 0.01


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["nonsense"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["intrinsics", f"images={tmp_path}", f"out={tmp_path / 'x.json'}"])
    assert e.value.code == 2 and "no *.png" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["handeye", f"out={tmp_path / 'x.json'}"])
    assert e.value.code == 2 and "required" in capsys.readouterr().err
