"""Closed-loop grasping evaluation in the PyBullet twin (``sim2real-eval``).

Protocol (one call of :func:`evaluate` = one domain):

- Episode ``e`` is the scene ``e`` of the render profile with ``object_split: test`` (the
  held-out objects, directories ``*0``), drawn from ``SeedSequence([EVAL_SEED_BASE + seed,
  e])``: disjoint from every training render (training seeds are small integers) and
  replayable. The profile decides 1-5 objects, the physics ranges and the look.
- Each attempt renders the current scene once in the domain's profile (new camera jitter,
  visuals, lighting, distractors and sensor noise per attempt; frames at the profile's
  ``resolution_scale`` of the calibration's ``image_size`` unless ``render_scale`` is
  given), asks the policy for a grasp (raw RGB -> :class:`perception.core.decode.DecodedGrasp`)
  and executes it with the floating hand (:meth:`sim_render.gripper.FloatingHand.execute`),
  at the scene's gripper force.
- A lifted object leaves the scene. A failed attempt counts against the object under the
  grasp (the first object a vertical ray at the grasp hits, else the nearest object centre
  within 5 cm); an object that failed twice is given up (removed, not cleared). Objects
  that leave the workspace are removed too. An episode ends when no object is left, after
  ``2 x objects`` attempts, or at a "no grasp" answer (the policy says nothing left is worth
  grasping, which the contract allows: it is not an attempt, and the objects left count
  against clearance; ``no_grasp="attempt"`` counts it as a failed attempt instead).
- Results: attempts, successes, success rate (successes / attempts) with a Wilson 95%
  interval, clearance (objects lifted / objects), "no grasp" answers.

This module is the protocol and ``sim2real-eval``. The policies it runs:
:mod:`policies.eval_adapters` (the artifact, exactly as the service runs it, and a network in
memory) and :mod:`policies.eval_brackets` (the reference policies that look at the simulator:
the oracle, its pixel version, random, the rule on the observed depth). It never drives
PyBullet itself: the twin's episode operations (render a frame, remove an object, what lies
under a grasp, strays) are :class:`sim_render.scene.SceneRenderer`'s and
:class:`sim_render.cell.Cell`'s.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from perception.core.artifact import ArtifactError
from perception.core.calibration import Calibration, CalibrationError, load_calibration
from perception.core.cli import config_number, run_hydra_command
from perception.core.decode import DecodedGrasp
from perception.core.geometry import table_view
from perception.core.jsonio import write_json
from perception.core.progress import progress
from policies.eval_adapters import EvalPolicy, OnnxPolicy
from policies.eval_brackets import (
    EvalContext,
    ObservedRulePolicy,
    OraclePixelPolicy,
    OraclePolicy,
    RandomPolicy,
)

__all__ = [
    "EVAL_SEED_BASE",
    "evaluate",
    "evaluate_domains",
    "evaluate_empty_bin",
    "load_profile",
    "newcombe_interval",
    "wilson_interval",
    "main",
]

log = logging.getLogger(__name__)

#: Evaluation scenes come from ``SeedSequence([EVAL_SEED_BASE + seed, episode])``.
EVAL_SEED_BASE = 1_000_000
#: Added to the evaluation seed for the empty-bin frames, so they are scenes of their own.
EMPTY_BIN_SEED_OFFSET = 50_000
#: Failed attempts after which an object is given up.
MAX_ATTEMPTS_PER_OBJECT = 2
#: A failed grasp is blamed on the nearest object centre within this distance, metres.
BLAME_RADIUS = 0.05


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for ``z = 1.96``)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_interval(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """The difference ``k1/n1 - k2/n2`` of two proportions and its 95% interval
    (Newcombe's hybrid score, from their :func:`wilson_interval` s)."""
    p1, p2 = k1 / max(n1, 1), k2 / max(n2, 1)
    l1, u1 = wilson_interval(k1, n1)
    l2, u2 = wilson_interval(k2, n2)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


# ----------------------------------------------------------------------------- profiles
def load_profile(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The render profile ``conf/render/<name>.yaml``, composed (``render.<key>=...`` overrides)."""
    from sim_render.api import compose_config  # lazy: hydra (checks answer first)

    try:
        return compose_config("render", [f"render={name}", *overrides]).render
    except Exception as exc:
        known = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "render").glob("*.yaml"))
        raise ValueError(f"cannot load render profile {name!r} ({exc}); known profiles: {known}") from exc


def _eval_profile(profile: DictConfig | dict, render_scale: float | None) -> DictConfig:
    cfg = OmegaConf.create(
        OmegaConf.to_container(profile, resolve=True) if isinstance(profile, DictConfig) else dict(profile)
    )
    cfg.object_split = "test"
    cfg.frames_per_scene = 1
    cfg.empty_scene_prob = 0.0  # an episode needs objects to grasp; an empty bin is no episode
    if render_scale is not None:
        cfg.resolution_scale = float(render_scale)
    return cfg


# ----------------------------------------------------------------------------- the loop
class _Episodes:
    """The attempts of one domain's episodes (the protocol in the module docstring), with the
    running totals and "no grasp" reasons."""

    def __init__(self, policy: Any, renderer: Any, cfg: DictConfig, max_attempts_per_object: int, no_grasp: str,
                 camera_calibration: str) -> None:
        self.policy, self.renderer, self.cfg = policy, renderer, cfg
        self.world = renderer.world()
        self.max_attempts = int(max_attempts_per_object)
        self.no_grasp, self.camera_calibration = no_grasp, camera_calibration
        self.uses_pixels = bool(getattr(policy, "uses_pixels", True))
        self.totals = {"objects": 0, "attempts": 0, "successes": 0, "cleared": 0, "no_grasp": 0, "given_up": 0,
                       "strays": 0}
        self.reasons: dict[str, int] = {}

    def ask(self, rngs: dict, force: float) -> DecodedGrasp:
        """Render the scene as it stands (pixel policies) and ask the policy for a grasp."""
        w, policy = self.world, self.policy
        frame = self.renderer.render_frame(rngs["visuals"]) if self.uses_pixels else None
        camera = frame.camera if frame is not None else None
        if hasattr(policy, "bind"):
            policy.bind(EvalContext(w.cell, w.hand, w.calib, self.cfg, w.timing, force, rngs["grasps"], camera,
                                    frame=frame))
        if camera is not None and self.camera_calibration == "actual" and getattr(policy, "takes_calibration", False):
            return policy(frame.rgb, calibration=camera.scaled(tuple(w.calib.image_size)))
        return policy(frame.rgb if frame is not None else None)

    def execute(self, dec: DecodedGrasp, force: float, ep: dict, failed: dict[int, int]) -> dict:
        """Execute an answered grasp; the lifted object leaves, a twice-failed one is given up."""
        cell = self.world.cell
        target = cell.object_under(dec.grasp.position[0], dec.grasp.position[1], BLAME_RADIUS)
        out = self.world.hand.execute(dec.grasp, force, self.world.timing)
        rec = {"grasp": dec.grasp.to_dict(), "success": bool(out.success)}
        if out.success and 0 <= out.lifted_object < len(cell.bodies.objects):
            cell.remove_object(out.lifted_object)
            ep["successes"] += 1
            ep["cleared"] += 1
        else:
            rec["success"] = False
            if target is not None and target in cell.bodies.objects:
                failed[target] = failed.get(target, 0) + 1
                if failed[target] >= self.max_attempts:
                    cell.remove_object(cell.bodies.objects.index(target))
                    self.totals["given_up"] += 1
        cell.settle(int(self.cfg.physics.settle_steps) // 2)
        ep["strays"] += cell.remove_strays()
        return rec

    def episode(self, e: int) -> dict:
        """Scene ``e`` until it is clear, the attempts run out or the policy answers no grasp."""
        cell = self.world.cell
        rngs, params = self.renderer.build_scene(e)
        force = float(params["physics"]["gripper_force"])
        n0 = len(cell.bodies.objects)
        failed: dict[int, int] = {b: 0 for b in cell.bodies.objects}
        ep = {"episode": e, "objects": n0, "attempts": 0, "successes": 0, "cleared": 0, "outcomes": []}
        ep["strays"] = cell.remove_strays()
        while cell.bodies.objects and ep["attempts"] < self.max_attempts * n0:
            dec = self.ask(rngs, force)
            if dec.grasp is None:
                self.totals["no_grasp"] += 1
                key = (dec.reason or "no grasp").split("(")[0].strip()
                self.reasons[key] = self.reasons.get(key, 0) + 1
                ep["outcomes"].append({"grasp": None, "success": False, "reason": dec.reason})
                if self.no_grasp == "end_episode":
                    break
                ep["attempts"] += 1
                continue
            ep["attempts"] += 1
            ep["outcomes"].append(self.execute(dec, force, ep, failed))
        for key in ("objects", "attempts", "successes", "cleared", "strays"):
            self.totals[key] += ep[key]
        return ep


def evaluate(
    policy: EvalPolicy | Callable[[np.ndarray | None], DecodedGrasp],
    domain_profile_cfg: DictConfig | dict | str,
    calib: Calibration,
    n_episodes: int,
    seed: int = 0,
    render_scale: float | None = None,
    max_attempts_per_object: int = MAX_ATTEMPTS_PER_OBJECT,
    episode_offset: int = 0,
    time_limit_s: float | None = None,
    keep_episodes: bool = True,
    no_grasp: str = "end_episode",
    camera_calibration: str = "actual",
) -> dict:
    """Run the closed loop on one domain (see the module docstring for the protocol).

    Args:
        policy: raw RGB ``(h, w, 3)`` uint8 -> :class:`DecodedGrasp` (see :class:`EvalPolicy`).
        domain_profile_cfg: a render profile config, or its name (``conf/render/<name>.yaml``).
        calib: the twin's nominal calibration (the policy's own is its business).
        n_episodes: episodes (scenes) to run.
        seed: evaluation seed; scenes come from ``SeedSequence([EVAL_SEED_BASE + seed, e])``.
        render_scale: raw frame size as a fraction of ``calib.image_size`` (``None``: the
            profile's ``resolution_scale``).
        max_attempts_per_object: failed attempts after which an object is given up.
        episode_offset: first episode index (to split a run).
        time_limit_s: stop starting new episodes after this long (the result says so).
        keep_episodes: include per-episode records.
        no_grasp: what a "no grasp" answer does: ``"end_episode"`` (the default: the policy
            says nothing left is worth grasping; the episode ends, the objects left count
            against clearance, no attempt is counted) or ``"attempt"`` (a failed attempt).
        camera_calibration: the calibration a pixel policy gets with each frame:
            ``"actual"`` (default) the camera that rendered it, as a user who calibrated their
            camera gives it (policies with ``takes_calibration``); ``"nominal"`` the policy's
            own, so the profile's camera jitter acts as calibration error.

    Returns:
        ``domain``, ``policy``, ``episodes``, ``objects``, ``attempts``, ``successes``,
        ``rate``, ``rate_ci95`` ``[lo, hi]``, ``cleared``, ``clearance``, ``no_grasp``,
        ``given_up``, ``strays`` (objects that left the workspace), ``seed``, ``render_size``,
        ``time_s``, ``truncated``, ``reasons`` (counts of "no grasp" reasons), ``episodes_detail``.
    """
    from sim_render.scene import SceneRenderer, render_size  # lazy: pybullet (checks answer first)

    if camera_calibration not in ("actual", "nominal"):
        raise ValueError(f"camera_calibration must be 'actual' or 'nominal', got {camera_calibration!r}")
    if no_grasp not in ("end_episode", "attempt"):
        raise ValueError(f"no_grasp must be 'end_episode' or 'attempt', got {no_grasp!r}")
    if isinstance(domain_profile_cfg, str):
        domain_profile_cfg = load_profile(domain_profile_cfg)
    cfg = _eval_profile(domain_profile_cfg, render_scale)
    domain = str(cfg.get("name", "unnamed"))
    uses_pixels = bool(getattr(policy, "uses_pixels", True))
    renderer = SceneRenderer(calib, cfg, EVAL_SEED_BASE + int(seed))
    t0 = time.perf_counter()
    episodes = []
    truncated = False
    name = getattr(policy, "name", "policy")
    # A bar at a terminal, a line every few percent of the episodes in a log (one line per
    # episode was most of a budget=small log once the bars were gone); each episode's record
    # is in the result (keep_episodes) and, for the curious, at DEBUG.
    bar = progress(total=int(n_episodes), desc=f"eval {domain} {name}", unit="episode")
    try:
        run = _Episodes(policy, renderer, cfg, max_attempts_per_object, no_grasp, camera_calibration)
        for e in range(episode_offset, episode_offset + int(n_episodes)):
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                truncated = True
                break
            ep = run.episode(e)
            episodes.append(ep)
            log.debug("%s %s episode %d: %d/%d attempts succeeded, %d/%d objects cleared", domain, name, e,
                      ep["successes"], ep["attempts"], ep["cleared"], ep["objects"])
            t = run.totals
            bar.set_postfix_str(f"{t['successes']}/{t['attempts']} attempts succeeded, "
                                f"{t['cleared']}/{t['objects']} objects cleared")
            bar.update(1)
    finally:
        bar.close()
        renderer.close()
    totals, reasons = run.totals, run.reasons
    n, k = totals["attempts"], totals["successes"]
    lo, hi = wilson_interval(k, n)
    result = {
        "domain": domain,
        "policy": getattr(policy, "name", type(policy).__name__),
        "episodes": len(episodes),
        **totals,
        "rate": k / n if n else 0.0,
        "rate_ci95": [lo, hi],
        "clearance": totals["cleared"] / totals["objects"] if totals["objects"] else 0.0,
        "seed": int(seed),
        "scene_seed": EVAL_SEED_BASE + int(seed),
        "episode_range": [int(episode_offset), int(episode_offset) + len(episodes)],
        "render_size": list(render_size(calib, float(cfg.resolution_scale))) if uses_pixels else None,
        "camera_calibration": camera_calibration if uses_pixels else None,
        "time_s": time.perf_counter() - t0,
        "truncated": truncated,
        "reasons": reasons,
    }
    if keep_episodes:
        result["episodes_detail"] = episodes
    return result


def evaluate_empty_bin(
    policy: EvalPolicy,
    domain_profile_cfg: DictConfig | dict | str,
    calib: Calibration,
    n_frames: int,
    seed: int = 0,
    render_scale: float | None = None,
) -> dict:
    """How often the policy answers no grasp on frames of the empty bin.

    A grasp on a bare floor is worse than none: after a cleared bin the answer should be
    null. Frames come from the domain's randomization (in ``randomized``: natural-image
    floors, bin floors of their own look) with the bin forced empty, from scenes
    ``SeedSequence([EVAL_SEED_BASE + seed + EMPTY_BIN_SEED_OFFSET, i])``.

    Returns:
        ``domain``, ``frames``, ``null``, ``rate`` (null answers / frames), ``rate_ci95``,
        ``qualities`` (of the grasps answered), ``time_s``.
    """
    from sim_render.scene import SceneRenderer  # lazy: pybullet (checks answer first)

    if isinstance(domain_profile_cfg, str):
        domain_profile_cfg = load_profile(domain_profile_cfg)
    cfg = _eval_profile(domain_profile_cfg, render_scale)
    cfg.empty_scene_prob = 1.0
    renderer = SceneRenderer(calib, cfg, EVAL_SEED_BASE + EMPTY_BIN_SEED_OFFSET + int(seed))
    t0 = time.perf_counter()
    nulls, qualities = 0, []
    try:
        calib_size = tuple(renderer.world().calib.image_size)
        for i in range(int(n_frames)):
            rngs, _ = renderer.build_scene(i)
            frame = renderer.render_frame(rngs["visuals"])
            if getattr(policy, "takes_calibration", False):
                dec = policy(frame.rgb, calibration=frame.camera.scaled(calib_size))
            else:
                dec = policy(frame.rgb)
            if dec.grasp is None:
                nulls += 1
            else:
                qualities.append(float(dec.grasp.quality))
    finally:
        renderer.close()
    lo, hi = wilson_interval(nulls, int(n_frames))
    return {"domain": str(cfg.get("name", "unnamed")), "frames": int(n_frames), "null": nulls,
            "rate": nulls / n_frames if n_frames else 0.0, "rate_ci95": [lo, hi], "qualities": qualities,
            "time_s": time.perf_counter() - t0}


def evaluate_domains(
    policy: EvalPolicy | None,
    domains: Sequence[str],
    calib: Calibration,
    n_episodes: int,
    seed: int = 0,
    brackets: Sequence[str] = ("oracle", "random"),
    bracket_domain: str = "randomized",
    bracket_episodes: int | None = None,
    render_scale: float | None = None,
    keep_episodes: bool = False,
    no_grasp: str = "end_episode",
    camera_calibration: str = "actual",
    empty_bin_frames: int = 0,
) -> dict:
    """The policy on each domain, plus the brackets once (on ``bracket_domain``).

    With ``empty_bin_frames > 0`` also :func:`evaluate_empty_bin` on each domain
    (``out["empty_bin"][domain]``).

    ``policy=None`` runs the brackets alone. Brackets: ``oracle``, ``random``,
    ``rule_observed`` (:class:`ObservedRulePolicy`, in the policy's view when it is a table
    view, else a 96 px one) and, with a policy, ``oracle_pixels`` (:class:`OraclePixelPolicy`
    in the policy's view).

    Returns:
        ``{"policy": {domain: result}, "brackets": {name: result}}``.
    """
    out: dict[str, Any] = {"policy": {}, "brackets": {}}
    for d in domains if policy is not None else ():
        out["policy"][d] = evaluate(
            policy, d, calib, n_episodes, seed, render_scale, keep_episodes=keep_episodes, no_grasp=no_grasp,
            camera_calibration=camera_calibration,
        )
        if empty_bin_frames > 0:
            out.setdefault("empty_bin", {})[d] = evaluate_empty_bin(policy, d, calib, empty_bin_frames, seed,
                                                                    render_scale)

    pview = getattr(policy, "view", None)
    rule_view = pview if pview is not None and pview.is_table else table_view(calib, (96, 96))
    make: dict[str, Callable[[], EvalPolicy]] = {
        "oracle": OraclePolicy, "random": RandomPolicy,
        "rule_observed": lambda: ObservedRulePolicy(rule_view, int(getattr(policy, "angle_bins", 12))),
    }
    if policy is not None and hasattr(policy, "view") and hasattr(policy, "angle_bins"):
        make["oracle_pixels"] = lambda: OraclePixelPolicy(policy.view, policy.angle_bins)  # type: ignore[union-attr]
    for b in brackets:
        if b not in make:
            raise ValueError(f"unknown bracket {b!r}; known: {sorted(make)} (oracle_pixels needs a policy)")
        out["brackets"][b] = evaluate(
            make[b](), bracket_domain, calib, bracket_episodes or n_episodes, seed, keep_episodes=keep_episodes,
            no_grasp=no_grasp,
        )
    return out


# ----------------------------------------------------------------------------- CLI
def _summary_line(name: str, r: dict) -> str:
    lo, hi = r["rate_ci95"]
    return (f"{name:>24}: {r['successes']:3d}/{r['attempts']:3d} = {100 * r['rate']:5.1f}% "
            f"[{100 * lo:4.1f}, {100 * hi:4.1f}]  clearance {100 * r['clearance']:5.1f}%  ({r['time_s']:.0f} s)")


def run_eval(cfg: DictConfig) -> dict:
    """What ``sim2real-eval`` does; returns the JSON it writes."""

    # Ranges before any work (ValueError names the key; the command exits 2).
    config_number(cfg, "n_episodes", int, lo=1)
    config_number(cfg, "empty_bin_frames", int, lo=0)
    config_number(cfg, "workspace_margin", float, lo=0)
    if cfg.bracket_episodes is not None:
        config_number(cfg, "bracket_episodes", int, lo=1)
    if cfg.quality_threshold is not None:
        config_number(cfg, "quality_threshold", float, lo=0, hi=1)
    if cfg.render_scale is not None:
        config_number(cfg, "render_scale", float, lo=0, lo_open=True)
    policy = None
    if cfg.artifact:
        policy = OnnxPolicy(cfg.artifact, cfg.calibration, cfg.quality_threshold, cfg.workspace_margin,
                            precision=str(cfg.precision))
        calib = policy.calibration
    else:
        calib = load_calibration(cfg.calibration)
    result: dict[str, Any] = {
        "artifact": str(cfg.artifact) if cfg.artifact else None,
        "calibration": calib.to_dict(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    res = evaluate_domains(
        policy, list(cfg.domains), calib, int(cfg.n_episodes), int(cfg.seed), list(cfg.brackets),
        str(cfg.bracket_domain), cfg.bracket_episodes, cfg.render_scale, keep_episodes=bool(cfg.keep_episodes),
        no_grasp=str(cfg.no_grasp), camera_calibration=str(cfg.camera_calibration),
        empty_bin_frames=int(cfg.empty_bin_frames),
    )
    result.update(res)
    out = Path(cfg.output) if cfg.output else (Path(cfg.artifact) / "eval.json" if cfg.artifact else Path("eval.json"))
    write_json(out, result)
    for d, r in result["policy"].items():
        print(_summary_line(f"policy@{d}", r))
    for b, r in result["brackets"].items():
        print(_summary_line(f"{b}@{r['domain']}", r))
    for d, r in result.get("empty_bin", {}).items():
        print(f"{'empty bin@' + d:>24}: {r['null']:3d}/{r['frames']:3d} answered no grasp")
    print(f"wrote {out}")
    return result


def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig  # lazy: hydra (checks answer first)

    # Hydra has configured the root logger already (basicConfig would do nothing): set its level.
    logging.getLogger().setLevel(logging.INFO if cfg.verbose else logging.WARNING)
    if cfg.verbose:  # the episode log too: a line per episode, kept at DEBUG out of the pipeline's log
        log.setLevel(logging.DEBUG)
    if not cfg.artifact:
        # A bare command would run the reference policies for a minute and write ./eval.json.
        given = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
        if "brackets" not in given:
            print("sim2real-eval: error: nothing to evaluate: give artifact=DIR (a policy artifact) or "
                  "brackets=[oracle,random] (the reference policies alone)", file=sys.stderr)
            sys.exit(2)
    run_eval(cfg)


def main() -> None:
    run_hydra_command("eval", "sim2real-eval", __doc__ or "", _run, (ArtifactError, CalibrationError, ValueError, OSError),
                      writable_dirs=())
