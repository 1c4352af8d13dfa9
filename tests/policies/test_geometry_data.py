"""Frames for the geometry alone (policies/geometry_data.py): rendered by the real PyBullet twin,
the same with one and two workers, resumed shard by shard, streamed every frame once a pass,
and trained on by a real Lightning Trainer that continues from its checkpoint."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conf import to_plain
from perception.core.calibration import Calibration, default_calibration_path
from policies.base import camera_mount
from policies.geometry import train_geometry
from policies.geometry_data import (
    DATA_FILE,
    GeometryDataError,
    GeometrySceneMaker,
    GeometryShards,
    geometry_data_datasets,
    read_geometry_shard,
    render_geometry_data,
)
from sim_render.api import compose_config, render_config

GCFG = {"view_size": [64, 48], "margin": 0.03}
# Cheap looks: the code paths are the same (the profile's own values are in conf/render/randomized.yaml).
FAST = ["render.resolution_scale=0.2", "render.lighting.cast_shadow.prob=0.0", "render.lighting.shadow_prob=0.0"]


def _setup(tmp: Path) -> tuple[Calibration, list[Calibration], dict]:
    calib = Calibration.load(default_calibration_path())
    mounts = [calib, camera_mount(calib, 40.0, 8.0, 0.9)]
    return calib, mounts, to_plain(render_config(tmp / "unused", 1, overrides=FAST).render)


def _render(out: Path, workers: int, seed: int = 0, n: int = 3) -> dict:
    calib, mounts, rcfg = _setup(out.parent)
    return render_geometry_data(out, calib, mounts, rcfg, GCFG, n_scenes=n, seed=seed, frames_per_mount=1,
                                scenes_per_shard=2, workers=workers)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((d / "shards").glob("*.npz"))}


@pytest.fixture(scope="module")
def geometry_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("geometry_data") / "one"
    _render(out, workers=1)
    return out


def test_the_records_hold_the_heights_of_the_settled_scene(tmp_path):
    """Part pixels stand no higher than the parts' tops in PyBullet; the table and floor are at 0."""
    calib, mounts, rcfg = _setup(tmp_path)
    maker = GeometrySceneMaker(calib, mounts[:1], rcfg, GCFG, frames_per_mount=2, seed=0)
    rec = maker(1)
    world = maker.renderer.world()
    import pybullet as pb  # noqa: F401  (the client's own module)

    client = world.cell.client
    tops = [client.getAABB(b)[1][2] - calib.table_z for b in world.cell.bodies.objects]
    assert rec["view_rgb"].shape == (2, 48, 64, 3) and rec["height"].dtype == np.float16
    assert list(rec["mount"]) == [0, 0] and list(rec["scene"]) == [1, 1]
    h = rec["height"].astype(np.float32)
    part = rec["object"] & np.isfinite(h)
    assert part.sum() > 20, "the scene's parts are seen"
    assert float(h[part].max()) <= max(tops) + 0.005
    assert float(np.percentile(h[part], 90)) > 0.005, "parts stand above the floor"
    rest = ~rec["object"] & np.isfinite(h)
    assert abs(float(np.median(h[rest]))) < 0.003, "most of the rest is the table and the bin floor, at 0"
    # Two looks of one settled scene: the same geometry (camera jitter aside), other pixels.
    assert not np.array_equal(rec["view_rgb"][0], rec["view_rgb"][1])
    assert abs(int(rec["object"][0].sum()) - int(rec["object"][1].sum())) < 0.3 * rec["object"][0].sum()


def test_one_and_two_workers_write_the_same_shards_and_a_run_resumes(geometry_data, tmp_path, caplog):
    two = tmp_path / "two"
    info = _render(two, workers=2)
    assert info["rendered"] == 2 and info["kept"] == 0
    assert _digests(two) == _digests(geometry_data)
    # A shard whose marker is gone is unfinished: only it is rendered again, to the same bytes.
    (two / "shards" / "geo-000001.json").unlink()
    before = (two / "shards" / "geo-000000.npz").stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        info = _render(two, workers=1)
    assert info["rendered"] == 1 and info["kept"] == 1
    assert "resuming, 1 of 2 shards" in caplog.text
    assert (two / "shards" / "geo-000000.npz").stat().st_mtime_ns == before
    assert _digests(two) == _digests(geometry_data)


def test_a_folder_of_other_settings_is_refused_untouched(geometry_data):
    before = _digests(geometry_data), (geometry_data / DATA_FILE).read_bytes()
    with pytest.raises(GeometryDataError, match="other settings"):
        _render(geometry_data, workers=1, seed=5)
    assert (_digests(geometry_data), (geometry_data / DATA_FILE).read_bytes()) == before


def test_a_damaged_shard_is_named(geometry_data, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(geometry_data, bad)
    p = bad / "shards" / "geo-000000.npz"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(GeometryDataError, match="geo-000000.npz.*damaged"):
        read_geometry_shard(p)


def _image_keys(batches) -> list[bytes]:
    return [hashlib.sha1(img.numpy().tobytes()).hexdigest().encode() for b in batches for img in b["image"]]


def test_the_stream_gives_every_frame_once_a_pass_in_a_new_order(geometry_data):
    ds = GeometryShards([geometry_data], augment=None, seed=0, buffer_shards=1)
    assert len(ds) == 3 * 2  # 3 scenes x 2 mounts x 1 look
    want = sorted(_image_keys([{"image": torch.stack([x["image"] for x in GeometryShards([geometry_data])])}]))
    first = _image_keys(DataLoader(ds, batch_size=1))
    second = _image_keys(DataLoader(ds, batch_size=1))
    assert sorted(first) == want and sorted(second) == want
    assert first != second
    # Two loader workers split the pass's shards between them: still every frame once.
    two = _image_keys(DataLoader(ds, batch_size=1, num_workers=2))
    assert sorted(two) == want


def test_training_on_geometry_data_continues_from_its_checkpoint(geometry_data, tmp_path, caplog):
    base = compose_config("base")
    g = to_plain(base.geometry)
    g.update(GCFG, batch_size=2, max_steps=2, max_time_s=None, val_every_n_steps=2, checkpoint_every_n_steps=1,
             network={"base_channels": 4, "dilations": [2]}, accelerator="cpu")
    out = tmp_path / "run"
    data = geometry_data_datasets([geometry_data], [geometry_data], g, seed=0)
    first = train_geometry(g, [], out, seed=0, logger_cfg={"name": "none"}, datasets=data)
    assert first["global_step"] == 2 and first["n_train_frames"] == 6 and first["n_val_frames"] == 6
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert np.isfinite(first["errors"]["object_median_m"])
    g["max_steps"] = 4
    with caplog.at_level(logging.INFO):
        second = train_geometry(g, [], out, seed=0, logger_cfg={"name": "none"},
                                datasets=geometry_data_datasets([geometry_data], [geometry_data], g, seed=0))
    assert "continuing the run" in caplog.text
    assert second["global_step"] == 4
    with pytest.raises(GeometryDataError, match="is not a geometry data folder"):
        geometry_data_datasets([geometry_data, tmp_path], [], g, seed=0)


def test_each_streamed_frame_carries_its_mounts_camera_maps_mirrored_with_it(geometry_data):
    """A frame's ``camera`` is :func:`camera_channels` of the view of the mount it was seen from;
    a horizontal flip mirrors the maps with the image (each map is a scalar of world and camera)."""
    from perception.core.geometry import camera_channels
    from policies.geometry import geometry_view
    from policies.geometry_data import load_geometry_frames

    _, mounts, _ = _setup(geometry_data.parent)
    want = [camera_channels(m, geometry_view(m, GCFG)) for m in mounts]
    assert not np.allclose(want[0], want[1]), "the two mounts see the table differently"
    plain = list(GeometryShards([geometry_data], augment=None, seed=0, buffer_shards=1))
    flipped = list(GeometryShards([geometry_data], augment={"hflip": 1.0}, seed=0, buffer_shards=1))
    frames, _, _ = load_geometry_frames([geometry_data], first_of=geometry_data)
    held = [frames[i] for i in range(len(frames))]
    for items, mirror in ((plain, False), (flipped, True), (held, False)):
        seen = set()
        for it in items:
            cam = it["camera"].numpy()
            k = next(k for k, w in enumerate(want) if np.allclose(cam, w[:, :, ::-1] if mirror else w, atol=1e-6))
            seen.add(k)
        assert seen == {0, 1}
