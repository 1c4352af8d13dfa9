"""int8 graphs (policies/int8.py): quantized on frames of the camera, checked, served on a CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from perception.core.artifact import ArtifactError, PolicyRunner, load_metadata
from perception.core.geometry import make_view
from policies.export import export_artifact
from policies.int8 import Int8Error, add_int8_graphs
from policies.networks import GraspNet


@pytest.fixture(scope="module")
def frames(calib):
    """Frames of the PyBullet twin's cell at the camera's size, a few refills apart."""
    from sim_render.sim_robot import SimCell

    out = []
    for seed in range(3):
        cell = SimCell(calib, seed=seed)
        out += [cell.render() for _ in range(2)]
        cell.close()
    return out


def _artifact(path, calib):
    """A small policy with trained-like batch-norm statistics and the shipped geometry graph."""
    from policies.geometry import GEOMETRY_FORMAT
    from policies.weights import load_base

    torch.manual_seed(0)
    net = GraspNet(angle_bins=6, base_channels=8).train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.rand(4, 3, 48, 48) * 2 - 1)
    geometry = {"base": load_base("geometry_base_v2", GEOMETRY_FORMAT), "options": {},
                "info": {"name": "geometry_base_v2"}}
    return export_artifact(net.eval(), make_view(calib, (48, 48), "table"), calib, {"flip_average": True}, path,
                           geometry=geometry)


@pytest.mark.slow  # exports and quantizes an artifact (about 20 s): the fast tier must stay under 10 minutes
def test_int8_graphs_run_on_the_cpu_close_to_the_float_ones(tmp_path, calib, frames):
    """Both graphs get an int8 copy calibrated on some frames and measured on the others; a
    CPU runner picks them (``auto``), ``fp32`` keeps the float ones, and the two answer the
    same maps on a frame within the measured difference."""
    art = _artifact(tmp_path / "artifact", calib)
    float_bytes = (art / "policy.onnx").read_bytes()
    entry = add_int8_graphs(art, frames, max_frames=4)
    assert entry["frames"] == 4 and entry["check_frames"] == 2 and entry["held_out"]
    meta = load_metadata(art)
    assert meta.int8_onnx_path == art / "policy.int8.onnx" and meta.geometry.int8_onnx_path == art / "geometry.int8.onnx"
    assert (art / "policy.onnx").read_bytes() == float_bytes  # the float graph stays the reference
    g = json.loads((art / "metadata.json").read_text())["geometry"]["int8"]
    assert set(g["max_abs_diff"]) == {"height", "part"}
    # Metres, on the held-out frames. The mean is what a grasp feels; the worst pixel sits on a
    # part's edge, where one int8 step of the features flips the height between part and floor
    # (measured with onnxruntime 1.32: 0.031 m at worst, 0.00035 m mean).
    assert g["mean_abs_diff"]["height"] < 0.002 and g["max_abs_diff"]["height"] < 0.06
    assert not list(art.glob(".int8-*"))  # its working folder is gone

    int8 = PolicyRunner(art, calib, providers=["CPUExecutionProvider"])
    fp32 = PolicyRunner(art, calib, precision="fp32")
    assert int8.precision == "int8" and fp32.precision == "fp32"
    a, b = int8.infer(frames[1]), fp32.infer(frames[1])  # a calibration frame: within the ranges measured
    assert not np.array_equal(a.quality, b.quality)  # another graph ran
    assert float(np.abs(a.quality - b.quality).mean()) < 0.005
    assert float(np.abs(a.surface - b.surface).mean()) < 0.005  # metres, the rebuilt top-down surface
    assert float(np.abs(a.quality - b.quality).max()) < 0.05


@pytest.mark.slow  # each exports and quantizes an artifact (15-40 s): the fast tier must stay under 10 minutes
def test_int8_graphs_come_also_where_symbolic_shape_inference_fails(tmp_path, calib, frames, monkeypatch, caplog):
    """onnxruntime before 1.31 (1.30 on a GPU machine's image) fails its symbolic shape
    inference on the exported graphs' Concat with an IndexError; ONNX's own inference then
    prepares them. That version's failure is replayed here on the installed onnxruntime."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    def old_onnxruntime(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(SymbolicShapeInference, "infer_shapes", staticmethod(old_onnxruntime))
    art = _artifact(tmp_path / "artifact", calib)
    with caplog.at_level("INFO", logger="policies.int8"):
        entry = add_int8_graphs(art, frames, max_frames=4)
    assert "symbolic shape inference failed on policy.onnx" in caplog.text
    assert "symbolic shape inference failed on geometry.onnx" in caplog.text
    assert load_metadata(art).geometry.int8_onnx_path == art / "geometry.int8.onnx"
    assert entry["max_abs_diff"]["quality"] < 0.05  # the same quantization, prepared another way


@pytest.mark.slow  # each exports and quantizes an artifact (15-40 s): the fast tier must stay under 10 minutes
def test_a_changed_int8_graph_or_a_missing_one_is_refused(tmp_path, calib, frames):
    art = _artifact(tmp_path / "artifact", calib)
    with pytest.raises(ArtifactError, match="no int8 graphs"):
        PolicyRunner(art, calib, precision="int8")
    with pytest.raises(ArtifactError, match="precision must be one of"):
        PolicyRunner(art, calib, precision="int4")
    assert PolicyRunner(art, calib).precision == "fp32"  # auto without int8 graphs
    add_int8_graphs(art, frames[:1])  # one frame: it calibrates and measures, and says so
    raw = json.loads((art / "metadata.json").read_text())
    assert raw["int8"]["held_out"] is False and raw["int8"]["check_frames"] == 1
    (art / "geometry.int8.onnx").write_bytes((art / "geometry.int8.onnx").read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="geometry.int8.onnx_sha256"):
        load_metadata(art)


@pytest.mark.slow  # each exports and quantizes an artifact (15-40 s): the fast tier must stay under 10 minutes
def test_frames_that_cannot_calibrate_leave_the_artifact_as_it_was(tmp_path, calib, frames):
    art = _artifact(tmp_path / "artifact", calib)
    before = {p.name: p.read_bytes() for p in art.iterdir()}
    with pytest.raises(Int8Error, match="no frames"):
        add_int8_graphs(art, [])
    with pytest.raises(Int8Error, match="could not quantize"):  # another camera's size: preprocessing refuses
        add_int8_graphs(art, [f[:, :400] for f in frames])
    assert {p.name: p.read_bytes() for p in art.iterdir()} == before


@pytest.mark.slow  # each exports and quantizes an artifact (15-40 s): the fast tier must stay under 10 minutes
def test_the_service_runs_the_int8_graphs_and_refuses_a_precision_it_cannot_give(tmp_path, calib, frames):
    """``sim2real-serve`` on a real loopback port: ``auto`` runs the int8 graphs on the CPU and
    says so in ``/v1/info``; ``precision=int8`` on a float artifact, or an unknown precision,
    stops it at start with exit 2 and a message."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from perception.core.calibration import default_calibration_path
    from perception.core.imageio import encode_image
    from perception.core.testing import free_port, wait_until_healthy

    serve = Path(sys.executable).parent / "sim2real-serve"
    float_art = _artifact(tmp_path / "float", calib)
    int8_art = _artifact(tmp_path / "int8", calib)
    add_int8_graphs(int8_art, frames)
    cal = f"calibration={default_calibration_path()}"
    port = free_port()
    proc = subprocess.Popen([str(serve), f"artifact={int8_art}", cal, f"port={port}", "threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc)
        assert httpx.get(url + "/v1/info", timeout=10).json()["precision"] == "int8"
        r = httpx.post(url + "/v1/grasp", content=encode_image(frames[0], "png"), headers={"Content-Type": "image/png"},
                       timeout=30)
        assert r.status_code == 200 and "grasp" in r.json()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "running the int8 graphs" in out
    for art, precision, message in ((float_art, "int8", "no int8 graphs"), (int8_art, "int4", "precision must be one of")):
        res = subprocess.run([str(serve), f"artifact={art}", cal, f"port={free_port()}", f"precision={precision}"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and message in res.stdout + res.stderr and "Traceback" not in res.stderr


def test_the_pipeline_refuses_int8_max_frames_below_one_before_any_stage(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([str(Path(sys.executable).parent / "sim2real-pipeline"), f"output_dir={tmp_path / 'out'}",
                          "int8.max_frames=0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "int8.max_frames must be >= 1, got 0" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "out" / "stages").exists()
