"""Fixtures of the scaling tests: console scripts in subprocesses, tiny rendered data, W&B
offline records, and a watch on the files that DDP ranks other than 0 write."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _wandb_offline(tmp_path, monkeypatch):
    """No network: W&B offline, its files in tmp_path, nothing inherited from a sweep agent."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    for var in ("WANDB_RUN_ID", "WANDB_SWEEP_ID", "WANDB_SWEEP_PARAM_PATH", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:  # a failed test must not leave a run to the next one
        wandb.finish()


def run_cli(name: str, *args: str, env: dict | None = None, timeout: float = 170, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
    """Run the console script ``name`` of this environment; fail with its output if it fails."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    res = subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=timeout,
                         env=full_env, cwd=cwd)
    if res.returncode != 0:
        pytest.fail(f"{name} {' '.join(args)} exited {res.returncode}\n--- stdout\n{res.stdout[-6000:]}\n"
                    f"--- stderr\n{res.stderr[-6000:]}")
    return res


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess]:
    return run_cli


# ------------------------------------------------------------------ data
@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """Three randomized scenes (six frames, quarter resolution) and three 'real' frames."""
    from sim_render.api import export_real_frames, render_dataset

    root = tmp_path_factory.mktemp("scaling_data")
    render_dataset(root / "sim", n_scenes=3, profile="randomized", seed=0,
                   overrides=["render.resolution_scale=0.25"])
    render_dataset(root / "target", n_scenes=3, profile="target", seed=1,
                   overrides=["render.resolution_scale=0.25", "render.grasps.n_heuristic=0",
                              "render.grasps.n_random=0"])
    export_real_frames(root / "target", root / "real")
    return {"sim": root / "sim", "real": root / "real"}


# ------------------------------------------------------------------ W&B offline runs
def _wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a ``run-*.wandb`` file: a 7-byte header, then LevelDB-log records
    (checksum u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # padding to the end of the block
            pos += left
            continue
        if pos + 7 + n > len(data):  # a record still being written
            return
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def read_wandb_run(run_dir: Path) -> dict:
    """What an offline run recorded: ``id``, ``project``, ``tags``, ``job_type``, ``config``
    (merged updates, JSON-decoded), ``history`` (list of dicts), ``summary`` (last values)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).glob("run-*.wandb"))
    assert len(files) == 1, f"one transaction log expected in {run_dir}, found {files}"
    # wandb.finish() returns when the run's exit is acknowledged, which can be before the
    # wandb-core writer has flushed the log to disk (seen on a loaded CI machine): read the
    # log once it holds its exit record, the last one a finished run writes.
    deadline = time.monotonic() + 60.0
    while True:
        records = []
        for raw in _wandb_records(files[0]):
            rec = pb.Record()
            rec.ParseFromString(raw)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{files[0]} has no exit record 60 s after the run finished"
        time.sleep(0.2)
    out: dict = {"id": None, "project": None, "tags": [], "job_type": None, "config": {}, "history": [],
                 "summary": {}}

    def key(item) -> str:
        return item.key or "/".join(item.nested_key)

    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(id=rec.run.run_id, project=rec.run.project, tags=list(rec.run.tags),
                       job_type=rec.run.job_type)
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in rec.summary.update})
    for k, v in out["config"].items():  # W&B stores config items as {"value": ...}
        if isinstance(v, dict) and set(v) == {"value"}:
            out["config"][k] = v["value"]
    return out


@pytest.fixture
def wandb_run() -> Callable[[Path], dict]:
    return read_wandb_run


# ------------------------------------------------------------------ writes of DDP ranks
_HOOK = '''
"""Test hook (tests/scaling): log the files each process writes under RANK_WRITES_WATCH."""
import os
import sys

_watch, _log = os.environ.get("RANK_WRITES_WATCH"), os.environ.get("RANK_WRITES_LOG")
if _watch and _log:
    _watch = os.path.realpath(_watch)
    _busy = [False]
    _EVENTS = ("os.rename", "os.replace", "os.remove", "shutil.rmtree", "os.truncate")

    def _hook(event, args):
        if _busy[0] or (event != "open" and event not in _EVENTS):
            return
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if not writes or isinstance(path, int):
                return
        else:
            path = args[1] if event in ("os.rename", "os.replace") else args[0]
        try:
            real = os.path.realpath(os.fsdecode(path))
        except Exception:
            return
        if real == _watch or real.startswith(_watch + os.sep):
            _busy[0] = True
            try:
                rank = os.environ.get("LOCAL_RANK", "0")
                with open(_log, "a") as fh:
                    fh.write(f"{rank}\\t{event}\\t{os.path.relpath(real, _watch)}\\n")
            finally:
                _busy[0] = False

    sys.addaudithook(_hook)
'''


@pytest.fixture
def rank_writes(tmp_path) -> Callable[[Path], tuple[dict, Callable[[], dict[str, list[str]]]]]:
    """``env, read = rank_writes(watched_dir)``: run a process with ``env`` and ``read()`` gives
    ``{local_rank: [relative paths written]}`` for every process it started (an audit hook in a
    ``sitecustomize`` sees Python-level opens for writing, renames and removals)."""
    hook_dir = tmp_path / "rank_hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(textwrap.dedent(_HOOK))
    log = tmp_path / "rank_writes.tsv"

    def make(watch: Path):
        env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "RANK_WRITES_WATCH": str(watch), "RANK_WRITES_LOG": str(log)}

        def read() -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            if log.is_file():
                for line in log.read_text().splitlines():
                    rank, _event, rel = line.split("\t")
                    out.setdefault(rank, []).append(rel)
            return out

        return env, read

    return make
