"""Drivers other packages register for the robot applications.

This floor never names a higher package, by import or by string. The simulated cell lives in
``sim_render`` (PyBullet, the training install) and registers itself through entry points
(``pyproject.toml``): a camera under ``sim2real_grasp.cameras``, a robot adapter under
``sim2real_grasp.robots``, and the cell a sim camera and a sim robot share under
``sim2real_grasp.cells``, each by name (``sim``). On a robot-only install the names are still
registered, but their code cannot be imported: ``camera=sim`` then answers with a message
saying so, not a traceback.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, distributions
from typing import Any

__all__ = ["GROUPS", "PluginError", "load_registered", "registered"]

#: Kinds of driver -> entry-point group.
GROUPS = {"cameras": "sim2real_grasp.cameras", "robots": "sim2real_grasp.robots", "cells": "sim2real_grasp.cells"}


class PluginError(ValueError):
    """A registered driver that cannot be loaded here (bad input to the command: exit 2)."""


@cache
def registered(kind: str) -> dict[str, EntryPoint]:
    """The drivers registered for ``kind`` (``cameras``, ``robots``, ``cells``), by name.

    Every installed distribution is read (``entry_points()`` keeps only the first of a name,
    which may be a stale ``*.egg-info`` left in a source tree)."""
    group, found = GROUPS[kind], {}
    for dist in distributions():
        for ep in dist.entry_points:
            if ep.group == group:
                found.setdefault(ep.name, ep)
    return found


def load_registered(kind: str, name: str) -> Any:
    """The class registered as ``name`` for ``kind``.

    Raises:
        KeyError: nothing of that name is registered.
        PluginError: it is registered, but its package cannot be imported here (on a
            robot-only install, the simulated cell: PyBullet is not there).
    """
    ep = registered(kind)[name]
    try:
        return ep.load()
    except ImportError as exc:
        raise PluginError(
            f"{kind[:-1]} {name!r} is {ep.value}, which cannot be imported here ({exc}): it needs the "
            "full install (make install), not the robot-only one"
        ) from exc
