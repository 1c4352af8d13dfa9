"""The fixed camera's empty bin (perception/core/background.py) and what the decode and the
artifact do with it."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import cv2
import numpy as np
import pytest

from perception.core.artifact import ArtifactError, file_sha256, load_metadata, write_metadata
from perception.core.background import (
    MIN_FRAMES,
    BackgroundError,
    BackgroundModel,
    changed_patch_px,
    fit_background,
)
from perception.core.decode import DecodeOptions, decode_grasp, parts_region
from perception.core.geometry import base_to_view_pixels, table_view

A = 12
SIZE = 96


def _floor(rng: np.random.Generator) -> np.ndarray:
    """A wood-like floor: smooth coloured stripes with grain, float RGB in [0, 255]."""
    v, u = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    grain = np.sin(u / 5.0 + 2.0 * np.sin(v / 11.0)) + 0.3 * rng.standard_normal((SIZE, SIZE)).astype(np.float32)
    grain = cv2.GaussianBlur(grain, (5, 5), 0)
    base = np.array([170.0, 110.0, 70.0], np.float32)
    return np.clip(base * (1.0 + 0.25 * grain[..., None]), 0, 255)


def _lit(floor: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The floor under another light: a tinted lamp, a hard shadow across a random line
    (60% of the light gone) and sensor noise."""
    v, u = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    a = rng.uniform(0, math.pi)
    side = (np.cos(a) * (u - SIZE / 2) + np.sin(a) * (v - SIZE / 2)) > rng.uniform(-30, 30)
    shade = np.where(side, 1.0, 0.4).astype(np.float32)
    tint = rng.uniform(0.9, 1.1, 3).astype(np.float32)
    x = floor * shade[..., None] * tint + rng.normal(0, 2.0, floor.shape).astype(np.float32)
    return np.clip(x, 0, 255).astype(np.uint8)


def _with_part(frame: np.ndarray, v: int, u: int, h: int, w: int, colour=(40, 160, 60)) -> np.ndarray:
    out = frame.copy()
    out[v:v + h, u:u + w] = colour
    return out


@pytest.fixture(scope="module")
def scene():
    rng = np.random.default_rng(0)
    floor = _floor(rng)
    region = np.zeros((SIZE, SIZE), bool)
    region[10:86, 10:86] = True
    # The user's frames: parts somewhere in most of them, the light different in each.
    frames = []
    for i in range(40):
        f = _lit(floor, rng)
        if i % 4:
            f = _with_part(f, *rng.integers(12, 70, 2), 12, 8, colour=tuple(int(c) for c in rng.integers(0, 255, 3)))
        frames.append(f)
    model, info = fit_background(frames, region, threshold=0.04, min_part_px=20)
    return floor, region, model, info, rng


def test_an_empty_bin_under_another_light_is_unchanged_and_a_part_is_not(scene):
    """The median of frames with parts in them is the empty floor; a new shadow and tint
    change nothing that counts, a part of 6 x 6 cells does, a part outside the region does
    not, and a part in a dimmer frame still does."""
    floor, region, model, info, rng = scene
    assert info["frames"] == 40 and 0 < info["noise"] < model.threshold
    assert info["shown"] == pytest.approx(30 / 40)  # the frames with a part, and only they
    chroma = lambda x: x / (x.sum(axis=-1, keepdims=True) + 3.0)  # noqa: E731
    # The floor's colour everywhere, the parts gone (brightness: the median light's).
    assert np.abs(chroma(model.image.astype(float)) - chroma(floor))[region].max() < 0.02
    for _ in range(10):
        empty = _lit(floor, rng)
        assert model.unchanged(empty, region), changed_patch_px(empty, model, region)
    part = _with_part(_lit(floor, rng), 40, 40, 6, 6)
    assert changed_patch_px(part, model, region) >= 30 and not model.unchanged(part, region)
    outside = _with_part(_lit(floor, rng), 0, 0, 8, 8)  # outside the region: not looked at
    assert model.unchanged(outside, region)
    dim = _with_part((_lit(floor, rng) * 0.5).astype(np.uint8), 40, 40, 6, 6, colour=(20, 80, 30))
    assert not model.unchanged(dim, region)  # a part in the dark, as long as it has a colour


def test_a_background_needs_enough_frames_of_one_size(scene):
    floor, region, _, _, rng = scene
    frames = [_lit(floor, rng) for _ in range(MIN_FRAMES - 1)]
    with pytest.raises(BackgroundError, match=f"at least {MIN_FRAMES} frames"):
        fit_background(frames, region, 0.04, 20)
    with pytest.raises(BackgroundError, match="one size"):
        fit_background(frames + [np.zeros((50, 50, 3), np.uint8)], region, 0.04, 20)
    with pytest.raises(BackgroundError, match="differ in size"):
        changed_patch_px(np.zeros((50, 50, 3), np.uint8), scene[2], region)
    with pytest.raises(BackgroundError, match="min_part_px"):
        BackgroundModel(image=scene[2].image, threshold=0.03, min_part_px=0)


def _bar_surface(calib, view, x: float, y: float) -> np.ndarray:
    """A predicted surface with a 2 x 8 cm bar standing 3 cm at (x, y)."""
    s = np.zeros((view.size[1], view.size[0]), np.float32)
    corners = np.array([[x - 0.04, y - 0.01, 0], [x + 0.04, y + 0.01, 0]], np.float64)
    uv = base_to_view_pixels(corners, calib, view)
    (u0, u1), (v0, v1) = sorted(uv[:, 0].round().astype(int)), sorted(uv[:, 1].round().astype(int))
    s[v0:v1 + 1, u0:u1 + 1] = 0.03
    return s


def test_answer_on_parts_withholds_its_guess_from_a_frame_that_shows_nothing_new(calib, scene):
    """Quality under the threshold everywhere and a part predicted by the geometry (a look the
    network was not trained on): with the camera's background, the empty bin's frame is
    answered null with the bin looking empty; the same maps with a part in the frame are
    answered; without a background, or above the threshold, nothing changes, unless the
    background's gate is ``always``."""
    view = table_view(calib, (SIZE, SIZE))
    floor, _, _, _, rng = scene
    region = parts_region(calib, view)
    model, _ = fit_background([_lit(floor, rng) for _ in range(MIN_FRAMES)], region, 0.04, min_part_px=20)
    q = np.full((A, SIZE, SIZE), 0.05, np.float32)
    w = np.full((SIZE, SIZE), 0.02, np.float32)
    h = np.full((SIZE, SIZE), 0.02, np.float32)
    bar = _bar_surface(calib, view, 0.5, 0.02)
    opts = DecodeOptions(0.3, on_part_px=1, answer_on_parts=True)
    empty_frame = _lit(floor, rng)
    dec = decode_grasp(q, w, h, calib, view, opts, surface=bar, view_rgb=empty_frame, background=model)
    assert dec.grasp is None and dec.empty and "camera's empty bin" in dec.reason
    vv, uu = np.nonzero(region)
    v, u = int(np.median(vv)), int(np.median(uu))
    part_frame = _with_part(empty_frame, v - 4, u - 4, 8, 8)
    dec = decode_grasp(q, w, h, calib, view, opts, surface=bar, view_rgb=part_frame, background=model)
    assert dec.grasp is not None and dec.grasp.quality == pytest.approx(0.05)
    assert decode_grasp(q, w, h, calib, view, opts, surface=bar, view_rgb=empty_frame).grasp is not None
    sure = np.full_like(q, 0.9)  # above the threshold: the background is not asked ...
    assert decode_grasp(sure, w, h, calib, view, opts, surface=bar, view_rgb=empty_frame, background=model).grasp is not None
    always = dataclasses.replace(model, gate="always")  # ... unless it gates every answer
    dec = decode_grasp(sure, w, h, calib, view, opts, surface=bar, view_rgb=empty_frame, background=always)
    assert dec.grasp is None and dec.empty
    assert decode_grasp(sure, w, h, calib, view, opts, surface=bar, view_rgb=part_frame, background=always).grasp is not None
    with pytest.raises(BackgroundError, match="gate must be one of"):
        dataclasses.replace(model, gate="never")


def test_the_artifact_carries_the_background_checked(tmp_path, artifact_dir, scene):
    """``background`` in ``metadata.json``: read into the runner's model; a changed image, an
    image of another size or an entry without its hash is refused with the field named."""
    _, region, model, _, _ = scene
    art = tmp_path / "a"
    shutil.copytree(artifact_dir, art)
    meta = json.loads((art / "metadata.json").read_text())
    W, H = meta["view"]["size"]
    image = cv2.resize(model.image, (W, H), interpolation=cv2.INTER_AREA)
    cv2.imwrite(str(art / "background.png"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    entry = {"image": "background.png", "image_sha256": file_sha256(art / "background.png"), "threshold": 0.03,
             "min_part_px": 20, "source": "test"}
    write_metadata(art, {**meta, "background": entry})
    got = load_metadata(art).background
    assert got is not None and np.array_equal(got.image, image) and got.threshold == 0.03 and got.min_part_px == 20
    assert load_metadata(artifact_dir).background is None  # absent: no test
    for change, match in (({"image_sha256": None}, "background.image_sha256' is missing"),
                          ({"image": "../x.png"}, "plain \\*.png"),
                          ({"threshold": 2.0}, "threshold in \\(0, 1\\)")):
        with pytest.raises(ArtifactError, match=match):
            write_metadata(art, {**meta, "background": {**entry, **change}})
    cv2.imwrite(str(art / "background.png"), np.zeros((H + 1, W, 3), np.uint8))
    with pytest.raises(ArtifactError, match="background.image_sha256"):
        load_metadata(art)
    entry["image_sha256"] = file_sha256(art / "background.png")
    with pytest.raises(ArtifactError, match="not the policy view's"):
        write_metadata(art, {**meta, "background": entry})
