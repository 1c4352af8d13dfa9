"""int8 graphs for a CPU robot: the artifact's graphs quantized, calibrated on the camera's own frames.

On a robot's CPU the two graphs of an artifact (the policy's, flip-averaged, and the geometry
network's) are most of ``/v1/grasp``'s time. Quantized to 8 bits (weights per output
channel, activations per tensor; onnxruntime's static QDQ format, whose convolutions run
as integer kernels) they run about twice as fast (``docs/benchmarks.md``, "Grasp service").

The activations' ranges are measured on frames of the user's camera (the pipeline's
``real_dir``, the frames the service will see), each preprocessed into the graph's own
view exactly as the runner does, so no real activation is clipped by a range seen only in
sim. Frames left out of that calibration then measure what the quantization changes (the
largest and mean absolute difference of every output against the float graph), recorded
in ``metadata.json`` beside the int8 graph's name and hash. The float graphs stay in the
artifact, unchanged: they are the reference the export verified against torch, and what a
GPU runs (:class:`perception.core.artifact.PolicyRunner`'s ``precision``).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from perception.core.artifact import METADATA_FILE, file_sha256, load_metadata, write_metadata
from perception.core.preprocess import preprocess, to_network_input

__all__ = ["Int8Error", "INT8_SUFFIX", "add_int8_graphs"]

log = logging.getLogger(__name__)

#: ``policy.onnx`` -> ``policy.int8.onnx``.
INT8_SUFFIX = ".int8.onnx"
#: Frames kept out of the calibration to measure the difference, at most.
CHECK_FRAMES = 16


class Int8Error(RuntimeError):
    """The graphs could not be quantized (the artifact is left as it was)."""


def _quantize(src: Path, dst: Path, inputs: list[np.ndarray], input_name: str) -> None:
    import onnxruntime as ort  # lazy: onnxruntime (only to quantize)
    from onnxruntime.quantization import (  # lazy: onnxruntime (only to quantize)
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process  # lazy: onnxruntime (quantizing)

    class Frames(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter({input_name: x} for x in inputs)

        def get_next(self) -> dict | None:
            return next(self._it, None)

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / src.name
        try:  # shapes inferred and the graph folded, as the quantizer expects
            quant_pre_process(str(src), str(pre))
        except IndexError:
            # onnxruntime before 1.31: its symbolic shape inference fails on the exported
            # graphs' Concat (found on a GPU machine's onnxruntime 1.30); ONNX's own shape
            # inference does the job for these static-shape graphs.
            log.info("onnxruntime %s: symbolic shape inference failed on %s, using ONNX's", ort.__version__, src.name)
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        part = Path(tmp) / dst.name
        quantize_static(str(pre), str(part), Frames(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        part.replace(dst)


def _difference(float_path: Path, int8_path: Path, inputs: list[np.ndarray], input_name: str) -> tuple[dict, dict]:
    """Largest and mean absolute difference of each output, int8 against float, over ``inputs``."""
    import onnxruntime as ort  # lazy: onnxruntime (only to quantize)

    a = ort.InferenceSession(str(float_path), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(int8_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in a.get_outputs()]
    worst = dict.fromkeys(names, 0.0)
    total = dict.fromkeys(names, 0.0)
    for x in inputs:
        for name, ya, yb in zip(names, a.run(names, {input_name: x}), b.run(names, {input_name: x})):
            d = np.abs(ya.astype(np.float64) - yb)
            worst[name] = max(worst[name], float(d.max()))
            total[name] += float(d.mean())
    return worst, {k: v / len(inputs) for k, v in total.items()}


def add_int8_graphs(artifact_dir: str | Path, frames: Sequence[np.ndarray], max_frames: int = 64) -> dict:
    """Write int8 copies of an artifact's graphs beside them and name them in its ``metadata.json``.

    Args:
        artifact_dir: an exported artifact (float graphs); an earlier int8 entry is replaced.
        frames: raw ``(H, W, 3)`` uint8 RGB frames of the serving camera, at the artifact
            calibration's ``image_size``.
        max_frames: at most this many (evenly spaced) calibrate the activations' ranges; up to
            :data:`CHECK_FRAMES` of the others measure the difference (with fewer than 2
            frames in all, the calibration frames measure it too, and ``held_out`` says so).

    Returns:
        the policy's ``int8`` entry (the geometry graph's is in ``metadata.json: geometry.int8``).

    Raises:
        Int8Error: no frames, or onnxruntime could not quantize a graph; the artifact is unchanged.
    """
    root = Path(artifact_dir)
    meta = load_metadata(root)
    if not frames:
        raise Int8Error("no frames to calibrate the int8 graphs on")
    if max_frames < 1:
        raise Int8Error(f"max_frames must be >= 1, got {max_frames}")
    step = max(1, len(frames) // max_frames)
    cal_idx = list(range(0, len(frames), step))[:max_frames]
    rest = sorted(set(range(len(frames))) - set(cal_idx))
    check_idx = rest[:: max(1, len(rest) // CHECK_FRAMES)][:CHECK_FRAMES] or cal_idx
    calib = meta.calibration

    def inputs(view, mean, std, idx):
        return [to_network_input(preprocess(frames[i], calib, view), mean, std) for i in idx]

    graphs = [("int8", meta.onnx_path, meta.input_name, (meta.view, meta.mean, meta.std))]
    if meta.geometry is not None:
        g = meta.geometry
        graphs.append(("geometry.int8", g.onnx_path, g.input_name, (g.view, g.mean, g.std)))
    raw = json.loads((root / METADATA_FILE).read_text())
    # Quantized into a folder of the artifact's own, moved beside the float graphs only once
    # every graph is done: a failure leaves the artifact as it was.
    with tempfile.TemporaryDirectory(dir=root, prefix=".int8-") as tmp:
        done = []
        try:
            for where, float_path, input_name, spec in graphs:
                name = float_path.name.removesuffix(".onnx") + INT8_SUFFIX
                part = Path(tmp) / name
                _quantize(float_path, part, inputs(*spec, cal_idx), input_name)
                worst, mean = _difference(float_path, part, inputs(*spec, check_idx), input_name)
                entry = {"onnx": name, "onnx_sha256": file_sha256(part), "format": "QDQ",
                         "weights": "int8 per output channel", "activations": "uint8 per tensor, MinMax ranges",
                         "frames": len(cal_idx), "check_frames": len(check_idx), "held_out": check_idx is not cal_idx,
                         "max_abs_diff": worst, "mean_abs_diff": mean}
                (raw["geometry"] if where.startswith("geometry") else raw)["int8"] = entry
                done.append(part)
        except Exception as exc:  # onnxruntime's quantizer raises what its passes raise
            raise Int8Error(f"could not quantize the graphs of {root}: {type(exc).__name__}: {exc}") from exc
        for part in done:
            part.replace(root / part.name)
    write_metadata(root, raw)  # only once it loads: the new hashes match
    log.info("int8 graphs in %s (%d calibration frames): policy quality differs by at most %.3f", root,
             len(cal_idx), raw["int8"]["max_abs_diff"].get(meta.outputs["quality"], float("nan")))
    return raw["int8"]
