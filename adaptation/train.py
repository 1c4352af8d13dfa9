"""``sim2real-adapt``: train the sim->real translation.

    sim2real-adapt sim_dir=DIR real_dir=DIR output_dir=DIR [calibration=FILE]
                   [adaptation=cyclegan|cyclegan_resnet9|none] [logger=wandb|csv|none]
                   [trainer=default|cpu|ddp] [max_steps=N] [max_time=SECONDS] [ckpt_path=last]

Writes into ``output_dir``: ``checkpoints/{last,best}.ckpt`` (weights + resolved config),
``generator.pt`` + ``generator.json`` (the EMA generator of the best validation distance, for
:mod:`adaptation.translate`), ``panels/*.png``, ``config.yaml`` and ``report.json``.
:func:`train` is the same run as a function, for the pipeline.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
import time
import zipfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, WandbLogger

from adaptation.data import AdaptDataModule, SimDataError
from adaptation.images import RealFramesError
from adaptation.module import CycleGANModule
from adaptation.progress import trainer_progress
from perception.core.atomic import atomic_write_text
from perception.core.calibration import Calibration, CalibrationError, calibration_path
from perception.core.cli import run_hydra_command
from perception.core.jsonio import write_json

__all__ = ["main", "train", "compose_config", "resolve_ckpt_path", "build_logger", "REPORT_NAME"]

log = logging.getLogger(__name__)

REPORT_NAME = "report.json"


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The ``sim2real-adapt`` config (``conf/adapt.yaml``) with Hydra overrides, for in-process use."""

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="adapt", overrides=list(overrides))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="adapt", overrides=list(overrides))


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    """``None`` -> fresh start; ``"last"`` -> ``output_dir/checkpoints/last.ckpt`` (fresh, with a
    warning, when there is none yet); anything else must be an existing file."""
    if ckpt_path in (None, "", "null"):
        return None
    if str(ckpt_path) == "last":
        p = output_dir / "checkpoints" / "last.ckpt"
        if not p.is_file():
            log.warning("ckpt_path=last but %s does not exist: starting a fresh run", p)
            return None
        path = p
    else:
        path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path {path} does not exist; use ckpt_path=last to resume the run in output_dir")
    # A checkpoint is a zip archive: one cut short by a kill or a full disk is refused here,
    # with its name, instead of a traceback from deep inside torch.load.
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(f"ckpt_path {path} is not a readable checkpoint ({exc}): it was probably cut short; "
                         "resume from an earlier one in checkpoints/ or start fresh (ckpt_path=null)") from None
    if bad is not None:
        raise ValueError(f"ckpt_path {path} is damaged (entry {bad}); resume from an earlier checkpoint")
    return str(path)


def _checkpoint_extra(ckpt: str) -> dict[str, Any]:
    try:
        data = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as exc:  # resume still works, only the W&B run id is new
        log.warning("could not read the run id from %s: %s", ckpt, exc)
        return {}
    return data.get("adaptation") or {}


def build_logger(lcfg: DictConfig | None, output_dir: Path, run_id: str | None) -> Any:
    """The logger ``lcfg.name`` (wandb | csv | none) writing under ``output_dir``."""
    name = "none" if lcfg is None else str(lcfg.get("name", "none"))
    if name == "none":
        return False
    if name == "csv":
        return CSVLogger(save_dir=str(output_dir), name="csv")
    if name == "wandb":
        return WandbLogger(
            project=str(lcfg.get("project", "sim2real-grasp")),
            name=lcfg.get("run_name"),
            save_dir=str(output_dir),
            id=run_id,
            resume="allow",
            mode=str(lcfg.get("mode", "offline")),
            tags=list(lcfg.get("tags") or []),
        )
    raise KeyError(f"unknown logger '{name}'; known loggers: ['csv', 'none', 'wandb']")


def _new_run_id() -> str:
    """A new W&B run id; the one in ``WANDB_RUN_ID`` wins (a W&B sweep agent sets it per run)."""

    return os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)


def _require(cfg: DictConfig, key: str, hint: str) -> str:
    if OmegaConf.is_missing(cfg, key) or cfg.get(key) in (None, ""):
        raise ValueError(f"{key} is required: {hint}")
    return str(cfg.get(key))


def train(cfg: DictConfig | dict) -> dict[str, Any]:
    """Train the translation that ``cfg`` (``conf/adapt.yaml``) describes.

    Args:
        cfg: the composed config (see :func:`compose_config`).

    Returns:
        The report (also written to ``output_dir/report.json``): the best held-out distance of
        adapted frames to real ones beside raw sim's, the content scores, throughput and paths.
        ``{"adaptation": "none"}`` for ``adaptation=none``.
    """
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    a = cfg.adaptation
    if str(a.name) == "none":
        log.info("adaptation=none: nothing to train")
        return {"adaptation": "none"}
    sim_dir = _require(cfg, "sim_dir", "pass sim_dir=DIR, a dataset rendered by sim2real-render")
    real_dir = _require(cfg, "real_dir", "pass real_dir=DIR, a folder of frames from the calibrated camera")
    out = Path(str(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    calib_path = calibration_path(cfg.get("calibration"))
    calib = Calibration.load(calib_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    resolved["calibration"] = str(calib_path)
    pl.seed_everything(int(cfg.seed), workers=True)

    dm = AdaptDataModule(
        sim_dir=sim_dir, real_dir=real_dir, calibration=calib,
        image_size=a.image_size, crop=a.get("crop"), batch_size=int(a.batch_size),
        num_workers=int(cfg.get("num_workers", 0)), val_fraction=float(cfg.data.val_fraction),
        val_frames=int(cfg.data.val_frames), sim_val_frames=int(cfg.data.sim_val_frames),
        flip=bool(a.get("flip", True)), jitter=float(a.get("jitter", 0.0)), seed=int(cfg.seed),
        view=OmegaConf.to_container(a.view, resolve=True) if a.get("view") else None,
    )
    dm.setup("fit")  # read and check every frame now: bad inputs stop before any training starts
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), out)
    module = CycleGANModule(resolved, output_dir=str(out))
    outer_run = getattr(sys.modules.get("wandb"), "run", None)  # a caller's (the pipeline's): joined, kept open
    run_id = (_checkpoint_extra(ckpt).get("wandb_run_id") if ckpt else None) or getattr(outer_run, "id", None) or _new_run_id()
    module.run_id = run_id
    logger = build_logger(cfg.get("logger"), out, run_id)

    ckpt_cb = ModelCheckpoint(
        dirpath=str(out / "checkpoints"), filename="best", monitor="val/swd_adapted_real", mode="min",
        save_top_k=1, save_last=True, auto_insert_metric_name=False, enable_version_counter=False,
    )
    tkw = dict(OmegaConf.to_container(cfg.trainer, resolve=True))
    tkw["enable_progress_bar"], progress_cbs = trainer_progress("translator", bool(tkw.get("enable_progress_bar", True)))
    max_time = cfg.get("max_time")
    fast = bool(cfg.get("fast_dev_run", False))
    trainer = pl.Trainer(
        **tkw,
        max_steps=2 * int(cfg.max_steps),  # Lightning counts both optimizers' steps
        max_epochs=-1,
        max_time=timedelta(seconds=float(max_time)) if max_time else None,
        val_check_interval=int(cfg.val_every_n_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=int(cfg.get("log_every_n_steps", 10)),
        logger=logger,
        callbacks=[ckpt_cb, *progress_cbs],
        default_root_dir=str(out),
        fast_dev_run=fast,
    )
    if trainer.is_global_zero:
        atomic_write_text(out / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(resolved)))
    t0 = time.perf_counter()
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
        if (
            cfg.get("final_validation", True)
            and not fast
            and module._last_val_step != module.iteration
            and not trainer.interrupted
        ):
            trainer.validate(module, datamodule=dm, verbose=False)
        if not fast and not trainer.interrupted:
            _save_final(trainer, module, ckpt_cb, out)
        wall = time.perf_counter() - t0
        report = _report(module, dm, cfg, out, wall, ckpt_cb)
        if trainer.is_global_zero:
            write_json(out / REPORT_NAME, report, indent=2)
    finally:
        _finish_logger(logger, keep=outer_run)
    return report


def _finish_logger(logger: Any, keep: Any = None) -> None:
    """Close the W&B run, so that a later run in the same process starts its own; ``keep``, a
    run the caller opened before (the pipeline's, which this one joined), stays open."""

    if isinstance(logger, WandbLogger):
        import wandb  # lazy: wandb (only with the wandb logger)

        if wandb.run is not None and wandb.run is not keep:
            wandb.finish()


def _save_final(trainer: pl.Trainer, module: CycleGANModule, ckpt_cb: Any, out: Path) -> None:
    """Checkpoints of the run's end: ModelCheckpoint saves only after in-loop validations,
    so ``last.ckpt`` is rewritten at the final step, and ``best.ckpt`` too when the final
    validation was the best. Every process calls this (the strategy writes on rank 0)."""
    d = out / "checkpoints"
    if module.best.get("step") == module.iteration and "swd_adapted_real" in module.best:
        best = d / "best.ckpt"
        ckpt_cb.best_model_path = str(best)
        ckpt_cb.best_model_score = torch.tensor(float(module.best["swd_adapted_real"]))
        ckpt_cb.best_k_models = {str(best): ckpt_cb.best_model_score}
        ckpt_cb.kth_best_model_path = str(best)
        ckpt_cb.kth_value = ckpt_cb.best_model_score
        trainer.save_checkpoint(best, weights_only=False)
    last = d / "last.ckpt"
    ckpt_cb.last_model_path = str(last)
    trainer.save_checkpoint(last, weights_only=False)


def _report(module: CycleGANModule, dm: AdaptDataModule, cfg: DictConfig, out: Path, wall: float, ckpt_cb: Any) -> dict:
    best = dict(module.best)
    last = dict(getattr(module, "last_metrics", {}) or {})

    def pick(d: dict, k: str) -> float | None:
        v = d.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    gen = out / "generator.pt"
    return {
        "adaptation": str(cfg.adaptation.name),
        "generator_name": str(cfg.adaptation.generator.name),
        "distance": {
            "metric": "sliced Wasserstein distance of Laplacian-pyramid 7x7 patches, x1000, held-out real frames",
            "adapted_real": pick(best, "swd_adapted_real"),
            "sim_real": pick(best, "swd_sim_real"),
            "ratio": pick(best, "swd_ratio"),
            "adapted_real_last": pick(last, "swd_adapted_real"),
        },
        "content": {
            "metric": "probe segmentation (trained on raw sim) of adapted frames vs the sim labels",
            "object_iou": pick(best, "content_object_iou"),
            "instance_recall": pick(best, "content_instance_recall"),
            "mean_iou": pick(best, "content_mean_iou"),
            "sim_object_iou": pick(best, "content_sim_object_iou"),
            "sim_instance_recall": pick(best, "content_sim_instance_recall"),
        },
        "best_step": best.get("step"),
        "steps": module.iteration,
        "resumed_from_step": module.start_iteration,
        "train_images_per_s": module.throughput(),
        "wall_time_s": wall,
        "parameters": module.parameter_counts(),
        "data": dm.summary() if getattr(dm, "_ready", False) else {},
        "generator": str(gen) if gen.is_file() else None,
        "best_checkpoint": ckpt_cb.best_model_path or None,
        "last_checkpoint": str(out / "checkpoints" / "last.ckpt") if (out / "checkpoints" / "last.ckpt").is_file() else None,
        "wandb_run_id": module.run_id if str(cfg.logger.get("name", "none")) == "wandb" else None,
    }


def _run(cfg: DictConfig) -> None:
    report = train(cfg)
    if report.get("adaptation") == "none":
        print("sim2real-adapt: adaptation=none, nothing trained")
        return
    d, c = report["distance"], report["content"]
    print(
        f"sim2real-adapt: distance to real {d['adapted_real']} (raw sim {d['sim_real']}), "
        f"content object IoU {c['object_iou']} (raw sim {c['sim_object_iou']}); "
        f"wrote {Path(str(cfg.output_dir)) / REPORT_NAME}"
    )


def main() -> None:
    run_hydra_command("adapt", "sim2real-adapt", __doc__ or "", _run,
                      (CalibrationError, RealFramesError, SimDataError, FileNotFoundError, ValueError, KeyError),
                      writable_dirs=())


if __name__ == "__main__":
    main()
