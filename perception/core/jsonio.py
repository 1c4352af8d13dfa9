"""One JSON writer for every file the project writes (reports, metadata, run markers, shards).

Python's ``json`` writes ``NaN`` and ``Infinity``, which are not JSON (a browser, ``jq`` or
another language's parser refuses the whole file), and refuses numpy scalars. Every writer
goes through :func:`to_jsonable`, so the rules are the same everywhere:

- numpy scalars and arrays become Python numbers and lists, tuples lists, paths strings,
  dictionary keys strings, OmegaConf containers plain ones;
- a non-finite float becomes ``null`` in a report (a metric with no value yet), and is an
  error where the file is data (``strict=True``: shard metadata);
- any other object is written as its ``str`` in a report, and is an error with ``strict``.

:func:`read_json` reads one back, naming the file when it is not JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from perception.core.atomic import atomic_write_text

__all__ = ["dumps_json", "read_json", "to_jsonable", "write_json"]


def to_jsonable(value: Any, strict: bool = False) -> Any:
    """``value`` as plain JSON types (recursively; the rules in the module docstring).

    Raises:
        ValueError: with ``strict``, a non-finite number.
        TypeError: with ``strict``, an object JSON has no type for.
    """
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, strict) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v, strict) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist(), strict)
    if isinstance(value, np.generic):
        return to_jsonable(value.item(), strict)
    if isinstance(value, float) and not math.isfinite(value):
        if strict:
            raise ValueError(f"non-finite number {value} cannot be stored")
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return str(value)
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf  # lazy: omegaconf (optional dependency)

        if isinstance(value, DictConfig | ListConfig):
            return to_jsonable(OmegaConf.to_container(value, resolve=True), strict)
    except ImportError:  # pragma: no cover - omegaconf is a dependency of every install
        pass
    if strict:
        raise TypeError(f"value of type {type(value).__name__} is not JSON-serialisable: {value!r}")
    return str(value)


def dumps_json(obj: Any, indent: int | None = 1, sort_keys: bool = False, strict: bool = False) -> str:
    """The text of ``obj`` as a JSON file: :func:`to_jsonable`, never ``NaN``, a final newline.

    ``sort_keys`` (with the fixed separators) gives the same bytes for the same content.
    """
    return json.dumps(to_jsonable(obj, strict), indent=indent, sort_keys=sort_keys, allow_nan=False) + "\n"


def write_json(path: str | Path, obj: Any, indent: int | None = 1, sort_keys: bool = False,
               strict: bool = False) -> None:
    """Write :func:`dumps_json` of ``obj`` to ``path`` atomically (the old file or the new, never half)."""
    atomic_write_text(Path(path), dumps_json(obj, indent, sort_keys, strict))


def read_json(path: str | Path) -> Any:
    """The contents of the JSON file ``path``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON (or not UTF-8, or nested too deep for the parser); the
            message names the file and where it breaks.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    except RecursionError as exc:  # [[[...]]] deeper than the parser's stack: not a file we wrote
        raise ValueError(f"{path}: not valid JSON (nested too deep)") from exc
