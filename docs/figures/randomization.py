"""Regenerate docs/images/surface_families.png, randomization_natural.png and cast_shadows.png.

    .venv/bin/python docs/figures/randomization.py [--scenes 6] [--seed 3] [--out-dir docs/images]

1. Each natural-image texture family (sim_render/surfaces.py), four seeds each, at the
   profile's texture size, coloured from the table's colour ranges.
2. Randomized training frames of the packaged calibration: two renders of each scene, an
   empty bin among them (``empty_scene_prob`` forced on for the last scene).
3. Traced cast shadows (sim_render/shadows.py): randomized frames as rendered, the same
   frame with its traced shadow (a quarter of the light left, 1.5 px penumbra) and the
   traced mask; the light drawn low (0.5-0.9 rad) so that the shadows are long.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from perception.core.calibration import Calibration, default_calibration_path
from perception.core.imageio import write_image
from policies.evaluate import load_profile
from sim_render.randomization import render_randomized
from sim_render.scene import SceneRenderer
from sim_render.sensor import as_plain
from sim_render.shadows import apply_cast_shadow, cast_shadow_mask
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


def shadows_panel(calib: Calibration, n_scenes: int, seed: int) -> np.ndarray:
    # The frame as rendered without the traced shadow (the profile draws one on every frame), then with it.
    cfg = dict(as_plain(load_profile("randomized", ["render.empty_scene_prob=0.0", "render.lighting.elevation=[0.5,0.9]",
                                                    "render.lighting.cast_shadow.prob=0.0"])))
    shadow = cfg["lighting"]["cast_shadow"]
    renderer = SceneRenderer(calib, cfg, seed)
    rows = []
    try:
        for scene in range(n_scenes):
            rngs, _params = renderer.build_scene(scene)
            cell = renderer.world().cell
            frame = render_randomized(cell.client, cell.bodies, calib, rngs["visuals"], cfg)
            mask = cast_shadow_mask(cell.client, frame.depth, frame.seg_raw, frame.camera,
                                    frame.params["lighting"]["lightDirection"], float(shadow["resolution"]),
                                    float(shadow["max_rise"]))
            shaded = apply_cast_shadow(frame.rgb, mask, {"light_left": 0.25, "penumbra_px": 1.5})
            grey = np.repeat((mask[..., None] * 255 + 0.5).astype(np.uint8), 3, axis=2)
            rows.append(np.concatenate([frame.rgb, shaded, grey], axis=1))
    finally:
        renderer.close()
    return np.concatenate(rows, axis=0)


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
    write_image(args.out_dir / "cast_shadows.png",
                shadows_panel(Calibration.load(default_calibration_path()), 3, args.seed))


if __name__ == "__main__":
    main()
