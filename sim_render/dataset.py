"""The rendered dataset: shard format, shard writing/verification, manifest and torch reader.

The on-disk format is described in ``docs/dataset.md``; :data:`FRAME_ARRAYS` and
:data:`GRASP_ARRAYS` below are its single source of truth (names, dtypes, shapes), used
by the writer, the verifier and the reader alike.

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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from perception import jsonio
from perception.atomic import atomic_write_bytes, atomic_write_text
from perception.calibration import Calibration
from perception.geometry import project_points
from perception.grasp import normalize_angle

__all__ = [
    "FORMAT_VERSION",
    "FRAME_ARRAYS",
    "GRASP_ARRAYS",
    "SOURCE_HEURISTIC",
    "SOURCE_RANDOM",
    "SEG_BACKGROUND",
    "SEG_BIN",
    "SEG_DISTRACTOR",
    "SEG_FIRST_OBJECT",
    "CorruptShardError",
    "DatasetError",
    "FrameRecord",
    "GraspLabels",
    "SyntheticFrames",
    "MANIFEST_KEYS",
    "build_manifest",
    "check_shard_belongs",
    "read_shard_meta",
    "shard_name",
    "shard_scenes",
    "to_jsonable",
    "verify_shard",
    "write_shard",
]

#: Version of the on-disk format; bumped on any incompatible change.
FORMAT_VERSION = 1

#: ``grasp_source`` values.
SOURCE_HEURISTIC = 0
SOURCE_RANDOM = 1
SOURCE_PERTURBED = 2

#: ``seg`` labels: object ``i`` of a scene is ``SEG_FIRST_OBJECT + i``.
SEG_BACKGROUND = 0
SEG_BIN = 1
SEG_DISTRACTOR = 2
SEG_FIRST_OBJECT = 3

#: Per-frame arrays of a shard: name -> (dtype, shape). ``F`` frames, ``H x W`` pixels.
FRAME_ARRAYS: dict[str, tuple[np.dtype, tuple[int | str, ...]]] = {
    "rgb": (np.dtype(np.uint8), ("F", "H", "W", 3)),
    "depth": (np.dtype(np.float16), ("F", "H", "W")),
    "seg": (np.dtype(np.uint8), ("F", "H", "W")),
    "frame_scene": (np.dtype(np.int32), ("F",)),
    "camera_K": (np.dtype(np.float64), ("F", 3, 3)),
    "camera_dist": (np.dtype(np.float64), ("F", 5)),
    "camera_T_base_camera": (np.dtype(np.float64), ("F", 4, 4)),
}

#: Per-grasp arrays of a shard: name -> (dtype, shape). ``G`` grasp rows.
#: Every name but ``grasp_frame`` is ``"grasp_" + `` a :class:`GraspLabels` field.
GRASP_ARRAYS: dict[str, tuple[np.dtype, tuple[int | str, ...]]] = {
    "grasp_frame": (np.dtype(np.int32), ("G",)),
    "grasp_position": (np.dtype(np.float32), ("G", 3)),
    "grasp_yaw": (np.dtype(np.float32), ("G",)),
    "grasp_width": (np.dtype(np.float32), ("G",)),
    "grasp_success": (np.dtype(np.bool_), ("G",)),
    "grasp_pixel": (np.dtype(np.float32), ("G", 2)),
    "grasp_image_angle": (np.dtype(np.float32), ("G",)),
    "grasp_image_width": (np.dtype(np.float32), ("G",)),
    "grasp_object": (np.dtype(np.int16), ("G",)),
    "grasp_source": (np.dtype(np.uint8), ("G",)),
}

_ALL_ARRAYS = {**FRAME_ARRAYS, **GRASP_ARRAYS}
_IMAGE_ARRAYS = ("rgb", "depth", "seg")

#: Zip settings of the ``.npz``: deflate level 1 keeps nearly all of level 6's ratio on
#: rendered frames (rgb ~3x, depth and seg 30-50x) at a third of the time; the fixed
#: timestamp makes the bytes (and the sha256) reproducible.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_COMPRESSION = {"deflate": (zipfile.ZIP_DEFLATED, 1), "stored": (zipfile.ZIP_STORED, None)}


class DatasetError(ValueError):
    """A dataset folder is missing, incomplete, or holds data of another run.

    A ``ValueError``: it is bad input (a wrong folder), reported like other config errors.
    """


class CorruptShardError(DatasetError):
    """A shard is missing its metadata, truncated, altered or internally inconsistent.

    Args:
        name: the shard's name, e.g. ``"shard-000003"``.
        reason: what is wrong with it.
    """

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, reason)
        self.name = name
        self.reason = reason

    def __str__(self) -> str:
        return f"shard {self.name} is corrupt: {self.reason}"


# ----------------------------------------------------------------------------- records
@dataclass
class GraspLabels:
    """Labelled grasps seen in one frame (``G`` rows); arrays are cast on construction.

    Attributes:
        position: ``(G, 3)`` float32, fingertip midpoint in the base frame, metres.
        yaw: ``(G,)`` float32, base-frame yaw in ``(-pi/2, pi/2]``, radians.
        width: ``(G,)`` float32, opening before closing, metres.
        success: ``(G,)`` bool, the physics trial lifted an object.
        pixel: ``(G, 2)`` float32, raw (distorted) ``(u, v)`` of ``position`` in the frame.
        image_angle: ``(G,)`` float32, grasp angle in the raw image plane, radians.
        image_width: ``(G,)`` float32, opening in raw pixels.
        object: ``(G,)`` int16, index ``i`` of the targeted object (seg label ``3 + i``),
            ``-1`` for none.
        source: ``(G,)`` uint8, :data:`SOURCE_HEURISTIC` or :data:`SOURCE_RANDOM`.
    """

    position: np.ndarray
    yaw: np.ndarray
    width: np.ndarray
    success: np.ndarray
    pixel: np.ndarray
    image_angle: np.ndarray
    image_width: np.ndarray
    object: np.ndarray
    source: np.ndarray

    def __post_init__(self) -> None:
        n = None
        for f in fields(self):
            dtype, shape = GRASP_ARRAYS["grasp_" + f.name]
            arr = np.asarray(getattr(self, f.name))
            if arr.size == 0:
                arr = arr.reshape((0, *shape[1:]))
            arr = arr.astype(dtype, copy=False)
            if arr.ndim != len(shape) or arr.shape[1:] != tuple(shape[1:]):
                raise ValueError(f"GraspLabels.{f.name} has shape {arr.shape}, expected {shape}")
            if n is None:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise ValueError(f"GraspLabels.{f.name} has {arr.shape[0]} rows, position has {n}")
            setattr(self, f.name, arr)

    def __len__(self) -> int:
        return int(self.position.shape[0])

    @classmethod
    def empty(cls) -> GraspLabels:
        """Labels with no grasp (a frame whose scene yielded no candidate)."""
        return cls(**{f.name: np.zeros(0) for f in fields(cls)})

    def as_dict(self) -> dict[str, np.ndarray]:
        """The arrays keyed by field name (the reader's ``item["grasps"]``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class FrameRecord:
    """One rendered frame of one scene, with the grasps labelled for it.

    Attributes:
        rgb: ``(H, W, 3)`` uint8, the raw distorted frame as the camera delivers it.
        depth: ``(H, W)`` metres along the camera ``z``; 0 where nothing was hit.
            Stored as float16 (about 0.5 mm resolution at 1 m).
        seg: ``(H, W)`` uint8 labels, see :data:`SEG_BACKGROUND` and friends.
        camera: the camera actually used (jittered), at the rendered resolution.
        params: the randomization parameters of this frame (JSON-serialisable; numpy
            scalars and arrays are converted), enough to replay it.
        grasps: the scene's grasps, projected into this frame.
        scene: the scene index ``i`` (its randomness comes from ``SeedSequence([seed, i])``).
    """

    rgb: np.ndarray
    depth: np.ndarray
    seg: np.ndarray
    camera: Calibration
    params: dict
    grasps: GraspLabels
    scene: int


# ----------------------------------------------------------------------------- synthetic
class SyntheticFrames:
    """A PyBullet-free stand-in renderer: cheap, valid, seeded frames for tests and smoke runs.

    ``make_frames`` for :func:`sim_render.shards.render_shards` that follows the renderer
    rules (scene ``i`` draws everything from ``SeedSequence([seed, i])``; picklable). A
    scene is 1-5 coloured discs lying in the workspace, seen through the nominal camera
    with jittered focal length: ``rgb``, ``seg`` (bin outline, objects ``3 + i``) and
    ``depth`` (the table plane, discs 2 cm higher) agree with each other, and the grasp
    labels (heuristic ones on the discs, random ones elsewhere, random outcomes) are
    projected consistently, so training code can run end to end on a folder made in
    milliseconds. The pictures are not physics: use the real renderer for anything else.

    Args:
        seed: the dataset seed.
        calibration: the nominal calibration (object or dict).
        image_size: rendered ``(width, height)``.
        frames_per_scene: frames per scene.
    """

    def __init__(
        self,
        seed: int,
        calibration: Calibration | dict,
        image_size: tuple[int, int],
        frames_per_scene: int = 2,
    ) -> None:
        self.seed = int(seed)
        self.calibration = (
            calibration if isinstance(calibration, Calibration) else Calibration.from_dict(calibration)
        )
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.frames_per_scene = int(frames_per_scene)

    def __call__(self, scene: int) -> list[FrameRecord]:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(scene)]))
        nominal = self.calibration.scaled(self.image_size)
        (x0, x1), (y0, y1), z = nominal.workspace_x, nominal.workspace_y, nominal.table_z
        n_obj = int(rng.integers(1, 6))
        centers = np.column_stack(
            [
                rng.uniform(x0 + 0.04, x1 - 0.04, n_obj),
                rng.uniform(y0 + 0.04, y1 - 0.04, n_obj),
                np.full(n_obj, z + 0.02),
            ]
        )
        colors = rng.integers(40, 256, (n_obj, 3))
        # The scene's grasps: 1-3 on each disc, 2 random ones (no object, never succeed).
        per_obj = rng.integers(1, 4, n_obj)
        obj = np.concatenate([np.repeat(np.arange(n_obj), per_obj), [-1, -1]])
        pos = np.concatenate(
            [
                centers[obj[:-2]],
                np.column_stack([rng.uniform(x0, x1, 2), rng.uniform(y0, y1, 2), [z + 0.01] * 2]),
            ]
        )
        yaw = normalize_angle(rng.uniform(-np.pi, np.pi, len(obj)))
        width = rng.uniform(0.03, 0.08, len(obj))
        success = (obj >= 0) & (rng.random(len(obj)) < 0.5)
        source = np.where(obj >= 0, SOURCE_HEURISTIC, SOURCE_RANDOM)

        w, h = self.image_size
        frames = []
        for _ in range(self.frames_per_scene):
            focal = float(rng.uniform(0.97, 1.03))
            K = nominal.K.copy()
            K[0, 0] *= focal
            K[1, 1] *= focal
            camera = nominal.replace(K=K)
            # Depth of the table plane along each pixel's ray (camera z), then discs on top.
            uu, vv = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))
            uv = np.column_stack([uu.ravel(), vv.ravel()]).reshape(-1, 1, 2)
            xy = cv2.undistortPoints(uv, camera.K, camera.dist).reshape(-1, 2)
            rays = np.column_stack([xy, np.ones(len(xy))])  # camera frame, unit z
            R, c = camera.T_base_camera[:3, :3], camera.T_base_camera[:3, 3]
            ray_z = rays @ R[2]
            depth = np.where(ray_z < -1e-6, (z - c[2]) / np.minimum(ray_z, -1e-6), 0.0).reshape(h, w)
            table_rgb = rng.integers(60, 200, 3)
            rgb = np.clip(table_rgb + rng.normal(0, 4, (h, w, 3)), 0, 255).astype(np.uint8)
            seg = np.full((h, w), SEG_BACKGROUND, np.uint8)
            corners = project_points(nominal.workspace_corners(), camera).round().astype(np.int32)
            cv2.polylines(seg, [corners], True, SEG_BIN, max(1, w // 160))
            cam_centers = (centers - c) @ R  # base -> camera frame
            for k, uv in enumerate(project_points(centers, camera)):
                radius = max(1, int(round(K[0, 0] * 0.025 / cam_centers[k, 2])))
                mask = np.zeros((h, w), np.uint8)
                cv2.circle(mask, (int(round(uv[0])), int(round(uv[1]))), radius, 1, -1)
                on = mask.astype(bool)
                seg[on] = SEG_FIRST_OBJECT + k
                rgb[on] = colors[k]
                depth[on] = cam_centers[k, 2]
            pixel = project_points(pos, camera)
            half = 0.5 * width[:, None] * np.column_stack([np.cos(yaw), np.sin(yaw), np.zeros_like(yaw)])
            tips = project_points(np.concatenate([pos - half, pos + half]), camera)
            line = tips[len(pos) :] - tips[: len(pos)]
            frames.append(
                FrameRecord(
                    rgb=rgb,
                    depth=depth.astype(np.float32),
                    seg=seg,
                    camera=camera,
                    params={
                        "focal_scale": focal,
                        "table_rgb": table_rgb,
                        "centers": centers,
                        "colors": colors,
                    },
                    grasps=GraspLabels(
                        position=pos,
                        yaw=yaw,
                        width=width,
                        success=success,
                        pixel=pixel,
                        image_angle=normalize_angle(np.arctan2(line[:, 1], line[:, 0])),
                        image_width=np.linalg.norm(line, axis=1),
                        object=obj,
                        source=source,
                    ),
                    scene=int(scene),
                )
            )
        return frames


# ----------------------------------------------------------------------------- helpers
def shard_name(index: int) -> str:
    """``"shard-000042"`` for shard 42 (files ``shards/<name>.npz`` and ``.json``)."""
    return f"shard-{int(index):06d}"


def to_jsonable(value: Any) -> Any:
    """Plain JSON types for shard metadata: :func:`perception.jsonio.to_jsonable`, strict
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
    """Validate the records and assemble the shard's arrays (in :data:`_ALL_ARRAYS` order)."""
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
        dtype, shape = _ALL_ARRAYS[name]
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
    return {name: out[name] for name in _ALL_ARRAYS}


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
            for arr_name, (dtype, shape) in _ALL_ARRAYS.items():
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


def shard_scenes(k: int, n_scenes: int, scenes_per_shard: int) -> tuple[int, int]:
    """Half-open scene range ``[a, b)`` of shard ``k``."""
    a = k * scenes_per_shard
    return a, min(a + scenes_per_shard, n_scenes)


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




def __getattr__(name: str) -> Any:
    # The torch reader lives in sim_render.reader, so render workers never import torch.
    if name in ("SimFrameDataset", "collate_frames"):
        from sim_render import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
