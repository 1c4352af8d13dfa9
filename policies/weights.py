"""The shipped weights: policy bases and geometry networks in ``policies/bases/`` (or any path), read
without unpickling code.

A file holds a network's ``state_dict``, a ``format`` tag and the JSON-able ``config`` it was trained
with: it loads with ``torch.load(..., weights_only=True)``. :mod:`policies.base` writes the policy
base, :mod:`policies.geometry` the geometry network; the training, export and pipeline stages read
them here (a module of its own, so that none of them imports another's command to load a file).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

__all__ = ["BASE_DIR", "BASE_FORMAT", "BaseError", "base_path", "base_digest", "load_base", "check_base_fits"]

log = logging.getLogger("sim2real.base")

BASE_DIR = Path(__file__).resolve().parent / "bases"
BASE_FORMAT = 1


class BaseError(ValueError):
    """A base that is missing, unreadable or does not fit the policy config."""


def base_path(name: str | Path, what: str = "policy base") -> Path:
    """The file of a base: a name shipped in ``policies/bases/`` (``grasp_base_v1``) or a path.

    ``what`` names it in the errors (``"geometry network"`` for ``policy.geometry``)."""
    p = Path(str(name))
    if p.suffix == ".pt" or p.is_file() or len(p.parts) > 1:
        if not p.is_file():
            raise BaseError(f"{what} file not found: {p}")
        return p
    shipped = BASE_DIR / f"{p.name}.pt"
    if not shipped.is_file():
        have = sorted(q.stem for q in BASE_DIR.glob("*.pt"))
        raise BaseError(f"no shipped {what} named {p.name!r} (shipped: {have or 'none'})")
    return shipped


def base_digest(name: str | Path) -> str:
    """A short hash of the base's bytes (for the policy stage's cache key)."""
    return hashlib.sha256(base_path(name).read_bytes()).hexdigest()[:16]


def load_base(name: str | Path, fmt: int | str = BASE_FORMAT) -> dict:
    """``{"state_dict", "config", "format", ...}`` of a base, loaded without unpickling code.

    Args:
        name: see :func:`base_path`.
        fmt: the format the file must carry: :data:`BASE_FORMAT` (a policy base) or
            :data:`policies.geometry.GEOMETRY_FORMAT` (a geometry network).
    """
    import torch  # lazy: torch (commands check a base's name before paying for torch)

    path = base_path(name, "policy base" if fmt == BASE_FORMAT else "geometry network")
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise BaseError(f"base {path} could not be read: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != fmt or "state_dict" not in data:
        raise BaseError(f"{path} is not a base of format {fmt!r} (it says {data.get('format') if isinstance(data, dict) else None!r})")
    return data


def check_base_fits(base: dict, pcfg: dict, where: str = "policy.base") -> None:
    """Refuse a base whose network or angle bins differ from the policy config's (its weights
    would not load); warn when only the view size differs."""
    # The network's class is compared by what it builds: a base saved before the configs named
    # their class (no ``_target_``) holds a GraspNet, as a config without one builds.
    default = "policies.networks.GraspNet"
    want = {"angle_bins": int(pcfg["angle_bins"]), **dict(pcfg["network"])}
    want["_target_"] = want.get("_target_") or default
    have = dict(base.get("network") or {})
    have["_target_"] = have.get("_target_") or default
    if {k: have.get(k) for k in want} != {k: (list(v) if isinstance(v, tuple) else v) for k, v in want.items()}:
        raise BaseError(f"{where}: the base's network {have} does not match policy.network/angle_bins {want}; "
                        "set policy.base=null or train a base for this network (sim2real-train-base)")
    if list(base.get("view_size", [])) != [int(v) for v in pcfg["view_size"]]:
        # The network is fully convolutional, so the weights load at any size; its features
        # were learnt at the base's pixel size, which fine-tuning has to move.
        log.warning("%s: the base was trained at view_size %s, the policy uses %s", where, base.get("view_size"),
                    list(pcfg["view_size"]))
