"""Dense geometric pseudo-labels: the labeller's rule on a height grid, and its projection."""

from __future__ import annotations

import numpy as np

from policies.geometric import geometric_grasps, geometric_view_labels, height_grid, splat_view_labels


def _bar_grid(res=0.004):
    xs = np.arange(0.30, 0.70, res) + res / 2
    ys = np.arange(-0.20, 0.20, res) + res / 2
    h = np.zeros((len(ys), len(xs)))
    gx, gy = np.meshgrid(xs, ys)
    bar = (np.abs(gy) <= 0.01) & (np.abs(gx - 0.5) <= 0.08)  # 2 cm wide, 16 cm long, along x
    h[bar] = 0.03
    return xs, ys, h, np.ones_like(h, bool), bar


def test_rule_grasps_a_bar_across_not_along():
    xs, ys, h, known, bar = _bar_grid()
    g = geometric_grasps(xs, ys, h, known, bar, 0.0, n_yaws=12)
    centre = (np.abs(g["position"][:, 1]) < 0.003) & (np.abs(g["position"][:, 0] - 0.5) < 0.04)
    across = centre & (np.abs(np.abs(g["yaw"]) - np.pi / 2) < 1e-6)
    along = centre & (np.abs(g["yaw"]) < 1e-6)
    assert across.any() and along.any()
    assert g["success"][across].all()
    assert not g["success"][along].any()
    # Fingertip height: the top minus the labeller's grasp depth; opening symmetric about the cell.
    from sim_render.labels import GRASP_DEPTH

    np.testing.assert_allclose(g["position"][across, 2], 0.03 - GRASP_DEPTH)
    assert (g["width"][across] <= 0.08).all() and (g["width"][across] > 0.02).all()
    assert g["certain"].all()


def test_unseen_cells_make_verdicts_uncertain():
    xs, ys, h, known, bar = _bar_grid()
    known = known.copy()
    gx, gy = np.meshgrid(xs, ys)
    known[(gy > 0.012) & (gy < 0.03)] = False  # the shadow on one side of the bar
    g = geometric_grasps(xs, ys, h, known, bar, 0.0, n_yaws=12)
    across = (np.abs(g["position"][:, 1]) < 0.003) & (np.abs(np.abs(g["yaw"]) - np.pi / 2) < 1e-6)
    assert g["success"][across].all() and not g["certain"][across].any()


def test_projection_and_splat(calib, view):
    xs, ys, h, known, bar = _bar_grid()
    g = geometric_grasps(xs, ys, h, known, bar, 0.0, n_yaws=12)
    raw = calib.scaled((160, 120))
    lab = geometric_view_labels(g, raw, raw, view)
    assert lab["uv"].shape == (len(g["yaw"]), 2)
    sp = splat_view_labels(lab, view, 12)
    A, H, W = 12, view.height, view.width
    assert sp["index"].min() >= 0 and sp["index"].max() < A * H * W
    assert ((sp["target"] >= 0) & (sp["target"] <= 1)).all() and ((sp["weight"] > 0) & (sp["weight"] <= 1)).all()
    assert sp["mask"].any() and (sp["z"][sp["mask"]] > 0).all()


def test_height_grid_of_a_flat_table(calib):
    from perception.geometry import raw_pixels_to_rays

    raw = calib.scaled((160, 120))
    vv, uu = np.mgrid[0:120, 0:160]
    rays = raw_pixels_to_rays(np.stack([uu.ravel(), vv.ravel()], 1), raw)
    R, t = raw.T_base_camera[:3, :3], raw.T_base_camera[:3, 3]
    depth = ((0.0 - t[2]) / (rays @ R.T)[:, 2]).reshape(120, 160).astype(np.float32)
    seg = np.zeros((120, 160), np.uint8)
    xs, ys, height, known, is_obj = height_grid(depth, seg, raw, resolution=0.008)
    assert known.mean() > 0.8 and not is_obj.any()
    np.testing.assert_allclose(height[known], 0.0, atol=1e-3)
