"""One scene, end to end: objects dropped, grasps executed, frames rendered.

:class:`SceneRenderer` is the per-worker callable behind ``sim2real-render``: scene
``i`` draws all of its randomness from ``SeedSequence([seed, i])`` (split into
independent streams for objects, physics, grasps and visuals), so the data never
depends on how many workers or jobs made it, and a sample can be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from omegaconf import DictConfig, OmegaConf

from perception.core.calibration import Calibration, project_points
from perception.core.grasp import normalize_angle
from sim_render.cell import BIN_WALL_HEIGHT, BIN_WALL_THICKNESS, Cell
from sim_render.format import (
    SEG_BACKGROUND,
    SEG_BIN,
    SEG_DISTRACTOR,
    SEG_FIRST_OBJECT,
    FrameRecord,
    GraspLabels,
)
from sim_render.gripper import FloatingHand, GraspTiming
from sim_render.labels import (
    LabelledGrasp,
    heuristic_candidates,
    label_grasps,
    perturbed_candidates,
    random_candidates,
)
from sim_render.objects import object_urdfs
from sim_render.sensor import as_plain, draw_range

if TYPE_CHECKING:
    from sim_render.randomization import RenderedFrame

__all__ = ["SceneRenderer", "SceneWorld", "render_size", "scene_streams", "project_labels"]

#: Streams spawned from a scene's SeedSequence, in this order.
_STREAMS = ("objects", "physics", "grasps", "visuals")
# Third words of the SeedSequences that decide whether a scene is an empty bin, and its walls.
_EMPTY_SCENE_KEY = 0xE3
_BIN_WALLS_KEY = 0xB1


def render_size(calib: Calibration, scale: float) -> tuple[int, int]:
    """Raw frame size rendered for ``scale`` of the calibration's ``image_size``."""
    return max(8, round(calib.width * scale)), max(8, round(calib.height * scale))


def scene_streams(seed: int, scene: int) -> dict[str, np.random.Generator]:
    """Independent generators of one scene, from ``SeedSequence([seed, scene])``."""
    children = np.random.SeedSequence([int(seed), int(scene)]).spawn(len(_STREAMS))
    return {name: np.random.default_rng(ss) for name, ss in zip(_STREAMS, children)}


def project_labels(
    labels: list[LabelledGrasp], camera: Calibration
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw-pixel centre ``(G, 2)``, image-plane angle ``(G,)`` and width in px of grasps."""
    if not labels:
        return np.zeros((0, 2)), np.zeros(0), np.zeros(0)
    centers = np.array([lg.grasp.position for lg in labels])
    tips = np.concatenate([lg.grasp.fingertips() for lg in labels])  # (2G, 3)
    uv = project_points(np.concatenate([centers, tips]), camera)
    c, t = uv[: len(labels)], uv[len(labels) :].reshape(-1, 2, 2)
    line = t[:, 1] - t[:, 0]
    return c, normalize_angle(np.arctan2(line[:, 1], line[:, 0])), np.linalg.norm(line, axis=1)


@dataclass
class SceneWorld:
    """The set-up twin of a :class:`SceneRenderer`: its cell, hand and profile."""

    calib: Calibration  # the nominal camera and cell
    cfg: DictConfig  # the render profile
    cfg_plain: dict  # the same as plain containers (what the per-frame draws read)
    cell: Cell
    hand: FloatingHand
    urdfs: list[str]  # the object split's URDF files
    timing: GraspTiming


class SceneRenderer:
    """Picklable per-worker renderer; the PyBullet client is created lazily.

    Args:
        calib: the nominal (user's) calibration: the twin's camera and cell.
        cfg: the ``render`` profile config (``conf/render/*.yaml``).
        seed: the dataset seed.
    """

    def __init__(self, calib: Calibration | dict, cfg: DictConfig | dict, seed: int) -> None:
        self.calib_dict = calib.to_dict() if isinstance(calib, Calibration) else dict(calib)
        self.cfg_dict = (
            OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        )
        self.seed = int(seed)
        self._state: SceneWorld | None = None

    def __getstate__(self) -> dict:
        return {"calib_dict": self.calib_dict, "cfg_dict": self.cfg_dict, "seed": self.seed, "_state": None}

    # ---------------------------------------------------------------- set-up
    @property
    def cfg(self) -> DictConfig:
        return OmegaConf.create(self.cfg_dict)

    def world(self) -> SceneWorld:
        """The twin this renderer draws in (made on first use, kept across scenes)."""
        if self._state is None:
            calib = Calibration.from_dict(self.calib_dict)
            cfg = self.cfg
            from sim_render.camera import setup_renderer  # lazy: ~10 ms on the render check path
            from sim_render.randomization import validate_profile  # lazy: hydra via randomization

            validate_profile(cfg)
            cell = Cell(calib, cfg.physics.timestep, cfg.physics.solver_iterations)
            # EGL only sees bodies created after its plugin loads; every scene resets the world.
            setup_renderer(cell.client, cfg.renderer)
            g = cfg.grasps
            self._state = SceneWorld(
                calib=calib,
                cfg=cfg,
                cfg_plain=as_plain(cfg),
                cell=cell,
                hand=FloatingHand(cell),
                urdfs=object_urdfs(cfg.object_split),
                timing=GraspTiming(g.descend_steps, g.close_steps, g.lift_steps, g.hold_steps),
            )
        return self._state

    def render_frame(self, rng: np.random.Generator) -> RenderedFrame:
        """One randomized frame of the scene as it stands now (the profile's looks, camera and
        sensor drawn from ``rng``): what an evaluation shows its policy before each attempt."""
        from sim_render.randomization import render_randomized  # lazy: hydra via randomization

        w = self.world()
        return render_randomized(w.cell.client, w.cell.bodies, w.calib, rng, w.cfg_plain)

    def close(self) -> None:
        if self._state is not None:
            self._state.cell.close()
            self._state = None

    def reset_world(self, scene: int | None = None) -> dict:
        """A fresh world for every scene, so a scene never depends on the ones before.

        Returns:
            The bin's walls drawn for ``scene`` (``bin_walls`` of the profile; the cell's
            defaults without it): ``{"height": m, "thickness": m}``.
        """
        from sim_render.textures import texture_pool  # lazy: ~15 ms on the render check path

        st = self.world()
        walls = self.bin_walls(scene)
        st.cell.reset(walls["height"], walls["thickness"])
        texture_pool(st.cell.client).clear()  # texture ids died with the world
        st.hand = FloatingHand(st.cell)
        return walls

    def bin_walls(self, scene: int | None) -> dict:
        """The bin's wall height and thickness for ``scene``, metres.

        Drawn from a generator of its own (``SeedSequence([seed, scene, 0xB1])``), so a
        profile without ``bin_walls`` keeps every other stream.
        """
        cfg = self.world().cfg.get("bin_walls")
        if cfg is None or scene is None:
            return {"height": BIN_WALL_HEIGHT, "thickness": BIN_WALL_THICKNESS}
        rng = np.random.default_rng(np.random.SeedSequence([int(self.seed), int(scene), _BIN_WALLS_KEY]))
        return {"height": draw_range(rng, cfg["height"]), "thickness": draw_range(rng, cfg["thickness"])}

    # ---------------------------------------------------------------- physics
    def build_scene(self, scene: int) -> tuple[dict[str, np.random.Generator], dict]:
        """Drop the scene's objects and apply its physics; returns streams and params."""
        from sim_render.randomization import sample_physics  # lazy: hydra via randomization

        st = self.world()
        cfg, cell = st.cfg, st.cell
        rngs = scene_streams(self.seed, scene)
        lo, hi = cfg.objects_per_scene
        walls = self.reset_world(scene)
        ids: list[int] = []
        for _attempt in range(0 if self.is_empty(scene) else 5):
            n = int(rngs["objects"].integers(lo, hi + 1))
            picks = rngs["objects"].choice(len(st.urdfs), size=n, replace=False)
            ids = cell.drop_objects(
                [st.urdfs[k] for k in picks], rngs["objects"], cfg.physics.settle_steps
            )
            if ids:
                break
            cell.clear_objects()
        physics = sample_physics(rngs["physics"], cfg.physics, len(ids))
        cell.apply_physics(physics)
        st.hand.set_friction(physics["finger_friction"])
        cell.settle(cfg.physics.settle_steps // 4)
        params = {
            "objects": [str(u).split("random_urdfs/")[-1] for u in cell.bodies.object_urdfs],
            "physics": physics,
        }
        if self.world().cfg.get("bin_walls") is not None:
            params["bin_walls"] = walls
        return rngs, params

    def is_empty(self, scene: int) -> bool:
        """Whether ``scene`` is an empty bin (``empty_scene_prob`` of the profile).

        Drawn from a generator of its own, so profiles without empty scenes keep every
        other stream, and the scenes that are not empty are the same with or without it.
        """
        prob = float(self.world().cfg.get("empty_scene_prob", 0.0))
        if prob <= 0.0:
            return False
        rng = np.random.default_rng(np.random.SeedSequence([int(self.seed), int(scene), _EMPTY_SCENE_KEY]))
        return bool(rng.random() < prob)

    def label_scene(self, rngs: dict[str, np.random.Generator], physics: dict) -> list[LabelledGrasp]:
        st = self.world()
        cfg, cell = st.cfg, st.cell
        hmap = cell.height_map()
        cands = heuristic_candidates(cell, hmap, cfg.grasps.n_heuristic, rngs["grasps"])
        cands += random_candidates(cell, hmap, cfg.grasps.n_random, rngs["grasps"])
        # After the others, from the same stream: profiles without perturbed ones keep their labels.
        cands += perturbed_candidates(cell, hmap, cands, int(cfg.grasps.n_perturbed), rngs["grasps"])
        return label_grasps(cell, st.hand, cands, float(physics["gripper_force"]), st.timing)

    # ---------------------------------------------------------------- visuals
    def render_frames(
        self, scene: int, rngs: dict[str, np.random.Generator], params: dict, labels: list[LabelledGrasp]
    ) -> list[FrameRecord]:
        """Render ``frames_per_scene`` randomized frames of the settled scene, labels projected."""
        cfg = self.world().cfg
        grasp_arrays = {
            "position": np.array([lg.grasp.position for lg in labels], dtype=np.float32).reshape(-1, 3),
            "yaw": np.array([lg.grasp.yaw for lg in labels], dtype=np.float32),
            "width": np.array([lg.grasp.width for lg in labels], dtype=np.float32),
            "success": np.array([lg.success for lg in labels], dtype=bool),
            "object": np.array([lg.lifted_object for lg in labels], dtype=np.int16),
            "source": np.array([lg.source for lg in labels], dtype=np.uint8),
        }
        frames = []
        for _ in range(int(cfg.frames_per_scene)):
            frame = self.render_frame(rngs["visuals"])
            uv, angle, width_px = project_labels(labels, frame.camera)
            frames.append(
                FrameRecord(
                    rgb=frame.rgb,
                    depth=frame.depth,
                    seg=self.segmentation(frame.seg_raw, frame.distractor_ids),
                    camera=frame.camera,
                    params={**params, **frame.params},
                    grasps=GraspLabels(
                        pixel=uv.astype(np.float32),
                        image_angle=angle.astype(np.float32),
                        image_width=width_px.astype(np.float32),
                        **grasp_arrays,
                    ),
                    scene=scene,
                )
            )
        return frames

    def segmentation(self, seg_raw: np.ndarray, distractors: list[int]) -> np.ndarray:
        """Map PyBullet body ids to the dataset's labels (see docs/dataset.md)."""
        b = self.world().cell.bodies
        lut = {b.table: SEG_BACKGROUND}
        lut.update({w: SEG_BIN for w in b.bin_walls})
        lut.update({d: SEG_DISTRACTOR for d in distractors})
        lut.update({o: SEG_FIRST_OBJECT + i for i, o in enumerate(b.objects)})
        out = np.zeros(seg_raw.shape, dtype=np.uint8)
        for body, label in lut.items():
            out[seg_raw == body] = label
        return out

    def __call__(self, scene: int) -> list[FrameRecord]:
        rngs, params = self.build_scene(scene)
        labels = self.label_scene(rngs, params["physics"])
        return self.render_frames(scene, rngs, params, labels)
