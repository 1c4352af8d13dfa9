"""Benchmark of the sim->real translation (issue 3): speed, quality at equal wall-clock, content.

    .venv/bin/python benchmarks/adaptation.py                       # the full run (~50 min on 2 cores)
    .venv/bin/python benchmarks/adaptation.py --quick               # a smoke run of the script (~2 min)
    .venv/bin/python benchmarks/adaptation.py --minutes 10 --out outputs/benchmarks/adaptation

In one run, on the same machine, at the same resolution (the default view, 96x96, 64x64
training crops, batch 4):

1. speed: training images/s (full CycleGAN iterations: both generators, both discriminators)
   and inference ms/frame (batch 1, EMA generator) of the fast default against ``resnet9``;
2. quality at equal wall-clock: ``--minutes`` of training each on the same sim frames
   (randomized profile) and target stand-in frames (the ``target`` profile exported as PNG,
   a held-out split of them measures the distance): the best held-out SWD of adapted frames
   to real ones, beside raw sim's;
3. content: the probe's object IoU and instance recall on adapted frames of the fast default
   with and without the content loss (``content_pmse=0``), beside raw sim's;
4. the one-sided CUT-style variant (``adaptation=cut``) for the same wall-clock.

Writes ``OUT/results.json`` and ``OUT/adaptation.md`` (the table for ``docs/benchmarks.md``);
training runs are kept under ``OUT/runs/`` (panels, reports, checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adaptation.networks import build  # noqa: E402


def render_data(out: Path, sim_scenes: int, real_scenes: int, seed: int) -> tuple[Path, Path]:
    """Render (or reuse) the sim dataset and the target stand-in frames."""
    from sim_render.api import export_real_frames, render_dataset  # lazy: hydra via sim_render.api

    sim, target, real = out / "data" / "sim", out / "data" / "target", out / "data" / "real"
    t0 = time.perf_counter()
    render_dataset(sim, n_scenes=sim_scenes, profile="randomized", seed=seed)
    render_dataset(target, n_scenes=real_scenes, profile="target", seed=seed + 1000)
    if not real.is_dir() or not any(real.glob("*.png")):
        export_real_frames(target, real)
    print(f"[data] rendered/reused in {time.perf_counter() - t0:.0f} s: {sim}, {real}", flush=True)
    return sim, real


EXTRA: list[str] = []  # overrides added to every run (--quick shrinks the probe)


def run_train(sim: Path, real: Path, out: Path, overrides: list[str]) -> dict[str, Any]:
    from adaptation.train import compose_config, train  # lazy: lightning via adaptation.train

    cfg = compose_config(
        [f"sim_dir={sim}", f"real_dir={real}", f"output_dir={out}", "logger=csv", "trainer=cpu",
         "trainer.enable_progress_bar=false", *EXTRA, *overrides]
    )
    return train(cfg)


def speed(sim: Path, real: Path, out: Path, name: str, extra: list[str], steps: int, n_infer: int) -> dict[str, Any]:
    """Training images/s over ``steps`` iterations (no validation) and inference ms/frame."""
    rep = run_train(sim, real, out / "runs" / f"speed_{name}", [
        *extra, f"max_steps={steps}", "val_every_n_steps=1000000", "final_validation=false",
        "log_images_every_n_steps=0", "metrics.probe.steps=1",
    ])
    from omegaconf import OmegaConf  # lazy: omegaconf (only this step needs it)

    from adaptation.train import compose_config  # lazy: lightning via adaptation.train

    cfg = compose_config([*extra, "sim_dir=x", "real_dir=y"])
    spec = OmegaConf.to_container(cfg.adaptation.generator, resolve=True)
    g = build("generator", spec.pop("name"), **spec).eval()
    w, h = cfg.adaptation.image_size
    x = torch.rand(1, 3, h, w) * 2 - 1
    times = []
    with torch.no_grad():
        for i in range(n_infer + 2):
            t = time.perf_counter()
            g(x)
            if i >= 2:
                times.append((time.perf_counter() - t) * 1e3)
    res = {
        "generator": name,
        "parameters_G": rep["parameters"]["G_sim2real"],
        "parameters_D": rep["parameters"]["D_real"],
        "train_images_per_s": rep["train_images_per_s"],
        "train_steps": rep["steps"],
        "infer_ms_per_frame": statistics.median(times),
        "image_size": list(cfg.adaptation.image_size),
        "crop": list(cfg.adaptation.crop),
        "batch_size": int(cfg.adaptation.batch_size),
    }
    print(f"[speed] {json.dumps(res)}", flush=True)
    return res


def quality(sim: Path, real: Path, out: Path, name: str, extra: list[str], minutes: float, val_every: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    rep = run_train(sim, real, out / "runs" / f"quality_{name}", [
        *extra, "max_steps=100000000", f"max_time={minutes * 60:.0f}", f"val_every_n_steps={val_every}",
        f"log_images_every_n_steps={val_every}",
    ])
    res = {
        "run": name,
        "overrides": extra,
        "minutes": minutes,
        "steps": rep["steps"],
        "best_step": rep["best_step"],
        "train_images_per_s": rep["train_images_per_s"],
        "swd_adapted_real": rep["distance"]["adapted_real"],
        "swd_adapted_real_last": rep["distance"]["adapted_real_last"],
        "swd_sim_real": rep["distance"]["sim_real"],
        "swd_ratio": rep["distance"]["ratio"],
        "content_object_iou": rep["content"]["object_iou"],
        "content_instance_recall": rep["content"]["instance_recall"],
        "sim_object_iou": rep["content"]["sim_object_iou"],
        "sim_instance_recall": rep["content"]["sim_instance_recall"],
        "wall_s": time.perf_counter() - t0,
        "run_dir": str(out / "runs" / f"quality_{name}"),
    }
    print(f"[quality] {json.dumps(res)}", flush=True)
    return res


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(results: dict[str, Any]) -> str:
    s = results["speed"]
    fast, ref = s["fast"], s["resnet9"]
    lines = [
        "## Adaptation (issue 3): `benchmarks/adaptation.py`",
        "",
        f"Machine: {results['machine']}; torch threads {results['threads']}; view "
        f"{fast['image_size'][0]}x{fast['image_size'][1]}, crops {fast['crop'][0]}x{fast['crop'][1]}, batch {fast['batch_size']}; "
        f"data: {results['data']['sim_frames']} sim frames (randomized), {results['data']['real_frames']} target stand-in frames.",
        "",
        "| generator | params G | params D | train images/s | inference ms/frame |",
        "|---|---|---|---|---|",
    ]
    for r in (fast, ref):
        lines.append(
            f"| {r['generator']} | {r['parameters_G'] / 1e6:.2f}M | {r['parameters_D'] / 1e6:.2f}M | "
            f"{_f(r['train_images_per_s'], 2)} | {_f(r['infer_ms_per_frame'], 1)} |"
        )
    lines += [
        "",
        f"Speed-up of the fast default: training {s['train_speedup']:.1f}x, inference {s['infer_speedup']:.1f}x (goal: 10x both).",
        "",
        f"Quality after {results['minutes']:g} minutes of training each (SWD x1000 of 7x7 Laplacian-pyramid patches to held-out "
        "target frames, lower is better; content: probe trained on raw sim, on adapted frames):",
        "",
        "| run | iterations | best at | SWD adapted→real | SWD raw sim→real | ratio | object IoU | instance recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    q = results["quality"]
    first = next(iter(q.values()))
    lines.append(
        f"| raw sim (no translation) | - | - | - | {_f(first['swd_sim_real'])} | 1.00 | "
        f"{_f(first['sim_object_iou'], 3)} | {_f(first['sim_instance_recall'], 3)} |"
    )
    for name, r in q.items():
        lines.append(
            f"| {name} | {r['steps']} | {r['best_step']} | {_f(r['swd_adapted_real'])} | {_f(r['swd_sim_real'])} | "
            f"{_f(r['swd_ratio'], 2)} | {_f(r['content_object_iou'], 3)} | {_f(r['content_instance_recall'], 3)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "benchmarks" / "adaptation"))
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall-clock per quality run")
    ap.add_argument("--sim-scenes", type=int, default=120)
    ap.add_argument("--real-scenes", type=int, default=150, help="target stand-in scenes (one PNG frame each or more)")
    ap.add_argument("--speed-steps-fast", type=int, default=60)
    ap.add_argument("--speed-steps-resnet9", type=int, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny data and durations: checks that the script works")
    ap.add_argument("--skip", nargs="*", default=[], choices=["speed", "resnet9", "no_content", "cut"], help="parts to leave out")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.sim_scenes, args.real_scenes = 0.25, 3, 4
        args.speed_steps_fast, args.speed_steps_resnet9 = 4, 1
        EXTRA.append("metrics.probe.steps=20")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim, real = render_data(out, args.sim_scenes, args.real_scenes, args.seed)
    from sim_render.reader import SimFrameDataset  # lazy: cv2 via sim_render.reader

    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "threads": args.threads,
        "minutes": args.minutes,
        "data": {"sim_frames": len(SimFrameDataset(sim, fields=("rgb",))), "real_frames": len(list(real.glob("*.png")))},
        "quick": args.quick,
    }
    n_infer = 5 if args.quick else 30
    resnet9 = ["adaptation=cyclegan_resnet9"]
    if "speed" not in args.skip:
        sp = {"fast": speed(sim, real, out, "fast", [], args.speed_steps_fast, n_infer)}
        if "resnet9" not in args.skip:
            sp["resnet9"] = speed(sim, real, out, "resnet9", resnet9, args.speed_steps_resnet9, max(3, n_infer // 5))
            sp["train_speedup"] = sp["fast"]["train_images_per_s"] / sp["resnet9"]["train_images_per_s"]
            sp["infer_speedup"] = sp["resnet9"]["infer_ms_per_frame"] / sp["fast"]["infer_ms_per_frame"]
        results["speed"] = sp
    q: dict[str, Any] = {}
    q["fast (default)"] = quality(sim, real, out, "fast", [], args.minutes, 4 if args.quick else 150)
    if "no_content" not in args.skip:
        q["fast, no content loss"] = quality(
            sim, real, out, "fast_no_content", ["adaptation.loss.content_pmse=0"], args.minutes, 4 if args.quick else 150
        )
    if "cut" not in args.skip:
        q["fast, one-sided CUT"] = quality(sim, real, out, "cut", ["adaptation=cut"], args.minutes, 4 if args.quick else 300)
    if "resnet9" not in args.skip:
        q["resnet9"] = quality(sim, real, out, "resnet9", resnet9, args.minutes, 2 if args.quick else 15)
    results["quality"] = q
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if "speed" in results and "resnet9" in results["speed"]:
        md = markdown(results)
        (out / "adaptation.md").write_text(md)
        print(md)
    print(f"results in {out / 'results.json'}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
