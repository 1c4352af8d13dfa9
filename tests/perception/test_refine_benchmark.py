"""The refine benchmark's judge of a written calibration: the workspace error
(``benchmarks/refine.py``), against poses whose effect is known in closed form."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scripts import load_script

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.refine import AcceptSettings, perturb, pose_change

_bench = load_script("benchmarks/refine.py", "bench_refine")  # benchmarks/ is not an installed package
workspace_error_mm, workspace_outcome = _bench.workspace_error_mm, _bench.workspace_outcome


def test_the_workspace_error_is_zero_for_the_truth_and_a_shift_for_a_level_move():
    true = Calibration.load(default_calibration_path())
    assert workspace_error_mm(true, true.T_base_camera) < 1e-9
    # The camera moved 5 mm level (x, y), turning not at all: every pixel's ray moves 5 mm with it.
    moved = perturb(true.T_base_camera, np.array([0, 0, 0, 0.003, 0.004, 0.0]))
    assert abs(workspace_error_mm(true, moved) - 5.0) < 1e-6


def test_a_slide_along_the_ridge_moves_the_workspace_less_than_the_camera_centre():
    true = Calibration.load(default_calibration_path())
    T = true.T_base_camera
    # Turn the camera about an axis through the workspace centre: the centre's pixel stays, and
    # the camera centre moves far. The pose error reads it as large; the workspace error does not.
    centre = true.workspace_center
    angle = math.radians(2.0)
    axis = np.array([0.0, 0.0, 1.0])
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    R = np.eye(3) + math.sin(angle) * K + (1 - math.cos(angle)) * K @ K
    turned = np.eye(4)
    turned[:3, :3] = R @ T[:3, :3]
    turned[:3, 3] = centre + R @ (T[:3, 3] - centre)
    shift_mm = pose_change(T, turned)[0] * 1e3
    assert shift_mm > 15.0
    assert workspace_error_mm(true, turned) < shift_mm / 2


def test_the_outcome_by_workspace_error():
    true = Calibration.load(default_calibration_path())
    x = [0, 0, 0, 0.006, 0.008, 0.0]  # given 10 mm off, level
    half = perturb(true.T_base_camera, np.array([0, 0, 0, 0.0018, 0.0024, 0.0]))   # 3 mm
    worse = perturb(true.T_base_camera, np.array([0, 0, 0, 0.009, 0.012, 0.0]))   # 15 mm
    rec = {"x": x, "fit_T_base_camera": half.tolist()}
    acc = AcceptSettings.defaults(write_distance=True)  # the fit written as it is
    assert workspace_outcome(rec, accepted=True, true=true, acc=acc)[0] == "recovered"
    assert workspace_outcome(rec, accepted=False, true=true, acc=acc)[0] == "kept"
    worse_rec = {"x": x, "fit_T_base_camera": worse.tolist()}
    assert workspace_outcome(worse_rec, accepted=True, true=true, acc=acc)[0] == "wrong"
    assert workspace_outcome({"x": x}, accepted=True, true=true, acc=acc)[0] is None  # a stored fit without its pose


def test_a_stored_fit_is_judged_on_the_pose_the_command_writes():
    # The given calibration is right; the fit slid 15 mm towards the bin (a bin off the
    # workspace's size). Written as it is, that is wrong; with the distance left as given
    # (the default), the pose written is the given one.
    true = Calibration.load(default_calibration_path())
    T = true.T_base_camera
    sight = (true.workspace_center - T[:3, 3]) / np.linalg.norm(true.workspace_center - T[:3, 3])
    rec = {"x": [0.0] * 6, "fit_T_base_camera": perturb(T, np.r_[0, 0, 0, 0.015 * sight]).tolist(),
           "fit_mm": 15.0, "fit_deg": 0.0}
    as_fitted = _bench.written_error(rec, true, AcceptSettings.defaults(write_distance=True))
    assert abs(as_fitted[0] - 15.0) < 1e-6
    assert _bench.written_error(rec, true, AcceptSettings.defaults())[0] < 1e-6
    assert np.allclose(_bench.written_pose(rec, true, AcceptSettings.defaults()), T)


def test_fits_stored_before_the_rules_evidence_are_refused_with_a_message(tmp_path, monkeypatch, capsys):
    """A replay (or a continued run) over fits stored before the fit reported what the rule
    weighs stops with a message naming the file and the cells, not a KeyError, and the file
    is left as it was."""
    stored = tmp_path / "natural_seed0_f10_walls.jsonl"
    old = {**_bench.draw_cell(0, 0), "evidence": {"sigma_mm": 4.0}, "before_mm": 3.0, "before_deg": 0.1,
           "fit_mm": 2.0, "fit_deg": 0.1}
    stored.write_text(json.dumps(old) + "\n")
    before = stored.read_bytes()
    monkeypatch.setattr("sys.argv", ["refine.py", "--replay", "--cells", "1", "--seed", "0", "--measured-walls",
                                     "--placement", "inner", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        _bench.main()
    assert str(stored) in str(exc.value) and "[0]" in str(exc.value) and "correction_sigmas" in str(exc.value)
    assert stored.read_bytes() == before


def test_a_bin_inset_that_leaves_no_bin_is_a_message_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["refine.py", "--cells", "1", "--bin-inset-mm", "200", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        _bench.main()
    assert exc.value.code == 2 and "--bin-inset-mm 200" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing fitted, nothing written
