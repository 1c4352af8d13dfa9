"""The robot floor loads what other packages register (entry points) and never names them."""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from perception.robot import plugins
from perception.robot.cameras import CameraError, open_camera
from perception.robot.robots import make_robot

ROOT = Path(__file__).resolve().parents[2]


def test_sim_render_registers_the_simulated_cell():
    for kind in ("cameras", "robots", "cells"):
        assert plugins.registered(kind)["sim"].value.startswith("sim_render.")
    assert plugins.load_registered("cells", "sim").__name__ == "SimCell"


def test_a_registered_driver_that_cannot_be_imported_says_what_to_install(monkeypatch):
    """What a robot-only install (no PyBullet) answers to camera=sim and robot=sim."""
    gone = {"sim": EntryPoint("sim", "no_such_package.sim_robot:SimCamera", "sim2real_grasp.cameras")}
    monkeypatch.setattr(plugins, "registered", lambda kind: gone)
    with pytest.raises(CameraError, match="needs the full install"):
        open_camera("sim")
    with pytest.raises(plugins.PluginError, match="needs the full install"):
        make_robot("sim")


def test_perception_names_no_higher_package():
    """By import or by string: the core never names the robot floor, and neither floor names
    sim_render, adaptation or policies in code (docstrings may say what registers what)."""
    higher = re.compile(r"^\s*(from|import)\s+(sim_render|adaptation|policies)\b|[\"'](sim_render|adaptation|policies)\.\w",
                        re.M)
    up = re.compile(r"^\s*(from|import)\s+perception\.robot\b|[\"']perception\.robot\.", re.M)
    bad = {}
    for path in (ROOT / "perception").rglob("*.py"):
        text = path.read_text()
        hits = higher.findall(text) + (up.findall(text) if "core" in path.parts else [])
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert bad == {}
