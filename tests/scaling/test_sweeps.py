"""W&B sweep files (conf/sweeps/*.yaml): every run a sweep can launch composes.

Each sweep point is turned into a command line exactly as ``wandb agent`` does it (wandb's own
``create_sweep_command`` / ``create_sweep_command_args``, ``${args_no_hyphens}``), and its Hydra
overrides are composed against the entry point's config and resolved, in the environment an
agent gives a run (``WANDB_SWEEP_ID``, ``WANDB_RUN_ID``). Values: every ``values`` entry, and
``min``, ``max`` and the middle of each distribution; grid sweeps: every point of the grid.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

SWEEPS = sorted((Path(__file__).parents[2] / "conf" / "sweeps").glob("*.yaml"))

#: console script -> its config (conf/NAME.yaml)
ENTRY_CONFIGS = {"sim2real-adapt": "adapt", "sim2real-pipeline": "pipeline", "sim2real-train-policy": "train_policy"}

AGENT_ENV = {"WANDB_SWEEP_ID": "sw33p1d", "WANDB_RUN_ID": "run0001", "SIM2REAL_SIM_DIR": "/data/sim",
             "SIM2REAL_REAL_DIR": "/data/real"}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _param_values(spec: dict) -> list:
    """The values of one sweep parameter that the test composes."""
    if "value" in spec:
        return [spec["value"]]
    if "values" in spec:
        return list(spec["values"])
    lo, hi = spec["min"], spec["max"]
    dist = spec.get("distribution", "uniform")
    if dist in ("log_uniform_values", "q_log_uniform_values"):
        mid = math.sqrt(lo * hi)
    elif dist in ("int_uniform", "q_uniform"):
        mid = (lo + hi) // 2
    else:
        mid = (lo + hi) / 2
    return [lo, mid, hi]


def _points(sweep: dict) -> list[dict]:
    """Sweep points: the whole grid of a grid sweep; else each value of each parameter with the
    others at their first value."""
    params = {k: _param_values(v) for k, v in sweep["parameters"].items()}
    if sweep["method"] == "grid":
        keys = list(params)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(params[k] for k in keys))]
    base = {k: v[0] for k, v in params.items()}
    return [base] + [{**base, k: v} for k, vals in params.items() for v in vals[1:]]


def _agent_command(sweep: dict, point: dict, monkeypatch) -> list[str]:
    """The argv ``wandb agent`` runs for ``point`` (wandb/wandb_agent.py ``_command_run``)."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    command = sweep_utils.create_sweep_command(list(sweep["command"]))
    sweep_vars = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    sweep_vars.update(interpreter=["python"], program=[sweep["program"]], env=["/usr/bin/env"])
    argv: list[str] = []
    for c in map(str, command):
        argv += (sweep_vars.get(c[2:-1]) or []) if c.startswith("${") and c.endswith("}") else [c]
    return argv


def _compose(config_name: str, overrides: list[str]):
    from sim_render.api import compose_config

    return compose_config(config_name, overrides)


@pytest.fixture(autouse=True)
def _hydra():
    """One Hydra initialisation for all the composes of a test (compose_config reuses it)."""
    from hydra import initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        yield


def test_there_are_sweeps_for_the_translator_and_the_policy():
    programs = {_load(p)["program"] for p in SWEEPS}
    assert {"sim2real-adapt", "sim2real-pipeline"} <= programs, [p.name for p in SWEEPS]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_file_is_a_wandb_sweep(path):
    sweep = _load(path)
    assert sweep["program"] in ENTRY_CONFIGS, sweep["program"]
    assert sweep["method"] in ("grid", "random", "bayes")
    assert sweep["metric"]["goal"] in ("minimize", "maximize") and sweep["metric"]["name"]
    cmd = [str(c) for c in sweep["command"]]
    assert "${args_no_hyphens}" in cmd, "runs must take the sweep's values as Hydra overrides"
    assert "logger=wandb" in cmd and "logger.mode=online" in cmd, "a sweep run reports to the sweep"
    assert any(c.startswith("output_dir=") and "WANDB_RUN_ID" in c for c in cmd), "one output_dir per run"
    for name, spec in sweep["parameters"].items():
        kinds = [k for k in ("value", "values", "distribution") if k in spec]
        assert kinds in (["value"], ["values"], ["distribution"]) or ("min" in spec and "max" in spec), name
        if "distribution" in spec or "min" in spec:
            assert spec["min"] < spec["max"], name
            assert sweep["method"] != "grid", f"{name}: a grid sweep cannot draw from a distribution"


@pytest.mark.slow  # composes every point of every sweep (about 25 s): the fast tier must stay under 10 minutes
@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_sweep_point_composes(path, monkeypatch):
    from sim_render.api import render_config
    from sim_render.randomization import validate_profile

    for k, v in AGENT_ENV.items():
        monkeypatch.setenv(k, v)
    sweep = _load(path)
    config_name = ENTRY_CONFIGS[sweep["program"]]
    points = _points(sweep)
    assert points
    checked: set[tuple] = set()
    for point in points:
        argv = _agent_command(sweep, point, monkeypatch)
        assert argv[:2] == ["/usr/bin/env", sweep["program"]], argv
        overrides = argv[2:]
        try:
            cfg = _compose(config_name, overrides)
            resolved = OmegaConf.to_container(cfg, resolve=True)
        except Exception as exc:  # noqa: BLE001 - name the sweep point in the failure
            pytest.fail(f"{path.name}: {overrides} does not compose: {exc}")
        for key, value in point.items():  # the value reached the config (groups: by their name)
            node = OmegaConf.select(cfg, key)
            got = node.name if OmegaConf.is_config(node) and "name" in node else node
            assert got == value, f"{path.name}: {key}={value!r} gave {got!r}"
        assert resolved["logger"]["name"] == "wandb" and resolved["logger"]["mode"] == "online"
        assert resolved["output_dir"].endswith(f"{AGENT_ENV['WANDB_SWEEP_ID']}/{AGENT_ENV['WANDB_RUN_ID']}")
        if config_name == "adapt":
            assert resolved["sim_dir"] == AGENT_ENV["SIM2REAL_SIM_DIR"]
        if config_name == "pipeline":  # the render overrides the pipeline passes on compose too
            render_over = (*cfg.budget.render.overrides, *cfg.randomization.overrides)
            if render_over not in checked:
                validate_profile(render_config("/tmp/unused", 4, "randomized", 0, None, list(render_over)).render)
                checked.add(render_over)


def test_sweep_metrics_are_what_the_runs_log():
    from policies.pipeline.run import eval_summary

    evaluation = {
        "policy": {d: {"successes": 1, "attempts": 2, "rate": 0.5, "rate_ci95": [0.1, 0.9], "clearance": 0.5}
                   for d in ("randomized", "target")},
        "brackets": {"oracle": {"successes": 2, "attempts": 2, "rate": 1.0, "rate_ci95": [0.3, 1.0],
                                "clearance": 1.0, "domain": "randomized"}},
    }
    pipeline_keys = set(eval_summary(evaluation))
    for path in SWEEPS:
        sweep = _load(path)
        name = sweep["metric"]["name"]
        if sweep["program"] == "sim2real-pipeline":
            assert name in pipeline_keys, (path.name, sorted(pipeline_keys))
        elif sweep["program"] == "sim2real-adapt":  # logged by adaptation.module each validation
            assert name in ("val/swd_adapted_real", "val/swd_ratio", "val/content_object_iou"), name


@pytest.mark.parametrize("level", sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "randomization").glob("*.yaml")))
def test_randomization_levels_are_valid_profiles(level):
    from sim_render.api import render_config
    from sim_render.randomization import validate_profile

    cfg = _compose("pipeline", [f"randomization={level}"])
    assert cfg.randomization.name == level
    validate_profile(render_config("/tmp/unused", 4, "randomized", 0, None, list(cfg.randomization.overrides)).render)


def test_a_sweep_agents_run_id_is_the_run_id(monkeypatch):
    from adaptation.train import _new_run_id
    from policies.loggers import wandb_run_id

    monkeypatch.setenv("WANDB_RUN_ID", "agentrun")
    assert _new_run_id() == "agentrun" and wandb_run_id() == "agentrun" and wandb_run_id("saved") == "agentrun"
    monkeypatch.delenv("WANDB_RUN_ID")
    assert _new_run_id() != _new_run_id() and wandb_run_id("saved") == "saved"
