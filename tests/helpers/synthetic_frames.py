"""A stand-in renderer for the dataset tests: frames and labels without PyBullet, in seconds.

Imported by name (``pyproject.toml``: ``pythonpath``), so that a render worker started by
``spawn`` can unpickle it.
"""

from __future__ import annotations

import cv2
import numpy as np

from perception.core.calibration import Calibration, project_points
from perception.core.grasp import normalize_angle
from sim_render.format import (
    SEG_BACKGROUND,
    SEG_BIN,
    SEG_FIRST_OBJECT,
    SOURCE_HEURISTIC,
    SOURCE_RANDOM,
    FrameRecord,
    GraspLabels,
)


class SyntheticFrames:
    """A PyBullet-free stand-in renderer: cheap, valid, seeded frames for tests and smoke runs.

    ``make_frames`` for :func:`sim_render.render_job.render_shards` that follows the renderer
    rules (scene ``i`` draws everything from ``SeedSequence([seed, i])``; picklable). A
    scene is 1-5 coloured discs lying in the workspace, seen through the nominal camera
    with jittered focal length: ``rgb``, ``seg`` (bin outline, objects ``3 + i``) and
    ``depth`` (the table plane, discs 2 cm higher) agree with each other, and the grasp
    labels (heuristic ones on the discs, random ones elsewhere, random outcomes) are
    projected consistently, so training code can run end to end on a folder made in
    milliseconds. The pictures are not physics: use the real renderer for anything else.

    Args:
        seed: the dataset seed.
        calibration: the nominal calibration (object or dict).
        image_size: rendered ``(width, height)``.
        frames_per_scene: frames per scene.
    """

    def __init__(
        self,
        seed: int,
        calibration: Calibration | dict,
        image_size: tuple[int, int],
        frames_per_scene: int = 2,
    ) -> None:
        self.seed = int(seed)
        self.calibration = (
            calibration if isinstance(calibration, Calibration) else Calibration.from_dict(calibration)
        )
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.frames_per_scene = int(frames_per_scene)

    def __call__(self, scene: int) -> list[FrameRecord]:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(scene)]))
        nominal = self.calibration.scaled(self.image_size)
        (x0, x1), (y0, y1), z = nominal.workspace_x, nominal.workspace_y, nominal.table_z
        n_obj = int(rng.integers(1, 6))
        centers = np.column_stack(
            [
                rng.uniform(x0 + 0.04, x1 - 0.04, n_obj),
                rng.uniform(y0 + 0.04, y1 - 0.04, n_obj),
                np.full(n_obj, z + 0.02),
            ]
        )
        colors = rng.integers(40, 256, (n_obj, 3))
        # The scene's grasps: 1-3 on each disc, 2 random ones (no object, never succeed).
        per_obj = rng.integers(1, 4, n_obj)
        obj = np.concatenate([np.repeat(np.arange(n_obj), per_obj), [-1, -1]])
        pos = np.concatenate(
            [
                centers[obj[:-2]],
                np.column_stack([rng.uniform(x0, x1, 2), rng.uniform(y0, y1, 2), [z + 0.01] * 2]),
            ]
        )
        yaw = normalize_angle(rng.uniform(-np.pi, np.pi, len(obj)))
        width = rng.uniform(0.03, 0.08, len(obj))
        success = (obj >= 0) & (rng.random(len(obj)) < 0.5)
        source = np.where(obj >= 0, SOURCE_HEURISTIC, SOURCE_RANDOM)

        w, h = self.image_size
        frames = []
        for _ in range(self.frames_per_scene):
            focal = float(rng.uniform(0.97, 1.03))
            K = nominal.K.copy()
            K[0, 0] *= focal
            K[1, 1] *= focal
            camera = nominal.replace(K=K)
            # Depth of the table plane along each pixel's ray (camera z), then discs on top.
            uu, vv = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))
            uv = np.column_stack([uu.ravel(), vv.ravel()]).reshape(-1, 1, 2)
            xy = cv2.undistortPoints(uv, camera.K, camera.dist).reshape(-1, 2)
            rays = np.column_stack([xy, np.ones(len(xy))])  # camera frame, unit z
            R, c = camera.T_base_camera[:3, :3], camera.T_base_camera[:3, 3]
            ray_z = rays @ R[2]
            depth = np.where(ray_z < -1e-6, (z - c[2]) / np.minimum(ray_z, -1e-6), 0.0).reshape(h, w)
            table_rgb = rng.integers(60, 200, 3)
            rgb = np.clip(table_rgb + rng.normal(0, 4, (h, w, 3)), 0, 255).astype(np.uint8)
            seg = np.full((h, w), SEG_BACKGROUND, np.uint8)
            corners = project_points(nominal.workspace_corners(), camera).round().astype(np.int32)
            cv2.polylines(seg, [corners], True, SEG_BIN, max(1, w // 160))
            cam_centers = (centers - c) @ R  # base -> camera frame
            for k, uv in enumerate(project_points(centers, camera)):
                radius = max(1, int(round(K[0, 0] * 0.025 / cam_centers[k, 2])))
                mask = np.zeros((h, w), np.uint8)
                cv2.circle(mask, (int(round(uv[0])), int(round(uv[1]))), radius, 1, -1)
                on = mask.astype(bool)
                seg[on] = SEG_FIRST_OBJECT + k
                rgb[on] = colors[k]
                depth[on] = cam_centers[k, 2]
            pixel = project_points(pos, camera)
            half = 0.5 * width[:, None] * np.column_stack([np.cos(yaw), np.sin(yaw), np.zeros_like(yaw)])
            tips = project_points(np.concatenate([pos - half, pos + half]), camera)
            line = tips[len(pos) :] - tips[: len(pos)]
            frames.append(
                FrameRecord(
                    rgb=rgb,
                    depth=depth.astype(np.float32),
                    seg=seg,
                    camera=camera,
                    params={
                        "focal_scale": focal,
                        "table_rgb": table_rgb,
                        "centers": centers,
                        "colors": colors,
                    },
                    grasps=GraspLabels(
                        position=pos,
                        yaw=yaw,
                        width=width,
                        success=success,
                        pixel=pixel,
                        image_angle=normalize_angle(np.arctan2(line[:, 1], line[:, 0])),
                        image_width=np.linalg.norm(line, axis=1),
                        object=obj,
                        source=source,
                    ),
                    scene=int(scene),
                )
            )
        return frames
