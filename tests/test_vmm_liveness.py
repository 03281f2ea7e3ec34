"""A sandbox's VMM killed (SIGKILL) while the server runs: within moments the sandbox is
a filesystem-only pause (E2B has no "crashed" state), the server's log says why,
requests racing the exit answer 4xx, connect boots it from its disk with what was
written and synced before, and nothing is leaked (VMM processes, network namespaces).
The settling logic on fakes: tests/test_liveness_unit.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.config import Config
from tests.e2b.support import wait_until
from tests.helpers import (
    ServerProcess,
    create_sandbox_id,
    live_server,
    netns_names,
    run_command,
    vmm_pids,
)

pytestmark = pytest.mark.vm

MARKER = "/home/user/marker"


@pytest.fixture(scope="module")
def liveness_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    # A short linger: a sandbox paused the ordinary way releases its network soon.
    node = ServerProcess(home=test_root / "liveness", extra_env={"AENV_NETWORK_LINGER": "1"})
    with live_server(node) as srv:
        yield srv


def _states(c: httpx.Client) -> dict[str, str]:
    return {s["sandboxID"]: s["state"] for s in c.get("/sandboxes").json()}


def _consistent(srv: ServerProcess) -> bool:
    """Each running sandbox has one VMM and one network namespace, a paused one none,
    and nothing else has either."""
    with srv.client() as c:
        states = _states(c)
    prefix = f"ae{Config.load(env={}, home=srv.home).instance_tag}-"
    running = {sid for sid, state in states.items() if state == "running"}
    for sid in states:
        if len(vmm_pids(f"/sandboxes/{sid}/")) != (1 if sid in running else 0):
            return False
    namespaces = {n for n in netns_names() if n.startswith(prefix)}
    return len(vmm_pids(str(srv.home))) == len(running) == len(namespaces)


def _sandbox_with_marker(srv: ServerProcess, text: str) -> tuple[str, int]:
    """A new sandbox with ``text`` written and synced to its disk, and its VMM's pid."""
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
    assert run_command(srv.url, sandbox_id, f"echo {text} > {MARKER} && sync").exit_code == 0
    (pid,) = vmm_pids(f"/sandboxes/{sandbox_id}/")
    return sandbox_id, pid


def _kill_vmm(pid: int) -> None:
    # Gone already if the operation it races released it first.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_paused(c: httpx.Client, sandbox_id: str) -> None:
    # Settled within milliseconds; the limit only bounds a failing test.
    wait_until(lambda: _states(c).get(sandbox_id) == "paused", "the sandbox listed paused", 15)


def _connect_and_check(srv: ServerProcess, sandbox_id: str, text: str) -> None:
    with srv.client() as c:
        resumed = c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 300})
        assert resumed.status_code == 201, resumed.text
        assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
    assert run_command(srv.url, sandbox_id, f"cat {MARKER}").stdout == f"{text}\n"
    assert len(vmm_pids(f"/sandboxes/{sandbox_id}/")) == 1


def test_killed_vmm_becomes_a_filesystem_pause(liveness_server: ServerProcess) -> None:
    srv = liveness_server
    sandbox_id, pid = _sandbox_with_marker(srv, "survived")
    _kill_vmm(pid)
    with srv.client() as c:
        _wait_paused(c, sandbox_id)
        detail = c.get(f"/sandboxes/{sandbox_id}").json()
        assert detail["state"] == "paused" and detail["pauseMode"] == "filesystem"
    assert vmm_pids(f"/sandboxes/{sandbox_id}/") == []
    assert _consistent(srv)
    log = srv.log_path.read_text(errors="replace")
    assert f"sandbox {sandbox_id}: its VMM pid {pid} was killed by signal 9 (SIGKILL)" in log
    assert "kept as a filesystem-only pause" in log
    _connect_and_check(srv, sandbox_id, "survived")
    assert _consistent(srv)
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    wait_until(lambda: _consistent(srv), "nothing left of the sandbox", 10)


def test_a_guest_reset_is_named_as_such(liveness_server: ServerProcess) -> None:
    """A guest that resets (here an immediate reboot through sysrq, as a triple fault
    does) ends its QEMU with status 0 (-no-reboot), as a power-off would: the warning
    names the reason QEMU gave, so the two are told apart."""
    srv = liveness_server
    sandbox_id, pid = _sandbox_with_marker(srv, "before-reset")
    reboot = "(sleep 1; echo b > /proc/sysrq-trigger) >/dev/null 2>&1 &"
    assert run_command(srv.url, sandbox_id, reboot, user="root").exit_code == 0
    with srv.client() as c:
        _wait_paused(c, sandbox_id)
        assert c.get(f"/sandboxes/{sandbox_id}").json()["pauseMode"] == "filesystem"
    log = srv.log_path.read_text(errors="replace")
    assert (
        f"sandbox {sandbox_id}: its VMM pid {pid} exited with status 0 (the guest reset: "
        "a reboot it asked for, or a triple fault: guest-reset)"
    ) in log
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    wait_until(lambda: _consistent(srv), "nothing left of the sandbox", 10)


def test_requests_right_after_the_kill_answer_4xx(liveness_server: ServerProcess) -> None:
    srv = liveness_server
    sandbox_id, pid = _sandbox_with_marker(srv, "raced")
    with srv.client() as c:
        _kill_vmm(pid)
        # Sent at once, before or while the exit is settled: the settling goes first
        # or the operation settles it itself; either way the sandbox is paused.
        pause = c.post(f"/sandboxes/{sandbox_id}/pause", json={})
        snapshot = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={})
        fork = c.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        metrics = c.get(f"/sandboxes/{sandbox_id}/metrics")
        assert pause.status_code == 409, pause.text
        assert snapshot.status_code == 409, snapshot.text
        assert fork.status_code == 409, fork.text
        # Not an error: the samples taken while it ran (E2B keeps them for its life).
        assert metrics.status_code == 200 and isinstance(metrics.json(), list), metrics.text
        assert _states(c)[sandbox_id] == "paused"
        assert c.get("/snapshots", params={"sandboxID": sandbox_id}).json() == []
    assert _consistent(srv)
    _connect_and_check(srv, sandbox_id, "raced")
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    wait_until(lambda: _consistent(srv), "nothing left of the sandbox", 10)


@pytest.mark.parametrize(
    ("operation", "delay"),
    [("pause", 0.0), ("pause", 0.05), ("snapshot", 0.0), ("snapshot", 0.05)],
)
def test_vmm_killed_during_an_operation(
    liveness_server: ServerProcess, operation: str, delay: float
) -> None:
    """Whichever comes first, the operation succeeds or answers 409, never 500, and the
    sandbox ends paused with its disk."""
    srv = liveness_server
    sandbox_id, pid = _sandbox_with_marker(srv, operation)
    path = f"/sandboxes/{sandbox_id}/{'pause' if operation == 'pause' else 'snapshots'}"

    def call() -> httpx.Response:
        with srv.client() as c:
            return c.post(path, json={})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call)
        time.sleep(delay)
        _kill_vmm(pid)
        response = pending.result()
    done = 204 if operation == "pause" else 201
    assert response.status_code in (done, 409), response.text
    with srv.client() as c:
        _wait_paused(c, sandbox_id)
        for snap in c.get("/snapshots", params={"sandboxID": sandbox_id}).json():
            assert c.delete(f"/snapshots/{snap['snapshotID']}").status_code == 204
    wait_until(lambda: _consistent(srv), "the paused sandbox's network released", 10)
    _connect_and_check(srv, sandbox_id, operation)
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    wait_until(lambda: _consistent(srv), "nothing left of the sandbox", 10)
