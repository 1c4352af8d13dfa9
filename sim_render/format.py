"""The rendered dataset's format: what every writer and reader of it imports.

Its constants (the version, the ``seg`` labels, the grasp sources), the arrays of a shard
(:data:`FRAME_ARRAYS` and :data:`GRASP_ARRAYS`: names, dtypes, shapes; their single source
of truth), the records a renderer hands the writer (:class:`FrameRecord`,
:class:`GraspLabels`), the errors, and the shard names. The files: ``docs/dataset.md``;
the writer and verifier: :mod:`sim_render.shard_io`; the torch reader: :mod:`sim_render.reader`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from perception.core.calibration import Calibration

__all__ = [
    "ALL_ARRAYS",
    "FORMAT_VERSION",
    "FRAME_ARRAYS",
    "GRASP_ARRAYS",
    "IMAGE_ARRAYS",
    "SEG_BACKGROUND",
    "SEG_BIN",
    "SEG_DISTRACTOR",
    "SEG_FIRST_OBJECT",
    "SOURCE_HEURISTIC",
    "SOURCE_PERTURBED",
    "SOURCE_RANDOM",
    "CorruptShardError",
    "DatasetError",
    "FrameRecord",
    "GraspLabels",
    "shard_name",
    "shard_scenes",
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

#: Every array of a shard, in the order the writer stores them.
ALL_ARRAYS = {**FRAME_ARRAYS, **GRASP_ARRAYS}
#: The per-pixel arrays (the reader loads only those a dataset asks for).
IMAGE_ARRAYS = ("rgb", "depth", "seg")


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


def shard_name(index: int) -> str:
    """``"shard-000042"`` for shard 42 (files ``shards/<name>.npz`` and ``.json``)."""
    return f"shard-{int(index):06d}"


def shard_scenes(k: int, n_scenes: int, scenes_per_shard: int) -> tuple[int, int]:
    """Half-open scene range ``[a, b)`` of shard ``k``."""
    a = k * scenes_per_shard
    return a, min(a + scenes_per_shard, n_scenes)
