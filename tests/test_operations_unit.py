"""Per-sandbox operations: one at a time, joined when identical, immune to cancellation."""

from __future__ import annotations

import asyncio

import pytest

from agentenv.orchestrator.operations import SandboxOperations


class Work:
    """An operation that counts its runs and finishes when the test lets it."""

    def __init__(self, result: str = "done", error: Exception | None = None) -> None:
        self.result = result
        self.error = error
        self.runs = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self) -> str:
        self.runs += 1
        self.started.set()
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.result


async def test_identical_requests_share_one_run() -> None:
    ops = SandboxOperations()
    work = Work()
    callers = [asyncio.create_task(ops.run("s", "pause", work, join=True)) for _ in range(3)]
    await work.started.wait()
    late = asyncio.create_task(ops.run("s", "pause", work, join=True))
    await asyncio.sleep(0)
    work.release.set()
    assert await asyncio.gather(*callers, late) == ["done"] * 4
    assert work.runs == 1
    assert ops.pending() == []


async def test_joined_callers_share_the_failure() -> None:
    ops = SandboxOperations()
    work = Work(error=RuntimeError("no room"))
    callers = [asyncio.create_task(ops.run("s", "pause", work, join=True)) for _ in range(2)]
    await work.started.wait()
    work.release.set()
    outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert [str(o) for o in outcomes] == ["no room", "no room"]
    assert work.runs == 1


async def test_a_finished_operation_is_not_joined() -> None:
    ops = SandboxOperations()
    first, second = Work("first"), Work("second")
    first.release.set()
    second.release.set()
    assert await ops.run("s", "pause", first, join=True) == "first"
    assert await ops.run("s", "pause", second, join=True) == "second"
    assert (first.runs, second.runs) == (1, 1)


async def test_operations_on_one_sandbox_run_one_after_another() -> None:
    ops = SandboxOperations()
    first, second = Work("pause"), Work("kill")
    paused = asyncio.create_task(ops.run("s", "pause", first, join=True))
    await first.started.wait()
    killed = asyncio.create_task(ops.run("s", "kill", second, join=True))
    second.release.set()
    await asyncio.sleep(0.01)
    assert second.runs == 0  # queued behind the pause
    assert len(ops.pending("s")) == 2
    first.release.set()
    assert [await paused, await killed] == ["pause", "kill"]


async def test_other_sandboxes_and_unjoined_kinds_do_not_wait_or_join() -> None:
    ops = SandboxOperations()
    held, other, snapshot = Work(), Work("other"), Work("snapshot")
    blocked = asyncio.create_task(ops.run("a", "pause", held, join=True))
    await held.started.wait()
    other.release.set()
    assert await ops.run("b", "pause", other, join=True) == "other"
    snapshot.release.set()
    # Without join, two snapshot requests are two snapshots.
    both = [asyncio.create_task(ops.run("c", "snapshot", snapshot, join=False)) for _ in range(2)]
    assert await asyncio.gather(*both) == ["snapshot", "snapshot"]
    assert snapshot.runs == 2
    held.release.set()
    await blocked


async def test_a_caller_going_away_does_not_abort_the_operation() -> None:
    ops = SandboxOperations()
    work = Work()
    caller = asyncio.create_task(ops.run("s", "resume", work, join=True))
    await work.started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    (running,) = ops.pending("s")
    work.release.set()
    assert await running == "done"
