"""Render a dataset into shards: resume, worker pool, progress and manifest.

This module is renderer-agnostic: it calls ``make_frames(i)`` for every scene ``i`` it
needs and writes what comes back (see :func:`render_shards`). The per-scene renderer
(PyBullet) lives elsewhere and must follow two rules:

* **Seeding.** ``make_frames(i)`` draws *all* its randomness from
  ``numpy.random.default_rng(numpy.random.SeedSequence([seed, i]))`` (the ``seed`` it was
  built with), never from global state or anything a previous scene left behind, and
  that includes simulator state: a PyBullet client reused across scenes must be reset
  so that scene ``i`` renders the same in a fresh worker as after other scenes. Then
  scene ``i`` is the same whichever worker renders it, in whatever order, so the data
  (and the shard bytes) do not depend on the number of workers or on resuming.
* **Picklability.** With ``workers > 1`` the callable is pickled into each worker
  process, so it must be an instance of a top-level class whose heavy state (the
  PyBullet client, loaded meshes) is created lazily on first call, in the worker.

Workers are started with the ``spawn`` method: a fresh interpreter per worker, which
is what PyBullet (and its EGL plugin) needs, since neither survives ``fork`` of a process
that already has a client, and it avoids forking a parent whose torch/OpenMP threads
are running. Workers only render; the parent assembles and writes shards, so every
write (and every disk error) happens in one place.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import pickle
import tempfile
import traceback
from collections.abc import Callable, Generator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from pathlib import Path

from perception.core.progress import progress as progress_bar
from sim_render.format import FORMAT_VERSION, CorruptShardError, FrameRecord, shard_name, shard_scenes
from sim_render.shard_io import (
    build_manifest,
    check_shard_belongs,
    read_shard_meta,
    to_jsonable,
    verify_shard,
    write_shard,
)

__all__ = ["OutputDirError", "SceneRenderError", "WorkerError", "REQUIRED_META", "render_shards"]

log = logging.getLogger(__name__)

#: Keys ``render_shards`` needs in ``meta``: the profile name, a hash of the resolved
#: render config, the nominal calibration (dict, as in the calibration file) and the
#: rendered frame size ``[width, height]``.
REQUIRED_META = ("profile", "config_hash", "calibration", "image_size")

MakeFrames = Callable[[int], list[FrameRecord]]


class OutputDirError(OSError):
    """The output folder cannot be created or written."""


class SceneRenderError(RuntimeError):
    """``make_frames(scene)`` raised or returned something that is not a list of frames.

    Args:
        scene: the scene index.
        detail: the original error with its traceback (kept as text, since the error
            may come from a worker process).
    """

    def __init__(self, scene: int, detail: str) -> None:
        super().__init__(scene, detail)
        self.scene = scene
        self.detail = detail

    def __str__(self) -> str:
        return (
            f"rendering scene {self.scene} failed (finished shards are kept: rerun the same "
            f"command to resume):\n{self.detail}"
        )


class WorkerError(RuntimeError):
    """A render worker process died without reporting an error."""


# ----------------------------------------------------------------------------- workers
def _call_make_frames(make_frames: MakeFrames, scene: int, in_worker: bool = False) -> list[FrameRecord]:
    """Render one scene and check what came back.

    In a worker the original traceback is kept as text (exception chains do not
    survive pickling); in-process it stays attached as ``__cause__``.
    """
    try:
        frames = make_frames(scene)
    except Exception as exc:
        detail = (
            "".join(traceback.format_exception(exc)).rstrip() if in_worker else f"{type(exc).__name__}: {exc}"
        )
        raise SceneRenderError(scene, detail) from exc
    if not isinstance(frames, list) or not all(isinstance(f, FrameRecord) for f in frames):
        raise SceneRenderError(scene, f"make_frames returned {type(frames).__name__}, not list[FrameRecord]")
    bad = sorted({f.scene for f in frames} - {scene})
    if bad:
        raise SceneRenderError(scene, f"make_frames({scene}) returned frames of scene(s) {bad}")
    return frames


_worker_make_frames: MakeFrames | None = None


def _init_worker(make_frames: MakeFrames) -> None:
    # Unpickled once per worker, so a lazily created PyBullet client lives across scenes.
    global _worker_make_frames
    _worker_make_frames = make_frames


def _worker_render(scene: int) -> tuple[int, list[FrameRecord]]:
    assert _worker_make_frames is not None, "worker not initialised"
    return scene, _call_make_frames(_worker_make_frames, scene, in_worker=True)


def _scene_results(
    make_frames: MakeFrames, scenes: list[int], workers: int
) -> Generator[tuple[int, list[FrameRecord]], None, None]:
    """``(scene, frames)`` for every scene, in completion order.

    One worker renders in this process (no pickling, easy to debug). More use a
    ``spawn`` process pool with a bounded window of ``2 * workers`` submitted scenes, so
    results never pile up in memory. A ``ProcessPoolExecutor`` rather than a
    ``multiprocessing.Pool``: when a worker dies (a PyBullet segfault, the OOM killer, a
    callable that cannot be unpickled in a fresh process) it fails with
    ``BrokenProcessPool`` where a ``Pool`` silently respawns workers forever. Close the
    generator (``contextlib.closing``) to cancel the remaining scenes.
    """
    workers = min(workers, len(scenes))
    if workers <= 1:
        for i in scenes:
            yield i, _call_make_frames(make_frames, i)
        return
    try:
        pickle.dumps(make_frames)
    except Exception as exc:
        raise TypeError(
            f"make_frames ({type(make_frames).__name__}) must be picklable for workers > 1: use an "
            "instance of a top-level class that creates its PyBullet client lazily"
        ) from exc
    todo = iter(scenes)
    pending: set[Future] = set()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(make_frames,)
    ) as pool:
        try:
            while True:
                while len(pending) < 2 * workers and (i := next(todo, None)) is not None:
                    pending.add(pool.submit(_worker_render, i))
                if not pending:
                    return
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()  # re-raises a worker's SceneRenderError
        except BrokenProcessPool as exc:
            raise WorkerError(
                "a render worker process died (a crash in the renderer, out of memory, or make_frames "
                f"({type(make_frames).__name__}) could not be unpickled in a fresh process: its class "
                "must be importable, not defined in __main__ or a test module); rerun with workers=1 "
                "to see the error in this process"
            ) from exc
        finally:
            for future in pending:
                future.cancel()


# ----------------------------------------------------------------------------- helpers
def _check_writable(out_dir: Path) -> None:
    """Create ``out_dir/shards`` and write a probe file there, before any rendering."""
    try:
        (out_dir / "shards").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir / "shards"):
            pass
    except OSError as exc:
        raise OutputDirError(
            exc.errno,
            f"output_dir {out_dir} is not writable ({exc.strerror or exc}): choose another output_dir",
            str(out_dir),
        ) from exc


def _remove_stale_temp_files(out_dir: Path, shard_indices: range, whole: bool) -> None:
    """Remove temporary files a killed run left, for this run's shards only.

    Other launchers may be writing other shards of the same folder right now, so their
    temporary files (and, for a partial range, the manifest's) are left alone.
    """
    patterns = [f".{shard_name(k)}.{ext}.*.tmp" for k in shard_indices for ext in ("npz", "json")]
    stale = [p for pattern in patterns for p in (out_dir / "shards").glob(pattern)]
    if whole:
        stale += list(out_dir.glob(".manifest.json.*.tmp"))
    for p in stale:
        log.info("removing stale temporary file %s", p)
        p.unlink(missing_ok=True)


def _drop_outdated_manifest(out_dir: Path, expected: dict) -> None:
    """Remove a manifest that describes another dataset than the one being rendered.

    The reader trusts the manifest, so one left from, say, a smaller ``n_scenes`` must
    not survive while its shards are being replaced.
    """
    path = out_dir / "manifest.json"
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
        same = old.get("format_version") == FORMAT_VERSION and all(
            old.get(k) == v for k, v in expected.items()
        )
    except (OSError, ValueError):
        same = False
    if not same:
        log.warning("removing %s: it describes another render of this folder", path)
        path.unlink(missing_ok=True)


def _shard_ready(out_dir: Path, k: int, expected: dict, full_check: bool) -> bool:
    """Whether shard ``k`` is finished, belongs to this dataset and is intact.

    Args:
        full_check: verify sizes and sha256 (shards this run would render); otherwise
            only the metadata and the file size (shards of other launchers, which
            verified them when they wrote them).

    Raises:
        DatasetError: the shard comes from another run (seed, config or profile).
    """
    path = out_dir / "shards" / f"{shard_name(k)}.npz"
    if not path.exists() and not path.with_suffix(".json").exists():
        return False
    try:
        if full_check:
            verify_shard(path)
        meta = read_shard_meta(path)
        if not full_check and (not path.is_file() or path.stat().st_size != meta.get("bytes")):
            return False
    except CorruptShardError as exc:
        if full_check:
            log.warning("%s; it will be rendered again", exc)
        return False
    check_shard_belongs(meta, expected, k)
    want = list(shard_scenes(k, int(expected["n_scenes"]), int(expected["scenes_per_shard"])))
    if meta.get("scenes") != want:
        if full_check:
            log.warning(
                "%s holds scenes %s, this run needs %s (n_scenes changed?); it will be rendered again",
                shard_name(k),
                meta.get("scenes"),
                want,
            )
        return False
    return True


# ----------------------------------------------------------------------------- main entry
def _expected(meta: dict, n_scenes: int, scenes_per_shard: int, seed: int, workers: int,
              shard_range: tuple[int, int] | None) -> tuple[dict, int, tuple[int, int]]:
    """The dataset's description every shard must match (as it reads back from JSON), the
    number of shards and the range to render; checks the arguments."""
    missing_meta = [k for k in REQUIRED_META if k not in meta]
    if missing_meta:
        raise ValueError(f"render_shards: meta lacks {missing_meta} (needs {list(REQUIRED_META)})")
    if n_scenes < 1 or scenes_per_shard < 1 or workers < 1:
        raise ValueError(
            f"n_scenes ({n_scenes}), scenes_per_shard ({scenes_per_shard}) and workers ({workers}) must be >= 1"
        )
    n_shards = math.ceil(n_scenes / scenes_per_shard)
    a, b = (0, n_shards) if shard_range is None else (int(shard_range[0]), int(shard_range[1]))
    if not 0 <= a < b <= n_shards:
        raise ValueError(f"shard_range {shard_range} must satisfy 0 <= a < b <= n_shards = {n_shards}")
    expected = {**meta, "seed": int(seed), "n_scenes": int(n_scenes), "scenes_per_shard": int(scenes_per_shard)}
    # As it reads back from JSON (tuples become lists), to compare with files.
    return json.loads(json.dumps(to_jsonable(expected), sort_keys=True)), n_shards, (a, b)


def _write_finished(out_dir: Path, k: int, done: dict[int, list[FrameRecord]], expected: dict) -> None:
    """Write shard ``k`` once all its scenes are rendered (``done``: scene -> frames)."""
    lo, hi = shard_scenes(k, int(expected["n_scenes"]), int(expected["scenes_per_shard"]))
    shard_meta = {
        "shard": k,
        "scenes": [lo, hi],
        "seed": expected["seed"],
        "config_hash": expected["config_hash"],
        "profile": expected["profile"],
        "image_size": expected["image_size"],
        "scene_seeds": {str(s): [int(expected["seed"]), s] for s in range(lo, hi)},
    }
    # Scene order, not completion order: the bytes must not depend on workers.
    ordered = [f for s in sorted(done) for f in done[s]]
    write_shard(out_dir / "shards" / f"{shard_name(k)}.npz", ordered, shard_meta)
    # A line per shard: which process of a launcher wrote which shard (tests/scaling reads it).
    log.info("wrote %s (scenes %d..%d)", shard_name(k), lo, hi - 1)


def render_shards(
    out_dir: Path,
    n_scenes: int,
    scenes_per_shard: int,
    seed: int,
    make_frames: MakeFrames,
    meta: dict,
    workers: int = 1,
    shard_range: tuple[int, int] | None = None,
    progress: bool = True,
    on_checked: Callable[[], None] | None = None,
) -> dict:
    """Render the missing shards of a dataset (resuming), then write its manifest.

    Shard ``k`` holds scenes ``[k * scenes_per_shard, (k + 1) * scenes_per_shard)``.
    Shards of ``shard_range`` that are finished and intact are kept; corrupt ones are
    named in a warning and rendered again; the rest are rendered with ``make_frames``
    (see the module docstring for its seeding and picklability rules). When every shard
    of the dataset is finished (possibly by other launchers for other ranges), the
    manifest is written.

    Args:
        out_dir: the dataset folder; created if needed.
        n_scenes: number of scenes in the whole dataset.
        scenes_per_shard: scenes per shard (the last shard may hold fewer).
        seed: the dataset seed; scene ``i`` uses ``SeedSequence([seed, i])``.
        make_frames: ``make_frames(i) -> list[FrameRecord]``, the frames of scene ``i``.
        meta: dataset description, :data:`REQUIRED_META` at least; copied into the
            manifest (so it must not hold timestamps or worker counts).
        workers: rendering processes (1 = render in this process).
        shard_range: ``(a, b)``: render only shards ``a .. b-1`` (launchers fanning out).
        progress: report the scenes rendered (a bar at a terminal, a line every few percent otherwise).
        on_checked: called once the folder passed every check, before anything is rendered.

    Returns:
        The manifest when the whole dataset is finished; otherwise (a ``shard_range``
        whose siblings are not done yet) a summary ``{"complete": False, "shards": [a, b],
        "rendered": [names], "reused": [names], "missing": [names outside the range]}``.

    Raises:
        OutputDirError: ``out_dir`` cannot be written (before any rendering).
        SceneRenderError: ``make_frames`` failed for a scene; finished shards are kept.
        OSError: a shard write failed (``ENOSPC`` with advice); no partial shard remains.
        DatasetError: ``out_dir`` holds shards of another seed/config/profile.
    """
    out_dir = Path(out_dir)
    expected, n_shards, (a, b) = _expected(meta, n_scenes, scenes_per_shard, seed, workers, shard_range)

    _check_writable(out_dir)
    _remove_stale_temp_files(out_dir, range(a, b), whole=(a, b) == (0, n_shards))
    # Raises before anything is changed when the folder holds another run's shards.
    todo = [k for k in range(a, b) if not _shard_ready(out_dir, k, expected, full_check=True)]
    if on_checked is not None:  # e.g. the CLI's config.yaml: written only into a folder this run may use
        on_checked()
    _drop_outdated_manifest(out_dir, expected)
    reused = [shard_name(k) for k in sorted(set(range(a, b)) - set(todo))]
    if reused:
        log.info("resuming: %d of %d shards already finished", len(reused), b - a)

    def scenes_of(k: int) -> range:
        return range(*shard_scenes(k, n_scenes, scenes_per_shard))

    scenes = [i for k in todo for i in scenes_of(k)]
    in_range = sum(len(scenes_of(k)) for k in range(a, b))
    rendered: list[str] = []
    pending: dict[int, dict[int, list[FrameRecord]]] = {k: {} for k in todo}
    with (
        progress_bar(total=in_range, initial=in_range - len(scenes), unit="scene", desc="render",
                     disable=not progress) as bar,
        closing(_scene_results(make_frames, scenes, workers)) as results,
    ):
        for i, frames in results:
            k = i // scenes_per_shard
            pending[k][i] = frames
            if len(pending[k]) == len(scenes_of(k)):
                _write_finished(out_dir, k, pending.pop(k), expected)
                rendered.append(shard_name(k))
                bar.set_postfix_str(f"{len(reused) + len(rendered)}/{b - a} shards written")
            bar.update(1)

    outside = [k for k in range(n_shards) if not a <= k < b]
    missing = [shard_name(k) for k in outside if not _shard_ready(out_dir, k, expected, full_check=False)]
    if missing:
        log.info("manifest not written yet: %d shard(s) outside %s unfinished", len(missing), [a, b])
        return {
            "complete": False,
            "shards": [a, b],
            "rendered": sorted(rendered),
            "reused": reused,
            "missing": missing,
        }
    log.info("%d shard(s) rendered, %d kept; writing the manifest", len(rendered), len(reused))
    return build_manifest(out_dir, expected)
