"""The project's Hydra configs (``pkg://conf``), and the one reader code uses for their defaults.

A function that takes a partial config section (the policy's ``targets``, ``augment``,
``loss``, ``view``) fills the rest from the YAML here instead of a copy in Python, so a
default changed in ``conf/`` is the default everywhere.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from importlib import resources
from typing import Any

__all__ = ["config_default", "policy_default"]


@lru_cache(maxsize=8)
def _config_file(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    text = resources.files(__name__).joinpath(path).read_text()
    return OmegaConf.to_container(OmegaConf.create(text), resolve=True)


def config_default(path: str, key: str) -> Any:
    """A copy of ``key``'s value in the packaged ``conf/<path>`` (a file without a defaults list)."""
    return copy.deepcopy(_config_file(path)[key])


def policy_default(key: str) -> Any:
    """A copy of ``conf/policy/default.yaml``'s ``key`` (e.g. ``"targets"``: a dict)."""
    return config_default("policy/default.yaml", key)
