"""The PyBullet cell behind the robot-side interfaces: a sim camera and a sim robot.

:class:`SimCell` holds one :class:`~sim_render.cell.Cell` (the calibration's digital twin)
with objects in the bin and the floating hand. :class:`SimCamera` implements
:class:`perception.robot.cameras.Camera` by rendering the calibrated camera's raw frame;
:class:`SimRobot` implements :class:`perception.robot.robots.RobotAdapter` by executing the
contract's grasp physically and reporting whether an object was lifted. A successful
grasp takes the object out of the bin (as a robot would put it away); an empty bin is
refilled. Both share the cell so that the camera sees what the robot did:

    sim2real-grasp-loop artifact=DIR camera=sim robot=sim max_attempts=10

Used for tests and demos; ``perception`` never imports this module (the loop loads it
by name only when ``sim`` is asked for).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from perception.core.calibration import Calibration, load_calibration
from perception.robot.cameras.base import Camera, CameraError, Frame
from perception.robot.robots import GraspRequest, Outcome, RobotAdapter
from sim_render.camera import render_camera
from sim_render.cell import Cell
from sim_render.gripper import FloatingHand, GraspTiming, hold_steps_for
from sim_render.objects import object_urdfs

__all__ = ["SimCell", "SimCamera", "SimRobot"]


class SimCell:
    """One simulated cell shared by a :class:`SimCamera` and a :class:`SimRobot`.

    Args:
        calib: the calibration (default: the packaged one); frames come at its ``image_size``.
        seed: seeds the objects and their drop poses.
        n_objects: ``(min, max)`` objects per refill.
        split: ``"test"`` (held-out objects, the default for demos) or ``"train"``.
        gripper_force: N per finger.
        settle_steps: physics steps to let dropped objects come to rest.
        render_margin: extra field of view rendered before distortion (see ``conf/render``).
        renderer: ``"tiny"`` or ``"egl"``.
        read_noise: Gaussian sensor noise on each frame, 8-bit levels: a real sensor never
            delivers the same pixels twice, and the loop takes two identical frames for a
            frozen camera.
    """

    def __init__(
        self,
        calib: Calibration | None = None,
        seed: int = 0,
        n_objects: tuple[int, int] = (2, 4),
        split: str = "test",
        gripper_force: float = 70.0,
        settle_steps: int = 240,
        render_margin: float = 0.15,
        renderer: str = "tiny",
        read_noise: float = 1.0,
    ) -> None:
        self.calib = calib or load_calibration()
        self.read_noise = float(read_noise)
        self._noise_rng = np.random.default_rng(np.random.SeedSequence([int(seed), 104729]))
        self.rng = np.random.default_rng(np.random.SeedSequence([int(seed), 7919]))
        self.n_objects = n_objects
        self.urdfs = object_urdfs(split)
        self.gripper_force = float(gripper_force)
        self.settle_steps = int(settle_steps)
        self.render_margin = float(render_margin)
        self.renderer = renderer
        self.lock = threading.RLock()  # the camera thread and the loop share one PyBullet client
        self.cell = Cell(self.calib)
        self.hand = FloatingHand(self.cell)
        self.timing = GraspTiming(hold_steps=hold_steps_for(1.0, self.cell.timestep))
        self.scenes = 0
        self.refill()

    def refill(self) -> None:
        """Clear the bin and drop a new set of objects into it."""
        with self.lock:
            self.cell.clear_objects()
            n = int(self.rng.integers(self.n_objects[0], self.n_objects[1] + 1))
            picks = self.rng.choice(len(self.urdfs), size=n, replace=False)
            self.cell.drop_objects([self.urdfs[i] for i in picks], self.rng, self.settle_steps)
            self.scenes += 1

    def render(self) -> np.ndarray:
        """The raw RGB frame of the calibrated camera ``(H, W, 3)`` at ``image_size``."""
        with self.lock:
            rgb, _, _ = render_camera(self.cell.client, self.calib, self.render_margin, self.renderer)
            noise = self._noise_rng.normal(0.0, self.read_noise, rgb.shape) if self.read_noise > 0 else 0.0
        return np.clip(rgb + noise, 0, 255).astype(np.uint8) if self.read_noise > 0 else rgb

    def execute(self, request: GraspRequest) -> Outcome:
        with self.lock:
            out = self.hand.execute(request.grasp, self.gripper_force, self.timing)
            detail = {"tip_z": out.tip_z, "scene": self.scenes}
            if out.success and out.lifted_object >= 0:
                body = self.cell.bodies.objects.pop(out.lifted_object)
                self.cell.bodies.object_urdfs.pop(out.lifted_object)
                self.cell.client.removeBody(body)
                detail["removed_object"] = int(out.lifted_object)
            self.cell.settle(self.settle_steps)
            if not self.cell.bodies.objects:
                self.refill()
                detail["refilled"] = True
            # What a real robot measures during the grasp (CONTRACT.md section 7): the stop is where
            # the fingertips were when the descent ended.
            return Outcome(bool(out.success), detail, contact_stop=out.contact_stop,
                           fingertip_z=None if out.contact_stop is None else float(out.tip_z),
                           jaw_width=out.jaw_width)

    def camera(self, fps: float | None = 5.0) -> SimCamera:
        return SimCamera(cell=self, fps=fps)

    def robot(self) -> SimRobot:
        return SimRobot(cell=self)

    def close(self) -> None:
        with self.lock:
            self.cell.close()


class SimCamera(Camera):
    """The calibrated camera rendered from a :class:`SimCell` (its own one by default).

    Args:
        cell: the shared cell; ``None`` creates one from ``calib`` and ``seed``.
        fps: frame rate (rendering is paced to it; ``None``: as fast as it renders).
    """

    def __init__(self, cell: SimCell | None = None, calib: Calibration | None = None, seed: int = 0,
                 fps: float | None = 5.0) -> None:
        self._own = cell is None
        self._cell = cell
        self._calib, self._seed = calib, seed
        self.fps = fps
        self._open = False
        self._index = 0
        self._next_due = 0.0
        self.name = f"sim:{seed}"

    @property
    def cell(self) -> SimCell:
        if self._cell is None:
            self._cell = SimCell(self._calib, seed=self._seed)
        return self._cell

    def open(self) -> None:
        _ = self.cell
        self._open = True
        self._next_due = time.monotonic()

    @property
    def is_open(self) -> bool:
        return self._open

    def read(self) -> Frame:
        if not self._open:
            raise CameraError("sim camera is not open")
        if self.fps:
            delay = self._next_due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._next_due = max(self._next_due + 1.0 / self.fps, time.monotonic())
        img = self.cell.render()
        self._index += 1
        return Frame(image=img, timestamp=time.monotonic(), index=self._index, source=self.name)

    def close(self) -> None:
        self._open = False
        if self._own and self._cell is not None:
            self._cell.close()
            self._cell = None


class SimRobot(RobotAdapter):
    """Executes grasps in a :class:`SimCell` (its own one by default) and reports success."""

    name = "sim"

    def __init__(self, cell: SimCell | None = None, calib: Calibration | None = None, seed: int = 0) -> None:
        self._own = cell is None
        self.cell = cell or SimCell(calib, seed=seed)

    def execute(self, request: GraspRequest) -> Outcome:
        return self.cell.execute(request)

    def close(self) -> None:
        if self._own:
            self.cell.close()
