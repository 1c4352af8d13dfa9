"""The grasp conversion the policy relies on: view pixel + height <-> base frame, and the
decode picking the peak of the maps (the same numbers the service uses)."""

from __future__ import annotations

import numpy as np
import pytest

from perception.core.calibration import project_points
from perception.core.decode import DecodeOptions, decode_grasp
from perception.core.frames import MIN_TIP_CLEARANCE
from perception.core.geometry import base_to_view_pixels, raw_to_view_pixels
from perception.core.grasp import angle_bin_centers, base_grasp_to_view, normalize_angle, view_grasp_to_base

HEIGHTS = [MIN_TIP_CLEARANCE, 0.02, 0.05, 0.09]
#: Pixel tolerance of round trips (the packaged rotation is orthonormal to full precision).
PX_TOL = 1e-6


@pytest.mark.parametrize("h", HEIGHTS)
def test_view_base_view_round_trip(calib, view, h):
    rng = np.random.default_rng(0)
    uv = np.stack([rng.uniform(8, view.width - 8, 20), rng.uniform(8, view.height - 8, 20)], axis=1)
    angle = rng.uniform(-np.pi / 2, np.pi / 2, 20)
    width_px = rng.uniform(3, 12, 20)
    z = np.full(20, calib.table_z + h)
    pos, yaw, width = view_grasp_to_base(uv, angle, width_px, z, calib, view)
    np.testing.assert_allclose(pos[:, 2], z, atol=1e-9)
    uv2, angle2, width_px2 = base_grasp_to_view(pos, yaw, width, calib, view)
    np.testing.assert_allclose(uv2, uv, atol=PX_TOL)
    np.testing.assert_allclose(np.cos(2 * (angle2 - angle)), 1.0, atol=1e-3)
    # The opening maps back up to perspective: the base-frame fingertips are placed
    # symmetrically about the centre, their images are not quite (a fraction of a percent).
    ok = width < 0.08
    np.testing.assert_allclose(width_px2[ok], width_px[ok], rtol=5e-3)


@pytest.mark.parametrize("h", HEIGHTS)
def test_raw_pixel_round_trip_through_base(calib, view, h):
    """Base point -> raw pixel (cv2.projectPoints, distortion) -> view pixel -> base at h."""
    from perception.core.geometry import view_pixels_to_base

    rng = np.random.default_rng(1)
    pts = np.stack([rng.uniform(*calib.workspace_x, 15), rng.uniform(*calib.workspace_y, 15),
                    np.full(15, calib.table_z + h)], axis=1)
    raw = project_points(pts, calib)
    uv = raw_to_view_pixels(raw, calib, view, pts[:, 2])  # the height matters only to a table view
    np.testing.assert_allclose(uv, base_to_view_pixels(pts, calib, view), atol=PX_TOL)
    back = view_pixels_to_base(uv, calib, view, pts[:, 2])
    np.testing.assert_allclose(back, pts, atol=1e-5)


@pytest.mark.parametrize("h", HEIGHTS)
def test_decode_returns_the_peak_at_its_height(calib, view, h):
    A = 12
    W, H = view.size
    pt = np.array([[0.52, 0.03, calib.table_z + h]])
    u, v = np.rint(base_to_view_pixels(pt, calib, view)[0]).astype(int)
    q = np.full((A, H, W), 0.1, np.float32)
    q[4, v, u] = 0.95
    width = np.full((H, W), 0.05, np.float32)
    height = np.full((H, W), h, np.float32)
    dec = decode_grasp(q, width, height, calib, view, DecodeOptions(0.5))
    assert dec.grasp is not None and dec.reason is None
    assert dec.grasp.position[2] == pytest.approx(max(calib.table_z + h, calib.table_z + MIN_TIP_CLEARANCE))
    np.testing.assert_allclose(base_to_view_pixels(np.array([dec.grasp.position]), calib, view)[0], (u, v), atol=PX_TOL)
    # The base-frame yaw projects back onto the bin's image-plane angle.
    _, ang, _ = base_grasp_to_view(np.array([dec.grasp.position]), dec.grasp.yaw, 0.03, calib, view)
    assert abs(normalize_angle(ang[0] - angle_bin_centers(A)[4])) < 1e-3
    # pixel is the raw projection of the position.
    np.testing.assert_allclose(dec.pixel, project_points(np.array([dec.grasp.position]), calib)[0], atol=1e-6)
    # Below the threshold: no grasp, with a reason.
    none = decode_grasp(q * 0.5, width, height, calib, view, DecodeOptions(0.5))
    assert none.grasp is None and none.reason


def test_table_view_pixels_are_base_xy_at_every_height(calib):
    """A table view's pixel is a base (x, y): the height never moves a grasp sideways, the
    workspace (plus margin) fills the view, and its axes follow the camera's image."""
    from perception.core.geometry import table_view, view_pixels_to_base

    view = table_view(calib, (96, 96), margin=0.03)
    uv = np.array([[10.0, 20.0], [47.5, 47.5], [90.0, 5.0]])
    low = view_pixels_to_base(uv, calib, view, calib.table_z)
    high = view_pixels_to_base(uv, calib, view, calib.table_z + 0.1)
    np.testing.assert_allclose(low[:, :2], high[:, :2], atol=1e-12)
    corners = np.array([[x, y, 0.0] for x in calib.workspace_x for y in calib.workspace_y])
    px = base_to_view_pixels(corners, calib, view)
    assert px.min() >= 0 and px.max() <= 95
    # Square pixels: 0.36 m (workspace + margins) over 96 px.
    d = base_to_view_pixels(np.array([[0.5, 0.0, 0], [0.5 + 0.0375, 0.0, 0]]), calib, view)
    assert np.linalg.norm(d[1] - d[0]) == pytest.approx(10.0)
    # The packaged camera looks along -x with +y to its right: u follows +y, v follows +x.
    ref = base_to_view_pixels(np.array([[0.5, 0.0, 0], [0.5, 0.1, 0], [0.6, 0.0, 0]]), calib, view)
    assert ref[1, 0] > ref[0, 0] and abs(ref[1, 1] - ref[0, 1]) < 1e-9
    assert ref[2, 1] > ref[0, 1] and abs(ref[2, 0] - ref[0, 0]) < 1e-9


def test_table_view_warp_puts_a_table_point_on_its_pixel(calib):
    """preprocess with a table view samples each view pixel where its plane point projects."""
    import cv2

    from perception.core.geometry import table_view
    from perception.core.preprocess import preprocess

    view = table_view(calib, (96, 96), plane_height=0.0)
    W, H = calib.image_size
    frame = np.zeros((H, W, 3), np.uint8)
    pt = np.array([[0.45, -0.05, calib.table_z]])
    u, v = np.rint(project_points(pt, calib)[0]).astype(int)
    cv2.circle(frame, (int(u), int(v)), 6, (255, 255, 255), -1)
    out = preprocess(frame, calib, view)[..., 0].astype(np.float64)
    vv, uu = np.mgrid[0 : out.shape[0], 0 : out.shape[1]]
    centroid = np.array([(uu * out).sum(), (vv * out).sum()]) / out.sum()
    np.testing.assert_allclose(centroid, base_to_view_pixels(pt, calib, view)[0], atol=0.5)
    # The cached remap maps are the plane points' projections (cv2.projectPoints).
    from perception.core.geometry import view_to_raw_pixels
    from perception.core.preprocess import view_maps

    m1, m2 = view_maps(calib, view)
    vv, uu = np.mgrid[0:96, 0:96]
    ref = view_to_raw_pixels(np.stack([uu.ravel(), vv.ravel()], axis=1), calib, view)
    np.testing.assert_allclose(np.stack([m1.ravel(), m2.ravel()], axis=1), ref, atol=1e-3)
