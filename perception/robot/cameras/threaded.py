"""A background capture thread over any :class:`~perception.robot.cameras.base.Camera`.

It keeps only the newest frame with its capture time; :meth:`ThreadedCamera.read` can
demand a maximum frame age and refuses stale frames (:class:`StaleFrameError`), so a
grasp is never computed from an old picture. A camera that fails (unplugged, file gone,
driver error) is closed and reopened with exponential backoff; :meth:`close` stops the
thread and releases the device.
"""

from __future__ import annotations

import logging
import threading
import time

from perception.robot.cameras.base import Camera, EndOfStream, Frame, StaleFrameError

__all__ = ["ThreadedCamera"]

log = logging.getLogger(__name__)


class ThreadedCamera:
    """Capture continuously in a thread and serve the newest frame.

    Args:
        camera: the driver.
        max_age: default maximum age in seconds of a frame returned by :meth:`read`
            (``None``: any age).
        backoff_initial, backoff_max: seconds between reopen attempts (doubling).
        reopen_on_end: reopen finite sources at their end (loops a video file);
            otherwise the thread stops there and reads become stale.
    """

    def __init__(
        self,
        camera: Camera,
        max_age: float | None = 0.5,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        reopen_on_end: bool = True,
    ) -> None:
        self.camera = camera
        self.max_age = max_age
        self.backoff_initial = float(backoff_initial)
        self.backoff_max = float(backoff_max)
        self.reopen_on_end = reopen_on_end
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._frame: Frame | None = None
        self._seq = 0
        self._last_read_seq = 0
        self._thread: threading.Thread | None = None
        self.state = "stopped"
        self.last_error: str | None = None
        self.reconnects = 0
        self.frames = 0

    # ---------------------------------------------------------------- control
    def start(self) -> ThreadedCamera:
        if self._thread is not None:
            return self
        self._stop.clear()
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, name=f"capture-{self.camera.name}", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and release the camera (idempotent)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("capture thread of %s did not stop within %.1f s", self.camera.name, timeout)
        try:
            self.camera.close()
        except Exception:  # pragma: no cover - driver specific
            log.exception("closing %s failed", self.camera.name)
        self.state = "stopped"

    def __enter__(self) -> ThreadedCamera:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- thread
    def _wait(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _run(self) -> None:
        backoff = self.backoff_initial
        frames_since_open = 0
        while not self._stop.is_set():
            if not self.camera.is_open:
                try:
                    self.camera.open()
                    frames_since_open = 0
                    self.state = "running"
                    log.info("camera %s opened", self.camera.name)
                except Exception as exc:
                    self._failed(f"open failed: {exc}")
                    self._wait(backoff)
                    backoff = min(backoff * 2, self.backoff_max)
                    continue
            try:
                frame = self.camera.read()
            except EndOfStream as exc:
                self.camera.close()
                if not self.reopen_on_end:
                    self.state, self.last_error = "ended", str(exc)
                    break
                if frames_since_open == 0:  # an empty source: do not spin
                    self._failed(str(exc))
                    self._wait(backoff)
                    backoff = min(backoff * 2, self.backoff_max)
                continue
            except Exception as exc:
                self._failed(f"read failed: {exc}")
                try:
                    self.camera.close()
                except Exception:  # pragma: no cover
                    pass
                self._wait(backoff)
                backoff = min(backoff * 2, self.backoff_max)
                continue
            frames_since_open += 1
            backoff = self.backoff_initial
            self.state = "running"
            with self._cond:
                self._frame = frame
                self._seq += 1
                self.frames += 1
                self._cond.notify_all()

    def _failed(self, message: str) -> None:
        if self.state != "reconnecting":
            log.warning("camera %s lost: %s; reconnecting", self.camera.name, message)
        self.state = "reconnecting"
        self.last_error = message
        self.reconnects += 1

    # ------------------------------------------------------------------ reads
    def latest(self) -> Frame | None:
        """The newest frame whatever its age (``None`` before the first)."""
        with self._cond:
            return self._frame

    def read(
        self,
        max_age: float | None = -1.0,
        timeout: float | None = None,
        fresh: bool = False,
        after: float | None = None,
    ) -> Frame:
        """The newest frame, no older than ``max_age`` seconds.

        Args:
            max_age: limit in seconds; ``-1`` (default): the camera's ``max_age``;
                ``None``: no limit.
            timeout: how long to wait for a frame that satisfies the limit
                (default: ``max_age``, or 1 s without a limit).
            fresh: also demand a frame not returned by an earlier ``read``.
            after: also demand a frame captured at or after this :func:`time.monotonic`
                time (e.g. once the robot has left the view).

        Raises:
            StaleFrameError: no such frame within ``timeout``; the message says why
                (camera reconnecting, its last error, the newest frame's age).
        """
        limit = self.max_age if max_age == -1.0 else max_age
        wait = timeout if timeout is not None else (limit if limit is not None else 1.0)
        deadline = time.monotonic() + max(0.0, wait)
        with self._cond:
            while True:
                f = self._frame
                now = time.monotonic()
                if (
                    f is not None
                    and (limit is None or now - f.timestamp <= limit)
                    and (not fresh or self._seq > self._last_read_seq)
                    and (after is None or f.timestamp >= after)
                ):
                    self._last_read_seq = self._seq
                    return f
                remaining = deadline - now
                if remaining <= 0 or self._stop.is_set():
                    break
                self._cond.wait(min(remaining, 0.05))
        age = "no frame yet" if f is None else f"the newest frame is {now - f.timestamp:.2f} s old"
        lim = "" if limit is None else f" (limit {limit:.2f} s)"
        why = f"; camera {self.state}" + (f": {self.last_error}" if self.last_error and self.state != "running" else "")
        raise StaleFrameError(f"no fresh frame from {self.camera.name}: {age}{lim}{why}")

    def status(self) -> dict:
        f = self.latest()
        return {
            "camera": self.camera.name,
            "state": self.state,
            "frames": self.frames,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
            "newest_age_s": None if f is None else round(time.monotonic() - f.timestamp, 3),
        }
