"""Training entry points: a real Lightning fit on rendered data, resume, the Hydra config, consistency."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from perception.core.artifact import PolicyRunner
from policies.module import GraspPolicyModule
from policies.train import train_policy


def _cfg(overrides=()):
    from sim_render.api import compose_config

    return compose_config("train_policy", [
        "policy.base=null", "policy.view_size=[64,64]", "policy.network.base_channels=8", "policy.batch_size=2",
        "policy.val_fraction=0.34", "policy.val_every_n_steps=2", *overrides,
    ])


def test_config_composes_and_names_its_keys():
    cfg = _cfg()
    p = cfg.policy
    for key in ("view_size", "angle_bins", "network", "targets", "loss", "optim", "batch_size", "max_steps",
                "max_time_s", "accelerator", "quality_threshold"):
        assert key in p, key
    assert cfg.translator is None and list(cfg.dataset_dirs) == []


def test_the_policy_config_is_typed_by_the_schema():
    from hydra.errors import ConfigCompositionException

    from conf.schema import PolicyConfig

    p = _cfg().policy
    assert OmegaConf.get_type(p) is PolicyConfig and OmegaConf.missing_keys(p) == set()
    for bad in ("policy.view.margin=wide", "policy.angle_bins=12.5", "policy.decode.widthmargin=0.05"):
        with pytest.raises(ConfigCompositionException):
            _cfg([bad])
    # Nullable sections and Lightning's own types are kept as written: a count of batches stays an int.
    p = _cfg(["policy.augment=null", "policy.decode.rule={support_px: 2}", "policy.limit_val_batches=2"]).policy
    assert p.augment is None and p.decode.rule.support_px == 2 and p.limit_val_batches == 2
    assert isinstance(p.limit_val_batches, int)


def test_bad_view_and_rule_options_are_refused_before_training(rendered, tmp_path):
    import pytest

    from policies.train import check_policy_config

    with pytest.raises(ValueError, match="view.kind"):
        train_policy(_cfg(["policy.view.kind=sideways"]), [rendered], tmp_path / "a", fast_dev_run=True)
    with pytest.raises(ValueError, match="top-down view"):
        check_policy_config(_cfg(["policy.view.kind=camera", "+policy.decode.rule={support_px: 1}"]))
    with pytest.raises(ValueError, match="unknown keys"):
        check_policy_config(_cfg(["+policy.decode.rule={support: 1}"]))
    with pytest.raises(ValueError, match="mapping"):
        check_policy_config(_cfg(["+policy.decode.rule=yes"]))
    with pytest.raises(ValueError, match="exclusive .*; set policy.decode.fingers_clear=null "
                                         "policy.decode.jaws_on_part=null to use the rule"):
        check_policy_config(_cfg(["+policy.decode.rule={support_px: 1}", "policy.decode.fingers_clear=0.25"]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_policy_config(_cfg(["policy.decode.fingers_clear=2"]))
    with pytest.raises(ValueError, match="set policy.decode.fingers_clear=null policy.decode.jaws_on_part=null for a camera"):
        check_policy_config(_cfg(["policy.view.kind=camera", "policy.geometry=null", "policy.decode.fingers_clear=0.25"]))
    with pytest.raises(ValueError, match=r"jaws_on_part must be a share in \[0, 1\]"):
        check_policy_config(_cfg(["policy.decode.jaws_on_part=-0.5"]))
    with pytest.raises(ValueError, match="jaws_on_part and policy.decode.rule are exclusive"):
        check_policy_config(_cfg(["+policy.decode.rule={support_px: 1}", "policy.decode.fingers_clear=null",
                                  "policy.decode.jaws_on_part=0.75"]))
    with pytest.raises(ValueError, match=r"sweep_depth must be in \[0, 0.05\] m"):
        check_policy_config(_cfg(["policy.decode.sweep_depth=0.2"]))
    # The schema refuses a word where metres go when the config is composed; a config read from a
    # file (not composed) still meets check_policy_config's own message.
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="sweep_depth"):
        _cfg(["policy.decode.sweep_depth=deep"])
    from_file = OmegaConf.to_container(_cfg().policy)
    from_file["decode"]["sweep_depth"] = "deep"
    with pytest.raises(ValueError, match="sweep_depth must be a number of metres"):
        check_policy_config(from_file)
    with pytest.raises(ValueError, match="sweep_depth and policy.decode.rule are exclusive"):
        check_policy_config(_cfg(["+policy.decode.rule={support_px: 1}", "policy.decode.fingers_clear=null",
                                  "policy.decode.jaws_on_part=null", "policy.decode.sweep_depth=0.02"]))
    with pytest.raises(ValueError, match="policy.decode.sweep_depth=null for a camera"):
        check_policy_config(_cfg(["policy.view.kind=camera", "policy.geometry=null", "policy.decode.sweep_depth=0.02"]))
    check_policy_config(_cfg(["policy.decode.sweep_depth=0.02"]))  # a table view takes it beside the shares
    # a table view takes the rule
    check_policy_config(_cfg(["+policy.decode.rule={support_px: 1}", "policy.decode.fingers_clear=null",
                              "policy.decode.jaws_on_part=null"]))
    assert not (tmp_path / "a").exists()


def test_fast_dev_run_fits_and_exports(rendered, tmp_path, calib):
    out = tmp_path / "run"
    summary = train_policy(_cfg(), [rendered], out, fast_dev_run=True)
    assert summary["global_step"] == 1
    assert (out / "policy.ckpt").is_file() and (out / "config.yaml").is_file()
    assert json.loads((out / "train_summary.json").read_text())["artifact"] == str(out / "artifact")
    assert any(k.startswith("val/") for k in summary["metrics"]) and any(k.startswith("train/") for k in summary["metrics"])
    for v in summary["metrics"].values():
        assert np.isfinite(v)
    module = GraspPolicyModule.load_from_checkpoint(out / "policy.ckpt", map_location="cpu")
    assert module.hparams["config"]["policy"]["view_size"] == [64, 64]
    runner = PolicyRunner(out / "artifact")
    assert runner.meta.input_size == (64, 64)
    maps = runner.infer(np.zeros((calib.height, calib.width, 3), np.uint8))
    assert np.isfinite(maps.quality).all()
    assert maps.surface is not None and maps.surface.shape == (64, 64) and (maps.surface >= 0).all()


def test_resume_continues_the_step_count(rendered, tmp_path):
    out = tmp_path / "run"
    first = train_policy(_cfg(["policy.max_steps=2"]), [rendered], out, export=False)
    assert first["global_step"] == 2
    second = train_policy(_cfg(["policy.max_steps=4"]), [rendered], out, export=False,
                          ckpt_path="last")
    assert second["global_step"] == 4
    # A checkpoint cut short (a kill, a full disk) is refused by name, not with torch's traceback.
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes((out / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut short"):
        train_policy(_cfg(["policy.max_steps=6"]), [rendered], out, export=False, ckpt_path=cut)


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_training_that_worsens_the_held_out_frames_keeps_the_start_weights(rendered, tmp_path):
    start = train_policy(_cfg(["policy.max_steps=6"]), [rendered], tmp_path / "start", export=False)
    # A learning rate that wrecks the network: every validation after the start is worse.
    wrecked = train_policy(_cfg(["policy.max_steps=4", "policy.optim.lr=50.0", "policy.optim.warmup_steps=0"]),
                           [rendered], tmp_path / "wrecked", init_from=start["checkpoint"])
    kept = wrecked["kept"]
    assert kept["by"] == "val/quality_loss" and kept["step"] == 0 and kept["last_step"] == 4
    assert kept["value"] < kept["last_value"] and wrecked["metrics"]["val/quality_loss"] == kept["value"]
    saved, first = _weights(tmp_path / "wrecked" / "policy.ckpt"), _weights(start["checkpoint"])
    assert all(torch.equal(saved[k], first[k]) for k in first)  # policy.ckpt: the start, unchanged
    last = _weights(tmp_path / "wrecked" / "checkpoints" / "last.ckpt")
    assert not all(torch.equal(last[k], first[k]) for k in first)  # last.ckpt: where training got, to resume
    meta = json.loads((tmp_path / "wrecked" / "artifact" / "metadata.json").read_text())
    assert meta["training"]["kept"]["step"] == 0
    # The artifact is exported from the kept weights: its maps are not those of the last weights' artifact.
    frame = np.random.default_rng(0).integers(0, 255, (120, 160, 3), np.uint8)
    again = train_policy(_cfg(["policy.max_steps=4", "policy.optim.lr=50.0", "policy.optim.warmup_steps=0",
                               "policy.keep_best_by=null"]), [rendered], tmp_path / "last", init_from=start["checkpoint"])
    assert again["kept"] is None
    wrecked_maps = PolicyRunner(tmp_path / "wrecked" / "artifact").infer(frame).quality
    assert not np.allclose(wrecked_maps, PolicyRunner(tmp_path / "last" / "artifact").infer(frame).quality)


def test_kept_weights_are_the_lowest_validation_and_a_bad_metric_is_named(rendered, tmp_path):
    summary = train_policy(_cfg(["policy.max_steps=6"]), [rendered], tmp_path / "run", export=False)
    import csv

    rows = [r for r in csv.DictReader(open(next((tmp_path / "run" / "logs").rglob("metrics.csv"))))
            if r.get("val/quality_loss")]
    logged = {int(r["step"]): float(r["val/quality_loss"]) for r in rows}
    assert 0 in logged and len(logged) >= 3  # the start, the validations, the end
    assert summary["kept"]["value"] == pytest.approx(min(logged.values()), rel=1e-6)
    with pytest.raises(ValueError, match="keep_best_by='val/nothing' is not a validation metric; one of: .*val/loss"):
        train_policy(_cfg(["policy.max_steps=2", "policy.keep_best_by=val/nothing"]), [rendered], tmp_path / "bad",
                     export=False)


def test_adapted_training_uses_the_translator(rendered, tmp_path):
    calls = []

    def translator(x):
        calls.append(x.shape)
        return x[..., ::-1].copy()  # swap R and B: a stand-in "domain"

    summary = train_policy(_cfg(), [rendered], tmp_path / "run", translator=translator, fast_dev_run=True,
                           export=False)
    assert calls and calls[0][1:] == (64, 64, 3)
    assert summary["adapted"] is True


def test_consistency_finetune_moves_the_generator_only(rendered, view):
    from adaptation.networks import build_generator
    from policies.consistency import consistency_finetune
    from policies.data import PolicyFrames
    from policies.networks import GraspNet

    torch.manual_seed(0)
    gen = build_generator("fast")
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy = GraspNet(angle_bins=6, base_channels=8)
    g0 = [p.detach().clone() for p in gen.parameters()]
    p0 = [p.detach().clone() for p in policy.parameters()]
    res = consistency_finetune(gen, policy, PolicyFrames(rendered, view=view, angle_bins=6), steps=2, batch_size=2)
    assert res["steps"] == 2 and np.isfinite(res["disagreement_after"])
    assert any(not torch.equal(a, b) for a, b in zip(g0, gen.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(p0, policy.parameters()))
    assert all(p.requires_grad for p in policy.parameters())


@pytest.mark.slow  # about 30 s: a training command in a subprocess: the fast tier must stay under 10 minutes
def test_train_cli_fast_dev_run(rendered, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("sim2real-train-policy")
    out = tmp_path / "cli"
    proc = subprocess.run(
        [str(exe), f"dataset_dirs=[{rendered}]", f"output_dir={out}", "fast_dev_run=true",
         "policy.base=null", "policy.view_size=[64,64]", "policy.network.base_channels=8", "policy.batch_size=2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "artifact" / "metadata.json").is_file()


def test_train_cli_refuses_no_data(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("sim2real-train-policy")
    proc = subprocess.run([str(exe), f"output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "dataset_dirs" in proc.stderr


def test_time_budget_fits_the_cosine_schedule_to_the_pace():
    module = GraspPolicyModule(network={"angle_bins": 4, "base_channels": 4},
                               optim={"lr": 1e-3, "max_steps": 100000, "max_time_s": 10.0, "warmup_steps": 5})
    sched = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert module._horizon == 100000
    module._t_start, module._step_start = 100.0, 0
    module.update_horizon(20, 102.0)  # 20 steps in 2 s: 0.1 s per step, 8 s left
    assert 90 <= module._horizon <= 110
    assert sched.lr_lambdas[0](module._horizon) < 0.06  # the schedule ends with the budget


def test_the_old_resume_key_names_the_new_one(monkeypatch, capsys):
    from policies.train import main

    monkeypatch.setattr("sys.argv", ["sim2real-train-policy", "dataset_dirs=[x]", "resume=out/checkpoints/last.ckpt"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "ckpt_path=" in capsys.readouterr().err


def test_a_switched_on_augment_section_is_typed_when_checked():
    from policies.train import check_policy_config

    check_policy_config(_cfg(["policy.augment={hflip: 0.0}"]))  # partial: the rest comes from conf/
    with pytest.raises(ValueError, match="policy.augment.shift_px"):
        check_policy_config(_cfg(["policy.augment={hflip: 0.5, shift_px: lots}"]))
    with pytest.raises(ValueError, match="policy.augment.*flip"):
        check_policy_config(_cfg(["policy.augment=null", "policy.augment={flip: 0.5}"]))  # switched off, then on


@pytest.mark.parametrize("bad", [
    {"blur": 2},
    {"neighbourhood_px": -1},
    {"neighbourhood_px": "wide"},
    {"width_margin": 1.5},
    {"on_part_px": -1},
    {"fingers_clear": 2},
    {"jaws_on_part": "much"},
    {"sweep_depth": 0.2},
    {"part_centre": -0.5},
    {"rule": {"support": 1}},
    {"rule": {}, "jaws_on_part": 0.75},
])
def test_decode_options_are_checked_in_one_place(tmp_path, bad):
    """The same bad decode mapping, in a policy config and in an artifact's metadata.json, is
    refused with the same words: one validator (DecodeOptions.from_dict), only the way each
    names the key differs (policy.decode.KEY, 'decode.KEY'). A second check anywhere, worded
    or ranged its own way, fails this."""
    import shutil

    from perception.core.artifact import ArtifactError, load_metadata
    from perception.core.decode import DecodeOptions, DecodeOptionsError
    from perception.core.testing import make_test_artifact
    from policies.train import check_policy_config

    with pytest.raises(DecodeOptionsError) as want:
        DecodeOptions.from_dict(bad, threshold=0.5)
    policy = OmegaConf.to_container(_cfg().policy)
    policy["decode"] = bad
    with pytest.raises(ValueError) as config:
        check_policy_config(policy)
    art = tmp_path / "a"
    shutil.copytree(make_test_artifact(tmp_path / "art"), art)
    meta = json.loads((art / "metadata.json").read_text())
    meta["decode"] = bad
    (art / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError) as artifact:
        load_metadata(art)

    def problem(message: str, names: list[str]) -> str:
        """The words after the names of the keys."""
        at = [message.find(n) for n in names]
        assert all(i >= 0 for i in at), (message, names)
        return message[at[-1] + len(names[-1]):].strip()

    keys = list(want.value.keys)
    from_config = problem(str(config.value), [f"policy.decode.{k}" for k in keys] or ["policy.decode"])
    from_artifact = problem(str(artifact.value), [f"'decode.{k}'" for k in keys] or ["'decode'"])
    # The config's message may add what to set there ("; set policy.decode.X=null to use the rule").
    assert from_config.split("; set policy.decode.")[0] == from_artifact == want.value.problem


def test_the_config_names_the_network_and_optimizer_classes():
    """``_target_`` picks the class (as Hydra's instantiate reads it); without one, the class a
    checkpoint or base saved before the configs named it was built with."""
    import torch

    from policies.module import GraspPolicyModule
    from policies.networks import GeometryNet, GraspNet, build_network, configured_class

    net = {"base_channels": 4, "dilations": [2]}
    assert type(build_network(net, GraspNet)) is GraspNet
    assert type(build_network({"_target_": "policies.networks.GraspNet", **net}, GraspNet)) is GraspNet
    with pytest.raises(ValueError, match="is not a policies.networks.GraspNet"):
        build_network({"_target_": "policies.networks.GeometryNet", **net}, GraspNet, "policy.network")
    with pytest.raises(ValueError, match="does not name an importable class"):
        configured_class({"_target_": "policies.networks.NoSuchNet"}, GeometryNet, "geometry.network")
    module = GraspPolicyModule(network={**net, "angle_bins": 4},
                               optim={"_target_": "torch.optim.SGD", "lr": 0.01, "weight_decay": 0.0,
                                      "scheduler": "none"})
    assert type(module.configure_optimizers()) is torch.optim.SGD
    assert type(GraspPolicyModule(network={**net, "angle_bins": 4}, optim={"scheduler": "none"})
                .configure_optimizers()) is torch.optim.AdamW
