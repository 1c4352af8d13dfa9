"""Geometry from RGB (policies/geometry.py, perception.core.geometry.camera_heights_to_surface): the
camera-view targets and the top-down rebuild the deployed decode makes from predicted heights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from perception.core.geometry import camera_heights_to_surface, make_view, table_view
from perception.core.rule import OBJECT_HEIGHT
from policies.data import table_view_surface
from policies.geometry import GeometryFrames, geometry_losses, geometry_record
from policies.networks import GeometryNet
from sim_render.format import SEG_FIRST_OBJECT
from sim_render.reader import SimFrameDataset


def test_the_rebuild_from_true_heights_is_the_rule_observed_surface(rendered):
    """Fed the heights the renderer's depth gives, the geometry decode's rebuild is the surface
    the ``rule_observed`` bracket builds from that depth (up to the views' sampling)."""
    frames = SimFrameDataset(rendered, fields=("rgb", "depth", "seg"))
    calib = frames.calibration
    cam_view = make_view(calib, (160, 120), "camera", margin=0.03)
    top = table_view(calib, (64, 64))
    checked = 0
    for i in range(len(frames)):
        item = dict(frames[i])
        h, w = np.asarray(item["depth"]).shape
        camera = calib.scaled((w, h))
        item["camera"] = camera  # one camera for both paths: the comparison is of the rebuilds alone
        rec = geometry_record(item, calib, cam_view)
        assert rec["view_rgb"].shape == (120, 160, 3) and rec["height"].shape == (120, 160)
        cap = 0.9 * OBJECT_HEIGHT
        surface, on_part = camera_heights_to_surface(rec["height"].astype(np.float32), rec["object"], calib,
                                                     cam_view, top, interior_margin=0.01, floor_height=cap)
        want, label, known = table_view_surface(np.asarray(item["depth"]), np.asarray(item["seg"]), camera, top)
        want = want - calib.table_z
        part_want = known & (label >= SEG_FIRST_OBJECT)
        if part_want.sum() < 10:
            continue
        checked += 1
        both = known & (surface > 0)
        assert np.median(np.abs(surface[both & part_want] - want[both & part_want])) < 0.003
        iou = (on_part & part_want).sum() / (on_part | part_want).sum()
        assert iou > 0.7, iou
        # off the parts (floor, walls) the rebuild is the depth's too, the interior floor capped
        off = known & ~part_want & ~on_part
        assert np.mean((np.abs(surface[off] - want[off]) < 0.003) | (np.abs(surface[off] - cap) < 1e-6)) > 0.9  # part edges: the two views sample them apart
    assert checked >= 2


def test_the_rebuild_says_which_cells_the_camera_saw(rendered):
    """``SurfaceRebuild.top_down``'s ``seen`` cells are those the camera's own depth sees from
    the same frame (the ``rule_observed`` rebuild's ``known``): the cells behind a part along
    the camera's line of sight are unseen, and read 0 there all the same."""
    from perception.core.geometry import SurfaceRebuild

    frames = SimFrameDataset(rendered, fields=("rgb", "depth", "seg"))
    calib = frames.calibration
    cam_view = make_view(calib, (160, 120), "camera", margin=0.03)
    top = table_view(calib, (64, 64))
    rebuild = SurfaceRebuild(calib, cam_view, top, 0.01, 0.9 * OBJECT_HEIGHT)
    hidden_parts = 0
    for i in range(len(frames)):
        item = dict(frames[i])
        h, w = np.asarray(item["depth"]).shape
        camera = calib.scaled((w, h))
        item["camera"] = camera
        rec = geometry_record(item, calib, cam_view)
        surface, on_part, seen = rebuild.top_down(rec["height"].astype(np.float32), rec["object"])
        plain_surface, plain_part = rebuild(rec["height"].astype(np.float32), rec["object"])
        np.testing.assert_array_equal(surface, plain_surface)
        np.testing.assert_array_equal(on_part, plain_part)
        _, label, known = table_view_surface(np.asarray(item["depth"]), np.asarray(item["seg"]), camera, top)
        assert seen.dtype == bool and seen.shape == known.shape
        assert np.mean(seen == known) > 0.9  # the two views sample the edges of what they see apart
        behind = ~seen & ~known
        assert np.all(surface[behind] == 0.0)
        if ((label >= SEG_FIRST_OBJECT) & known).sum() >= 10:
            hidden_parts += int(behind.sum() > 0)
    assert hidden_parts >= 2  # every scene with a part hides some floor behind it


def test_camera_heights_to_surface_refuses_the_wrong_views(calib):
    top = table_view(calib, (32, 32))
    cam = make_view(calib, (40, 30), "camera")
    with pytest.raises(ValueError, match="camera view"):
        camera_heights_to_surface(np.zeros((32, 32)), np.zeros((32, 32), bool), calib, top, top, 0.01, 0.004)
    with pytest.raises(ValueError, match="must be the camera view"):
        camera_heights_to_surface(np.zeros((20, 20)), np.zeros((20, 20), bool), calib, cam, top, 0.01, 0.004)
    flat, part = camera_heights_to_surface(np.full((30, 40), 0.05), np.zeros((30, 40), bool), calib, cam, top,
                                           0.01, 0.004)
    assert not part.any() and flat.max() == pytest.approx(0.05)  # the walls' ring keeps its height
    interior = flat[8:24, 8:24]
    assert np.all(interior <= 0.004)  # 5 cm seen nowhere on a part: floor inside the bin


def test_measured_walls_stand_inside_the_workspace_edges_however_low_the_network_reads_them(calib):
    """``walls=(height, thickness)``: every top-down cell within the thickness of a workspace
    edge is a wall at least that high (never a part), the floor cap starts inside the walls'
    inner faces, and the rest of the surface is the one without walls."""
    from perception.core.geometry import view_pixels_to_base

    top = table_view(calib, (64, 64))
    cam = make_view(calib, (80, 60), "camera")
    low = np.full((60, 80), 0.004)  # the network reads the whole scene 4 mm high, the walls too
    args = (np.zeros((60, 80), bool), calib, cam, top, 0.01, 0.0072)
    plain, _ = camera_heights_to_surface(low, *args)
    walled, part = camera_heights_to_surface(low, *args, walls=(0.058, 0.012))
    v, u = np.mgrid[0:64, 0:64]
    xy = view_pixels_to_base(np.stack([u.ravel(), v.ravel()], 1).astype(float), calib, top, 0.0).reshape(64, 64, 3)
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    inset = np.minimum.reduce([xy[..., 0] - x0, x1 - xy[..., 0], xy[..., 1] - y0, y1 - xy[..., 1]])
    band = (inset >= 0) & (inset <= 0.012)
    assert band.sum() > 50 and np.all(walled[band] == pytest.approx(0.058)) and not part[band].any()
    assert np.all(plain[band] < 0.01)  # without them the walls are as low as the network read them
    np.testing.assert_array_equal(walled[~band], plain[~band])
    with pytest.raises(ValueError, match="walls"):
        camera_heights_to_surface(low, *args, walls=(-0.01, 0.012))


def test_geometry_frames_augment_and_the_loss_learns_a_known_target(rendered):
    frames = SimFrameDataset(rendered, fields=("rgb", "depth", "seg"))
    calib = frames.calibration
    view = make_view(calib, (48, 36), "camera", margin=0.03)
    recs = [geometry_record(frames[i], calib, view) for i in range(len(frames))]
    ds = GeometryFrames(recs, {"hflip": 1.0, "color": 0.0}, seed=0)
    item = ds[0]
    want = np.where(np.isfinite(recs[0]["height"]), recs[0]["height"], 0)[:, ::-1].astype(np.float32)
    np.testing.assert_allclose(item["height_target"].numpy(), want, atol=1e-6)  # flipped with the image
    assert item["image"].shape == (3, 36, 48) and item["known"].dtype == torch.bool

    torch.manual_seed(0)
    net = GeometryNet(base_channels=8)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    batch = {k: torch.stack([GeometryFrames(recs)[i][k] for i in range(len(recs))]) for k in item}
    cfg = {"height_weight": 20.0, "mask_weight": 1.0, "object_weight": 4.0}
    first = geometry_losses(net(batch["image"]), batch, cfg)
    for _ in range(60):
        loss = geometry_losses(net(batch["image"]), batch, cfg)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = geometry_losses(net(batch["image"]), batch, cfg)
    assert last["height_loss"] < 0.5 * first["height_loss"] and last["object_loss"] < first["object_loss"]


@pytest.mark.slow  # about 30 s: the fast tier must stay under 10 minutes
def test_the_shipped_networks_answer_null_on_empty_bins_with_high_frequency_floors(calib, tmp_path):
    """An artifact of the shipped base and geometry network, with the on-part gate, on 20 seeded
    empty-bin twin frames whose table, bin and floor all carry the natural-statistics textures.

    The issue's goal is 18 of 20 null answers; geometry_base_v1 answered 16 (measured, 2026-12-01:
    on the other 4 it saw parts of 54-180 top-down cells in stroke and cell textures, with
    heights above the 8 mm part threshold, see docs/policy.md), the shipped geometry_base_v2
    answers 17 (2026-12-03) with the quality threshold's null behind the gate. Since
    ``decode.answer_on_parts`` (on: a frame showing a part is never answered null for want of
    quality, which took validation cell 4 from 6.7% to 23.6%) the gate alone decides, and it
    answers 16 (docs/decode.md: the measured trade). This guards both; the goal stays open."""
    from omegaconf import OmegaConf

    from perception.core.artifact import write_metadata
    from policies.eval_adapters import OnnxPolicy
    from policies.evaluate import evaluate_empty_bin, load_profile
    from policies.export import export_artifact
    from policies.module import GraspPolicyModule
    from policies.train import geometry_export
    from sim_render.api import compose_config

    cfg = compose_config("pipeline")  # the shipped defaults: geometry network, on-part gate
    pcfg = OmegaConf.to_container(cfg.policy, resolve=True)
    from policies.weights import load_base

    base = load_base(pcfg["base"])
    module = GraspPolicyModule(network=base["network"])
    module.load_state_dict(base["state_dict"])
    view = make_view(calib, tuple(pcfg["view_size"]), **pcfg["view"])
    art = export_artifact(module, view, calib, pcfg, tmp_path / "artifact", geometry=geometry_export(pcfg))
    textured = load_profile("randomized", ["render.surface_textures.table.prob=1.0", "render.surface_textures.bin.prob=1.0",
                                           "render.surface_textures.floor.prob=1.0"])
    res = evaluate_empty_bin(OnnxPolicy(art), textured, calib, n_frames=20, seed=0, render_scale=0.5)
    assert res["null"] >= 16, res
    meta = json.loads((art / "metadata.json").read_text())
    meta["decode"].pop("answer_on_parts")  # absent: the threshold's null too, as before
    write_metadata(art, meta)
    res = evaluate_empty_bin(OnnxPolicy(art), textured, calib, n_frames=20, seed=0, render_scale=0.5)
    assert res["null"] >= 17, res


def test_a_pyramid_geometry_network_named_by_a_config_reloads_and_exports(tmp_path):
    """``geometry.network`` naming :class:`PyramidGeometryNet` over the default block (its
    ``base_channels`` cleared with null) builds that class; a saved file's contents rebuild the
    same outputs, at a size no power of 16 divides; the geometry graph exports and agrees."""
    from policies.export import GEOMETRY_OUTPUT_NAMES, export_graph, graph_max_diff
    from policies.geometry import geometry_net
    from policies.networks import HEIGHT_MAX, GeometryExport, PyramidGeometryNet, build_network

    block = {"_target_": "policies.networks.PyramidGeometryNet", "base_channels": None,
             "widths": [4, 8, 8, 16, 16], "dilations": [1, 2]}
    torch.manual_seed(0)
    net = build_network(block, GeometryNet, "geometry.network")
    assert type(net) is PyramidGeometryNet and len(net.down) == 4
    net.train()
    with torch.no_grad():  # batch-norm statistics of their own, as after training
        for _ in range(3):
            net(torch.randn(4, 3, 60, 76))
    net.eval()
    x = torch.randn(2, 3, 60, 76)
    with torch.no_grad():
        out = net(x)
        again = geometry_net({"network": block, "state_dict": net.state_dict()})(x)
    assert out["height"].shape == (2, 1, 60, 76) and out["object_logits"].shape == (2, 1, 60, 76)
    assert 0 <= float(out["height"].min()) and float(out["height"].max()) <= HEIGHT_MAX
    torch.testing.assert_close(again["height"], out["height"])
    wrapper = GeometryExport(net)
    export_graph(wrapper, tmp_path / "geometry.onnx", (76, 60), GEOMETRY_OUTPUT_NAMES)
    assert graph_max_diff(wrapper, tmp_path / "geometry.onnx", x.numpy(), GEOMETRY_OUTPUT_NAMES) < 1e-4
    with pytest.raises(ValueError, match="at least two levels"):
        build_network({**block, "widths": [8]}, GeometryNet, "geometry.network")


def test_a_geometry_network_given_the_cameras_maps_exports_them_inside_its_graph(tmp_path):
    """``camera_input``: the network takes the view's camera maps beside the image and refuses to
    run without them; a saved file's contents rebuild it; the exported graph holds the artifact
    calibration's maps, takes the image alone and agrees with torch; other maps change the answer."""
    import onnxruntime as ort

    from perception.core.calibration import Calibration, default_calibration_path
    from perception.core.geometry import camera_channels, network_view
    from policies.export import GEOMETRY_OUTPUT_NAMES, export_graph, graph_max_diff
    from policies.geometry import geometry_net
    from policies.networks import GeometryExport, build_network

    block = {"_target_": "policies.networks.GeometryNet", "base_channels": 4, "dilations": [2], "camera_input": True}
    torch.manual_seed(0)
    net = build_network(block, GeometryNet, "geometry.network").eval()
    calib = Calibration.load(default_calibration_path())
    view = network_view(calib, (64, 48))
    cam = net.camera_maps(calib, view)
    np.testing.assert_array_equal(cam[0].numpy(), camera_channels(calib, view))
    x = torch.randn(2, 3, 48, 64)
    with pytest.raises(ValueError, match="camera_input"):
        net(x)
    with torch.no_grad():
        out = net(x, cam)
        again = geometry_net({"network": block, "state_dict": net.state_dict()})(x, cam)
        other = net(x, torch.zeros_like(cam))
    torch.testing.assert_close(again["height"], out["height"])
    assert float((other["height"] - out["height"]).abs().max()) > 1e-4, "the maps are read"
    wrapper = GeometryExport(net, cam)
    path = tmp_path / "geometry.onnx"
    export_graph(wrapper, path, (64, 48), GEOMETRY_OUTPUT_NAMES)
    inputs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()
    assert [(i.name, i.shape[1]) for i in inputs] == [("image", 3)]
    assert graph_max_diff(wrapper, path, x.numpy(), GEOMETRY_OUTPUT_NAMES) < 1e-4


def test_height_bins_read_one_of_two_answers_where_the_mean_reads_between():
    """``bin_height``: a pixel torn between a lying part (bin 6) and a stacked one (bin 17) reads
    bin 6's neighbourhood under ``mode`` and a height between the two under ``mean``; a pixel sure
    of one bin reads its centre either way."""
    from policies.networks import BINS_BELOW_TABLE, bin_height, height_bin_centres

    K = 32
    centres = height_bin_centres(K)
    assert float(centres[BINS_BELOW_TABLE]) == 0.0, "the table's height is a bin's centre"
    p = torch.full((K,), 1e-6)
    p[6], p[17] = 0.55, 0.45
    torn = torch.log(p / p.sum()).view(1, K, 1, 1)
    sure = torch.full((1, K, 1, 1), -20.0)
    sure[0, 9] = 20.0
    mode, mean = bin_height(torn, centres, "mode").item(), bin_height(torn, centres, "mean").item()
    assert abs(mode - float(centres[6])) < 1e-4
    assert abs(mean - (0.55 * float(centres[6]) + 0.45 * float(centres[17]))) < 1e-4
    for readout in ("mode", "mean"):
        assert abs(bin_height(sure, centres, readout).item() - float(centres[9])) < 1e-6
    table = torch.full((1, K, 1, 1), -20.0)
    table[0, BINS_BELOW_TABLE - 1 : BINS_BELOW_TABLE + 2, 0, 0] = torch.tensor([0.0, 1.0, 0.0])
    for readout in ("mode", "mean"):  # a symmetric belief about the table reads the table
        assert abs(bin_height(table, centres, readout).item()) < 1e-6


def test_a_geometry_network_with_height_bins_learns_a_known_target_and_exports(rendered, tmp_path):
    """``height_bins``: the cross-entropy on the bins teaches the heights of a rendered frame (the
    height read from the bins comes within two bins on the parts' median), a file's contents
    rebuild it, its graph agrees with torch; bad settings are refused (the stop fine-tune on such
    a network: tests/policies/test_stops.py)."""
    from policies.export import GEOMETRY_OUTPUT_NAMES, export_graph, graph_max_diff
    from policies.geometry import geometry_net
    from policies.networks import HEIGHT_MAX, GeometryExport, build_network

    frames = SimFrameDataset(rendered, fields=("rgb", "depth", "seg"))
    calib = frames.calibration
    view = make_view(calib, (48, 36), "camera", margin=0.03)
    recs = [geometry_record(frames[i], calib, view) for i in range(len(frames))]
    items = [GeometryFrames(recs)[i] for i in range(len(recs))]
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    block = {"_target_": "policies.networks.GeometryNet", "base_channels": 8, "dilations": [2], "height_bins": 16}
    torch.manual_seed(0)
    net = build_network(block, GeometryNet, "geometry.network")
    cfg = {"height_weight": 20.0, "mask_weight": 1.0, "object_weight": 4.0, "bin_weight": 1.0, "bin_sigma": 1.0}
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    part = batch["known"] & batch["object_target"]
    with torch.no_grad():
        first = float((net(batch["image"])["height"][:, 0] - batch["height_target"]).abs()[part].median())
    for _ in range(80):
        loss = geometry_losses(net(batch["image"]), batch, cfg)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    with torch.no_grad():
        out = net(batch["image"])
    assert out["height_bin_logits"].shape == (len(recs), 16, 36, 48) and "height_logits" not in out
    err = float((out["height"][:, 0] - batch["height_target"]).abs()[part].median())
    assert err < 0.5 * first and err < 2 * HEIGHT_MAX / 16, (first, err)
    with torch.no_grad():
        again = geometry_net({"network": block, "state_dict": net.state_dict()})(batch["image"])
    torch.testing.assert_close(again["height"], out["height"])
    wrapper = GeometryExport(net)
    export_graph(wrapper, tmp_path / "geometry.onnx", (48, 36), GEOMETRY_OUTPUT_NAMES)
    assert graph_max_diff(wrapper, tmp_path / "geometry.onnx", batch["image"][:2].numpy(), GEOMETRY_OUTPUT_NAMES) < 1e-4
    for bad, match in (({"height_bins": 4}, "height_bins"), ({"readout": "median"}, "readout")):
        with pytest.raises(ValueError, match=match):
            build_network({**block, **bad}, GeometryNet, "geometry.network")
