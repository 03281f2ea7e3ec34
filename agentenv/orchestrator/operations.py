"""One operation at a time per sandbox.

:class:`SandboxOperations` serialises the operations on each sandbox behind a lock of
its own, runs each as a task so that a caller going away (a client disconnect cancels its
request) never aborts one half-way, and lets a caller asking for an operation of the same
kind as one queued or running share that one's outcome. It knows nothing about what the
operations do; the orchestrator owns that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")


class SandboxOperations:
    """Per-sandbox locks and the joinable operations queued or running on them."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._joinable: dict[tuple[str, str], asyncio.Task[object]] = {}
        self._detached: set[asyncio.Task[object]] = set()

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """The lock every operation on ``sandbox_id`` holds while it runs."""
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def forget(self, sandbox_id: str) -> None:
        """Drop the lock of a sandbox that is gone."""
        self._locks.pop(sandbox_id, None)

    async def run(
        self, sandbox_id: str, kind: str, work: Callable[[], Awaitable[T]], *, join: bool
    ) -> T:
        """Run ``work`` under the sandbox's lock as a task of its own and return its
        result. With ``join``, a call made while an operation of the same ``kind`` on the
        same sandbox is queued or running gets that operation's outcome (result or
        exception) instead of starting a second one."""
        key = (sandbox_id, kind)
        task = cast("asyncio.Task[T] | None", self._joinable.get(key) if join else None)
        if task is None:

            async def locked() -> T:
                async with self.lock(sandbox_id):
                    return await work()

            task = asyncio.get_running_loop().create_task(locked())
            if join:
                self._joinable[key] = cast("asyncio.Task[object]", task)

                def drop(done: asyncio.Task[object]) -> None:
                    if self._joinable.get(key) is done:
                        del self._joinable[key]

                task.add_done_callback(drop)
            else:
                # The event loop keeps only weak references to tasks.
                self._detached.add(cast("asyncio.Task[object]", task))
                task.add_done_callback(self._detached.discard)
        return await asyncio.shield(task)

    def pending(self, sandbox_id: str | None = None) -> list[asyncio.Task[object]]:
        """The joinable operations queued or running, on one sandbox or on all."""
        return [
            task
            for (sid, _), task in self._joinable.items()
            if sandbox_id is None or sid == sandbox_id
        ]
