"""Shard orchestration: determinism across workers, resume, corruption, disk errors.

No PyBullet: :class:`SyntheticFrames` stands in for the renderer, drawing its frames
from ``SeedSequence([seed, i])``, the same seeding rule the real renderer follows.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import tempfile
import time
from pathlib import Path

import pytest
from synthetic_frames import SyntheticFrames

import perception.core.atomic
from perception.core.calibration import Calibration, default_calibration_path
from sim_render.format import CorruptShardError, DatasetError, FrameRecord
from sim_render.render_job import OutputDirError, SceneRenderError, WorkerError, render_shards
from sim_render.shard_io import verify_shard

SIZE = (32, 24)  # rendered (width, height): tiny, the tests are about files, not pixels
NOMINAL = Calibration.load(default_calibration_path())
META = {
    "profile": "test",
    "config_hash": "0123456789abcdef",
    "calibration": NOMINAL.to_dict(),
    "image_size": list(SIZE),
}


class FakeFrames(SyntheticFrames):
    """:class:`SyntheticFrames` that logs its calls and can crash once (in-process only).

    Args:
        log_dir: every call leaves a file ``scene-<i>-...`` there (counts renders).
        fail_once_on: scene whose first render raises (a crash mid-run).
    """

    def __init__(self, log_dir: Path, fail_once_on: int | None = None) -> None:
        super().__init__(seed=7, calibration=NOMINAL, image_size=SIZE)
        self.log_dir = log_dir
        self.fail_once_on = fail_once_on

    def __call__(self, i: int) -> list[FrameRecord]:
        (self.log_dir / f"scene-{i}-{os.getpid()}-{time.monotonic_ns()}").touch()
        marker = self.log_dir / "failed-once"
        if i == self.fail_once_on and not marker.exists():
            marker.touch()
            raise RuntimeError(f"simulated crash in scene {i}")
        return super().__call__(i)


class DiesInWorker(SyntheticFrames):
    """Pickles fine, but kills the process that unpickles it (a worker that crashes)."""

    def __reduce__(self):
        return (os._exit, (3,))


def _render(out: Path, workers: int = 1, n_scenes: int = 10, **kwargs) -> dict:
    kwargs.setdefault("make_frames", SyntheticFrames(seed=7, calibration=NOMINAL, image_size=SIZE))
    return render_shards(
        out,
        n_scenes=n_scenes,
        scenes_per_shard=4,
        seed=7,
        meta=META,
        workers=workers,
        progress=False,
        **kwargs,
    )


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _renders(log_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in log_dir.glob("scene-*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of an uninterrupted one-worker render of 10 scenes (3 shards)."""
    out = tmp_path_factory.mktemp("reference")
    _render(out)
    return _files(out)


def test_manifest_lists_shards_without_worker_count_or_time(reference: dict[str, bytes]) -> None:
    manifest = json.loads(reference["manifest.json"])
    assert manifest["n_shards"] == 3 and manifest["n_scenes"] == 10
    assert [s["scenes"] for s in manifest["shards"]] == [[0, 4], [4, 8], [8, 10]]
    assert manifest["totals"]["frames"] == 20
    assert manifest["calibration"] == NOMINAL.to_dict() and manifest["image_size"] == list(SIZE)
    assert not {"workers", "time", "created", "timestamp"} & set(manifest)
    for k, entry in enumerate(manifest["shards"]):
        meta = json.loads(reference[f"shards/shard-{k:06d}.json"])
        assert meta["sha256"] == entry["sha256"]
        assert meta["scene_seeds"][str(4 * k)] == [7, 4 * k]


def test_two_workers_write_the_same_bytes(tmp_path: Path, reference: dict[str, bytes]) -> None:
    manifest = _render(tmp_path, workers=2)
    assert manifest["n_shards"] == 3
    assert _files(tmp_path) == reference


def test_a_dying_worker_fails_the_run_instead_of_hanging(tmp_path: Path) -> None:
    """Regression: a ``multiprocessing.Pool`` respawned such workers forever (a hang)."""
    with pytest.raises(WorkerError, match="worker process died"):
        _render(tmp_path, workers=2, make_frames=DiesInWorker(7, NOMINAL, SIZE))
    assert not list((tmp_path / "shards").iterdir())


def test_scene_errors_survive_the_trip_from_a_worker() -> None:
    err = pickle.loads(pickle.dumps(SceneRenderError(5, "Traceback: boom")))
    assert err.scene == 5 and "scene 5" in str(err) and "boom" in str(err)


def test_interrupted_run_resumes_to_the_same_dataset(tmp_path: Path, reference: dict[str, bytes]) -> None:
    out, log_dir = tmp_path / "out", tmp_path / "log"
    log_dir.mkdir()
    frames = FakeFrames(log_dir, fail_once_on=5)
    with pytest.raises(SceneRenderError, match="scene 5") as info:
        _render(out, make_frames=frames)
    assert "simulated crash" in str(info.value)
    assert (out / "shards" / "shard-000000.json").exists()
    assert not (out / "shards" / "shard-000001.npz").exists()
    assert not (out / "manifest.json").exists()
    first = (out / "shards" / "shard-000000.npz").stat()

    _render(out, make_frames=frames)
    assert _files(out) == reference
    # Shard 0 was kept, not rendered again: its scenes were rendered once, its file untouched.
    assert _renders(log_dir) == [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9]
    again = (out / "shards" / "shard-000000.npz").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


def test_stale_temp_files_are_removed(tmp_path: Path, reference: dict[str, bytes]) -> None:
    (tmp_path / "shards").mkdir(parents=True)
    (tmp_path / "shards" / ".shard-000001.npz.abc123.tmp").write_bytes(b"half a shard")
    _render(tmp_path)
    assert _files(tmp_path) == reference


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate", "bytes"),
        ("flip", "sha256"),
        ("drop_json", "metadata"),
        ("drop_npz", "data file"),
    ],
)
def test_corrupt_shard_is_named_and_rendered_again(
    tmp_path: Path, reference: dict[str, bytes], caplog: pytest.LogCaptureFixture, damage: str, reason: str
) -> None:
    out = tmp_path / "out"
    for name, data in reference.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    npz = out / "shards" / "shard-000001.npz"
    if damage == "truncate":
        npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(npz.read_bytes())
        data[len(data) // 2] ^= 0xFF
        npz.write_bytes(bytes(data))
    elif damage == "drop_json":
        npz.with_suffix(".json").unlink()
    else:
        npz.unlink()
    with pytest.raises(CorruptShardError, match=reason) as info:
        verify_shard(npz)
    assert info.value.name == "shard-000001" and "shard-000001" in str(info.value)
    verify_shard(out / "shards" / "shard-000000.npz")

    log_dir = tmp_path / "log"
    log_dir.mkdir()
    with caplog.at_level(logging.WARNING, logger="sim_render.render_job"):
        _render(out, make_frames=FakeFrames(log_dir))
    assert "shard-000001" in caplog.text
    assert _renders(log_dir) == [4, 5, 6, 7]
    assert _files(out) == reference


def test_shards_of_another_seed_are_not_overwritten(tmp_path: Path, reference: dict[str, bytes]) -> None:
    _render(tmp_path)
    with pytest.raises(DatasetError, match="seed"):
        render_shards(
            tmp_path, 10, 4, seed=8, make_frames=SyntheticFrames(8, NOMINAL, SIZE), meta=META, progress=False
        )
    assert _files(tmp_path) == reference


def test_unwritable_output_dir_fails_before_rendering(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(OutputDirError, match="not writable") as info:
        _render(blocker / "out", make_frames=FakeFrames(log_dir))
    assert isinstance(info.value, OSError) and str(blocker / "out") in str(info.value)
    assert _renders(log_dir) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_dir_fails_before_rendering(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OutputDirError, match="not writable"):
            _render(tmp_path / "out")
    finally:
        tmp_path.chmod(0o700)


class _FullDisk:
    """A file object that writes half of the first block, then reports a full disk."""

    def __init__(self, fh) -> None:
        self._fh = fh

    def write(self, data: bytes) -> int:
        self._fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self._fh, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


@pytest.mark.parametrize("which", ["npz", "json"])
def test_full_disk_leaves_no_partial_shard(
    tmp_path: Path, reference: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """The disk fills while shard 1's ``.npz`` (or its ``.json``) is written."""
    names: dict[int, str] = {}
    real_mkstemp, real_fdopen = tempfile.mkstemp, os.fdopen

    def mkstemp(*args, **kwargs):
        fd, path = real_mkstemp(*args, **kwargs)
        names[fd] = Path(path).name
        return fd, path

    def fdopen(fd, *args, **kwargs):
        fh = real_fdopen(fd, *args, **kwargs)
        return _FullDisk(fh) if names.get(fd, "").startswith(f".shard-000001.{which}.") else fh

    monkeypatch.setattr(perception.core.atomic.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(perception.core.atomic.os, "fdopen", fdopen)
    with pytest.raises(OSError, match="no space left on device") as info:
        _render(tmp_path)
    assert info.value.errno == errno.ENOSPC and "shard-000001" in str(info.value)
    monkeypatch.undo()

    left = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert left == ["shard-000000.json", "shard-000000.npz"]  # no partial shard, no temp file
    verify_shard(tmp_path / "shards" / "shard-000000.npz")
    _render(tmp_path)
    assert _files(tmp_path) == reference
