"""Two cheap ways to meet the user's camera without training, measured on labelled cells:
BatchNorm statistics recomputed on the cell's unlabelled frames (AdaBN, Li et al. 2016) and
each frame given the sim views' low-frequency Fourier amplitude (FDA, Yang and Soatto 2020,
here at test time).

    .venv/bin/python benchmarks/geometry_tta.py --cell DIR --frames DIR [--cell DIR --frames DIR ...]
        --sim-views GEOMETRY_DATA [--geometry geometry_base_v2] [--alphas 0,0.5,1] [--betas 0,0.01,0.03,0.06]
        [--free-steps 150] [--cut-paste-scenes 256 [--cut-paste-steps 400] [--raw-sim]] [--work DIR]

``--cell DIR`` is a labelled cell as ``benchmarks/geometry.py --cell`` reads it; ``--frames
DIR`` (one per ``--cell``, in order) the same cell's unlabelled frames written with another
seed (``make_real_frames.py --out DIR --seed 0``): AdaBN's statistics come from them, never
from the frames measured. ``--sim-views`` is a geometry data folder (its shards' camera
views) whose mean amplitude spectrum FDA gives each real view within ``beta`` of the
spectrum's centre (a fraction of the shorter side). ``alpha`` mixes the sim statistics
(0) with the real ones (1). ``--free-steps N`` also fine-tunes N steps on the frames' free
labels (:func:`free_labels`: table and bin floor at height 0 where nothing changed; every
other pixel held to the network's own prediction). ``--cut-paste-scenes N`` fine-tunes on sim
parts rendered through the cell's own calibration and pasted onto its background
(:func:`cut_paste_finetune`; ``--raw-sim``: on the sim views as rendered, the control). Prints one line per cell and setting,
then one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: benchmarks/adaptation.py must not shadow adaptation/

import geometry as G  # noqa: E402  (benchmarks/geometry.py: the same cells, network and scores)

from perception.core.geometry import view_pixels_to_base  # noqa: E402
from perception.core.imageio import read_image, write_image  # noqa: E402
from perception.core.preprocess import preprocess, to_network_input  # noqa: E402
from policies.geometry_data import read_geometry_shard  # noqa: E402
from policies.networks import with_batchnorm_statistics  # noqa: E402

SIM_VIEWS = 512  # sim views averaged into the amplitude spectrum
ADAPT_BATCH = 16


def free_labels(views: np.ndarray, calib, view, wall_m: float = 0.06, margin_m: float = 0.01,
                outside_m: float = 0.05, change: float = 0.08) -> np.ndarray:
    """``(N, H, W)`` bool: the pixels a cell's own frames label "height 0, no part" for free.

    A pixel's ray meets the table plane and the plane ``wall_m`` above it (the contract's
    tallest wall) both inside the workspace less ``margin_m`` (it looks into the bin through
    its open top, never at a wall) or both beyond the workspace plus ``outside_m`` (the table
    past any wall); and the frame there differs from the frames' per-pixel median by under
    ``change`` (0-1, the channels' mean): nothing stands there in this frame.
    """
    W, H = view.size
    uu, vv = np.meshgrid(np.arange(W, dtype=np.float64), np.arange(H, dtype=np.float64))
    uv = np.stack([uu.ravel(), vv.ravel()], 1)
    low = view_pixels_to_base(uv, calib, view, calib.table_z)[:, :2]
    high = view_pixels_to_base(uv, calib, view, calib.table_z + wall_m)[:, :2]
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y

    def inside(p: np.ndarray, d: float) -> np.ndarray:
        return (p[:, 0] > x0 + d) & (p[:, 0] < x1 - d) & (p[:, 1] > y0 + d) & (p[:, 1] < y1 - d)

    region = ((inside(low, margin_m) & inside(high, margin_m))
              | (~inside(low, -outside_m) & ~inside(high, -outside_m))).reshape(H, W)
    x = views.astype(np.float32) / 255.0
    unchanged = np.abs(x - np.median(x, axis=0)).mean(-1) < change
    return unchanged & region[None]


def free_label_finetune(net: torch.nn.Module, images: torch.Tensor, labelled: np.ndarray, steps: int,
                        lr: float = 1e-4, batch: int = 8, seed: int = 0) -> torch.nn.Module:
    """A copy of ``net`` fine-tuned on the free labels: height 0 and no part where ``labelled``;
    every other pixel held to ``net``'s own prediction (the sim-trained network is the anchor).
    BatchNorm statistics stay the sim ones (AdaBN did not help)."""
    with torch.no_grad():
        ref = net.eval()(images)
    ref_h, ref_p = ref["height"], torch.sigmoid(ref["object_logits"])
    lab = torch.from_numpy(labelled)[:, None].float()
    tuned = copy.deepcopy(net).eval()
    opt = torch.optim.AdamW(tuned.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _step in range(steps):
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        out = tuned(images[idx])
        m, rest = lab[idx], 1 - lab[idx]
        h, logit = out["height"], out["object_logits"]

        def mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x * w).sum() / w.sum().clamp_min(1)

        free = 20 * mean(F.smooth_l1_loss(h, torch.zeros_like(h), reduction="none", beta=0.01), m) \
            + mean(F.binary_cross_entropy_with_logits(logit, torch.zeros_like(logit), reduction="none"), m)
        anchor = 20 * mean(F.smooth_l1_loss(h, ref_h[idx], reduction="none", beta=0.01), rest) \
            + mean(F.binary_cross_entropy_with_logits(logit, ref_p[idx], reduction="none"), rest)
        opt.zero_grad()
        (free + anchor).backward()
        opt.step()
    return tuned.eval()


def render_cell_sim(calib, gdata: dict, out_dir: Path, scenes: int, workers: int, seed: int = 777) -> dict[str, np.ndarray]:
    """``scenes`` randomized sim scenes seen through the cell's own calibration, two looks each, in the
    geometry network's view: ``view_rgb``, ``height`` (NaN where unknown), ``object``. Resumable."""
    from omegaconf import OmegaConf  # lazy: only the cut-and-paste mode renders

    from policies.geometry_data import render_geometry_data  # lazy: pybullet (only to render)
    from sim_render.api import render_config  # lazy: hydra and pybullet (only to render)

    render_cfg = OmegaConf.to_container(render_config(out_dir / "render", 1, "randomized", 0, None, []).render,
                                        resolve=True)
    gcfg = {"view_size": list(gdata["view_size"]), "margin": float(gdata["margin"])}
    render_geometry_data(out_dir / "sim", calib, [calib], render_cfg, gcfg, scenes, seed=seed, frames_per_mount=2,
                         scenes_per_shard=32, workers=workers)
    shards = [read_geometry_shard(p) for p in sorted((out_dir / "sim" / "shards").glob("geo-*.npz"))]
    return {k: np.concatenate([sh[k] for sh in shards]) for k in ("view_rgb", "height", "object")}


def cut_paste_finetune(net: torch.nn.Module, real_images: torch.Tensor, real_views: np.ndarray, free: np.ndarray,
                       sim: dict[str, np.ndarray], steps: int, raw: bool = False, lr: float = 1e-4,
                       seed: int = 0) -> tuple[torch.nn.Module, np.ndarray]:
    """A copy of ``net`` fine-tuned on sim parts pasted onto the cell's own background.

    The background is the real views' per-pixel median (parts move, the bin stays); each sim
    view's part pixels (``object``) are pasted onto it, with their sim heights and mask as labels,
    and the background's pixels labelled height 0, no part where the free labels ever saw the
    floor or table (``free``, :func:`free_labels`); walls and the rest carry no label. Each step
    takes 4 such composites and 4 real views, the real ones held to ``net``'s own predictions.
    ``raw``: the sim views as rendered instead (every known pixel labelled): the control that
    tells the cell's background from more sim training through the cell's camera. Returns the
    tuned network and the first composites (for a look).
    """
    height = np.asarray(sim["height"], dtype=np.float32)
    part = np.asarray(sim["object"], dtype=bool)
    background = np.median(real_views, axis=0).astype(np.uint8)
    if raw:
        images, known = sim["view_rgb"], ~np.isnan(height)
        target = np.nan_to_num(height, nan=0.0)
    else:
        images = np.where(part[..., None], sim["view_rgb"], background[None])
        known = (part & ~np.isnan(height)) | (free.any(axis=0)[None] & ~part)
        target = np.where(part, np.nan_to_num(height, nan=0.0), 0.0).astype(np.float32)
    x_sim = torch.from_numpy(np.concatenate([to_network_input(v) for v in images]))
    known_t = torch.from_numpy(known)[:, None].float()
    height_t = torch.from_numpy(target)[:, None]
    part_t = torch.from_numpy(part)[:, None].float()
    with torch.no_grad():
        ref = net.eval()(real_images)
    ref_h, ref_p = ref["height"], torch.sigmoid(ref["object_logits"])
    tuned = copy.deepcopy(net).eval()  # BatchNorm statistics stay the sim ones
    opt = torch.optim.AdamW(tuned.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _step in range(steps):
        i_sim = torch.randint(0, len(x_sim), (4,), generator=gen)
        i_real = torch.randint(0, len(real_images), (4,), generator=gen)
        out_sim, out_real = tuned(x_sim[i_sim]), tuned(real_images[i_real])
        w = known_t[i_sim] * (1.0 + 3.0 * part_t[i_sim])  # part pixels weigh 4x, as in the base's training
        h_loss = (F.smooth_l1_loss(out_sim["height"], height_t[i_sim], reduction="none", beta=0.01) * w).sum() \
            / w.sum().clamp_min(1)
        p_loss = (F.binary_cross_entropy_with_logits(out_sim["object_logits"], part_t[i_sim], reduction="none")
                  * known_t[i_sim]).sum() / known_t[i_sim].sum().clamp_min(1)
        anchor = 20 * F.smooth_l1_loss(out_real["height"], ref_h[i_real], beta=0.01) \
            + F.binary_cross_entropy_with_logits(out_real["object_logits"], ref_p[i_real])
        opt.zero_grad()
        (20 * h_loss + p_loss + anchor).backward()
        opt.step()
    return tuned.eval(), np.asarray(images[:4])


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
    ap.add_argument("--free-steps", type=int, default=0,
                    help="also fine-tune this many steps on the frames' free labels (0: not)")
    ap.add_argument("--cut-paste-scenes", type=int, default=0,
                    help="also fine-tune on sim parts pasted onto the cell's background: this many sim scenes "
                         "rendered through the cell's calibration (0: not)")
    ap.add_argument("--cut-paste-steps", type=int, default=400)
    ap.add_argument("--raw-sim", action="store_true", help="with --cut-paste-scenes: the sim views as rendered (the control)")
    ap.add_argument("--work", type=Path, default=Path("outputs/geometry_tta"),
                    help="where the cells' sim renders go (reused by a later run)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    if len(args.cell) != len(args.frames):
        ap.error("give one --frames DIR for each --cell DIR")
    for frames_dir in args.frames:
        if not frames_dir.is_dir() or not any(p.suffix.lower() in G.FRAME_SUFFIXES for p in frames_dir.iterdir()):
            ap.error(f"--frames {frames_dir}: not a folder of PNG or JPEG frames (make_real_frames.py --out DIR: DIR/real)")
    try:
        cells = [G.load_cell(d) for d in args.cell]  # every folder checked before anything runs
    except G.CellError as exc:
        ap.error(str(exc))
    shards = sorted((args.sim_views / "shards").glob("geo-*.npz"))
    if not shards:
        ap.error(f"--sim-views {args.sim_views}: no geometry data shards")
    sim_views, k = [], 0
    while sum(len(v) for v in sim_views) < SIM_VIEWS and k < len(shards):
        sim_views.append(read_geometry_shard(shards[k])["view_rgb"])
        k += 1
    sim = np.concatenate(sim_views)[:SIM_VIEWS].astype(np.float32) / 255.0
    geom = AdaptedGeometry(args.geometry)
    geom.sim_amplitude = np.fft.fftshift(np.abs(np.fft.fft2(sim, axes=(1, 2))).mean(0), axes=(0, 1))
    base = geom.net.eval()
    result = {}
    for cell_dir, frames_dir, cell in zip(args.cell, args.frames, cells):
        files = sorted(p for p in frames_dir.iterdir() if p.suffix.lower() in G.FRAME_SUFFIXES)
        views = np.stack([preprocess(read_image(f), cell.calib, geom.view(cell.calib)) for f in files])
        real = torch.from_numpy(np.concatenate([to_network_input(v) for v in views]))
        settings = [("adabn", a) for a in (float(x) for x in args.alphas.split(","))] + \
                   [("fda", b) for b in (float(x) for x in args.betas.split(",")) if b > 0] + \
                   ([("free", float(args.free_steps))] if args.free_steps > 0 else []) + \
                   ([("raw-sim" if args.raw_sim else "cut-paste", float(args.cut_paste_steps))]
                    if args.cut_paste_scenes > 0 else [])
        for kind, value in settings:
            if kind in ("cut-paste", "raw-sim"):
                sim = render_cell_sim(cell.calib, geom.data, args.work / cell_dir.name, args.cut_paste_scenes,
                                      args.workers)
                geom.net, shown = cut_paste_finetune(base, real, views, free_labels(views, cell.calib, geom.view(cell.calib)),
                                                     sim, int(value), raw=kind == "raw-sim")
                write_image(args.work / cell_dir.name / f"{kind}_examples.png", np.concatenate(list(shown), axis=1))
            elif kind == "free":
                geom.net = free_label_finetune(base, real, free_labels(views, cell.calib, geom.view(cell.calib)),
                                               int(value))
            else:
                geom.net = with_batchnorm_statistics(base, real, value, ADAPT_BATCH) if kind == "adabn" and value > 0 else base
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
