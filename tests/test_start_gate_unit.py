"""How many sandboxes start at once (``Config.max_starting``): a start waits for a place
from its restore until envd's /init is over, and is refused with a 503 when none comes in
time. On an orchestrator with fake VMs, its envd /init held back by a gate."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.errors import CapacityExhausted
from agentenv.orchestrator.resources import StartGate
from tests.fakes import FAKE_TEMPLATE, Node, start_node


def _restores(node: Node) -> int:
    return sum(1 for call, _ in node.driver.calls if call == "restore")


async def test_places_are_given_back_once_and_waiters_are_refused_in_time() -> None:
    gate = StartGate(places=1, wait_s=0.2)
    first = await gate.enter("create")
    assert gate.starting() == 1
    with pytest.raises(CapacityExhausted, match=r"1 sandboxes are starting .* 0\.2 s"):
        await gate.enter("create")
    # A waiter whose caller goes away takes no place with it.
    waiter = asyncio.ensure_future(gate.enter("resume"))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    first.leave()
    first.leave()  # once only
    assert gate.starting() == 0
    second = await gate.enter("create")
    assert gate.starting() == 1
    second.leave()
    unbounded = StartGate(places=0, wait_s=0.0)
    places = [await unbounded.enter("create") for _ in range(3)]
    assert unbounded.starting() == 0
    for place in places:
        place.leave()


async def test_a_create_waits_for_the_last_start_to_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one place, a second create does not restore its machine until the first
    sandbox's /init is over; a failed /init and a kill give the place back too."""
    node = await start_node(
        tmp_path / "a",
        tmp_path / "repository",
        in_memory_store=True,
        configure=lambda c: c.with_overrides(max_starting=1, envd_init_timeout=0.5),
    )
    release = asyncio.Event()
    real_init = envd_client.init

    async def held_init(*args: Any, **kwargs: Any) -> int:
        await release.wait()
        return await real_init(*args, **kwargs)

    monkeypatch.setattr(envd_client, "init", held_init)
    try:
        orch = node.orchestrator
        gate = orch._lifecycle.starts
        first = await orch.create(FAKE_TEMPLATE, envd_in_background=True)
        assert gate.starting() == 1
        restores = _restores(node)
        second = asyncio.ensure_future(orch.create(FAKE_TEMPLATE, envd_in_background=True))
        await asyncio.sleep(0.2)
        assert not second.done()
        assert _restores(node) == restores  # still waiting for a place
        release.set()
        await orch.ready_for_traffic(first.sandbox_id)
        second_id = (await second).sandbox_id
        await orch.ready_for_traffic(second_id)
        assert gate.starting() == 0

        # A /init that fails gives the place back.
        node.envd.unreachable.add(orch.get(second_id).guest_address)
        await orch.pause(second_id)
        await orch.resume(second_id)
        assert gate.starting() == 1
        settling = orch._lifecycle.inits.running(second_id)
        assert settling is not None
        await settling
        assert gate.starting() == 0

        # So does a kill while the /init runs.
        release.clear()
        third = await orch.create(FAKE_TEMPLATE, envd_in_background=True)
        assert gate.starting() == 1
        await orch.kill(third.sandbox_id)
        assert gate.starting() == 0
    finally:
        release.set()
        await node.stop()
