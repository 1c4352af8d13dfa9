"""The object set: PyBullet's procedural ``random_urdfs`` (contract section 3).

Directories whose number ends in 0 are the held-out test objects, ``*[1-9]`` the
training objects. Objects are used at their URDF scale.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pybullet_data

__all__ = ["SPLITS", "object_urdfs"]

SPLITS = ("train", "test")


@functools.lru_cache(maxsize=4)
def object_urdfs(split: str) -> tuple[str, ...]:
    """Sorted URDF paths of one split.

    Args:
        split: ``"train"`` (directories ``*[1-9]``) or ``"test"`` (``*0``).

    Raises:
        ValueError: for an unknown split name.
        FileNotFoundError: when pybullet_data has no random_urdfs.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown object split {split!r}; known: {list(SPLITS)}")
    root = Path(pybullet_data.getDataPath()) / "random_urdfs"
    if not root.is_dir():
        raise FileNotFoundError(f"pybullet_data has no random_urdfs at {root}")
    out = []
    for d in sorted(root.iterdir()):
        if not d.name.isdigit():
            continue
        urdf = d / f"{d.name}.urdf"
        if not urdf.is_file():
            continue
        is_test = d.name.endswith("0")
        if is_test == (split == "test"):
            out.append(str(urdf))
    return tuple(out)
