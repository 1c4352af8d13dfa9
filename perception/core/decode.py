"""Decode the policy's maps into one base-frame grasp (vectorised; runs per request).

The policy predicts, for every view pixel and image-plane angle bin, the probability
that a top-down grasp centred there succeeds (``quality``), the opening in metres
(``width``) and the fingertip height above the table in metres (``height``).
:func:`decode_grasp` picks the best (angle bin, pixel) whose grasp, back-projected at its
own fingertip height, lies inside the calibration's workspace. Nothing outside the
workspace is ever returned: that is the service's and the loop's safety guarantee.
With ``rule`` (an artifact's ``decode.rule``) only grasps that fit the predicted
``surface`` by the grasp rule of :mod:`perception.core.rule` are candidates. With ``on_part_px``
(``decode.on_part_px``) only grasps on a part the predicted ``surface`` shows are, and a
frame whose surface shows no part answers no grasp: a grasp on a bare bin floor is worse
than none. With ``fingers_clear`` (``decode.fingers_clear``) a grasp whose fingers would come
down on a part or a wall of the predicted ``surface`` is answered only when no other clears,
and with ``jaws_on_part`` (``decode.jaws_on_part``) one whose jaws close on too little of a
part (at its end, on its rim) only when no other meets enough. ``sweep_depth`` raises the
fingertips over what the predicted surface puts under the fingers, and ``part_centre`` puts a
grasp across a part's middle before one at its end (both measured, off by default);
``guarded_descent`` answers every grasp at the lowest fingertip height the contract allows,
and ``unseen_standing`` has ``fingers_clear`` keep the fingers off the cells the camera did
not see (both measured, off).
An artifact with a geometry graph (:mod:`perception.core.artifact`) hands in, as
``surface``, the one rebuilt from the camera-view heights it predicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import cv2
import numpy as np

from perception.core.background import BackgroundModel
from perception.core.calibration import Calibration, project_points
from perception.core.frames import GRIPPER_MAX_WIDTH, MAX_TIP_HEIGHT, MIN_TIP_CLEARANCE
from perception.core.geometry import NetworkView, view_pixels_to_base
from perception.core.grasp import Grasp, angle_bin_centers, normalize_angle, view_grasp_to_base
from perception.core.repeats import DEFAULT_REPEATS
from perception.core.rule import (
    ABOVE_TIPS,
    CHECK_OPTIONS,
    DEFAULT_RULE,
    finger_landing,
    finger_obstacle,
    fitting_grasps,
    jaw_span,
    object_cells,
    off_centre,
    rule_options,
    share_option,
    support_score,
)

__all__ = ["DecodeOptions", "DecodeOptionsError", "DecodedGrasp", "decode_grasp", "grasp_in_workspace", "parts_region",
           "area_cells"]

#: What a grasp whose finger would land on something loses in the choice (``fingers_clear``):
#: more than any score's range, so every clear grasp comes first.
_BLOCKED_SHIFT = 4.0
#: What a grasp whose jaws meet too little of a part loses (``jaws_on_part``): more than any
#: quality's range and less than ``_BLOCKED_SHIFT``, so clear fingers still come first.
_SHALLOW_SHIFT = 2.0
#: Length in view pixels of the image-plane segment used to turn an angle into a yaw.
#: Plane-to-image is a homography, so the direction does not depend on it.
_YAW_SEGMENT_PX = 10.0


@dataclass(frozen=True)
class DecodedGrasp:
    """Result of :func:`decode_grasp`.

    Attributes:
        grasp: the grasp in ``B``, or ``None`` when nothing in the workspace is good enough.
        view_pixel: ``(u, v)`` of the grasp centre in the network's view image.
        pixel: ``(u, v)`` of ``grasp.position`` projected into the raw (distorted) frame at
            ``calib.image_size`` (``cv2.projectPoints``).
        reason: why ``grasp`` is ``None`` (``None`` when a grasp is returned).
        angle_bin: the chosen image-plane angle bin.
        view_angle: its angle in the view image (radians, from ``+u`` towards ``+v``).
        empty: ``grasp`` is ``None`` because the bin looks empty (``on_part_px``, or the
            ``background`` test of ``answer_on_parts``), not for want of quality.
    """

    grasp: Grasp | None
    view_pixel: tuple[float, float] | None
    pixel: tuple[float, float] | None
    reason: str | None
    angle_bin: int | None = None
    view_angle: float | None = None
    empty: bool = False  # no grasp because the bin looks empty (``on_part_px``, the background)

    def to_dict(self) -> dict:
        """The service's answer fields: ``grasp``, ``pixel`` and ``reason``."""
        return {
            "grasp": None if self.grasp is None else self.grasp.to_dict(),
            "pixel": None if self.pixel is None else [float(self.pixel[0]), float(self.pixel[1])],
            "reason": self.reason,
        }


#: The keys of an artifact's ``decode`` (``metadata.json``) and of ``policy.decode``: the options
#: a policy is tuned with. The others of :class:`DecodeOptions` (the threshold, the workspace
#: margin, the repeat memory's reach) are the server's settings, never read from that mapping.
DECODE_KEYS = ("neighbourhood_px", "width_margin", "rule", "rule_first", "on_part_px", "answer_on_parts",
               "guarded_descent", "unseen_standing", *CHECK_OPTIONS)


class DecodeOptionsError(ValueError):
    """A bad decode option: :attr:`problem` with the :attr:`keys` it is about (none: the whole
    ``decode`` mapping). ``str()`` names them ``decode.KEY``; :meth:`located` as the reader of
    the options calls them (the artifact's ``'decode.KEY'``, the config's ``policy.decode.KEY``)."""

    def __init__(self, problem: str, *keys: str) -> None:
        self.problem = problem
        self.keys = keys
        super().__init__(self.located("decode"))

    def __reduce__(self):
        # Rebuilt from its parts across a process boundary (args holds the formatted message).
        return type(self), (self.problem, *self.keys)

    def located(self, section: str, quote: str = "") -> str:
        """The message with each key named ``{quote}{section}.{key}{quote}``."""
        names = [f"{quote}{section}.{k}{quote}" for k in self.keys] or [f"{quote}{section}{quote}"]
        return f"{' and '.join(names)} {self.problem}"


def _number(key: str, value: Any, kind: Callable[[Any], Any], what: str) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise DecodeOptionsError(f"must be {what}: {exc}", key) from exc


@dataclass(frozen=True)
class DecodeOptions:
    """Every option of :func:`decode_grasp`, checked once, here (see its arguments).

    Built from an artifact's or a config's ``decode`` mapping by :meth:`from_dict` (which
    refuses unknown keys), or directly; every construction (:meth:`replace` too) checks and
    types the values. ``rule``: the validated grasp-rule options (the given keys of
    :data:`perception.core.rule.DEFAULT_RULE`); ``None``: off, as every check is.

    Raises:
        DecodeOptionsError: a ``decode`` option of the wrong type or range, or checks combined
            with ``rule`` (a :class:`ValueError` naming the key).
        ValueError: ``threshold`` outside ``[0, 1]``, a negative ``workspace_margin``,
            ``avoid_radius`` or ``avoid_yaw``.
    """

    threshold: float
    workspace_margin: float = 0.0
    neighbourhood_px: int = 0
    width_margin: float = 0.0
    rule: dict | None = None
    rule_first: float | None = None
    on_part_px: int | None = None
    answer_on_parts: bool = False
    guarded_descent: bool = False
    unseen_standing: bool = False
    fingers_clear: float | None = None
    jaws_on_part: float | None = None
    sweep_depth: float | None = None
    part_centre: float | None = None
    avoid_radius: float = DEFAULT_REPEATS["radius"]
    avoid_yaw: float = math.radians(DEFAULT_REPEATS["yaw_deg"])

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name, what in (("threshold", "in [0, 1]"), ("workspace_margin", ">= 0 m"), ("avoid_radius", ">= 0 m"),
                           ("avoid_yaw", ">= 0 rad")):
            try:
                value = float(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"decode {name} must be a number: {exc}") from exc
            if not (0.0 <= value <= 1.0 if name == "threshold" else 0.0 <= value < math.inf):  # NaN fails too
                raise ValueError(f"decode {name} must be {what}, got {getattr(self, name)!r}")
            put(name, value)
        put("neighbourhood_px", _number("neighbourhood_px", self.neighbourhood_px, int, "an integer"))
        if self.neighbourhood_px < 0:
            raise DecodeOptionsError("must be >= 0", "neighbourhood_px")
        put("width_margin", _number("width_margin", self.width_margin, float, "a number of metres"))
        if not 0.0 <= self.width_margin <= 1.0:  # NaN fails too
            raise DecodeOptionsError(f"must be in [0, 1] m, got {self.width_margin!r}", "width_margin")
        if self.on_part_px is not None:
            put("on_part_px", _number("on_part_px", self.on_part_px, int, "an integer"))
            if self.on_part_px < 0:
                raise DecodeOptionsError("must be >= 0 (or null: off)", "on_part_px")
        for flag in ("answer_on_parts", "guarded_descent", "unseen_standing"):
            if getattr(self, flag) is None:  # null: off, as the other options
                put(flag, False)
            if not isinstance(getattr(self, flag), bool):
                raise DecodeOptionsError(f"must be true or false, got {getattr(self, flag)!r}", flag)
        if self.answer_on_parts and self.on_part_px is None:
            raise DecodeOptionsError("needs on_part_px (the parts it answers on are the predicted surface's; "
                                     "without them an empty bin would get a grasp)", "answer_on_parts", "on_part_px")
        for key, check in CHECK_OPTIONS.items():  # the re-ranking checks
            if getattr(self, key) is not None:
                try:
                    put(key, check(getattr(self, key)))
                except ValueError as exc:
                    raise DecodeOptionsError(str(exc), key) from exc
        if self.unseen_standing and self.fingers_clear is None:
            raise DecodeOptionsError("needs fingers_clear (the check whose obstacles it adds to)", "unseen_standing")
        if self.guarded_descent and self.sweep_depth is not None:
            raise DecodeOptionsError("are exclusive (sweep_depth raises the fingertips over what the fingers "
                                     "meet; guarded_descent sends them to the lowest height)", "guarded_descent",
                                     "sweep_depth")
        if self.rule_first is not None:
            try:
                put("rule_first", share_option(self.rule_first))
            except ValueError as exc:
                raise DecodeOptionsError(str(exc), "rule_first") from exc
            if self.rule is not None:
                raise DecodeOptionsError("are exclusive (rule_first answers the rule's grasps first and the "
                                         "policy's otherwise; rule answers the rule's alone)", "rule_first", "rule")
        if self.rule is not None:
            try:
                put("rule", rule_options(self.rule))
            except ValueError as exc:
                raise DecodeOptionsError(f"is not valid: {exc}", "rule") from exc
            checks = [key for key in CHECK_OPTIONS if getattr(self, key) is not None]
            if checks:
                raise DecodeOptionsError("are exclusive (the rule's own test covers where the fingers land and "
                                         "the jaws close)", *checks, "rule")

    @classmethod
    def from_dict(cls, d: Any, *, threshold: float, workspace_margin: float = 0.0) -> DecodeOptions:
        """The options of a ``decode`` mapping (:data:`DECODE_KEYS`; absent: the default; null turns
        ``rule``, ``on_part_px`` and the checks off),
        with the server's ``threshold`` and ``workspace_margin``.

        Raises:
            DecodeOptionsError: not a mapping, unknown keys (they would be silently ignored), or
                a bad value (see the class).
        """
        if not isinstance(d, Mapping):
            raise DecodeOptionsError("must be an object (a mapping of option to value)")
        unknown = set(d) - set(DECODE_KEYS)
        if unknown:
            raise DecodeOptionsError(f"has unknown keys {sorted(unknown)}; known: {list(DECODE_KEYS)}")
        return cls(threshold=threshold, workspace_margin=workspace_margin, **{str(k): v for k, v in d.items()})

    def to_dict(self) -> dict:
        """The ``decode`` mapping of these options (``metadata.json``): ``neighbourhood_px``,
        ``width_margin`` and the options that are on."""
        out: dict = {"neighbourhood_px": self.neighbourhood_px, "width_margin": self.width_margin}
        out.update({k: getattr(self, k) for k in DECODE_KEYS
                    if k not in out and getattr(self, k) is not None and getattr(self, k) is not False})
        if "rule" in out:
            out["rule"] = dict(out["rule"])  # the metadata's own copy, not the options' dict
        return out

    def replace(self, **changes: Any) -> DecodeOptions:
        """A copy with ``changes`` (checked as any construction is)."""
        return replace(self, **changes)


def grasp_in_workspace(grasp: Grasp, calib: Calibration, margin: float = 0.0) -> bool:
    """Whether a grasp is safe to hand to the robot: finite, inside the workspace, and with
    its fingertips between ``MIN_TIP_CLEARANCE`` and ``MAX_TIP_HEIGHT`` above the table."""
    p = np.asarray(grasp.position, dtype=np.float64)
    return bool(
        np.all(np.isfinite(p))
        and margin >= 0.0
        and calib.table_z + MIN_TIP_CLEARANCE - 1e-9 <= p[2] <= calib.table_z + MAX_TIP_HEIGHT
        and math.isfinite(grasp.yaw)
        and -math.pi / 2 < grasp.yaw <= math.pi / 2
        and 0.0 <= grasp.width <= GRIPPER_MAX_WIDTH
        and calib.workspace_x[0] + margin <= p[0] <= calib.workspace_x[1] - margin
        and calib.workspace_y[0] + margin <= p[1] <= calib.workspace_y[1] - margin
    )


def _none(reason: str, empty: bool = False) -> DecodedGrasp:
    return DecodedGrasp(grasp=None, view_pixel=None, pixel=None, reason=reason, empty=empty)


def decode_grasp(
    quality: np.ndarray,
    width: np.ndarray,
    height: np.ndarray,
    calib: Calibration,
    view: NetworkView,
    options: DecodeOptions,
    *,
    surface: np.ndarray | None = None,
    avoid: Sequence[Grasp] = (),
    rerank: np.ndarray | None = None,
    walls_inset: float = 0.0,
    view_rgb: np.ndarray | None = None,
    background: BackgroundModel | None = None,
    seen: np.ndarray | None = None,
) -> DecodedGrasp:
    """Pick the best grasp inside the workspace from the policy's maps.

    Args:
        quality: ``(A, H, W)`` success probability per angle bin (bin centres
            :func:`perception.core.grasp.angle_bin_centers`).
        width: ``(H, W)`` predicted opening, metres (clipped to ``[0, 0.08]``).
        height: ``(H, W)`` predicted fingertip height above ``table_z``, metres.
        calib: the serving camera (pose, workspace, intrinsics for ``pixel``).
        view: the network's view.
        options: the decode's options (:class:`DecodeOptions`, checked when built), below.
        surface: ``(H, W)`` predicted surface above ``table_z``, metres (needed by ``rule`` and
            the checks); per frame.
        avoid: grasps not to answer (:class:`perception.core.repeats.RepeatGuard`: they just
            failed on this scene): no candidate whose centre, at its own fingertip height,
            is closer than ``avoid_radius`` metres (in ``x, y``) to one and whose yaw is
            within ``avoid_yaw`` radians (inclusive) of its yaw; per frame.
        rerank: ``(A, H, W)`` shifts added to the quality of the entries at or above
            ``threshold`` when choosing among them (:class:`perception.robot.online.OnlineResidual`):
            it re-ranks the network's candidates and never admits one below the threshold;
            the answered quality stays the network's; per frame.
        walls_inset: metres the bin's walls reach inside the workspace edges (the artifact's
            ``geometry.walls`` thickness, which the rebuilt surface stands there): parts are
            looked for that much further in, so a wall is never taken for a part.
        view_rgb, background: the frame in the policy's view (``(H, W, 3)`` uint8) and the
            fixed camera's empty bin (:class:`perception.core.background.BackgroundModel`, the
            artifact's ``background``): with ``answer_on_parts``, a frame on which no part-sized
            patch inside the walls changed against the background gets no answer below the
            threshold (the bin looks empty; the predicted part is the network's, not the bin's),
            and with the background's ``gate="always"`` no answer at all. Either ``None``: no
            such test.
        seen: ``(H, W)`` bool, the cells of ``surface`` the camera saw
            (:meth:`perception.core.geometry.SurfaceRebuild.top_down`; ``None``: all), for
            ``unseen_standing``; per frame.

    The fields of ``options``:
        threshold: minimum quality; below it no grasp is returned.
        workspace_margin: metres by which the workspace is shrunk on every side.
        neighbourhood_px: ``r > 0`` scores each (angle, pixel) by the *lowest* quality in
            its ``(2r+1)^2`` neighbourhood (a grey erosion per angle bin): a grasp is chosen
            where its neighbours are good too, so a pixel or two of localisation error, or
            an isolated spike of the map on a part's edge, does not decide the attempt.
        width_margin: metres added to the predicted opening (clipped to the gripper's
            0.08 m): the descent is guarded, and an opening a little wide rarely hurts
            while one a little narrow lands a finger on the part.
        rule: options of the grasp rule (:data:`perception.core.rule.DEFAULT_RULE`; ``None``:
            off; table views only). Only grasps that fit the predicted surface
            (:func:`perception.core.rule.fitting_grasps`) are candidates; each scores
            ``support * quality ** quality_power`` (:func:`perception.core.rule.support_score`),
            ``threshold`` applies to that score, and the grasp takes the rule's fingertip
            height and opening (plus ``width_margin``).
        on_part_px: ``None``: off. Otherwise a grasp centre must lie within this many view
            pixels of a part of the predicted ``surface`` (:func:`perception.core.rule.object_cells`
            with the rule's defaults: higher than ``OBJECT_HEIGHT`` above the table, at least
            ``min_object_px`` cells, inside the workspace clear of the walls); with no part
            at all the answer is no grasp, with the reason that the bin looks empty. Table
            views only.
        fingers_clear: ``None``: off. Otherwise a grasp whose either finger, coming down
            opened as answered, would land with more than this share of its footprint on
            something standing in the predicted ``surface`` (a part or a wall:
            :func:`perception.core.rule.object_cells` over the whole view,
            :func:`perception.core.rule.finger_landing`) is chosen only when no grasp at or above
            ``threshold`` lands clear: it re-ranks and never turns an answer into no grasp.
            Table views only; not with ``rule`` (whose own test covers the landing).
        unseen_standing: with ``fingers_clear``, a cell of the surface the camera did not see
            (``seen`` false: behind a part along the camera's line of sight, where the rebuilt
            surface reads the floor without having seen it) counts as standing: a finger is
            not sent down where nothing says the way is clear (a lower limb of the same part,
            another part behind it).
        jaws_on_part: ``None``: off. Otherwise a grasp whose jaws, along the line through its
            centre across the closing direction and as deep as the fingers, meet less than
            this share of a part of the predicted ``surface`` (:func:`perception.core.rule.jaw_span`
            on the parts ``on_part_px`` looks for) is chosen only when no grasp at or above
            ``threshold`` meets enough: a re-rank below ``fingers_clear``'s (clear fingers
            first), never a null. Table views only; not with ``rule``.
        answer_on_parts: with ``on_part_px``, a frame whose predicted surface shows a part is
            never answered "no grasp" for want of quality: when no grasp reaches ``threshold``
            (or every one that does is ``avoid``-ed), the decode answers as with the threshold
            at 0 (the checks still rank; the answered quality says how sure). Only "the bin
            looks empty" stays a null (the predicted surface shows no part, or with
            ``background``, the frame shows nothing new in the bin): a null with parts in the
            bin is a failed attempt that tells the robot nothing.
        rule_first: ``None``: off. Otherwise a score in ``[0, 1]``: the grasp ``rule`` (with
            :data:`perception.core.rule.DEFAULT_RULE`) would answer on the predicted ``surface``
            at this threshold, with its fingertip height and opening, is answered first; when
            the rule finds none, the decode below answers as without it (the checks, the
            ``threshold``). Table views only; not with ``rule``.
        sweep_depth: ``None``: off. Otherwise the fingertips of every (angle, pixel) come
            down to the higher of the network's height and :data:`perception.core.rule.ABOVE_TIPS`
            over the highest point of the predicted ``surface`` under either finger
            (:func:`perception.core.rule.finger_obstacle`, opened as answered), and a grasp whose
            fingertips then stay less than ``sweep_depth`` metres below the surface at its
            centre (the pads would close on too little of the part) is chosen only when no
            grasp at or above ``threshold`` can come down clear that deep: a re-rank at
            ``fingers_clear``'s level, never a null. The answered ``z`` is the raised height.
            Table views only; not with ``rule`` or ``guarded_descent``.
        guarded_descent: every answer's ``z`` is ``table_z`` + :data:`MIN_TIP_CLEARANCE`, the
            lowest the contract allows: the hand comes down until it meets resistance. The
            grasp's centre, yaw and opening are the ones it would have answered.
        part_centre: ``None``: off. Otherwise a weight in ``[0, 1]``: every grasp loses that
            much times how far its centre lies from the centre of its part of the predicted
            surface (:func:`perception.core.rule.off_centre`: 0 at the part's centroid, 1 at its
            farthest cell or off it), so that within each check's tier a grasp across a
            part's middle comes before one at its end of the same quality. Table views only;
            not with ``rule``.
        avoid_radius, avoid_yaw: the reach of ``avoid`` (metres, radians).

    Returns:
        :class:`DecodedGrasp`; its ``grasp`` is ``None`` with a ``reason`` when no
        (angle, pixel) at or above ``threshold`` maps inside the workspace.
        Non-finite map values never produce a grasp.
    """
    o = options
    kw = {"surface": surface, "avoid": avoid, "rerank": rerank, "walls_inset": walls_inset, "seen": seen}
    if o.answer_on_parts:
        unchanged = ""
        if background is not None and view_rgb is not None:
            changed = background.changed_px(view_rgb, parts_region(calib, view, walls_inset))
            if changed < background.min_part_px:
                unchanged = (f"against the camera's empty bin no patch of {background.min_part_px} view cells changed "
                             f"inside the walls (largest {changed})")
                if background.gate == "always":
                    return _none(f"the bin looks empty: {unchanged}", empty=True)
        first = decode_grasp(quality, width, height, calib, view, replace(o, answer_on_parts=False), **kw)
        if first.grasp is not None or first.empty:
            return first
        if unchanged:
            return _none(f"the bin looks empty: no grasp reaches the quality threshold {o.threshold:.2f}, and "
                         f"{unchanged}", empty=True)
        return decode_grasp(quality, width, height, calib, view, replace(o, answer_on_parts=False, threshold=0.0), **kw)
    if o.rule_first is not None:
        # The rule on the predicted surface answers first where it finds a grasp (on few frames:
        # a blurred surface merges parts wider than the opening), the policy's own choice
        # elsewhere. Measured, off: docs/decode.md.
        first = decode_grasp(quality, width, height, calib, view,
                             replace(o, rule={}, rule_first=None, threshold=o.rule_first,
                                     **{k: None for k in CHECK_OPTIONS}),
                             **kw)
        if first.grasp is not None:
            return first
        o = replace(o, rule_first=None)
    threshold, rule, avoid_radius, avoid_yaw = o.threshold, o.rule, o.avoid_radius, o.avoid_yaw
    q, wmap, hmap = _checked_maps(quality, width, height, view)
    A, H, W = q.shape
    q = _neighbourhood_worst(q, o.neighbourhood_px)
    rule_width = None
    if rule is not None:
        q, rule_width, hmap = _apply_rule(q, surface, calib, view, rule, walls_inset)
    q, avoided = _without_failures(q, avoid, hmap, calib, view, threshold, avoid_radius, avoid_yaw)
    if rerank is None:
        score = q
    else:
        with np.errstate(invalid="ignore"):
            score = np.where(q >= threshold, q + np.nan_to_num(np.asarray(rerank, dtype=np.float32)), -np.inf)
    checks = {key: getattr(o, key) for key in CHECK_OPTIONS}
    reranked = rerank is not None or any(c is not None for c in checks.values())
    score, parts, tips = _apply_checks(q, score, threshold, wmap, hmap, o.width_margin, surface, calib, view, checks,
                                       walls_inset, None if not o.unseen_standing else seen)
    abin = score.argmax(axis=0)
    if tips is not None:
        hmap = np.take_along_axis(tips, abin[None], axis=0)[0]
    qbest = np.take_along_axis(q, abin[None], axis=0)[0]
    sbest = np.take_along_axis(score, abin[None], axis=0)[0] if reranked else qbest
    valid = (qbest >= threshold) & np.isfinite(wmap) & np.isfinite(hmap)
    if rule_width is not None:
        valid &= qbest > 0  # grasps that do not fit score 0
    if o.on_part_px is not None:
        near = _near(parts if parts is not None else _parts(surface, calib, view, "on_part_px", walls_inset),
                     o.on_part_px)
        if not near.any():
            return _none(f"the bin looks empty: the predicted surface shows no part higher than "
                         f"{DEFAULT_RULE['object_height']:.3f} m above the table in the workspace", empty=True)
        if not (valid & near).any() and valid.any() and not avoided:
            return _none(f"no grasp on a predicted part reaches the quality threshold {threshold:.2f}")
        valid &= near
    idx = np.flatnonzero(valid)
    if idx.size == 0 and avoided:
        return _none(f"every grasp at or above the quality threshold {threshold:.2f} is within "
                     f"{avoid_radius:.3f} m and {math.degrees(avoid_yaw):.0f} deg of one that just failed on this scene")
    if idx.size == 0:
        best = float(qbest.max()) if np.isfinite(qbest).any() else float("nan")
        return _none(f"no grasp reaches the quality threshold {threshold:.2f} (best {best:.2f})")

    m = o.workspace_margin
    vs, us = np.divmod(idx, W)
    uv = np.stack([us, vs], axis=1).astype(np.float64)
    z, inside, why = _centres_inside(uv, hmap.reshape(-1)[idx], calib, view, m, threshold)
    if why is not None:
        return _none(why)
    cand = np.flatnonzero(inside)
    k = cand[np.argmax(sbest.reshape(-1)[idx[cand]])]
    v, u = int(vs[k]), int(us[k])
    a = int(abin[v, u])
    opening = wmap[v, u] if rule_width is None else rule_width[a, v, u]
    # (the opening stays in the maps' float32 until it is clipped, as it always was)
    if o.guarded_descent:
        # The contract's hand stops on ~3 N of resistance (section 3): sent to the lowest height
        # allowed, it comes down beside the part until a finger meets the floor or what stands
        # under it, so the predicted height no longer decides where the jaws close.
        z[k] = calib.table_z + MIN_TIP_CLEARANCE
    return _answer(u, v, a, A, float(z[k]), opening + o.width_margin, float(qbest[v, u]), calib, view, m)


def _checked_maps(quality: np.ndarray, width: np.ndarray, height: np.ndarray,
                  view: NetworkView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The maps as arrays, their shapes checked against each other and the view."""
    q = np.asarray(quality)
    wmap = np.asarray(width)
    hmap = np.asarray(height)
    if q.ndim != 3 or wmap.shape != q.shape[1:] or hmap.shape != q.shape[1:]:
        raise ValueError(
            f"maps must be quality (A, H, W), width and height (H, W); got {q.shape}, {wmap.shape}, {hmap.shape}"
        )
    _, H, W = q.shape
    if (W, H) != tuple(view.size):
        raise ValueError(f"maps are {W}x{H} but the view is {view.size[0]}x{view.size[1]}")
    return q, wmap, hmap


def _answer(u: int, v: int, a: int, A: int, z: float, opening: float, quality: float, calib: Calibration,
            view: NetworkView, margin: float) -> DecodedGrasp:
    """The grasp at view pixel ``(u, v)``, angle bin ``a``, fingertips at ``z`` in ``B``."""
    angle = float(angle_bin_centers(A)[a])
    pos, yaw, _ = view_grasp_to_base(np.array([[float(u), float(v)]]), np.array([angle]), np.array([_YAW_SEGMENT_PX]),
                                     np.array([z]), calib, view)
    w_m = float(np.clip(opening, 0.0, GRIPPER_MAX_WIDTH))
    grasp = Grasp(position=pos[0], yaw=float(yaw[0]), width=w_m, quality=quality)
    if not grasp_in_workspace(grasp, calib, margin):  # defensive: the same numbers were checked above
        return _none("the best grasp failed the final workspace check")
    pixel = project_points(pos, calib)[0]
    return DecodedGrasp(
        grasp=grasp,
        view_pixel=(float(u), float(v)),
        pixel=(float(pixel[0]), float(pixel[1])),
        reason=None,
        angle_bin=a,
        view_angle=angle,
    )


def _without_failures(q: np.ndarray, avoid: Sequence, hmap: np.ndarray, calib: Calibration, view: NetworkView,
                      threshold: float, radius: float, yaw_tol: float) -> tuple[np.ndarray, bool]:
    """``q`` with the grasps near a reported failure (``avoid``) at ``-inf``; whether any of
    them was at or above the threshold."""
    if not len(avoid):
        return q, False
    blocked = _avoided(avoid, hmap, calib, view, q.shape[0], radius, yaw_tol)
    if blocked is None:
        return q, False
    return np.where(blocked, -np.inf, q), bool((q[blocked] >= threshold).any())


def _neighbourhood_worst(q: np.ndarray, r: int) -> np.ndarray:
    """Each entry's worst quality within ``r`` view pixels (its own angle bin); non-finite
    qualities become ``-inf`` and can never win."""
    finite_q = np.isfinite(q)
    if not finite_q.all():
        q = np.where(finite_q, q, -np.inf)
    if r <= 0:
        return q
    kernel = np.ones((2 * r + 1, 2 * r + 1), np.uint8)
    # Outside the map counts as good (border = +inf), so edge pixels are not penalised
    # for their missing neighbours; non-finite values stay losers (-inf spreads).
    return np.stack([
        cv2.erode(np.ascontiguousarray(plane, dtype=np.float32), kernel,
                  borderType=cv2.BORDER_CONSTANT, borderValue=float("inf"))
        for plane in q
    ])


def _apply_checks(q: np.ndarray, score: np.ndarray, threshold: float, wmap: np.ndarray, hmap: np.ndarray,
                  width_margin: float, surface: np.ndarray | None, calib: Calibration, view: NetworkView,
                  checks: dict, walls_inset: float = 0.0, seen: np.ndarray | None = None,
                  ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The re-ranking checks on the predicted surface (``fingers_clear``, ``jaws_on_part``,
    ``sweep_depth``, ``part_centre``; see :func:`decode_grasp`; never with ``rule``:
    :class:`DecodeOptions` refuses them together).

    Returns:
        The score, the surface's parts when a check needed them, and the fingertip heights
        raised to come down clear (``sweep_depth``; else ``None``).

    ``seen``: the cells the camera saw, when ``unseen_standing`` is on (the others stand for
    ``fingers_clear``); ``None``: off.
    """
    if all(c is None for c in checks.values()):
        return score, None, None
    A = q.shape[0]
    if seen is not None and np.shape(seen) != q.shape[1:]:
        raise ValueError(f"seen must be the maps' (H, W) {q.shape[1:]}, got {np.shape(seen)}")
    # A check moves a grasp below every one that passes it, and keeps it above every grasp
    # below the threshold: it re-ranks, it never admits or removes one.
    with np.errstate(invalid="ignore"):
        score = np.where(q >= threshold, score, -np.inf)
    fingers_clear, jaws_on_part = checks["fingers_clear"], checks["jaws_on_part"]
    sweep_depth, part_centre = checks["sweep_depth"], checks["part_centre"]
    if fingers_clear is not None or sweep_depth is not None:  # the opening the fingers come down at
        opening = np.clip(np.nan_to_num(wmap, nan=GRIPPER_MAX_WIDTH) + width_margin, 0.0, GRIPPER_MAX_WIDTH)
    if fingers_clear is not None:
        standing = _standing(surface, view, "fingers_clear")
        if seen is not None:  # unseen_standing
            standing = standing | ~np.asarray(seen, dtype=bool)
        landing = finger_landing(standing, _cell_m(view), A, opening)
        score = np.where(landing > float(fingers_clear), score - _BLOCKED_SHIFT, score)
    parts = None  # the predicted surface's parts, for jaws_on_part and on_part_px alike
    if jaws_on_part is not None:
        parts = _parts(surface, calib, view, "jaws_on_part", walls_inset)
        span = jaw_span(parts, _cell_m(view), A)
        # The spans are counts of cells over the strip's cells: a tolerance for the filter's rounding.
        score = np.where(span < float(jaws_on_part) - 1e-6, score - _SHALLOW_SHIFT, score)
    tips = None  # (A, H, W) fingertip heights raised to come down clear, for sweep_depth
    if sweep_depth is not None:
        s = _surface_map(surface, view, "sweep_depth")
        need = finger_obstacle(s, _cell_m(view), A, opening) + ABOVE_TIPS
        tips = np.maximum(hmap[None].astype(np.float32), need)  # NaN heights stay NaN: never valid
        top = np.nan_to_num(s, nan=0.0)[None]
        score = np.where(need > top - float(sweep_depth) + 1e-6, score - _BLOCKED_SHIFT, score)
    if part_centre is not None:
        if parts is None:
            parts = _parts(surface, calib, view, "part_centre", walls_inset)
        # Less than a check's shift (part_centre <= 1): it orders grasps within a tier, never across.
        score = score - float(part_centre) * off_centre(parts)[None]
    return score, parts, tips


def _centres_inside(uv: np.ndarray, heights: np.ndarray, calib: Calibration, view: NetworkView,
                    margin: float, threshold: float) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Back-project candidate centres at their own fingertip heights; which lie inside the
    workspace (less ``margin``), low enough, and where the camera sees the workspace.

    Returns:
        The fingertip heights ``z`` in ``B``, a boolean mask, and the reason when none is left.
    """
    z = calib.table_z + heights.astype(np.float64)
    z = np.maximum(z, calib.table_z + MIN_TIP_CLEARANCE)
    centres = view_pixels_to_base(uv, calib, view, z)
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    with np.errstate(invalid="ignore"):
        inside = (
            np.isfinite(centres).all(axis=1)
            & (centres[:, 0] >= x0 + margin)
            & (centres[:, 0] <= x1 - margin)
            & (centres[:, 1] >= y0 + margin)
            & (centres[:, 1] <= y1 - margin)
            & (z <= calib.table_z + MAX_TIP_HEIGHT)
        )
    if not inside.any():
        return z, inside, (f"no grasp at or above the quality threshold {threshold:.2f} lies inside the workspace "
                           f"({len(uv)} candidates outside)")
    # A camera may leave a corner of the workspace out of its frame: nothing is answered there.
    # When the box from the table to the highest candidate is in view, so is every candidate.
    top = float(z[inside].max())
    box = np.concatenate([calib.workspace_corners(calib.table_z), calib.workspace_corners(top)])
    if not calib.in_image(project_points(box, calib)).all():
        inside[np.flatnonzero(inside)[~calib.in_image(project_points(centres[inside], calib))]] = False
        if not inside.any():
            return z, inside, (f"no grasp at or above the quality threshold {threshold:.2f} lies where the camera "
                               "sees the workspace")
    return z, inside, None


def _avoided(
    avoid: Sequence[Grasp], hmap: np.ndarray, calib: Calibration, view: NetworkView, n_bins: int,
    radius: float, yaw_tol: float,
) -> np.ndarray | None:
    """``(A, H, W)`` bool: the (angle bin, pixel) grasps near one of ``avoid``; ``None``: none."""
    H, W = hmap.shape
    vs, us = np.mgrid[0:H, 0:W]
    uv = np.stack([us.ravel(), vs.ravel()], axis=1).astype(np.float64)
    h = np.nan_to_num(hmap.reshape(-1).astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    z = np.maximum(calib.table_z + h, calib.table_z + MIN_TIP_CLEARANCE)
    xy = view_pixels_to_base(uv, calib, view, z)[:, :2]
    close_to = []  # per avoided grasp: the pixels whose centre is within the radius of it
    for g in avoid:
        dx, dy = xy[:, 0] - g.position[0], xy[:, 1] - g.position[1]
        close_to.append(dx * dx + dy * dy < radius * radius)
    near = np.flatnonzero(np.logical_or.reduce(close_to))
    if near.size == 0:
        return None
    # The yaw of every angle bin at each near pixel (it varies across a camera view).
    angles = angle_bin_centers(n_bins)
    k = np.repeat(near, n_bins)
    a = np.tile(np.arange(n_bins), near.size)
    _, yaw, _ = view_grasp_to_base(uv[k], angles[a], np.full(k.size, _YAW_SEGMENT_PX), z[k], calib, view)
    blocked = np.zeros((n_bins, H * W), bool)
    for close, g in zip(close_to, avoid):
        turn = np.abs(normalize_angle(yaw - g.yaw))
        hit = close[k] & (turn <= yaw_tol + 1e-9)  # inclusive, and robust to rounding: bins 15 deg apart
        blocked[a[hit], k[hit]] = True
    return blocked.reshape(n_bins, H, W) if blocked.any() else None


def parts_region(calib: Calibration, view: NetworkView, walls_inset: float = 0.0) -> np.ndarray:
    """``(H, W)`` bool: the view cells where parts are looked for (``on_part_px``, the
    background test): inside the workspace, the rule's ``region_margin`` plus ``walls_inset``
    metres clear of its edges."""
    return _part_region(calib, view, float(DEFAULT_RULE["region_margin"]) + float(walls_inset))


def _part_region(calib: Calibration, view: NetworkView, margin: float) -> np.ndarray:
    """``(H, W)`` bool: view cells inside the workspace, ``margin`` metres clear of its edge
    (where the bin walls stand): where parts are looked for."""
    W, H = view.size
    vv, uu = np.mgrid[0:H, 0:W]
    xy = view_pixels_to_base(np.stack([uu.ravel(), vv.ravel()], axis=1), calib, view, calib.table_z)
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    return ((xy[:, 0] >= x0 + margin) & (xy[:, 0] <= x1 - margin)
            & (xy[:, 1] >= y0 + margin) & (xy[:, 1] <= y1 - margin)).reshape(H, W)


def area_cells(area_m2: float, view: NetworkView) -> int:
    """Cells of the top-down ``view`` that cover ``area_m2`` square metres (at least one)."""
    return max(1, round(float(area_m2) / _cell_m(view) ** 2))


def _cell_m(view: NetworkView) -> float:
    """Metres per cell of a top-down view (metric and isotropic)."""
    return 1.0 / float(np.linalg.norm(view.K[0, :2]))


def _surface_map(surface: np.ndarray | None, view: NetworkView, option: str) -> np.ndarray:
    """The predicted surface as float32 ``(H, W)``, checked for the decode ``option`` that needs it."""
    if not view.is_table:
        raise ValueError(f"{option} needs a top-down view (view kind 'table'); this view is a camera view")
    if surface is None:
        raise ValueError(f"{option} needs the predicted surface map (the policy has no 'surface' output)")
    s = np.asarray(surface, dtype=np.float32)
    if s.shape != (view.size[1], view.size[0]):
        raise ValueError(f"surface must be (H, W) = {(view.size[1], view.size[0])}, got {s.shape}")
    return s


def _standing(surface: np.ndarray | None, view: NetworkView, option: str) -> np.ndarray:
    """``(H, W)`` bool: what stands in the predicted surface anywhere in the view (parts, the
    bin walls): higher than the rule's ``object_height``, specks removed."""
    s = _surface_map(surface, view, option)
    return object_cells(s, None, float(DEFAULT_RULE["object_height"]), int(DEFAULT_RULE["min_object_px"]))


def _parts(surface: np.ndarray | None, calib: Calibration, view: NetworkView, option: str,
           walls_inset: float = 0.0) -> np.ndarray:
    """``(H, W)`` bool: the parts of the predicted surface, inside the workspace clear of the
    walls (the rule's ``object_cells`` with its defaults; ``walls_inset``: see :func:`decode_grasp`)."""
    s = _surface_map(surface, view, option)
    region = parts_region(calib, view, walls_inset)
    return object_cells(s, region, float(DEFAULT_RULE["object_height"]), int(DEFAULT_RULE["min_object_px"]))


def _near(parts: np.ndarray, radius_px: int) -> np.ndarray:
    """``(H, W)`` bool: cells within ``radius_px`` of ``parts``."""
    if radius_px > 0 and parts.any():
        k = np.ones((2 * radius_px + 1, 2 * radius_px + 1), np.uint8)
        parts = cv2.dilate(parts.astype(np.uint8), k) > 0
    return parts


def _apply_rule(
    q: np.ndarray, surface: np.ndarray | None, calib: Calibration, view: NetworkView, rule: dict,
    walls_inset: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule's score ``(A, H, W)``, opening ``(A, H, W)`` and fingertip height ``(H, W)``
    (``rule``: :attr:`DecodeOptions.rule`, checked)."""
    opt = {**DEFAULT_RULE, **rule}
    s = _surface_map(surface, view, "the grasp rule")
    A = q.shape[0]
    px_m = _cell_m(view)
    # Parts are looked for inside the workspace, clear of the bin walls at its edge.
    region = _part_region(calib, view, float(opt["region_margin"]) + float(walls_inset))
    parts = object_cells(s, region, float(opt["object_height"]), int(opt["min_object_px"]))
    fits, width, tip, _ = fitting_grasps(s, px_m, A, parts)
    score = support_score(fits, int(opt["support_px"]), float(opt["bin_weight"]))
    power = float(opt["quality_power"])
    if power != 0.0:
        score = score * np.power(np.clip(q, 0.0, 1.0), power)
    return np.where(np.isfinite(q), score, -np.inf).astype(np.float32), width, tip
