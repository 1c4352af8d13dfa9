"""The grasp policy's LightningModule: losses, metrics and optimizer around :class:`GraspNet`.

Losses (see ``conf/policy/default.yaml`` ``loss``):

- quality: binary cross-entropy on the labelled (pixel, angle bin) entries, normalised by
  their weight (``pos_weight`` scales the successes), plus ``dense_negative_weight`` times
  the mean cross-entropy of the table and bin pixels towards 0 in every bin, plus
  ``object_negative_weight`` times the same on the *unlabelled* (pixel, bin) entries of
  object pixels (positive-unlabelled learning: the labels are a sparse sample of the
  graspable places, so the score of a place follows how often it was labelled a success,
  and the other angle bins of a labelled place are pushed down: without it the network
  is free to call every object pixel good at every angle, and the decode's arg-max picks
  one of them at random);
- height: weighted smooth-L1 (metres, ``beta=0.01``) against the dense height target;
- surface: the same against the surface seen from above (the decode's grasp rule runs on it);
- width: smooth-L1 on the pixels of successful labels.

Metrics: ``train/loss``, ``train/quality_loss``, ``train/height_loss``, ``train/surface_loss``,
``train/width_loss``;
``val/...`` the same plus ``val/label_acc`` (labelled entries classified at 0.5),
``val/label_pos_recall``, ``val/label_precision``, ``val/height_mae_m`` and ``val/surface_mae_m`` (object pixels),
``val/width_mae_m`` and ``val/top1_on_object`` (fraction of frames whose best
(pixel, bin) lies on an object).
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from conf import as_dict, with_policy_defaults
from policies.networks import GraspNet, build_network, configured_class

__all__ = ["TimedCosineModule", "GraspPolicyModule", "grasp_losses"]


def grasp_losses(
    out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], loss_cfg: dict, step: int | None = None
) -> dict[str, torch.Tensor]:
    """The policy losses of one batch (see the module docstring).

    Args:
        out: :class:`GraspNet` outputs.
        batch: :class:`policies.data.PolicyFrames` items, collated.
        loss_cfg: ``loss`` keys (``conf/policy/default.yaml``'s values for those not given).
        step: the global step (for ``height_trust_after``); ``None`` applies the trust.

    Returns:
        ``loss``, ``quality_loss``, ``height_loss``, ``surface_loss``, ``width_loss`` (scalars).
    """
    c = with_policy_defaults("loss", loss_cfg)
    logits = out["quality_logits"]
    tq, wq = batch["quality_target"], batch["quality_weight"]
    sigma = float(c["height_trust_sigma"])
    if sigma > 0 and (step is None or step >= int(c["height_trust_after"])):
        h_err = (out["height"][:, 0] - batch["height_target"]).detach()
        trust = torch.exp(-((h_err / sigma) ** 2))
        if "real" in batch:  # a recorded real attempt has no height label to trust it by
            trust = torch.where(batch["real"].view(-1, 1, 1) > 0, torch.ones_like(trust), trust)
        tq = tq * trust.unsqueeze(1)
    bce = F.binary_cross_entropy_with_logits(logits, tq, reduction="none")
    w = wq * (1.0 + (float(c["pos_weight"]) - 1.0) * tq)
    label_loss = (w * bce).sum() / w.sum().clamp_min(1.0)
    unlabelled = wq == 0
    dense_f = (batch["dense_negative"].unsqueeze(1) & unlabelled).float()
    neg = F.softplus(logits)  # BCE towards 0
    dense_loss = (neg * dense_f).sum() / dense_f.sum().clamp_min(1.0)
    obj_f = (batch["object_mask"].unsqueeze(1) & unlabelled).float()
    object_loss = (neg * obj_f).sum() / obj_f.sum().clamp_min(1.0)
    quality_loss = (
        label_loss
        + float(c["dense_negative_weight"]) * dense_loss
        + float(c["object_negative_weight"]) * object_loss
    )

    hw = batch["height_weight"]
    h_err = F.smooth_l1_loss(out["height"][:, 0], batch["height_target"], reduction="none", beta=0.01)
    height_loss = (hw * h_err).sum() / hw.sum().clamp_min(1.0)
    sw = batch["surface_weight"]
    s_err = F.smooth_l1_loss(out["surface"][:, 0], batch["surface_target"], reduction="none", beta=0.01)
    surface_loss = (sw * s_err).sum() / sw.sum().clamp_min(1.0)
    wm = batch["width_mask"].float()
    w_err = F.smooth_l1_loss(out["width"][:, 0], batch["width_target"], reduction="none", beta=0.01)
    width_loss = (wm * w_err).sum() / wm.sum().clamp_min(1.0)
    loss = (
        float(c["quality_weight"]) * quality_loss
        + float(c["height_weight"]) * height_loss
        + float(c["surface_weight"]) * surface_loss
        + float(c["width_weight"]) * width_loss
    )
    return {
        "loss": loss,
        "quality_loss": quality_loss,
        "label_loss": label_loss,
        "dense_loss": dense_loss,
        "object_loss": object_loss,
        "height_loss": height_loss,
        "surface_loss": surface_loss,
        "width_loss": width_loss,
    }


class TimedCosineModule(pl.LightningModule):
    """AdamW with a warm-up and a cosine schedule that, under a time budget, ends with the budget.

    Args:
        optim: ``lr``, ``weight_decay``, ``scheduler`` (``cosine`` or ``none``), ``warmup_steps``,
            ``max_steps`` (the cosine horizon) and ``max_time_s`` (a time budget: the horizon
            is then re-estimated as training goes, so the schedule ends with the budget).
    """

    def __init__(self, optim: dict | DictConfig | None = None) -> None:
        super().__init__()
        self.optim_cfg = {"_target_": "torch.optim.AdamW", "lr": 2e-3, "weight_decay": 1e-4, "scheduler": "cosine",
                          "max_steps": 1000, **as_dict(optim)}

    def log_losses(self, stage: str, losses: dict[str, torch.Tensor], batch_size: int, prog_bar: bool = True) -> None:
        """Log every loss as ``stage/name`` (``loss`` itself on the progress bar when ``prog_bar``)."""
        for k, v in losses.items():
            self.log(f"{stage}/{k}", v, prog_bar=prog_bar and k == "loss", batch_size=batch_size)

    def configure_optimizers(self) -> Any:
        o = self.optim_cfg
        optimizer = configured_class(o, torch.optim.Optimizer, "optim")
        opt = optimizer(self.parameters(), lr=float(o["lr"]), weight_decay=float(o["weight_decay"]))
        if str(o.get("scheduler", "none")) != "cosine":
            return opt
        self._horizon = max(1, int(o["max_steps"]))
        warm = min(int(o.get("warmup_steps", 20)), self._horizon // 5)

        def factor(step: int) -> float:
            # The horizon is read at every step: with a time budget it is re-estimated
            # from the pace of training (see on_train_batch_end).
            total = max(self._horizon, warm + 1)
            if step < warm:
                return (step + 1) / max(1, warm)
            t = min(1.0, (step - warm) / max(1, total - warm))
            return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(t * math.pi))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        self._t_start = time.perf_counter()
        self._step_start = int(self.global_step)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.update_horizon(int(self.global_step), time.perf_counter())

    def update_horizon(self, step: int, now: float) -> None:
        """With ``optim.max_time_s``, fit the cosine schedule to the steps the time allows."""
        budget = self.optim_cfg.get("max_time_s")
        if not budget or not hasattr(self, "_horizon"):
            return
        done = step - self._step_start
        if done < 10:
            return
        per_step = (now - self._t_start) / done
        remaining = max(0.0, float(budget) - (now - self._t_start))
        est = step + int(remaining / max(per_step, 1e-6))
        self._horizon = max(1, min(int(self.optim_cfg["max_steps"]), est))



class GraspPolicyModule(TimedCosineModule):
    """Trains :class:`GraspNet` on :class:`policies.data.PolicyFrames` batches.

    Args:
        network: ``GraspNet`` keyword arguments (``angle_bins``, ``base_channels``, ``dilations``).
        loss: ``loss`` overrides of ``conf/policy/default.yaml``.
        optim: ``lr``, ``weight_decay``, ``scheduler`` (``cosine`` or ``none``), ``warmup_steps``,
            ``max_steps`` (the cosine horizon) and ``max_time_s`` (a time budget: the horizon
            is then re-estimated as training goes, so the schedule ends with the budget).
        view: the network view as ``NetworkView.to_dict()`` (saved with the checkpoint so
            an artifact can be exported from it alone).
        calibration: the nominal calibration dict (ditto).
        config: the resolved policy config (saved with the checkpoint).
    """

    def __init__(
        self,
        network: dict | DictConfig | None = None,
        loss: dict | DictConfig | None = None,
        optim: dict | DictConfig | None = None,
        view: dict | None = None,
        calibration: dict | None = None,
        config: dict | None = None,
    ) -> None:
        super().__init__(optim)
        network, loss, optim = as_dict(network), as_dict(loss), as_dict(optim)
        self.save_hyperparameters(
            {"network": network, "loss": loss, "optim": optim, "view": view, "calibration": calibration,
             "config": config}
        )
        self.net = build_network(network, GraspNet, "policy.network")
        self.loss_cfg = with_policy_defaults("loss", loss)

    @property
    def angle_bins(self) -> int:
        return self.net.angle_bins

    def forward(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.net(image)

    # ---------------------------------------------------------------- steps
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.net(batch["image"])
        losses = grasp_losses(out, batch, self.loss_cfg, step=int(self.global_step))
        self.log_losses("train", losses, batch["image"].shape[0])
        return losses["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out = self.net(batch["image"])
        losses = grasp_losses(out, batch, self.loss_cfg)
        n = batch["image"].shape[0]
        self.log_losses("val", losses, n)
        for k, v in grasp_metrics(out, batch).items():
            self.log(f"val/{k}", v, batch_size=n)

@torch.no_grad()
def grasp_metrics(out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validation metrics of one batch (see the module docstring)."""
    prob = torch.sigmoid(out["quality_logits"])
    wq = batch["quality_weight"] >= 1.0  # the labelled entries themselves, not the angle spread
    tq = batch["quality_target"] >= 0.5
    pred = prob >= 0.5
    n = wq.sum().clamp_min(1)
    metrics = {"label_acc": ((pred == tq) & wq).sum() / n}
    pos = tq & wq
    metrics["label_pos_recall"] = (pred & pos).sum() / pos.sum().clamp_min(1)
    metrics["label_precision"] = (pred & pos).sum() / (pred & wq).sum().clamp_min(1)
    obj = batch["object_mask"]
    h_err = (out["height"][:, 0] - batch["height_target"]).abs()
    hmask = obj & (batch["height_weight"] > 0)
    metrics["height_mae_m"] = (h_err * hmask).sum() / hmask.sum().clamp_min(1)
    smask = obj & (batch["surface_weight"] > 0)
    s_err = (out["surface"][:, 0] - batch["surface_target"]).abs()
    metrics["surface_mae_m"] = (s_err * smask).sum() / smask.sum().clamp_min(1)
    wm = batch["width_mask"]
    metrics["width_mae_m"] = ((out["width"][:, 0] - batch["width_target"]).abs() * wm).sum() / wm.sum().clamp_min(1)
    N, A, H, W = prob.shape
    best = prob.reshape(N, -1).argmax(dim=1) % (H * W)
    on_obj = obj.reshape(N, -1).gather(1, best[:, None])[:, 0]
    metrics["top1_on_object"] = on_obj.float().mean()
    return metrics
