"""The foundation end to end: real microVMs created and commanded over HTTP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    ServerProcess,
    create_sandbox,
    create_sandbox_id,
    live_server,
    run_command,
    vmm_pids,
)

pytestmark = pytest.mark.vm


def wait_gone(c: httpx.Client, home: Path, sandbox_id: str, limit: float = 60.0) -> None:
    """Wait until an expiring sandbox is unknown to the API *and* its VMM and files are
    released (the API stops listing it as soon as the kill starts)."""
    workdir = home / "sandboxes" / sandbox_id
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if (
            c.get(f"/sandboxes/{sandbox_id}").status_code == 404
            and not vmm_pids(f"/sandboxes/{sandbox_id}/")
            and not workdir.exists()
        ):
            return
        time.sleep(0.25)
    pytest.fail(f"sandbox {sandbox_id} not fully released after {limit}s")


# -- auth and bad input ---------------------------------------------------------------------
def test_health_without_a_key_says_only_that_the_node_is_up(server: ServerProcess) -> None:
    anonymous = httpx.get(f"{server.url}/health", trust_env=False)
    assert anonymous.status_code == 200
    assert set(anonymous.json()) == {"status", "version"}
    wrong = httpx.get(f"{server.url}/health", headers={"X-API-Key": "e2b_wrong"}, trust_env=False)
    assert wrong.status_code == 401
    with server.client() as c:
        response = c.get("/health")
    assert response.status_code == 200
    health = response.json()
    assert health["templates"]["base"] == "ready"
    # The mode, and why the server chose it (what `auto` found, or that it was set).
    assert health["mode"] == f"{health['vmm']}/{health['accel']}"
    reason = health["modeReason"]
    assert reason.startswith("vmm=") and "; accel=" in reason, reason
    # Not even with the key: no data directory, no key.
    assert server.home.as_posix() not in reason
    assert server.api_key not in response.text


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "e2b_wrong"}])
def test_api_key_required(server: ServerProcess, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/v2/sandboxes"), ("POST", "/sandboxes"), ("GET", "/sandboxes/x")]:
        response = httpx.request(
            method,
            f"{server.url}{path}",
            headers=headers,
            json={"templateID": "base"},
            trust_env=False,
        )
        assert response.status_code == 401, (method, path, response.text)
        body = response.json()
        assert body["code"] == 401 and body["message"]


def test_bad_inputs(server: ServerProcess) -> None:
    with server.client() as c:
        unknown = c.post("/v2/sandboxes", json={"templateID": "no-such-template"})
        assert unknown.status_code == 400
        assert "no-such-template" in unknown.json()["message"]

        malformed = c.post(
            "/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert malformed.status_code == 400
        assert malformed.json()["code"] == 400

        missing = c.post("/sandboxes", json={"timeout": 10})
        assert missing.status_code == 400
        assert "templateID" in missing.json()["message"]

        negative = c.post("/sandboxes", json={"templateID": "base", "timeout": -5})
        assert negative.status_code == 400
        assert "timeout" in negative.json()["message"]

        assert c.get("/sandboxes/inope").status_code == 404
        assert c.get("/sandboxes/inope").json()["code"] == 404
        assert c.delete("/sandboxes/inope").status_code == 404
        bad_timeout = c.post("/sandboxes/inope/timeout", json={"timeout": -1})
        assert bad_timeout.status_code == 400


def test_unknown_sandbox_through_proxy(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.url}/process.Process/Start",
        headers={"E2b-Sandbox-Id": "inotthere", "Content-Type": "application/connect+json"},
        content=b"",
        trust_env=False,
    )
    assert response.status_code == 502
    assert "inotthere" in response.json()["message"]


# -- running commands ----------------------------------------------------------------------
def test_create_and_run_commands(server: ServerProcess) -> None:
    with server.client() as c:
        sbx = create_sandbox(
            c, timeout=120, metadata={"purpose": "test"}, envVars={"GREETING": "hej"}
        )
        sandbox_id = str(sbx["sandboxID"])
        assert sbx["templateID"] == "base"
        assert sbx["envdVersion"]
        assert "clientID" in sbx and "domain" in sbx
        try:
            echo = run_command(server.url, sandbox_id, "echo hello")
            assert echo.stdout == "hello\n"
            assert echo.exit_code == 0
            assert "exitCode" not in echo.events[-1]["end"]

            uname = run_command(server.url, sandbox_id, "uname -a")
            assert uname.stdout.startswith("Linux ")
            assert uname.exit_code == 0

            failing = run_command(server.url, sandbox_id, "echo oops >&2; exit 3")
            assert failing.exit_code == 3
            assert failing.stderr == "oops\n"
            assert failing.status == "exit status 3"

            env = run_command(server.url, sandbox_id, "echo $GREETING $EXTRA", envs={"EXTRA": "x"})
            assert env.stdout == "hej x\n"

            nproc = run_command(server.url, sandbox_id, "nproc; id -un; cat /proc/cmdline")
            assert int(nproc.stdout.split()[0]) >= 1

            detail = c.get(f"/sandboxes/{sandbox_id}").json()
            assert detail["state"] == "running"
            assert detail["metadata"] == {"purpose": "test"}
            listed = c.get("/v2/sandboxes", params={"metadata": "purpose=test"}).json()
            assert sandbox_id in [s["sandboxID"] for s in listed]
            other = c.get("/v2/sandboxes", params={"metadata": "purpose=other"}).json()
            assert sandbox_id not in [s["sandboxID"] for s in other]
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_clock_is_set_on_restore(server: ServerProcess) -> None:
    with server.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=60)
        try:
            guest_now = int(run_command(server.url, sandbox_id, "date +%s").stdout)
            assert abs(guest_now - time.time()) < 30
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_sandboxes_are_isolated(server: ServerProcess) -> None:
    with server.client() as c:
        a = create_sandbox_id(c, timeout=120)
        b = create_sandbox_id(c, timeout=120)
        try:
            assert run_command(server.url, a, "echo secret-a > /tmp/mine; sync").exit_code == 0
            assert run_command(server.url, a, "cat /tmp/mine").stdout == "secret-a\n"
            missing = run_command(server.url, b, "cat /tmp/mine")
            assert missing.exit_code != 0
            assert "No such file" in missing.stderr
            # Each guest has the same address, but they are different machines.
            ids = {
                run_command(server.url, s, "cat /proc/sys/kernel/random/boot_id").stdout
                for s in (a, b)
            }
            assert len(ids) == 1 or len(ids) == 2  # same snapshot may share boot_id
            pids_a = vmm_pids(f"/sandboxes/{a}/")
            pids_b = vmm_pids(f"/sandboxes/{b}/")
            assert len(pids_a) == 1 and len(pids_b) == 1 and pids_a != pids_b
        finally:
            c.delete(f"/sandboxes/{a}")
            c.delete(f"/sandboxes/{b}")


def test_kill_releases_everything(server: ServerProcess) -> None:
    with server.client() as c:
        before_ns = server.netns_names()
        sandbox_id = create_sandbox_id(c, timeout=120)
        workdir = server.home / "sandboxes" / sandbox_id
        pids = vmm_pids(f"/sandboxes/{sandbox_id}/")
        new_ns = server.netns_names() - before_ns
        assert len(pids) == 1
        assert len(new_ns) == 1
        assert workdir.is_dir()
        links_before = Path("/sys/class/net").iterdir()
        host_links = {p.name for p in links_before}

        response = c.delete(f"/sandboxes/{sandbox_id}")
        assert response.status_code == 204

        assert c.get(f"/sandboxes/{sandbox_id}").status_code == 404
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 404
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
        assert not (server.netns_names() & new_ns)
        assert not workdir.exists()
        # The veth pair goes in the background (the kernel takes 10-20 ms of RCU grace
        # periods to delete it; the kill does not wait for that), but it does go.
        deadline = time.monotonic() + 30
        while True:
            host_links_after = {p.name for p in Path("/sys/class/net").iterdir()}
            gone = host_links - host_links_after
            if any(name.startswith("ae") for name in gone) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert any(name.startswith("ae") for name in gone), "the sandbox's veth must be gone"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def test_ttl_expiry_kills(server: ServerProcess) -> None:
    with server.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=1)
        wait_gone(c, server.home, sandbox_id)
        assert sandbox_id not in [s["sandboxID"] for s in c.get("/v2/sandboxes").json()]


def test_set_timeout_shortens(server: ServerProcess) -> None:
    with server.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=600)
        end_before = c.get(f"/sandboxes/{sandbox_id}").json()["endAt"]
        assert c.post(f"/sandboxes/{sandbox_id}/timeout", json={"timeout": 1}).status_code == 204
        wait_gone(c, server.home, sandbox_id)
        assert end_before


def test_list_paging(server: ServerProcess) -> None:
    with server.client() as c:
        ids = [create_sandbox_id(c, timeout=120, metadata={"batch": "paging"}) for _ in range(3)]
        try:
            seen: list[str] = []
            token = None
            while True:
                params = {"metadata": "batch=paging", "limit": "2"}
                if token:
                    params["nextToken"] = token
                response = c.get("/v2/sandboxes", params=params)
                assert response.status_code == 200
                seen += [s["sandboxID"] for s in response.json()]
                token = response.headers.get("x-next-token")
                if not token:
                    break
            assert sorted(seen) == sorted(ids)
        finally:
            for sandbox_id in ids:
                c.delete(f"/sandboxes/{sandbox_id}")


# -- restart -------------------------------------------------------------------------------
def test_restart_keeps_records_consistent(test_root: Path, guest_image: None) -> None:
    """A server restart re-adopts sandboxes whose VMM survived and keeps the disks of
    the rest."""
    with live_server(ServerProcess(home=test_root / "restart")) as srv:
        with srv.client() as c:
            survivor = create_sandbox_id(c, timeout=300)
            victim = create_sandbox_id(c, timeout=300)
            assert run_command(srv.url, survivor, "echo 42 > /tmp/state").exit_code == 0
        victim_pids = vmm_pids(f"/sandboxes/{victim}/")
        srv.stop(signal.SIGKILL)
        # While the server is down one VMM dies; the other keeps running.
        for pid in victim_pids:
            os.kill(pid, signal.SIGKILL)
        assert vmm_pids(f"/sandboxes/{survivor}/")
        srv.start()
        with srv.client() as c:
            listed = {s["sandboxID"]: s["state"] for s in c.get("/v2/sandboxes").json()}
            assert listed[survivor] == "running"
            # The victim lost its processes but not its disk: a filesystem-only pause.
            assert listed[victim] == "paused"
            assert c.get(f"/sandboxes/{victim}").json()["pauseMode"] == "filesystem"
            assert vmm_pids(f"/sandboxes/{victim}/") == []
            assert run_command(srv.url, survivor, "cat /tmp/state").stdout == "42\n"
            assert c.delete(f"/sandboxes/{survivor}").status_code == 204
            assert c.delete(f"/sandboxes/{victim}").status_code == 204
            assert not (srv.home / "sandboxes" / victim).exists()


def test_failed_create_leaves_nothing(server: ServerProcess) -> None:
    """A create that fails midway (here: its network slot's address is taken on the host)
    answers with a JSON error and leaves no record, VM, namespace or directory behind."""
    import ipaddress

    from pyroute2 import IPRoute

    with server.client() as c:
        subnet = ipaddress.IPv4Network((server.home / "subnet").read_text().strip())
        used = len(c.get("/sandboxes").json())
        # Slots are handed out lowest first; with `used` sandboxes running, the next is
        # `used` (none of this session's other tests leave sandboxes behind).
        blocker_ip = str(subnet.network_address + 4 * used + 1)
        before_dirs = set((server.home / "sandboxes").iterdir())
        before_ns = server.netns_names()
        with IPRoute() as ipr:
            ipr.link("add", ifname="aeblock0", kind="veth", peer="aeblock1")
            index = ipr.link_lookup(ifname="aeblock0")[0]
            ipr.addr("add", index=index, address=blocker_ip, prefixlen=30)
            try:
                failed = c.post("/sandboxes", json={"templateID": "base"})
            finally:
                ipr.link("del", index=index)
        assert failed.status_code == 500, failed.text
        assert "in use" in failed.json()["message"]
        assert len(c.get("/sandboxes").json()) == used
        assert set((server.home / "sandboxes").iterdir()) == before_dirs
        assert server.netns_names() == before_ns
        # The slot is free again and the next create succeeds.
        ok = c.post("/sandboxes", json={"templateID": "base"})
        assert ok.status_code == 201
        assert c.delete(f"/sandboxes/{ok.json()['sandboxID']}").status_code == 204


def test_openapi_document_describes_the_api(server: ServerProcess) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", trust_env=False).json()
    for path in (
        "/sandboxes",
        "/v2/sandboxes",
        "/sandboxes/{sandbox_id}",
        "/sandboxes/{sandbox_id}/timeout",
        "/sandboxes/{sandbox_id}/metrics",
    ):
        assert path in doc["paths"], path
    created = doc["paths"]["/v2/sandboxes"]["post"]["responses"]
    assert "201" in created and "400" in created
    schema = doc["components"]["schemas"]["Sandbox"]["properties"]
    assert {"sandboxID", "templateID", "envdVersion", "clientID"} <= set(schema)
