"""The benchmark scripts keep ``docs/results.md`` current: each owns one block of it.

A block sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``; the page says
where each goes and what it means, the script writes what is between (a table and the
command, commit and date that measured it) when run with ``--write``. The blocks and their
scripts (``tests/test_results_doc.py`` checks each block has its writer):

- ``transfer``: ``benchmarks/transfer.py`` (the validation cells' closed loop);
- ``geometry``: ``benchmarks/geometry.py`` (the geometry network on the cells' frames);
- ``refine``: ``benchmarks/refine.py --replay`` (the camera refinement on twin cells);
- ``service``: ``benchmarks/service.py`` (the grasp service's latency and memory).
"""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

from perception.core.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
#: Which script writes each block (the test reads this).
WRITERS = {"transfer": "benchmarks/transfer.py", "geometry": "benchmarks/geometry.py", "refine": "benchmarks/refine.py",
           "service": "benchmarks/service.py"}
_BLOCK = re.compile(r"<!-- results:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)


class ResultsDocError(ValueError):
    """The page has no block of that name (its markers were removed or misspelt)."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- results:{name} -->", f"<!-- /results:{name} -->"


def blocks(doc: Path = RESULTS) -> dict[str, str]:
    """Every block of ``doc``: name -> what is between its markers."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(doc.read_text(encoding="utf-8"))}


def commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=False).stdout.strip()
    return out or "unknown"


def write_block(name: str, text: str, command: str, doc: Path = RESULTS) -> None:
    """Replace block ``name`` of ``doc`` with ``text`` and the line saying how it was measured.

    The page is written whole beside the old one and moved over it (:func:`atomic_write_text`):
    a stopped script leaves the old page, never half a new one.

    Raises:
        ResultsDocError: ``doc`` has no block ``name``.
    """
    begin, end = markers(name)
    page = doc.read_text(encoding="utf-8")
    if begin not in page or end not in page or page.index(begin) > page.index(end):
        raise ResultsDocError(f"{doc} has no block '{name}' (the lines {begin} and {end}): put them where the "
                              "results go, then run the script again")
    body = (f"Measured by `{command}` at commit `{commit()}` on {datetime.date.today().isoformat()}.\n\n"
            f"{text.strip()}\n")
    atomic_write_text(doc, page[:page.index(begin) + len(begin)] + "\n" + body + page[page.index(end):])
