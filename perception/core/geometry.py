"""Pixel <-> base-frame geometry through the calibrated camera (numpy + OpenCV).

Two pixel spaces exist:

- **raw** pixels: the camera's own, distorted frames at ``calib.image_size`` (or a
  scaled copy of the calibration for smaller frames). ``pixel`` in the HTTP API is raw.
- **view** pixels: the image the network sees, :class:`NetworkView`, of one of two kinds:

  - ``"camera"``: the undistorted, cropped and resized image, a virtual pinhole camera
    with the real camera's pose and the matrix ``K`` chosen so that the workspace fills
    it (:func:`network_view`);
  - ``"table"``: a top-down orthographic image of the workspace, the frame warped onto
    the horizontal plane ``plane_z`` (:func:`table_view`). A view pixel *is* a base-frame
    ``(x, y)``, whatever the height, so an error in the predicted fingertip height no
    longer moves a grasp sideways (through an oblique camera the ``"camera"`` kind turns
    1 cm of height error into ~0.8 cm in ``x, y``). Things above the plane appear shifted
    away from the camera in it, which the network learns.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from perception.core.calibration import Calibration, project_points
from perception.core.frames import transform_points

__all__ = [
    "NetworkView",
    "undistort_points",
    "network_view",
    "table_view",
    "make_view",
    "raw_pixels_to_rays",
    "rays_to_plane",
    "raw_pixel_to_base",
    "view_pixels_to_base",
    "base_to_view_pixels",
    "raw_to_view_pixels",
    "view_to_raw_pixels",
    "view_rays",
    "camera_channels",
    "CAMERA_CHANNELS",
    "top_down_max",
    "camera_heights_to_surface",
    "SurfaceRebuild",
]


#: Iterations of the point undistortion (the default 5 leaves ~0.1 px at the corners).
UNDISTORT_CRITERIA = (cv2.TERM_CRITERIA_COUNT | cv2.TERM_CRITERIA_EPS, 40, 1e-10)


def undistort_points(uv: np.ndarray, K: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """Normalised undistorted coordinates, iterated to convergence (OpenCV 4 and 5)."""
    if hasattr(cv2, "undistortPointsIter"):  # OpenCV 4.x
        return cv2.undistortPointsIter(uv, K, dist, None, None, UNDISTORT_CRITERIA)
    return cv2.undistortPoints(uv, K, dist, None, None, criteria=UNDISTORT_CRITERIA)


def raw_pixels_to_rays(uv: np.ndarray, calib: Calibration) -> np.ndarray:
    """Undistort raw pixels into unit-depth rays in the camera frame ``(N, 3)``."""
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 1, 2)
    xy = undistort_points(uv, calib.K, calib.dist).reshape(-1, 2)
    return np.concatenate([xy, np.ones((len(xy), 1))], axis=1)


def rays_to_plane(rays_cam: np.ndarray, calib: Calibration, z: np.ndarray | float) -> np.ndarray:
    """Intersect camera-frame rays with the horizontal plane ``z`` (in ``B``).

    Args:
        rays_cam: ``(N, 3)`` ray directions in ``C``.
        calib: gives the camera pose.
        z: plane height(s) in ``B``, scalar or ``(N,)``.

    Returns:
        ``(N, 3)`` base-frame points; NaN where a ray does not meet the plane ahead.
    """
    R = calib.T_base_camera[:3, :3]
    origin = calib.T_base_camera[:3, 3]
    d = np.asarray(rays_cam, dtype=np.float64).reshape(-1, 3) @ R.T
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), (len(d),))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (z - origin[2]) / d[:, 2]
    t = np.where(t > 0, t, np.nan)
    return origin + d * t[:, None]


def raw_pixel_to_base(uv: np.ndarray, calib: Calibration, z: np.ndarray | float) -> np.ndarray:
    """Back-project raw pixels onto the plane at height ``z`` in ``B`` ``(N, 3)``."""
    return rays_to_plane(raw_pixels_to_rays(uv, calib), calib, z)


@dataclass(frozen=True)
class NetworkView:
    """The image the network sees: a virtual camera over the workspace.

    Attributes:
        K: ``(3, 3)``. ``kind="camera"``: the pinhole matrix of a camera with the real
            camera's pose. ``kind="table"``: the affine map from base ``(x, y, 1)`` on the
            table to view ``(u, v, 1)`` (an orthographic camera looking down ``-z``).
        size: ``(width, height)`` in pixels.
        kind: ``"camera"`` or ``"table"`` (see the module docstring).
        plane_z: ``kind="table"``: height in ``B`` of the plane the frame is warped onto.
    """

    K: np.ndarray
    size: tuple[int, int]
    kind: str = "camera"
    plane_z: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("camera", "table"):
            raise ValueError(f"view kind must be 'camera' or 'table', got {self.kind!r}")

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]

    @property
    def is_table(self) -> bool:
        return self.kind == "table"

    def to_dict(self) -> dict:
        d = {"K": np.asarray(self.K).tolist(), "size": list(self.size), "kind": self.kind}
        if self.is_table:
            d["plane_z"] = float(self.plane_z)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> NetworkView:
        return cls(
            K=np.asarray(d["K"], dtype=np.float64),
            size=(int(d["size"][0]), int(d["size"][1])),
            kind=str(d.get("kind", "camera")),  # artifacts before the table view had no kind
            plane_z=float(d.get("plane_z", 0.0)),
        )


def network_view(
    calib: Calibration,
    size: tuple[int, int],
    margin: float = 0.03,
    max_height: float = 0.12,
) -> NetworkView:
    """The view that frames the workspace (plus ``margin`` metres) in ``size`` pixels.

    The box spans the workspace from the table up to ``max_height`` above it, so
    the tops of objects near the far edge stay in view. Pixels are square.
    """
    x0, x1 = calib.workspace_x
    y0, y1 = calib.workspace_y
    zs = (calib.table_z, calib.table_z + max_height)
    corners = np.array(
        [[x, y, z] for x in (x0 - margin, x1 + margin) for y in (y0 - margin, y1 + margin) for z in zs]
    )
    cam = transform_points(calib.T_camera_base, corners)
    xy = cam[:, :2] / cam[:, 2:3]
    lo, hi = xy.min(axis=0), xy.max(axis=0)
    w, h = int(size[0]), int(size[1])
    f = min(w / (hi[0] - lo[0]), h / (hi[1] - lo[1]))
    mid = (lo + hi) / 2
    K = np.array(
        [[f, 0.0, (w - 1) / 2 - f * mid[0]], [0.0, f, (h - 1) / 2 - f * mid[1]], [0.0, 0.0, 1.0]]
    )
    return NetworkView(K=K, size=(w, h))


def table_view(
    calib: Calibration,
    size: tuple[int, int],
    margin: float = 0.03,
    plane_height: float = 0.02,
) -> NetworkView:
    """The top-down view of the workspace (plus ``margin`` metres) in ``size`` pixels.

    The image axes are base axes, turned in 90 degree steps so that the view looks the way
    the camera sees the cell (``u`` is the base axis nearest the camera's image right):
    panels read naturally and a horizontal flip is a mirror across the camera's line of
    sight. Pixels are square; the workspace is centred.

    Args:
        plane_height: metres above ``table_z`` of the plane the frame is warped onto: about
            the height of the parts grasped, so that they appear where they stand.
    """
    R = calib.T_base_camera[:3, :3]
    right = R[:2, 0]
    if abs(right[0]) >= abs(right[1]):
        u_dir = np.array([np.sign(right[0]) or 1.0, 0.0])
    else:
        u_dir = np.array([0.0, np.sign(right[1]) or 1.0])
    v_dir = np.array([u_dir[1], -u_dir[0]])  # u x v = -z: a camera looking down, not a mirror
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    extent = np.array([x1 - x0, y1 - y0]) + 2 * margin
    centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2])
    w, h = int(size[0]), int(size[1])
    res = max(float(np.abs(u_dir) @ extent) / w, float(np.abs(v_dir) @ extent) / h)
    K = np.array(
        [
            [u_dir[0] / res, u_dir[1] / res, (w - 1) / 2 - u_dir @ centre / res],
            [v_dir[0] / res, v_dir[1] / res, (h - 1) / 2 - v_dir @ centre / res],
            [0.0, 0.0, 1.0],
        ]
    )
    return NetworkView(K=K, size=(w, h), kind="table", plane_z=float(calib.table_z + plane_height))


def make_view(calib: Calibration, size: tuple[int, int], kind: str, **kw: float) -> NetworkView:
    """:func:`table_view` or :func:`network_view` by ``kind``; ``kw``: ``margin`` (both kinds),
    ``plane_height`` (the table view's; a camera view has no plane and ignores it, so one
    view spec serves either kind)."""
    if kind == "table":
        return table_view(calib, size, **kw)
    if kind == "camera":
        return network_view(calib, size, **{k: v for k, v in kw.items() if k == "margin"})
    raise ValueError(f"view kind must be 'camera' or 'table', got {kind!r}")


def base_to_view_pixels(points_base: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Project base-frame points into view pixels ``(N, 2)`` (no distortion).

    ``kind="table"``: the point's ``(x, y)``; its height does not matter.
    """
    pts = np.asarray(points_base, dtype=np.float64).reshape(-1, 3)
    if view.is_table:
        return pts[:, :2] @ view.K[:2, :2].T + view.K[:2, 2]
    cam = transform_points(calib.T_camera_base, pts)
    uvw = cam @ view.K.T
    return uvw[:, :2] / uvw[:, 2:3]


def view_pixels_to_base(
    uv: np.ndarray, calib: Calibration, view: NetworkView, z: np.ndarray | float
) -> np.ndarray:
    """Back-project view pixels onto the plane(s) at height ``z`` in ``B`` ``(N, 3)``.

    ``kind="table"``: the pixel's ``(x, y)`` at height ``z``.
    """
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
    if view.is_table:
        xy = (uv - view.K[:2, 2]) @ np.linalg.inv(view.K[:2, :2]).T
        zz = np.broadcast_to(np.asarray(z, dtype=np.float64), (len(uv),))
        return np.concatenate([xy, zz[:, None]], axis=1)
    Kinv = np.linalg.inv(view.K)
    rays = np.concatenate([uv, np.ones((len(uv), 1))], axis=1) @ Kinv.T
    return rays_to_plane(rays, calib, z)


def raw_to_view_pixels(
    uv: np.ndarray, calib: Calibration, view: NetworkView, z: np.ndarray | float | None = None
) -> np.ndarray:
    """Map raw (distorted) pixels of ``calib``'s frames to view pixels ``(N, 2)``.

    ``kind="table"``: the raw pixel's ray meets the plane at height ``z`` (default the
    view's ``plane_z``: where the image content lands); ``kind="camera"`` ignores ``z``.
    """
    rays = raw_pixels_to_rays(uv, calib)
    if view.is_table:
        return base_to_view_pixels(rays_to_plane(rays, calib, view.plane_z if z is None else z), calib, view)
    uvw = rays @ view.K.T
    return uvw[:, :2] / uvw[:, 2:3]


def view_to_raw_pixels(uv: np.ndarray, calib: Calibration, view: NetworkView) -> np.ndarray:
    """Map view pixels to raw (distorted) pixels of ``calib``'s frames ``(N, 2)``
    (``kind="table"``: the view pixel's point on the plane ``plane_z``)."""
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
    if view.is_table:
        return project_points(view_pixels_to_base(uv, calib, view, view.plane_z), calib)
    rays = np.concatenate([uv, np.ones((len(uv), 1))], axis=1) @ np.linalg.inv(view.K).T
    out, _ = cv2.projectPoints(rays, np.zeros(3), np.zeros(3), calib.K, calib.dist)
    return out.reshape(-1, 2)


def view_rays(calib: Calibration, view: NetworkView) -> tuple[np.ndarray, np.ndarray]:
    """The rays of a camera view's pixels in ``B``: the camera centre ``(3,)`` and each pixel's
    direction ``(H*W, 3)`` (row-major; not normalised: a pixel's point at height ``z`` is
    ``origin + dirs * (z - origin_z) / dirs_z``)."""
    if view.is_table:
        raise ValueError("a table view has no rays (its pixels look straight down)")
    W, H = view.size
    vv, uu = np.mgrid[0:H, 0:W]
    uv1 = np.stack([uu.ravel(), vv.ravel(), np.ones(H * W)], axis=1).astype(np.float64)
    return calib.T_base_camera[:3, 3].copy(), (uv1 @ np.linalg.inv(view.K).T) @ calib.T_base_camera[:3, :3].T


#: The maps :func:`camera_channels` gives a geometry network beside the image, in this order.
CAMERA_CHANNELS = ("edge", "range", "steep", "pixel")
#: Metres of the ``edge`` map that span [-1, 1]: a wall's thickness and a finger's width are a few cm.
_EDGE_SCALE = 0.1


def camera_channels(calib: Calibration, view: NetworkView) -> np.ndarray:
    """The calibrated camera's geometry at every pixel of a camera view, as maps beside the image.

    Why: from the image alone a network cannot tell how far the camera is or how steeply it
    looks, so a wall or a stacked part of unknown height may read as the training set's mean
    height (the error measured in issue 36). The calibration knows both; these maps hand them
    over, the way camera-aware depth networks take their intrinsics (CAM-Convs, Facil et al. 2019).
    Each is a scalar of the world and the camera, so a horizontal mirror of the view mirrors
    the maps and nothing else. Measured, off by default (``geometry.network.camera_input``): the
    walls in the validation cells read a little nearer their height, the parts worse
    (docs/experiments/2026-12-07-geometry-given-the-cameras-geometry.md).

    Returns:
        ``(len(CAMERA_CHANNELS), H, W)`` float32, of the point where the pixel's ray meets the
        table (``table_z``): ``edge``, its signed distance to the workspace's nearest edge
        (positive inside; metres / 0.1, clipped to [-1, 1]); ``range``, its distance from the
        camera centre, metres; ``steep``, the ray's downward component (1: straight down);
        ``pixel``, the size of a view pixel there across the ray, mm. A ray that does not meet
        the table ahead (above the horizon) is treated as meeting it at 10 m.
    """
    origin, dirs = view_rays(calib, view)
    dirs = dirs / np.linalg.norm(dirs, axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (float(calib.table_z) - origin[2]) / dirs[:, 2]
    t = np.where(np.isfinite(t) & (t > 0), t, 10.0)
    p = origin + dirs * t[:, None]
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    edge = np.min(np.stack([p[:, 0] - x0, x1 - p[:, 0], p[:, 1] - y0, y1 - p[:, 1]]), axis=0)
    W, H = view.size
    maps = np.stack([
        np.clip(edge / _EDGE_SCALE, -1.0, 1.0),
        t,
        -dirs[:, 2],
        1000.0 * t / float(view.K[0, 0]),
    ])
    return maps.reshape(len(CAMERA_CHANNELS), H, W).astype(np.float32)


def top_down_max(
    ix: np.ndarray, iy: np.ndarray, z: np.ndarray, labels: np.ndarray, shape: tuple[int, int],
    fill_iterations: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Bin points into a top-down grid, keeping each cell's highest point.

    Args:
        ix, iy: ``(N,)`` integer cell indices (inside ``shape``); ``z`` their heights;
            ``labels`` their segmentation labels.
        shape: ``(ny, nx)``.
        fill_iterations: unseen cells next to seen ones take their highest neighbour's height
            this many times (closes the gaps between pixel footprints).

    Returns:
        ``height`` ``(ny, nx)`` (``-inf`` where nothing was seen) and ``top_label``
        ``(ny, nx)`` uint8, the label of each cell's highest point.
    """
    height = np.full(shape, -np.inf)
    np.maximum.at(height, (iy, ix), z)
    # The label of each cell's highest point: write in increasing height, the last write wins.
    order = np.argsort(z, kind="stable")
    top_label = np.zeros(shape, dtype=np.uint8)
    top_label[iy[order], ix[order]] = labels[order]
    # Fill sampling gaps (cells between the footprints of neighbouring pixels) with the
    # highest neighbour; larger unseen areas (behind objects) stay unknown.
    k3 = np.ones((3, 3), np.uint8)
    for _ in range(int(fill_iterations)):
        known = np.isfinite(height)
        grown = cv2.dilate(np.where(known, height, -1e9).astype(np.float32), k3)
        lab_grown = cv2.dilate(np.where(known, top_label, 0).astype(np.uint8), k3)
        fill = ~known & (grown > -1e8)
        height[fill] = grown[fill]
        top_label[fill] = lab_grown[fill]
    return height, top_label


class SurfaceRebuild:
    """The top-down surface from per-pixel heights in a camera view (the geometry network's output).

    Every camera-view pixel is lifted onto its ray (the view is a pinhole camera with the
    serving camera's pose) at its height, and the points are binned into ``top_view``
    keeping each cell's highest (:func:`top_down_max`): the rebuild the ``rule_observed``
    bracket makes from a depth frame, from predicted heights. The rays and the top view's
    cells are computed once per calibration; a call costs about 2 ms at 160x120.

    Inside the workspace shrunk by ``interior_margin`` (the bin's interior, where parts
    are), a cell whose highest point is not on a part is floor: its height is capped at
    ``floor_height``, so that noise of the predicted height on a textured floor makes no
    part. Outside it (the bin walls) the heights stand, as obstacles for the fingers.

    ``walls`` (``(height, thickness)``, metres: the bin's walls as measured, e.g. by
    ``sim2real-calibrate refine``) stands them where the contract does (section 3, the
    outer faces on the workspace edges, the walls inside it): every cell within
    ``thickness`` of an edge is a wall at least ``height`` high, whatever the network read
    there (it reads some walls near the floor, and a finger on a wall stops the descent),
    and the interior starts ``interior_margin`` inside the walls' inner faces.

    Args:
        calib: the serving calibration.
        camera_view: the geometry network's view (``kind="camera"``).
        top_view: the top-down view of the surface (``kind="table"``).
        interior_margin: metres.
        floor_height: metres above the table.
        fill_iterations: see :func:`top_down_max`.
        walls: ``(height, thickness)`` in metres, or ``None``: the walls only as the network reads them.
    """

    def __init__(self, calib: Calibration, camera_view: NetworkView, top_view: NetworkView, interior_margin: float,
                 floor_height: float, fill_iterations: int = 1,
                 walls: tuple[float, float] | None = None) -> None:
        if camera_view.is_table or not top_view.is_table:
            raise ValueError("the surface rebuild maps a camera view (kind 'camera') onto a top-down view (kind 'table')")
        self.calib, self.camera_view, self.top_view = calib, camera_view, top_view
        self.floor_height, self.fill_iterations = float(floor_height), int(fill_iterations)
        self._origin, self._dirs = view_rays(calib, camera_view)
        (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
        Wt, Ht = top_view.size
        ty, tx = np.mgrid[0:Ht, 0:Wt]
        cell_xy = view_pixels_to_base(np.stack([tx.ravel(), ty.ravel()], axis=1).astype(np.float64), calib, top_view, 0.0)

        def inside(m: float) -> np.ndarray:
            return ((cell_xy[:, 0] >= x0 + m) & (cell_xy[:, 0] <= x1 - m) & (cell_xy[:, 1] >= y0 + m)
                    & (cell_xy[:, 1] <= y1 - m)).reshape(Ht, Wt)

        self.wall_height, thickness = (0.0, 0.0) if walls is None else (float(walls[0]), float(walls[1]))
        if not (0.0 <= self.wall_height < 0.5 and 0.0 <= thickness < 0.5):
            raise ValueError(f"walls must be (height, thickness) in metres within [0, 0.5), got {walls!r}")
        # A cell is on a wall when its centre is: the walls' inner faces a thickness inside the edges.
        self.wall = inside(0.0) & ~inside(thickness) if thickness > 0 and self.wall_height > 0 else np.zeros((Ht, Wt), bool)
        self.interior = inside(float(interior_margin) + (thickness if self.wall.any() else 0.0))

    def __call__(self, height: np.ndarray, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """
        Args:
            height: ``(H, W)`` metres above ``calib.table_z`` seen at each camera-view pixel.
            part: ``(H, W)`` bool, whether the pixel sees a part.

        Returns:
            ``surface`` ``(H', W')`` float32 metres above ``table_z`` (0 where nothing was seen)
            and ``on_part`` ``(H', W')`` bool, in ``top_view``.
        """
        surface, on_part, _ = self.top_down(height, part)
        return surface, on_part

    def top_down(self, height: np.ndarray, part: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``surface`` and ``on_part`` as :meth:`__call__` returns them, and ``seen`` ``(H', W')``
        bool: the cells some camera-view pixel's point fell in (or filled between such cells).
        The others lie behind something along the camera's line of sight (a part's far side, the
        floor in its lee, the strip inside the near wall), or outside the view: their surface
        reads 0 (or the measured walls' height) without anything having been seen there."""
        W, H = self.camera_view.size
        h = np.asarray(height, dtype=np.float64)
        if h.shape != (H, W) or np.shape(part) != (H, W):
            raise ValueError(f"height {h.shape} and part {np.shape(part)} must be the camera view's ({H}, {W})")
        h = h.ravel()
        z = self.calib.table_z + h
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (z - self._origin[2]) / self._dirs[:, 2]
        ok = np.isfinite(t) & (t > 0)
        pts = self._origin + self._dirs[ok] * t[ok, None]
        tv = np.rint(base_to_view_pixels(pts, self.calib, self.top_view)).astype(np.int64)
        Wt, Ht = self.top_view.size
        inside = (tv[:, 0] >= 0) & (tv[:, 0] < Wt) & (tv[:, 1] >= 0) & (tv[:, 1] < Ht)
        labels = np.asarray(part, dtype=bool).ravel()[ok].astype(np.uint8)
        top, top_part = top_down_max(tv[inside, 0], tv[inside, 1], h[ok][inside], labels[inside], (Ht, Wt),
                                     self.fill_iterations)
        known = np.isfinite(top)
        surface = np.where(known, top, 0.0)
        on_part = known & (top_part > 0)
        surface = np.where(self.interior & ~on_part, np.minimum(surface, self.floor_height), surface)
        surface = np.where(self.wall, np.maximum(surface, self.wall_height), surface)
        on_part = on_part & ~self.wall
        return surface.astype(np.float32), on_part, known


def camera_heights_to_surface(
    height: np.ndarray,
    part: np.ndarray,
    calib: Calibration,
    camera_view: NetworkView,
    top_view: NetworkView,
    interior_margin: float,
    floor_height: float,
    fill_iterations: int = 1,
    walls: tuple[float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One :class:`SurfaceRebuild` call (see it for the arguments and the result)."""
    return SurfaceRebuild(calib, camera_view, top_view, interior_margin, floor_height, fill_iterations,
                          walls)(height, part)
