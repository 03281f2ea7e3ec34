"""Faults injected for real into running sandboxes, beside those with their own files
(VMM SIGKILL: test_vmm_liveness.py; server kill -9: test_crash_recovery.py; the
repository down or a node killed mid-commit: test_repository_nodes.py; a full data
filesystem: test_disk_space.py). Each test checks what the API reports, that nothing
leaks, and that nothing the guest wrote is lost."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def fault_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    node = ServerProcess(home=test_root / "faults", extra_env={"AENV_NETWORK_LINGER": "1"})
    with live_server(node) as srv:
        yield srv


def _nothing_left(srv: ServerProcess) -> bool:
    """No VMM and no network namespace of this server is left."""
    prefix = f"ae{Config.load(env={}, home=srv.home).instance_tag}-"
    return not vmm_pids(str(srv.home)) and not any(n.startswith(prefix) for n in netns_names())


def _kill_all(srv: ServerProcess) -> None:
    with srv.client() as c:
        for sandbox in c.get("/sandboxes").json():
            assert c.delete(f"/sandboxes/{sandbox['sandboxID']}").status_code == 204
    wait_until(lambda: _nothing_left(srv), "nothing left of the sandboxes", 30)


def test_envd_killed_inside_the_guest_comes_back_configured(
    fault_server: ServerProcess,
) -> None:
    """kill -9 of envd by the guest itself: the guest's init starts it again and it comes
    back with the sandbox's env vars, default user and access token (kept on the guest's
    /run), so the sandbox works again without the node doing anything."""
    srv = fault_server
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600, envVars={"FAULT_VAR": "kept"})
    before = run_command(srv.url, sandbox_id, "echo $FAULT_VAR; whoami; cat /proc/1/comm")
    assert before.exit_code == 0 and before.stdout.split()[:2] == ["kept", "user"]
    # What it keeps is root's alone.
    kept = run_command(srv.url, sandbox_id, "stat -c %a /run/aenv/envd-state.json", user="root")
    assert kept.stdout == "600\n"
    assert run_command(srv.url, sandbox_id, "cat /run/aenv/envd-state.json").exit_code != 0
    # "[.]": the pattern must not match the shells whose command lines carry it.
    find_envd = "pgrep -f 'agentenv[.]envd'"
    envd_pid = run_command(srv.url, sandbox_id, find_envd, user="root").stdout
    assert len(envd_pid.split()) == 1, envd_pid
    # Detached, so the command's own stream ends normally before envd dies.
    killer = "(sleep 1; pkill -9 -f 'agentenv[.]envd') > /dev/null 2>&1 &"
    started = run_command(srv.url, sandbox_id, f'setsid sh -c "{killer}"', user="root")
    assert started.exit_code == 0

    def answers() -> bool:
        with contextlib.suppress(Exception):
            result = run_command(srv.url, sandbox_id, "echo $FAULT_VAR; whoami", timeout=10)
            return result.exit_code == 0 and result.stdout.split() == ["kept", "user"]
        return False

    time.sleep(1.5)  # let the kill land first
    wait_until(answers, "envd back with the sandbox's configuration", 90)
    # It is a new envd (the old one died), answering as the old one did.
    after = run_command(srv.url, sandbox_id, find_envd, user="root").stdout
    assert len(after.split()) == 1 and after != envd_pid, (envd_pid, after)
    with srv.client() as c:
        assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
    _kill_all(srv)


def test_stopped_vmm_fails_operations_cleanly_and_recovers(
    fault_server: ServerProcess,
) -> None:
    """A VMM frozen with SIGSTOP (a hung VMM): pause answers an error in bounded time
    and leaves the sandbox running, not half-paused; after SIGCONT everything works and
    what the guest wrote is there; a kill of a frozen VMM leaves nothing behind."""
    srv = fault_server
    with srv.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
    assert run_command(srv.url, sandbox_id, "echo frozen > /home/user/f && sync").exit_code == 0
    (pid,) = vmm_pids(f"/sandboxes/{sandbox_id}/")
    os.kill(pid, signal.SIGSTOP)
    try:
        with srv.client() as c:
            c.timeout = httpx.Timeout(120)
            paused = c.post(f"/sandboxes/{sandbox_id}/pause", json={})
            assert paused.status_code >= 500, paused.text
            assert "got no answer" in paused.json()["message"], paused.text
            detail = c.get(f"/sandboxes/{sandbox_id}").json()
            assert detail["state"] == "running", detail
    finally:
        os.kill(pid, signal.SIGCONT)
    assert run_command(srv.url, sandbox_id, "cat /home/user/f").stdout == "frozen\n"
    with srv.client() as c:
        assert c.post(f"/sandboxes/{sandbox_id}/pause", json={}).status_code == 204
        assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 201
    assert run_command(srv.url, sandbox_id, "cat /home/user/f").stdout == "frozen\n"

    # Killing a frozen VMM works at once and leaves nothing.
    (pid,) = vmm_pids(f"/sandboxes/{sandbox_id}/")
    os.kill(pid, signal.SIGSTOP)
    with srv.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        assert c.get(f"/sandboxes/{sandbox_id}").status_code == 404
    wait_until(lambda: _nothing_left(srv), "nothing left of the frozen sandbox", 30)
