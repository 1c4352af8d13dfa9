"""``sim2real-calibrate refine`` in the twin: frames rendered with a known camera, a
calibration off by 4 mm and 0.3 degrees, the pose refined from the bin's walls.

The frames come from the ``target`` look (one cell, one look, objects changing between
frames, as a user's photos are) with the camera exactly at the truth and the walls of one
drawn height. The twin stands the walls' inner faces on the workspace edges it is handed,
so most tests here say ``fit.wall_placement: inner``. Handed the workspace narrowed by the
walls' thickness (``bin_inside``), it builds the bin the contract's section 5 describes and
the command assumes by default, the outer faces on the edges: the last test. Tolerance (issue 14): residual within 1.5 mm and 0.1 degrees, for the fit;
the pose written keeps the given camera's distance along its line of sight to the bin
(``accept.write_distance: false``), so there it holds across that line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.imageio import read_image
from perception.core.refine import (
    RefineSettings,
    bin_inside,
    perturb,
    pose_change,
    refine_pose,
    workspace_shift_mm,
)
from perception.robot.calibrate import main
from sim_render.api import render_cell_frames


def _unit(rng: np.random.Generator) -> np.ndarray:
    v = rng.normal(size=3)
    return v / np.linalg.norm(v)


def _sight_errors(true: Calibration, T: np.ndarray, T_given: np.ndarray) -> tuple[float, float]:
    """(m): the camera centre's error from the truth along the given camera's line of sight to
    the workspace centre, and across it."""
    sight = (true.workspace_center - T_given[:3, 3]) / np.linalg.norm(true.workspace_center - T_given[:3, 3])
    err = T[:3, 3] - true.T_base_camera[:3, 3]
    along = float(err @ sight)
    return along, float(np.linalg.norm(err - along * sight))


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    rng = np.random.default_rng(14)
    height = float(rng.uniform(0.03, 0.06))  # the contract bounds it; the fit must find it
    true = Calibration.load(default_calibration_path())
    frames = render_cell_frames(tmp_path_factory.mktemp("frames"), true, 10, height, 0.02, seed=3)
    return true, frames, height, rng


@pytest.mark.slow  # about 100 s: 10 frames rendered and fitted: the fast tier must stay under 10 minutes
def test_refine_recovers_an_injected_camera_error(cell, tmp_path, capsys):
    true, frames, height, rng = cell
    x = np.r_[_unit(rng) * math.radians(0.3), _unit(rng) * 0.004]
    off = true.replace(T_base_camera=perturb(true.T_base_camera, x))
    off.save(tmp_path / "off.json")
    out = tmp_path / "refined.json"
    assert main(["refine", f"calibration={tmp_path / 'off.json'}", f"real_dir={frames}", f"out={out}",
                 "fit.wall_placement=inner"]) == 0
    refined = json.loads(out.read_text())
    report = refined["calibration_report"]["refine"]
    shift, angle = pose_change(true.T_base_camera, np.array(report["fit_T_base_camera"]))
    assert shift <= 0.0015 and angle <= 0.1, (shift, angle)  # the fit
    # The pose written: the fit's turn and sideways place, the given camera's distance.
    written = np.array(refined["T_base_camera"])
    along, across = _sight_errors(true, written, off.T_base_camera)
    assert across <= 0.0015 and pose_change(true.T_base_camera, written)[1] <= 0.1, (across,)
    assert abs(along - _sight_errors(true, off.T_base_camera, off.T_base_camera)[0]) < 1e-6
    before = pose_change(true.T_base_camera, off.T_base_camera)
    assert before[0] > 0.0039 and before[1] > 0.29
    # Every other field as it was; the report says what was corrected and what was found.
    src = off.to_dict()
    assert {k: v for k, v in refined.items() if k not in ("T_base_camera", "calibration_report")} == \
        {k: v for k, v in src.items() if k not in ("T_base_camera", "calibration_report")}
    assert abs(report["wall_height_m"] - height) < 0.002
    assert report["edge_contrast"] > report["edge_contrast_before"]
    assert 3.0 < report["fit_correction_mm"] < 6.0
    assert (tmp_path / "refined.png").stat().st_size > 10_000
    assert "corrected by" in capsys.readouterr().out
    assert report["written"] == "refined" and "repeatably" in report["reason"]


@pytest.mark.slow
def test_a_right_calibration_is_kept_or_barely_moved(cell, tmp_path):
    """Handed the true pose, the command writes it as given, or within 1 mm and 0.1 degrees
    of it: refining a good calibration never makes it worse by more than the fit's noise."""
    true, frames, _height, _rng = cell
    true.save(tmp_path / "true.json")
    out = tmp_path / "refined.json"
    assert main(["refine", f"calibration={tmp_path / 'true.json'}", f"real_dir={frames}", f"out={out}",
                 "fit.wall_placement=inner"]) == 0
    shift, angle = pose_change(true.T_base_camera, np.array(json.loads(out.read_text())["T_base_camera"]))
    assert shift <= 0.001 and angle <= 0.1, (shift, angle)


@pytest.mark.slow
def test_the_search_prior_keeps_a_thin_wall_from_sliding_to_its_outer_edge(tmp_path):
    """A wall 14 mm thick, 25 mm high (``benchmarks/refine.py --seed 1``, cell 2): without the
    prior the search locks the top's inner line onto the outer edge and the pose slides some
    4 cm, which the command refuses; with it (the default) the camera is recovered."""
    true = Calibration.load(default_calibration_path())
    rng = np.random.default_rng(1)
    for _cell in range(3):  # the benchmark's draws up to its cell 2
        height, thickness = float(rng.uniform(0.02, 0.06)), float(rng.uniform(0.003, 0.03))
        turn, move = _unit(rng), _unit(rng)
    x = np.r_[turn * math.radians(0.3), move * 0.004]
    off = true.replace(T_base_camera=perturb(true.T_base_camera, x))
    folder = render_cell_frames(tmp_path, true, 10, height, thickness, seed=1002)
    frames = [read_image(p) for p in sorted(folder.glob("*.png"))]
    inner = RefineSettings.defaults(wall_placement="inner")  # the twin's bin as handed the workspace
    res = refine_pose(frames, off, inner)
    shift, angle = pose_change(true.T_base_camera, res.T_base_camera)
    assert shift <= 0.0015 and angle <= 0.1, (shift, angle)
    assert abs(res.wall_thickness - thickness) < 0.002
    # Without the prior the search slid 4 cm here once (refused then); whatever it finds
    # now, the decision never writes a pose off the truth.
    without = refine_pose(frames, off, RefineSettings.defaults(prior_weight=0.0, wall_placement="inner"))
    _along, across = _sight_errors(true, without.written_pose, off.T_base_camera)
    angle = pose_change(true.T_base_camera, without.written_pose)[1]
    assert (without.written_pose is without.T_given) or (across <= 0.0015 and angle <= 0.1), without.reason


@pytest.mark.slow  # about 60 s: 10 frames rendered and fitted
def test_a_bin_off_the_workspace_edges_does_not_slide_the_written_camera(tmp_path):
    """The bin's walls 3 mm inside the workspace edges the fit is told, the calibration right
    (``benchmarks/refine.py --bin-inset-mm 3 --seed 1``, cell 0: walls 40 mm high, 29 mm thick,
    measured within 1 mm). The fit shrinks the bin in the image by sliding the camera some
    15 mm along its line of sight and passes every test; written as it was, the camera
    centre was 15 mm off the truth. Written without that move, it stays within 2 mm."""
    true = Calibration.load(default_calibration_path())
    bin_cell = true.narrowed(0.003)
    height, thickness = 0.0405, 0.0287
    x = np.array([1.5e-4, -5.9e-4, 4.1e-4, -3.4e-5, 3.7e-5, 2.3e-5])  # right: 0.06 mm, 0.04 degrees
    given = true.replace(T_base_camera=perturb(true.T_base_camera, x))
    folder = render_cell_frames(tmp_path, bin_cell, 10, height, thickness, seed=1000, natural_surfaces=True)
    frames = [read_image(p) for p in sorted(folder.glob("*.png"))]
    res = refine_pose(frames, given, RefineSettings.defaults(wall_height=0.0409, wall_thickness=0.0281,
                                                             wall_placement="inner"))
    assert abs(res.sight_move_m) > 0.005, res.sight_move_m  # the fit did slide along the line of sight
    shift, angle = pose_change(true.T_base_camera, res.written_pose)
    assert shift <= 0.002 and angle <= 0.1, (shift, angle, res.reason)


@pytest.mark.slow  # about 60 s: 10 frames rendered and fitted
def test_the_default_refines_a_bin_whose_outer_faces_stand_on_the_workspace_edges(tmp_path):
    """The contract's bin (section 5: the outer walls on the workspace edges; the walls
    12 mm thick inside the workspace), the command's defaults with the walls measured as the
    README's step 3 does (a ruler: 1 mm off), the calibration 4 mm and 0.3 degree off: the
    pose written puts what the camera sees in the workspace within 1.5 mm of the truth (the
    error a grasp carries)."""
    true = Calibration.load(default_calibration_path())
    rng = np.random.default_rng(35)
    x = np.r_[_unit(rng) * math.radians(0.3), _unit(rng) * 0.004]
    off = true.replace(T_base_camera=perturb(true.T_base_camera, x))
    off.save(tmp_path / "off.json")
    folder = render_cell_frames(tmp_path / "frames", bin_inside(true, 0.012, "outer"), 10, 0.045, 0.012, seed=5)
    out = tmp_path / "refined.json"
    assert main(["refine", f"calibration={tmp_path / 'off.json'}", f"real_dir={folder}", f"out={out}",
                 "fit.wall_height=0.046", "fit.wall_thickness=0.013"]) == 0
    refined = json.loads(out.read_text())
    report = refined["calibration_report"]["refine"]
    assert report["wall_placement"] == "outer" and report["written"] == "refined", report["reason"]
    written = np.array(refined["T_base_camera"])
    given_ws = workspace_shift_mm(true, true.T_base_camera, off.T_base_camera)
    written_ws = workspace_shift_mm(true, true.T_base_camera, written)
    assert given_ws > 3.0 and written_ws <= 1.5, (given_ws, written_ws)
    assert abs(report["wall_thickness_m"] - 0.012) < 0.003


@pytest.mark.slow  # about 40 s: 10 frames rendered and fitted
def test_the_walls_alone_are_measured_on_the_contracts_bin(tmp_path):
    """``measure_walls`` (what the pipeline writes into the artifact when the calibration has
    no refine report): the contract's bin, 45 mm high and 12 mm thick inside the workspace,
    the calibration right; the fit reads both within 3 mm. The twin's own bin (the inner
    faces on the edges) is not measured with the inner model: no wall stands in the workspace."""
    from perception.core.refine import measure_walls

    true = Calibration.load(default_calibration_path())
    folder = render_cell_frames(tmp_path / "frames", bin_inside(true, 0.012, "outer"), 10, 0.045, 0.012, seed=5)
    frames = [read_image(p) for p in sorted(folder.glob("*.png"))]
    walls = measure_walls(frames, true)
    assert walls is not None and abs(walls[0] - 0.045) < 0.003 and abs(walls[1] - 0.012) < 0.003, walls
    assert measure_walls(frames, true, RefineSettings.defaults(wall_placement="inner")) is None
