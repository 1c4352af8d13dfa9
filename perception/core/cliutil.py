"""Small helpers shared by the console scripts (no torch here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["arg_value", "check_writable_dir_args", "fail", "format_number"]


def fail(prog: str, message: str, code: int = 2) -> None:
    """Print ``prog: error: message`` to stderr and exit with ``code`` (never 0)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


def arg_value(argv: list[str], key: str) -> str | None:
    """The value of a ``key=value`` command-line override (last one wins)."""
    value = None
    for a in argv:
        if a.startswith(key + "="):
            value = a.split("=", 1)[1]
    return value


def check_writable_dir_args(prog: str, argv: list[str], keys: tuple[str, ...] = ("output_dir",)) -> None:
    """Refuse, before Hydra creates its run folder there, an output folder that cannot be written."""
    for key in keys:
        value = arg_value(argv, key)
        if value in (None, "", "null"):
            continue
        path = Path(value)
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            fail(prog, f"{key}={value} is not writable: {probe} is not a folder")
        if not os.access(probe, os.W_OK | os.X_OK):
            fail(prog, f"{key}={value} is not writable (no write permission on {probe})")


def format_number(v: Any, digits: int = 3) -> str:
    """A score for a summary line or a report table: ``n/a`` when missing, floats with
    ``digits`` decimals."""
    return "n/a" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)
