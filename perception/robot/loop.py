"""``sim2real-grasp-loop``: camera -> policy -> robot, recording every attempt.

    sim2real-grasp-loop artifact=DIR calibration=FILE camera=SPEC robot=dry|jsonl|sim|http://... out_dir=DIR

Each step reads a fresh frame from a :class:`~perception.robot.cameras.ThreadedCamera` (no
older than ``max_frame_age``), runs the policy in process, decodes the best grasp inside
the workspace, hands it to the robot adapter (:mod:`perception.robot.robots`) and records the
attempt: the raw frame in ``out_dir/frames/`` (a folder ``sim2real-adapt`` takes as
``real_dir``) and one JSON line in ``out_dir/attempts.jsonl`` with the grasp and, when the
robot reports it, the outcome (the labels for a later fine-tuning step: deploy, collect,
retrain). Safety: only grasps inside the workspace and at or above the quality threshold
leave the loop, frames older than the limit are refused, and steps are rate limited.
A grasp the robot executed without success is not handed over again while the scene
around it has not moved (``repeats``, :mod:`perception.core.repeats`, as in the service).
SIGINT and SIGTERM stop the loop after the current step.

The hand-off never overlaps a motion: a robot that did not answer in time may still be
moving, so the next grasp waits until the adapter confirms that the motion ended
(``robot_idle_timeout``); one that cannot confirm ends the loop with exit code 3 and the
attempt's number. A bad frame (another size, one pixel-identical to the previous frame or
with a driver counter that did not advance: a frozen camera, since a real sensor never
repeats its noise) is one failed step with its reason; ``max_failed_steps`` of them in a
row end the loop (exit code 3).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perception.core.artifact import ArtifactError, PolicyRunner
from perception.core.calibration import CalibrationError
from perception.core.cli import CliError, compose_config, config_number, setup_logging
from perception.core.decode import grasp_in_workspace
from perception.core.jsonio import write_json
from perception.core.outcomes import MEASURED_FIELDS, OutcomeError, check_measured
from perception.core.recording import Recording, RecordingError, load_attempts
from perception.core.repeats import RepeatGuard, repeat_options
from perception.robot.cameras import CameraError, StaleFrameError, ThreadedCamera, open_camera
from perception.robot.cameras.base import Frame
from perception.robot.plugins import load_registered
from perception.robot.robots import GraspRequest, Outcome, RobotAdapter, RobotError, make_robot

#: Exit code of a loop that stopped itself for safety (unconfirmed motion, failing steps).
EXIT_STOPPED_FOR_SAFETY = 3

__all__ = ["GraspLoop", "LoopConfig", "load_attempts", "main"]

log = logging.getLogger("sim2real.loop")

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
    repeats: dict | None = None  # perception.core.repeats options (None: off); a reported success is never remembered
    max_failed_steps: int = 10  # consecutive failed steps (bad or stale frames, errors) before stopping
    robot_idle_timeout: float = 30.0  # s to wait for a robot that did not answer in time to confirm it stopped

    def validate(self) -> None:
        """Raises ValueError naming the first setting out of range."""
        def check(key: str, ok: bool, want: str) -> None:
            if not ok:
                raise ValueError(f"{key} must be {want}, got {getattr(self, key)!r}")

        def finite(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for key in ("max_frame_age", "max_decision_age", "frame_timeout", "robot_idle_timeout"):
            check(key, finite(getattr(self, key)) and getattr(self, key) > 0, "> 0 s")
        for key in ("rate_hz", "settle_s", "workspace_margin"):
            check(key, finite(getattr(self, key)) and getattr(self, key) >= 0, ">= 0")
        check("quality_threshold", self.quality_threshold is None
              or (finite(self.quality_threshold) and 0.0 <= self.quality_threshold <= 1.0), "in [0, 1] (or null)")
        for key in ("max_attempts", "max_steps"):
            v = getattr(self, key)
            check(key, v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), "a whole number >= 1 (or null)")
        for key in ("max_robot_errors", "max_failed_steps"):
            v = getattr(self, key)
            check(key, isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1")


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
    failed_steps: int = 0
    stopped_by: str = ""
    stop_reason: str = ""
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
                 recorder: Recording | None = None, config: LoopConfig | None = None,
                 stop: threading.Event | None = None) -> None:
        self.camera = camera
        self.runner = runner
        self.robot = robot
        self.recorder = recorder
        self.cfg = config or LoopConfig()
        self.cfg.validate()
        self.stop = stop or threading.Event()
        self.stats = LoopStats()
        self.threshold = float(self.cfg.quality_threshold if self.cfg.quality_threshold is not None
                               else runner.meta.quality_threshold)
        self._not_before = 0.0
        self._frames_after = 0.0
        self._consecutive_robot_errors = 0
        self._consecutive_failed = 0
        self._previous: Frame | None = None
        self.repeats = RepeatGuard.build(self.calib, self.cfg.repeats)
        #: What every frame is decoded with: the artifact's options, the loop's threshold and
        #: margin, and the repeat memory's reach.
        self.options = runner.meta.decode_options.replace(threshold=self.threshold,
                                                          workspace_margin=self.cfg.workspace_margin)
        if self.repeats is not None:
            self.options = self.repeats.avoidance(self.options)

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
            self._failed(str(exc))
            return None
        self.stats.steps += 1
        bad, stale = self._bad_frame(frame)
        if bad is not None:
            self.stats.stale_frames += int(stale)
            self._failed(bad)
            return None
        t0 = time.perf_counter()
        avoid: list = []
        try:
            if self.repeats is not None:
                fingerprint, avoid = self.repeats.avoiding(frame.image)
            _, dec = self.runner.decide(frame.image, self.options, avoid=avoid)
        except Exception as exc:  # one bad frame is one failed step, never the end of the loop
            log.exception("processing frame %d failed", frame.index)
            self._failed(f"processing frame {frame.index} failed: {exc}")
            return None
        self._consecutive_failed = 0
        entry = self._entry(frame, dec, 1000.0 * (time.perf_counter() - t0))
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
        outcome = self._execute(GraspRequest(attempt_id, g, dec.pixel, time.time() - age), entry)
        self._frames_after = time.monotonic() + self.cfg.settle_s
        if outcome is not None:
            entry["outcome"] = self._outcome_entry(outcome)
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

    def _entry(self, frame: Frame, dec: Any, latency_ms: float) -> dict[str, Any]:
        """The step's record before the robot acts: the frame's age, the latency, the answer's reason."""
        return {
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

    def _execute(self, request: GraspRequest, entry: dict) -> Outcome | None:
        """Hand the grasp to the robot; its outcome, or ``None`` on a robot error (noted in
        ``entry``). A robot that may still be moving and does not confirm that it stopped
        aborts the loop: the next grasp could overlap the motion."""
        self.stats.attempts += 1
        try:
            outcome = self.robot.execute(request)
        except RobotError as exc:
            self.stats.robot_errors += 1
            self._consecutive_robot_errors += 1
            entry["error"] = str(exc)
            log.error("robot: %s", exc)
            if exc.in_motion and not self.robot.confirm_idle(self.cfg.robot_idle_timeout):
                self._abort("robot_unconfirmed", f"attempt {request.id}: the robot did not answer in time and "
                            f"did not confirm within {self.cfg.robot_idle_timeout:g} s that its motion ended; no "
                            "further grasp is sent")
            return None
        self._consecutive_robot_errors = 0
        return outcome

    def _outcome_entry(self, outcome: Outcome) -> dict:
        """The outcome as recorded. Measured fields out of range for this cell (POST /v1/outcome's
        rules) are left out, with the reason: the success bit still counts."""
        entry = outcome.to_dict()
        try:
            check_measured(entry, self.calib.table_z)
        except OutcomeError as exc:
            log.error("robot: %s; its measured fields are not recorded", exc)
            entry = {k: v for k, v in entry.items() if k not in MEASURED_FIELDS}
            entry["measured_refused"] = str(exc)
        return entry

    def _bad_frame(self, frame: Frame) -> tuple[str | None, bool]:
        """Why a frame must not be used (its size, a frozen camera) and whether it is stale; ``(None, False)``: usable."""
        W, H = self.calib.image_size
        img = frame.image
        if not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.shape == (H, W, 3)):
            shape = getattr(img, "shape", None)
            return (f"frame {frame.index} is {shape} {getattr(img, 'dtype', '')}; the calibration wants "
                    f"({H}, {W}, 3) uint8"), False
        prev, self._previous = self._previous, frame
        if prev is not None and frame.index <= prev.index and frame.source == prev.source:
            return f"frame {frame.index}: the camera's frame counter did not advance (previous {prev.index})", True
        if prev is not None and np.array_equal(img, prev.image):
            return (f"frame {frame.index} is pixel-identical to the previous frame: a frozen camera "
                    "(a real sensor never repeats its noise)"), True
        return None, False

    def _failed(self, reason: str) -> None:
        self.stats.failed_steps += 1
        self._consecutive_failed += 1
        log.warning("failed step (%d in a row): %s", self._consecutive_failed, reason)
        if self._consecutive_failed >= self.cfg.max_failed_steps:
            self._abort("failed_steps", f"{self._consecutive_failed} failed steps in a row; the last: {reason}")

    def _abort(self, by: str, reason: str) -> None:
        self.stats.stopped_by, self.stats.stop_reason = by, reason
        log.error("stopping: %s", reason)
        self.stop.set()

    @property
    def stopped_for_safety(self) -> bool:
        return self.stats.stopped_by in ("robot_unconfirmed", "failed_steps", "robot_errors")

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
                self._abort("robot_errors", f"{self._consecutive_robot_errors} robot errors in a row")
                break
            self.step()
        if not self.stats.stopped_by:
            self.stats.stopped_by = "signal"
        return self.stats


# ------------------------------------------------------------------------ CLI
def _build_camera_and_robot(cfg, calib):
    """Camera and robot from the config; ``sim`` for both shares one simulated cell (the one
    sim_render registers, :mod:`perception.robot.plugins`)."""
    cam_spec, robot_spec = cfg.camera, str(cfg.robot)
    shared = None
    if str(cam_spec) == "sim" or robot_spec == "sim":
        shared = load_registered("cells", "sim")(calib, seed=int(cfg.seed))
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
        robot = make_robot(robot_spec, token=cfg.robot_token, timeout=float(cfg.robot_timeout),
                           idle_url=cfg.robot_idle_url or None)
    elif robot_spec == "jsonl":
        robot = make_robot(robot_spec, timeout=float(cfg.robot_timeout))
    else:
        robot = make_robot(robot_spec)
    return camera, robot, shared


def loop_config(cfg, repeats: dict | None) -> LoopConfig:
    """:class:`LoopConfig` from ``conf/grasp_loop.yaml``; a bad value raises ValueError naming its key."""
    def opt_int(key: str) -> int | None:
        return None if cfg[key] is None else config_number(cfg, key, int, lo=1)

    out = LoopConfig(
        max_frame_age=config_number(cfg, "max_frame_age", float, lo=0, lo_open=True),
        max_decision_age=config_number(cfg, "max_decision_age", float, lo=0, lo_open=True),
        rate_hz=config_number(cfg, "rate_hz", float, lo=0),
        settle_s=config_number(cfg, "settle_s", float, lo=0),
        quality_threshold=None if cfg.quality_threshold is None
        else config_number(cfg, "quality_threshold", float, lo=0, hi=1),
        workspace_margin=config_number(cfg, "workspace_margin", float, lo=0),
        max_attempts=opt_int("max_attempts"),
        max_steps=opt_int("max_steps"),
        max_robot_errors=config_number(cfg, "max_robot_errors", int, lo=1),
        record_no_grasp=bool(cfg.record_no_grasp),
        repeats=repeats,
        max_failed_steps=config_number(cfg, "max_failed_steps", int, lo=1),
        robot_idle_timeout=config_number(cfg, "robot_idle_timeout", float, lo=0, lo_open=True),
    )
    out.validate()
    return out


def main(argv: list[str] | None = None) -> int:
    """``sim2real-grasp-loop artifact=DIR calibration=FILE camera=SPEC robot=... out_dir=DIR``."""
    prog = "sim2real-grasp-loop"
    cfg = compose_config("grasp_loop", list(sys.argv[1:] if argv is None else argv), prog, __doc__ or "")
    setup_logging(cfg.log_level)  # logs go to stderr: stdout may carry the jsonl protocol
    if not cfg.artifact:
        raise CliError(prog, "artifact=DIR is required")
    try:
        # Every setting is checked before a camera or robot is opened.
        repeats = repeat_options(cfg.repeats)
        loop_cfg = loop_config(cfg, repeats)
        for key in ("robot_timeout", "reconnect_backoff_max"):
            config_number(cfg, key, float, lo=0, lo_open=True)
        runner = PolicyRunner(str(cfg.artifact), None if not cfg.calibration else str(cfg.calibration),
                              intra_op_num_threads=cfg.threads, precision=str(cfg.precision))
        try:  # a folder of another camera, or one another process records into
            recorder = Recording(cfg.out_dir, runner.calib, debug_images=bool(cfg.debug_images),
                                 source="loop") if cfg.out_dir else None
        except (RecordingError, OSError) as exc:
            raise ValueError(f"out_dir={cfg.out_dir}: {exc}") from exc
        camera, robot, shared = _build_camera_and_robot(cfg, runner.calib)
    except (ArtifactError, CalibrationError, CameraError, ValueError, ImportError) as exc:
        raise CliError(prog, f"not starting: {exc}") from exc
    stop = threading.Event()

    def _on_signal(sig, _frame):
        log.info("received %s, stopping after the current step", signal.Signals(sig).name)
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
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
        write_json(Path(cfg.out_dir) / "last_session.json", summary, indent=2)
    log.info("loop finished: %s", json.dumps(summary))
    if loop.stopped_for_safety:
        print(f"{prog}: stopped: {stats.stop_reason}", file=sys.stderr)
        return EXIT_STOPPED_FOR_SAFETY
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
