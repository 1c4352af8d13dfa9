"""The geometry network's fine-tune on what the robot measured, judged on the recording's own held-out stops.

    .venv/bin/python benchmarks/stops.py --run RUN_DIR --recording REC [--recording REC ...] \
        [--steps 160] [--set key=value ...]

``RUN_DIR`` is a ``sim2real-pipeline`` output_dir, ``REC`` the recording its artifact made with
outcomes that carry ``contact_stop``/``fingertip_z``/``jaw_width`` (a validation cell's
``run_all.sh FINETUNE=1`` leaves both). The attempts are split as ``sim2real-finetune`` splits
them (``finetune.check_fraction``, ``finetune.guard_attempts``); the run's geometry network is
fine-tuned on the training block's labels beside the run's sim frames for ``--steps`` steps
(a step count, not a time, so that runs compare on a busy machine), with ``finetune.geometry``'s
settings and ``--set`` overrides of them (``label_weight=0.3``, ``optim.lr=1e-4``,
``between_weight=1.0`` to use the part-between-the-pads labels). Before and after, the planning surface (the
rebuilt top-down surface the decode plans on, float graphs) is read under the footprints of each
attempt and compared with what was measured (:func:`policies.stops.stop_errors`), on the check
block and on the training block. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the packages before benchmarks/ (its adaptation.py)

from perception.core.artifact import PolicyRunner  # noqa: E402
from perception.core.calibration import Calibration  # noqa: E402
from perception.core.geometry import SurfaceRebuild  # noqa: E402
from perception.core.imageio import read_image  # noqa: E402
from perception.core.preprocess import preprocess, to_network_input  # noqa: E402
from policies.finetune import (  # noqa: E402
    FinetuneError,
    finetune_run_geometry,
    load_labelled_attempts,
    rebased_run,
    split_blocks,
)
from policies.geometry import GEOMETRY_FORMAT, geometry_net  # noqa: E402
from policies.stops import stop_errors, stop_label, surface_at_stops  # noqa: E402
from policies.weights import load_base  # noqa: E402
from sim_render.api import compose_config  # noqa: E402


def _judge(net: torch.nn.Module, block: tuple[list, list], runner: PolicyRunner, rebuild: SurfaceRebuild,
           calib: Calibration, g: dict) -> dict:
    gm = runner.meta.geometry
    highest, labels = [], []
    with torch.no_grad():
        for label, view_rgb in zip(*block):
            if label is None:
                continue
            o = net(torch.from_numpy(to_network_input(view_rgb, gm.mean, gm.std)))
            part = torch.sigmoid(o["object_logits"][0, 0]).numpy() >= gm.part_threshold
            surface, _ = rebuild(o["height"][0, 0].numpy(), part)
            highest.append(surface_at_stops(surface, runner.view, calib, label, float(g["footprint_step_m"])))
            labels.append(label)
    return stop_errors(highest, labels, float(g["tolerance_m"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="a sim2real-pipeline output_dir")
    ap.add_argument("--recording", required=True, action="append", help="a recording with measured outcomes")
    ap.add_argument("--steps", type=int, default=160, help="fine-tune steps (default 160)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a finetune.geometry setting (optim.lr=1e-4, label_weight=0.3, between_weight=1.0)")
    ap.add_argument("--out", type=Path, default=None, help="where the fine-tuned network goes (default: RUN/stops_benchmark)")
    args = ap.parse_args(argv)
    report_path = args.run / "report.json"
    if not report_path.is_file():
        print(f"--run {args.run}: no report.json there (not a sim2real-pipeline output_dir)", file=sys.stderr)
        return 2
    cfg = compose_config("finetune", [f"finetune.geometry.{kv}" for kv in args.set])
    g = OmegaConf.to_container(cfg.finetune.geometry, resolve=True)
    g.update({"max_steps": int(args.steps), "max_time_s": None})
    run = rebased_run(json.loads(report_path.read_text()), args.run)  # a run folder moved or copied
    calib = Calibration.load(run["calibration"])
    try:
        attempts = load_labelled_attempts(args.recording, calib)
    except FinetuneError as exc:
        print(f"--recording: {exc}", file=sys.stderr)
        return 2
    train_idx, check_idx = split_blocks(len(attempts), float(cfg.finetune.check_fraction),
                                        int(cfg.finetune.guard_attempts))
    name = (run.get("policy_config") or run["config"]["policy"]).get("geometry")
    if not name:
        print(f"--run {args.run}: its policy has no geometry network", file=sys.stderr)
        return 2
    base = load_base(name, GEOMETRY_FORMAT)
    runner = PolicyRunner(run["artifact"], calib)
    gm = runner.meta.geometry
    rebuild = SurfaceRebuild(calib, gm.view, runner.view, gm.interior_margin, gm.floor_height, walls=gm.walls)
    rules = {"part_between_m": float(g["part_between_m"]), "closed_m": float(g["closed_m"])}

    def block(idx):
        att = [attempts[i] for i in idx]
        return ([stop_label(a["grasp"], a["outcome"], calib.table_z, **rules) for a in att],
                [preprocess(read_image(Path(a["_dir"]) / a["frame"]), calib, gm.view) for a in att])

    check, train = block(check_idx), block(train_idx)
    zero_shot = geometry_net(base)
    before = {"check": _judge(zero_shot, check, runner, rebuild, calib, g),
              "train": _judge(zero_shot, train, runner, rebuild, calib, g)}
    t0 = time.perf_counter()
    # sim2real-finetune's own geometry stage, on the training block.
    res = finetune_run_geometry(run, {"geometry": name}, [attempts[i] for i in train_idx], calib, OmegaConf.create(g),
                                args.out or args.run / "stops_benchmark", args.seed)
    if not res.get("path"):
        print(f"no geometry fine-tune: {res['reason']}", file=sys.stderr)
        return 2
    tuned = geometry_net(load_base(res["path"], GEOMETRY_FORMAT))
    after = {"check": _judge(tuned, check, runner, rebuild, calib, g),
             "train": _judge(tuned, train, runner, rebuild, calib, g)}
    for side in ("check", "train"):
        b, a = before[side], after[side]
        if not b["stops"]:
            print(f"{side}: no measured stop", file=sys.stderr)
            continue
        print(f"{side}: {b['stops']} stops, mean {b['stop_error_mean_mm']:.1f} -> {a['stop_error_mean_mm']:.1f} mm, "
              f"median {b['stop_error_median_mm']:.1f} -> {a['stop_error_median_mm']:.1f}, p90 "
              f"{b['stop_error_p90_mm']:.1f} -> {a['stop_error_p90_mm']:.1f}, signed median "
              f"{b['stop_error_signed_median_mm']:+.1f} -> {a['stop_error_signed_median_mm']:+.1f}; bound violations "
              f"{b['bound_violations']} -> {a['bound_violations']} of {b['bounds']}", file=sys.stderr)
    print(json.dumps({"before": before, "after": after, "trained": {**res, "wall_s": round(time.perf_counter() - t0, 1)},
                      "settings": {k: v for k, v in g.items()}, "attempts": {"train": len(train_idx),
                                                                             "check": len(check_idx)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
