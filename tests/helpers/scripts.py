"""The repository's scripts (``benchmarks/*.py``, ``docs/gen_reference.py``) loaded as modules.

They are folders of scripts, not installed packages, so a test loads one from its file.
Imported by name (``pyproject.toml``: ``pythonpath``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative_path: str, name: str) -> ModuleType:
    """The script at ``ROOT/relative_path`` as the module ``name``, registered in ``sys.modules``
    (its dataclasses and pickled objects look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
