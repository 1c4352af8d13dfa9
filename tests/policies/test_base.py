"""The pretrained base (policies/base.py): camera mounts, training on several cameras,
the file's format, and a policy that starts from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perception.core.calibration import CalibrationError
from policies.base import camera_mount, train_base
from policies.train import check_policy_config, train_policy
from policies.weights import BaseError, base_path, load_base


def _axis_hits_table(calib):
    T = calib.T_base_camera
    pos, axis = T[:3, 3], T[:3, 2]
    return pos + axis * (calib.table_z - pos[2]) / axis[2]


def test_camera_mount_moves_the_camera_around_the_point_it_looks_at(calib):
    same = camera_mount(calib, 0, 0, 1.0)
    np.testing.assert_allclose(same.T_base_camera, calib.T_base_camera, atol=1e-6)
    target = _axis_hits_table(calib)
    for az, el, scale in [(40, 8, 0.9), (-40, -6, 1.1), (180, 0, 1.0)]:
        moved = camera_mount(calib, az, el, scale)
        np.testing.assert_allclose(_axis_hits_table(moved), target, atol=1e-6)
        r0, r1 = calib.camera_position - target, moved.camera_position - target
        assert np.linalg.norm(r1) == pytest.approx(scale * np.linalg.norm(r0))
        turn = np.degrees(np.arctan2(r1[1], r1[0]) - np.arctan2(r0[1], r0[0]))
        assert (turn - az + 180) % 360 - 180 == pytest.approx(0, abs=1e-6)
        assert abs(moved.T_base_camera[2, 0]) < 1e-9  # the image x axis stays level
        np.testing.assert_array_equal(moved.K, calib.K)
    with pytest.raises(CalibrationError, match="outside the camera's view"):
        camera_mount(calib, 0, 0, 0.3)  # so close that the workspace no longer fits the image


def _base_cfg(tmp_path):
    from sim_render.api import compose_config

    return compose_config("base", [
        f"output_dir={tmp_path / 'base'}", "scenes_per_camera=2", "workers=1", "scenes_per_shard=2",
        "cameras=[{azimuth_deg: 0, elevation_deg: 0, distance_scale: 1.0},"
        "{azimuth_deg: 180, elevation_deg: 0, distance_scale: 1.0}]",
        "randomization.overrides=['render.resolution_scale=0.25']",
        "policy.view_size=[64,64]", "policy.network.base_channels=8", "policy.batch_size=2",
        "policy.max_steps=2", "policy.max_time_s=null", "policy.val_every_n_steps=2", "policy.val_fraction=0.25",
        "geometry.view_size=[64,48]", "geometry.network.base_channels=8", "geometry.batch_size=2",
        "geometry.max_steps=2", "geometry.max_time_s=null", "geometry.val_every_n_steps=2",
        "geometry.val_fraction=0.25", "logger=none"])


@pytest.fixture(scope="module")
def small_base(tmp_path_factory):
    """A base and a geometry network trained for two steps on two scenes from each of two opposite camera mounts."""
    root = tmp_path_factory.mktemp("base")
    res = train_base(_base_cfg(root))
    return root, res["policy"], res["geometry"]


@pytest.mark.slow  # about 30 s: two renders and two trainings: the fast tier must stay under 10 minutes
def test_a_base_trains_on_two_cameras_and_a_policy_starts_from_it(small_base, tmp_path):
    root, res, _ = small_base
    path = base_path(res["base"])
    data = load_base(path)  # weights_only: nothing pickled
    assert data["data"]["scenes"] == 4 and len(data["data"]["cameras"]) == 2
    assert data["network"]["base_channels"] == 8 and data["training"]["global_step"] == 2
    # the two folders were rendered for two cameras, each seen in its own top-down view
    cams = sorted((root / "base" / "cameras").glob("cam*.json"))
    assert len(cams) == 2

    # lr 0: the policy trained from the base keeps the base's weights exactly
    from sim_render.api import compose_config

    cfg = compose_config("train_policy", [
        f"policy.base={path}", "policy.view_size=[64,64]", "policy.network.base_channels=8", "policy.batch_size=2",
        "policy.val_fraction=0.34", "policy.max_steps=2", "policy.optim.lr=0", "policy.optim.weight_decay=0",
        "logger=none"])
    summary = train_policy(cfg, [root / "base" / "data" / "cam0"], tmp_path / "policy")
    assert summary["base"]["name"] == str(path) and len(summary["base"]["digest"]) == 16
    trained = torch.load(summary["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert set(trained) == set(data["state_dict"])
    stats = ("running_mean", "running_var", "num_batches_tracked")  # normalisation statistics move at lr 0
    weights = [k for k in data["state_dict"] if not k.endswith(stats)]
    assert len(weights) > 10
    for k in weights:
        torch.testing.assert_close(trained[k], data["state_dict"][k], msg=k)


def test_a_base_that_does_not_fit_or_is_not_there_is_refused_before_training(small_base, tmp_path):
    from sim_render.api import compose_config

    with pytest.raises(BaseError, match="not found"):
        check_policy_config(compose_config("train_policy", [f"policy.base={tmp_path / 'nope.pt'}"]))
    with pytest.raises(BaseError, match="no shipped policy base named 'grasp_base_v0'"):
        check_policy_config(compose_config("train_policy", ["policy.base=grasp_base_v0"]))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(BaseError, match="could not be read"):
        check_policy_config(compose_config("train_policy", [f"policy.base={bad}"]))
    with pytest.raises(BaseError, match="does not match policy.network"):
        check_policy_config(compose_config("train_policy", [f"policy.base={small_base[1]['base']}", "policy.network.base_channels=16"]))


def test_mixed_calibrations_need_the_flag(small_base):
    from policies.data import make_policy_datasets

    dirs = sorted((small_base[0] / "base" / "data").glob("cam*"))
    spec = {"kind": "table", "margin": 0.03, "plane_height": 0.02}
    with pytest.raises(ValueError, match="another calibration"):
        make_policy_datasets(dirs, spec, (64, 64), 12)
    train, _, view, calib = make_policy_datasets(dirs, spec, (64, 64), 12, mixed_calibrations=True)
    views = [part.view for part in train.datasets]
    assert views[0] is view and not np.allclose(views[0].K, views[1].K)  # the opposite mount turns the view


def test_the_shipped_base_loads_without_pickled_code_and_fits_the_default_policy():
    import json

    from omegaconf import OmegaConf

    from policies.weights import BASE_DIR, check_base_fits
    from sim_render.api import compose_config

    cfg = compose_config("pipeline", [])
    path = base_path(cfg.policy.base)
    assert path.parent == BASE_DIR and path.stat().st_size <= 20 * 2**20  # the cap: 20 MB
    data = load_base(cfg.policy.base)
    check_base_fits(data, OmegaConf.to_container(cfg.policy, resolve=True))
    info = json.loads(path.with_suffix(".json").read_text())  # the text beside it says the same
    assert info["data"] == data["data"] and info["training"]["global_step"] == data["training"]["global_step"]
    budget_small = compose_config("pipeline", ["budget=small"]).budget.render.n_scenes
    assert data["data"]["scenes"] >= 2 * budget_small and len(data["data"]["cameras"]) > 1
    # its own scene seeds: not the pipeline's (seed 0.. and the stand-in's 500,000..) nor the evaluation's
    from policies.evaluate import EVAL_SEED_BASE

    assert data["data"]["seed"] >= 2 * EVAL_SEED_BASE


def test_the_geometry_network_trains_beside_the_base_and_goes_into_the_artifact(small_base, tmp_path):
    """sim2real-train-base's geometry part (a real Lightning Trainer, two steps), then a policy whose
    artifact carries it: the runner's surface is the one rebuilt from the geometry graph."""
    from perception.core.artifact import PolicyRunner, load_metadata
    from perception.core.decode import decode_grasp
    from policies.geometry import GEOMETRY_FORMAT
    from sim_render.api import compose_config
    from sim_render.reader import SimFrameDataset

    root, _, geo = small_base
    data = load_base(geo["base"], GEOMETRY_FORMAT)  # weights_only
    assert data["global_step"] == 2 and data["view_size"] == [64, 48]
    assert data["data"]["scenes"] == 4
    for k in ("object_median_m", "object_p90_m", "floor_median_m", "floor_p90_m"):
        assert np.isfinite(data["errors"][k]) and 0 <= data["errors"][k] <= 0.15
    assert data["errors"]["floor_pixels"] > data["errors"]["object_pixels"] > 0
    with pytest.raises(BaseError, match="is not a base of format"):
        load_base(geo["base"])  # a geometry network is not a policy base

    cfg = compose_config("train_policy", [
        "policy.base=null", f"policy.geometry={geo['base']}", "policy.view_size=[64,64]",
        "policy.network.base_channels=8", "policy.batch_size=2", "policy.val_fraction=0.34", "policy.max_steps=1",
        "policy.decode.rule={support_px: 1}", "policy.decode.fingers_clear=null", "policy.decode.jaws_on_part=null",
        "policy.decode.on_part_px=1",
        "logger=none"])
    summary = train_policy(cfg, [root / "base" / "data" / "cam0"], tmp_path / "policy")
    meta = load_metadata(summary["artifact"])
    assert meta.geometry is not None and meta.geometry.view.size == (64, 48) and not meta.geometry.view.is_table
    assert meta.raw["geometry"]["onnx_max_abs_diff"] <= 1e-4

    runner = PolicyRunner(summary["artifact"])
    frame = SimFrameDataset(root / "base" / "data" / "cam0", fields=("rgb",))[0]["rgb"]
    height, part = runner.geometry_maps(frame)
    assert height.shape == part.shape == (48, 64) and np.all((part >= 0) & (part <= 1))
    surface, on_part = runner.geometry_surface(frame)
    maps = runner.infer(frame)
    np.testing.assert_array_equal(maps.surface, surface)
    assert maps.surface.shape == (64, 64) and np.all(np.isfinite(maps.surface))
    dec = decode_grasp(maps.quality, maps.width, maps.height, runner.calib, runner.view,
                       meta.decode_options.replace(threshold=0.0), surface=maps.surface)
    if not on_part.any():  # no part seen: "the bin looks empty"
        assert dec.grasp is None and "empty" in dec.reason
    with pytest.raises(ValueError, match="needs the top-down view"):
        check_policy_config(compose_config("train_policy", [f"policy.geometry={geo['base']}", "policy.view.kind=camera",
                                                            "policy.base=null"]))


@pytest.mark.slow  # about 40 s: two geometry data renders and a training: the fast tier must stay under 10 minutes
def test_the_geometry_trains_on_its_own_frames_and_renders_no_labelled_data(tmp_path):
    """``geometry_data.scenes > 0``: sim2real-train-base parts=[geometry] renders the geometry's own
    frames (train and held-out scenes, every mount) and trains on them streamed, without the
    labelled renders; the file says what it learned from."""
    from omegaconf import OmegaConf

    from policies.geometry import GEOMETRY_FORMAT
    from policies.geometry_data import GeometryShards

    cfg = _base_cfg(tmp_path)
    OmegaConf.update(cfg, "parts", ["geometry"])
    OmegaConf.update(cfg, "geometry_data", {"scenes": 3, "dir": None, "frames_per_mount": 1, "scenes_per_shard": 2,
                                            "val_scenes": 1})
    res = train_base(cfg)
    assert set(res) == {"geometry"}
    out = tmp_path / "base"
    assert not (out / "data").exists(), "no labelled render for a geometry trained on its own frames"
    train, val = out / "geometry_data" / "train", out / "geometry_data" / "val"
    assert len(GeometryShards([train])) == 3 * 2 and len(GeometryShards([val])) == 1 * 2
    data = load_base(res["geometry"]["base"], GEOMETRY_FORMAT)
    assert data["global_step"] == 2 and data["n_train_frames"] == 6 and data["n_val_frames"] == 2
    assert data["data"]["frames"] == 6 and data["data"]["geometry_data"]["scenes"] == 3
    assert np.isfinite(data["errors"]["object_median_m"])
