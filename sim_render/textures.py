"""Procedural textures (numpy + OpenCV) and the per-client PyBullet texture pool.

Every generator has the signature ``(rng, size) -> (size, size, 3) uint8 RGB`` and is
registered by name in :data:`TEXTURES`. Abstract ones (``noise``, ``stripes``,
``checkers``, ``blotches``, ``gradient``) draw their colours at random; photo-like
ones (``wood``, ``brushed_metal``, ``cardboard``, ``fabric``, ``plastic``) keep to
the colours of the material they imitate, so they can stand in for a real cell.

PyBullet multiplies a texture by the shape's ``rgbaColor``; meshes without texture
coordinates (the ``random_urdfs`` objects) show a single texel.

:class:`TexturePool` loads textures into a client once: a texture is identified by
``(kind, variant, size)`` and generated from a seed derived from those alone, so
the same key gives the same image in every process, whatever was loaded before.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

__all__ = [
    "TEXTURES",
    "MAX_TEXTURES_PER_CLIENT",
    "make_texture",
    "texture_seed",
    "TexturePool",
    "texture_pool",
    "value_noise",
]

#: Textures loaded into one physics client at most (PyBullet never frees them).
MAX_TEXTURES_PER_CLIENT = 32
# Base of the per-texture seeds, so texture streams differ from other seeded streams.
_TEXTURE_SEED_BASE = 0x7E47

TextureFn = Callable[[np.random.Generator, int], np.ndarray]


# ------------------------------------------------------------------- primitives
def value_noise(
    rng: np.random.Generator, size: int, octaves: int = 4, base_cells: int = 2, persistence: float = 0.5
) -> np.ndarray:
    """Multi-octave value noise (a cheap Perlin stand-in) in ``[0, 1]``.

    Args:
        rng: the generator.
        size: side of the square output, pixels.
        octaves: layers; each doubles the number of cells.
        base_cells: lattice cells across the first octave.
        persistence: amplitude ratio between successive octaves.

    Returns:
        ``(size, size)`` float32 in ``[0, 1]``.
    """
    out = np.zeros((size, size), np.float32)
    amp, total = 1.0, 0.0
    for o in range(octaves):
        cells = base_cells * 2**o + 1
        lattice = rng.random((cells, cells), dtype=np.float32)
        out += amp * cv2.resize(lattice, (size, size), interpolation=cv2.INTER_CUBIC)
        total += amp
        amp *= persistence
    return _normalize(out / total)


def _normalize(x: np.ndarray) -> np.ndarray:
    """Stretch to ``[0, 1]`` (float32)."""
    lo, hi = float(x.min()), float(x.max())
    return ((x - lo) / max(hi - lo, 1e-6)).astype(np.float32)


def _random_color(rng: np.random.Generator) -> np.ndarray:
    """A random RGB colour in ``[0, 1]`` (uniform per channel)."""
    return rng.random(3, dtype=np.float32)


def _mix(t: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Blend colours ``a`` -> ``b`` by ``t`` ``(H, W)`` in ``[0, 1]``; uint8 RGB."""
    t = np.clip(t, 0.0, 1.0)[..., None]
    out = a[None, None, :] * (1.0 - t) + b[None, None, :] * t
    return np.clip(out * 255.0 + 0.5, 0, 255).astype(np.uint8)


def _coords(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates in ``[0, 1)``: ``(x, y)`` each ``(size, size)`` float32."""
    t = np.arange(size, dtype=np.float32) / size
    return np.meshgrid(t, t)


# ----------------------------------------------------------- abstract textures
def noise(rng: np.random.Generator, size: int) -> np.ndarray:
    """Multi-octave value noise between two random colours."""
    t = value_noise(rng, size, octaves=int(rng.integers(2, 6)), base_cells=int(rng.integers(1, 5)))
    return _mix(t, _random_color(rng), _random_color(rng))


def stripes(rng: np.random.Generator, size: int) -> np.ndarray:
    """Parallel stripes at a random angle, period and sharpness."""
    x, y = _coords(size)
    angle = rng.uniform(0.0, np.pi)
    period = rng.uniform(0.05, 0.35)  # fraction of the texture
    sharp = rng.uniform(1.0, 12.0)
    s = np.sin(2 * np.pi * (x * np.cos(angle) + y * np.sin(angle)) / period)
    t = 0.5 + 0.5 * np.tanh(sharp * s)
    return _mix(t, _random_color(rng), _random_color(rng))


def checkers(rng: np.random.Generator, size: int) -> np.ndarray:
    """A checkerboard with a random number of cells."""
    n = int(rng.integers(2, 12))
    x, y = _coords(size)
    t = ((np.floor(x * n) + np.floor(y * n)) % 2).astype(np.float32)
    return _mix(t, _random_color(rng), _random_color(rng))


def blotches(rng: np.random.Generator, size: int) -> np.ndarray:
    """Irregular patches of 2-4 colours (thresholded low-frequency noise)."""
    k = int(rng.integers(2, 5))
    t = value_noise(rng, size, octaves=3, base_cells=int(rng.integers(2, 5)))
    level = np.minimum((t * k).astype(np.int32), k - 1)
    palette = np.clip(rng.random((k, 3)) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return palette[level]


def gradient(rng: np.random.Generator, size: int) -> np.ndarray:
    """A linear gradient at a random angle between two random colours."""
    x, y = _coords(size)
    angle = rng.uniform(0.0, 2 * np.pi)
    t = _normalize(x * np.cos(angle) + y * np.sin(angle))
    return _mix(t, _random_color(rng), _random_color(rng))


# --------------------------------------------------------- photo-like textures
# Material colours (RGB in [0, 1]) and how far a variant may stray from them.
_WOOD_LIGHT = np.array([0.74, 0.55, 0.36], np.float32)
_WOOD_DARK = np.array([0.47, 0.30, 0.17], np.float32)
_CARDBOARD = np.array([0.70, 0.55, 0.38], np.float32)
_METAL = np.array([0.62, 0.63, 0.65], np.float32)
_MATERIAL_JITTER = 0.06


def _material(rng: np.random.Generator, color: np.ndarray) -> np.ndarray:
    return np.clip(color + rng.uniform(-_MATERIAL_JITTER, _MATERIAL_JITTER, 3).astype(np.float32), 0.0, 1.0)


def wood(rng: np.random.Generator, size: int) -> np.ndarray:
    """Wood: growth rings bent by noise, plus fine grain along the boards."""
    x, y = _coords(size)
    warp = value_noise(rng, size, octaves=3, base_cells=2)
    centre = rng.uniform(-1.0, 2.0, 2)
    # Rings elongated along x: the board is cut along the trunk.
    r = np.sqrt(((x - centre[0]) * 0.15) ** 2 + (y - centre[1]) ** 2) * rng.uniform(6.0, 14.0) + 2.5 * warp
    rings = 0.5 + 0.5 * np.sin(2 * np.pi * r)
    grain = cv2.resize(rng.random((size, max(size // 16, 2)), dtype=np.float32), (size, size))
    t = 0.65 * rings**2 + 0.35 * grain
    return _mix(t, _material(rng, _WOOD_LIGHT), _material(rng, _WOOD_DARK))


def brushed_metal(rng: np.random.Generator, size: int) -> np.ndarray:
    """Brushed metal: grey with streaks along one direction and a soft sheen."""
    streaks = cv2.blur(rng.random((size, size), dtype=np.float32), (max(size // 4, 3), 1))
    x, _ = _coords(size)
    sheen = 0.5 + 0.5 * np.cos(2 * np.pi * (x + rng.random()))
    t = 0.6 * _normalize(streaks) + 0.4 * sheen
    base = _material(rng, _METAL)
    return _mix(t, base * 0.85, np.minimum(base * 1.12, 1.0))


def cardboard(rng: np.random.Generator, size: int) -> np.ndarray:
    """Cardboard: brown with fibre speckle and faint corrugation."""
    x, y = _coords(size)
    fibres = rng.random((size, size), dtype=np.float32)
    blotch = value_noise(rng, size, octaves=3, base_cells=3)
    corrugation = 0.5 + 0.5 * np.sin(2 * np.pi * y * rng.uniform(8.0, 16.0))
    t = 0.45 * blotch + 0.35 * fibres + 0.2 * corrugation
    base = _material(rng, _CARDBOARD)
    return _mix(t, base * 0.88, np.minimum(base * 1.08, 1.0))


def fabric(rng: np.random.Generator, size: int) -> np.ndarray:
    """Woven fabric: a fine over-under weave in a muted random colour."""
    x, y = _coords(size)
    n = rng.uniform(10.0, 24.0)  # threads across the texture
    weave = np.sin(2 * np.pi * n * x) * np.sin(2 * np.pi * n * y)
    fuzz = rng.random((size, size), dtype=np.float32)
    t = 0.5 + 0.35 * weave + 0.15 * (fuzz - 0.5)
    hue_color = 0.25 + 0.5 * _random_color(rng)  # muted: away from pure black/white
    return _mix(t, hue_color * 0.75, np.minimum(hue_color * 1.1, 1.0))


def plastic(rng: np.random.Generator, size: int) -> np.ndarray:
    """Matte plastic: an almost uniform grey with faint speckle (tinted by rgbaColor)."""
    t = 0.5 * value_noise(rng, size, octaves=2, base_cells=4) + 0.5 * rng.random(
        (size, size), dtype=np.float32
    )
    grey = np.float32(0.9)
    return _mix(t, np.full(3, grey - 0.06, np.float32), np.full(3, grey + 0.06, np.float32))


#: Generators by name; ``make_texture`` raises with this list on an unknown name.
TEXTURES: dict[str, TextureFn] = {
    "noise": noise,
    "stripes": stripes,
    "checkers": checkers,
    "blotches": blotches,
    "gradient": gradient,
    "wood": wood,
    "brushed_metal": brushed_metal,
    "cardboard": cardboard,
    "fabric": fabric,
    "plastic": plastic,
}


def texture_seed(kind: str, variant: int, size: int) -> np.random.SeedSequence:
    """The seed of texture ``(kind, variant, size)``: stable across processes."""
    return np.random.SeedSequence([_TEXTURE_SEED_BASE, zlib.crc32(kind.encode()), int(variant), int(size)])


def make_texture(kind: str, rng: np.random.Generator | int, size: int = 64) -> np.ndarray:
    """Generate one texture.

    Args:
        kind: a name in :data:`TEXTURES`.
        rng: a generator, or an int variant (seeded by :func:`texture_seed`).
        size: side of the square texture, pixels.

    Returns:
        ``(size, size, 3)`` uint8 RGB.

    Raises:
        KeyError: for an unknown kind (the message lists the known ones).
    """
    if kind not in TEXTURES:
        raise KeyError(f"unknown texture kind '{kind}'; known: {sorted(TEXTURES)}")
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(texture_seed(kind, int(rng), size))
    return TEXTURES[kind](rng, int(size))


# ------------------------------------------------------------------------- pool
_TMP_DIR: dict[int, Path] = {}


def _texture_dir() -> Path:
    """This process's folder of texture PNGs (forked workers get their own)."""
    pid = os.getpid()
    if pid not in _TMP_DIR:
        path = Path(tempfile.mkdtemp(prefix=f"sim_render_textures_{pid}_"))
        _TMP_DIR[pid] = path
        atexit.register(_remove_dir, path, pid)
    return _TMP_DIR[pid]


def _remove_dir(path: Path, owner_pid: int) -> None:
    """atexit hook: a forked child inherits the parent's hooks and must not run them."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class TexturePool:
    """Textures loaded into one physics client, by ``(kind, variant, size)``.

    ``loadTexture`` memory is never freed by PyBullet, so a pool loads each key once
    and holds at most ``capacity`` keys; beyond that it forgets the least recently
    used one (a warning says the configuration asks for too many). After
    ``resetSimulation`` all texture ids are void: call :meth:`clear`.
    """

    def __init__(self, client: Any, capacity: int = MAX_TEXTURES_PER_CLIENT) -> None:
        self._client = weakref.proxy(client) if _weakrefable(client) else client
        self.capacity = int(capacity)
        self._ids: OrderedDict[tuple[str, int, int], int] = OrderedDict()
        self._warned = False

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        """Forget every loaded texture (after ``resetSimulation``)."""
        self._ids.clear()

    def get(self, kind: str, variant: int, size: int) -> int:
        """The texture unique id of ``(kind, variant, size)``, loading it once.

        Returns:
            A ``textureUniqueId`` for ``changeVisualShape``.
        """
        key = (str(kind), int(variant), int(size))
        if key in self._ids:
            self._ids.move_to_end(key)
            return self._ids[key]
        if len(self._ids) >= self.capacity:
            if not self._warned:
                warnings.warn(
                    f"more than {self.capacity} distinct textures requested on one client; "
                    "lower textures.variants_per_kind or the number of kinds (PyBullet never frees textures)",
                    stacklevel=2,
                )
                self._warned = True
            self._ids.popitem(last=False)
        path = _texture_dir() / f"{key[0]}_{key[1]}_{key[2]}.png"
        if not path.exists():
            img = make_texture(key[0], key[1], key[2])
            tmp = path.with_suffix(f".{os.getpid()}.tmp.png")
            cv2.imwrite(str(tmp), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
            tmp.replace(path)
        tex_id = int(self._client.loadTexture(str(path)))
        if tex_id < 0:
            raise RuntimeError(f"PyBullet could not load texture {path}")
        self._ids[key] = tex_id
        return tex_id


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


_POOLS: weakref.WeakKeyDictionary[Any, TexturePool] = weakref.WeakKeyDictionary()


def texture_pool(client: Any) -> TexturePool:
    """The :class:`TexturePool` of a physics client (created on first use)."""
    pool = _POOLS.get(client)
    if pool is None:
        pool = _POOLS[client] = TexturePool(client)
    return pool
