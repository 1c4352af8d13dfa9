"""Regenerate docs/images/policy_surface.png: the surface a policy predicts, and where the grasp rule fits.

    .venv/bin/python docs/figures/policy_surface.py --checkpoint RUN/policy.ckpt --dataset SIM_DIR \
        [--frames 0 97 194 388] [--out docs/images/policy_surface.png]

Per frame (table view): the view image, the surface rebuilt from the rendered depth (the
training target), the predicted surface, and the cells where perception.core.rule finds a grasp
at some angle on each.
"""

from __future__ import annotations

import argparse

import cv2
import numpy as np
import torch

from perception.core.draw import label_image, panel
from perception.core.geometry import NetworkView
from perception.core.imageio import write_image
from perception.core.rule import fitting_grasps, object_cells
from policies.data import PolicyFrames
from policies.module import GraspPolicyModule

SURFACE_RANGE_M = 0.08  # colour scale of the surface images


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--frames", type=int, nargs="+", default=[0, 97, 194, 388])
    ap.add_argument("--out", default="docs/images/policy_surface.png")
    args = ap.parse_args()

    module = GraspPolicyModule.load_from_checkpoint(args.checkpoint, map_location="cpu").eval()
    view = NetworkView.from_dict(module.hparams["view"])
    if not view.is_table:
        raise SystemExit("the checkpoint's view is not a top-down (table) view")
    frames = PolicyFrames(args.dataset, view=view, angle_bins=module.angle_bins, indices=args.frames)
    px_m = 1.0 / float(np.linalg.norm(view.K[0, :2]))

    def up(img: np.ndarray) -> np.ndarray:
        return cv2.resize(img, None, fx=3, fy=3, interpolation=cv2.INTER_NEAREST)

    def heights(s: np.ndarray) -> np.ndarray:
        grey = (np.clip(s / SURFACE_RANGE_M, 0, 1) * 255).astype(np.uint8)
        return up(np.ascontiguousarray(cv2.applyColorMap(grey, cv2.COLORMAP_VIRIDIS)[..., ::-1]))

    def mask(m: np.ndarray) -> np.ndarray:
        return up(np.repeat((m * 255).astype(np.uint8)[..., None], 3, axis=2))

    rows = []
    for i in range(len(frames)):
        item = frames[i]
        with torch.no_grad():
            predicted = module.net(item["image"][None])["surface"][0, 0].numpy()
        seen = np.where(item["surface_weight"].numpy() > 0, item["surface_target"].numpy(), 0).astype(np.float32)
        fits_seen = fitting_grasps(seen, px_m, module.angle_bins, object_cells(seen)).fits.any(0)
        fits_pred = fitting_grasps(predicted, px_m, module.angle_bins, object_cells(predicted)).fits.any(0)
        cells = [up(item["view_rgb"].numpy()), heights(seen), heights(predicted), mask(fits_seen), mask(fits_pred)]
        names = ["view (sim)", "surface seen (depth)", "surface predicted", "rule fits: seen", "rule fits: predicted"]
        rows.append([label_image(c, n) for c, n in zip(cells, names)])
    write_image(args.out, panel(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
