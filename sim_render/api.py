"""Python API over the render CLI, for the pipeline, tests and notebooks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from conf import to_plain
from perception.core.atomic import atomic_write_bytes
from perception.core.imageio import write_image
from sim_render.cli import render

__all__ = ["compose_config", "render_config", "render_dataset", "export_real_frames", "render_cell_frames"]


def compose_config(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose one of the packaged configs (``conf/*.yaml``) with Hydra overrides."""

    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def render_config(
    output_dir: str | Path,
    n_scenes: int,
    profile: str = "randomized",
    seed: int = 0,
    calibration: str | Path | None = None,
    overrides: Sequence[str] = (),
    workers: int = 1,
) -> DictConfig:
    """The config that ``sim2real-render`` would run for these arguments."""
    args = [
        f"render={profile}",
        f"output_dir={Path(output_dir).as_posix()}",
        f"n_scenes={int(n_scenes)}",
        f"seed={int(seed)}",
        f"workers={int(workers)}",
    ]
    if calibration is not None:
        args.append(f"calibration={Path(calibration).as_posix()}")
    return compose_config("render", [*args, *overrides])


def render_dataset(
    output_dir: str | Path,
    n_scenes: int,
    profile: str = "randomized",
    seed: int = 0,
    calibration: str | Path | None = None,
    overrides: Sequence[str] = (),
    workers: int = 1,
) -> dict:
    """Render (or resume) a dataset; returns its manifest."""

    cfg = render_config(output_dir, n_scenes, profile, seed, calibration, overrides, workers)
    return render(cfg)


def export_real_frames(dataset_dir: str | Path, out_dir: str | Path, size: tuple[int, int] | None = None) -> list[Path]:
    """Write a dataset's raw frames as PNG files, like a folder of camera photos.

    The project's stand-in for real frames (contract section 4) is the ``target``
    profile rendered this way: unlabeled images at the calibration's ``image_size``.
    """
    from sim_render.reader import SimFrameDataset  # lazy: torch via reader (export only)

    ds = SimFrameDataset(dataset_dir, fields=("rgb",))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = tuple(size) if size is not None else tuple(ds.calibration.image_size)
    paths = []
    for i in range(len(ds)):
        rgb = ds[i]["rgb"]
        if (rgb.shape[1], rgb.shape[0]) != size:
            rgb = cv2.resize(rgb, size, interpolation=cv2.INTER_LINEAR)
        path = out / f"frame_{i:05d}.png"
        ok, buf = cv2.imencode(".png", np.ascontiguousarray(rgb[:, :, ::-1]))
        if not ok:
            raise OSError(f"could not encode {path}")

        atomic_write_bytes(path, buf.tobytes())
        paths.append(path)
    return paths


def render_cell_frames(
    out_dir: str | Path, calib: Any, n: int, wall_height: float, wall_thickness: float, seed: int = 0,
    profile: str = "target", natural_surfaces: bool = False,
) -> Path:
    """``n`` frames of one cell exactly as ``calib``'s camera sees it, as ``*.png`` in ``out_dir``.

    A cell's photos, in the twin: one look (``profile``, the stand-in for a real camera),
    the camera at the calibration with no jitter, the walls of one height and thickness,
    the objects changing from frame to frame. What ``sim2real-calibrate refine`` is
    tested and measured on (an error injected into the calibration it is handed).

    ``natural_surfaces``: the harder cell of ``benchmarks/refine.py``: table and bin
    covered with ``randomized``'s natural-image textures (their own straight and curved
    edges compete with the walls'), its traced cast shadows, and one look for every
    frame (the lamp, the textures, the sensor's draw), as a real cell keeps them; only
    the objects, and so their shadows, change between frames.
    """
    from sim_render.scene import SceneRenderer  # lazy: pybullet via scene (render only)

    cfg = to_plain(compose_config("render", [f"render={profile}"]).render)
    cfg.update(resolution_scale=1.0, frames_per_scene=1, empty_scene_prob=0.0,
               bin_walls={"height": [wall_height, wall_height], "thickness": [wall_thickness, wall_thickness]})
    cfg["camera"] = {k: 0.0 for k in cfg["camera"]}
    if natural_surfaces:
        randomized = to_plain(compose_config("render", ["render=randomized"]).render)
        cfg["surface_textures"] = {**randomized["surface_textures"], "table": {"prob": 1.0}, "bin": {"prob": 1.0}}
        cfg["lighting"]["cast_shadow"] = randomized["lighting"]["cast_shadow"]
        for surface in ("table", "bin"):  # the textures' palettes come from these
            cfg["colors"][surface] = randomized["colors"][surface]
        # The look's draws follow the object count (one per object first): a fixed count
        # keeps the surfaces' draws the same in every frame.
        count = int(np.random.default_rng([seed, 2]).integers(2, 5))
        cfg["objects_per_scene"] = [count, count]
    renderer = SceneRenderer(calib, cfg, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, scene = 0, 0
    try:
        while written < n:
            if scene >= 4 * n:
                raise RuntimeError(f"render_cell_frames: {written} of {n} frames after {scene} scenes")
            rngs, _params = renderer.build_scene(scene)
            scene += 1
            if natural_surfaces and len(renderer.world().cell.bodies.objects) != cfg["objects_per_scene"][0]:
                continue  # a part fell out of the bin: the look's draws would shift
            look = np.random.default_rng([seed, 1]) if natural_surfaces else rngs["visuals"]
            frame = renderer.render_frame(look)
            write_image(out / f"{written:03d}.png", frame.rgb)
            written += 1
    finally:
        renderer.close()
    return out
