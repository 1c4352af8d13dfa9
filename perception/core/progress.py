"""Progress on long work: a bar for a person at a terminal, a few lines for a log file.

A tqdm bar redraws itself several times a second; on a terminal that is one line, in a log
file (a job run without a terminal, CI, ``nohup``) every redraw is kept, and a
``budget=small`` pipeline's log was 515 KB, nearly all of it bar refreshes. So a bar is
drawn only when the stream is a terminal; otherwise :class:`PercentLog` writes one line
each time the work crosses another :func:`line_every_percent` percent, and one at the end.
The trainers get the same through :func:`adaptation.progress.trainer_progress`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = ["interactive", "line_every_percent", "PercentLog", "progress"]

log = logging.getLogger("sim2real.progress")


def line_every_percent() -> float:
    """``conf/progress.yaml``'s ``line_every_percent``: without a terminal, a progress line
    every this many percent of the work (its one source; a value outside (0, 100] raises)."""
    from conf import config_default  # lazy: conf loads hydra (robot floor imports this)

    every = float(config_default("progress.yaml", "line_every_percent"))
    if not 0 < every <= 100:
        raise ValueError(f"conf/progress.yaml: line_every_percent must be in (0, 100], got {every}")
    return every


def interactive(stream: IO | None = None) -> bool:
    """Whether ``stream`` (default: stderr, where bars go) is a terminal a person watches."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def next_threshold(done: float, total: float, every: float) -> float:
    """The first multiple of ``every`` percent of ``total`` past ``done`` (several crossed by
    one update give one line, not one each); ``inf`` without a ``total``."""
    if not total or total <= 0:
        return float("inf")
    step = total * every / 100.0
    return (int(done / step) + 1) * step


class PercentLog:
    """The part of tqdm's interface the project uses, writing a line every ``every`` percent.

    ``update(n)`` counts; a line goes out when the count crosses the next multiple of
    ``every`` percent of ``total``, and one at :meth:`close` with the count and the time
    taken. Without a ``total`` only the closing line is written. :meth:`set_postfix_str`
    adds a running summary to the lines (a tqdm bar shows it after the bar).
    """

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every: float | None = None,
                 stream: IO | None = None) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc or "progress", unit
        self.n, self.stream = int(initial), stream
        self.every = line_every_percent() if every is None else float(every)
        self.postfix = ""
        self.t0 = time.monotonic()
        self._next = next_threshold(self.n, self.total or 0, self.every)
        self._closed = False

    def _line(self, text: str) -> None:
        text = f"{text}, {self.postfix}" if self.postfix else text
        if self.stream is not None:
            print(text, file=self.stream, flush=True)
        else:
            log.info("%s", text)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Shown in the next line (tqdm's signature; ``refresh`` has nothing to redraw here)."""
        self.postfix = s

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self._next and self.total and self.n < self.total:  # the end has its own line
            pct = 100.0 * self.n / self.total
            self._line(f"{self.desc}: {self.n}/{self.total} {self.unit} ({pct:.0f}%, "
                       f"{time.monotonic() - self.t0:.0f} s)")
            self._next = next_threshold(self.n, self.total, self.every)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        total = f"/{self.total}" if self.total else ""
        self._line(f"{self.desc}: {self.n}{total} {self.unit} done ({time.monotonic() - self.t0:.0f} s)")

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("PercentLog: nothing to iterate (no iterable given)")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> PercentLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, disable: bool = False, leave: bool = True, stream: IO | None = None) -> Any:
    """A tqdm bar on a terminal, a :class:`PercentLog` otherwise (``disable``: neither).

    ``stream``: where the terminal's bar goes and what is tested for a terminal (default
    stderr); the lines of a :class:`PercentLog` go to it when given, else to the log
    (``sim2real.progress``, so they carry the log's time stamps).
    """
    if disable:
        return iterable if iterable is not None else PercentLog(total=0, stream=_Nowhere())
    if interactive(stream):
        from tqdm import tqdm  # lazy: tqdm (only for an interactive terminal)

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave,
                    file=stream if stream is not None else sys.stderr)
    return PercentLog(iterable, total=total, desc=desc, unit=unit, initial=initial, stream=stream)


class _Nowhere:
    """A stream that drops what is written: a disabled :func:`progress` still takes updates."""

    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass
