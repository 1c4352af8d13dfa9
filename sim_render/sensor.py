"""Camera sensor effects applied to rendered raw RGB frames.

The chain follows a camera's: optics (vignetting, defocus / motion blur), the
sensor (Gaussian read noise and Poisson-like shot noise on 8-bit levels), the ISP
(white balance, gamma and a contrast S-curve as one per-channel look-up table,
then saturation) and finally a JPEG round trip.

Randomizations (``sensor:`` in ``conf/render/*.yaml``, each a ``[lo, hi]`` range
drawn uniformly, a degenerate range meaning a fixed value):

- ``white_balance_r``, ``white_balance_b``: gains on R and on B relative to G, unitless.
- ``gamma``: exponent on intensity in ``[0, 1]`` (``> 1`` darkens mid-tones).
- ``contrast``: S-curve strength, 0 is linear, negative flattens.
- ``saturation``: colour saturation factor, 1 unchanged.
- ``vignetting``: intensity lost at the image corners, fraction.
- ``blur_prob``: probability of blurring; then ``defocus_sigma`` (Gaussian sigma)
  and ``motion_length`` (streak length, random direction), px at calibration
  resolution (scaled by ``pixel_scale``).
- ``read_noise``: Gaussian std, 8-bit levels; ``shot_noise``: variance per
  8-bit level of intensity (std = sqrt(shot_noise * I)).
- ``jpeg_prob``: probability of a JPEG round trip; ``jpeg_quality``: OpenCV
  quality 0-100.
- ``bayer_prob``: probability that the frame goes through a colour filter array: the
  optics' image is sampled on an RGGB mosaic (one colour per photosite), the noise is
  added there, and one of OpenCV's demosaicing methods (bilinear, edge-aware, VNG)
  rebuilds RGB, with the zipper and false-colour artefacts of a real pipeline.
- ``sharpen``: unsharp-mask amount of the ISP (0: none, unitless), with radius
  ``sharpen_sigma`` (Gaussian sigma, px at calibration resolution): the halos at edges
  that most camera pipelines add.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import cv2
import numpy as np
from omegaconf import DictConfig, OmegaConf

__all__ = ["draw_range", "draw_ranges", "as_plain", "apply_sensor", "apply_sensor_params", "tone_lut", "SENSOR_KEYS"]

#: The keys of a ``sensor:`` config section.
SENSOR_KEYS = (
    "white_balance_r",
    "white_balance_b",
    "gamma",
    "contrast",
    "saturation",
    "vignetting",
    "blur_prob",
    "defocus_sigma",
    "motion_length",
    "read_noise",
    "shot_noise",
    "jpeg_prob",
    "jpeg_quality",
    "bayer_prob",
    "sharpen",
    "sharpen_sigma",
)
#: OpenCV's demosaicing methods for an RGGB mosaic (OpenCV 4 names, kept in OpenCV 5).
_DEMOSAIC = (cv2.COLOR_BayerBG2RGB, cv2.COLOR_BayerBG2RGB_EA, cv2.COLOR_BayerBG2RGB_VNG)
# cv2.setRNGSeed takes a 32-bit int.
_NOISE_SEED_MAX = 2**31 - 1
# Effects below these sizes change no 8-bit pixel: skip them.
_MIN_BLUR_PX = 0.2
_MIN_MOTION_PX = 1.0


def as_plain(cfg: Mapping) -> Mapping:
    """A config section as plain dicts and lists.

    Reading an OmegaConf node costs microseconds and the randomizers read a few hundred per
    frame, so they work on plain containers. A ``DictConfig`` is converted on every call (no
    cache keyed by object identity): a renderer converts its profile once
    (:class:`sim_render.scene.SceneRenderer` keeps ``cfg_plain``) and passes that.

    Args:
        cfg: a ``DictConfig`` or any mapping (returned as is).

    Returns:
        A plain mapping with the same content.
    """
    if not isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.to_container(cfg, resolve=True)


def draw_range(rng: np.random.Generator, value: Any) -> float:
    """Draw one value of a config range: the project's one range convention.

    Args:
        rng: the generator (always advanced by one draw, so the stream does not
            depend on whether a range is degenerate).
        value: ``[lo, hi]`` drawn uniformly (``lo == hi`` gives exactly ``lo``), or a
            scalar returned as is.

    Returns:
        The value.

    Raises:
        ValueError: when ``lo > hi`` or the range is not a pair.
    """
    u = float(rng.random())
    if isinstance(value, int | float):
        return float(value)
    pair = [float(v) for v in value]
    if len(pair) != 2 or pair[0] > pair[1]:
        raise ValueError(f"a range must be [lo, hi] with lo <= hi, got {list(value)}")
    lo, hi = pair
    return lo if lo == hi else lo + (hi - lo) * u


def draw_ranges(rng: np.random.Generator, value: Any, n: int) -> np.ndarray:
    """``n`` draws of :func:`draw_range` at once: the same ``(n,)`` values, the generator
    advanced alike (``rng.random(n)`` is ``n`` successive ``rng.random()``)."""
    u = rng.random(n)
    if isinstance(value, int | float):
        return np.full(n, float(value))
    pair = [float(v) for v in value]
    if len(pair) != 2 or pair[0] > pair[1]:
        raise ValueError(f"a range must be [lo, hi] with lo <= hi, got {list(value)}")
    lo, hi = pair
    return np.full(n, lo) if lo == hi else lo + (hi - lo) * u


def tone_lut(gains: tuple[float, float, float], gamma: float, contrast: float) -> np.ndarray:
    """Per-channel 8-bit look-up table: white balance, gamma, then an S-curve.

    Args:
        gains: ``(r, g, b)`` multipliers on intensity.
        gamma: exponent on intensity in ``[0, 1]``.
        contrast: weight of the smoothstep S-curve blended with the identity.

    Returns:
        ``(256, 1, 3)`` uint8 table for ``cv2.LUT``.
    """
    x = np.linspace(0.0, 1.0, 256)[:, None] * np.asarray(gains, dtype=np.float64)[None, :]
    x = np.clip(x, 0.0, 1.0) ** gamma
    x = x + contrast * (x * x * (3.0 - 2.0 * x) - x)
    return np.clip(x * 255.0 + 0.5, 0, 255).astype(np.uint8).reshape(256, 1, 3)


@functools.lru_cache(maxsize=8)
def _radius2(h: int, w: int) -> np.ndarray:
    """Squared distance from the image centre, 1 at the corners ``(H, W, 1)`` float32."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r2 = ((x - (w - 1) / 2) ** 2 + (y - (h - 1) / 2) ** 2) / (((w - 1) / 2) ** 2 + ((h - 1) / 2) ** 2)
    r2 = r2[..., None]
    r2.setflags(write=False)
    return r2


def _mosaic(x: np.ndarray) -> np.ndarray:
    """Sample ``(H, W, 3)`` RGB on an RGGB colour filter array: ``(H, W)``, one colour a photosite."""
    out = x[..., 1].copy()
    out[0::2, 0::2] = x[0::2, 0::2, 0]
    out[1::2, 1::2] = x[1::2, 1::2, 2]
    return out


def _motion_kernel(length: float, angle: float) -> np.ndarray:
    """Normalised line kernel of ``length`` px at ``angle`` rad."""
    k = int(np.ceil(length)) | 1
    kernel = np.zeros((k, k), np.float32)
    c = (k - 1) / 2
    dx, dy = np.cos(angle) * (length - 1) / 2, np.sin(angle) * (length - 1) / 2
    cv2.line(kernel, (round(c - dx), round(c - dy)), (round(c + dx), round(c + dy)), 1.0, 1, cv2.LINE_AA)
    return kernel / max(float(kernel.sum()), 1e-6)


def apply_sensor(
    rgb: np.ndarray, rng: np.random.Generator, cfg: Mapping, pixel_scale: float = 1.0
) -> tuple[np.ndarray, dict]:
    """Apply the randomized sensor effects of ``cfg`` to a raw frame.

    Every parameter is drawn first, in a fixed order (the stream of ``rng`` does not
    depend on which effects end up active), and the noise images come from a seed
    drawn from ``rng``, so ``params`` replays the frame exactly.

    Args:
        rgb: ``(H, W, 3)`` uint8 RGB raw frame.
        rng: the frame's generator.
        cfg: the profile, or its ``sensor:`` section (keys :data:`SENSOR_KEYS`).
        pixel_scale: rendered width / calibration width (blur sizes in the config
            are at calibration resolution).

    Returns:
        ``(H, W, 3)`` uint8 RGB and the JSON-serialisable parameters drawn.
    """
    cfg = as_plain(cfg)
    if "sensor" in cfg:
        cfg = cfg["sensor"]
    missing = [k for k in SENSOR_KEYS if k not in cfg]
    if missing:
        raise KeyError(f"sensor config lacks {missing}; expected keys {list(SENSOR_KEYS)}")
    img = np.asarray(rgb)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"apply_sensor expects (H, W, 3) uint8 RGB, got {img.shape} {img.dtype}")
    params: dict[str, Any] = {
        "white_balance": [
            draw_range(rng, cfg["white_balance_r"]),
            1.0,
            draw_range(rng, cfg["white_balance_b"]),
        ],
        "gamma": draw_range(rng, cfg["gamma"]),
        "contrast": draw_range(rng, cfg["contrast"]),
        "saturation": draw_range(rng, cfg["saturation"]),
        "vignetting": draw_range(rng, cfg["vignetting"]),
        "blur": bool(rng.random() < float(cfg["blur_prob"])),
        "defocus_sigma": draw_range(rng, cfg["defocus_sigma"]) * pixel_scale,
        "motion_length": draw_range(rng, cfg["motion_length"]) * pixel_scale,
        "motion_angle": float(rng.uniform(0.0, np.pi)),
        "read_noise": draw_range(rng, cfg["read_noise"]),
        "shot_noise": draw_range(rng, cfg["shot_noise"]),
        "noise_seed": int(rng.integers(0, _NOISE_SEED_MAX)),
        "jpeg": bool(rng.random() < float(cfg["jpeg_prob"])),
        "jpeg_quality": int(round(draw_range(rng, cfg["jpeg_quality"]))),
        "bayer": bool(rng.random() < float(cfg["bayer_prob"])),
        "demosaic": int(rng.integers(len(_DEMOSAIC))),
        "sharpen": draw_range(rng, cfg["sharpen"]),
        "sharpen_sigma": draw_range(rng, cfg["sharpen_sigma"]) * pixel_scale,
    }
    return apply_sensor_params(img, params), params


def apply_sensor_params(img: np.ndarray, q: dict) -> np.ndarray:
    """Apply drawn sensor parameters ``q`` (the ``params`` of :func:`apply_sensor`: a replay).

    Args:
        img: ``(H, W, 3)`` uint8 RGB.
        q: the parameters.

    Returns:
        ``(H, W, 3)`` uint8 RGB.
    """
    h, w = img.shape[:2]
    blur = q["blur"] and (q["defocus_sigma"] >= _MIN_BLUR_PX or q["motion_length"] >= _MIN_MOTION_PX)
    noisy = q["read_noise"] > 0 or q["shot_noise"] > 0
    bayer = bool(q.get("bayer", False))  # parameters stored before the mosaic existed replay without it
    if q["vignetting"] > 0 or blur or noisy or bayer:
        x = img.astype(np.float32)
        if q["vignetting"] > 0:
            x *= 1.0 - np.float32(q["vignetting"]) * _radius2(h, w)
        if blur and q["defocus_sigma"] >= _MIN_BLUR_PX:
            x = cv2.GaussianBlur(x, (0, 0), q["defocus_sigma"], borderType=cv2.BORDER_REFLECT)
        if blur and q["motion_length"] >= _MIN_MOTION_PX:
            x = cv2.filter2D(
                x, -1, _motion_kernel(q["motion_length"], q["motion_angle"]), borderType=cv2.BORDER_REFLECT
            )
        if bayer:
            x = _mosaic(x)
        if noisy:
            # OpenCV's seeded generator: 3x faster than numpy's normals, the frame
            # cost that matters most here (it reseeds this thread's cv2 RNG).
            gauss = np.empty_like(x)
            cv2.setRNGSeed(q["noise_seed"])
            cv2.randn(gauss, 0.0, 1.0)
            std = np.sqrt(np.float32(q["read_noise"]) ** 2 + np.float32(q["shot_noise"]) * np.maximum(x, 0.0))
            x += std * gauss
        img = np.clip(x + 0.5, 0, 255).astype(np.uint8)
        if bayer:
            img = cv2.cvtColor(img, _DEMOSAIC[int(q["demosaic"]) % len(_DEMOSAIC)])
    else:
        img = img.copy()
    gains = tuple(q["white_balance"])
    if gains != (1.0, 1.0, 1.0) or q["gamma"] != 1.0 or q["contrast"] != 0.0:
        img = cv2.LUT(img, tone_lut(gains, q["gamma"], q["contrast"]))
    if q["saturation"] != 1.0:
        gray = cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
        img = cv2.addWeighted(img, q["saturation"], gray, 1.0 - q["saturation"], 0.0)
    amount = float(q.get("sharpen", 0.0))
    if amount > 0 and float(q.get("sharpen_sigma", 0.0)) >= _MIN_BLUR_PX:
        soft = cv2.GaussianBlur(img, (0, 0), float(q["sharpen_sigma"]), borderType=cv2.BORDER_REFLECT)
        img = cv2.addWeighted(img, 1.0 + amount, soft, -amount, 0.0)
    if q["jpeg"]:
        ok, buf = cv2.imencode(
            ".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, q["jpeg_quality"]]
        )
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        img = cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    return img
