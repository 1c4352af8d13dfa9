"""``sim2real-finetune``: fine-tune a pipeline run's policy on the cell's own recorded attempts.

    sim2real-finetune run_dir=DIR recordings=[DIR,...] output_dir=DIR budget=tiny|small seed=N

(docs/robot_cell.md section 7.) A recorded attempt is one grasp on one real frame, with the
robot's word on whether it lifted something: a sparse label (one pixel and one angle of
the quality map), where the sim data labels every frame densely. So the run's policy
trains on both at once, from its own weights: a share ``real_fraction`` of each batch's
items are real attempts (their quality at the answered pixel and angle, nothing else), the
rest the run's sim frames (translated as the run trained on them), so that nothing it
learnt in sim is forgotten. A recording of failures only teaches where not to grasp; the
sim frames keep the policy answering elsewhere.

The check: the attempts, in the order they were recorded, split into contiguous blocks;
the last ``check_fraction`` of them is held out, with a guard band of ``guard_attempts``
left out of training before it (retries on one scene are near-duplicates and must not
straddle the split). On the check block ``report.json`` compares the run's artifact and the
new one: the predicted quality at each recorded grasp against its outcome (ROC AUC and a
calibration curve), and how often each answers no grasp on those frames, with the AUC's
change and its interval (a block bootstrap: those few attempts resolve only a large change).

What the robot measured (contract section 7: ``contact_stop``, ``fingertip_z``, ``jaw_width``)
labels the geometry network, before the policy's fine-tune: :mod:`policies.stops` says what each
field says and trains the run's geometry network on it beside the run's sim frames
(``finetune.geometry``); the candidate artifact carries the fine-tuned geometry graph. The check
block then also reads each artifact's planning surface under the fingers of its held-out
attempts against the measured stops (``check.before.stops``, ``check.after.stops``: median
and p90 of the error, mm) and the change of the mean error with its interval
(``check.stop_error_difference``, the same block bootstrap).

Promotion: ``output_dir/artifact/`` (the format ``sim2real-serve`` loads) holds the better of the
two. The fine-tuned artifact goes there only when the check block shows it better (the AUC
change's interval above 0) and its geometry not worse (the stop error's interval not above 0,
:func:`promotion_decision`); otherwise ``artifact/`` is the run's zero-shot artifact, copied
unchanged. ``force=true`` promotes it whatever the check says.
Either way the fine-tuned artifact is in ``output_dir/candidate/``, ``report.json`` says
``promoted`` and ``promotion_reason``, the exit code is 0 and the last line says which was kept.

Writes ``output_dir/artifact/``, ``output_dir/candidate/``, ``output_dir/report.json``, the
training's folder ``output_dir/train/`` and the fine-tuned geometry network
``output_dir/geometry/geometry.pt``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from adaptation.images import RealFrames, RealFramesError
from adaptation.translate import Translator
from perception.core.artifact import ArtifactError, PolicyRunner, write_metadata
from perception.core.atomic import replace_tree
from perception.core.calibration import Calibration, CalibrationError
from perception.core.cli import config_number, run_hydra_command
from perception.core.cliutil import format_number
from perception.core.geometry import NetworkView
from perception.core.grasp import angle_to_bin, base_grasp_to_view
from perception.core.imageio import read_image
from perception.core.jsonio import write_json
from perception.core.outcomes import measured
from perception.core.preprocess import preprocess, to_network_input
from perception.core.recording import load_attempts, load_header
from policies.geometry import GEOMETRY_FORMAT, base_view, geometry_net, make_geometry_datasets
from policies.int8 import Int8Error, add_int8_graphs
from policies.stops import (
    StopFrames,
    StopLabel,
    finetune_geometry,
    stop_errors,
    stop_label,
    surface_at_stops,
)
from policies.weights import load_base

__all__ = ["RealAttempts", "load_labelled_attempts", "split_blocks", "roc_auc", "calibration_curve",
           "auc_difference", "stop_error_difference", "Promotion", "promotion_decision", "check_block",
           "finetune_run_geometry", "finetune",
           "main"]

log = logging.getLogger(__name__)


class FinetuneError(ValueError):
    """Recordings that cannot be fine-tuned on (the command exits 2 with the message)."""


def load_labelled_attempts(recordings: Sequence[str | Path], calib: Calibration) -> list[dict]:
    """The attempts of ``recordings`` with a grasp and an outcome, in order, each with ``_dir``.

    Raises:
        FinetuneError: a missing folder, a recording of another calibration or image size,
            or no attempt with an outcome at all.
    """
    out: list[dict] = []
    for rec in recordings:
        rec = Path(rec)
        if not rec.is_dir():
            raise FinetuneError(f"recording {rec} is not a folder")
        header = load_header(rec) or {}
        size = header.get("image_size")
        if size is not None and list(size) != list(calib.image_size):
            raise FinetuneError(f"recording {rec} has frames of {size}; this run's camera gives "
                                f"{list(calib.image_size)}: record with this run's calibration")
        attempts = load_attempts(rec)
        digests = {header.get("calibration_digest")} | {a.get("calibration_digest") for a in attempts}
        digests.discard(None)
        if digests and digests != {calib.digest()}:
            raise FinetuneError(f"recording {rec} was made with another calibration ({sorted(digests)}) than this "
                                f"run's ({calib.digest()}): fine-tune the run trained with that camera")
        for a in attempts:
            outcome = a.get("outcome") or {}
            if (a.get("grasp") is None or a.get("view_pixel") is None or not a.get("frame")
                    or not isinstance(outcome.get("success"), bool)):
                continue
            out.append({**a, "_dir": str(rec)})
    if not out:
        raise FinetuneError(f"no recorded attempt with an outcome in {[str(r) for r in recordings]}: report "
                            "outcomes (POST /v1/outcome, or the loop's robot adapter) before fine-tuning")
    return out


def split_blocks(n: int, check_fraction: float, guard: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and check indices of ``n`` attempts in recording order: the last ``check_fraction``
    (at least one) is the check block, the ``guard`` before it are left out of both."""
    n_check = max(1, int(round(n * float(check_fraction)))) if n > 1 and check_fraction > 0 else 0
    check = np.arange(n - n_check, n)
    train = np.arange(0, max(0, n - n_check - int(guard)))
    if len(train) == 0 and n_check:  # too few to hold any out: train on all, check on all (said in the report)
        return np.arange(n), np.arange(n)
    return train, check


def _label_bin(attempt: dict, calib: Calibration, view: NetworkView, angle_bins: int) -> tuple[int, int, int]:
    """``(angle_bin, v, u)`` of an attempt's grasp in the view."""
    g = attempt["grasp"]
    uv, angle, _ = base_grasp_to_view(np.asarray(g["position"]), float(g["yaw"]), float(g["width"]), calib, view)
    W, H = view.size
    u, v = (int(np.clip(round(float(c)), 0, s - 1)) for c, s in zip(uv[0], (W, H)))
    return int(angle_to_bin(float(angle[0]), angle_bins)), v, u


def _read_frame(attempt: dict) -> np.ndarray:
    return read_image(Path(attempt["_dir"]) / attempt["frame"])


class RealAttempts(Dataset):
    """Recorded attempts as :class:`policies.data.PolicyFrames`-like items.

    The target is the outcome at the answered grasp's pixel and angle bin (and its 3x3
    neighbourhood, the grasp's own spread); every other entry has weight 0. ``real`` is 1
    (the loss does not discount these labels by the predicted height: there is no height
    label for them).
    """

    def __init__(self, attempts: Sequence[dict], calib: Calibration, view: NetworkView, angle_bins: int,
                 label_weight: float = 1.0) -> None:
        self.calib, self.view, self.angle_bins = calib, view, int(angle_bins)
        self.label_weight = float(label_weight)
        self.items = []
        for a in attempts:
            view_rgb = preprocess(_read_frame(a), calib, view)
            self.items.append((view_rgb, _label_bin(a, calib, view, self.angle_bins), bool(a["outcome"]["success"])))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        view_rgb, (a, v, u), success = self.items[i]
        W, H = self.view.size
        A = self.angle_bins
        tq = np.zeros((A, H, W), np.float32)
        wq = np.zeros((A, H, W), np.float32)
        vs, us = slice(max(0, v - 1), v + 2), slice(max(0, u - 1), u + 2)
        tq[a, vs, us] = float(success)
        wq[a, vs, us] = self.label_weight
        zeros, false = np.zeros((H, W), np.float32), np.zeros((H, W), bool)
        t = {"quality_target": tq, "quality_weight": wq, "dense_negative": false, "width_target": zeros,
             "width_mask": false, "height_target": zeros, "height_weight": zeros, "surface_target": zeros,
             "surface_weight": zeros, "object_mask": false}
        out = {k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in t.items()}
        out["image"] = torch.from_numpy(to_network_input(view_rgb)[0])
        out["view_rgb"] = torch.from_numpy(np.ascontiguousarray(view_rgb))
        out["index"] = torch.tensor(-1 - i)
        out["real"] = torch.tensor(1.0)
        return out


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """The area under the ROC curve (Mann-Whitney, ties count half); ``None`` with one class only."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def calibration_curve(scores: Sequence[float], labels: Sequence[bool], bins: int = 5) -> list[dict]:
    """Per quality band of width ``1 / bins``: attempts, mean predicted quality, observed success rate."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    idx = np.clip((s * bins).astype(int), 0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        out.append({"band": [b / bins, (b + 1) / bins], "attempts": int(m.sum()),
                    "mean_quality": float(s[m].mean()) if m.any() else None,
                    "success_rate": float(y[m].mean()) if m.any() else None})
    return out


def _block_starts(n: int, block_attempts: int) -> tuple[int, np.ndarray]:
    k = max(1, min(int(block_attempts), n))
    return k, np.arange(n - k + 1)


def _block_resample(rng: np.random.Generator, n: int, k: int, starts: np.ndarray) -> np.ndarray:
    """One moving-block resample of ``n`` indices in runs of ``k`` consecutive ones."""
    return (rng.choice(starts, size=-(-n // k))[:, None] + np.arange(k)[None, :]).ravel()[:n]


def auc_difference(before: Sequence[float], after: Sequence[float], labels: Sequence[bool],
                   block_attempts: int, resamples: int, seed: int = 0) -> dict | None:
    """``after``'s ROC AUC minus ``before``'s on the same attempts, with a 95% interval.

    The interval comes from a moving-block bootstrap: both artifacts' scores are resampled
    together, in runs of ``block_attempts`` consecutive attempts, because retries on one scene
    are near-duplicates and resampling them one by one would make the interval too narrow.
    A resample with one class only is drawn again (up to ``resamples`` more times). ``None``
    when the attempts hold one class only."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    auc_b, auc_a = roc_auc(b, y), roc_auc(a, y)
    if auc_b is None or auc_a is None:
        return None
    n = len(y)
    k, starts = _block_starts(n, block_attempts)
    rng = np.random.default_rng(seed)
    diffs: list[float] = []
    for _ in range(2 * int(resamples)):
        idx = _block_resample(rng, n, k, starts)
        ab, aa = roc_auc(b[idx], y[idx]), roc_auc(a[idx], y[idx])
        if ab is not None and aa is not None:
            diffs.append(aa - ab)
        if len(diffs) == int(resamples):
            break
    lo, hi = np.percentile(diffs, [2.5, 97.5]) if diffs else (None, None)
    return {"difference": auc_a - auc_b, "interval": [float(lo), float(hi)] if diffs else None,
            "resamples": len(diffs), "block_attempts": k, "attempts": n}


def stop_error_difference(before_mm: Sequence[float], after_mm: Sequence[float], block_attempts: int,
                          resamples: int, seed: int = 0) -> dict | None:
    """The mean size of the geometry's error at the held-out stops, ``after`` minus ``before`` (mm;
    below 0: the fine-tuned geometry agrees better with what the robot measured), with a 95%
    interval from the same moving-block bootstrap as :func:`auc_difference`. ``None`` without stops."""
    b, a = np.abs(np.asarray(before_mm, dtype=np.float64)), np.abs(np.asarray(after_mm, dtype=np.float64))
    n = len(b)
    if n == 0:
        return None
    k, starts = _block_starts(n, block_attempts)
    rng = np.random.default_rng(seed)
    diffs = [float(a[idx].mean() - b[idx].mean())
             for idx in (_block_resample(rng, n, k, starts) for _ in range(int(resamples)))]
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return {"difference": float(a.mean() - b.mean()), "interval": [float(lo), float(hi)], "resamples": len(diffs),
            "block_attempts": k, "attempts": n}


class Promotion(NamedTuple):
    """Whether the fine-tuned artifact goes to ``artifact/``, and why (``report.json``)."""

    promoted: bool
    reason: str


def _unresolvable(change: dict) -> str | None:
    """Why a bootstrap change resolves nothing, or ``None``."""
    if change.get("interval") is None:
        return "no interval (every bootstrap resample held one class only)"
    if change["attempts"] <= change["block_attempts"]:
        # One block covers the whole check block: every resample is the same sequence, so
        # the "interval" is the point estimate again and resolves nothing.
        return (f"the check block's {change['attempts']} attempts fit in one bootstrap block of "
                f"{change['block_attempts']}: no interval it can resolve")
    return None


def _judge_auc(auc_change: dict | None) -> tuple[int, str]:
    """+1 the AUC change shows the fine-tune better, -1 worse, 0 neither; and what it says."""
    if auc_change is None:
        return 0, "the check block holds one class of outcome only (or no attempt): no AUC to compare"
    why = _unresolvable(auc_change)
    if why is not None:
        return 0, why if "one bootstrap block" in why else f"the AUC difference has {why}"
    d, (lo, hi) = auc_change["difference"], auc_change["interval"]
    stated = f"AUC difference {d:+.3f}, 95% interval [{lo:+.3f}, {hi:+.3f}]"
    if lo > 0:
        return 1, f"the check block shows it better ({stated}, above 0)"
    if hi < 0:
        return -1, f"the check block shows it worse ({stated}, below 0)"
    return 0, f"the check block cannot call it better ({stated} includes 0)"


def _judge_stops(stop_change: dict | None) -> tuple[int, str]:
    """+1 the geometry's error at the held-out stops shown smaller, -1 larger, 0 neither."""
    if stop_change is None:
        return 0, "no measured stop in the check block"
    why = _unresolvable(stop_change)
    if why is not None:
        return 0, f"at the measured stops, {why}"
    d, (lo, hi) = stop_change["difference"], stop_change["interval"]
    stated = f"mean error {d:+.1f} mm, 95% interval [{lo:+.1f}, {hi:+.1f}] on {stop_change['attempts']} stops"
    if hi < 0:
        return 1, f"the geometry agrees better with the measured stops ({stated}, below 0)"
    if lo > 0:
        return -1, f"the geometry agrees worse with the measured stops ({stated}, above 0)"
    return 0, f"the measured stops cannot call the geometry better ({stated} includes 0)"


def promotion_decision(auc_change: dict | None, held_out: bool, force: bool,
                       stop_change: dict | None = None) -> Promotion:
    """Promote the fine-tuned artifact only when the check block shows it better and nowhere worse.

    Better means ``auc_change``'s 95% interval (``check.auc_difference``) lies above 0 on
    attempts held out of training; when the geometry was fine-tuned on what the robot measured,
    ``stop_change``'s (``check.stop_error_difference``, mm) must not lie above 0 (the geometry
    shown worse) either. A geometry shown better does not promote the candidate by itself: the
    candidate carries the fine-tuned policy too. A change the check cannot resolve is kept out of ``artifact/``:
    it is as likely a loss in the cell as a gain (AUC 0.573 -> 0.537, interval across 0, was
    promoted once and took the cell from 41.4% to 33.8%).

    Args:
        auc_change: :func:`auc_difference`'s answer (``difference``, ``interval``,
            ``block_attempts``, ``attempts``), or ``None`` when the check block holds one
            class of outcome only (or no attempt).
        held_out: the check block's attempts were left out of training.
        force: promote whatever the check says (the reason still says what it said).
        stop_change: :func:`stop_error_difference`'s answer, or ``None`` (no geometry fine-tune,
            or no stop in the check block): the AUC alone decides.

    Returns:
        ``Promotion(promoted, reason)``.
    """
    if not held_out:
        better, reason = False, "the check block was trained on (too few attempts to hold any out)"
    else:
        auc, reason = _judge_auc(auc_change)
        better = auc > 0
        if stop_change is not None:
            # The candidate carries the fine-tuned policy and geometry together: a geometry shown
            # better cannot carry a policy the check could not call better (AUC 0.573 -> 0.537 once
            # took a cell from 41.4% to 33.8%), so the stops can keep a candidate out, not bring one in.
            stops, stop_reason = _judge_stops(stop_change)
            better = auc > 0 and stops >= 0
            reason = f"{reason}; {stop_reason}"
    if force and not better:
        return Promotion(True, f"forced (force=true); without it kept out: {reason}")
    return Promotion(better, reason)


def check_block(artifact: str | Path, attempts: Sequence[dict], frames: Sequence[np.ndarray],
                calib: Calibration, labels: Sequence[StopLabel | None] = (), tolerance: float = 0.0,
                footprint_step: float = 0.002) -> tuple[dict, list[float], list[float]]:
    """An artifact on the held-out attempts (``frames``: their raw frames): quality at each
    recorded grasp against its outcome, and its own answers on those frames (null rate); with
    ``labels`` (:func:`policies.stops.stop_label` per attempt), the surface its decode plans on
    against what the robot measured (``stops``: :func:`policies.stops.stop_errors`).
    Returns the summary, the quality at each attempt (for :func:`auc_difference`) and the
    geometry's error at each measured stop, mm (for :func:`stop_error_difference`)."""
    runner = PolicyRunner(artifact, calib)
    scores, outcomes, nulls = [], [], 0
    highest, measured_labels = [], []
    for k, (a, raw) in enumerate(zip(attempts, frames)):
        maps, dec = runner.decide(raw)
        ab, v, u = _label_bin(a, calib, runner.view, runner.meta.angle_bins)
        scores.append(float(maps.quality[ab, v, u]))
        outcomes.append(bool(a["outcome"]["success"]))
        nulls += dec.grasp is None
        label = labels[k] if k < len(labels) else None
        top = (surface_at_stops(maps.surface, runner.view, calib, label, footprint_step)
               if label is not None and maps.surface is not None else None)
        if top is not None:  # None: the footprints lie outside the planning surface
            highest.append(top)
            measured_labels.append(label)
    n = len(attempts)
    summary = {"attempts": n, "successes": int(sum(outcomes)), "auc": roc_auc(scores, outcomes),
               "calibration": calibration_curve(scores, outcomes), "null_rate": nulls / n if n else None,
               "mean_quality": float(np.mean(scores)) if n else None}
    if measured_labels:
        summary["stops"] = stop_errors(highest, measured_labels, tolerance)
    errors = [1000 * (h - lab.stop) for h, lab in zip(highest, measured_labels) if lab.stop is not None]
    return summary, scores, errors


def finetune(cfg: DictConfig) -> dict:
    """What ``sim2real-finetune`` does; returns ``report.json``'s content."""
    from policies.train import train_policy  # lazy: lightning via policies.train (only to train)

    t0 = time.perf_counter()
    run_dir = Path(str(cfg.run_dir or ""))
    if not cfg.run_dir or not (run_dir / "report.json").is_file():
        raise FinetuneError(f"run_dir={cfg.run_dir}: not the output_dir of a finished sim2real-pipeline run "
                            "(no report.json there)")
    if not cfg.recordings:
        raise FinetuneError("recordings=[DIR,...] is required: the folders sim2real-serve record_dir= or "
                            "sim2real-grasp-loop out_dir= wrote")
    if not cfg.output_dir:
        raise FinetuneError("output_dir=DIR is required")
    # The settings, and the budget's training time on top of them.
    f = OmegaConf.merge(OmegaConf.to_container(cfg.finetune, resolve=True),
                        OmegaConf.to_container(cfg.budget.finetune, resolve=True))
    for key, lo in (("real_fraction", 0.0), ("check_fraction", 0.0)):
        config_number(f, key, float, lo=lo, hi=1)
    config_number(f, "guard_attempts", int, lo=0)
    config_number(f, "max_time_s", float, lo=0, lo_open=True)
    if not isinstance(cfg.force, bool):
        raise ValueError(f"force must be true or false, got {cfg.force!r}")
    for key, kind, lo in (("label_weight", float, 0.0), ("tolerance_m", float, 0.0), ("anchor_weight", float, 0.0),
                          ("between_weight", float, 0.0), ("batch_size", int, 1), ("max_steps", int, 1)):
        config_number(f.geometry, key, kind, lo=lo, prefix="finetune.geometry.")
    if f.geometry.max_time_s is not None:
        try:
            config_number(f.geometry, "max_time_s", float, lo=0, lo_open=True, prefix="finetune.geometry.")
        except ValueError as exc:
            raise ValueError(f"{exc} (null: no time limit)") from None
    for key in ("block_attempts", "resamples"):
        config_number(f.auc_interval, key, int, lo=1, prefix="finetune.auc_interval.")
    try:
        run = json.loads((run_dir / "report.json").read_text())
        missing = [k for k in ("calibration", "artifact", "policy") if k not in run]
        if missing or "checkpoint" not in run["policy"]:
            raise KeyError(", ".join(missing) or "policy.checkpoint")
        run = rebased_run(run, run_dir)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise FinetuneError(f"{run_dir}/report.json is not a sim2real-pipeline report ({type(exc).__name__}: "
                            f"{exc})") from None
    if not run.get("sim_dataset"):
        raise FinetuneError(f"{run_dir}/report.json is from an older sim2real-pipeline (no sim_dataset): rerun the "
                            "pipeline (its stages are reused) to fine-tune it")
    calib = Calibration.load(run["calibration"])
    attempts = load_labelled_attempts([str(r) for r in cfg.recordings], calib)
    train_idx, check_idx = split_blocks(len(attempts), float(f.check_fraction), int(f.guard_attempts))
    train_att = [attempts[i] for i in train_idx]
    check_att = [attempts[i] for i in check_idx]
    log.info("finetune: %d attempts with an outcome (%d successes): %d train, %d check", len(attempts),
             sum(a["outcome"]["success"] for a in attempts), len(train_att), len(check_att))

    policy = run["policy"]
    p_cfg = dict(run.get("policy_config") or {**run["config"]["policy"], **run["config"]["budget"]["policy"]})
    # keep_best_by: null: the sim frames' held-out loss cannot judge what the cell's attempts
    # taught; the check block on held-out attempts decides (and keeps the zero-shot artifact).
    p_cfg.update({"max_time_s": float(f.max_time_s), "max_steps": int(f.max_steps),
                  "val_every_n_steps": int(f.val_every_n_steps), "base": None, "keep_best_by": None})
    if "optim" in f:
        p_cfg["optim"] = {**(p_cfg.get("optim") or {}), **OmegaConf.to_container(f.optim, resolve=True)}
    view = NetworkView.from_dict(json.loads((Path(run["artifact"]) / "metadata.json").read_text())["view"])
    real = RealAttempts(train_att, calib, view, int(p_cfg["angle_bins"]), float(f.label_weight))
    translator = None
    if run.get("translator"):
        translator = Translator(run["translator"])
    out = Path(str(cfg.output_dir))
    g = f.geometry
    geometry = finetune_run_geometry(run, p_cfg, train_att, calib, g, out / "geometry", int(cfg.seed))
    if geometry.get("path"):
        p_cfg["geometry"] = geometry["path"]  # the candidate's export puts the fine-tuned network in
    summary = train_policy(
        OmegaConf.create({"policy": p_cfg, "seed": int(cfg.seed), "logger": OmegaConf.to_container(cfg.logger)}),
        [run["sim_dataset"]], out / "train", translator=translator, seed=int(cfg.seed),
        init_from=policy["checkpoint"], extra_train=real, extra_fraction=float(f.real_fraction),
    )
    # The fine-tuned artifact is always kept in candidate/ (int8 graphs added there, where
    # nothing serves it yet); artifact/ is written once, whole, after the decision.
    candidate = replace_tree(summary["artifact"], out / "candidate")
    int8 = _int8_like_the_run(run, candidate, calib)
    _cell_entries_like_the_run(run, candidate)
    check_frames = [_read_frame(a) for a in check_att]  # read once for both artifacts
    check_labels = [stop_label(a["grasp"], a["outcome"], calib.table_z, float(g.part_between_m), float(g.closed_m))
                    for a in check_att]
    kw = {"labels": check_labels, "tolerance": float(g.tolerance_m), "footprint_step": float(g.footprint_step_m)}
    before, before_q, before_stops = check_block(run["artifact"], check_att, check_frames, calib, **kw)
    after, after_q, after_stops = check_block(candidate, check_att, check_frames, calib, **kw)
    block, resamples = int(f.auc_interval.block_attempts), int(f.auc_interval.resamples)
    auc_change = auc_difference(before_q, after_q, [bool(a["outcome"]["success"]) for a in check_att],
                                block, resamples, int(cfg.seed))
    # The stops judge the candidate only when its geometry is not the run's.
    stop_change = (stop_error_difference(before_stops, after_stops, block, resamples, int(cfg.seed))
                   if geometry.get("path") else None)
    held_out = bool(set(train_idx.tolist()).isdisjoint(check_idx.tolist()))
    promotion = promotion_decision(auc_change, held_out, cfg.force, stop_change)
    # Not promoted: the run's artifact byte for byte (replace_tree copies beside, then renames).
    artifact = replace_tree(candidate if promotion.promoted else run["artifact"], out / "artifact")
    log.info("finetune: kept the %s artifact in %s: %s", "fine-tuned" if promotion.promoted else "zero-shot",
             artifact, promotion.reason)
    report = {
        "run_dir": str(run_dir), "recordings": [str(r) for r in cfg.recordings], "artifact": str(artifact),
        "candidate": str(candidate), "promoted": promotion.promoted, "promotion_reason": promotion.reason,
        "budget": str(cfg.budget.name), "seed": int(cfg.seed), "calibration": run["calibration"],
        "attempts": {"with_outcome": len(attempts), "successes": int(sum(a["outcome"]["success"] for a in attempts)),
                     "train": len(train_att), "check": len(check_att), "held_out": held_out,
                     # What the robot measured (CONTRACT.md section 7): labels on the geometry (policies/stops.py).
                     "with_measured": sum(bool(measured(a["outcome"])) for a in attempts),
                     "contact_stops": sum(measured(a["outcome"]).get("contact_stop") is True for a in attempts)},
        "geometry": geometry,
        "check": {"before": before, "after": after, "auc_difference": auc_change, "stop_error_difference": stop_change},
        "int8": int8,
        "training": {k: summary[k] for k in ("global_step", "train_time_s", "n_train_frames", "metrics")},
        "config": OmegaConf.to_container(cfg, resolve=True),
        "wall_s": time.perf_counter() - t0,
    }
    write_json(out / "report.json", report)
    return report


def finetune_run_geometry(run: dict, p_cfg: dict, attempts: Sequence[dict], calib: Calibration, g: Any, out: Path,
                       seed: int) -> dict:
    """The run's geometry network fine-tuned on what the robot measured in ``attempts`` beside the
    run's sim frames (:func:`policies.stops.finetune_geometry`): ``report.json``'s ``geometry``,
    with ``path`` (the new network's file) when it was, ``reason`` when it was not."""
    if not g.enabled:
        return {"finetuned": False, "reason": "finetune.geometry.enabled=false"}
    if not p_cfg.get("geometry"):
        return {"finetuned": False, "reason": "the run's policy has no geometry network (policy.geometry=null)"}
    base = load_base(p_cfg["geometry"], GEOMETRY_FORMAT)
    stops = StopFrames(attempts, calib, base_view(base, calib), float(g.part_between_m), float(g.closed_m),
                       anchor=geometry_net(base) if float(g.anchor_weight) > 0 else None,
                       anchor_clearance_m=float(g.anchor_clearance_m))
    if len(stops) == 0:
        log.info("finetune: no training attempt carries what the robot measured; the geometry stays as it was")
        return {"finetuned": False, "reason": "no training attempt carries what the robot measured (contact_stop, "
                                              "fingertip_z, jaw_width)"}
    # The run's sim frames as rendered (the geometry network's own training domain), with its augmentation.
    gcfg = {"view_size": base["view_size"], "margin": base["margin"],
            "augment": (base.get("config") or {}).get("augment")}
    sim, _, _, _ = make_geometry_datasets([run["sim_dataset"]], gcfg, 0.0, seed)
    log.info("finetune: the geometry network on %d measured attempts beside %d sim frames", len(stops), len(sim))
    return {"finetuned": True, "from": str(p_cfg["geometry"]),
            **finetune_geometry(base, stops, sim, out, OmegaConf.to_container(g, resolve=True), seed)}


def _cell_entries_like_the_run(run: dict, artifact: Path) -> None:
    """What the pipeline measured of the cell after training goes into the candidate as the run's
    artifact has it: the bin's walls (``geometry.walls``) and the camera's empty bin
    (``background`` and its image). Fine-tuning changes the networks, not the cell."""
    src = Path(run["artifact"])
    run_meta = json.loads((src / "metadata.json").read_text())
    meta = json.loads((artifact / "metadata.json").read_text())
    walls = (run_meta.get("geometry") or {}).get("walls")
    if walls is not None and meta.get("geometry") is not None:
        meta["geometry"]["walls"] = walls
    background = run_meta.get("background")
    if background is not None:
        shutil.copyfile(src / background["image"], artifact / background["image"])
        meta["background"] = background
    if walls is not None or background is not None:
        write_metadata(artifact, meta)


def _int8_like_the_run(run: dict, artifact: Path, calib: Calibration) -> dict | None:
    """The new artifact gets int8 graphs when the run's has them, calibrated as the pipeline's
    were (its real frames, its ``int8.max_frames``); without those frames it stays float (logged)."""
    if json.loads((Path(run["artifact"]) / "metadata.json").read_text()).get("int8") is None:
        return None
    max_frames = int(((run.get("config") or {}).get("int8") or {}).get("max_frames", 64))
    try:
        if not run.get("real_dir"):
            raise RealFramesError("the run's report.json names no real_dir")
        return add_int8_graphs(artifact, RealFrames(run["real_dir"], calib), max_frames)
    except (RealFramesError, Int8Error) as exc:
        log.warning("the run's artifact has int8 graphs, the fine-tuned one will not: %s", exc)
        return None


def rebased_run(run: dict, run_dir: Path) -> dict:
    """The run's paths, moved with its folder: a path under the output_dir it was written in
    that no longer exists is looked up under ``run_dir`` (a run folder can be copied or moved)."""
    old = Path(str((run.get("config") or {}).get("output_dir") or run_dir))

    def move(p: Any) -> Any:
        if not isinstance(p, str) or not p or Path(p).exists():
            return p
        for base in (old, old.resolve()):
            try:
                return str(run_dir / Path(p).relative_to(base))
            except ValueError:
                continue
        return p

    run = dict(run)
    for key in ("artifact", "sim_dataset", "translator", "calibration", "real_dir"):  # real_dir: the int8 ranges
        run[key] = move(run.get(key))
    run["policy"] = {**run["policy"], "checkpoint": move(run["policy"]["checkpoint"])}
    return run


def _summary(report: dict) -> str:
    b, a, d = report["check"]["before"], report["check"]["after"], report["check"]["auc_difference"]
    change = ""
    if d and d["interval"]:
        lo, hi = d["interval"]
        verdict = "better" if lo > 0 else "worse" if hi < 0 else "no difference the check block can resolve"
        change = f" ({d['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]: {verdict})"
    stops = ""
    if b.get("stops") and a.get("stops") and b["stops"]["stops"]:
        stops = (f", geometry at {b['stops']['stops']} measured stops {format_number(b['stops']['stop_error_median_mm'])}"
                 f" -> {format_number(a['stops']['stop_error_median_mm'])} mm median")
    kept = (f"kept the fine-tuned artifact in {report['artifact']}" if report["promoted"] else
            f"kept the zero-shot artifact in {report['artifact']} (the fine-tuned one: {report['candidate']})")
    return (f"fine-tuned on {report['attempts']['train']} attempts, checked on {report['attempts']['check']}: "
            f"AUC {format_number(b['auc'])} -> {format_number(a['auc'])}{change}, "
            f"null rate {format_number(b['null_rate'])} -> {format_number(a['null_rate'])}{stops} ({report['wall_s']:.0f} s)\n"
            f"{kept}: {report['promotion_reason']}")


def _run(cfg: DictConfig) -> None:
    logging.getLogger().setLevel(logging.INFO)
    print(_summary(finetune(cfg)))


def main() -> None:
    run_hydra_command("finetune", "sim2real-finetune", __doc__ or "", _run,
                      (FinetuneError, ArtifactError, CalibrationError, ValueError, OSError))


if __name__ == "__main__":
    main()
