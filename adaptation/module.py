"""The CycleGAN LightningModule: losses, metrics, optimizers, EMA, export.

Domains: ``sim`` (A) and ``real`` (B); ``G_sim2real`` maps A to B, ``G_real2sim`` back;
``D_real`` and ``D_sim`` are PatchGANs. One training step (manual optimization):

1. generators: least-squares GAN loss against both discriminators, cycle L1 (``cycle``),
   identity L1 (``identity`` x ``cycle``, as the reference), and the content loss on the
   adapted sim frame: GraspGAN's masked pairwise MSE (``content_pmse``) between the sim
   frame and its translation over the objects, the distractors and a thin ring around them
   (``content_dilate`` pixels), which allows a per-channel colour shift but not a change of
   shape or a vanished object; optionally (``content_seg``) the cross-entropy of a
   segmentation head, trained on raw sim frames only, on the adapted frame;
2. discriminators: least-squares loss on real frames and on translations drawn from an
   image pool (``pool_size``), plus the segmentation head's loss on augmented sim frames.

The learning rate is constant, then decays linearly to zero from ``decay_start`` (a fraction of
the run, counted in steps or in ``max_time``, whichever is further). An exponential moving
average of ``G_sim2real`` (``ema``) is what validation measures and what is exported.

Validation (every ``val_every_n_steps``) translates the held-out sim frames and measures
``val/swd_adapted_real`` (multi-scale patch SWD to the held-out real frames, see
:mod:`adaptation.metrics`) beside its baseline ``val/swd_sim_real``, and the content scores of
the adapted frames (``val/content_object_iou``, ``val/content_instance_recall``) beside those of
the raw sim frames. Whenever the distance improves the EMA generator is exported to
``output_dir/generator.pt`` + ``generator.json`` (see :mod:`adaptation.translate`).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import cv2
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Timer
from torch import nn
from torchvision.utils import make_grid

from adaptation import metrics as M
from adaptation.data import to_uint8
from adaptation.networks import build, count_parameters
from adaptation.translate import save_generator
from perception.core.jsonio import to_jsonable
from sim_render.format import SEG_DISTRACTOR

__all__ = ["CycleGANModule", "ImagePool", "masked_pmse", "content_mask", "lsgan_loss", "GENERATOR_FORMAT"]

log = logging.getLogger(__name__)

#: ``format`` field of ``generator.json``.
GENERATOR_FORMAT = "sim2real-grasp/generator"


# --------------------------------------------------------------------------- losses and helpers
def lsgan_loss(pred: torch.Tensor, target_is_real: bool) -> torch.Tensor:
    """Least-squares GAN loss (Mao et al. 2017): ``mean((pred - target)^2)``."""
    return F.mse_loss(pred, torch.full_like(pred, 1.0 if target_is_real else 0.0))


def content_mask(seg: torch.Tensor, dilate: int = 3) -> torch.Tensor:
    """Float mask ``(N, 1, H, W)`` of objects and distractors (labels >= ``SEG_DISTRACTOR``), dilated by ``dilate`` px."""
    m = (seg >= SEG_DISTRACTOR).float()[:, None]
    if dilate > 0:
        m = F.max_pool2d(m, 2 * dilate + 1, stride=1, padding=dilate)
    return m


def masked_pmse(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked pairwise MSE (GraspGAN): the variance of ``x - y`` inside the mask, per channel.

    Invariant to a constant per-channel shift inside the mask (the palette may change),
    sensitive to anything that changes shape or contrast. Images whose mask is empty add 0.

    Shape:
        ``x, y``: ``(N, C, H, W)``; ``mask``: ``(N, 1, H, W)``. Returns a scalar.
    """
    d = (x - y) * mask
    n = mask.sum(dim=(2, 3)).clamp_min(1.0)
    mean = d.sum(dim=(2, 3)) / n
    sq = (d * d).sum(dim=(2, 3)) / n
    return (sq - mean * mean).clamp_min(0).mean()


class ImagePool:
    """History of generated images for the discriminator (Shrivastava et al. 2017).

    With probability 1/2 a query returns a stored image (and stores the new one in its place).
    The pool lives in one process and is not checkpointed: a resumed run refills it.
    """

    def __init__(self, size: int = 50) -> None:
        self.size = int(size)
        self.images: list[torch.Tensor] = []

    def query(self, images: torch.Tensor) -> torch.Tensor:
        if self.size <= 0:
            return images
        out = []
        for img in images.detach():
            img = img[None]
            if len(self.images) < self.size:
                self.images.append(img)
                out.append(img)
            elif torch.rand(1).item() < 0.5:
                j = int(torch.randint(0, self.size, (1,)).item())
                out.append(self.images[j].clone())
                self.images[j] = img
            else:
                out.append(img)
        return torch.cat(out, 0)


def _features(gen: nn.Module, x: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
    """Encoder features of a generator for PatchNCE: ``gen.features(x)`` (with the input as
    layer 0), indexed by ``layers``."""
    if not hasattr(gen, "features"):
        raise KeyError(f"generator {type(gen).__name__} has no features() for mode=cut")
    feats = [x, *gen.features(x)]
    return [feats[i] for i in layers]


def _build(kind: str, spec: dict) -> nn.Module:
    spec = dict(spec)
    name = spec.pop("name")
    return build(kind, name, **spec)


# --------------------------------------------------------------------------- the module
class CycleGANModule(pl.LightningModule):
    """CycleGAN with content preservation for sim->real frames.

    Args:
        config: the resolved run configuration (``conf/adapt.yaml``) as a plain dict; stored in
            every checkpoint (``hyper_parameters["config"]``). The module reads its
            ``adaptation``, ``max_steps``, ``max_time``, ``metrics`` and ``log_images_every_n_steps``.
        output_dir: where panels and the exported generator go (``None``: nothing is written).
    """

    def __init__(self, config: dict, output_dir: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters({"config": config})
        self.automatic_optimization = False
        self.config = config
        self.output_dir = Path(output_dir) if output_dir else None
        a = config["adaptation"]
        self.acfg = a
        self.mode = str(a.get("mode", "cyclegan"))
        if self.mode not in ("cyclegan", "cut"):
            raise KeyError(f"unknown adaptation mode '{self.mode}'; known modes: ['cut', 'cyclegan']")
        self.G_sim2real = _build("generator", a["generator"])
        self.D_real = _build("discriminator", a["discriminator"])
        if self.mode == "cyclegan":
            self.G_real2sim = _build("generator", a["generator"])
            self.D_sim = _build("discriminator", a["discriminator"])
        else:  # one-sided: PatchNCE between the sim frame and its translation replaces the cycle
            self.G_real2sim = None
            self.D_sim = None
            nce = a.get("nce", {})
            self.nce_layers = list(nce.get("layers", [0, 1, 2, 3]))
            self.nce_patches = int(nce.get("patches", 128))
            self.nce_tau = float(nce.get("temperature", 0.07))
            chans = [f.shape[1] for f in _features(self.G_sim2real, torch.zeros(1, 3, 32, 32), self.nce_layers)]
            dim = int(nce.get("dim", 128))
            self.nce_mlps = nn.ModuleList(
                nn.Sequential(nn.Linear(c, dim), nn.ReLU(True), nn.Linear(dim, dim)) for c in chans
            )
        self.G_sim2real_ema = copy.deepcopy(self.G_sim2real).requires_grad_(False)
        loss = a["loss"]
        self.seg_head = (
            build("seg_head", "small", n_classes=M.N_SEG_CLASSES, width=int(a.get("seg_head_width", 16)))
            if float(loss.get("content_seg", 0.0)) > 0
            else None
        )
        mcfg = config.get("metrics", {})
        probe_cfg = mcfg.get("probe", {})
        # The probe is not trained by the optimizers (requires_grad off, so DDP leaves it alone);
        # it is trained once in on_fit_start and then kept in the checkpoints.
        self.probe = build("seg_head", "small", n_classes=M.N_SEG_CLASSES, width=int(probe_cfg.get("width", 16)))
        self.probe.requires_grad_(False)
        self.register_buffer("probe_ready", torch.tensor(False))
        self.pool_real = ImagePool(a.get("pool_size", 50))
        self.pool_sim = ImagePool(a.get("pool_size", 50))
        self.best: dict[str, Any] = {}
        self.run_id: str | None = None
        self._val: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._baseline: dict[str, float] | None = None
        self._train_time = 0.0
        self._train_images = 0
        self._t_step: float | None = None
        self._last_val_step = -1
        self.start_iteration = 0

    # -------------------------------------------------------------- setup
    def parameter_counts(self) -> dict[str, int]:
        nets = {"G_sim2real": self.G_sim2real, "G_real2sim": self.G_real2sim, "D_real": self.D_real, "D_sim": self.D_sim}
        return {k: count_parameters(v) for k, v in nets.items() if v is not None}

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        o = self.acfg["optim"]
        betas = tuple(o.get("betas", (0.5, 0.999)))
        lr = float(o["lr"])
        g_params = list(self.G_sim2real.parameters())
        d_params = list(self.D_real.parameters())
        if self.mode == "cyclegan":
            g_params += list(self.G_real2sim.parameters())
            d_params += list(self.D_sim.parameters())
        else:
            g_params += list(self.nce_mlps.parameters())
        if self.seg_head is not None:
            d_params += list(self.seg_head.parameters())
        opt_g = torch.optim.Adam(g_params, lr=lr, betas=betas)
        opt_d = torch.optim.Adam(d_params, lr=lr * float(o.get("d_lr_factor", 1.0)), betas=betas)
        return [opt_g, opt_d]

    def on_fit_start(self) -> None:
        self._ensure_probe()

    def on_validation_start(self) -> None:
        self._ensure_probe()

    def _ensure_probe(self) -> None:
        if bool(self.probe_ready):
            return
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "probe_data"):
            return
        p = self.config.get("metrics", {}).get("probe", {})
        t0 = time.perf_counter()
        state = None
        if self.trainer.is_global_zero:
            images, seg = dm.probe_data()
            probe = M.train_probe(
                images, seg, steps=int(p.get("steps", 300)), batch_size=int(p.get("batch_size", 16)),
                lr=float(p.get("lr", 3e-3)), width=int(p.get("width", 16)), crop=p.get("crop"),
                seed=int(self.config.get("seed", 0)),
                device=self.device,
            )
            state = {k: v.cpu() for k, v in probe.state_dict().items()}
        state = self.trainer.strategy.broadcast(state, src=0)
        self.probe.load_state_dict(state)
        self.probe.to(self.device)  # (no dropout or batch norm: train and eval mode are the same)
        self.probe_ready.fill_(True)
        log.info("content probe trained in %.1f s", time.perf_counter() - t0)

    # -------------------------------------------------------------- schedule
    @property
    def iteration(self) -> int:
        """Training iterations done (Lightning's ``global_step`` counts both optimizers' steps)."""
        return int(self.global_step) // 2

    def _progress(self) -> float:
        """Fraction of the run done: the further of steps / max_steps and time / max_time."""
        p = 0.0
        max_steps = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        if max_steps:
            p = self.global_step / max_steps
        max_time = self.config.get("max_time")
        if max_time:
            timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
            if timer is not None:
                p = max(p, timer.time_elapsed("train") / float(max_time))
        return min(max(p, 0.0), 1.0)

    def lr_factor(self) -> float:
        start = float(self.acfg["optim"].get("decay_start", 0.5))
        p = self._progress()
        if p <= start or start >= 1.0:
            return 1.0
        return max(0.0, (1.0 - p) / (1.0 - start))

    def _set_lr(self, factor: float) -> None:
        o = self.acfg["optim"]
        lr = float(o["lr"]) * factor
        opt_g, opt_d = self.optimizers()
        for g in opt_g.param_groups:
            g["lr"] = lr
        for g in opt_d.param_groups:
            g["lr"] = lr * float(o.get("d_lr_factor", 1.0))

    # -------------------------------------------------------------- training
    def forward(self, sim: torch.Tensor) -> torch.Tensor:
        """Translate sim frames with the EMA generator. Shape ``(N, 3, H, W)`` in ``[-1, 1]``."""
        return self.G_sim2real_ema(sim)

    @torch.no_grad()
    def _update_ema(self) -> None:
        decay = float(self.acfg.get("ema", 0.999))
        step = self.iteration
        d = min(decay, (1.0 + step) / (10.0 + step))
        for pe, p in zip(self.G_sim2real_ema.parameters(), self.G_sim2real.parameters()):
            pe.lerp_(p.detach(), 1.0 - d)
        for be, b in zip(self.G_sim2real_ema.buffers(), self.G_sim2real.buffers()):
            be.copy_(b)

    def on_train_start(self) -> None:
        self.start_iteration = self.iteration

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t_step = time.perf_counter()

    def _generator_losses(self, sim: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Mode-specific generator loss (without the content terms), logs and images."""
        w = self.acfg["loss"]
        lam_gan = float(w.get("gan", 1.0))
        fake_real = self.G_sim2real(sim)
        logs: dict[str, torch.Tensor] = {}
        if self.mode == "cut":
            lam_nce = float(w.get("nce", 10.0))
            loss_gan = lsgan_loss(self.D_real(fake_real), True)
            loss_nce = self._patch_nce(sim, fake_real)
            loss = lam_gan * loss_gan + lam_nce * loss_nce
            if float(w.get("nce_identity", 0.0)) > 0:
                loss_nce_idt = self._patch_nce(real, self.G_sim2real(real))
                loss = loss + float(w["nce_identity"]) * lam_nce * loss_nce_idt
                logs["train/loss_nce_identity"] = loss_nce_idt.detach()
            logs.update({"train/loss_gan": loss_gan.detach(), "train/loss_nce": loss_nce.detach()})
            return loss, logs, {"fake_real": fake_real}
        lam_cyc = float(w.get("cycle", 10.0))
        lam_idt = float(w.get("identity", 0.5)) * lam_cyc
        rec_sim = self.G_real2sim(fake_real)
        fake_sim = self.G_real2sim(real)
        rec_real = self.G_sim2real(fake_sim)
        loss_gan = lsgan_loss(self.D_real(fake_real), True) + lsgan_loss(self.D_sim(fake_sim), True)
        loss_cyc = F.l1_loss(rec_sim, sim) + F.l1_loss(rec_real, real)
        loss = lam_gan * loss_gan + lam_cyc * loss_cyc
        if lam_idt > 0:
            loss_idt = F.l1_loss(self.G_sim2real(real), real) + F.l1_loss(self.G_real2sim(sim), sim)
            loss = loss + lam_idt * loss_idt
            logs["train/loss_identity"] = loss_idt.detach()
        logs.update({"train/loss_gan": loss_gan.detach(), "train/loss_cycle": loss_cyc.detach()})
        return loss, logs, {"fake_real": fake_real, "rec_sim": rec_sim, "fake_sim": fake_sim, "rec_real": rec_real}

    def _patch_nce(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """PatchNCE (Park et al. 2020): features of ``out`` must match those of ``src`` at the same
        location, among the other sampled locations of the same image; ``src`` features detached."""
        with torch.no_grad():  # the keys carry no gradient (as in CUT)
            f_src = _features(self.G_sim2real, src, self.nce_layers)
        f_out = _features(self.G_sim2real, out, self.nce_layers)
        total = src.new_zeros(())
        for mlp, fs, fo in zip(self.nce_mlps, f_src, f_out):
            b, c, h, w = fs.shape
            n = min(self.nce_patches, h * w)
            idx = torch.randperm(h * w, device=fs.device)[:n]
            ks = fs.flatten(2)[:, :, idx].permute(0, 2, 1)  # (B, n, C)
            qs = fo.flatten(2)[:, :, idx].permute(0, 2, 1)
            with torch.no_grad():
                k = F.normalize(mlp(ks), dim=-1)
            q = F.normalize(mlp(qs), dim=-1)
            logits = torch.bmm(q, k.transpose(1, 2)) / self.nce_tau  # (B, n, n), positives on the diagonal
            target = torch.arange(n, device=fs.device).expand(b, n)
            total = total + F.cross_entropy(logits.reshape(b * n, n), target.reshape(-1))
        return total / len(self.nce_mlps)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        w = self.acfg["loss"]
        it = self.iteration
        opt_g, opt_d = self.optimizers()
        factor = self.lr_factor()
        self._set_lr(factor)
        sim, seg, real = batch["sim"], batch["seg"], batch["real"]
        lam_pmse = float(w.get("content_pmse", 0.0))
        lam_seg = float(w.get("content_seg", 0.0))
        cls = M.seg_classes(seg)

        # ---- generators
        self.toggle_optimizer(opt_g)
        loss_g, logs, imgs = self._generator_losses(sim, real)
        fake_real = imgs["fake_real"]
        mask = content_mask(seg, int(w.get("content_dilate", 3)))
        loss_pmse = masked_pmse(fake_real, sim, mask)
        if lam_pmse > 0:
            loss_g = loss_g + lam_pmse * loss_pmse
        if self.seg_head is not None and lam_seg > 0:
            loss_segc = F.cross_entropy(self.seg_head(fake_real), cls)
            loss_g = loss_g + lam_seg * loss_segc
            logs["train/loss_content_seg"] = loss_segc.detach()
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self._update_ema()

        # ---- discriminators (and the seg head on raw sim frames)
        self.toggle_optimizer(opt_d)
        fr = self.pool_real.query(fake_real.detach())
        loss_d_real = 0.5 * (lsgan_loss(self.D_real(real), True) + lsgan_loss(self.D_real(fr), False))
        loss_d = loss_d_real
        logs["train/loss_d_real"] = loss_d_real.detach()
        if self.D_sim is not None:
            fs = self.pool_sim.query(imgs["fake_sim"].detach())
            loss_d_sim = 0.5 * (lsgan_loss(self.D_sim(sim), True) + lsgan_loss(self.D_sim(fs), False))
            loss_d = loss_d + loss_d_sim
            logs["train/loss_d_sim"] = loss_d_sim.detach()
        if self.seg_head is not None:
            loss_head = F.cross_entropy(self.seg_head(M.photometric_augment(sim)), cls)
            loss_d = loss_d + loss_head
            logs["train/loss_seg_head"] = loss_head.detach()
        opt_d.zero_grad(set_to_none=True)
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        # ---- bookkeeping
        n_img = sim.shape[0] * self.trainer.world_size
        if self._t_step is not None:
            dt = time.perf_counter() - self._t_step
            self._train_time += dt
            self._train_images += n_img
            logs["train/images_per_s"] = torch.tensor(n_img / max(dt, 1e-9))
        logs.update(
            {
                "train/loss_g": loss_g.detach(),
                "train/loss_content_pmse": loss_pmse.detach(),
                "train/lr_factor": torch.tensor(factor),
            }
        )
        self.log_dict(logs, on_step=True, on_epoch=False)
        self.log("g", loss_g.detach(), prog_bar=True, logger=False)
        self.log("d", loss_d.detach(), prog_bar=True, logger=False)
        every = int(self.config.get("log_images_every_n_steps", 0) or 0)
        if every > 0 and it % every == 0 and self.trainer.is_global_zero:
            k = min(4, len(sim))
            d = {key: v[:k].detach() for key, v in imgs.items()}
            self._save_panels(
                "train", it, sim[:k], d["fake_real"], d.get("rec_sim"), real[:k], d.get("fake_sim"), d.get("rec_real"),
            )

    # -------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        self._val = defaultdict(list)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        sim, seg, real = batch["sim"], batch["seg"], batch["real"]
        adapted = self.G_sim2real_ema(sim)
        self._val["sim"].append(sim)
        self._val["seg"].append(seg)
        self._val["real"].append(real)
        self._val["adapted"].append(adapted)
        for key in ("idx", "sim_first", "real_first"):
            if key in batch:
                self._val[key].append(batch[key])

    def _gathered(self, key: str) -> torch.Tensor:
        x = torch.cat(self._val[key])
        if self.trainer.world_size > 1:
            x = self.all_gather(x)
            x = x.reshape(-1, *x.shape[2:])
        return x.detach().cpu()

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or not self._val:
            return
        sim, seg, real = self._gathered("sim"), self._gathered("seg"), self._gathered("real")
        adapted = self._gathered("adapted")
        if "idx" in self._val:
            # every held-out frame once, in dataset order (ranks interleave; samplers pad)
            idx = self._gathered("idx")
            sim_first, real_first = self._gathered("sim_first"), self._gathered("real_first")
            order = torch.argsort(idx, stable=True)
            keep = order[torch.cat([torch.tensor([True]), idx[order][1:] != idx[order][:-1]])]
            s_sel = keep[sim_first[keep]]
            sim, seg, adapted = sim[s_sel], seg[s_sel], adapted[s_sel]
            real = real[keep[real_first[keep]]]
        self._val = defaultdict(list)
        n_sim = len(sim)
        scfg = dict(self.config.get("metrics", {}).get("swd", {}))
        swd_ad = M.sliced_wasserstein(adapted, real, **scfg)
        if self._baseline is None:
            swd_sim = M.sliced_wasserstein(sim, real, **scfg)
            c_sim = M.content_scores(M.predict_classes(self.probe, sim), seg)
            self._baseline = {
                "swd_sim_real": swd_sim["mean"],
                **{f"swd_sim_real_{k}": v for k, v in swd_sim.items() if k != "mean"},
                **{f"content_sim_{k}": v for k, v in c_sim.items()},
            }
        c_ad = M.content_scores(M.predict_classes(self.probe, adapted), seg)
        values = {
            "swd_adapted_real": swd_ad["mean"],
            **{f"swd_adapted_real_{k}": v for k, v in swd_ad.items() if k != "mean"},
            **self._baseline,
            "content_object_iou": c_ad["object_iou"],
            "content_mean_iou": c_ad["mean_iou"],
            "content_instance_recall": c_ad["instance_recall"],
        }
        values["swd_ratio"] = values["swd_adapted_real"] / max(values["swd_sim_real"], 1e-9)
        # every rank computed the same numbers from the same gathered frames (the mean is a no-op)
        self.log_dict({f"val/{k}": float(v) for k, v in values.items()}, sync_dist=True)
        self.log("val/swd", values["swd_adapted_real"], prog_bar=True, logger=False, sync_dist=True)
        self._last_val_step = self.iteration
        improved = not self.best or values["swd_adapted_real"] < self.best.get("swd_adapted_real", math.inf)
        if improved:
            self.best = {**{k: float(v) for k, v in values.items()}, "step": self.iteration}
            if self.trainer.is_global_zero:
                self.export_generator()
        self.last_metrics = {**{k: float(v) for k, v in values.items()}, "step": self.iteration}
        if self.trainer.is_global_zero:
            k = min(4, n_sim, len(real))
            rec_sim = to_sim = rec_real = None
            if self.G_real2sim is not None:
                with torch.no_grad():
                    rec_sim = self.G_real2sim(adapted[:k].to(self.device)).cpu()
                    to_sim = self.G_real2sim(real[:k].to(self.device)).cpu()
                    rec_real = self.G_sim2real_ema(to_sim.to(self.device)).cpu()
            self._save_panels("val", self.iteration, sim[:k], adapted[:k], rec_sim, real[:k], to_sim, rec_real)

    # -------------------------------------------------------------- panels and export
    def _save_panels(self, tag: str, step: int, sim, adapted, rec_sim, real, to_sim, rec_real) -> None:
        """Write ``sim | adapted | cycled`` and ``real | to-sim | cycled`` grids (PNG + logger)."""

        grids = {}
        for name, cols in (("sim2real", (sim, adapted, rec_sim)), ("real2sim", (real, to_sim, rec_real))):
            cols = tuple(c for c in cols if c is not None)
            if name == "real2sim" and len(cols) == 1:
                continue  # one-sided mode: no real->sim generator
            n = min(len(c) for c in cols)
            if n == 0:
                continue
            rows = torch.stack([c[:n].detach().float().cpu() for c in cols], 1).reshape(-1, *cols[0].shape[1:])
            grid = make_grid(rows, nrow=len(cols), padding=2, pad_value=1.0, normalize=False)
            grids[name] = to_uint8(grid).permute(1, 2, 0).numpy()
        if self.output_dir is not None:
            d = self.output_dir / "panels"
            d.mkdir(parents=True, exist_ok=True)
            for name, img in grids.items():
                cv2.imwrite(str(d / f"{tag}_{name}_step{step:07d}.png"), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
                cv2.imwrite(str(d / f"{tag}_{name}_latest.png"), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        logger = self.logger
        if logger is not None and hasattr(logger, "log_image"):
            try:
                logger.log_image(
                    key=f"{tag}/panels", images=list(grids.values()),
                    caption=["sim | adapted | cycled back", "real | to-sim | cycled back"][: len(grids)],
                    step=int(self.global_step),
                )
            except Exception as exc:  # a logger that cannot take images must not stop training
                log.warning("could not log image panels: %s", exc)

    def generator_metadata(self) -> dict[str, Any]:
        a = self.acfg
        meta: dict[str, Any] = {
            "format": GENERATOR_FORMAT,
            "version": 1,
            "generator": dict(a["generator"]),
            "image_size": list(a["image_size"]),
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "step": self.iteration,
            "ema": float(a.get("ema", 0.999)),
            "metrics": {k: v for k, v in self.best.items()},
        }
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "view"):
            meta["view"] = dm.view.to_dict()
            meta["calibration_digest"] = dm.calib.digest()
        return meta

    def export_generator(self, out_dir: str | Path | None = None) -> Path | None:
        """Save the EMA ``G_sim2real`` as ``generator.pt`` (a plain state_dict) + ``generator.json``."""
        d = Path(out_dir) if out_dir is not None else self.output_dir
        if d is None:
            return None

        return save_generator(self.G_sim2real_ema.state_dict(), to_jsonable(self.generator_metadata()), d)

    # -------------------------------------------------------------- checkpoint extras
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["adaptation"] = {
            "best": to_jsonable(self.best),
            "wandb_run_id": self.run_id,
            "train_time": float(self._train_time),
            "train_images": int(self._train_images),
            "baseline": to_jsonable(self._baseline) if self._baseline else None,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        extra = checkpoint.get("adaptation") or {}
        self.best = dict(extra.get("best") or {})
        self.run_id = extra.get("wandb_run_id") or self.run_id
        self._train_time = float(extra.get("train_time", 0.0))
        self._train_images = int(extra.get("train_images", 0))
        self._baseline = extra.get("baseline") or None

    def throughput(self) -> float:
        """Training images per second (all processes), validation excluded."""
        return self._train_images / self._train_time if self._train_time > 0 else float("nan")
