"""A live agentenv server for the official ``e2b`` SDK. It runs with ``AENV_DOMAIN`` so
``get_host(port)`` names route through its proxy; tests point the SDK at it per client
(``tests/e2b/support.py``) rather than through process-wide ``E2B_*`` variables."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import E2B

from tests.e2b.support import sdk_client
from tests.helpers import ServerProcess, free_port, live_server


@pytest.fixture(scope="session")
def e2b_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    port = free_port()
    srv = ServerProcess(
        home=test_root / "e2b", port=port, extra_env={"AENV_DOMAIN": f"localhost:{port}"}
    )
    with live_server(srv):
        yield srv


@pytest.fixture(scope="session")
def e2b(e2b_server: ServerProcess) -> E2B:
    """The SDK, bound to ``e2b_server``."""
    return sdk_client(e2b_server)
