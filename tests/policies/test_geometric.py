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
    from perception.core.rule import GRASP_DEPTH

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
    from perception.core.geometry import raw_pixels_to_rays

    raw = calib.scaled((160, 120))
    vv, uu = np.mgrid[0:120, 0:160]
    rays = raw_pixels_to_rays(np.stack([uu.ravel(), vv.ravel()], 1), raw)
    R, t = raw.T_base_camera[:3, :3], raw.T_base_camera[:3, 3]
    depth = ((0.0 - t[2]) / (rays @ R.T)[:, 2]).reshape(120, 160).astype(np.float32)
    seg = np.zeros((120, 160), np.uint8)
    xs, ys, height, known, is_obj = height_grid(depth, seg, raw, resolution=0.008)
    assert known.mean() > 0.8 and not is_obj.any()
    np.testing.assert_allclose(height[known], 0.0, atol=1e-3)


def test_the_labellers_dense_rule_agrees_with_the_decodes():
    """The dense pseudo-labels are perception.core.rule's verdicts (the decode's rule) at each
    cell's base position and yaw: the grid's columns are x, its rows y."""
    from perception.core.rule import fitting_grasps, object_cells

    PX, A = 0.004, 12
    rng = np.random.default_rng(0)
    s = np.zeros((72, 72), np.float32)
    for _ in range(6):
        v, u = rng.integers(8, 60, 2)
        s[v : v + rng.integers(3, 12), u : u + rng.integers(3, 20)] = rng.uniform(0.01, 0.07)
    xs = np.arange(72) * PX + 0.3
    ys = np.arange(72) * PX - 0.15
    known = np.ones_like(s, dtype=bool)
    parts = object_cells(s, min_object_px=1)
    g = geometric_grasps(xs, ys, s.astype(np.float64), known, parts, 0.0, n_yaws=A)
    fits, width, *_ = fitting_grasps(s, PX, A, parts)
    iu = np.rint((g["position"][:, 0] - xs[0]) / PX).astype(int)
    iv = np.rint((g["position"][:, 1] - ys[0]) / PX).astype(int)
    k = np.rint(np.mod(g["yaw"], np.pi) / (np.pi / A)).astype(int) % A
    assert len(k) > 500
    np.testing.assert_array_equal(fits[k, iv, iu], g["success"])
    ok = g["success"]
    np.testing.assert_allclose(width[k, iv, iu][ok], g["width"][ok], atol=1e-6)
