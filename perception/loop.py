"""``sim2real-grasp-loop``: camera -> policy -> robot, recording every attempt.

    sim2real-grasp-loop artifact=DIR calibration=FILE camera=SPEC robot=dry|jsonl|sim|http://... out_dir=DIR

Each step reads a fresh frame from a :class:`~perception.cameras.ThreadedCamera` (no
older than ``max_frame_age``), runs the policy in process, decodes the best grasp inside
the workspace, hands it to the robot adapter (:mod:`perception.robots`) and records the
attempt: the raw frame in ``out_dir/frames/`` (a folder ``sim2real-adapt`` takes as
``real_dir``) and one JSON line in ``out_dir/attempts.jsonl`` with the grasp and, when the
robot reports it, the outcome (the labels for a later fine-tuning step: deploy, collect,
retrain). Safety: only grasps inside the workspace and at or above the quality threshold
leave the loop, frames older than the limit are refused, and steps are rate limited.
A grasp the robot executed without success is not handed over again while the scene
around it has not moved (``repeats``, :mod:`perception.repeats`, as in the service).
SIGINT and SIGTERM stop the loop after the current step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perception.artifact import PolicyRunner
from perception.atomic import atomic_write_text
from perception.cameras import StaleFrameError, ThreadedCamera
from perception.cameras.base import Frame
from perception.decode import DecodedGrasp, decode_grasp, grasp_in_workspace
from perception.imageio import write_image
from perception.repeats import RepeatGuard, repeat_options
from perception.robots import GraspRequest, Outcome, RobotAdapter, RobotError

__all__ = ["AttemptRecorder", "GraspLoop", "LoopConfig", "load_attempts", "main"]

log = logging.getLogger("sim2real.loop")

ATTEMPTS_FILE = "attempts.jsonl"
FRAMES_DIR = "frames"


class AttemptRecorder:
    """Writes attempts into ``out_dir``: ``frames/attempt_NNNNNN.png`` + ``attempts.jsonl``.

    Numbering continues after the attempts already in the folder, so several sessions
    collect into one folder. Frames are written atomically and each JSON line is flushed
    and fsynced, so a crash loses at most the attempt in progress.
    """

    def __init__(self, out_dir: str | Path, debug_images: bool = False) -> None:
        self.dir = Path(out_dir)
        (self.dir / FRAMES_DIR).mkdir(parents=True, exist_ok=True)
        self.debug_images = debug_images
        existing = load_attempts(self.dir) if (self.dir / ATTEMPTS_FILE).exists() else []
        self.next_id = max((int(a.get("id", 0)) for a in existing), default=0) + 1
        self._fh = open(self.dir / ATTEMPTS_FILE, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def new_id(self) -> int:
        with self._lock:
            i = self.next_id
            self.next_id += 1
            return i

    def record(self, attempt_id: int, frame: Frame, entry: dict, decoded: DecodedGrasp | None = None,
               calib=None) -> dict:
        name = f"{FRAMES_DIR}/attempt_{attempt_id:06d}.png"
        write_image(self.dir / name, frame.image)
        if self.debug_images and decoded is not None and calib is not None:
            from perception.overlay import draw_decoded

            write_image(self.dir / "debug" / f"attempt_{attempt_id:06d}.jpg", draw_decoded(frame.image, decoded, calib))
        line = {"id": attempt_id, "frame": name, **entry}
        with self._lock:
            self._fh.write(json.dumps(line) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
        return line

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


def load_attempts(folder: str | Path) -> list[dict]:
    """The attempts recorded in ``folder/attempts.jsonl`` (a torn last line is skipped)."""
    path = Path(folder) / ATTEMPTS_FILE
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a torn line in %s", path)
    return out


@dataclass
class LoopConfig:
    """Safety and pacing of the loop (units: seconds, attempts per second)."""

    max_frame_age: float = 0.5  # s, frames older than this are never used
    max_decision_age: float = 1.5  # s, a grasp from an older frame is not handed to the robot
    rate_hz: float = 0.5  # at most this many steps per second
    settle_s: float = 0.2  # s after the robot answers before the next frame may be taken
    quality_threshold: float | None = None  # None: the artifact's
    workspace_margin: float = 0.0  # m
    max_attempts: int | None = None  # grasps handed to the robot, then stop
    max_steps: int | None = None  # steps (with or without a grasp), then stop
    max_robot_errors: int = 3  # consecutive robot errors before stopping
    record_no_grasp: bool = True  # also record frames where nothing was worth grasping
    frame_timeout: float = 5.0  # s to wait for a fresh frame before logging and retrying
    repeats: dict | None = None  # perception.repeats options (None: off); a reported success is never remembered


@dataclass
class LoopStats:
    steps: int = 0
    attempts: int = 0
    successes: int = 0
    failures: int = 0
    unknown: int = 0
    no_grasp: int = 0
    stale_frames: int = 0
    robot_errors: int = 0
    stopped_by: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class GraspLoop:
    """The on-robot loop (see the module docstring).

    Args:
        camera: a started :class:`ThreadedCamera`.
        runner: the policy (its ``calib`` is the serving calibration).
        robot: the adapter grasps are handed to.
        recorder: where attempts go (``None``: not recorded).
        config: :class:`LoopConfig`.
        stop: an event that ends :meth:`run` between steps.
    """

    def __init__(self, camera: ThreadedCamera, runner: PolicyRunner, robot: RobotAdapter,
                 recorder: AttemptRecorder | None = None, config: LoopConfig | None = None,
                 stop: threading.Event | None = None) -> None:
        self.camera = camera
        self.runner = runner
        self.robot = robot
        self.recorder = recorder
        self.cfg = config or LoopConfig()
        self.stop = stop or threading.Event()
        self.stats = LoopStats()
        self.threshold = float(self.cfg.quality_threshold if self.cfg.quality_threshold is not None
                               else runner.meta.quality_threshold)
        self._not_before = 0.0
        self._frames_after = 0.0
        self._consecutive_robot_errors = 0
        self.repeats = RepeatGuard.build(self.calib, self.cfg.repeats)

    @property
    def calib(self):
        return self.runner.calib

    def _wait_rate(self) -> None:
        delay = self._not_before - time.monotonic()
        if delay > 0:
            self.stop.wait(delay)

    def step(self) -> dict | None:
        """One step; returns the recorded entry (``None`` when no fresh frame came)."""
        self._wait_rate()
        if self.stop.is_set():
            return None
        period = 1.0 / self.cfg.rate_hz if self.cfg.rate_hz > 0 else 0.0
        self._not_before = time.monotonic() + period
        try:
            frame = self.camera.read(max_age=self.cfg.max_frame_age, timeout=self.cfg.frame_timeout,
                                     fresh=True, after=self._frames_after)
        except StaleFrameError as exc:
            self.stats.stale_frames += 1
            log.warning("%s", exc)
            return None
        self.stats.steps += 1
        t0 = time.perf_counter()
        avoid: dict = {}
        if self.repeats is not None:
            fingerprint, avoid = self.repeats.avoiding(frame.image)
        maps = self.runner.infer(frame.image)
        dec = decode_grasp(maps.quality, maps.width, maps.height, self.calib, self.runner.view,
                           self.threshold, self.cfg.workspace_margin, surface=maps.surface,
                           **self.runner.meta.decode, **avoid)
        latency_ms = 1000.0 * (time.perf_counter() - t0)
        entry: dict[str, Any] = {
            "time": time.time(),
            "frame_age_s": round(time.monotonic() - frame.timestamp, 4),
            "latency_ms": round(latency_ms, 2),
            "grasp": None,
            "pixel": None,
            "view_pixel": None,
            "reason": dec.reason,
            "outcome": None,
            "error": None,
            "quality_threshold": self.threshold,
            "code_version": self.runner.meta.code_version,
            "calibration_digest": self.calib.digest(),
            "camera": frame.source,
        }
        attempt_id = self.recorder.new_id() if self.recorder else self.stats.steps
        g = dec.grasp
        if g is not None and not grasp_in_workspace(g, self.calib, self.cfg.workspace_margin):
            g, entry["reason"] = None, "grasp refused by the workspace safety check"
        age = time.monotonic() - frame.timestamp
        if g is not None and age > self.cfg.max_decision_age:
            g, entry["reason"] = None, f"frame was {age:.2f} s old at hand-off (limit {self.cfg.max_decision_age} s)"
        if g is None:
            self.stats.no_grasp += 1
            if self.repeats is not None:
                self.repeats.answered(fingerprint, None)
            if self.recorder and self.cfg.record_no_grasp:
                return self.recorder.record(attempt_id, frame, entry, dec, self.calib)
            return entry
        entry.update(grasp=g.to_dict(), pixel=list(dec.pixel), view_pixel=list(dec.view_pixel))
        request = GraspRequest(attempt_id, g, dec.pixel, time.time() - age)
        self.stats.attempts += 1
        try:
            outcome = self.robot.execute(request)
            self._consecutive_robot_errors = 0
        except RobotError as exc:
            self.stats.robot_errors += 1
            self._consecutive_robot_errors += 1
            entry["error"] = str(exc)
            outcome = None
            log.error("robot: %s", exc)
        self._frames_after = time.monotonic() + self.cfg.settle_s
        if outcome is not None:
            entry["outcome"] = outcome.to_dict()
            self._count(outcome)
        if self.repeats is not None:
            # The robot's word wins over the frame's: a success is not avoided. A grasp that was not
            # executed (a dry run, a robot error) did not fail: it is not avoided either.
            executed = outcome is not None and not outcome.detail.get("dry_run")
            self.repeats.answered(fingerprint, g if executed and outcome.success is not True else None)
        if self.recorder:
            entry = self.recorder.record(attempt_id, frame, entry, dec, self.calib)
        log.info("attempt %d: grasp at (%.3f, %.3f, %.3f) yaw %.2f q=%.2f -> %s", attempt_id, *g.position, g.yaw,
                 g.quality, "error" if outcome is None else outcome.success)
        return entry

    def _count(self, outcome: Outcome) -> None:
        if outcome.success is True:
            self.stats.successes += 1
        elif outcome.success is False:
            self.stats.failures += 1
        else:
            self.stats.unknown += 1

    def run(self) -> LoopStats:
        """Step until stopped, ``max_attempts`` / ``max_steps`` reached, or the robot keeps failing."""
        c = self.cfg
        while not self.stop.is_set():
            if c.max_attempts is not None and self.stats.attempts >= c.max_attempts:
                self.stats.stopped_by = "max_attempts"
                break
            if c.max_steps is not None and self.stats.steps >= c.max_steps:
                self.stats.stopped_by = "max_steps"
                break
            if self._consecutive_robot_errors >= c.max_robot_errors:
                self.stats.stopped_by = "robot_errors"
                log.error("stopping: %d robot errors in a row", self._consecutive_robot_errors)
                break
            self.step()
        if not self.stats.stopped_by:
            self.stats.stopped_by = "signal"
        return self.stats


# ------------------------------------------------------------------------ CLI
def _build_camera_and_robot(cfg, calib):
    """Camera and robot from the config; ``sim`` for both shares one PyBullet cell."""
    from perception.cameras import open_camera
    from perception.robots import make_robot

    cam_spec, robot_spec = cfg.camera, str(cfg.robot)
    shared = None
    if str(cam_spec) == "sim" or robot_spec == "sim":
        from importlib import import_module

        SimCell = import_module("sim_render.sim_robot").SimCell  # noqa: N806 - a class
        shared = SimCell(calib, seed=int(cfg.seed))
    if cam_spec is None:
        raise ValueError("camera=SPEC is required (a device index, a video file, a folder of frames, sim, ...)")
    if str(cam_spec) == "sim":
        camera = shared.camera()
    else:
        kw = {"fps": float(cfg.camera_fps)} if cfg.camera_fps else {}
        camera = open_camera(cam_spec, **kw)
    if robot_spec == "sim":
        robot = shared.robot()
    elif robot_spec.startswith(("http://", "https://")):
        robot = make_robot(robot_spec, token=cfg.robot_token, timeout=float(cfg.robot_timeout))
    elif robot_spec == "jsonl":
        robot = make_robot(robot_spec, timeout=float(cfg.robot_timeout))
    else:
        robot = make_robot(robot_spec)
    return camera, robot, shared


def main(argv: list[str] | None = None) -> int:
    """``sim2real-grasp-loop artifact=DIR calibration=FILE camera=SPEC robot=... out_dir=DIR``."""
    from perception.artifact import ArtifactError
    from perception.calibration import CalibrationError
    from perception.cameras import CameraError
    from perception.cli import CliError, compose_config, setup_logging

    prog = "sim2real-grasp-loop"
    cfg = compose_config("grasp_loop", list(sys.argv[1:] if argv is None else argv), prog, __doc__ or "")
    setup_logging(cfg.log_level)  # logs go to stderr: stdout may carry the jsonl protocol
    if not cfg.artifact:
        raise CliError(prog, "artifact=DIR is required")
    try:
        repeats = repeat_options(cfg.repeats)  # bad settings stop the loop before a camera or robot is opened
        runner = PolicyRunner(str(cfg.artifact), None if not cfg.calibration else str(cfg.calibration),
                              intra_op_num_threads=cfg.threads)
        camera, robot, shared = _build_camera_and_robot(cfg, runner.calib)
    except (ArtifactError, CalibrationError, CameraError, ValueError, ImportError) as exc:
        raise CliError(prog, f"not starting: {exc}") from exc
    loop_cfg = LoopConfig(
        max_frame_age=float(cfg.max_frame_age),
        max_decision_age=float(cfg.max_decision_age),
        rate_hz=float(cfg.rate_hz),
        settle_s=float(cfg.settle_s),
        quality_threshold=cfg.quality_threshold,
        workspace_margin=float(cfg.workspace_margin),
        max_attempts=cfg.max_attempts,
        max_steps=cfg.max_steps,
        max_robot_errors=int(cfg.max_robot_errors),
        record_no_grasp=bool(cfg.record_no_grasp),
        repeats=repeats,
    )
    stop = threading.Event()

    def _on_signal(sig, _frame):
        log.info("received %s, stopping after the current step", signal.Signals(sig).name)
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    recorder = AttemptRecorder(cfg.out_dir, debug_images=bool(cfg.debug_images)) if cfg.out_dir else None
    threaded = ThreadedCamera(camera, max_age=loop_cfg.max_frame_age, backoff_max=float(cfg.reconnect_backoff_max))
    t0 = time.monotonic()
    try:
        threaded.start()
        loop = GraspLoop(threaded, runner, robot, recorder, loop_cfg, stop)
        stats = loop.run()
    finally:
        threaded.close()
        robot.close()
        if recorder:
            recorder.close()
        if shared is not None:
            shared.close()
        for s, h in previous.items():
            signal.signal(s, h)
    summary = {**stats.to_dict(), "duration_s": round(time.monotonic() - t0, 2),
               "out_dir": None if not cfg.out_dir else str(cfg.out_dir)}
    if cfg.out_dir:
        atomic_write_text(Path(cfg.out_dir) / "last_session.json", json.dumps(summary, indent=2) + "\n")
    log.info("loop finished: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
