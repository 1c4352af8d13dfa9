"""Small synthetic policy artifacts for tests, demos and benchmarks (needs the ``onnx`` package).

:func:`make_test_artifact` writes a real ``policy.onnx`` (built with ``onnx.helper``, no
torch) and ``metadata.json`` in the artifact format of :mod:`perception.core.artifact`. The
graph's quality map is a fixed prior that peaks at a chosen point of the table, plus
``gain`` times the frame's brightness, so bright spots in the frame attract the grasp.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from perception.core.artifact import policy_metadata, write_metadata
from perception.core.calibration import Calibration, load_calibration, project_points
from perception.core.geometry import make_view
from perception.core.grasp import angle_to_bin, base_grasp_to_view

__all__ = ["make_test_artifact", "make_test_frame", "scan_bomb_jpeg", "send_json", "free_port", "wait_until_healthy",
           "resident_memory_bytes"]


def make_test_artifact(
    out_dir: str | Path,
    calibration: Calibration | None = None,
    view_size: tuple[int, int] = (96, 96),
    angle_bins: int = 8,
    peak_xy: tuple[float, float] | None = (0.5, 0.05),
    peak_yaw: float = 0.3,
    peak_quality: float = 0.9,
    base_quality: float = 0.05,
    gain: float = 0.0,
    width: float = 0.05,
    height: float = 0.02,
    threshold: float = 0.5,
    conv_channels: int = 0,
    view_kind: str = "table",
) -> Path:
    """Write a synthetic artifact and return its directory.

    Args:
        out_dir: artifact directory (created).
        calibration: the camera (default: the packaged calibration).
        view_size: ``(W, H)`` of the network input.
        angle_bins: ``A``.
        peak_xy: base-frame ``(x, y)`` where the prior quality peaks (``None``: flat prior).
        peak_yaw: base-frame yaw of the peak grasp (selects the angle bin).
        peak_quality, base_quality: prior quality at the peak and elsewhere.
        gain: logit added per unit of normalised frame brightness.
        width, height: constant predicted opening and fingertip height, metres.
        threshold: ``quality_threshold`` in the metadata.
        conv_channels: if > 0, add a 3x3 convolution stack of this width (a heavier,
            more realistic forward pass for benchmarks; it does not change the outputs).
        view_kind: the network view's kind (``"table"``, the policy's default, or ``"camera"``).
    """
    import onnx  # lazy: onnx (only the test-artifact builders need it)
    from onnx import helper  # lazy: onnx (only the test-artifact builders need it)

    calib = calibration or load_calibration()
    view = make_view(calib, view_size, view_kind)
    W, H = view.size
    A = int(angle_bins)

    prior = _prior_logits(calib, view, A, peak_xy, peak_yaw, peak_quality, base_quality, height)
    graph = _test_graph(prior, A, W, H, gain, width, height, conv_channels)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "policy.onnx"))
    write_metadata(out, policy_metadata(
        "policy.onnx", (W, H), ("quality", "width", "height"), A, threshold, view, calib,
        {"synthetic": True, "peak_xy": peak_xy, "peak_yaw": peak_yaw, "gain": gain}, "test"))
    return out


def _prior_logits(calib: Calibration, view: Any, A: int, peak_xy: tuple[float, float] | None, peak_yaw: float,
                  peak_quality: float, base_quality: float, height: float) -> np.ndarray:
    """``(1, A, H, W)`` quality logits: ``base_quality`` everywhere, a Gaussian bump to
    ``peak_quality`` where the grasp at ``peak_xy`` / ``peak_yaw`` lands in the view."""
    W, H = view.size

    def logit(p: float) -> float:
        p = min(max(p, 1e-4), 1 - 1e-4)
        return float(np.log(p / (1 - p)))

    prior = np.full((1, A, H, W), logit(base_quality), dtype=np.float32)
    if peak_xy is not None:
        z = calib.table_z + height
        pos = np.array([[peak_xy[0], peak_xy[1], z]])
        uv, ang, _ = base_grasp_to_view(pos, peak_yaw, 0.05, calib, view)
        u0, v0 = uv[0]
        a0 = int(angle_to_bin(ang[0], A))
        yy, xx = np.mgrid[0:H, 0:W]
        bump = np.exp(-((xx - u0) ** 2 + (yy - v0) ** 2) / (2 * 2.0**2))
        p = base_quality + (peak_quality - base_quality) * bump
        prior[0, a0] = np.log(p / (1 - p)).astype(np.float32)
        # A weaker echo in the neighbouring bins, as a trained network would give.
        for da in (-1, 1):
            pe = base_quality + 0.5 * (peak_quality - base_quality) * bump
            prior[0, (a0 + da) % A] = np.maximum(prior[0, (a0 + da) % A], np.log(pe / (1 - pe)))
    return prior


def _test_graph(prior: np.ndarray, A: int, W: int, H: int, gain: float, width: float, height: float,
                conv_channels: int) -> Any:
    """The ONNX graph: ``quality = sigmoid(prior + gain * mean(image))``, constant width and
    height, and with ``conv_channels`` a convolution stack whose output is multiplied by 0."""
    from onnx import TensorProto, helper, numpy_helper  # lazy: onnx (only the test-artifact builders need it)

    nodes = []
    inits = [
        numpy_helper.from_array(prior, "prior"),
        numpy_helper.from_array(np.array(gain, dtype=np.float32), "gain"),
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        numpy_helper.from_array(np.full((1, 1, H, W), width, dtype=np.float32), "wconst"),
        numpy_helper.from_array(np.full((1, 1, H, W), height, dtype=np.float32), "hconst"),
    ]
    src = "image"
    if conv_channels > 0:
        rng = np.random.default_rng(0)
        c_in = 3
        for i in range(3):
            wname, bname = f"conv{i}_w", f"conv{i}_b"
            inits.append(numpy_helper.from_array(
                (rng.standard_normal((conv_channels, c_in, 3, 3)) * 0.1).astype(np.float32), wname))
            inits.append(numpy_helper.from_array(np.zeros(conv_channels, dtype=np.float32), bname))
            nodes.append(helper.make_node("Conv", [src, wname, bname], [f"c{i}"], pads=[1, 1, 1, 1]))
            nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
            src, c_in = f"r{i}", conv_channels
        nodes.append(helper.make_node("ReduceMean", [src], ["convfeat"], axes=[1], keepdims=1))
        nodes.append(helper.make_node("Mul", ["convfeat", "zero"], ["convzero"]))
    nodes += [
        helper.make_node("ReduceMean", ["image"], ["feat"], axes=[1], keepdims=1),
        helper.make_node("Mul", ["feat", "gain"], ["gfeat"]),
        helper.make_node("Add", ["gfeat", "prior"], ["logits0"]),
    ]
    if conv_channels > 0:
        nodes.append(helper.make_node("Add", ["logits0", "convzero"], ["logits"]))
    else:
        nodes.append(helper.make_node("Identity", ["logits0"], ["logits"]))
    nodes += [
        helper.make_node("Sigmoid", ["logits"], ["quality"]),
        helper.make_node("Mul", ["feat", "zero"], ["fzero"]),
        helper.make_node("Add", ["fzero", "wconst"], ["width"]),
        helper.make_node("Add", ["fzero", "hconst"], ["height"]),
    ]
    graph = helper.make_graph(
        nodes,
        "sim2real_test_policy",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, H, W])],
        [
            helper.make_tensor_value_info("quality", TensorProto.FLOAT, ["N", A, H, W]),
            helper.make_tensor_value_info("width", TensorProto.FLOAT, ["N", 1, H, W]),
            helper.make_tensor_value_info("height", TensorProto.FLOAT, ["N", 1, H, W]),
        ],
        inits,
    )
    return graph


def make_test_frame(
    calib: Calibration | None = None,
    spot_xy: tuple[float, float] | None = None,
    seed: int = 0,
    spot_radius_px: int = 14,
) -> np.ndarray:
    """A raw RGB frame at ``calib.image_size``: textured grey, optionally with a bright
    spot drawn where the base-frame point ``spot_xy`` (on the table) projects."""

    calib = calib or load_calibration()
    W, H = calib.image_size
    rng = np.random.default_rng(seed)
    img = rng.integers(40, 90, size=(H, W, 3), dtype=np.uint8)
    if spot_xy is not None:
        uv = project_points(np.array([[spot_xy[0], spot_xy[1], calib.table_z]]), calib)[0]
        cv2.circle(img, (int(round(uv[0])), int(round(uv[1]))), spot_radius_px, (255, 255, 255), -1)
    return img



def scan_bomb_jpeg(rgb: np.ndarray, scans: int | None = None, max_bytes: int | None = None) -> bytes:
    """A progressive JPEG of ``rgb`` whose last scan is repeated: ``scans`` scans in all, or
    as many as fit in ``max_bytes`` (a legal file that costs a pass over the image per scan)."""

    prog = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR),
                        [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    starts = [i for i in range(len(prog) - 1) if prog[i] == 0xFF and prog[i + 1] == 0xDA]
    last = prog[starts[-1]:-2]
    repeats = scans - len(starts) if scans is not None else max(1, (int(max_bytes) - len(prog)) // len(last))
    return prog[:-2] + last * repeats + b"\xff\xd9"


def send_json(handler, obj) -> None:
    """Answer ``200`` with ``obj`` as JSON from an ``http.server`` handler (test controllers)."""
    body = json.dumps(obj).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for test servers)."""

    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(url: str, proc, timeout: float = 60.0) -> None:
    """Wait until a ``sim2real-serve`` process at ``url`` answers ``/healthz`` with 200.

    Args:
        url: ``http://host:port`` of the service.
        proc: its ``subprocess.Popen`` (stdout piped): an early exit raises with its output.
        timeout: seconds to wait.

    Raises:
        RuntimeError: the process exited, or the service was not ready in time.
    """

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited early: {proc.stdout.read() if proc.stdout else ''}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"service at {url} did not become ready within {timeout:.0f} s")


def resident_memory_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux ``/proc``; 0 elsewhere): tests and benchmarks
    read a service's memory from outside (the service reports its own in ``/metrics``)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
