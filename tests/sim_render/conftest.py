"""Shared fixtures of the sim_render tests."""

from __future__ import annotations

from types import SimpleNamespace

import pybullet as p
import pybullet_data
import pytest
from pybullet_utils.bullet_client import BulletClient


@pytest.fixture()
def scene(calib):
    """A table, a four-wall bin on the workspace edges and two random_urdfs objects."""
    c = BulletClient(connection_mode=p.DIRECT)
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2

    def box(half, pos):
        col = c.createCollisionShape(p.GEOM_BOX, halfExtents=half)
        return c.createMultiBody(
            0.0, col, c.createVisualShape(p.GEOM_BOX, halfExtents=half), basePosition=pos
        )

    table = box([1.0, 1.0, 0.02], [cx, cy, calib.table_z - 0.02])
    t, h = 0.005, 0.03
    walls = [
        box([t, (y1 - y0) / 2, h], [x0, cy, h]),
        box([t, (y1 - y0) / 2, h], [x1, cy, h]),
        box([(x1 - x0) / 2, t, h], [cx, y0, h]),
        box([(x1 - x0) / 2, t, h], [cx, y1, h]),
    ]
    data = pybullet_data.getDataPath()
    objects = [
        c.loadURDF(f"{data}/random_urdfs/001/001.urdf", [cx - 0.05, cy, 0.03]),
        c.loadURDF(f"{data}/random_urdfs/002/002.urdf", [cx + 0.05, cy + 0.04, 0.03]),
    ]
    yield c, SimpleNamespace(table=table, bin_walls=walls, objects=objects)
    c.disconnect()
