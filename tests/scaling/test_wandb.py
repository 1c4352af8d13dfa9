"""Weights & Biases, offline (no network): the pipeline's one run with the evaluation table,
image panels and summary a sweep reads; the trainers joining it; the policy trainer's own
runs with the resolved config, and resume keeping the run id. Runs are read back from their
offline transaction logs (``run-*.wandb``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

EVALUATION = {
    "policy": {
        "randomized": {"successes": 3, "attempts": 4, "rate": 0.75, "rate_ci95": [0.3, 0.95], "clearance": 0.6},
        "target": {"successes": 1, "attempts": 4, "rate": 0.25, "rate_ci95": [0.05, 0.7], "clearance": 0.2},
    },
    "brackets": {
        "oracle": {"successes": 4, "attempts": 4, "rate": 1.0, "rate_ci95": [0.5, 1.0], "clearance": 1.0,
                   "domain": "randomized"},
        "random": {"successes": 0, "attempts": 4, "rate": 0.0, "rate_ci95": [0.0, 0.5], "clearance": 0.0,
                   "domain": "randomized"},
    },
}


def _png(path, seed):
    import cv2

    rgb = np.random.default_rng(seed).integers(0, 255, (24, 32, 3), dtype=np.uint8)
    cv2.imwrite(str(path), rgb)
    return path.name


def test_pipeline_run_logs_table_panels_and_summary_and_trainers_join_it(tmp_path, monkeypatch, wandb_run):
    import wandb

    from adaptation.train import _finish_logger
    from policies.loggers import policy_logger
    from policies.pipeline.run import pipeline_run
    from sim_render.api import compose_config

    monkeypatch.setenv("WANDB_RUN_ID", "sweeprun1")  # as a W&B sweep agent sets it
    out = tmp_path / "pipe"
    cfg = compose_config("pipeline", ["logger=wandb", f"output_dir={out}", "logger.tags=[scaling,test]",
                                      "randomization=strong"])
    assert cfg.logger.mode == "offline"  # WANDB_MODE=offline (conftest); the default is offline too
    with pipeline_run(cfg) as tracking:
        run = wandb.run
        assert run is not None and run.id == "sweeprun1"
        # a trainer of a stage joins the pipeline's run and leaves it open
        stage = policy_logger(cfg.logger, out / "stages" / "policy-x", config={"policy": {"lr": 1}})
        assert stage.logger.experiment is run
        stage.logger.log_metrics({"train/loss": 0.5}, step=1)
        stage.finish()
        _finish_logger(stage.logger, keep=run)  # the translator trainer's rule
        assert wandb.run is run
        out.mkdir(exist_ok=True)
        report = {"evaluation": EVALUATION, "wall_s": 12.0,
                  "figures": {"success": _png(out / "report_success.png", 0), "panels": _png(out / "report_panels.png", 1)},
                  "stages": {"render": {"wall_s": 1.0, "reused": False, "hash": "a"}},
                  "adapt": {"distance": {"adapted_real": 40.0, "sim_real": 80.0, "ratio": 0.5}}}
        summary = tracking.log_report(report, out)
    assert wandb.run is None, "the pipeline's run is finished on exit"
    assert summary["eval/success_rate"] == pytest.approx(4 / 8)
    assert summary["eval/oracle/success_rate"] == 1.0 and summary["adapt/swd_ratio"] == 0.5

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    rec = wandb_run(runs[0])
    assert rec["id"] == "sweeprun1" and rec["project"] == "sim2real-grasp" and rec["job_type"] == "pipeline"
    assert rec["tags"] == ["scaling", "test"]
    assert rec["config"]["budget"]["name"] == "tiny" and rec["config"]["randomization"]["name"] == "strong"
    assert rec["config"]["output_dir"] == str(out)  # the resolved config
    logged = {k: v for h in rec["history"] for k, v in h.items()}
    assert logged["train/loss"] == 0.5
    assert logged["eval/table/_type"] == "table-file" and logged["eval/table/nrows"] == 4
    assert logged["report/panels/_type"] == "image-file" and logged["report/success/_type"] == "image-file"
    assert rec["summary"]["eval/success_rate"] == pytest.approx(0.5)
    assert rec["summary"]["eval/target/success_rate"] == pytest.approx(0.25)
    tables = list(runs[0].glob("files/media/table/eval/table_*.table.json"))
    assert tables, list(runs[0].rglob("*"))
    table = json.loads(tables[0].read_text())
    assert table["columns"][:2] == ["name", "domain"]
    assert [r[:2] for r in table["data"]] == [["policy", "randomized"], ["policy", "target"],
                                              ["oracle", "randomized"], ["random", "randomized"]]


def test_tracking_is_off_for_csv_and_none(tmp_path):
    import wandb

    from policies.loggers import policy_logger
    from policies.pipeline.run import pipeline_run
    from sim_render.api import compose_config

    for name in ("csv", "none"):
        cfg = compose_config("pipeline", [f"logger={name}", f"output_dir={tmp_path / name}"])
        with pipeline_run(cfg) as tracking:
            assert tracking.log_report({"evaluation": EVALUATION}, tmp_path) == {}
        assert wandb.run is None and not (tmp_path / name / "wandb").exists()
    assert policy_logger(None, tmp_path).logger.__class__.__name__ == "CSVLogger"  # as before the group
    assert policy_logger({"name": "none"}, tmp_path).logger is False
    with pytest.raises(KeyError, match="known loggers"):
        policy_logger({"name": "tensorboard"}, tmp_path)


@pytest.mark.slow
def test_policy_trainer_logs_to_wandb_and_resume_keeps_the_run(tiny_data, tmp_path, wandb_run):
    import wandb

    from policies.train import train_policy
    from sim_render.api import compose_config

    out = tmp_path / "run"
    over = ["policy.base=null", "policy.view_size=[64,64]", "policy.network.base_channels=8", "policy.batch_size=2",
            "policy.val_fraction=0.34", "policy.val_every_n_steps=2", "policy.log_every_n_steps=1",
            "logger=wandb", "logger.tags=[ddp-test]"]
    first = train_policy(compose_config("train_policy", [*over, "policy.max_steps=2"]), [tiny_data["sim"]], out,
                         export=False)
    assert wandb.run is None, "the trainer finishes the run it started"
    second = train_policy(compose_config("train_policy", [*over, "policy.max_steps=4"]), [tiny_data["sim"]], out,
                          export=False, ckpt_path=out / "checkpoints" / "last.ckpt")
    assert (first["global_step"], second["global_step"]) == (2, 4)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    recs = [wandb_run(r) for r in runs]
    assert recs[0]["id"] == recs[1]["id"] == (out / ".wandb_run_id").read_text().strip()
    for rec in recs:
        assert rec["project"] == "sim2real-grasp" and rec["tags"] == ["ddp-test"] and rec["job_type"] == "policy"
        assert rec["config"]["policy"]["view_size"] == [64, 64] and rec["config"]["logger"]["name"] == "wandb"
        keys = {k for h in rec["history"] for k in h}
        assert "train/loss" in keys and "val/loss" in keys, keys
    steps = [h["trainer/global_step"] for h in recs[1]["history"] if "train/loss" in h]
    assert steps and min(steps) >= 2, steps  # the resumed run continues the step count
