"""docs/results.md is kept current by the benchmark scripts (benchmarks/results_doc.py): each
block has the script that writes it, and writing one block leaves the rest of the page as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
results_doc = load_script("benchmarks/results_doc.py", "results_doc")  # benchmarks/ is not a package


def test_every_block_of_the_results_page_has_its_script_and_each_script_writes_it():
    found = results_doc.blocks()
    assert set(found) == set(results_doc.WRITERS), "a block without a writer, or a writer without its block"
    for name, script in results_doc.WRITERS.items():
        source = (ROOT / script).read_text(encoding="utf-8")
        assert f'write_block("{name}"' in source, f"{script} does not write block {name}"
        assert '"--write"' in source


def test_writing_a_block_replaces_it_alone_and_says_how_it_was_measured(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nby hand\n\n<!-- results:a -->\nold a\n<!-- /results:a -->\n\n"
                    "<!-- results:b -->\nold b\n<!-- /results:b -->\ntail\n")
    results_doc.write_block("a", "| x |\n|---|\n| 1 |", "python benchmarks/x.py --write", doc=page)
    text = page.read_text()
    assert "old a" not in text and "| 1 |" in text and "old b" in text
    assert text.startswith("# Results\n\nby hand\n") and text.endswith("<!-- /results:b -->\ntail\n")
    assert "Measured by `python benchmarks/x.py --write` at commit" in results_doc.blocks(page)["a"]
    results_doc.write_block("a", "| 2 |", "again", doc=page)  # twice: still one block, the newest
    assert results_doc.blocks(page)["a"].count("Measured by") == 1 and "| 2 |" in page.read_text()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_page_without_the_block_is_refused_and_left_as_it_was(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n")
    with pytest.raises(results_doc.ResultsDocError, match="no block 'geometry'"):
        results_doc.write_block("geometry", "| 1 |", "cmd", doc=page)
    assert page.read_text() == "# Results\n"
