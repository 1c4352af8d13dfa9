"""What the robot measured during a grasp as labels on the geometry network (policies/stops.py):
what each outcome says, and that a few fine-tune steps move the network's heights under the
fingers towards what was measured, with a real Lightning Trainer on a twin frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perception.core.frames import GRIPPER_FINGER_HALF_THICKNESS
from perception.core.geometry import view_rays
from perception.core.imageio import encode_image
from policies.data import split_by_scene
from policies.finetune import promotion_decision, stop_error_difference
from policies.geometry import GEOMETRY_FORMAT, base_view, geometry_net, make_geometry_datasets
from policies.stops import (
    StopFrames,
    finetune_geometry,
    footprint_points,
    in_region,
    stop_errors,
    stop_label,
)
from policies.weights import load_base
from sim_render.reader import SimFrameDataset

TZ = 0.0  # the labels' heights are relative to table_z: any table height reads the same
GRASP = {"position": [0.5, 0.0, TZ + 0.02], "yaw": 0.0, "width": 0.05}
RULES = {"part_between_m": 0.005, "closed_m": 0.002}
HELD_OUT = 0.34  # of the rendered scenes: one of three


def _label(**outcome):
    return stop_label(GRASP, {"success": False, **outcome}, TZ, **RULES)


def test_each_measured_field_says_what_it_says_and_no_more():
    stop = _label(contact_stop=True, fingertip_z=TZ + 0.03, jaw_width=0.0)
    assert stop.stop == stop.bound == pytest.approx(0.03) and stop.swept and stop.between is None
    # A full descent is a bound only; without fingertip_z the answered z is where it ended.
    reached = _label(contact_stop=False)
    assert reached.stop is None and reached.bound == pytest.approx(0.02) and not reached.swept
    assert _label(contact_stop=False, fingertip_z=TZ + 0.004).bound == pytest.approx(0.004)
    # A part between the pads at the fingertips' height: half the closed opening.
    held = _label(contact_stop=False, fingertip_z=TZ + 0.01, jaw_width=0.03)
    assert held.between == pytest.approx(0.015) and not held.swept and held.bound == pytest.approx(0.01)
    assert _label(contact_stop=False, jaw_width=0.003).between is None  # neither closed nor holding: no claim
    # No height known: a stop without where, a width without a height, nothing measured.
    assert _label(contact_stop=True) is None
    assert _label(jaw_width=0.03) is None
    assert stop_label(GRASP, {"success": True}, TZ, **RULES) is None
    assert stop_label(GRASP, None, TZ, **RULES) is None


def test_the_footprints_are_the_fingers_and_the_swept_band_is_between_them():
    lab = _label(contact_stop=True, fingertip_z=TZ + 0.03, jaw_width=0.0)
    c, a = np.asarray([lab.centre]), np.asarray([lab.axis])

    def inside(pts, inner):
        return in_region(pts[None], c, a, np.asarray([[inner]]), np.asarray([[lab.pad_outer]]),
                         np.asarray([[lab.half_depth]]))[0]

    pads = footprint_points(lab, 0.002)
    along = pads[:, 0] - 0.5  # yaw 0: the closing line is x
    assert inside(pads, lab.pad_inner).all() and (np.abs(along) >= 0.025 - 1e-9).all()
    assert np.abs(along).max() == pytest.approx(0.025 + 2 * GRIPPER_FINGER_HALF_THICKNESS, abs=1e-3)
    band = footprint_points(lab, 0.002, swept=True)
    assert inside(band, 0.0).all() and not inside(band, lab.pad_inner).all()
    assert inside(np.asarray([[0.5, 0.0]]), 0.0)[0] and not inside(np.asarray([[0.5, 0.0]]), lab.pad_inner)[0]
    assert not inside(np.asarray([[0.5, 0.02]]), 0.0)[0]  # beyond the fingers' depth


def test_the_check_reads_stops_as_errors_and_full_descents_as_bounds():
    labels = [_label(contact_stop=True, fingertip_z=TZ + 0.03), _label(contact_stop=True, fingertip_z=TZ + 0.01),
              _label(contact_stop=False, fingertip_z=TZ + 0.005), _label(contact_stop=False, fingertip_z=TZ + 0.005)]
    e = stop_errors([0.035, 0.0, 0.02, 0.006], labels, tolerance=0.003)
    assert e["stops"] == 2 and e["stop_error_median_mm"] == pytest.approx(7.5)
    assert e["bounds"] == 2 and e["bound_violations"] == 1  # 15 mm over its bound; 1 mm is within the tolerance


def test_the_stops_keep_a_worse_geometry_out_and_do_not_bring_an_unresolved_policy_in():
    before = np.tile([8.0, 12.0, 5.0, 20.0, 9.0], 4)
    closer = stop_error_difference(before, before - 4.0, block_attempts=5, resamples=500)
    assert closer["difference"] == pytest.approx(-4.0) and closer["interval"][1] < 0
    farther = stop_error_difference(before, before + 3.0, block_attempts=5, resamples=500)
    assert farther["interval"][0] > 0
    noisy = stop_error_difference(before, before + np.tile([-6.0, 6.0], 10), block_attempts=5, resamples=500)
    assert noisy["interval"][0] < 0 < noisy["interval"][1]
    better_auc = {"difference": 0.2, "interval": [0.05, 0.3], "block_attempts": 5, "attempts": 20}
    unresolved_auc = {"difference": 0.01, "interval": [-0.1, 0.12], "block_attempts": 5, "attempts": 20}
    worse_auc = {"difference": -0.2, "interval": [-0.3, -0.05], "block_attempts": 5, "attempts": 20}
    # The candidate carries the fine-tuned policy too: a better geometry does not bring in a policy the
    # check could not call better (the regression of AUC 0.573 -> 0.537, served, 41.4% -> 33.8%).
    held = promotion_decision(unresolved_auc, True, False, stop_change=closer)
    assert not held.promoted and "agrees better with the measured stops" in held.reason
    assert not promotion_decision(worse_auc, True, False, stop_change=closer).promoted
    assert promotion_decision(better_auc, True, False, stop_change=closer).promoted
    assert promotion_decision(better_auc, True, False, stop_change=noisy).promoted  # not shown worse
    kept = promotion_decision(better_auc, True, False, stop_change=farther)  # a geometry shown worse keeps it out
    assert not kept.promoted and "agrees worse" in kept.reason
    assert stop_error_difference([], [], 5, 100) is None
    assert promotion_decision(better_auc, True, False, stop_change=None).promoted  # no stops: the AUC decides


@pytest.fixture(scope="module")
def twin(rendered, tmp_path_factory):
    """A rendered twin frame written as a recording's frame would be, the shipped geometry network,
    its view on the frame's calibration and the rays of that view."""
    frames = SimFrameDataset(rendered, fields=("rgb",))
    calib = frames.calibration
    folder = tmp_path_factory.mktemp("stops")
    # A frame of a scene the fine-tune's sim frames leave out (make_geometry_datasets splits the same way).
    _, held_out = split_by_scene(frames, HELD_OUT, 0)
    (folder / "f.png").write_bytes(encode_image(np.asarray(frames[int(held_out[0])]["rgb"]), "png"))
    base = load_base("geometry_base_v2", GEOMETRY_FORMAT)
    view = base_view(base, calib)
    return {"calib": calib, "dir": folder, "base": base, "view": view, "net": geometry_net,
            "rays": view_rays(calib, view), "rendered": rendered}


def _highest_under(net, ds: StopFrames, rays) -> list[float]:
    """Per item, the highest predicted point whose (x, y) lies under its footprints (metres above the table)."""
    origin, dirs = rays
    out = []
    with torch.no_grad():
        for i in range(len(ds)):
            item = ds[i]
            h = net(item["image"][None])["height"][0, 0].numpy().ravel().astype(np.float64)
            t = (ds.calib.table_z + h - origin[2]) / dirs[:, 2]
            xy = origin[:2] + dirs[:, :2] * t[:, None]
            inside = in_region(xy[None], item["centre"].numpy()[None], item["axis"].numpy()[None],
                               np.asarray([[float(item["pad_inner"])]]), np.asarray([[float(item["pad_outer"])]]),
                               np.asarray([[float(item["half_depth"])]]))[0]
            out.append(float(h[inside].max()) if inside.any() else 0.0)
    return out


def test_measured_stops_pull_the_geometry_under_the_fingers_towards_them(twin, tmp_path):
    """One attempt stopped 3 cm above what the network sees under its fingers; another went down to
    5 mm where the network sees its highest part: a few fine-tune steps (a real Trainer, beside
    twin frames) move both towards what was measured."""

    calib, view, base = twin["calib"], twin["view"], twin["base"]
    net = twin["net"](base)
    tz = calib.table_z
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    # Candidate grasp centres inside the bin; the network's view of each.
    centres = [(x, y) for x in np.linspace(x0 + 0.06, x1 - 0.06, 7) for y in np.linspace(y0 + 0.06, y1 - 0.06, 7)]

    def attempt(xy, outcome):
        return {"grasp": {"position": [xy[0], xy[1], tz + 0.02], "yaw": 0.3, "width": 0.04}, "frame": "f.png",
                "_dir": str(twin["dir"]), "outcome": {"success": False, **outcome}}

    probe = StopFrames([attempt(c, {"contact_stop": True, "fingertip_z": tz + 0.05}) for c in centres], calib, view,
                       **RULES)
    seen = _highest_under(net, probe, twin["rays"])
    low, high = centres[int(np.argmin(seen))], centres[int(np.argmax(seen))]
    assert max(seen) > min(seen) + 0.005  # the frame has parts: somewhere is higher than elsewhere
    stop_at = min(seen) + 0.03
    bound = 0.005
    attempts = [attempt(low, {"contact_stop": True, "fingertip_z": tz + stop_at}),
                attempt(high, {"contact_stop": False, "fingertip_z": tz + bound})]
    stops = StopFrames(attempts, calib, view, **RULES, anchor=net)
    assert len(stops) == 2 and stops[0]["stop_mask"].any()
    # The rest of the frame is held to the network's own answer; what the labels speak of is left free.
    assert not (stops[0]["anchor_mask"] & stops[0]["stop_mask"]).any() and stops[0]["anchor_mask"].float().mean() > 0.8
    before = _highest_under(net, stops, twin["rays"])

    sim, _, _, _ = make_geometry_datasets([twin["rendered"]], {"view_size": base["view_size"], "margin": base["margin"],
                                                               "augment": None}, HELD_OUT, 0)
    gcfg = {"batch_size": 2, "label_weight": 1.0, "tolerance_m": 0.003, "anchor_weight": 1.0, "between_weight": 0.0,
            "max_steps": 25, "max_time_s": None, "accelerator": "cpu", "optim": {"lr": 3e-4, "warmup_steps": 0}}
    res = finetune_geometry(base, stops, sim, tmp_path / "g", gcfg, seed=0)
    assert res["global_step"] == 25 and res["attempts"] == 2

    tuned = load_base(res["path"], GEOMETRY_FORMAT)
    assert tuned["finetuned"]["attempts"] == 2 and tuned["view_size"] == base["view_size"]
    after = _highest_under(twin["net"](tuned), stops, twin["rays"])
    # The stop: the highest point under the fingers rises towards it (at least half the way).
    assert abs(after[0] - stop_at) < 0.5 * abs(before[0] - stop_at)
    # The full descent: what stood above its end under the fingers comes down.
    assert before[1] > bound + 0.005 and after[1] - bound < 0.5 * (before[1] - bound)


def test_a_stop_pulls_the_height_read_from_bins_towards_it(twin, tmp_path):
    """A network whose height is classified into bins (``height_bins``) is fine-tuned on the stops
    through the height read from its bins: after the same steps with and without the label, the
    highest point under the fingers ends nearer the measured stop with it."""
    from policies.networks import GeometryNet, build_network

    # A stop well above what the sim frames teach there (metres above the table): the sim loss
    # alone pulls away from it.
    STOP = 0.09
    calib, view, v2 = twin["calib"], twin["view"], twin["base"]
    block = {"_target_": "policies.networks.GeometryNet", "base_channels": 8, "dilations": [2], "height_bins": 16}
    torch.manual_seed(0)
    net = build_network(block, GeometryNet, "geometry.network").eval()
    base = {"format": GEOMETRY_FORMAT, "network": block, "state_dict": net.state_dict(),
            "view_size": v2["view_size"], "margin": v2["margin"], "config": {"name": "bins"}}
    tz = calib.table_z
    cx, cy = float(np.mean(calib.workspace_x)), float(np.mean(calib.workspace_y))
    attempt = {"grasp": {"position": [cx, cy, tz + 0.02], "yaw": 0.3, "width": 0.04}, "frame": "f.png",
               "_dir": str(twin["dir"]), "outcome": {"success": False, "contact_stop": True, "fingertip_z": tz + STOP}}
    stops = StopFrames([attempt], calib, view, **RULES)
    before = _highest_under(net, stops, twin["rays"])[0]  # for the message
    sim, _, _, _ = make_geometry_datasets([twin["rendered"]], {"view_size": base["view_size"], "margin": base["margin"],
                                                               "augment": None}, HELD_OUT, 0)
    after = {}
    for weight in (0.0, 1.0):
        gcfg = {"batch_size": 2, "label_weight": weight, "tolerance_m": 0.003, "anchor_weight": 0.0,
                "between_weight": 0.0, "max_steps": 40, "max_time_s": None, "accelerator": "cpu",
                "optim": {"lr": 3e-3, "warmup_steps": 0}}
        res = finetune_geometry(base, stops, sim, tmp_path / f"w{weight}", gcfg, seed=0)
        after[weight] = _highest_under(geometry_net(load_base(res["path"], GEOMETRY_FORMAT)), stops, twin["rays"])[0]
    assert abs(after[1.0] - STOP) < 0.5 * abs(after[0.0] - STOP), (before, after)
