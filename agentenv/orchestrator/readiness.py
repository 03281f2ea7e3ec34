"""When a template build's start command has made the template ready, as E2B decides it:
the ready command is tried until it succeeds or a deadline passes, and the start
command's lifetime does not matter unless it failed. A start command that ended with
status 0 (``echo ready``) leaves the ready command to decide; one that ended otherwise
(a non-zero status, a signal, its shell gone without a status) before the ready command
succeeded fails the build. No I/O here: the build passes in how to ask the guest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# What E2B waits for when a start command comes without a ready command.
DEFAULT_READY_CMD = "sleep 20"
# E2B's bound on the ready command.
READY_TIMEOUT_S = 600.0
READY_POLL_S = 1.0


@dataclass(frozen=True)
class StartState:
    """The start command as last seen: running, or ended with ``exit_code`` (None when
    it ended without leaving one)."""

    running: bool
    exit_code: int | None = None

    @property
    def failed(self) -> bool:
        return not self.running and self.exit_code != 0


class NotReady(Exception):
    """The template did not become ready; ``start`` is the start command's state when
    the build gave up, if there is one."""

    def __init__(self, message: str, start: StartState | None = None) -> None:
        super().__init__(message)
        self.start = start


class StartCommandFailed(NotReady):
    """The start command failed before the ready command succeeded."""


async def wait_until_ready(
    start_state: Callable[[], Awaitable[StartState]] | None,
    ready: Callable[[], Awaitable[bool]],
    *,
    timeout_s: float = READY_TIMEOUT_S,
    poll_s: float = READY_POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Return once ``ready()`` is true; :class:`StartCommandFailed` if the start command
    (``start_state``, None without one) failed first, :class:`NotReady` when
    ``timeout_s`` passed."""
    deadline = clock() + timeout_s
    state: StartState | None = None
    while True:
        if start_state is not None:
            state = await start_state()
            if state.failed:
                raise StartCommandFailed(_ended(state), state)
        if await ready():
            if start_state is not None:
                # It may have failed while the ready command ran.
                state = await start_state()
                if state.failed:
                    raise StartCommandFailed(_ended(state), state)
            return
        if clock() >= deadline:
            ended = ""
            if state is not None and not state.running:
                ended = f" (the start command {_ended(state)})"
            raise NotReady(f"did not succeed within {timeout_s:.0f}s{ended}", state)
        await sleep(poll_s)


def _ended(state: StartState) -> str:
    if state.exit_code is None:
        return "ended without an exit status"
    return f"exited with code {state.exit_code}"
