"""A residual on the network's quality, learnt from outcomes as they arrive (``online=true``).

Torch-free and small on purpose: a table of additive shifts, one per (angle bin, quality
band). An outcome for a grasp of bin ``a`` answered with quality ``q`` moves the shift of
``(a, band(q))`` by ``lr * (success - (q + shift))``, a step of logistic-regression-like
recalibration on the band, and the shift is clipped to ``[-bound, bound]``. At decode time
the shift is added to the quality of the grasps at or above the threshold only
(:func:`perception.core.decode.decode_grasp`'s ``rerank``): it re-ranks what the network
proposes, and never makes a grasp out of one the network put below its threshold. The
answered quality stays the network's.

The table is saved beside the recording (``online.json``, written atomically after each
outcome) and read back at start, so a restart keeps what the cell taught it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from perception.core.jsonio import write_json

__all__ = ["DEFAULT_ONLINE", "OnlineResidual"]

#: The settings' defaults (``conf/serve.yaml`` ``online_options`` overrides them).
DEFAULT_ONLINE: dict[str, float] = {
    "bands": 5,     # quality bands of width 1 / bands
    "lr": 0.1,      # step per outcome
    "bound": 0.2,   # the largest shift, in quality units
}
ONLINE_FILE = "online.json"


class OnlineResidual:
    """Shifts per (angle bin, quality band), updated per outcome, saved in ``folder``."""

    def __init__(self, folder: str | Path, angle_bins: int, options: dict | None = None) -> None:
        o = {**DEFAULT_ONLINE, **{k: v for k, v in dict(options or {}).items() if v is not None}}
        unknown = set(o) - set(DEFAULT_ONLINE)
        if unknown:
            raise ValueError(f"unknown online_options {sorted(unknown)}; known: {sorted(DEFAULT_ONLINE)}")
        self.bands, self.lr, self.bound = int(o["bands"]), float(o["lr"]), float(o["bound"])
        if self.bands < 1 or not 0 < self.lr <= 1 or not 0 <= self.bound <= 1:
            raise ValueError(f"online_options: bands >= 1, lr in (0, 1], bound in [0, 1]; got {o}")
        self.path = Path(folder) / ONLINE_FILE
        self.shift = np.zeros((int(angle_bins), self.bands))
        self.updates = 0
        self._lock = threading.Lock()
        if self.path.is_file():
            saved = json.loads(self.path.read_text())
            table = np.asarray(saved.get("shift"), dtype=np.float64)
            if table.shape == self.shift.shape:
                self.shift = np.clip(table, -self.bound, self.bound)
                self.updates = int(saved.get("updates", 0))

    def band(self, q: np.ndarray | float) -> np.ndarray:
        return np.clip((np.asarray(q, dtype=np.float64) * self.bands).astype(int), 0, self.bands - 1)

    def rerank(self, quality: np.ndarray) -> np.ndarray:
        """``(A, H, W)`` shifts for the quality maps (``decode_grasp(rerank=...)``)."""
        q = np.nan_to_num(np.asarray(quality, dtype=np.float64), nan=0.0, posinf=1.0, neginf=0.0)
        with self._lock:
            table = self.shift.copy()
        return table[np.arange(q.shape[0])[:, None, None], self.band(q)]

    def update(self, angle_bin: int, quality: float, success: bool) -> float:
        """One outcome; returns the new shift of its cell (saved before returning)."""
        a, b = int(angle_bin), int(self.band(float(quality)))
        with self._lock:
            p = float(np.clip(quality + self.shift[a, b], 0.0, 1.0))
            self.shift[a, b] = float(np.clip(self.shift[a, b] + self.lr * (float(success) - p),
                                             -self.bound, self.bound))
            self.updates += 1
            state = {"shift": self.shift.tolist(), "updates": self.updates,
                     "options": {"bands": self.bands, "lr": self.lr, "bound": self.bound}}
            write_json(self.path, state, indent=None)
            return float(self.shift[a, b])
