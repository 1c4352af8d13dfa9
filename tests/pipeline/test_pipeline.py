"""The whole mission at budget=tiny, run once by the contract's command line (a real
subprocess), and the tests that reuse its output: the report, the artifact (onnxruntime
against torch), the service answering from it, sim2real-eval on it, stage reuse, and the
task-consistency option on top of the same stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BIN = Path(sys.executable).parent


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout, env=env)
    if res.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n"
                    f"--- stderr\n{res.stderr[-6000:]}")
    return res


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    """``sim2real-pipeline calibration=FILE real_dir=DIR output_dir=DIR budget=tiny seed=N``,
    exactly as the contract writes it, on a few stand-in real frames."""
    from perception.core.calibration import default_calibration_path
    from sim_render.api import export_real_frames, render_dataset

    root = tmp_path_factory.mktemp("pipeline")
    render_dataset(root / "target", n_scenes=24, profile="target", seed=3,  # 24: a background needs 20
                   overrides=["render.grasps.n_heuristic=0", "render.grasps.n_random=0",
                              "render.resolution_scale=1.0"])
    export_real_frames(root / "target", root / "real")
    out = root / "out"
    t0 = time.perf_counter()
    res = _run("sim2real-pipeline", f"calibration={default_calibration_path()}", f"real_dir={root / 'real'}",
               f"output_dir={out}", "budget=tiny", "seed=0")
    return {"out": out, "real": root / "real", "wall_s": time.perf_counter() - t0, "stdout": res.stdout,
            "report": json.loads((out / "report.json").read_text())}


@pytest.mark.slow  # the budget=tiny pipeline they share takes 2.5 minutes: the fast tier must stay under 10 minutes
def test_pipeline_writes_the_report_and_artifact(tiny_run):
    out, rep = tiny_run["out"], tiny_run["report"]
    assert rep["budget"] == "tiny" and rep["adaptation"] == "cyclegan" and rep["real_dir"] == str(tiny_run["real"])
    assert set(rep["stages"]) >= {"render", "adapt", "policy", "int8", "eval"}
    assert "real" not in rep["stages"]  # a real_dir was given: no stand-in frames rendered
    assert all(s["wall_s"] >= 0 and not s["reused"] for s in rep["stages"].values())
    ev = rep["evaluation"]
    assert set(ev["brackets"]) >= {"oracle", "random"}
    for name in ("randomized", "canonical", "target", "target_b"):
        r = ev["policy"][name]
        assert 0 <= r["successes"] <= r["attempts"]
        lo, hi = r["rate_ci95"]
        assert 0.0 <= lo <= hi <= 1.0
    for f in ("report.md", "report_success.png", "report_panels.png", "artifact/policy.onnx",
              "artifact/metadata.json"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    # The served artifact has int8 copies of both graphs, their ranges from the real frames,
    # and a runner on the CPU runs them; the policy stage's own artifact stays float.
    meta = json.loads((out / "artifact" / "metadata.json").read_text())
    assert meta["int8"]["frames"] >= 1 and meta["geometry"]["int8"]["onnx"] == "geometry.int8.onnx"
    assert rep["int8"]["entry"]["onnx_sha256"] == meta["int8"]["onnx_sha256"]
    assert "int8" not in json.loads((Path(rep["policy"]["artifact"]) / "metadata.json").read_text())
    # The camera's empty bin, from the 24 real frames (the decode answers on parts by default).
    assert "background" in rep["stages"] and meta["background"]["frames"] == 24
    assert (out / "artifact" / meta["background"]["image"]).is_file()
    from perception.core.artifact import PolicyRunner

    assert PolicyRunner(out / "artifact", providers=["CPUExecutionProvider"]).precision == "int8"
    md = (out / "report.md").read_text()
    assert "randomized" in md and "oracle" in md
    # The plain statement comes right under the title; the translation's scores are in.
    first = md.split("\n")[2]
    assert first.startswith("> ") and any(w in first for w in ("lifted an object", "Nothing was grasped",
                                                               "No grasp succeeded")), first
    assert "## Adaptation" in md and "| raw sim frames to real |" in md and "| object IoU |" in md


@pytest.mark.slow  # the budget=tiny pipeline they share takes 2.5 minutes: the fast tier must stay under 10 minutes
def test_artifact_runs_without_torch_and_matches_torch(tiny_run):
    """The artifact loads in a process where importing torch fails, and onnxruntime agrees
    with the stage's torch checkpoint within 1e-4 on real frames."""
    out = tiny_run["out"]
    code = ("import sys; sys.modules['torch'] = None\n"
            "from perception.core.artifact import PolicyRunner\n"
            "from perception.core.testing import make_test_frame\n"
            f"r = PolicyRunner({str(out / 'artifact')!r})\n"
            "m = r.infer(make_test_frame(r.calib))\n"
            "print(m.quality.shape, r.meta.view.kind, r.meta.decode)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "table" in res.stdout and "neighbourhood_px" in res.stdout

    from policies.export import onnx_torch_max_diff
    from policies.module import GraspPolicyModule

    ckpt = Path(tiny_run["report"]["policy"]["checkpoint"])
    module = GraspPolicyModule.load_from_checkpoint(ckpt, map_location="cpu")
    flip = bool(module.hparams["config"]["policy"].get("flip_average", False))
    from perception.core.artifact import PolicyRunner
    from perception.core.testing import make_test_frame

    runner = PolicyRunner(out / "artifact")
    x = runner.to_input(runner.preprocess(make_test_frame(runner.calib)))
    assert onnx_torch_max_diff(module.net, out / "artifact" / "policy.onnx", x, flip) < 1e-4


@pytest.mark.slow  # the budget=tiny pipeline they share takes 2.5 minutes: the fast tier must stay under 10 minutes
def test_service_answers_from_the_pipeline_artifact(tiny_run):
    """sim2real-serve on loopback with the contract's command line answers a frame."""
    import httpx

    from perception.core.calibration import Calibration, default_calibration_path, project_points
    from perception.core.imageio import encode_image
    from perception.core.testing import free_port, make_test_frame, wait_until_healthy

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(BIN / "sim2real-serve"), f"artifact={tiny_run['out'] / 'artifact'}",
                             f"calibration={default_calibration_path()}", "host=127.0.0.1", f"port={port}",
                             "token=null"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, proc, timeout=60)
        calib = Calibration.load(default_calibration_path())
        body = encode_image(make_test_frame(calib), "png")
        r = httpx.post(url + "/v1/grasp", content=body, headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200
        ans = r.json()
        assert set(ans) >= {"grasp", "pixel", "latency_ms", "reason"}
        if ans["grasp"] is None:
            assert ans["reason"] and ans["pixel"] is None
        else:
            g = ans["grasp"]
            x, y, _ = g["position"]
            assert calib.workspace_x[0] <= x <= calib.workspace_x[1] and calib.workspace_y[0] <= y <= calib.workspace_y[1]
            np.testing.assert_allclose(ans["pixel"], project_points(np.array([g["position"]]), calib)[0], atol=1e-3)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow  # the budget=tiny pipeline they share takes 2.5 minutes: the fast tier must stay under 10 minutes
def test_eval_cli_on_the_pipeline_artifact(tiny_run, tmp_path):
    out = tmp_path / "eval.json"
    _run("sim2real-eval", f"artifact={tiny_run['out'] / 'artifact'}", f"output={out}", "n_episodes=2", "seed=3",
         "domains=[randomized]", "brackets=[]", timeout=200)
    r = json.loads(out.read_text())["policy"]["randomized"]
    assert r["attempts"] >= 0 and 0 <= r["successes"] <= r["attempts"]


@pytest.mark.slow  # about a minute (the consistency stage trains): the fast tier must stay under 10 minutes
def test_rerun_reuses_every_stage_and_task_consistency_builds_on_them(tiny_run):
    """The same command again reuses every stage; with task consistency on, only the new
    stage (and what depends on it) runs, and the artifact comes from it."""
    from perception.core.calibration import default_calibration_path

    out = tiny_run["out"]
    args = [f"calibration={default_calibration_path()}", f"real_dir={tiny_run['real']}", f"output_dir={out}",
            "budget=tiny", "seed=0"]
    _run("sim2real-pipeline", *args)
    rep = json.loads((out / "report.json").read_text())
    assert all(s["reused"] for s in rep["stages"].values()), rep["stages"]
    _run("sim2real-pipeline", *args, "task_consistency.enabled=true", "task_consistency.steps=3",
         "task_consistency.batch_size=2", "task_consistency.policy_time_s=3")
    rep = json.loads((out / "report.json").read_text())
    st = rep["stages"]
    assert st["render"]["reused"] and st["adapt"]["reused"] and st["policy"]["reused"]
    assert not st["consistency"]["reused"] and not st["int8"]["reused"] and not st["eval"]["reused"]
    tc = rep["task_consistency"]
    assert tc["finetune"]["steps"] == 3 and np.isfinite(tc["finetune"]["disagreement_after"])
    assert Path(tc["generator"], "generator.pt").is_file()
    meta = json.loads((out / "artifact" / "metadata.json").read_text())
    assert rep["policy"]["artifact"] == tc["policy"]["artifact"]
    assert meta["training"]["global_step"] >= 1


@pytest.mark.slow  # the budget=tiny pipeline they share takes 2.5 minutes: the fast tier must stay under 10 minutes
def test_a_moved_output_folder_is_reused_from_its_new_place(tiny_run, tmp_path):
    """Stage results name files inside their stage folder; after the output folder is
    copied elsewhere a rerun reuses every stage and reads the copies, not the original."""
    import shutil

    from perception.core.calibration import default_calibration_path

    moved = tmp_path / "moved"
    shutil.copytree(tiny_run["out"], moved)
    _run("sim2real-pipeline", f"calibration={default_calibration_path()}", f"real_dir={tiny_run['real']}",
         f"output_dir={moved}", "budget=tiny", "seed=0")
    rep = json.loads((moved / "report.json").read_text())
    assert all(s["reused"] for s in rep["stages"].values()), rep["stages"]
    assert Path(rep["policy"]["artifact"]).is_relative_to(moved)
    assert Path(rep["policy"]["checkpoint"]).is_relative_to(moved)


def test_render_stage_hash_follows_the_profile_file(tmp_path):
    """Regression: the render stages were hashed on their overrides alone, so a changed
    conf/render/*.yaml (new ranges) reused frames drawn with the old ones."""
    from omegaconf import OmegaConf

    from perception.core.calibration import default_calibration_path
    from policies.pipeline.flow import _profile_payload, stage_hash

    conf = Path(__file__).resolve().parents[2] / "conf" / "render" / "randomized.yaml"
    on_disk = OmegaConf.to_container(OmegaConf.load(conf), resolve=True)
    payload = _profile_payload(tmp_path, "randomized", default_calibration_path(), [])
    assert payload["surface_textures"] == on_disk["surface_textures"]
    assert payload["empty_scene_prob"] == on_disk["empty_scene_prob"]
    other = _profile_payload(tmp_path, "randomized", default_calibration_path(), ["render.empty_scene_prob=0.0"])
    assert stage_hash({"profile": payload}) != stage_hash({"profile": other})


def test_an_interrupted_stage_resumes_from_what_it_finished(tmp_path):
    """issue 12: the rerun deleted an unfinished stage although its shards and checkpoints existed."""
    from policies.pipeline.flow import Stages

    def interrupted(d):
        (d / "shard-000000.npz").write_text("finished part")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Stages(tmp_path, reuse=True).run("render", {"n": 4}, interrupted)
    seen = []
    d, res, _ = Stages(tmp_path, reuse=True).run("render", {"n": 4}, lambda d: seen.append(sorted(os.listdir(d))) or {})
    assert seen == [["shard-000000.npz"]] and (d / "stage.json").is_file()
    # reuse=false starts every stage anew
    with pytest.raises(KeyboardInterrupt):
        Stages(tmp_path, reuse=True).run("render", {"n": 5}, interrupted)
    seen.clear()
    Stages(tmp_path, reuse=False).run("render", {"n": 5}, lambda d: seen.append(sorted(os.listdir(d))) or {})
    assert seen == [[]]


@pytest.mark.slow
def test_finetune_on_a_recording_made_by_the_service_in_the_twin(tiny_run, tmp_path):
    """Contract section 7 end to end: the tiny run's service records attempts a PyBullet cell
    executes (outcomes through POST /v1/outcome), sim2real-finetune trains on them, keeps the
    zero-shot artifact (3 held-out attempts cannot show it better), and the new one is served."""
    import signal

    import httpx

    from perception.core.imageio import encode_image
    from perception.core.recording import load_attempts
    from perception.core.testing import free_port, wait_until_healthy
    from perception.robot.robots import GraspRequest
    from sim_render.sim_robot import SimCell

    out, rec = tiny_run["out"], tmp_path / "rec"

    def serve(artifact, *extra):
        port = free_port()
        proc = subprocess.Popen([str(BIN / "sim2real-serve"), f"artifact={artifact}", f"port={port}", "threads=1",
                                 "log_level=warning", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, proc, timeout=60)
        return proc, url

    # A zero threshold: the tiny policy answers a grasp on every frame, right or wrong.
    proc, url = serve(out / "artifact", f"record_dir={rec}", "quality_threshold=0.0")
    cell = SimCell(seed=11)
    try:
        from perception.core.grasp import Grasp

        executed, reasons = 0, []
        with httpx.Client(timeout=30) as c:
            for _ in range(80):
                ans = c.post(url + "/v1/grasp", content=encode_image(cell.render(), "png"),
                             headers={"Content-Type": "image/png"}).json()
                if ans["grasp"] is None:  # e.g. "the bin looks empty": not recorded
                    assert ans["attempt_id"] is None
                    reasons.append(ans["reason"])
                    cell.refill()
                    continue
                g = ans["grasp"]
                outcome = cell.execute(GraspRequest(1, Grasp(tuple(g["position"]), g["yaw"], g["width"], g["quality"])))
                r = c.post(url + "/v1/outcome", json={"attempt_id": ans["attempt_id"], "success": bool(outcome.success)})
                assert r.status_code == 200
                executed += 1
                if executed == 16:
                    break
        assert executed == 16, reasons[:5]
    finally:
        cell.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert len([a for a in load_attempts(rec) if a["outcome"] is not None]) == 16

    ft = tmp_path / "ft"
    t0 = time.perf_counter()
    res = _run("sim2real-finetune", f"run_dir={out}", f"recordings=[{rec}]", f"output_dir={ft}", "budget=tiny",
               "seed=0")
    wall = time.perf_counter() - t0
    report = json.loads((ft / "report.json").read_text())
    # Exit 0 either way; too few held-out attempts to show it better: artifact/ is the run's, unchanged.
    assert report["promoted"] is False and res.stdout.strip().splitlines()[-1].startswith("kept the zero-shot")
    assert all((ft / "artifact" / p.name).read_bytes() == p.read_bytes() for p in (out / "artifact").iterdir()
               if p.is_file())
    assert report["attempts"]["with_outcome"] == 16 and report["attempts"]["check"] >= 1
    for side in ("before", "after"):
        chk = report["check"][side]
        assert chk["attempts"] == report["attempts"]["check"] and 0.0 <= chk["null_rate"] <= 1.0
        assert sum(b["attempts"] for b in chk["calibration"]) == chk["attempts"]
    change = report["check"]["auc_difference"]  # None when the check block holds one class only
    assert change is None or change["interval"][0] <= change["difference"] <= change["interval"][1]
    assert report["training"]["global_step"] > 0 and wall < 300
    # int8 graphs like the run's, from the run's real frames.
    assert report["int8"]["frames"] >= 1 and (ft / "candidate" / "policy.int8.onnx").is_file()
    # What the pipeline measured of the cell stays: the walls and the camera's empty bin.
    run_meta, cand_meta = (json.loads((d / "metadata.json").read_text()) for d in (out / "artifact", ft / "candidate"))
    assert cand_meta["background"] == run_meta["background"] and (ft / "candidate" / "background.png").is_file()
    assert cand_meta["geometry"].get("walls") == run_meta["geometry"].get("walls")
    proc, url = serve(ft / "candidate")
    try:
        frame = encode_image(SimCell(seed=12).render(), "png")
        assert httpx.post(url + "/v1/grasp", content=frame, headers={"Content-Type": "image/png"},
                          timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    # Refused with a message and exit 2: no outcomes; no run.
    empty = tmp_path / "empty"
    empty.mkdir()
    res = subprocess.run([str(BIN / "sim2real-finetune"), f"run_dir={out}", f"recordings=[{empty}]",
                          f"output_dir={tmp_path / 'x'}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "no recorded attempt with an outcome" in res.stderr
    res = subprocess.run([str(BIN / "sim2real-finetune"), f"run_dir={tmp_path}", f"recordings=[{rec}]",
                          f"output_dir={tmp_path / 'x'}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "report.json" in res.stderr


def _geometry_artifact(tmp_path: Path, calib) -> Path:
    """A test artifact with a geometry entry (its graph: the policy's, which loads as one)."""
    from perception.core.artifact import write_metadata
    from perception.core.testing import make_test_artifact

    art = make_test_artifact(tmp_path / "served", calib)
    meta = json.loads((art / "metadata.json").read_text())
    meta["geometry"] = {"onnx": meta["onnx"], "input": {"name": "image", "mean": [0.5] * 3, "std": [0.25] * 3},
                        "outputs": {"height": "height", "part": "height"}, "view": {**meta["view"], "kind": "camera"},
                        "part_threshold": 0.5, "interior_margin": 0.01, "floor_height": 0.007}
    write_metadata(art, meta)
    return art


@pytest.mark.parametrize("case", ["given", "report", "inner", "stand-in", "off"])
def test_the_walls_stage_writes_the_bins_walls_into_the_artifact(tmp_path, case):
    """``walls``: given numbers, else the calibration's refine report; the stand-in's twin bin
    (no ``real_dir``) gets none, and ``walls.enabled=false`` serves the artifact untouched."""
    from omegaconf import OmegaConf

    from perception.core.artifact import load_metadata
    from perception.core.calibration import Calibration, default_calibration_path
    from policies.pipeline.flow import Stages, _Run, _walls

    calib_path = default_calibration_path()
    calib = Calibration.load(calib_path)
    if case in ("report", "inner"):  # what sim2real-calibrate refine writes beside the pose
        data = json.loads(Path(calib_path).read_text())
        data["calibration_report"] = {"refine": {"wall_placement": "outer" if case == "report" else "inner",
                                                 "wall_height_m": 0.059,
                                                 "wall_thickness_m": 0.0121, "edge_contrast": 3.2}}
        calib_path = tmp_path / "refined.json"
        calib_path.write_text(json.dumps(data))
    walls = {"enabled": case != "off", "height": 0.05 if case == "given" else None,
             "thickness": 0.02 if case == "given" else None}
    cfg = OmegaConf.create({"walls": walls, "real_dir": str(tmp_path) if case == "inner" else None})
    served = _geometry_artifact(tmp_path, calib)
    run = _Run(cfg, tmp_path / "out", Path(calib_path), calib, Stages(tmp_path / "out", reuse=True), 0)
    out, res, h = _walls(run, str(served), "policyhash", tmp_path, "realhash")
    g = load_metadata(out).geometry
    if case in ("off", "stand-in", "inner"):  # inner: real frames, yet no wall stands in the workspace
        assert g.walls is None and h == "policyhash"
        assert out == str(served) and (res is None) == (case == "off")
    else:
        assert g.walls == ((0.05, 0.02) if case == "given" else (0.059, 0.0121)) and h != "policyhash"
        assert Path(out) != served and load_metadata(served).geometry.walls is None  # the policy stage's stays


@pytest.mark.parametrize("case", ["made", "off", "no_answer_on_parts", "too_few_frames"])
def test_the_background_stage_writes_the_cameras_empty_bin_into_the_artifact(tmp_path, case):
    """``background``: the median of the real frames in the policy's view goes into the artifact
    (its image hashed, the numbers from the config) when the decode answers on parts; off, for a
    decode without ``answer_on_parts`` and with too few frames the artifact is served untouched."""
    import cv2
    from omegaconf import OmegaConf

    from perception.core.artifact import load_metadata, write_metadata
    from perception.core.background import MIN_FRAMES
    from perception.core.calibration import Calibration, default_calibration_path
    from policies.pipeline.flow import Stages, _background, _Run
    from sim_render.api import compose_config

    calib_path = default_calibration_path()
    calib = Calibration.load(calib_path)
    served = _geometry_artifact(tmp_path, calib)
    meta = json.loads((served / "metadata.json").read_text())
    meta["decode"] = {"on_part_px": 1, "answer_on_parts": case != "no_answer_on_parts"}
    write_metadata(served, meta)
    real = tmp_path / "real"
    real.mkdir()
    rng = np.random.default_rng(0)
    W, H = calib.image_size
    floor = rng.integers(60, 200, (H // 8, W // 8, 3)).astype(np.uint8)
    for i in range(MIN_FRAMES - 1 if case == "too_few_frames" else MIN_FRAMES + 4):
        frame = cv2.resize(floor, (W, H), interpolation=cv2.INTER_NEAREST) * rng.uniform(0.6, 1.0)
        cv2.imwrite(str(real / f"{i:03d}.png"), frame.astype(np.uint8))
    cfg = compose_config("pipeline", [f"background.enabled={case != 'off'}"])
    run = _Run(cfg, tmp_path / "out", Path(calib_path), calib, Stages(tmp_path / "out", reuse=True), 0)
    out, res, h = _background(run, str(served), "policyhash", real, "realhash")
    bg = load_metadata(out).background
    if case != "made":
        assert bg is None and out == str(served) and h == "policyhash"
        assert (res is None) == (case != "too_few_frames")
        if res is not None:
            assert f"at least {MIN_FRAMES} frames" in res["reason"]
        return
    b_cfg = OmegaConf.to_container(cfg.background)
    cell_mm = 1e3 / float(np.linalg.norm(load_metadata(out).view.K[0, :2]))
    assert bg.threshold == b_cfg["threshold"] and bg.min_part_px == round(b_cfg["min_part_mm2"] / cell_mm ** 2)
    assert h != "policyhash" and Path(out) != served and load_metadata(served).background is None
    entry = json.loads((Path(out) / "metadata.json").read_text())["background"]
    assert entry["frames"] == MIN_FRAMES + 4 and 0.0 <= entry["shown"] <= 1.0
    # The frames differ only in brightness: the floor is its own background.
    view = load_metadata(out).view
    from perception.core.decode import parts_region
    from perception.core.preprocess import preprocess

    frame = cv2.cvtColor(cv2.imread(str(real / "000.png")), cv2.COLOR_BGR2RGB)
    assert bg.unchanged(preprocess(frame, calib, view), parts_region(calib, view))


def test_background_settings_out_of_range_are_refused_before_any_stage():
    from omegaconf import OmegaConf

    from policies.pipeline.flow import background_config

    for change, match in (({"max_frames": 5}, "background.max_frames"), ({"threshold": 0.0}, "background.threshold"),
                          ({"min_part_mm2": -1}, "background.min_part_mm2"), ({"gate": "never"}, "background.gate")):
        with pytest.raises(ValueError, match=match):
            background_config(OmegaConf.create({"background": {"enabled": True, "max_frames": 300, "threshold": 0.04,
                                                               "min_part_mm2": 280, "gate": "always", **change}}))


def test_walls_given_by_half_or_out_of_range_are_refused_before_any_stage():
    from omegaconf import OmegaConf

    from policies.pipeline.flow import walls_config

    for walls, match in (({"height": 0.05, "thickness": None}, "walls.thickness"),
                         ({"height": 0.5, "thickness": 0.01}, "walls.height"),
                         ({"height": 0.05, "thickness": 0.0}, "walls.thickness"),
                         ({"fit": {"hypothesis": 1}}, "walls.fit: .*hypothesis")):
        with pytest.raises(ValueError, match=match):
            walls_config(OmegaConf.create({"walls": {"enabled": True, **walls}}))
    assert walls_config(OmegaConf.create({"walls": {"enabled": True, "height": 0.05, "thickness": 0.01}}))["height"] == 0.05
