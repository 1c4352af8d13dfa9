"""``sim2real-pipeline``: render -> adapt -> train the policy -> evaluate -> export.

    sim2real-pipeline calibration=FILE real_dir=DIR output_dir=DIR budget=tiny|small|full seed=N

Each stage writes into ``output_dir/stages/<stage>-<hash>/`` and records a
``stage.json`` last (its commit marker). The hash covers the stage's config and the
hashes of its inputs, so a rerun reuses exactly the stages whose config and inputs
match and never picks up stale results from another seed, budget or adaptation
setting. A stage interrupted mid-way (no ``stage.json``) resumes in its folder on the rerun:
the render stages keep their finished shards, the training stages continue from
``checkpoints/last.ckpt``; ``reuse=false`` starts every stage anew. The final outputs are ``output_dir/artifact/`` (what ``sim2real-serve``
loads) and ``output_dir/report.json`` / ``report.md`` with plots and image panels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from adaptation.images import RealFrames, RealFramesError, list_real_frames, load_real_frames
from conf import to_plain
from perception.core.artifact import file_sha256, write_metadata
from perception.core.atomic import replace_tree
from perception.core.background import GATES, MIN_FRAMES, BackgroundError, fit_background
from perception.core.calibration import Calibration, CalibrationError, calibration_path
from perception.core.cli import config_number, run_hydra_command
from perception.core.decode import area_cells, parts_region
from perception.core.geometry import NetworkView
from perception.core.jsonio import write_json
from perception.core.preprocess import preprocess
from perception.core.refine import RefineError, RefineSettings, frame_picks, measure_walls
from policies.eval_adapters import OnnxPolicy
from policies.evaluate import evaluate_domains
from policies.int8 import Int8Error, add_int8_graphs
from policies.loggers import logger_name
from policies.pipeline.report import write_report
from policies.pipeline.run import pipeline_run
from policies.weights import base_digest
from sim_render.api import export_real_frames, render_config
from sim_render.cli import render

# The stages' torch and Lightning modules (policies.train, .data, .module, .consistency,
# adaptation.train, .translate) are imported inside the stage that runs them: torch takes
# seconds to load, and `--help` or a bad value must answer without it.

__all__ = ["run_pipeline", "main", "stage_hash"]

log = logging.getLogger("sim2real.pipeline")


def stage_hash(payload: Any) -> str:
    """Short, stable hash of a JSON-able payload (a stage's config and input hashes)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


class Stages:
    """Runs stages with reuse by hash and records their wall times."""

    def __init__(self, root: Path, reuse: bool) -> None:
        self.root = root / "stages"
        self.reuse = reuse
        self.records: dict[str, dict] = {}

    def run(self, name: str, payload: dict, fn: Callable[[Path], dict]) -> tuple[Path, dict, str]:
        """Run ``fn(stage_dir)`` unless a finished stage with the same hash exists."""
        h = stage_hash(payload)
        d = self.root / f"{name}-{h}"
        marker = d / "stage.json"
        if self.reuse and marker.is_file():
            rec = json.loads(marker.read_text())
            if rec.get("dir") and rec["dir"] != str(d):
                # The output folder was moved or copied: the result's paths follow it.
                rec["result"] = _rebase_paths(rec["result"], rec["dir"], str(d))
            rec["reused"] = True
            self.records[name] = rec
            log.info("stage %-8s reused %s", name, d)
            return d, rec["result"], h
        if d.exists() and not self.reuse:
            shutil.rmtree(d)  # reuse=false: everything anew
        if d.exists():
            # An interrupted attempt with this very hash: its finished shards and checkpoints
            # are what the stage resumes from (render shards, ckpt_path=last), not rubbish.
            log.info("stage %-8s resuming the unfinished attempt in %s", name, d)
        d.mkdir(parents=True, exist_ok=True)
        log.info("stage %-8s running -> %s", name, d)
        t0 = time.perf_counter()
        result = fn(d)
        wall = time.perf_counter() - t0
        rec = {"stage": name, "hash": h, "dir": str(d), "payload": payload, "result": result, "wall_s": wall,
               "reused": False}
        write_json(marker, rec)
        self.records[name] = rec
        log.info("stage %-8s done in %.1f s", name, wall)
        return d, result, h


def _rebase_paths(obj: Any, old: str, new: str) -> Any:
    """``obj`` with every string path under the folder ``old`` moved under ``new``."""
    if isinstance(obj, dict):
        return {k: _rebase_paths(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebase_paths(v, old, new) for v in obj]
    if isinstance(obj, str) and (obj == old or obj.startswith(old.rstrip("/") + "/")):
        return new + obj[len(old):]
    return obj



def _profile_payload(out: Path, profile: str, calib_path: Path, overrides: list) -> dict:
    """The composed render profile, for a render stage's hash: a changed ``conf/render``
    file renders anew instead of reusing frames drawn with the old ranges."""

    return to_plain(render_config(out, 1, profile, 0, calib_path, overrides).render)


def run_pipeline(cfg: DictConfig) -> dict:
    """Run the whole pipeline that ``cfg`` (``conf/pipeline.yaml``) describes.

    With ``logger=wandb`` the whole run is one W&B run (:func:`policies.pipeline.run.pipeline_run`):
    the trainers log into it, and the report's table, plot and panels go into it at the end.
    """

    with pipeline_run(cfg) as tracking:
        report = _run_pipeline(cfg)
        tracking.log_report(report, Path(str(cfg.output_dir)))
    return report


@dataclass
class _Run:
    """What every stage of one pipeline run shares."""

    cfg: DictConfig
    out: Path
    calib_path: Path
    calib: Calibration
    stages: Stages
    seed: int

    @property
    def budget(self) -> DictConfig:
        return self.cfg.budget


def _run_pipeline(cfg: DictConfig) -> dict:
    """The flow: real frames -> sim data -> adaptation -> policy -> (task consistency) ->
    int8 -> the served artifact -> evaluation in the twin -> report."""
    from policies.train import check_policy_config  # lazy: torch (not at import of the pipeline)

    check_policy_config(cfg.policy)  # before any stage runs: a bad option costs no rendering
    walls_config(cfg)
    background_config(cfg)
    if cfg.get("int8") is not None:

        config_number({"int8.max_frames": cfg.int8.get("max_frames")}, "int8.max_frames", int, lo=1)
    t_start = time.perf_counter()
    out = Path(str(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    calib_path = calibration_path(cfg.calibration)
    run = _Run(cfg, out, calib_path, Calibration.load(calib_path), Stages(out, bool(cfg.reuse)), int(cfg.seed))

    real_dir, real_hash = _real_frames(run)
    sim_path, sim_res, sim_hash = _render_stage(run)
    adapt_path, adapt_res, adapt_hash = _adapt_stage(run, sim_path, sim_hash, real_dir, real_hash)
    translator_path = str(adapt_path) if adapt_path is not None else None
    translator = _translator(translator_path)  # loaded once: the policy trains through it, the report draws it
    p_cfg, policy_res, policy_hash = _policy_stage(run, sim_path, sim_hash, translator, adapt_hash)
    consistency_res, policy_res, policy_hash, tuned_path = _consistency_stage(
        run, sim_path, sim_hash, adapt_path, adapt_hash, p_cfg, policy_res, policy_hash, translator_path)
    if tuned_path != translator_path:  # task consistency fine-tuned it
        translator_path, translator = tuned_path, _translator(tuned_path)
    served, int8_res, policy_hash = _int8(run, policy_res, policy_hash, real_dir, real_hash)
    served, walls_res, policy_hash = _walls(run, served, policy_hash, real_dir, real_hash)
    served, background_res, policy_hash = _background(run, served, policy_hash, real_dir, real_hash)
    artifact = replace_tree(served, out / "artifact")
    eval_res = _eval_stage(run, served, policy_hash)


    report = {
        "config": to_plain(cfg),
        "calibration": str(calib_path),
        "real_dir": str(real_dir),
        "artifact": str(artifact),
        "budget": str(run.budget.name),
        "adaptation": str(cfg.adaptation.name),
        "seed": run.seed,
        "wall_s": time.perf_counter() - t_start,
        "stages": {k: {"wall_s": v["wall_s"], "reused": v["reused"], "hash": v["hash"]}
                   for k, v in run.stages.records.items()},
        "render": sim_res,
        # What sim2real-finetune continues from: the sim frames, the translator the policy saw
        # them through, the policy's resolved config.
        "sim_dataset": str(sim_path),
        "translator": translator_path,
        "policy_config": p_cfg,
        "adapt": adapt_res,
        "policy": policy_res,
        "task_consistency": consistency_res,
        "int8": int8_res,
        "walls": walls_res,
        "background": background_res,
        "evaluation": eval_res,
    }
    write_report(report, out, sim_dataset=sim_path, real_dir=real_dir, translator=translator, calib=run.calib)
    return report


def _translator(path: str | None) -> Any:
    """The sim -> adapted translator saved at ``path`` (``None``: none)."""
    if path is None:
        return None
    from adaptation.translate import Translator  # lazy: torch (only this stage)

    return Translator(path)


def _real_frames(run: _Run) -> tuple[Path, str]:
    """The real frames: the user's folder (checked, hashed by name, size and time), or the
    ``target`` stand-in rendered for them. Returns the folder and its hash."""
    cfg, calib, budget, seed = run.cfg, run.calib, run.budget, run.seed
    if cfg.real_dir:

        real_dir = Path(str(cfg.real_dir))
        load_real_frames(real_dir, calib)  # stops here, naming the file, on bad input
        real_key = {"real_dir": str(real_dir.resolve()), "files": [
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in list_real_frames(real_dir)]}
        return real_dir, stage_hash(real_key)

    def make_real(d: Path) -> dict:
        rcfg = render_config(d / "dataset", int(budget.real.n_scenes), "target",
                             int(cfg.real_seed_offset) + seed, run.calib_path, list(budget.real.overrides))
        render(rcfg)
        paths = export_real_frames(d / "dataset", d / "frames", tuple(calib.image_size))
        return {"real_dir": str(d / "frames"), "n_frames": len(paths)}

    real_payload = {"calibration": calib.digest(), "n": int(budget.real.n_scenes), "seed": seed,
                    "offset": int(cfg.real_seed_offset), "overrides": list(budget.real.overrides),
                    "profile": _profile_payload(run.out, "target", run.calib_path, list(budget.real.overrides))}
    _, real_res, real_hash = run.stages.run("real", real_payload, make_real)
    return Path(real_res["real_dir"]), real_hash


def _render_stage(run: _Run) -> tuple[Path, dict, str]:
    """The policy's (and the translator's) randomized sim data."""

    cfg, budget, seed = run.cfg, run.budget, run.seed
    render_over = [f"scenes_per_shard={int(budget.render.scenes_per_shard)}", *budget.render.overrides,
                   *(cfg.randomization.overrides if cfg.get("randomization") else [])]
    render_payload = {"calibration": run.calib.digest(), "n": int(budget.render.n_scenes), "seed": seed,
                      "overrides": render_over,
                      "profile": _profile_payload(run.out, "randomized", run.calib_path, render_over)}

    def make_render(d: Path) -> dict:
        rcfg = render_config(d, int(budget.render.n_scenes), "randomized", seed, run.calib_path, render_over,
                             int(budget.render.workers))
        manifest = render(rcfg)
        return {"dataset": str(d), "totals": manifest.get("totals", {})}

    return run.stages.run("render", render_payload, make_render)


def _adapt_stage(run: _Run, sim_path: Path, sim_hash: str, real_dir: Path,
                 real_hash: str) -> tuple[Path | None, dict, str]:
    """The sim -> real translator (``adaptation=none``: none), trained at the policy's view
    scale and in its view: the images the policy sees."""
    cfg = run.cfg
    if str(cfg.adaptation.name) == "none":
        return None, {"adaptation": "none"}, "none"
    from adaptation.train import compose_config as adapt_compose  # lazy: torch (only this stage)
    from adaptation.train import train as adapt_train  # lazy: torch (only this stage)

    adaptation = to_plain(cfg.adaptation)
    adaptation["image_size"] = list(cfg.policy.view_size)
    if cfg.policy.get("view") is not None:
        adaptation["view"] = to_plain(cfg.policy.view)
    a_budget = to_plain(run.budget.adapt)
    a_payload = {"adaptation": adaptation, "budget": a_budget, "sim": sim_hash, "real": real_hash,
                 "calibration": run.calib.digest(), "seed": run.seed}

    def make_adapt(d: Path) -> dict:
        acfg = adapt_compose([f"adaptation={cfg.adaptation.name}", f"logger={logger_name(cfg.get('logger'))}"])
        OmegaConf.set_struct(acfg, False)
        acfg.adaptation = OmegaConf.create(adaptation)
        for k, v in a_budget.items():
            acfg[k] = v
        acfg.sim_dir, acfg.real_dir, acfg.output_dir = str(sim_path), str(real_dir), str(d)
        acfg.calibration, acfg.seed = str(run.calib_path), run.seed
        acfg.ckpt_path = "last"  # an interrupted attempt continues (a fresh run when there is none)
        return adapt_train(acfg)

    return run.stages.run("adapt", a_payload, make_adapt)


def _policy_stage(run: _Run, sim_path: Path, sim_hash: str, translator: Any,
                  adapt_hash: str) -> tuple[dict, dict, str]:
    """The policy, trained (from the base) on the sim frames seen through the translator;
    training exports the artifact into the stage. Returns its resolved config too."""
    from policies.train import train_policy  # lazy: torch (only this stage)

    cfg, seed = run.cfg, run.seed
    p_cfg = to_plain(cfg.policy)
    p_cfg.update({k: v for k, v in to_plain(run.budget.policy).items()})
    p_payload = {"policy": p_cfg, "sim": sim_hash, "adapt": adapt_hash, "seed": seed}
    if p_cfg.get("base"):
        p_payload["base_digest"] = base_digest(p_cfg["base"])  # a retrained base trains anew
    if p_cfg.get("geometry"):
        p_payload["geometry_digest"] = base_digest(p_cfg["geometry"])  # a retrained geometry network exports anew

    def make_policy(d: Path) -> dict:
        summary = train_policy(OmegaConf.create({"policy": p_cfg, "seed": seed, "logger": to_plain(cfg.get("logger"))}),
                               [str(sim_path)], d, translator=translator, seed=seed,
                               ckpt_path="last")
        return {k: summary[k] for k in ("artifact", "checkpoint", "metrics", "global_step", "train_time_s",
                                        "n_train_frames", "n_val_frames", "adapted", "base", "kept")}

    _, policy_res, policy_hash = run.stages.run("policy", p_payload, make_policy)
    return p_cfg, policy_res, policy_hash


def _consistency_stage(run: _Run, sim_path: Path, sim_hash: str, adapt_path: Path | None, adapt_hash: str,
                       p_cfg: dict, policy_res: dict, policy_hash: str,
                       translator_path: str | None) -> tuple[dict | None, dict, str, str | None]:
    """Task consistency (optional, after RL-CycleGAN): fine-tune the translator so that the
    policy's maps agree on sim frames and their translations, retranslate, fine-tune the
    policy. Returns its result and the policy, its hash and the translator after it."""
    tc = to_plain(run.cfg.get("task_consistency")) or {}
    if not tc.get("enabled"):
        return None, policy_res, policy_hash, translator_path
    if adapt_path is None:
        log.warning("task_consistency.enabled is ignored with adaptation=none: there is no translator to fine-tune")
        return None, policy_res, policy_hash, translator_path
    c_payload = {"task_consistency": tc, "policy": policy_hash, "adapt": adapt_hash, "sim": sim_hash, "seed": run.seed}

    def make_consistency(d: Path) -> dict:
        return task_consistency_stage(tc, p_cfg, run.cfg, str(sim_path), adapt_path, policy_res, d, run.seed)

    _, res, policy_hash = run.stages.run("consistency", c_payload, make_consistency)
    policy_res = {**policy_res, **res["policy"], "task_consistency": res["finetune"]}
    return res, policy_res, policy_hash, str(res["generator"])


def _int8(run: _Run, policy_res: dict, policy_hash: str, real_dir: Path,
          real_hash: str) -> tuple[str, dict | None, str]:
    """int8 graphs for a CPU robot (policies/int8.py), their ranges from the real frames.
    Returns what sim2real-serve gets (the policy's artifact, with int8 graphs when made),
    the stage's result and the hash the evaluation follows."""
    int8_cfg = to_plain(run.cfg.get("int8")) or {}
    served = policy_res["artifact"]
    if not int8_cfg.get("enabled"):
        return served, None, policy_hash
    i_payload = {"int8": int8_cfg, "policy": policy_hash, "real": real_hash}

    def make_int8(d: Path) -> dict:
        return int8_stage(policy_res["artifact"], real_dir, run.calib, int(int8_cfg["max_frames"]), d)

    _, int8_res, i_hash = run.stages.run("int8", i_payload, make_int8)
    if int8_res.get("artifact"):
        return int8_res["artifact"], int8_res, i_hash
    return served, int8_res, policy_hash


def walls_config(cfg: DictConfig) -> dict:
    """The pipeline's ``walls`` block, checked: ``height`` and ``thickness`` both null or both
    metres in (0, 0.1]; ``fit``, changes to ``conf/calibrate_refine.yaml``'s fit.

    Raises:
        ValueError: the message names the key, its value and the range.
    """
    w_cfg = to_plain(cfg.get("walls")) or {}
    if any(w_cfg.get(k) is not None for k in ("height", "thickness")):
        for key in ("height", "thickness"):
            config_number(w_cfg, key, float, lo=0.0, hi=0.1, lo_open=True, prefix="walls.")
    try:
        RefineSettings.defaults(**(w_cfg.get("fit") or {}))
    except (RefineError, TypeError) as exc:
        raise ValueError(f"walls.fit: {exc}") from exc
    return w_cfg


def _walls(run: _Run, served: str, policy_hash: str, real_dir: Path,
           real_hash: str) -> tuple[str, dict | None, str]:
    """The bin's walls written into the artifact's geometry entry (``metadata.json:
    geometry.walls``), so that the rebuilt surface stands them inside the workspace edges
    (contract section 3) however low the network reads them: as given (``walls.height`` and
    ``walls.thickness``), else from the calibration's ``sim2real-calibrate refine`` report,
    else fitted on the real frames at the given pose (:func:`perception.core.refine.measure_walls`).
    The ``target`` stand-in's bin stands its walls outside the workspace (the twin's), as does a
    bin refined with ``fit.wall_placement=inner``: those write none unless given. Returns what
    is served next, the stage's result and the hash the evaluation follows."""
    w_cfg = walls_config(run.cfg)
    meta = json.loads((Path(served) / "metadata.json").read_text())
    if not w_cfg.get("enabled") or meta.get("geometry") is None:
        return served, None, policy_hash
    given = [w_cfg.get("height"), w_cfg.get("thickness")]
    st = RefineSettings.defaults(**(w_cfg.get("fit") or {}))
    report = (json.loads(run.calib_path.read_text()).get("calibration_report") or {}).get("refine") or {}
    from_report = None
    # A fit that found walls (its edges at least min_contrast over the image's), standing inside the workspace.
    if (report.get("wall_placement") == "outer" and float(report.get("edge_contrast") or 0.0) >= st.min_contrast
            and report.get("wall_height_m") and report.get("wall_thickness_m")):
        from_report = [float(report["wall_height_m"]), float(report["wall_thickness_m"])]
    if all(v is None for v in given) and from_report is None:
        # No wall stands in the workspace: the twin's stand-in, or a refine told the workspace is the bin's inside.
        if report.get("wall_placement") == "inner":
            return served, {"walls": None, "source": "none: the refine report's walls stand outside the workspace "
                                                     "(fit.wall_placement=inner)"}, policy_hash
        if not run.cfg.real_dir:
            return served, {"walls": None, "source": "none: the target stand-in's walls stand outside the workspace"}, \
                policy_hash

    w_payload = {"walls": w_cfg, "policy": policy_hash, "real": real_hash, "report": from_report,
                 "fit": dataclasses.asdict(st)}

    def make_walls(d: Path) -> dict:
        if all(v is not None for v in given):
            walls, source = [float(v) for v in given], "given (walls.height, walls.thickness)"
        elif from_report is not None:
            walls, source = from_report, f"the calibration's refine report ({run.calib_path})"
        else:
            frames = RealFrames(real_dir, run.calib)
            picks = frame_picks(len(frames), st.max_frames)  # as sim2real-calibrate refine picks them
            log.info("fitting the bin's walls on %d real frames (perception/core/refine.py)", len(picks))
            fitted = measure_walls([frames[int(i)] for i in picks], run.calib, st)
            walls, source = (None if fitted is None else list(fitted)), f"fitted on {len(picks)} frames of {real_dir}"
        art = replace_tree(served, d / "artifact")
        raw = json.loads((art / "metadata.json").read_text())
        raw["geometry"]["walls"] = None if walls is None else {"height": walls[0], "thickness": walls[1], "source": source}
        write_metadata(art, raw)
        log.info("bin walls in the artifact: %s (%s)", "none found" if walls is None else
                 f"{walls[0] * 1e3:.0f} mm high, {walls[1] * 1e3:.0f} mm thick", source)
        return {"artifact": str(art), "walls": walls, "source": source}

    _, walls_res, w_hash = run.stages.run("walls", w_payload, make_walls)
    return walls_res["artifact"], walls_res, w_hash


def background_config(cfg: DictConfig) -> dict:
    """The pipeline's ``background`` block, checked: ``max_frames`` an integer >= the
    background's :data:`perception.core.background.MIN_FRAMES`, ``threshold`` in (0, 0.5],
    ``min_part_mm2`` square millimetres > 0, ``gate`` one of
    :data:`perception.core.background.GATES`.

    Raises:
        ValueError: the message names the key, its value and the range.
    """
    b_cfg = to_plain(cfg.get("background")) or {}
    if b_cfg.get("enabled"):
        config_number(b_cfg, "max_frames", int, lo=MIN_FRAMES, prefix="background.")
        config_number(b_cfg, "threshold", float, lo=0.0, hi=0.5, lo_open=True, prefix="background.")
        config_number(b_cfg, "min_part_mm2", float, lo=0.0, lo_open=True, prefix="background.")
        if b_cfg.get("gate") not in GATES:
            raise ValueError(f"background.gate must be one of {', '.join(GATES)}, got {b_cfg.get('gate')!r}")
    return b_cfg


def _background(run: _Run, served: str, policy_hash: str, real_dir: Path,
                real_hash: str) -> tuple[str, dict | None, str]:
    """The fixed camera's empty bin written into the artifact (``metadata.json: background``,
    ``background.png``): the per-pixel median of the real frames in the policy's view
    (:func:`perception.core.background.fit_background`), so that ``decode.answer_on_parts``
    withholds its below-threshold answer from a frame that shows nothing new in the bin.
    Only for artifacts whose decode answers on parts (the test is that option's). Returns what
    is served next, the stage's result and the hash the evaluation follows."""
    b_cfg = background_config(run.cfg)
    meta = json.loads((Path(served) / "metadata.json").read_text())
    if not b_cfg.get("enabled") or not (meta.get("decode") or {}).get("answer_on_parts"):
        return served, None, policy_hash
    b_payload = {"background": b_cfg, "policy": policy_hash, "real": real_hash}

    def make_background(d: Path) -> dict:
        art = replace_tree(served, d / "artifact")
        raw = json.loads((art / "metadata.json").read_text())
        view = NetworkView.from_dict(raw["view"])
        walls = (raw.get("geometry") or {}).get("walls")
        region = parts_region(run.calib, view, 0.0 if walls is None else float(walls["thickness"]))
        frames = RealFrames(real_dir, run.calib)
        picks = frame_picks(len(frames), int(b_cfg["max_frames"]))
        min_part_px = area_cells(float(b_cfg["min_part_mm2"]) * 1e-6, view)
        try:
            model, info = fit_background((preprocess(frames[int(i)], run.calib, view) for i in picks), region,
                                         float(b_cfg["threshold"]), min_part_px, str(b_cfg["gate"]))
        except BackgroundError as exc:  # the user's too few frames deserve a warning; the stand-in's (tiny) not
            log.log(logging.WARNING if run.cfg.real_dir else logging.INFO, "no background in the artifact: %s", exc)
            return {"artifact": served, "background": None, "reason": str(exc)}
        name = "background.png"
        if not cv2.imwrite(str(art / name), cv2.cvtColor(model.image, cv2.COLOR_RGB2BGR)):
            raise OSError(f"cannot write {art / name}")
        raw["background"] = {"image": name, "image_sha256": file_sha256(art / name), "threshold": model.threshold,
                             "min_part_px": model.min_part_px, "gate": model.gate, "frames": info["frames"],
                             "noise": info["noise"], "shown": info["shown"],
                             "source": f"median of {info['frames']} frames of {real_dir}"}
        write_metadata(art, raw)
        if info["shown"] < 0.9:  # the user's frames hold parts: the test should see one on nearly all
            log.warning("the camera's empty bin sees a part on only %.0f%% of the real frames: the parts may be the "
                        "bin's colour, and answers on them below the quality threshold will be withheld "
                        "(background.enabled=false turns the test off)", 100 * info["shown"])
        log.info("the camera's empty bin in the artifact: median of %d real frames; a part is %d view cells changed "
                 "by > %.3f in chromaticity, and %.0f%% of the real frames show one", info["frames"],
                 model.min_part_px, model.threshold, 100 * info["shown"])
        return {"artifact": str(art), "background": raw["background"]}

    _, res, b_hash = run.stages.run("background", b_payload, make_background)
    if res["background"] is None:
        return served, res, policy_hash
    return res["artifact"], res, b_hash


def _eval_stage(run: _Run, served: str, policy_hash: str) -> dict:
    """The served artifact in the twin: every domain, the brackets, the empty bins."""

    e_cfg = to_plain(run.budget.eval)
    e_payload = {"eval": e_cfg, "policy": policy_hash, "calibration": run.calib.digest(), "seed": run.seed}

    def make_eval(d: Path) -> dict:
        pol = OnnxPolicy(served, run.calib)
        res = evaluate_domains(pol, list(e_cfg["domains"]), run.calib, int(e_cfg["n_episodes"]), run.seed,
                               bracket_episodes=int(e_cfg["bracket_episodes"]), render_scale=e_cfg["render_scale"],
                               empty_bin_frames=int(e_cfg.get("empty_bin_frames", 0)))
        write_json(d / "eval.json", res)
        return res

    _, eval_res, _ = run.stages.run("eval", e_payload, make_eval)
    return eval_res


def int8_stage(artifact: str | Path, real_dir: Path, calib: Calibration, max_frames: int, d: Path) -> dict:
    """The policy stage's artifact copied into ``d`` with int8 graphs added, calibrated on the
    real frames; a graph onnxruntime cannot quantize leaves the float artifact in use (logged)."""

    art = replace_tree(artifact, d / "artifact")
    try:  # the frames are read as the quantizer picks them: max_frames and a few more, not all
        entry = add_int8_graphs(art, RealFrames(real_dir, calib), max_frames)
    except Int8Error as exc:
        log.warning("no int8 graphs, the float artifact is served: %s", exc)
        return {"artifact": None, "error": str(exc)}
    return {"artifact": str(art), "entry": entry}


def task_consistency_stage(
    tc: dict, p_cfg: dict, cfg: DictConfig, sim_path: str, adapt_path: Path, policy_res: dict, d: Path, seed: int
) -> dict:
    """The pipeline's ``task_consistency`` stage, in ``d``.

    1. :func:`policies.consistency.consistency_finetune` fine-tunes the adaptation stage's
       generator against the frozen policy (trained on its translations) on the sim frames;
       the result is saved as ``d/generator/`` (a generator folder like the adaptation's).
    2. The policy is fine-tuned from its weights for ``policy_time_s`` on the frames the new
       generator translates, and exported (``d/policy/artifact``).

    Returns:
        ``generator`` (folder), ``finetune`` (the fine-tuning's numbers) and ``policy``
        (``artifact``, ``checkpoint``, ``metrics``, ``global_step``, ``train_time_s``).
    """
    from adaptation.translate import (  # lazy: torch (only this stage)
        Translator,
        load_generator,
        save_generator,
    )
    from policies.consistency import consistency_finetune  # lazy: torch (only this stage)
    from policies.data import PolicyFrames  # lazy: torch (only this stage)
    from policies.module import GraspPolicyModule  # lazy: torch (only this stage)
    from policies.train import train_policy  # lazy: torch (only this stage)

    generator = load_generator(adapt_path).requires_grad_(True)
    policy = GraspPolicyModule.load_from_checkpoint(policy_res["checkpoint"], map_location="cpu")
    frames = PolicyFrames(sim_path, view=NetworkView.from_dict(policy.hparams["view"]),
                          angle_bins=int(policy.net.angle_bins), targets=p_cfg.get("targets"))
    ft = consistency_finetune(generator, policy, frames, steps=int(tc["steps"]), lr=float(tc["lr"]),
                              batch_size=int(tc["batch_size"]), anchor_weight=float(tc["anchor_weight"]),
                              max_time_s=tc.get("max_time_s"))
    gen_dir = save_generator(generator.state_dict(), {**generator.meta, "task_consistency": ft}, d / "generator").parent
    p2 = {**p_cfg, "max_time_s": float(tc["policy_time_s"])}
    summary = train_policy(OmegaConf.create({"policy": p2, "seed": seed, "logger": to_plain(cfg.get("logger"))}),
                           [sim_path], d / "policy", translator=Translator(str(gen_dir)), seed=seed,
                           init_from=policy_res["checkpoint"])
    return {"generator": str(gen_dir), "finetune": ft,
            "policy": {k: summary[k] for k in ("artifact", "checkpoint", "metrics", "global_step", "train_time_s")}}


def check_budget_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse a command-line ``policy.KEY=...`` that the budget also sets.

    The budget's ``policy`` keys (``max_steps``, ``max_time_s``, ...) replace the policy
    group's in the policy stage (:func:`_policy_stage`), so such an override would be dropped
    without a word and the run would train as if it were not there.

    Raises:
        ValueError: naming the override and the ``budget.policy.KEY`` that works.
    """
    budget_keys = set((cfg.budget.get("policy") or {}).keys())
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("policy.") and key.removeprefix("policy.") in budget_keys:
            name = key.removeprefix("policy.")
            raise ValueError(f"{override}: budget={cfg.budget.name} sets policy.{name} to "
                             f"{cfg.budget.policy[name]}, and the budget's value is the one used; "
                             f"write budget.policy.{name}=... instead")


def _run(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if HydraConfig.initialized():
        check_budget_overrides(cfg, HydraConfig.get().overrides.task)  # before any stage runs
    report = run_pipeline(cfg)
    print(f"artifact: {report['artifact']}")
    print(f"report:   {Path(str(cfg.output_dir)) / 'report.md'}  ({report['wall_s']:.0f} s)")


def main() -> None:
    run_hydra_command("pipeline", "sim2real-pipeline", __doc__ or "", _run,
                      (CalibrationError, RealFramesError, ValueError, OSError))
