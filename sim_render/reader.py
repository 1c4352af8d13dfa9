"""The torch reader of rendered datasets (format: docs/dataset.md).

Kept apart from the writer (:mod:`sim_render.shard_io`) so that render workers, which only
write shards, never import torch; both read the format from :mod:`sim_render.format`.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from perception.core.calibration import Calibration
from sim_render.format import (
    ALL_ARRAYS,
    FORMAT_VERSION,
    IMAGE_ARRAYS,
    CorruptShardError,
    DatasetError,
    GraspLabels,
)
from sim_render.shard_io import read_shard_meta, verify_shard

__all__ = ["SimFrameDataset", "collate_frames"]


class _Shard:
    """The decoded arrays of one shard (what the reader's LRU cache holds)."""

    def __init__(self, path_npz: Path, meta: dict, image_fields: Sequence[str]) -> None:
        try:
            with np.load(path_npz, allow_pickle=False) as npz:
                # Small arrays always; images only when asked for (decoding is the main cost).
                self.arrays = {
                    name: npz[name]
                    for name in ALL_ARRAYS
                    if name not in IMAGE_ARRAYS or name in image_fields
                }
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise CorruptShardError(
                Path(path_npz).stem, f"undecodable ({type(exc).__name__}: {exc}); check it with verify_shard"
            ) from exc
        self.meta = meta
        # grasp_frame is sorted, so a frame's rows are one slice.
        self.grasp_start = np.searchsorted(self.arrays["grasp_frame"], np.arange(meta["n_frames"] + 1))
        self.nbytes = sum(a.nbytes for a in self.arrays.values())


class SimFrameDataset(Dataset):
    """Frames of a rendered dataset, one item per frame.

    Shards are decoded lazily, per process, into an LRU cache of at most ``cache_mb``
    decoded megabytes, so DataLoader workers start light and only hold what they read
    (the cache is dropped when the dataset is pickled to a worker). Decoding a shard
    costs about 9 ms (8 frames at 320x240), a cached frame 0.2 ms; a dataset smaller
    than the cache is decoded once per process.

    Args:
        root: the dataset folder (``OUT``).
        fields: which of ``"rgb"``, ``"depth"``, ``"seg"``, ``"grasps"`` to return.
        verify: check every shard's size and sha256 against the manifest at start.
        cache_mb: decoded shards kept per process, megabytes (at least one shard).

    Attributes:
        manifest: the parsed ``manifest.json``.
        calibration: the nominal :class:`Calibration` (as given to the renderer, at the
            calibration file's resolution; ``render_calibration`` is it at the rendered size).

    Item (``dataset[i]``), numpy arrays:
        ``rgb`` ``(H, W, 3)`` uint8; ``depth`` ``(H, W)`` float32 metres (0 = none);
        ``seg`` ``(H, W)`` uint8; ``grasps`` dict of ``(G, ...)`` arrays (``position``,
        ``yaw``, ``width``, ``success``, ``pixel``, ``image_angle``, ``image_width``,
        ``object``, ``source``); ``camera`` the jittered :class:`Calibration` at ``(W, H)``;
        ``scene`` int; ``params`` dict; ``index`` int (``i``).
    """

    FIELDS = ("rgb", "depth", "seg", "grasps")

    def __init__(
        self,
        root: str | Path,
        fields: Sequence[str] = FIELDS,
        verify: bool = False,
        cache_mb: float = 256.0,
    ) -> None:
        self.root = Path(root)
        unknown = [f for f in fields if f not in self.FIELDS]
        if unknown:
            raise ValueError(f"unknown dataset fields {unknown}; known: {list(self.FIELDS)}")
        self.fields = tuple(fields)
        self.cache_bytes = int(cache_mb * 1e6)
        self.manifest = self._read_manifest()
        self.calibration = Calibration.from_dict(self.manifest["calibration"], check_view=False)
        self.image_size = tuple(int(v) for v in self.manifest["image_size"])
        self._shards = self.manifest["shards"]
        self._offsets = np.cumsum([0] + [s["n_frames"] for s in self._shards])
        if self._offsets[-1] == 0:
            raise DatasetError(f"dataset {self.root} holds no frames")
        if verify:
            for s in self._shards:
                path = self._shard_path(s)
                verify_shard(path)
                if read_shard_meta(path)["sha256"] != s["sha256"]:
                    raise CorruptShardError(s["name"], "it changed after manifest.json was written")
        self._cache: OrderedDict[int, _Shard] = OrderedDict()

    def _read_manifest(self) -> dict:
        path = self.root / "manifest.json"
        if not self.root.is_dir():
            raise DatasetError(
                f"dataset folder {self.root} does not exist; render one with "
                f"`sim2real-render output_dir={self.root}`"
            )
        if not path.is_file():
            n = len(list((self.root / "shards").glob("shard-*.json")))
            raise DatasetError(
                f"{self.root} has no manifest.json ({n} finished shard(s) in shards/): the render "
                "did not finish or this is not a dataset folder; rerun the same sim2real-render "
                "command to resume it"
            )
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetError(f"{path} is unreadable: {exc}") from exc
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DatasetError(
                f"{path} has format_version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}"
            )
        return manifest

    @property
    def render_calibration(self) -> Calibration:
        """The nominal calibration at the rendered resolution."""
        return self.calibration.scaled(self.image_size)

    def _shard_path(self, entry: dict) -> Path:
        return self.root / "shards" / f"{entry['name']}.npz"

    def __getstate__(self) -> dict:
        # DataLoader workers get the index only; each fills its own cache.
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()
        return state

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _shard(self, k: int) -> _Shard:
        shard = self._cache.get(k)
        if shard is not None:
            self._cache.move_to_end(k)
            return shard
        entry = self._shards[k]
        path = self._shard_path(entry)
        if not path.is_file():
            raise DatasetError(f"{path} listed in the manifest is missing")
        meta = read_shard_meta(path)
        if meta["sha256"] != entry["sha256"]:
            raise CorruptShardError(entry["name"], "it changed after manifest.json was written")
        shard = _Shard(path, meta, [f for f in self.fields if f in IMAGE_ARRAYS])
        self._cache[k] = shard
        while len(self._cache) > 1 and sum(s.nbytes for s in self._cache.values()) > self.cache_bytes:
            self._cache.popitem(last=False)
        return shard

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"frame index {index} out of range for {len(self)} frames")
        k = int(np.searchsorted(self._offsets, i, side="right")) - 1
        j = i - int(self._offsets[k])
        shard = self._shard(k)
        a = shard.arrays
        w, h = self.image_size
        item: dict[str, Any] = {
            "index": i,
            "scene": int(a["frame_scene"][j]),
            "params": shard.meta["frames"][j]["params"],
            "camera": Calibration(
                image_size=(w, h),
                K=a["camera_K"][j].copy(),
                dist=a["camera_dist"][j].copy(),
                T_base_camera=a["camera_T_base_camera"][j].copy(),
                table_z=self.calibration.table_z,
                workspace_x=self.calibration.workspace_x,
                workspace_y=self.calibration.workspace_y,
            ),
        }
        # Copies, so items never pin a whole cached shard in memory.
        if "rgb" in self.fields:
            item["rgb"] = a["rgb"][j].copy()
        if "depth" in self.fields:
            item["depth"] = a["depth"][j].astype(np.float32)
        if "seg" in self.fields:
            item["seg"] = a["seg"][j].copy()
        if "grasps" in self.fields:
            lo, hi = int(shard.grasp_start[j]), int(shard.grasp_start[j + 1])
            item["grasps"] = {f.name: a["grasp_" + f.name][lo:hi].copy() for f in fields(GraspLabels)}
        return item


def collate_frames(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """DataLoader ``collate_fn`` for :class:`SimFrameDataset` items.

    Args:
        batch: items from ``SimFrameDataset.__getitem__``.

    Returns:
        ``rgb`` ``(B, H, W, 3)`` uint8, ``depth`` ``(B, H, W)`` float32, ``seg``
        ``(B, H, W)`` uint8 and ``index``/``scene`` ``(B,)`` int64 as torch tensors (those
        present in the items); ``camera``, ``params`` and ``grasps`` (dicts of numpy
        arrays, one per frame: frames have different numbers of grasps) as lists.
    """
    if not batch:
        raise ValueError("collate_frames got an empty batch")
    out: dict[str, Any] = {}
    for key in IMAGE_ARRAYS:
        if key in batch[0]:
            out[key] = torch.from_numpy(np.stack([b[key] for b in batch]))
    for key in ("index", "scene"):
        out[key] = torch.tensor([b[key] for b in batch], dtype=torch.int64)
    for key in ("camera", "params", "grasps"):
        if key in batch[0]:
            out[key] = [b[key] for b in batch]
    return out
