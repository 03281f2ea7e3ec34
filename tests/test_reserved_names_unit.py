"""Snapshot and template names may not take the namespaces the catalog names its own
records in (a resume's claim, secrets, volumes): a snapshot named ``claim:<id>:<g>`` would
otherwise block that resume, one named ``secret:x`` the secret ``x``."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.orchestrator.errors import InvalidRequest
from tests.fakes import FAKE_TEMPLATE, start_node


async def test_reserved_namespaces_are_refused(tmp_path: Path) -> None:
    node = await start_node(tmp_path / "a", tmp_path / "repository", in_memory_store=True)
    try:
        orch = node.orchestrator
        sandbox_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
        for name in (f"claim:{sandbox_id}:1", "secret:api-token", "volume:data", "secret"):
            with pytest.raises(InvalidRequest, match="reserved"):
                await orch.snapshot(sandbox_id, name)
        assert (await orch.snapshot(sandbox_id, "secrets:fine")).snapshot_id
    finally:
        await node.stop()
