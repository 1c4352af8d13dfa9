"""``sim2real-capture``: collect real camera frames for adaptation (docs/robot_cell.md section 4).

    sim2real-capture camera=SPEC out_dir=DIR n=200 interval=1.0 trigger=time|key calibration=FILE

Frames are written to ``out_dir/frames/`` (pass ``real_dir=out_dir/frames`` to the
pipeline), spaced ``interval`` seconds apart or one per Enter key (``trigger=key``), each
no older than ``max_age``. ``out_dir/summary.json`` lists them with their brightness and
sharpness, and ``out_dir/contact_sheet.png`` shows them at a glance. With a
``calibration``, frames of another size stop the capture with a clear message.
SIGINT / SIGTERM end it early, keeping what was captured.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np

from perception.core.calibration import Calibration, CalibrationError
from perception.core.cli import CliError, compose_config, setup_logging
from perception.core.imageio import write_image
from perception.core.jsonio import write_json
from perception.core.overlay import contact_sheet
from perception.robot.cameras import CameraError, StaleFrameError, ThreadedCamera, open_camera

__all__ = ["capture_frames", "frame_stats", "main"]

log = logging.getLogger("sim2real.capture")

#: Width of the contact sheet thumbnails, pixels.
THUMB_W = 160


def frame_stats(rgb: np.ndarray) -> dict:
    """Mean brightness (0-255) and sharpness (variance of the Laplacian) of a frame."""
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    return {"brightness": round(float(gray.mean()), 2),
            "sharpness": round(float(cv2.Laplacian(gray, cv2.CV_64F).var()), 2)}


def capture_frames(
    camera: ThreadedCamera,
    out_dir: str | Path,
    n: int,
    interval: float = 1.0,
    max_age: float = 0.5,
    expected_size: tuple[int, int] | None = None,
    fmt: str = "png",
    trigger=None,
    stop: threading.Event | None = None,
    frame_timeout: float = 10.0,
    sheet_columns: int = 10,
    sheet_max: int = 100,
) -> dict:
    """Capture ``n`` frames from a started camera into ``out_dir``; returns the summary.

    Args:
        trigger: ``None`` for timed capture, or a callable that blocks until the next frame
            is wanted and returns ``False`` to stop (key-triggered capture).

    Raises:
        CameraError: frames of a size other than ``expected_size``, or no fresh frame
            within ``frame_timeout``.
    """
    out = Path(out_dir)
    frames_dir = out / "frames"
    frames_dir.mkdir(parents=True, exist_ok=True)
    start_index = len(list(frames_dir.glob("frame_*.*")))
    stop = stop or threading.Event()
    records, thumbs = [], []
    t_start = time.time()
    next_due = time.monotonic()
    size = None
    summary_box: list[dict] = []
    try:
        for k in range(int(n)):
            if stop.is_set():
                break
            if trigger is not None:
                if not trigger():
                    break
            else:
                delay = next_due - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    break
                next_due = max(next_due + interval, time.monotonic())
            try:
                frame = camera.read(max_age=max_age, timeout=frame_timeout, fresh=True)
            except StaleFrameError as exc:
                raise CameraError(f"capture stopped after {len(records)} frames: {exc}") from exc
            h, w = frame.image.shape[:2]
            if expected_size is not None and (w, h) != tuple(expected_size):
                raise CameraError(
                    f"the camera delivers {w}x{h} frames but the calibration's image_size is "
                    f"{expected_size[0]}x{expected_size[1]}: set the camera to its calibrated resolution"
                )
            size = (w, h)
            name = f"frame_{start_index + k:05d}.{fmt}"
            write_image(frames_dir / name, frame.image)
            rec = {"file": f"frames/{name}", "time": time.time(), "age_s": round(frame.age(), 4), **frame_stats(frame.image)}
            records.append(rec)
            thumbs.append(cv2.resize(frame.image, (THUMB_W, max(1, h * THUMB_W // w)), interpolation=cv2.INTER_AREA))
            log.info("frame %d/%d: %s", k + 1, n, name)
    finally:
        # Contact sheet: up to sheet_max frames spread evenly over the capture.
        if thumbs:
            idx = np.unique(np.linspace(0, len(thumbs) - 1, min(sheet_max, len(thumbs))).round().astype(int))
            sheet = contact_sheet([thumbs[i] for i in idx], columns=sheet_columns, thumb_width=THUMB_W)
            write_image(out / "contact_sheet.png", sheet)
        summary = {
            "n": len(records),
            "requested": int(n),
            "camera": camera.camera.name,
            "image_size": None if size is None else list(size),
            "started": t_start,
            "duration_s": round(time.time() - t_start, 2),
            "frames_dir": str(frames_dir),
            "brightness_mean": round(float(np.mean([r["brightness"] for r in records])), 2) if records else None,
            "frames": records,
            "camera_status": camera.status(),
        }
        write_json(out / "summary.json", summary, indent=2)
        summary_box.append(summary)
    return summary_box[0]


def _key_trigger() -> bool:
    print("press Enter to capture a frame (q + Enter to stop): ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return bool(line) and line.strip().lower() not in ("q", "quit", "exit")


def main(argv: list[str] | None = None) -> int:
    """``sim2real-capture camera=SPEC out_dir=DIR n=N``."""

    prog = "sim2real-capture"
    cfg = compose_config("capture", list(sys.argv[1:] if argv is None else argv), prog, __doc__ or "")
    setup_logging(cfg.log_level)
    if cfg.camera is None:
        raise CliError(prog, "camera=SPEC is required (a device index, /dev/videoN, a video file, a folder, ...)")
    if str(cfg.trigger) not in ("time", "key"):
        raise CliError(prog, f"trigger must be time or key, got {cfg.trigger!r}")
    if str(cfg.format) not in ("png", "jpg"):
        raise CliError(prog, f"format must be png or jpg, got {cfg.format!r}")
    try:
        expected = Calibration.load(cfg.calibration).image_size if cfg.calibration else None
        kw = {"fps": float(cfg.camera_fps)} if cfg.camera_fps else {}
        cam = open_camera(cfg.camera, **kw)
    except (CalibrationError, CameraError) as exc:
        raise CliError(prog, str(exc)) from exc
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    threaded = ThreadedCamera(cam, max_age=float(cfg.max_age)).start()
    try:
        summary = capture_frames(
            threaded, cfg.out_dir, int(cfg.n), interval=float(cfg.interval), max_age=float(cfg.max_age),
            expected_size=expected, fmt=str(cfg.format), trigger=_key_trigger if cfg.trigger == "key" else None,
            stop=stop, sheet_columns=int(cfg.sheet_columns), sheet_max=int(cfg.sheet_max),
        )
    except CameraError as exc:
        raise CliError(prog, str(exc)) from exc
    finally:
        threaded.close()
        for s, h in previous.items():
            signal.signal(s, h)
    print(f"captured {summary['n']} frames ({summary['image_size']}) into {summary['frames_dir']}; "
          f"contact sheet {Path(cfg.out_dir) / 'contact_sheet.png'}; use real_dir={summary['frames_dir']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
