"""``sim2real-calibrate refine``: what it refuses, when it keeps the calibration, and which wall edges it looks for.

The round trip on rendered frames (an injected camera error recovered) is in
tests/sim_render/test_refine_in_twin.py; these need no renderer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.imageio import write_image
from perception.core.refine import (
    AcceptSettings,
    RefineError,
    RefineSettings,
    bin_inside,
    correction_sigmas,
    decide,
    perturb,
    wall_lines,
    without_sight_move,
)
from perception.robot.calibrate import main

# A fit cut short: these frames have no walls to find, so the search only has to fail.
QUICK = ["fit.hypotheses=1", "fit.start_heights=1", "fit.scales_px=[3.0]", "fit.restarts=1"]


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "cal.json"
    Calibration.load(default_calibration_path()).save(path)
    return path


def _frames(folder, size, n=3, seed=0):
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(n):
        # Texture at every scale and no straight edges: a floor with no bin on it.
        img = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
        img = np.kron(img, np.ones((8, 8, 1), dtype=np.uint8))
        write_image(folder / f"{i:03d}.png", img)
    return folder


@pytest.mark.slow  # about 20 s: a full fit: the fast tier must stay under 10 minutes
def test_frames_without_walls_keep_the_calibration_as_given_and_say_why(tmp_path, calib_file, capsys):
    """No walls to fit is no evidence: the calibration is written unchanged (the README's
    next command still has its file), exit 0, the reason in the output and the report."""
    frames = _frames(tmp_path / "frames", (640, 480))
    out = tmp_path / "refined.json"
    assert main(["refine", f"calibration={calib_file}", f"real_dir={frames}", f"out={out}", *QUICK]) == 0
    printed = capsys.readouterr().out
    assert "kept T_base_camera as given" in printed
    given, written = json.loads(calib_file.read_text()), json.loads(out.read_text())
    assert written["T_base_camera"] == given["T_base_camera"]
    report = written["calibration_report"]["refine"]
    assert report["written"] == "as given" and report["correction_mm"] == 0.0
    assert report["reason"] and report["reason"].split(":")[0] in printed
    assert out.with_suffix(".png").stat().st_size > 1000


# Evidence of a fit that passes every test of the rule; each case below spoils one.
STRONG = {"contrast": 2.0, "contrast_before": 1.2, "correction_mm": 6.0, "correction_deg": 0.4,
          "rival_share": 0.5, "halves_mm": 0.3, "halves_deg": 0.02, "halves_workspace_mm": 0.2,
          "explained": 30.0, "explained_given": 10.0,
          "sigma_mm": 1.0, "sigma_deg": 0.05, "starts": 9, "starts_agreeing": 5, "correction_sigmas": 12.0,
          "workspace_shift_mm": 5.0,
          "wall_height_m": 0.04, "wall_thickness_m": 0.01}


@pytest.mark.parametrize("spoil, why", [
    ({"contrast": 1.1}, "no bin walls found"),
    ({"correction_mm": 25.0}, "recalibrate"),
    ({"correction_deg": 2.5}, "recalibrate"),
    ({"correction_mm": 0.5, "correction_deg": 0.02}, "already fits"),
    ({"rival_share": 0.999}, "two poses"),
    ({"sigma_mm": 40.0}, "loose"),
    ({"correction_sigmas": 3.0}, "within the fit's own uncertainty"),
    ({"halves_workspace_mm": 3.0}, "not repeatable"),
])
def test_the_rule_keeps_the_calibration_unless_every_test_passes(spoil, why):
    st, acc = RefineSettings.defaults(), AcceptSettings.defaults()
    assert decide(STRONG, st, acc)[0]
    accepted, reason = decide({**STRONG, **spoil}, st, acc)
    assert not accepted and why in reason, reason


def test_a_correction_along_the_fits_loose_direction_spans_fewer_sigmas():
    # A fit loose along one direction of the pose (the turn-and-move ridge) and tight across it.
    ridge = np.array([0.01, 0, 0, 0, 0.008, 0]) / np.linalg.norm([0.01, 0.008])
    cov = np.eye(6) * 1e-8 + np.outer(ridge, ridge) * 1e-4
    along, across = ridge * 0.005, np.array([0, 0, 1.0, 0, 0, 0]) * 0.005
    assert correction_sigmas(along, cov) < 1.0 < 10.0 < correction_sigmas(across, cov)
    assert correction_sigmas(across, None) == 0.0  # no covariance (too few edges): nothing shown


def test_halves_that_slide_along_the_ridge_but_see_the_workspace_alike_are_repeatable():
    # The halves' cameras far apart (a slide along the turn-and-move ridge) while what they see
    # of the workspace stays put: repeatable where a grasp needs it. The reverse is not.
    st, acc = RefineSettings.defaults(), AcceptSettings.defaults(max_halves_workspace_mm=1.0)
    assert decide({**STRONG, "halves_mm": 9.0, "halves_deg": 0.9, "halves_workspace_mm": 0.4}, st, acc)[0]
    accepted, reason = decide({**STRONG, "halves_mm": 0.3, "halves_workspace_mm": 1.5}, st, acc)
    assert not accepted and "1.5 mm apart" in reason, reason


def test_faint_walls_are_judged_by_contrast_and_sigmas_not_by_absolute_edge():
    # Walls so faint that the fit explains little edge in absolute terms (the image's
    # contrast sets that scale) while it clears the contrast and the correction tests.
    faint = {**STRONG, "explained": 1.4, "explained_given": 0.0}
    assert decide(faint, RefineSettings.defaults(), AcceptSettings.defaults())[0]


def test_measured_walls_take_the_looser_limit_and_only_they():
    loose, too_loose = {"sigma_mm": 10.0}, {"sigma_mm": 20.0}
    acc = AcceptSettings.defaults(max_sigma_mm=5.0, max_sigma_mm_measured=15.0)
    fitted = RefineSettings.defaults()
    measured = RefineSettings.defaults(wall_height=0.04, wall_thickness=0.01)
    half = RefineSettings.defaults(wall_height=0.04)  # thickness still fitted: the strict limits
    assert not decide({**STRONG, **loose}, fitted, acc)[0]
    assert not decide({**STRONG, **loose}, half, acc)[0]
    assert decide({**STRONG, **loose}, measured, acc)[0]
    accepted, reason = decide({**STRONG, **too_loose}, measured, acc)
    assert not accepted and "with the walls measured" in reason, reason


def test_accept_settings_come_from_the_config_and_are_checked(tmp_path, calib_file, capsys):
    acc = AcceptSettings.defaults()
    assert 0 < acc.max_rival_share <= 1
    with pytest.raises(RefineError, match="unknown"):
        AcceptSettings.defaults(typo=1)
    with pytest.raises(RefineError, match=">= 0"):
        AcceptSettings.defaults(max_halves_workspace_mm=-1)
    with pytest.raises(RefineError, match="true or false"):
        AcceptSettings.defaults(write_distance=1)
    frames = _frames(tmp_path / "frames", (640, 480), n=1)
    with pytest.raises(SystemExit) as exc:
        main(["refine", f"calibration={calib_file}", f"real_dir={frames}", f"out={tmp_path / 'r.json'}",
              "accept.max_halves_workspace_mm=-1"])
    assert exc.value.code == 2 and ">= 0" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("case", ["wrong_size", "same_file", "no_frames", "bad_height", "bad_wall"])
def test_bad_input_is_a_message_and_exit_2(tmp_path, calib_file, capsys, case):
    out = tmp_path / "refined.json"
    args = {"calibration": calib_file, "real_dir": tmp_path / "frames", "out": out}
    extra = []
    if case == "wrong_size":
        _frames(tmp_path / "frames", (320, 240), n=1)
    else:
        (tmp_path / "frames").mkdir()
        if case != "no_frames":
            _frames(tmp_path / "frames2", (640, 480), n=1)
            args["real_dir"] = tmp_path / "frames2"
    if case == "same_file":
        args["out"] = calib_file
    if case == "bad_height":
        extra = ["fit.height_range=[0.01,0.09]"]
    if case == "bad_wall":  # millimetres where metres are asked
        extra = ["fit.wall_height=45"]
    before = calib_file.read_bytes()
    with pytest.raises(SystemExit) as exc:
        main(["refine", *(f"{k}={v}" for k, v in args.items()), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert {"wrong_size": "320x240", "same_file": "overwrite", "no_frames": "no *.png",
            "bad_height": "0.06", "bad_wall": "fit.wall_height must be in metres"}[case] in err, err
    assert calib_file.read_bytes() == before and not out.exists()


def test_the_edges_looked_for_follow_the_camera():
    calib = Calibration.load(default_calibration_path())
    cam = calib.camera_position
    assert cam[0] > calib.workspace_x[1]  # the shipped camera looks back over the far wall
    names = {name for name, _a, _b in wall_lines(calib, 0.05, 0.01)}
    # The far wall's inner face turns away from the camera: its foot is hidden, its outer
    # face and that face's foot are seen. The other walls show their inner feet.
    assert "x_max/inner_foot" not in names and "x_max/outer_foot" in names
    assert {"x_min/inner_foot", "y_min/inner_foot", "y_max/inner_foot"} <= names
    assert all(f"{w}/inner_top" in names and f"{w}/outer_top" in names for w in ("x_min", "x_max", "y_min", "y_max"))
    thin = {name for name, _a, _b in wall_lines(calib, 0.05, 0.0)}
    assert not any("outer" in name for name in thin)
    for name, a, b in wall_lines(calib, 0.05, 0.01):
        z = calib.table_z + (0.05 if name.endswith("top") else 0.0)
        assert a[2] == pytest.approx(z) and b[2] == pytest.approx(z)


def test_the_outer_placement_stands_the_outer_faces_on_the_workspace_edges():
    """Contract section 5: the bin's outer walls stand on the workspace edges. With
    ``outer`` the outer top edges lie on the edges and the inner faces a thickness inside;
    ``inner`` puts the inner faces there, and the outer model is the inner one on the bin's
    inside (``bin_inside``): the same lines."""
    calib = Calibration.load(default_calibration_path())
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    t = 0.012
    outer = {name: (a, b) for name, a, b in wall_lines(calib, 0.05, t, placement="outer")}
    inner = {name: (a, b) for name, a, b in wall_lines(calib, 0.05, t, placement="inner")}
    assert outer["x_min/outer_top"][0][0] == pytest.approx(x0) and outer["x_max/outer_top"][0][0] == pytest.approx(x1)
    assert outer["y_min/outer_top"][0][1] == pytest.approx(y0) and outer["y_max/outer_top"][0][1] == pytest.approx(y1)
    assert outer["x_min/inner_top"][0][0] == pytest.approx(x0 + t) and outer["y_max/inner_top"][0][1] == pytest.approx(y1 - t)
    assert inner["x_min/inner_top"][0][0] == pytest.approx(x0) and inner["x_min/outer_top"][0][0] == pytest.approx(x0 - t)
    same = {name: (a, b) for name, a, b in wall_lines(bin_inside(calib, t, "outer"), 0.05, t, placement="inner")}
    assert same.keys() == outer.keys()
    for name in same:
        np.testing.assert_allclose(np.stack(same[name]), np.stack(outer[name]))
    assert bin_inside(calib, t, "inner") is calib
    assert RefineSettings.defaults().wall_placement == "outer"  # the contract's wording is the default
    with pytest.raises(RefineError, match="wall_placement"):
        RefineSettings.defaults(wall_placement="middle")


def test_settings_come_from_the_config_and_are_checked():
    st = RefineSettings.defaults()
    assert st.max_shift_m == pytest.approx(0.02) and st.max_rotation_deg == pytest.approx(2.0)
    with pytest.raises(RefineError, match="unknown"):
        RefineSettings.defaults(typo=1)
    with pytest.raises(RefineError, match="thickness_range"):
        RefineSettings.defaults(thickness_range=[0.02, 0.01])
    with pytest.raises(RefineError, match="prior_weight"):
        RefineSettings.defaults(prior_weight=-0.1)


def test_measured_walls_narrow_the_search_to_the_reading():
    """A ruler's reading of the walls replaces their search ranges by the reading +- the
    tolerance (cut at the contract's 60 mm and at 0 thickness); nonsense is refused by name."""
    st = RefineSettings.defaults()
    assert st.wall_height is None and st.height_range == pytest.approx((0.01, 0.06))
    measured = RefineSettings.defaults(wall_height=0.045, wall_thickness=0.001, wall_tolerance=0.002)
    assert measured.height_range == pytest.approx((0.043, 0.047))
    assert measured.thickness_range == pytest.approx((0.0, 0.003))
    assert RefineSettings.defaults(wall_height=0.06).height_range == pytest.approx((0.058, 0.06))
    for bad, key in (({"wall_height": 45}, "wall_height"), ({"wall_height": 0.0}, "wall_height"),
                     ({"wall_thickness": -0.01}, "wall_thickness"), ({"wall_tolerance": 0.5}, "wall_tolerance")):
        with pytest.raises(RefineError, match=key):
            RefineSettings.defaults(**bad)


def test_the_written_pose_keeps_the_distance_along_the_line_of_sight_and_the_rest_of_the_fit():
    # A fit that moved the camera 15 mm towards the bin (what a bin 3 mm inside the workspace
    # edges does to it), 3 mm sideways and turned it 0.3 degrees: written without the 15 mm.
    calib = Calibration.load(default_calibration_path())
    T0 = calib.T_base_camera
    sight = (calib.workspace_center - T0[:3, 3]) / np.linalg.norm(calib.workspace_center - T0[:3, 3])
    side = np.cross(sight, [0.0, 0.0, 1.0])
    side /= np.linalg.norm(side)
    fit = perturb(T0, np.r_[0.0, np.radians(0.3), 0.0, 0.015 * sight + 0.003 * side])
    written, move = without_sight_move(calib, T0, fit)
    assert abs(move - 0.015) < 1e-9
    assert np.allclose(written[:3, 3], T0[:3, 3] + 0.003 * side, atol=1e-9)  # the sideways move stays
    assert np.allclose(written[:3, :3], fit[:3, :3])                        # and so does the turn
    # A fit with no move along the line of sight is written as it is.
    across = perturb(T0, np.r_[0.0, 0.0, 0.0, 0.004 * side])
    same, none = without_sight_move(calib, T0, across)
    assert abs(none) < 1e-12 and np.allclose(same, across)


def test_the_visibility_check_weighs_the_bins_inside_where_the_walls_stand_inside_the_workspace():
    """A pose that puts a sliver of the workspace's edge out of view but sees all of the
    bin's inside is not refused when the walls stand inside the workspace (their outer
    faces on its edges); it is when the workspace is the bin's inside, and so is a pose that
    cuts into the bin's inside."""
    from perception.robot.calibrate import _sees_less

    calib = Calibration.load(default_calibration_path())

    def turned(deg: float) -> Calibration:
        return calib.replace(T_base_camera=perturb(calib.T_base_camera, np.r_[np.radians(deg), 0, 0, 0, 0, 0]))

    sliver, deep = turned(9.0), turned(14.0)
    assert sliver.workspace_visible_share() < 1.0 == bin_inside(sliver, 0.03, "outer").workspace_visible_share()
    assert _sees_less(calib, sliver, 0.03, "outer") is None
    assert "of the workspace where" in _sees_less(calib, sliver, 0.03, "inner")
    assert bin_inside(deep, 0.03, "outer").workspace_visible_share() < 1.0
    assert "of the bin's inside where" in _sees_less(calib, deep, 0.03, "outer")
