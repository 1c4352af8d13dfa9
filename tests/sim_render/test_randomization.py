"""Randomization: profiles, determinism, replay, textures, sensor, distractors, physics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pybullet as p
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from pybullet_utils.bullet_client import BulletClient

from conf import to_plain
from conf.schema import RenderProfile
from perception.core.calibration import Calibration, default_calibration_path, project_points
from sim_render.api import compose_config
from sim_render.randomization import (
    add_distractors,
    apply_visual_params,
    apply_visuals,
    jitter_camera,
    remove_bodies,
    render_randomized,
    sample_camera,
    sample_lighting,
    sample_physics,
    validate_profile,
)
from sim_render.sensor import apply_sensor, apply_sensor_params
from sim_render.textures import TEXTURES, TexturePool, make_texture

CONF = Path(__file__).resolve().parents[2] / "conf" / "render"
PROFILES = ("randomized", "canonical", "target", "target_b")
# Small frames keep TinyRenderer fast: 128x96 from the 640x480 calibration.
TEST_SCALE = 0.2


def _profile(name: str, **overrides) -> dict:
    """The profile as Hydra composes it (a profile file states only what differs from its base)."""
    cfg = to_plain(compose_config("render", [f"render={name}"]).render)
    cfg.update(overrides)
    return cfg


def _keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
    return out


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, 0]))


@pytest.fixture(scope="module")
def calib() -> Calibration:
    return Calibration.load(default_calibration_path())




# ------------------------------------------------------------------ profiles
@pytest.mark.parametrize("name", PROFILES)
def test_profile_is_complete_and_valid(name):
    cfg = _profile(name)
    assert cfg["name"] == name
    # Sections a profile may leave out (then off): image-space textures, empty bins, traced shadows.
    optional = ("surface_textures", "empty_scene_prob", "bin_walls", "lighting.cast_shadow")
    keys = lambda c: {k for k in _keys(c) if not any(k == o or k.startswith(o + ".") for o in optional)}  # noqa: E731
    assert keys(cfg) == keys(_profile("randomized"))
    validate_profile(OmegaConf.create(cfg))


@pytest.mark.parametrize("name", [n for n in PROFILES if n != "randomized"])
def test_a_profile_file_states_only_what_differs_from_its_base(name):
    """The profiles compose through Hydra defaults: a file holds its base's name and the
    values that differ from it, never a copy (a copied block drifts when the base changes)."""
    own = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    bases = [d for d in own.pop("defaults") if d != "_self_"]
    assert len(bases) == 1 and bases[0] in PROFILES
    base = _profile(bases[0])

    def same_as_base(node, ref, path=""):
        if isinstance(node, dict) and isinstance(ref, dict):
            return [p for k, v in node.items() for p in same_as_base(v, ref.get(k, _ABSENT), f"{path}{k}.")]
        return [path.rstrip(".")] if node == ref else []

    assert same_as_base(own, base) == []
    assert _profile(name)["name"] == name


_ABSENT = object()


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_is_typed_by_the_schema_and_sets_every_key(name):
    cfg = compose_config("render", [f"render={name}"]).render
    assert OmegaConf.get_type(cfg) is RenderProfile
    assert OmegaConf.missing_keys(cfg) == set()  # the YAML sets every key the schema names


@pytest.mark.parametrize(
    ("override", "key"),
    [("render.grasps.n_random=many", "n_random"), ("render.physics.timestep=fast", "timestep"),
     ("render.sensor.blur_prob=often", "blur_prob"), ("render.textures.table.kinds=5", "kinds"),
     ("render.physcs.mass=[0.1,0.2]", "physcs")],
)
def test_the_schema_refuses_a_wrong_type_or_an_unknown_key_when_composing(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config("render", ["render=randomized", override])
    assert key in f"{err.value} {err.value.__cause__}"


def test_a_key_a_profile_forgets_is_reported_missing_not_filled_from_python():
    schema = OmegaConf.structured(RenderProfile)
    own = OmegaConf.load(CONF / "randomized.yaml")
    own.pop("defaults")
    del own.physics["timestep"]
    assert "physics.timestep" in OmegaConf.missing_keys(OmegaConf.merge(schema, own))


def test_a_section_switched_on_from_the_command_line_is_typed_by_validate_profile():
    """A null section (target's bin_walls, cast_shadow) can be switched on with a mapping; its
    dataclass then names an unknown key or a wrong type, its ranges are checked as ever."""
    on = to_plain(compose_config("render", ["render=target", "render.bin_walls={height: [0.03, 0.06], thickness: [0.01, 0.01]}"]).render)
    validate_profile(on)
    for override, expected in [
        ("render.bin_walls={height: [0.03, 0.06], thicknes: [0.01, 0.01]}", "bin_walls.thicknes"),
        ("render.lighting.cast_shadow={prob: often, light_left: [0.1, 0.6], penumbra: [0.5, 3.0], resolution: 0.25, max_rise: 0.3}",
         "lighting.cast_shadow.prob"),
        ("render.bin_walls={height: [0.03, 0.09], thickness: [0.01, 0.01]}", "0.06 m"),
    ]:
        cfg = to_plain(compose_config("render", ["render=target", override]).render)
        with pytest.raises(ValueError, match=expected) as err:
            validate_profile(cfg)
        assert str(err.value).count(expected) == 1  # the type check gates the value check: one message


def test_types_alone_check_no_ranges_validate_profile_does():
    """A probability of 1.5 and a range [0.9, 0.1] have the right types: the schema lets them
    through and validate_profile (which every renderer runs first) names both."""
    cfg = to_plain(compose_config("render", ["render=randomized", "render.lighting.shadow_prob=1.5",
                                             "render.sensor.gamma=[1.2,0.8]"]).render)
    with pytest.raises(ValueError) as err:
        validate_profile(cfg)
    assert "lighting.shadow_prob" in str(err.value) and "sensor.gamma" in str(err.value)


@pytest.mark.parametrize("name", ["target", "target_b"])
def test_target_profiles_train_split_and_nominal_distortion(name):
    cfg = _profile(name)
    assert cfg["object_split"] == "train"
    assert cfg["camera"]["distortion_jitter"] == 0.0


def test_validate_profile_names_bad_fields():
    cfg = _profile("randomized")
    cfg["textures"]["table"]["kinds"] = ["marble"]
    cfg["lighting"]["ambient"] = [0.9, 0.1]
    with pytest.raises(ValueError, match="marble") as err:
        validate_profile(cfg)
    assert "lighting.ambient" in str(err.value) and "noise" in str(err.value)


# -------------------------------------------------------------- determinism
def _by_order(frame) -> np.ndarray:
    seg = frame.seg_raw.copy()
    for k, body in enumerate(frame.distractor_ids):
        seg[frame.seg_raw == body] = -100 - k
    return seg


def test_same_seed_same_frame(scene, calib):
    client, bodies = scene
    cfg = _profile("randomized", resolution_scale=TEST_SCALE)
    a = render_randomized(client, bodies, calib, _rng(3), cfg)
    b = render_randomized(client, bodies, calib, _rng(3), cfg)
    np.testing.assert_array_equal(a.rgb, b.rgb)
    # PyBullet hands out the ids of removed bodies again, in its own order: compare the
    # distractors by their place in distractor_ids (the dataset maps them all to one label).
    np.testing.assert_array_equal(_by_order(a), _by_order(b))
    assert json.dumps(a.params) == json.dumps(b.params)
    c = render_randomized(client, bodies, calib, _rng(4), cfg)
    assert not np.array_equal(a.rgb, c.rgb)


def test_canonical_ignores_the_seed(scene, calib):
    client, bodies = scene
    cfg = _profile("canonical", resolution_scale=TEST_SCALE)
    frames = [render_randomized(client, bodies, calib, _rng(s), cfg) for s in (0, 1, 2)]
    for f in frames[1:]:
        np.testing.assert_array_equal(f.rgb, frames[0].rgb)
        np.testing.assert_array_equal(f.depth, frames[0].depth)
    np.testing.assert_array_equal(frames[0].camera.K, calib.scaled(frames[0].camera.image_size).K)
    assert frames[0].distractor_ids == []


def test_visual_params_replay(scene, calib):
    """Applying the stored params reproduces the frame."""
    client, bodies = scene
    cfg = _profile("randomized", resolution_scale=TEST_SCALE)
    cam = calib.scaled((128, 96))
    from sim_render.camera import render_camera

    params = apply_visuals(client, bodies, _rng(7), cfg)
    first = render_camera(client, cam, 0.15)[0]
    apply_visuals(client, bodies, _rng(8), cfg)
    apply_visual_params(client, bodies, json.loads(json.dumps(params)))
    np.testing.assert_array_equal(render_camera(client, cam, 0.15)[0], first)


def test_visuals_follow_palette(scene):
    client, bodies = scene
    cfg = _profile("canonical")
    params = apply_visuals(client, bodies, _rng(0), cfg)
    assert params["objects"][0]["rgba"][:3] == cfg["colors"]["objects"]["palette"][0]
    assert all(s["texture"] is None for s in [params["table"], params["bin"], *params["objects"]])
    rgba = client.getVisualShapeData(bodies.objects[0])[0][7]
    np.testing.assert_allclose(rgba[:3], cfg["colors"]["objects"]["palette"][0])


# ------------------------------------------------------------ camera, light
def test_camera_jitter_within_ranges_and_replays(calib):
    cfg = _profile("randomized")["camera"]
    cam, params = sample_camera(calib, _rng(1), cfg)
    assert np.all(np.abs(cam.T_base_camera[:3, 3] - calib.T_base_camera[:3, 3]) <= cfg["position_jitter"])
    assert abs(cam.K[0, 0] / calib.K[0, 0] - 1) <= cfg["focal_jitter"] + 1e-12
    assert np.all(np.abs(cam.K[:2, 2] - calib.K[:2, 2]) <= cfg["principal_jitter"])
    assert np.all(np.abs(cam.dist[:2] - calib.dist[:2]) <= cfg["distortion_jitter"])
    np.testing.assert_array_equal(cam.dist[2:], calib.dist[2:])
    R, R0 = cam.T_base_camera[:3, :3], calib.T_base_camera[:3, :3]
    np.testing.assert_allclose(R @ R.T, R0 @ R0.T, atol=1e-12)  # a rotation of the nominal
    replay = jitter_camera(calib, json.loads(json.dumps(params)))
    np.testing.assert_array_equal(replay.T_base_camera, cam.T_base_camera)
    np.testing.assert_array_equal(replay.K, cam.K)


def test_zero_jitter_is_nominal(calib):
    cam, _ = sample_camera(calib, _rng(1), _profile("canonical")["camera"])
    for a in ("K", "dist", "T_base_camera"):
        np.testing.assert_array_equal(getattr(cam, a), getattr(calib, a))


def test_lighting_keywords(scene):
    cfg = _profile("randomized")
    light = sample_lighting(_rng(2), cfg["lighting"])
    assert light == sample_lighting(_rng(2), cfg)  # the profile or its section
    assert np.isclose(np.linalg.norm(light["lightDirection"]), 1.0) and light["lightDirection"][2] > 0
    lo, hi = cfg["lighting"]["ambient"]
    assert lo <= light["lightAmbientCoeff"] <= hi and light["shadow"] in (0, 1)
    client, _ = scene
    client.getCameraImage(32, 24, **light)  # PyBullet accepts every keyword
    json.dumps(light)


# ---------------------------------------------------------------- distractors
def test_distractors_are_visual_only_outside_workspace_and_in_view(scene, calib):
    client, bodies = scene
    cfg = _profile("randomized")
    cfg["distractors"]["count"] = [4, 4]
    params: list[dict] = []
    ids = add_distractors(client, calib, _rng(5), cfg, table=bodies.table, params_out=params)
    assert len(ids) == len(params) >= 3
    d = cfg["distractors"]
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    for body, prm in zip(ids, params):
        assert client.getCollisionShapeData(body, -1) == ()
        assert client.getBodyInfo(body) is not None
        x, y, _ = prm["position"]
        r = float(np.hypot(*prm["half_extents"][:2]))
        outside = (
            x < x0 - d["clearance"] - r
            or x > x1 + d["clearance"] + r
            or y < y0 - d["clearance"] - r
            or y > y1 + d["clearance"] + r
        )
        assert outside
        u, v = project_points(np.array([prm["position"]]), calib)[0]
        assert 0 <= u < calib.width and 0 <= v < calib.height
    again: list[dict] = []
    remove_bodies(client, ids)
    ids2 = add_distractors(client, calib, _rng(5), cfg, table=bodies.table, params_out=again)
    assert json.dumps(again) == json.dumps(params)
    remove_bodies(client, ids2)


def test_distractors_change_no_physics(scene, calib):
    client, bodies = scene
    cfg = _profile("randomized")
    cfg["distractors"]["count"] = [4, 4]
    before = client.getNumBodies()
    ids = add_distractors(client, calib, _rng(6), cfg)
    client.stepSimulation()
    assert client.getContactPoints() == () or all(
        c[1] not in ids and c[2] not in ids for c in client.getContactPoints()
    )
    remove_bodies(client, ids)
    assert client.getNumBodies() == before


# ---------------------------------------------------------------- physics
def test_sample_physics_ranges():
    cfg = _profile("randomized")["physics"]
    phys = sample_physics(_rng(0), cfg, n_objects=3)
    for key in ("lateral_friction", "spinning_friction", "mass", "restitution"):
        assert len(phys[key]) == 3
        assert all(cfg[key][0] <= v <= cfg[key][1] for v in phys[key])
    for key in ("table_friction", "gripper_force", "finger_friction"):
        assert cfg[key][0] <= phys[key] <= cfg[key][1]
    canonical = sample_physics(_rng(1), _profile("canonical"), n_objects=2)
    assert canonical == sample_physics(_rng(2), _profile("canonical"), n_objects=2)


# ---------------------------------------------------------------- textures
@pytest.mark.parametrize("kind", sorted(TEXTURES))
@pytest.mark.parametrize("size", [64, 128])
def test_texture_layout_and_determinism(kind, size):
    img = make_texture(kind, 0, size)
    assert img.shape == (size, size, 3) and img.dtype == np.uint8
    np.testing.assert_array_equal(img, make_texture(kind, 0, size))
    assert not np.array_equal(img, make_texture(kind, 1, size))
    assert img.std() > 0.5  # a texture, not a flat colour


def test_unknown_texture_kind_lists_known():
    with pytest.raises(KeyError, match="wood"):
        make_texture("marble", 0)


def test_texture_pool_loads_once_and_caps():
    c = BulletClient(connection_mode=p.DIRECT)
    try:
        pool = TexturePool(c, capacity=3)
        a = pool.get("wood", 0, 64)
        assert pool.get("wood", 0, 64) == a and len(pool) == 1
        for v in range(1, 3):
            pool.get("noise", v, 64)
        with pytest.warns(UserWarning, match="distinct textures"):
            pool.get("checkers", 0, 64)
        assert len(pool) == 3
    finally:
        c.disconnect()


# ------------------------------------------------------------------ sensor
@pytest.mark.parametrize("name", PROFILES)
def test_sensor_keeps_layout(name):
    img = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    out, params = apply_sensor(img, _rng(1), _profile(name)["sensor"])
    assert out.shape == img.shape and out.dtype == np.uint8
    assert abs(float(out.mean()) - float(img.mean())) < 40  # a look, not a different image
    np.testing.assert_array_equal(apply_sensor_params(img, json.loads(json.dumps(params))), out)


def test_sensor_canonical_is_identity():
    img = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out, _ = apply_sensor(img, _rng(1), _profile("canonical")["sensor"])
    np.testing.assert_array_equal(out, img)


def test_sensor_every_effect_runs():
    img = np.full((48, 64, 3), 128, np.uint8)
    cfg = _profile("randomized")["sensor"]
    cfg.update(
        blur_prob=1.0,
        jpeg_prob=1.0,
        defocus_sigma=[1.0, 1.0],
        motion_length=[3.0, 3.0],
        read_noise=[3.0, 3.0],
        vignetting=[0.3, 0.3],
    )
    out, params = apply_sensor(img, _rng(0), cfg)
    assert params["blur"] and params["jpeg"]
    assert out[24, 32].mean() > out[0, 0].mean()  # vignetting darkens the corners
    assert out.std() > 1.0  # noise
