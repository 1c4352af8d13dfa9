"""The trainers' loggers (the policy's and the geometry network's): CSV, Weights & Biases or nothing.

:func:`policy_logger` is the Lightning logger of :func:`policies.train.train_policy`, from the
``logger`` group (``conf/logger/{csv,wandb,none}.yaml``): CSV in ``OUTPUT/logs/metrics.csv``
(the default), W&B, or none. Inside a pipeline with ``logger=wandb`` a trainer joins the
pipeline's run (:mod:`policies.pipeline.run`) and leaves it open.

W&B runs are offline unless the config (``logger.mode``) or ``WANDB_MODE`` says otherwise. The
run id is the one in ``WANDB_RUN_ID`` when set (a ``wandb agent`` sets it for each sweep run, so
the run is the sweep's), else a new one; a policy run resumed in the same ``output_dir`` keeps
its id. Every function here is a no-op for csv/none, and only rank 0 writes (DDP).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from conf import to_plain
from perception.core.atomic import atomic_write_text

__all__ = ["LOGGERS", "logger_name", "TrainLogger", "policy_logger", "wandb_run_id", "active_wandb_run", "rank_zero"]

#: The logger group's choices (``conf/logger/*.yaml``).
LOGGERS = ("csv", "none", "wandb")

#: Where a policy run keeps its W&B run id, so that ``ckpt_path=...`` continues the same W&B run.
RUN_ID_FILE = ".wandb_run_id"



def logger_name(lcfg: Any, default: str = "csv") -> str:
    """The name (csv | wandb | none) of a ``logger`` node or bare name; ``default`` for ``None``."""
    if lcfg is None:
        return default
    name = str(lcfg) if isinstance(lcfg, str) else str(lcfg.get("name", default))
    if name not in LOGGERS:
        raise KeyError(f"unknown logger '{name}'; known loggers: {list(LOGGERS)}")
    return name


def wandb_run_id(default: str | None = None) -> str:
    """``WANDB_RUN_ID`` (set by a W&B sweep agent) if set, else ``default``, else a new id."""
    return os.environ.get("WANDB_RUN_ID") or default or secrets.token_hex(4)


def active_wandb_run() -> Any:
    """The W&B run open in this process (a pipeline's, which a trainer joins), or ``None``."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


def rank_zero() -> bool:
    """Whether this process is DDP's rank 0 (the one that writes)."""
    from pytorch_lightning.utilities.rank_zero import rank_zero_only  # lazy: lightning (pipeline fast path)

    return getattr(rank_zero_only, "rank", 0) == 0


@dataclass
class TrainLogger:
    """A trainer's logger and the W&B run that was open before it (joined, never finished)."""

    logger: Any
    outer_run: Any = None
    id_file: Path | None = None

    def finish(self, failed: bool = False) -> None:
        """Finish the W&B run this trainer started (not a pipeline's it joined), after noting
        its id in ``output_dir`` for a resume. Call it on every rank (only rank 0 acts)."""
        from pytorch_lightning.loggers import WandbLogger  # lazy: lightning (pipeline fast path)

        if not isinstance(self.logger, WandbLogger) or not rank_zero():
            return
        run = active_wandb_run()
        if run is None or run is self.outer_run:
            return
        if self.id_file is not None:
            atomic_write_text(self.id_file, f"{run.id}\n")
        run.finish(exit_code=1 if failed else 0)


def policy_logger(
    lcfg: Mapping | DictConfig | str | None,
    output_dir: str | Path,
    config: Mapping | None = None,
    resume: str | Path | None = None,
) -> TrainLogger:
    """The policy trainer's logger.

    Args:
        lcfg: the ``logger`` node (``name``: csv | wandb | none, and for wandb ``project``,
            ``mode``, ``run_name``, ``tags``), a bare name, or ``None`` (csv, as before the
            logger group existed).
        output_dir: the run's folder: ``logs/metrics.csv`` (csv), ``wandb/`` (wandb).
        config: the resolved run config, stored in the W&B run.
        resume: the checkpoint the run resumes from: the W&B run id saved in
            ``output_dir`` is reused.

    Returns:
        A :class:`TrainLogger`; its ``logger`` is what ``pl.Trainer(logger=...)`` takes.
    """
    name = logger_name(lcfg, "csv")
    out = Path(output_dir)
    if name == "none":
        return TrainLogger(False)
    if name == "csv":
        from pytorch_lightning.loggers import CSVLogger  # lazy: lightning (pipeline fast path)

        return TrainLogger(CSVLogger(str(out), name="logs", version=""))
    from pytorch_lightning.loggers import WandbLogger  # lazy: lightning (pipeline fast path)

    lcfg = to_plain(lcfg) if not isinstance(lcfg, str) else {"name": "wandb"}
    id_file = out / RUN_ID_FILE
    saved = id_file.read_text().strip() if resume and id_file.is_file() else None
    run_id = wandb_run_id(saved)
    logger = WandbLogger(
        project=str(lcfg.get("project") or "sim2real-grasp"),
        name=lcfg.get("run_name"),
        save_dir=str(out),
        id=run_id,
        resume="allow",
        mode=str(lcfg.get("mode") or "offline"),
        tags=[str(t) for t in (lcfg.get("tags") or [])],
        job_type="policy",
        config=dict(config) if config is not None else None,
    )
    return TrainLogger(logger, active_wandb_run(), id_file)
