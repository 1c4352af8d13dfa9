"""Training progress without a terminal: a line every few percent of the run.

Lightning's bar redraws every step; in a log file each redraw is kept (and a new bar
starts for every epoch and every validation), which is what filled a ``budget=small``
pipeline's log. :func:`trainer_progress` keeps the bar when a person watches a terminal
and swaps it for :class:`StepProgress` otherwise (:mod:`perception.core.progress` does the
same for the project's own loops). It lives here, in the lowest package that trains,
so the adaptation's and the policy's trainers share it.
"""

from __future__ import annotations

import logging
import math
import time

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Timer

from perception.core.progress import interactive, line_every_percent, next_threshold

__all__ = ["StepProgress", "trainer_progress"]

log = logging.getLogger("sim2real.progress")


class StepProgress(pl.Callback):
    """Logs ``name: step k/N (p%), the bar's metrics, seconds`` each time training crosses another
    ``every`` percent, and once when it ends.

    How far along a run is: its steps out of the steps it may take (``max_steps``, or the
    epochs' batches), or its time out of ``max_time``, whichever is further. The budgets'
    trainers stop on time with ``max_steps`` far out of reach (``budget=small``: 100000
    steps, 360 s), so counted by steps alone they would say nothing until the end.
    """

    def __init__(self, name: str, every: float | None = None) -> None:
        self.name = name
        self.every = line_every_percent() if every is None else float(every)
        self.total, self.next, self.t0 = 0, float("inf"), time.monotonic()
        self.timer: Timer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = trainer.estimated_stepping_batches  # max_steps, or max_epochs' batches; inf when neither
        self.total = int(steps) if math.isfinite(steps) and steps > 0 else 0
        # Lightning adds a Timer callback for max_time; its clock is the one that stops the run.
        self.timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        self.t0 = time.monotonic()
        self.next = next_threshold(100.0 * self._done(trainer), 100.0, self.every) / 100.0

    def _budget_s(self) -> float | None:
        left = self.timer.time_remaining() if self.timer is not None else None
        return None if left is None else self.timer.time_elapsed() + left

    def _done(self, trainer: pl.Trainer) -> float:
        """The share of the run done, 0..1 (by steps or by time, the larger)."""
        done = trainer.global_step / self.total if self.total else 0.0
        budget = self._budget_s()
        if budget:
            done = max(done, self.timer.time_elapsed() / budget)
        return min(done, 1.0)

    def _metrics(self, trainer: pl.Trainer) -> str:
        """What Lightning's bar shows after it: the metrics logged with ``prog_bar=True``
        (the translator's ``g``, ``d``, ``val/swd``; the policy's ``train/loss``, ``val/loss``)."""
        return ", ".join(f"{k} {float(v):.4g}" for k, v in sorted(trainer.progress_bar_metrics.items()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        done = self._done(trainer)
        if done >= self.next and done < 1.0 and trainer.is_global_zero:  # the end has its own line
            budget = self._budget_s()
            by_time = bool(budget) and (not self.total or done > trainer.global_step / self.total)
            of = f" of {budget:.0f} s" if by_time else ""
            shown = self._metrics(trainer)
            log.info("%s: step %d%s (%.0f%%%s)%s, %.0f s", self.name, trainer.global_step,
                     f"/{self.total}" if self.total and not by_time else "", 100.0 * done, of,
                     f", {shown}" if shown else "",
                     time.monotonic() - self.t0)
            self.next = next_threshold(100.0 * done, 100.0, self.every) / 100.0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            shown = self._metrics(trainer)
            log.info("%s: training ended at step %d%s%s, %.0f s", self.name, int(trainer.global_step),
                     f"/{self.total}" if self.total else "", f", {shown}" if shown else "", time.monotonic() - self.t0)


def trainer_progress(name: str, wanted: bool = True) -> tuple[bool, list[pl.Callback]]:
    """``(enable_progress_bar, callbacks)`` for a ``pl.Trainer``: Lightning's bar when
    ``wanted`` and stderr is a terminal; :class:`StepProgress` lines when ``wanted`` and
    it is not; nothing when not ``wanted``."""
    if not wanted:
        return False, []
    if interactive():
        return True, []
    return False, [StepProgress(name)]
