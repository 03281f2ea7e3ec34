"""Shared pieces for the SDK tests: connection settings bound to an ``e2b.E2B`` client.

Binding the settings to a client (rather than the ``E2B_*`` environment variables) keeps
them out of every other test; ``debug`` is pinned off because an ``E2B_DEBUG`` in the
environment would make the SDK skip the control plane.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from e2b import E2B

from tests.helpers import ServerProcess


def sdk_opts(server: ServerProcess) -> dict[str, Any]:
    """Per-call connection settings, e.g. ``Sandbox.kill(id, **sdk_opts(server))``."""
    return {
        "debug": False,
        "api_url": server.url,
        "sandbox_url": server.url,
        "api_key": server.api_key,
    }


def sdk_client(server: ServerProcess) -> E2B:
    """A client whose ``Sandbox`` / ``AsyncSandbox`` talk to ``server``."""
    return E2B(**sdk_opts(server))


def wait_until(check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")
