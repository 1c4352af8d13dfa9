"""Image-space surface textures with the statistics of natural images.

Why image space: PyBullet's own texture path cannot carry what a policy must learn to
ignore. The ``random_urdfs`` meshes have no texture coordinates (an object shows a single
texel), a client holds 32 textures, and 64 px tiled over a table is coarse. Here each
rendered pixel's surface point is rebuilt from the depth and the camera that rendered
it, and a texture is looked up at that point's coordinates *on the surface*: tri-planar,
the base ``(x, y)`` plane for faces that look up, ``(y, z)`` or ``(x, z)`` for walls and
the sides of objects. So a pattern lies on the surface, is foreshortened by the
perspective and is cut by occlusion edges like a real one. The renderer's lighting is
kept: a textured surface is rendered in a neutral grey (:data:`NEUTRAL_ALBEDO`) and the
texture multiplies the shading measured from it, shadows included.

Texture families (:data:`FAMILIES`; each ``(rng, size, params) -> (size, size)`` float32
field in ``[0, 1]``, coloured through a palette drawn for the surface), written from what
natural images and materials look like (power spectra near ``1/f^2``, occlusion edges at
every scale and orientation), not from any one cell:

- ``spectral``: Gaussian noise with power spectrum ``1/f^exponent``, stretched along one
  direction by ``anisotropy`` (grain, brushing, fibre) and pushed through a ``sharpness``
  curve (smooth clouds to hard-edged blotches: stone, paint, stains).
- ``dead_leaves``: occluding discs whose radii follow a power law (the occlusion model of
  natural images: scale-invariant, with sharp edges at every scale and orientation).
- ``cells``: Voronoi cells of their own colours with grout between them (stone, tiles,
  granules, gravel, cork).
- ``speckle``: dots of a few colours on a varying base (speckled paint, terrazzo, granite,
  print dots, dirt).
- ``strokes``: line segments of power-law length and random width, oriented around one
  direction or anywhere (fibres, scratches, wood grain, weaves, hand marks).

Randomizations (``surface_textures:`` in ``conf/render/*.yaml``; a profile without it
renders as before):

- ``<surface>.prob`` for ``table``, ``bin`` (all walls share one draw) and ``objects``
  (one draw per object): probability that the surface is textured here; ``floor.prob``:
  probability that the bin has a floor of its own look (in the bin's colours) instead of
  showing the table between its walls.
- ``families``: the families drawn from and their parameter ranges (fractions of the
  texture side unless a unit is given); ``held_out``: families never drawn.
- ``tile``: metres of surface one texture image covers; ``contrast``: spread of value
  around the surface's colour (the palette comes from ``colors.<surface>``);
  ``hue_spread``: hue spread of the palette, fraction of the wheel; ``accent_prob``:
  probability that one palette colour is drawn anywhere on the colour wheel.
"""

from __future__ import annotations

import colorsys
import functools
from collections.abc import Callable, Mapping
from typing import Any

import cv2
import numpy as np

from perception.core.calibration import Calibration
from perception.core.geometry import raw_pixels_to_rays
from sim_render.sensor import as_plain, draw_range, draw_ranges

__all__ = [
    "FAMILIES",
    "NEUTRAL_ALBEDO",
    "SURFACES",
    "make_surface_texture",
    "sample_surface_textures",
    "surface_coordinates",
    "apply_surface_textures",
    "validate_surface_textures",
    "masks_for",
]

#: Grey level a surface is rendered with when it gets an image-space texture: light
#: enough that its 8-bit shading is well resolved, dark enough that highlights rarely clip.
NEUTRAL_ALBEDO = 0.75
#: Surfaces that can be textured here (keys of ``surface_textures:``, besides ``floor``: the
#: bin's own floor, which always gets a texture when it is drawn).
SURFACES = ("table", "bin", "objects")
# Pixels between the undistorted rays that surface_coordinates interpolates (< 1 mm on the table).
_RAY_STEP = 8
# Seeds of texture images, so a stored seed regenerates the same image.
_SEED_MAX = 2**31 - 1

FamilyFn = Callable[[np.random.Generator, int, Mapping], np.ndarray]


# --------------------------------------------------------------------- families
def _spectral_field(
    rng: np.random.Generator, size: int, exponent: float, anisotropy: float = 1.0, angle: float = 0.0
) -> np.ndarray:
    """Zero-mean, unit-std Gaussian field with power spectrum ``1/f^exponent``, periodic."""
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    c, s = np.cos(angle), np.sin(angle)
    # Compressing the spectrum across `angle` stretches the features along it.
    f = np.sqrt((anisotropy * (fx * c + fy * s)) ** 2 + (-fx * s + fy * c) ** 2)
    f[0, 0] = np.inf
    amp = f ** (-exponent / 2.0)
    white = np.fft.rfft2(rng.standard_normal((size, size)))
    field = np.fft.irfft2(white * amp, s=(size, size)).astype(np.float32)
    field -= field.mean()
    return field / max(float(field.std()), 1e-8)


def _squash(z: np.ndarray, sharpness: float) -> np.ndarray:
    """Map a unit-std field to ``[0, 1]``: 1 gives a smooth ramp, 8 hard-edged patches."""
    return (0.5 + 0.5 * np.tanh(sharpness * z * 0.5)).astype(np.float32)


def spectral(rng: np.random.Generator, size: int, p: Mapping) -> np.ndarray:
    """Power-law noise, optionally anisotropic and thresholded (a scalar field)."""
    z = _spectral_field(
        rng, size, draw_range(rng, p["exponent"]), draw_range(rng, p["anisotropy"]), rng.uniform(0, np.pi)
    )
    return _squash(z, draw_range(rng, p["sharpness"]))


def dead_leaves(rng: np.random.Generator, size: int, p: Mapping) -> np.ndarray:
    """Occluding discs, radii ``~ r^-3`` between ``radius`` bounds (a scalar field)."""
    n = int(round(draw_range(rng, p["count"])))
    r0, r1 = (float(v) * size for v in p["radius"])
    r0 = max(r0, 0.5)
    # Inverse CDF of the density r^-3 on [r0, r1]: the scale-invariant case.
    u = rng.random(n)
    radii = (r0**-2 - u * (r0**-2 - r1**-2)) ** -0.5
    centres = rng.random((n, 2)) * size
    levels = rng.random(n)
    canvas = np.full((size, size), float(rng.random()), np.float32)
    # Integer centres and radii in one pass (truncated, rounded half to even: what int() and
    # round() give one by one); the loop then only draws.
    xy = centres.astype(int).tolist()
    r_px = np.maximum(np.rint(radii).astype(int), 1).tolist()
    for (x, y), r, level in zip(xy, r_px, levels.tolist()):
        cv2.circle(canvas, (x, y), r, level, -1, cv2.LINE_AA)
    return canvas


def cells(rng: np.random.Generator, size: int, p: Mapping) -> np.ndarray:
    """Voronoi cells with a level each, grout of ``grout`` width at value 0 (a scalar field)."""
    n = max(int(round(draw_range(rng, p["count"]))), 2)
    seeds = np.ones((size, size), np.uint8)
    pts = (rng.random((n, 2)) * size).astype(int)
    seeds[pts[:, 1], pts[:, 0]] = 0
    _, labels = cv2.distanceTransformWithLabels(seeds, cv2.DIST_L2, 5, labelType=cv2.DIST_LABEL_PIXEL)
    levels = 0.25 + 0.75 * rng.random(int(labels.max()) + 1).astype(np.float32)
    field = levels[labels]
    # Texture inside each cell: stones and tiles are not flat.
    field *= 1.0 + 0.15 * _spectral_field(rng, size, 2.0)
    grout = draw_range(rng, p["grout"]) * size
    if grout >= 0.5:
        edge = (np.diff(labels, axis=0, prepend=labels[:1]) != 0) | (np.diff(labels, axis=1, prepend=labels[:, :1]) != 0)
        k = max(int(round(grout)), 1)
        edge = cv2.dilate(edge.astype(np.uint8), np.ones((k, k), np.uint8)) > 0
        field[edge] = 0.1 * rng.random()
    return np.clip(field, 0.0, 1.0)


def speckle(rng: np.random.Generator, size: int, p: Mapping) -> np.ndarray:
    """Dots of up to three levels on a softly varying base (a scalar field)."""
    field = 0.5 + 0.1 * _spectral_field(rng, size, draw_range(rng, p["base_exponent"]))
    density = draw_range(rng, p["density"])
    for level in rng.random(int(rng.integers(1, 4))):
        radius = max(int(round(draw_range(rng, p["radius"]) * size)), 1)
        spots = (rng.random((size, size)) < density / (np.pi * radius**2)).astype(np.uint8)
        kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius - 1 if radius > 1 else 1,) * 2)
        mask = cv2.dilate(spots, kernel) > 0
        field[mask] = level
    return np.clip(field, 0.0, 1.0).astype(np.float32)


def strokes(rng: np.random.Generator, size: int, p: Mapping) -> np.ndarray:
    """Line segments, lengths ``~ l^-2``, around one orientation or any (a scalar field)."""
    field = 0.5 + 0.1 * _spectral_field(rng, size, 2.0)
    n = int(round(draw_range(rng, p["count"])))
    l0, l1 = (float(v) * size for v in p["length"])
    lengths = (l0**-1 - rng.random(n) * (l0**-1 - l1**-1)) ** -1
    angles = rng.uniform(0, np.pi) + draw_range(rng, p["orientation_spread"]) * rng.standard_normal(n)
    widths = np.maximum(np.round(draw_ranges(rng, p["width"], n) * size), 1)
    centres = rng.random((n, 2)) * size
    levels = rng.random(n)
    dx, dy = 0.5 * lengths * np.cos(angles), 0.5 * lengths * np.sin(angles)
    ends = np.stack([centres[:, 0] - dx, centres[:, 1] - dy, centres[:, 0] + dx, centres[:, 1] + dy], axis=1)
    for (x0, y0, x1, y1), w, level in zip(ends.astype(int).tolist(), widths.astype(int).tolist(), levels.tolist()):
        cv2.line(field, (x0, y0), (x1, y1), level, w, cv2.LINE_AA)
    return np.clip(field, 0.0, 1.0)


#: Families by name; an unknown name raises with this list.
FAMILIES: dict[str, FamilyFn] = {
    "spectral": spectral,
    "dead_leaves": dead_leaves,
    "cells": cells,
    "speckle": speckle,
    "strokes": strokes,
}


# ---------------------------------------------------------------------- colours
def _palette(rng: np.random.Generator, colors: Mapping, cfg: Mapping, k: int) -> np.ndarray:
    """``k`` RGB colours ``(k, 3)`` around one drawn from ``colors.<surface>``, sorted by value."""
    hue = draw_range(rng, colors["hue"])
    sat = draw_range(rng, colors["saturation"])
    val = draw_range(rng, colors["value"])
    contrast = draw_range(rng, cfg["contrast"])
    spread = float(cfg["hue_spread"])
    out = []
    for i in range(k):
        if i > 0 and rng.random() < float(cfg["accent_prob"]):
            h, s, v = rng.random(), rng.random(), rng.uniform(0.1, 1.0)
        else:
            h = hue + spread * rng.uniform(-1, 1)
            s = np.clip(sat * rng.uniform(0.7, 1.3), 0.0, 1.0)
            v = np.clip(val + contrast * rng.uniform(-1, 1), 0.02, 1.0)
        out.append(colorsys.hsv_to_rgb(h % 1.0, float(s), float(v)))
    out = np.asarray(out, np.float32)
    return out[np.argsort(out.sum(axis=1))]


def _colorize(field: np.ndarray, palette: np.ndarray) -> np.ndarray:
    """A scalar field in ``[0, 1]`` through a colour ramp ``(k, 3)``: ``(H, W, 3)`` float32."""
    stops = np.linspace(0.0, 1.0, len(palette))
    flat = field.ravel()
    return np.stack([np.interp(flat, stops, palette[:, c]) for c in range(3)], axis=1).reshape(
        *field.shape, 3
    ).astype(np.float32)


def make_surface_texture(params: Mapping, cfg: Mapping, colors: Mapping) -> np.ndarray:
    """The texture image of one drawn surface (a replay from its stored ``params``).

    Args:
        params: one surface's entry of :func:`sample_surface_textures` (``family``, ``seed``).
        cfg: the profile's ``surface_textures`` section.
        colors: the profile's ``colors.<surface>`` section.

    Returns:
        ``(size, size, 3)`` float32 RGB in ``[0, 1]``.
    """
    family = str(params["family"])
    if family not in FAMILIES:
        raise KeyError(f"unknown surface texture family '{family}'; known: {sorted(FAMILIES)}")
    rng = np.random.default_rng(int(params["seed"]))
    size = int(cfg["size"])
    field = FAMILIES[family](rng, size, cfg["families"][family])
    palette = _palette(rng, colors, cfg, int(rng.integers(2, 5)))
    return _colorize(field, palette)


# ----------------------------------------------------------------------- draws
def _families(cfg: Mapping) -> list[str]:
    held = set(map(str, cfg.get("held_out") or []))
    return [f for f in cfg["families"] if f not in held]


def _draw_one(rng: np.random.Generator, cfg: Mapping, families: list[str]) -> dict:
    return {
        "family": families[int(rng.integers(len(families)))],
        "seed": int(rng.integers(0, _SEED_MAX)),
        "tile_m": draw_range(rng, cfg["tile"]),
        "angle": float(rng.uniform(0.0, 2 * np.pi)),
        "offset": [float(v) for v in rng.random(2)],
    }


def sample_surface_textures(rng: np.random.Generator, cfg: Mapping, n_objects: int) -> dict:
    """Draw which surfaces get an image-space texture, and which one.

    Args:
        rng: the frame's generator (a fixed number of draws per surface).
        cfg: the profile's ``surface_textures`` section.
        n_objects: objects in the scene.

    Returns:
        ``{"table": t | None, "bin": t | None, "floor": t | None, "objects": [t | None, ...]}``
        (``floor``: the bin's own floor, the table inside the walls, in the bin's colours), each ``t``
        a dict with ``family``, ``seed``, ``tile_m`` (m), ``angle`` (rad) and ``offset``
        (fraction of a tile): JSON-serialisable, enough to replay the frame.
    """
    cfg = as_plain(cfg)
    families = _families(cfg)

    def draw(surface: str) -> dict | None:
        textured = rng.random() < float(cfg[surface]["prob"])
        one = _draw_one(rng, cfg, families) if families else None
        return one if textured else None

    return {
        "table": draw("table"),
        "bin": draw("bin"),
        "floor": draw("floor"),
        "objects": [draw("objects") for _ in range(n_objects)],
    }


# ------------------------------------------------------------------ application
def _unit_gradient(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.gradient(a, axis=axis)`` at unit spacing, the same arithmetic without its overhead:
    central differences inside, one-sided at both ends."""
    def at(s: slice) -> tuple:
        return tuple(s if i == axis else slice(None) for i in range(a.ndim))

    out = np.empty_like(a)
    out[at(slice(1, -1))] = (a[at(slice(2, None))] - a[at(slice(None, -2))]) / 2.0
    out[at(slice(0, 1))] = a[at(slice(1, 2))] - a[at(slice(0, 1))]
    out[at(slice(-1, None))] = a[at(slice(-1, None))] - a[at(slice(-2, -1))]
    return out


@functools.lru_cache(maxsize=8)
def _ray_grid(h: int, w: int) -> tuple[np.ndarray, tuple[int, int], np.ndarray, np.ndarray]:
    """The pixels of :func:`surface_coordinates`' ray grid (every ``_RAY_STEP`` px and the last
    row and column), its shape, and the remap maps placing each pixel of an ``(h, w)`` frame in it.

    The same for every frame of a size, so made once: the maps in OpenCV's fixed-point form,
    which is what ``cv2.remap`` turns float maps into on every call (the same interpolation).
    """
    gv = np.append(np.arange(0, h, _RAY_STEP), h - 1)
    gu = np.append(np.arange(0, w, _RAY_STEP), w - 1)
    guu, gvv = np.meshgrid(gu, gv)
    # Each pixel's fractional place in the grid, for a bilinear lookup.
    fu = np.interp(np.arange(w), gu, np.arange(len(gu))).astype(np.float32)
    fv = np.interp(np.arange(h), gv, np.arange(len(gv))).astype(np.float32)
    mu, mv = np.meshgrid(fu, fv)
    map_xy, map_frac = cv2.convertMaps(mu, mv, cv2.CV_16SC2)
    px = np.stack([guu.ravel(), gvv.ravel()], axis=1)
    for a in (px, map_xy, map_frac):
        a.flags.writeable = False  # shared by every call
    return px, (len(gv), len(gu)), map_xy, map_frac


def surface_coordinates(depth: np.ndarray, camera: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """Tri-planar surface coordinates of every pixel, metres, and each pixel's footprint.

    Args:
        depth: ``(H, W)`` metres along the camera's ``z``; the camera at ``(W, H)``.

    Returns:
        ``(H, W, 2)`` float32 coordinates: base ``(x, y)`` where the surface faces up,
        ``(y, z)`` where it faces along ``x``, ``(x, z)`` along ``y``; and ``(H, W)``
        float32 metres one pixel spans on the surface (for the texture's level of detail).
    """
    h, w = depth.shape
    # Undistorting every pixel costs more than the texturing itself; rays vary smoothly
    # across the frame, so undistort a grid every _RAY_STEP px and interpolate between.
    grid_px, grid_shape, map_xy, map_frac = _ray_grid(h, w)
    grid = raw_pixels_to_rays(grid_px, camera)[:, :2].reshape(*grid_shape, 2).astype(np.float32)
    xy = cv2.remap(grid, map_xy, map_frac, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    d = depth.astype(np.float32)
    T = camera.T_base_camera.astype(np.float32)
    cam = np.concatenate([xy * d[..., None], d[..., None]], axis=2)
    # A channel-first copy: the differences, cross product and norms below run on contiguous
    # planes (half the time of the (H, W, 3) versions, same bits). The product stays stacked
    # (H, W, 3) @ (3, 3): as one (H*W, 3) matrix it goes to multithreaded BLAS, whose spinning
    # threads slow the other render worker on the same cores.
    pts = np.moveaxis(cam @ T[:3, :3].T + T[:3, 3], 2, 0).copy()
    du, dv = _unit_gradient(pts, 2), _unit_gradient(pts, 1)
    n_x = np.abs(du[1] * dv[2] - du[2] * dv[1])
    n_y = np.abs(du[2] * dv[0] - du[0] * dv[2])
    n_z = np.abs(du[0] * dv[1] - du[1] * dv[0])
    # The normal's largest component, the first on ties (argmax's rule): 0 faces along x, 1 along y, 2 up.
    axis = np.where((n_x >= n_y) & (n_x >= n_z), 0, np.where(n_y >= n_z, 1, 2))
    x, y, z = pts
    coords = np.stack(
        [np.where(axis == 0, y, x), np.where(axis == 2, y, z)], axis=2
    ).astype(np.float32)
    norm_u = np.sqrt(du[0] * du[0] + du[1] * du[1] + du[2] * du[2])
    norm_v = np.sqrt(dv[0] * dv[0] + dv[1] * dv[1] + dv[2] * dv[2])
    footprint = np.sqrt(norm_u * norm_v).astype(np.float32)
    return coords, footprint


def _wrap(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` wrapped into ``[0, n]`` (float32), for a ``BORDER_WRAP`` lookup.

    ``a - n * floor(a / n)`` rather than ``a % n``: 30x faster, and bit for bit
    ``np.remainder``'s answer when ``n`` is a power of two (every pyramid level of a texture:
    :func:`validate_surface_textures` requires a power-of-two ``size``): ``a / n`` and ``n * k``
    are then exact, and the one rounding left is the subtraction's, which ``np.remainder`` makes too.
    """
    return (a - n * np.floor(a / n)).astype(np.float32)


def _sample(texture: np.ndarray, coords: np.ndarray, footprint: float, t: Mapping) -> np.ndarray:
    """Look ``texture`` up at surface ``coords`` ``(H, W, 2)`` m, prefiltered to the pixel footprint."""
    size = texture.shape[0]
    texel = float(t["tile_m"]) / size
    img = texture
    # A camera integrates over its pixel: drop to the pyramid level whose texel is about
    # one pixel, instead of point-sampling a texture finer than the pixel (aliasing).
    levels = int(np.clip(np.floor(np.log2(max(footprint / texel, 1.0))), 0, np.log2(size) - 2))
    for _ in range(levels):
        img = cv2.pyrDown(img)
    texel *= 2**levels
    c, s = np.cos(t["angle"]), np.sin(t["angle"])
    rot = coords @ np.array([[c, s], [-s, c]], np.float32)
    n = img.shape[0]
    m = _wrap(rot / texel + np.asarray(t["offset"], np.float32) * n, n)
    return cv2.remap(img, m[..., 0], m[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_WRAP)


def apply_surface_textures(
    rgb: np.ndarray,
    depth: np.ndarray,
    masks: Mapping[str, list[np.ndarray]],
    camera: Calibration,
    drawn: Mapping,
    cfg: Mapping,
    colors: Mapping,
) -> np.ndarray:
    """Texture the drawn surfaces of a rendered frame, keeping its shading.

    Args:
        rgb: ``(H, W, 3)`` uint8 frame, the textured surfaces rendered at :data:`NEUTRAL_ALBEDO`.
        depth: ``(H, W)`` metres along the camera's ``z``.
        masks: per surface (``table``, ``bin``, ``objects``) one boolean ``(H, W)`` mask
            per drawn entry (``objects``: one per object, in order).
        camera: the camera that rendered the frame, at ``(W, H)``.
        drawn: :func:`sample_surface_textures`' result.
        cfg: the profile's ``surface_textures`` section; colors: its ``colors`` section.

    Returns:
        ``(H, W, 3)`` uint8.
    """
    cfg = as_plain(cfg)
    floor = drawn.get("floor")
    if not any(t is not None for t in (drawn["table"], drawn["bin"], floor, *drawn["objects"])):
        return rgb
    coords, footprint = surface_coordinates(depth, camera)
    masks = dict(masks)
    if floor is not None:
        # The bin's floor: the table between the walls (an up-facing pixel's coordinates are its base x, y).
        (x0, x1), (y0, y1) = camera.workspace_x, camera.workspace_y
        x, y = coords[..., 0], coords[..., 1]
        inside = masks["table"][0] & (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
        masks["floor"] = [inside]
        masks["table"] = [masks["table"][0] & ~inside]
    jobs = []
    for surface in (*SURFACES, "floor"):
        entries = drawn[surface] if surface == "objects" else [drawn.get(surface)]
        for t, mask in zip(entries, masks.get(surface, [])):
            if t is not None and mask.any():
                jobs.append((surface, t, mask))
    out = rgb.astype(np.float32)
    flat = drawn.get("table_flat")
    if flat is not None:  # the table was rendered grey for the floor's sake: give it its drawn colour back
        mask = masks["table"][0]
        np.multiply(out, np.asarray(flat, np.float32) / NEUTRAL_ALBEDO, out=out, where=mask[..., None])
    for surface, t, mask in jobs:
        tex = make_surface_texture(t, cfg, colors["bin" if surface == "floor" else surface])
        rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
        box = np.s_[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]  # look up only where the surface is
        sub = mask[box]
        fp = float(np.median(footprint[mask]))
        region = out[box]
        # In place where the surface is (a masked multiply: no gather and scatter of its pixels).
        np.multiply(region, _sample(tex, coords[box], fp, t) / NEUTRAL_ALBEDO, out=region, where=sub[..., None])
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def validate_surface_textures(cfg: Mapping) -> list[str]:
    """Problems in a ``surface_textures`` section (an empty list when it is fine)."""
    cfg = as_plain(cfg)
    problems = []
    for key in ("families", "size", "tile", "contrast", "hue_spread", "accent_prob", "floor", *SURFACES):
        if key not in cfg:
            problems.append(f"surface_textures.{key} is missing")
    if problems:
        return problems
    unknown = sorted(set(map(str, cfg["families"])) - set(FAMILIES))
    if unknown:
        problems.append(f"surface_textures.families has unknown {unknown}; known: {sorted(FAMILIES)}")
    held = set(map(str, cfg.get("held_out") or []))
    if held - set(map(str, cfg["families"])):
        problems.append(f"surface_textures.held_out names families not in families: {sorted(held - set(cfg['families']))}")
    if not _families(cfg) and any(float(cfg[s]["prob"]) > 0 for s in (*SURFACES, "floor")):
        problems.append("surface_textures: every family is held out but a surface prob is > 0")
    if int(cfg["size"]) < 16 or int(cfg["size"]) & (int(cfg["size"]) - 1):
        problems.append(f"surface_textures.size must be a power of two >= 16 px, got {cfg['size']}")
    lo, hi = (float(v) for v in cfg["tile"])
    if not 0 < lo <= hi:
        problems.append(f"surface_textures.tile must be [lo, hi] metres with 0 < lo <= hi, got {cfg['tile']}")
    for s in (*SURFACES, "floor"):
        if not 0.0 <= float(cfg[s].get("prob", -1)) <= 1.0:
            problems.append(f"surface_textures.{s}.prob must be a probability in [0, 1]")
    if not 0.0 <= float(cfg["accent_prob"]) <= 1.0:
        problems.append("surface_textures.accent_prob must be a probability in [0, 1]")
    return problems


def masks_for(seg_raw: np.ndarray, bodies: Any) -> dict[str, list[np.ndarray]]:
    """Per-surface masks of a rendered frame from PyBullet's body-id segmentation."""
    return {
        "table": [seg_raw == bodies.table],
        "bin": [np.isin(seg_raw, list(bodies.bin_walls))],
        "objects": [seg_raw == o for o in bodies.objects],
    }
