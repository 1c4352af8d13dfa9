"""Regenerate docs/images/surface_families.png and docs/images/randomization_natural.png.

    .venv/bin/python docs/figures/randomization.py [--scenes 6] [--seed 3] [--out-dir docs/images]

1. Each natural-image texture family (sim_render/surfaces.py), four seeds each, at the
   profile's texture size, coloured from the table's colour ranges.
2. Randomized training frames of the packaged calibration: two renders of each scene, an
   empty bin among them (``empty_scene_prob`` forced on for the last scene).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from perception.calibration import Calibration, default_calibration_path
from perception.imageio import write_image
from policies.evaluate import load_profile
from sim_render.scene import SceneRenderer
from sim_render.sensor import as_plain
from sim_render.surfaces import FAMILIES, make_surface_texture


def families_panel(cfg: dict) -> np.ndarray:
    rows = []
    for family in FAMILIES:
        tiles = [make_surface_texture({"family": family, "seed": s}, cfg["surface_textures"], cfg["colors"]["table"])
                 for s in range(4)]
        rows.append(np.concatenate(tiles, axis=1))
    return (np.concatenate(rows, axis=0) * 255 + 0.5).astype(np.uint8)


def frames_panel(calib: Calibration, n_scenes: int, seed: int) -> np.ndarray:
    frames = []
    full = SceneRenderer(calib, load_profile("randomized"), seed)
    for s in range(n_scenes - 1):
        frames += [f.rgb for f in full(s)]
    full.close()
    empty = SceneRenderer(calib, load_profile("randomized", ["render.empty_scene_prob=1.0"]), seed)
    frames += [f.rgb for f in empty(n_scenes - 1)]
    empty.close()
    cols = 4
    frames += [np.zeros_like(frames[0])] * (-len(frames) % cols)
    return np.concatenate([np.concatenate(frames[i:i + cols], axis=1) for i in range(0, len(frames), cols)], axis=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenes", type=int, default=6)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "images")
    args = ap.parse_args()
    cfg = dict(as_plain(load_profile("randomized")))
    write_image(args.out_dir / "surface_families.png", families_panel(cfg))
    write_image(args.out_dir / "randomization_natural.png",
                frames_panel(Calibration.load(default_calibration_path()), args.scenes, args.seed))


if __name__ == "__main__":
    main()
