"""The reference policies ("brackets") of an evaluation: they look at the simulator, not only
at pixels, and bound what a policy can reach in the twin. :class:`OraclePolicy` (the labeller's
best physics-verified candidate), :class:`OraclePixelPolicy` (that grasp as a perfect pixel
policy would give it), :class:`RandomPolicy` (the lower bracket) and
:class:`ObservedRulePolicy` (the grasp rule on the depth the camera saw). Each is a
:class:`Bracket`: the protocol (:func:`policies.evaluate.evaluate`) binds it to every attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig

from perception.core.calibration import Calibration, project_points
from perception.core.decode import DecodedGrasp, DecodeOptions, decode_grasp
from perception.core.geometry import NetworkView, raw_to_view_pixels
from perception.core.grasp import Grasp, angle_bin_centers, angle_to_bin, view_grasp_to_base
from policies.eval_adapters import decoded_at

__all__ = ["Bracket", "EvalContext", "ObservedRulePolicy", "OraclePixelPolicy", "OraclePolicy", "RandomPolicy"]


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


class Bracket:
    """A reference policy that looks at the simulator: the evaluation binds it to each attempt
    (:class:`EvalContext`) before asking for a grasp."""

    name = "bracket"
    uses_pixels = False

    def __init__(self) -> None:
        self.ctx: EvalContext | None = None

    def bind(self, ctx: EvalContext) -> None:
        self.ctx = ctx

    def context(self) -> EvalContext:
        """The attempt this bracket is bound to.

        Raises:
            RuntimeError: not bound (used outside :func:`policies.evaluate.evaluate`).
        """
        if self.ctx is None:
            raise RuntimeError(f"{type(self).__name__} must be bound to the evaluation (bind(ctx)) before use")
        return self.ctx


class OraclePolicy(Bracket):
    """The labeller's best physics-verified candidate (upper bracket; ignores pixels).

    Every attempt generates the labeller's candidates (``n_heuristic`` + ``n_random`` of the
    profile's ``grasps`` section) on the current scene, executes each from the saved physics
    state (restored after each) and returns a successful one, heuristic candidates first;
    "no grasp" when none succeeded.
    """

    name = "oracle"
    uses_pixels = False

    def __init__(self, n_heuristic: int | None = None, n_random: int | None = None) -> None:
        super().__init__()
        self.n_heuristic, self.n_random = n_heuristic, n_random

    def __call__(self, raw_rgb: np.ndarray | None = None) -> DecodedGrasp:
        from sim_render.labels import (  # lazy: pybullet via sim_render.labels
            heuristic_candidates,
            label_grasps,
            random_candidates,
        )

        ctx = self.context()
        g = ctx.cfg.grasps
        nh = int(g.n_heuristic if self.n_heuristic is None else self.n_heuristic)
        nr = int(g.n_random if self.n_random is None else self.n_random)
        hmap = ctx.cell.height_map()
        cands = heuristic_candidates(ctx.cell, hmap, nh, ctx.rng) + random_candidates(ctx.cell, hmap, nr, ctx.rng)
        labelled = label_grasps(ctx.cell, ctx.hand, cands, ctx.force, ctx.timing)
        good = sorted((lg for lg in labelled if lg.success), key=lambda lg: lg.source)
        if not good:
            return DecodedGrasp(None, None, None, f"none of {len(labelled)} labeller candidates succeeded")
        return decoded_at(good[0].grasp, ctx.calib)


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
        out = decoded_at(grasp, calib)
        return DecodedGrasp(out.grasp, (float(centre[0, 0]), float(centre[0, 1])), out.pixel, None)


class RandomPolicy(Bracket):
    """Uniform position and yaw in the workspace at the local surface height minus the
    labeller's grasp depth, opening 0.08 m (the labeller's random candidates; lower bracket)."""

    name = "random"

    def __call__(self, raw_rgb: np.ndarray | None = None) -> DecodedGrasp:
        from sim_render.labels import random_candidates  # lazy: pybullet via sim_render.labels

        ctx = self.context()
        cand = random_candidates(ctx.cell, ctx.cell.height_map(), 1, ctx.rng)[0]
        return decoded_at(cand.grasp, ctx.calib)


class ObservedRulePolicy(Bracket):
    """The grasp rule on the surface the camera actually saw (a diagnostic bracket).

    The attempt's rendered depth is rebuilt top-down into a table view
    (:func:`policies.data.table_view_surface`: exactly what the policy's ``surface`` output is
    trained towards, unseen cells as free) and decoded with the rule of
    :mod:`perception.core.rule` alone (a flat quality map, ``quality_power`` 0), through the
    calibration the policy would be given. Its rate is what the rule decode reaches with a
    perfect surface prediction: the ceiling of geometry without learned quality.

    Args:
        view: a top-down view (the policy's, or ``table_view(calib, (96, 96))``).
        angle_bins: angle bins of the decode.
        rule: :data:`perception.core.rule.DEFAULT_RULE` overrides.
    """

    name = "rule_observed"
    uses_pixels = True
    takes_calibration = True

    def __init__(self, view: NetworkView, angle_bins: int = 12, rule: dict | None = None) -> None:
        if not view.is_table:
            raise ValueError("the rule_observed bracket needs a top-down view (kind 'table')")
        super().__init__()
        self.view, self.angle_bins = view, int(angle_bins)
        self.rule = {**(rule or {}), "quality_power": 0.0}
        self.options = DecodeOptions(threshold=1e-6, rule=self.rule)

    def __call__(self, raw_rgb: np.ndarray | None = None, calibration: Calibration | None = None) -> DecodedGrasp:
        from policies.data import table_view_surface  # lazy: torch via policies.data (only this bracket)

        ctx = self.context()
        if ctx.frame is None:
            raise RuntimeError("ObservedRulePolicy must be bound to an evaluation that renders frames")
        calib = ctx.calib if calibration is None else calibration
        f = ctx.frame
        surface_z, _, _ = table_view_surface(np.asarray(f.depth), np.asarray(f.seg_raw), f.camera, self.view)
        surface = np.where(np.isfinite(surface_z), surface_z - calib.table_z, 0.0).astype(np.float32)
        W, H = self.view.size
        flat = np.ones((self.angle_bins, H, W), np.float32)
        zeros = np.zeros((H, W), np.float32)
        # Flat maps on the rendered surface, no network: decode_grasp itself, not PolicyRunner.decide.
        return decode_grasp(flat, zeros, zeros, calib, self.view, self.options, surface=surface)
