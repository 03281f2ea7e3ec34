"""Persistent snapshots, fork, and the state machine that serialises operations on a
sandbox, through the HTTP API with real VMs."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time

import httpx
import pytest

from agentenv.orchestrator.capture import MAX_DISK_CHAIN
from agentenv.storage.images import backing_chain
from tests.e2b.support import sdk_client, wait_until
from tests.helpers import (
    COUNTER,
    ServerProcess,
    create_sandbox_id,
    run_command,
    vmm_pids,
)

pytestmark = pytest.mark.vm


def _out(server: ServerProcess, sandbox_id: str, command: str) -> str:
    result = run_command(server.url, sandbox_id, command)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def test_snapshot_starts_sandboxes_and_parent_keeps_running(server: ServerProcess) -> None:
    with server.client() as c:
        parent = create_sandbox_id(c, metadata={"role": "parent"}, timeout=300)
        started: list[str] = [parent]
        try:
            _out(server, parent, "echo on-disk > /home/user/state; echo in-memory > /dev/shm/m")
            pid = int(_out(server, parent, COUNTER))
            taken = c.post(f"/sandboxes/{parent}/snapshots", json={"name": "snap-test"})
            assert taken.status_code == 201, taken.text
            snapshot_id = taken.json()["snapshotID"]
            assert taken.json()["names"] == ["snap-test"]

            # The parent runs on, and its later writes are not in the snapshot.
            assert c.get(f"/sandboxes/{parent}").json()["state"] == "running"
            _out(server, parent, "echo changed > /home/user/state")
            assert _out(server, parent, f"kill -0 {pid} && echo alive") == "alive\n"

            listed = c.get("/snapshots").json()
            assert snapshot_id in [s["snapshotID"] for s in listed]
            assert c.get(f"/snapshots/{snapshot_id}").json()["sandboxID"] == parent
            assert c.get("/snapshots", params={"sandboxID": "nope"}).json() == []
            again = c.post(f"/sandboxes/{parent}/snapshots", json={"name": "snap-test"})
            assert again.status_code == 409

            # By id or by name, wherever a template is accepted: three sandboxes.
            children = [
                create_sandbox_id(c, key, timeout=300)
                for key in (snapshot_id, "snap-test", snapshot_id)
            ]
            started += children
            for child in children:
                assert _out(server, child, "cat /home/user/state /dev/shm/m") == (
                    "on-disk\nin-memory\n"
                )
                # The counting process was captured running, and runs on in each copy.
                first = int(_out(server, child, "cat /dev/shm/counter"))
                time.sleep(0.6)
                assert int(_out(server, child, f"kill -0 {pid}; cat /dev/shm/counter")) > first
            _out(server, children[0], "echo mine > /home/user/state")
            assert _out(server, children[1], "cat /home/user/state") == "on-disk\n"
            assert _out(server, parent, "cat /home/user/state") == "changed\n"

            # Names may carry E2B's namespace/name:tag shape.
            slashed = c.post(f"/sandboxes/{parent}/snapshots", json={"name": "team/snap:v1"})
            assert slashed.status_code == 201, slashed.text
            assert c.get("/snapshots/team/snap:v1").json()["names"] == ["team/snap:v1"]
            assert c.delete("/snapshots/team/snap:v1").status_code == 204

            # Deleting hides it at once; sandboxes started from it keep working.
            assert c.delete(f"/snapshots/{snapshot_id}").status_code == 204
            assert c.get(f"/snapshots/{snapshot_id}").status_code == 404
            assert c.delete(f"/snapshots/{snapshot_id}").status_code == 404
            refused = c.post("/sandboxes", json={"templateID": snapshot_id})
            assert refused.status_code == 400
            assert _out(server, children[2], "cat /home/user/state") == "on-disk\n"
        finally:
            for sandbox_id in started:
                c.delete(f"/sandboxes/{sandbox_id}")
        # Once nothing uses it, its files go too.
        assert not (server.home / "snapshots" / snapshot_id).exists()


def test_snapshot_after_writing_1gib(server: ServerProcess) -> None:
    with server.client() as c:
        parent = create_sandbox_id(c, timeout=300)
        child = None
        try:
            result = run_command(
                server.url,
                parent,
                "dd if=/dev/urandom of=/home/user/seed bs=1M count=4 status=none && "
                "for i in $(seq 256); do cat /home/user/seed; done > /home/user/big && "
                "sync && sha256sum /home/user/big | cut -c1-64",
                timeout=600,
            )
            assert result.exit_code == 0, result.stderr
            digest = result.stdout.strip()
            taken = c.post(f"/sandboxes/{parent}/snapshots", json={})
            assert taken.status_code == 201, taken.text
            child = create_sandbox_id(c, taken.json()["snapshotID"], timeout=300)
            size = _out(server, child, "stat -c %s /home/user/big").strip()
            assert size == str(1024 * 1024 * 1024)
            check = run_command(
                server.url, child, "sha256sum /home/user/big | cut -c1-64", timeout=600
            )
            assert check.stdout.strip() == digest
            assert c.delete(f"/snapshots/{taken.json()['snapshotID']}").status_code == 204
        finally:
            for sandbox_id in (parent, child):
                if sandbox_id:
                    c.delete(f"/sandboxes/{sandbox_id}")


def test_fork_16_children_share_state_not_writes(server: ServerProcess) -> None:
    with server.client() as c:
        parent = create_sandbox_id(
            c, metadata={"run": "fork"}, envVars={"FROM_PARENT": "yes"}, timeout=300
        )
        children: list[str] = []
        snapshot_dirs = set((server.home / "snapshots").iterdir())
        try:
            _out(server, parent, "echo disk > /home/user/d; echo mem > /dev/shm/m")
            pid = int(_out(server, parent, COUNTER))
            forked = c.post(f"/sandboxes/{parent}/fork", json={"count": 16, "timeout": 300})
            assert forked.status_code == 201, forked.text
            items = forked.json()
            assert len(items) == 16
            errors = [item["error"] for item in items if "error" in item]
            assert not errors, errors
            children = [item["sandbox"]["sandboxID"] for item in items]
            assert len(set(children) | {parent}) == 17
            assert c.get(f"/sandboxes/{parent}").json()["state"] == "running"

            def check(child: str) -> str:
                out = _out(
                    server,
                    child,
                    f"cat /home/user/d /dev/shm/m; kill -0 {pid} && echo alive; "
                    'echo "$FROM_PARENT"; echo child-$RANDOM > /home/user/d; cat /home/user/d; '
                    "cat /proc/sys/kernel/random/uuid",
                )
                return out

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                outputs = dict(zip(children, pool.map(check, children), strict=True))
            for out in outputs.values():
                lines = out.split("\n")
                assert lines[:4] == ["disk", "mem", "alive", "yes"], out
            # Each child's write stays its own: no sibling and not the parent sees it.
            written = {child: out.split("\n")[4] for child, out in outputs.items()}
            assert len(set(written.values())) > 1
            # Entropy is reseeded in each child: the kernel RNG does not repeat itself.
            uuids = {out.split("\n")[5] for out in outputs.values()}
            assert len(uuids) == len(children)
            for child in children[:4]:
                assert _out(server, child, "cat /home/user/d").strip() == written[child]
            assert _out(server, parent, "cat /home/user/d") == "disk\n"

            # Each child has its own identity; metadata and lineage are recorded.
            detail = c.get(f"/sandboxes/{children[0]}").json()
            assert detail["metadata"] == {"run": "fork"}
            assert detail["lineage"]["parentID"] == parent
            assert sorted(c.get(f"/sandboxes/{parent}").json()["lineage"]["children"]) == sorted(
                children
            )
            assert len(vmm_pids(f"/sandboxes/{children[0]}/")) == 1
        finally:
            for sandbox_id in [parent, *children]:
                c.delete(f"/sandboxes/{sandbox_id}")
        # The fork's frozen image goes with the last sandbox that used it.
        assert set((server.home / "snapshots").iterdir()) == snapshot_dirs


def test_fork_rejects_bad_requests(server: ServerProcess) -> None:
    with server.client() as c:
        assert c.post("/sandboxes/nope/fork", json={"count": 1}).status_code == 404
        sandbox_id = create_sandbox_id(c, timeout=300)
        try:
            for bad in ({"count": 0}, {"count": 21}, {"count": "x"}, {"timeout": -1}):
                answer = c.post(f"/sandboxes/{sandbox_id}/fork", json=bad)
                assert answer.status_code == 400, (bad, answer.text)
            assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            refused = c.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
            assert refused.status_code == 409
            assert c.post(f"/sandboxes/{sandbox_id}/snapshots", json={}).status_code == 409
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_identical_requests_join_and_disconnects_do_not_abort(server: ServerProcess) -> None:
    with server.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=300)
        try:
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                pauses = list(
                    pool.map(
                        lambda _: c.post(f"/sandboxes/{sandbox_id}/pause").status_code, range(3)
                    )
                )
            # One pause ran. A request that overlapped it joined it (204); one that came
            # after it finished finds the sandbox paused (409). Which of the two happens is
            # up to thread scheduling here; tests/test_operations_unit.py pins the joining.
            assert 204 in pauses and set(pauses) <= {204, 409}, pauses
            paused_lines = [
                line
                for line in server.log_path.read_text(errors="replace").splitlines()
                if f"sandbox {sandbox_id} paused in" in line
            ]
            assert len(paused_lines) == 1, paused_lines
            # A client that gives up at once does not abort the resume it started.
            with pytest.raises(httpx.TimeoutException):
                c.post(f"/sandboxes/{sandbox_id}/connect", json={}, timeout=0.001)
            deadline = time.monotonic() + 30
            while c.get(f"/sandboxes/{sandbox_id}").json()["state"] != "running":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert _out(server, sandbox_id, "echo ok") == "ok\n"
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_concurrent_pause_kill_connect_end_consistent(server: ServerProcess) -> None:
    with server.client() as c:
        for _ in range(3):
            sandbox_id = create_sandbox_id(c, timeout=300)
            namespaces = server.netns_names()
            calls = [
                ("post", f"/sandboxes/{sandbox_id}/pause"),
                ("post", f"/sandboxes/{sandbox_id}/connect"),
                ("delete", f"/sandboxes/{sandbox_id}"),
                ("post", f"/sandboxes/{sandbox_id}/pause"),
            ]
            with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
                statuses = list(
                    pool.map(lambda call: c.request(call[0], call[1], json={}).status_code, calls)
                )
            assert all(s in (200, 201, 204, 404, 409) for s in statuses), statuses
            # The kill ran after whatever was in flight: gone, with nothing left behind.
            assert statuses[2] == 204
            assert c.get(f"/sandboxes/{sandbox_id}").status_code == 404
            assert vmm_pids(f"/sandboxes/{sandbox_id}/") == []
            assert not (server.home / "sandboxes" / sandbox_id).exists()
            assert server.netns_names() <= namespaces


def test_auto_resume_on_traffic(server: ServerProcess) -> None:
    with server.client() as c:
        sandbox_id = create_sandbox_id(c, autoResume={"enabled": True}, autoPause=True, timeout=300)
        try:
            assert c.get(f"/sandboxes/{sandbox_id}").json()["lifecycle"] == {
                "autoResume": True,
                "onTimeout": "pause",
            }
            _out(server, sandbox_id, "echo before > /home/user/f")
            assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            # Traffic through the proxy wakes it.
            assert _out(server, sandbox_id, "cat /home/user/f") == "before\n"
            assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")
        other = create_sandbox_id(c, timeout=300)
        try:
            assert c.post(f"/sandboxes/{other}/pause").status_code == 204
            refused = httpx.get(
                f"{server.url}/health", headers={"E2b-Sandbox-Id": other}, trust_env=False
            )
            assert refused.status_code == 502
        finally:
            c.delete(f"/sandboxes/{other}")


def test_sdk_snapshots_and_fork(server: ServerProcess) -> None:
    e2b = sdk_client(server)
    sbx = e2b.Sandbox.create(timeout=300)
    made: list[object] = [sbx]
    try:
        sbx.files.write("/home/user/sdk.txt", "from the parent")
        info = sbx.create_snapshot(name="sdk-snap")
        assert info.names == ["sdk-snap"]
        listed = list(e2b.Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items())
        assert info.snapshot_id in [s.snapshot_id for s in listed]
        started = e2b.Sandbox.create(template="sdk-snap", timeout=120)
        made.append(started)
        assert started.files.read("/home/user/sdk.txt") == "from the parent"
        assert e2b.Sandbox.delete_snapshot(info.snapshot_id) is True
        assert e2b.Sandbox.delete_snapshot(info.snapshot_id) is False

        forks = sbx.fork(count=2, timeout=120)
        assert len(forks) == 2
        for child in forks:
            assert not isinstance(child, Exception), child
            made.append(child)
            assert child.sandbox_id != sbx.sandbox_id
            assert child.files.read("/home/user/sdk.txt") == "from the parent"
            assert child.commands.run("echo forked").stdout == "forked\n"
    finally:
        for s in made:
            s.kill()  # type: ignore[attr-defined]


def test_snapshot_chains_are_bounded(server: ServerProcess) -> None:
    """Each snapshot seals one more disk layer; past MAX_DISK_CHAIN layers the chain is
    flattened in the background, with the same contents."""
    with server.client() as c:
        parent = create_sandbox_id(c, timeout=300)
        started = [parent]
        snapshots: list[str] = []
        try:
            for n in range(MAX_DISK_CHAIN + 1):
                _out(server, parent, f"echo {n} > /home/user/layer-{n}")
                taken = c.post(f"/sandboxes/{parent}/snapshots", json={})
                assert taken.status_code == 201, taken.text
                snapshots.append(taken.json()["snapshotID"])
            last_disk = server.home / "snapshots" / snapshots[-1] / "disk.qcow2"

            def depth() -> int:
                return len([p for p in backing_chain(last_disk) if p.suffix == ".qcow2"])

            # Nine seals in a row would make ten qcow2 images; flattening keeps it short.
            wait_until(lambda: depth() <= 3, "the deep chain to be flattened")
            expected = "".join(f"{n}\n" for n in range(MAX_DISK_CHAIN + 1))
            for key in (snapshots[-1], snapshots[2]):
                child = create_sandbox_id(c, key, timeout=300)
                started.append(child)
                layers = _out(server, child, "cat $(ls -v /home/user/layer-*)")
                count = MAX_DISK_CHAIN + 1 if key == snapshots[-1] else 3
                assert layers == "".join(f"{n}\n" for n in range(count))
            assert _out(server, parent, "cat $(ls -v /home/user/layer-*)") == expected
        finally:
            for sandbox_id in started:
                c.delete(f"/sandboxes/{sandbox_id}")
            for snapshot_id in snapshots:
                c.delete(f"/snapshots/{snapshot_id}")


def test_failed_snapshot_and_pause_leave_the_sandbox_running(server: ServerProcess) -> None:
    """Failures half-way (here: the sandbox's directory turned immutable, so sealing the
    disk cannot create the new top image after the VM was stopped) roll back: the VM
    runs on, nothing half-made is left, and the operations work once the cause is gone."""
    with server.client() as c:
        sandbox_id = create_sandbox_id(c, timeout=300)
        workdir = server.home / "sandboxes" / sandbox_id
        try:
            _out(server, sandbox_id, "echo kept > /home/user/f")
            subprocess.run(["chattr", "+i", str(workdir)], check=True)
            try:
                failed = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "no"})
                assert failed.status_code == 500, failed.text
                assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
                assert _out(server, sandbox_id, "cat /home/user/f") == "kept\n"
                assert c.get("/snapshots", params={"sandboxID": sandbox_id}).json() == []
                assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 500
                assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
                assert _out(server, sandbox_id, "echo still > /home/user/g") == ""
            finally:
                subprocess.run(["chattr", "-i", str(workdir)], check=True)
            taken = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "yes"})
            assert taken.status_code == 201, taken.text
            assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 201
            assert _out(server, sandbox_id, "cat /home/user/f /home/user/g") == "kept\nstill\n"
            assert c.delete(f"/snapshots/{taken.json()['snapshotID']}").status_code == 204
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_fork_children_pause_snapshot_and_fork_again(server: ServerProcess) -> None:
    """A fork child's RAM is a private mapping of its parent's image (or, where its guest
    gives freed pages back, a clone of it): pausing it streams RAM or saves device state,
    it comes back with a file of its own, and it can be snapshotted and forked like any
    sandbox."""
    with server.client() as c:
        parent = create_sandbox_id(c, timeout=300)
        made = [parent]
        snapshot_id = None
        try:
            _out(server, parent, "echo 1 > /home/user/gen; echo p > /dev/shm/m")
            child = c.post(f"/sandboxes/{parent}/fork", json={}).json()[0]["sandbox"]["sandboxID"]
            made.append(child)
            pid = int(_out(server, child, COUNTER))
            assert c.post(f"/sandboxes/{child}/pause").status_code == 204
            assert c.post(f"/sandboxes/{child}/connect", json={}).status_code == 201
            assert _out(server, child, f"kill -0 {pid}; cat /home/user/gen /dev/shm/m") == "1\np\n"
            _out(server, child, "echo 2 > /home/user/gen")
            grandchild = c.post(f"/sandboxes/{child}/fork", json={"count": 1}).json()[0]
            grandchild_id = grandchild["sandbox"]["sandboxID"]
            made.append(grandchild_id)
            assert _out(server, grandchild_id, f"kill -0 {pid}; cat /home/user/gen") == "2\n"
            lineage = c.get(f"/sandboxes/{grandchild_id}").json()["lineage"]
            assert lineage["parentID"] == child
            snapshot_id = c.post(f"/sandboxes/{grandchild_id}/snapshots", json={}).json()[
                "snapshotID"
            ]
            from_snapshot = create_sandbox_id(c, snapshot_id, timeout=300)
            made.append(from_snapshot)
            assert _out(server, from_snapshot, "cat /home/user/gen /dev/shm/m") == "2\np\n"
        finally:
            for sandbox_id in made:
                c.delete(f"/sandboxes/{sandbox_id}")
            if snapshot_id:
                c.delete(f"/snapshots/{snapshot_id}")
