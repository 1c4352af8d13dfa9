"""Benchmark of the grasp policy's inference: onnxruntime against torch on the same input.

    .venv/bin/python benchmarks/policy.py [--artifact DIR | --checkpoint policy.ckpt] [--n 100] [--threads 1]

Times the network's forward pass on one ``(1, 3, H, W)`` input (ms per frame, median and
p90 after a warm-up), with onnxruntime (the artifact, as the service runs it) and with
torch (the same weights), at the same thread count, and checks that both give the same
maps. With ``--artifact`` the torch network is rebuilt from the artifact's ``training``
config and the checkpoint beside it (``ARTIFACT/../policy.ckpt``) when there is one; without
either option an untrained default ``GraspNet`` is exported to a temporary folder (speed
does not depend on the weights). Also times preprocessing (raw frame -> view) and the decode.
Short by design: about ten seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from perception.core.artifact import PolicyRunner  # noqa: E402
from perception.core.calibration import Calibration, default_calibration_path  # noqa: E402
from perception.core.decode import decode_grasp  # noqa: E402
from perception.core.geometry import NetworkView, network_view  # noqa: E402


def _time(fn, n: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(1000.0 * (time.perf_counter() - t))
    return out


def _stats(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"median_ms": statistics.median(s), "p90_ms": s[int(0.9 * (len(s) - 1))], "n": len(s)}


def _network_and_artifact(args: argparse.Namespace) -> tuple:
    """The torch network and its artifact: from ``--checkpoint`` (exported to a temporary
    folder), ``--artifact`` (its ``policy.ckpt`` beside it) or a fresh network; and the
    temporary folder to clean up (``None`` when there is none)."""
    from policies.export import export_artifact  # lazy: torch (after --help)
    from policies.module import GraspPolicyModule  # lazy: lightning via policies.module (after --help)
    from policies.networks import GraspNet  # lazy: torch (after --help)

    tmp = None
    if args.checkpoint is not None:
        module = GraspPolicyModule.load_from_checkpoint(args.checkpoint, map_location="cpu")
        net = module.net.eval()
        calib = Calibration.from_dict(module.hparams["calibration"], check_view=False)
        view = NetworkView.from_dict(module.hparams["view"])
        tmp = tempfile.TemporaryDirectory()
        artifact = export_artifact(net, view, calib, module.hparams["config"]["policy"], Path(tmp.name) / "artifact")
    elif args.artifact is not None:
        artifact = args.artifact
        ckpt = artifact.parent / "policy.ckpt"
        if not ckpt.is_file():
            raise SystemExit(f"no {ckpt} beside the artifact: pass --checkpoint to compare with torch")
        net = GraspPolicyModule.load_from_checkpoint(ckpt, map_location="cpu").net.eval()
    else:
        calib = Calibration.load(default_calibration_path())
        view = network_view(calib, (128, 128))
        net = GraspNet(angle_bins=12, base_channels=16).eval()
        tmp = tempfile.TemporaryDirectory()
        artifact = export_artifact(net, view, calib, {"quality_threshold": 0.5}, Path(tmp.name) / "artifact")
    return net, artifact, tmp


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=None)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch  # lazy: torch (after --help)

    from policies.networks import ExportWrapper, count_parameters  # lazy: torch (after --help)

    torch.set_num_threads(args.threads)

    net, artifact, tmp = _network_and_artifact(args)
    runner = PolicyRunner(artifact, intra_op_num_threads=args.threads)
    W, H = runner.meta.input_size
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (runner.calib.height, runner.calib.width, 3), dtype=np.uint8)
    view_rgb = runner.preprocess(raw)
    x = runner.to_input(view_rgb)
    # The exported graph, as the artifact's training config built it (mirror average or not).
    flip = bool(runner.meta.raw.get("training", {}).get("config", {}).get("flip_average", False))
    wrapper = ExportWrapper(net, flip).eval()
    xt = torch.from_numpy(x)

    def torch_forward():
        with torch.inference_mode():
            return wrapper(xt)

    ort_ms = _time(lambda: runner.forward(x), args.n)
    torch_ms = _time(torch_forward, args.n)
    onnx_out = runner.forward(x)
    torch_out = [t.numpy() for t in torch_forward()]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(onnx_out, torch_out))
    q, w, h, *surface = onnx_out
    surface_map = surface[0][0, 0] if surface else None
    pre_ms = _time(lambda: runner.preprocess(raw), args.n)
    # The decode alone, timed on maps already computed (PolicyRunner.decide would time the graph too).
    every = runner.meta.decode_options.replace(threshold=0.0)
    dec_ms = _time(lambda: decode_grasp(q[0], w[0, 0], h[0, 0], runner.calib, runner.view, every, surface=surface_map),
                   args.n)
    result = {
        "input": [1, 3, H, W],
        "parameters": count_parameters(net),
        "threads": args.threads,
        "flip_average": flip,
        "onnxruntime": _stats(ort_ms),
        "torch": _stats(torch_ms),
        "preprocess": _stats(pre_ms),
        "decode": _stats(dec_ms),
        "max_abs_diff": diff,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch_version": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    o, t = result["onnxruntime"]["median_ms"], result["torch"]["median_ms"]
    print(f"policy forward {W}x{H}: onnxruntime {o:.2f} ms, torch {t:.2f} ms per frame "
          f"({args.threads} thread(s)); max |diff| {diff:.1e}")
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
