"""Progress on long work: a bar for a person at a terminal, a few lines for a log file.

A tqdm bar redraws itself several times a second; on a terminal that is one line, in a log
file (a job run without a terminal, CI, ``nohup``) every redraw is kept, and a
``budget=small`` pipeline's log was 515 KB, nearly all of it bar refreshes. So a bar is
drawn only when the stream is a terminal; otherwise :class:`PercentLog` writes one line
every :data:`LINE_EVERY_PERCENT` percent and one at the end. The trainers get the same
through :func:`adaptation.progress.trainer_progress`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = ["LINE_EVERY_PERCENT", "interactive", "PercentLog", "progress"]

#: Without a terminal, a progress line every this many percent of the work.
LINE_EVERY_PERCENT = 10

log = logging.getLogger("sim2real.progress")


def interactive(stream: IO | None = None) -> bool:
    """Whether ``stream`` (default: stderr, where bars go) is a terminal a person watches."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PercentLog:
    """The part of tqdm's interface the project uses, writing a line every ``every`` percent.

    ``update(n)`` counts; a line goes out when the count crosses the next multiple of
    ``every`` percent of ``total`` (several crossed at once make one line), and one at
    :meth:`close` with the count and the time taken. Without a ``total`` only the closing
    line is written.
    """

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every: float = LINE_EVERY_PERCENT,
                 stream: IO | None = None) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc or "progress", unit
        self.n, self.every, self.stream = int(initial), float(every), stream
        self.t0 = time.monotonic()
        self._next = self._threshold_after(self.n)
        self._closed = False

    def _threshold_after(self, n: int) -> float:
        if not self.total:
            return float("inf")
        step = self.total * self.every / 100.0
        return (int(n / step) + 1) * step

    def _line(self, text: str) -> None:
        if self.stream is not None:
            print(text, file=self.stream, flush=True)
        else:
            log.info("%s", text)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self._next and self.total and self.n < self.total:
            pct = 100.0 * self.n / self.total
            self._line(f"{self.desc}: {self.n}/{self.total} {self.unit} ({pct:.0f}%, "
                       f"{time.monotonic() - self.t0:.0f} s)")
            self._next = self._threshold_after(self.n)

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
    stderr); the lines of a :class:`PercentLog` go to it when given, else to the log.
    """
    if disable:
        return iterable if iterable is not None else PercentLog(total=0, stream=_nowhere())
    if interactive(stream):
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave,
                    file=stream if stream is not None else sys.stderr)
    return PercentLog(iterable, total=total, desc=desc, unit=unit, initial=initial, stream=stream)


class _Nowhere:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _nowhere() -> _Nowhere:
    return _Nowhere()
