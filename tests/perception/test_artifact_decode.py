"""Artifact loading, the policy runner and grasp decoding."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perception.core.artifact import (
    MAX_METADATA_BYTES,
    ArtifactError,
    PolicyRunner,
    calibration_drift,
    calibration_sha256,
    load_metadata,
)
from perception.core.calibration import Calibration, project_points
from perception.core.decode import DecodeOptions, DecodeOptionsError, decode_grasp, grasp_in_workspace
from perception.core.frames import GRIPPER_MAX_WIDTH, MIN_TIP_CLEARANCE
from perception.core.grasp import normalize_angle
from perception.core.testing import make_test_artifact, make_test_frame


def test_metadata_round_trip(artifact_dir, calib):
    meta = load_metadata(artifact_dir)
    assert meta.input_name == "image" and meta.angle_bins == 8
    assert meta.view.size == meta.input_size
    assert meta.calibration.digest() == calib.digest()


def _geometry_entry(meta: dict, onnx: str = "policy.onnx", kind: str = "camera", part_threshold: float = 0.5) -> dict:
    """A ``geometry`` entry of metadata.json (its ONNX file: one the artifact has)."""
    return {"onnx": onnx, "input": {"name": "image", "mean": [0.5] * 3, "std": [0.25] * 3},
            "outputs": {"height": "height", "part": "part"}, "view": {**meta["view"], "kind": kind},
            "part_threshold": part_threshold, "interior_margin": 0.01, "floor_height": 0.007}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m.update(format="pickle"), "format"),
        (lambda m: m.update(format_version=2), "format_version"),
        (lambda m: m.update(onnx="../policy.onnx"), "plain"),
        (lambda m: m["input"].update(channels="BGR"), "channels"),
        (lambda m: m.pop("angle_bins"), "angle_bins"),
        (lambda m: m["view"].update(size=[10, 10]), "view.size"),
        (lambda m: m["calibration"].pop("K"), "'K'"),
        (lambda m: m.update(decode={"neighbourhood_px": -1}), "neighbourhood_px"),
        (lambda m: m.update(decode={"blur": 2}), "unknown keys"),
        (lambda m: m.update(decode={"sweep_depth": 0.2}), r"decode.sweep_depth' must be in \[0, 0.05\] m"),
        (lambda m: m.update(decode={"sweep_depth": 0.02}), "decode.sweep_depth' needs a 'surface' output"),
        (lambda m: m.update(decode={"part_centre": 2}), r"decode.part_centre' must be a share in \[0, 1\]"),
        (lambda m: (m["outputs"].update(surface="surface"), m.update(decode={"fingers_clear": 0.25, "unseen_standing": True})),
         "decode.unseen_standing' needs a 'geometry' graph"),
        (lambda m: m.update(decode={"unseen_standing": True}), "decode.unseen_standing' needs fingers_clear"),
        (lambda m: m["view"].update(kind="fisheye"), "view"),
        (lambda m: m.update(geometry=_geometry_entry(m, onnx="nope.onnx")), "geometry ONNX file .* not found"),
        (lambda m: m.update(geometry=_geometry_entry(m, kind="table")), "must be a camera view"),
        (lambda m: m.update(geometry=_geometry_entry(m, part_threshold=1.5)), "part_threshold"),
        (lambda m: m.update(geometry={**_geometry_entry(m), "outputs": {"height": "h"}}), "outputs' field 'part'|'part' is missing"),
        (lambda m: m.update(geometry={**_geometry_entry(m), "walls": [0.06, 0.01]}), "geometry.walls' must be an object"),
        (lambda m: m.update(geometry={**_geometry_entry(m), "walls": {"height": 0.06}}), "thickness"),
        (lambda m: m.update(geometry={**_geometry_entry(m), "walls": {"height": 0.06, "thickness": 0.3}}),
         r"thickness in \(0, 0.1\] m"),
        (lambda m: m.update(geometry={**_geometry_entry(m), "walls": {"height": "high", "thickness": 0.01}}),
         "must be numbers"),
    ],
)
def test_bad_metadata_is_refused(tmp_path, artifact_dir, mutate, message):
    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    mutate(meta)
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=message):
        load_metadata(d)


@pytest.mark.parametrize("case", ["widened", "moved_table", "no_hash"])
def test_the_calibration_it_was_exported_for_is_held_by_its_hash(tmp_path, artifact_dir, case, caplog):
    """A service started without calibration= serves by the metadata's calibration: a workspace
    widened (or a table moved) in metadata.json after export is refused, not served."""
    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    assert meta["calibration_sha256"] == calibration_sha256(meta["calibration"])
    if case == "widened":
        meta["calibration"]["workspace"]["x"][1] += 0.2
    elif case == "moved_table":
        meta["calibration"]["table_z"] -= 0.05
    else:
        del meta["calibration_sha256"]  # an artifact from before the hash: served, with a warning
    (d / "metadata.json").write_text(json.dumps(meta))
    if case == "no_hash":
        with caplog.at_level("WARNING"):
            load_metadata(d)
        assert "calibration_sha256" in caplog.text
        return
    with pytest.raises(ArtifactError, match="changed after export"):
        load_metadata(d)


@pytest.mark.parametrize("case", ["huge", "deep"])
def test_metadata_is_sized_and_parsed_safely(tmp_path, artifact_dir, case):
    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    with open(d / "metadata.json", "wb") as fh:
        if case == "huge":  # sparse: its size is checked before a byte is read, so no memory is spent
            fh.truncate(MAX_METADATA_BYTES + 1)
        else:
            fh.write(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ArtifactError, match="over the" if case == "huge" else "not valid JSON"):
        load_metadata(d)


def test_missing_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="not found"):
        load_metadata(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="metadata.json"):
        load_metadata(tmp_path)


def test_runner_output_shapes_and_peak(artifact_dir, calib):
    runner = PolicyRunner(artifact_dir, intra_op_num_threads=1)
    maps = runner.infer(make_test_frame(calib))
    A, (W, H) = runner.meta.angle_bins, runner.meta.input_size
    assert maps.quality.shape == (A, H, W) and maps.quality.dtype == np.float32
    assert maps.width.shape == (H, W) and maps.height.shape == (H, W)
    assert np.all((maps.quality >= 0) & (maps.quality <= 1))
    dec = decode_grasp(maps.quality, maps.width, maps.height, runner.calib, runner.view, DecodeOptions(0.5))
    assert dec.grasp is not None
    # The synthetic prior peaks at (0.5, 0.05) on the table, 2 cm up.
    assert dec.grasp.position[0] == pytest.approx(0.5, abs=0.01)
    assert dec.grasp.position[1] == pytest.approx(0.05, abs=0.01)
    assert dec.grasp.position[2] == pytest.approx(0.02, abs=1e-4)
    assert dec.grasp.width == pytest.approx(0.05, abs=1e-6)
    # Yaw within half an angle bin of the peak's 0.3 rad.
    assert abs(normalize_angle(dec.grasp.yaw - 0.3)) <= math.pi / 8 / 2 + 0.05
    # pixel is the position projected through the calibration (cv2.projectPoints).
    np.testing.assert_allclose(dec.pixel, project_points(np.array([dec.grasp.position]), calib)[0])


def test_runner_refuses_other_image_size(artifact_dir, calib):
    other = calib.scaled((320, 240))
    with pytest.raises(ArtifactError, match="image_size is 320x240"):
        PolicyRunner(artifact_dir, other)


def test_drift_warnings(calib):
    K = calib.K.copy()
    K[0, 0] *= 1.05
    T = calib.T_base_camera.copy()
    T[0, 3] += 0.03
    warnings = calibration_drift(calib, calib.replace(K=K, T_base_camera=T))
    assert any("fx" in w for w in warnings) and any("moved 30.0 mm" in w for w in warnings)
    assert calibration_drift(calib, calib) == []


def test_threshold_and_workspace(artifact_dir, calib):
    runner = PolicyRunner(artifact_dir, intra_op_num_threads=1)
    m = runner.infer(make_test_frame(calib))
    dec = decode_grasp(m.quality, m.width, m.height, calib, runner.view, DecodeOptions(0.99))
    assert dec.grasp is None and dec.pixel is None and "threshold" in dec.reason
    # A quality map whose only good pixels lie outside the workspace gives no grasp.
    q = np.zeros_like(m.quality)
    q[:, 0, 0] = 1.0  # the view's corner is outside the workspace (margin around it)
    dec = decode_grasp(q, m.width, m.height, calib, runner.view, DecodeOptions(0.5))
    assert dec.grasp is None and "workspace" in dec.reason


def test_nan_maps_never_give_a_grasp(artifact_dir, calib):
    meta = load_metadata(artifact_dir)
    W, H = meta.input_size
    q = np.full((8, H, W), np.nan, dtype=np.float32)
    dec = decode_grasp(q, np.zeros((H, W)), np.zeros((H, W)), calib, meta.view, DecodeOptions(0.0))
    assert dec.grasp is None
    q = np.ones((8, H, W), dtype=np.float32)
    dec = decode_grasp(q, np.full((H, W), np.nan), np.zeros((H, W)), calib, meta.view, DecodeOptions(0.0))
    assert dec.grasp is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31 - 1),
    threshold=st.floats(0.0, 1.0),
    margin=st.sampled_from([0.0, 0.01, 0.05]),
    scale=st.sampled_from([0.01, 0.1, 1.0, 10.0]),
    angle_bins=st.sampled_from([1, 6, 12]),
    kind=st.sampled_from(["table", "camera"]),
    neighbourhood=st.sampled_from([0, 1, 2]),
    width_margin=st.sampled_from([0.0, 0.02, 0.08]),
    rule=st.sampled_from([None, {}, {"quality_power": 0.0, "support_px": 0}]),
    on_part=st.sampled_from([None, 0, 2]),
)
def test_decode_property_never_outside_workspace(calib, seed, threshold, margin, scale, angle_bins, kind,
                                                 neighbourhood, width_margin, rule, on_part):
    """Over random maps, both view kinds and the decode options (the grasp rule on a random
    surface included), a returned grasp is always inside the workspace, with a normalised
    yaw and an opening the gripper can make."""
    from perception.core.geometry import make_view

    view = make_view(calib, (40, 32), kind)
    rng = np.random.default_rng(seed)
    q = rng.random((angle_bins, 32, 40)).astype(np.float32)
    width = (rng.standard_normal((32, 40)) * scale).astype(np.float32)
    height = (rng.standard_normal((32, 40)) * scale).astype(np.float32)
    surface = (rng.random((32, 40)) * rng.choice([0.0, 0.03, 0.1])).astype(np.float32)
    if kind != "table":
        rule = on_part = None  # both need a top-down view (refused otherwise: test_rule.py, below)
    options = DecodeOptions(threshold, workspace_margin=margin, neighbourhood_px=neighbourhood,
                            width_margin=width_margin, rule=rule, on_part_px=on_part)
    dec = decode_grasp(q, width, height, calib, view, options, surface=surface)
    if dec.grasp is None:
        assert dec.reason
        return
    if on_part is not None:  # on a part of the predicted surface, or within on_part pixels of one
        from perception.core.rule import OBJECT_HEIGHT

        u, v = (int(c) for c in dec.view_pixel)
        patch = surface[max(v - on_part, 0):v + on_part + 1, max(u - on_part, 0):u + on_part + 1]
        assert (patch > OBJECT_HEIGHT).any()
    g = dec.grasp
    x, y, z = g.position
    assert calib.workspace_x[0] + margin <= x <= calib.workspace_x[1] - margin
    assert calib.workspace_y[0] + margin <= y <= calib.workspace_y[1] - margin
    assert -math.pi / 2 < g.yaw <= math.pi / 2
    assert 0.0 <= g.width <= GRIPPER_MAX_WIDTH
    assert z >= calib.table_z
    assert g.quality >= threshold - 1e-6
    assert grasp_in_workspace(g, calib, margin)


def test_decode_neighbourhood_prefers_a_broad_peak_and_width_margin_opens(calib):
    """neighbourhood_px scores a grasp by its worst neighbour: a lone spike loses to a
    slightly lower plateau; width_margin widens the opening up to the gripper's limit."""
    from perception.core.geometry import table_view

    view = table_view(calib, (48, 48))
    q = np.full((4, 48, 48), 0.1, np.float32)
    q[1, 20, 30] = 0.99  # a spike
    q[2, 10:15, 10:15] = 0.9  # a plateau
    w = np.full((48, 48), 0.05, np.float32)
    h = np.full((48, 48), 0.02, np.float32)
    spike = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5))
    assert spike.view_pixel == (30.0, 20.0) and spike.angle_bin == 1
    robust = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, neighbourhood_px=1, width_margin=0.02))
    assert robust.angle_bin == 2 and 11 <= robust.view_pixel[0] <= 13 and 11 <= robust.view_pixel[1] <= 13
    assert robust.grasp.quality == pytest.approx(0.9) and robust.grasp.width == pytest.approx(0.07)
    wide = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08))
    assert wide.grasp.width == pytest.approx(GRIPPER_MAX_WIDTH)


def test_guarded_descent_sends_the_fingertips_to_the_lowest_height_and_changes_nothing_else(calib):
    """decode.guarded_descent: the same grasp, its z the lowest the contract allows (the hand
    comes down until it meets resistance); off, the network's height; a non-boolean is refused."""
    from perception.core.geometry import table_view

    view = table_view(calib, (48, 48))
    q = np.full((4, 48, 48), 0.1, np.float32)
    q[1, 20, 30] = 0.9
    w = np.full((48, 48), 0.05, np.float32)
    h = np.full((48, 48), 0.045, np.float32)  # the network's fingertips 4.5 cm up
    own = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5))
    guarded = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, guarded_descent=True))
    assert own.grasp.position[2] == pytest.approx(calib.table_z + 0.045, abs=1e-6)
    assert guarded.grasp.position[2] == pytest.approx(calib.table_z + MIN_TIP_CLEARANCE)
    np.testing.assert_allclose(guarded.grasp.position[:2], own.grasp.position[:2])
    assert (guarded.grasp.yaw, guarded.grasp.width, guarded.view_pixel) == (own.grasp.yaw, own.grasp.width,
                                                                          own.view_pixel)
    assert DecodeOptions.from_dict({"guarded_descent": True}, threshold=0.5).to_dict()["guarded_descent"] is True
    assert "guarded_descent" not in DecodeOptions(0.5).to_dict()  # off is left out of the metadata
    with pytest.raises(DecodeOptionsError, match="decode.guarded_descent"):
        DecodeOptions(0.5, guarded_descent="yes")
    with pytest.raises(DecodeOptionsError, match="exclusive"):  # sweep_depth's raised height would be dropped
        DecodeOptions(0.5, guarded_descent=True, sweep_depth=0.01)


def test_on_part_answers_null_on_an_empty_bin_and_keeps_grasps_on_parts(calib):
    """decode.on_part_px: a surface with no part (a bare floor, however good the quality
    looks) answers no grasp and says why; with a part, the grasp goes to it even where
    the quality peaks on the floor; a speck of surface below min_object_px is no part."""
    from perception.core.geometry import network_view, table_view

    view = table_view(calib, (48, 48))
    q = np.full((4, 48, 48), 0.1, np.float32)
    q[0, 30:34, 30:34] = 0.95  # the floor looks graspable
    w = np.full((48, 48), 0.05, np.float32)
    h = np.full((48, 48), 0.02, np.float32)
    floor = np.zeros((48, 48), np.float32)
    off = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5), surface=floor)
    assert off.grasp is not None  # off: the floor is answered
    empty = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, on_part_px=1), surface=floor)
    assert empty.grasp is None and "looks empty" in empty.reason
    speck = floor.copy()
    speck[20:22, 20:22] = 0.04  # 4 cells: noise, not a part
    assert "looks empty" in decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, on_part_px=1), surface=speck).reason

    part = floor.copy()
    part[14:20, 14:20] = 0.03
    q[2, 15:19, 15:19] = 0.7
    dec = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, on_part_px=1), surface=part)
    assert dec.angle_bin == 2 and 13 <= dec.view_pixel[0] <= 20 and 13 <= dec.view_pixel[1] <= 20
    q[2] = 0.1  # no grasp on the part is good enough: null, not the floor
    low = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, on_part_px=1), surface=part)
    assert low.grasp is None and "on a predicted part" in low.reason
    with pytest.raises(ValueError, match="top-down view"):
        cam = network_view(calib, (48, 48))
        decode_grasp(q, w, h, calib, cam, DecodeOptions(0.5, on_part_px=1), surface=part)
    with pytest.raises(ValueError, match="surface map"):
        decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, on_part_px=1))


def test_artifact_decode_options_are_read_with_defaults(tmp_path, artifact_dir, calib):
    """metadata.json: decode is optional (old artifacts), validated, and read as given."""
    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    meta.pop("decode", None)  # artifacts without options decode as before
    (d / "metadata.json").write_text(json.dumps(meta))
    assert load_metadata(d).decode == {"neighbourhood_px": 0, "width_margin": 0.0}
    meta["decode"] = {"neighbourhood_px": 2, "width_margin": 0.03}
    (d / "metadata.json").write_text(json.dumps(meta))
    assert load_metadata(d).decode == {"neighbourhood_px": 2, "width_margin": 0.03}
    meta["decode"] = {"neighbourhood_px": 2, "width_margin": 0.03, "on_part_px": None}  # null: off
    (d / "metadata.json").write_text(json.dumps(meta))
    assert load_metadata(d).decode == {"neighbourhood_px": 2, "width_margin": 0.03}
    meta["decode"]["on_part_px"] = -1
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="on_part_px"):
        load_metadata(d)
    # a geometry graph: read with its numbers; its surface is rebuilt onto the policy's top-down view only
    meta["decode"]["on_part_px"] = 1
    meta["geometry"] = _geometry_entry(meta)
    for key in ("fingers_clear", "jaws_on_part"):  # the decode's re-ranking shares
        for bad, match in ((1.5, "in \\[0, 1\\]"), ("much", "must be a number")):
            meta["decode"][key] = bad
            (d / "metadata.json").write_text(json.dumps(meta))
            with pytest.raises(ArtifactError, match=f"decode.{key}' .*{match}"):
                load_metadata(d)
        meta["decode"][key], meta["decode"]["rule"] = 0.25, {}
        (d / "metadata.json").write_text(json.dumps(meta))
        with pytest.raises(ArtifactError, match=f"decode.{key}' and 'decode.rule' are exclusive"):
            load_metadata(d)
        del meta["decode"]["rule"]
        (d / "metadata.json").write_text(json.dumps(meta))
        assert load_metadata(d).decode[key] == 0.25
        del meta["decode"][key]
    g = load_metadata(d).geometry
    assert g is not None and g.part_threshold == 0.5 and g.floor_height == 0.007 and not g.view.is_table
    assert g.walls is None  # absent: the walls as the network reads them
    meta["geometry"]["walls"] = {"height": 0.058, "thickness": 0.012, "source": "a ruler"}
    (d / "metadata.json").write_text(json.dumps(meta))
    assert load_metadata(d).geometry.walls == (0.058, 0.012)
    del meta["geometry"]["walls"]
    meta["view"]["kind"] = "camera"
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="needs a top-down policy view"):
        load_metadata(d)


def test_decode_with_every_pixel_a_candidate_picks_the_best_in_the_workspace(calib):
    """The whole map a candidate (threshold 0): one grasp, in the workspace, at the bin the
    map's best pixel there holds. (Its speed is benchmarks/service.py's ``grasp_decode``.)"""
    from perception.core.geometry import network_view

    view = network_view(calib, (224, 224))
    rng = np.random.default_rng(0)
    q = rng.random((16, 224, 224)).astype(np.float32)
    w = np.full((224, 224), 0.05, np.float32)
    h = np.full((224, 224), 0.02, np.float32)
    res = decode_grasp(q, w, h, calib, view, DecodeOptions(0.0))
    assert res.grasp is not None and res.reason is None
    x, y = res.grasp.position[:2]
    assert calib.in_workspace(float(x), float(y))
    u, v = res.view_pixel
    assert q[res.angle_bin, int(round(v)), int(round(u))] > 0.99  # among the best of 800k uniform draws


def test_perception_imports_no_torch():
    """The robot side never imports torch (nor PyBullet), directly or through imports."""
    code = (
        "import sys, perception.core.artifact, perception.core.decode, perception.robot.service, perception.robot.cameras, "
        "perception.robot.calibrate, perception.robot.capture, perception.robot.loop, perception.robot.robots, perception.core.imageio; "
        "bad = [m for m in ('torch', 'pybullet', 'lightning', 'pytorch_lightning', 'kornia') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_conv_artifact_runs(tmp_path, calib):
    d = make_test_artifact(tmp_path / "conv", conv_channels=8, view_size=(64, 48))
    runner = PolicyRunner(d, intra_op_num_threads=1)
    m = runner.infer(make_test_frame(calib))
    assert m.quality.shape == (8, 48, 64)


def test_a_tampered_artifact_does_not_start(tmp_path, artifact_dir, calib, caplog):
    """issue 12: a changed ONNX file, table_z NaN or a widened workspace stop the load; no hash warns."""
    from perception.core.artifact import check_calibration

    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    assert len(meta["onnx_sha256"]) == 64 and load_metadata(d).onnx_path.is_file()
    with open(d / "policy.onnx", "ab") as fh:  # one byte appended: still loads in onnxruntime, not here
        fh.write(b"\0")
    with pytest.raises(ArtifactError, match="changed or corrupted"):
        load_metadata(d)
    shutil.copy(artifact_dir / "policy.onnx", d / "policy.onnx")
    bad = json.loads(json.dumps(meta))
    bad["calibration"]["table_z"] = float("nan")
    (d / "metadata.json").write_text(json.dumps(bad))
    with pytest.raises(ArtifactError, match="table_z.*finite"):
        load_metadata(d)
    wide = json.loads(json.dumps(meta))
    wide["calibration"]["workspace"]["x"] = [0.1, 0.9]
    (d / "metadata.json").write_text(json.dumps(wide))
    with pytest.raises(ArtifactError, match="changed after export"):  # the hash covers the calibration
        load_metadata(d)
    del wide["calibration_sha256"]  # an artifact from before that hash: a serving calibration still refuses it
    (d / "metadata.json").write_text(json.dumps(wide))
    with pytest.raises(ArtifactError, match="reaches outside the serving"):
        check_calibration(load_metadata(d), calib)
    old = {k: v for k, v in meta.items() if k != "onnx_sha256"}
    old["quality_threshold"] = 0.0
    (d / "metadata.json").write_text(json.dumps(old))
    with caplog.at_level("WARNING"):
        load_metadata(d)
    assert "onnx_sha256" in caplog.text and "nearly every grasp" in caplog.text


def test_safety_check_bounds_the_height(calib):
    from perception.core.grasp import Grasp

    x, y = sum(calib.workspace_x) / 2, sum(calib.workspace_y) / 2
    ok = Grasp(position=[x, y, calib.table_z + 0.02], yaw=0.1, width=0.05, quality=0.9)
    assert grasp_in_workspace(ok, calib)
    for z in (calib.table_z - 0.01, calib.table_z + 0.2):
        assert not grasp_in_workspace(Grasp(position=[x, y, z], yaw=0.1, width=0.05, quality=0.9), calib), z
    assert not grasp_in_workspace(ok, calib, margin=-0.5)


def test_the_metadata_writer_writes_only_what_the_loader_reads(tmp_path):
    """One writer for metadata.json (the exporter and the test artifacts): a field the loader
    would refuse stops the write and leaves the file as it was."""
    from perception.core.artifact import ArtifactError, load_metadata, write_metadata

    art = make_test_artifact(tmp_path / "art")
    before = (art / "metadata.json").read_bytes()
    meta = json.loads(before)
    assert load_metadata(art).angle_bins == meta["angle_bins"]
    for field, bad in (("quality_threshold", 1.5), ("angle_bins", 0), ("onnx", "../policy.onnx")):
        with pytest.raises(ArtifactError, match=field):
            write_metadata(art, {**meta, field: bad})
        assert (art / "metadata.json").read_bytes() == before
    (art / "policy.onnx").write_bytes((art / "policy.onnx").read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="onnx_sha256"):
        write_metadata(art, meta)  # the graph changed after its hash was taken
    del meta["onnx_sha256"]
    assert write_metadata(art, meta).onnx_path == art / "policy.onnx"  # a missing hash is taken from the graph


def test_runner_decide_is_infer_then_decode(tmp_path, artifact_dir, calib):
    """PolicyRunner.decide answers exactly what infer + decode_grasp with the artifact's options
    answered (the service's path before it), and passes a frame's calibration, avoid list and
    re-rank (a function of the quality maps) through."""
    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    meta["decode"] = {"neighbourhood_px": 1, "width_margin": 0.02}
    meta["quality_threshold"] = 0.3
    (d / "metadata.json").write_text(json.dumps(meta))
    runner = PolicyRunner(d, intra_op_num_threads=1)
    assert runner.meta.decode_options == DecodeOptions(runner.meta.quality_threshold, neighbourhood_px=1,
                                                       width_margin=0.02)
    raw = make_test_frame(calib)

    def same(a, b):
        assert a.to_dict() == b.to_dict() and a.view_pixel == b.view_pixel and a.angle_bin == b.angle_bin

    maps = runner.infer(raw)
    old = decode_grasp(maps.quality, maps.width, maps.height, runner.calib, runner.view,
                       DecodeOptions(runner.meta.quality_threshold, **runner.meta.decode), surface=maps.surface)
    got_maps, got = runner.decide(raw)
    assert got.grasp is not None
    same(got, old)
    np.testing.assert_array_equal(got_maps.quality, maps.quality)
    # the server's own options, a grasp to avoid, a re-rank from the maps, another calibration
    options = runner.meta.decode_options.replace(threshold=0.02, workspace_margin=0.01)
    shift = np.zeros_like(maps.quality)
    shift[(got.angle_bin + 1) % shift.shape[0]] = 0.5
    moved = Calibration.from_dict({**calib.to_dict(), "table_z": calib.table_z + 0.002}, check_view=False)
    m2 = runner.infer(raw, calibration=moved)
    old = decode_grasp(m2.quality, m2.width, m2.height, moved, runner.view, options, surface=m2.surface,
                       avoid=[got.grasp], rerank=shift)
    seen = []
    _, new = runner.decide(raw, options, calibration=moved, avoid=[got.grasp],
                           rerank=lambda q: seen.append(q) or shift)
    same(new, old)
    assert new.grasp.position[2] == pytest.approx(got.grasp.position[2] + 0.002)  # the frame's calibration
    assert (new.view_pixel, new.angle_bin) != (got.view_pixel, got.angle_bin)  # avoided, re-ranked
    assert len(seen) == 1 and seen[0] is not None and seen[0].shape == maps.quality.shape
    _, new = runner.decide(raw, options, calibration=moved, avoid=[got.grasp], rerank=shift)  # an array as well
    same(new, old)
    # A view image (the report's translated one): infer_view, then the same decode.
    view = runner.preprocess(raw)
    vm = runner.infer_view(view)
    old = decode_grasp(vm.quality, vm.width, vm.height, runner.calib, runner.view, options, surface=vm.surface)
    same(runner.decide_view(view, options)[1], old)


def test_a_decode_option_error_reads_the_same_after_crossing_a_process():
    import pickle

    from perception.core.decode import DecodeOptions, DecodeOptionsError

    with pytest.raises(DecodeOptionsError) as info:
        DecodeOptions(threshold=0.5, neighbourhood_px=-1)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) == "decode.neighbourhood_px must be >= 0"
    assert copy.keys == ("neighbourhood_px",)
