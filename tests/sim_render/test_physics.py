"""The cell can grasp: physics-verified outcomes of known grasps on a real object."""

from __future__ import annotations

import numpy as np
import pytest

from perception.calibration import Calibration, default_calibration_path
from perception.frames import GRIPPER_MAX_WIDTH
from perception.grasp import Grasp
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
