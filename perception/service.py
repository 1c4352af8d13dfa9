"""The on-robot grasp service, ``sim2real-serve`` (shared/CONTRACT.md section 6).

``POST /v1/grasp`` takes the raw bytes of one PNG or JPEG frame from the calibrated
camera and answers the best grasp inside the workspace. ``GET /healthz`` tells whether
the model is loaded, ``GET /metrics`` gives Prometheus counters and latency histograms,
``GET /v1/info`` describes the loaded policy, and ``/docs`` / ``/openapi.json`` describe
the API.

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
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from perception.artifact import ArtifactError, PolicyRunner, check_calibration, load_metadata
from perception.calibration import Calibration, CalibrationError
from perception.decode import DecodedGrasp, decode_grasp, grasp_in_workspace
from perception.imageio import ImageDecodeError, decode_image, encode_image
from perception.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from perception.metrics import Counter, Gauge, Histogram, Registry, resident_memory_bytes
from perception.overlay import draw_decoded
from perception.preprocess import PreprocessError
from perception.repeats import RepeatGuard

__all__ = ["create_app", "GraspService", "main", "DEFAULT_MAX_BODY_BYTES"]

log = logging.getLogger("sim2real.serve")

DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
#: Bytes read and thrown away after the body limit is hit, so that the client can
#: read its 413 instead of a connection reset; past this the connection is dropped.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
ACCEPTED_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}
KNOWN_PATHS = {"/healthz", "/v1/grasp", "/v1/info", "/metrics", "/docs", "/openapi.json", "/redoc"}


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
        self.threads = intra_op_num_threads
        # None: every frame is answered on its own (the CLI turns the memory on: conf/repeats/default.yaml).
        self.repeats = RepeatGuard.build(self.calib, repeats)
        self.runner: PolicyRunner | None = None
        self.load_error: str | None = None

    def load(self) -> None:
        """Create the onnxruntime session (the slow part)."""
        try:
            self.runner = PolicyRunner(self.artifact_dir, self.calib, intra_op_num_threads=self.threads)
        except Exception as exc:
            self.load_error = str(exc)
            raise

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def process(self, body: bytes, keep_rgb: bool = False) -> _Result:
        """Bytes of one frame -> decoded grasp. Raises ImageDecodeError / PreprocessError."""
        assert self.runner is not None
        rgb = decode_image(body, expected_size=self.calib.image_size)
        avoid: dict = {}
        if self.repeats is not None:
            fingerprint, avoid = self.repeats.avoiding(rgb)
        maps = self.runner.infer(rgb)
        dec = decode_grasp(maps.quality, maps.width, maps.height, self.calib, self.runner.view,
                           self.threshold, self.margin, surface=maps.surface, **self.meta.decode, **avoid)
        if dec.grasp is not None and not grasp_in_workspace(dec.grasp, self.calib, self.margin):
            dec = DecodedGrasp(None, None, None, "grasp refused by the workspace safety check")
        if self.repeats is not None:
            self.repeats.answered(fingerprint, dec.grasp)
        return _Result(dec, rgb if keep_rgb else None)

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
            "ready": self.ready,
            "repeats": None if self.repeats is None else self.repeats.state(),
        }


def _error(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


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
            self.requests.inc(label, str(status["code"]))
            self.latency.observe(time.perf_counter() - t0, label)


async def _read_body(request: Request, limit: int) -> tuple[bytes | None, int]:
    """Read at most ``limit`` bytes; returns ``(None, n)`` when the body is larger."""
    chunks: list[bytes] = []
    size = 0
    over = False
    async for chunk in request.stream():
        size += len(chunk)
        if over:
            if size > DRAIN_LIMIT_BYTES:
                break
            continue
        if size > limit:
            over = True
            chunks = []
            continue
        chunks.append(chunk)
    return (None if over else b"".join(chunks)), size


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
) -> FastAPI:
    """Build the grasp service.

    Args:
        artifact_dir: the policy artifact (``policy.onnx`` + ``metadata.json``).
        calibration: the serving camera (wins over the artifact's); ``None``: the artifact's.
        token: bearer token required on ``/v1/grasp``; ``None`` or ``""``: no auth.
        max_body_bytes: larger bodies get ``413``.
        quality_threshold: ``None``: the artifact's.
        workspace_margin: metres the workspace is shrunk by for returned grasps.
        intra_op_num_threads: onnxruntime threads per inference.
        max_concurrency: inferences run at once in worker threads.
        background_load: create the onnxruntime session after start-up in a thread
            (``/healthz`` answers ``503`` until it is ready); by default it is created here.
        repeats: :func:`perception.repeats.repeat_options` keys: a grasp answered on a scene
            that has not moved around it since is not answered again
            (:class:`perception.repeats.RepeatGuard`); ``None`` or ``memory=0``: off, every
            frame answered on its own.

    Raises:
        ArtifactError, CalibrationError: a bad artifact, or a calibration whose
            ``image_size`` differs from the artifact's (the service must not start).
    """
    svc = GraspService(artifact_dir, calibration, quality_threshold, workspace_margin, intra_op_num_threads, repeats)
    for w in svc.warnings:
        log.warning("calibration drift from the trained camera: %s", w)
    if not background_load:
        svc.load()
    token = token or None
    limiter = anyio.CapacityLimiter(max(1, int(max_concurrency)))

    registry = Registry()
    requests = registry.add(Counter("sim2real_http_requests_total", "HTTP responses by path and status", ("path", "status")))
    latency = registry.add(Histogram("sim2real_http_request_duration_seconds", "HTTP request latency", ("path",)))
    infer_hist = registry.add(Histogram("sim2real_inference_duration_seconds", "decode + preprocess + forward + grasp decode"))
    grasps = registry.add(Counter("sim2real_grasp_answers_total", "200 answers by result", ("result",)))
    registry.add(Gauge("sim2real_model_ready", "1 once the model is loaded", fn=lambda: 1.0 if svc.ready else 0.0))
    registry.add(Gauge("sim2real_calibration_drift_warnings", "calibration differences from the trained camera",
                       fn=lambda: float(len(svc.warnings))))
    registry.add(Gauge("sim2real_repeats_remembered", "grasps not answered again: they just failed on the unchanged scene",
                       fn=lambda: float(svc.repeats.state()["remembered"]) if svc.repeats else 0.0))
    registry.add(Gauge("process_resident_memory_bytes", "resident memory of the service", fn=resident_memory_bytes))

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

    app = FastAPI(
        title="sim2real-grasp service",
        version="1",
        description=(
            "POST one raw PNG or JPEG frame from the calibrated camera to /v1/grasp; the answer is the best "
            "top-down grasp inside the workspace in the robot base frame (shared/CONTRACT.md section 6)."
        ),
        lifespan=lifespan,
    )
    app.state.service = svc
    app.state.registry = registry

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health}})
    async def healthz():
        if svc.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error" if svc.load_error else "loading"}, status_code=503)

    @app.get("/v1/info")
    async def info():
        return JSONResponse(svc.info())

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(registry.render(), media_type=METRICS_CONTENT_TYPE)

    body_doc = {"schema": {"type": "string", "format": "binary"}}

    @app.post(
        "/v1/grasp",
        response_model=GraspAnswer,
        responses={
            200: {"content": {"image/png": {}}, "description": "the grasp (or, with debug=1, the frame with it drawn "
                  "and the JSON answer in the X-Grasp-Result header)"},
            400: {"model": ErrorAnswer, "description": "undecodable image or a size other than image_size"},
            401: {"model": ErrorAnswer, "description": "token missing or wrong"},
            413: {"model": ErrorAnswer, "description": "body over the limit"},
            415: {"model": ErrorAnswer, "description": "not image/png or image/jpeg"},
            503: {"model": ErrorAnswer, "description": "model not loaded yet"},
        },
        openapi_extra={
            "requestBody": {"required": True, "content": {"image/png": body_doc, "image/jpeg": body_doc}},
            "parameters": [{"name": "debug", "in": "query", "required": False, "schema": {"type": "integer"},
                            "description": "1: answer the frame with the grasp drawn (PNG)"}],
        },
    )
    async def grasp(request: Request):
        t0 = time.perf_counter()
        error: tuple[int, str, dict | None] | None = None
        if token is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                error = (401, "missing or wrong token: send 'Authorization: Bearer TOKEN'",
                         {"WWW-Authenticate": "Bearer"})
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if error is None and ctype not in ACCEPTED_TYPES:
            error = (415, f"Content-Type must be image/png or image/jpeg, got {ctype or 'none'!r}", None)
        declared = request.headers.get("content-length")
        if error is None and declared is not None:
            try:
                if int(declared) > max_body_bytes:
                    error = (413, f"body of {int(declared)} bytes is over the limit of {max_body_bytes}", None)
            except ValueError:
                error = (400, "invalid Content-Length", None)
        try:
            body, size = await _read_body(request, max_body_bytes)
        except ClientDisconnect:
            return _error(400, "client disconnected before sending the whole body")
        if error is None and body is None:
            error = (413, f"body of {size}+ bytes is over the limit of {max_body_bytes}", None)
        if error is not None:
            return _error(*error)
        if not svc.ready:
            return _error(503, "the model is not loaded yet", {"Retry-After": "1"})
        debug = request.query_params.get("debug", "0").lower() in ("1", "true", "yes")
        try:
            t_inf = time.perf_counter()
            result = await anyio.to_thread.run_sync(svc.process, body, debug, limiter=limiter)
            infer_hist.observe(time.perf_counter() - t_inf)
        except (ImageDecodeError, PreprocessError) as exc:
            return _error(400, str(exc))
        except Exception:
            log.exception("processing a frame failed")
            return _error(500, "internal error while processing the frame")
        dec = result.decoded
        grasps.inc("grasp" if dec.grasp is not None else "none")
        answer = dec.to_dict()
        answer["latency_ms"] = round(1000.0 * (time.perf_counter() - t0), 3)
        answer = {k: answer[k] for k in ("grasp", "pixel", "latency_ms", "reason")}
        if debug:
            png = await anyio.to_thread.run_sync(
                lambda: encode_image(draw_decoded(result.rgb, dec, svc.calib), "png"), limiter=limiter)
            return Response(png, media_type="image/png",
                            headers={"X-Grasp-Result": json.dumps(answer, separators=(",", ":"))})
        return Response(json.dumps(answer), media_type="application/json")

    app.add_middleware(_MetricsMiddleware, requests=requests, latency=latency)
    return app


# ------------------------------------------------------------------------ CLI
class _Server:
    """uvicorn's server, ending with status 0 after SIGINT / SIGTERM (no re-raise)."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, h in original.items():
                        signal.signal(s, h)

            def handle_exit(self, sig, frame):
                if not self.should_exit:
                    log.info("received %s, shutting down", signal.Signals(sig).name)
                super().handle_exit(sig, frame)

        return Server(config)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    """``sim2real-serve artifact=DIR calibration=FILE host=127.0.0.1 port=8000 token=null``."""
    from perception.cli import CliError, compose_config, setup_logging

    prog = "sim2real-serve"
    cfg = compose_config("serve", list(sys.argv[1:] if argv is None else argv), prog, __doc__ or "")
    setup_logging(cfg.log_level)
    if not cfg.artifact:
        raise CliError(prog, "artifact=DIR is required (the folder with policy.onnx and metadata.json)")
    token = None if cfg.token in (None, "") else str(cfg.token)
    try:
        app = create_app(
            artifact_dir=str(cfg.artifact),
            calibration=None if cfg.calibration in (None, "") else str(cfg.calibration),
            token=token,
            max_body_bytes=int(float(cfg.max_body_mb) * 1024 * 1024),
            quality_threshold=cfg.quality_threshold,
            workspace_margin=float(cfg.workspace_margin),
            intra_op_num_threads=cfg.threads,
            max_concurrency=int(cfg.max_concurrency),
            repeats=dict(cfg.repeats),
        )
    except (ArtifactError, CalibrationError, ValueError) as exc:
        raise CliError(prog, f"not starting: {exc}") from exc
    host = str(cfg.host)
    if not _is_loopback(host) and token is None:
        log.warning("binding %s without a token: anyone on the network can ask for grasps", host)
    import uvicorn

    config = uvicorn.Config(app, host=host, port=int(cfg.port), log_level=str(cfg.log_level).lower(),
                            access_log=bool(cfg.access_log), timeout_graceful_shutdown=5, lifespan="on")
    server = _Server.make(config)
    log.info("serving %s on http://%s:%d (token %s)", cfg.artifact, host, int(cfg.port),
             "required" if token else "off")
    server.run()
    if getattr(server, "started", True) is False:
        raise CliError(prog, f"could not start the server on {host}:{cfg.port}")
    log.info("stopped")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
