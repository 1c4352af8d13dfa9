"""Export the trained policy as the robot-side artifact: ``policy.onnx`` + ``metadata.json``.

The format is the one :mod:`perception.core.artifact` reads (``format_version`` 1)::

    {"format": "sim2real-grasp-policy", "format_version": 1, "onnx": "policy.onnx",
     "input": {"name": "image", "layout": "NCHW", "channels": "RGB", "dtype": "float32",
               "size": [W, H], "mean": [3], "std": [3]},
     "outputs": {"quality": "quality", "width": "width", "height": "height"},
     "angle_bins": A, "quality_threshold": 0.5, "decode": {policy.decode}, "view": NetworkView.to_dict(),
     "calibration": {...}, "training": {...}, "code_version": "..."}

The graph is :class:`policies.networks.ExportWrapper` (quality as probabilities) with a
dynamic batch dimension. The whole folder is built beside the target and swapped in with
renames, so a reader never sees a new ONNX file with old metadata; before the swap the
ONNX graph is run with onnxruntime and compared with torch (max abs difference
``verify_atol``, 1e-4 by default).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from conf import as_dict
from perception.core.artifact import file_sha256, policy_metadata, write_metadata
from perception.core.atomic import default_dir_mode, default_file_mode
from perception.core.calibration import Calibration
from perception.core.geometry import NetworkView
from perception.core.preprocess import IMAGE_MEAN, IMAGE_STD
from perception.core.rule import DEFAULT_RULE, OBJECT_HEIGHT
from policies.geometry import base_view, geometry_net
from policies.networks import ExportWrapper, GeometryExport, GraspNet

__all__ = ["export_artifact", "export_onnx", "export_graph", "graph_max_diff", "onnx_torch_max_diff", "code_version", "ExportError", "ONNX_FILE"]

log = logging.getLogger(__name__)

ONNX_FILE = "policy.onnx"
OPSET = 18
#: The graph's outputs, in ExportWrapper's order (perception.core.artifact.PolicyRunner reads them by name).
OUTPUT_NAMES = ("quality", "width", "height", "surface")


class ExportError(RuntimeError):
    """The ONNX graph could not be written or does not reproduce the torch network."""


def code_version() -> str:
    """``sim2real-grasp <version>`` plus the git commit when the source is a checkout."""
    try:
        ver = version("sim2real-grasp")
    except Exception:  # not installed
        ver = "unknown"
    try:
        root = Path(__file__).resolve().parents[1]
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"sim2real-grasp {ver}" + (f" ({sha})" if sha else "")


def _net_of(module_or_net: nn.Module) -> GraspNet:
    net = getattr(module_or_net, "net", module_or_net)
    if not isinstance(net, GraspNet):
        raise TypeError(f"expected a GraspNet or a module holding one in .net, got {type(module_or_net).__name__}")
    return net


def export_onnx(net: GraspNet, path: Path, size: tuple[int, int], flip_average: bool = False) -> None:
    """Write ``ExportWrapper(net, flip_average)`` to ``path`` (input ``image`` ``(N, 3, H, W)``, dynamic ``N``)."""
    export_graph(ExportWrapper(net, flip_average), path, size, OUTPUT_NAMES)


def export_graph(wrapper: nn.Module, path: Path, size: tuple[int, int], output_names: tuple[str, ...]) -> None:
    """Write ``wrapper`` (input ``image`` ``(N, 3, H, W)``, dynamic ``N``) to ``path``.

    The dynamo exporter (onnx + onnxscript) is tried first, the TorchScript one second.
    """
    w, h = size
    wrapper = wrapper.eval().cpu()
    x = torch.zeros(2, 3, h, w)
    names = {"input_names": ["image"], "output_names": list(output_names)}
    errors = []
    with _Quiet("onnxscript", "onnx_ir", "torch.onnx", "torch.export"):
        try:
            batch = torch.export.Dim("N", min=1, max=1024)
            prog = torch.onnx.export(
                wrapper, (x,), None, dynamo=True, dynamic_shapes={"image": {0: batch}}, opset_version=OPSET,
                external_data=False, verbose=False, **names,
            )
            prog.save(str(path))
            return
        except Exception as exc:  # fall back to the TorchScript exporter
            errors.append(f"dynamo: {type(exc).__name__}: {exc}")
        try:
            torch.onnx.export(
                wrapper, (x,), str(path), dynamo=False, opset_version=17,
                dynamic_axes={k: {0: "N"} for k in ("image", *output_names)},
                **names,
            )
        except Exception as exc:
            errors.append(f"torchscript: {type(exc).__name__}: {exc}")
            raise ExportError("ONNX export failed: " + " | ".join(errors)) from exc


class _Quiet:
    """Raise the level of the exporters' chatty INFO loggers for the duration of an export."""

    def __init__(self, *names: str) -> None:
        self.loggers = [logging.getLogger(n) for n in names]
        self.levels: list[int] = []

    def __enter__(self) -> _Quiet:
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc: Any) -> None:
        for lg, lvl in zip(self.loggers, self.levels):
            lg.setLevel(lvl)


def onnx_torch_max_diff(net: GraspNet, onnx_path: Path, x: np.ndarray, flip_average: bool = False) -> float:
    """Largest absolute difference between onnxruntime and torch outputs on ``x`` ``(N, 3, H, W)``."""
    return graph_max_diff(ExportWrapper(net, flip_average), onnx_path, x, OUTPUT_NAMES)


def graph_max_diff(wrapper: nn.Module, onnx_path: Path, x: np.ndarray, output_names: tuple[str, ...]) -> float:
    """:func:`onnx_torch_max_diff` for any exported wrapper."""
    import onnxruntime as ort  # lazy: onnxruntime (only the export's check runs it)

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
    got = sess.run(list(output_names), {"image": x.astype(np.float32)})
    with torch.no_grad():
        want = wrapper.eval().cpu()(torch.from_numpy(x.astype(np.float32)))
    return max(float(np.max(np.abs(g - w.numpy()))) for g, w in zip(got, want))


#: The geometry graph's file and outputs (perception.core.artifact.GeometryMetadata).
GEOMETRY_ONNX_FILE = "geometry.onnx"
GEOMETRY_OUTPUT_NAMES = ("height", "part")


def _export_geometry(geometry: dict, calibration: Calibration, tmp: Path, verify_atol: float) -> dict:
    """Write the geometry graph into the artifact folder ``tmp``; its ``metadata.json`` entry."""

    base = geometry["base"]
    net = geometry_net(base)
    view = base_view(base, calibration)
    wrapper = GeometryExport(net, net.camera_maps(calibration, view))
    export_graph(wrapper, tmp / GEOMETRY_ONNX_FILE, view.size, GEOMETRY_OUTPUT_NAMES)
    w, h = view.size
    x = np.random.default_rng(1).standard_normal((2, 3, h, w)).astype(np.float32)
    diff = graph_max_diff(wrapper, tmp / GEOMETRY_ONNX_FILE, x, GEOMETRY_OUTPUT_NAMES)
    if not diff <= verify_atol:
        raise ExportError(f"geometry graph: onnxruntime and torch outputs differ by {diff:.2e} (> {verify_atol:.0e})")

    # Parts are looked for clear of the walls (the rule's region); a floor cell stays just below a part's height.
    opts = {"part_threshold": 0.5, "interior_margin": DEFAULT_RULE["region_margin"], "floor_height": 0.9 * OBJECT_HEIGHT,
            **{k: v for k, v in dict(geometry.get("options") or {}).items() if v is not None}}
    return {
        "onnx": GEOMETRY_ONNX_FILE,
        "input": {"name": "image", "mean": list(IMAGE_MEAN), "std": list(IMAGE_STD)},
        "outputs": {k: k for k in GEOMETRY_OUTPUT_NAMES},
        "view": view.to_dict(),
        "part_threshold": float(opts["part_threshold"]),
        "interior_margin": float(opts["interior_margin"]),
        "floor_height": float(opts["floor_height"]),
        "base": geometry.get("info"),
        "onnx_max_abs_diff": diff,
    }


def export_artifact(
    module_or_net: nn.Module,
    view: NetworkView,
    calibration: Calibration,
    cfg: Any,
    out_dir: str | Path,
    training: dict | None = None,
    verify_atol: float = 1e-4,
    sample_inputs: np.ndarray | None = None,
    geometry: dict | None = None,
) -> Path:
    """Write the artifact folder ``out_dir`` (replacing an older one atomically).

    Args:
        module_or_net: a :class:`GraspNet` or a module holding one as ``.net``.
        view: the network view the policy was trained in.
        calibration: the nominal calibration it was trained for.
        cfg: the policy config (``quality_threshold`` is read from it; the whole resolved
            config is stored under ``training.config``).
        out_dir: the artifact folder.
        training: extra facts stored under ``training`` (metrics, dataset, steps).
        verify_atol: maximum allowed onnxruntime vs torch difference.
        sample_inputs: ``(N, 3, H, W)`` inputs for the check (random ones are added).
        geometry: ``{"base": a geometry base (policies.weights.load_base), "options":
            policy.geometry_decode, "info": {name, digest}}``: also write the geometry graph
            (``geometry.onnx``, on the camera view of ``calibration``); ``None``: none.

    Returns:
        ``out_dir``.

    Raises:
        ExportError: export failed or onnxruntime disagrees with torch.
    """
    net = _net_of(module_or_net)
    was_training = net.training
    net.eval()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    w, h = view.size
    cfgd = as_dict(cfg)
    threshold = float(cfgd.get("quality_threshold", 0.5))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        onnx_path = tmp / ONNX_FILE
        flip_average = bool(cfgd.get("flip_average", False))
        export_onnx(net, onnx_path, (w, h), flip_average)
        rng = np.random.default_rng(0)
        checks = [rng.standard_normal((2, 3, h, w)).astype(np.float32)]
        if sample_inputs is not None:
            checks.append(np.asarray(sample_inputs, dtype=np.float32))
        diff = max(onnx_torch_max_diff(net, onnx_path, x, flip_average) for x in checks)
        if not diff <= verify_atol:
            raise ExportError(f"onnxruntime and torch outputs differ by {diff:.2e} (> {verify_atol:.0e})")
        meta = policy_metadata(ONNX_FILE, (w, h), OUTPUT_NAMES, net.angle_bins, threshold, view, calibration,
                               {**(training or {}), "config": cfgd, "onnx_max_abs_diff": diff}, code_version(),
                               cfgd.get("decode"))
        if geometry is not None:
            meta["geometry"] = _export_geometry(geometry, calibration, tmp, verify_atol)
            meta["geometry"]["onnx_sha256"] = file_sha256(tmp / GEOMETRY_ONNX_FILE)
        meta["onnx_sha256"] = file_sha256(onnx_path)  # the loader refuses a graph changed after export
        write_metadata(tmp, meta)
        # mkdtemp makes a private folder; the artifact gets what a plain mkdir / open would (the umask's).
        os.chmod(tmp, default_dir_mode())
        for f in tmp.iterdir():
            os.chmod(f, default_file_mode())
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        net.train(was_training)
    log.info("exported the policy artifact to %s (onnx vs torch max diff %.1e)", out, diff)
    return out
