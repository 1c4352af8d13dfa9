"""The one JSON writer: what every report, metadata file and shard index is written with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from perception.core.jsonio import dumps_json, to_jsonable, write_json


def _strict_loads(text: str):
    """Parse as a strict JSON reader would (no NaN / Infinity)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_a_report_with_missing_metrics_is_still_json(tmp_path):
    report = {"success": np.float32(0.25), "auc": float("nan"), "worst": -math.inf, "n": np.int64(3),
              "curve": np.array([0.5, np.nan]), "dir": tmp_path, "cfg": OmegaConf.create({"a": [1, 2]}),
              ("tuple",): (1, 2), "when": object}
    write_json(tmp_path / "r.json", report)
    back = _strict_loads((tmp_path / "r.json").read_text())
    assert back["success"] == 0.25 and back["n"] == 3 and back["auc"] is None and back["worst"] is None
    assert back["curve"] == [0.5, None] and back["dir"] == str(tmp_path) and back["cfg"] == {"a": [1, 2]}
    assert back["('tuple',)"] == [1, 2] and back["when"] == str(object)
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary left


def test_data_files_refuse_what_they_cannot_store(tmp_path):
    with pytest.raises(ValueError, match="non-finite"):
        dumps_json({"x": [1.0, float("inf")]}, strict=True)
    with pytest.raises(TypeError, match="object"):
        to_jsonable({"x": object()}, strict=True)
    path = tmp_path / "index.json"
    path.write_text("old\n")
    with pytest.raises(ValueError):
        write_json(path, {"x": float("nan")}, strict=True)
    assert path.read_text() == "old\n"  # a refused write leaves the old file


def test_sorted_keys_give_the_same_bytes_for_the_same_content():
    a = dumps_json({"b": 1, "a": {"d": np.float64(2.5), "c": Path("p")}}, sort_keys=True)
    b = dumps_json({"a": {"c": "p", "d": 2.5}, "b": 1}, sort_keys=True)
    assert a == b and a.endswith("}\n")


def test_read_json_reads_what_write_json_wrote_and_names_a_broken_file(tmp_path):
    from perception.core.jsonio import read_json

    good = tmp_path / "good.json"
    write_json(good, {"a": [1, 2.5], "b": None})
    assert read_json(good) == {"a": [1, 2.5], "b": None}
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        read_json(bad)
    with pytest.raises(OSError):
        read_json(tmp_path / "missing.json")
