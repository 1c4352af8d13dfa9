"""Image-space natural-image textures, the CFA/ISP sensor stages and empty-bin scenes (issue 11)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import cv2
import numpy as np
import pytest

from conf import to_plain
from perception.core.calibration import Calibration, default_calibration_path
from sim_render.api import compose_config
from sim_render.randomization import render_randomized, validate_profile
from sim_render.sensor import apply_sensor_params, draw_range, draw_ranges
from sim_render.surfaces import (
    FAMILIES,
    _ray_grid,
    _spectral_field,
    _unit_gradient,
    _wrap,
    dead_leaves,
    make_surface_texture,
    sample_surface_textures,
    surface_coordinates,
)

ROOT = Path(__file__).resolve().parents[2]
TEST_SCALE = 0.25


def _profile(name: str = "randomized") -> dict:
    return to_plain(compose_config("render", [f"render={name}"]).render)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, 7]))


@pytest.fixture(scope="module")
def calib() -> Calibration:
    return Calibration.load(default_calibration_path())




# --------------------------------------------------------------- the families
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_a_seeded_texture(family):
    cfg = _profile()["surface_textures"]
    colors = _profile()["colors"]["table"]
    a = make_surface_texture({"family": family, "seed": 5}, cfg, colors)
    assert a.shape == (cfg["size"], cfg["size"], 3) and a.dtype == np.float32
    assert 0.0 <= a.min() and a.max() <= 1.0 and np.isfinite(a).all()
    np.testing.assert_array_equal(a, make_surface_texture({"family": family, "seed": 5}, cfg, colors))
    assert not np.array_equal(a, make_surface_texture({"family": family, "seed": 6}, cfg, colors))
    assert a.std() > 0.01  # a pattern, not a flat colour


def _spectrum_slope(field: np.ndarray) -> float:
    """Slope of the radially averaged power spectrum in log-log (natural images: about -2)."""
    n = field.shape[0]
    power = np.abs(np.fft.fft2(field - field.mean())) ** 2
    f = np.sqrt(np.fft.fftfreq(n)[:, None] ** 2 + np.fft.fftfreq(n)[None, :] ** 2)
    bands = np.geomspace(2.0 / n, 0.4, 12)
    mids, means = [], []
    for lo, hi in zip(bands[:-1], bands[1:]):
        sel = (f >= lo) & (f < hi)
        mids.append(np.sqrt(lo * hi))
        means.append(power[sel].mean())
    return float(np.polyfit(np.log(mids), np.log(means), 1)[0])


@pytest.mark.parametrize("exponent", [1.5, 2.0, 3.0])
def test_spectral_field_has_the_configured_power_law(exponent):
    slopes = [_spectral_field(np.random.default_rng(s), 128, exponent) for s in range(4)]
    slope = np.mean([_spectrum_slope(z) for z in slopes])
    assert abs(slope + exponent) < 0.25


def test_dead_leaves_have_edges_at_every_scale():
    cfg = _profile()["surface_textures"]
    img = make_surface_texture({"family": "dead_leaves", "seed": 1}, cfg, _profile()["colors"]["table"])
    grey = img.mean(axis=2)
    # Gradient energy at full, half and quarter resolution: occlusion edges survive each scale.
    for level in range(3):
        g = cv2.resize(grey, None, fx=0.5**level, fy=0.5**level, interpolation=cv2.INTER_AREA)
        assert np.abs(np.diff(g, axis=1)).max() > 0.05


# ------------------------------------------- the fast paths, bit for bit (render cost)
def test_dead_leaves_draw_the_discs_int_and_round_give_one_by_one():
    p = _profile()["surface_textures"]["families"]["dead_leaves"]
    for seed in range(20):
        got = dead_leaves(np.random.default_rng(seed), 128, p)
        # The draws of dead_leaves replayed, each disc placed with Python's int() and round().
        rng = np.random.default_rng(seed)
        n = int(round(draw_range(rng, p["count"])))
        r0, r1 = (float(v) * 128 for v in p["radius"])
        u = rng.random(n)
        radii = (max(r0, 0.5) ** -2 - u * (max(r0, 0.5) ** -2 - r1**-2)) ** -0.5
        centres, levels = rng.random((n, 2)) * 128, rng.random(n)
        want = np.full((128, 128), float(rng.random()), np.float32)
        for (x, y), r, level in zip(centres, radii, levels):
            cv2.circle(want, (int(x), int(y)), max(int(round(r)), 1), float(level), -1, cv2.LINE_AA)
        np.testing.assert_array_equal(got, want)


def test_draw_ranges_are_successive_draw_range():
    for value in ([0.2, 0.9], [0.5, 0.5], 0.3):
        a, b = np.random.default_rng(3), np.random.default_rng(3)
        np.testing.assert_array_equal(draw_ranges(a, value, 50), [draw_range(b, value) for _ in range(50)])
        assert a.random() == b.random()  # the generators advanced alike
    with pytest.raises(ValueError, match="lo <= hi"):
        draw_ranges(np.random.default_rng(0), [1.0, 0.0], 3)


def test_unit_gradient_is_numpys_gradient():
    a = np.random.default_rng(0).standard_normal((3, 17, 23)).astype(np.float32)
    for axis in (1, 2):
        got = _unit_gradient(a, axis)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.gradient(a, axis=axis))


@pytest.mark.parametrize("n", [128, 64, 32, 4])
def test_wrap_is_numpys_remainder_for_a_power_of_two(n):
    a = (np.random.default_rng(n).standard_normal(20000) * 700).astype(np.float32)
    a[:6] = [-0.0, -n, -1e-6, -(2.0**-30), n, 3 * n]  # signed zero, multiples, and what rounds up to n
    got = _wrap(a, n)
    np.testing.assert_array_equal(got, np.remainder(a, np.float32(n)))
    assert not np.signbit(got).any() and got.max() <= n


def test_ray_grid_maps_interpolate_as_the_float_maps_do():
    """The fixed-point maps made once per frame size look up what the float maps would."""
    h, w = 61, 83
    px, shape, map_xy, map_frac = _ray_grid(h, w)
    grid = np.random.default_rng(1).random((*shape, 2)).astype(np.float32)
    gu, gv = np.unique(px[:, 0]), np.unique(px[:, 1])
    mu, mv = np.meshgrid(np.interp(np.arange(w), gu, np.arange(len(gu))).astype(np.float32),
                         np.interp(np.arange(h), gv, np.arange(len(gv))).astype(np.float32))
    want = cv2.remap(grid, mu, mv, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    got = cv2.remap(grid, map_xy, map_frac, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    np.testing.assert_array_equal(got, want)
    assert _ray_grid(h, w)[2] is map_xy and not map_xy.flags.writeable  # made once, shared read-only


def test_held_out_family_is_never_drawn():
    cfg = _profile()["surface_textures"]
    cfg["table"]["prob"] = 1.0
    drawn = {sample_surface_textures(_rng(s), cfg, 0)["table"]["family"] for s in range(300)}
    assert drawn == set(cfg["families"])
    cfg["held_out"] = ["cells"]
    held = {sample_surface_textures(_rng(s), cfg, 0)["table"]["family"] for s in range(300)}
    assert held == set(cfg["families"]) - {"cells"}


def test_bad_surface_texture_settings_are_refused():
    cfg = _profile()
    cfg["surface_textures"]["families"]["marble"] = {}
    cfg["surface_textures"]["tile"] = [0.5, 0.1]
    with pytest.raises(ValueError, match="marble") as err:
        validate_profile(cfg)
    assert "surface_textures.tile" in str(err.value)
    cfg = _profile()
    cfg["surface_textures"]["held_out"] = list(cfg["surface_textures"]["families"])
    with pytest.raises(ValueError, match="held out"):
        validate_profile(cfg)


# ------------------------------------------------------------- on a render
def test_surface_coordinates_are_base_coordinates_on_the_table(calib):
    """On a flat table the tri-planar coordinates are the base (x, y) the pixel sees."""
    cam = calib.scaled((160, 120))
    vv, uu = np.mgrid[0:120, 0:160]
    from perception.core.geometry import raw_pixel_to_base

    pts = raw_pixel_to_base(np.stack([uu.ravel(), vv.ravel()], axis=1), cam, calib.table_z).reshape(120, 160, 3)
    depth = ((pts - cam.T_base_camera[:3, 3]) @ cam.T_base_camera[:3, :3])[..., 2].astype(np.float32)
    coords, footprint = surface_coordinates(depth, cam)
    np.testing.assert_allclose(coords[5:-5, 5:-5], pts[5:-5, 5:-5, :2], atol=1e-3)  # < a pixel footprint
    assert 0.0005 < float(np.median(footprint)) < 0.02  # metres a pixel spans on the table


def test_surface_coordinates_are_the_cross_product_formula_bit_for_bit(calib):
    """The plane-by-plane arithmetic gives what np.gradient, np.cross and argmax give on (H, W, 3)."""
    cam = calib.scaled((160, 120))
    rng = np.random.default_rng(4)
    # A table at 0.8-1.2 m with steps and boxes in it: every face direction and its ties.
    depth = (1.0 + 0.2 * cv2.resize(rng.random((6, 8)), (160, 120), interpolation=cv2.INTER_NEAREST)).astype(np.float32)
    depth += (0.01 * rng.standard_normal((120, 160))).astype(np.float32) * (rng.random((120, 160)) < 0.3)
    coords, footprint = surface_coordinates(depth, cam)
    px, shape, _, _ = _ray_grid(120, 160)
    from perception.core.geometry import raw_pixels_to_rays

    gu, gv = np.unique(px[:, 0]), np.unique(px[:, 1])
    mu, mv = np.meshgrid(np.interp(np.arange(160), gu, np.arange(len(gu))).astype(np.float32),
                         np.interp(np.arange(120), gv, np.arange(len(gv))).astype(np.float32))
    grid = raw_pixels_to_rays(px, cam)[:, :2].reshape(*shape, 2).astype(np.float32)
    xy = cv2.remap(grid, mu, mv, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    T = cam.T_base_camera.astype(np.float32)
    pts = np.concatenate([xy * depth[..., None], depth[..., None]], axis=2) @ T[:3, :3].T + T[:3, 3]
    du, dv = np.gradient(pts, axis=1), np.gradient(pts, axis=0)
    axis = np.argmax(np.abs(np.cross(du, dv)), axis=2)
    assert len(np.unique(axis)) == 3  # the scene has faces along x, along y and up
    x, y, z = pts[..., 0], pts[..., 1], pts[..., 2]
    np.testing.assert_array_equal(coords, np.stack([np.where(axis == 0, y, x), np.where(axis == 2, y, z)], axis=2))
    np.testing.assert_array_equal(
        footprint, np.sqrt(np.linalg.norm(du, axis=2) * np.linalg.norm(dv, axis=2)).astype(np.float32))


def _high_freq(img: np.ndarray, mask: np.ndarray) -> float:
    grey = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).astype(np.float32)
    lap = cv2.Laplacian(grey, cv2.CV_32F)
    inner = cv2.erode(mask.astype(np.uint8), np.ones((5, 5), np.uint8)) > 0
    return float(np.abs(lap[inner]).mean())


def _clean_profile() -> dict:
    """The randomized profile at test scale, with no sensor effect and no PyBullet table texture."""
    cfg = _profile()
    cfg.update(resolution_scale=TEST_SCALE)
    cfg["sensor"].update(blur_prob=0.0, jpeg_prob=0.0, read_noise=[0.0, 0.0], shot_noise=[0.0, 0.0],
                         bayer_prob=0.0, sharpen=[0.0, 0.0])
    cfg["textures"]["table"]["prob"] = 0.0
    return cfg


def test_textured_table_carries_high_frequencies_and_replays(scene, calib):
    client, bodies = scene
    base = _clean_profile()
    on, off = json.loads(json.dumps(base)), json.loads(json.dumps(base))
    on["surface_textures"]["table"]["prob"] = 1.0
    off["surface_textures"]["table"]["prob"] = 0.0
    hf_on, hf_off = [], []
    for s in range(4):
        a = render_randomized(client, bodies, calib, _rng(s), on)
        b = render_randomized(client, bodies, calib, _rng(s), off)
        table = a.seg_raw == bodies.table
        hf_on.append(_high_freq(a.rgb, table))
        hf_off.append(_high_freq(b.rgb, b.seg_raw == bodies.table))
        assert a.params["surface_textures"]["table"] is not None
        assert b.params["surface_textures"]["table"] is None
        again = render_randomized(client, bodies, calib, _rng(s), on)
        np.testing.assert_array_equal(again.rgb, a.rgb)
    assert np.median(hf_on) > 2.0 * np.median(hf_off)


def test_bin_floor_has_its_own_look_and_the_table_keeps_its_colour(scene, calib):
    client, bodies = scene
    cfg = _clean_profile()
    cfg["lighting"]["shadow_prob"] = 0.0
    st = cfg["surface_textures"]
    st["table"]["prob"], st["floor"]["prob"] = 0.0, 1.0
    frame = render_randomized(client, bodies, calib, _rng(2), cfg)
    drawn = frame.params["surface_textures"]
    assert drawn["floor"] is not None and drawn["table"] is None
    from perception.core.geometry import raw_pixel_to_base

    h, w = frame.seg_raw.shape
    vv, uu = np.mgrid[0:h, 0:w]
    xy = raw_pixel_to_base(np.stack([uu.ravel(), vv.ravel()], 1), frame.camera, calib.table_z)[:, :2].reshape(h, w, 2)
    (x0, x1), (y0, y1) = calib.workspace_x, calib.workspace_y
    inside = (xy[..., 0] > x0 + 0.02) & (xy[..., 0] < x1 - 0.02) & (xy[..., 1] > y0 + 0.02) & (xy[..., 1] < y1 - 0.02)
    table = frame.seg_raw == bodies.table
    assert _high_freq(frame.rgb, table & inside) > 2.0 * _high_freq(frame.rgb, table & ~inside)
    # Outside the bin the table shows its drawn colour, not the grey it was rendered in.
    grey = render_randomized(client, bodies, calib, _rng(2), {**cfg, "surface_textures": {**st, "floor": {"prob": 0.0}}})
    out_new = frame.rgb[table & ~inside].mean(axis=0)
    assert np.abs(out_new - grey.rgb[grey.seg_raw == bodies.table].mean(axis=0)).max() < 25


def test_profile_without_surface_textures_renders_as_before(scene, calib):
    """The other profiles have no section: their frames do not draw or change."""
    client, bodies = scene
    cfg = _profile("target")
    cfg.update(resolution_scale=TEST_SCALE)
    frame = render_randomized(client, bodies, calib, _rng(0), cfg)
    assert "surface_textures" not in frame.params


# ------------------------------------------------------------------ sensor
def _sensor_off(**kw) -> dict:
    q = {"white_balance": [1.0, 1.0, 1.0], "gamma": 1.0, "contrast": 0.0, "saturation": 1.0, "vignetting": 0.0,
         "blur": False, "defocus_sigma": 0.0, "motion_length": 0.0, "motion_angle": 0.0, "read_noise": 0.0,
         "shot_noise": 0.0, "noise_seed": 0, "jpeg": False, "jpeg_quality": 90, "bayer": False, "demosaic": 0,
         "sharpen": 0.0, "sharpen_sigma": 1.0}
    q.update(kw)
    return q


@pytest.mark.parametrize("method", [0, 1, 2])
def test_bayer_keeps_flat_colour_and_adds_false_colour_at_edges(method):
    flat = np.zeros((32, 32, 3), np.uint8)
    flat[...] = (180, 90, 40)
    out = apply_sensor_params(flat, _sensor_off(bayer=True, demosaic=method))
    np.testing.assert_allclose(out[4:-4, 4:-4].astype(int), flat[4:-4, 4:-4].astype(int), atol=2)
    stripes = np.zeros((32, 32, 3), np.uint8)
    stripes[:, 1::3] = 255  # grey stripes, no colour anywhere
    out = apply_sensor_params(stripes, _sensor_off(bayer=True, demosaic=method)).astype(int)
    chroma = np.abs(out - out.mean(axis=2, keepdims=True)).max()
    assert chroma > 20  # demosaicing invents colour at fine edges, as real sensors do


def test_sharpening_overshoots_at_edges():
    step = np.full((16, 32, 3), 60, np.uint8)
    step[:, 16:] = 160
    out = apply_sensor_params(step, _sensor_off(sharpen=1.0, sharpen_sigma=1.5)).astype(int)
    assert out[8, 16:20].max() > 165 and out[8, 12:16].min() < 55
    assert (out[8, :8] == 60).all()  # flat areas untouched


def test_sensor_params_stored_before_the_cfa_replay():
    img = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    old = {k: v for k, v in _sensor_off().items() if k not in ("bayer", "demosaic", "sharpen", "sharpen_sigma")}
    np.testing.assert_array_equal(apply_sensor_params(img, old), img)


# ------------------------------------------------------------- empty scenes
def test_empty_scenes_have_no_objects_and_leave_the_others_alone(calib):
    from sim_render.scene import SceneRenderer

    cfg = _profile()
    cfg.update(resolution_scale=0.1, frames_per_scene=1)
    cfg["grasps"].update(n_heuristic=2, n_random=2, n_perturbed=0)
    half = SceneRenderer(calib, {**cfg, "empty_scene_prob": 0.5}, seed=11)
    none = SceneRenderer(calib, {**cfg, "empty_scene_prob": 0.0}, seed=11)
    empties = [s for s in range(12) if half.is_empty(s)]
    assert 0 < len(empties) < 12
    full = next(s for s in range(12) if s not in empties)
    (rec,) = half(empties[0])
    assert rec.params["objects"] == [] and not rec.grasps.success.any()
    assert rec.grasps.success.size == 2  # the random candidates, all on the bare floor
    a, b = half(full)[0], none(full)[0]
    assert a.params["objects"] == b.params["objects"] and a.params["objects"]
    np.testing.assert_array_equal(a.rgb, b.rgb)
    half.close()
    none.close()


def test_no_sample_photographs_from_imaging_libraries():
    """The photographs bundled with scikit-image and imageio are kept for acceptance cells."""
    pattern = re.compile(r"skimage\.data|from skimage import data|imageio:|imageio\.v\d\.imread\(.imageio")
    offenders = [
        str(path.relative_to(ROOT))
        for pkg in ("sim_render", "adaptation", "policies", "perception", "conf", "benchmarks")
        for path in (ROOT / pkg).rglob("*")
        if path.suffix in (".py", ".yaml") and pattern.search(path.read_text(errors="ignore"))
    ]
    assert offenders == []


def test_bin_walls_are_drawn_per_scene_within_the_contract(calib):
    from sim_render.scene import SceneRenderer

    cfg = _profile()
    cfg.update(resolution_scale=0.1, frames_per_scene=1, bin_walls={"height": [0.03, 0.06], "thickness": [0.005, 0.03]})
    r = SceneRenderer(calib, cfg, seed=4)
    walls = [r.bin_walls(s) for s in range(20)]
    heights = [w["height"] for w in walls]
    assert all(0.03 <= h <= 0.06 for h in heights) and max(heights) - min(heights) > 0.01
    _, params = r.build_scene(3)
    assert params["bin_walls"] == walls[3]
    cell = r.world().cell
    aabb = cell.client.getAABB(cell.bodies.bin_walls[0])
    assert abs((aabb[1][2] - aabb[0][2]) - walls[3]["height"]) < 1e-3
    assert abs((aabb[1][0] - aabb[0][0]) - walls[3]["thickness"]) < 1e-3
    r.close()
    plain = SceneRenderer(calib, {k: v for k, v in cfg.items() if k != "bin_walls"}, seed=4)
    assert plain.bin_walls(3) == {"height": 0.06, "thickness": 0.01}  # the cell's defaults
    plain.close()
