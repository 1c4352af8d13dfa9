"""The rendered camera matches the calibration: projection, distortion, depth, ids."""

from __future__ import annotations

import warnings

import cv2
import numpy as np
import pybullet as p
import pytest
from pybullet_utils.bullet_client import BulletClient

from perception.core.calibration import Calibration, default_calibration_path, project_points
from sim_render.camera import (
    FAR_M,
    distort_image,
    pinhole_plan,
    raw_getcamera_fps,
    render_camera,
    setup_renderer,
    undistort_pixels,
)

SIZE = (320, 240)
MARGIN = 0.15


@pytest.fixture(scope="module")
def calib() -> Calibration:
    return Calibration.load(default_calibration_path())


@pytest.fixture(scope="module")
def camera(calib: Calibration) -> Calibration:
    return calib.scaled(SIZE)


@pytest.fixture()
def client():
    c = BulletClient(connection_mode=p.DIRECT)
    yield c
    c.disconnect()


def _box(client, centre, half, rgba=(0.8, 0.2, 0.2, 1.0)) -> int:
    vis = client.createVisualShape(p.GEOM_BOX, halfExtents=list(half), rgbaColor=list(rgba))
    return client.createMultiBody(0.0, -1, vis, basePosition=list(centre))


def _ray_box(camera: Calibration, centre, half) -> tuple[np.ndarray, np.ndarray]:
    """Analytic mask and depth of an axis-aligned box seen through the raw camera."""
    w, h = camera.image_size
    uv = np.stack(np.meshgrid(np.arange(w, dtype=float), np.arange(h, dtype=float)), -1).reshape(-1, 2)
    xy = undistort_pixels(uv, camera.K, camera.dist)
    d = np.c_[xy, np.ones(len(xy))] @ camera.T_base_camera[:3, :3].T  # z_cam = 1 per unit t
    o = camera.T_base_camera[:3, 3]
    lo, hi = np.asarray(centre) - half, np.asarray(centre) + half
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = (lo - o) / d, (hi - o) / d
    t_near = np.nanmax(np.minimum(t1, t2), axis=1)
    t_far = np.nanmin(np.maximum(t1, t2), axis=1)
    hit = (t_far >= t_near) & (t_far > 0)
    return hit.reshape(h, w), np.where(hit, t_near, np.nan).reshape(h, w)


BOXES = [
    ([0.5, 0.0, 0.03], [0.04, 0.03, 0.03]),
    ([0.38, 0.13, 0.02], [0.02, 0.02, 0.02]),
    ([0.63, -0.13, 0.02], [0.03, 0.015, 0.02]),
    ([0.36, -0.14, 0.01], [0.01, 0.01, 0.01]),
]


@pytest.mark.parametrize("centre,half", BOXES)
def test_box_matches_analytic_raw_camera(client, camera, centre, half):
    """The rendered box covers the raw pixels whose undistorted rays hit it."""
    body = _box(client, centre, half)
    rgb, depth, seg = render_camera(client, camera, MARGIN)
    expected, expected_depth = _ray_box(camera, centre, half)
    mask = seg == body
    ys, xs = np.nonzero(mask)
    ey, ex = np.nonzero(expected)
    assert abs(xs.mean() - ex.mean()) < 0.3 and abs(ys.mean() - ey.mean()) < 0.3
    # Only edge pixels may disagree.
    assert (mask ^ expected).sum() <= 0.1 * expected.sum() + 4
    inner = cv2.erode(expected.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
    np.testing.assert_allclose(depth[inner], expected_depth[inner], atol=3e-3)


@pytest.mark.parametrize(
    "point", [[0.5, 0.0, 0.03], [0.37, 0.14, 0.0], [0.64, -0.14, 0.06], [0.64, 0.14, 0.0]]
)
def test_point_projects_where_project_points_says(client, camera, point):
    """A small marker appears within 1 px of cv2.projectPoints (distortion included)."""
    half = 0.006
    body = _box(client, point, [half] * 3)
    _, _, seg = render_camera(client, camera, MARGIN)
    ys, xs = np.nonzero(seg == body)
    assert len(xs) > 0
    uv = project_points(np.array([point]), camera)[0]
    assert np.hypot(xs.mean() - uv[0], ys.mean() - uv[1]) < 1.0


def test_outputs_layout_and_background(client, camera):
    rgb, depth, seg = render_camera(client, camera, MARGIN)
    w, h = camera.image_size
    assert rgb.shape == (h, w, 3) and rgb.dtype == np.uint8
    assert depth.shape == (h, w) and depth.dtype == np.float32
    assert seg.shape == (h, w) and seg.dtype == np.int32
    assert np.all(seg == -1)
    np.testing.assert_allclose(depth, FAR_M, rtol=1e-4)


def test_strong_barrel_distortion_uses_margin(client, camera):
    """A lens that sees more than its pinhole renders a wider field, and still projects right."""
    barrel = camera.replace(dist=np.array([-0.3, 0.08, 0.0, 0.0, 0.0]))
    plan = pinhole_plan(barrel, MARGIN)
    assert not plan.clipped
    assert plan.size[0] > camera.width and plan.size[1] > camera.height
    corner = [0.64, 0.14, 0.0]
    body = _box(client, corner, [0.006] * 3)
    _, _, seg = render_camera(client, barrel, MARGIN)
    ys, xs = np.nonzero(seg == body)
    uv = project_points(np.array([corner]), barrel)[0]
    assert np.hypot(xs.mean() - uv[0], ys.mean() - uv[1]) < 1.0


def test_too_small_margin_warns(camera):
    barrel = camera.replace(dist=np.array([-0.3, 0.08, 0.0, 0.0, 0.0]))
    with pytest.warns(UserWarning, match="render_margin"):
        pinhole_plan(barrel, 0.0)


def test_interpolated_map_is_exact(camera):
    """The grid-interpolated distortion map matches per-pixel undistortion to 0.05 px."""
    for cam in (camera, camera.replace(dist=np.array([-0.3, 0.08, 0.001, -0.001, 0.0]))):
        plan = pinhole_plan(cam, MARGIN)
        w, h = cam.image_size
        probe = np.zeros((plan.size[1], plan.size[0], 2), np.float32)
        probe[..., 0], probe[..., 1] = np.meshgrid(np.arange(plan.size[0]), np.arange(plan.size[1]))
        got = distort_image(probe, plan.K, plan.size, cam, cv2.INTER_LINEAR)
        uv = np.stack(np.meshgrid(np.arange(w, dtype=float), np.arange(h, dtype=float)), -1).reshape(-1, 2)
        xy = undistort_pixels(uv, cam.K, cam.dist)
        exact = (xy * plan.K[[0, 1], [0, 1]] + plan.K[:2, 2]).reshape(h, w, 2)
        # Every raw pixel's ray is inside the pinhole render.
        assert (
            exact.min() >= 0
            and exact[..., 0].max() <= plan.size[0] - 1
            and exact[..., 1].max() <= plan.size[1] - 1
        )
        # OpenCV 4 interpolates remap with 1/32 px weights; allow for that.
        assert np.abs(got - exact).max() < 0.05 + 1 / 32


def test_distort_image_without_distortion_is_identity(camera):
    pinhole = camera.replace(dist=np.zeros(5))
    img = np.random.default_rng(0).integers(0, 256, (camera.height, camera.width, 3), dtype=np.uint8)
    out = distort_image(img, pinhole.K, pinhole.image_size, pinhole, cv2.INTER_NEAREST)
    np.testing.assert_array_equal(out, img)
    seg = (
        np.arange(camera.width * camera.height, dtype=np.int32).reshape(camera.height, camera.width) % 50 - 1
    )
    np.testing.assert_array_equal(
        distort_image(seg, pinhole.K, pinhole.image_size, pinhole, cv2.INTER_NEAREST), seg
    )


def test_same_scene_same_frame(client, camera):
    _box(client, [0.5, 0.0, 0.03], [0.04, 0.03, 0.03])
    light = {
        "lightDirection": [0.3, 0.2, 0.9],
        "lightColor": [1.0, 0.9, 0.8],
        "shadow": 1,
        "lightDistance": 2.0,
    }
    a = render_camera(client, camera, MARGIN, lighting=light)
    b = render_camera(client, camera, MARGIN, lighting=light)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_egl_after_scene_falls_back_to_tiny(client, camera):
    """EGL only sees bodies created after its plugin: a late request keeps TinyRenderer."""
    _box(client, [0.5, 0.0, 0.03], [0.04, 0.03, 0.03])
    tiny = render_camera(client, camera, MARGIN, "tiny")
    with pytest.warns(UserWarning, match="TinyRenderer"):
        egl = render_camera(client, camera, MARGIN, "egl")
    for x, y in zip(tiny, egl):
        np.testing.assert_array_equal(x, y)


def test_unknown_renderer_raises(client, camera):
    with pytest.raises(ValueError, match="known"):
        render_camera(client, camera, MARGIN, "vulkan")


def test_raw_getcamera_fps_positive(client, camera):
    assert raw_getcamera_fps(client, camera.scaled((64, 48)), n=2) > 0


@pytest.mark.egl
def test_egl_matches_tiny_geometry(calib):
    """With the plugin loaded before the scene, EGL ids and depth match TinyRenderer's."""
    camera = calib.scaled(SIZE)
    frames = {}
    for renderer in ("tiny", "egl"):
        c = BulletClient(connection_mode=p.DIRECT)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback would make this test vacuous
            setup_renderer(c, renderer)
        _box(c, [0.5, 0.0, 0.03], [0.04, 0.03, 0.03])
        frames[renderer] = render_camera(c, camera, MARGIN, renderer)
        c.disconnect()
    (_, d_tiny, s_tiny), (_, d_egl, s_egl) = frames["tiny"], frames["egl"]
    assert (s_tiny != s_egl).mean() < 0.002
    same = s_tiny == s_egl
    np.testing.assert_allclose(d_tiny[same], d_egl[same], atol=5e-3)
