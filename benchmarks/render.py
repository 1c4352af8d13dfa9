"""Render benchmarks (issue 2), measured side by side in one run, printed as ratios.

    .venv/bin/python benchmarks/render.py [--quick]

1. Frames/s at 128x128 with full randomization (camera jitter, textures, colours,
   lights, distractors, distortion, sensor effects) against raw ``getCameraImage`` of
   the same scene. 128x128 is a square camera cut from the packaged one (same focal
   length), scaled to 128 px.
1b. Milliseconds per frame at the pipeline's render size with the randomization of issue 11
   (natural-image surface textures, Bayer mosaic, sharpening, shadows and traced cast shadows
   on every frame: the shipped profile) against the profile before it, and the shipped profile
   without the traced cast shadows (their own share).
2. Two render workers against one (scenes/s of ``sim2real-render``, same data).
3. Physics-verified grasp labels per core-second, end to end (scene building
   included), against PyBullet's ``KukaDiverseObjectEnv`` episode loop (needs
   ``gym``: ``pip install -e .[bench]``); agreement of the fast labelling settings
   with a slow reference setting on the same grasps.
4. Label yield: scenes with at least one success, heuristic and random success rates.
5. Distinct geometry frames per CPU-second (issue 36): the geometry path
   (``policies/geometry_data.py``: a scene settled once, no grasps, rendered from the base's
   four camera mounts with ``frames_per_mount`` looks each, turned into the network's
   records) against the base's render (``sim2real-train-base``: 48 grasps executed, two
   frames a scene, raw frames not yet turned into records), the same scenes, one process,
   alternated scene by scene.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import packaging.version
import pybullet_data

# The repository's packages before this folder's scripts (benchmarks/adaptation.py is not the package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conf import to_plain  # noqa: E402
from perception.core.calibration import Calibration, default_calibration_path  # noqa: E402
from policies.base import camera_mounts  # noqa: E402
from sim_render.api import compose_config, render_config, render_dataset  # noqa: E402
from sim_render.camera import raw_getcamera_fps  # noqa: E402
from sim_render.labels import label_grasps  # noqa: E402
from sim_render.randomization import render_randomized  # noqa: E402
from sim_render.scene import SceneRenderer, render_size  # noqa: E402
from sim_render.sensor import as_plain  # noqa: E402


def square_camera(calib: Calibration) -> Calibration:
    """A square (height x height) cut of the camera, same focal length and centre."""
    h = calib.height
    K = calib.K.copy()
    K[0, 2] -= (calib.width - h) / 2
    return calib.replace(image_size=(h, h), K=K).scaled((128, 128))


def _settled_scene(scene: int) -> tuple[Calibration, Any, Any, Any]:
    """The packaged camera, the randomized profile, and scene ``scene`` (seed 0) dropped and
    settled: ``(calib, cfg, client, bodies)``."""
    calib = Calibration.load(default_calibration_path())
    cfg = render_config(tempfile.mkdtemp(), 1).render
    sr = SceneRenderer(calib, cfg, seed=0)
    sr.build_scene(scene)
    st = sr.world()
    return calib, cfg, st.cell.client, st.cell.bodies


def bench_frames(n: int) -> dict:
    calib, cfg, client, bodies = _settled_scene(0)
    cam = square_camera(calib)
    plain = dict(as_plain(cfg))
    plain["resolution_scale"] = 1.0
    sq = cam.replace(image_size=(128, 128))
    rng = np.random.default_rng(0)
    # Interleave the two measurements in rounds so machine noise hits both alike.
    raw_t, full_t = 0.0, 0.0
    for _ in range(5):
        raw_t += n / raw_getcamera_fps(client, cam, n=n)
        t0 = time.perf_counter()
        for _ in range(n):
            render_randomized(client, bodies, sq, rng, plain)
        full_t += time.perf_counter() - t0
    raw_fps, full_fps = 5 * n / raw_t, 5 * n / full_t
    return {"raw_fps": raw_fps, "randomized_fps": full_fps, "ratio": full_fps / raw_fps}


# `lighting.shadow_prob` of the randomized profile before issue 11 (shadows cost render time).
_SHADOW_PROB_BEFORE = 0.3


def _without_new_randomization(plain: dict) -> dict:
    """The profile as it was before issue 11: no natural-image textures, no CFA/ISP stages,
    shadows on 30% of the frames, no traced cast shadows (the bin walls' geometry costs no render time)."""
    off = {k: v for k, v in plain.items() if k != "surface_textures"}
    off["sensor"] = {**plain["sensor"], "bayer_prob": 0.0, "sharpen": [0.0, 0.0]}
    off["lighting"] = {**_without_cast_shadows(plain)["lighting"], "shadow_prob": _SHADOW_PROB_BEFORE}
    return off


def _without_cast_shadows(plain: dict) -> dict:
    """The profile with ``lighting.cast_shadow`` off (sim_render/shadows.py draws nothing)."""
    light = plain["lighting"]
    return {**plain, "lighting": {**light, "cast_shadow": {**light["cast_shadow"], "prob": 0.0}}}


def bench_new_randomization(n: int, rounds: int = 10) -> dict:
    """Per-frame cost of the shipped randomization against the profile before issue 11 and
    against itself without traced cast shadows, at the pipeline's render size, interleaved in
    rounds of the same ``n`` seeded frames; the ratios are medians over the rounds (a burst of
    load on a shared machine then moves one round, not the answer)."""
    calib, cfg, client, bodies = _settled_scene(1)
    on = dict(as_plain(cfg))
    off = _without_new_randomization(on)
    no_cast = _without_cast_shadows(on)
    times: dict[str, list[float]] = {"off": [], "on": [], "no_cast": []}
    for _ in range(rounds):
        for name, plain in (("off", off), ("on", on), ("no_cast", no_cast)):
            t0 = time.perf_counter()
            for i in range(n):  # frame i draws from seed i in every round and profile: the same frames each time
                render_randomized(client, bodies, calib, np.random.default_rng(i), plain)
            times[name].append(1000 * (time.perf_counter() - t0) / n)
    ms = {k: float(np.median(v)) for k, v in times.items()}
    ratio = lambda k: float(np.median(np.asarray(times[k]) / np.asarray(times["off"])))  # noqa: E731
    return {"frame_ms_off": ms["off"], "frame_ms_on": ms["on"], "ratio": ratio("on"),
            "frame_ms_without_cast_shadows": ms["no_cast"], "ratio_without_cast_shadows": ratio("no_cast"),
            "rounds": rounds, "frames_per_round": n, "render_size": list(render_size(calib, float(cfg.resolution_scale)))}


def bench_workers(n_scenes: int) -> dict:
    over = ["render.resolution_scale=0.2", "render.frames_per_scene=1", "scenes_per_shard=2"]
    times = {}
    manifests = {}
    for workers in (1, 2, 1, 2):
        d = Path(tempfile.mkdtemp())
        t0 = time.perf_counter()
        render_dataset(d, n_scenes, seed=3, overrides=over, workers=workers)
        times.setdefault(workers, []).append(time.perf_counter() - t0)
        manifests[workers] = (d / "manifest.json").read_text()
        shutil.rmtree(d)
    t1, t2 = min(times[1]), min(times[2])
    return {"one_worker_s": t1, "two_workers_s": t2, "speedup": t1 / t2,
            "identical_manifests": manifests[1] == manifests[2]}


def kuka_episodes_per_s(seconds: float) -> float | None:
    """PyBullet's own grasping env loop (random actions), episodes per second."""
    if importlib.util.find_spec("gym") is None:
        return None

    # pybullet_envs registers old gym ids and imports pkg_resources in its __init__:
    # load its modules without running that __init__.
    sys.modules.setdefault("pkg_resources", types.SimpleNamespace(parse_version=packaging.version.parse))
    spec = importlib.util.find_spec("pybullet_envs")
    pkg = types.ModuleType("pybullet_envs")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["pybullet_envs"] = pkg
    from pybullet_envs.bullet.kuka_diverse_object_gym_env import KukaDiverseObjectEnv  # lazy: optional (gym)

    env = KukaDiverseObjectEnv(renders=False, isDiscrete=False, maxSteps=8, urdfRoot=pybullet_data.getDataPath())
    env.reset()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        env.reset()
        done = False
        while not done:
            _, _, done, _ = env.step(env.action_space.sample())
        n += 1
    return n / (time.perf_counter() - t0)


def bench_labels(n_scenes: int) -> dict:
    """Labels per core-second with the profile's fast settings, scene building included."""
    calib = Calibration.load(default_calibration_path())
    cfg = render_config(tempfile.mkdtemp(), 1).render
    sr = SceneRenderer(calib, cfg, seed=100)
    n_labels, n_ok, scenes_ok = 0, 0, 0
    heur, rand = [], []
    t_cpu0, t0 = time.process_time(), time.perf_counter()
    for s in range(n_scenes):
        rngs, params = sr.build_scene(s)
        labels = sr.label_scene(rngs, params["physics"])
        n_labels += len(labels)
        ok = [lg.success for lg in labels]
        n_ok += sum(ok)
        scenes_ok += any(ok)
        heur += [lg.success for lg in labels if lg.source == 0]
        rand += [lg.success for lg in labels if lg.source == 1]
    cpu, wall = time.process_time() - t_cpu0, time.perf_counter() - t0
    return {
        "scenes": n_scenes, "labels": n_labels, "labels_per_core_s": n_labels / cpu, "labels_per_wall_s": n_labels / wall,
        "yield_scenes_with_success": scenes_ok / n_scenes, "heuristic_success": float(np.mean(heur)) if heur else None,
        "heuristic_candidates_per_scene": len(heur) / n_scenes, "random_success": float(np.mean(rand)) if rand else None,
    }


def bench_agreement(n_scenes: int) -> dict:
    """Fast labelling settings against a slow reference on the very same grasps."""
    calib = Calibration.load(default_calibration_path())
    fast_cfg = render_config(tempfile.mkdtemp(), 1).render
    slow_cfg = render_config(tempfile.mkdtemp(), 1, overrides=[
        "render.physics.timestep=0.0041666667", "render.physics.solver_iterations=50",
        "render.grasps.descend_steps=96", "render.grasps.close_steps=96", "render.grasps.lift_steps=120",
        "render.grasps.hold_steps=240"]).render
    agree, total, fast_ok, slow_ok = 0, 0, 0, 0
    for s in range(n_scenes):
        results = []
        for cfg in (fast_cfg, slow_cfg):
            sr = SceneRenderer(calib, cfg, seed=200)
            rngs, params = sr.build_scene(s)
            if not results:
                labels = sr.label_scene(rngs, params["physics"])
                cands = labels
            st = sr.world()
            out = label_grasps(st.cell, st.hand, [type("C", (), {"grasp": lg.grasp, "source": lg.source})()
                                                        for lg in cands], float(params["physics"]["gripper_force"]),
                               st.timing)
            results.append([lg.success for lg in out])
            sr.close()
        f, sl = np.array(results[0]), np.array(results[1])
        agree += int(np.sum(f == sl))
        total += len(f)
        fast_ok += int(f.sum())
        slow_ok += int(sl.sum())
    return {"grasps": total, "agreement": agree / max(total, 1), "fast_success": fast_ok / max(total, 1),
            "slow_success": slow_ok / max(total, 1)}


def bench_geometry_frames(n_scenes: int, frames_per_mount: int) -> dict:
    from policies.geometry_data import GeometrySceneMaker  # lazy: torch via geometry_data

    base = compose_config("base")
    calib = Calibration.load(default_calibration_path())
    over = list(base.randomization.overrides)
    labelled_cfg = render_config(tempfile.mkdtemp(), 1, overrides=[*over, f"render.frames_per_scene={int(base.frames_per_scene)}"]).render
    mounts = camera_mounts(calib, base.cameras)
    labelled = SceneRenderer(calib, labelled_cfg, seed=0)
    geometry = GeometrySceneMaker(calib, mounts, to_plain(labelled_cfg), to_plain(base.geometry), frames_per_mount, seed=0)
    labelled(n_scenes)  # warm-up: the worlds, texture pools and meshes
    geometry(n_scenes)
    t = {"labelled": 0.0, "geometry": 0.0}
    frames = {"labelled": 0, "geometry": 0}
    for scene in range(n_scenes):
        t0 = time.perf_counter()
        frames["labelled"] += len(labelled(scene))
        t1 = time.perf_counter()
        frames["geometry"] += len(geometry(scene)["scene"])
        t["labelled"] += t1 - t0
        t["geometry"] += time.perf_counter() - t1
    rate = {k: frames[k] / t[k] for k in t}
    return {"scenes": n_scenes, "frames_per_mount": frames_per_mount, "mounts": len(mounts),
            "labelled_frames_per_s": rate["labelled"], "geometry_frames_per_s": rate["geometry"],
            "labelled_s_per_scene": t["labelled"] / n_scenes, "geometry_s_per_scene": t["geometry"] / n_scenes,
            "ratio": rate["geometry"] / rate["labelled"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--only-randomization", action="store_true", help="run 1b alone (the per-frame cost)")
    ap.add_argument("--only-geometry", action="store_true", help="run 5 alone (geometry frames per CPU-second)")
    ap.add_argument("--frames-per-mount", type=int, default=2, help="5: looks of each settled scene from each mount")
    args = ap.parse_args()
    q = args.quick
    res: dict = {}
    if args.only_geometry:
        res["geometry_frames"] = bench_geometry_frames(3 if q else 12, args.frames_per_mount)
        print("5. geometry frames per CPU-second vs the base's labelled render:", json.dumps(res["geometry_frames"]))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return
    if not args.only_randomization:
        res["frames_128"] = bench_frames(10 if q else 40)
        print("1. frames/s at 128x128:", json.dumps(res["frames_128"]))
    res["new_randomization"] = bench_new_randomization(4 if q else 20, rounds=3 if q else 7)
    print("1b. the shipped randomization (natural textures, CFA/ISP, traced cast shadows) vs before issue 11:", json.dumps(res["new_randomization"]))
    if args.only_randomization:
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return
    res["workers"] = bench_workers(4 if q else 24)
    print("2. two workers vs one:", json.dumps(res["workers"]))
    labels = bench_labels(3 if q else 12)
    kuka = kuka_episodes_per_s(5 if q else 30)
    labels["kuka_episodes_per_s"] = kuka
    labels["ratio_vs_kuka"] = None if kuka is None else labels["labels_per_core_s"] / kuka
    res["labels"] = labels
    print("3./4. labels:", json.dumps(labels))
    res["agreement"] = bench_agreement(2 if q else 6)
    print("3. fast vs slow reference:", json.dumps(res["agreement"]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
