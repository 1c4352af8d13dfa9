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

from omegaconf import OmegaConf

from conf.schema import register as register_schemas

__all__ = ["REMOVED_KEYS", "as_dict", "config_default", "policy_default", "removed_key", "to_plain", "with_policy_defaults"]

# The schemas (conf/schema.py) go into Hydra's ConfigStore when the config package is
# imported, which Hydra does (``pkg://conf``) before it composes anything.
register_schemas()

#: Keys taken out of (or renamed in) ``conf/``, each with what to use instead: a command line
#: that still sets one is refused with this message (exit 2) rather than Hydra's "not in struct".
REMOVED_KEYS: dict[str, str] = {
    "budget.time_limit_s": "removed: nothing read it; each budget's wall-time goal is stated in its "
                           "conf/budget/*.yaml comment and measured in docs/benchmarks.md",
    "profile": "removed from the config: choose the render profile with render=NAME "
               "(sim2real-render still takes profile=NAME on its command line)",
}


@lru_cache(maxsize=8)
def _config_file(path: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(path).read_text()
    return OmegaConf.to_container(OmegaConf.create(text), resolve=True)


def removed_key(override: str) -> str | None:
    """What to say of a Hydra override (``key=value``, ``+key=value``) naming a removed key;
    ``None`` when its key is not one."""
    key = override.split("=", 1)[0].lstrip("+~")
    why = REMOVED_KEYS.get(key)
    return None if why is None else f"{key} is no longer a config key: {why}"


def config_default(path: str, key: str) -> Any:
    """A copy of ``key``'s value in the packaged ``conf/<path>`` (a file without a defaults list)."""
    return copy.deepcopy(_config_file(path)[key])


def policy_default(key: str) -> Any:
    """A copy of ``conf/policy/default.yaml``'s ``key`` (e.g. ``"targets"``: a dict)."""
    return config_default("policy/default.yaml", key)


def to_plain(node: Any) -> Any:
    """A config node (mapping or list) as plain, resolved Python containers; anything else as is."""

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def as_dict(section: Any) -> dict:
    """A config section (a node, a mapping or ``None``) as a new plain dict (``{}`` for None)."""
    return {} if section is None else dict(to_plain(section))


def with_policy_defaults(key: str, given: Any) -> dict:
    """``conf/policy/default.yaml``'s section ``key`` with the keys of ``given`` (a partial
    section, a node or ``None``) over it: what a function taking a partial section uses."""
    return {**policy_default(key), **as_dict(given)}
