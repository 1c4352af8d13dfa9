"""Recordings of the cell's own attempts: what the loop and the service write, what fine-tuning reads.

A recording is a folder (docs/robot_cell.md section 7)::

    recording.json     format, version, the calibration (and its digest) and image size
    frames/            attempt_NNNNNN.png|jpg: the frame of each attempt, as the camera gave it
    attempts.jsonl     one JSON line per attempt: "id" (a string), "frame", "grasp", "pixel", ...
    outcomes.jsonl     one JSON line per reported outcome: {"attempt_id", "outcome", "time"}

``sim2real-grasp-loop out_dir=DIR`` writes an attempt's outcome into its line, as its robot
adapter reports it; ``sim2real-serve record_dir=DIR`` writes the attempt when it answers
and the outcome when ``POST /v1/outcome`` brings it. :func:`load_attempts` merges both: the
last outcome reported for an attempt wins.

Nothing is rewritten: lines are appended, flushed and fsynced under a lock, frames are
written atomically before their line, so a kill loses at most the line being written. A
torn last line (a kill mid-write) is cut off when the folder is opened again, so the next
line does not glue onto it. One process records into a folder at a time (an exclusive
lock on ``recording.json``'s sibling ``.lock``); ids continue after the highest one found in
the lines or in ``frames/``, so they stay unique across restarts.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import IO, Any

from perception.core.atomic import atomic_write_bytes
from perception.core.calibration import Calibration
from perception.core.imageio import write_image
from perception.core.jsonio import dumps_json, write_json
from perception.core.overlay import draw_decoded

__all__ = ["ATTEMPTS_FILE", "OUTCOMES_FILE", "FRAMES_DIR", "HEADER_FILE", "Recording", "RecordingError",
           "attempt_key", "load_attempts", "load_header"]

log = logging.getLogger("sim2real.recording")

RECORDING_FORMAT = "sim2real-recording"
RECORDING_VERSION = 1
HEADER_FILE = "recording.json"
ATTEMPTS_FILE = "attempts.jsonl"
OUTCOMES_FILE = "outcomes.jsonl"
FRAMES_DIR = "frames"
_FRAME_RE = re.compile(r"attempt_(\d+)\.")


class RecordingError(ValueError):
    """A folder that cannot be recorded into (another camera, another process holds it)."""


def attempt_key(number: int) -> str:
    """The string id of attempt ``number`` (what ``attempt_id`` carries on the wire)."""
    return f"{int(number):06d}"


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line without its newline (a kill mid-write), so appends start clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        keep = data.rfind(b"\n") + 1
        log.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
        fh.truncate(keep)


def _read_lines(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            log.warning("skipping a torn line in %s", path)
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def load_header(folder: str | Path) -> dict | None:
    """``recording.json`` of a recording (``None``: a folder from before it existed, or none)."""
    path = Path(folder) / HEADER_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_attempts(folder: str | Path) -> list[dict]:
    """The attempts of a recording in order, each with its latest ``outcome`` (or ``None``).

    ``id`` is a string (older loop recordings wrote numbers: they are read as strings too).
    """
    folder = Path(folder)
    attempts = _read_lines(folder / ATTEMPTS_FILE)
    for a in attempts:
        if "id" in a and not isinstance(a["id"], str):
            a["id"] = attempt_key(a["id"])
    by_id = {a.get("id"): a for a in attempts}
    for o in _read_lines(folder / OUTCOMES_FILE):
        a = by_id.get(o.get("attempt_id"))
        if a is not None:
            a["outcome"] = o.get("outcome")
    return attempts


class Recording:
    """Records attempts and outcomes into ``folder`` (see the module's docstring).

    Args:
        folder: the recording; created when absent.
        calib: the camera every frame comes from. A folder recorded with another
            calibration or image size is refused (``RecordingError``): fine-tuning needs one
            camera per recording. ``None``: not checked (and not written into the header).
        debug_images: also write ``debug/attempt_NNNNNN.jpg`` with the grasp drawn.
        max_attempts: the disk cap: past it :meth:`reserve` gives no number and nothing
            more is recorded (the caller keeps working). ``None``: no cap.
        source: who records (``loop``, ``serve``), in the header's list of sessions.
    """

    def __init__(self, folder: str | Path, calib: Calibration | None = None, debug_images: bool = False,
                 max_attempts: int | None = None, source: str = "loop") -> None:
        self.dir = Path(folder)
        (self.dir / FRAMES_DIR).mkdir(parents=True, exist_ok=True)
        self.debug_images = debug_images
        self.max_attempts = None if max_attempts is None else int(max_attempts)
        self._lock_fh: IO[str] = open(self.dir / ".lock", "a")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_fh.close()
            raise RecordingError(f"{self.dir} is being recorded into by another process") from None
        try:
            self._check_header(calib, source)
            for name in (ATTEMPTS_FILE, OUTCOMES_FILE):
                _cut_torn_tail(self.dir / name)
            attempts = load_attempts(self.dir)
            numbers = [int(a["id"]) for a in attempts if str(a.get("id", "")).isdigit()]
            numbers += [int(m.group(1)) for p in (self.dir / FRAMES_DIR).iterdir() if (m := _FRAME_RE.match(p.name))]
            self.next_id = max(numbers, default=0) + 1
            self.ids = {str(a["id"]) for a in attempts if "id" in a}
            self._fh = open(self.dir / ATTEMPTS_FILE, "a", encoding="utf-8")
            self._outcomes = open(self.dir / OUTCOMES_FILE, "a", encoding="utf-8")
        except BaseException:
            self._lock_fh.close()
            raise
        self._lock = threading.Lock()
        self._reserved = 0

    def _check_header(self, calib: Calibration | None, source: str) -> None:
        header = load_header(self.dir)
        if header is not None and calib is not None and header.get("calibration_digest") not in (None, calib.digest()):
            raise RecordingError(
                f"{self.dir} was recorded with another calibration ({header.get('calibration_digest')}, image size "
                f"{header.get('image_size')}) than this one ({calib.digest()}, {list(calib.image_size)}): record "
                "into a new folder")
        if header is None:
            header = {"format": RECORDING_FORMAT, "version": RECORDING_VERSION, "sessions": []}
            if calib is not None:
                header.update(calibration_digest=calib.digest(), image_size=list(calib.image_size),
                              calibration=calib.to_dict())
        header["sessions"] = [*header.get("sessions", []), {"source": source, "started": time.time()}]
        write_json(self.dir / HEADER_FILE, header)

    @property
    def count(self) -> int:
        return len(self.ids)

    def _take_id(self) -> int:  # under self._lock
        i = self.next_id
        self.next_id += 1
        return i

    def new_id(self) -> int:
        """The next attempt number (its string id: :func:`attempt_key`); the cap does not apply."""
        with self._lock:
            return self._take_id()

    def reserve(self) -> int | None:
        """The next attempt number, or ``None`` at the cap (concurrent callers never pass it);
        :meth:`release` it once recorded."""
        with self._lock:
            if self.max_attempts is not None and len(self.ids) + self._reserved >= self.max_attempts:
                return None
            self._reserved += 1
            return self._take_id()

    def _append(self, fh: IO[str], line: dict) -> None:
        with self._lock:
            if fh.closed:  # a request still running at shutdown: not recorded, not a crash
                raise OSError(f"the recording in {self.dir} is closed")
            fh.write(dumps_json(line, indent=None))
            fh.flush()
            os.fsync(fh.fileno())

    def record(self, attempt_id: int, frame, entry: dict, decoded=None, calib=None) -> dict:
        """The loop's attempt: ``frame.image`` (RGB) as PNG, then its line."""

        name = f"{FRAMES_DIR}/attempt_{int(attempt_id):06d}.png"
        write_image(self.dir / name, frame.image)
        if self.debug_images and decoded is not None and calib is not None:
            write_image(self.dir / "debug" / f"attempt_{int(attempt_id):06d}.jpg",
                        draw_decoded(frame.image, decoded, calib))
        return self._line(attempt_id, name, entry)

    def record_bytes(self, attempt_id: int, data: bytes, ext: str, entry: dict) -> dict:
        """The service's attempt: the frame's bytes exactly as sent (``ext``: png or jpg), then its line."""
        name = f"{FRAMES_DIR}/attempt_{int(attempt_id):06d}.{ext}"
        atomic_write_bytes(self.dir / name, data)
        return self._line(attempt_id, name, entry)

    def _line(self, attempt_id: int, frame_name: str, entry: dict) -> dict:
        key = attempt_key(attempt_id)
        line = {"id": key, "frame": frame_name, **entry}
        self._append(self._fh, line)
        with self._lock:
            self.ids.add(key)
        return line

    def release(self) -> None:
        """A :meth:`reserve` d number was recorded (or given up): it no longer counts as pending."""
        with self._lock:
            self._reserved = max(0, self._reserved - 1)

    def record_outcome(self, key: str, outcome: dict[str, Any]) -> bool:
        """Append ``outcome`` for attempt ``key``; ``False``: no such attempt here."""
        if key not in self.ids:
            return False
        self._append(self._outcomes, {"attempt_id": key, "outcome": outcome, "time": time.time()})
        return True

    def close(self) -> None:
        with self._lock:
            for fh in (self._fh, self._outcomes):
                if not fh.closed:
                    fh.close()
        if not self._lock_fh.closed:
            self._lock_fh.close()  # releases the flock
