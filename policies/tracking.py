"""Experiment tracking of the policy trainer and the pipeline: CSV, Weights & Biases or nothing.

* :func:`policy_logger`: the Lightning logger of :func:`policies.train.train_policy`, from the
  ``logger`` group (``conf/logger/{csv,wandb,none}.yaml``): CSV in ``OUTPUT/logs/metrics.csv``
  (the default), W&B, or none.
* :func:`pipeline_run`: one W&B run around a whole ``sim2real-pipeline`` when ``logger=wandb``.
  The trainers of its stages join that run (and leave it open); the report goes into it: the
  resolved config, the evaluation as a ``wandb.Table``, the success plot and the image panels
  as ``wandb.Image``, and the success rates in the run summary (what a W&B sweep optimises).

W&B runs are offline unless the config (``logger.mode``) or ``WANDB_MODE`` says otherwise. The
run id is the one in ``WANDB_RUN_ID`` when set (a ``wandb agent`` sets it for each sweep run, so
the run is the sweep's), else a new one; a policy run resumed in the same ``output_dir`` keeps
its id. Every function here is a no-op for csv/none, and only rank 0 writes (DDP).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from sim_render.api import to_plain

__all__ = ["LOGGERS", "logger_name", "TrainLogger", "policy_logger", "wandb_run_id", "active_wandb_run", "PipelineRun",
           "pipeline_run", "eval_summary"]

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


def _rank_zero() -> bool:
    from pytorch_lightning.utilities.rank_zero import rank_zero_only

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
        from pytorch_lightning.loggers import WandbLogger

        if not isinstance(self.logger, WandbLogger) or not _rank_zero():
            return
        run = active_wandb_run()
        if run is None or run is self.outer_run:
            return
        if self.id_file is not None:
            from perception.core.atomic import atomic_write_text

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
        from pytorch_lightning.loggers import CSVLogger

        return TrainLogger(CSVLogger(str(out), name="logs", version=""))
    from pytorch_lightning.loggers import WandbLogger

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


# ----------------------------------------------------------------------------- the pipeline
def eval_summary(evaluation: Mapping) -> dict[str, float]:
    """Scalar results of an evaluation (``policies.evaluate.evaluate_domains``) for a run summary.

    ``eval/success_rate`` (the policy's successes / attempts over all domains: the metric of
    ``conf/sweeps/policy.yaml``), ``eval/clearance`` (mean over domains), and per domain and
    bracket ``eval/<name>/success_rate`` and ``eval/<name>/clearance``.
    """
    out: dict[str, float] = {}
    succ = att = 0
    clear = []
    for dom, r in (evaluation.get("policy") or {}).items():
        out[f"eval/{dom}/success_rate"] = float(r["rate"])
        out[f"eval/{dom}/clearance"] = float(r["clearance"])
        succ += int(r["successes"])
        att += int(r["attempts"])
        clear.append(float(r["clearance"]))
    if evaluation.get("policy"):
        out["eval/success_rate"] = succ / att if att else 0.0
        out["eval/clearance"] = sum(clear) / len(clear)
    for b, r in (evaluation.get("brackets") or {}).items():
        out[f"eval/{b}/success_rate"] = float(r["rate"])
        out[f"eval/{b}/clearance"] = float(r["clearance"])
    return out


class PipelineRun:
    """The pipeline's W&B run (``run=None``: tracking is off and every method does nothing)."""

    def __init__(self, run: Any = None) -> None:
        self.run = run

    def log_report(self, report: Mapping, output_dir: str | Path) -> dict[str, float]:
        """Log a pipeline report (``policies.pipeline.run_pipeline``) written into ``output_dir``.

        Returns:
            The scalars put in the run summary (empty when tracking is off).
        """
        if self.run is None:
            return {}
        import wandb

        from policies.report import eval_rows

        out = Path(output_dir)
        evaluation = report.get("evaluation") or {}
        columns = ["name", "domain", "successes", "attempts", "rate", "ci95_low", "ci95_high", "clearance"]
        data = [[r["name"], r["domain"], int(r["successes"]), int(r["attempts"]), float(r["rate"]),
                 float(r["rate_ci95"][0]), float(r["rate_ci95"][1]), float(r["clearance"])]
                for r in eval_rows(evaluation)]
        logged: dict[str, Any] = {"eval/table": wandb.Table(columns=columns, data=data)}
        captions = {"success": "grasp success per domain (Wilson 95% CI)",
                    "panels": "sim frames | network view | real frames, with the policy's grasps"}
        for key, name in (report.get("figures") or {}).items():
            if name and (out / name).is_file():
                logged[f"report/{key}"] = wandb.Image(str(out / name), caption=captions.get(key, key))
        summary = eval_summary(evaluation)
        for name, st in (report.get("stages") or {}).items():
            summary[f"stages/{name}/wall_s"] = float(st["wall_s"])
        distance = (report.get("adapt") or {}).get("distance") or {}
        for k in ("adapted_real", "sim_real", "ratio"):
            if distance.get(k) is not None:
                summary[f"adapt/swd_{k}"] = float(distance[k])
        if report.get("wall_s") is not None:
            summary["wall_s"] = float(report["wall_s"])
        self.run.log({**logged, **summary})
        self.run.summary.update(summary)
        return summary


@contextmanager
def pipeline_run(cfg: DictConfig) -> Iterator[PipelineRun]:
    """A W&B run around a pipeline when ``cfg.logger.name`` is ``wandb`` (else tracking is off).

    The run holds the resolved pipeline config, lives in ``output_dir/wandb``, and is
    finished on exit (marked failed when the pipeline raised).
    """
    lcfg = cfg.get("logger")
    if logger_name(lcfg, "csv") != "wandb" or not _rank_zero():
        yield PipelineRun(None)
        return
    import wandb

    lcfg = to_plain(lcfg) if not isinstance(lcfg, str) else {"name": "wandb"}
    out = Path(str(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=str(lcfg.get("project") or "sim2real-grasp"),
        name=lcfg.get("run_name"),
        tags=[str(t) for t in (lcfg.get("tags") or [])],
        mode=str(lcfg.get("mode") or "offline"),
        dir=str(out),
        id=wandb_run_id(),
        resume="allow",
        job_type="pipeline",
        config=to_plain(cfg),
    )
    try:
        yield PipelineRun(run)
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()
