"""Lightning's bar becomes a few log lines without a terminal (adaptation.progress), on a real Trainer."""

from __future__ import annotations

import logging

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from adaptation.progress import StepProgress, trainer_progress
from perception.core.progress import LINE_EVERY_PERCENT


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, _idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_fit_without_a_terminal_logs_a_line_every_few_percent(tmp_path, caplog):
    bar, callbacks = trainer_progress("tiny")  # pytest's stderr is not a terminal
    assert bar is False and isinstance(callbacks[0], StepProgress)
    data = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=4)  # 16 steps an epoch
    trainer = pl.Trainer(max_steps=200, max_epochs=-1, enable_progress_bar=bar, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), accelerator="cpu")
    with caplog.at_level(logging.INFO, logger="sim2real.progress"):
        trainer.fit(_Tiny(), data)
    lines = [r.getMessage() for r in caplog.records if r.name == "sim2real.progress"]
    assert 5 <= len(lines) <= 100 // LINE_EVERY_PERCENT + 1, lines
    assert lines[0].startswith("tiny: step 20/200 (10%)") and "train/loss" in lines[0]
    assert lines[-1].startswith("tiny: training ended at step 200/200")


def test_no_bar_asked_means_no_lines_either():
    assert trainer_progress("tiny", wanted=False) == (False, [])
