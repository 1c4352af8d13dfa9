"""The geometry network's height error on held-out sim frames, and a picture of it on real ones.

    .venv/bin/python benchmarks/geometry.py [--geometry geometry_base_v1] [--scenes 40]
        [--real DIR --calibration FILE] [--panel docs/images/geometry_real.png]

Renders ``--scenes`` randomized scenes (the pipeline's default randomization, the packaged
calibration, scene seeds from 3,000,000: nobody trains on them) and prints the absolute
error of the predicted height above the table, median and p90, on part pixels and on the
rest (table, bin, floor), and the part mask's IoU (:func:`policies.geometry.geometry_errors`).
With ``--real`` (a folder of a camera's photos and its calibration) it draws, for a few of
them, the camera view, the predicted part mask over it and the predicted height: what the
grasp rule will run on in that cell.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from perception.core.calibration import Calibration, default_calibration_path  # noqa: E402
from perception.core.imageio import read_image  # noqa: E402
from perception.core.preprocess import preprocess, to_network_input  # noqa: E402
from policies.geometry import (  # noqa: E402
    GeometryFrames,
    geometry_errors,
    geometry_record,
    geometry_view,
    load_geometry_net,
)
from policies.networks import HEIGHT_MAX, GeometryNet  # noqa: E402

HELD_OUT_SEED = 3_000_000


def held_out_errors(net: GeometryNet, data: dict, scenes: int) -> dict:
    from sim_render.api import compose_config, render_dataset
    from sim_render.reader import SimFrameDataset

    overrides = list(compose_config("base", []).randomization.overrides or [])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "held_out"
        render_dataset(root, scenes, "randomized", HELD_OUT_SEED, overrides=overrides, workers=1)
        frames = SimFrameDataset(root, fields=("rgb", "depth", "seg"))
        view = geometry_view(frames.calibration, data)
        recs = [geometry_record(frames[i], frames.calibration, view) for i in range(len(frames))]
    return {**geometry_errors(net, GeometryFrames(recs)), "frames": len(recs), "scenes": scenes}


@torch.no_grad()
def real_panel(net: GeometryNet, data: dict, real_dir: Path, calib: Calibration, out: Path, n: int = 4) -> None:
    view = geometry_view(calib, data)
    files = sorted(p for p in real_dir.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))[:n]
    if not files:
        raise SystemExit(f"no PNG or JPEG frames in {real_dir}")
    rows = []
    for f in files:
        rgb = preprocess(read_image(f), calib, view)
        o = net(torch.from_numpy(to_network_input(rgb)))
        height = o["height"][0, 0].numpy()
        part = torch.sigmoid(o["object_logits"][0, 0]).numpy()
        mask = rgb.copy()
        mask[part >= 0.5] = (0.5 * mask[part >= 0.5] + [0, 127, 0]).astype(np.uint8)
        hcol = cv2.applyColorMap(np.clip(height / HEIGHT_MAX * 255, 0, 255).astype(np.uint8), cv2.COLORMAP_VIRIDIS)
        rows.append(np.concatenate([rgb, mask, hcol[:, :, ::-1]], axis=1))
    img = np.concatenate(rows, axis=0)
    img = cv2.resize(img, (img.shape[1] * 2, img.shape[0] * 2), interpolation=cv2.INTER_NEAREST)
    out.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(out), img[:, :, ::-1])
    print(f"panel: {out} (camera view | predicted parts in green | predicted height, 0 to {HEIGHT_MAX * 100:.0f} cm)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="geometry_base_v1", help="a shipped geometry network or a .pt path")
    ap.add_argument("--scenes", type=int, default=40, help="held-out sim scenes (0: skip)")
    ap.add_argument("--real", type=Path, help="a folder of real photos")
    ap.add_argument("--calibration", type=Path, default=None, help="their camera's calibration (with --real)")
    ap.add_argument("--panel", type=Path, default=ROOT / "docs" / "images" / "geometry_real.png")
    args = ap.parse_args()
    torch.set_num_threads(2)
    net, data = load_geometry_net(args.geometry)
    if args.scenes > 0:
        t0 = time.perf_counter()
        res = held_out_errors(net, data, args.scenes)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
        print(f"held-out sim, {res['frames']} frames of {res['scenes']} scenes: height error median / p90 "
              f"{res['object_median_m'] * 1000:.1f} / {res['object_p90_m'] * 1000:.1f} mm on parts, "
              f"{res['floor_median_m'] * 1000:.1f} / {res['floor_p90_m'] * 1000:.1f} mm elsewhere; "
              f"part IoU {res['object_iou']:.2f} ({time.perf_counter() - t0:.0f} s)")
    if args.real is not None:
        calib = Calibration.load(args.calibration or default_calibration_path())
        real_panel(net, data, args.real, calib, args.panel)


if __name__ == "__main__":
    main()
