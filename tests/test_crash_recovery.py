"""``kill -9`` of the server at bad moments: while sandboxes run, during a pause, during a
snapshot and during a fork. After a restart every sandbox callers knew of is running or
paused with its data, and nothing is leaked (VMM processes, network namespaces, sandbox
directories, snapshot files)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.config import Config
from tests.helpers import (
    COUNTER,
    ServerProcess,
    create_sandbox_id,
    live_server,
    netns_names,
    run_command,
    vmm_pids,
)

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def crash_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    with live_server(ServerProcess(home=test_root / "crash")) as srv:
        yield srv


def _kill9_during(
    srv: ServerProcess, method: str, path: str, delay: float, body: dict[str, object] | None = None
) -> None:
    """Send a request, SIGKILL the server ``delay`` seconds later, restart it."""

    def call() -> None:
        try:
            with srv.client() as c:
                c.request(method, path, json=body or {}, timeout=60)
        except httpx.HTTPError:
            pass  # the server died under it

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call)
        time.sleep(delay)
        srv.stop(signal.SIGKILL)
        pending.result()
    srv.start()


def _assert_consistent(srv: ServerProcess) -> dict[str, str]:
    """Every listed sandbox has what its state needs and nothing else exists."""
    with srv.client() as c:
        states = {s["sandboxID"]: s["state"] for s in c.get("/sandboxes").json()}
    prefix = f"ae{Config.load(env={}, home=srv.home).instance_tag}-"
    running = {sid for sid, state in states.items() if state == "running"}
    for sid in states:
        pids = vmm_pids(f"/sandboxes/{sid}/")
        assert len(pids) == (1 if sid in running else 0), (sid, states[sid], pids)
    assert len(vmm_pids(str(srv.home))) == len(running)
    assert len({n for n in netns_names() if n.startswith(prefix)}) == len(running)
    assert {p.name for p in (srv.home / "sandboxes").iterdir()} == set(states)
    return states


def _check_alive(srv: ServerProcess, sandbox_id: str, state: str, marker: str) -> None:
    """A running sandbox answers with its data; a paused one resumes with it."""
    if state == "paused":
        with srv.client() as c:
            assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 201
    assert run_command(srv.url, sandbox_id, "cat /home/user/marker").stdout == marker


def test_kill9_while_running(crash_server: ServerProcess) -> None:
    srv = crash_server
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
    run_command(srv.url, sandbox_id, "echo running > /home/user/marker")
    pid = int(run_command(srv.url, sandbox_id, COUNTER).stdout)
    srv.stop(signal.SIGKILL)
    srv.start()
    states = _assert_consistent(srv)
    assert states[sandbox_id] == "running"
    _check_alive(srv, sandbox_id, "running", "running\n")
    assert run_command(srv.url, sandbox_id, f"kill -0 {pid}").exit_code == 0
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204


@pytest.mark.parametrize("delay", [0.01, 0.04, 0.15])
def test_kill9_during_pause(crash_server: ServerProcess, delay: float) -> None:
    srv = crash_server
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
    run_command(srv.url, sandbox_id, "echo paused > /home/user/marker")
    _kill9_during(srv, "POST", f"/sandboxes/{sandbox_id}/pause", delay)
    states = _assert_consistent(srv)
    assert states[sandbox_id] in ("running", "paused")
    _check_alive(srv, sandbox_id, states[sandbox_id], "paused\n")
    _assert_consistent(srv)
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204


@pytest.mark.parametrize("delay", [0.02, 0.3])
def test_kill9_during_snapshot(crash_server: ServerProcess, delay: float) -> None:
    srv = crash_server
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
    run_command(srv.url, sandbox_id, "echo snap > /home/user/marker")
    _kill9_during(srv, "POST", f"/sandboxes/{sandbox_id}/snapshots", delay)
    states = _assert_consistent(srv)
    assert states[sandbox_id] == "running"
    _check_alive(srv, sandbox_id, "running", "snap\n")
    with srv.client() as c:
        # A snapshot that completed starts sandboxes; an unfinished one is not listed.
        for snap in c.get("/snapshots", params={"sandboxID": sandbox_id}).json():
            child = c.post("/sandboxes", json={"templateID": snap["snapshotID"]})
            assert child.status_code == 201, child.text
            child_id = child.json()["sandboxID"]
            _check_alive(srv, child_id, "running", "snap\n")
            assert c.delete(f"/sandboxes/{child_id}").status_code == 204
            assert c.delete(f"/snapshots/{snap['snapshotID']}").status_code == 204
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    # Snapshot files nothing uses any more are gone.
    with srv.client() as c:
        assert c.get("/snapshots").json() == []
    assert not any((srv.home / "snapshots").iterdir())


@pytest.mark.parametrize("delay", [0.5, 1.0, 1.5])
def test_kill9_during_fork(crash_server: ServerProcess, delay: float) -> None:
    srv = crash_server
    with srv.client() as c:
        parent = create_sandbox_id(c, timeout=600)
    run_command(srv.url, parent, "echo fork > /home/user/marker")
    _kill9_during(srv, "POST", f"/sandboxes/{parent}/fork", delay, {"count": 6})
    states = _assert_consistent(srv)
    assert states[parent] == "running"
    _check_alive(srv, parent, "running", "fork\n")
    # Children that had started are whole sandboxes; the others were never handed out.
    for sandbox_id, state in states.items():
        if sandbox_id != parent:
            _check_alive(srv, sandbox_id, state, "fork\n")
    with srv.client() as c:
        for sandbox_id in states:
            assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    assert not any((srv.home / "snapshots").iterdir())


def test_vmm_killed_while_server_down_keeps_the_disk(crash_server: ServerProcess) -> None:
    """A VMM that dies while no server watches takes the processes with it, not the
    files: the sandbox comes back as a filesystem-only pause."""
    srv = crash_server
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
    run_command(srv.url, sandbox_id, "echo disk > /home/user/marker && sync")
    pids = vmm_pids(f"/sandboxes/{sandbox_id}/")
    srv.stop(signal.SIGKILL)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    srv.start()
    states = _assert_consistent(srv)
    assert states[sandbox_id] == "paused"
    with srv.client() as c:
        assert c.get(f"/sandboxes/{sandbox_id}").json()["pauseMode"] == "filesystem"
    _check_alive(srv, sandbox_id, "paused", "disk\n")
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
