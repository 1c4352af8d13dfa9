"""Training the grasp policy: :func:`train_policy` (in-process) and ``sim2real-train-policy``.

    sim2real-train-policy dataset_dirs=[DIR,...] output_dir=DIR [translator=GEN] [policy.max_steps=N]

Writes into ``output_dir``: ``policy.ckpt`` (weights + the resolved config in its
hyperparameters; ``GraspPolicyModule.load_from_checkpoint`` restores it), ``config.yaml``,
``checkpoints/last.ckpt`` (resume with ``ckpt_path=last``, as ``sim2real-adapt`` does), ``logs/version_N/metrics.csv``
(``train/...``, ``val/...``; one version per run, so a resumed run keeps the earlier log), ``artifact/`` (``policy.onnx`` + ``metadata.json``, see :mod:`policies.export`)
and ``train_summary.json`` (what :func:`train_policy` returns). With ``policy.keep_best_by`` (the
default) ``policy.ckpt`` and the artifact hold the weights with the lowest held-out metric, the
start weights (the base) among them; ``checkpoints/last.ckpt`` holds the last ones, to resume.
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import ConcatDataset, DataLoader, Dataset, WeightedRandomSampler

from adaptation.progress import trainer_progress
from adaptation.translate import Translator
from conf import policy_default
from conf.schema import Augment, section_problems
from perception.core.atomic import atomic_write_text
from perception.core.calibration import CalibrationError
from perception.core.cli import run_hydra_command
from perception.core.cliutil import arg_value, fail
from perception.core.decode import DecodeOptions, DecodeOptionsError
from perception.core.jsonio import write_json
from perception.core.rule import CHECK_OPTIONS
from policies.data import TranslateFn, make_policy_datasets
from policies.export import export_artifact
from policies.geometry import GEOMETRY_FORMAT
from policies.loggers import policy_logger
from policies.module import GraspPolicyModule
from policies.weights import base_digest, check_base_fits, load_base

if TYPE_CHECKING:
    import numpy as np

    from perception.core.calibration import Calibration
    from perception.core.geometry import NetworkView

__all__ = ["train_policy", "policy_config", "main"]

log = logging.getLogger(__name__)


def policy_config(cfg: DictConfig | dict) -> DictConfig:
    """The ``policy`` node of a ``train_policy`` config, or ``cfg`` itself when it is one."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    return cfg.policy if "policy" in cfg else cfg


def check_policy_config(pcfg: DictConfig | dict) -> None:
    """Refuse option combinations that would only fail after training (a clear message, early).

    Raises:
        ValueError: an unknown view kind, a decode rule or re-ranking check without a top-down
            view, or decode options :class:`perception.core.decode.DecodeOptions` refuses (both
            of them at once, a share outside [0, 1], ...).
    """
    pcfg = policy_config(pcfg)
    kind = str((pcfg.get("view") or policy_default("view"))["kind"])
    if kind not in ("table", "camera"):
        raise ValueError(f"policy.view.kind must be 'table' or 'camera', got {kind!r}")
    # A partial augment section is filled from conf/ (policies.data.augment_item).
    if pcfg.get("augment") is not None:
        if problems := section_problems(Augment, pcfg.augment, "policy.augment", partial=True):
            raise ValueError("; ".join(problems))
    if pcfg.get("base"):
        check_base_fits(load_base(pcfg.base), OmegaConf.to_container(pcfg, resolve=True)
                        if isinstance(pcfg, DictConfig) else dict(pcfg))
    if pcfg.get("geometry"):
        load_base(pcfg.geometry, GEOMETRY_FORMAT)  # present and readable, before any stage runs
        if kind != "table":
            raise ValueError("policy.geometry needs the top-down view (policy.view.kind=table): its surface is rebuilt onto it")
    decode = pcfg.get("decode") or {}
    if isinstance(decode, DictConfig):
        decode = OmegaConf.to_container(decode, resolve=True)
    # What the view must be for the options that are on (a camera view hears it first) ...
    for key in ("rule", "rule_first"):
        if decode.get(key) is not None and kind != "table":
            raise ValueError(f"policy.decode.{key} needs the top-down view (policy.view.kind=table); "
                             f"set policy.decode.{key}=null for a camera view")
    shares = [key for key in CHECK_OPTIONS if decode.get(key) is not None]  # the decode's re-ranking checks
    if shares and kind != "table":
        raise ValueError(f"policy.decode.{' and '.join(shares)} need the top-down view (policy.view.kind=table); "
                         f"set {' '.join(f'policy.decode.{k}=null' for k in shares)} for a camera view")
    # ... and the options themselves: the one check, the artifact's (perception/core/decode.py).
    threshold = pcfg.get("quality_threshold")
    try:
        DecodeOptions.from_dict(decode, threshold=0.5 if threshold is None else threshold)
    except DecodeOptionsError as exc:
        checks = [k for k in exc.keys if k != "rule"]
        hint = (f"; set {' '.join(f'policy.decode.{k}=null' for k in checks)} to use the rule"
                if "rule" in exc.keys and checks else "")
        raise ValueError(exc.located("policy.decode") + hint) from exc
    except ValueError as exc:  # the threshold: the artifact's quality_threshold
        raise ValueError(f"policy.quality_threshold: {exc}") from exc


def _float_metrics(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out


class KeepBest(pl.Callback):
    """Remembers the weights with the lowest ``metric`` over every validation of a run.

    Validating the start weights before ``fit`` (the base) puts them among the candidates, so
    training that makes the held-out frames worse leaves the start in place: on a handful of
    scenes (``budget=tiny``) the fine-tuned maps fit the training frames and lose on held-out
    ones, and the base as it is grasped more in the validation cells
    (docs/experiments/2026-12-08-the-policy-stage-keeps-its-best-weights.md). Its state (the
    best weights included) travels in a checkpoint, so a resumed run still knows them.
    """

    def __init__(self, metric: str) -> None:
        self.metric = str(metric)
        self.best: dict[str, Any] | None = None  # {"step", "value", "metrics", "state"}
        self.last: dict[str, Any] | None = None  # {"step", "value"}: the latest validation

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = _float_metrics(trainer.callback_metrics)
        if self.metric not in metrics:
            raise ValueError(f"policy.keep_best_by={self.metric!r} is not a validation metric; "
                             f"one of: {', '.join(sorted(k for k in metrics if k.startswith('val/')))}")
        value, step = metrics[self.metric], int(trainer.global_step)
        self.last = {"step": step, "value": value}
        if self.best is None or value < self.best["value"]:
            self.best = {"step": step, "value": value, "metrics": {k: v for k, v in metrics.items() if k.startswith("val/")},
                         "state": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "best": self.best, "last": self.last}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("metric") == self.metric:  # another metric: its values do not compare
            self.best, self.last = state_dict.get("best"), state_dict.get("last")

    def restore(self, module: pl.LightningModule) -> dict[str, Any]:
        """Load the best weights into ``module`` (the last ones, when they are the best); what was kept."""
        assert self.best is not None and self.last is not None, "restore() before any validation"
        module.load_state_dict(self.best["state"])
        return {"by": self.metric, "step": self.best["step"], "value": self.best["value"],
                "last_step": self.last["step"], "last_value": self.last["value"]}


def train_policy(
    cfg: DictConfig | dict,
    dataset_dirs: Sequence[str | Path],
    output_dir: str | Path,
    translator: TranslateFn | None = None,
    ckpt_path: str | Path | None = None,
    export: bool = True,
    fast_dev_run: bool | int = False,
    seed: int | None = None,
    callbacks: Sequence[pl.Callback] = (),
    init_from: str | Path | None = None,
    mixed_calibrations: bool = False,
    extra_train: Dataset | None = None,
    extra_fraction: float = 0.0,
) -> dict:
    """Train the policy with a Lightning ``Trainer``, save it, and export the artifact.

    Args:
        cfg: the policy config (``conf/policy/*.yaml``) or a whole ``train_policy`` config.
        dataset_dirs: rendered dataset folders (one nominal calibration).
        output_dir: where everything goes (see the module docstring).
        translator: ``(N, H, W, 3) uint8 -> uint8`` on view images (sim -> adapted); ``None``
            trains on the sim frames as rendered (the ``adaptation=none`` ablation).
        ckpt_path: a Lightning checkpoint to continue from; ``"last"``:
            ``output_dir/checkpoints/last.ckpt`` (a fresh run when there is none yet).
        export: write ``output_dir/artifact``.
        fast_dev_run: Lightning's smoke-test mode (one batch of each).
        seed: overrides ``cfg.seed`` (default 0).
        callbacks: extra Lightning callbacks.
        init_from: a ``policy.ckpt`` whose network weights training starts from (a fresh
            optimiser and schedule: fine-tuning, unlike ``ckpt_path``). Without it (and without
            ``ckpt_path``) training starts from ``policy.base`` when set (:mod:`policies.base`).
        mixed_calibrations: folders rendered for different cameras, each seen in the view
            of its own calibration (the base's training; the artifact is the first's).
        extra_train: more training items with the sim items' keys (recorded real attempts,
            :class:`policies.finetune.RealAttempts`), drawn as ``extra_fraction`` of each
            epoch's items (with replacement; the sim frames make up the rest).

    Returns:
        ``checkpoint``, ``artifact`` (or ``None``), ``config``, ``metrics`` (final ``val/...``,
        last ``train/...``), ``global_step``, ``train_time_s``, ``n_train_frames``,
        ``n_val_frames``, ``view``, ``logs`` (the run's CSV log folder), ``device``, ``kept``
        (with ``policy.keep_best_by``: the step and metric value of the weights saved and
        exported, and the last validation's; ``None`` without it or without held-out frames).
    """
    full = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    pcfg = policy_config(full)
    check_policy_config(pcfg)
    if seed is None:
        seed = int(full.get("seed", 0) or 0)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if pcfg.get("num_threads"):
        torch.set_num_threads(int(pcfg.num_threads))
    pl.seed_everything(int(seed), workers=True, verbose=False)

    view_size = tuple(int(v) for v in pcfg.view_size)
    angle_bins = int(pcfg.angle_bins)
    view_spec = OmegaConf.to_container(pcfg.view, resolve=True) if pcfg.get("view") else None  # None: the config's
    train_ds, val_ds, view, calib = make_policy_datasets(
        [str(d) for d in dataset_dirs], view_spec, view_size, angle_bins, translator,
        OmegaConf.to_container(pcfg.targets, resolve=True), float(pcfg.val_fraction), int(seed),
        bool(pcfg.get("cache", True)),
        OmegaConf.to_container(pcfg.augment, resolve=True) if pcfg.get("augment") else None,
        float(pcfg.get("translate_fraction", 1.0)),
        mixed_calibrations=mixed_calibrations,
    )
    if len(train_ds) == 0:
        raise ValueError(f"no training frames in {list(dataset_dirs)}")
    train_loader, val_loader = _loaders(pcfg, train_ds, val_ds, extra_train, extra_fraction, int(seed))
    pcfg_dict = OmegaConf.to_container(pcfg, resolve=True)
    module = _module(pcfg, view, calib, {"policy": pcfg_dict, "seed": int(seed), "dataset_dirs": [str(d) for d in dataset_dirs],
                                         "translator": None if translator is None else repr(translator)})
    from adaptation.train import resolve_ckpt_path  # lazy: kornia via adaptation.train

    resume = resolve_ckpt_path(None if ckpt_path is None else str(ckpt_path), out)
    base_info = _start_weights(module, pcfg, init_from, resume)
    keep = (KeepBest(str(pcfg.keep_best_by)) if pcfg.get("keep_best_by") and val_loader is not None
            and not fast_dev_run else None)
    trainer, tlog = _trainer(full, pcfg, out, resume, val_loader is not None,
                             [*callbacks, keep] if keep is not None else callbacks, fast_dev_run)
    t0 = time.perf_counter()
    try:
        if keep is not None and resume is None:
            trainer.validate(module, val_loader, verbose=False)  # the start weights are a candidate
        trainer.fit(module, train_loader, val_loader, ckpt_path=str(resume) if resume else None)
    except BaseException:
        tlog.finish(failed=True)
        raise
    train_time = time.perf_counter() - t0
    metrics = {k: v for k, v in _float_metrics(trainer.callback_metrics).items() if k.startswith("train/")}
    kept = None
    if val_loader is not None:
        res = trainer.validate(module, val_loader, verbose=False)
        metrics.update(_float_metrics(res[0] if res else {}))
        if keep is not None:
            kept = keep.restore(module)
            metrics.update(keep.best["metrics"])  # the val/ metrics of the weights saved
            log.info("policy: kept the weights of step %d (%s %.4f; the last, step %d: %.4f)", kept["step"],
                     kept["by"], kept["value"], kept["last_step"], kept["last_value"])
    summary = _save(trainer, module, full, out, {
        "metrics": metrics, "global_step": int(trainer.global_step), "train_time_s": train_time,
        "n_train_frames": len(train_ds), "n_val_frames": 0 if val_ds is None else len(val_ds),
        "view": view.to_dict(), "logs": str(getattr(trainer.logger, "log_dir", None) or "") or None,
        "device": str(module.device), "adapted": translator is not None, "base": base_info, "kept": kept,
    })
    if export and trainer.is_global_zero:
        sample = next(iter(val_loader if val_loader is not None else train_loader))["image"][:2].numpy()
        summary["artifact"] = str(_export(module, view, calib, pcfg_dict, out, sample, summary, dataset_dirs))
    if trainer.is_global_zero:
        write_json(out / "train_summary.json", summary)
    tlog.finish()
    return summary


def _module(pcfg: DictConfig, view: NetworkView, calib: Calibration, config: dict) -> GraspPolicyModule:
    """The LightningModule: network, losses and optimiser from ``pcfg``; the view, camera and
    ``config`` (the resolved run config) saved with its weights."""
    return GraspPolicyModule(
        network={"angle_bins": int(pcfg.angle_bins), **OmegaConf.to_container(pcfg.network, resolve=True)},
        loss=OmegaConf.to_container(pcfg.loss, resolve=True),
        optim={**OmegaConf.to_container(pcfg.optim, resolve=True), "max_steps": int(pcfg.max_steps),
               "max_time_s": float(pcfg.max_time_s) if pcfg.get("max_time_s") else None},
        view=view.to_dict(),
        calibration=calib.to_dict(),
        config=config,
    )


def _export(module: GraspPolicyModule, view: NetworkView, calib: Calibration, pcfg_dict: dict, out: Path,
            sample: np.ndarray, summary: dict, dataset_dirs: Sequence[str | Path]) -> Path:
    """``out/artifact``: the trained network (and the config's geometry network) as ONNX, with
    the training's facts in its metadata."""
    return export_artifact(
        module.cpu(), view, calib, pcfg_dict, out / "artifact", sample_inputs=sample,
        geometry=geometry_export(pcfg_dict),
        training={k: summary[k] for k in ("metrics", "global_step", "train_time_s", "n_train_frames",
                                          "n_val_frames", "adapted", "base", "kept")} | {"dataset_dirs": [str(d) for d in dataset_dirs]},
    )


def _save(trainer: pl.Trainer, module: GraspPolicyModule, full: DictConfig, out: Path, facts: dict) -> dict:
    """Save ``policy.ckpt`` (weights and the resolved config) and ``config.yaml``; the run's
    summary: where they are, and ``facts``."""
    ckpt_path = out / "policy.ckpt"
    trainer.save_checkpoint(str(ckpt_path), weights_only=False)
    config_path = out / "config.yaml"
    if trainer.is_global_zero:  # (DDP: the other ranks write nothing)
        atomic_write_text(config_path, OmegaConf.to_yaml(full, resolve=True))
    return {"checkpoint": str(ckpt_path), "artifact": None, "config": str(config_path), **facts}


def _loaders(pcfg: DictConfig, train_ds: Dataset, val_ds: Dataset | None, extra_train: Dataset | None,
             extra_fraction: float, seed: int) -> tuple[DataLoader, DataLoader | None]:
    """The training loader (the sim frames, mixed with ``extra_train`` as ``extra_fraction`` of
    each epoch's items when given) and the validation loader."""
    bs = int(pcfg.batch_size)
    nw = int(pcfg.get("num_workers", 0))
    loader_kw = {"num_workers": nw, "persistent_workers": nw > 0}
    if extra_train is not None and len(extra_train) and extra_fraction > 0:
        n_sim, n_extra = len(train_ds), len(extra_train)
        f = min(max(float(extra_fraction), 0.0), 1.0)
        weights = torch.cat([torch.full((n_sim,), (1.0 - f) / n_sim), torch.full((n_extra,), f / n_extra)])
        sampler = WeightedRandomSampler(weights, num_samples=n_sim + n_extra, replacement=True,
                                        generator=torch.Generator().manual_seed(int(seed)))
        train_loader = DataLoader(ConcatDataset([train_ds, extra_train]), batch_size=bs, sampler=sampler,
                                  drop_last=n_sim + n_extra >= bs, **loader_kw)
    else:
        train_loader = DataLoader(train_ds, batch_size=bs, shuffle=True, drop_last=len(train_ds) >= bs, **loader_kw)
    val_loader = DataLoader(val_ds, batch_size=bs, shuffle=False, **loader_kw) if val_ds is not None else None
    return train_loader, val_loader


def _start_weights(module: GraspPolicyModule, pcfg: DictConfig, init_from: str | Path | None,
                   resume: Path | None) -> dict | None:
    """Load the weights training starts from: ``init_from`` (fine-tuning), else the base when
    set and not resuming; returns the base's name and digest when it was loaded."""
    if init_from is not None:
        state = torch.load(str(init_from), map_location="cpu", weights_only=True)["state_dict"]
        module.load_state_dict(state)
        return None
    if not pcfg.get("base") or resume is not None:
        return None

    module.load_state_dict(load_base(pcfg.base)["state_dict"])
    base_info = {"name": str(pcfg.base), "digest": base_digest(pcfg.base)}
    log.info("policy: starting from the base %s (%s)", pcfg.base, base_info["digest"])
    return base_info


def _trainer(full: DictConfig, pcfg: DictConfig, out: Path, resume: Path | None, validates: bool,
             callbacks: Sequence[pl.Callback], fast_dev_run: bool | int) -> tuple[pl.Trainer, Any]:
    """The Lightning trainer (checkpoints every validation, the time cap, the run's logger)."""
    val_every = int(pcfg.val_every_n_steps)
    ckpt_cb = ModelCheckpoint(
        dirpath=out / "checkpoints", filename="step{step}", auto_insert_metric_name=False,
        save_last=True, save_top_k=1, every_n_train_steps=val_every,
    )
    max_time = datetime.timedelta(seconds=float(pcfg.max_time_s)) if pcfg.get("max_time_s") else None
    # A trainer group (conf/trainer/*.yaml, e.g. trainer=ddp) wins over the policy's device keys.
    # Progress on, as the trainer groups have it: a bar at a terminal, a line every few percent
    # in a log (trainer_progress); off, the pipeline's longest stage said nothing for minutes.
    tkw: dict[str, Any] = {"accelerator": str(pcfg.accelerator), "devices": pcfg.devices,
                           "precision": pcfg.precision, "enable_progress_bar": True, "deterministic": False}
    if full.get("trainer"):
        tkw.update(OmegaConf.to_container(full.trainer, resolve=True))
    tkw["enable_progress_bar"], progress_cbs = trainer_progress("policy", bool(tkw["enable_progress_bar"]))
    tlog = policy_logger(full.get("logger"), out, OmegaConf.to_container(full, resolve=True), resume=resume)
    trainer = pl.Trainer(
        default_root_dir=str(out),
        max_steps=int(pcfg.max_steps),
        max_epochs=-1,
        max_time=max_time,
        logger=tlog.logger,
        callbacks=[ckpt_cb, *callbacks, *progress_cbs],
        val_check_interval=val_every if validates else None,
        check_val_every_n_epoch=None,
        limit_val_batches=pcfg.limit_val_batches if validates else 0,
        num_sanity_val_steps=0,
        log_every_n_steps=int(pcfg.log_every_n_steps),
        enable_model_summary=False,
        fast_dev_run=fast_dev_run,
        **tkw,
    )
    return trainer, tlog


def geometry_export(pcfg: DictConfig | dict) -> dict | None:
    """The ``geometry`` argument of :func:`policies.export.export_artifact` for ``policy.geometry``
    (a shipped geometry network put into the artifact as it is), or ``None``."""
    pcfg = policy_config(pcfg)
    if not pcfg.get("geometry"):
        return None
    opts = pcfg.get("geometry_decode")
    return {"base": load_base(pcfg.geometry, GEOMETRY_FORMAT),
            "options": OmegaConf.to_container(opts, resolve=True) if isinstance(opts, DictConfig) else dict(opts or {}),
            "info": {"name": str(pcfg.geometry), "digest": base_digest(pcfg.geometry)}}


def load_translator(path: str | Path) -> TranslateFn:
    """The sim->real generator at ``path`` as a data-loader translator."""
    return Translator(str(path))


def _run(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO)
    dirs = list(cfg.dataset_dirs) if cfg.dataset_dirs else []
    if isinstance(cfg.dataset_dirs, str):
        dirs = [cfg.dataset_dirs]
    if not dirs:
        raise ValueError("dataset_dirs is empty: give dataset_dirs=[DIR,...] (sim2real-render output folders)")
    translator = load_translator(cfg.translator) if cfg.translator else None
    summary = train_policy(
        cfg, dirs, cfg.output_dir, translator, ckpt_path=cfg.ckpt_path, export=bool(cfg.export),
        fast_dev_run=bool(cfg.fast_dev_run), seed=int(cfg.seed),
    )
    m = summary["metrics"]
    shown = {k: round(v, 4) for k, v in m.items() if k.startswith("val/")}
    print(f"trained {summary['global_step']} steps in {summary['train_time_s']:.0f} s; {shown}")
    print(f"checkpoint {summary['checkpoint']}; artifact {summary['artifact']}")


def main() -> None:
    if arg_value(sys.argv[1:], "resume") is not None or arg_value(sys.argv[1:], "+resume") is not None:
        fail("sim2real-train-policy", "resume= is now ckpt_path=, as in sim2real-adapt: ckpt_path=last (this "
             "output_dir's checkpoints/last.ckpt) or ckpt_path=FILE.ckpt")
    # FileNotFoundError (an OSError) for a missing ckpt_path too
    run_hydra_command("train_policy", "sim2real-train-policy", __doc__ or "", _run,
                      (CalibrationError, ValueError, OSError), writable_dirs=())
