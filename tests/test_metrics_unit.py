"""Sandbox metrics history and the end of a sandbox's traffic, on an orchestrator with
fake VMs and a fake envd (no VMs; the SDK's view is tests/e2b/test_sdk_metrics.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import cast

import httpx
import pytest

from agentenv.orchestrator.errors import SandboxNotFound
from agentenv.orchestrator.metrics import (
    GUEST_SAMPLE_INTERVAL_S,
    GUEST_SAMPLE_MAX_AGE_S,
    IDLE_REPORT_INTERVAL_S,
    GuestSample,
    MetricsHistory,
)
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxEvent, Store, utcnow
from agentenv.vmm.base import GuestMemory, VirtualMachine
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


MIB = 1024 * 1024


class _MeteredVM:
    """What the history asks of a VMM: its pid, CPU time and the balloon's report."""

    def __init__(self) -> None:
        self.pid = 4242
        self.cpu = 100.0
        self.memory: GuestMemory | None = GuestMemory(512 * MIB, 384 * MIB, 32 * MIB)
        self.asked_every: list[float] = []
        self.writes: int | None = None  # the VMM does not count drive writes

    def cpu_seconds(self) -> float:
        return self.cpu

    async def disk_writes(self) -> int | None:
        return self.writes

    async def guest_memory(self, report_every_s: float) -> GuestMemory | None:
        self.asked_every.append(report_every_s)
        return self.memory


class _Sampler:
    """A history over one fake-envd sandbox and a :class:`_MeteredVM`, on a fake clock."""

    def __init__(self, node: Node, sandbox_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.node, self.sandbox_id = node, sandbox_id
        self.vm = _MeteredVM()
        self.clock = 1000.0
        monkeypatch.setattr(time, "monotonic", lambda: self.clock)
        orch = node.orchestrator
        self.history = MetricsHistory(
            orch.store, orch.http, lambda _: cast(VirtualMachine, self.vm), interval_s=5
        )

    def guest_asked(self) -> int:
        return sum(r.path == "/metrics" for r in self.node.envd.requests)

    async def sample(self, after_s: float, cpu_s: float = 0.0) -> dict[str, object]:
        self.clock += after_s
        self.vm.cpu += cpu_s
        await self.history.sample([await self.node.orchestrator.get_settled(self.sandbox_id)])
        latest = self.history.latest(self.sandbox_id)
        assert latest is not None
        return latest.figures


async def test_samples_between_guest_ones_are_measured_on_the_host(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    orch = node.orchestrator
    sandbox_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
    view = await orch.get_settled(sandbox_id)
    sampler = _Sampler(node, sandbox_id, monkeypatch)
    vm, guest_asked, sample = sampler.vm, sampler.guest_asked, sampler.sample

    asked = guest_asked()
    first = await sample(0)
    # The first sample is envd's; the balloon driver is asked to report at the interval.
    assert guest_asked() == asked + 1 and vm.asked_every == [5]
    assert first["disk_used"] == 300 * MIB

    # Then the host measures, and envd is not asked: CPU time over the interval and
    # vCPUs, the balloon's figures, the disk carried from envd's sample.
    second = await sample(5, cpu_s=1.0)
    assert guest_asked() == asked + 1
    assert second["cpu_used_pct"] == 100.0 * 1.0 / (5 * view.record.vcpus)
    assert second["mem_total"] == 512 * MIB and second["mem_used"] == 128 * MIB
    assert second["mem_cache"] == 32 * MIB
    assert (second["disk_used"], second["disk_total"]) == (300 * MIB, 1024 * MIB)
    assert (await sample(5))["cpu_used_pct"] == 0.0

    # envd again: for fresh disk figures, after a resume (another VMM process), and
    # whenever the balloon has nothing to say.
    await sample(GUEST_SAMPLE_INTERVAL_S)
    assert guest_asked() == asked + 2
    await sample(5)
    assert guest_asked() == asked + 2
    vm.pid += 1
    await sample(5)
    assert guest_asked() == asked + 3
    vm.memory = None
    await sample(5, cpu_s=1.0)
    assert guest_asked() == asked + 4


async def test_envd_is_asked_for_disk_figures_only_after_drive_writes(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox_id = (await node.orchestrator.create(FAKE_TEMPLATE)).sandbox_id
    sampler = _Sampler(node, sandbox_id, monkeypatch)
    sampler.vm.writes = 7
    asked = sampler.guest_asked()
    await sampler.sample(0)
    assert sampler.guest_asked() == asked + 1
    # Due, but the guest wrote nothing: the disk figures still hold, envd sleeps on.
    for _ in range(3):
        figures = await sampler.sample(GUEST_SAMPLE_INTERVAL_S)
        assert figures["disk_used"] == 300 * MIB
    assert sampler.guest_asked() == asked + 1
    # A write: envd is asked at the next due sample, not before.
    sampler.vm.writes = 8
    await sampler.sample(5)
    assert sampler.guest_asked() == asked + 1
    await sampler.sample(GUEST_SAMPLE_INTERVAL_S)
    assert sampler.guest_asked() == asked + 2
    # Without writes, envd's figures are still renewed once they reach the maximum age.
    await sampler.sample(GUEST_SAMPLE_MAX_AGE_S - 1)
    assert sampler.guest_asked() == asked + 2
    await sampler.sample(1)
    assert sampler.guest_asked() == asked + 3


async def test_an_idle_guest_reports_its_memory_seldom(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox_id = (await node.orchestrator.create(FAKE_TEMPLATE)).sandbox_id
    sampler = _Sampler(node, sandbox_id, monkeypatch)
    vm, sample = sampler.vm, sampler.sample
    vm.writes = 0  # nothing written: envd's disk figures hold, envd is not asked
    await sample(0)
    assert (await sample(5, cpu_s=1.0))["mem_used"] == 128 * MIB
    assert vm.asked_every == [5, 5]
    # Idle (its VMM used almost no CPU): the balloon is asked to report seldom, and the
    # samples in between carry its figures without asking the VMM.
    vm.memory = GuestMemory(512 * MIB, 256 * MIB, 32 * MIB)
    assert (await sample(5, cpu_s=0.01))["mem_used"] == 256 * MIB
    idle = IDLE_REPORT_INTERVAL_S
    assert vm.asked_every == [5, 5, idle]
    vm.memory = GuestMemory(512 * MIB, 128 * MIB, 32 * MIB)
    figures = await sample(5)
    assert figures["mem_used"] == 256 * MIB and figures["cpu_used_pct"] == 0.0
    assert vm.asked_every == [5, 5, idle]
    # Busy again: reports at the interval; until the guest has reported since, envd is
    # asked (the VMM has no figures), then the figures are the VMM's.
    vm.memory, asked = None, sampler.guest_asked()
    await sample(5, cpu_s=0.5)
    assert sampler.guest_asked() == asked + 1 and vm.asked_every[-1] == 5
    vm.memory = GuestMemory(512 * MIB, 128 * MIB, 32 * MIB)
    assert (await sample(5, cpu_s=0.5))["mem_used"] == 384 * MIB
    assert sampler.guest_asked() == asked + 1
    vm.asked_every = [5, 5, idle, 5]
    # While idle, the VMM is asked once in the idle interval.
    await sample(5)
    assert vm.asked_every == [5, 5, idle, 5, idle]
    for _ in range(round(idle / 5) - 1):
        await sample(5)
    assert vm.asked_every == [5, 5, idle, 5, idle]
    await sample(5)
    assert vm.asked_every == [5, 5, idle, 5, idle, idle]


class _StuckVM(_MeteredVM):
    """A VMM that never answers for its balloon (its monitor busy elsewhere)."""

    async def guest_memory(self, report_every_s: float) -> GuestMemory | None:
        await asyncio.Event().wait()
        return None


async def test_a_stuck_sandbox_holds_back_no_other_sample(node: Node) -> None:
    orch = node.orchestrator
    stuck_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
    fine_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
    machines = {stuck_id: _StuckVM(), fine_id: _MeteredVM()}
    history = MetricsHistory(
        orch.store,
        orch.http,
        lambda sandbox_id: cast(VirtualMachine, machines[sandbox_id]),
        interval_s=0.2,
    )
    views = [await orch.get_settled(stuck_id), await orch.get_settled(fine_id)]
    # Bounded by the interval: the tick ends, with the answering sandbox's sample.
    await asyncio.wait_for(history.sample(views), 10)
    assert history.latest(fine_id) is not None
    assert history.latest(stuck_id) is None
