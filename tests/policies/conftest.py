"""Fixtures of the policy tests: a tiny dataset rendered by the real renderer into a
temporary folder (once per session), the default calibration and its network views."""

from __future__ import annotations

import pytest
import torch

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.geometry import make_view

VIEW_SIZE = (64, 64)  # small views keep the fits fast; the code paths are the same


@pytest.fixture(autouse=True)
def _two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(2, n))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def calib() -> Calibration:
    return Calibration.load(default_calibration_path())


@pytest.fixture(scope="session", params=["table", "camera"])
def view(calib, request):
    """Both kinds of network view: every test of the geometry and the targets runs on each."""
    return make_view(calib, VIEW_SIZE, request.param)


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    """Two randomized scenes (four frames) rendered at a quarter of the camera's resolution."""
    from sim_render.api import render_dataset

    root = tmp_path_factory.mktemp("policy_data") / "sim"
    render_dataset(root, n_scenes=3, profile="randomized", seed=0, overrides=["render.resolution_scale=0.25"])
    return root
