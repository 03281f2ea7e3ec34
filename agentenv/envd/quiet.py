"""A uvicorn server that sleeps while nothing happens.

uvicorn's ``Server.main_loop`` wakes ten times a second to refresh the ``Date`` header and
to notice a shutdown request. In a guest under TCG each of those wakeups runs the Python
interpreter at emulation speed and keeps the vCPU and the VMM's main loop busy: it was the
largest single cost of an idle sandbox (10 of its ~40 wakeups a second). This server waits
on an event that the signal handler sets instead, and sends no ``Date`` header (it would
go stale without the tick; the node's proxy in front adds its own).
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` whose main loop blocks until an exit is requested."""

    def __init__(self, config: uvicorn.Config) -> None:
        if config.date_header:
            raise ValueError(
                "QuietServer sends no Date header: build its Config with date_header=False"
            )
        super().__init__(config)
        self._exit_requested: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._exit_requested = asyncio.Event()
        # One tick sets the default headers and honours an exit requested during start-up.
        if await self.on_tick(0):
            return
        await self._exit_requested.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # Signal handlers run between bytecodes of the loop's own thread: hand the wakeup
        # to the loop through its self-pipe rather than touching the event from here.
        if self._loop is not None and self._exit_requested is not None:
            self._loop.call_soon_threadsafe(self._exit_requested.set)
