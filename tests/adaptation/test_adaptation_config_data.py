"""Every config composes and builds; the data module preprocesses and augments consistently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaptation.data import AdaptDataModule
from adaptation.module import CycleGANModule
from adaptation.train import build_logger, compose_config
from perception.core.calibration import Calibration, default_calibration_path
from perception.core.geometry import network_view
from perception.core.preprocess import preprocess, preprocess_labels


@pytest.mark.parametrize("adaptation", ["cyclegan", "cyclegan_resnet9", "cut"])
@pytest.mark.parametrize("trainer", ["cpu", "default", "ddp"])
def test_configs_compose_and_build(adaptation, trainer, tmp_path):
    cfg = compose_config([f"adaptation={adaptation}", f"trainer={trainer}", "sim_dir=x", "real_dir=y"])
    from omegaconf import OmegaConf

    module = CycleGANModule(OmegaConf.to_container(cfg, resolve=True))
    counts = module.parameter_counts()
    if adaptation in ("cyclegan", "cut"):
        assert counts["G_sim2real"] < 0.4e6
        assert ("G_real2sim" in counts) == (adaptation == "cyclegan")
    else:
        assert counts["G_sim2real"] > 11e6
    assert cfg.trainer.accelerator in ("cpu", "auto")


@pytest.mark.parametrize("logger", ["wandb", "csv", "none"])
def test_logger_configs(logger, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose_config([f"logger={logger}"])
    if logger == "wandb":
        assert cfg.logger.mode == "offline" and cfg.logger.project == "sim2real-grasp"
        monkeypatch.setenv("WANDB_MODE", "disabled")
        assert compose_config(["logger=wandb"]).logger.mode == "disabled"
    else:
        lg = build_logger(cfg.logger, tmp_path, "abc")
        assert (lg is False) == (logger == "none")


def test_preprocess_labels_follows_the_frame():
    calib = Calibration.load(default_calibration_path())
    view = network_view(calib, (96, 96))
    h, w = 240, 320
    seg = np.zeros((h, w), np.uint8)
    seg[100:140, 150:200] = 5
    rgb = np.zeros((h, w, 3), np.uint8)
    rgb[seg == 5] = 255
    v_seg = preprocess_labels(seg, calib, view)
    v_rgb = preprocess(rgb, calib, view)
    assert v_seg.shape == (96, 96) and v_seg.dtype == np.uint8
    assert set(np.unique(v_seg)) <= {0, 5}  # nearest: no mixed labels
    inside = v_rgb[..., 0] > 200
    assert inside.sum() > 20 and (v_seg[inside] == 5).mean() > 0.95


def test_datamodule_splits_and_augments(adapt_dirs):
    sim, real = adapt_dirs
    dm = AdaptDataModule(sim, real, image_size=(96, 96), crop=(64, 64), batch_size=2, jitter=0.05)
    dm.setup("fit")
    s = dm.summary()
    assert s["n_real_val"] >= 1 and s["n_real_train"] >= 1 and s["n_sim_val"] >= 1
    assert not set(map(str, dm.real_val_paths)) & {str(p) for i, p in enumerate(dm.real_paths) if p not in dm.real_val_paths}
    batch = next(iter(dm.train_dataloader()))
    assert batch["sim"].dtype == torch.uint8 and batch["sim"].shape[1:] == (3, 96, 96)
    fb = {"sim": batch["sim"].float() / 127.5 - 1, "seg": batch["seg"].long(), "real": batch["real"].float() / 127.5 - 1}
    # make the objects visible in the frame so alignment can be checked after the crop
    fb["sim"][:, 0] = torch.where(fb["seg"] >= 2, 1.0, -1.0)
    out = dm.augment(fb)
    assert out["sim"].shape[-2:] == (64, 64) and out["seg"].shape[-2:] == (64, 64)
    assert out["real"].shape[-2:] == (64, 64)
    obj = out["seg"] >= 2
    if obj.any():
        assert (out["sim"][:, 0][obj] > 0.5).float().mean() > 0.95
