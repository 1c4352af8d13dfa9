"""Shared command-line plumbing for the robot-side commands (Hydra overrides, no torch).

The commands compose ``conf/<name>.yaml`` with Hydra's compose API, so they take plain
Hydra overrides (``key=value``, ``+key=value``) exactly like the training commands, but
write no ``outputs/`` folder and leave logging and signal handling to the command.
``--help`` prints the config with its comments; ``--cfg`` prints the composed config.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from importlib import resources
from typing import Any

from perception.core.cliutil import check_writable_dir_args, fail

__all__ = ["CliError", "check_override_types", "check_removed_keys", "compose_config", "config_groups", "config_number", "exit_on_help", "help_text", "hydra_command_checks", "run_hydra_command", "setup_logging"]


class CliError(SystemExit):
    """Exit with status 2 and a message on stderr."""

    def __init__(self, prog: str, message: str) -> None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        super().__init__(2)


def _config_text(name: str) -> str:
    return (resources.files("conf") / f"{name}.yaml").read_text()


def _defaults(path) -> list:
    from omegaconf import OmegaConf  # lazy: omegaconf (help and the checks answer without it)

    node = OmegaConf.create(path.read_text())
    return list(OmegaConf.to_container(node).get("defaults", []) or [])


def config_groups(name: str) -> dict[str, tuple[str, list[str]]]:
    """The config groups ``conf/<name>.yaml`` composes: ``{group: (default, [options])}``.

    Read from its defaults list (and, below a group, from the chosen option's), so that a
    command's ``--help`` lists what applies to it, not every folder under ``conf/``.
    """
    root = resources.files("conf")
    found: dict[str, tuple[str, list[str]]] = {}

    def walk(file, prefix: str) -> None:
        for entry in _defaults(file):
            if not isinstance(entry, dict):
                continue  # _self_
            for key, choice in entry.items():
                key = str(key)
                if key.startswith(("override ", "hydra/", "/hydra")) or key == "hydra":
                    continue
                group = key if key.startswith("/") or not prefix else f"{prefix}/{key}"
                group = group.lstrip("/").split("@")[0]
                folder = root / group
                options = sorted(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".yaml")) \
                    if folder.is_dir() else []
                found[group] = ("null" if choice is None else str(choice), options)
                if choice is not None and (folder / f"{choice}.yaml").is_file():
                    walk(folder / f"{choice}.yaml", group)

    walk(root / f"{name}.yaml", "")
    return found


def help_text(name: str, prog: str, doc: str = "") -> str:
    """``--help``: the command's docstring, its config groups with their options, its config with comments."""
    lines = [doc.strip(), ""] if doc else []
    groups = config_groups(name)
    if groups:
        lines.append(f"Config groups (select with group=option, e.g. {prog} {next(iter(groups))}=...):")
        for group, (choice, options) in groups.items():
            lines.append(f"  {group}: {' | '.join(options) or '(none)'}   [default: {choice}]")
        lines.append("")
    lines += [f"Config (conf/{name}.yaml), override with key=value:", "", _config_text(name)]
    return "\n".join(lines)


def _type_error(key: str, default, value) -> str | None:
    """Why ``value`` cannot stand where the config's default is ``default`` (``None``: it can)."""
    if value is None or default is None or isinstance(default, str):
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"{key} must be true or false, got {value!r}"
    if isinstance(default, (int, float)):
        # An int default does not make the key whole-numbered (``max_time_s: 600`` takes 90.5):
        # the commands that need a whole number check that themselves.
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{key} must be a number, got {value!r}"
    return None


def check_override_types(name: str, argv: list[str], prog: str) -> None:
    """Refuse ``key=value`` overrides whose value has another type than the key's default.

    ``seed=abc`` would otherwise end deep inside a command with a bare ``int()`` error that
    does not name the key. The defaults are ``conf/<name>.yaml`` composed with the command
    line's group selections (``budget=small`` changes them). Sweeps (``a=1,2``) and what
    Hydra itself will refuse (unknown keys, bad syntax) are left to Hydra.

    Raises:
        CliError: exit 2, the message naming the key, the value and the type it needs.
    """
    from hydra import compose, initialize_config_module  # lazy: hydra (after --help)
    from hydra.core.global_hydra import GlobalHydra  # lazy: hydra (after --help)
    from hydra.core.override_parser.overrides_parser import OverridesParser  # lazy: hydra (after --help)
    from omegaconf import OmegaConf  # lazy: omegaconf (after --help)

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except Exception:
        return  # Hydra reports the syntax error itself
    choices = config_groups(name)
    groups = set(choices)
    is_group = [o.key_or_group.lstrip("+~").split("@")[0] in groups or o.key_or_group.startswith("hydra")
                for o in overrides]
    for o in overrides:  # an option the group does not have: name the ones it has (Hydra would dump its search path)
        group = o.key_or_group.lstrip("+~").split("@")[0]
        if group in choices and not o.is_delete() and not o.is_sweep_override():
            value, options = o.value(), choices[group][1]
            if isinstance(value, str) and options and value not in options:
                raise CliError(prog, f"{group}={value}: no such option; choose one of {' | '.join(options)} "
                                     f"(conf/{group}/)")
    group_args = [a for a, g in zip(args, is_group) if g]
    was_initialized = GlobalHydra.instance().is_initialized()
    try:
        if was_initialized:  # inside @hydra.main: its config search path is set up
            defaults = compose(config_name=name, overrides=group_args)
        else:
            with initialize_config_module(config_module="conf", version_base="1.3"):
                defaults = compose(config_name=name, overrides=group_args)
    except Exception:
        return
    finally:
        if not was_initialized:
            GlobalHydra.instance().clear()
    for o, g in zip(overrides, is_group):
        if g or o.is_delete() or o.is_sweep_override() or o.key_or_group.startswith("hydra."):
            continue
        default = OmegaConf.select(defaults, o.key_or_group, default=None, throw_on_resolution_failure=False)
        message = _type_error(o.key_or_group, default, o.value())
        if message:
            raise CliError(prog, message)


def exit_on_help(name: str, prog: str, doc: str, argv: list[str]) -> None:
    """``--help`` for a ``@hydra.main`` command: :func:`help_text` instead of Hydra's page,
    which lists every folder under ``conf/`` as a group of every command."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(name, prog, doc))
        print("Hydra's own options: --hydra-help, --cfg job (the composed config), "
              "-m/--multirun (sweeps; hydra/launcher=submitit_local|submitit_slurm, docs/scaling.md)")
        raise SystemExit(0)


def check_removed_keys(argv: list[str], prog: str) -> None:
    """Refuse an override of a key taken out of ``conf/`` (``conf.REMOVED_KEYS``), naming what
    replaces it.

    Raises:
        CliError: exit 2.
    """
    from conf import removed_key  # lazy: conf loads hydra (robot floor imports this)

    for arg in argv:
        why = removed_key(arg) if "=" in arg and not arg.startswith("-") else None
        if why:
            raise CliError(prog, why)


def hydra_command_checks(name: str, prog: str, doc: str, argv: list[str]) -> None:
    """What a ``@hydra.main`` command's ``main()`` runs before Hydra: ``--help``, removed keys,
    value types."""
    exit_on_help(name, prog, doc, argv)
    check_removed_keys(argv, prog)
    check_override_types(name, argv, prog)


def run_hydra_command(
    name: str,
    prog: str,
    doc: str,
    run: Callable[[Any], None],
    errors: tuple[type[BaseException], ...],
    *,
    writable_dirs: tuple[str, ...] = ("output_dir",),
    argv: list[str] | None = None,
) -> None:
    """A training-side command's ``main()``: the checks before Hydra, then ``run(cfg)`` under
    ``@hydra.main`` on ``conf/<name>.yaml``, with ``errors`` (a user's to mend) answered
    ``prog: error: ...`` and exit 2, nothing half-written (each ``run`` writes atomically).

    ``writable_dirs`` are the keys whose folders are checked before Hydra makes its run
    folder inside them (``()``: none). Hydra reads its overrides from ``sys.argv``; ``argv``
    (default ``sys.argv[1:]``) is what the checks see.
    """
    import hydra  # lazy: hydra's app machinery (the robot's compose-only commands never load it)

    argv = sys.argv[1:] if argv is None else argv
    hydra_command_checks(name, prog, doc, argv)
    if writable_dirs:
        check_writable_dir_args(prog, argv, writable_dirs)

    @hydra.main(config_path="pkg://conf", config_name=name, version_base="1.3")
    def _app(cfg) -> None:
        try:
            run(cfg)
        except errors as exc:
            fail(prog, str(exc))

    _app()


def compose_config(name: str, argv: list[str], prog: str, doc: str = ""):
    """Compose ``conf/<name>.yaml`` with Hydra overrides ``argv``.

    Returns:
        An ``omegaconf.DictConfig`` (resolved lazily).

    Raises:
        SystemExit: 0 after ``--help`` / ``--cfg``, 2 on a bad override (message on stderr).
    """
    from hydra import compose, initialize_config_module  # lazy: hydra (only to compose)
    from hydra.core.global_hydra import GlobalHydra  # lazy: hydra (only to compose)
    from omegaconf import OmegaConf  # lazy: omegaconf (only to compose)

    if any(a in ("-h", "--help") for a in argv):
        print(help_text(name, prog, doc))
        raise SystemExit(0)
    show = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise CliError(prog, f"arguments must be Hydra overrides key=value, got {bad}; see {prog} --help")
    check_removed_keys(argv, prog)
    check_override_types(name, argv, prog)
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
        from omegaconf import OmegaConf  # lazy: omegaconf (only with a composed config in hand)

        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        from omegaconf import OmegaConf  # lazy: omegaconf (only with a composed config in hand)

        OmegaConf.set_struct(self.cfg, True)


def config_number(cfg, key: str, kind: type = float, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False, prefix: str = ""):
    """``cfg[key]`` as a finite ``int`` or ``float`` within ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    ``prefix``: where ``cfg`` sits in the whole config (``"finetune.geometry."``), for the message.

    Raises:
        ValueError: the message names the key, the value and the range.
    """

    value = cfg[key] if key in cfg else None
    what = "a whole number" if kind is int else "a number"
    name = f"{prefix}{key}"
    try:
        num = float(value)
        if not math.isfinite(num) or (kind is int and not num.is_integer()):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    num = kind(num)
    if lo is not None and (num <= lo if lo_open else num < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    if hi is not None and num > hi:
        raise ValueError(f"{name} must be <= {hi:g}, got {value!r}")
    return num


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
