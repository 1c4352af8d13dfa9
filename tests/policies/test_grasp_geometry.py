"""The grasp conversion the policy relies on: view pixel + height <-> base frame, and the
decode picking the peak of the maps (the same numbers the service uses)."""

from __future__ import annotations

import numpy as np
import pytest

from perception.decode import decode_grasp
from perception.frames import MIN_TIP_CLEARANCE
from perception.geometry import base_to_view_pixels, project_points, raw_to_view_pixels
from perception.grasp import angle_bin_centers, base_grasp_to_view, normalize_angle, view_grasp_to_base

HEIGHTS = [MIN_TIP_CLEARANCE, 0.02, 0.05, 0.09]
#: Pixel tolerance: the packaged calibration's rotation is rounded to 6 decimals, so R.T is its
#: inverse only to ~1e-6 and a round trip drifts by ~1e-4 px (4 micrometres at the table).
PX_TOL = 1e-3


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
    from perception.geometry import view_pixels_to_base

    rng = np.random.default_rng(1)
    pts = np.stack([rng.uniform(*calib.workspace_x, 15), rng.uniform(*calib.workspace_y, 15),
                    np.full(15, calib.table_z + h)], axis=1)
    raw = project_points(pts, calib)
    uv = raw_to_view_pixels(raw, calib, view)
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
    dec = decode_grasp(q, width, height, calib, view, 0.5)
    assert dec.grasp is not None and dec.reason is None
    assert dec.grasp.position[2] == pytest.approx(max(calib.table_z + h, calib.table_z + MIN_TIP_CLEARANCE))
    np.testing.assert_allclose(base_to_view_pixels(np.array([dec.grasp.position]), calib, view)[0], (u, v), atol=PX_TOL)
    # The base-frame yaw projects back onto the bin's image-plane angle.
    _, ang, _ = base_grasp_to_view(np.array([dec.grasp.position]), dec.grasp.yaw, 0.03, calib, view)
    assert abs(normalize_angle(ang[0] - angle_bin_centers(A)[4])) < 1e-3
    # pixel is the raw projection of the position.
    np.testing.assert_allclose(dec.pixel, project_points(np.array([dec.grasp.position]), calib)[0], atol=1e-6)
    # Below the threshold: no grasp, with a reason.
    none = decode_grasp(q * 0.5, width, height, calib, view, 0.5)
    assert none.grasp is None and none.reason
