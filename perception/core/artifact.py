"""The policy artifact (``ARTIFACT/policy.onnx`` + ``ARTIFACT/metadata.json``) and its runner.

The artifact is the only thing the robot side loads: an ONNX graph and a JSON file,
never a pickle. :func:`load_metadata` validates ``metadata.json``;
:class:`PolicyRunner` wraps an onnxruntime session and turns one raw camera frame into
the policy's maps (:class:`PolicyMaps`), using the same :func:`perception.core.preprocess.preprocess`
as training, and (:meth:`PolicyRunner.decide`) into the decoded grasp.

Metadata (``format_version`` 1)::

    {"format": "sim2real-grasp-policy", "format_version": 1, "onnx": "policy.onnx",
     "input": {"name": "image", "layout": "NCHW", "channels": "RGB", "dtype": "float32",
               "size": [W, H], "mean": [3], "std": [3]},
     "outputs": {"quality": "quality", "width": "width", "height": "height",
                 "surface": "surface"},                        (surface optional)
     "angle_bins": A, "quality_threshold": 0.5,
     "decode": {"neighbourhood_px": 1, "width_margin": 0.08,   (optional; absent: 0, 0)
                "rule": {...},                                 (optional; needs surface)
                "on_part_px": 1,                               (optional; needs surface or geometry)
                "fingers_clear": 0.25,                         (optional; needs surface or geometry)
                "jaws_on_part": 1.0,                           (optional; needs surface or geometry)
                "sweep_depth": 0.02,                           (optional, metres; needs surface or geometry)
                "part_centre": 0.3},                           (optional; needs surface or geometry)
     "geometry": {"onnx": "geometry.onnx", "input": {"name": "image", "mean": [3], "std": [3]},
                  "outputs": {"height": "height", "part": "part"}, "view": NetworkView.to_dict(),
                  "part_threshold": 0.5, "interior_margin": 0.01, "floor_height": 0.0072,
                  "int8": {...}},                              (optional; int8 optional, as below)
     "int8": {"onnx": "policy.int8.onnx", "onnx_sha256": "<hex>", "frames": 64,
              "max_abs_diff": {...}, "mean_abs_diff": {...}},  (optional)
     "view": NetworkView.to_dict(), "calibration": {contract calibration},
     "training": {...}, "code_version": "...",
     "onnx_sha256": "<hex>"}                                   (and geometry.onnx_sha256)

``onnx_sha256`` is the SHA-256 of the ONNX file's bytes: the loader refuses a file that
does not match it (a swapped or corrupted graph), and warns when it is absent (artifacts
written before it existed).

``int8`` (optional, in the policy's entry and in ``geometry``): the same graph with its
weights and activations quantized to 8 bits (:mod:`policies.int8`), written beside the
float one, with its own hash and its measured difference from it. On a CPU the runner
runs these (about twice as fast); on a GPU, or with ``precision="fp32"``, the float
graphs. The float graphs stay the reference: they are what the export verified against
torch.

ONNX outputs: ``quality`` ``(N, A, H, W)`` success probability per image-plane angle bin
(:func:`perception.core.grasp.angle_bin_centers`), ``width`` ``(N, 1, H, W)`` opening in metres,
``height`` ``(N, 1, H, W)`` fingertip height above ``table_z`` in metres, and (artifacts
that carry it) ``surface`` ``(N, 1, H, W)`` the surface seen from above, metres above
``table_z``, which the decode's grasp rule (``decode.rule``, :mod:`perception.core.rule`) runs on.

``geometry`` (optional): a second graph on the *camera* view (``kind="camera"``) with outputs
``height`` ``(N, 1, H, W)``, metres above ``table_z`` of what each pixel sees, and ``part``
``(N, 1, H, W)``, the probability that it sees a part. The runner rebuilds the top-down
surface from them through the serving calibration
(:class:`perception.core.geometry.SurfaceRebuild`) and it replaces the ``surface`` map:
the grasp rule then runs on geometry seen where a part's edges are the image's edges.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from perception.core.background import BackgroundError, BackgroundModel
from perception.core.calibration import Calibration, CalibrationError
from perception.core.decode import DecodedGrasp, DecodeOptions, DecodeOptionsError, decode_grasp
from perception.core.frames import rotation_angle
from perception.core.geometry import NetworkView, SurfaceRebuild
from perception.core.grasp import Grasp
from perception.core.jsonio import read_json, to_jsonable, write_json
from perception.core.preprocess import IMAGE_MEAN, IMAGE_STD, preprocess, to_network_input
from perception.core.rule import CHECK_OPTIONS

__all__ = [
    "ARTIFACT_FORMAT",
    "ARTIFACT_FORMAT_VERSION",
    "ArtifactError",
    "ArtifactMetadata",
    "GeometryMetadata",
    "PolicyMaps",
    "PolicyRunner",
    "PRECISIONS",
    "load_metadata",
    "policy_metadata",
    "write_metadata",
    "file_sha256",
    "calibration_drift",
    "check_calibration",
]

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = "sim2real-grasp-policy"
ARTIFACT_FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
#: Bytes a metadata.json may have (a real one is tens of kB): checked before it is read, so a
#: huge or wrong file costs no memory.
MAX_METADATA_BYTES = 4 * 1024 * 1024

#: Drift between the serving calibration and the artifact's above which a warning is logged.
DRIFT_FOCAL_REL = 0.02  # fraction of fx / fy
DRIFT_PRINCIPAL_PX = 8.0  # pixels
DRIFT_TRANSLATION_M = 0.01  # metres
DRIFT_ROTATION_RAD = math.radians(1.0)
#: A quality threshold below this lets nearly every grasp through: a warning at load.
LOW_THRESHOLD_WARNING = 0.05
#: The runner's ``precision``: ``auto`` runs the int8 graphs when the artifact has them and the
#: graphs run on the CPU, ``fp32`` the float graphs, ``int8`` the int8 graphs (an error without them).
PRECISIONS = ("auto", "fp32", "int8")


class ArtifactError(ValueError):
    """The artifact is missing, of another format, inconsistent, or does not fit the camera."""


@dataclass(frozen=True, eq=False)
class GeometryMetadata:
    """The artifact's optional geometry graph (``metadata.json`` ``geometry``).

    Attributes:
        onnx_path: its ONNX file inside the artifact.
        input_name, mean, std: as the policy's input.
        outputs: ``{"height": name, "part": name}``.
        view: its camera view (``kind="camera"``).
        part_threshold: a pixel sees a part at or above this probability.
        interior_margin, floor_height: metres, see :class:`perception.core.geometry.SurfaceRebuild`.
        int8_onnx_path: its int8 graph (``geometry.int8``), or ``None``.
        walls: ``(height, thickness)`` metres of the bin's walls (``geometry.walls``, optional):
            the rebuild stands them inside the workspace edges; ``None``: as the network reads them.
    """

    onnx_path: Path
    input_name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    outputs: dict[str, str]
    view: NetworkView
    part_threshold: float
    interior_margin: float
    floor_height: float
    int8_onnx_path: Path | None = None
    walls: tuple[float, float] | None = None


def _walls(entry: Any) -> tuple[float, float] | None:
    """``geometry.walls``: absent or null, or ``{"height": m, "thickness": m, ...}`` (other keys,
    such as where the numbers came from, are kept in the file and not read)."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ArtifactError("field 'geometry.walls' must be an object {height, thickness} in metres (or absent)")
    try:
        height, thickness = float(_req(entry, "height", "geometry.walls")), float(_req(entry, "thickness", "geometry.walls"))
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"fields 'geometry.walls.height' and 'thickness' must be numbers: {exc}") from exc
    if not (0.0 < height <= 0.2 and 0.0 < thickness <= 0.1):
        raise ArtifactError(f"field 'geometry.walls': height in (0, 0.2] m and thickness in (0, 0.1] m, "
                            f"got {height!r} and {thickness!r}")
    return height, thickness


def _geometry_metadata(root: Path, g: Any) -> GeometryMetadata:
    if not isinstance(g, dict):
        raise ArtifactError("field 'geometry' must be an object (or absent)")
    name = _req(g, "onnx", "geometry")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".onnx"):
        raise ArtifactError(f"field 'geometry.onnx' must be a plain *.onnx file name inside the artifact, got {name!r}")
    if not (root / name).is_file():
        raise ArtifactError(f"geometry ONNX file {root / name} not found")
    _check_sha256(root / name, g.get("onnx_sha256"), "geometry.onnx_sha256")
    inp = _req(g, "input", "geometry")
    input_name = _req(inp, "name", "geometry.input")
    if not isinstance(input_name, str) or not input_name:
        raise ArtifactError("field 'geometry.input.name' must be a non-empty string")
    outs = _req(g, "outputs", "geometry")
    outputs = {}
    for key in ("height", "part"):
        val = _req(outs, key, "geometry.outputs")
        if not isinstance(val, str) or not val:
            raise ArtifactError(f"field 'geometry.outputs.{key}' must be an ONNX output name")
        outputs[key] = val
    try:
        view = NetworkView.from_dict(_req(g, "view", "geometry"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"field 'geometry.view' must be {{'K': 3x3, 'size': [W, H]}}: {exc}") from exc
    if view.is_table:
        raise ArtifactError("field 'geometry.view' must be a camera view (kind 'camera')")
    try:
        thr, margin, floor = (float(_req(g, k, "geometry")) for k in ("part_threshold", "interior_margin", "floor_height"))
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"fields 'geometry.part_threshold', 'interior_margin', 'floor_height' must be numbers: {exc}") from exc
    if not 0.0 < thr < 1.0 or not 0.0 <= margin < 0.5 or not 0.0 <= floor < 0.1:
        raise ArtifactError("field 'geometry': part_threshold in (0, 1), interior_margin in [0, 0.5) m, "
                            "floor_height in [0, 0.1) m")
    return GeometryMetadata(onnx_path=root / name, input_name=input_name, mean=_triple(inp, "mean", "geometry.input"),
                            std=_triple(inp, "std", "geometry.input"), outputs=outputs, view=view, part_threshold=thr,
                            interior_margin=margin, floor_height=floor,
                            int8_onnx_path=_int8_path(root, g.get("int8"), "geometry.int8"),
                            walls=_walls(g.get("walls")))


def _int8_path(root: Path, entry: Any, where: str) -> Path | None:
    """The int8 graph an ``int8`` entry names (checked against its hash), or ``None`` when absent."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ArtifactError(f"field {where!r} must be an object (or absent)")
    name = _req(entry, "onnx", where)
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".onnx"):
        raise ArtifactError(f"field '{where}.onnx' must be a plain *.onnx file name inside the artifact, got {name!r}")
    if not (root / name).is_file():
        raise ArtifactError(f"int8 ONNX file {root / name} not found ({where})")
    if entry.get("onnx_sha256") is None:  # written together with the graph: no old int8 entries without it
        raise ArtifactError(f"field '{where}.onnx_sha256' is missing")
    _check_sha256(root / name, entry["onnx_sha256"], f"{where}.onnx_sha256")
    return root / name


@dataclass(frozen=True, eq=False)
class ArtifactMetadata:
    """Validated ``metadata.json``.

    Attributes:
        path: the artifact directory.
        onnx_path: the ONNX file inside it.
        input_name: ONNX input name.
        input_size: ``(W, H)`` of the network input (equals ``view.size``).
        mean, std: per-channel RGB normalisation of ``x / 255``.
        outputs: ``{"quality": name, "width": name, "height": name}`` ONNX output names,
            and ``"surface"`` when the graph has it.
        angle_bins: number of image-plane angle bins ``A``.
        quality_threshold: default decision threshold.
        decode_options: the :class:`~perception.core.decode.DecodeOptions` the policy was tuned
            with (``metadata.json: decode``, checked), its threshold ``quality_threshold``:
            what :meth:`PolicyRunner.decide` decodes with by default.
        view: the network's :class:`~perception.core.geometry.NetworkView`.
        calibration: the calibration the policy was trained for.
        raw: the whole JSON document.
        geometry: the geometry graph (:class:`GeometryMetadata`), or ``None``.
        int8_onnx_path: the policy's int8 graph (``int8``), or ``None``.
        background: the fixed camera's empty bin in the policy's view (``background``,
            optional; :mod:`perception.core.background`), or ``None``.
    """

    path: Path
    onnx_path: Path
    input_name: str
    input_size: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    outputs: dict[str, str]
    angle_bins: int
    quality_threshold: float
    view: NetworkView
    calibration: Calibration
    decode_options: DecodeOptions
    raw: dict = field(default_factory=dict)
    geometry: GeometryMetadata | None = None
    int8_onnx_path: Path | None = None
    background: BackgroundModel | None = None

    @property
    def code_version(self) -> str | None:
        return self.raw.get("code_version")

    @property
    def decode(self) -> dict:
        """The decode options as ``metadata.json`` holds them (:meth:`DecodeOptions.to_dict`:
        ``neighbourhood_px``, ``width_margin`` and the options that are on), derived from
        :attr:`decode_options`."""
        return self.decode_options.to_dict()


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def calibration_sha256(calibration: dict) -> str:
    """Hex SHA-256 of the metadata's ``calibration`` block (canonical JSON): it holds the
    safety fields (workspace, table_z, the camera's pose) a service without its own
    ``calibration=`` serves by, so an edit of them after export is refused."""
    return hashlib.sha256(json.dumps(calibration, sort_keys=True).encode()).hexdigest()


def _check_sha256(path: Path, want: Any, field_name: str) -> None:
    if want is None:
        log.warning("artifact field %r is absent: %s is not checked against its hash (an artifact from before "
                    "hashes; export it again)", field_name, path.name)
        return
    if not isinstance(want, str) or len(want) != 64:
        raise ArtifactError(f"field {field_name!r} must be a hex SHA-256 (64 characters)")
    got = file_sha256(path)
    if got != want.lower():
        raise ArtifactError(f"{path} does not match the artifact's {field_name} ({got[:12]}... against "
                            f"{want[:12]}...): the file was changed or corrupted after export")


def _req(d: Any, key: str, where: str = "metadata") -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ArtifactError(f"artifact {where} field '{key}' is missing")
    return d[key]


def _triple(d: dict, key: str, where: str = "input") -> tuple[float, float, float]:
    try:
        vals = tuple(float(v) for v in d[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"artifact metadata field '{where}.{key}' must be 3 numbers") from exc
    if len(vals) != 3 or not all(math.isfinite(v) for v in vals):
        raise ArtifactError(f"artifact metadata field '{where}.{key}' must be 3 finite numbers")
    if key == "std" and any(v <= 0 for v in vals):
        raise ArtifactError(f"artifact metadata field '{where}.std' must be positive")
    return vals  # type: ignore[return-value]


def _decode_options(d: Any, threshold: float) -> DecodeOptions:
    """The validated ``decode`` options (:meth:`DecodeOptions.from_dict`: unknown keys are refused,
    they would be silently ignored), with the artifact's quality threshold."""
    try:
        return DecodeOptions.from_dict(d, threshold=threshold)
    except DecodeOptionsError as exc:
        raise ArtifactError(f"artifact metadata field{'s' if len(exc.keys) > 1 else ''} "
                            f"{exc.located('decode', quote=chr(39))}") from exc


def policy_metadata(
    onnx_name: str,
    input_size: tuple[int, int],
    output_names: Any,
    angle_bins: int,
    quality_threshold: float,
    view: NetworkView,
    calibration: Calibration,
    training: dict,
    code_version: str,
    decode: dict | None = None,
) -> dict:
    """The ``metadata.json`` of a policy artifact, every field :func:`load_metadata` reads,
    built in one place for every writer (the exporter, the test artifacts).

    Args:
        onnx_name: the graph's file name inside the artifact.
        input_size: ``(W, H)`` of the network input (the view's size).
        output_names: the graph's output names (``quality``, ``width``, ``height``[, ``surface``]).
        training: what the artifact was trained on (stored as ``training``).
        code_version: the commit it was exported at.
        decode: the ``decode`` mapping (:meth:`perception.core.decode.DecodeOptions.from_dict`
            reads it; ``None``: none).
    """
    w, h = (int(v) for v in input_size)
    return {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_FORMAT_VERSION,
        "onnx": onnx_name,
        "input": {"name": "image", "layout": "NCHW", "channels": "RGB", "dtype": "float32", "size": [w, h],
                  "mean": list(IMAGE_MEAN), "std": list(IMAGE_STD)},
        "outputs": {k: k for k in output_names},
        "angle_bins": int(angle_bins),
        "quality_threshold": float(quality_threshold),
        "decode": dict(decode or {}),
        "view": view.to_dict(),
        "calibration": calibration.to_dict(),
        "training": dict(training),
        "code_version": str(code_version),
    }


def write_metadata(artifact_dir: str | Path, meta: dict) -> ArtifactMetadata:
    """Write ``artifact_dir/metadata.json`` atomically once it reads back as :func:`load_metadata`
    reads it (graphs present, hashes matching): no writer leaves metadata the loader refuses.

    ``onnx_sha256`` is filled in from the graph when absent.

    Raises:
        ArtifactError: the metadata would not load (nothing is written).
    """
    root = Path(artifact_dir)
    meta = to_jsonable(meta)
    if "onnx_sha256" not in meta and isinstance(meta.get("onnx"), str) and (root / meta["onnx"]).is_file():
        meta["onnx_sha256"] = file_sha256(root / meta["onnx"])
    if "calibration_sha256" not in meta and isinstance(meta.get("calibration"), dict):
        meta["calibration_sha256"] = calibration_sha256(meta["calibration"])
    parsed = _parse_metadata(root, meta)
    write_json(root / METADATA_FILE, meta)
    return parsed


def load_metadata(artifact_dir: str | Path) -> ArtifactMetadata:
    """Read and validate ``artifact_dir/metadata.json``.

    Raises:
        ArtifactError: naming the file and the field that is wrong.
    """
    root = Path(artifact_dir)
    if not root.is_dir():
        raise ArtifactError(f"artifact directory not found: {root}")
    meta_path = root / METADATA_FILE
    if not meta_path.is_file():
        raise ArtifactError(f"{meta_path} not found: not a {ARTIFACT_FORMAT} artifact")
    size = meta_path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise ArtifactError(f"{meta_path} is {size} bytes, over the {MAX_METADATA_BYTES} a metadata file may have: "
                            "not an artifact's metadata (export the policy again)")
    try:
        raw = read_json(meta_path)
    except OSError as exc:
        raise ArtifactError(f"{meta_path} cannot be read: {exc}") from exc
    except ValueError as exc:
        raise ArtifactError(str(exc)) from exc
    try:
        return _parse_metadata(root, raw)
    except ArtifactError as exc:
        raise ArtifactError(f"{meta_path}: {exc}") from exc


def _check_calibration_sha256(raw: dict) -> None:
    want = raw.get("calibration_sha256")
    if want is None:
        log.warning("artifact field 'calibration_sha256' is absent: the workspace and camera it was exported for "
                    "are not checked against their hash (an artifact from before it; export it again, or serve "
                    "with calibration=FILE)")
        return
    if not isinstance(want, str) or want.lower() != calibration_sha256(raw["calibration"]):
        raise ArtifactError("field 'calibration' does not match 'calibration_sha256': its workspace, table or camera "
                            "was changed after export. Export the policy again (a wider workspace is not a setting)")


def _parse_input(inp: Any) -> tuple[str, tuple[int, int], tuple, tuple]:
    """The ``input`` field: the graph's input name, ``(W, H)``, the normalisation's mean and std."""
    name = _req(inp, "name", "input")
    if not isinstance(name, str) or not name:
        raise ArtifactError("field 'input.name' must be a non-empty string")
    for key, want in (("layout", "NCHW"), ("channels", "RGB"), ("dtype", "float32")):
        got = _req(inp, key, "input")
        if got != want:
            raise ArtifactError(f"field 'input.{key}' is {got!r}; only {want!r} is supported")
    try:
        w, h = (int(v) for v in _req(inp, "size", "input"))
    except (TypeError, ValueError) as exc:
        raise ArtifactError("field 'input.size' must be [width, height]") from exc
    if w <= 0 or h <= 0:
        raise ArtifactError("field 'input.size' must be positive")
    return name, (w, h), _triple(inp, "mean"), _triple(inp, "std")


def _parse_outputs(outs: Any) -> dict[str, str]:
    """The ``outputs`` field: map name -> the graph's output name (``surface`` optional)."""
    outputs = {}
    for key in ("quality", "width", "height", "surface"):
        if key == "surface" and isinstance(outs, dict) and key not in outs:
            continue  # artifacts before the surface map
        val = _req(outs, key, "outputs")
        if not isinstance(val, str) or not val:
            raise ArtifactError(f"field 'outputs.{key}' must be an ONNX output name")
        outputs[key] = val
    return outputs


def _parse_metadata(root: Path, raw: Any) -> ArtifactMetadata:
    if not isinstance(raw, dict):
        raise ArtifactError("metadata must be a JSON object")
    fmt = raw.get("format")
    if fmt != ARTIFACT_FORMAT:
        raise ArtifactError(f"format is {fmt!r}, expected {ARTIFACT_FORMAT!r}")
    version = raw.get("format_version")
    if version != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(
            f"format_version {version!r} is not supported (this code reads {ARTIFACT_FORMAT_VERSION})"
        )
    onnx_name = _req(raw, "onnx")
    if not isinstance(onnx_name, str) or Path(onnx_name).name != onnx_name or not onnx_name.endswith(".onnx"):
        raise ArtifactError(f"field 'onnx' must be a plain *.onnx file name inside the artifact, got {onnx_name!r}")
    onnx_path = root / onnx_name
    if not onnx_path.is_file():
        raise ArtifactError(f"ONNX file {onnx_path} not found")
    _check_sha256(onnx_path, raw.get("onnx_sha256"), "onnx_sha256")

    name, (w, h), mean, std = _parse_input(_req(raw, "input"))
    outputs = _parse_outputs(_req(raw, "outputs"))
    try:
        angle_bins = int(_req(raw, "angle_bins"))
        threshold = float(_req(raw, "quality_threshold"))
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"'angle_bins' and 'quality_threshold' must be numbers: {exc}") from exc
    if angle_bins < 1:
        raise ArtifactError("field 'angle_bins' must be >= 1")
    if not 0.0 <= threshold <= 1.0:
        raise ArtifactError("field 'quality_threshold' must be in [0, 1]")
    if threshold < LOW_THRESHOLD_WARNING:
        log.warning("the artifact's quality_threshold is %.3f: nearly every grasp passes it, and an empty bin is "
                    "answered with a grasp", threshold)
    decode_options = _decode_options(raw.get("decode", {}), threshold)
    try:
        view = NetworkView.from_dict(_req(raw, "view"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"field 'view' must be {{'K': 3x3, 'size': [W, H]}}: {exc}") from exc
    if view.K.shape != (3, 3) or not np.all(np.isfinite(view.K)):
        raise ArtifactError("field 'view.K' must be a finite 3x3 matrix")
    if tuple(view.size) != (w, h):
        raise ArtifactError(f"field 'view.size' {list(view.size)} differs from 'input.size' {[w, h]}")
    geometry = _geometry_metadata(root, raw["geometry"]) if raw.get("geometry") is not None else None
    if geometry is not None and not view.is_table:
        raise ArtifactError("field 'geometry' needs a top-down policy view (view.kind 'table'): the surface is rebuilt onto it")
    for key in ("rule", "rule_first", "on_part_px", *CHECK_OPTIONS):
        if getattr(decode_options, key) is not None and (("surface" not in outputs and geometry is None) or not view.is_table):
            raise ArtifactError(f"field 'decode.{key}' needs a 'surface' output or a 'geometry' graph, and a "
                                "top-down view (view.kind 'table')")
    if decode_options.unseen_standing and geometry is None:
        raise ArtifactError("field 'decode.unseen_standing' needs a 'geometry' graph (the cells the camera saw are "
                            "those of its rebuilt surface)")
    try:
        calib = Calibration.from_dict(_req(raw, "calibration"), check_view=False)
        _check_calibration_sha256(raw)
    except CalibrationError as exc:
        raise ArtifactError(f"field 'calibration': {exc}") from exc
    return ArtifactMetadata(
        path=root,
        onnx_path=onnx_path,
        input_name=name,
        input_size=(w, h),
        mean=mean,
        std=std,
        outputs=outputs,
        angle_bins=angle_bins,
        quality_threshold=threshold,
        view=view,
        calibration=calib,
        decode_options=decode_options,
        raw=raw,
        geometry=geometry,
        int8_onnx_path=_int8_path(root, raw.get("int8"), "int8"),
        background=_background(root, raw.get("background"), view),
    )


def _background(root: Path, entry: Any, view: NetworkView) -> BackgroundModel | None:
    """``background``: absent or null, or ``{"image": "*.png", "image_sha256": hex, "threshold":
    t, "min_part_px": n[, "gate": g], ...}`` (other keys, such as what it was made from, are
    kept and not read); the image is the policy's view size."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ArtifactError("field 'background' must be an object {image, image_sha256, threshold, min_part_px} "
                            "(or absent)")
    name = _req(entry, "image", "background")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".png"):
        raise ArtifactError(f"field 'background.image' must be a plain *.png file name inside the artifact, got {name!r}")
    path = root / name
    if not path.is_file():
        raise ArtifactError(f"background image {path} not found")
    if entry.get("image_sha256") is None:  # written together with the image: no entries without it
        raise ArtifactError("field 'background.image_sha256' is missing")
    _check_sha256(path, entry["image_sha256"], "background.image_sha256")
    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    W, H = view.size
    if bgr is None or bgr.shape != (H, W, 3):
        raise ArtifactError(f"background image {path} is {None if bgr is None else bgr.shape}, not the policy "
                            f"view's ({H}, {W}, 3)")
    try:
        return BackgroundModel(image=cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB),
                               threshold=float(_req(entry, "threshold", "background")),
                               min_part_px=int(_req(entry, "min_part_px", "background")),
                               gate=entry.get("gate") or "below_threshold")
    except (TypeError, ValueError, BackgroundError) as exc:
        raise ArtifactError(f"field 'background': {exc}") from exc


def calibration_drift(trained: Calibration, serving: Calibration) -> list[str]:
    """Human-readable differences between the trained-for and the serving calibration.

    Only differences above the ``DRIFT_*`` tolerances are listed; an empty list means the
    camera matches what the policy was trained for. ``image_size`` is not compared here
    (see :func:`check_calibration`).
    """
    out = []
    Kt, Ks = trained.K, serving.K
    for i, name in ((0, "fx"), (1, "fy")):
        rel = abs(Ks[i, i] - Kt[i, i]) / Kt[i, i]
        if rel > DRIFT_FOCAL_REL:
            out.append(f"K {name} {Ks[i, i]:.1f} differs from the trained {Kt[i, i]:.1f} by {100 * rel:.1f}%")
    for i, name in ((0, "cx"), (1, "cy")):
        d = abs(Ks[i, 2] - Kt[i, 2])
        if d > DRIFT_PRINCIPAL_PX:
            out.append(f"K {name} {Ks[i, 2]:.1f} differs from the trained {Kt[i, 2]:.1f} by {d:.1f} px")
    dt = float(np.linalg.norm(serving.T_base_camera[:3, 3] - trained.T_base_camera[:3, 3]))
    if dt > DRIFT_TRANSLATION_M:
        out.append(f"camera position moved {1000 * dt:.1f} mm from the trained pose")
    dr = rotation_angle(serving.T_base_camera[:3, :3], trained.T_base_camera[:3, :3])
    if dr > DRIFT_ROTATION_RAD:
        out.append(f"camera orientation turned {math.degrees(dr):.2f} deg from the trained pose")
    return out


def check_calibration(meta: ArtifactMetadata, calib: Calibration) -> list[str]:
    """Refuse a serving calibration of another ``image_size`` or one whose workspace does
    not hold the artifact's; return drift warnings.

    Raises:
        ArtifactError: when ``calib.image_size`` differs from the artifact's, or the
            artifact's workspace reaches outside the serving one (a widened workspace in
            a changed ``metadata.json``).
    """
    if tuple(calib.image_size) != tuple(meta.calibration.image_size):
        W, H = calib.image_size
        Wt, Ht = meta.calibration.image_size
        raise ArtifactError(
            f"the calibration's image_size is {W}x{H} but the policy in {meta.path} was trained "
            f"for {Wt}x{Ht} frames: use the calibration of the camera the policy was trained for, "
            "or retrain the policy with this calibration"
        )
    tol = 1e-3  # m: a rounded number in a hand-edited calibration is not a widened workspace
    for axis, (lo, hi), (tlo, thi) in (("x", calib.workspace_x, meta.calibration.workspace_x),
                                       ("y", calib.workspace_y, meta.calibration.workspace_y)):
        if tlo < lo - tol or thi > hi + tol:
            raise ArtifactError(
                f"the artifact's workspace.{axis} [{tlo:.3f}, {thi:.3f}] m reaches outside the serving "
                f"calibration's [{lo:.3f}, {hi:.3f}] m: export the policy for this calibration")
    return calibration_drift(meta.calibration, calib)


@dataclass(frozen=True)
class PolicyMaps:
    """The policy's output for one frame (batch dimension removed).

    Shapes: ``quality (A, H, W)``, ``width (H, W)`` metres, ``height (H, W)`` metres,
    ``surface (H, W)`` metres (``None`` for artifacts without it). ``view_rgb`` is the
    network's input image ``(H, W, 3)`` uint8 (for debugging). ``seen (H, W)`` bool: with a
    geometry graph, the cells of the rebuilt surface the camera saw
    (:meth:`perception.core.geometry.SurfaceRebuild.top_down`); ``None`` without one.
    """

    quality: np.ndarray
    width: np.ndarray
    height: np.ndarray
    view_rgb: np.ndarray | None = None
    surface: np.ndarray | None = None
    seen: np.ndarray | None = None


def default_providers() -> list[str]:
    """CUDA when onnxruntime has it, else CPU."""
    import onnxruntime as ort  # lazy: onnxruntime (only to run a graph, not to read the metadata)

    avail = ort.get_available_providers()
    if "CUDAExecutionProvider" in avail:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class PolicyRunner:
    """Runs the exported policy on raw camera frames with onnxruntime (thread-safe).

    Args:
        artifact_dir: folder holding ``metadata.json`` and the ONNX file.
        calibration: the serving camera (a :class:`Calibration`, a path, or ``None`` for
            the artifact's own). A different ``image_size`` raises :class:`ArtifactError`;
            drift of ``K`` or the pose is logged and listed in :attr:`warnings`.
        intra_op_num_threads: onnxruntime intra-op threads (``None``: onnxruntime's choice).
        providers: onnxruntime execution providers (``None``: :func:`default_providers`).
        allow_spinning: let idle onnxruntime threads busy-wait (a little lower latency,
            but they burn CPU the robot computer may need elsewhere).
        meta: ``artifact_dir``'s metadata when the caller has already loaded it
            (:func:`load_metadata` reads and hashes the ONNX files: once is enough).
        precision: one of :data:`PRECISIONS`; :attr:`precision` says which graphs run.

    ``infer`` may be called from several threads at once: onnxruntime sessions are
    thread-safe for ``run`` and preprocessing keeps no mutable state.
    """

    def __init__(
        self,
        artifact_dir: str | Path,
        calibration: Calibration | str | Path | None = None,
        intra_op_num_threads: int | None = None,
        providers: list[str] | None = None,
        allow_spinning: bool = False,
        meta: ArtifactMetadata | None = None,
        precision: str = "auto",
    ) -> None:
        import onnxruntime as ort  # lazy: onnxruntime (only to run a graph, not to read the metadata)

        self.meta = meta if meta is not None else load_metadata(artifact_dir)
        if precision not in PRECISIONS:
            raise ArtifactError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        providers = list(providers or default_providers())
        has_int8 = self.meta.int8_onnx_path is not None and (
            self.meta.geometry is None or self.meta.geometry.int8_onnx_path is not None)
        if precision == "int8" and not has_int8:
            raise ArtifactError(f"precision=int8: artifact {self.meta.path} has no int8 graphs (rerun "
                                "sim2real-pipeline on its output folder, whose int8 stage adds them, or serve with "
                                "precision=auto)")
        # The int8 graphs are for the CPU: a GPU provider runs the float ones faster.
        use_int8 = precision == "int8" or (precision == "auto" and has_int8 and providers == ["CPUExecutionProvider"])
        #: ``"int8"`` or ``"fp32"``: the graphs this runner runs.
        self.precision = "int8" if use_int8 else "fp32"
        if calibration is None:
            calib = self.meta.calibration
        elif isinstance(calibration, Calibration):
            calib = calibration
        else:
            calib = Calibration.load(calibration)
        self.warnings = check_calibration(self.meta, calib)
        for w in self.warnings:
            log.warning("calibration drift: %s", w)
        self.calib = calib
        self.view = self.meta.view

        # With a geometry graph the two graphs run side by side: each gets half the threads
        # (on 2 cores, faster than two threads each one after the other; benchmarks/service.py).
        threads = intra_op_num_threads
        if self.meta.geometry is not None:
            threads = max(1, int(threads or cpu_count()) // 2)

        def session(path: Path) -> Any:
            opts = ort.SessionOptions()
            if threads:
                opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = 1
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.log_severity_level = 3
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "1" if allow_spinning else "0")
            try:
                return ort.InferenceSession(str(path), sess_options=opts, providers=providers)
            except Exception as exc:  # onnxruntime raises its own exception types
                raise ArtifactError(f"cannot load ONNX model {path}: {exc}") from exc

        self.session = session(self.meta.int8_onnx_path if use_int8 else self.meta.onnx_path)
        self._check_graph()
        self._out_names = [self.meta.outputs[k] for k in ("quality", "width", "height", "surface")
                           if k in self.meta.outputs]
        g = self.meta.geometry
        self.geometry_session = None if g is None else session(g.int8_onnx_path if use_int8 else g.onnx_path)
        # The serving calibration's rebuild is made once; per-frame calibrations (the twin's
        # evaluation) are kept by digest.
        self._serving_rebuild = None if g is None else SurfaceRebuild(calib, g.view, self.view, g.interior_margin,
                                                                      g.floor_height, walls=g.walls)
        self._rebuilds: dict[str, SurfaceRebuild] = {}
        self._pool = None
        if g is not None:
            # The geometry graph runs beside the policy's (onnxruntime releases the GIL).
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="geometry")
            names = {o.name for o in self.geometry_session.get_outputs()}
            missing = [n for n in g.outputs.values() if n not in names]
            if missing or [i.name for i in self.geometry_session.get_inputs()] != [g.input_name]:
                raise ArtifactError(f"geometry ONNX model {g.onnx_path} does not have the input {g.input_name!r} "
                                    f"and outputs {sorted(g.outputs.values())} its metadata names")

    # ------------------------------------------------------------------ checks
    def _check_graph(self) -> None:
        m = self.meta
        inputs = {i.name: i for i in self.session.get_inputs()}
        if m.input_name not in inputs or len(inputs) != 1:
            raise ArtifactError(
                f"ONNX model inputs are {sorted(inputs)}, metadata names a single input {m.input_name!r}"
            )
        shape = inputs[m.input_name].shape
        want = [None, 3, m.input_size[1], m.input_size[0]]
        if len(shape) != 4 or any(isinstance(s, int) and w is not None and s != w for s, w in zip(shape, want)):
            raise ArtifactError(f"ONNX input shape {shape} does not match (N, 3, {want[2]}, {want[3]})")
        outputs = {o.name for o in self.session.get_outputs()}
        missing = [n for n in m.outputs.values() if n not in outputs]
        if missing:
            raise ArtifactError(f"ONNX model lacks outputs {missing} named in metadata (has {sorted(outputs)})")

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    # ---------------------------------------------------------------- running
    def to_input(self, view_rgb: np.ndarray) -> np.ndarray:
        """``(H, W, 3)`` or ``(N, H, W, 3)`` uint8 view images -> ``(N, 3, H, W)`` float32."""
        return to_network_input(view_rgb, self.meta.mean, self.meta.std)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        """Raw ONNX forward pass: ``(N, 3, H, W)`` -> ``quality (N,A,H,W), width, height (N,1,H,W)``
        and ``surface (N,1,H,W)`` when the artifact has it."""
        return tuple(self.session.run(self._out_names, {self.meta.input_name: x}))

    def preprocess(self, raw_rgb: np.ndarray, calibration: Calibration | None = None) -> np.ndarray:
        """Raw frame -> the network's view image ``(H, W, 3)`` uint8 (see :func:`preprocess`)."""
        return preprocess(raw_rgb, self.calib if calibration is None else calibration, self.view)

    def infer(self, raw_rgb: np.ndarray, keep_view: bool = False, calibration: Calibration | None = None) -> PolicyMaps:
        """Run the policy on one raw RGB frame at the calibration's ``image_size``.

        With a geometry graph its rebuilt surface (:meth:`geometry_surface`) replaces the
        policy's ``surface`` map. ``calibration`` overrides the serving one for this frame.

        Raises:
            perception.core.preprocess.PreprocessError: frames of another aspect ratio or layout.
        """
        if self._pool is None:
            return self.infer_view(self.preprocess(raw_rgb, calibration), keep_view=keep_view)
        pending = self._pool.submit(self.geometry_top_down, raw_rgb, calibration)
        maps = self.infer_view(self.preprocess(raw_rgb, calibration), keep_view=keep_view)
        surface, _, seen = pending.result()
        return PolicyMaps(quality=maps.quality, width=maps.width, height=maps.height, view_rgb=maps.view_rgb,
                          surface=surface, seen=seen)

    def decide(
        self,
        raw_rgb: np.ndarray,
        options: DecodeOptions | None = None,
        *,
        calibration: Calibration | None = None,
        avoid: Sequence[Grasp] = (),
        rerank: np.ndarray | Callable[[np.ndarray], np.ndarray] | None = None,
        keep_view: bool = False,
    ) -> tuple[PolicyMaps, DecodedGrasp]:
        """One raw frame to the decoded answer: :meth:`infer`, then
        :func:`perception.core.decode.decode_grasp` on its maps (and surface) through the same
        calibration. The one way a policy is run on a frame.

        Args:
            options: ``None``: the artifact's (:attr:`ArtifactMetadata.decode_options`, its
                ``quality_threshold``); a server's own threshold or margin:
                ``runner.meta.decode_options.replace(threshold=...)``.
            calibration: overrides the serving one for this frame (as in :meth:`infer`).
            avoid: grasps not to answer (the repeat memory's).
            rerank: ``(A, H, W)`` quality shifts, or a function of the quality maps that gives
                them (the online residual needs the maps first).
            keep_view: keep the network's input image in the returned maps.
        """
        # The background test (the artifact's ``background``) reads the frame in the policy's view.
        need_view = keep_view or self.meta.background is not None
        maps = self.infer(raw_rgb, keep_view=need_view, calibration=calibration)
        decoded = self._decode(maps, self.calib if calibration is None else calibration, options, avoid, rerank)
        return (maps if keep_view or not need_view else dataclasses.replace(maps, view_rgb=None)), decoded

    def decide_view(self, view_rgb: np.ndarray, options: DecodeOptions | None = None) -> tuple[PolicyMaps, DecodedGrasp]:
        """:meth:`decide` on an already preprocessed view image (a translated one, in the
        pipeline's report) through the serving calibration: :meth:`infer_view`, then the same
        decode. Without a raw frame there is no geometry graph's surface: the policy's own."""
        maps = self.infer_view(view_rgb)
        return maps, self._decode(maps, self.calib, options, (), None)

    def _decode(self, maps: PolicyMaps, calib: Calibration, options: DecodeOptions | None, avoid: Sequence[Grasp],
                rerank: np.ndarray | Callable[[np.ndarray], np.ndarray] | None) -> DecodedGrasp:
        walls = None if self.meta.geometry is None or maps.surface is None else self.meta.geometry.walls
        return decode_grasp(maps.quality, maps.width, maps.height, calib, self.view,
                            self.meta.decode_options if options is None else options, surface=maps.surface,
                            avoid=avoid, rerank=rerank(maps.quality) if callable(rerank) else rerank,
                            walls_inset=0.0 if walls is None else walls[1], view_rgb=maps.view_rgb,
                            background=self.meta.background, seen=maps.seen)

    def geometry_maps(self, raw_rgb: np.ndarray, calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The geometry graph on one raw frame: ``height`` and ``part`` probability ``(H, W)`` in its camera view."""
        g = self.meta.geometry
        if g is None or self.geometry_session is None:
            raise ArtifactError(f"artifact {self.meta.path} has no geometry graph")
        x = to_network_input(preprocess(raw_rgb, self.calib if calibration is None else calibration, g.view),
                             g.mean, g.std)
        height, part = self.geometry_session.run([g.outputs["height"], g.outputs["part"]], {g.input_name: x})
        W, H = g.view.size
        if height.shape != (1, 1, H, W) or part.shape != (1, 1, H, W):
            raise ArtifactError(f"geometry ONNX outputs have shapes {height.shape}, {part.shape}; expected (1, 1, {H}, {W})")
        return height[0, 0], part[0, 0]

    def geometry_surface(self, raw_rgb: np.ndarray, calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The top-down ``surface`` (metres above ``table_z``) and ``on_part`` maps in the policy's
        view, rebuilt from the geometry graph's heights through the serving calibration."""
        surface, on_part, _ = self.geometry_top_down(raw_rgb, calibration)
        return surface, on_part

    def geometry_top_down(self, raw_rgb: np.ndarray, calibration: Calibration | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`geometry_surface` and the ``seen`` cells of the rebuild
        (:meth:`perception.core.geometry.SurfaceRebuild.top_down`)."""
        g = self.meta.geometry
        height, part = self.geometry_maps(raw_rgb, calibration)
        rebuild = self._serving_rebuild
        if calibration is not None:
            key = calibration.digest()
            rebuild = self._rebuilds.get(key)
            if rebuild is None:
                if len(self._rebuilds) >= 8:  # keep a few
                    self._rebuilds.clear()
                rebuild = self._rebuilds[key] = SurfaceRebuild(calibration, g.view, self.view, g.interior_margin,
                                                               g.floor_height, walls=g.walls)
        return rebuild.top_down(height, part >= g.part_threshold)

    def infer_view(self, view_rgb: np.ndarray, keep_view: bool = False) -> PolicyMaps:
        """Run the policy on an already preprocessed view image ``(H, W, 3)`` uint8."""
        q, w, h, *rest = self.forward(self.to_input(view_rgb))
        A, (W, H) = self.meta.angle_bins, self.meta.input_size
        if q.shape[1:] != (A, H, W) or any(m.shape[1:] != (1, H, W) for m in (w, h, *rest)):
            raise ArtifactError(
                f"ONNX outputs have shapes {[m.shape for m in (q, w, h, *rest)]}; expected "
                f"(1, {A}, {H}, {W}) and (1, 1, {H}, {W})"
            )
        return PolicyMaps(quality=q[0], width=w[0, 0], height=h[0, 0], view_rgb=view_rgb if keep_view else None,
                          surface=rest[0][0, 0] if rest else None)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
