"""Two cheap ways to meet the user's camera without training, measured on labelled cells:
BatchNorm statistics recomputed on the cell's unlabelled frames (AdaBN, Li et al. 2016) and
each frame given the sim views' low-frequency Fourier amplitude (FDA, Yang and Soatto 2020,
here at test time).

    .venv/bin/python benchmarks/geometry_tta.py --cell DIR --frames DIR [--cell DIR --frames DIR ...]
        --sim-views GEOMETRY_DATA [--geometry geometry_base_v2] [--alphas 0,0.5,1] [--betas 0,0.01,0.03,0.06]

``--cell DIR`` is a labelled cell as ``benchmarks/geometry.py --cell`` reads it; ``--frames
DIR`` (one per ``--cell``, in order) the same cell's unlabelled frames written with another
seed (``make_real_frames.py --out DIR --seed 0``): AdaBN's statistics come from them, never
from the frames measured. ``--sim-views`` is a geometry data folder (its shards' camera
views) whose mean amplitude spectrum FDA gives each real view within ``beta`` of the
spectrum's centre (a fraction of the shorter side). ``alpha`` mixes the sim statistics
(0) with the real ones (1). Prints one line per cell and setting, then one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

import geometry as G  # noqa: E402  (benchmarks/geometry.py: the same cells, network and scores)

from perception.core.imageio import read_image  # noqa: E402
from perception.core.preprocess import preprocess, to_network_input  # noqa: E402
from policies.geometry_data import read_geometry_shard  # noqa: E402

SIM_VIEWS = 512  # sim views averaged into the amplitude spectrum
ADAPT_BATCH = 16


def adabn(net: torch.nn.Module, views: torch.Tensor, alpha: float) -> torch.nn.Module:
    """A copy of ``net`` whose BatchNorm running statistics are ``(1 - alpha) * sim + alpha * real``."""
    real = copy.deepcopy(net)
    norms = [m for m in real.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a plain average over every batch
    real.train()
    with torch.no_grad():
        for i in range(0, len(views), ADAPT_BATCH):
            real(views[i:i + ADAPT_BATCH])
    out = copy.deepcopy(net).eval()
    for mine, theirs in zip([m for m in out.modules() if isinstance(m, torch.nn.BatchNorm2d)], norms):
        mine.running_mean.mul_(1 - alpha).add_(alpha * theirs.running_mean)
        mine.running_var.mul_(1 - alpha).add_(alpha * theirs.running_var)
    return out


def fda(rgb: np.ndarray, sim_amplitude: np.ndarray, beta: float) -> np.ndarray:
    """``rgb`` with the centre of its amplitude spectrum (half-size ``beta`` x the shorter side) from the sim views."""
    f = np.fft.fftshift(np.fft.fft2(rgb.astype(np.float32) / 255.0, axes=(0, 1)), axes=(0, 1))
    amp, phase = np.abs(f), np.angle(f)
    h, w = rgb.shape[:2]
    b, cy, cx = max(1, int(min(h, w) * beta)), h // 2, w // 2
    amp[cy - b:cy + b + 1, cx - b:cx + b + 1] = sim_amplitude[cy - b:cy + b + 1, cx - b:cx + b + 1]
    out = np.fft.ifft2(np.fft.ifftshift(amp * np.exp(1j * phase), axes=(0, 1)), axes=(0, 1)).real
    return np.clip(out * 255.0, 0, 255).astype(np.uint8)


class AdaptedGeometry(G.TorchGeometry):
    """``benchmarks/geometry.py``'s torch geometry, its view FDA-mapped when ``beta`` > 0."""

    beta, sim_amplitude = 0.0, None

    @torch.no_grad()
    def predict(self, raw_rgb, calib):
        view = preprocess(raw_rgb, calib, self.view(calib))
        if self.beta > 0:
            view = fda(view, self.sim_amplitude, self.beta)
        o = self.net(torch.from_numpy(to_network_input(view)))
        return o["height"][0, 0].numpy(), torch.sigmoid(o["object_logits"][0, 0]).numpy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cell", type=Path, action="append", required=True)
    ap.add_argument("--frames", type=Path, action="append", required=True)
    ap.add_argument("--sim-views", type=Path, required=True)
    ap.add_argument("--geometry", default="geometry_base_v2")
    ap.add_argument("--alphas", default="0,0.5,1")
    ap.add_argument("--betas", default="0,0.01,0.03,0.06")
    args = ap.parse_args()
    if len(args.cell) != len(args.frames):
        ap.error("give one --frames DIR for each --cell DIR")
    shards = sorted((args.sim_views / "shards").glob("geo-*.npz"))
    if not shards:
        ap.error(f"--sim-views {args.sim_views}: no geometry data shards")
    views, k = [], 0
    while sum(len(v) for v in views) < SIM_VIEWS and k < len(shards):
        views.append(read_geometry_shard(shards[k])["view_rgb"])
        k += 1
    sim = np.concatenate(views)[:SIM_VIEWS].astype(np.float32) / 255.0
    geom = AdaptedGeometry(args.geometry)
    geom.sim_amplitude = np.fft.fftshift(np.abs(np.fft.fft2(sim, axes=(1, 2))).mean(0), axes=(0, 1))
    base = geom.net.eval()
    result = {}
    for cell_dir, frames_dir in zip(args.cell, args.frames):
        cell = G.load_cell(cell_dir)
        files = sorted(p for p in frames_dir.iterdir() if p.suffix.lower() in G.FRAME_SUFFIXES)
        real = torch.from_numpy(np.concatenate(
            [to_network_input(preprocess(read_image(f), cell.calib, geom.view(cell.calib))) for f in files]))
        settings = [("adabn", a) for a in (float(x) for x in args.alphas.split(","))] + \
                   [("fda", b) for b in (float(x) for x in args.betas.split(",")) if b > 0]
        for kind, value in settings:
            geom.net = adabn(base, real, value) if kind == "adabn" and value > 0 else base
            geom.beta = value if kind == "fda" else 0.0
            s = G.scores(G.measure_cell(geom, cell))
            key = f"{cell_dir.name} {kind}={value:g}"
            result[key] = {k: s[k] for k in ("part_median_mm", "part_p90_mm", "part_within_5mm", "part_iou",
                                              "rest_p90_mm", "frames")}
            print(f"{key} ({len(files)} unlabelled frames): parts {s['part_median_mm']:.1f} / {s['part_p90_mm']:.1f} mm, "
                  f"{s['part_within_5mm']:.1%} within 5 mm, IoU {s['part_iou']:.3f}, rest p90 {s['rest_p90_mm']:.1f} mm",
                  flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
