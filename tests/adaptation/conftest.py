"""Fixtures for the adaptation tests: a tiny sim dataset and a folder of 'real' frames.

They are rendered with ``sim_render.api`` (randomized profile for sim, the ``target`` profile
exported to PNG for real) when the renderer is available; otherwise a synthetic OpenCV
stand-in (``tests/adaptation/adapt_synthetic.py``) is written and ``SimFrameDataset`` is pointed at
it for the duration of each test.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch


def _load_synthetic():
    # tests/ is not a package and pytest does not put this folder on sys.path: load by path
    import importlib.util

    path = Path(__file__).with_name("adapt_synthetic.py")
    spec = importlib.util.spec_from_file_location("adapt_synthetic", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("adapt_synthetic", mod)
    spec.loader.exec_module(mod)
    return sys.modules["adapt_synthetic"]


synthetic = _load_synthetic()


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _render(root: Path) -> tuple[Path, Path] | None:
    """Render with the real renderer; None (and a warning) when it cannot, or when
    ``ADAPT_TESTS_SYNTHETIC=1`` asks for the synthetic stand-in. The renderer has its own
    tests: these test the adaptation, so a renderer failure must not hide them."""
    if os.environ.get("ADAPT_TESTS_SYNTHETIC") == "1":
        return None
    try:
        from sim_render.api import export_real_frames, render_dataset

        render_dataset(root / "sim", n_scenes=2, profile="randomized", seed=0)
        render_dataset(root / "target", n_scenes=2, profile="target", seed=1)
        export_real_frames(root / "target", root / "real")
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"adaptation tests use synthetic frames: the renderer failed: {exc!r}"[:500], stacklevel=1)
        return None
    return root / "sim", root / "real"


@pytest.fixture(scope="session")
def _adapt_data(tmp_path_factory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("adapt_data")
    dirs = _render(root)
    if dirs is not None:
        return dirs[0], dirs[1], "render"
    sim = synthetic.write_sim_dataset(root / "sim", n_frames=8, seed=0)
    real = synthetic.write_real_frames(root / "real", n_frames=8, seed=1)
    return sim, real, "synthetic"


@pytest.fixture
def adapt_dirs(_adapt_data, monkeypatch) -> tuple[Path, Path]:
    """``(sim_dir, real_dir)`` readable through ``sim_render.reader.SimFrameDataset``."""
    sim, real, kind = _adapt_data
    if kind == "synthetic":
        try:
            import sim_render.reader as mod

            monkeypatch.setattr(mod, "SimFrameDataset", synthetic.SyntheticFrameDataset)
        except ImportError:
            fake = types.ModuleType("sim_render.reader")
            fake.SimFrameDataset = synthetic.SyntheticFrameDataset
            monkeypatch.setitem(sys.modules, "sim_render.reader", fake)
    return sim, real
