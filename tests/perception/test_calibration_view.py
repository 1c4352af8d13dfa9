"""A workspace partly out of the camera's frame: accepted with a warning, never grasped where
unseen; mostly out of it: refused with the share the camera sees."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from perception.core.calibration import (
    MIN_WORKSPACE_VISIBLE,
    Calibration,
    CalibrationError,
    default_calibration_path,
    project_points,
)
from perception.core.decode import DecodeOptions, decode_grasp
from perception.core.geometry import table_view, view_pixels_to_base


def _widened(extra_x: float) -> dict:
    """The shipped calibration with the workspace stretched away from the robot by ``extra_x`` m."""
    data = json.loads(default_calibration_path().read_text())
    x0, x1 = data["workspace"]["x"]
    data["workspace"] = {"x": [x0, x1 + extra_x], "y": data["workspace"]["y"]}
    return data


def test_the_shipped_camera_sees_its_whole_workspace(caplog):
    with caplog.at_level(logging.WARNING, logger="perception.core.calibration"):
        calib = Calibration.load(default_calibration_path())
    assert calib.workspace_visible_share() == 1.0 and not caplog.records


def test_a_corner_out_of_view_loads_with_a_warning_and_is_never_grasped(caplog):
    with caplog.at_level(logging.WARNING, logger="perception.core.calibration"):
        calib = Calibration.from_dict(_widened(0.3))
    share = calib.workspace_visible_share()
    assert MIN_WORKSPACE_VISIBLE < share < 1.0
    assert any("outside the camera's view" in r.getMessage() for r in caplog.records)

    view = table_view(calib, (48, 48))
    W, H = view.size
    vv, uu = np.mgrid[0:H, 0:W]
    uv = np.stack([uu.ravel(), vv.ravel()], axis=1).astype(float)
    xyz = view_pixels_to_base(uv, calib, view, calib.table_z + 0.02)
    raw = project_points(xyz, calib)
    w, h = calib.image_size
    unseen = ~((raw[:, 0] >= 0) & (raw[:, 0] <= w - 1) & (raw[:, 1] >= 0) & (raw[:, 1] <= h - 1))
    inside = ((xyz[:, 0] > calib.workspace_x[0]) & (xyz[:, 0] < calib.workspace_x[1])
              & (xyz[:, 1] > calib.workspace_y[0]) & (xyz[:, 1] < calib.workspace_y[1]))
    target = np.flatnonzero(unseen & inside)
    assert target.size > 0  # the view holds workspace cells the camera does not see
    q = np.full((4, H, W), 0.1, np.float32)
    q[0].reshape(-1)[target] = 0.95  # the policy's best grasps all lie where nothing is seen
    seen_cell = np.flatnonzero(~unseen & inside)[0]
    q[1].reshape(-1)[seen_cell] = 0.6
    wmap = np.full((H, W), 0.05, np.float32)
    hmap = np.full((H, W), 0.02, np.float32)
    dec = decode_grasp(q, wmap, hmap, calib, view, DecodeOptions(0.5))
    assert dec.grasp is not None and dec.view_pixel == (float(seen_cell % W), float(seen_cell // W))
    u, v = dec.pixel
    assert 0 <= u <= w - 1 and 0 <= v <= h - 1
    q[1] = 0.1
    none = decode_grasp(q, wmap, hmap, calib, view, DecodeOptions(0.5))
    assert none.grasp is None and "where the camera sees" in none.reason


def test_a_workspace_mostly_out_of_view_is_refused():
    data = _widened(0.8)
    assert Calibration.from_dict(data, check_view=False).workspace_visible_share() < MIN_WORKSPACE_VISIBLE
    with pytest.raises(CalibrationError, match=r"outside the camera's view: the camera sees \d+%"):
        Calibration.from_dict(data)


def test_one_loader_resolves_every_commands_calibration(tmp_path):
    """``calibration=`` null or empty is the packaged camera; a path is that file, checked."""
    from perception.core.calibration import calibration_path, load_calibration

    assert calibration_path(None) == calibration_path("") == default_calibration_path()
    assert load_calibration().digest() == Calibration.load(default_calibration_path()).digest()
    moved = json.loads(default_calibration_path().read_text())
    moved["T_base_camera"][0][3] += 0.01
    mine = tmp_path / "cell.json"
    mine.write_text(json.dumps(moved))
    assert calibration_path(str(mine)) == mine
    assert load_calibration(mine).digest() != load_calibration().digest()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CalibrationError):
        load_calibration(tmp_path / "bad.json")
