"""The gateway's route cache: which up node holds a sandbox, for the sandbox's traffic
(every envd call would otherwise ask the scheduler, which asks Redis).

An entry routes for ``ttl_s``. For as long again after that it still routes the requests
that find it, while the scheduler is asked again off their path (one lookup at a time per
sandbox): a lookup took longer than the relayed request itself on a loaded host, and each
sandbox's traffic paid it once every ``ttl_s``, the longer the requests, the larger the
share of them. What the lookup finds replaces the entry; a failed one drops it, so the
next request asks the scheduler itself (and gets its answer: a 503 when it is unreachable
or the node is down). An entry older than twice ``ttl_s`` (a sandbox idle that long) is
looked up on the request's path, as a missing one is. What the gateway itself changes
(kill, connect elsewhere) and a node's failure are :meth:`RouteCache.forget`-ed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from agentenv.cluster.models import NodeInfo

log = logging.getLogger("agentenv.cluster.gateway")

#: Entries kept before expired ones are swept.
MAX_ENTRIES = 100_000


class RouteCache:
    """Sandbox to up node, from ``lookup`` (None: bound to no node; it raises what a
    caller is to answer, e.g. a node or scheduler unavailable)."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[NodeInfo | None]],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup = lookup
        self.ttl_s = ttl_s
        self._clock = clock
        # sandbox id -> (fresh until, node)
        self._entries: dict[str, tuple[float, NodeInfo]] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    async def owner(self, sandbox_id: str) -> tuple[NodeInfo | None, bool]:
        """The node holding ``sandbox_id``, and whether it came from the cache."""
        now = self._clock()
        cached = self._entries.get(sandbox_id)
        if cached is not None:
            fresh_until, known = cached
            if now < fresh_until:
                return known, True
            if now < fresh_until + self.ttl_s:
                self._refresh_later(sandbox_id)
                return known, True
        node = await self._lookup(sandbox_id)
        self._remember(sandbox_id, node)
        return node, False

    def forget(self, sandbox_id: str) -> None:
        """Drop what is known of ``sandbox_id`` (a lookup under way included)."""
        self._entries.pop(sandbox_id, None)
        task = self._refreshing.pop(sandbox_id, None)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        tasks = list(self._refreshing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _remember(self, sandbox_id: str, node: NodeInfo | None) -> None:
        if node is None or self.ttl_s <= 0:
            self._entries.pop(sandbox_id, None)
            return
        now = self._clock()
        if len(self._entries) > MAX_ENTRIES:
            self._entries = {k: v for k, v in self._entries.items() if v[0] + self.ttl_s > now}
        self._entries[sandbox_id] = (now + self.ttl_s, node)

    def _refresh_later(self, sandbox_id: str) -> None:
        if sandbox_id in self._refreshing:
            return
        task = asyncio.get_running_loop().create_task(self._refresh(sandbox_id))
        self._refreshing[sandbox_id] = task
        task.add_done_callback(lambda done: self._refreshed(sandbox_id, done))

    def _refreshed(self, sandbox_id: str, task: asyncio.Task[None]) -> None:
        if self._refreshing.get(sandbox_id) is task:
            del self._refreshing[sandbox_id]

    async def _refresh(self, sandbox_id: str) -> None:
        try:
            node = await self._lookup(sandbox_id)
        except Exception as exc:  # whatever it was, the next request asks again
            log.info("route of sandbox %s dropped: %s", sandbox_id, exc)
            node = None
        self._remember(sandbox_id, node)
