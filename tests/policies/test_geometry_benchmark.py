"""``benchmarks/geometry.py --cell``: the geometry network measured on a cell's own labelled frames.

A cell here is two frames written into ``tmp_path`` with their label files, as
``make_real_frames.py --geometry`` writes them: a bin with two parts on the table, seen
through the packaged calibration, heights that change from pixel to pixel (so that labels
sampled any other way than the frame's nearest raw pixel would not match).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from scripts import load_script

from perception.core.calibration import Calibration, default_calibration_path, project_points
from perception.core.geometry import SurfaceRebuild, make_view
from perception.core.imageio import write_image
from perception.core.preprocess import view_maps

ROOT = Path(__file__).resolve().parents[2]
FRAME_SIZE = (320, 240)  # half the calibration's image_size: the benchmark scales it as the service does


bench = load_script("benchmarks/geometry.py", "bench_geometry")


def _scene(calib: Calibration, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``height`` float16 and ``label`` uint8 of one raw frame: table, a walled bin, two parts."""
    w, h = FRAME_SIZE
    cal = calib.scaled(FRAME_SIZE)
    cx, cy = project_points(np.array([[0.5, 0.0, calib.table_z]]), cal)[0]
    cx, cy = int(cx + rng.integers(-8, 9)), int(cy + rng.integers(-8, 9))
    label = np.full((h, w), bench.TABLE, np.uint8)
    height = rng.uniform(0.0, 0.002, (h, w))
    label[cy - 50:cy + 50, cx - 70:cx + 70] = bench.BIN_WALL
    height[cy - 50:cy + 50, cx - 70:cx + 70] = 0.04 + rng.uniform(-0.003, 0.003, (100, 140))
    label[cy - 44:cy + 44, cx - 64:cx + 64] = bench.BIN_FLOOR
    height[cy - 44:cy + 44, cx - 64:cx + 64] = rng.uniform(0.004, 0.006, (88, 128))
    for dx, dy, top in ((-30, -10, 0.03), (25, 12, 0.05)):
        sl = np.s_[cy + dy - 12:cy + dy + 12, cx + dx - 15:cx + dx + 15]
        label[sl] = bench.PART
        height[sl] = top + rng.uniform(-0.004, 0.004, (24, 30))
    label[:12, :16] = bench.NOTHING  # rays that meet nothing
    height[:12, :16] = np.nan
    return height.astype(np.float16), label


@pytest.fixture
def cell(tmp_path) -> Path:
    d = tmp_path / "cell"
    (d / "real").mkdir(parents=True)
    (d / "geometry").mkdir()
    shutil.copy(default_calibration_path(), d / "calibration.json")
    calib = Calibration.load(d / "calibration.json")
    rng = np.random.default_rng(0)
    for i in range(2):
        height, label = _scene(calib, rng)
        rgb = rng.integers(0, 256, (FRAME_SIZE[1], FRAME_SIZE[0], 3), dtype=np.uint8)
        rgb[label == bench.PART] = (200, 120, 40)
        write_image(d / "real" / f"{i:05d}.png", rgb)
        np.savez_compressed(d / "geometry" / f"{i:05d}.npz", height=height, label=label)
    return d


class Oracle:
    """A geometry that "predicts" the true height and part mask of the frame it is given, sampled
    into its view at the raw pixel nearest to where :func:`preprocess` samples the frame (its own
    ``np.rint`` look-up, not the benchmark's), plus ``offset`` metres."""

    part_threshold = 0.5
    name = "oracle"

    def __init__(self, cell: Path, offset: float = 0.0) -> None:
        from perception.core.imageio import read_image

        self.offset = offset
        self.truth = {}
        for f in sorted((cell / "real").iterdir()):
            with np.load(cell / "geometry" / f"{f.stem}.npz") as z:
                self.truth[read_image(f).tobytes()] = (z["height"].astype(np.float32), z["label"])

    def view(self, calib):
        return make_view(calib, (80, 60), "camera", margin=0.03)

    def rebuild(self, calib):
        return SurfaceRebuild(calib, self.view(calib), make_view(calib, (48, 48), "table"), 0.01, 0.0072)

    def predict(self, raw, calib):
        height, label = self.truth[raw.tobytes()]
        h, w = label.shape
        mx, my = view_maps(calib.scaled((w, h)), self.view(calib))
        ix, iy = np.rint(mx).astype(int), np.rint(my).astype(int)
        inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h)
        hv = np.where(inside, height[iy.clip(0, h - 1), ix.clip(0, w - 1)], np.nan)
        part = inside & (label[iy.clip(0, h - 1), ix.clip(0, w - 1)] == bench.PART)
        return hv + self.offset, part.astype(np.float32)


def _run(cell: Path, geom) -> dict:
    return bench.run(bench.parser().parse_args(["--cell", str(cell)]), geom=geom)


def test_a_network_that_returns_the_true_height_scores_zero(cell):
    res = _run(cell, Oracle(cell))
    s = res["cells"][str(cell)]
    assert s["frames"] == 2 and s["part_pixels"] > 100 and s["rest_pixels"] > 1000
    assert s["part_median_mm"] < 1e-6 and s["part_p90_mm"] < 1e-6 and s["rest_p90_mm"] < 1e-6
    assert s["part_within_5mm"] == 1.0 and s["part_iou"] == 1.0
    # both top-down surfaces are rebuilt the same way: their part edges are the same cells
    assert s["topdown_edge_median_mm"] == 0.0 and s["topdown_edge_p90_mm"] == 0.0
    assert res["pooled"] == s
    # The results page's table (--write) shows those figures, a row a cell.
    table = bench.results_table(res, "the oracle")
    assert f"| {cell.name} (2) | 0.0 / 0.0 mm | 100% | 1.00 | 0.0 mm |" in table and "the oracle" in table


def test_write_without_a_cell_exits_2_and_writes_nothing(capsys):
    page = ROOT / "docs" / "results.md"
    before = page.read_text()
    assert bench.main(["--sim", "1", "--write"]) == 2
    assert "give --cell DIR" in capsys.readouterr().err and page.read_text() == before


def test_a_network_10_mm_too_high_scores_10_mm(cell):
    s = _run(cell, Oracle(cell, offset=0.010))["pooled"]
    assert s["part_median_mm"] == pytest.approx(10.0, abs=0.05)
    assert s["part_p90_mm"] == pytest.approx(10.0, abs=0.05) and s["rest_p90_mm"] == pytest.approx(10.0, abs=0.05)
    assert s["part_within_5mm"] == 0.0 and s["part_iou"] == 1.0


def test_the_benchmark_prints_one_json_line_with_its_keys_and_draws_only_when_asked(cell, tmp_path, capsys):
    assert bench.main(["--geometry", "geometry_base_v2", "--cell", str(cell), "--cell", str(cell)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = {"part_median_mm", "part_p90_mm", "part_within_5mm", "part_iou", "rest_p90_mm", "frames",
            "topdown_edge_median_mm", "topdown_edge_p90_mm"}
    assert set(out) == {"cells", "pooled"} and list(out["cells"]) == [str(cell)]
    assert keys <= set(out["cells"][str(cell)]) and keys <= set(out["pooled"])
    assert 0.0 <= out["pooled"]["part_within_5mm"] <= 1.0 and 0.0 <= out["pooled"]["part_iou"] <= 1.0
    assert not list(tmp_path.rglob("*panel*"))
    panel = tmp_path / "panel.png"
    assert bench.main(["--cell", str(cell), "--panel", str(panel)]) == 0
    assert panel.stat().st_size > 0


def test_a_folder_that_is_not_a_cell_exits_2_with_a_message(cell, capsys):
    shutil.rmtree(cell / "geometry")
    assert bench.main(["--cell", str(cell)]) == 2
    err = capsys.readouterr().err
    assert "not a labelled cell" in err and "geometry" in err and "make_real_frames.py" in err


def test_a_frame_without_its_label_file_exits_2(cell, capsys):
    (cell / "geometry" / "00001.npz").unlink()
    assert bench.main(["--cell", str(cell)]) == 2
    assert "real/00001.png" in capsys.readouterr().err


def test_the_edge_distance_is_symmetric_so_a_map_full_of_edges_scores_badly():
    true = np.zeros((40, 40), bool)
    true[10:30, 10:30] = True
    assert np.all(bench.edge_distances_mm(true, true, 5.0) == 0)
    checker = (np.indices((40, 40)).sum(axis=0) % 2).astype(bool)  # an edge in every cell
    d = bench.edge_distances_mm(true, checker, 5.0)
    assert np.median(d[:int(bench.part_edges(true).sum())]) <= 5.0  # every true edge has a predicted one close by
    assert np.percentile(d, 90) > 25.0  # but most predicted edges are far from any true one
    assert np.all(bench.edge_distances_mm(true, np.zeros_like(true), 5.0) == pytest.approx(np.hypot(40, 40) * 5.0))
