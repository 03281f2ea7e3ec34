"""Named background tasks of a node and their shutdown.

Every task the orchestrator starts outside a request goes through one
:class:`Supervisor`: periodic loops (the reaper, the RAM flusher), keyed jobs that at
most one of runs per key (a snapshot's commit, a paused sandbox's upload) and
fire-and-forget work (making files durable, flattening). :meth:`Supervisor.shutdown`
cancels them all and waits for them, so nothing runs on after the store is closed.
Work that must finish rather than be cancelled (a network's removal after a kill, a
volume's publishing) is a :class:`FinishingWork` its owner drains at shutdown.
They own no sandbox state and know nothing of what the tasks do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger("agentenv.orchestrator")


class Supervisor:
    def __init__(self) -> None:
        self._loops: dict[str, asyncio.Task[None]] = {}
        # kind -> key -> task: at most one task per (kind, key).
        self._jobs: dict[str, dict[str, asyncio.Task[None]]] = {}
        self._loose: set[asyncio.Task[Any]] = set()

    def every(self, name: str, interval: float, tick: Callable[[], Awaitable[None]]) -> None:
        """Run ``tick`` every ``interval`` seconds until shutdown; a failing tick is
        logged and the loop goes on."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await tick()
                except Exception:
                    log.exception("background loop %s failed", name)

        self._loops[name] = asyncio.get_running_loop().create_task(loop(), name=name)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Start ``coro`` in the background, kept until done (or shutdown)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._loose.add(task)
        task.add_done_callback(self._loose.discard)
        return task

    def start_job(
        self, kind: str, key: str, make: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.Task[None]:
        """The running ``kind`` job for ``key``, or a new one made by ``make``."""
        jobs = self._jobs.setdefault(kind, {})
        task = jobs.get(key)
        if task is not None and not task.done():
            return task
        task = asyncio.get_running_loop().create_task(make(), name=f"{kind} {key}")
        jobs[key] = task

        def forget(done: asyncio.Task[None]) -> None:
            if jobs.get(key) is done:
                del jobs[key]

        task.add_done_callback(forget)
        return task

    def job(self, kind: str, key: str) -> asyncio.Task[None] | None:
        task = self._jobs.get(kind, {}).get(key)
        return task if task is not None and not task.done() else None

    async def cancel_job(self, kind: str, key: str) -> None:
        """Cancel the ``kind`` job for ``key``, if any, and wait until it has stopped."""
        task = self._jobs.get(kind, {}).pop(key, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def shutdown(self) -> None:
        tasks = [
            *self._loops.values(),
            *(t for jobs in self._jobs.values() for t in jobs.values()),
            *self._loose,
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._loops.clear()
        self._jobs.clear()
        self._loose.clear()


class FinishingWork:
    """Background work that shutdown waits for instead of cancelling: each piece runs in
    a task of its own, a failure is logged (``what`` failed) and :meth:`drain` waits for
    every piece, including those started meanwhile."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, work: Coroutine[Any, Any, None], what: str) -> None:
        async def logged() -> None:
            try:
                await work
            except Exception as exc:
                log.warning("%s failed: %s", what, exc)

        task = asyncio.get_running_loop().create_task(logged(), name=what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
