"""The pipeline's W&B run: one run around a whole ``sim2real-pipeline`` when ``logger=wandb``.

The trainers of its stages join that run (and leave it open, :mod:`policies.loggers`); the
report goes into it: the resolved config, the evaluation as a ``wandb.Table``, the success plot
and the image panels as ``wandb.Image``, and the success rates in the run summary (what a W&B
sweep optimises). Offline unless ``logger.mode`` or ``WANDB_MODE`` says otherwise; the run id
is ``WANDB_RUN_ID`` when a sweep agent sets it. Every function here is a no-op for csv/none,
and only rank 0 writes (DDP).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from conf import to_plain
from policies.loggers import logger_name, rank_zero, wandb_run_id
from policies.pipeline.report import eval_rows

__all__ = ["PipelineRun", "pipeline_run", "eval_summary"]


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
        """Log a pipeline report (``policies.pipeline.flow.run_pipeline``) written into ``output_dir``.

        Returns:
            The scalars put in the run summary (empty when tracking is off).
        """
        if self.run is None:
            return {}
        import wandb  # lazy: wandb (only with the wandb logger)

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
    if logger_name(lcfg, "csv") != "wandb" or not rank_zero():
        yield PipelineRun(None)
        return
    import wandb  # lazy: wandb (only with the wandb logger)

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
