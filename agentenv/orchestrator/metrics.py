"""Sandboxes' resource history: envd's figures, sampled every ``Config.metrics_interval``
seconds (by default :data:`SAMPLE_INTERVAL_S`, E2B's interval) while a sandbox runs and
kept for its life, so ``GET /sandboxes/{id}/metrics?start=&end=`` answers a time window
as E2B's does.

Owns the samples (in memory: a restart of the server starts the history again). Asks
the envd of the running sandboxes it is given; changes nothing else. A sample costs the
guest one small ``/metrics`` request (a few /proc reads).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from datetime import datetime

import httpx

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.store import SandboxEvent, Store, utcnow
from agentenv.orchestrator.views import SandboxView

log = logging.getLogger("agentenv.orchestrator")

#: E2B collects a sandbox's metrics every 5 seconds.
SAMPLE_INTERVAL_S = 5.0
#: A sample not answered by then is skipped (the guest may be pausing).
SAMPLE_TIMEOUT_S = 3.0
#: Samples kept per sandbox: a day at the interval, E2B's longest sandbox life.
MAX_SAMPLES = int(24 * 3600 / SAMPLE_INTERVAL_S)


@dataclass(frozen=True)
class GuestSample:
    """envd's ``/metrics`` figures, and when the host took them."""

    at: datetime
    figures: dict[str, object]


class MetricsHistory:
    """Every sandbox's samples, oldest first, until its record is removed."""

    def __init__(self, store: Store, http: httpx.AsyncClient, limit: int = MAX_SAMPLES) -> None:
        self._store = store
        self._http = http
        self._limit = limit
        self._samples: dict[str, deque[GuestSample]] = {}
        store.listen(self._follow)

    def _follow(self, event: SandboxEvent) -> None:
        if event.new is None:
            self._samples.pop(event.sandbox_id, None)

    def record(self, sandbox_id: str, sample: GuestSample) -> None:
        samples = self._samples.get(sandbox_id)
        if samples is None:
            samples = self._samples[sandbox_id] = deque(maxlen=self._limit)
        samples.append(sample)

    def between(
        self, sandbox_id: str, start: datetime | None, until: datetime | None
    ) -> list[GuestSample]:
        """The samples taken in [start, until) (None: no bound)."""
        return [
            s
            for s in self._samples.get(sandbox_id, ())
            if (start is None or s.at >= start) and (until is None or s.at < until)
        ]

    def latest(self, sandbox_id: str) -> GuestSample | None:
        samples = self._samples.get(sandbox_id)
        return samples[-1] if samples else None

    async def sample(self, running: list[SandboxView]) -> None:
        """One sample of each of the ``running`` sandboxes, all at once."""
        await asyncio.gather(*(self._sample(view) for view in running))

    async def _sample(self, view: SandboxView) -> None:
        try:
            figures = await envd_client.metrics(
                self._http, view.guest_address, view.record.envd_token, timeout=SAMPLE_TIMEOUT_S
            )
        except envd_client.EnvdUnreachable as exc:
            log.debug("no metrics sample of %s: %s", view.sandbox_id, exc)
            return
        if self._store.get_sandbox(view.sandbox_id) is not None:  # not removed meanwhile
            self.record(view.sandbox_id, GuestSample(utcnow(), figures))
