"""Training targets: labels mapped into the view, dense maps built from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perception.core.calibration import project_points
from perception.core.frames import MIN_TIP_CLEARANCE
from perception.core.grasp import Grasp, angle_to_bin, base_grasp_to_view
from perception.core.rule import GRASP_DEPTH
from policies.data import (
    PolicyFrames,
    build_targets,
    labels_to_view,
    split_by_scene,
    surface_height_view,
    translated_frame,
)

A = 12


def _raw_labels(grasps: list[Grasp], camera):
    """What the renderer stores: raw pixels of the centre, raw angle and opening."""
    c = project_points(np.array([g.position for g in grasps]), camera)
    tips = project_points(np.concatenate([g.fingertips() for g in grasps]), camera).reshape(-1, 2, 2)
    line = tips[:, 1] - tips[:, 0]
    return {"pixel": c, "image_angle": np.arctan2(line[:, 1], line[:, 0]), "image_width": np.linalg.norm(line, axis=1),
            "position": np.array([g.position for g in grasps])}


@pytest.mark.parametrize("raw_size", [(640, 480), (160, 120)])
def test_labels_to_view_matches_base_projection(calib, view, raw_size):
    grasps = [Grasp((0.45, -0.05, z), yaw, 0.05) for z, yaw in [(0.005, 0.3), (0.04, -1.2), (0.09, 1.5)]]
    raw = calib.scaled(raw_size)
    uv, angle, width_px = labels_to_view(_raw_labels(grasps, raw), raw, view)
    uv_ref, angle_ref, width_ref = base_grasp_to_view(
        np.array([g.position for g in grasps]), np.array([g.yaw for g in grasps]), np.array([g.width for g in grasps]),
        calib, view,
    )
    np.testing.assert_allclose(uv, uv_ref, atol=1e-3)
    np.testing.assert_allclose(np.cos(2 * angle), np.cos(2 * angle_ref), atol=1e-4)
    # A table view's fingertips come from raw ones placed symmetrically in the image, which in
    # perspective they are not quite: a few 1e-4 of the opening.
    np.testing.assert_allclose(width_px, width_ref, rtol=1e-3 if view.is_table else 1e-4)


def test_surface_height_of_a_flat_table(calib, view):
    """A depth image of the plane z = 0.02 gives that height at every view pixel it covers."""
    raw = calib.scaled((160, 120))
    vv, uu = np.mgrid[0:120, 0:160]
    from perception.core.geometry import raw_pixels_to_rays

    rays = raw_pixels_to_rays(np.stack([uu.ravel(), vv.ravel()], 1), raw)
    R, t = raw.T_base_camera[:3, :3], raw.T_base_camera[:3, 3]
    d = rays @ R.T
    depth = ((0.02 - t[2]) / d[:, 2]).reshape(120, 160).astype(np.float32)  # along camera z (rays have z=1)
    z = surface_height_view(depth, raw, raw, view)
    known = np.isfinite(z)
    assert known.mean() > 0.9
    np.testing.assert_allclose(z[known], 0.02, atol=2e-3)


def test_build_targets_values():
    H, W = 32, 40
    seg = np.zeros((H, W), np.uint8)
    seg[10:20, 10:20] = 3  # an object
    seg[0:2, :] = 1  # a bin wall
    valid = np.ones((H, W), bool)
    valid[:, -2:] = False
    surface = np.full((H, W), 0.0, np.float32)
    surface[10:20, 10:20] = 0.05
    surface[0:2, :] = 0.06
    uv = np.array([[15.2, 14.8], [15.0, 15.0], [12.0, 18.0], [30.0, 25.0]])
    angle = np.array([0.0, 0.01, np.pi / 2, 0.5])
    success = np.array([True, False, True, False])
    width = np.array([0.05, 0.08, 0.04, 0.08])
    z = np.array([0.03, 0.03, 0.028, 0.005])
    t = build_targets(seg, valid, surface, uv, angle, success, width, z, 0.0, A, {"label_radius": 1.0})
    assert t["quality_target"].shape == (A, H, W) and t["quality_target"].dtype == np.float32
    for k in ("dense_negative", "width_mask", "object_mask"):
        assert t[k].shape == (H, W) and t[k].dtype == bool
    # Two labels share (bin 0, pixel (15, 15)): one success, one failure -> 0.5.
    assert t["quality_weight"][0, 15, 15] == 1.0 and t["quality_target"][0, 15, 15] == pytest.approx(0.5)
    b = int(angle_to_bin(np.pi / 2, A))
    assert t["quality_target"][b, 18, 12] == 1.0 and t["quality_weight"][b, 18, 12] == 1.0
    assert t["quality_weight"][b, 18, 13] == 1.0 and t["quality_weight"][b, 18, 14] == 0.0  # radius 1
    assert t["quality_weight"][:, 5, 30].sum() == 0.0  # unlabelled pixels weigh nothing
    # Dense negatives: table and bin pixels, valid ones only; never the object.
    assert t["dense_negative"][5, 5] and t["dense_negative"][0, 5] and not t["dense_negative"][15, 15]
    assert not t["dense_negative"][5, W - 1]
    # Heights: surface minus the grasp depth, clamped at the clearance; labels override.
    assert t["height_target"][5, 5] == pytest.approx(MIN_TIP_CLEARANCE)
    assert t["height_target"][11, 11] == pytest.approx(0.05 - GRASP_DEPTH)
    assert t["height_target"][0, 30] == pytest.approx(0.06 - GRASP_DEPTH)
    assert t["height_target"][15, 15] == pytest.approx(0.03)
    assert t["height_weight"][15, 15] > t["height_weight"][11, 11] > t["height_weight"][5, 5] > 0
    assert t["height_weight"][5, W - 1] == 0.0
    # Widths: successful labels only.
    assert t["width_mask"][18, 12] and t["width_target"][18, 12] == pytest.approx(0.04)
    assert not t["width_mask"][25, 30]


def test_angle_spread_never_overrides_a_label():
    seg = np.zeros((8, 8), np.uint8)
    t = build_targets(seg, np.ones((8, 8), bool), np.zeros((8, 8), np.float32), np.array([[4.0, 4.0]]),
                      np.array([0.0]), np.array([True]), np.array([0.05]), np.array([0.01]), 0.0, A,
                      {"label_radius": 0.0, "angle_spread": 1, "angle_spread_weight": 0.3})
    assert t["quality_weight"][0, 4, 4] == 1.0
    assert t["quality_weight"][1, 4, 4] == pytest.approx(0.3) and t["quality_weight"][A - 1, 4, 4] == pytest.approx(0.3)
    assert t["quality_target"][1, 4, 4] == 1.0


def test_policy_frames_on_rendered_data(rendered, view):
    ds = PolicyFrames(rendered, view=view, angle_bins=A)
    item = ds[0]
    H, W = view.height, view.width
    assert item["image"].shape == (3, H, W) and item["image"].dtype == torch.float32
    assert item["view_rgb"].shape == (H, W, 3) and item["view_rgb"].dtype == torch.uint8
    assert item["quality_target"].shape == (A, H, W)
    for k, v in item.items():
        if v.is_floating_point():
            assert torch.isfinite(v).all(), k
    assert float(item["image"].min()) >= -1.0 and float(item["image"].max()) <= 1.0
    # Successful labels sit on objects (their centres are inside the part they close around).
    rec = ds.compact(0)
    uv = np.rint(rec["label_uv"][rec["label_success"]]).astype(int)
    inside = (uv[:, 0] >= 0) & (uv[:, 0] < W) & (uv[:, 1] >= 0) & (uv[:, 1] < H)
    if inside.any():
        on_obj = rec["seg_view"][uv[inside, 1], uv[inside, 0]] >= 3
        assert on_obj.mean() > 0.8
    # A translator is applied to the view image.
    inv = PolicyFrames(rendered, view=view, angle_bins=A, translator=lambda x: 255 - x)
    assert torch.equal(inv[0]["view_rgb"], 255 - item["view_rgb"])
    # translate_fraction: a fixed subset of the frames is adapted, the others stay as rendered.
    half = PolicyFrames(rendered, view=view, angle_bins=A, translator=lambda x: 255 - x, translate_fraction=0.5)
    plain = [ds[i]["view_rgb"] for i in range(len(ds))]
    flags = [translated_frame(int(half.indices[i]), 0.5) for i in range(len(ds))]
    for i in range(len(ds)):
        want = 255 - plain[i] if flags[i] else plain[i]
        assert torch.equal(half[i]["view_rgb"], want)
    with pytest.raises(ValueError, match="translate_fraction"):
        PolicyFrames(rendered, view=view, angle_bins=A, translate_fraction=1.5)


def test_translated_frame_subset_has_the_asked_share():
    picked = np.array([translated_frame(i, 0.3) for i in range(2000)])
    assert abs(picked.mean() - 0.3) < 0.03
    assert all(translated_frame(i, 1.0) for i in range(50)) and not any(translated_frame(i, 0.0) for i in range(50))
    assert picked[:8].any() and not picked[:8].all()  # spread out, not a block


def test_split_by_scene_keeps_scenes_whole(rendered):
    from sim_render.reader import SimFrameDataset

    frames = SimFrameDataset(rendered)
    tr, va = split_by_scene(frames, 0.3, seed=0)
    assert len(va) > 0 and len(tr) > 0 and not set(tr) & set(va)
    scenes = [frames[i]["scene"] for i in range(len(frames))]
    assert not {scenes[i] for i in tr} & {scenes[i] for i in va}


def test_hflip_mirrors_pixels_and_angle_bins():
    from perception.core.grasp import angle_bin_centers, normalize_angle
    from policies.data import augment_item

    H, W = 16, 20
    seg = np.zeros((H, W), np.uint8)
    t = build_targets(seg, np.ones((H, W), bool), np.zeros((H, W), np.float32), np.array([[3.0, 5.0]]),
                      np.array([0.4]), np.array([True]), np.array([0.05]), np.array([0.02]), 0.0, A,
                      {"label_radius": 0.0})
    img = np.zeros((H, W, 3), np.uint8)
    img[5, 3] = 255
    rng = np.random.default_rng(0)
    out_img, out = augment_item(img, t, rng, {"hflip": 1.0, "shift_px": 0, "color": 0.0})
    assert out_img[5, W - 1 - 3].max() == 255
    b = int(np.flatnonzero(out["quality_weight"][:, 5, W - 1 - 3])[0])
    assert abs(normalize_angle(angle_bin_centers(A)[b] + 0.4)) <= np.pi / A / 2 + 1e-9
    assert out["height_target"][5, W - 1 - 3] == pytest.approx(0.02)
    back_img, back = augment_item(out_img, out, rng, {"hflip": 1.0, "shift_px": 0, "color": 0.0})
    assert np.array_equal(back_img, img)
    for k in t:
        assert np.array_equal(back[k], t[k]), k


def test_shift_moves_image_and_targets_together():
    from policies.data import augment_item

    H, W = 16, 20
    seg = np.zeros((H, W), np.uint8)
    t = build_targets(seg, np.ones((H, W), bool), np.zeros((H, W), np.float32), np.array([[10.0, 8.0]]),
                      np.array([0.0]), np.array([True]), np.array([0.05]), np.array([0.02]), 0.0, A,
                      {"label_radius": 0.0})
    img = np.zeros((H, W, 3), np.uint8)
    img[8, 10] = 200
    for seed in range(5):
        out_img, out = augment_item(img, t, np.random.default_rng(seed), {"hflip": 0.0, "shift_px": 3, "color": 0.0})
        v, u = np.argwhere(out_img[..., 0] == 200)[0]
        assert out["quality_weight"][0, v, u] == 1.0 and out["quality_weight"].sum() == 1.0


def test_table_view_surface_rebuilds_a_box_top_down(calib):
    """A 4 cm box on the table, seen obliquely: the top-down surface puts its top over its
    footprint (not where the image shows it), the table around it, and nothing behind it."""
    from perception.core.geometry import base_to_view_pixels, raw_pixels_to_rays, table_view
    from policies.data import table_view_surface

    raw = calib.scaled((320, 240))
    view = table_view(raw, (96, 96))
    vv, uu = np.mgrid[0:240, 0:320]
    rays = raw_pixels_to_rays(np.stack([uu.ravel(), vv.ravel()], 1), raw)
    R, t = raw.T_base_camera[:3, :3], raw.T_base_camera[:3, 3]
    d = rays @ R.T
    s_table = (0.0 - t[2]) / d[:, 2]
    s_top = (0.04 - t[2]) / d[:, 2]
    top_pts = t + d * s_top[:, None]
    box = (np.abs(top_pts[:, 0] - 0.5) < 0.03) & (np.abs(top_pts[:, 1]) < 0.03)  # rays hitting the top face
    s = np.where(box, s_top, s_table)
    seg = np.where(box, 3, 0).reshape(240, 320).astype(np.uint8)
    surface, label, known = table_view_surface(s.reshape(240, 320).astype(np.float32), seg, raw, view)
    u0, v0 = np.rint(base_to_view_pixels(np.array([[0.5, 0.0, 0.0]]), raw, view)[0]).astype(int)
    assert known[v0, u0] and label[v0, u0] == 3 and surface[v0, u0] == pytest.approx(0.04, abs=1e-3)
    u1, v1 = np.rint(base_to_view_pixels(np.array([[0.5, 0.1, 0.0]]), raw, view)[0]).astype(int)
    assert known[v1, u1] and label[v1, u1] == 0 and surface[v1, u1] == pytest.approx(0.0, abs=1e-3)
    # The far side of the box (away from the camera at +x) is hidden by it: unknown, not table.
    u2, v2 = np.rint(base_to_view_pixels(np.array([[0.5 - 0.045, 0.0, 0.0]]), raw, view)[0]).astype(int)
    assert not known[v2, u2]


def test_what_a_dataset_is_not_given_is_the_configs(rendered, calib):
    """One source for the policy's defaults: the view, its size and the angle bins a dataset
    is not given are conf/policy/default.yaml's (the code once said 128 px and a camera view
    where the config said 96 px and the top-down one)."""
    from conf import policy_default
    from perception.core.geometry import make_view

    ds = PolicyFrames(rendered)
    spec = policy_default("view")
    want = make_view(calib, tuple(policy_default("view_size")), spec.pop("kind"), **spec)
    assert ds.view.kind == want.kind and ds.view.size == want.size
    np.testing.assert_allclose(ds.view.K, want.K)
    assert ds.angle_bins == policy_default("angle_bins")
    assert ds.targets == policy_default("targets") and ds.augment is None
    assert PolicyFrames(rendered, augment={"hflip": 0.0}).augment == {**policy_default("augment"), "hflip": 0.0}
