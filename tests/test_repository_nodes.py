"""Two node servers with separate data directories sharing one snapshot repository
(a posix directory, then S3): paused sandboxes move between them with their files and
processes, snapshots taken on one start sandboxes on the other, deletions are seen by
both, volumes follow their writer; an S3 server that is down or a server killed
mid-commit loses nothing."""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import SandboxException, VolumeException

from tests.e2b.support import sdk_opts
from tests.helpers import COUNTER, ServerProcess, create_sandbox_id, live_server, run_command
from tests.s3server import S3Server, start_s3_server

pytestmark = pytest.mark.vm


def wait_for(predicate: object, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def sh(srv: ServerProcess, sandbox_id: str, command: str) -> str:
    result = run_command(srv.url, sandbox_id, command)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout.strip()


def counter(srv: ServerProcess, sandbox_id: str) -> int:
    return int(sh(srv, sandbox_id, "cat /dev/shm/counter"))


def pause_committed(srv: ServerProcess, sandbox_id: str) -> bool:
    with srv.client() as c:
        body = c.get(f"/sandboxes/{sandbox_id}").json()
    assert body["state"] == "paused", body
    return bool(body.get("pauseCommitted"))


def snapshot_visible(srv: ServerProcess, key: str) -> bool:
    with srv.client() as c:
        return c.get(f"/snapshots/{key}").status_code == 200


def move(sandbox_id: str, source: ServerProcess, dest: ServerProcess) -> None:
    """Pause on ``source``, resume on ``dest`` (which adopts it from the repository), and
    see ``source`` drop its stale copy."""
    with source.client() as c:
        assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
    wait_for(lambda: pause_committed(source, sandbox_id), what="the pause to be committed")
    with dest.client() as c:
        r = c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 300})
        assert r.status_code == 201, r.text
    with source.client() as c:
        wait_for(
            lambda: c.get(f"/sandboxes/{sandbox_id}").status_code == 404,
            what="the source node to drop the sandbox the other resumed",
        )


@pytest.fixture(scope="module")
def s3(test_root: Path) -> Iterator[S3Server]:
    with start_s3_server(test_root / "s3") as server:
        yield server


SHARED_ENVD_TOKEN_KEY = "5e" * 32


@pytest.fixture(scope="module", params=["posix", "s3"])
def nodes(
    request: pytest.FixtureRequest, test_root: Path, guest_image: None
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    kind = request.param
    # Nodes that resume each other's sandboxes derive envd tokens from one key.
    extra = {"AENV_NETWORK_LINGER": "1", "AENV_ENVD_TOKEN_KEY": SHARED_ENVD_TOKEN_KEY}
    if kind == "posix":
        extra["AENV_REPOSITORY"] = (test_root / "shared-repository").as_uri()
    else:
        s3: S3Server = request.getfixturevalue("s3")
        extra.update(s3.env)
        extra["AENV_REPOSITORY"] = s3.url("nodes")
    a = ServerProcess(home=test_root / f"{kind}-node-a", extra_env={**extra, "AENV_NODE_ID": "a"})
    b = ServerProcess(home=test_root / f"{kind}-node-b", extra_env={**extra, "AENV_NODE_ID": "b"})
    with live_server(a), live_server(b):
        yield a, b


def test_pause_on_one_node_resume_on_the_other_and_back(
    nodes: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = nodes
    sandbox_id = create_sandbox_id(a, timeout=600)
    sh(a, sandbox_id, "echo moved > /home/user/marker.txt")
    pid = sh(a, sandbox_id, COUNTER)
    wait_for(lambda: counter(a, sandbox_id) > 2, what="the counter to run")
    move(sandbox_id, a, b)
    assert sh(b, sandbox_id, "cat /home/user/marker.txt") == "moved"
    assert sh(b, sandbox_id, f"kill -0 {pid} && echo alive") == "alive"
    first = counter(b, sandbox_id)
    wait_for(lambda: counter(b, sandbox_id) > first, what="the counter to go on on B")

    # Adopted sandboxes are like any other: they snapshot, and the snapshot starts more.
    with b.client() as c:
        r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={})
        assert r.status_code == 201, r.text
        child = create_sandbox_id(b, r.json()["snapshotID"], timeout=600)
        assert sh(b, child, "cat /home/user/marker.txt") == "moved"
        assert c.delete(f"/sandboxes/{child}").status_code == 204

    # And back: paused on B, resumed on A.
    sh(b, sandbox_id, "echo back >> /home/user/marker.txt")
    move(sandbox_id, b, a)
    assert sh(a, sandbox_id, "cat /home/user/marker.txt") == "moved\nback"
    assert sh(a, sandbox_id, f"kill -0 {pid} && echo alive") == "alive"
    # Killed on A: nobody can resume it from the repository any more.
    with a.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    with b.client() as c:
        assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 404


def test_snapshot_taken_on_one_node_starts_sandboxes_on_the_other(
    nodes: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = nodes
    sandbox_id = create_sandbox_id(a, timeout=600)
    sh(a, sandbox_id, "echo from-a > /home/user/snap.txt")
    name = f"shared-{sandbox_id[-6:]}"
    with a.client() as c:
        r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": name})
        assert r.status_code == 201, r.text
        snapshot_id = r.json()["snapshotID"]
        # The name is taken everywhere.
        again = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": name})
        assert again.status_code == 409, again.text
    wait_for(lambda: snapshot_visible(b, name), what="the snapshot to reach B")
    child = create_sandbox_id(b, name, timeout=600)
    assert sh(b, child, "cat /home/user/snap.txt") == "from-a"
    with b.client() as c:
        listed = c.get("/snapshots").json()
        assert snapshot_id in [s["snapshotID"] for s in listed]
        assert c.delete(f"/sandboxes/{child}").status_code == 204
        # Deleted on B: gone for A too.
        assert c.delete(f"/snapshots/{name}").status_code == 204
    with a.client() as c:
        assert c.get(f"/snapshots/{snapshot_id}").status_code == 404
        r = c.post("/sandboxes", json={"templateID": name})
        assert r.status_code == 400, r.text
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def test_s3_down_pause_stays_local_and_is_uploaded_later(
    s3: S3Server, test_root: Path, guest_image: None
) -> None:
    """With the repository unreachable, pause and snapshots still work on the node (and
    the sandbox is never lost); they are committed once it is back."""
    extra = {**s3.env, "AENV_REPOSITORY": s3.url("outage"), "AENV_NETWORK_LINGER": "1"}
    node = ServerProcess(home=test_root / "outage-node", extra_env=extra)
    with live_server(node):
        sandbox_id = create_sandbox_id(node, timeout=600)
        sh(node, sandbox_id, "echo kept > /home/user/kept.txt")
        s3.stop()
        try:
            with node.client() as c:
                assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
                time.sleep(2)
                assert not pause_committed(node, sandbox_id)
                r = c.post(f"/sandboxes/{sandbox_id}/connect", json={})
                assert r.status_code == 201, r.text
            assert sh(node, sandbox_id, "cat /home/user/kept.txt") == "kept"
            with node.client() as c:
                assert c.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
        finally:
            s3.start()
        # Uploaded once the repository is back (retried in the background).
        wait_for(lambda: pause_committed(node, sandbox_id), 180, "the upload after the outage")
        with node.client() as c:
            assert c.post(f"/sandboxes/{sandbox_id}/connect", json={}).status_code == 201
        assert sh(node, sandbox_id, "cat /home/user/kept.txt") == "kept"


def test_repository_down_mid_commit_commits_once_it_is_back(
    s3: S3Server, test_root: Path, guest_image: None
) -> None:
    """The S3 server stops while a snapshot is being uploaded: the node keeps the
    snapshot (it starts sandboxes locally), retries, and commits it in full once the
    repository is back, after which another node starts sandboxes from it."""
    extra = {**s3.env, "AENV_REPOSITORY": s3.url("midcommit")}
    a = ServerProcess(home=test_root / "midcommit-a", extra_env=extra)
    b = ServerProcess(home=test_root / "midcommit-b", extra_env=extra)
    with live_server(a), live_server(b):
        sandbox_id = create_sandbox_id(a, timeout=600)
        # New data, so the upload takes long enough to be cut.
        sh(a, sandbox_id, "head -c 200M /dev/urandom > /home/user/big && echo mid > /home/user/m")
        with a.client() as c:
            r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "mid-commit"})
            assert r.status_code == 201, r.text
            snapshot_id = r.json()["snapshotID"]
        wait_for(lambda: f"committing snapshot {snapshot_id}" in a.log_tail(200), 60, "the commit")
        s3.stop()
        try:
            assert f"{snapshot_id} committed" not in a.log_tail(400)
            # The node that took it still starts sandboxes from it meanwhile.
            local = create_sandbox_id(a, "mid-commit", timeout=600)
            assert sh(a, local, "cat /home/user/m") == "mid"
            time.sleep(3)
        finally:
            s3.start()
        wait_for(lambda: snapshot_visible(b, "mid-commit"), 300, "the commit after the outage")
        elsewhere = create_sandbox_id(b, "mid-commit", timeout=600)
        assert sh(b, elsewhere, "cat /home/user/m") == "mid"
        assert sh(b, elsewhere, "stat -c %s /home/user/big") == str(200 * 1024 * 1024)


def test_server_killed_mid_commit_leaves_the_previous_state(
    s3: S3Server, test_root: Path, guest_image: None
) -> None:
    extra = {
        **s3.env,
        "AENV_REPOSITORY": s3.url("crash"),
        "AENV_ENVD_TOKEN_KEY": SHARED_ENVD_TOKEN_KEY,
    }
    a = ServerProcess(home=test_root / "crash-a", extra_env=extra)
    b = ServerProcess(home=test_root / "crash-b", extra_env=extra)
    with live_server(a), live_server(b):
        sandbox_id = create_sandbox_id(a, timeout=600)
        sh(a, sandbox_id, "echo one > /home/user/gen.txt")
        with a.client() as c:
            r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "crash-one"})
            assert r.status_code == 201, r.text
        wait_for(lambda: snapshot_visible(b, "crash-one"), what="the first commit")
        # New data the second commit must upload, so it takes a while.
        sh(
            a,
            sandbox_id,
            "head -c 300M /dev/urandom > /home/user/big && echo two > /home/user/gen.txt",
        )
        with a.client() as c:
            r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "crash-two"})
            assert r.status_code == 201, r.text
            second = r.json()["snapshotID"]
        wait_for(lambda: f"committing snapshot {second}" in a.log_tail(200), 60, "the commit")
        time.sleep(0.3)
        assert a.proc is not None
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        # It was killed mid-commit (hashing and uploading ~800 MiB takes seconds).
        assert f"{second} committed" not in a.log_tail(400)
        # The repository is readable, with the first snapshot and without the second.
        with b.client() as c:
            names = [n for s in c.get("/snapshots").json() for n in s["names"]]
            assert "crash-one" in names
            assert "crash-two" not in names
        child = create_sandbox_id(b, "crash-one", timeout=600)
        assert sh(b, child, "cat /home/user/gen.txt") == "one"
        # The restarted server finishes the interrupted commit.
        a.start()
        wait_for(lambda: snapshot_visible(b, "crash-two"), 300, "the resumed commit")
        child2 = create_sandbox_id(b, "crash-two", timeout=600)
        assert sh(b, child2, "cat /home/user/gen.txt") == "two"


def test_repository_unreachable_on_create_from_unknown_name(
    test_root: Path, guest_image: None
) -> None:
    extra = {
        "AENV_REPOSITORY": "s3://agentenv/nowhere",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
    }
    node = ServerProcess(home=test_root / "no-repo-node", extra_env=extra)
    with live_server(node), node.client() as c:
        r = c.post("/sandboxes", json={"templateID": "not-here"})
        assert r.status_code == 503, r.text
        assert "repository" in r.json()["message"]
        # The built-in template does not need the repository.
        r = c.post("/sandboxes", json={"templateID": "base"})
        assert r.status_code == 201, r.text
        assert httpx.get(f"{node.url}/health").json()["status"] == "ok"


def test_a_volume_follows_its_writer_across_nodes(
    nodes: tuple[ServerProcess, ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A volume lives in the repository: made and written on one node, mounted by a
    sandbox on the other; while that sandbox holds it the first node answers 409 naming
    the writer's node, and once it is killed the first node sees what it wrote."""
    a, b = nodes
    name = f"roaming-{secrets.token_hex(4)}"
    monkeypatch.setenv("E2B_VOLUME_API_URL", a.url)
    vol = Volume.create(name, **sdk_opts(a))
    vol.write_file("/from-a.txt", "written on a")
    sandbox = Sandbox.create(timeout=300, volume_mounts={"/data": name}, **sdk_opts(b))
    try:
        assert sandbox.commands.run("cat /data/from-a.txt").stdout == "written on a"
        sandbox.commands.run("echo from-b > /data/from-b.txt")
        with pytest.raises(SandboxException, match="writer on node b"):
            Sandbox.create(timeout=60, volume_mounts={"/data": name}, **sdk_opts(a))
        with pytest.raises(VolumeException, match="writer on node b"):
            vol.read_file("/from-a.txt")
        with pytest.raises(VolumeException):
            Volume.destroy(vol.volume_id, **sdk_opts(a))
        monkeypatch.setenv("E2B_VOLUME_API_URL", b.url)  # b serves it from its guest
        assert Volume.connect(vol.volume_id, **sdk_opts(b)).read_file("/from-b.txt") == "from-b\n"
    finally:
        sandbox.kill()
    monkeypatch.setenv("E2B_VOLUME_API_URL", a.url)

    def published() -> bool:
        try:
            return vol.read_file("/from-b.txt") == "from-b\n"
        except VolumeException:  # b still publishing: its claim is held until then
            return False

    wait_for(published, what="b to publish the volume")
    assert Volume.destroy(vol.volume_id, **sdk_opts(a)) is True
