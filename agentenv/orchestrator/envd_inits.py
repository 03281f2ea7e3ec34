"""envd's ``/init`` after a restore (create, resume, re-adoption), run in the background.

A create or resume answers once the machine runs; ``/init`` (the sandbox's token, env
vars, the clock and an entropy reseed) follows here, and whatever talks to the sandbox
waits for it (:meth:`EnvdInits.settled`). A new sandbox whose first ``/init`` failed has
an envd without a token: it is refused traffic (:meth:`EnvdInits.check`).

Owns the running ``/init`` tasks, the failures of first ones, and what runs after a
first one succeeded (``after_first``: the lifecycle's, given the sandbox's id). Writes
only a record's ``envd_pending`` (cleared once its ``/init`` is done); the lifecycle
decides when one runs and passes the sandbox's place among those starting, given back
when it is over.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.errors import OperationFailed
from agentenv.orchestrator.resources import StartPlace
from agentenv.orchestrator.store import SandboxRecord, Store
from agentenv.orchestrator.timing import PhaseTimer

log = logging.getLogger("agentenv.orchestrator")


class EnvdInits:
    """The background ``/init`` of each sandbox just started or resumed."""

    def __init__(self, store: Store, http: httpx.AsyncClient, timeout_s: float) -> None:
        self.store = store
        self.http = http
        self.timeout_s = timeout_s
        self._running: dict[str, asyncio.Task[None]] = {}
        # Sandboxes whose first envd /init failed, and why (see check).
        self._failed: dict[str, str] = {}
        #: Run after a sandbox's first /init succeeded, in a task of its own that a kill
        #: or shutdown cancels.
        self.after_first: Callable[[str], Coroutine[Any, Any, None]] | None = None
        self._after: dict[str, asyncio.Task[None]] = {}

    def running(self, sandbox_id: str) -> asyncio.Task[None] | None:
        return self._running.get(sandbox_id)

    def start(
        self,
        rec: SandboxRecord,
        guest_address: str,
        *,
        first: bool = False,
        place: StartPlace | None = None,
    ) -> None:
        """Initialise envd (clock, entropy reseed, token) in the background. ``first``:
        a new sandbox's, whose envd has no token of its own yet (a resumed one keeps the
        token it was paused with), so if it fails the sandbox is refused traffic.
        ``place``, the sandbox's among those starting, is given back once it is over."""
        what = "start" if first else "resume"

        async def init() -> None:
            phases = PhaseTimer()
            try:
                attempts = await envd_client.init(
                    self.http,
                    guest_address,
                    env_vars=rec.env_vars,
                    access_token=rec.envd_token,
                    timeout=self.timeout_s,
                )
                phases.mark("init")
            except Exception as exc:
                log.error("sandbox %s: envd /init after %s failed: %s", rec.sandbox_id, what, exc)
                if first:
                    self._failed[rec.sandbox_id] = str(exc)
                return
            finally:
                if place is not None:
                    place.leave()
                if self._running.get(rec.sandbox_id) is task:
                    del self._running[rec.sandbox_id]
            # Traffic to the sandbox waited for this: after a fork of many children
            # it is where their time goes (the guests' first work under TCG).
            log.info(
                "sandbox %s: envd /init after %s in %s, %d request(s)",
                rec.sandbox_id,
                what,
                phases,
                attempts,
            )
            self._failed.pop(rec.sandbox_id, None)
            if first and self.after_first is not None:
                self._start_after_first(rec.sandbox_id, self.after_first)
            rec.envd_pending = None
            try:
                self.store.update_sandbox(rec.sandbox_id, envd_pending=None)
            except sqlite3.Error as exc:
                # envd has its token: the sandbox serves. The record still says the
                # /init is owed, so a restart runs it once more, which is harmless.
                log.warning("sandbox %s: recording its envd /init failed: %s", rec.sandbox_id, exc)

        task = asyncio.get_running_loop().create_task(init())
        self._running[rec.sandbox_id] = task

    def _start_after_first(
        self, sandbox_id: str, work: Callable[[str], Coroutine[Any, Any, None]]
    ) -> None:
        async def run() -> None:
            try:
                await work(sandbox_id)
            except Exception as exc:
                log.warning("sandbox %s: work after its start failed: %s", sandbox_id, exc)
            finally:
                if self._after.get(sandbox_id) is task:
                    del self._after[sandbox_id]

        task = asyncio.get_running_loop().create_task(run())
        self._after[sandbox_id] = task

    async def settled(self, sandbox_id: str) -> None:
        """Wait for envd's /init of a sandbox just started or resumed (an operation that
        saves the machine, or talks to envd itself, must not run beside it)."""
        running = self._running.get(sandbox_id)
        if running is None:
            return
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            # A kill cancels the /init it makes pointless; the waiter then goes on to
            # find the sandbox gone. Only a cancellation of the waiter itself propagates.
            if not running.cancelled():
                raise
        except Exception:
            pass  # logged by the /init task; check says what it means

    def check(self, sandbox_id: str) -> None:
        """:class:`OperationFailed` if the sandbox's first envd /init failed: its envd has
        no token and must not be reached."""
        failed = self._failed.get(sandbox_id)
        if failed is not None:
            raise OperationFailed(
                f"sandbox {sandbox_id} did not start: envd /init failed ({failed}); kill it"
            )

    def forget(self, sandbox_id: str) -> None:
        """A sandbox being killed: its /init, if still running, is pointless."""
        self._failed.pop(sandbox_id, None)
        for tasks in (self._running, self._after):
            running = tasks.pop(sandbox_id, None)
            if running is not None:
                running.cancel()

    async def stop(self) -> None:
        """Cancel the /inits still running (a server shutting down): each stays owed in
        its record, and the next start runs it again."""
        tasks = [*self._running.values(), *self._after.values()]
        self._running.clear()
        self._after.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
