"""The HTTP server under ``sim2real-serve``: uvicorn with limits a robot network needs.

uvicorn alone keeps a connection that sends nothing open for ever, accepts connections
until the process runs out of file descriptors (and then logs every failed ``accept``),
and answers ``500`` to a request it cancels at shutdown. This module bounds each of
those, so that a slow, idle or hostile client can never starve a normal frame:

- **header timeout**: a connection gets ``header_timeout_s`` from its opening (or from
  its previous answer) to a request's complete headers, else ``408`` and closed;
- **connection limit**: beyond ``max_connections`` the connection idle the longest is
  closed to make room; when none is idle the new one is answered ``503`` and closed at
  once. The limit is checked against the open-file limit at start (:func:`check_open_files`);
- **rate-limited accept errors**: asyncio's "socket.accept() out of system resource" is
  logged once per :data:`ACCEPT_LOG_INTERVAL_S` with the count suppressed;
- **shutdown**: :class:`Stopper` cancels what waits (bodies, the inference queue), so
  those requests get ``503``; what runs finishes, within ``shutdown_timeout_s``.

The body timeout and the inference queue are the app's (``perception.robot.service``), set
from the same :class:`ServerLimits`. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields

import anyio
import h11

__all__ = ["AcceptLogFilter", "ServerLimits", "ServerStats", "Stopper", "check_open_files", "install_accept_log_filter",
           "make_server", "ACCEPT_LOG_INTERVAL_S"]

log = logging.getLogger("sim2real.serve")

#: Seconds between two logged "socket.accept() out of system resource" errors.
ACCEPT_LOG_INTERVAL_S = 10.0
#: File descriptors kept for the service's own use (model, logs, pipes, libraries).
RESERVED_FDS = 32


@dataclass(frozen=True)
class ServerLimits:
    """Limits of the service's HTTP side (``conf/serve.yaml``, ``limits:``; units in the names)."""

    header_timeout_s: float = 10.0   # from a connection's opening (or its last answer) to complete headers
    body_timeout_s: float = 10.0     # to receive one request's whole body
    max_connections: int = 64        # open connections; beyond: 503 and closed
    backlog: int = 64                # connections the kernel queues (and asyncio accepts at once)
    max_queue: int = 8               # /v1/grasp requests waiting for an inference slot; beyond: 503
    evict_after_s: float = 0.5       # an upload admitted this long ago may give its place to a newcomer
    max_jpeg_scans: int = 32         # progressive JPEG scans counted before decoding; more: 400
    shutdown_timeout_s: float = 4.0  # SIGTERM: how long running requests may take to finish

    @classmethod
    def from_config(cls, cfg: Mapping | None) -> ServerLimits:
        """Build from a config mapping (``null`` values keep the defaults) and validate.

        Raises:
            ValueError: an unknown key or a value out of range, naming ``limits.<key>``.
        """
        cfg = dict(cfg or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(cfg) - set(known))
        if unknown:
            raise ValueError(f"unknown limits key(s) {unknown}; known: {sorted(known)}")
        kwargs = {}
        for key, value in cfg.items():
            if value is None:
                continue
            want = known[key].type
            try:
                num = float(value)
                if want == "int":
                    if not num.is_integer():
                        raise ValueError
                    num = int(num)
            except (TypeError, ValueError):
                raise ValueError(f"limits.{key} must be a {'whole ' if want == 'int' else ''}number, "
                                 f"got {value!r}") from None
            kwargs[key] = num
        out = cls(**kwargs)
        out.validate()
        return out

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"limits.{f.name} must be > 0, got {v}")
        if self.header_timeout_s > 60 or self.body_timeout_s > 60:
            raise ValueError("limits.header_timeout_s and limits.body_timeout_s must be at most 60 s: "
                             "a longer wait lets idle clients hold the service's connections")
        if self.shutdown_timeout_s > 30:
            raise ValueError(f"limits.shutdown_timeout_s must be at most 30 s, got {self.shutdown_timeout_s}")


class ServerStats:
    """Counters the protocol layer keeps for ``/metrics`` (thread-safe enough: ints under the GIL)."""

    def __init__(self) -> None:
        self.open_connections = 0
        self.refused_connections = 0
        self.evicted_connections = 0
        self.header_timeouts = 0
        self.accept_errors = 0


class Stopper:
    """Shutdown for the app: a flag, and the cancel scopes of what waits, cancelled at once.

    ``begin()`` may be called from a signal handler; the scopes are cancelled on the event
    loop's thread.
    """

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._scopes: set[anyio.CancelScope] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def waiting(self):
        """A cancel scope that shutdown cancels; ``scope.cancelled_caught`` tells the caller."""
        self._loop = asyncio.get_running_loop()
        scope = anyio.CancelScope()
        if self.stopping.is_set():
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)

    def begin(self) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def cancel_all() -> None:
            for s in list(self._scopes):
                s.cancel()

        try:
            loop.call_soon_threadsafe(cancel_all)
        except RuntimeError:  # the loop already stopped
            pass


# ------------------------------------------------------------ open files
def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def check_open_files(limits: ServerLimits) -> int:
    """Make sure ``max_connections`` (plus what is accepted at once) fits the open-file limit.

    Raises the soft limit towards the hard one when needed.

    Returns:
        The open-file soft limit in force.

    Raises:
        ValueError: the limit cannot hold the connections (names ``limits.max_connections``).
    """
    need = _open_fds() + RESERVED_FDS + int(limits.max_connections) + int(limits.backlog)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, need)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < need:
        raise ValueError(
            f"limits.max_connections={limits.max_connections} with limits.backlog={limits.backlog} needs about "
            f"{need} open files (the service's own {need - limits.max_connections - limits.backlog} included), "
            f"above the open-file limit {soft} (hard {hard}): lower them or raise `ulimit -n`")
    return int(soft)


# --------------------------------------------------- accept error logging
class AcceptLogFilter(logging.Filter):
    """Lets one "socket.accept() out of system resource" record through per interval."""

    def __init__(self, stats: ServerStats | None, interval_s: float = ACCEPT_LOG_INTERVAL_S) -> None:
        super().__init__()
        self.stats, self.interval_s = stats, interval_s
        self._last = -math.inf
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        if self.stats is not None:
            self.stats.accept_errors += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return False
        self._last = now
        exc = record.exc_info[1] if record.exc_info else None
        record.msg = (f"socket.accept() out of system resource ({exc}); {self._suppressed} more in the last "
                      f"{self.interval_s:.0f} s not logged: too many open connections for the open-file limit")
        record.args, record.exc_info, record.exc_text = (), None, None
        self._suppressed = 0
        return True


_ACCEPT_FILTER = AcceptLogFilter(None)


def install_accept_log_filter(stats: ServerStats | None = None) -> logging.Filter:
    """Rate-limit asyncio's accept errors (one filter per process; ``stats`` counts them all)."""
    _ACCEPT_FILTER.stats = stats
    logger = logging.getLogger("asyncio")
    if _ACCEPT_FILTER not in logger.filters:
        logger.addFilter(_ACCEPT_FILTER)
    return _ACCEPT_FILTER


# ---------------------------------------------------------------- protocol
def _raw_response(status: int, reason: str, detail: str, retry_after: bool = False) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _guarded_protocol(limits: ServerLimits, stats: ServerStats):
    """uvicorn's h11 protocol with the header timeout and the connection limit."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # lazy: uvicorn (only when serving)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            self._opened = time.monotonic()
            super().connection_made(transport)
            stats.open_connections += 1
            if len(self.connections) > limits.max_connections and not self._evict_idle():
                stats.refused_connections += 1
                with contextlib.suppress(Exception):
                    transport.write(_raw_response(503, "Service Unavailable",
                                                  f"too many open connections (limit {limits.max_connections})",
                                                  retry_after=True))
                transport.close()
                return
            self._arm()

        def _evict_idle(self) -> bool:
            """At the limit, the connection idle the longest makes room: a client that holds
            connections without using them cannot lock out one that sends a frame."""
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                    and not c._in_request() and not c.transport.is_closing()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._opened)
            stats.evicted_connections += 1
            oldest._timed_out(evicted=True)
            return True

        def connection_lost(self, exc) -> None:
            self._disarm()
            stats.open_connections -= 1
            super().connection_lost(exc)

        # Between requests (after opening, after an answer, while a body the app did not
        # read is drained) the client has header_timeout_s; inside a request the app's
        # body timeout applies.
        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(limits.header_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self, evicted: bool = False) -> None:
            self._disarm()
            if self.transport.is_closing() or self._in_request():
                return
            if not evicted:
                stats.header_timeouts += 1
            if self.conn.our_state is h11.IDLE:
                with contextlib.suppress(Exception):
                    self.transport.write(_raw_response(408, "Request Timeout", "connection closed: " + (
                        "the service needed it for another client" if evicted
                        else f"no complete request within {limits.header_timeout_s:g} s")))
            self.transport.close()
            # The connections set is what the limit counts: a closed one leaves it now, not
            # when the event loop gets round to connection_lost.
            self.connections.discard(self)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()
            elif not self.transport.is_closing():
                self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_request():  # a pipelined request already started
                self._disarm()
            elif not self.transport.is_closing():
                self._arm()

    return GuardedH11Protocol


# ------------------------------------------------------------------ server
def make_server(app, host: str, port: int, limits: ServerLimits, log_level: str = "info",
                access_log: bool = False, stopper: Stopper | None = None, stats: ServerStats | None = None,
                handle_signals: bool = True):
    """A uvicorn server for ``app`` under ``limits``.

    SIGINT / SIGTERM (``handle_signals``) begin the ``stopper``'s shutdown and end the
    server with status 0 within ``limits.shutdown_timeout_s`` (plus the model's last
    inferences, which are bounded).
    """
    import uvicorn  # lazy: uvicorn (only when serving)

    stats = stats or getattr(app.state, "server_stats", None) or ServerStats()
    stopper = stopper or getattr(app.state, "stopper", None) or Stopper()
    install_accept_log_filter(stats)
    config = uvicorn.Config(app, host=host, port=int(port), log_level=str(log_level).lower(), access_log=access_log,
                            http=_guarded_protocol(limits, stats), backlog=int(limits.backlog),
                            timeout_graceful_shutdown=float(limits.shutdown_timeout_s), lifespan="on")

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if not handle_signals or threading.current_thread() is not threading.main_thread():
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
            stopper.begin()
            super().handle_exit(sig, frame)

        def stop(self) -> None:
            """Shut down from another thread (tests, embedding)."""
            stopper.begin()
            self.should_exit = True

    return Server(config)
