"""Do not answer again a grasp that has just failed on an unchanged scene.

A robot that is answered the same grasp on the same scene fails the same way: a
deterministic policy on a frame that differs only by sensor noise gives the same answer,
and the robot is stuck. The service hears no outcome (``POST /v1/grasp`` is all contract
section 6 has), but the next frame tells it: when the scene around an answered grasp has
not moved since the grasp was answered, the grasp lifted nothing from there (a success
removes the part it closed on), so it failed, and it would fail again. Such a grasp is not
answered again (no grasp within ``radius`` and ``yaw_deg`` of it) for the next ``memory``
answers; once what was around it has moved it is forgotten and may be answered again.

"Moved" is measured on a fingerprint of each frame: its grey levels averaged over
``block_px`` x ``block_px`` blocks (averaging divides the sensor's per-pixel noise by
``block_px``). The difference of two fingerprints, less its median (a global exposure
shift is not a change of the scene), is kept where it exceeds ``noise_sigmas`` times the
noise the difference shows itself (1.4826 x its median absolute deviation: most of a frame
does not change between two attempts). Within ``region`` metres of the grasp (the open
gripper's reach, projected through the calibration) that change, divided by the
brightness gradient the region had, is how far its content moved (to first order a shift
by ``s`` changes an image by ``s`` times its gradient along the shift, ``2/pi`` of its
magnitude on average over directions). A grasp is forgotten once what was around it moved
by ``radius`` or more, the distance that makes it another grasp: a nudge of a centimetre,
or a part lifted elsewhere, leaves the same failure in place; a part pushed away, lifted
from there, or dropped there, forgets it.

The memory is per service and assumes one robot sends the frames, each after executing
the previous answer. ``repeats.memory=0`` switches it off (every frame answered on its own).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

if TYPE_CHECKING:  # perception.core.decode reads DEFAULT_REPEATS from here
    from perception.core.decode import DecodeOptions

from perception.core.calibration import Calibration, project_points
from perception.core.grasp import Grasp

__all__ = ["DEFAULT_REPEATS", "repeat_options", "frame_fingerprint", "moved_blocks", "RepeatGuard"]

#: The settings' defaults, their one source (``conf/repeats/default.yaml`` overrides them; null keeps these).
DEFAULT_REPEATS: dict[str, float] = {
    "memory": 8,  # answers a grasp is remembered for; 0: off
    # Chosen in validation cells 0-1 (1, 3 and 5 cm), confirmed on cells 4-6: a grasp within 3 cm of
    # one that failed on an unchanged scene fails too at any yaw (docs/decode.md).
    "radius": 0.03,  # m: no grasp centre this close (in x, y) to a remembered failure, nor a scene moved less ...
    "yaw_deg": 90.0,  # ... turned by this much or less from it (90: at any yaw)
    "region": 0.06,  # m around a grasp (the open gripper's reach plus the part it closes on) whose motion counts
    "block_px": 8,  # raw pixels per fingerprint block side
    "noise_sigmas": 5.0,  # a difference of two frames below this many noise deviations is noise
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
    if out["memory"] < 0:
        raise ValueError(f"repeats.memory must be >= 0, got {out['memory']}")
    for k in ("radius", "yaw_deg", "region", "noise_sigmas"):
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


def moved_blocks(before: np.ndarray, after: np.ndarray, region: tuple[slice, slice], noise_sigmas: float) -> float:
    """How far, in blocks, the content of ``region`` moved between two fingerprints (see the module docstring).

    ``inf`` when something appeared where there was no gradient at all; 0 when nothing
    beyond noise changed.
    """
    d = np.asarray(after, np.float32) - np.asarray(before, np.float32)
    d -= np.median(d)
    noise = 1.4826 * float(np.median(np.abs(d)))
    excess = float(np.maximum(np.abs(d[region]) - float(noise_sigmas) * noise, 0.0).sum())
    if excess == 0.0:
        return 0.0
    patch = np.asarray(before, np.float32)[region]
    if min(patch.shape) < 2:
        return math.inf
    gy, gx = np.gradient(patch)
    gradient = (2.0 / math.pi) * float(np.hypot(gx, gy).sum())
    return excess / gradient if gradient > 0 else math.inf


@dataclass
class _Answered:
    grasp: Grasp
    fingerprint: np.ndarray
    region: tuple[slice, slice]  # the fingerprint blocks within ``region`` of the grasp
    blocks_per_m: float  # fingerprint blocks per metre there
    answer: int  # index of the answer that gave it
    tag: str | None = None  # the attempt's id, for a reported outcome


class RepeatGuard:
    """The answered grasps whose scene has not moved around them since (see the module docstring).

    Args:
        calib: the serving calibration (to find a grasp's region in the frame).
        options: :func:`repeat_options` keys.

    Call :meth:`avoiding` (or :meth:`failed` with a frame's fingerprint) before decoding a
    frame and :meth:`answered` with the answer after. Thread-safe.
    """

    def __init__(self, calib: Calibration, options: dict | None = None) -> None:
        self.calib = calib
        self.options = repeat_options(options)
        self._memory: deque[_Answered] = deque()
        self._answers = 0
        self._lock = threading.Lock()

    @classmethod
    def build(cls, calib: Calibration, options: dict | None) -> RepeatGuard | None:
        """The guard the options ask for; ``None`` when they are ``None`` or ``memory`` is 0 (off)."""
        if options is None:
            return None
        guard = cls(calib, options)
        return guard if guard.enabled else None

    def avoiding(self, rgb: np.ndarray) -> tuple[np.ndarray, list[Grasp]]:
        """A frame's fingerprint (for :meth:`answered`) and the grasps that failed on it: the
        ``avoid`` of :func:`perception.core.decode.decode_grasp` (with options from :meth:`avoidance`)."""
        fingerprint = self.fingerprint(rgb)
        return fingerprint, self.failed(fingerprint)

    @property
    def enabled(self) -> bool:
        return int(self.options["memory"]) > 0

    def avoidance(self, options: DecodeOptions) -> DecodeOptions:
        """``options`` with this guard's reach (``avoid_radius``, ``avoid_yaw``): what the decode
        of a frame's ``avoid`` list (:meth:`avoiding`) runs with."""
        return replace(options, avoid_radius=float(self.options["radius"]),
                       avoid_yaw=math.radians(float(self.options["yaw_deg"])))

    def fingerprint(self, rgb: np.ndarray) -> np.ndarray:
        return frame_fingerprint(rgb, int(self.options["block_px"]))

    def _region(self, grasp: Grasp, shape: tuple[int, int]) -> tuple[tuple[slice, slice], float]:
        """The fingerprint blocks within ``region`` metres of a grasp, and blocks per metre there."""
        r = float(self.options["region"])
        t = np.linspace(0.0, 2.0 * math.pi, 16, endpoint=False)
        x, y, z = grasp.position
        ring = np.stack([x + r * np.cos(t), y + r * np.sin(t), np.full_like(t, z)], axis=1)
        uv = project_points(np.vstack([ring, [[x, y, z]]]), self.calib) / float(self.options["block_px"])
        per_m = float(np.linalg.norm(uv[:-1] - uv[-1], axis=1).mean()) / r if r > 0 else 0.0
        u0, v0 = np.floor(uv.min(axis=0)).astype(int)
        u1, v1 = np.ceil(uv.max(axis=0)).astype(int) + 1
        h, w = shape
        region = (slice(int(np.clip(v0, 0, h)), int(np.clip(v1, 0, h))),
                  slice(int(np.clip(u0, 0, w)), int(np.clip(u1, 0, w))))
        return region, per_m

    def failed(self, fingerprint: np.ndarray) -> list[Grasp]:
        """The remembered grasps around which the scene has not moved by ``radius`` in this frame.

        The others (moved around them, or answered ``memory`` answers ago) are forgotten.
        """
        if not self.enabled:
            return []
        o = self.options
        with self._lock:
            keep: deque[_Answered] = deque()
            for a in self._memory:
                if self._answers - a.answer >= int(o["memory"]) or a.fingerprint.shape != fingerprint.shape:
                    continue
                moved = moved_blocks(a.fingerprint, fingerprint, a.region, o["noise_sigmas"])
                if moved >= float(o["radius"]) * a.blocks_per_m:
                    continue
                keep.append(a)
            self._memory = keep
            return [a.grasp for a in keep]

    def answered(self, fingerprint: np.ndarray, grasp: Grasp | None, tag: str | None = None) -> None:
        """Count an answer; remember its grasp (``None``: a null answer) with its frame.

        ``tag``: the attempt's id, so that :meth:`reported` can find it.
        """
        if not self.enabled:
            return
        with self._lock:
            self._answers += 1
            if grasp is not None:
                region, per_m = self._region(grasp, fingerprint.shape)
                self._memory.append(_Answered(grasp, fingerprint, region, per_m, self._answers, tag))

    def reported(self, tag: str, success: bool) -> None:
        """The robot's word on an answered grasp: a success is not avoided (the frame may not show
        the lift yet); a failure stays avoided until the scene around it moves, as it would."""
        if not success:
            return
        with self._lock:
            self._memory = deque(a for a in self._memory if a.tag != tag)

    def state(self) -> dict[str, Any]:
        """For ``/v1/info``: the settings and how many grasps are avoided now."""
        with self._lock:
            return {**self.options, "remembered": len(self._memory)}
