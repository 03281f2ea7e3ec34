"""Sandbox metrics history and the end of a sandbox's traffic, on an orchestrator with
fake VMs and a fake envd (no VMs; the SDK's view is tests/e2b/test_sdk_metrics.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from agentenv.orchestrator.errors import SandboxNotFound
from agentenv.orchestrator.metrics import GuestSample, MetricsHistory
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxEvent, Store, utcnow
from tests.fakes import FAKE_TEMPLATE, Node, start_node


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository", in_memory_store=True)
    yield started
    await started.stop()


async def test_history_keeps_a_window_and_a_bound() -> None:
    store = Store(None)
    async with httpx.AsyncClient() as http:
        history = MetricsHistory(store, http, limit=3)
        t0 = utcnow()
        for i in range(5):
            history.record("a", GuestSample(t0 + timedelta(seconds=5 * i), {"i": i}))

        def kept(start_s: float | None, until_s: float | None) -> list[object]:
            start = t0 + timedelta(seconds=start_s) if start_s is not None else None
            until = t0 + timedelta(seconds=until_s) if until_s is not None else None
            return [s.figures["i"] for s in history.between("a", start, until)]

        assert kept(None, None) == [2, 3, 4]  # the oldest went past the bound
        assert kept(15, 20) == [3]  # [start, until)
        assert kept(-100, 0) == []
        assert kept(30, None) == []
        assert history.between("other", None, None) == []
        # A removed sandbox's history goes with its record.
        store.listen(lambda _: None)
        history._follow(SandboxEvent("a", SandboxState.KILLING, None, utcnow()))
        assert kept(None, None) == []


async def test_metrics_honour_the_window(node: Node) -> None:
    orch = node.orchestrator
    before = utcnow()
    sandbox_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
    # A window before the sandbox existed has nothing, and asks the guest nothing.
    asked = len(node.envd.requests)
    assert await orch.metrics(sandbox_id, before - timedelta(hours=1), before) == []
    assert len(node.envd.requests) == asked
    # Not sampled yet: the window that reaches now gets a sample taken at once, kept.
    (first,) = await orch.metrics(sandbox_id, None, None)
    assert first.figures["cpu_count"] == 1
    assert await orch.metrics(sandbox_id, before, None) == [first]
    assert await orch.metrics(sandbox_id, first.at + timedelta(seconds=1), None) == []
    vcpus = (await orch.get_settled(sandbox_id)).record.vcpus
    assert orch.latest_metrics({sandbox_id, "nosuch"}) == {sandbox_id: (first, vcpus)}
    await orch.pause(sandbox_id)
    assert await orch.metrics(sandbox_id, None, None) == [first]  # kept through a pause
    await orch.kill(sandbox_id)
    with pytest.raises(SandboxNotFound):
        await orch.metrics(sandbox_id, None, None)


async def test_without_periodic_sampling_each_request_samples(tmp_path: Path) -> None:
    """metrics_interval 0 (idle guests are never woken for metrics): a request whose
    window reaches now samples the guest, and the samples add up to a history."""
    node = await start_node(
        tmp_path / "a",
        tmp_path / "repository",
        in_memory_store=True,
        configure=lambda c: c.with_overrides(metrics_interval=0),
    )
    try:
        orch = node.orchestrator
        sandbox_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
        (first,) = await orch.metrics(sandbox_id, None, None)
        first_again, second = await orch.metrics(sandbox_id, None, None)
        assert first_again == first and second.at >= first.at
    finally:
        await node.stop()


async def test_kill_and_pause_end_traffic(node: Node) -> None:
    orch = node.orchestrator
    ended: list[tuple[str, str]] = []
    orch.on_traffic_end(lambda sandbox_id, reason: ended.append((sandbox_id, reason)))
    sandbox_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
    await orch.snapshot(sandbox_id)
    assert ended == []  # a snapshot keeps the sandbox running
    await orch.pause(sandbox_id)
    assert ended == [(sandbox_id, "paused")]
    await orch.resume(sandbox_id)
    await orch.kill(sandbox_id)
    assert ended == [(sandbox_id, "paused"), (sandbox_id, "killed")]
    paused = (await orch.create(FAKE_TEMPLATE)).sandbox_id
    await orch.pause(paused)
    await orch.kill(paused)  # its traffic ended with the pause
    assert ended[2:] == [(paused, "paused")]
