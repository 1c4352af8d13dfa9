"""A floating parallel-jaw hand with the Franka Hand's geometry that executes
contract grasps (section 3) and checks success physically.

Success conditions: some object's centre of mass is at least ``SUCCESS_HEIGHT``
above ``table_z`` both when the hold starts and when it ends.

The hand's base is driven by a fixed constraint (so contacts push back), the
fingers by force-limited position motors. Hand frame: ``x`` along the line joining
the fingertips, ``z`` up; fingers hang along ``-z`` below the palm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pybullet as p

from perception.core.frames import (
    GRIPPER_FINGER_HALF_DEPTH,
    GRIPPER_FINGER_HALF_THICKNESS,
    GRIPPER_FINGER_LENGTH,
    GRIPPER_MAX_WIDTH,
    LIFT_HEIGHT,
    MIN_TIP_CLEARANCE,
    SUCCESS_HEIGHT,
)
from perception.core.grasp import Grasp
from sim_render.cell import Cell

__all__ = ["GraspTiming", "GraspOutcome", "FloatingHand"]

#: Palm half extents (x along the finger line, y, z), metres (Franka Hand ~0.2 x 0.06 x 0.06).
PALM_HALF = (0.1, 0.03, 0.03)
#: Finger half extents (x thickness, y depth, z half length), metres.
FINGER_HALF = (GRIPPER_FINGER_HALF_THICKNESS, GRIPPER_FINGER_HALF_DEPTH, GRIPPER_FINGER_LENGTH / 2)
#: Hand and finger masses, kg.
PALM_MASS, FINGER_MASS = 0.6, 0.03
#: Vertical resistance that stops the descent, N (contract: about 3 N).
DESCENT_STOP_FORCE = 3.0
#: Force of the constraint that drives the hand, N.
ARM_FORCE = 400.0
#: Where the hand waits between grasps, metres above the table.
PARK_HEIGHT = 1.5
#: Fingertip height where each descent starts, metres above the table (above any object).
START_HEIGHT = 0.16
#: Extra steps allowed for the hand to arrive at the bottom of the descent.
SETTLE_STEPS = 24
#: Distance to the fingertip target that counts as arrived, metres.
ARRIVAL_TOLERANCE = 0.002
#: Finger closing speed limit, m/s.
FINGER_SPEED = 0.2

_TIP_BELOW_BASE = PALM_HALF[2] + 2 * FINGER_HALF[2]


@dataclass(frozen=True)
class GraspTiming:
    """Step counts of one grasp execution (the physics step is the cell's)."""

    descend_steps: int = 24
    close_steps: int = 24
    lift_steps: int = 30
    hold_steps: int = 12


@dataclass
class GraspOutcome:
    success: bool
    lifted_object: int  # index into cell.bodies.objects, -1 when none
    tip_z: float        # fingertip height actually reached, metres
    # What a robot measures during the grasp (CONTRACT.md section 7); None: not measured (the hand
    # could not even be placed above the grasp).
    contact_stop: bool | None = None   # the descent stopped on resistance before the grasp's z
    jaw_width: float | None = None     # metres between the pads after closing, before the lift


class FloatingHand:
    """The floating hand, created once per cell and reused for every grasp."""

    def __init__(self, cell: Cell) -> None:
        self.cell = cell
        c = cell.client
        palm_col = c.createCollisionShape(p.GEOM_BOX, halfExtents=PALM_HALF)
        palm_vis = c.createVisualShape(p.GEOM_BOX, halfExtents=PALM_HALF, rgbaColor=[0.9, 0.9, 0.9, 1])
        fin_col = c.createCollisionShape(p.GEOM_BOX, halfExtents=FINGER_HALF)
        fin_vis = c.createVisualShape(p.GEOM_BOX, halfExtents=FINGER_HALF, rgbaColor=[0.2, 0.2, 0.2, 1])
        fz = -PALM_HALF[2] - FINGER_HALF[2]
        park = self._park_pose()
        self.body = c.createMultiBody(
            baseMass=PALM_MASS,
            baseCollisionShapeIndex=palm_col,
            baseVisualShapeIndex=palm_vis,
            basePosition=park,
            linkMasses=[FINGER_MASS, FINGER_MASS],
            linkCollisionShapeIndices=[fin_col, fin_col],
            linkVisualShapeIndices=[fin_vis, fin_vis],
            linkPositions=[[0, 0, fz], [0, 0, fz]],
            linkOrientations=[[0, 0, 0, 1], [0, 0, 0, 1]],
            linkInertialFramePositions=[[0, 0, 0], [0, 0, 0]],
            linkInertialFrameOrientations=[[0, 0, 0, 1], [0, 0, 0, 1]],
            linkParentIndices=[0, 0],
            linkJointTypes=[p.JOINT_PRISMATIC, p.JOINT_PRISMATIC],
            linkJointAxis=[[1, 0, 0], [-1, 0, 0]],
        )
        for j in (0, 1):
            c.changeDynamics(self.body, j, jointLowerLimit=FINGER_HALF[0],
                             jointUpperLimit=GRIPPER_MAX_WIDTH / 2 + FINGER_HALF[0])
        self.constraint = c.createConstraint(
            self.body, -1, -1, -1, p.JOINT_FIXED, [0, 0, 0], [0, 0, 0], park
        )
        c.changeConstraint(self.constraint, park, maxForce=ARM_FORCE)
        self._excluded = {self.body}

    def _park_pose(self) -> list[float]:
        x, y, _ = self.cell.calib.workspace_center
        return [x, y, self.cell.calib.table_z + PARK_HEIGHT]

    def park(self) -> None:
        c = self.cell.client
        pose = self._park_pose()
        c.resetBasePositionAndOrientation(self.body, pose, [0, 0, 0, 1])
        c.resetBaseVelocity(self.body, [0, 0, 0], [0, 0, 0])
        c.changeConstraint(self.constraint, pose, [0, 0, 0, 1], maxForce=ARM_FORCE)

    def set_friction(self, friction: float) -> None:
        for j in (0, 1):
            self.cell.client.changeDynamics(self.body, j, lateralFriction=float(friction))

    # --------------------------------------------------------------- helpers
    def _set_fingers(self, q: float, force: float, reset: bool = False) -> None:
        c = self.cell.client
        for j in (0, 1):
            if reset:
                c.resetJointState(self.body, j, q)
            c.setJointMotorControl2(
                self.body, j, p.POSITION_CONTROL, targetPosition=q, force=force, maxVelocity=FINGER_SPEED
            )

    def _upward_force(self) -> float:
        total = 0.0
        for cp in self.cell.client.getContactPoints(bodyA=self.body):
            # contactNormalOnB points from B to A: its z is the push on the hand.
            total += cp[9] * cp[7][2]
        return total

    # ---------------------------------------------------------------- grasp
    def execute(self, grasp: Grasp, force: float, timing: GraspTiming) -> GraspOutcome:
        """Execute one grasp from the current physics state and check success.

        The caller restores the scene's saved state before each call.
        """
        c = self.cell.client
        table_z = self.cell.calib.table_z
        x, y, z = grasp.position
        tip_z = max(z, table_z + MIN_TIP_CLEARANCE)
        q = p.getQuaternionFromEuler([0, 0, grasp.yaw])
        start_tip = max(tip_z, table_z + START_HEIGHT)
        base = [x, y, start_tip + _TIP_BELOW_BASE]
        c.resetBasePositionAndOrientation(self.body, base, q)
        c.resetBaseVelocity(self.body, [0, 0, 0], [0, 0, 0])
        open_q = min(grasp.width, GRIPPER_MAX_WIDTH) / 2 + FINGER_HALF[0]
        self._set_fingers(open_q, force, reset=True)
        c.changeConstraint(self.constraint, base, q, maxForce=ARM_FORCE)
        if c.getContactPoints(bodyA=self.body):
            # The hand cannot even be placed above the grasp: a real arm would collide.
            self.park()
            return GraspOutcome(False, -1, start_tip)

        # Descend to the fingertip height, or until ~3 N pushes back.
        reached = start_tip
        stopped = False
        for k in range(1, timing.descend_steps + 1):
            target = start_tip + (tip_z - start_tip) * k / timing.descend_steps
            c.changeConstraint(self.constraint, [x, y, target + _TIP_BELOW_BASE], q, maxForce=ARM_FORCE)
            c.stepSimulation()
            reached = c.getBasePositionAndOrientation(self.body)[0][2] - _TIP_BELOW_BASE
            if self._upward_force() > DESCENT_STOP_FORCE:
                stopped = True
                break
        else:
            # The driven base lags its target: let it arrive (or meet resistance).
            for _ in range(SETTLE_STEPS):
                if reached - tip_z < ARRIVAL_TOLERANCE:
                    break
                if self._upward_force() > DESCENT_STOP_FORCE:
                    stopped = True
                    break
                c.stepSimulation()
                reached = c.getBasePositionAndOrientation(self.body)[0][2] - _TIP_BELOW_BASE
        hold_at = [x, y, reached + _TIP_BELOW_BASE]
        c.changeConstraint(self.constraint, hold_at, q, maxForce=ARM_FORCE)

        # Close.
        self._set_fingers(FINGER_HALF[0], force)
        for _ in range(timing.close_steps):
            c.stepSimulation()
        # Each joint is the distance from the palm's axis to its finger's centre.
        jaw_width = max(0.0, sum(c.getJointState(self.body, j)[0] for j in (0, 1)) - 2 * FINGER_HALF[0])

        # Lift 0.2 m, then hold.
        for k in range(1, timing.lift_steps + 1):
            target = [x, y, hold_at[2] + LIFT_HEIGHT * k / timing.lift_steps]
            c.changeConstraint(self.constraint, target, q, maxForce=ARM_FORCE)
            c.stepSimulation()
        lifted_start = self.cell.object_heights() >= SUCCESS_HEIGHT
        for _ in range(timing.hold_steps):
            c.stepSimulation()
        lifted_end = self.cell.object_heights() >= SUCCESS_HEIGHT
        both = np.flatnonzero(lifted_start & lifted_end)
        self.park()
        return GraspOutcome(bool(len(both)), int(both[0]) if len(both) else -1, float(reached), stopped,
                            float(jaw_width))


def hold_steps_for(seconds: float, timestep: float) -> int:
    """Steps that integrate a hold of ``seconds`` at ``timestep``."""
    return int(math.ceil(seconds / timestep))
