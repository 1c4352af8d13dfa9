"""Progress without a terminal is a few lines, with one a bar (perception.core.progress)."""

from __future__ import annotations

import io
from pathlib import Path

from omegaconf import OmegaConf

from perception.core.progress import PercentLog, line_every_percent, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_a_long_loop_writes_a_line_every_few_percent():
    out = io.StringIO()  # a log file: no terminal
    for _ in progress(range(10_000), desc="render", unit="scene", stream=out):
        pass
    lines = out.getvalue().splitlines()
    assert len(lines) <= 100 / line_every_percent() + 2, lines
    assert "\r" not in out.getvalue()  # no redraws
    first = int(10_000 * line_every_percent() / 100)
    assert lines[0].startswith(f"render: {first}/10000 scene ({line_every_percent():.0f}%")
    assert lines[-1].startswith("render: 10000/10000 scene done")


def test_the_step_is_conf_progress_yaml():
    """One source: conf/progress.yaml (a number the YAML sets, not a copy in Python)."""
    conf = Path(__file__).resolve().parents[2] / "conf" / "progress.yaml"
    assert line_every_percent() == float(OmegaConf.load(conf).line_every_percent)


def test_updates_by_hand_cross_several_thresholds_in_one_line_and_close_once():
    out = io.StringIO()
    with progress(total=100, initial=5, desc="shards", stream=out) as bar:
        bar.update(50)  # 5 -> 55: past several thresholds, one line
        bar.set_postfix_str("3/4 shards written")
        bar.update(45)
    bar.close()  # closing twice writes nothing more
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "55/100" in lines[0] and "done" in lines[1], lines
    assert lines[1].endswith(", 3/4 shards written")  # the running summary rides on the line


def test_at_a_terminal_it_is_a_tqdm_bar():
    from tqdm import tqdm

    term = _Terminal()
    bar = progress(range(50), desc="render", stream=term)
    assert isinstance(bar, tqdm) and not isinstance(bar, PercentLog)
    for _ in bar:
        pass
    assert "render" in term.getvalue() and "50/50" in term.getvalue()


def test_disabled_it_writes_nothing():
    out = io.StringIO()
    assert list(progress(range(3), disable=True, stream=out)) == [0, 1, 2]
    with progress(total=10, disable=True, stream=out) as bar:
        bar.update(10)
    assert out.getvalue() == ""
