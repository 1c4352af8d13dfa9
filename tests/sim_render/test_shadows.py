"""Cast shadows traced towards the light (sim_render/shadows.py), in a real PyBullet scene."""

from __future__ import annotations

import numpy as np
import pybullet as p
import pytest
from omegaconf import OmegaConf
from pybullet_utils.bullet_client import BulletClient

from conf import to_plain
from perception.core.calibration import Calibration, default_calibration_path, project_points
from sim_render.api import compose_config
from sim_render.camera import render_camera
from sim_render.randomization import render_randomized, validate_profile
from sim_render.shadows import apply_cast_shadow, cast_shadow_mask, sample_cast_shadow, validate_cast_shadow

SIZE = (320, 240)
BOX_HALF = (0.03, 0.03, 0.05)  # a 10 cm tall block
ELEVATION = np.pi / 4  # the light 45 degrees up: the block's shadow is 10 cm long


@pytest.fixture(scope="module")
def calib() -> Calibration:
    return Calibration.load(default_calibration_path())


@pytest.fixture()
def block_scene(calib):
    """A table and one block in the middle of the workspace, with collision shapes."""
    c = BulletClient(connection_mode=p.DIRECT)
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2, calib.table_z])

    def box(half, pos):
        col = c.createCollisionShape(p.GEOM_BOX, halfExtents=list(half))
        vis = c.createVisualShape(p.GEOM_BOX, halfExtents=list(half), rgbaColor=[0.8, 0.8, 0.8, 1])
        return c.createMultiBody(0.0, col, vis, basePosition=list(pos))

    table = box([1.0, 1.0, 0.02], centre - [0, 0, 0.02])
    block = box(BOX_HALF, centre + [0, 0, BOX_HALF[2]])
    yield c, centre, table, block
    c.disconnect()


def _towards_camera(calib: Calibration, centre: np.ndarray) -> np.ndarray:
    """Unit vector on the table from ``centre`` towards the camera: a shadow cast that way is in view."""
    u = calib.T_base_camera[:2, 3] - centre[:2]
    return np.array([*(u / np.linalg.norm(u)), 0.0])


def _light(calib: Calibration, centre: np.ndarray) -> np.ndarray:
    """The light 45 degrees up, from beyond the block: its shadow falls towards the camera."""
    u = _towards_camera(calib, centre)
    return np.array([-u[0] * np.cos(ELEVATION), -u[1] * np.cos(ELEVATION), np.sin(ELEVATION)])


def _mask_at(mask: np.ndarray, points: np.ndarray, camera: Calibration) -> np.ndarray:
    uv = np.rint(project_points(points, camera)).astype(int)
    return mask[uv[:, 1], uv[:, 0]]


def test_the_block_shadows_the_table_away_from_the_light_only(calib, block_scene):
    c, centre, _table, block = block_scene
    camera = calib.scaled(SIZE)
    _rgb, depth, seg = render_camera(c, camera, 0.1)
    mask = cast_shadow_mask(c, depth, seg, camera, _light(calib, centre), resolution=1.0, max_rise=0.3)
    u = _towards_camera(calib, centre)
    v = np.array([-u[1], u[0], 0.0])
    # The block's faces are 3-4.2 cm from its centre and it is 10 cm tall: with the light 45
    # degrees up, the table 6-10 cm from the centre towards the camera is in its shadow, the
    # table as far to either side and 20 cm away is lit, and so is the block's own top.
    shadowed = np.array([centre + s * u for s in (0.06, 0.08, 0.10)])
    lit = np.array([centre + 0.08 * v, centre - 0.08 * v, centre + 0.2 * u])
    top = centre + [0.0, 0.0, 2 * BOX_HALF[2]]
    assert np.all(_mask_at(mask, shadowed, camera) > 0.99)
    assert np.all(_mask_at(mask, lit, camera) < 0.01)
    assert _mask_at(mask, top[None], camera)[0] < 0.01
    assert np.all(mask[seg == block] < 0.5)


def test_a_low_ray_limit_or_a_light_below_the_horizon_casts_nothing(calib, block_scene):
    c, centre, _table, _block = block_scene
    camera = calib.scaled(SIZE)
    _rgb, depth, seg = render_camera(c, camera, 0.1)
    # Rays followed only 5 mm up cannot reach the block's 10 cm top from more than 5 mm away.
    short = cast_shadow_mask(c, depth, seg, camera, _light(calib, centre), resolution=1.0, max_rise=0.005)
    full = cast_shadow_mask(c, depth, seg, camera, _light(calib, centre), resolution=1.0, max_rise=0.3)
    assert short.sum() < 0.05 * full.sum()
    assert not cast_shadow_mask(c, depth, seg, camera, [1.0, 0.0, 0.0], resolution=1.0, max_rise=0.3).any()


def test_a_coarse_grid_finds_the_same_shadow(calib, block_scene):
    c, centre, _table, _block = block_scene
    camera = calib.scaled(SIZE)
    _rgb, depth, seg = render_camera(c, camera, 0.1)
    full = cast_shadow_mask(c, depth, seg, camera, _light(calib, centre), resolution=1.0, max_rise=0.3) > 0.5
    coarse = cast_shadow_mask(c, depth, seg, camera, _light(calib, centre), resolution=0.25, max_rise=0.3) > 0.5
    assert full.sum() > 500  # the shadow is a real patch of the frame
    iou = (full & coarse).sum() / (full | coarse).sum()
    assert iou > 0.7


def test_skipping_rays_outside_every_other_box_leaves_the_mask_as_it_is(calib, scene, monkeypatch):
    import sim_render.shadows as shadows

    client, bodies = scene
    cfg = to_plain(compose_config("render", ["render=randomized"]).render)
    cfg["lighting"]["elevation"] = [0.6, 1.2]
    cfg["lighting"]["cast_shadow"]["prob"] = 1.0
    rng = np.random.default_rng(5)
    frames = [render_randomized(client, bodies, calib, rng, cfg) for _ in range(3)]

    def masks():
        return [cast_shadow_mask(client, f.depth, f.seg_raw, f.camera, f.params["lighting"]["lightDirection"],
                                 resolution=0.5, max_rise=0.3) for f in frames]

    skipped = masks()
    # The skip does skip: a ray from the table far from every part meets no other box.
    far = np.array([[calib.workspace_x[0] - 0.3, 0.0, calib.table_z + 0.004]])
    assert not shadows._may_hit_other(client, far, far + [0.0, 0.0, 0.3], np.array([bodies.table]))[0]
    monkeypatch.setattr(shadows, "_may_hit_other", lambda c, s, e, o: np.ones(len(s), dtype=bool))
    every_ray = masks()
    assert sum(float(m.mean()) for m in every_ray) > 0.01  # there are shadows to keep
    for a, b in zip(skipped, every_ray):
        assert np.array_equal(a, b)


def test_apply_keeps_the_drawn_share_of_the_light_in_the_shadow():
    rgb = np.full((40, 40, 3), 200, dtype=np.uint8)
    mask = np.zeros((40, 40), dtype=np.float32)
    mask[:, 20:] = 1.0
    out = apply_cast_shadow(rgb, mask, {"light_left": 0.25, "penumbra_px": 0.0})
    assert np.all(out[:, :20] == 200) and np.all(out[:, 20:] == 50)
    soft = apply_cast_shadow(rgb, mask, {"light_left": 0.25, "penumbra_px": 2.0})
    edge = soft[20, 17:23, 0].astype(int)
    assert np.all(np.diff(edge) <= 0) and 50 < edge[2] < 200  # a soft edge, falling into the shadow


def test_sampling_draws_nothing_when_off_and_stays_in_range():
    cfg = {"prob": 0.0, "light_left": [0.1, 0.6], "penumbra": [0.5, 3.0], "resolution": 0.25, "max_rise": 0.3}
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert sample_cast_shadow(rng, cfg) is None and sample_cast_shadow(rng, None) is None
    assert rng.bit_generator.state == state
    drawn = [sample_cast_shadow(rng, {**cfg, "prob": 1.0}) for _ in range(50)]
    assert all(0.1 <= d["light_left"] <= 0.6 and 0.5 <= d["penumbra_px"] <= 3.0 for d in drawn)
    half = [sample_cast_shadow(rng, {**cfg, "prob": 0.5}) for _ in range(400)]
    assert 120 < sum(d is not None for d in half) < 280


def test_bad_settings_are_named():
    good = {"prob": 1.0, "light_left": [0.1, 0.6], "penumbra": [0.5, 3.0], "resolution": 0.25, "max_rise": 0.3}
    assert validate_cast_shadow(good) == []
    for key, value in (("light_left", [0.5, 1.5]), ("penumbra", [3.0, 1.0]), ("resolution", 0.0),
                       ("max_rise", -1.0), ("prob", 2.0), ("prob", "often"), ("resolution", None),
                       ("light_left", "dark")):
        problems = validate_cast_shadow({**good, key: value})
        assert len(problems) == 1 and f"cast_shadow.{key}" in problems[0]
    profile = to_plain(compose_config("render", ["render=randomized"]).render)
    profile["lighting"]["cast_shadow"]["light_left"] = [0.2, 1.2]
    with pytest.raises(ValueError, match="cast_shadow.light_left"):
        validate_profile(OmegaConf.create(profile))


def test_the_randomized_profile_renders_darker_shadows_when_on(calib, scene):
    client, bodies = scene
    cfg = to_plain(compose_config("render", ["render=randomized"]).render)
    cfg["lighting"]["elevation"] = [0.6, 0.6]  # a low lamp: long shadows inside the bin
    cfg["distractors"]["count"] = [0, 0]  # their draws follow the shadow's: the same frame without them
    cfg["lighting"]["cast_shadow"]["prob"] = 0.0
    off = render_randomized(client, bodies, calib, np.random.default_rng(4), cfg)
    assert "cast_shadow" not in off.params
    cfg["lighting"]["cast_shadow"].update(prob=1.0, light_left=[0.2, 0.2], penumbra=[0.0, 0.0])
    on = render_randomized(client, bodies, calib, np.random.default_rng(4), cfg)
    assert on.params["cast_shadow"]["light_left"] == pytest.approx(0.2)
    # The same scene and camera draw (the sensor's and distractors' draws come after the shadow's).
    assert on.params["camera"] == off.params["camera"]
    assert np.array_equal(on.depth, off.depth)
    traced = cast_shadow_mask(client, off.depth, off.seg_raw, off.camera, off.params["lighting"]["lightDirection"],
                              resolution=0.25, max_rise=0.3) > 0.99
    assert 0.01 < traced.mean() < 0.5
    # Shadowed against lit pixels, in each frame: the sensor's gain cancels, the shadow does not.
    def ratio(frame):
        grey = frame.rgb.astype(float).mean(2)
        return grey[traced].mean() / grey[~traced].mean()
    assert ratio(on) < 0.6 * ratio(off)
