"""``sim2real-render``: render randomized, physics-labelled sim data into shards.

    sim2real-render calibration=FILE output_dir=DIR n_scenes=N workers=N profile=randomized seed=N

``profile=NAME`` selects the profile config ``conf/render/NAME.yaml`` (an alias of
Hydra's ``render=NAME``). Re-running the same command resumes: complete shards are
kept, missing ones are made.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from perception.core.atomic import atomic_write_text
from perception.core.calibration import Calibration, CalibrationError, load_calibration
from perception.core.cli import run_hydra_command
from sim_render.panel import dataset_panel, save_png

__all__ = ["main", "render", "config_hash", "parse_shard_range"]

log = logging.getLogger(__name__)


def config_hash(calib: Calibration, render_cfg: DictConfig, seed: int, scenes_per_shard: int) -> str:
    """Hash of everything that determines the data (not worker counts or paths)."""
    payload = {
        "calibration": calib.to_dict(),
        "render": OmegaConf.to_container(render_cfg, resolve=True),
        "seed": int(seed),
        "scenes_per_shard": int(scenes_per_shard),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def parse_shard_range(text: str | None, n_shards: int | None = None) -> tuple[int, int] | None:
    """``"a:b"`` -> ``(a, b)``: shards ``a .. b-1``; ``"i/n"`` -> the ``i``-th (from 0) of ``n``
    near-equal, contiguous parts of the ``n_shards`` shards (what a launcher fanning out over
    ``shards=0/n,1/n,...`` needs); ``None`` for the whole dataset."""
    if text in (None, "", "null"):
        return None
    if "/" in str(text):
        try:
            i, n = (int(v) for v in str(text).split("/"))
        except ValueError as exc:
            raise ValueError(f"shards must look like 'a:b' or 'i/n' (part i of n, from 0), got {text!r}") from exc
        if n_shards is None:
            raise ValueError(f"shards={text!r}: the number of shards is needed to split them into parts")
        if not 0 <= i < n or n > n_shards:
            raise ValueError(
                f"shards={text!r}: need 0 <= i < n <= the dataset's {n_shards} shards "
                "(fewer parts, or a smaller scenes_per_shard)"
            )
        return i * n_shards // n, (i + 1) * n_shards // n
    try:
        a, b = (int(v) for v in str(text).split(":"))
    except ValueError as exc:
        raise ValueError(f"shards must look like 'a:b' (first shard, one past the last), got {text!r}") from exc
    if a < 0 or b <= a:
        raise ValueError(f"shards range {text!r} is empty or negative")
    return a, b


def render(cfg: DictConfig) -> dict:
    """Render the dataset ``cfg`` describes; returns the manifest (or the shard summary)."""
    from sim_render.render_job import render_shards  # lazy: multiprocessing (checks answer first)
    from sim_render.scene import SceneRenderer, render_size  # lazy: pybullet (checks answer first)

    calib = load_calibration(cfg.calibration)
    out = Path(cfg.output_dir)
    if int(cfg.n_scenes) <= 0:
        raise ValueError(f"n_scenes must be positive, got {cfg.n_scenes}")
    chash = config_hash(calib, cfg.render, cfg.seed, cfg.scenes_per_shard)
    out.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    meta = {
        "profile": str(cfg.render.name),
        "config_hash": chash,
        "calibration": calib.to_dict(),
        "image_size": list(render_size(calib, cfg.render.resolution_scale)),
    }
    manifest = render_shards(
        out_dir=out,
        n_scenes=int(cfg.n_scenes),
        scenes_per_shard=int(cfg.scenes_per_shard),
        seed=int(cfg.seed),
        make_frames=SceneRenderer(calib, cfg.render, int(cfg.seed)),
        meta=meta,
        workers=int(cfg.workers),
        shard_range=parse_shard_range(cfg.shards, math.ceil(int(cfg.n_scenes) / max(int(cfg.scenes_per_shard), 1))),
        progress=True,
        # After the checks: a rerun refused (another seed, another config) leaves the folder's config as it was.
        on_checked=lambda: atomic_write_text(out / "config.yaml", resolved),
    )
    if manifest.get("complete") is not False and cfg.get("panel", True):
        # A look at the data: the first frames with their executed grasps drawn.
        save_png(out / "panel.png", dataset_panel([out]))
    return manifest


def _alias_profile(argv: list[str]) -> list[str]:
    """``profile=NAME`` is the documented spelling of Hydra's ``render=NAME``."""
    return ["render=" + a.split("=", 1)[1] if a.startswith("profile=") else a for a in argv]


def _run(cfg: DictConfig) -> None:
    manifest = render(cfg)
    if manifest.get("complete") is False:
        print(f"rendered shards {manifest['shards']} of {cfg.output_dir}: {manifest['rendered']} made, "
              f"{manifest['reused']} kept, {manifest['missing']} still missing elsewhere")
    else:
        print(f"rendered {cfg.output_dir}: {json.dumps(manifest.get('totals', {}))}")


def main() -> None:
    sys.argv = [sys.argv[0], *_alias_profile(sys.argv[1:])]
    # Shards are written atomically: an error leaves nothing half-written behind.
    run_hydra_command("render", "sim2real-render", __doc__ or "", _run,
                      (CalibrationError, ValueError, OSError, RuntimeError))
