"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

A crash or a full disk leaves either the old file or no file, never half of one. The
file gets the mode a plain ``open`` would give it (0666 less the umask): ``mkstemp``'s
0600 would make datasets and reports on a shared folder unreadable to everyone else.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "default_dir_mode", "default_file_mode",
           "replace_tree"]


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for a moment, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """0666 less the process's umask (what ``open(path, "w")`` creates)."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """0777 less the process's umask (what ``mkdir`` creates)."""
    return 0o777 & ~_umask()


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(fileobj)`` on a temporary file and rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, default_file_mode())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def replace_tree(src: str | Path, dst: str | Path) -> Path:
    """Copy the folder ``src`` to ``dst``, replacing what was there.

    The copy is made beside ``dst`` (``.NAME.tmp``) and renamed into place, so a copy cut
    off midway never stands at ``dst`` (an artifact is either the old one or the new one,
    whole; between the two renames there is briefly none).
    """

    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dst
