"""Closed-loop grasping evaluation in the PyBullet twin (``sim2real-eval``).

Protocol (one call of :func:`evaluate` = one domain):

- Episode ``e`` is the scene ``e`` of the render profile with ``object_split: test`` (the
  held-out objects, directories ``*0``), drawn from ``SeedSequence([EVAL_SEED_BASE + seed,
  e])``: disjoint from every training render (training seeds are small integers) and
  replayable. The profile decides 1-5 objects, the physics ranges and the look.
- Each attempt renders the current scene once in the domain's profile (new camera jitter,
  visuals, lighting, distractors and sensor noise per attempt; frames at the profile's
  ``resolution_scale`` of the calibration's ``image_size`` unless ``render_scale`` is
  given), asks the policy for a grasp (raw RGB -> :class:`perception.decode.DecodedGrasp`)
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

Policies: :class:`OnnxPolicy` (the artifact, exactly as the service runs it: ``PolicyRunner``
+ :func:`perception.decode.decode_grasp`), :class:`TorchPolicy` (a network in memory, same
decode), and the brackets :class:`OraclePolicy` (the labeller's candidates executed from the
saved state; the best physics-verified one) and :class:`RandomPolicy`, which ignore pixels
and are run once.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from perception.calibration import Calibration
from perception.decode import DecodedGrasp, decode_grasp
from perception.geometry import NetworkView, project_points
from perception.grasp import Grasp
from perception.jsonio import write_json

__all__ = [
    "EVAL_SEED_BASE",
    "EvalContext",
    "EvalPolicy",
    "OnnxPolicy",
    "TorchPolicy",
    "OraclePolicy",
    "OraclePixelPolicy",
    "RandomPolicy",
    "ObservedRulePolicy",
    "evaluate",
    "evaluate_domains",
    "load_profile",
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


# ----------------------------------------------------------------------------- policies
@dataclass
class EvalContext:
    """What the evaluator exposes to bracket policies (which look at the simulator, not pixels)."""

    cell: Any
    hand: Any
    calib: Calibration
    cfg: DictConfig
    timing: Any
    force: float
    rng: np.random.Generator
    camera: Calibration | None = None  # the actual (jittered) camera of this attempt's frame
    view: NetworkView | None = None  # the policy's view, for OraclePixelPolicy
    frame: Any = None  # the attempt's rendered frame (RGB, depth, segmentation), for ObservedRulePolicy


class EvalPolicy(Protocol):
    """A policy under evaluation: ``policy(raw_rgb) -> DecodedGrasp``.

    ``uses_pixels = False`` lets the evaluator skip rendering (the policy is then called
    with ``None``); ``bind(ctx)``, when present, is called before every attempt;
    ``takes_calibration = True`` means ``policy(raw_rgb, calibration=...)`` accepts the
    calibration of the camera that took the frame.
    """

    name: str
    uses_pixels: bool

    def __call__(self, raw_rgb: np.ndarray | None) -> DecodedGrasp: ...


def _decoded(grasp: Grasp, calib: Calibration) -> DecodedGrasp:
    px = project_points(np.asarray([grasp.position]), calib)[0]
    return DecodedGrasp(grasp=grasp, view_pixel=None, pixel=(float(px[0]), float(px[1])), reason=None)


class OnnxPolicy:
    """The exported artifact, run exactly as the service runs it.

    Args:
        artifact_dir: the artifact folder.
        calibration: the serving calibration (``None``: the artifact's own).
        threshold: quality threshold (``None``: the artifact's ``quality_threshold``).
        workspace_margin: metres the workspace is shrunk by in the decode.
        intra_op_num_threads: onnxruntime threads.
    """

    uses_pixels = True
    takes_calibration = True

    def __init__(
        self,
        artifact_dir: str | Path,
        calibration: Calibration | str | Path | None = None,
        threshold: float | None = None,
        workspace_margin: float = 0.0,
        intra_op_num_threads: int | None = None,
        precision: str = "auto",
    ) -> None:
        from perception.artifact import PolicyRunner

        self.runner = PolicyRunner(artifact_dir, calibration, intra_op_num_threads=intra_op_num_threads,
                                   precision=precision)
        self.threshold = float(self.runner.meta.quality_threshold if threshold is None else threshold)
        self.workspace_margin = float(workspace_margin)
        self.name = f"onnx:{Path(artifact_dir).name}"

    @property
    def calibration(self) -> Calibration:
        return self.runner.calib

    @property
    def view(self) -> NetworkView:
        return self.runner.view

    @property
    def angle_bins(self) -> int:
        return self.runner.meta.angle_bins

    def __call__(self, raw_rgb: np.ndarray | None, calibration: Calibration | None = None) -> DecodedGrasp:
        """Grasp for one raw frame; ``calibration`` overrides the serving one for this frame."""
        calib = self.runner.calib if calibration is None else calibration
        maps = self.runner.infer(raw_rgb, calibration=calibration)
        return decode_grasp(
            maps.quality, maps.width, maps.height, calib, self.runner.view, self.threshold,
            workspace_margin=self.workspace_margin, surface=maps.surface, **self.runner.meta.decode,
        )


class TorchPolicy:
    """A :class:`~policies.networks.GraspNet` (or a module holding one) in memory.

    Args:
        module: the network or :class:`~policies.module.GraspPolicyModule`.
        view, calibration: the network view and nominal calibration; taken from the
            module's hyperparameters when ``None``.
        threshold: quality threshold.
        device: torch device.
    """

    uses_pixels = True
    takes_calibration = True

    def __init__(
        self,
        module: Any,
        view: NetworkView | None = None,
        calibration: Calibration | None = None,
        threshold: float = 0.5,
        workspace_margin: float = 0.0,
        device: str = "cpu",
    ) -> None:
        import torch

        from policies.networks import ExportWrapper

        hp = getattr(module, "hparams", {}) or {}
        if view is None:
            if not hp.get("view"):
                raise ValueError("TorchPolicy needs a view (the module has none in its hyperparameters)")
            view = NetworkView.from_dict(hp["view"])
        if calibration is None:
            if not hp.get("calibration"):
                raise ValueError("TorchPolicy needs a calibration (the module has none in its hyperparameters)")
            calibration = Calibration.from_dict(hp["calibration"], check_view=False)
        self.net = getattr(module, "net", module).to(device).eval()
        self.view, self.calibration = view, calibration
        self.angle_bins = int(self.net.angle_bins)
        self.threshold = float(threshold)
        self.workspace_margin = float(workspace_margin)
        # The decode options and the exported graph's forward (with its test-time mirror
        # average when configured) the policy was trained with, as its artifact carries them.
        pcfg = (hp.get("config") or {}).get("policy", {})
        self.decode = dict(pcfg.get("decode") or {})
        self.graph = ExportWrapper(self.net, bool(pcfg.get("flip_average", False))).to(device).eval()
        self.device = device
        self._torch = torch
        self.name = "torch"

    def maps(
        self, raw_rgb: np.ndarray, calibration: Calibration | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``quality (A, H, W)``, ``width (H, W)``, ``height (H, W)``, ``surface (H, W)`` of one raw frame."""
        from perception.preprocess import preprocess, to_network_input

        torch = self._torch
        calib = self.calibration if calibration is None else calibration
        x = torch.from_numpy(to_network_input(preprocess(raw_rgb, calib, self.view))).to(self.device)
        with torch.no_grad():
            q, w, h, s = self.graph(x)
        return q[0].cpu().numpy(), w[0, 0].cpu().numpy(), h[0, 0].cpu().numpy(), s[0, 0].cpu().numpy()

    def __call__(self, raw_rgb: np.ndarray | None, calibration: Calibration | None = None) -> DecodedGrasp:
        """Grasp for one raw frame; ``calibration`` overrides the policy's for this frame."""
        calib = self.calibration if calibration is None else calibration
        q, w, h, s = self.maps(raw_rgb, calib)
        return decode_grasp(q, w, h, calib, self.view, self.threshold, workspace_margin=self.workspace_margin,
                            surface=s, **self.decode)


class OraclePolicy:
    """The labeller's best physics-verified candidate (upper bracket; ignores pixels).

    Every attempt generates the labeller's candidates (``n_heuristic`` + ``n_random`` of the
    profile's ``grasps`` section) on the current scene, executes each from the saved physics
    state (restored after each) and returns a successful one, heuristic candidates first;
    "no grasp" when none succeeded.
    """

    name = "oracle"
    uses_pixels = False

    def __init__(self, n_heuristic: int | None = None, n_random: int | None = None) -> None:
        self.n_heuristic, self.n_random = n_heuristic, n_random
        self.ctx: EvalContext | None = None

    def bind(self, ctx: EvalContext) -> None:
        self.ctx = ctx

    def __call__(self, raw_rgb: np.ndarray | None = None) -> DecodedGrasp:
        from sim_render.labels import heuristic_candidates, label_grasps, random_candidates

        ctx = self.ctx
        if ctx is None:
            raise RuntimeError("OraclePolicy must be bound to the evaluation (bind(ctx)) before use")
        g = ctx.cfg.grasps
        nh = int(g.n_heuristic if self.n_heuristic is None else self.n_heuristic)
        nr = int(g.n_random if self.n_random is None else self.n_random)
        hmap = ctx.cell.height_map()
        cands = heuristic_candidates(ctx.cell, hmap, nh, ctx.rng) + random_candidates(ctx.cell, hmap, nr, ctx.rng)
        labelled = label_grasps(ctx.cell, ctx.hand, cands, ctx.force, ctx.timing)
        good = sorted((lg for lg in labelled if lg.success), key=lambda lg: lg.source)
        if not good:
            return DecodedGrasp(None, None, None, f"none of {len(labelled)} labeller candidates succeeded")
        return _decoded(good[0].grasp, ctx.calib)


class OraclePixelPolicy(OraclePolicy):
    """The oracle's grasp as a perfect *pixel* policy would output it (a diagnostic bracket).

    The oracle's grasp is projected into the frame through the camera that actually rendered
    it (centre and fingertips), mapped into the network view with the calibration the policy
    is given (the nominal one, or the frame's own with ``camera_calibration="actual"``),
    snapped to the view's pixel grid and angle bins, and back-projected through that
    calibration at the grasp's true height: exactly what a policy that never errs on the
    image would execute. Its rate is the ceiling that calibration error (the profile's
    camera jitter, in ``"nominal"`` mode) and the map's discretisation leave.

    Args:
        view: the policy's network view (``network_view(calib, size)``).
        angle_bins: the policy's angle bins.
    """

    name = "oracle_pixels"
    uses_pixels = True
    takes_calibration = True

    def __init__(self, view: NetworkView, angle_bins: int = 12, **kw: Any) -> None:
        super().__init__(**kw)
        self.view, self.angle_bins = view, int(angle_bins)

    def __call__(self, raw_rgb: np.ndarray | None = None, calibration: Calibration | None = None) -> DecodedGrasp:
        from perception.geometry import raw_to_view_pixels
        from perception.grasp import angle_bin_centers, angle_to_bin, view_grasp_to_base

        dec = super().__call__(raw_rgb)
        ctx = self.ctx
        if dec.grasp is None or ctx is None or ctx.camera is None or raw_rgb is None:
            return dec
        g = dec.grasp
        pts = np.concatenate([np.asarray([g.position]), g.fingertips()])
        raw = project_points(pts, ctx.camera)  # the camera that took the frame (its size)
        calib = ctx.calib if calibration is None else calibration  # what the policy is told
        # A table view's pixel is where the ray meets the grasp's own height (what a perfect
        # policy's pixel + height amounts to); a camera view ignores the height.
        uv = raw_to_view_pixels(raw, calib.scaled((raw_rgb.shape[1], raw_rgb.shape[0])), self.view,
                                np.full(len(raw), g.position[2]))
        line = uv[2] - uv[1]
        a = angle_bin_centers(self.angle_bins)[angle_to_bin(np.arctan2(line[1], line[0]), self.angle_bins)]
        centre = np.rint(uv[:1])
        pos, yaw, _ = view_grasp_to_base(centre, np.array([a]), np.array([10.0]), np.array([g.position[2]]),
                                         calib, self.view)
        grasp = Grasp(position=pos[0], yaw=float(yaw[0]), width=g.width, quality=1.0)
        out = _decoded(grasp, calib)
        return DecodedGrasp(out.grasp, (float(centre[0, 0]), float(centre[0, 1])), out.pixel, None)


class RandomPolicy:
    """Uniform position and yaw in the workspace at the local surface height minus the
    labeller's grasp depth, opening 0.08 m (the labeller's random candidates; lower bracket)."""

    name = "random"
    uses_pixels = False

    def __init__(self) -> None:
        self.ctx: EvalContext | None = None

    def bind(self, ctx: EvalContext) -> None:
        self.ctx = ctx

    def __call__(self, raw_rgb: np.ndarray | None = None) -> DecodedGrasp:
        from sim_render.labels import random_candidates

        ctx = self.ctx
        if ctx is None:
            raise RuntimeError("RandomPolicy must be bound to the evaluation (bind(ctx)) before use")
        cand = random_candidates(ctx.cell, ctx.cell.height_map(), 1, ctx.rng)[0]
        return _decoded(cand.grasp, ctx.calib)


class ObservedRulePolicy:
    """The grasp rule on the surface the camera actually saw (a diagnostic bracket).

    The attempt's rendered depth is rebuilt top-down into a table view
    (:func:`policies.data.table_view_surface`: exactly what the policy's ``surface`` output is
    trained towards, unseen cells as free) and decoded with the rule of
    :mod:`perception.rule` alone (a flat quality map, ``quality_power`` 0), through the
    calibration the policy would be given. Its rate is what the rule decode reaches with a
    perfect surface prediction: the ceiling of geometry without learned quality.

    Args:
        view: a top-down view (the policy's, or ``table_view(calib, (96, 96))``).
        angle_bins: angle bins of the decode.
        rule: :data:`perception.rule.DEFAULT_RULE` overrides.
    """

    name = "rule_observed"
    uses_pixels = True
    takes_calibration = True

    def __init__(self, view: NetworkView, angle_bins: int = 12, rule: dict | None = None) -> None:
        if not view.is_table:
            raise ValueError("the rule_observed bracket needs a top-down view (kind 'table')")
        self.view, self.angle_bins = view, int(angle_bins)
        self.rule = {**(rule or {}), "quality_power": 0.0}
        self.ctx: EvalContext | None = None

    def bind(self, ctx: EvalContext) -> None:
        self.ctx = ctx

    def __call__(self, raw_rgb: np.ndarray | None = None, calibration: Calibration | None = None) -> DecodedGrasp:
        from policies.data import table_view_surface

        ctx = self.ctx
        if ctx is None or ctx.frame is None:
            raise RuntimeError("ObservedRulePolicy must be bound to an evaluation that renders frames")
        calib = ctx.calib if calibration is None else calibration
        f = ctx.frame
        surface_z, _, _ = table_view_surface(np.asarray(f.depth), np.asarray(f.seg_raw), f.camera, self.view)
        surface = np.where(np.isfinite(surface_z), surface_z - calib.table_z, 0.0).astype(np.float32)
        W, H = self.view.size
        flat = np.ones((self.angle_bins, H, W), np.float32)
        zeros = np.zeros((H, W), np.float32)
        return decode_grasp(flat, zeros, zeros, calib, self.view, 1e-6, surface=surface, rule=self.rule)


# ----------------------------------------------------------------------------- profiles
def load_profile(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The render profile ``conf/render/<name>.yaml``, composed (``render.<key>=...`` overrides)."""
    from sim_render.api import compose_config

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
def _remove_object(cell: Any, k: int) -> None:
    body = cell.bodies.objects.pop(k)
    cell.bodies.object_urdfs.pop(k)
    cell.client.removeBody(body)


def _blame(cell: Any, grasp: Grasp) -> int | None:
    """Body id of the object a grasp was aimed at (see the module docstring), or None."""
    x, y, _ = grasp.position
    tz = cell.calib.table_z
    hit = cell.client.rayTest([x, y, tz + 0.5], [x, y, tz - 0.01])[0]
    if hit[0] in cell.bodies.objects:
        return int(hit[0])
    best, best_d = None, BLAME_RADIUS
    for body in cell.bodies.objects:
        (bx, by, _), _ = cell.client.getBasePositionAndOrientation(body)
        d = math.hypot(bx - x, by - y)
        if d < best_d:
            best, best_d = body, d
    return best


def _drop_strays(cell: Any) -> int:
    """Remove objects that left the workspace (or fell through); returns how many."""
    n = 0
    for k in reversed(range(len(cell.bodies.objects))):
        (x, y, z), _ = cell.client.getBasePositionAndOrientation(cell.bodies.objects[k])
        if not cell.calib.in_workspace(x, y) or z < cell.calib.table_z - 0.02:
            _remove_object(cell, k)
            n += 1
    return n


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
    from sim_render.randomization import render_randomized
    from sim_render.scene import SceneRenderer, render_size

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
    totals = {"objects": 0, "attempts": 0, "successes": 0, "cleared": 0, "no_grasp": 0, "given_up": 0, "strays": 0}
    reasons: dict[str, int] = {}
    episodes = []
    truncated = False
    try:
        st = renderer._setup()
        cell, hand = st["cell"], st["hand"]
        for e in range(episode_offset, episode_offset + int(n_episodes)):
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                truncated = True
                break
            rngs, params = renderer.build_scene(e)
            force = float(params["physics"]["gripper_force"])
            n0 = len(cell.bodies.objects)
            failed: dict[int, int] = {b: 0 for b in cell.bodies.objects}
            ep = {"episode": e, "objects": n0, "attempts": 0, "successes": 0, "cleared": 0, "outcomes": []}
            ep_rng = rngs["grasps"]
            strays0 = _drop_strays(cell)
            ep["strays"] = strays0
            while cell.bodies.objects and ep["attempts"] < max_attempts_per_object * n0:
                rgb, camera = None, None
                if uses_pixels:
                    frame = render_randomized(cell.client, cell.bodies, st["calib"], rngs["visuals"], cfg)
                    rgb, camera = frame.rgb, frame.camera
                if hasattr(policy, "bind"):
                    policy.bind(EvalContext(cell, hand, st["calib"], cfg, st["timing"], force, ep_rng, camera,
                                            frame=frame if uses_pixels else None))
                if camera is not None and camera_calibration == "actual" and getattr(policy, "takes_calibration", False):
                    dec = policy(rgb, calibration=camera.scaled(tuple(st["calib"].image_size)))
                else:
                    dec = policy(rgb)
                if dec.grasp is None:
                    totals["no_grasp"] += 1
                    key = (dec.reason or "no grasp").split("(")[0].strip()
                    reasons[key] = reasons.get(key, 0) + 1
                    ep["outcomes"].append({"grasp": None, "success": False, "reason": dec.reason})
                    if no_grasp == "end_episode":
                        break
                    ep["attempts"] += 1
                    continue
                ep["attempts"] += 1
                target = _blame(cell, dec.grasp)
                out = hand.execute(dec.grasp, force, st["timing"])
                rec = {"grasp": dec.grasp.to_dict(), "success": bool(out.success)}
                if out.success and 0 <= out.lifted_object < len(cell.bodies.objects):
                    _remove_object(cell, out.lifted_object)
                    ep["successes"] += 1
                    ep["cleared"] += 1
                else:
                    rec["success"] = False
                    if target is not None and target in cell.bodies.objects:
                        failed[target] = failed.get(target, 0) + 1
                        if failed[target] >= max_attempts_per_object:
                            _remove_object(cell, cell.bodies.objects.index(target))
                            totals["given_up"] += 1
                cell.settle(int(cfg.physics.settle_steps) // 2)
                ep["strays"] += _drop_strays(cell)
                ep["outcomes"].append(rec)
            totals["objects"] += n0
            totals["attempts"] += ep["attempts"]
            totals["successes"] += ep["successes"]
            totals["cleared"] += ep["cleared"]
            totals["strays"] += ep["strays"]
            episodes.append(ep)
            log.info("%s %s episode %d: %d/%d attempts succeeded, %d/%d objects cleared",
                     domain, getattr(policy, "name", "policy"), e, ep["successes"], ep["attempts"], ep["cleared"], n0)
    finally:
        renderer.close()
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
    from sim_render.randomization import render_randomized
    from sim_render.scene import SceneRenderer

    if isinstance(domain_profile_cfg, str):
        domain_profile_cfg = load_profile(domain_profile_cfg)
    cfg = _eval_profile(domain_profile_cfg, render_scale)
    cfg.empty_scene_prob = 1.0
    renderer = SceneRenderer(calib, cfg, EVAL_SEED_BASE + EMPTY_BIN_SEED_OFFSET + int(seed))
    t0 = time.perf_counter()
    nulls, qualities = 0, []
    try:
        st = renderer._setup()
        for i in range(int(n_frames)):
            rngs, _ = renderer.build_scene(i)
            frame = render_randomized(st["cell"].client, st["cell"].bodies, st["calib"], rngs["visuals"], cfg)
            if getattr(policy, "takes_calibration", False):
                dec = policy(frame.rgb, calibration=frame.camera.scaled(tuple(st["calib"].image_size)))
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
    from perception.geometry import table_view

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
    from perception.calibration import load_calibration
    from perception.cli import config_number

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


@hydra.main(config_path="pkg://conf", config_name="eval", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from perception.artifact import ArtifactError
    from perception.calibration import CalibrationError

    # Hydra has configured the root logger already (basicConfig would do nothing): set its level.
    logging.getLogger().setLevel(logging.INFO if cfg.verbose else logging.WARNING)
    if not cfg.artifact:
        # A bare command would run the reference policies for a minute and write ./eval.json.
        given = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
        if "brackets" not in given:
            print("sim2real-eval: error: nothing to evaluate: give artifact=DIR (a policy artifact) or "
                  "brackets=[oracle,random] (the reference policies alone)", file=sys.stderr)
            sys.exit(2)
    try:
        run_eval(cfg)
    except (ArtifactError, CalibrationError, ValueError, OSError) as exc:
        print(f"sim2real-eval: error: {exc}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    from perception.cli import hydra_command_checks

    hydra_command_checks("eval", "sim2real-eval", __doc__ or "", sys.argv[1:])
    _hydra_main()
