"""Every command's command line: ``--help`` lists the config groups it composes, and a value
of the wrong type stops it with exit 2 and the key's name (a real Hydra compose)."""

from __future__ import annotations

import pytest

from conf import REMOVED_KEYS
from perception.core.cli import check_override_types, compose_config, config_groups, help_text

CONFIGS = ["pipeline", "render", "adapt", "train_policy", "base", "eval", "serve", "grasp_loop", "capture",
           "translate", "calibrate_intrinsics", "calibrate_handeye"]


@pytest.mark.parametrize("name", CONFIGS)
def test_help_lists_only_the_groups_the_command_composes(name):
    text = help_text(name, f"sim2real-{name}")
    assert f"conf/{name}.yaml" in text
    assert "  sweeps:" not in text and "  hydra" not in text  # conf/sweeps holds W&B sweeps, not a group
    for group, (choice, options) in config_groups(name).items():
        assert f"  {group}: " in text and choice in (*options, "null")


def test_the_pipeline_groups_are_its_defaults_list():
    groups = config_groups("pipeline")
    assert {"budget", "adaptation", "adaptation/generator", "policy", "randomization", "logger"} == set(groups)
    assert groups["budget"] == ("tiny", ["full", "small", "tiny"])


@pytest.mark.parametrize("name, override, key, kind", [
    ("pipeline", "seed=abc", "seed", "a number"),
    ("pipeline", "budget=small", None, None),          # a group choice, not a value
    ("render", "n_scenes=many", "n_scenes", "a number"),
    ("train_policy", "seed=x", "seed", "a number"),
    ("eval", "keep_episodes=3", "keep_episodes", "true or false"),
    ("serve", "port=abc", "port", "a number"),
    ("serve", "limits.body_timeout_s=0.5", None, None),  # an int default takes a float
    ("grasp_loop", "rate_hz=fast", "rate_hz", "a number"),
    ("translate", "raw=2", "raw", "true or false"),
    ("pipeline", "seed=1,2", None, None),              # a sweep is Hydra's to expand
])
def test_a_value_of_the_wrong_type_names_its_key(name, override, key, kind, capsys):
    if key is None:
        check_override_types(name, [override], "prog")
        return
    with pytest.raises(SystemExit) as exc:
        check_override_types(name, [override], "prog")
    assert exc.value.code == 2
    assert f"prog: error: {key} must be {kind}" in capsys.readouterr().err


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_no_removed_key_is_still_in_a_config(key):
    """A key in conf.REMOVED_KEYS is gone from every command's composed config (with every
    budget), so the refusal below never hides a key that still works."""
    from omegaconf import OmegaConf

    for name in CONFIGS:
        budgets = [[f"budget={b}"] for b in ("tiny", "small", "full")] if "budget" in config_groups(name) else [[]]
        for overrides in budgets:
            cfg = compose_config(name, overrides, "prog")
            assert OmegaConf.select(cfg, key, default="absent") == "absent", (name, overrides)


def test_a_removed_key_is_refused_with_its_replacement(tmp_path):
    """A removed key on a real command line: exit 2, the key and what replaces it, no run
    folder made (Hydra alone would say "not in struct" and name nothing)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "from policies.pipeline import main; main()", f"output_dir={out}",
           "budget.time_limit_s=100"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "budget.time_limit_s is no longer a config key" in res.stderr and "docs/benchmarks.md" in res.stderr
    assert not out.exists()
    with pytest.raises(SystemExit) as exc:
        compose_config("render", ["+profile=target"], "prog")
    assert exc.value.code == 2


@pytest.mark.parametrize("name, override, group", [
    ("pipeline", "budget=huge", "budget"),
    ("base", "experiment=nope", "experiment"),
    ("render", "render=nope", "render"),
    ("pipeline", "adaptation/generator=nope", "adaptation/generator"),
])
def test_an_option_a_group_does_not_have_is_refused_with_the_ones_it_has(name, override, group, capsys):
    with pytest.raises(SystemExit) as exc:
        check_override_types(name, [override], f"sim2real-{name}")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "no such option" in err
    for option in config_groups(name)[group][1]:
        assert option in err
    check_override_types(name, [f"{group}={config_groups(name)[group][1][0]}"], f"sim2real-{name}")  # one it has


def test_a_policy_key_the_budget_sets_is_refused_on_the_command_line(tmp_path):
    """``policy.max_steps=1`` with ``budget=tiny``: the budget's 150 replaced it in the policy
    stage without a word; now exit 2 before any stage, naming the override that works."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "from policies.pipeline import main; main()", f"output_dir={out}", "budget=tiny",
           "policy.max_steps=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "policy.max_steps=1" in res.stderr and "budget.policy.max_steps=" in res.stderr
    assert not (out / "stages").exists()  # no stage ran
    from omegaconf import OmegaConf

    from policies.pipeline.flow import check_budget_overrides
    cfg = OmegaConf.create({"budget": {"name": "tiny", "policy": {"max_steps": 150, "max_time_s": 35}}})
    check_budget_overrides(cfg, ["budget.policy.max_steps=1", "policy.lr=0.1", "policy.base=null"])  # these are used
    with pytest.raises(ValueError, match="budget.policy.max_time_s"):
        check_budget_overrides(cfg, ["++policy.max_time_s=9"])
