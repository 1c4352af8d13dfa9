"""``benchmarks/variants.py``: the metadata variants it serves and the paired figures it prints
(the closed loop itself needs the validation cell, which CI does not have)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scripts import load_script

from perception.core.artifact import ArtifactError, load_metadata

_bench = load_script("benchmarks/variants.py", "bench_variants")  # benchmarks/ is not an installed package


def test_a_variant_changes_only_the_keys_it_names_and_is_checked_by_the_loader(tmp_path, artifact_dir):
    out = _bench.patched(artifact_dir, tmp_path / "v", {"quality_threshold": 0.42, "decode.width_margin": None,
                                                         "decode.neighbourhood_px": 2})
    meta, src = json.loads((out / "metadata.json").read_text()), json.loads((artifact_dir / "metadata.json").read_text())
    assert meta["quality_threshold"] == 0.42 and "width_margin" not in meta["decode"]
    assert meta["decode"]["neighbourhood_px"] == 2 and meta["onnx_sha256"] == src["onnx_sha256"]
    assert load_metadata(out).decode["width_margin"] == 0.0  # removed: the loader's default
    with pytest.raises(ArtifactError, match="rule_first"):  # no geometry, no surface: refused before serving
        _bench.patched(artifact_dir, tmp_path / "w", {"decode.rule_first": 0.05})


def test_the_difference_is_paired_by_episode():
    base = {(0, e): [e % 2, 2, 0] for e in range(30)}
    same = _bench.figures(dict(base), base, np.random.default_rng(0))
    assert same["minus_base"] == 0.0 and same["interval"] == [0.0, 0.0]  # the same episodes: no spread at all
    better = {k: [v[0] + (k[1] < 6), v[1], v[2]] for k, v in base.items()}
    f = _bench.figures(better, base, np.random.default_rng(0))
    assert f["successes"] == 21 and f["attempts"] == 60 and f["minus_base"] == pytest.approx(0.1)
    assert f["no_grasp"] == 0
    assert 0.0 < f["interval"][0] < 0.1 < f["interval"][1]


def test_a_serve_key_goes_to_the_service_and_leaves_the_artifact_alone():
    meta, serve = _bench.split_variant({"serve:repeats.radius": 0.03, "decode.width_margin": 0.02,
                                        "serve:repeats.yaw_deg": 90})
    assert meta == {"decode.width_margin": 0.02}
    assert serve == {"repeats.radius": 0.03, "repeats.yaw_deg": 90}
    assert _bench.split_variant({"serve:repeats.memory": 0}) == ({}, {"repeats.memory": 0})  # the artifact as it is


def test_another_runs_artifact_needs_one_folder_per_cell_and_a_name_of_its_own(tmp_path, artifact_dir, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "calibration.json").write_text("{}")
    (run / "artifact").symlink_to(artifact_dir)
    common = ["--cell", str(tmp_path / "cell"), "--work", str(tmp_path / "work"), "--run", f"0:{run}", "--run", f"1:{run}"]
    assert _bench.main([*common, "--other", f"v2=0:{run}"]) == 2  # cell 1 has no folder: not paired
    assert "one folder for each --run cell [0, 1]" in capsys.readouterr().err
    assert _bench.main([*common, "--other", f"base=0:{run}", "--other", f"base=1:{run}"]) == 2
    assert "NAME not 'base'" in capsys.readouterr().err
    assert _bench.main([*common, "--other", f"v2=0:{run}", "--other", f"v2=1:{tmp_path / 'none'}"]) == 2
    assert "needs" in capsys.readouterr().err and not (tmp_path / "work").exists()  # nothing served
