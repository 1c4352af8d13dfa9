"""sim2real-adapt end to end on tiny data: smoke run, resume, content loss, bad inputs."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from adaptation.images import RealFramesError
from adaptation.train import compose_config, train

#: overrides that keep every run to seconds on 2 CPU cores
TINY = [
    "trainer=cpu",
    "trainer.enable_progress_bar=false",
    "metrics.probe.steps=5",
    "metrics.swd.patches_per_image=16",
    "metrics.swd.directions=32",
    "metrics.swd.repeats=1",
    "log_images_every_n_steps=2",
]


def _cfg(sim, real, out, *extra):
    return compose_config([f"sim_dir={sim}", f"real_dir={real}", f"output_dir={out}", *TINY, *extra])


VARIANTS = {
    "default": [],
    "seg_content_identity": ["adaptation.loss.content_seg=0.5", "adaptation.loss.identity=0.5"],
    "cut": ["adaptation=cut"],
    "cut_resnet9_small": ["adaptation=cut", "adaptation/generator=resnet9", "adaptation.generator.ngf=8",
                          "adaptation.generator.n_blocks=1", "adaptation.loss.nce_identity=1"],
    "resnet9_small": ["adaptation=cyclegan_resnet9", "adaptation.generator.ngf=8", "adaptation.generator.n_blocks=1",
                      "adaptation.discriminator.ndf=8"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fast_dev_run_writes_generator_panels_and_report(adapt_dirs, tmp_path, variant):
    sim, real = adapt_dirs
    out = tmp_path / "run"
    report = train(_cfg(sim, real, out, "fast_dev_run=true", "logger=none", *VARIANTS[variant]))
    assert (out / "generator.pt").is_file() and (out / "generator.json").is_file()
    assert (out / "config.yaml").is_file()
    assert list((out / "panels").glob("train_sim2real_*.png")) and list((out / "panels").glob("val_sim2real_*.png"))
    two_sided = not variant.startswith("cut")
    assert bool(list((out / "panels").glob("val_real2sim_*.png"))) == two_sided
    saved = json.loads((out / "report.json").read_text())
    assert saved["distance"]["adapted_real"] > 0 and saved["distance"]["sim_real"] > 0
    assert "object_iou" in saved["content"] and report["steps"] == 1


def test_resume_continues_the_step_and_keeps_the_wandb_run(adapt_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sim, real = adapt_dirs
    out = tmp_path / "run"
    first = train(_cfg(sim, real, out, "max_steps=3", "val_every_n_steps=2", "logger=wandb"))
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 6  # 3 iterations x (generator + discriminator step)
    assert ckpt["hyper_parameters"]["config"]["adaptation"]["generator"]["name"] == "fast"
    assert (out / "checkpoints" / "best.ckpt").is_file()
    second = train(_cfg(sim, real, out, "max_steps=5", "val_every_n_steps=2", "logger=wandb", "ckpt_path=last"))
    assert second["resumed_from_step"] == 3 and second["steps"] == 5
    assert second["wandb_run_id"] == first["wandb_run_id"]
    runs = list((out / "wandb").glob(f"*-{first['wandb_run_id']}"))
    assert runs, list((out / "wandb").iterdir())
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 10


def _csv_metric(out, key):
    rows = list(csv.DictReader(open(next((out / "csv").glob("version_*/metrics.csv")))))
    return [float(r[key]) for r in rows if r.get(key)]


@pytest.mark.slow  # about 15 s of training: the fast tier must stay under 10 minutes
def test_content_loss_falls_on_a_tiny_overfit_run(adapt_dirs, tmp_path):
    # a generator that does not start as the identity, so the content loss starts high
    sim, real = adapt_dirs
    out = tmp_path / "run"
    train(_cfg(
        sim, real, out, "logger=csv", "max_steps=30", "val_every_n_steps=1000", "final_validation=false",
        "log_every_n_steps=1", "log_images_every_n_steps=0", "adaptation.generator.residual=false",
        "adaptation.optim.lr=0.002", "adaptation.optim.decay_start=1.0", "adaptation.loss.content_pmse=50", "adaptation.flip=false",
        "adaptation.jitter=0", "adaptation.image_size=[64,64]", "adaptation.crop=[64,64]",
    ))
    pmse = _csv_metric(out, "train/loss_content_pmse")
    assert len(pmse) >= 25
    first, last = sum(pmse[:5]) / 5, sum(pmse[-5:]) / 5
    print("content loss", first, last)
    assert last < 0.5 * first, (first, last)


def test_adaptation_none_trains_nothing(tmp_path):
    assert train(compose_config(["adaptation=none", f"output_dir={tmp_path}"])) == {"adaptation": "none"}


@pytest.mark.parametrize("case", ["missing", "empty", "unreadable", "wrong_size"])
def test_bad_real_dir_stops_with_its_message(adapt_dirs, tmp_path, case):
    import cv2
    import numpy as np

    sim, _ = adapt_dirs
    real = tmp_path / "real"
    if case != "missing":
        real.mkdir()
    if case == "unreadable":
        (real / "frame_0.png").write_bytes(b"\x89PNG garbage")
    if case == "wrong_size":
        cv2.imwrite(str(real / "frame_0.png"), np.zeros((100, 120, 3), np.uint8))
    expected = {
        "missing": "does not exist",
        "empty": "holds no",
        "unreadable": r"frame_0\.png is not a readable",
        "wrong_size": r"frame_0\.png is 120x100 but the calibration's image_size is 640x480",
    }[case]
    with pytest.raises(RealFramesError, match=expected):
        train(_cfg(sim, real, tmp_path / "out", "logger=none"))


def test_cli_reports_bad_input_and_exits_2(adapt_dirs, tmp_path, monkeypatch, capsys):
    from adaptation import train as train_mod

    sim, _ = adapt_dirs
    (tmp_path / "real").mkdir()
    monkeypatch.setattr(
        sys, "argv",
        ["sim2real-adapt", f"sim_dir={sim}", f"real_dir={tmp_path / 'real'}", f"output_dir={tmp_path / 'out'}", "logger=none"],
    )
    with pytest.raises(SystemExit) as exc:
        train_mod.main()
    assert exc.value.code == 2
    assert "holds no *.png or *.jpg frames" in capsys.readouterr().err
