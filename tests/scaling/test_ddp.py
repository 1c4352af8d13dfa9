"""Lightning DDP (``trainer=ddp``) on two CPU processes (gloo) for both trainers: the run
finishes, only rank 0 writes checkpoints, logs and reports, and its checkpoint resumes on one
process. The trainers run as their console scripts, as a user starts them: Lightning starts
rank 1 by running the same command line again."""

from __future__ import annotations

import json

import pytest
import torch

DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.enable_progress_bar=false"]

#: overrides that keep a translator run to seconds (as in tests/adaptation)
ADAPT_TINY = ["metrics.probe.steps=5", "metrics.swd.patches_per_image=16", "metrics.swd.directions=32",
              "metrics.swd.repeats=1", "log_images_every_n_steps=2", "adaptation.batch_size=1"]

POLICY_TINY = ["policy.base=null", "policy.view_size=[64,64]", "policy.network.base_channels=8", "policy.batch_size=2",
               "policy.val_fraction=0.34", "policy.val_every_n_steps=2"]


def _rank_one_wrote_only_its_job_log(writes: dict[str, list[str]]) -> None:
    """Rank 1 writes nothing but Hydra's per-process job log (``train_ddp_process_1.log``,
    which Lightning names for it); rank 0 wrote the checkpoints (the watch works)."""
    assert any(p.startswith("checkpoints/") for p in writes.get("0", [])), writes
    others = [p for rank, paths in writes.items() if rank != "0" for p in paths]
    assert all(p.startswith(".hydra_runs/") and p.endswith("train_ddp_process_1.log") for p in others), others


@pytest.mark.slow
def test_adapt_ddp_two_processes_then_resume_on_one(tiny_data, tmp_path, cli, rank_writes, wandb_run):
    from adaptation.train import compose_config, train

    out = tmp_path / "adapt"
    env, writes = rank_writes(out)
    args = [f"sim_dir={tiny_data['sim']}", f"real_dir={tiny_data['real']}", f"output_dir={out}", *ADAPT_TINY]
    res = cli("sim2real-adapt", *args, *DDP, "logger=wandb", "max_steps=3", "val_every_n_steps=2", env=env)
    assert "distance to real" in res.stdout
    _rank_one_wrote_only_its_job_log(writes())
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 6  # 3 iterations x (generator + discriminator step), same on each rank
    assert ckpt["hyper_parameters"]["config"]["trainer"]["strategy"].startswith("ddp")
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 3 and report["data"]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one W&B run: rank 0's
    rec = wandb_run(runs[0])
    assert rec["id"] == report["wandb_run_id"] and rec["project"] == "sim2real-grasp"
    assert rec["config"]["config"]["trainer"]["devices"] == 2  # the resolved config went with the run
    assert any("val/swd_adapted_real" in h for h in rec["history"])
    assert any(h.get("val/panels/_type") == "images/separated" for h in rec["history"])  # panels as W&B media

    # resume the DDP checkpoint on one process (in this one)
    second = train(compose_config([*args, "trainer=cpu", "trainer.enable_progress_bar=false", "logger=csv",
                                   "max_steps=5", "val_every_n_steps=2", "ckpt_path=last"]))
    assert second["resumed_from_step"] == 3 and second["steps"] == 5
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 10


@pytest.mark.slow
def test_policy_ddp_two_processes_then_resume_on_one(tiny_data, tmp_path, cli, rank_writes):
    from policies.train import train_policy
    from sim_render.api import compose_config

    out = tmp_path / "policy"
    env, writes = rank_writes(out)
    res = cli("sim2real-train-policy", f"dataset_dirs=[{tiny_data['sim']}]", f"output_dir={out}", *POLICY_TINY,
              *DDP, "policy.max_steps=4", env=env)
    assert "trained 4 steps" in res.stdout
    _rank_one_wrote_only_its_job_log(writes())
    for name in ("policy.ckpt", "config.yaml", "train_summary.json", "artifact/policy.onnx", "artifact/metadata.json",
                 "logs/metrics.csv", "checkpoints/last.ckpt"):
        assert (out / name).is_file(), name
    assert [p.name for p in (out / "logs").iterdir() if p.is_dir()] == []  # one CSV log, no per-rank version
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 4 and summary["artifact"] == str(out / "artifact")
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["config"]["policy"]["view_size"] == [64, 64]

    # resume the DDP checkpoint on one process (in this one)
    cfg = compose_config("train_policy", [*POLICY_TINY, "policy.max_steps=6"])
    second = train_policy(cfg, [tiny_data["sim"]], out, ckpt_path=out / "checkpoints" / "last.ckpt", export=False)
    assert second["global_step"] == 6
