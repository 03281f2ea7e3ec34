"""The node's guest-RAM budget (``Config.memory_overcommit``): creates, forks and resumes
beyond it are refused with a 503 that says why, and paused sandboxes lend nothing. On an
orchestrator with fake VMs (the fake template's sandboxes have 128 MiB)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.orchestrator.errors import CapacityExhausted
from agentenv.orchestrator.resources import (
    MemoryBudget,
    host_headroom_mib,
    host_memory_pressure_pct,
    host_ram_mib,
)
from agentenv.orchestrator.store import Store
from tests.fakes import FAKE_TEMPLATE, start_node

SANDBOX_MIB = 128


def test_budget_arithmetic() -> None:
    store = Store(None)
    store.open()
    budget = MemoryBudget(store, overcommit=1.5, host_mib=1000)
    assert budget.limit_mib == 1500
    with budget.hold("a", 1000, "create"):
        assert budget.lent_mib() == 1000
        with pytest.raises(CapacityExhausted, match=r"lends 1000 MiB .* may lend 1500 MiB"):
            budget.admit(501, "create")
        budget.admit(500, "create")
    assert budget.lent_mib() == 0  # released with the start, whatever its outcome
    assert MemoryBudget(store, overcommit=0, host_mib=1000).limit_mib is None
    store.close()


def test_starts_are_refused_while_the_host_is_below_its_reserve() -> None:
    store = Store(None)
    store.open()
    headroom = [5000]
    budget = MemoryBudget(
        store, overcommit=0, host_mib=1000, reserve_mib=1024, headroom_mib=lambda: headroom[0]
    )
    budget.admit(512, "create")
    headroom[0] = 1000
    with pytest.raises(CapacityExhausted, match=r"has 1000 MiB .* below its 1024 MiB reserve"):
        budget.admit(512, "resume")
    # 0 turns the check off.
    MemoryBudget(store, overcommit=0, host_mib=1000, headroom_mib=lambda: 0).admit(512, "fork")
    store.close()


def test_starts_are_refused_while_the_host_stalls_on_memory() -> None:
    store = Store(None)
    store.open()
    stalled: list[float | None] = [0.4]
    budget = MemoryBudget(
        store, overcommit=0, host_mib=1000, pressure_limit_pct=10, pressure_pct=lambda: stalled[0]
    )
    budget.admit(512, "create")
    stalled[0] = 12.5
    with pytest.raises(CapacityExhausted, match=r"stalled on memory 12.5 % .* limit of 10 %"):
        budget.admit(512, "fork")
    stalled[0] = None  # a kernel without pressure stall information: no check
    budget.admit(512, "resume")
    # 0 turns the check off.
    MemoryBudget(store, overcommit=0, host_mib=1000, pressure_pct=lambda: 99.0).admit(512, "fork")
    store.close()


def test_the_host_memory_pressure_is_read() -> None:
    stalled = host_memory_pressure_pct()
    if not Path("/proc/pressure/memory").exists():
        assert stalled is None
        return
    assert stalled is not None and 0 <= stalled <= 100


def test_the_host_headroom_leaves_out_mapped_pages() -> None:
    info = {
        line.split(":")[0]: int(line.split()[1]) // 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
    }
    assert host_headroom_mib() <= info["MemAvailable"] - info["Mapped"] + 64


async def test_starts_beyond_the_budget_are_refused(tmp_path: Path) -> None:
    # Room for two sandboxes and a half.
    ratio = 2.5 * SANDBOX_MIB / host_ram_mib()
    node = await start_node(
        tmp_path / "a",
        tmp_path / "repository",
        in_memory_store=True,
        configure=lambda c: c.with_overrides(memory_overcommit=ratio),
    )
    try:
        orch = node.orchestrator
        first = (await orch.create(FAKE_TEMPLATE)).sandbox_id
        second = (await orch.create(FAKE_TEMPLATE)).sandbox_id
        with pytest.raises(CapacityExhausted, match="create refused"):
            await orch.create(FAKE_TEMPLATE)
        (refused_child,) = await orch.fork(first, 1)
        assert isinstance(refused_child, CapacityExhausted)
        # A paused sandbox holds no RAM: its place can be taken, and it cannot come back
        # until one goes.
        await orch.pause(second)
        third = (await orch.create(FAKE_TEMPLATE)).sandbox_id
        with pytest.raises(CapacityExhausted, match="resume refused"):
            await orch.resume(second)
        assert (await orch.get_settled(second)).state == "paused"  # nothing changed
        await orch.kill(third)
        await orch.resume(second)
        assert (await orch.get_settled(second)).state == "running"
    finally:
        await node.stop()
