"""Shared command-line plumbing for the robot-side commands (Hydra overrides, no torch).

The commands compose ``conf/<name>.yaml`` with Hydra's compose API, so they take plain
Hydra overrides (``key=value``, ``+key=value``) exactly like the training commands, but
write no ``outputs/`` folder and leave logging and signal handling to the command.
``--help`` prints the config with its comments; ``--cfg`` prints the composed config.
"""

from __future__ import annotations

import logging
import sys
from importlib import resources

__all__ = ["CliError", "compose_config", "config_number", "setup_logging"]


class CliError(SystemExit):
    """Exit with status 2 and a message on stderr."""

    def __init__(self, prog: str, message: str) -> None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        super().__init__(2)


def _config_text(name: str) -> str:
    return (resources.files("conf") / f"{name}.yaml").read_text()


def compose_config(name: str, argv: list[str], prog: str, doc: str = ""):
    """Compose ``conf/<name>.yaml`` with Hydra overrides ``argv``.

    Returns:
        An ``omegaconf.DictConfig`` (resolved lazily).

    Raises:
        SystemExit: 0 after ``--help`` / ``--cfg``, 2 on a bad override (message on stderr).
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if any(a in ("-h", "--help") for a in argv):
        print((doc.strip() + "\n\n" if doc else "") + f"Config (conf/{name}.yaml), override with key=value:\n")
        print(_config_text(name))
        raise SystemExit(0)
    show = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise CliError(prog, f"arguments must be Hydra overrides key=value, got {bad}; see {prog} --help")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose(config_name=name, overrides=list(argv))
    except Exception as exc:  # hydra raises several exception types for bad overrides
        raise CliError(prog, f"{exc}") from exc
    finally:
        GlobalHydra.instance().clear()
    if "hydra" in cfg:
        with _open_struct(cfg):
            del cfg["hydra"]
    if show:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        raise SystemExit(0)
    return cfg


class _open_struct:
    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def __enter__(self):
        from omegaconf import OmegaConf

        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        from omegaconf import OmegaConf

        OmegaConf.set_struct(self.cfg, True)


def config_number(cfg, key: str, kind: type = float, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False):
    """``cfg[key]`` as a finite ``int`` or ``float`` within ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    Raises:
        ValueError: the message names the key, the value and the range.
    """
    import math

    value = cfg[key] if key in cfg else None
    what = "a whole number" if kind is int else "a number"
    try:
        num = float(value)
        if not math.isfinite(num) or (kind is int and not num.is_integer()):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be {what}, got {value!r}") from None
    num = kind(num)
    if lo is not None and (num <= lo if lo_open else num < lo):
        raise ValueError(f"{key} must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    if hi is not None and num > hi:
        raise ValueError(f"{key} must be <= {hi:g}, got {value!r}")
    return num


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
