"""Lightning's bar becomes a few log lines without a terminal (adaptation.progress), on a real Trainer."""

from __future__ import annotations

import datetime
import logging
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from adaptation.progress import StepProgress, trainer_progress
from perception.core.progress import line_every_percent


class _Tiny(pl.LightningModule):
    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.step_s = step_s

    def training_step(self, batch, _idx):
        time.sleep(self.step_s)  # a step that takes time, for a run that stops on its clock
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train/loss", loss, prog_bar=True)  # what the bar would show goes into the lines
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, caplog, module: _Tiny, **trainer_kw) -> list[str]:
    bar, callbacks = trainer_progress("tiny")  # pytest's stderr is not a terminal
    assert bar is False and isinstance(callbacks[0], StepProgress)
    data = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=4)  # 16 steps an epoch
    trainer = pl.Trainer(max_epochs=-1, enable_progress_bar=bar, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), accelerator="cpu", **trainer_kw)
    with caplog.at_level(logging.INFO, logger="sim2real.progress"):
        trainer.fit(module, data)
    return [r.getMessage() for r in caplog.records if r.name == "sim2real.progress"]


def test_a_fit_without_a_terminal_logs_a_line_every_few_percent(tmp_path, caplog):
    lines = _fit(tmp_path, caplog, _Tiny(), max_steps=200)
    every = line_every_percent()
    assert 100 / every / 2 <= len(lines) <= 100 / every + 1, lines
    assert lines[0].startswith(f"tiny: step {int(200 * every / 100)}/200 ({every:.0f}%)") and "train/loss" in lines[0]
    assert lines[-1].startswith("tiny: training ended at step 200/200")


def test_a_run_that_stops_on_its_time_budget_reports_the_share_of_its_time(tmp_path, caplog):
    """The budgets' trainers stop on max_time with max_steps out of reach (budget=small: 100000
    steps, 360 s): counted by steps alone, they logged nothing until the end."""
    lines = _fit(tmp_path, caplog, _Tiny(step_s=0.01), max_steps=100_000,
                 max_time=datetime.timedelta(seconds=2))
    assert 100 / line_every_percent() / 2 <= len(lines) <= 100 / line_every_percent() + 1, lines
    assert all(" of 2 s)" in line for line in lines[:-1]), lines
    assert lines[-1].startswith("tiny: training ended at step ")


def test_no_bar_asked_means_no_lines_either():
    assert trainer_progress("tiny", wanted=False) == (False, [])
