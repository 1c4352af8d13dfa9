"""Robot adapters: where the grasp loop hands its grasps.

Every adapter implements :class:`RobotAdapter`: ``execute(request) -> Outcome`` moves
the robot (or asks a controller to) and reports, when it knows, whether the grasp
succeeded. Adapters:

- :class:`JsonLinesRobot` (``robot=jsonl``): one JSON line per grasp on stdout, one JSON
  line back on stdin (``{"id": 3, "success": true}``), for a controller that runs the
  loop as a child process.
- :class:`HttpCallbackRobot` (``robot=http://HOST:PORT/PATH``): POSTs the grasp as JSON to
  a real controller and reads ``{"success": ...}`` from the answer.
- :class:`DryRunRobot` (``robot=dry``): logs grasps and moves nothing.
- ``robot=sim``: the PyBullet cell's robot, which sim_render registers
  (:mod:`perception.robot.plugins`; loaded when used).

Request (what every adapter sends)::

    {"type": "grasp", "id": 7, "grasp": {"position": [x, y, z], "yaw": .., "width": .., "quality": ..},
     "pixel": [u, v], "frame_timestamp": 1700000000.12}
"""

from __future__ import annotations

import abc
import importlib
import json
import logging
import select
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import IO, Any

from perception.core.grasp import Grasp
from perception.core.outcomes import MEASURED_FIELDS, OutcomeError, check_measured
from perception.robot.plugins import load_registered, registered

__all__ = [
    "GraspRequest",
    "Outcome",
    "RobotAdapter",
    "RobotError",
    "DryRunRobot",
    "JsonLinesRobot",
    "HttpCallbackRobot",
    "make_robot",
    "KNOWN_ROBOTS",
]

log = logging.getLogger("sim2real.robot")


class RobotError(RuntimeError):
    """The robot or its controller could not execute the grasp or did not answer.

    ``in_motion``: the robot may still be moving (it did not answer in time), so no
    further grasp may be sent until :meth:`RobotAdapter.confirm_idle` says it stopped.
    """

    def __init__(self, message: str, in_motion: bool = False) -> None:
        super().__init__(message)
        self.in_motion = bool(in_motion)


@dataclass
class GraspRequest:
    """One grasp handed to the robot."""

    id: int
    grasp: Grasp
    pixel: tuple[float, float] | None = None
    frame_timestamp: float | None = None

    def to_dict(self) -> dict:
        return {
            "type": "grasp",
            "id": int(self.id),
            "grasp": self.grasp.to_dict(),
            "pixel": None if self.pixel is None else [float(self.pixel[0]), float(self.pixel[1])],
            "frame_timestamp": self.frame_timestamp,
        }


@dataclass
class Outcome:
    """What the robot reports: ``success`` is ``None`` when it does not know; the measured fields
    (:mod:`perception.core.outcomes`: ``contact_stop``, ``fingertip_z`` metres in ``B``, ``jaw_width``
    metres) are ``None`` when it does not measure them (a dry run leaves them out)."""

    success: bool | None = None
    detail: dict = field(default_factory=dict)
    contact_stop: bool | None = None
    fingertip_z: float | None = None
    jaw_width: float | None = None

    def to_dict(self) -> dict:
        measured = {k: getattr(self, k) for k in MEASURED_FIELDS if getattr(self, k) is not None}
        return {"success": self.success, **measured, **({"detail": self.detail} if self.detail else {})}


class RobotAdapter(abc.ABC):
    """Executes grasps; implementations must be safe to ``close`` twice."""

    name = "robot"

    @abc.abstractmethod
    def execute(self, request: GraspRequest) -> Outcome:
        """Execute one grasp; raises :class:`RobotError` when it cannot."""

    def confirm_idle(self, timeout: float) -> bool:
        """After a :class:`RobotError` with ``in_motion``: wait up to ``timeout`` seconds for
        the robot to confirm that its last motion ended. ``False``: it did not (or this
        adapter has no way to ask): the loop must not send another grasp."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> RobotAdapter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DryRunRobot(RobotAdapter):
    """Moves nothing; logs each grasp and reports no outcome."""

    name = "dry"

    def __init__(self) -> None:
        self.requests: list[GraspRequest] = []

    def execute(self, request: GraspRequest) -> Outcome:
        self.requests.append(request)
        log.info("dry run: would execute %s", json.dumps(request.to_dict()))
        return Outcome(None, {"dry_run": True})


def _parse_outcome(obj: Any, expect_id: int | None) -> Outcome:
    if not isinstance(obj, dict):
        raise RobotError(f"the controller answered {obj!r}; expected a JSON object with 'success'")
    if expect_id is not None and "id" in obj and obj["id"] != expect_id:
        raise RobotError(f"the controller answered for grasp {obj['id']}, expected {expect_id}")
    success = obj.get("success")
    if success is not None and not isinstance(success, bool):
        raise RobotError(f"'success' must be true, false or null, got {success!r}")
    measured = {k: obj.get(k) for k in MEASURED_FIELDS}
    try:  # POST /v1/outcome's rules; fingertip_z's range is checked by the loop, which knows table_z
        check_measured(measured, table_z=None)
    except OutcomeError as exc:
        raise RobotError(f"the controller's outcome is malformed: {exc}") from None
    return Outcome(success, {k: v for k, v in obj.items() if k not in ("id", "success", "type", *MEASURED_FIELDS)},
                   **measured)


class JsonLinesRobot(RobotAdapter):
    """Grasps as JSON lines on ``out`` (stdout); outcomes as JSON lines from ``inp`` (stdin).

    Args:
        out, inp: text streams (default stdout / stdin).
        wait_outcome: wait for the controller's answer line after each grasp.
        timeout: seconds to wait for it (``None``: forever).
    """

    name = "jsonl"

    def __init__(self, out: IO[str] | None = None, inp: IO[str] | None = None, wait_outcome: bool = True,
                 timeout: float | None = 120.0) -> None:
        self.out = out or sys.stdout
        self.inp = inp or sys.stdin
        self.wait_outcome = wait_outcome
        self.timeout = timeout
        self._pending: int | None = None  # the id whose outcome came too late

    def _line_within(self, timeout: float | None) -> str | None:
        if timeout is not None:
            try:
                ready, _, _ = select.select([self.inp], [], [], timeout)
            except (OSError, ValueError, TypeError):  # not a selectable stream (e.g. StringIO)
                ready = [self.inp]
            if not ready:
                return None
        return self.inp.readline()

    def confirm_idle(self, timeout: float) -> bool:
        """The late outcome line of the grasp that timed out (or ``{"type": "idle"}``) confirms it."""
        deadline = time.monotonic() + float(timeout)
        while self._pending is not None:
            line = self._line_within(max(0.0, deadline - time.monotonic()))
            if not line:
                return False
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and (obj.get("type") == "idle" or obj.get("id") == self._pending):
                log.info("controller: grasp %s ended after its timeout", self._pending)
                self._pending = None
        return True

    def execute(self, request: GraspRequest) -> Outcome:
        if self._pending is not None:
            raise RobotError(f"grasp {self._pending} has not confirmed its end; not sending grasp {request.id}",
                             in_motion=True)
        try:
            self.out.write(json.dumps(request.to_dict()) + "\n")
            self.out.flush()
        except (OSError, ValueError) as exc:
            raise RobotError(f"cannot write to the controller: {exc}") from exc
        if not self.wait_outcome:
            return Outcome(None)
        line = self._line_within(self.timeout)
        if line is None:
            self._pending = request.id
            raise RobotError(f"no outcome from the controller within {self.timeout:.0f} s", in_motion=True)
        if not line:
            raise RobotError("the controller closed its output (stdin of the loop)")
        try:
            return _parse_outcome(json.loads(line), request.id)
        except json.JSONDecodeError as exc:
            raise RobotError(f"the controller's answer is not JSON: {line.strip()[:200]!r}") from exc


class HttpCallbackRobot(RobotAdapter):
    """POST each grasp as JSON to ``url``; the answer's JSON ``success`` is the outcome.

    An empty ``2xx`` answer means the grasp was accepted with no outcome; any other
    status, or no answer within ``timeout`` seconds, raises :class:`RobotError`. After a
    timeout the robot may still be moving: with ``idle_url`` the adapter asks it
    (``GET idle_url`` answering ``{"idle": true}``) before the next grasp; without one it
    cannot, and the loop stops.
    """

    name = "http"

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0, idle_url: str | None = None) -> None:
        for u in (url, idle_url):
            if u is not None and not str(u).startswith(("http://", "https://")):
                raise ValueError(f"callback url must start with http:// or https://, got {u!r}")
        self.url = url
        self.token = token
        self.timeout = float(timeout)
        self.idle_url = idle_url

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def confirm_idle(self, timeout: float) -> bool:
        if not self.idle_url:
            return False
        deadline = time.monotonic() + float(timeout)
        while time.monotonic() < deadline:
            try:
                req = urllib.request.Request(self.idle_url, headers=self._headers())
                with urllib.request.urlopen(req, timeout=max(0.1, min(5.0, deadline - time.monotonic()))) as resp:
                    if json.loads(resp.read(1 << 16) or b"{}").get("idle") is True:
                        return True
            except (urllib.error.URLError, OSError, TimeoutError, ValueError, AttributeError):
                pass
            time.sleep(0.2)
        return False

    def execute(self, request: GraspRequest) -> Outcome:
        body = json.dumps(request.to_dict()).encode()
        headers = {"Content-Type": "application/json", **self._headers()}
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = resp.read(1 << 20)
        except urllib.error.HTTPError as exc:
            raise RobotError(f"controller at {self.url} answered {exc.code}: {exc.read(500)!r}") from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            timed_out = isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)
            if timed_out:  # it got the grasp and may be executing it
                raise RobotError(f"controller at {self.url} did not answer within {self.timeout:g} s",
                                 in_motion=True) from exc
            raise RobotError(f"controller at {self.url} unreachable: {exc}") from exc
        if not data.strip():
            return Outcome(None)
        try:
            return _parse_outcome(json.loads(data), request.id)
        except json.JSONDecodeError as exc:
            raise RobotError(f"controller answer is not JSON: {data[:200]!r}") from exc


KNOWN_ROBOTS = ("dry", "jsonl", "http://...", *sorted(registered("robots")), "package.module:Class")


def make_robot(spec: Any, **kwargs: Any) -> RobotAdapter:
    """Build an adapter from a spec (see the module docstring); ``kwargs`` go to it."""
    if isinstance(spec, RobotAdapter):
        return spec
    s = str(spec).strip()
    if s == "dry":
        return DryRunRobot()
    if s == "jsonl":
        return JsonLinesRobot(**kwargs)
    if s.startswith(("http://", "https://")):
        return HttpCallbackRobot(s, **kwargs)
    if s in registered("robots"):
        return load_registered("robots", s)(**kwargs)
    target = s if ":" in s and "." in s.partition(":")[0] else None
    if target:
        mod, _, cls = target.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load robot adapter {target}: {exc}") from exc
        return obj(**kwargs)
    raise ValueError(f"unknown robot {s!r}; known: {', '.join(KNOWN_ROBOTS)}")
