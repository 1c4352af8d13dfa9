"""The pretrained policy base: ``sim2real-train-base`` and the shipped file it writes.

    sim2real-train-base output_dir=DIR [scenes_per_camera=N] [policy.max_time_s=S]

A ``budget=small`` pipeline trains its policy for 12 minutes on 480 scenes of one camera:
little data for what the policy must learn (the validation loss turns up within a few
hundred steps). The base is the same network trained once, far longer, on several times
more randomized scenes seen from several camera mounts (``conf/base.yaml``), only on the
project's own renders. The pipeline's policy stage starts from it (``policy.base``) and
fine-tunes it on the user's calibration for its usual time; both adaptation settings start
from the same base, and ``policy.base=null`` trains from scratch as before.

The file (``policies/bases/NAME.pt``, shipped as package data) holds the policy module's
``state_dict`` and the JSON-able ``config`` it was trained with, nothing pickled: it loads
with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from conf import to_plain
from perception.core.atomic import atomic_write
from perception.core.calibration import Calibration, CalibrationError, load_calibration
from perception.core.cli import run_hydra_command
from perception.core.jsonio import write_json
from policies.weights import BASE_FORMAT, BaseError

__all__ = ["camera_mount", "camera_mounts", "train_base", "render_geometry_base_data", "main"]

log = logging.getLogger("sim2real.base")

def camera_mount(calib: Calibration, azimuth_deg: float, elevation_deg: float, distance_scale: float) -> Calibration:
    """``calib`` with its camera moved around the point its optical axis meets the table.

    The camera keeps looking at that point, its image ``x`` axis level (as mounted cameras
    are); the offsets are added to its azimuth and elevation around the point and its
    distance is scaled. Intrinsics and workspace are unchanged.

    Raises:
        CalibrationError: the moved camera does not see the whole workspace.
    """
    T = calib.T_base_camera
    pos, axis = T[:3, 3], T[:3, 2]
    if axis[2] >= -1e-6:
        raise CalibrationError("the camera does not look down at the table")
    target = pos + axis * (calib.table_z - pos[2]) / axis[2]
    rel = pos - target
    dist = float(np.linalg.norm(rel)) * float(distance_scale)
    az = math.atan2(rel[1], rel[0]) + math.radians(azimuth_deg)
    el = math.asin(rel[2] / np.linalg.norm(rel)) + math.radians(elevation_deg)
    new_pos = target + dist * np.array([math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el)])
    z = (target - new_pos) / np.linalg.norm(target - new_pos)
    x = np.cross(z, [0.0, 0.0, 1.0])
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    T_new = np.eye(4)
    T_new[:3, :3] = np.stack([x, y, z], axis=1)
    T_new[:3, 3] = new_pos
    moved = calib.replace(T_base_camera=T_new)
    moved.check_workspace_visible(min_share=1.0)  # a mount the base trains on sees the whole workspace
    return moved


def camera_mounts(calib: Calibration, cameras: Any) -> list[Calibration]:
    """:func:`camera_mount` of every entry of ``conf/base.yaml``'s ``cameras``, in order."""
    return [camera_mount(calib, float(c["azimuth_deg"]), float(c["elevation_deg"]), float(c["distance_scale"]))
            for c in cameras]


def render_base_data(cfg: DictConfig, out: Path) -> list[Path]:
    """Render ``scenes_per_camera`` randomized scenes per camera mount into ``out/data/cam<i>``
    (resumable: ``sim2real-render`` skips finished shards)."""
    from sim_render.api import render_config  # lazy: sim_render's render command (the checks answer first)
    from sim_render.cli import render  # lazy: likewise

    calib = load_calibration()
    overrides = [f"scenes_per_shard={int(cfg.scenes_per_shard)}", f"render.frames_per_scene={int(cfg.frames_per_scene)}",
                 *(cfg.randomization.overrides if cfg.get("randomization") else [])]
    dirs = []
    for i, (cam, mount) in enumerate(zip(cfg.cameras, camera_mounts(calib, cfg.cameras))):
        calib_file = out / "cameras" / f"cam{i}.json"
        calib_file.parent.mkdir(parents=True, exist_ok=True)
        mount.save(calib_file)
        d = out / "data" / f"cam{i}"
        # Each mount gets its own block of scene seeds: no scene is rendered twice.
        seed = int(cfg.seed) + i * 100_000
        log.info("camera %d of %d (%s): %d scenes -> %s", i + 1, len(cfg.cameras), dict(cam),
                 int(cfg.scenes_per_camera), d)
        render(render_config(d, int(cfg.scenes_per_camera), "randomized", seed, calib_file, overrides,
                             int(cfg.workers)))
        dirs.append(d)
    return dirs


def train_base(cfg: DictConfig) -> dict:
    """Render the base's data, train what ``parts`` lists on it and write ``output_dir/NAME.pt``
    (the policy base) and ``output_dir/GEOMETRY_NAME.pt`` (the geometry network).

    Returns:
        ``{"policy": ..., "geometry": ...}``, each part's summary (absent when not trained).
    """
    parts = [str(p) for p in (cfg.get("parts") or ["policy"])]
    unknown = sorted(set(parts) - {"policy", "geometry"})
    if unknown:
        raise ValueError(f"parts: unknown {unknown}; known: policy, geometry")
    out = Path(str(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    gdata = cfg.get("geometry_data")
    own_data = "geometry" in parts and gdata is not None and int(gdata.scenes) > 0
    res: dict = {}
    if "policy" in parts or ("geometry" in parts and not own_data):
        t0 = time.perf_counter()
        dirs = render_base_data(cfg, out)
        render_s = time.perf_counter() - t0
        if "policy" in parts:
            res["policy"] = _train_policy_base(cfg, out, dirs, render_s)
    if "geometry" in parts:
        if own_data:
            t0 = time.perf_counter()
            dirs, val_dirs = render_geometry_base_data(cfg, out)
            res["geometry"] = _train_geometry_base(cfg, out, dirs, time.perf_counter() - t0, val_dirs)
        else:
            res["geometry"] = _train_geometry_base(cfg, out, dirs, render_s)
    return res


#: Added to the base's seed for the geometry data's held-out scenes: a block no other data uses.
GEOMETRY_VAL_SEED_OFFSET = 900_000


def render_geometry_base_data(cfg: DictConfig, out: Path) -> tuple[list[Path], list[Path]]:
    """Render ``geometry_data.scenes`` scenes for the geometry alone (and ``val_scenes`` held-out
    ones from their own seed block) from every camera mount; resumable. Returns the training
    and validation folders."""
    from policies.geometry_data import render_geometry_data  # lazy: torch (checks answer first)
    from sim_render.api import render_config  # lazy: sim_render's render command (the checks answer first)

    gd = cfg.geometry_data
    calib = load_calibration()
    mounts = camera_mounts(calib, cfg.cameras)
    render_cfg = to_plain(render_config(out, 1, "randomized", int(cfg.seed), None,
                                        list(cfg.randomization.overrides) if cfg.get("randomization") else []).render)
    root = Path(str(gd.dir)) if gd.get("dir") else out / "geometry_data"
    dirs = []
    for sub, n, seed in (("val", int(gd.val_scenes), int(cfg.seed) + GEOMETRY_VAL_SEED_OFFSET),
                         ("train", int(gd.scenes), int(cfg.seed))):
        if n <= 0:
            continue
        log.info("geometry data %s: %d scenes x %d mounts x %d looks -> %s", sub, n, len(mounts),
                 int(gd.frames_per_mount), root / sub)
        render_geometry_data(root / sub, calib, mounts, render_cfg, to_plain(cfg.geometry), n, seed,
                             int(gd.frames_per_mount), int(gd.scenes_per_shard), int(cfg.workers))
        dirs.append(root / sub)
    return dirs[-1:], dirs[:-1]


def _train_geometry_base(cfg: DictConfig, out: Path, dirs: list[Path], render_s: float,
                         val_dirs: list[Path] | None = None) -> dict:
    import torch  # lazy: torch (checks answer first)

    from policies.geometry import train_geometry  # lazy: torch (checks answer first)
    from policies.geometry_data import geometry_data_datasets  # lazy: torch (checks answer first)

    gcfg = to_plain(cfg.geometry)
    datasets = None if val_dirs is None else geometry_data_datasets(dirs, val_dirs, gcfg, int(cfg.seed))
    g = train_geometry(gcfg, dirs, out / "geometry", seed=int(cfg.seed), logger_cfg=to_plain(cfg.get("logger")),
                       datasets=datasets)
    if val_dirs is None:
        data = {"scenes": int(cfg.scenes_per_camera) * len(cfg.cameras), "frames_per_scene": int(cfg.frames_per_scene)}
    else:
        data = {"geometry_data": to_plain(cfg.geometry_data), "frames": g["n_train_frames"]}
    data.update({"profile": "randomized", "randomization": to_plain(cfg.randomization), "cameras": to_plain(cfg.cameras),
                 "seed": int(cfg.seed), "render_time_s": round(render_s, 1)})
    name = str(cfg.geometry.name)
    saved = torch.load(g["path"], map_location="cpu", weights_only=True)
    target = out / f"{name}.pt"
    atomic_write(target, lambda fh: torch.save({**saved, "name": name, "data": data}, fh))
    info = {"name": name, "data": data, **{k: v for k, v in g.items() if k != "path"}}
    write_json(out / f"{name}.json", info)
    return {"base": str(target), **info}


def _train_policy_base(cfg: DictConfig, out: Path, dirs: list[Path], render_s: float) -> dict:
    import torch  # lazy: torch (checks answer first)

    from policies.train import train_policy  # lazy: torch (checks answer first)

    pcfg = OmegaConf.to_container(cfg.policy, resolve=True)
    pcfg["base"] = None  # the base itself starts from scratch
    summary = train_policy(OmegaConf.create({"policy": pcfg, "seed": int(cfg.seed), "logger": to_plain(cfg.get("logger"))}),
                           [str(d) for d in dirs], out / "policy", seed=int(cfg.seed), mixed_calibrations=True)
    ckpt = torch.load(summary["checkpoint"], map_location="cpu", weights_only=False)
    state = {k: v.detach().clone() for k, v in ckpt["state_dict"].items()}
    n_scenes = int(cfg.scenes_per_camera) * len(cfg.cameras)
    info = {
        "name": str(cfg.name),
        "network": {"angle_bins": int(pcfg["angle_bins"]), **pcfg["network"]},
        "view_size": list(pcfg["view_size"]),
        "view": pcfg["view"],
        "data": {"scenes": n_scenes, "frames_per_scene": int(cfg.frames_per_scene), "profile": "randomized",
                 "randomization": to_plain(cfg.randomization), "cameras": to_plain(cfg.cameras), "seed": int(cfg.seed)},
        "training": {"global_step": summary["global_step"], "train_time_s": round(summary["train_time_s"], 1),
                     "render_time_s": round(render_s, 1), "metrics": summary["metrics"], "device": summary["device"],
                     "n_train_frames": summary["n_train_frames"], "n_val_frames": summary["n_val_frames"]},
        "config": pcfg,
    }
    target = out / f"{cfg.name}.pt"
    atomic_write(target, lambda fh: torch.save({"format": BASE_FORMAT, "state_dict": state, **info}, fh))
    write_json(out / f"{cfg.name}.json", info)
    return {"base": str(target), **info}



def _run(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    res = train_base(cfg)
    if "policy" in res:
        p, t = res["policy"], res["policy"]["training"]
        print(f"base: {p['base']} ({p['data']['scenes']} scenes, {t['global_step']} steps, "
              f"render {t['render_time_s']:.0f} s + train {t['train_time_s']:.0f} s on {t['device']})")
    if "geometry" in res:
        g = res["geometry"]
        e = g["errors"]
        print(f"geometry: {g['base']} ({g['global_step']} steps, train {g['train_time_s']:.0f} s on {g['device']}; "
              f"height error median/p90 {e.get('object_median_m', float('nan')) * 1000:.1f}/"
              f"{e.get('object_p90_m', float('nan')) * 1000:.1f} mm on parts, "
              f"{e.get('floor_median_m', float('nan')) * 1000:.1f}/{e.get('floor_p90_m', float('nan')) * 1000:.1f} mm "
              f"elsewhere; part IoU {e.get('object_iou', float('nan')):.2f})")


def main() -> None:
    run_hydra_command("base", "sim2real-train-base", __doc__ or "", _run,
                      (CalibrationError, BaseError, ValueError, OSError))
