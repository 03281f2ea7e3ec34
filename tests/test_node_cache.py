"""A node whose cache is smaller than the snapshots it starts sandboxes from: it keeps
starting them (evicting and fetching again), never evicts what a sandbox uses, and
never holds more than its bound."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, create_sandbox_id, live_server, run_command

pytestmark = pytest.mark.vm


def health(srv: ServerProcess) -> dict[str, Any]:
    with srv.client() as c:
        body: dict[str, Any] = c.get("/health").json()
    return body


def kill(srv: ServerProcess, sandbox_id: str) -> None:
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def read(srv: ServerProcess, sandbox_id: str, path: str) -> str:
    result = run_command(srv.url, sandbox_id, f"cat {path}")
    assert result.exit_code == 0, result.stderr
    return result.stdout.strip()


def within_bound(srv: ServerProcess) -> dict[str, Any]:
    cache = health(srv)["cache"]
    assert cache["usedBytes"] <= cache["limitBytes"], cache
    return dict(cache)


@pytest.fixture(scope="module")
def snapshots(test_root: Path, guest_image: None) -> Iterator[tuple[Path, list[str]]]:
    """Three snapshots committed by a producer node, each with its own file."""
    repository = test_root / "cache-repository"
    producer = ServerProcess(
        home=test_root / "cache-producer", extra_env={"AENV_REPOSITORY": repository.as_uri()}
    )
    names = []
    with live_server(producer):
        for i in range(3):
            sandbox_id = create_sandbox_id(producer, "base", timeout=600)
            # Different RAM contents per snapshot, so they share little.
            result = run_command(
                producer.url,
                sandbox_id,
                f"echo snap-{i} > /home/user/which && head -c 64M /dev/urandom > /dev/shm/fill",
            )
            assert result.exit_code == 0, result.stderr
            with producer.client() as c:
                r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": f"cached-{i}"})
                assert r.status_code == 201, r.text
            names.append(f"cached-{i}")
            kill(producer, sandbox_id)
        # Committed before the producer goes away.
        wait_committed(producer, 3)
    yield repository, names


def wait_committed(srv: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if srv.log_path.read_text(errors="replace").count("committed to") >= count:
            return
        time.sleep(0.3)
    raise AssertionError(f"fewer than {count} commits:\n{srv.log_tail()}")


def test_bounded_cache_evicts_refetches_and_pins(
    snapshots: tuple[Path, list[str]], test_root: Path
) -> None:
    repository, names = snapshots
    home = test_root / "cache-consumer"
    env = {"AENV_REPOSITORY": repository.as_uri()}
    # First with room to spare, to learn what one snapshot takes here.
    with live_server(ServerProcess(home=home, extra_env=env)) as node:
        sandbox_id = create_sandbox_id(node, names[0], timeout=600)
        assert read(node, sandbox_id, "/home/user/which") == "snap-0"
        one = health(node)["cache"]["usedBytes"]
        assert one > 0
        kill(node, sandbox_id)
    # Now bounded to a quarter more than one snapshot: two never fit at once.
    bound = one * 5 // 4
    env["AENV_CACHE_SIZE"] = str(bound)
    with live_server(ServerProcess(home=home, extra_env=env)) as node:
        within_bound(node)
        for i in (1, 2, 0, 1):  # 0 was evicted by then: fetched again
            sandbox_id = create_sandbox_id(node, names[i], timeout=600)
            assert read(node, sandbox_id, "/home/user/which") == f"snap-{i}"
            within_bound(node)
            kill(node, sandbox_id)
        fetched = node.log_path.read_text(errors="replace").count("fetching machine state")
        assert fetched >= 4, "every start after the first needed a fetch"

        # A running sandbox pins what it started from: the next snapshot does not fit.
        pinned = create_sandbox_id(node, names[2], timeout=600)
        with node.client() as c:
            r = c.post("/sandboxes", json={"templateID": names[0]})
            assert r.status_code == 507, r.text
            assert "cache" in r.json()["message"]
        assert read(node, pinned, "/home/user/which") == "snap-2"
        within_bound(node)
        # Released: it fits again.
        kill(node, pinned)
        sandbox_id = create_sandbox_id(node, names[0], timeout=600)
        assert read(node, sandbox_id, "/home/user/which") == "snap-0"
        within_bound(node)
        kill(node, sandbox_id)
