"""Domain randomization of the twin: visuals, lighting, camera, distractors, physics.

Every function draws from the scene's ``numpy.random.Generator`` in a fixed order
and returns the JSON-serialisable parameters it drew, so a sample can be stored
beside the frame and replayed (:func:`apply_visual_params`, :func:`jitter_camera`,
:func:`sim_render.sensor.apply_sensor_params`). Ranges are ``[lo, hi]`` (uniform,
:func:`sim_render.sensor.draw_range`); a profile whose ranges are degenerate
(``conf/render/canonical.yaml``) renders the same plain frame for every seed.

Randomizations (sections of ``conf/render/*.yaml``, units there):

- ``colors.<surface>``: ``palette`` (RGB in ``[0, 1]``, picked uniformly, then
  ``palette_jitter`` per channel) or, with an empty palette, HSV ranges ``hue``,
  ``saturation``, ``value``; ``specular`` grey level. Surfaces: ``table``, ``bin``,
  ``objects`` (one draw per object), ``distractors``.
- ``textures.<surface>``: ``prob`` of a texture, ``kinds`` to pick from
  (:data:`sim_render.textures.TEXTURES`); ``size`` px and ``variants_per_kind``
  distinct images per kind (the per-client pool holds kinds x variants).
- ``surface_textures`` (optional): image-space textures with natural-image statistics on
  the table, the bin's walls and floor and the objects (:mod:`sim_render.surfaces`).
- ``bin_walls`` (optional, :meth:`sim_render.scene.SceneRenderer.bin_walls`): wall height
  and thickness per scene, metres.
- ``empty_scene_prob`` (optional, :meth:`sim_render.scene.SceneRenderer.is_empty`): the
  share of scenes that are an empty bin.
- ``lighting``: direction (``azimuth``, ``elevation``), ``color`` per channel,
  ``distance``, ``ambient``/``diffuse``/``specular`` coefficients, ``shadow_prob``;
  ``cast_shadow`` (optional): shadows traced towards that light and darkened to a share of
  the light left in them (:mod:`sim_render.shadows`).
- ``camera``: pose, focal length, principal point and ``k1``/``k2`` jitter.
- ``distractors``: visual-only shapes on the table outside the workspace.
- ``physics``: friction, mass, restitution, gripper force (sampled here, applied
  by the cell).
"""

from __future__ import annotations

import colorsys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import cv2
import numpy as np
import pybullet as p

from conf.schema import BinWalls, CastShadow, SurfaceTextures, section_problems
from perception.core.calibration import Calibration, project_points
from sim_render.camera import RENDERERS, render_camera
from sim_render.sensor import SENSOR_KEYS, apply_sensor, as_plain, draw_range
from sim_render.shadows import apply_cast_shadow, cast_shadow_mask, sample_cast_shadow, validate_cast_shadow
from sim_render.surfaces import (
    NEUTRAL_ALBEDO,
    apply_surface_textures,
    masks_for,
    sample_surface_textures,
    validate_surface_textures,
)
from sim_render.textures import MAX_TEXTURES_PER_CLIENT, TEXTURES, texture_pool

__all__ = [
    "SceneBodies",
    "validate_profile",
    "sample_visuals",
    "apply_visual_params",
    "apply_visuals",
    "sample_lighting",
    "sample_camera",
    "jitter_camera",
    "add_distractors",
    "remove_bodies",
    "sample_physics",
    "RenderedFrame",
    "render_randomized",
]

_SURFACES = ("table", "bin", "objects", "distractors")
_LIGHTING_RANGES = ("azimuth", "elevation", "distance", "ambient", "diffuse", "specular")
_COLOR_RANGES = ("hue", "saturation", "value", "specular")
_CAMERA_JITTERS = (
    "position_jitter",
    "rotation_jitter",
    "focal_jitter",
    "principal_jitter",
    "distortion_jitter",
)
_DISTRACTOR_SHAPES = ("box", "sphere", "cylinder")
# Physical parameters drawn per object and per scene (``physics:`` ranges).
_PER_OBJECT = ("lateral_friction", "spinning_friction", "mass", "restitution")
_PER_SCENE = ("table_friction", "gripper_force", "finger_friction")
# Rejection sampling of one distractor's position gives up after this many tries.
_DISTRACTOR_TRIES = 60
# Distractors must project this far (fraction of the image size) inside the frame.
_DISTRACTOR_IMAGE_INSET = 0.02


class SceneBodies(Protocol):
    """The PyBullet bodies of one scene (single-link bodies; ids are unique ids)."""

    table: int
    bin_walls: list[int]
    objects: list[int]


# -------------------------------------------------------------------- helpers
def _pair(value: Any, name: str) -> tuple[float, float]:
    """``[lo, hi]`` from a config value (a scalar is the degenerate range)."""
    if isinstance(value, int | float):
        return float(value), float(value)
    lo, hi = (float(v) for v in value)
    if lo > hi:
        raise ValueError(f"config range '{name}' must have lo <= hi, got [{lo}, {hi}]")
    return lo, hi


def _section(cfg: Mapping, name: str) -> Mapping:
    """A profile's section ``name``, given the profile or the section itself."""
    cfg = as_plain(cfg)
    return cfg[name] if name in cfg else cfg


def _draw_int(rng: np.random.Generator, value: Any, name: str) -> int:
    """An integer from an inclusive ``[lo, hi]`` range."""
    lo, hi = _pair(value, name)
    return int(rng.integers(int(lo), int(hi) + 1))


def _links(client: Any, body: int) -> list[int]:
    """All link indices of a body whose visuals we set (``-1`` is the base)."""
    return [-1, *range(client.getNumJoints(body))]


# ---------------------------------------------------------------- validation
class _Problems(list):
    """The problems found in a profile, with the checks the sections share."""

    def range(self, section: Mapping, key: str, where: str, lo_min: float | None = None) -> None:
        """``section[key]`` is a range ``[lo, hi]`` (lo <= hi), lo at least ``lo_min``."""
        if key not in section:
            self.append(f"{where}.{key} is missing")
            return
        try:
            lo, _ = _pair(section[key], f"{where}.{key}")
        except (TypeError, ValueError) as exc:
            self.append(f"{where}.{key}: {exc}")
            return
        if lo_min is not None and lo < lo_min:
            self.append(f"{where}.{key} must be >= {lo_min}, got {section[key]}")

    def prob(self, section: Mapping, key: str, where: str) -> None:
        """``section[key]`` is a probability."""
        if key not in section or not 0.0 <= float(section[key]) <= 1.0:
            self.append(f"{where}.{key} must be a probability in [0, 1]")


def validate_profile(cfg: Mapping) -> None:
    """Check a render profile's randomization sections once, before rendering.

    Args:
        cfg: a profile (``conf/render/*.yaml``).

    Raises:
        ValueError: listing every missing key, bad range, unknown name, and a
            texture pool larger than :data:`sim_render.textures.MAX_TEXTURES_PER_CLIENT`.
    """
    cfg = as_plain(cfg)
    sections = ("camera", "lighting", "textures", "colors", "sensor", "distractors", "physics")
    missing = [s for s in (*sections, "render_margin", "renderer", "resolution_scale") if s not in cfg]
    if missing:
        raise ValueError(f"render profile '{cfg.get('name')}' lacks {missing}")
    problems = _Problems()
    if cfg["renderer"] not in RENDERERS:
        problems.append(f"renderer '{cfg['renderer']}' is unknown; known: {list(RENDERERS)}")
    for key in _CAMERA_JITTERS:
        if float(cfg["camera"].get(key, -1)) < 0:
            problems.append(f"camera.{key} must be a number >= 0")
    _check_lighting(cfg["lighting"], problems)
    _check_textures(cfg["textures"], problems)
    _check_colors(cfg["colors"], problems)
    sensor = cfg["sensor"]
    for key in SENSOR_KEYS:
        if key.endswith("_prob"):
            problems.prob(sensor, key, "sensor")
        else:
            problems.range(sensor, key, "sensor", None if key == "contrast" else 0.0)
    _check_distractors(cfg["distractors"], problems)
    for key in (*_PER_OBJECT, *_PER_SCENE):
        problems.range(cfg["physics"], key, "physics", 0.0)
    # A switchable section's values are checked once its keys and types are right (one
    # message each, and no value check meets a word where it reads a number).
    textures = cfg.get("surface_textures")
    if textures is not None:
        problems += section_problems(SurfaceTextures, textures, "surface_textures") or validate_surface_textures(textures)
    walls = cfg.get("bin_walls")
    wall_problems = [] if walls is None else section_problems(BinWalls, walls, "bin_walls")
    problems += wall_problems
    if walls is not None and not wall_problems:
        problems.range(walls, "height", "bin_walls", 1e-3)
        problems.range(walls, "thickness", "bin_walls", 1e-3)
        if "height" in walls and float(walls["height"][1]) > 0.06:
            problems.append("bin_walls.height must stay within the contract's 0.06 m")
    if not 0.0 <= float(cfg.get("empty_scene_prob", 0.0)) <= 1.0:
        problems.append("empty_scene_prob must be a probability in [0, 1]")
    if problems:
        raise ValueError(f"render profile '{cfg.get('name')}' is invalid:\n  " + "\n  ".join(problems))


def _check_lighting(light: Mapping, problems: _Problems) -> None:
    for key in _LIGHTING_RANGES:
        problems.range(light, key, "lighting")
    if len(light.get("color", [])) != 3:
        problems.append("lighting.color must hold three ranges (R, G, B)")
    else:
        for i, channel in enumerate("rgb"):
            problems.range({channel: light["color"][i]}, channel, "lighting.color", 0.0)
    problems.prob(light, "shadow_prob", "lighting")
    if light.get("cast_shadow") is not None:
        problems += (section_problems(CastShadow, light["cast_shadow"], "lighting.cast_shadow")
                     or validate_cast_shadow(light["cast_shadow"]))


def _check_textures(tex: Mapping, problems: _Problems) -> None:
    kinds: set[str] = set()
    for surface in _SURFACES:
        s = tex.get(surface, {})
        problems.prob(s, "prob", f"textures.{surface}")
        problems.prob(s, "tint", f"textures.{surface}")
        unknown = sorted(set(map(str, s.get("kinds", []))) - set(TEXTURES))
        if unknown:
            problems.append(f"textures.{surface}.kinds has unknown {unknown}; known: {sorted(TEXTURES)}")
        kinds |= set(map(str, s.get("kinds", [])))
    pool = len(kinds) * int(tex.get("variants_per_kind", 0))
    if pool > MAX_TEXTURES_PER_CLIENT or int(tex.get("variants_per_kind", 0)) < 1 or int(tex.get("size", 0)) < 1:
        problems.append(
            f"textures: size >= 1 px and 1 <= kinds x variants_per_kind <= {MAX_TEXTURES_PER_CLIENT} "
            f"(got {len(kinds)} kinds x {tex.get('variants_per_kind')})"
        )


def _check_colors(colors: Mapping, problems: _Problems) -> None:
    for surface in _SURFACES:
        c = colors.get(surface)
        if c is None:
            problems.append(f"colors.{surface} is missing")
            continue
        for key in _COLOR_RANGES:
            problems.range(c, key, f"colors.{surface}", 0.0)
        palette = c.get("palette")
        if not isinstance(palette, list) or any(
            not isinstance(rgb, list) or len(rgb) != 3 or not all(0.0 <= float(v) <= 1.0 for v in rgb)
            for rgb in palette
        ):
            problems.append(f"colors.{surface}.palette must be a list of [r, g, b] in [0, 1]")
        if float(c.get("palette_jitter", -1)) < 0:
            problems.append(f"colors.{surface}.palette_jitter must be >= 0")


def _check_distractors(d: Mapping, problems: _Problems) -> None:
    problems.range(d, "count", "distractors", 0.0)
    problems.range(d, "size", "distractors", 1e-4)
    for key in ("clearance", "band", "occlusion_height"):
        if float(d.get(key, -1)) < 0:
            problems.append(f"distractors.{key} must be a number >= 0")
    unknown_shapes = sorted(set(map(str, d.get("shapes", []))) - set(_DISTRACTOR_SHAPES))
    if unknown_shapes:
        problems.append(f"distractors.shapes has unknown {unknown_shapes}; known: {list(_DISTRACTOR_SHAPES)}")


# ------------------------------------------------------------------- visuals
def _draw_surface(rng: np.random.Generator, colors: Mapping, textures: Mapping, tex_cfg: Mapping) -> dict:
    """One surface's colour, specular level and texture.

    Args:
        rng: the frame's generator.
        colors: ``colors.<surface>``; textures: ``textures.<surface>``;
        tex_cfg: the whole ``textures`` section (``size``, ``variants_per_kind``).

    Returns:
        ``{"rgba": [r, g, b, 1], "specular": s, "texture": None | {kind, variant, size}}``.
    """
    palette = [list(map(float, c)) for c in colors["palette"]]
    if palette:
        base = np.asarray(palette[int(rng.integers(len(palette)))])
        jitter = float(colors["palette_jitter"])
        rgb = np.clip(base + rng.uniform(-jitter, jitter, 3), 0.0, 1.0)
    else:
        hsv = [draw_range(rng, colors[k]) for k in ("hue", "saturation", "value")]
        rgb = np.asarray(colorsys.hsv_to_rgb(hsv[0] % 1.0, *hsv[1:]))
    specular = draw_range(rng, colors["specular"])
    texture = None
    kinds = list(textures["kinds"])
    if rng.random() < float(textures["prob"]) and kinds:
        kind = str(kinds[int(rng.integers(len(kinds)))])
        if kind not in TEXTURES:
            raise KeyError(f"unknown texture kind '{kind}' in config; known: {sorted(TEXTURES)}")
        texture = {
            "kind": kind,
            "variant": int(rng.integers(int(tex_cfg["variants_per_kind"]))),
            "size": int(tex_cfg["size"]),
        }
        # PyBullet multiplies the texture by rgbaColor: a full tint would darken it.
        tint = float(textures["tint"])
        rgb = (1.0 - tint) + tint * rgb
    return {"rgba": [*map(float, rgb), 1.0], "specular": float(specular), "texture": texture}


def sample_visuals(rng: np.random.Generator, cfg: Mapping, n_objects: int) -> dict:
    """Draw the colours and textures of a scene (no PyBullet needed).

    Args:
        rng: the frame's generator.
        cfg: the profile (``colors`` and ``textures`` sections).
        n_objects: number of objects.

    Returns:
        ``{"table": surface, "bin": surface, "objects": [surface, ...]}``, each as
        drawn by ``_draw_surface``.
    """
    cfg = as_plain(cfg)
    colors, textures = cfg["colors"], cfg["textures"]
    draw = lambda s: _draw_surface(rng, colors[s], textures[s], textures)
    return {
        "table": draw("table"),
        "bin": draw("bin"),
        "objects": [draw("objects") for _ in range(n_objects)],
    }


def _apply_surface(client: Any, body: int, surface: dict) -> None:
    """Set one body's colour, specular and texture (``-1`` removes a texture)."""
    tex = surface["texture"]
    tex_id = -1 if tex is None else texture_pool(client).get(tex["kind"], tex["variant"], tex["size"])
    spec = [surface["specular"]] * 3
    for link in _links(client, body):
        client.changeVisualShape(
            body, link, rgbaColor=surface["rgba"], specularColor=spec, textureUniqueId=tex_id
        )


def apply_visual_params(client: Any, bodies: SceneBodies, params: dict) -> None:
    """Apply drawn visual parameters (a replay of :func:`apply_visuals`).

    Raises:
        ValueError: when ``params`` has a different number of objects than ``bodies``.
    """
    if len(params["objects"]) != len(bodies.objects):
        raise ValueError(
            f"visual params describe {len(params['objects'])} objects, the scene has {len(bodies.objects)}"
        )
    _apply_surface(client, bodies.table, params["table"])
    for wall in bodies.bin_walls:
        _apply_surface(client, wall, params["bin"])
    for obj, surface in zip(bodies.objects, params["objects"]):
        _apply_surface(client, obj, surface)


def apply_visuals(client: Any, bodies: SceneBodies, rng: np.random.Generator, cfg: Mapping) -> dict:
    """Randomize colours, specular and textures of the table, bin and objects.

    The bin's walls share one draw; each object gets its own. Textures come from
    the client's pool (loaded once per ``(kind, variant, size)``).

    Args:
        client: the ``BulletClient``.
        bodies: ``table``, ``bin_walls``, ``objects`` body ids.
        rng: the frame's generator.
        cfg: the profile (``colors``, ``textures``).

    Returns:
        The JSON-serialisable parameters drawn (see :func:`sample_visuals`).
    """
    params = sample_visuals(rng, cfg, len(bodies.objects))
    apply_visual_params(client, bodies, params)
    return params


def _neutral_where_textured(visuals: dict, drawn: dict) -> None:
    """Render surfaces that get an image-space texture in neutral grey, untextured.

    :func:`sim_render.surfaces.apply_surface_textures` then measures their shading
    from the grey and multiplies the texture in.
    """
    grey = [NEUTRAL_ALBEDO] * 3 + [1.0]
    if drawn.get("floor") is not None and drawn["table"] is None:
        # The floor is cut out of the table, so the whole table renders grey; the rest
        # of it gets its drawn colour back in image space (its PyBullet texture is dropped).
        drawn["table_flat"] = [float(v) for v in visuals["table"]["rgba"][:3]]
        visuals["table"]["rgba"] = list(grey)
        visuals["table"]["texture"] = None
    pairs = [(visuals["table"], drawn["table"]), (visuals["bin"], drawn["bin"])]
    pairs += list(zip(visuals["objects"], drawn["objects"]))
    for surface, texture in pairs:
        if texture is not None:
            surface["rgba"] = list(grey)
            surface["texture"] = None


# ------------------------------------------------------------------ lighting
def sample_lighting(rng: np.random.Generator, cfg: Mapping) -> dict:
    """Draw the light, as ``getCameraImage`` keywords.

    Args:
        rng: the frame's generator.
        cfg: the profile, or its ``lighting`` section.

    Returns:
        ``lightDirection`` (unit vector towards the light, base frame),
        ``lightColor`` (RGB), ``lightDistance`` (m), ``lightAmbientCoeff``,
        ``lightDiffuseCoeff``, ``lightSpecularCoeff`` and ``shadow`` (0 or 1).
    """
    cfg = _section(cfg, "lighting")
    az = draw_range(rng, cfg["azimuth"])
    el = draw_range(rng, cfg["elevation"])
    color = [draw_range(rng, c) for c in cfg["color"]]
    if len(color) != 3:
        raise ValueError(f"lighting.color must hold three ranges (R, G, B), got {len(color)}")
    return {
        "lightDirection": [float(np.cos(el) * np.cos(az)), float(np.cos(el) * np.sin(az)), float(np.sin(el))],
        "lightColor": color,
        "lightDistance": draw_range(rng, cfg["distance"]),
        "lightAmbientCoeff": draw_range(rng, cfg["ambient"]),
        "lightDiffuseCoeff": draw_range(rng, cfg["diffuse"]),
        "lightSpecularCoeff": draw_range(rng, cfg["specular"]),
        "shadow": int(rng.random() < float(cfg["shadow_prob"])),
    }


# -------------------------------------------------------------------- camera
def sample_camera(
    nominal: Calibration, rng: np.random.Generator, cfg_camera: Mapping
) -> tuple[Calibration, dict]:
    """Jitter the nominal camera (a calibration error the policy must tolerate).

    Args:
        nominal: the calibration the cell was built from.
        rng: the frame's generator.
        cfg_camera: the profile or its ``camera`` section: ``position_jitter`` (m per axis), ``rotation_jitter`` (rad per
            axis of the camera frame), ``focal_jitter`` (fraction of fx and fy, one
            factor for both), ``principal_jitter`` (px at ``nominal.image_size``),
            ``distortion_jitter`` (absolute on k1 and k2); all uniform ``+-``.

    Returns:
        The jittered calibration and its parameters (replay with :func:`jitter_camera`).
    """
    cfg_camera = _section(cfg_camera, "camera")

    def sym(key: str, n: int) -> list[float]:
        # Always draw, so the stream does not depend on which jitters are zero.
        a = float(cfg_camera[key])
        if a < 0:
            raise ValueError(f"camera.{key} must be >= 0, got {a}")
        return [a * float(u) for u in rng.uniform(-1.0, 1.0, n)]

    params = {
        "position": sym("position_jitter", 3),
        "rotation": sym("rotation_jitter", 3),
        "focal_scale": 1.0 + sym("focal_jitter", 1)[0],
        "principal": sym("principal_jitter", 2),
        "distortion_k1k2": sym("distortion_jitter", 2),
    }
    return jitter_camera(nominal, params), params


def jitter_camera(nominal: Calibration, params: dict) -> Calibration:
    """Apply camera jitter parameters (see :func:`sample_camera`) to ``nominal``."""
    T = nominal.T_base_camera.copy()
    R_delta, _ = cv2.Rodrigues(np.asarray(params["rotation"], dtype=np.float64))
    T[:3, :3] = T[:3, :3] @ R_delta  # rotation about the camera's own axes
    T[:3, 3] += np.asarray(params["position"], dtype=np.float64)
    K = nominal.K.copy()
    K[0, 0] *= params["focal_scale"]
    K[1, 1] *= params["focal_scale"]
    K[0, 2] += params["principal"][0]
    K[1, 2] += params["principal"][1]
    dist = nominal.dist.copy()
    dist[:2] += np.asarray(params["distortion_k1k2"], dtype=np.float64)
    return nominal.replace(T_base_camera=T, K=K, dist=dist)


# --------------------------------------------------------------- distractors
def _workspace_hull(calib: Calibration, clearance: float, height: float) -> np.ndarray:
    """Image-plane convex hull ``(N, 2)`` float32 of the protected workspace volume."""
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    z0 = calib.table_z
    corners = np.array(
        [
            [x, y, z]
            for x in (x0 - clearance, x1 + clearance)
            for y in (y0 - clearance, y1 + clearance)
            for z in (z0, z0 + height)
        ]
    )
    uv = project_points(corners, calib).astype(np.float32)
    return cv2.convexHull(uv).reshape(-1, 2)


def _shape_extents(shape: str, dims: list[float]) -> np.ndarray:
    """Half extents ``(3,)`` of a distractor's bounding box from its dimensions."""
    if shape == "box":
        return np.asarray(dims, dtype=np.float64)
    if shape == "sphere":
        return np.full(3, dims[0])
    return np.array([dims[0], dims[0], dims[1]])  # cylinder: radius, half length


def _place_distractor(
    rng: np.random.Generator,
    calib: Calibration,
    ext: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    clearance: float,
    hull: np.ndarray,
) -> np.ndarray | None:
    """A resting position for a shape of half extents ``ext``, or None.

    Candidates are drawn in one batch (a fixed number of draws, whatever passes):
    outside the workspace plus ``clearance``, inside the image, and not overlapping
    ``hull`` (the protected workspace volume) in the image.
    """
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    r_xy = float(np.hypot(ext[0], ext[1]))  # footprint radius whatever the yaw
    xy = rng.uniform(lo, hi, (_DISTRACTOR_TRIES, 2))
    inside = (
        (xy[:, 0] > x0 - clearance - r_xy)
        & (xy[:, 0] < x1 + clearance + r_xy)
        & (xy[:, 1] > y0 - clearance - r_xy)
        & (xy[:, 1] < y1 + clearance + r_xy)
    )
    xy = xy[~inside]
    if not len(xy):
        return None
    centres = np.column_stack([xy, np.full(len(xy), calib.table_z + ext[2])])
    offsets = np.array(
        [[sx * r_xy, sy * r_xy, sz * ext[2]] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)]
    )
    uv = project_points((centres[:, None, :] + offsets[None]).reshape(-1, 3), calib).reshape(len(xy), 8, 2)
    w, h = calib.image_size
    inset = _DISTRACTOR_IMAGE_INSET * np.array([w, h])
    in_image = np.all((uv >= inset) & (uv <= np.array([w - 1, h - 1]) - inset), axis=(1, 2))
    for i in np.flatnonzero(in_image):
        footprint = cv2.convexHull(uv[i].astype(np.float32)).reshape(-1, 2)
        overlap, _ = cv2.intersectConvexConvex(footprint, hull)
        if overlap <= 0:
            return centres[i]
    return None


def add_distractors(
    client: Any,
    calib: Calibration,
    rng: np.random.Generator,
    cfg: Mapping,
    *,
    table: int | None = None,
    params_out: list | None = None,
) -> list[int]:
    """Add visual-only shapes on the table outside the workspace, in view.

    The shapes have no collision shape (``baseCollisionShapeIndex=-1``), so they
    never change physics labels; they stand beyond the workspace plus
    ``distractors.clearance`` (clear of the bin walls), inside the camera's image,
    and their image never overlaps the workspace volume up to
    ``distractors.occlusion_height``, so they hide nothing graspable. A shape that
    finds no such place within a few dozen tries is left out.

    Args:
        client: the ``BulletClient``.
        calib: the camera (nominal or jittered, any scale) that must see them.
        rng: the frame's generator.
        cfg: the profile (``distractors``, ``colors.distractors``, ``textures``).
        table: the table body; when given, shapes stay within its collision AABB.
        params_out: when a list, receives one JSON-serialisable dict per shape.

    Returns:
        The new body ids (remove them with :func:`remove_bodies`). Their pixels in
        ``seg_raw`` carry these ids: they are not objects.
    """
    cfg = as_plain(cfg)
    d = cfg["distractors"]
    n = _draw_int(rng, d["count"], "distractors.count")
    shapes = [str(s) for s in d["shapes"]]
    unknown = sorted(set(shapes) - set(_DISTRACTOR_SHAPES))
    if unknown:
        raise ValueError(f"unknown distractor shapes {unknown}; known: {list(_DISTRACTOR_SHAPES)}")
    if n == 0 or not shapes:
        return []
    clearance, band = float(d["clearance"]), float(d["band"])
    hull = _workspace_hull(calib, clearance, float(d["occlusion_height"]))
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    lo = np.array([x0 - clearance - band, y0 - clearance - band])
    hi = np.array([x1 + clearance + band, y1 + clearance + band])
    if table is not None:
        aabb_lo, aabb_hi = (np.asarray(v[:2]) for v in client.getAABB(table))
        if np.all(aabb_hi > aabb_lo):  # a table without a collision shape has a point AABB
            lo, hi = np.maximum(lo, aabb_lo), np.minimum(hi, aabb_hi)
    ids: list[int] = []
    for _ in range(n):
        shape = shapes[int(rng.integers(len(shapes)))]
        dims = [draw_range(rng, d["size"]) for _ in range(3)]
        ext = _shape_extents(shape, dims)
        yaw = float(rng.uniform(-np.pi, np.pi))
        surface = _draw_surface(
            rng, cfg["colors"]["distractors"], cfg["textures"]["distractors"], cfg["textures"]
        )
        pos = _place_distractor(rng, calib, ext, lo, hi, clearance, hull)
        if pos is None:
            continue
        if shape == "box":
            vs = client.createVisualShape(p.GEOM_BOX, halfExtents=ext.tolist(), rgbaColor=surface["rgba"])
        elif shape == "sphere":
            vs = client.createVisualShape(p.GEOM_SPHERE, radius=float(ext[0]), rgbaColor=surface["rgba"])
        else:
            vs = client.createVisualShape(
                p.GEOM_CYLINDER, radius=float(ext[0]), length=float(2 * ext[2]), rgbaColor=surface["rgba"]
            )
        body = client.createMultiBody(
            baseMass=0.0,
            baseCollisionShapeIndex=-1,
            baseVisualShapeIndex=vs,
            basePosition=pos.tolist(),
            baseOrientation=client.getQuaternionFromEuler([0.0, 0.0, yaw]),
        )
        _apply_surface(client, body, surface)
        ids.append(body)
        if params_out is not None:
            params_out.append(
                {
                    "shape": shape,
                    "half_extents": ext.tolist(),
                    "position": pos.tolist(),
                    "yaw": yaw,
                    **surface,
                }
            )
    return ids


def remove_bodies(client: Any, ids: Sequence[int]) -> None:
    """Remove bodies (e.g. a frame's distractors)."""
    for body in ids:
        client.removeBody(body)


# ------------------------------------------------------------------- physics


def sample_physics(rng: np.random.Generator, cfg_physics: Mapping, n_objects: int = 1) -> dict:
    """Draw the physical parameters of a scene (applied by the cell, not here).

    Args:
        rng: the scene's generator.
        cfg_physics: the profile, or its ``physics`` section.
        n_objects: objects in the scene.

    Returns:
        Per-object lists (length ``n_objects``) ``lateral_friction``,
        ``spinning_friction`` (unitless), ``mass`` (kg), ``restitution``; scalars
        ``table_friction``, ``gripper_force`` (N per finger), ``finger_friction``.
    """
    cfg_physics = _section(cfg_physics, "physics")
    out: dict[str, Any] = {
        k: [draw_range(rng, cfg_physics[k]) for _ in range(n_objects)] for k in _PER_OBJECT
    }
    out.update({k: draw_range(rng, cfg_physics[k]) for k in _PER_SCENE})
    return out


# -------------------------------------------------------------- whole frame
def _render_size(nominal: Calibration, cfg: Mapping) -> tuple[int, int]:
    """Rendered raw frame size: ``image_size * resolution_scale``, rounded."""
    s = float(cfg["resolution_scale"])
    return max(1, round(nominal.width * s)), max(1, round(nominal.height * s))


@dataclass
class RenderedFrame:
    """One randomized render of a scene.

    Attributes:
        rgb: ``(H, W, 3)`` uint8 RGB raw frame, sensor effects applied.
        depth: ``(H, W)`` float32 metres along the camera's ``z``.
        seg_raw: ``(H, W)`` int32 body unique ids (``-1`` background; distractor ids
            are in ``distractor_ids``).
        camera: the jittered calibration at the render size.
        params: everything drawn: ``camera``, ``visuals``, ``lighting``,
            ``distractors``, ``sensor`` (JSON-serialisable).
        distractor_ids: ids the distractors had (they are removed after rendering).
    """

    rgb: np.ndarray
    depth: np.ndarray
    seg_raw: np.ndarray
    camera: Calibration
    params: dict
    distractor_ids: list[int] = field(default_factory=list)


def render_randomized(
    client: Any, bodies: SceneBodies, nominal: Calibration, rng: np.random.Generator, cfg: Mapping
) -> RenderedFrame:
    """Randomize the look of a settled scene and render one raw frame.

    Order of draws: camera, visuals, surface textures (profiles with a
    ``surface_textures`` section only), lighting, its cast shadow (profiles with
    ``lighting.cast_shadow`` on only), distractors, sensor.

    Args:
        client: the ``BulletClient`` holding the scene.
        bodies: its ``table``, ``bin_walls``, ``objects``.
        nominal: the calibration (at its own resolution).
        rng: the frame's generator.
        cfg: the profile (``conf/render/*.yaml``).

    Returns:
        The :class:`RenderedFrame` at ``nominal.image_size * resolution_scale``.
    """
    cfg = as_plain(cfg)
    camera, cam_params = sample_camera(nominal, rng, cfg["camera"])
    surface_cfg = cfg.get("surface_textures")
    if surface_cfg is None:
        visuals = apply_visuals(client, bodies, rng, cfg)
        drawn = None
    else:
        visuals = sample_visuals(rng, cfg, len(bodies.objects))
        drawn = sample_surface_textures(rng, surface_cfg, len(bodies.objects))
        _neutral_where_textured(visuals, drawn)
        apply_visual_params(client, bodies, visuals)
    lighting = sample_lighting(rng, cfg["lighting"])
    shadow_cfg = cfg["lighting"].get("cast_shadow")
    shadow = sample_cast_shadow(rng, shadow_cfg)
    distractors: list[dict] = []
    ids = add_distractors(client, camera, rng, cfg, table=bodies.table, params_out=distractors)
    size = _render_size(nominal, cfg)
    scaled = camera.scaled(size)
    try:
        rgb, depth, seg = render_camera(
            client, scaled, float(cfg["render_margin"]), str(cfg["renderer"]), lighting
        )
    finally:
        remove_bodies(client, ids)
    if shadow is not None:  # the distractors have no collision shape: they cast no traced shadow
        shadow_mask = cast_shadow_mask(client, depth, seg, scaled, lighting["lightDirection"],
                                       float(shadow_cfg["resolution"]), float(shadow_cfg["max_rise"]))
    if drawn is not None:
        rgb = apply_surface_textures(
            rgb, depth, masks_for(seg, bodies), scaled, drawn, surface_cfg, cfg["colors"]
        )
    if shadow is not None:
        rgb = apply_cast_shadow(rgb, shadow_mask, shadow)
    rgb, sensor = apply_sensor(rgb, rng, cfg["sensor"], pixel_scale=size[0] / nominal.width)
    params = {
        "camera": cam_params,
        "visuals": visuals,
        "lighting": lighting,
        "distractors": distractors,
        "sensor": sensor,
    }
    if drawn is not None:
        params["surface_textures"] = drawn
    if shadow is not None:
        params["cast_shadow"] = shadow
    return RenderedFrame(rgb=rgb, depth=depth, seg_raw=seg, camera=scaled, params=params, distractor_ids=ids)
