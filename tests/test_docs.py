"""The documentation's generated reference (docs/gen_reference.py): complete, current, and read
from the YAML and the source as they are."""

from __future__ import annotations

from pathlib import Path

from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
gen = load_script("docs/gen_reference.py", "gen_reference")  # docs/ is not a package


def test_every_installed_command_has_its_options_documented():
    assert sorted(gen.COMMANDS) == gen.scripts()
    for names in gen.COMMANDS.values():
        assert all((gen.CONF / f"{n}.yaml").is_file() for n in names)


def test_the_generated_pages_are_current():
    assert gen.main(["--check"]) == 0, "run: python docs/gen_reference.py"


def test_a_comment_is_read_beside_above_and_continued(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# the header\n#   cmd key=value\n\n"
                    "a: 1          # metres, the first\n"
                    "              # and its second line\n"
                    "# the section's own words\n"
                    "b:\n"
                    "  c: 'x # y'  # seconds\n"
                    "              # and more\n"
                    "  d: 2\n")
    comments, header = gen.yaml_comments(path)
    assert header == ["the header", "cmd key=value"]
    assert comments == {"a": "metres, the first and its second line", "b": "the section's own words",
                        "b.c": "seconds and more"}
    rows, _defaults, _header = gen.option_table(path)
    assert "| `b.c` | `x # y` | seconds and more |" in rows and "| `b.d` | `2` |  |" in rows


def test_error_messages_are_found_where_they_are_raised():
    found = {(f, where, kind, text) for f, where, kind, text in gen.error_messages()}
    assert ("perception/core/calibration.py", "Calibration.load", "CalibrationError",
            "calibration file not found: …") in found
    # Every command's own exit messages (fail, CliError) are there too.
    assert any(kind in ("fail", "CliError") for _f, _w, kind, _t in found)


def test_every_error_message_says_what_to_do():
    missing = gen.without_remedy()
    assert not missing, f"write what to do about these in docs/remedies.yaml: {missing[:5]}"
    known = gen.remedies()
    # A message that neither says what to do nor has a remedy is caught; one that says it is not.
    assert gen.what_to_do("x.py", "NewError", "the frobnicator broke", known) is None
    assert gen.what_to_do("x.py", "NewError", "width must be positive", known) == "as the message says"
    # A remedy by type, one by file and type before it, and the internal checks' own words.
    assert gen.what_to_do("x.py", "ArtifactError", "artifact directory not found: …", known) == known["ArtifactError"]
    assert gen.what_to_do("perception/core/jsonio.py", "ValueError", "…: not valid JSON (…)", known) == \
        known["perception/core/jsonio.py:ValueError"]
    assert gen.what_to_do("perception/core/geometry.py", "ValueError", "maps", known) == gen.INTERNAL_TEXT
    assert gen.what_to_do("perception/core/geometry.py", "ValueError", "x must be 1", known) == "as the message says"
    assert all(v for v in known.values())


# The lab notebook apart from the pages that say how things work (issue 39): a page that
# explains stays short enough to read, and every dated experiment is found from the index.
DOCS = ROOT / "docs"
EXPERIMENTS = DOCS / "experiments"
MAX_PAGE_LINES = 300


def test_no_page_outside_the_notebook_and_the_reference_is_over_300_lines():
    long = {}
    for page in DOCS.rglob("*.md"):
        if page.parent in (EXPERIMENTS, DOCS / "reference"):
            continue
        n = len(page.read_text().splitlines())
        if n > MAX_PAGE_LINES:
            long[str(page.relative_to(ROOT))] = n
    assert not long, f"over {MAX_PAGE_LINES} lines (measurements go to docs/experiments/): {long}"


def test_every_experiment_is_linked_from_the_notebook_index():
    index = (EXPERIMENTS / "index.md").read_text()
    pages = sorted(p.name for p in EXPERIMENTS.glob("*.md") if p.name != "index.md")
    assert pages, "docs/experiments/ holds no experiment"
    assert [p for p in pages if f"]({p})" not in index] == []


def test_every_experiment_is_dated_and_states_its_result():
    for page in EXPERIMENTS.glob("*.md"):
        if page.name == "index.md":
            continue
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), f"{page.name}: starts with its # title"
        assert any(line.startswith("Result: ") for line in lines), f"{page.name}: no 'Result:' line"
        assert page.name[:10].count("-") == 2 and page.name[:4].isdigit(), f"{page.name}: YYYY-MM-DD-name.md"
