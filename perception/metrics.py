"""A tiny thread-safe Prometheus text-format registry (no extra dependency).

Counters and histograms with fixed label sets, rendered in the Prometheus text
exposition format 0.0.4 by :meth:`Registry.render`.
"""

from __future__ import annotations

import bisect
import math
import os
import threading

__all__ = ["Registry", "Counter", "Histogram", "Gauge", "resident_memory_bytes"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
             for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in items]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str, fn=None) -> None:
        super().__init__(name, help)
        self._value = 0.0
        self._fn = fn

    def set(self, v: float) -> None:
        self._value = float(v)

    def render(self) -> list[str]:
        v = self._fn() if self._fn is not None else self._value
        return self.header() + [f"{self.name} {_fmt(v)}"]


DEFAULT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (), buckets=DEFAULT_BUCKETS) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets))
        self._data: dict[tuple[str, ...], list] = {}

    def observe(self, value: float, *labels: str) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            d = self._data.get(labels)
            if d is None:
                d = self._data[labels] = [[0] * (len(self.buckets) + 1), 0.0, 0]
            d[0][i] += 1
            d[1] += value
            d[2] += 1

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, ([*v[0]], v[1], v[2])) for k, v in self._data.items())
        out = self.header()
        for key, (counts, total, n) in items:
            cum = 0
            for b, c in zip((*self.buckets, math.inf), counts):
                cum += c
                le = 'le="' + _fmt(b) + '"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {cum}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_fmt(total)}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {n}")
        return out


class Registry:
    """Holds metrics and renders them all."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"


def resident_memory_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
