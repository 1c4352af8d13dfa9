"""The cell can grasp: physics-verified outcomes of known grasps on a real object."""

from __future__ import annotations

import numpy as np
import pytest

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.frames import GRIPPER_MAX_WIDTH, MIN_TIP_CLEARANCE
from perception.core.grasp import Grasp
from sim_render.cell import Cell
from sim_render.gripper import FloatingHand, GraspTiming
from sim_render.labels import heuristic_candidates
from sim_render.objects import object_urdfs

# Fine physics for these checks (a reference setting, not the fast labelling one).
TIMING = GraspTiming(descend_steps=48, close_steps=48, lift_steps=60, hold_steps=120)


@pytest.fixture(scope="module")
def scene():
    calib = Calibration.load(default_calibration_path())
    cell = Cell(calib, timestep=1 / 120, solver_iterations=30)
    hand = FloatingHand(cell)
    rng = np.random.default_rng(5)
    urdf = object_urdfs("train")[5]  # a cross of bars about 0.15 m across
    ids = cell.drop_objects([urdf], rng, settle_steps=600)
    assert len(ids) == 1, "the object must come to rest inside the bin"
    state = cell.client.saveState()
    yield cell, hand, state
    cell.close()


def _run(cell, hand, state, grasp):
    cell.client.restoreState(stateId=state)
    out = hand.execute(grasp, force=70.0, timing=TIMING)
    cell.client.restoreState(stateId=state)
    return out


def test_grasp_across_one_bar_succeeds(scene):
    cell, hand, state = scene
    cell.client.restoreState(stateId=state)
    hmap = cell.height_map()
    cands = heuristic_candidates(cell, hmap, 12, np.random.default_rng(0))
    assert cands, "the heuristic must find a part narrower than the gripper"
    outcomes = [_run(cell, hand, state, c.grasp) for c in cands]
    assert any(o.success for o in outcomes)
    best = cands[[o.success for o in outcomes].index(True)].grasp
    assert best.width <= GRIPPER_MAX_WIDTH


def test_grasp_in_empty_space_fails(scene):
    cell, hand, state = scene
    _, _, height, body = cell.height_map()
    # A workspace corner far from the object.
    pos = cell.client.getBasePositionAndOrientation(cell.bodies.objects[0])[0]
    cal = cell.calib
    x = cal.workspace_x[0] + 0.03 if pos[0] > np.mean(cal.workspace_x) else cal.workspace_x[1] - 0.03
    y = cal.workspace_y[0] + 0.03 if pos[1] > np.mean(cal.workspace_y) else cal.workspace_y[1] - 0.03
    out = _run(cell, hand, state, Grasp((x, y, cal.table_z + 0.01), 0.0, GRIPPER_MAX_WIDTH))
    assert not out.success
    assert out.lifted_object == -1


def test_grasp_across_whole_wide_object_fails(scene):
    """Centred on the object, closing along its long axis: the fingers land on it."""
    cell, hand, state = scene
    cell.client.restoreState(stateId=state)
    xs, ys, _, body = cell.height_map()
    cells = np.argwhere(body >= 0)
    xy = np.stack([xs[cells[:, 1]], ys[cells[:, 0]]], axis=1)
    center = xy.mean(axis=0)
    _, vecs = np.linalg.eigh(np.cov((xy - center).T))
    major = vecs[:, -1]
    span = (xy - center) @ major
    assert span.max() - span.min() > 1.5 * GRIPPER_MAX_WIDTH, "the object must be much wider than the opening"
    yaw = float(np.arctan2(major[1], major[0]))
    out = _run(cell, hand, state, Grasp((center[0], center[1], cell.calib.table_z + 0.005), yaw, GRIPPER_MAX_WIDTH))
    assert not out.success


def test_perturbed_candidates_are_near_misses_of_heuristic_ones(scene):
    """Half turned (same point and height), half moved 1-2.5 cm (same yaw, the labeller's
    height at the new point), each derived from a heuristic candidate; turning a
    successful bar grasp by 90 degrees (closing along the bar) fails in physics."""
    from perception.core.grasp import normalize_angle
    from sim_render.labels import GRASP_DEPTH, _sample_heights, perturbed_candidates

    cell, hand, state = scene
    cell.client.restoreState(stateId=state)
    hmap = cell.height_map()
    base = heuristic_candidates(cell, hmap, 12, np.random.default_rng(0))
    out = perturbed_candidates(cell, hmap, base, 10, np.random.default_rng(1))
    assert len(out) == 10 and all(c.source == 2 for c in out)
    assert perturbed_candidates(cell, hmap, [], 10, np.random.default_rng(1)) == []
    for i, c in enumerate(out):
        g = c.grasp
        dists = [np.hypot(g.position[0] - b.grasp.position[0], g.position[1] - b.grasp.position[1]) for b in base]
        turns = [abs(normalize_angle(g.yaw - b.grasp.yaw)) for b in base]
        if i % 2 == 0:  # turned: some base candidate at the same point, 30-90 degrees away
            assert any(d < 1e-9 and np.pi / 6 - 1e-9 <= t <= np.pi / 2 + 1e-9 for d, t in zip(dists, turns))
        else:  # moved: some base candidate 1-2.5 cm away with the same yaw
            assert any(0.01 - 1e-9 <= d <= 0.025 + 1e-9 and t < 1e-9 for d, t in zip(dists, turns))
            top = float(_sample_heights(hmap, np.array([g.position[:2]]))[0])
            assert g.position[2] == pytest.approx(max(cell.calib.table_z + MIN_TIP_CLEARANCE, top - GRASP_DEPTH))
    # The near miss that matters most: a successful grasp across a bar, turned to close along it.
    ok = next(c.grasp for c in base if _run(cell, hand, state, c.grasp).success)
    along = Grasp(ok.position, ok.yaw + np.pi / 2, ok.width)
    assert not _run(cell, hand, state, along).success
