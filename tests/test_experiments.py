"""The documented runs as configs (``conf/experiment/*.yaml``, issue 37): each composes with
``sim2real-train-base``'s config, every value it sets is the one the command runs with (over
``conf/base.yaml``'s own), and the docs name it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conf import to_plain
from sim_render.api import compose_config

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def _leaves(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def test_there_are_experiments():
    assert len(EXPERIMENTS) >= 4, EXPERIMENTS


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_an_experiment_composes_and_its_values_win(name):
    own = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "experiment" / f"{name}.yaml"))
    # An experiment built on another names it in Hydra's defaults list: not a value of the config. The
    # other's values are checked by its own case, and must still hold where this one does not set them.
    parents = own.pop("defaults", [])
    missing = [k for k, v in _leaves(own) if v == "???"]
    given = [f"{k}=/tmp/given_{k.replace('.', '_')}" for k in missing]  # a value the user must give
    cfg = compose_config("base", [f"experiment={name}", *given])
    plain = to_plain(cfg)
    for key, value in _leaves(own):
        got = OmegaConf.select(cfg, key)
        want = f"/tmp/given_{key.replace('.', '_')}" if value == "???" else value
        assert got == want or to_plain(got) == want, (name, key, got, want)
    mine = {k for k, _ in _leaves(own)}
    for parent in parents:
        for key, value in _leaves(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "experiment" / f"{parent}.yaml"))):
            if key not in mine and key != "defaults" and value != "???":
                got = OmegaConf.select(cfg, key)
                assert got == value or to_plain(got) == value, (name, parent, key, got, value)
    assert plain["output_dir"]  # the rest of base.yaml is there


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_docs_name_each_experiment(name):
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    assert f"experiment={name}" in docs, f"conf/experiment/{name}.yaml is in no doc"


def test_a_run_without_an_experiment_is_the_base_as_before():
    cfg = compose_config("base", [])
    assert cfg.geometry.init_from is None and list(cfg.randomization.overrides) == []
