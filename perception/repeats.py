"""Do not answer again a grasp that has just failed on an unchanged scene.

A robot that is answered the same grasp on the same scene fails the same way: a
deterministic policy on a frame that differs only by sensor noise gives the same answer,
and the robot is stuck. The service hears no outcome (``POST /v1/grasp`` is all contract
section 6 has), but the next frame tells it: when the scene around an answered grasp looks
as it did when the grasp was answered, the grasp lifted nothing from there (a success
removes the part it closed on, a push moves it), so it failed. Such a grasp is not answered
again (no grasp within ``radius`` and ``yaw_deg`` of it) for the next ``memory`` answers;
once the scene around it has changed beyond sensor noise it is forgotten and may be
answered again, since what was there has moved.

"Changed" is measured on a fingerprint of each frame: its grey levels averaged over
``block_px`` x ``block_px`` blocks (averaging divides the sensor's per-pixel noise by
``block_px``). The difference of two fingerprints, less its median (a global exposure
shift is not a change of the scene), is compared per block with the noise it shows itself
(1.4826 x its median absolute deviation: most of a frame does not change between two
attempts); a block changed when it differs by more than ``noise_sigmas`` of that and by
at least ``min_change`` grey levels. The scene around a grasp changed when at least
``min_blocks`` blocks changed within ``region`` metres of it (the reach of the open
gripper, projected through the calibration): a change elsewhere (another part lifted)
does not make the same failure succeed.

The memory is per service and assumes one robot sends the frames, each after executing
the previous answer. ``repeats.memory=0`` switches it off (every frame answered on its own).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from perception.calibration import Calibration
from perception.geometry import project_points
from perception.grasp import Grasp

__all__ = ["DEFAULT_REPEATS", "repeat_options", "frame_fingerprint", "changed_blocks", "RepeatGuard"]

#: The settings' defaults (``conf/serve.yaml: repeats`` overrides them; null keeps these).
DEFAULT_REPEATS: dict[str, float] = {
    "memory": 8,  # answers a grasp is remembered for; 0: off
    "radius": 0.01,  # m: no grasp centre this close (in x, y) to a remembered failure ...
    "yaw_deg": 15.0,  # ... turned less than this from it
    "region": 0.06,  # m around a grasp (the open gripper's reach plus the part it closes on) where a change forgets it
    "block_px": 8,  # raw pixels per fingerprint block side
    "noise_sigmas": 5.0,  # a block changed beyond this many noise deviations ...
    "min_change": 2.0,  # ... and by at least this many grey levels (8-bit)
    "min_blocks": 2,  # changed blocks near a grasp that forget it
}


def repeat_options(options: dict | None) -> dict:
    """Validated settings: :data:`DEFAULT_REPEATS` with the given non-null keys overriding."""
    given = {k: v for k, v in dict(options or {}).items() if v is not None}
    unknown = set(given) - set(DEFAULT_REPEATS)
    if unknown:
        raise ValueError(f"unknown repeats options {sorted(unknown)}; known: {sorted(DEFAULT_REPEATS)}")
    out = dict(DEFAULT_REPEATS)
    for k, v in given.items():
        try:
            out[k] = type(DEFAULT_REPEATS[k])(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"repeats.{k} must be a number, got {v!r}") from exc
    for k in ("memory", "min_blocks"):
        if out[k] < 0:
            raise ValueError(f"repeats.{k} must be >= 0, got {out[k]}")
    for k in ("radius", "yaw_deg", "region", "noise_sigmas", "min_change"):
        if not (math.isfinite(out[k]) and out[k] >= 0):
            raise ValueError(f"repeats.{k} must be a finite number >= 0, got {out[k]}")
    if out["block_px"] < 1:
        raise ValueError(f"repeats.block_px must be >= 1, got {out['block_px']}")
    return out


def frame_fingerprint(rgb: np.ndarray, block_px: int) -> np.ndarray:
    """``(H // b, W // b)`` float32 mean grey level of each ``b x b`` block of an RGB ``uint8`` frame."""
    img = np.asarray(rgb)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"a fingerprint needs an (H, W, 3) RGB frame, got shape {img.shape}")
    grey = cv2.cvtColor(np.ascontiguousarray(img, dtype=np.uint8), cv2.COLOR_RGB2GRAY).astype(np.float32)
    b = int(block_px)
    h, w = grey.shape[0] // b, grey.shape[1] // b
    return cv2.resize(grey[: h * b, : w * b], (w, h), interpolation=cv2.INTER_AREA)


def changed_blocks(before: np.ndarray, after: np.ndarray, noise_sigmas: float, min_change: float) -> np.ndarray:
    """``(h, w)`` bool: the blocks of two fingerprints that differ beyond the noise they show."""
    d = np.asarray(after, np.float32) - np.asarray(before, np.float32)
    d -= np.median(d)
    noise = 1.4826 * float(np.median(np.abs(d)))
    return np.abs(d) > max(float(noise_sigmas) * noise, float(min_change))


@dataclass
class _Answered:
    grasp: Grasp
    fingerprint: np.ndarray
    region: tuple[slice, slice]  # the fingerprint blocks within ``region`` of the grasp
    answer: int  # index of the answer that gave it


class RepeatGuard:
    """The grasps answered on the scenes that still look the same (see the module docstring).

    Args:
        calib: the serving calibration (to find a grasp's region in the frame).
        options: :func:`repeat_options` keys.

    Call :meth:`failed` with a frame's fingerprint before decoding it (the grasps to avoid)
    and :meth:`answered` with the answer after. Thread-safe.
    """

    def __init__(self, calib: Calibration, options: dict | None = None) -> None:
        self.calib = calib
        self.options = repeat_options(options)
        self._memory: deque[_Answered] = deque()
        self._answers = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return int(self.options["memory"]) > 0

    @property
    def decode_options(self) -> dict:
        """The :func:`perception.decode.decode_grasp` keywords that apply the avoidance."""
        return {"avoid_radius": float(self.options["radius"]), "avoid_yaw": math.radians(float(self.options["yaw_deg"]))}

    def fingerprint(self, rgb: np.ndarray) -> np.ndarray:
        return frame_fingerprint(rgb, int(self.options["block_px"]))

    def _region(self, grasp: Grasp, shape: tuple[int, int]) -> tuple[slice, slice]:
        r = float(self.options["region"])
        t = np.linspace(0.0, 2.0 * math.pi, 16, endpoint=False)
        x, y, z = grasp.position
        ring = np.stack([x + r * np.cos(t), y + r * np.sin(t), np.full_like(t, z)], axis=1)
        uv = project_points(np.vstack([ring, [[x, y, self.calib.table_z]]]), self.calib)
        b = float(self.options["block_px"])
        u0, v0 = np.floor(uv.min(axis=0) / b).astype(int)
        u1, v1 = np.ceil(uv.max(axis=0) / b).astype(int) + 1
        h, w = shape
        return slice(int(np.clip(v0, 0, h)), int(np.clip(v1, 0, h))), slice(int(np.clip(u0, 0, w)), int(np.clip(u1, 0, w)))

    def failed(self, fingerprint: np.ndarray) -> list[Grasp]:
        """The remembered grasps whose scene around them is unchanged in this frame.

        The others (changed around them, or answered ``memory`` answers ago) are forgotten.
        """
        if not self.enabled:
            return []
        o = self.options
        with self._lock:
            keep: deque[_Answered] = deque()
            for a in self._memory:
                if self._answers - a.answer >= int(o["memory"]) or a.fingerprint.shape != fingerprint.shape:
                    continue
                changed = changed_blocks(a.fingerprint, fingerprint, o["noise_sigmas"], o["min_change"])
                if int(changed[a.region].sum()) >= int(o["min_blocks"]):
                    continue
                keep.append(a)
            self._memory = keep
            return [a.grasp for a in keep]

    def answered(self, fingerprint: np.ndarray, grasp: Grasp | None) -> None:
        """Count an answer; remember its grasp (``None``: a null answer) with its frame."""
        if not self.enabled:
            return
        with self._lock:
            self._answers += 1
            if grasp is not None:
                self._memory.append(_Answered(grasp, fingerprint, self._region(grasp, fingerprint.shape), self._answers))

    def forget(self) -> None:
        with self._lock:
            self._memory.clear()

    def state(self) -> dict[str, Any]:
        """For ``/v1/info``: the settings and how many grasps are avoided now."""
        with self._lock:
            return {**self.options, "remembered": len(self._memory)}
