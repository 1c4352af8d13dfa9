"""Hydra launchers: render fan-out over shard ranges with submitit's local launcher (parallel
processes), and the SLURM launcher configs turned into the sbatch script they would submit."""

from __future__ import annotations

import json
import os
import re
import stat
from collections import Counter

import pytest
from omegaconf import OmegaConf

ENTRY_CONFIGS = ("render", "adapt", "train_policy", "pipeline")
LAUNCHERS = ("slurm", "slurm_gpu", "submitit_slurm", "submitit_local")

#: a render small enough for seconds per scene on 2 cores
TINY_RENDER = ["render.resolution_scale=0.2", "render.frames_per_scene=1", "render.grasps.n_heuristic=2",
               "render.grasps.n_random=1"]


@pytest.mark.parametrize("n_shards", [1, 2, 3, 7, 10, 64])
def test_parts_cover_every_shard_exactly_once(n_shards):
    from sim_render.cli import parse_shard_range

    for n in range(1, n_shards + 1):
        ranges = [parse_shard_range(f"{i}/{n}", n_shards) for i in range(n)]
        covered = Counter(k for a, b in ranges for k in range(a, b))
        assert covered == Counter(range(n_shards)), (n, ranges)
        assert all(b > a for a, b in ranges), "no part is empty"
    with pytest.raises(ValueError, match="0 <= i < n"):
        parse_shard_range(f"0/{n_shards + 1}", n_shards)


@pytest.mark.parametrize("config_name", ENTRY_CONFIGS)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_configs_compose(config_name, launcher):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name, [f"hydra/launcher={launcher}"], return_hydra_config=True)
    target = cfg.hydra.launcher._target_
    assert target.startswith("hydra_plugins.hydra_submitit_launcher.submitit_launcher.")
    assert target.endswith("LocalLauncher" if launcher == "submitit_local" else "SlurmLauncher")


@pytest.mark.parametrize("launcher", ["slurm", "slurm_gpu"])
def test_slurm_launcher_config_makes_a_valid_sbatch_script(launcher, tmp_path, monkeypatch):
    """The plugin's own mapping of config keys to submitit parameters (``launch()`` in
    hydra_submitit_launcher), then submitit's sbatch text: no cluster needed, only an
    ``srun`` on PATH that submitit looks for."""
    import submitit
    from hydra import compose, initialize_config_module
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("adapt", [f"hydra/launcher={launcher}", "hydra.launcher.partition=gpu",
                                "hydra.launcher.setup=[source /venv/bin/activate]"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    params.pop("_target_")
    params["name"] = "sim2real"
    folder = params.pop("submitit_folder").replace("${hydra.sweep.dir}", str(tmp_path / "sweep"))
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    text = executor._executor._make_submission_file_text("python -m job", "uid")
    assert "#SBATCH --partition=gpu" in text and "source /venv/bin/activate" in text
    assert f"#SBATCH --time={params['timeout_min']}" in text
    assert f"#SBATCH --cpus-per-task={params['cpus_per_task']}" in text
    assert f"#SBATCH --ntasks-per-node={params['tasks_per_node']}" in text
    if launcher == "slurm_gpu":
        assert f"#SBATCH --gpus-per-node={params['gpus_per_node']}" in text
    assert executor._executor.parameters.get("array_parallelism", params["array_parallelism"]) == params["array_parallelism"]


def _shard_lines(log: str) -> list[str]:
    return re.findall(r"wrote (shard-\d+) \(scenes", log)


@pytest.mark.slow  # four launcher processes render (about 11 s): the fast tier must stay under 10 minutes
def test_submitit_local_multirun_renders_every_shard_once(tmp_path, cli):
    """``sim2real-render -m shards=0/3,1/3,2/3 hydra/launcher=submitit_local``: three processes,
    each shard written by exactly one of them, and the manifest byte-identical to one process's."""
    common = ["n_scenes=5", "scenes_per_shard=1", "seed=3", *TINY_RENDER]
    fan = tmp_path / "fan"
    res = cli("sim2real-render", "-m", f"output_dir={fan}", *common, "shards=0/3,1/3,2/3",
              "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5")
    jobs = sorted(p for p in fan.glob(".hydra_multirun/*/[0-9]*") if p.is_dir())
    assert len(jobs) == 3, res.stdout
    written, ranges, pids = [], [], set()
    for job in jobs:
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
        ranges.append(next(o for o in overrides if o.startswith("shards=")))
        written += _shard_lines((job / "render.log").read_text())
    for out_log in fan.glob(".hydra_multirun/*/.submitit/*/*_0_log.out"):
        pids.add(out_log.parent.name)  # submitit's local job id is the worker process id
    assert sorted(ranges) == ["shards=0/3", "shards=1/3", "shards=2/3"]
    assert len(pids) == 3, "one process per job"
    counts = Counter(written)
    assert counts == Counter(f"shard-{k:06d}" for k in range(5)), counts  # every shard, exactly once
    assert (fan / "manifest.json").is_file(), "the last job to finish writes the manifest"

    single = tmp_path / "single"
    cli("sim2real-render", f"output_dir={single}", *common)
    assert (fan / "manifest.json").read_bytes() == (single / "manifest.json").read_bytes()
    for k in range(5):
        name = f"shards/shard-{k:06d}.npz"
        assert (fan / name).read_bytes() == (single / name).read_bytes(), name

    # A final plain run (what to do when jobs race, or on a slow shared filesystem) is a no-op
    # on the finished shards and (re)writes the same manifest.
    before = {p.name: p.stat().st_mtime_ns for p in (fan / "shards").iterdir()}
    res = cli("sim2real-render", f"output_dir={fan}", *common, "hydra.run.dir=" + str(tmp_path / "final_run"))
    assert _shard_lines(res.stdout + res.stderr) == []
    assert before == {p.name: p.stat().st_mtime_ns for p in (fan / "shards").iterdir()}
    assert json.loads((fan / "manifest.json").read_text())["totals"]["frames"] == 5
