"""Pause releases a sandbox's VMM and network; resume (connect) brings back the same
machine: files, running processes and their in-memory state."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from agentenv.storage.clone import supports_reflink
from agentenv.storage.extents import unshared_bytes
from tests.e2b.support import sdk_client, wait_until
from tests.helpers import COUNTER, ServerProcess, live_server, run_command, vmm_pids

pytestmark = pytest.mark.vm


def test_pause_resume_keeps_files_and_processes(server: ServerProcess) -> None:
    with server.client() as c:
        created = c.post("/sandboxes", json={"templateID": "base", "timeout": 300})
        sandbox_id = created.json()["sandboxID"]
        try:
            assert run_command(server.url, sandbox_id, "echo kept > /home/user/f").exit_code == 0
            pid = int(run_command(server.url, sandbox_id, COUNTER).stdout)
            time.sleep(1)
            before = int(run_command(server.url, sandbox_id, "cat /dev/shm/counter").stdout)
            namespaces = server.netns_names()

            assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "paused"
            paused = c.get("/v2/sandboxes", params={"state": "paused"}).json()
            assert sandbox_id in [s["sandboxID"] for s in paused]
            # CPU and memory are released at once, the network after a short linger.
            assert vmm_pids(f"/sandboxes/{sandbox_id}/") == []
            wait_until(lambda: len(namespaces - server.netns_names()) == 1, "network released")
            refused = httpx.get(
                f"{server.url}/health", headers={"E2b-Sandbox-Id": sandbox_id}, trust_env=False
            )
            assert refused.status_code == 502
            again = c.post(f"/sandboxes/{sandbox_id}/pause")
            assert again.status_code == 409
            assert again.json()["code"] == 409

            resumed = c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 120})
            assert resumed.status_code == 201, resumed.text
            assert resumed.json()["sandboxID"] == sandbox_id
            assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
            assert run_command(server.url, sandbox_id, "cat /home/user/f").stdout == "kept\n"
            assert run_command(server.url, sandbox_id, f"kill -0 {pid}").exit_code == 0
            time.sleep(1)
            after = int(run_command(server.url, sandbox_id, "cat /dev/shm/counter").stdout)
            assert after > before
            # Connecting to a running sandbox is 200, and the legacy resume says 409.
            assert c.post(f"/v2/sandboxes/{sandbox_id}/connect", json={}).status_code == 200
            assert c.post(f"/sandboxes/{sandbox_id}/resume", json={}).status_code == 409
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_kill_a_paused_sandbox(server: ServerProcess) -> None:
    with server.client() as c:
        sandbox_id = c.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        assert c.get(f"/sandboxes/{sandbox_id}").status_code == 404
        assert not (server.home / "sandboxes" / sandbox_id).exists()
        assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 404


def test_sdk_pause_and_connect(server: ServerProcess) -> None:
    e2b = sdk_client(server)
    sbx = e2b.Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/sdk.txt", "before pause")
        assert sbx.pause() is True
        assert sbx.pause() is False  # already paused
        back = e2b.Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/home/user/sdk.txt") == "before pause"
        assert back.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_restart_keeps_paused_sandboxes(test_root: Path, guest_image: None) -> None:
    with live_server(ServerProcess(home=test_root / "paused-restart")) as srv:
        with srv.client() as c:
            sandbox_id = c.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            run_command(srv.url, sandbox_id, "echo 7 > /home/user/n")
            assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
        srv.stop()
        srv.start()
        with srv.client() as c:
            assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "paused"
            assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 201
            assert run_command(srv.url, sandbox_id, "cat /home/user/n").stdout == "7\n"
            assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def test_auto_pause_at_timeout(server: ServerProcess) -> None:
    """``autoPause`` (the SDK's ``lifecycle={"on_timeout": "pause"}``) pauses instead of
    killing when the timeout passes; the sandbox then waits for a connect."""
    e2b = sdk_client(server)
    # Written before the short timeout is set: on a loaded machine the write alone can
    # take longer than the 2 s.
    sbx = e2b.Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/home/user/kept.txt", "still here")
        sbx.set_timeout(2)
        with server.client() as c:
            assert c.get(f"/sandboxes/{sbx.sandbox_id}").json()["lifecycle"] == {
                "autoResume": False,
                "onTimeout": "pause",
            }
            deadline = time.monotonic() + 60
            while c.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] != "paused":
                assert time.monotonic() < deadline, "the sandbox was not paused at its timeout"
                time.sleep(0.5)
        back = e2b.Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.files.read("/home/user/kept.txt") == "still here"
    finally:
        sbx.kill()


def test_filesystem_pause_keeps_disk_and_restarts_processes(server: ServerProcess) -> None:
    """The SDK's ``pause(mode="filesystem")``: the disk is kept, RAM is discarded, and
    resuming boots the guest from its disk."""
    e2b = sdk_client(server)
    sbx = e2b.Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/on-disk.txt", "kept")
        sbx.commands.run("echo gone > /dev/shm/in-memory")
        assert sbx.pause(mode="filesystem") is True
        assert vmm_pids(f"/sandboxes/{sbx.sandbox_id}/") == []
        with server.client() as c:
            detail = c.get(f"/sandboxes/{sbx.sandbox_id}").json()
            assert (detail["state"], detail["pauseMode"]) == ("paused", "filesystem")
        back = e2b.Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.files.read("/home/user/on-disk.txt") == "kept"
        assert back.commands.run("test -e /dev/shm/in-memory || echo fresh").stdout == "fresh\n"
        # A full pause of the rebooted sandbox works as for any other.
        assert back.pause() is True
        again = e2b.Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.files.read("/home/user/on-disk.txt") == "kept"
    finally:
        sbx.kill()


def _pages_differing(a: Path, b: Path) -> int:
    """Bytes in 4 KiB pages whose content differs between two files of one size."""
    page, differing = 4096, 0
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while block_a := fa.read(1 << 20):
            block_b = fb.read(len(block_a))
            if block_a != block_b:
                differing += sum(
                    page
                    for i in range(0, len(block_a), page)
                    if block_a[i : i + page] != block_b[i : i + page]
                )
    return differing


def test_paused_ram_file_shares_what_it_did_not_change(server: ServerProcess) -> None:
    """A guest zeroes pages that were zero already, which unshares them from the
    template's RAM file; after a pause they are shared again, content untouched."""
    if not supports_reflink(server.home):
        pytest.skip(f"{server.home} cannot reflink: sandbox RAM is not a file of its own")
    (template_memory,) = (server.home / "templates" / "base").glob("*/memory.raw")
    with server.client() as c:
        created = c.post("/sandboxes", json={"templateID": "base", "timeout": 300})
        sandbox_id = created.json()["sandboxID"]
        try:
            # The guest's RAM: pages allocated (zeroed) and freed, and 8 MB of new data.
            script = (
                "head -c 20000000 /dev/zero > /dev/shm/z && rm /dev/shm/z && "
                "head -c 8000000 /dev/urandom > /dev/shm/r && md5sum /dev/shm/r"
            )
            out = run_command(server.url, sandbox_id, script)
            assert out.exit_code == 0, out
            memory = server.home / "sandboxes" / sandbox_id / "memory.raw"
            assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            line = f"sandbox {sandbox_id} (paused): RAM file shares"
            wait_until(lambda: line in server.log_path.read_text(errors="replace"), line, 120)
            # Every block it does not share is a page that really changed.
            assert unshared_bytes(memory) <= _pages_differing(template_memory, memory)
            assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 201
            again = run_command(server.url, sandbox_id, "md5sum /dev/shm/r")
            assert again.stdout == out.stdout
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")
