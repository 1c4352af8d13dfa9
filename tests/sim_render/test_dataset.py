"""The shard format and the torch reader: fields, dtypes, round trips and errors.

Datasets are made with :class:`SyntheticFrames` (no PyBullet) in a few milliseconds.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic_frames import SyntheticFrames
from torch.utils.data import DataLoader

from perception.core.calibration import Calibration, default_calibration_path
from sim_render.format import (
    FRAME_ARRAYS,
    GRASP_ARRAYS,
    CorruptShardError,
    DatasetError,
    FrameRecord,
    GraspLabels,
)
from sim_render.reader import SimFrameDataset, collate_frames
from sim_render.render_job import render_shards
from sim_render.shard_io import build_manifest, verify_shard, write_shard

SIZE = (40, 30)
NOMINAL = Calibration.load(default_calibration_path())
META = {"profile": "test", "config_hash": "cafe", "calibration": NOMINAL.to_dict(), "image_size": list(SIZE)}
GRASP_KEYS = {
    "position",
    "yaw",
    "width",
    "success",
    "pixel",
    "image_angle",
    "image_width",
    "object",
    "source",
}


def _make(out: Path, n_scenes: int = 6, shard_range: tuple[int, int] | None = None) -> dict:
    frames = SyntheticFrames(seed=3, calibration=NOMINAL, image_size=SIZE)
    return render_shards(out, n_scenes, 4, 3, frames, META, shard_range=shard_range, progress=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-scene dataset: 2 shards, 12 frames."""
    out = tmp_path_factory.mktemp("dataset")
    _make(out)
    return out


def test_items_have_the_documented_fields_and_dtypes(root: Path) -> None:
    ds = SimFrameDataset(root)
    assert len(ds) == ds.manifest["totals"]["frames"] == 12
    assert ds.calibration.to_dict() == NOMINAL.to_dict()
    assert ds.render_calibration.image_size == SIZE
    w, h = SIZE
    for i in (0, 7, -1):
        item = ds[i]
        assert item["rgb"].shape == (h, w, 3) and item["rgb"].dtype == np.uint8
        assert item["depth"].shape == (h, w) and item["depth"].dtype == np.float32
        assert item["seg"].shape == (h, w) and item["seg"].dtype == np.uint8
        assert isinstance(item["camera"], Calibration) and item["camera"].image_size == SIZE
        assert isinstance(item["scene"], int) and isinstance(item["params"], dict)
        grasps = item["grasps"]
        assert set(grasps) == GRASP_KEYS
        for key, arr in grasps.items():
            dtype, shape = GRASP_ARRAYS["grasp_" + key]
            assert arr.dtype == dtype and arr.shape[1:] == shape[1:] and len(arr) == len(grasps["position"])
        assert np.all(np.isfinite(item["depth"]))
    with pytest.raises(IndexError):
        ds[12]


def test_items_are_what_was_rendered(root: Path) -> None:
    ds = SimFrameDataset(root)
    make = SyntheticFrames(seed=3, calibration=NOMINAL, image_size=SIZE)
    for i in range(len(ds)):
        item = ds[i]
        frame = make(item["scene"])[i % 2]  # 2 frames per scene, scenes in order
        np.testing.assert_array_equal(item["rgb"], frame.rgb)
        np.testing.assert_array_equal(item["seg"], frame.seg)
        np.testing.assert_allclose(item["depth"], frame.depth, rtol=1e-3)  # float16 on disk
        np.testing.assert_array_equal(item["camera"].K, frame.camera.K)
        np.testing.assert_array_equal(item["camera"].T_base_camera, frame.camera.T_base_camera)
        for key, arr in frame.grasps.as_dict().items():
            np.testing.assert_array_equal(item["grasps"][key], arr)
        assert item["params"]["focal_scale"] == frame.params["focal_scale"]


def test_field_subset_and_unknown_field(root: Path) -> None:
    item = SimFrameDataset(root, fields=("rgb",))[3]
    assert "rgb" in item and not {"depth", "seg", "grasps"} & set(item)
    with pytest.raises(ValueError, match="known"):
        SimFrameDataset(root, fields=("rgb", "normals"))


def test_dataloader_batches_with_collate_frames(root: Path) -> None:
    ds = SimFrameDataset(root)
    ds[0]  # fill the cache: workers must not receive it
    assert not pickle.loads(pickle.dumps(ds))._cache
    loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, collate_fn=collate_frames)
    batches = list(loader)
    assert sum(len(b["grasps"]) for b in batches) == 12
    b = batches[0]
    w, h = SIZE
    assert b["rgb"].shape == (5, h, w, 3) and b["rgb"].dtype == torch.uint8
    assert b["depth"].dtype == torch.float32 and b["seg"].dtype == torch.uint8
    assert b["scene"].dtype == torch.int64 and len(b["camera"]) == len(b["params"]) == 5
    assert sorted(int(i) for batch in batches for i in batch["index"]) == list(range(12))


def test_missing_or_unfinished_dataset_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        SimFrameDataset(tmp_path / "nowhere")
    summary = _make(tmp_path, shard_range=(0, 1))  # shard 1 is left to another launcher
    assert summary["complete"] is False and summary["missing"] == ["shard-000001"]
    with pytest.raises(DatasetError, match=r"no manifest\.json \(1 finished shard"):
        SimFrameDataset(tmp_path)
    with pytest.raises(DatasetError, match="shard-000001"):
        build_manifest(tmp_path, {**META, "seed": 3, "n_scenes": 6, "scenes_per_shard": 4})
    manifest = _make(tmp_path, shard_range=(1, 2))  # the last launcher writes the manifest
    assert manifest["n_shards"] == 2 and len(SimFrameDataset(tmp_path)) == 12


def test_manifest_is_idempotent(tmp_path: Path) -> None:
    _make(tmp_path)
    path = tmp_path / "manifest.json"
    before = path.stat().st_mtime_ns, path.read_bytes()
    build_manifest(tmp_path, {**META, "seed": 3, "n_scenes": 6, "scenes_per_shard": 4})
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before


def test_corrupt_shard_is_caught_by_the_reader(tmp_path: Path) -> None:
    _make(tmp_path)
    npz = tmp_path / "shards" / "shard-000001.npz"
    npz.write_bytes(npz.read_bytes()[:-100])
    SimFrameDataset(tmp_path)[0]  # shard 0 is fine
    with pytest.raises(CorruptShardError, match="shard-000001"):
        SimFrameDataset(tmp_path, verify=True)
    with pytest.raises(CorruptShardError, match="shard-000001"):
        SimFrameDataset(tmp_path)[11]


def _frames(n: int = 3) -> list[FrameRecord]:
    return SyntheticFrames(seed=1, calibration=NOMINAL, image_size=SIZE, frames_per_scene=n)(0)


def test_shard_bytes_are_deterministic_and_numpy_readable(tmp_path: Path) -> None:
    meta = {"shard": 0, "scenes": [0, 1]}
    a = write_shard(tmp_path / "a" / "shard-000000.npz", _frames(), meta)
    b = write_shard(tmp_path / "b" / "shard-000000.npz", _frames(), meta)
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "a" / "shard-000000.npz").read_bytes() == (
        tmp_path / "b" / "shard-000000.npz"
    ).read_bytes()
    stored = write_shard(tmp_path / "c" / "shard-000000.npz", _frames(), meta, compression="stored")
    assert stored["bytes"] > a["bytes"]
    verify_shard(tmp_path / "c" / "shard-000000.npz")
    with (
        np.load(tmp_path / "a" / "shard-000000.npz") as deflated,
        np.load(tmp_path / "c" / "shard-000000.npz") as plain,
    ):
        assert list(deflated.keys()) == list(FRAME_ARRAYS) + list(GRASP_ARRAYS)
        for name, (dtype, _) in {**FRAME_ARRAYS, **GRASP_ARRAYS}.items():
            assert deflated[name].dtype == dtype
            np.testing.assert_array_equal(deflated[name], plain[name])
        assert np.all(np.diff(deflated["grasp_frame"]) >= 0)
    assert a["n_frames"] == 3 and a["n_grasps"] == 3 * len(_frames()[0].grasps)
    assert json.loads((tmp_path / "a" / "shard-000000.json").read_text()) == a


def test_shard_without_grasps_or_frames(tmp_path: Path) -> None:
    frames = _frames(2)
    for f in frames:
        f.grasps = GraspLabels.empty()
    meta = write_shard(tmp_path / "shard-000000.npz", frames, {"image_size": list(SIZE)})
    assert meta["n_grasps"] == 0 and meta["n_scenes_with_success"] == 0
    verify_shard(tmp_path / "shard-000000.npz")
    meta = write_shard(tmp_path / "shard-000001.npz", [], {"image_size": list(SIZE)})
    assert meta["n_frames"] == 0
    verify_shard(tmp_path / "shard-000001.npz")


def test_bad_frames_are_refused_before_writing(tmp_path: Path) -> None:
    frames = _frames(1)
    frames[0].rgb = frames[0].rgb.astype(np.float32)
    with pytest.raises(ValueError, match="rgb must be uint8"):
        write_shard(tmp_path / "shard-000000.npz", frames, {})
    frames = _frames(1)
    frames[0].camera = NOMINAL  # 640x480 camera for a 40x30 frame
    with pytest.raises(ValueError, match="camera image_size"):
        write_shard(tmp_path / "shard-000000.npz", frames, {})
    with pytest.raises(ValueError, match="position"):
        GraspLabels(**{**GraspLabels.empty().as_dict(), "position": np.zeros((2, 2))})
    assert not list(tmp_path.iterdir())
