"""The calibrated camera's geometry handed to a geometry network beside the image
(perception.core.geometry.camera_channels), checked on a camera whose answers are known."""

from __future__ import annotations

import numpy as np

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.geometry import CAMERA_CHANNELS, camera_channels, network_view


def _straight_down(height: float = 0.8) -> Calibration:
    """The shipped calibration's camera moved straight above the workspace centre, looking down."""
    calib = Calibration.load(default_calibration_path())
    cx, cy = calib.workspace_center[:2]
    T = np.eye(4)
    T[:3, :3] = np.diag([1.0, -1.0, -1.0])  # camera z along -z of B
    T[:3, 3] = [cx, cy, calib.table_z + height]
    return calib.replace(T_base_camera=T)


def test_a_camera_straight_above_the_workspace_gives_its_known_maps():
    calib = _straight_down(0.8)
    view = network_view(calib, (80, 60))
    maps = camera_channels(calib, view)
    assert maps.shape == (len(CAMERA_CHANNELS), 60, 80) and maps.dtype == np.float32
    edge, rng, steep, pixel = maps
    # The pixel at the principal point looks straight down from 0.8 m onto the workspace centre.
    u, v = view.K[0, 2], view.K[1, 2]
    iv, iu = int(round(v)), int(round(u))
    assert abs(rng[iv, iu] - 0.8) < 0.01 and steep[iv, iu] > 0.999
    assert abs(pixel[iv, iu] - 800.0 / view.K[0, 0]) < 0.05  # mm of table a view pixel spans there
    half = min(np.ptp(calib.workspace_x), np.ptp(calib.workspace_y)) / 2
    assert edge[iv, iu] == min(1.0, half / 0.1)
    # Off centre the rays slant and reach farther; the view's corners lie outside the workspace.
    assert steep.min() < steep[iv, iu] and rng.max() > rng[iv, iu]
    assert edge[0, 0] < 0 and edge[-1, -1] < 0
    # Straight down, pixel (u, v) sees the table at (cx + (u - u0) h / f, cy - (v - v0) h / f).
    cx, cy = calib.workspace_center[:2]
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    for iu, iv in ((5, 7), (40, 30), (70, 50), (12, 44)):
        x = cx + (iu - u) * 0.8 / view.K[0, 0]
        y = cy - (iv - v) * 0.8 / view.K[1, 1]
        want = np.clip(min(x - x0, x1 - x, y - y0, y1 - y) / 0.1, -1, 1)
        assert abs(edge[iv, iu] - want) < 1e-4, (iu, iv)


def test_a_farther_camera_sees_more_table_per_pixel_and_a_tilted_one_slants():
    near, far = _straight_down(0.6), _straight_down(1.2)
    view = network_view(near, (80, 60))  # the same pixels: only the camera's distance differs
    a, b = camera_channels(near, view), camera_channels(far, view)
    assert np.all(b[1] > a[1]) and np.all(b[3] > a[3])
    np.testing.assert_allclose(b[3] / a[3], 2.0, rtol=1e-4)
    shipped = Calibration.load(default_calibration_path())  # an oblique camera
    s = camera_channels(shipped, network_view(shipped, (80, 60)))
    assert s[2].max() < 0.999 and np.isfinite(s).all()
