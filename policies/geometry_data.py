"""Frames for the geometry network alone: a scene settled once, rendered many times, no grasps.

The geometry network (:mod:`policies.geometry`) needs a frame, the height every pixel sees
and the part mask; it needs no grasp label. The base's renders pay for those labels: 48
grasps executed in physics per scene, for two frames. Here a scene is dropped and settled
once (the same draws as ``sim2real-render``'s scene of that index), then rendered from every
camera mount of ``conf/base.yaml`` with ``frames_per_mount`` fresh looks each (lights,
textures, colours, camera jitter, sensor), and each frame is turned at once into what the
network trains on, in that mount's camera view (:func:`policies.geometry.geometry_record`):
``view_rgb`` uint8, ``height`` float16 metres above ``table_z`` (NaN where unknown) and
``object`` bool, about 100 KB a frame before compression, against about 600 KB for the raw
frame, depth and segmentation.

On disk (``DIR``)::

    geometry_data.json          what every shard must match (the config hash, the mounts' calibrations)
    shards/geo-000000.npz       view_rgb (N,H,W,3), height (N,H,W), object (N,H,W), scene (N,), mount (N,)
    shards/geo-000000.json      its commit marker: scenes, frames, sha256 (written after the .npz)

Scene ``i`` draws everything from ``SeedSequence([seed, i])`` (:class:`sim_render.scene.SceneRenderer`),
so the shards do not depend on the number of workers, and a stopped run continues: a shard
whose ``.json`` is there and matches is kept, the rest are rendered.

:class:`GeometryShards` streams them for training: shards in a new order each pass, a few
at a time decompressed into a buffer whose frames are shuffled, so memory holds a few shards,
never the data set (100,000 frames in memory would be about 11.5 GB).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import multiprocessing as mp
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from perception.core.atomic import atomic_write_bytes
from perception.core.calibration import Calibration
from perception.core.geometry import camera_channels
from perception.core.jsonio import read_json, write_json
from perception.core.progress import progress
from policies.geometry import GeometryFrames, geometry_item, geometry_record, geometry_view
from sim_render.randomization import render_randomized
from sim_render.scene import SceneRenderer

__all__ = ["GeometryDataError", "GeometrySceneMaker", "GeometryShards", "render_geometry_data", "is_geometry_data",
           "read_geometry_shard", "load_geometry_frames", "geometry_data_datasets", "mount_cameras", "DATA_FILE"]

log = logging.getLogger(__name__)

DATA_FILE = "geometry_data.json"
_FORMAT = "sim2real-grasp-geometry-data"
_ARRAYS = ("view_rgb", "height", "object", "scene", "mount")


class GeometryDataError(ValueError):
    """A geometry data folder that is missing, damaged, or made with other settings."""


def _shard_path(out: Path, k: int) -> Path:
    return out / "shards" / f"geo-{k:06d}.npz"


def is_geometry_data(path: str | Path) -> bool:
    """Whether ``path`` is a folder this module wrote (it holds :data:`DATA_FILE`)."""
    return (Path(path) / DATA_FILE).is_file()


class GeometrySceneMaker:
    """Picklable per-worker maker of one scene's geometry records (the PyBullet world is made lazily).

    Args:
        calib: the nominal calibration: the twin's cell.
        mounts: the camera mounts' calibrations (each frame is seen in its mount's view).
        render_cfg: the render profile (``conf/render/randomized.yaml`` with the randomization).
        gcfg: ``view_size`` and ``margin`` of the geometry network's view.
        frames_per_mount: looks rendered from each mount.
        seed: the data seed.
    """

    def __init__(self, calib: Calibration, mounts: Sequence[Calibration], render_cfg: dict, gcfg: dict,
                 frames_per_mount: int, seed: int) -> None:
        self.renderer = SceneRenderer(calib, render_cfg, seed)
        self.mounts = [m.to_dict() for m in mounts]
        self.gcfg = {"view_size": list(gcfg["view_size"]), "margin": float(gcfg["margin"])}
        self.frames_per_mount = int(frames_per_mount)
        self._views: list | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_views": None}

    def __call__(self, scene: int) -> dict[str, np.ndarray]:
        if self._views is None:
            mounts = [Calibration.from_dict(m) for m in self.mounts]
            self._views = [(m, geometry_view(m, self.gcfg)) for m in mounts]
        r = self.renderer
        rngs, _params = r.build_scene(int(scene))  # settled once, with the same draws as sim2real-render's scene
        world = r.world()
        recs, mounts = [], []
        for k, (mount, view) in enumerate(self._views):
            for _ in range(self.frames_per_mount):
                frame = render_randomized(world.cell.client, world.cell.bodies, mount, rngs["visuals"], world.cfg_plain)
                item = {"rgb": frame.rgb, "depth": frame.depth, "camera": frame.camera,
                        "seg": r.segmentation(frame.seg_raw, frame.distractor_ids)}
                recs.append(geometry_record(item, mount, view))
                mounts.append(k)
        return {
            "view_rgb": np.stack([x["view_rgb"] for x in recs]),
            "height": np.stack([x["height"] for x in recs]).astype(np.float16),
            "object": np.stack([x["object"] for x in recs]),
            "scene": np.full(len(recs), int(scene), dtype=np.int32),
            "mount": np.asarray(mounts, dtype=np.int8),
        }


_worker_maker: GeometrySceneMaker | None = None


def _init_worker(maker: GeometrySceneMaker) -> None:
    global _worker_maker
    _worker_maker = maker


def _worker_scene(scene: int) -> dict[str, np.ndarray]:
    assert _worker_maker is not None, "worker not initialised"
    return _worker_maker(scene)


def _scene_records(maker: GeometrySceneMaker, scenes: list[int], workers: int) -> Iterator[dict[str, np.ndarray]]:
    """Every scene's records, in scene order (so shards do not depend on ``workers``)."""
    if workers <= 1 or len(scenes) <= 1:
        for s in scenes:
            yield maker(s)
        return
    # spawn: PyBullet does not survive a fork of a process that has a client (sim_render/render_job.py).
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                             initializer=_init_worker, initargs=(maker,)) as pool:
        yield from pool.map(_worker_scene, scenes, chunksize=1)


def _write_shard(out: Path, k: int, parts: list[dict[str, np.ndarray]], meta: dict) -> None:
    """Shard ``k`` atomically: the ``.npz`` first, then its ``.json`` (the commit marker)."""
    arrays = {name: np.concatenate([p[name] for p in parts]) for name in _ARRAYS}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    data = buf.getvalue()
    path = _shard_path(out, k)
    path.with_suffix(".json").unlink(missing_ok=True)  # never a new .npz beside an old marker
    atomic_write_bytes(path, data)
    write_json(path.with_suffix(".json"), {**meta, "frames": int(arrays["scene"].shape[0]),
                                          "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})


def _shard_done(out: Path, k: int, meta: dict) -> bool:
    marker = _shard_path(out, k).with_suffix(".json")
    if not marker.is_file() or not _shard_path(out, k).is_file():
        return False
    try:
        got = read_json(marker)
    except (OSError, ValueError):
        return False
    return all(got.get(key) == value for key, value in meta.items())


def render_geometry_data(
    out_dir: str | Path, calib: Calibration, mounts: Sequence[Calibration], render_cfg: dict, gcfg: dict,
    n_scenes: int, seed: int, frames_per_mount: int = 2, scenes_per_shard: int = 32, workers: int = 1,
) -> dict:
    """Render the missing shards of a geometry data folder (resuming), see the module's docstring.

    Returns:
        The folder's description (:data:`DATA_FILE`) with ``rendered`` and ``kept`` shard counts.

    Raises:
        GeometryDataError: ``out_dir`` holds data made with other settings (another seed,
            profile, mounts or view); nothing is changed then.
        ValueError: a count below 1.
    """
    if min(int(n_scenes), int(frames_per_mount), int(scenes_per_shard), int(workers)) < 1:
        raise ValueError(f"n_scenes ({n_scenes}), frames_per_mount ({frames_per_mount}), scenes_per_shard "
                         f"({scenes_per_shard}) and workers ({workers}) must be >= 1")
    out = Path(out_dir)
    desc = {
        "format": _FORMAT, "seed": int(seed), "frames_per_mount": int(frames_per_mount),
        "scenes_per_shard": int(scenes_per_shard), "view_size": list(gcfg["view_size"]), "margin": float(gcfg["margin"]),
        "calibration": calib.to_dict(), "mounts": [m.to_dict() for m in mounts], "render": render_cfg,
    }
    # As it reads back from JSON, so that a folder compares equal to the run that made it.
    desc = json.loads(json.dumps(desc, sort_keys=True))
    chash = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    data_file = out / DATA_FILE
    if data_file.is_file():
        old = read_json(data_file)
        if old.get("config_hash") != chash:
            raise GeometryDataError(f"{out} holds geometry data made with other settings (config hash "
                                    f"{old.get('config_hash')}, this run {chash}): choose another folder")
    (out / "shards").mkdir(parents=True, exist_ok=True)
    # n_scenes may grow between runs (a campaign adds scenes): the description does not hold it.
    write_json(data_file, {**desc, "config_hash": chash})
    n_shards = math.ceil(int(n_scenes) / int(scenes_per_shard))

    def scenes_of(k: int) -> list[int]:
        return list(range(k * scenes_per_shard, min((k + 1) * scenes_per_shard, int(n_scenes))))

    def shard_meta(k: int) -> dict:
        s = scenes_of(k)
        return {"config_hash": chash, "shard": k, "scenes": [s[0], s[-1] + 1]}

    todo = [k for k in range(n_shards) if not _shard_done(out, k, shard_meta(k))]
    kept = n_shards - len(todo)
    if kept:
        log.info("geometry data: resuming, %d of %d shards already finished", kept, n_shards)
    maker = GeometrySceneMaker(calib, mounts, render_cfg, gcfg, frames_per_mount, seed)
    scenes = [s for k in todo for s in scenes_of(k)]
    pending: dict[int, list[dict[str, np.ndarray]]] = {}
    done_scenes = sum(len(scenes_of(k)) for k in range(n_shards)) - len(scenes)
    with progress(total=int(n_scenes), initial=done_scenes, unit="scene", desc="geometry frames") as bar:
        for rec in _scene_records(maker, scenes, int(workers)):
            scene = int(rec["scene"][0])
            k = scene // int(scenes_per_shard)
            pending.setdefault(k, []).append(rec)
            if len(pending[k]) == len(scenes_of(k)):
                _write_shard(out, k, pending.pop(k), shard_meta(k))
            bar.update(1)
    return {**desc, "config_hash": chash, "n_scenes": int(n_scenes), "rendered": len(todo), "kept": kept}


def read_geometry_shard(path: Path) -> dict[str, np.ndarray]:
    """One shard's arrays, checked against its marker's checksum.

    Raises:
        GeometryDataError: the shard is unfinished or damaged (rerun the render to replace it).
    """
    marker = path.with_suffix(".json")
    try:
        meta = read_json(marker)
        data = path.read_bytes()
    except (OSError, ValueError) as exc:
        raise GeometryDataError(f"{path}: unreadable or unfinished ({exc}); rerun the render to finish it") from exc
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise GeometryDataError(f"{path}: its bytes do not match {marker.name} (damaged); delete both and rerun the render")
    with np.load(io.BytesIO(data)) as z:
        return {name: z[name] for name in _ARRAYS}


def mount_cameras(d: str | Path) -> np.ndarray:
    """``(mounts, C, H, W)`` float32: :func:`perception.core.geometry.camera_channels` of each
    camera mount's view of a geometry data folder (its frames' ``mount`` indexes them)."""
    desc = read_json(Path(d) / DATA_FILE)
    return np.stack([camera_channels(m, geometry_view(m, desc))
                     for m in (Calibration.from_dict(x) for x in desc["mounts"])])


def _finished_shards(d: Path) -> list[Path]:
    if not is_geometry_data(d):
        raise GeometryDataError(f"{d} is not a geometry data folder (no {DATA_FILE}): render one with "
                                "sim2real-train-base parts=[geometry] geometry_data.scenes=N")
    shards = sorted(p for p in (d / "shards").glob("geo-*.npz") if p.with_suffix(".json").is_file())
    if not shards:
        raise GeometryDataError(f"{d} holds no finished shard")
    return shards


class GeometryShards(IterableDataset):
    """The frames of geometry data folders, streamed: every frame once a pass, in a new order each pass.

    Shards are taken in a shuffled order ``buffer_shards`` at a time, and the frames of those
    shards are shuffled together (memory: about ``buffer_shards`` shards). With DataLoader
    workers, each takes every ``num_workers``-th shard of the pass's order.

    Args:
        dirs: geometry data folders.
        augment: ``{"hflip": p, "color": fraction}`` (:class:`policies.geometry.GeometryFrames`) or ``None``.
        seed: the order's and augmentation's seed.
        buffer_shards: shards decompressed and shuffled together.
    """

    def __init__(self, dirs: Sequence[str | Path], augment: dict | None = None, seed: int = 0, buffer_shards: int = 4) -> None:
        self.shards = [p for d in dirs for p in _finished_shards(Path(d))]
        cameras = {Path(d): mount_cameras(d) for d in dirs}
        self.cameras = [cameras[p.parent.parent] for p in self.shards]  # the maps of each shard's mounts
        self.n_frames = sum(int(read_json(p.with_suffix(".json"))["frames"]) for p in self.shards)
        self.augment = augment
        self.seed = int(seed)
        self.buffer_shards = max(1, int(buffer_shards))
        self._pass = 0

    def __len__(self) -> int:
        return self.n_frames

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            wid, nw, key = 0, 1, self._pass
            self._pass += 1
        else:
            # A worker holds a copy made for this pass; torch seeds worker i with base + i, the
            # base drawn anew each pass (from the seeded main process): the workers' shared key.
            wid, nw, key = info.id, info.num_workers, (info.seed - info.id) % 2**63
        order = np.random.default_rng([self.seed, key]).permutation(len(self.shards))[wid::nw]
        rng = np.random.default_rng([self.seed, key, 1 + wid])
        for i in range(0, len(order), self.buffer_shards):
            parts = [read_geometry_shard(self.shards[j]) for j in order[i:i + self.buffer_shards]]
            rgb = np.concatenate([p["view_rgb"] for p in parts])
            height = np.concatenate([p["height"] for p in parts])
            obj = np.concatenate([p["object"] for p in parts])
            camera = [self.cameras[j][m] for j, p in zip(order[i:i + self.buffer_shards], parts) for m in p["mount"]]
            for f in rng.permutation(len(rgb)):
                yield geometry_item(rgb[f], height[f], obj[f], self.augment, rng, camera[f])


def load_geometry_frames(dirs: Sequence[str | Path], first_of: str | Path) -> tuple[Any, Any, Calibration]:
    """Geometry data folders held in memory (validation), and the view and nominal calibration
    of the folder ``first_of`` (what the trained network's file records).

    Returns:
        ``(frames, view, calibration)``; ``frames`` is a :class:`policies.geometry.GeometryFrames`
        without augmentation, ``None`` when ``dirs`` is empty.
    """
    if not is_geometry_data(first_of):
        raise GeometryDataError(f"{first_of} is not a geometry data folder (no {DATA_FILE})")
    desc = read_json(Path(first_of) / DATA_FILE)
    calib = Calibration.from_dict(desc["calibration"])
    view = geometry_view(calib, desc)
    records = []
    for d in dirs:
        cameras = mount_cameras(d)
        for p in _finished_shards(Path(d)):
            a = read_geometry_shard(p)
            records += [{"view_rgb": a["view_rgb"][i], "height": a["height"][i], "object": a["object"][i],
                         "camera": cameras[a["mount"][i]]} for i in range(len(a["scene"]))]
    return (GeometryFrames(records) if records else None), view, calib


def geometry_data_datasets(dirs: Sequence[str | Path], val_dirs: Sequence[str | Path], gcfg: dict,
                           seed: int) -> tuple[GeometryShards, Any, Any, Calibration]:
    """What :func:`policies.geometry.train_geometry` trains on (its ``datasets``): ``dirs`` streamed
    with ``gcfg``'s augmentation, ``val_dirs`` in memory, the first folder's view and calibration.

    Raises:
        GeometryDataError: a folder that is not geometry data, or holds no finished shard.
    """
    aug = gcfg.get("augment")
    train = GeometryShards(dirs, dict(aug) if aug else None, int(seed), int(gcfg["buffer_shards"]))
    val, view, calib = load_geometry_frames(val_dirs, first_of=dirs[0])
    return train, val, view, calib
