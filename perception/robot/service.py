"""The on-robot grasp service, ``sim2real-serve`` (docs/robot_cell.md section 6).

``POST /v1/grasp`` takes the raw bytes of one PNG or JPEG frame from the calibrated
camera and answers the best grasp inside the workspace. ``GET /healthz`` tells whether
the model is loaded, ``GET /metrics`` gives Prometheus counters and latency histograms,
``GET /v1/info`` describes the loaded policy, and ``/docs`` / ``/openapi.json`` describe
the API (a page served from here: a robot network has no internet).

Limits (``perception.robot.server.ServerLimits``, ``conf/serve.yaml`` ``limits:``): a bearer token
is checked before a body is read and guards everything but ``/healthz`` and the docs;
a body must arrive within ``body_timeout_s`` (``408``); ``/v1/grasp`` requests beyond
``max_concurrency + max_queue`` places get ``503`` with ``Retry-After`` before their body is
read, so memory stays under idle + (``max_concurrency + max_queue``) x the body limit; a
request that finds every place taken takes the place of the slowest body still arriving
(that one gets ``503``), so slow uploads cannot keep frames out; a JPEG
with more than ``max_jpeg_scans`` scans is ``400`` before decoding; at shutdown what waits
gets ``503`` and what runs gets its answer.

Safety: a returned grasp always lies inside the workspace (checked twice), below the
quality threshold the answer is ``"grasp": null`` with a reason, and bad input is a
``4xx`` that never stops the service.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from perception.core.artifact import PRECISIONS, ArtifactError, PolicyRunner, check_calibration, load_metadata
from perception.core.calibration import Calibration, CalibrationError
from perception.core.cli import CliError, compose_config, config_number, setup_logging
from perception.core.decode import DecodedGrasp, grasp_in_workspace
from perception.core.imageio import ImageDecodeError, decode_image, encode_image
from perception.core.outcomes import FINGERTIP_Z_RANGE_M, JAW_WIDTH_RANGE_M, OutcomeError, parse_outcome
from perception.core.overlay import draw_decoded
from perception.core.preprocess import PreprocessError
from perception.core.recording import Recording, attempt_key, load_attempts
from perception.core.repeats import RepeatGuard
from perception.robot.apidocs import api_docs_html
from perception.robot.online import OnlineResidual
from perception.robot.server import ServerLimits, ServerStats, Stopper, check_open_files, make_server

__all__ = ["create_app", "GraspService", "main", "DEFAULT_MAX_BODY_BYTES"]

log = logging.getLogger("sim2real.serve")

DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
#: Bytes read and thrown away after the body limit is hit, so that the client can
#: read its 413 instead of a connection reset; past this the connection is dropped.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
ACCEPTED_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}
#: Seconds: the request-latency histograms' buckets (a frame takes 20-60 ms on 2 cores).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Bytes: the largest /v1/outcome body (the contract's object is under 100 bytes).
MAX_OUTCOME_BYTES = 4096
KNOWN_PATHS = {"/healthz", "/v1/grasp", "/v1/outcome", "/v1/info", "/metrics", "/docs", "/openapi.json"}


# --------------------------------------------------------------------- schemas
class GraspModel(BaseModel):
    position: list[float] = Field(..., description="[x, y, z] in the robot base frame, metres; z is the fingertip height")
    yaw: float = Field(..., description="radians in (-pi/2, pi/2], from +x to the fingertip line, CCW from above")
    width: float = Field(..., description="opening before closing, metres (<= 0.08)")
    quality: float = Field(..., description="predicted success probability in [0, 1]")


class GraspAnswer(BaseModel):
    grasp: GraspModel | None
    pixel: list[float] | None = Field(..., description="position projected into the raw frame (u, v)")
    latency_ms: float
    reason: str | None = Field(..., description="why grasp is null")


class ErrorAnswer(BaseModel):
    detail: str


class Health(BaseModel):
    status: str


# --------------------------------------------------------------------- service
@dataclass
class _Result:
    decoded: DecodedGrasp
    rgb: object
    attempt_id: str | None = None


class GraspService:
    """The model, the calibration and the request processing (no HTTP here)."""

    def __init__(
        self,
        artifact_dir: str | Path,
        calibration: Calibration | str | Path | None = None,
        quality_threshold: float | None = None,
        workspace_margin: float = 0.0,
        intra_op_num_threads: int | None = None,
        repeats: dict | None = None,
        max_jpeg_scans: int = ServerLimits.max_jpeg_scans,
        record_dir: str | Path | None = None,
        record_max_attempts: int = 1000,
        online: bool = False,
        online_options: dict | None = None,
        precision: str = "auto",
    ) -> None:
        self.artifact_dir = Path(artifact_dir)
        # Validate everything cheap first, so a mismatch stops the service at start.
        self.meta = load_metadata(self.artifact_dir)
        if calibration is None:
            self.calib = self.meta.calibration
        elif isinstance(calibration, Calibration):
            self.calib = calibration
        else:
            self.calib = Calibration.load(calibration)
        self.warnings = check_calibration(self.meta, self.calib)
        self.threshold = float(self.meta.quality_threshold if quality_threshold is None else quality_threshold)
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"quality_threshold must be in [0, 1], got {self.threshold}")
        self.margin = float(workspace_margin)
        half = 0.5 * min(self.calib.workspace_x[1] - self.calib.workspace_x[0],
                         self.calib.workspace_y[1] - self.calib.workspace_y[0])
        if not (math.isfinite(self.margin) and 0.0 <= self.margin < half):
            # A negative margin would widen the workspace: grasps outside it (issue 12).
            raise ValueError(f"workspace_margin must be >= 0 m and below half the workspace ({half:.3f} m): "
                             f"it shrinks the workspace, got {workspace_margin}")
        self.max_jpeg_scans = int(max_jpeg_scans)
        self.threads = intra_op_num_threads
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        # None: every frame is answered on its own (the CLI turns the memory on: conf/repeats/default.yaml).
        self.repeats = RepeatGuard.build(self.calib, repeats)
        #: What every frame is decoded with: the artifact's options, this server's threshold and
        #: margin, and the repeat memory's reach.
        self.options = self.meta.decode_options.replace(threshold=self.threshold, workspace_margin=self.margin)
        if self.repeats is not None:
            self.options = self.repeats.avoidance(self.options)
        self.runner: PolicyRunner | None = None
        self.load_error: str | None = None
        if not int(record_max_attempts) > 0:
            raise ValueError(f"record_max_attempts must be > 0, got {record_max_attempts}")
        # Raises RecordingError (a ValueError) for a folder of another camera or one in use.
        self.recording = (Recording(record_dir, self.calib, max_attempts=int(record_max_attempts), source="serve")
                          if record_dir else None)
        self.recording_refused = 0  # attempts not recorded: the cap was reached
        # online=true: a residual on the quality, learnt from the outcomes (perception/robot/online.py).
        self.online: OnlineResidual | None = None
        self._answered: dict[str, tuple[int, float]] = {}  # attempt id -> (angle bin, quality), for its outcome
        if online:
            if self.recording is None:
                raise ValueError("online=true learns from the recorded attempts' outcomes: it needs record_dir=DIR")
            self.online = OnlineResidual(self.recording.dir, self.meta.angle_bins, online_options)
            for a in load_attempts(self.recording.dir):
                if a.get("angle_bin") is not None and a.get("grasp"):
                    self._answered[a["id"]] = (int(a["angle_bin"]), float(a["grasp"]["quality"]))

    def load(self) -> None:
        """Create the onnxruntime session (the slow part)."""
        try:
            self.runner = PolicyRunner(self.artifact_dir, self.calib, intra_op_num_threads=self.threads, meta=self.meta,
                                       precision=self.precision)
            log.info("running the %s graphs on %s", self.runner.precision, ", ".join(self.runner.providers))
        except Exception as exc:
            self.load_error = str(exc)
            raise

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def process(self, body: bytes, keep_rgb: bool = False, ext: str = "png") -> _Result:
        """Bytes of one frame -> decoded grasp, recorded when recording (``ext``: the bytes' format).

        Raises ImageDecodeError / PreprocessError."""
        assert self.runner is not None
        rgb = decode_image(body, expected_size=self.calib.image_size, max_jpeg_scans=self.max_jpeg_scans)
        # The repeat memory: the grasps that just failed on this scene are not answered again.
        avoid: list = []
        if self.repeats is not None:
            fingerprint, avoid = self.repeats.avoiding(rgb)
        # The online residual re-ranks the network's candidates, from the frame's quality maps.
        rerank = None if self.online is None else self.online.rerank
        _, dec = self.runner.decide(rgb, self.options, avoid=avoid, rerank=rerank)
        # The workspace safety check, on what leaves the service.
        if dec.grasp is not None and not grasp_in_workspace(dec.grasp, self.calib, self.margin):
            dec = DecodedGrasp(None, None, None, "grasp refused by the workspace safety check")
        attempt_id = self._record(body, ext, dec) if self.recording is not None and dec.grasp is not None else None
        if self.repeats is not None:
            self.repeats.answered(fingerprint, dec.grasp, attempt_id)
        return _Result(dec, rgb if keep_rgb else None, attempt_id)

    def _record(self, body: bytes, ext: str, dec: DecodedGrasp) -> str | None:
        """The frame as sent and its answer, on disk before the answer leaves; ``None`` at the cap."""
        rec = self.recording
        n = rec.reserve()
        if n is None:
            if self.recording_refused == 0:
                log.warning("recording: the cap of %d attempts in %s is reached; serving on without recording "
                            "(sim2real_recording_refused in /metrics counts what is not recorded)",
                            rec.max_attempts, rec.dir)
            self.recording_refused += 1
            return None
        entry = {
            "time": time.time(), "grasp": dec.grasp.to_dict(), "pixel": [float(v) for v in dec.pixel],
            "view_pixel": None if dec.view_pixel is None else [float(v) for v in dec.view_pixel],
            "angle_bin": dec.angle_bin,
            "reason": dec.reason, "outcome": None, "error": None, "quality_threshold": self.threshold,
            "code_version": self.meta.code_version, "calibration_digest": self.calib.digest(), "camera": "http",
        }
        try:
            rec.record_bytes(n, body, ext, entry)
        except OSError as exc:  # a full or failing disk: the robot still gets its grasp, unrecorded
            log.error("recording attempt %s failed: %s", attempt_key(n), exc)
            self.recording_refused += 1
            return None
        finally:
            rec.release()
        if self.online is not None and dec.angle_bin is not None:
            self._answered[attempt_key(n)] = (int(dec.angle_bin), float(dec.grasp.quality))
        return attempt_key(n)

    def record_outcome(self, attempt_id: str, outcome: dict) -> bool:
        """Write a reported outcome (fsynced), every field it was given kept; ``False``: an unknown attempt.

        Args:
            outcome: checked by :func:`perception.core.outcomes.parse_outcome` (``success`` and the
                optional measured fields).
        """
        success = bool(outcome["success"])
        known = self.recording.record_outcome(attempt_id, {"source": "http", **outcome})
        if known and self.repeats is not None:
            self.repeats.reported(attempt_id, bool(success))
        if known and self.online is not None and attempt_id in self._answered:
            self.online.update(*self._answered[attempt_id], bool(success))
        return known

    def info(self) -> dict:
        return {
            "artifact": str(self.artifact_dir),
            "code_version": self.meta.code_version,
            "image_size": list(self.calib.image_size),
            "input_size": list(self.meta.input_size),
            "angle_bins": self.meta.angle_bins,
            "quality_threshold": self.threshold,
            "workspace": {"x": list(self.calib.workspace_x), "y": list(self.calib.workspace_y)},
            "workspace_margin": self.margin,
            "calibration_digest": self.calib.digest(),
            "calibration_warnings": list(self.warnings),
            "providers": self.runner.providers if self.runner else None,
            "precision": self.runner.precision if self.runner else None,
            "ready": self.ready,
            "repeats": None if self.repeats is None else self.repeats.state(),
        }


def _error(status: int, detail: str, headers: dict | None = None, close: bool = False) -> JSONResponse:
    """A JSON error; ``close``: the connection ends with it.

    An error answered before its body was read leaves the connection open: uvicorn then
    reads the rest of the body and throws it away (so the client can read its answer),
    and ``perception.robot.server`` closes the connection if that takes ``header_timeout_s``.
    """
    headers = dict(headers or {})
    if close:
        headers["Connection"] = "close"
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class _Ticket:
    """One admitted /v1/grasp request: its body's progress and a scope to evict it by."""

    __slots__ = ("t0", "received", "uploading", "scope", "evicted")

    def __init__(self) -> None:
        self.t0, self.received, self.uploading = time.monotonic(), 0, True
        self.scope, self.evicted = anyio.CancelScope(), False

    def rate(self, now: float) -> float:
        return self.received / max(now - self.t0, 1e-3)


class _Gate:
    """The /v1/grasp places, from admission (before the body) to the answer.

    ``capacity`` places (``max_concurrency + max_queue``) bound the bodies held in memory.
    When every place is taken, a new request takes the place of the slowest upload still
    in progress that was admitted at least ``grace_s`` ago (lowest bytes per second since
    admission), which is answered ``503``:
    clients that trickle or never finish their bodies cannot keep a frame out for their
    ``body_timeout_s``. Only places whose bodies have all arrived, waiting for or in an
    inference, are a full queue (``503`` with ``Retry-After`` to the newcomer).
    Everything runs on the event loop's thread: no lock.
    """

    def __init__(self, capacity: int, grace_s: float) -> None:
        self.capacity, self.grace_s, self.refused, self.evicted = int(capacity), float(grace_s), 0, 0
        self.tickets: set[_Ticket] = set()

    @property
    def admitted(self) -> int:
        return len(self.tickets)

    def admit(self) -> _Ticket | None:
        if len(self.tickets) >= self.capacity:
            now = time.monotonic()
            # Only an upload that has had time to arrive can be the slowest: one admitted a
            # moment ago has 0 bytes and would always lose, so clients that retry at once
            # would evict each other and no body would ever arrive.
            uploading = [t for t in self.tickets if t.uploading and now - t.t0 >= self.grace_s]
            if not uploading:
                self.refused += 1
                return None
            slowest = min(uploading, key=lambda t: (t.rate(now), t.t0))
            slowest.evicted = True
            slowest.scope.cancel()
            self.tickets.discard(slowest)
            self.evicted += 1
        ticket = _Ticket()
        self.tickets.add(ticket)
        return ticket

    def release(self, ticket: _Ticket) -> None:
        self.tickets.discard(ticket)


class _MetricsMiddleware:
    """Pure ASGI middleware: counts responses by path and status, times them."""

    def __init__(self, app, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.requests.labels(label, str(status["code"])).inc()
            self.latency.labels(label).observe(time.perf_counter() - t0)


async def _read_body(request: Request, limit: int, ticket: _Ticket | None = None) -> tuple[bytearray | None, int]:
    """Read at most ``limit`` bytes; returns ``(None, n)`` when the body is larger.

    The bytes go into one buffer as they arrive, sized by ``Content-Length`` when it is
    declared: a list of chunks joined at the end held every body twice at its peak, and
    with every place of the queue filled by a near-limit upload that doubled the memory.
    ``ticket.received`` follows the bytes as they arrive (the gate evicts the slowest).
    """
    declared = request.headers.get("content-length", "")
    buf = bytearray(int(declared)) if declared.isdigit() and int(declared) <= limit else bytearray()
    view = memoryview(buf)
    size = 0
    over = False
    async for chunk in request.stream():
        n = len(chunk)
        if ticket is not None:
            ticket.received = size + n
        if over or size + n > limit:
            over = True
            size += n
            if size > DRAIN_LIMIT_BYTES:
                break
            continue
        if size + n <= len(buf):
            view[size:size + n] = chunk
        else:  # more than declared (h11 refuses that) or nothing declared: grow
            view.release()
            buf[size:] = chunk
            view = memoryview(buf)
        size += n
    view.release()
    if over:
        return None, size
    if size < len(buf):  # fewer bytes than declared: the client went away (h11 raises first)
        del buf[size:]
    return buf, size


def create_app(
    artifact_dir: str | Path,
    calibration: Calibration | str | Path | None = None,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    quality_threshold: float | None = None,
    workspace_margin: float = 0.0,
    intra_op_num_threads: int | None = None,
    max_concurrency: int = 2,
    background_load: bool = False,
    repeats: dict | None = None,
    limits: ServerLimits | None = None,
    record_dir: str | Path | None = None,
    record_max_attempts: int = 1000,
    online: bool = False,
    online_options: dict | None = None,
    precision: str = "auto",
) -> FastAPI:
    """Build the grasp service.

    Args:
        artifact_dir: the policy artifact (``policy.onnx`` + ``metadata.json``).
        calibration: the serving camera (wins over the artifact's); ``None``: the artifact's.
        token: bearer token required on everything but ``/healthz`` and the docs; ``None``
            or ``""``: no auth.
        max_body_bytes: larger bodies get ``413``.
        quality_threshold: ``None``: the artifact's.
        workspace_margin: metres (>= 0) the workspace is shrunk by for returned grasps.
        intra_op_num_threads: onnxruntime threads per inference.
        max_concurrency: inferences run at once in worker threads.
        background_load: create the onnxruntime session after start-up in a thread
            (``/healthz`` answers ``503`` until it is ready); by default it is created here.
        repeats: :func:`perception.core.repeats.repeat_options` keys: a grasp answered on a scene
            that has not moved around it since is not answered again
            (:class:`perception.core.repeats.RepeatGuard`); ``None`` or ``memory=0``: off, every
            frame answered on its own.
        limits: body timeout, queue, JPEG scans (:class:`perception.robot.server.ServerLimits`);
            the same object goes to :func:`perception.robot.server.make_server` for the rest.
        record_dir: record every answered grasp (the frame as sent and the answer) into this
            :class:`perception.core.recording.Recording`, and take outcomes at ``POST /v1/outcome``;
            ``None``: not recording (``/v1/outcome`` answers ``409``).
        record_max_attempts: the recording's disk cap in attempts; past it the service
            serves on without recording and counts what it did not record.
        online: learn a bounded residual on the quality from the outcomes as they arrive
            (:class:`perception.robot.online.OnlineResidual`, saved beside the recording); needs
            ``record_dir``. ``online_options``: its settings.
        precision: which of the artifact's graphs run (:data:`perception.core.artifact.PRECISIONS`):
            ``auto`` the int8 ones on a CPU when it has them, else the float ones.

    Raises:
        ArtifactError, CalibrationError: a bad artifact, or a calibration whose
            ``image_size`` differs from the artifact's (the service must not start).
        ValueError: a setting out of range (the message names it).
    """
    limits = limits or ServerLimits()
    limits.validate()
    if not int(max_body_bytes) > 0:
        raise ValueError(f"max_body_mb must be > 0, got {max_body_bytes} bytes")
    if not int(max_concurrency) > 0:
        raise ValueError(f"max_concurrency must be > 0, got {max_concurrency}")
    svc = GraspService(artifact_dir, calibration, quality_threshold, workspace_margin, intra_op_num_threads, repeats,
                       limits.max_jpeg_scans, record_dir, record_max_attempts, online, online_options, precision)
    for w in svc.warnings:
        log.warning("calibration drift from the trained camera: %s", w)
    if not background_load:
        svc.load()
    gate = _Gate(int(max_concurrency) + int(limits.max_queue), limits.evict_after_s)
    stopper, stats = Stopper(), ServerStats()
    # One registry per app (tests run several), with the process's own metrics
    # (process_resident_memory_bytes, open fds, CPU seconds) from prometheus_client.
    registry = CollectorRegistry()
    service_metrics = _ServiceMetrics.create(registry, svc, gate, stats)
    routes = _Routes(svc, token or None, anyio.CapacityLimiter(int(max_concurrency)), gate, stopper, limits,
                     int(max_body_bytes), service_metrics)

    # FastAPI's own /docs and /redoc load their scripts from a CDN: blank on a robot network.
    app = FastAPI(
        title="sim2real-grasp service",
        version="1",
        description=(
            "POST one raw PNG or JPEG frame from the calibrated camera to /v1/grasp; the answer is the best "
            "top-down grasp inside the workspace in the robot base frame (docs/robot_cell.md, section 6)."
        ),
        lifespan=_lifespan(svc, stopper),
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = svc
    app.state.registry = registry
    app.state.limits, app.state.stopper, app.state.server_stats = limits, stopper, stats
    unauthorized = {401: {"model": ErrorAnswer, "description": "token missing or wrong"}}
    app.get("/healthz", response_model=Health, responses={503: {"model": Health}})(routes.healthz)
    app.get("/v1/info", responses=unauthorized)(routes.info)

    @app.get("/metrics", response_class=Response, responses=unauthorized)
    async def metrics(request: Request):
        return routes.auth_error(request) or Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs():
        return HTMLResponse(api_docs_html(app.openapi()))

    app.post(**_GRASP_ROUTE)(routes.grasp)
    app.post("/v1/outcome", **_OUTCOME_ROUTE)(routes.outcome)
    app.add_middleware(_MetricsMiddleware, requests=service_metrics.requests, latency=service_metrics.latency)
    return app


_BODY_DOC = {"schema": {"type": "string", "format": "binary"}}

#: ``POST /v1/grasp``'s OpenAPI description.
_GRASP_ROUTE = dict(
    path="/v1/grasp",
    response_model=GraspAnswer,
    responses={
        200: {"content": {"image/png": {}}, "description": "the grasp (or, with debug=1, the frame with it drawn "
              "and the JSON answer in the X-Grasp-Result header)"},
        400: {"model": ErrorAnswer, "description": "undecodable image, a size other than image_size, or a "
              "JPEG with too many scans"},
        401: {"model": ErrorAnswer, "description": "token missing or wrong (checked before the body is read)"},
        408: {"model": ErrorAnswer, "description": "the body did not arrive within limits.body_timeout_s"},
        413: {"model": ErrorAnswer, "description": "body over the limit"},
        415: {"model": ErrorAnswer, "description": "not image/png or image/jpeg"},
        503: {"model": ErrorAnswer, "description": "model not loaded yet, queue full, or shutting down "
              "(Retry-After)"},
    },
    openapi_extra={
        "requestBody": {"required": True, "content": {"image/png": _BODY_DOC, "image/jpeg": _BODY_DOC}},
        "parameters": [{"name": "debug", "in": "query", "required": False, "schema": {"type": "integer"},
                        "description": "1: answer the frame with the grasp drawn (PNG)"}],
    },
)

#: ``POST /v1/outcome``'s OpenAPI description.
_OUTCOME_ROUTE = dict(
    responses={
        200: {"description": "the outcome is on disk", "content": {"application/json": {"example": {"recorded": True}}}},
        400: {"model": ErrorAnswer, "description": "not JSON"},
        401: {"model": ErrorAnswer, "description": "token missing or wrong (checked before the body is read)"},
        404: {"model": ErrorAnswer, "description": "no such attempt_id in the recording"},
        409: {"model": ErrorAnswer, "description": "the service is not recording (no record_dir)"},
        413: {"model": ErrorAnswer, "description": f"body over {MAX_OUTCOME_BYTES} bytes"},
        415: {"model": ErrorAnswer, "description": "not application/json"},
        422: {"model": ErrorAnswer, "description": "attempt_id (a non-empty string) or success (a boolean) missing, "
                                                   "or a measured field of the wrong type, not finite or out of range "
                                                   "(nothing is stored)"},
    },
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["attempt_id", "success"], "additionalProperties": True,
        "properties": {
            "attempt_id": {"type": "string"}, "success": {"type": "boolean"},
            "contact_stop": {"type": ["boolean", "null"],
                             "description": "the descent stopped on contact before reaching the grasp's z"},
            "fingertip_z": {"type": ["number", "null"],
                            "description": "metres in B: the fingertip height where the descent ended, within "
                                           f"[table_z{FINGERTIP_Z_RANGE_M[0]:+g}, table_z{FINGERTIP_Z_RANGE_M[1]:+g}]"},
            "jaw_width": {"type": ["number", "null"], "minimum": JAW_WIDTH_RANGE_M[0], "maximum": JAW_WIDTH_RANGE_M[1],
                          "description": "metres: the opening after closing, before the lift (near 0: nothing held)"},
        }}}}}},
)


def _lifespan(svc: GraspService, stopper: Stopper):
    """Load the model in a thread when it was not loaded at start-up; on shutdown, stop the
    waits and close the recording (flushed, the folder released for the next process)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not svc.ready:
            def _load() -> None:
                try:
                    svc.load()
                    log.info("model loaded from %s", svc.artifact_dir)
                except Exception:
                    log.exception("loading the model failed")

            threading.Thread(target=_load, name="model-load", daemon=True).start()
        yield
        stopper.begin()
        if svc.recording is not None:
            svc.recording.close()

    return lifespan


@dataclass
class _ServiceMetrics:
    """The service's Prometheus metrics (one registry per app)."""

    requests: Counter
    latency: Histogram
    infer_hist: Histogram
    grasps: Counter
    outcomes: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, svc: GraspService, gate: _Gate, stats: ServerStats) -> _ServiceMetrics:
        ProcessCollector(registry=registry)
        out = cls(
            requests=Counter("sim2real_http_requests", "HTTP responses by path and status", ("path", "status"),
                             registry=registry),
            latency=Histogram("sim2real_http_request_duration_seconds", "HTTP request latency", ("path",),
                              buckets=LATENCY_BUCKETS_S, registry=registry),
            infer_hist=Histogram("sim2real_inference_duration_seconds", "decode + preprocess + forward + grasp decode",
                                 buckets=LATENCY_BUCKETS_S, registry=registry),
            grasps=Counter("sim2real_grasp_answers", "200 answers by result", ("result",), registry=registry),
            outcomes=Counter("sim2real_outcomes", "POST /v1/outcome answers by status", ("status",),
                             registry=registry),
        )

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(name, doc, registry=registry).set_function(fn)

        gauge("sim2real_model_ready", "1 once the model is loaded", lambda: 1.0 if svc.ready else 0.0)
        gauge("sim2real_calibration_drift_warnings", "calibration differences from the trained camera",
              lambda: float(len(svc.warnings)))
        gauge("sim2real_repeats_remembered", "grasps not answered again: they just failed on the unchanged scene",
              lambda: float(svc.repeats.state()["remembered"]) if svc.repeats else 0.0)
        gauge("sim2real_grasp_requests_admitted", "/v1/grasp requests between admission and answer",
              lambda: float(gate.admitted))
        gauge("sim2real_grasp_requests_refused_queue_full", "/v1/grasp requests answered 503: queue full (total)",
              lambda: float(gate.refused))
        gauge("sim2real_grasp_uploads_evicted", "/v1/grasp bodies answered 503: slowest upload when a new request "
              "found the queue full (total)", lambda: float(gate.evicted))
        gauge("sim2real_open_connections", "open HTTP connections", lambda: float(stats.open_connections))
        gauge("sim2real_connections_refused", "connections over limits.max_connections, answered 503 (total)",
              lambda: float(stats.refused_connections))
        gauge("sim2real_header_timeouts", "connections closed: no request headers in time (total)",
              lambda: float(stats.header_timeouts))
        gauge("sim2real_accept_errors", "failed accepts: out of file descriptors (total)",
              lambda: float(stats.accept_errors))
        gauge("sim2real_recorded_attempts", "attempts in record_dir (0: not recording)",
              lambda: float(svc.recording.count) if svc.recording else 0.0)
        gauge("sim2real_online_updates", "outcomes the online residual learnt from (online=true)",
              lambda: float(svc.online.updates) if svc.online else 0.0)
        gauge("sim2real_recording_refused", "answered grasps not recorded: the cap was reached or the disk failed (total)",
              lambda: float(svc.recording_refused))
        return out


@dataclass
class _Routes:
    """What the service's routes share: the service, the token, the inference slots, the
    admission gate, shutdown, the limits and the metrics."""

    svc: GraspService
    token: str | None
    limiter: anyio.CapacityLimiter
    gate: _Gate
    stopper: Stopper
    limits: ServerLimits
    max_body_bytes: int
    metrics: _ServiceMetrics

    def auth_error(self, request: Request) -> JSONResponse | None:
        """``401`` unless the request carries the token (``None`` when none is set)."""
        if self.token is None:
            return None
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return None
        return _error(401, "missing or wrong token: send 'Authorization: Bearer TOKEN'",
                      {"WWW-Authenticate": "Bearer"})

    async def healthz(self):
        if self.svc.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error" if self.svc.load_error else "loading"}, status_code=503)

    async def info(self, request: Request):
        return self.auth_error(request) or JSONResponse(self.svc.info())

    async def grasp(self, request: Request):
        t0 = time.perf_counter()
        # Everything that can be refused is refused before the body is read: a refused
        # request costs neither memory nor a wait for its bytes (perception.robot.server bounds
        # how long its rest may trickle in).
        if (denied := self.auth_error(request)) is not None:
            return denied
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in ACCEPTED_TYPES:
            return _error(415, f"Content-Type must be image/png or image/jpeg, got {ctype or 'none'!r}")
        ext = {"png": "png", "jpeg": "jpg"}[ACCEPTED_TYPES[ctype]]
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > self.max_body_bytes:
                    return _error(413, f"body of {int(declared)} bytes is over the limit of {self.max_body_bytes}")
            except ValueError:
                return _error(400, "invalid Content-Length")
        if not self.svc.ready:
            return _error(503, "the model is not loaded yet", {"Retry-After": "1"})
        if self.stopper.stopping.is_set():
            return _error(503, "the service is shutting down", {"Retry-After": "1"}, close=True)
        if (ticket := self.gate.admit()) is None:
            return _error(503, f"{self.gate.capacity} requests are already queued or running; retry shortly",
                          {"Retry-After": "1"})
        try:
            body, refused = await self._receive(request, ticket)
            if refused is not None:
                return refused
            debug = request.query_params.get("debug", "0").lower() in ("1", "true", "yes")
            result = None
            with self.stopper.waiting():
                try:
                    t_inf = time.perf_counter()
                    result = await anyio.to_thread.run_sync(self.svc.process, body, debug, ext, limiter=self.limiter)
                    self.metrics.infer_hist.observe(time.perf_counter() - t_inf)
                except (ImageDecodeError, PreprocessError) as exc:
                    return _error(400, str(exc))
                except Exception:
                    log.exception("processing a frame failed")
                    return _error(500, "internal error while processing the frame")
            if result is None:  # shutdown cancelled the wait for an inference slot
                return _error(503, "the service is shutting down", {"Retry-After": "1"})
        finally:
            self.gate.release(ticket)
        dec = result.decoded
        self.metrics.grasps.labels("grasp" if dec.grasp is not None else "none").inc()
        answer = dec.to_dict()
        answer["latency_ms"] = round(1000.0 * (time.perf_counter() - t0), 3)
        answer = {k: answer[k] for k in ("grasp", "pixel", "latency_ms", "reason")}
        if self.svc.recording is not None:
            answer["attempt_id"] = result.attempt_id  # null: no grasp, or not recorded (the cap)
        if debug:
            png = await anyio.to_thread.run_sync(
                lambda: encode_image(draw_decoded(result.rgb, dec, self.svc.calib), "png"), limiter=self.limiter)
            return Response(png, media_type="image/png",
                            headers={"X-Grasp-Result": json.dumps(answer, separators=(",", ":"))})
        return Response(json.dumps(answer), media_type="application/json")

    async def _receive(self, request: Request, ticket: _Ticket) -> tuple[bytes | None, Response | None]:
        """The frame's bytes, read within the body timeout; or, instead, the answer that refuses
        it (disconnected, evicted from a full queue, shutting down, too slow, too large)."""
        with ticket.scope, self.stopper.waiting() as stop_scope, \
                anyio.move_on_after(self.limits.body_timeout_s) as body_scope:
            try:
                body, size = await _read_body(request, self.max_body_bytes, ticket)
            except ClientDisconnect:
                return None, _error(400, "client disconnected before sending the whole body")
        ticket.uploading = False
        if ticket.evicted:
            return None, _error(503, "the queue is full and this body was the slowest to arrive; retry shortly",
                                {"Retry-After": "1"}, close=True)
        if stop_scope.cancelled_caught:
            return None, _error(503, "the service is shutting down", {"Retry-After": "1"}, close=True)
        if body_scope.cancelled_caught:
            return None, _error(408, f"the body did not arrive within {self.limits.body_timeout_s:g} s", close=True)
        if body is None:
            return None, _error(413, f"body of {size}+ bytes is over the limit of {self.max_body_bytes}")
        return body, None

    async def outcome(self, request: Request):
        answer = await self._outcome(request)
        self.metrics.outcomes.labels(str(answer.status_code)).inc()
        return answer

    async def _outcome(self, request: Request) -> Response:
        # As for frames: everything that can be refused is refused before the body is read.
        if (denied := self.auth_error(request)) is not None:
            return denied
        if self.svc.recording is None:
            return _error(409, "this service is not recording: start it with record_dir=DIR")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return _error(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_OUTCOME_BYTES):
            return _error(413 if declared.isdigit() else 400,
                          f"an outcome body is at most {MAX_OUTCOME_BYTES} bytes, got {declared}")
        with anyio.move_on_after(self.limits.body_timeout_s) as body_scope:
            try:
                body, size = await _read_body(request, MAX_OUTCOME_BYTES)
            except ClientDisconnect:
                return _error(400, "client disconnected before sending the whole body")
        if body_scope.cancelled_caught:
            return _error(408, f"the body did not arrive within {self.limits.body_timeout_s:g} s", close=True)
        if body is None:
            return _error(413, f"an outcome body is at most {MAX_OUTCOME_BYTES} bytes")
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        except RecursionError:  # arrays nested ~1000 deep fit in the 4 KB cap and overflow the parser
            return _error(400, "the body is not JSON an outcome can be: nested too deeply")
        if not isinstance(obj, dict):
            return _error(422, 'the body must be an object {"attempt_id": "...", "success": true|false}')
        attempt_id = obj.get("attempt_id")
        if not isinstance(attempt_id, str) or not attempt_id:
            return _error(422, "attempt_id must be a non-empty string (the one /v1/grasp answered)")
        try:
            outcome = parse_outcome(obj, self.svc.calib.table_z)
        except OutcomeError as exc:
            return _error(422, str(exc))
        try:
            known = await anyio.to_thread.run_sync(self.svc.record_outcome, attempt_id, outcome)
        except OSError as exc:
            log.error("writing an outcome failed: %s", exc)
            return _error(503, "the outcome could not be written; retry", {"Retry-After": "1"})
        if not known:
            return _error(404, f"no attempt {attempt_id!r} in this recording")
        return JSONResponse({"recorded": True})


# ------------------------------------------------------------------------ CLI
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    """``sim2real-serve artifact=DIR calibration=FILE host=127.0.0.1 port=8000 token=null``."""
    prog = "sim2real-serve"
    cfg = compose_config("serve", list(sys.argv[1:] if argv is None else argv), prog, __doc__ or "")
    setup_logging(cfg.log_level)
    if not cfg.artifact:
        raise CliError(prog, "artifact=DIR is required (the folder with policy.onnx and metadata.json)")
    token = None if cfg.token in (None, "") else str(cfg.token)
    try:
        port = config_number(cfg, "port", int, lo=0, hi=65535)
        max_body_mb = config_number(cfg, "max_body_mb", float, lo=0, lo_open=True)
        max_concurrency = config_number(cfg, "max_concurrency", int, lo=1)
        limits = ServerLimits.from_config(cfg.limits)
        check_open_files(limits)
        app = create_app(
            artifact_dir=str(cfg.artifact),
            calibration=None if cfg.calibration in (None, "") else str(cfg.calibration),
            token=token,
            max_body_bytes=int(max_body_mb * 1024 * 1024),
            quality_threshold=cfg.quality_threshold,
            workspace_margin=config_number(cfg, "workspace_margin", float, lo=0),
            intra_op_num_threads=cfg.threads,
            max_concurrency=max_concurrency,
            repeats=dict(cfg.repeats),
            limits=limits,
            record_dir=None if cfg.record_dir in (None, "") else str(cfg.record_dir),
            record_max_attempts=config_number(cfg, "record_max_attempts", int, lo=1),
            online=bool(cfg.online),
            online_options=dict(cfg.online_options or {}),
            precision=str(cfg.precision),
        )
    except (ArtifactError, CalibrationError, ValueError, OSError) as exc:
        raise CliError(prog, f"not starting: {exc}") from exc
    host = str(cfg.host)
    if not _is_loopback(host) and token is None:
        log.warning("binding %s without a token: anyone on the network can ask for grasps", host)
    server = make_server(app, host, port, limits, log_level=str(cfg.log_level), access_log=bool(cfg.access_log))
    log.info("serving %s on http://%s:%d (token %s)", cfg.artifact, host, port, "required" if token else "off")
    server.run()
    if getattr(server, "started", True) is False:
        raise CliError(prog, f"could not start the server on {host}:{port}")
    log.info("stopped")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
