"""Choose the camera's empty-bin test in the twin: fixed looks under any light.

    .venv/bin/python benchmarks/background.py [--looks target target_b] [--real 150] [--frames 100] \\
        [--thresholds 0.03 0.035 0.04 0.045 0.05] [--min-part-mm2 280] [--seed 0] [--light randomized]

For each fixed look (a render profile whose textures do not change from frame to frame: the
user's cell) lit as ``--light``'s profile lights its frames (``randomized``: the lamp anywhere
above the table, tinted, traced shadows), it renders ``--real`` frames with parts (the user's
photos), ``--frames`` frames of the empty bin and ``--frames`` other frames with parts, the
held-out objects, each its own scene and light. The background is fitted on the first
(:func:`perception.core.background.fit_background` in the default calibration's 96 px policy
view, exactly as the pipeline's ``background`` stage fits it); for every threshold it counts
the empty bins the test calls unchanged (the answers it would withhold: all of them, ideally)
and the frames with parts it calls unchanged (those it would withhold wrongly: none, ideally,
but a part the bin's colour is invisible to it).

The last stdout line is one JSON object ``{"looks": {LOOK: {"noise": n, "shown": s,
"thresholds": {T: {"empty_unchanged": k, "empty": n, "parts_unchanged": k, "parts": n}}}}}``.
About 0.3 s a frame on 2 cores. The validation cells are not read here: the choice is the
twin's (``conf/pipeline.yaml: background``), and ``benchmarks/variants.py`` checks it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np
from omegaconf import OmegaConf

from perception.core.background import changed_patch_px, fit_background
from perception.core.calibration import Calibration, calibration_path
from perception.core.decode import area_cells, parts_region
from perception.core.geometry import table_view
from perception.core.preprocess import preprocess
from perception.core.progress import progress
from policies.evaluate import load_profile
from sim_render.api import compose_config
from sim_render.scene import SceneRenderer


def render_views(look: str, light: str, empty: bool, seed: int, n: int, calib: Calibration, view) -> list[np.ndarray]:
    """``n`` frames of ``look`` lit as ``light`` lights its frames, in the policy's view."""
    cfg = OmegaConf.create(OmegaConf.to_container(load_profile(look), resolve=True))
    cfg.lighting = OmegaConf.to_container(load_profile(light), resolve=True)["lighting"]
    cfg.empty_scene_prob = 1.0 if empty else 0.0
    cfg.object_split = "test"
    renderer = SceneRenderer(calib, cfg, seed)
    views = []
    try:
        for i in progress(range(n), desc=f"{look} {'empty' if empty else 'parts'}", total=n):
            rngs, _ = renderer.build_scene(i)
            frame = renderer.render_frame(rngs["visuals"])
            views.append(preprocess(frame.rgb, frame.camera.scaled(tuple(calib.image_size)), view))
    finally:
        renderer.close()
    return views


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--looks", nargs="+", default=["target", "target_b"])
    ap.add_argument("--light", default="randomized", help="the profile whose lighting block lights every frame")
    ap.add_argument("--real", type=int, default=150, help="frames with parts the background is fitted on")
    ap.add_argument("--frames", type=int, default=100, help="empty-bin frames, and frames with parts, measured")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.03, 0.035, 0.04, 0.045, 0.05])
    ap.add_argument("--min-part-mm2", type=float, default=None,
                    help="default: conf/pipeline.yaml's background.min_part_mm2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    b_cfg = OmegaConf.to_container(compose_config("pipeline").background)
    p_cfg = OmegaConf.to_container(compose_config("pipeline").policy, resolve=True)
    calib = Calibration.load(calibration_path(None))
    view = table_view(calib, tuple(p_cfg["view_size"]), **{k: p_cfg["view"][k] for k in ("margin", "plane_height")})
    min_part_px = area_cells((args.min_part_mm2 or float(b_cfg["min_part_mm2"])) * 1e-6, view)
    region = parts_region(calib, view)
    out: dict = {"min_part_px": min_part_px, "looks": {}}
    for k, look in enumerate(args.looks):
        base = 900_000 + 30_000 * k + 3 * args.seed  # scene seeds of this benchmark's own
        real = render_views(look, args.light, False, base, args.real, calib, view)
        empty = render_views(look, args.light, True, base + 1, args.frames, calib, view)
        parts = render_views(look, args.light, False, base + 2, args.frames, calib, view)
        model, info = fit_background(real, region, float(b_cfg["threshold"]), min_part_px)
        rows = {}
        for t in args.thresholds:
            m = dataclasses.replace(model, threshold=float(t))
            rows[str(t)] = {"empty_unchanged": sum(m.unchanged(v, region) for v in empty), "empty": len(empty),
                            "parts_unchanged": sum(m.unchanged(v, region) for v in parts), "parts": len(parts),
                            "parts_smallest_patch": sorted(changed_patch_px(v, m, region) for v in parts)[:3]}
        out["looks"][look] = {"noise": info["noise"], "shown": info["shown"], "thresholds": rows}
        for t, r in rows.items():
            print(f"{look:10s} threshold {t}: empty bins unchanged {r['empty_unchanged']}/{r['empty']}, "
                  f"frames with parts unchanged {r['parts_unchanged']}/{r['parts']}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
