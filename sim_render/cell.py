"""The PyBullet twin of the robot cell, built from the calibration file.

Randomizations (physical): object friction, spinning friction, mass, restitution,
table friction and gripper force, each drawn from the ranges in ``conf/render/``.

The cell holds a table top at ``table_z``, an open bin whose walls stand on the
edges of the workspace, 1-5 ``random_urdfs`` objects dropped into it, and a
floating parallel-jaw hand (:mod:`sim_render.gripper`). It runs in ``DIRECT`` mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pybullet as p
from pybullet_utils.bullet_client import BulletClient

from perception.core.calibration import Calibration

__all__ = ["CellBodies", "Cell", "BIN_WALL_HEIGHT", "BIN_WALL_THICKNESS"]

#: Height of the bin walls above the table, metres (contract: up to 0.06 m).
BIN_WALL_HEIGHT = 0.06
#: Thickness of the bin walls, metres. The twin stands them just outside the workspace
#: edges (their inner faces on the edges); the contract's section 5 words it the other way
#: ("the bin's outer walls stand on the workspace edges"), as ``sim2real-calibrate refine``
#: assumes by default and the validation cells build it: a bin 2 thicknesses narrower
#: inside than the twin's (docs/experiments/2026-12-06-refine-walls-outer-faces-on-the-edges.md).
BIN_WALL_THICKNESS = 0.01
#: Thickness of the table top slab, metres.
TABLE_THICKNESS = 0.05
#: Objects are dropped this far inside the workspace edges, metres.
DROP_MARGIN = 0.05
#: Linear speed below which an object counts as at rest, m/s.
REST_SPEED = 0.01


@dataclass
class CellBodies:
    """PyBullet body ids of the cell (what the visual randomizers colour)."""

    table: int
    bin_walls: list[int]
    objects: list[int] = field(default_factory=list)
    object_urdfs: list[str] = field(default_factory=list)


class Cell:
    """The static cell (table, bin) plus the objects of the current scene.

    Args:
        calib: the calibration the twin is built from (table height, workspace).
        timestep: physics step, seconds.
        solver_iterations: constraint solver iterations per step.
        client: an existing DIRECT client; a new one is created when None.
    """

    def __init__(
        self,
        calib: Calibration,
        timestep: float = 1.0 / 120.0,
        solver_iterations: int = 15,
        client: BulletClient | None = None,
    ) -> None:
        self.calib = calib
        self.client = client or BulletClient(connection_mode=p.DIRECT)
        self.timestep = float(timestep)
        self.solver_iterations = int(solver_iterations)
        self.bodies = self.reset()

    def reset(self, wall_height: float = BIN_WALL_HEIGHT, wall_thickness: float = BIN_WALL_THICKNESS) -> CellBodies:
        """Empty the world and rebuild the static cell.

        Every scene starts from here: PyBullet's results depend on the history of a
        world (body ids, contact caches), and a scene must not depend on which
        scenes the same worker rendered before it.

        Args:
            wall_height, wall_thickness: the bin's walls, metres (the contract bounds the
                height by 0.06 m and fixes neither).
        """
        c = self.client
        c.resetSimulation()
        c.setGravity(0, 0, -9.81)
        c.setPhysicsEngineParameter(
            fixedTimeStep=self.timestep, numSolverIterations=self.solver_iterations, deterministicOverlappingPairs=1
        )
        self.bodies = self._build_static(float(wall_height), float(wall_thickness))
        return self.bodies

    # ----------------------------------------------------------------- static
    def _box(self, half: list[float], pos: list[float], color: list[float]) -> int:
        c = self.client
        col = c.createCollisionShape(p.GEOM_BOX, halfExtents=half)
        vis = c.createVisualShape(p.GEOM_BOX, halfExtents=half, rgbaColor=color)
        return c.createMultiBody(0.0, col, vis, basePosition=pos)

    def _build_static(self, wall_height: float, wall_thickness: float) -> CellBodies:
        cal = self.calib
        (x0, x1), (y0, y1) = cal.workspace_x, cal.workspace_y
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        # The table extends well beyond the workspace so the camera sees a surface.
        table = self._box([1.0, 1.0, TABLE_THICKNESS / 2], [cx, cy, cal.table_z - TABLE_THICKNESS / 2],
                          [0.6, 0.6, 0.6, 1])
        t, h = wall_thickness, wall_height
        z = cal.table_z + h / 2
        hx, hy = (x1 - x0) / 2 + t, (y1 - y0) / 2 + t
        walls = [
            self._box([t / 2, hy, h / 2], [x0 - t / 2, cy, z], [0.3, 0.3, 0.35, 1]),
            self._box([t / 2, hy, h / 2], [x1 + t / 2, cy, z], [0.3, 0.3, 0.35, 1]),
            self._box([hx, t / 2, h / 2], [cx, y0 - t / 2, z], [0.3, 0.3, 0.35, 1]),
            self._box([hx, t / 2, h / 2], [cx, y1 + t / 2, z], [0.3, 0.3, 0.35, 1]),
        ]
        return CellBodies(table=table, bin_walls=walls)

    # ---------------------------------------------------------------- objects
    def clear_objects(self) -> None:
        for body in self.bodies.objects:
            self.client.removeBody(body)
        self.bodies.objects, self.bodies.object_urdfs = [], []

    def remove_object(self, k: int) -> None:
        """Take object ``k`` (its index in ``bodies.objects``) out of the scene: lifted, given up."""
        body = self.bodies.objects.pop(k)
        self.bodies.object_urdfs.pop(k)
        self.client.removeBody(body)

    def object_under(self, x: float, y: float, radius: float) -> int | None:
        """The object a grasp at base ``(x, y)`` was aimed at: the first object a vertical ray
        there hits, else the nearest object centre within ``radius`` metres; its body id, or
        ``None``."""
        tz = self.calib.table_z
        hit = self.client.rayTest([x, y, tz + 0.5], [x, y, tz - 0.01])[0]
        if hit[0] in self.bodies.objects:
            return int(hit[0])
        best, best_d = None, float(radius)
        for body in self.bodies.objects:
            (bx, by, _), _ = self.client.getBasePositionAndOrientation(body)
            d = math.hypot(bx - x, by - y)
            if d < best_d:
                best, best_d = body, d
        return best

    def remove_strays(self) -> int:
        """Remove the objects that left the workspace or fell through the table; how many."""
        n = 0
        for k in reversed(range(len(self.bodies.objects))):
            (x, y, z), _ = self.client.getBasePositionAndOrientation(self.bodies.objects[k])
            if not self.calib.in_workspace(x, y) or z < self.calib.table_z - 0.02:
                self.remove_object(k)
                n += 1
        return n

    def apply_physics(self, physics: dict) -> None:
        """Apply drawn physical parameters (see ``sample_physics``) to table and objects."""
        c = self.client
        c.changeDynamics(self.bodies.table, -1, lateralFriction=float(physics["table_friction"]))
        for i, body in enumerate(self.bodies.objects):
            c.changeDynamics(
                body,
                -1,
                mass=float(physics["mass"][i]),
                lateralFriction=float(physics["lateral_friction"][i]),
                spinningFriction=float(physics["spinning_friction"][i]),
                restitution=float(physics["restitution"][i]),
            )

    def drop_objects(self, urdfs: list[str], rng: np.random.Generator, settle_steps: int) -> list[int]:
        """Drop objects into the bin at random poses and let them come to rest.

        Objects that end outside the bin are removed. Returns the remaining ids.
        """
        c = self.client
        cal = self.calib
        (x0, x1), (y0, y1) = cal.workspace_x, cal.workspace_y
        for k, urdf in enumerate(urdfs):
            pos = [
                rng.uniform(x0 + DROP_MARGIN, x1 - DROP_MARGIN),
                rng.uniform(y0 + DROP_MARGIN, y1 - DROP_MARGIN),
                cal.table_z + 0.08 + 0.07 * k,
            ]
            q = rng.normal(size=4)
            q /= np.linalg.norm(q)
            body = c.loadURDF(urdf, basePosition=pos, baseOrientation=q.tolist())
            self.bodies.objects.append(body)
            self.bodies.object_urdfs.append(urdf)
        self.settle(settle_steps)
        keep_ids, keep_urdfs = [], []
        for body, urdf in zip(self.bodies.objects, self.bodies.object_urdfs):
            (x, y, z), _ = c.getBasePositionAndOrientation(body)
            if cal.in_workspace(x, y) and z > cal.table_z - 0.02:
                keep_ids.append(body)
                keep_urdfs.append(urdf)
            else:
                c.removeBody(body)
        self.bodies.objects, self.bodies.object_urdfs = keep_ids, keep_urdfs
        return keep_ids

    def settle(self, max_steps: int) -> int:
        """Step until every object is at rest (or ``max_steps``); returns steps taken."""
        c = self.client
        for step in range(max_steps):
            c.stepSimulation()
            if step % 20 == 19 and self._at_rest():
                return step + 1
        return max_steps

    def _at_rest(self) -> bool:
        for body in self.bodies.objects:
            v, w = self.client.getBaseVelocity(body)
            if np.linalg.norm(v) > REST_SPEED or np.linalg.norm(w) > 10 * REST_SPEED:
                return False
        return True

    def object_heights(self) -> np.ndarray:
        """Centre-of-mass heights of the objects above the table, metres ``(n,)``."""
        return np.array(
            [self.client.getBasePositionAndOrientation(b)[0][2] - self.calib.table_z for b in self.bodies.objects]
        )

    def height_map(
        self, resolution: float = 0.004, margin: float = 0.06
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Top-down ray-cast height map over the workspace and ``margin`` around it
        (so the bin walls are in it: fingers must not land on them).

        Returns:
            ``xs (nx,)``, ``ys (ny,)`` grid coordinates in ``B``; ``height (ny, nx)``
            surface height in ``B``; ``body (ny, nx)`` index into ``bodies.objects``
            of the surface hit (-1 for table, bin or nothing).
        """
        cal = self.calib
        (x0, x1), (y0, y1) = cal.workspace_x, cal.workspace_y
        xs = np.arange(x0 - margin + resolution / 2, x1 + margin, resolution)
        ys = np.arange(y0 - margin + resolution / 2, y1 + margin, resolution)
        gx, gy = np.meshgrid(xs, ys)
        top = cal.table_z + 0.5
        starts = np.stack([gx.ravel(), gy.ravel(), np.full(gx.size, top)], axis=1)
        ends = starts.copy()
        ends[:, 2] = cal.table_z - 0.01
        height = np.full(gx.size, cal.table_z)
        body = np.full(gx.size, -1, dtype=np.int64)
        index = {b: i for i, b in enumerate(self.bodies.objects)}
        batch = p.MAX_RAY_INTERSECTION_BATCH_SIZE
        for s in range(0, len(starts), batch):
            hits = self.client.rayTestBatch(starts[s : s + batch].tolist(), ends[s : s + batch].tolist())
            for j, hit in enumerate(hits):
                if hit[0] >= 0:
                    height[s + j] = hit[3][2]
                    body[s + j] = index.get(hit[0], -1)
        return xs, ys, height.reshape(gx.shape), body.reshape(gx.shape)

    def close(self) -> None:
        try:
            self.client.disconnect()
        except p.error:
            pass
