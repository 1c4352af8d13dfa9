"""sim2real-render end to end on the real renderer: determinism, resume, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim_render.api import render_dataset
from sim_render.reader import SimFrameDataset

# Small and fast, but the real PyBullet cell, labeller and renderer.
FAST = [
    "render.resolution_scale=0.2",
    "render.frames_per_scene=1",
    "render.grasps.n_heuristic=6",
    "render.grasps.n_random=2",
    "scenes_per_shard=2",
]


def _manifest(d: Path) -> str:
    return (d / "manifest.json").read_text()


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w1")
    render_dataset(out, 4, seed=11, overrides=FAST, workers=1)
    return out


def test_same_seed_same_data_with_one_and_two_workers(one_worker, tmp_path):
    render_dataset(tmp_path, 4, seed=11, overrides=FAST, workers=2)
    assert _manifest(one_worker) == _manifest(tmp_path)
    a, b = SimFrameDataset(one_worker), SimFrameDataset(tmp_path)
    assert len(a) == len(b) == 4
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert np.array_equal(x["rgb"], y["rgb"])
        assert np.array_equal(x["grasps"]["success"], y["grasps"]["success"])
        np.testing.assert_array_equal(x["grasps"]["position"], y["grasps"]["position"])


def test_interrupted_render_resumes_to_same_manifest(one_worker, tmp_path):
    # First job renders only shard 0 (as a launcher fanning out would), then the
    # full command completes the rest without touching the finished shard.
    partial = render_dataset(tmp_path, 4, seed=11, overrides=[*FAST, "shards=0:1"])
    assert partial.get("complete") is False
    shard0 = tmp_path / "shards" / "shard-000000.npz"
    mtime = shard0.stat().st_mtime_ns
    render_dataset(tmp_path, 4, seed=11, overrides=FAST)
    assert shard0.stat().st_mtime_ns == mtime
    assert _manifest(one_worker) == _manifest(tmp_path)


def test_labels_project_into_the_frame(one_worker):
    ds = SimFrameDataset(one_worker)
    manifest = json.loads(_manifest(one_worker))
    w, h = manifest["image_size"]
    item = ds[0]
    assert item["rgb"].shape == (h, w, 3) and item["rgb"].dtype == np.uint8
    px = item["grasps"]["pixel"]
    assert len(px) > 0
    inside = (px[:, 0] >= 0) & (px[:, 0] < w) & (px[:, 1] >= 0) & (px[:, 1] < h)
    assert inside.all(), "every grasp lies in the workspace, which the camera sees"
    assert set(np.unique(item["seg"])) >= {0, 1}  # table and bin are in view


def test_complete_render_writes_a_labelled_panel(one_worker):
    import cv2

    img = cv2.imread(str(one_worker / "panel.png"))
    assert img is not None and img.shape[0] > 50 and img.shape[1] > 50


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("sim2real-render")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)


def test_cli_malformed_calibration_names_the_field(tmp_path):
    bad = json.loads(Path(__file__).parents[2].joinpath("perception/core/data/default_calibration.json").read_text())
    bad["K"] = [[600, 0, 320], [0, 600, 240]]
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(bad))
    res = _cli(f"calibration={cal}", f"output_dir={tmp_path / 'out'}", "n_scenes=1")
    assert res.returncode == 2
    assert "'K'" in res.stderr and "Traceback" not in res.stderr
    assert not list((tmp_path / "out").glob("shards/*.npz"))


def test_cli_workspace_out_of_view_is_refused(tmp_path):
    bad = json.loads(Path(__file__).parents[2].joinpath("perception/core/data/default_calibration.json").read_text())
    bad["workspace"] = {"x": [2.0, 2.4], "y": [1.0, 1.3]}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(bad))
    res = _cli(f"calibration={cal}", f"output_dir={tmp_path / 'out'}", "n_scenes=1")
    assert res.returncode == 2
    assert "workspace" in res.stderr


def test_cli_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = _cli(f"output_dir={blocker / 'sub'}", "n_scenes=1", *FAST)
    assert res.returncode == 2
    assert "sim2real-render: error" in res.stderr


def test_a_refused_rerun_leaves_the_folder_config_alone(one_worker, tmp_path):
    """issue 12: config.yaml was written before the refusal, so it no longer matched the data."""
    import shutil

    from sim_render.format import DatasetError

    d = tmp_path / "ds"
    shutil.copytree(one_worker, d)
    before = (d / "config.yaml").read_text()
    with pytest.raises(DatasetError, match="another dataset"):
        render_dataset(d, 4, seed=12, overrides=FAST, workers=1)
    assert (d / "config.yaml").read_text() == before and "seed: 11" in before
