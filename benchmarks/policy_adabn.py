"""An artifact whose policy graph has BatchNorm statistics of the cell's own frames (AdaBN).

    .venv/bin/python benchmarks/policy_adabn.py --stage OUT/stages/policy-HASH --artifact OUT/artifact \\
        --real REAL_DIR --calibration CAL.json --out DIR [--mix 1.0]

AdaBN (Li et al. 2016): every BatchNorm layer of the policy network (the pipeline's policy
stage's ``policy.ckpt``, its config from the stage's ``stage.json``) gets the running mean and
variance of the real frames (each and its mirror image, in the policy's view, normalised as
the service normalises them), ``mix`` of them and ``1 - mix`` of the trained ones. The policy
graph is exported again into a copy of ``--artifact`` (its other files as they are; the int8
graphs are dropped, so both graphs run in float: compare it with ``--mix 0``, the same copy
without the change). ``benchmarks/variants.py --run K:DIR`` then measures it in the cell
(``DIR`` holds ``artifact/`` and ``calibration.json``: give ``--out DIR/artifact``).
Measured: docs/experiments/2026-12-07-policy-adabn.md (not shipped).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) in sys.path:  # benchmarks/adaptation.py must not shadow adaptation/
    sys.path.remove(str(Path(__file__).resolve().parent))
from adaptation.images import RealFrames  # noqa: E402
from perception.core.artifact import file_sha256, load_metadata, write_metadata  # noqa: E402
from perception.core.calibration import Calibration  # noqa: E402
from perception.core.preprocess import preprocess, to_network_input  # noqa: E402
from policies.export import export_onnx  # noqa: E402
from policies.module import GraspPolicyModule  # noqa: E402
from policies.networks import with_batchnorm_statistics  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=Path, required=True, help="the pipeline's stages/policy-HASH folder")
    ap.add_argument("--artifact", type=Path, required=True, help="the artifact served with that policy")
    ap.add_argument("--real", type=Path, required=True, help="the cell's real frames (the pipeline's real_dir)")
    ap.add_argument("--calibration", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mix", type=float, default=1.0, help="share of the real frames' statistics (0: unchanged)")
    args = ap.parse_args(argv)

    pcfg = json.loads((args.stage / "stage.json").read_text())["payload"]["policy"]
    meta = load_metadata(args.artifact)
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(args.artifact, args.out)
    raw = json.loads((args.out / "metadata.json").read_text())
    for name in ("policy.int8.onnx", "geometry.int8.onnx"):
        (args.out / name).unlink(missing_ok=True)
    raw.pop("int8", None)
    if raw.get("geometry"):
        raw["geometry"].pop("int8", None)
    if args.mix > 0:
        module = GraspPolicyModule(network=pcfg["network"])
        module.load_state_dict(torch.load(str(args.stage / "policy.ckpt"), map_location="cpu",
                                          weights_only=True)["state_dict"])
        calib = Calibration.load(args.calibration)
        frames = RealFrames(args.real, calib)
        views = np.stack([preprocess(frames[i], calib, meta.view) for i in range(len(frames))])
        x = torch.from_numpy(to_network_input(views, meta.mean, meta.std))
        net = with_batchnorm_statistics(module.net, torch.cat([x, torch.flip(x, dims=[3])]), args.mix, batch=50)
        layers = sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
        export_onnx(net, args.out / "policy.onnx", tuple(meta.view.size), bool(pcfg.get("flip_average")))
        raw["onnx_sha256"] = file_sha256(args.out / "policy.onnx")
        raw.setdefault("training", {})["adabn"] = {"frames": len(frames), "mix": args.mix, "layers": layers}
    write_metadata(args.out, raw)
    print(json.dumps({"artifact": str(args.out), "mix": args.mix}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
