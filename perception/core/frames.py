"""Frame, unit and image conventions, stated once for the whole project.

- Units: metres, radians, seconds.
- Base frame ``B``: right-handed, origin at the robot base, ``z`` up, ``x`` forward
  towards the table, ``y`` to the left.
- Camera frame ``C``: OpenCV optical convention, ``x`` right, ``y`` down, ``z`` along
  the view.
- Pixels ``(u, v)``: ``u`` column, ``v`` row, pixel centres at integer coordinates,
  origin at the top-left pixel (OpenCV convention).
- Transforms ``T_a_b`` are 4x4 homogeneous matrices mapping a point from frame ``b``
  to frame ``a``: ``p_a = T_a_b @ p_b``.
- Images in memory are ``uint8`` arrays of shape ``(H, W, 3)`` in **RGB** order.
  OpenCV decodes to BGR; :func:`perception.core.imageio.decode_image` converts once.
- Quaternions (PyBullet) are ``(x, y, z, w)``.
- Grasp yaw: angle from ``B``'s ``+x`` axis to the line joining the fingertips,
  counter-clockwise seen from above, normalised into ``(-pi/2, pi/2]``.
- Image-plane grasp angle: angle from the ``+u`` axis to the line joining the
  projected fingertips, measured towards ``+v``, normalised into ``(-pi/2, pi/2]``.
"""

from __future__ import annotations

import numpy as np

#: Maximum opening of the parallel-jaw gripper (Franka Hand), metres.
GRIPPER_MAX_WIDTH = 0.08
#: Finger length of the gripper, metres.
GRIPPER_FINGER_LENGTH = 0.05
#: Half the thickness of one finger along the closing direction, metres.
GRIPPER_FINGER_HALF_THICKNESS = 0.009
#: Half the depth of one finger across the closing direction, metres.
GRIPPER_FINGER_HALF_DEPTH = 0.011
#: Minimum fingertip height above the table, metres (contract section 3).
MIN_TIP_CLEARANCE = 0.005
#: Maximum fingertip height above the table a grasp may ask for, metres: the parts are a
#: few centimetres tall and the bin walls at most 0.06 m, so a higher grasp is a fault.
MAX_TIP_HEIGHT = 0.15
#: Height of the lift after closing, metres.
LIFT_HEIGHT = 0.2
#: Hold time after lifting, seconds.
HOLD_TIME = 1.0
#: An object is lifted when its centre of mass is this far above the table, metres.
SUCCESS_HEIGHT = 0.1


def transform_points(T: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Apply a 4x4 transform to points.

    Args:
        T: ``(4, 4)`` homogeneous transform.
        points: ``(N, 3)`` points.

    Returns:
        ``(N, 3)`` transformed points.
    """
    points = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    return points @ T[:3, :3].T + T[:3, 3]


def rotation_angle(Ra: np.ndarray, Rb: np.ndarray) -> float:
    """Angle of the rotation between two rotation matrices, radians."""
    c = (np.trace(np.asarray(Ra).T @ np.asarray(Rb)) - 1.0) / 2.0
    return float(np.arccos(min(1.0, max(-1.0, c))))


def invert_transform(T: np.ndarray) -> np.ndarray:
    """Inverse of a rigid 4x4 transform."""
    R = T[:3, :3]
    t = T[:3, 3]
    out = np.eye(4)
    out[:3, :3] = R.T
    out[:3, 3] = -R.T @ t
    return out
