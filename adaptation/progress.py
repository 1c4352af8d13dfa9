"""Training progress without a terminal: a line every few percent of the steps.

Lightning's bar redraws every step; in a log file each redraw is kept (and a new bar
starts for every epoch and every validation), which is what filled a ``budget=small``
pipeline's log. :func:`trainer_progress` keeps the bar when a person watches a terminal
and swaps it for :class:`StepProgress` otherwise (:mod:`perception.core.progress` does the
same for the project's own loops). It lives here, in the lowest package that trains,
so the adaptation's and the policy's trainers share it.
"""

from __future__ import annotations

import logging
import time

import pytorch_lightning as pl

from perception.core.progress import LINE_EVERY_PERCENT, interactive

__all__ = ["StepProgress", "trainer_progress"]

log = logging.getLogger("sim2real.progress")


class StepProgress(pl.Callback):
    """Logs ``name: step k/N (p%), loss, seconds`` each time training crosses another
    ``every`` percent of its steps, and once when it ends."""

    def __init__(self, name: str, every: float = LINE_EVERY_PERCENT) -> None:
        self.name, self.every = name, float(every)
        self.total, self.next, self.t0 = 0, float("inf"), time.monotonic()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.total = int(trainer.max_steps) if trainer.max_steps and trainer.max_steps > 0 else 0
        self.t0 = time.monotonic()
        self.next = self._after(trainer.global_step)

    def _after(self, step: int) -> float:
        if self.total <= 0:
            return float("inf")
        size = self.total * self.every / 100.0
        return (int(step / size) + 1) * size

    def _loss(self, trainer: pl.Trainer) -> str:
        losses = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("loss") and v.numel() == 1}
        return ", ".join(f"{k} {v:.4g}" for k, v in sorted(losses.items())[:3])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step >= self.next and step < self.total and trainer.is_global_zero:
            loss = self._loss(trainer)
            log.info("%s: step %d/%d (%.0f%%)%s, %.0f s", self.name, step, self.total, 100.0 * step / self.total,
                     f", {loss}" if loss else "", time.monotonic() - self.t0)
            self.next = self._after(step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            loss = self._loss(trainer)
            log.info("%s: training ended at step %d%s%s, %.0f s", self.name, int(trainer.global_step),
                     f"/{self.total}" if self.total else "", f", {loss}" if loss else "", time.monotonic() - self.t0)


def trainer_progress(name: str, wanted: bool = True) -> tuple[bool, list[pl.Callback]]:
    """``(enable_progress_bar, callbacks)`` for a ``pl.Trainer``: Lightning's bar when
    ``wanted`` and stderr is a terminal; :class:`StepProgress` lines when ``wanted`` and
    it is not; nothing when not ``wanted``."""
    if not wanted:
        return False, []
    if interactive():
        return True, []
    return False, [StepProgress(name)]
