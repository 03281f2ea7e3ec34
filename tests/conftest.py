from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SANDBOX_DOMAIN, ServerProcess, kill_vmms, live_server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The nested KVM tests (tests/kvm) take minutes: deselected, not skipped, unless
    # AENV_KVM_TESTS=1 (scripts/test sets it; `-m kvm` then runs only them).
    if os.environ.get("AENV_KVM_TESTS") != "1":
        nested = [item for item in items if item.get_closest_marker("kvm") is not None]
        if nested:
            config.hook.pytest_deselected(items=nested)
            items[:] = [item for item in items if item.get_closest_marker("kvm") is None]
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="VM tests need root (netns, taps, /dev/kvm)")
    for item in items:
        if "vm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_root() -> Iterator[Path]:
    # scripts/test puts AENV_TEST_DIR on a reflink-capable filesystem, as a production
    # data directory is; elsewhere the servers fall back to copies.
    base = Path(os.environ.get("AENV_TEST_DIR", "/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="aenv-test-", dir=base))
    yield root
    kill_vmms(str(root))
    if os.environ.get("AENV_KEEP_TEST_ROOT") != "1":
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def guest_image() -> None:
    """Bring the guest image up to date with the sources (envd lives on its tools drive);
    a no-op taking a second when nothing changed."""
    subprocess.run(
        [sys.executable, "-m", "agentenv.guest", "build"], check=True, stdout=subprocess.DEVNULL
    )


@pytest.fixture(scope="session")
def server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    """One live server (real VMs) shared by the API tests of a session."""
    # A short linger, so tests see a paused sandbox's network released soon. Host names
    # route to sandboxes only under the configured domain (SANDBOX_DOMAIN).
    node = ServerProcess(
        home=test_root / "node",
        extra_env={"AENV_NETWORK_LINGER": "1", "AENV_DOMAIN": SANDBOX_DOMAIN},
    )
    with live_server(node) as srv:
        yield srv
