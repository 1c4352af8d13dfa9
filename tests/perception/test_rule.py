"""The grasp rule on a top-down surface (perception/core/rule.py) and the decode that uses it."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from perception.core.artifact import ArtifactError, load_metadata
from perception.core.decode import DecodeOptions, DecodeOptionsError, decode_grasp
from perception.core.frames import GRIPPER_FINGER_HALF_THICKNESS, GRIPPER_MAX_WIDTH
from perception.core.geometry import make_view, table_view, view_pixels_to_base
from perception.core.grasp import angle_bin_centers, normalize_angle, view_grasp_to_base
from perception.core.rule import (
    ABOVE_TIPS,
    GRASP_DEPTH,
    WIDTH_MARGIN,
    finger_landing,
    finger_obstacle,
    fitting_grasps,
    jaw_span,
    object_cells,
    off_centre,
    support_score,
    sweep_depth_option,
)

PX = 0.004  # metres per cell of the synthetic grids
A = 12


def _grid(n: int = 64) -> np.ndarray:
    return np.zeros((n, n), np.float32)


def _bar(s: np.ndarray, v0: int, v1: int, u0: int, u1: int, top: float) -> np.ndarray:
    s[v0:v1, u0:u1] = top
    return s


def test_a_bar_fits_across_not_along():
    """A 2.4 cm x 12 cm bar, 4 cm tall: grasps closing across it (along v) fit on its
    centre line with the opening bar + 2 margins; along it (along u) nothing fits."""
    s = _bar(_grid(), 29, 35, 16, 46, 0.04)  # 6 rows (2.4 cm) by 30 columns (12 cm)
    parts = object_cells(s)
    fits, width, tip, _ = fitting_grasps(s, PX, A, parts)
    across = int(np.argmin(np.abs(angle_bin_centers(A) - math.pi / 2)))  # +v
    along = 0  # +u
    assert fits[across, 31:33, 20:42].all()  # the centre rows, away from the ends
    assert not fits[along].any()
    w = width[across, 31, 30]
    # symmetric about a centre cell: the longer side (3 cells) decides, plus the margins
    assert w == pytest.approx(2 * (3 * PX + PX / 2 + WIDTH_MARGIN), abs=1e-6)
    assert w <= GRIPPER_MAX_WIDTH
    assert tip[31, 30] == pytest.approx(0.04 - GRASP_DEPTH)
    assert not fits[:, s == 0].any()  # only part cells are grasp centres


def test_too_wide_a_part_and_a_blocked_finger_do_not_fit():
    """A 7 cm square leaves no room for the margins in a 0.08 m opening; a tall neighbour
    1.2 cm beside a bar blocks the finger that would land there."""
    box = _bar(_grid(), 20, 38, 20, 38, 0.03)  # 18 cells = 7.2 cm
    fits, *_ = fitting_grasps(box, PX, A, object_cells(box))
    assert not fits.any()
    s = _bar(_grid(), 29, 35, 16, 46, 0.04)
    fits_alone, *_ = fitting_grasps(s, PX, A, object_cells(s))
    s = _bar(s, 38, 44, 16, 46, 0.06)  # a taller bar 3 cells (1.2 cm) away along +v
    fits_near, *_ = fitting_grasps(s, PX, A, object_cells(s))
    across = int(np.argmin(np.abs(angle_bin_centers(A) - math.pi / 2)))
    assert fits_alone[across, 31, 30] and not fits_near[across, 31, 30]


def test_object_cells_drop_specks_and_respect_the_region():
    s = _bar(_grid(), 10, 16, 10, 30, 0.03)
    s[50, 50] = 0.05  # a one-cell speck of noise
    s[5, 5] = 0.005  # below the part height: the bin floor
    region = np.ones_like(s, dtype=bool)
    region[:, 25:] = False
    cells = object_cells(s, region)
    assert cells[12, 12] and not cells[50, 50] and not cells[5, 5] and not cells[12, 27]
    assert not object_cells(np.full_like(s, np.nan)).any()


def test_support_prefers_the_middle_of_a_part_and_is_bounded():
    s = _bar(_grid(), 29, 35, 16, 46, 0.04)
    fits, *_ = fitting_grasps(s, PX, A, object_cells(s))
    score = support_score(fits, support_px=2, bin_weight=0.5)
    assert score.min() >= 0 and score.max() <= 1
    assert (score[~fits] == 0).all()
    across = int(np.argmin(np.abs(angle_bin_centers(A) - math.pi / 2)))
    assert fits[across, 31, 16] and score[across, 31, 30] > score[across, 31, 16]  # the middle beats the end


@pytest.fixture(scope="module")
def calib():
    from perception.core.calibration import Calibration, default_calibration_path

    return Calibration.load(default_calibration_path())


def _bar_in_view(calib, view, x: float, y: float, yaw: float, half_len=0.05, half_w=0.012, top=0.04) -> np.ndarray:
    W, H = view.size
    vv, uu = np.mgrid[0:H, 0:W]
    xy = view_pixels_to_base(np.stack([uu.ravel(), vv.ravel()], axis=1), calib, view, 0.0)[:, :2].reshape(H, W, 2)
    d = xy - np.array([x, y])
    along = d[..., 0] * math.cos(yaw) + d[..., 1] * math.sin(yaw)
    across = -d[..., 0] * math.sin(yaw) + d[..., 1] * math.cos(yaw)
    return np.where((np.abs(along) <= half_len) & (np.abs(across) <= half_w), top, 0.0).astype(np.float32)


def test_decode_with_the_rule_grasps_a_bar_across_at_its_height(calib):
    """A flat quality map and a bar in the predicted surface: the rule decides, the grasp
    closes across the bar on its centre line, at the bar's top minus the grasp depth."""
    view = table_view(calib, (96, 96))
    x, y, yaw = 0.5, 0.02, 0.4
    surface = _bar_in_view(calib, view, x, y, yaw)
    q = np.full((A, 96, 96), 0.5, np.float32)
    w = np.full((96, 96), 0.02, np.float32)
    h = np.full((96, 96), 0.005, np.float32)
    dec = decode_grasp(q, w, h, calib, view, DecodeOptions(0.1, rule={"quality_power": 1.0}), surface=surface)
    g = dec.grasp
    assert g is not None
    dx, dy = g.position[0] - x, g.position[1] - y
    assert abs(dx * math.cos(yaw) + dy * math.sin(yaw)) < 0.05  # on the bar ...
    assert abs(-dx * math.sin(yaw) + dy * math.cos(yaw)) < 0.006  # ... within a cell or so of its centre line
    across = yaw + math.pi / 2
    diff = abs((g.yaw - across + math.pi / 2) % math.pi - math.pi / 2)
    assert diff <= math.radians(15) + 1e-6
    assert g.position[2] == pytest.approx(calib.table_z + 0.04 - GRASP_DEPTH, abs=1e-6)
    assert 0.024 < g.width <= GRIPPER_MAX_WIDTH
    # the quality still ranks what fits: zero quality there means no grasp at all
    none = decode_grasp(np.zeros_like(q), w, h, calib, view, DecodeOptions(0.1, rule={}), surface=surface)
    assert none.grasp is None and "threshold" in none.reason
    # an empty bin: nothing fits
    empty = decode_grasp(q, w, h, calib, view, DecodeOptions(0.0, rule={}), surface=np.zeros_like(surface))
    assert empty.grasp is None


def test_rule_first_answers_the_rules_grasp_and_otherwise_the_policys(calib):
    """``rule_first``: a bar the rule can close on comes first, at the rule's height and
    opening, though the policy's best is elsewhere; a bar wider than the opening (nothing
    fits) leaves the policy's own best, as without the option."""
    view = table_view(calib, (96, 96))
    x, y, yaw = 0.5, 0.02, 0.4
    q = np.full((A, 96, 96), 0.4, np.float32)
    q[:, 80, 12] = 0.95  # the policy's best: a corner far from the bar
    w = np.full((96, 96), 0.02, np.float32)
    h = np.full((96, 96), 0.005, np.float32)
    plain = DecodeOptions(0.3, fingers_clear=0.25)
    first = plain.replace(rule_first=0.1)
    bar = _bar_in_view(calib, view, x, y, yaw)
    ruled = decode_grasp(q, w, h, calib, view, first, surface=bar).grasp
    assert ruled is not None and math.hypot(ruled.position[0] - x, ruled.position[1] - y) < 0.05
    assert ruled.position[2] == pytest.approx(calib.table_z + 0.04 - GRASP_DEPTH, abs=1e-6)  # the rule's height
    own = decode_grasp(q, w, h, calib, view, plain, surface=bar).grasp
    assert math.hypot(own.position[0] - x, own.position[1] - y) > 0.1  # without it: the policy's corner
    slab = _bar_in_view(calib, view, x, y, yaw, half_w=0.06)  # 12 cm across: no grasp fits
    fallback = decode_grasp(q, w, h, calib, view, first, surface=slab).grasp
    own = decode_grasp(q, w, h, calib, view, plain, surface=slab).grasp
    assert fallback is not None and np.allclose(fallback.position, own.position) and fallback.yaw == own.yaw
    with pytest.raises(ValueError, match="rule_first' and 'decode.rule' are exclusive|rule_first and decode.rule"):
        DecodeOptions(0.3, rule={}, rule_first=0.1)
    with pytest.raises(ValueError, match="rule_first"):
        DecodeOptions(0.3, rule_first=1.5)


def test_answer_on_parts_never_answers_null_for_want_of_quality_while_a_part_shows(calib):
    """``answer_on_parts``: the policy's quality under the threshold everywhere (a look it was
    not trained on), a bar in the predicted surface: a grasp on the bar with its low quality,
    where the plain decode says "no grasp"; an empty surface stays "the bin looks empty"."""
    view = table_view(calib, (96, 96))
    x, y, yaw = 0.5, 0.02, 0.4
    q = np.full((A, 96, 96), 0.05, np.float32)
    w = np.full((96, 96), 0.02, np.float32)
    h = np.full((96, 96), 0.02, np.float32)
    bar = _bar_in_view(calib, view, x, y, yaw)
    plain = DecodeOptions(0.3, on_part_px=1, fingers_clear=0.25)
    assert decode_grasp(q, w, h, calib, view, plain, surface=bar).grasp is None
    dec = decode_grasp(q, w, h, calib, view, plain.replace(answer_on_parts=True), surface=bar)
    g = dec.grasp
    assert g is not None and g.quality == pytest.approx(0.05) and math.hypot(g.position[0] - x, g.position[1] - y) < 0.06
    empty = decode_grasp(q, w, h, calib, view, plain.replace(answer_on_parts=True), surface=np.zeros_like(bar))
    assert empty.grasp is None and empty.empty and "looks empty" in empty.reason
    with pytest.raises(ValueError, match="answer_on_parts' and 'decode.on_part_px|answer_on_parts and decode.on_part_px"):
        DecodeOptions(0.3, answer_on_parts=True)
    assert DecodeOptions(0.3, on_part_px=1, answer_on_parts=None).answer_on_parts is False  # null: off
    assert "answer_on_parts" not in plain.to_dict() and plain.replace(answer_on_parts=True).to_dict()["answer_on_parts"]


def test_walls_stood_in_the_surface_are_never_taken_for_parts(calib):
    """Walls 20 mm thick stood inside the workspace edges (``geometry.walls``) reach past the
    rule's 1 cm part region: with ``walls_inset`` an empty bin still looks empty (the bug the
    cells' empty bins showed with 12 mm walls: 4 of 43 answered null), and a part inside is
    still found."""
    from perception.core.geometry import camera_heights_to_surface, make_view

    view = table_view(calib, (96, 96))
    cam = make_view(calib, (80, 60), "camera")
    surface, _ = camera_heights_to_surface(np.zeros((60, 80)), np.zeros((60, 80), bool), calib, cam, view, 0.01,
                                           0.0072, walls=(0.058, 0.02))
    q = np.full((A, 96, 96), 0.9, np.float32)
    w, h = np.full((96, 96), 0.02, np.float32), np.full((96, 96), 0.02, np.float32)
    opts = DecodeOptions(0.3, on_part_px=1, jaws_on_part=1.0, answer_on_parts=True)
    sliver = decode_grasp(q, w, h, calib, view, opts, surface=surface)
    assert sliver.grasp is not None  # without the inset the walls' inner 10 mm are a "part"
    empty = decode_grasp(q, w, h, calib, view, opts, surface=surface, walls_inset=0.02)
    assert empty.grasp is None and empty.empty
    bar = np.maximum(surface, _bar_in_view(calib, view, 0.5, 0.02, 0.4))
    g = decode_grasp(q, w, h, calib, view, opts, surface=bar, walls_inset=0.02).grasp
    assert g is not None and math.hypot(g.position[0] - 0.5, g.position[1] - 0.02) < 0.06


def test_decode_rule_refuses_what_it_cannot_use(calib):
    q = np.full((A, 32, 32), 0.5, np.float32)
    m = np.zeros((32, 32), np.float32)
    with pytest.raises(ValueError, match="top-down view"):
        decode_grasp(q, m, m, calib, make_view(calib, (32, 32), "camera"), DecodeOptions(0.1, rule={}), surface=m)
    with pytest.raises(ValueError, match="surface"):
        decode_grasp(q, m, m, calib, table_view(calib, (32, 32)), DecodeOptions(0.1, rule={}))
    with pytest.raises(ValueError, match="unknown grasp rule options"):
        decode_grasp(q, m, m, calib, table_view(calib, (32, 32)), DecodeOptions(0.1, rule={"support": 1}), surface=m)


def test_artifact_rule_needs_a_surface_output(tmp_path, artifact_dir):
    """decode.rule is validated; an artifact whose graph has no surface cannot ask for it."""
    d = tmp_path / "a"
    shutil.copytree(artifact_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    meta["decode"] = {"neighbourhood_px": 1, "rule": {"support_px": 2}}
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="surface"):
        load_metadata(d)
    meta["outputs"]["surface"] = "height"  # any output name the graph has will do here
    (d / "metadata.json").write_text(json.dumps(meta))
    assert load_metadata(d).decode["rule"] == {"support_px": 2}
    meta["decode"]["rule"] = {"support_px": 2, "colour": 1}
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="unknown keys"):
        load_metadata(d)


def test_finger_landing_sees_a_part_too_wide_for_the_opening():
    """A 12 cm bar along u: closing along it (angle 0) fully open lands both fingers on
    the bar at its middle; closing across it they come down beside it on the floor.
    Off the bar's end the far finger is what lands."""
    px = 0.004
    A = 4
    occ = np.zeros((64, 64), bool)
    occ[29:35, 17:47] = True  # 24 mm x 120 mm
    landing = finger_landing(occ, px, A, np.full((64, 64), GRIPPER_MAX_WIDTH))
    assert landing.shape == (A, 64, 64) and landing.dtype == np.float32
    assert landing[0, 32, 32] > 0.9  # along the bar: both fingers on it
    assert landing[2, 32, 32] == 0.0  # across it: both on the floor
    assert 0.0 < landing[0, 32, 50] and landing[2, 32, 50] == 0.0  # beyond the end, along: one finger on it
    assert (landing >= 0).all() and (landing <= 1).all()
    assert not finger_landing(np.zeros_like(occ), px, A, np.full((64, 64), 0.05)).any()


def _bar_and_two_grasps(calib, n: int = 4):
    """A 4 cm tall, 14 cm long bar along x at the workspace's middle on a 64 px table view,
    and quality maps whose best grasp (0.9) closes along the bar at its centre and whose
    second (0.6) closes across it there: ``(view, surface, quality, along_bin, across_bin)``."""
    view = table_view(calib, (64, 64))
    surface = _bar_in_view(calib, view, 0.5, 0.0, 0.0, half_len=0.07, half_w=0.012, top=0.04)
    vs, us = np.nonzero(surface > 0)
    v0, u0 = int(np.median(vs)), int(np.median(us))
    along_bar = _angle_bin_of(calib, view, u0, v0, yaw=0.0, n=n)
    across_bar = _angle_bin_of(calib, view, u0, v0, yaw=math.pi / 2, n=n)
    q = np.full((n, 64, 64), 0.05, np.float32)
    q[along_bar, v0 - 1 : v0 + 2, u0 - 1 : u0 + 2] = 0.9
    q[across_bar, v0 - 1 : v0 + 2, u0 - 1 : u0 + 2] = 0.6
    return view, surface, q, along_bar, across_bar


def _refused_with_the_rule_or_without_a_surface(calib, view, q, w, h, surface, **check):
    """A decode check (``fingers_clear=...``, ``sweep_depth=...``) is exclusive with the rule
    and needs the surface map."""
    with pytest.raises(ValueError, match="exclusive"):
        decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, rule={}, **check), surface=surface)
    with pytest.raises(ValueError, match="surface map"):
        decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, **check))


def test_decode_fingers_clear_prefers_a_grasp_whose_fingers_land_free(calib):
    """decode.fingers_clear: the best quality closes along a bar longer than the opening;
    the decode answers the across grasp instead, at its own (lower) quality; with every
    angle blocked it still answers (a re-rank, never a null); exclusive with the rule."""
    view, surface, q, along_bar, across_bar = _bar_and_two_grasps(calib)
    w = np.full((64, 64), 0.05, np.float32)
    h = np.full((64, 64), 0.02, np.float32)
    plain = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08), surface=surface)
    assert plain.angle_bin == along_bar
    clear = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08, fingers_clear=0.25),
                         surface=surface)
    assert clear.angle_bin == across_bar and clear.grasp.quality == pytest.approx(0.6)
    q[across_bar] = 0.05
    still = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08, fingers_clear=0.25),
                         surface=surface)
    assert still.grasp is not None and still.angle_bin == along_bar
    _refused_with_the_rule_or_without_a_surface(calib, view, q, w, h, surface, fingers_clear=0.25)


def test_decode_unseen_standing_keeps_the_fingers_off_what_the_camera_did_not_see(calib):
    """decode.unseen_standing: with only the bar and its one side seen, the across grasp's far
    finger would come down where nothing was seen; the check then counts it as standing, and
    with every angle blocked the best quality is answered (a re-rank, never a null). Without
    the option, or without the seen cells, nothing changes; it needs fingers_clear."""
    view, surface, q, along_bar, across_bar = _bar_and_two_grasps(calib)
    w = np.full((64, 64), 0.05, np.float32)
    h = np.full((64, 64), 0.02, np.float32)
    _, us = np.nonzero(surface > 0)
    seen = np.ones((64, 64), bool)
    side = (slice(None), slice(0, us.min()))  # everything beside the bar on one side (u: across it here)
    seen[side] = False  # as behind a part
    clear = DecodeOptions(0.5, width_margin=0.08, fingers_clear=0.25)
    hidden = clear.replace(unseen_standing=True)
    assert decode_grasp(q, w, h, calib, view, clear, surface=surface, seen=seen).angle_bin == across_bar
    assert decode_grasp(q, w, h, calib, view, hidden, surface=surface).angle_bin == across_bar
    assert decode_grasp(q, w, h, calib, view, hidden, surface=surface, seen=seen).angle_bin == along_bar
    seen[side] = True  # seen after all: the across grasp is clear again
    assert decode_grasp(q, w, h, calib, view, hidden, surface=surface, seen=seen).angle_bin == across_bar
    with pytest.raises(ValueError, match="seen must be"):
        decode_grasp(q, w, h, calib, view, hidden, surface=surface, seen=seen[:10])
    with pytest.raises(DecodeOptionsError, match="needs fingers_clear"):
        DecodeOptions(0.5, unseen_standing=True)
    assert hidden.to_dict()["unseen_standing"] is True and "unseen_standing" not in clear.to_dict()


def test_jaw_span_is_short_at_a_bars_end_and_along_a_thin_bar():
    """A 12 mm x 120 mm bar along u: closing across it (angle pi/2) at its middle, the jaws'
    whole depth meets the bar; a cell in from its end, part of it reaches past; off the bar,
    none. Closing along the thin bar, the jaws' depth (22 mm) is wider than the bar."""
    px = 0.004
    occ = np.zeros((64, 64), bool)
    occ[31:34, 17:47] = True
    span = jaw_span(occ, px, 4)
    assert span.shape == (4, 64, 64) and span.dtype == np.float32
    assert span[2, 32, 32] == pytest.approx(1.0)
    assert 0.4 < span[2, 32, 18] < 0.9
    assert span[2, 40, 32] == 0.0
    assert 0.3 < span[0, 32, 32] < 0.8
    assert (span >= 0).all() and (span <= 1).all()


def test_decode_jaws_on_part_moves_the_grasp_in_from_a_bars_end(calib):
    """decode.jaws_on_part: the best quality closes across a bar at its very end; the decode
    answers the grasp across its middle instead, at its own (lower) quality; with nothing
    else above the threshold it still answers the end (a re-rank, never a null)."""
    view = table_view(calib, (64, 64))
    surface = _bar_in_view(calib, view, 0.5, 0.0, 0.0, half_len=0.06, half_w=0.008, top=0.04)
    vs, us = np.nonzero(surface > 0)
    v0, u0 = int(np.median(vs)), int(np.median(us))
    if np.ptp(us) > np.ptp(vs):  # the bar's length runs along u in this view
        end = (int(np.flatnonzero(surface[v0] > 0).min()), v0)
    else:
        end = (u0, int(np.flatnonzero(surface[:, u0] > 0).min()))
    across_bar = _angle_bin_of(calib, view, u0, v0, yaw=math.pi / 2, n=4)
    q = np.full((4, 64, 64), 0.05, np.float32)
    w = np.full((64, 64), 0.05, np.float32)
    h = np.full((64, 64), 0.02, np.float32)
    q[across_bar, end[1], end[0]] = 0.9
    q[across_bar, v0, u0] = 0.6
    plain = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5), surface=surface)
    assert plain.view_pixel == end
    inside = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, jaws_on_part=0.75), surface=surface)
    assert inside.view_pixel == (u0, v0) and inside.grasp.quality == pytest.approx(0.6)
    q[across_bar, v0, u0] = 0.05
    still = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, jaws_on_part=0.75), surface=surface)
    assert still.view_pixel == end
    with pytest.raises(ValueError, match="exclusive"):
        decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, jaws_on_part=0.75, rule={}), surface=surface)
    with pytest.raises(ValueError, match="surface map"):
        decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, jaws_on_part=0.75))


def _angle_bin_of(calib, view, u: int, v: int, yaw: float, n: int) -> int:
    """The image-plane angle bin whose base-frame yaw at view pixel (u, v) is nearest ``yaw``."""
    angles = angle_bin_centers(n)
    _, yaws, _ = view_grasp_to_base(np.array([[u, v]] * n, float), angles, np.full(n, 10.0), np.full(n, 0.02), calib, view)
    return int(np.argmin(np.abs(normalize_angle(yaws - yaw))))


def test_finger_obstacle_is_the_highest_point_under_either_finger():
    """A 4 cm bar along u and a 2 cm block beside it: closing across the bar at its middle
    fully open, one finger comes down over the block (its height), the other on the floor;
    closing along the bar both fingers come down on it; off everything, nothing."""
    px = 0.004
    s = np.zeros((64, 64), np.float32)
    s[29:35, 17:47] = 0.04  # 24 mm x 120 mm
    reach = int(round((GRIPPER_MAX_WIDTH / 2 + GRIPPER_FINGER_HALF_THICKNESS) / px))  # centre to a finger's centre
    s[32 + reach - 1 : 32 + reach + 2, 30:35] = 0.02  # a block under the +v finger of a grasp at (32, 32)
    ob = finger_obstacle(s, px, 4, np.full((64, 64), GRIPPER_MAX_WIDTH))
    assert ob.shape == (4, 64, 64) and ob.dtype == np.float32
    assert ob[2, 32, 32] == pytest.approx(0.02)  # across the bar: the block
    assert ob[0, 32, 32] == pytest.approx(0.04)  # along it: the bar
    assert ob[2, 10, 10] == 0.0
    # A narrower opening brings the fingers in past the block, beside the bar.
    assert finger_obstacle(s, px, 4, np.full((64, 64), 0.04))[2, 32, 32] == 0.0


def test_decode_sweep_depth_raises_the_fingers_over_a_low_neighbour(calib):
    """decode.sweep_depth: the best quality closes along a bar (the fingers would come down
    on it); across it one finger comes down over a 2 cm block, so the decode answers the
    across grasp with its fingertips raised to clear the block, still 1 cm or more below
    the bar's top. A block too tall to clear that deep leaves the along grasp (a re-rank,
    never a null). Validated in the artifact; exclusive with the rule."""
    view, surface, q, along_bar, across_bar = _bar_and_two_grasps(calib)
    block = _bar_in_view(calib, view, 0.5, 0.05, 0.0, half_len=0.02, half_w=0.012, top=0.02)  # 5 cm off in +y
    surface = np.maximum(surface, block)
    w = np.full((64, 64), 0.05, np.float32)
    h = np.full((64, 64), 0.015, np.float32)  # the network's: 2.5 cm below the bar's top
    plain = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08), surface=surface)
    assert plain.angle_bin == along_bar and plain.grasp.position[2] == pytest.approx(calib.table_z + 0.015)
    swept = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08, sweep_depth=0.01),
                         surface=surface)
    assert swept.angle_bin == across_bar and swept.grasp.quality == pytest.approx(0.6)
    assert swept.grasp.position[2] == pytest.approx(calib.table_z + 0.02 + ABOVE_TIPS, abs=1e-6)
    tall = np.maximum(surface, np.where(block > 0, 0.035, 0.0).astype(np.float32))
    still = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, width_margin=0.08, sweep_depth=0.01), surface=tall)
    assert still.grasp is not None and still.angle_bin == along_bar
    _refused_with_the_rule_or_without_a_surface(calib, view, q, w, h, surface, sweep_depth=0.01)
    with pytest.raises(ValueError, match=r"must be in \[0, 0.05\] m"):
        sweep_depth_option(0.2)


def test_off_centre_is_zero_at_a_parts_centroid_and_one_at_its_ends():
    parts = np.zeros((40, 60), bool)
    parts[18:23, 10:41] = True  # a bar, centroid (20, 25)
    parts[5:8, 50:53] = True  # a small square, centroid (6, 51)
    far = off_centre(parts)
    assert far.shape == parts.shape and far.dtype == np.float32
    assert far[20, 25] == 0.0 and far[6, 51] == 0.0
    assert far[20, 10] > 0.95 and far[20, 40] > 0.95  # the bar's ends, measured on the bar alone
    assert far[20, 18] == pytest.approx(7 / np.hypot(15, 2), abs=1e-6)
    assert (far[~parts] == 1.0).all() and (far[parts] <= 1.0).all()
    assert (off_centre(np.zeros((8, 8), bool)) == 1.0).all()


def test_decode_part_centre_moves_the_grasp_from_a_bars_end_to_its_middle(calib):
    """decode.part_centre: the best quality (0.9) crosses a bar near its end, a lower one
    (0.8) across its middle; a weight of 0.3 answers the middle, a weight too small for
    the quality gap leaves the end; exclusive with the rule and needs the surface."""
    view, surface, _, _, across_bar = _bar_and_two_grasps(calib)
    vs, us = np.nonzero(surface > 0)
    assert np.ptp(vs) > 4 * np.ptp(us)  # the bar runs along the view's v
    v0, u0, v_end = int(np.median(vs)), int(np.median(us)), int(vs.max()) - 1
    q = np.full((4, 64, 64), 0.05, np.float32)
    q[across_bar, v_end, u0] = 0.9
    q[across_bar, v0, u0] = 0.8
    w = np.full((64, 64), 0.05, np.float32)
    h = np.full((64, 64), 0.02, np.float32)
    plain = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5), surface=surface)
    assert plain.view_pixel == (u0, v_end)
    centred = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, part_centre=0.3), surface=surface)
    assert centred.view_pixel == (u0, v0) and centred.grasp.quality == pytest.approx(0.8)
    slight = decode_grasp(q, w, h, calib, view, DecodeOptions(0.5, part_centre=0.05), surface=surface)
    assert slight.view_pixel == (u0, v_end)
    _refused_with_the_rule_or_without_a_surface(calib, view, q, w, h, surface, part_centre=0.3)
