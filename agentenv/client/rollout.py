"""Rollouts for RL: fork a prepared sandbox into N children, run a function in each in
parallel, collect what each returned or raised, and clean the children up."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, get_args

from agentenv.api.models import SnapshotInfo
from agentenv.client.async_client import AsyncAgentEnv
from agentenv.client.connection import SandboxRef
from agentenv.client.errors import AgentEnvError
from agentenv.client.sync_client import AgentEnv

if TYPE_CHECKING:
    import e2b  # imported by the client once it makes SDK objects

T = TypeVar("T")

After = Literal["kill", "snapshot", "keep"]
"""What happens to a child once its function returned: ``kill`` it, ``snapshot`` it and
then kill it (the snapshot persists), or ``keep`` it running."""


@dataclass
class RolloutResult(Generic[T]):
    """What one child produced. ``error`` is what the function raised, why the child did
    not start (``sandbox_id`` is then ``None``), or why its snapshot failed; ``seconds``
    is the function's wall time."""

    index: int
    sandbox_id: str | None
    value: T | None = None
    error: Exception | None = None
    seconds: float = 0.0
    snapshot: SnapshotInfo | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _check_after(after: str) -> None:
    if after not in get_args(After):
        raise ValueError(f"after must be one of {', '.join(get_args(After))}, not {after!r}")


def rollout(
    client: AgentEnv,
    sandbox: SandboxRef,
    n: int,
    fn: Callable[[e2b.Sandbox, int], T],
    *,
    after: After = "kill",
    timeout: int | None = None,
    max_workers: int | None = None,
) -> list[RolloutResult[T]]:
    """Fork ``sandbox`` into ``n`` children and call ``fn(child, index)`` for each, in a
    thread per child (at most ``max_workers`` at a time). Each child is handled as soon
    as its function returns or raises, as ``after`` says. ``timeout`` is the children's
    lifetime in seconds: the server kills them then even if this process is gone.

    If the rollout itself is interrupted (Ctrl-C, a failing kill), every child is killed
    whatever ``after`` says, since the caller never learns their ids."""
    _check_after(after)
    children = client.fork(sandbox, n, timeout=timeout)
    results: list[RolloutResult[T] | None] = _results_for_failed(children)
    started = [(i, c) for i, c in enumerate(children) if not isinstance(c, AgentEnvError)]

    def run(index: int, child: e2b.Sandbox) -> RolloutResult[T]:
        result: RolloutResult[T] = RolloutResult(index, child.sandbox_id)
        start = time.perf_counter()
        try:
            result.value = fn(child, index)
        except Exception as exc:
            result.error = exc
        result.seconds = time.perf_counter() - start
        try:
            if after == "snapshot":
                result.snapshot = client.snapshot(child)
        except AgentEnvError as exc:
            result.error = result.error or exc
        finally:
            if after != "keep":
                client.kill(child)
        return result

    with ThreadPoolExecutor(max_workers=max_workers or max(1, len(started))) as pool:
        futures = [pool.submit(run, i, child) for i, child in started]
        try:
            for future in futures:
                finished = future.result()
                results[finished.index] = finished
        except BaseException:
            # Killing the children makes the functions still running in threads fail
            # fast, so leaving the pool does not wait for whole rollouts.
            for future in futures:
                future.cancel()
            for _, child in started:
                with contextlib.suppress(AgentEnvError):
                    client.kill(child)
            raise
    return _completed(results)


async def rollout_async(
    client: AsyncAgentEnv,
    sandbox: SandboxRef,
    n: int,
    fn: Callable[[e2b.AsyncSandbox, int], Awaitable[T]],
    *,
    after: After = "kill",
    timeout: int | None = None,
) -> list[RolloutResult[T]]:
    """``rollout`` for asyncio: ``await fn(child, index)`` runs concurrently in a task per
    child. Cancelling the rollout cancels the functions and kills every child."""
    _check_after(after)
    children = await client.fork(sandbox, n, timeout=timeout)
    results: list[RolloutResult[T] | None] = _results_for_failed(children)
    started = [(i, c) for i, c in enumerate(children) if not isinstance(c, AgentEnvError)]

    async def run(index: int, child: e2b.AsyncSandbox) -> RolloutResult[T]:
        result: RolloutResult[T] = RolloutResult(index, child.sandbox_id)
        start = time.perf_counter()
        try:
            result.value = await fn(child, index)
        except Exception as exc:
            result.error = exc
        result.seconds = time.perf_counter() - start
        try:
            if after == "snapshot":
                result.snapshot = await client.snapshot(child)
        except AgentEnvError as exc:
            result.error = result.error or exc
        finally:
            if after != "keep":
                await client.kill(child)
        return result

    tasks = [asyncio.create_task(run(i, child)) for i, child in started]
    try:
        for finished in await asyncio.gather(*tasks):
            results[finished.index] = finished
    except BaseException:
        # A cancelled task skips its own cleanup (and one cancelled before it first ran
        # never started), so the children are killed here, once the tasks have stopped.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(client.kill(c) for _, c in started), return_exceptions=True)
        raise
    return _completed(results)


def _results_for_failed(
    children: Iterable[e2b.Sandbox | e2b.AsyncSandbox | AgentEnvError],
) -> list[RolloutResult[T] | None]:
    """A result for each child that did not start; ``None`` holds the place of the others."""
    return [
        RolloutResult(i, None, error=child) if isinstance(child, AgentEnvError) else None
        for i, child in enumerate(children)
    ]


def _completed(results: list[RolloutResult[T] | None]) -> list[RolloutResult[T]]:
    done = [r for r in results if r is not None]
    if len(done) != len(results):
        raise AgentEnvError(None, "rollout finished without a result for every child")
    return done
