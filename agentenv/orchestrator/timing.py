"""Timing an operation's phases for the log line that reports it."""

from __future__ import annotations

import time


class PhaseTimer:
    """Durations of the named phases of one operation, for the log."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._start = self._last
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def __str__(self) -> str:
        total = (self._last - self._start) * 1000
        parts = ", ".join(f"{k} {v * 1000:.0f}" for k, v in self.phases.items())
        return f"{total:.0f} ms ({parts})"
