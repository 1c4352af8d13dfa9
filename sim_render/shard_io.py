"""Writing and verifying a rendered dataset's shards, and its manifest.

The on-disk format is described in ``docs/dataset.md``; :mod:`sim_render.format` holds its
single source of truth (names, dtypes, shapes), which this writer and verifier and the torch
reader (:mod:`sim_render.reader`) import alike.

Layout of a dataset folder ``OUT``::

    OUT/manifest.json               # built last, from the shard metadata files
    OUT/config.yaml                 # resolved render config (written by the CLI)
    OUT/shards/shard-000000.npz     # arrays (a zip of .npy members, np.load reads it)
    OUT/shards/shard-000000.json    # that shard's metadata; written last = commit marker

A shard's ``.npz`` is written byte-deterministically (fixed zip timestamps, fixed member
order and compression), so the same seed gives the same bytes and the same sha256 no
matter how many workers rendered it or whether the run was interrupted and resumed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from perception.core import jsonio
from perception.core.atomic import atomic_write_bytes, atomic_write_text
from sim_render.format import (
    ALL_ARRAYS,
    FORMAT_VERSION,
    GRASP_ARRAYS,
    CorruptShardError,
    DatasetError,
    FrameRecord,
    GraspLabels,
    shard_name,
    shard_scenes,
)

__all__ = [
    "MANIFEST_KEYS",
    "build_manifest",
    "check_shard_belongs",
    "read_shard_meta",
    "to_jsonable",
    "verify_shard",
    "write_shard",
]

#: Zip settings of the ``.npz``: deflate level 1 keeps nearly all of level 6's ratio on
#: rendered frames (rgb ~3x, depth and seg 30-50x) at a third of the time; the fixed
#: timestamp makes the bytes (and the sha256) reproducible.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_COMPRESSION = {"deflate": (zipfile.ZIP_DEFLATED, 1), "stored": (zipfile.ZIP_STORED, None)}

def to_jsonable(value: Any) -> Any:
    """Plain JSON types for shard metadata: :func:`perception.core.jsonio.to_jsonable`, strict
    (a non-finite number or an unknown type is an error: the file is data)."""
    return jsonio.to_jsonable(value, strict=True)


def _dumps(obj: Any) -> str:
    # sort_keys + fixed separators: the same content always gives the same bytes.
    return jsonio.dumps_json(obj, indent=1, sort_keys=True, strict=True)


def _json_path(path_npz: Path) -> Path:
    return Path(path_npz).with_suffix(".json")


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def _zip_arrays(arrays: dict[str, np.ndarray], compression: str) -> bytes:
    """An ``.npz`` (zip of ``<name>.npy``) with deterministic bytes.

    ``np.savez`` stamps every member with the current time; writing the members with a
    fixed ``date_time``, ``create_system`` and permissions makes the file a pure function
    of the arrays (for a given zlib), so its sha256 can be compared across runs.
    """
    ctype, level = _COMPRESSION[compression]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", allowZip64=True) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=_ZIP_DATE_TIME)
            info.create_system = 3  # unix, whatever the writing platform
            info.external_attr = 0o644 << 16
            zf.writestr(info, _npy_bytes(arr), compress_type=ctype, compresslevel=level)
    return buf.getvalue()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stack_frames(frames: Sequence[FrameRecord], image_size: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """Validate the records and assemble the shard's arrays (in :data:`ALL_ARRAYS` order)."""
    if frames:
        h, w = np.asarray(frames[0].rgb).shape[:2]
    elif image_size is not None:
        w, h = (int(v) for v in image_size)
    else:
        raise ValueError("an empty shard needs meta['image_size'] = [width, height]")
    for j, fr in enumerate(frames):
        where = f"frame {j} (scene {fr.scene})"
        rgb, depth, seg = np.asarray(fr.rgb), np.asarray(fr.depth), np.asarray(fr.seg)
        if rgb.shape != (h, w, 3) or rgb.dtype != np.uint8:
            raise ValueError(f"{where}: rgb must be uint8 ({h}, {w}, 3), got {rgb.dtype} {rgb.shape}")
        if depth.shape != (h, w) or seg.shape != (h, w):
            raise ValueError(f"{where}: depth {depth.shape} and seg {seg.shape} must be ({h}, {w})")
        if not np.all(np.isfinite(depth)) or float(depth.max(initial=0.0)) > 65000.0:
            raise ValueError(f"{where}: depth must be finite metres below 65000 (0 = no depth)")
        if tuple(fr.camera.image_size) != (w, h):
            raise ValueError(
                f"{where}: camera image_size {tuple(fr.camera.image_size)} differs from the frame's {(w, h)}"
            )
        if not isinstance(fr.grasps, GraspLabels):
            raise TypeError(f"{where}: grasps must be GraspLabels, got {type(fr.grasps).__name__}")
    n_frames = len(frames)

    def stack(values: list[np.ndarray], name: str) -> np.ndarray:
        dtype, shape = ALL_ARRAYS[name]
        if not values:
            dims = {"F": 0, "G": 0, "H": h, "W": w}
            return np.zeros([dims.get(d, d) for d in shape], dtype=dtype)
        return np.stack(values).astype(dtype, copy=False)

    out = {
        "rgb": stack([np.asarray(f.rgb) for f in frames], "rgb"),
        "depth": stack([np.asarray(f.depth, dtype=np.float32) for f in frames], "depth"),
        "seg": stack([np.asarray(f.seg) for f in frames], "seg"),
        "frame_scene": np.array([int(f.scene) for f in frames], dtype=np.int32),
        "camera_K": stack([f.camera.K for f in frames], "camera_K"),
        "camera_dist": stack([f.camera.dist for f in frames], "camera_dist"),
        "camera_T_base_camera": stack([f.camera.T_base_camera for f in frames], "camera_T_base_camera"),
    }
    counts = [len(f.grasps) for f in frames]
    out["grasp_frame"] = np.repeat(np.arange(n_frames, dtype=np.int32), counts)
    for f in fields(GraspLabels):
        name = "grasp_" + f.name
        dtype, shape = GRASP_ARRAYS[name]
        parts = [getattr(fr.grasps, f.name) for fr in frames]
        out[name] = (
            np.concatenate(parts).astype(dtype, copy=False)
            if parts
            else np.zeros((0, *shape[1:]), dtype=dtype)
        )
    return {name: out[name] for name in ALL_ARRAYS}


# ----------------------------------------------------------------------------- writing
def write_shard(
    path_npz: Path, frames: list[FrameRecord], meta: dict, *, compression: str = "deflate"
) -> dict:
    """Write one shard atomically: the ``.npz`` first, then its ``.json`` (the commit marker).

    A shard whose ``.json`` exists is complete; a crash or a full disk at any point leaves
    no ``.json``, no partial ``.npz`` and no temporary file.

    Args:
        path_npz: ``OUT/shards/shard-XXXXXX.npz``; the metadata goes beside it as ``.json``.
        frames: the shard's frames in order (scene by scene, each scene's frames in order).
        meta: shard-level metadata stored as is (``shard``, ``scenes``, ``seed``,
            ``config_hash``, ``profile``, ``scene_seeds``, ``image_size``, ...); the counts,
            ``frames``, ``sha256``, ``bytes``, ``compression`` and ``format_version`` are
            filled in here.
        compression: ``"deflate"`` (default, level 1) or ``"stored"``.

    Returns:
        The metadata as written to the ``.json``.

    Raises:
        ValueError: inconsistent frames (sizes, dtypes, camera size).
        OSError: the write failed; ``ENOSPC`` gets a message saying what to do.
    """
    path_npz = Path(path_npz)
    path_json = _json_path(path_npz)
    if compression not in _COMPRESSION:
        raise ValueError(f"unknown compression {compression!r}; known: {sorted(_COMPRESSION)}")
    if meta.get("scenes") is not None:
        lo, hi = meta["scenes"]
        outside = sorted({f.scene for f in frames if not lo <= f.scene < hi})
        if outside:
            raise ValueError(f"frames of scenes {outside} do not belong in a shard of scenes [{lo}, {hi})")
    arrays = _stack_frames(frames, meta.get("image_size"))
    data = _zip_arrays(arrays, compression)
    success = arrays["grasp_success"]
    scenes_with_success = np.unique(arrays["frame_scene"][arrays["grasp_frame"][success]])
    h, w = arrays["rgb"].shape[1:3]
    if meta.get("image_size") is not None and [int(v) for v in meta["image_size"]] != [w, h]:
        raise ValueError(f"frames are {w}x{h}, meta['image_size'] says {meta['image_size']}")
    out = dict(meta)
    out.update(
        format_version=FORMAT_VERSION,
        image_size=[int(w), int(h)],
        n_frames=int(arrays["rgb"].shape[0]),
        n_grasps=int(success.shape[0]),
        n_success=int(success.sum()),
        n_scenes_with_success=int(scenes_with_success.size),
        frames=[{"scene": int(f.scene), "params": to_jsonable(f.params)} for f in frames],
        compression=compression,
        sha256=hashlib.sha256(data).hexdigest(),
        bytes=len(data),
    )
    text = _dumps(out)  # fail on unserialisable params before touching the disk

    committed = False
    try:
        # Un-commit an older version first, so a crash below never pairs new data
        # with stale metadata.
        path_json.unlink(missing_ok=True)
        atomic_write_bytes(path_npz, data)
        atomic_write_text(path_json, text)
        committed = True
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"no space left on device while writing {path_npz.name} in {path_npz.parent} "
                f"({len(data) / 1e6:.1f} MB): free some space or choose another output_dir, then "
                "rerun the same command; finished shards are kept and the run resumes",
                str(path_npz),
            ) from exc
        raise
    finally:
        if not committed:
            # The .json is the commit marker: without it the .npz is garbage.
            path_npz.unlink(missing_ok=True)
    return json.loads(text)


# ----------------------------------------------------------------------------- verifying
def read_shard_meta(path_npz: Path) -> dict:
    """Read a shard's ``.json``; raise :class:`CorruptShardError` when absent or unreadable."""
    path_npz = Path(path_npz)
    name = path_npz.stem
    path_json = _json_path(path_npz)
    if not path_json.is_file():
        raise CorruptShardError(name, f"its metadata {path_json.name} is missing (the write did not finish)")
    try:
        meta = json.loads(path_json.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptShardError(name, f"its metadata {path_json.name} is unreadable: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise CorruptShardError(
            name,
            f"{path_json.name} has format_version {meta.get('format_version') if isinstance(meta, dict) else None},"
            f" this code reads {FORMAT_VERSION}",
        )
    return meta


def _npy_header(zf: zipfile.ZipFile, member: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a ``.npy`` member, reading only its header."""
    with zf.open(member) as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:  # (3, 0) only for non-latin-1 field names, which the writer never makes
            raise ValueError(f"unsupported .npy version {version}")
    return tuple(shape), np.dtype(dtype)


def verify_shard(path_npz: Path) -> None:
    """Check that a shard is complete and intact.

    Checks, cheapest first: the ``.json`` exists and parses, the ``.npz`` exists with the
    recorded size and sha256, every array is present with its dtype and a shape
    consistent with ``n_frames``/``n_grasps``, grasp rows point at existing frames and
    frames at the shard's scenes.

    Args:
        path_npz: the shard's ``.npz`` path.

    Raises:
        CorruptShardError: naming the shard and what is wrong.
    """
    path_npz = Path(path_npz)
    name = path_npz.stem
    meta = read_shard_meta(path_npz)
    if not path_npz.is_file():
        raise CorruptShardError(name, f"its data file {path_npz.name} is missing")
    size = path_npz.stat().st_size
    if size != meta.get("bytes"):
        raise CorruptShardError(
            name, f"{path_npz.name} has {size} bytes, expected {meta.get('bytes')} (truncated?)"
        )
    if _sha256_file(path_npz) != meta.get("sha256"):
        raise CorruptShardError(name, f"{path_npz.name} sha256 differs from the one recorded at write time")
    try:
        n_f, n_g = int(meta["n_frames"]), int(meta["n_grasps"])
        w, h = (int(v) for v in meta["image_size"])
        dims = {"F": n_f, "G": n_g, "H": h, "W": w}
        with zipfile.ZipFile(path_npz) as zf:
            members = set(zf.namelist())
            for arr_name, (dtype, shape) in ALL_ARRAYS.items():
                if arr_name + ".npy" not in members:
                    raise CorruptShardError(name, f"array '{arr_name}' is missing")
                got_shape, got_dtype = _npy_header(zf, arr_name + ".npy")
                want = tuple(dims.get(d, d) for d in shape)
                if got_shape != want or got_dtype != dtype:
                    raise CorruptShardError(
                        name, f"array '{arr_name}' is {got_dtype} {got_shape}, expected {dtype} {want}"
                    )
        with np.load(path_npz, allow_pickle=False) as npz:
            grasp_frame = npz["grasp_frame"]
            frame_scene = npz["frame_scene"]
            n_success = int(npz["grasp_success"].sum())
    except CorruptShardError:
        raise
    except (KeyError, TypeError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise CorruptShardError(name, f"undecodable: {type(exc).__name__}: {exc}") from exc
    if n_g and (grasp_frame.min() < 0 or grasp_frame.max() >= n_f or np.any(np.diff(grasp_frame) < 0)):
        raise CorruptShardError(name, "grasp_frame is not a sorted index into the shard's frames")
    if n_success != meta.get("n_success"):
        raise CorruptShardError(name, f"{n_success} successful grasps, metadata says {meta.get('n_success')}")
    if len(meta.get("frames", ())) != n_f:
        raise CorruptShardError(
            name, f"metadata lists {len(meta.get('frames', ()))} frames, n_frames is {n_f}"
        )
    if "scenes" in meta and n_f:
        a, b = meta["scenes"]
        if frame_scene.min() < a or frame_scene.max() >= b:
            raise CorruptShardError(name, f"frames belong to scenes outside its range [{a}, {b})")


# ----------------------------------------------------------------------------- manifest
#: Keys ``build_manifest`` needs in ``expected``.
MANIFEST_KEYS = (
    "profile",
    "seed",
    "config_hash",
    "scenes_per_shard",
    "n_scenes",
    "calibration",
    "image_size",
)


def build_manifest(out_dir: Path, expected: dict) -> dict:
    """Write ``out_dir/manifest.json`` from the shard metadata files, atomically.

    The manifest is a pure function of ``expected`` and the shards' ``.json`` files (no
    worker count, no timestamp), so any run of the same dataset writes the same bytes;
    an identical existing file is left untouched.

    Args:
        out_dir: the dataset folder (holding ``shards/``).
        expected: the dataset-level description: :data:`MANIFEST_KEYS` (``calibration`` is
            the nominal calibration dict, ``image_size`` the rendered ``[w, h]``); extra
            keys are copied into the manifest as they are.

    Returns:
        The manifest.

    Raises:
        ValueError: ``expected`` lacks a key.
        DatasetError: a shard is missing or belongs to another run (seed, config, range).
    """
    out_dir = Path(out_dir)
    missing_keys = [k for k in MANIFEST_KEYS if k not in expected]
    if missing_keys:
        raise ValueError(f"build_manifest: expected lacks {missing_keys}")
    n_scenes, per_shard = int(expected["n_scenes"]), int(expected["scenes_per_shard"])
    n_shards = math.ceil(n_scenes / per_shard)
    shards, missing = [], []
    totals = {"frames": 0, "grasps": 0, "successes": 0, "scenes_with_success": 0}
    for k in range(n_shards):
        path = out_dir / "shards" / f"{shard_name(k)}.npz"
        try:
            meta = read_shard_meta(path)
        except CorruptShardError:
            missing.append(shard_name(k))
            continue
        check_shard_belongs(meta, expected, k)
        want = list(shard_scenes(k, n_scenes, per_shard))
        if meta.get("scenes") != want:
            raise DatasetError(
                f"{shard_name(k)} holds scenes {meta.get('scenes')}, expected {want} "
                "(n_scenes or scenes_per_shard changed since it was rendered): rerun the render to replace it"
            )
        shards.append(
            {
                "name": shard_name(k),
                "scenes": meta["scenes"],
                "n_frames": meta["n_frames"],
                "n_grasps": meta["n_grasps"],
                "n_success": meta["n_success"],
                "n_scenes_with_success": meta["n_scenes_with_success"],
                "sha256": meta["sha256"],
                "bytes": meta["bytes"],
            }
        )
        totals["frames"] += meta["n_frames"]
        totals["grasps"] += meta["n_grasps"]
        totals["successes"] += meta["n_success"]
        totals["scenes_with_success"] += meta["n_scenes_with_success"]
    if missing:
        raise DatasetError(
            f"cannot build the manifest of {out_dir}: {len(missing)} of {n_shards} shards are not "
            f"finished ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})"
        )
    manifest = dict(expected)
    manifest.update(
        format_version=FORMAT_VERSION,
        n_shards=n_shards,
        totals=totals,
        shards=shards,
    )
    text = _dumps(manifest)
    path = out_dir / "manifest.json"
    if not (path.is_file() and path.read_text() == text):
        atomic_write_text(path, text)
    return json.loads(text)


def check_shard_belongs(meta: dict, expected: dict, k: int) -> None:
    """Raise :class:`DatasetError` when shard ``k`` was rendered by another run.

    Another run means another ``seed``, ``config_hash`` or ``profile``: its shards must
    not be mixed in (nor silently overwritten).
    """
    for key in ("seed", "config_hash", "profile"):
        if key in meta and meta[key] != expected[key]:
            raise DatasetError(
                f"{shard_name(k)} was rendered with {key}={meta[key]!r}, this run has {expected[key]!r}: "
                "the output folder holds another dataset; choose a new output_dir or delete it"
            )
