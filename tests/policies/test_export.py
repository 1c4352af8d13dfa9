"""The artifact: ONNX agrees with torch, the metadata is what the service reads, writes are atomic."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from perception.core.artifact import PolicyRunner, load_metadata
from perception.core.preprocess import IMAGE_MEAN, IMAGE_STD
from policies.export import ExportError, export_artifact, onnx_torch_max_diff
from policies.networks import ExportWrapper, GraspNet, count_parameters


def _net(A=6, c=8):
    torch.manual_seed(0)
    net = GraspNet(angle_bins=A, base_channels=c)
    # Non-trivial batch-norm statistics, as after training.
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(4, 3, 64, 64))
    return net.eval()


def test_network_shapes_and_ranges():
    net = GraspNet(angle_bins=12, base_channels=16).eval()
    assert 100_000 < count_parameters(net) < 500_000
    with torch.no_grad():
        out = net(torch.randn(2, 3, 96, 80))
    assert out["quality_logits"].shape == (2, 12, 96, 80)
    assert out["width"].shape == (2, 1, 96, 80) and out["height"].shape == (2, 1, 96, 80)
    assert out["surface"].shape == (2, 1, 96, 80)
    assert 0 <= float(out["width"].min()) and float(out["width"].max()) <= 0.08
    with torch.no_grad():
        q, w, h, s = ExportWrapper(net)(torch.randn(1, 3, 64, 64))
    assert 0 <= float(q.min()) and float(q.max()) <= 1


def test_onnx_matches_torch(tmp_path, calib, view):
    net = _net()
    art = export_artifact(net, view, calib, {"quality_threshold": 0.4}, tmp_path / "artifact",
                          training={"note": "test"})
    x = np.random.default_rng(1).standard_normal((3, 3, view.height, view.width)).astype(np.float32)
    assert onnx_torch_max_diff(net, art / "policy.onnx", x) < 1e-4
    # Realistic inputs too: a normalised image in [-1, 1].
    img = np.random.default_rng(2).uniform(-1, 1, (1, 3, view.height, view.width)).astype(np.float32)
    assert onnx_torch_max_diff(net, art / "policy.onnx", img) < 1e-4


# The table view's run of this test is in the slow tier: the camera view's covers the same code path
# (the fast tier stays under 10 minutes on 2 cores).
@pytest.mark.parametrize("view", ["camera", pytest.param("table", marks=pytest.mark.slow)], indirect=True)
def test_flip_average_is_mirror_equivariant_and_exports(tmp_path, calib, view):
    """With flip_average the graph's maps of a mirrored image are the mirrored maps (angle
    bins mirrored too), exactly; the exported ONNX carries it and agrees with torch."""
    net = _net(A=6)
    graph = ExportWrapper(net, flip_average=True).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        q, w, h, s = graph(x)
        qm, wm, hm, sm = graph(torch.flip(x, dims=[3]))
    perm = torch.tensor([(-b) % 6 for b in range(6)])
    torch.testing.assert_close(qm, torch.flip(q, dims=[3])[:, perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(wm, torch.flip(w, dims=[3]), atol=1e-7, rtol=0)
    torch.testing.assert_close(hm, torch.flip(h, dims=[3]), atol=1e-7, rtol=0)
    torch.testing.assert_close(sm, torch.flip(s, dims=[3]), atol=1e-7, rtol=0)
    with torch.no_grad():
        plain, *_ = ExportWrapper(net)(x)
    assert float((plain - q).abs().max()) > 1e-3  # it is not the plain graph
    art = export_artifact(net, view, calib, {"flip_average": True, "decode": {"neighbourhood_px": 1}},
                          tmp_path / "artifact")
    img = np.random.default_rng(3).uniform(-1, 1, (2, 3, view.height, view.width)).astype(np.float32)
    assert onnx_torch_max_diff(net, art / "policy.onnx", img, flip_average=True) < 1e-4
    assert onnx_torch_max_diff(net, art / "policy.onnx", img, flip_average=False) > 1e-3
    assert load_metadata(art).decode == {"neighbourhood_px": 1, "width_margin": 0.0}


# The table view's run of this test is in the slow tier: the camera view's covers the same code path
# (the fast tier stays under 10 minutes on 2 cores).
@pytest.mark.parametrize("view", ["camera", pytest.param("table", marks=pytest.mark.slow)], indirect=True)
def test_metadata_is_what_the_service_reads(tmp_path, calib, view):
    art = export_artifact(_net(A=6), view, calib, {"quality_threshold": 0.4}, tmp_path / "artifact")
    meta = load_metadata(art)
    raw = json.loads((art / "metadata.json").read_text())
    assert raw["format"] == "sim2real-grasp-policy" and raw["format_version"] == 1 and raw["onnx"] == "policy.onnx"
    assert raw["input"] == {"name": "image", "layout": "NCHW", "channels": "RGB", "dtype": "float32",
                            "size": [view.width, view.height], "mean": list(IMAGE_MEAN), "std": list(IMAGE_STD)}
    assert raw["outputs"] == {"quality": "quality", "width": "width", "height": "height", "surface": "surface"}
    assert meta.angle_bins == 6 and meta.quality_threshold == pytest.approx(0.4)
    np.testing.assert_allclose(meta.view.K, view.K)
    assert "code_version" in raw and raw["training"]["config"]["quality_threshold"] == 0.4
    runner = PolicyRunner(art)
    maps = runner.infer(np.zeros((calib.height, calib.width, 3), np.uint8))
    assert maps.quality.shape == (6, view.height, view.width)
    # The runner's input equals to_network_input's (the normalisation is the same).
    from perception.core.preprocess import to_network_input

    img = np.random.default_rng(0).integers(0, 256, (view.height, view.width, 3), dtype=np.uint8)
    np.testing.assert_allclose(runner.to_input(img), to_network_input(img), atol=1e-6)


# The table view's run of this test is in the slow tier: the camera view's covers the same code path
# (the fast tier stays under 10 minutes on 2 cores).
@pytest.mark.parametrize("view", ["camera", pytest.param("table", marks=pytest.mark.slow)], indirect=True)
def test_export_replaces_an_artifact_whole(tmp_path, calib, view):
    out = tmp_path / "artifact"
    export_artifact(_net(A=6), view, calib, {}, out)
    export_artifact(_net(A=4), view, calib, {}, out)
    assert load_metadata(out).angle_bins == 4
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "policy.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]  # no temporary folders left


# The table view's run of this test is in the slow tier: the camera view's covers the same code path
# (the fast tier stays under 10 minutes on 2 cores).
@pytest.mark.parametrize("view", ["camera", pytest.param("table", marks=pytest.mark.slow)], indirect=True)
def test_export_refuses_a_mismatch(tmp_path, calib, view, monkeypatch):
    import policies.export as ex

    monkeypatch.setattr(ex, "onnx_torch_max_diff", lambda *a, **k: 1.0)
    with pytest.raises(ExportError, match="differ"):
        export_artifact(_net(), view, calib, {}, tmp_path / "artifact")
    assert not (tmp_path / "artifact").exists()


def test_batchnorm_statistics_of_other_inputs_mix_into_a_copy():
    """AdaBN (``with_batchnorm_statistics``): alpha 1 gives the first layer the inputs' own
    channel statistics, alpha 0 the trained ones; the network given is left as it was."""
    from policies.networks import with_batchnorm_statistics

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).eval()
    views = torch.randn(40, 3, 8, 8) * 2.0 + 5.0
    full = with_batchnorm_statistics(net, views, 1.0, batch=10)
    assert not full.training and full is not net
    torch.testing.assert_close(full[0].running_mean, views.mean(dim=(0, 2, 3)), atol=1e-4, rtol=0)
    torch.testing.assert_close(full[0].running_var, views.var(dim=(0, 2, 3)), atol=0.05, rtol=0.02)
    torch.testing.assert_close(net[0].running_mean, torch.zeros(3))  # untouched
    none = with_batchnorm_statistics(net, views, 0.0, batch=10)
    torch.testing.assert_close(none[2].running_var, net[2].running_var)
    half = with_batchnorm_statistics(net, views, 0.5, batch=10)
    torch.testing.assert_close(half[0].running_mean, 0.5 * full[0].running_mean, atol=1e-5, rtol=0)
