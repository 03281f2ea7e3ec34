"""Issue #12's full disk, for real: a server whose data directory is a small loop-mounted
XFS filesystem (reflinks, as in production) and whose repository is another, each filled
with a ballast file in turn.

What this reproduces: a guest writing its RAM on a full data filesystem killed its VMM
with SIGBUS (the RAM file is a reflink and needs new blocks) while the API went on
saying ``running`` and ``/health`` ``ok``; creates failed with a misleading 500; commits
retried ENOSPC forever. Now: below the free-space floor creates, resumes, snapshots and
forks answer 507 and leave nothing behind, ``/health`` is degraded and says why, the
guest that died is a filesystem-only pause with a log line blaming the disk, a commit
that finds no space stops and is reported, and with the space back everything works.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ServerProcess, live_server, run_command, vmm_pids

pytestmark = pytest.mark.vm

DATA_FS_SIZE = 2 << 30
# Room for two snapshots of a sandbox of the base template (its RAM and guest image).
REPOSITORY_FS_SIZE = 3 << 30
FREE_SPACE_FLOOR = 400 << 20
# What the data filesystem keeps once filled: below the floor, less than the guest
# writes to its RAM below (as in the issue: 20 MB free, 150 MB written).
LEFT_FREE = 20 << 20


def _mounted(mountpoint: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(mountpoint)]).returncode == 0


def _unmount(mountpoint: Path) -> None:
    if _mounted(mountpoint) and subprocess.run(["umount", str(mountpoint)]).returncode != 0:
        # Something still holds it (a VMM being killed): detach now, freed when it goes.
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def _mount_xfs(image: Path, mountpoint: Path, size: int) -> None:
    """A sparse XFS image of ``size`` loop-mounted on ``mountpoint``. ``mount -o loop``
    gives the loop device autoclear: unmounting releases it."""
    mountpoint.mkdir()
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True)


@pytest.fixture(scope="module")
def filesystems(test_root: Path) -> Iterator[tuple[Path, Path]]:
    """Two loop-mounted XFS filesystems: the data directory's, of :data:`DATA_FS_SIZE`,
    and the repository's, of :data:`REPOSITORY_FS_SIZE`."""
    data, repository = test_root / "disk-full-data", test_root / "disk-full-repository"
    images = [test_root / "disk-full-data.img", test_root / "disk-full-repository.img"]
    try:
        _mount_xfs(images[0], data, DATA_FS_SIZE)
        _mount_xfs(images[1], repository, REPOSITORY_FS_SIZE)
        yield data, repository
    finally:
        for log in data.glob("*.log"):  # kept for a post-mortem
            with contextlib.suppress(OSError):
                (test_root / f"disk-full-{log.name}").write_bytes(log.read_bytes())
        _unmount(repository)
        _unmount(data)
        for image in images:
            image.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def node(filesystems: tuple[Path, Path], guest_image: None) -> Iterator[ServerProcess]:
    data, repository = filesystems
    srv = ServerProcess(
        home=data / "home",
        extra_env={
            "AENV_NETWORK_LINGER": "1",
            "AENV_FREE_SPACE_FLOOR": str(FREE_SPACE_FLOOR),
            "AENV_REPOSITORY": f"file://{repository}",
        },
    )
    with live_server(srv) as started:
        yield started


@pytest.fixture
def api(node: ServerProcess) -> Iterator[httpx.Client]:
    """A client of ``node``; the sandboxes a test leaves (failing) are killed after it."""
    with node.client() as c:
        yield c
        for item in c.get("/sandboxes").json():
            c.delete(f"/sandboxes/{item['sandboxID']}")


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def _filled(filesystem: Path, leave: int) -> Iterator[Path]:
    """``filesystem`` with a ballast file leaving ``leave`` bytes free, for the block."""
    ballast = filesystem / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, _free(filesystem) - leave)
    finally:
        os.close(fd)
    try:
        yield ballast
    finally:
        ballast.unlink()


def _entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.exists() else set()


def _wait_for(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def _create(c: httpx.Client) -> str:
    created = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 900})
    assert created.status_code == 201, created.text
    return str(created.json()["sandboxID"])


def test_a_commit_without_space_stops_and_is_reported(
    node: ServerProcess, filesystems: tuple[Path, Path], api: httpx.Client
) -> None:
    """A snapshot taken while the repository is full is usable on this node; its commit
    stops at the first ENOSPC (logged once, no retries) and ``/health`` says so. Once a
    commit succeeds again, the stopped one is committed too."""
    repository, c = filesystems[1], api
    sandbox_id = _create(c)
    # XFS needs some blocks for the ballast's own extent map: not all can be taken.
    with _filled(repository, 1 << 20):
        log_start = node.log_path.stat().st_size
        snapshot = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "no-room"})
        assert snapshot.status_code == 201, snapshot.text
        snapshot_id = snapshot.json()["snapshotID"]

        def reported() -> dict[str, Any] | None:
            health: dict[str, Any] = c.get("/health").json()
            return health if snapshot_id in (health.get("detail") or "") else None

        health = _wait_for("the stopped commit in /health", reported)
        assert health["status"] == "degraded" and "space" in health["detail"]
        time.sleep(12)  # longer than the retry interval of reachable-repository errors
        log = node.log_path.read_bytes()[log_start:].decode(errors="replace")
        assert log.count(f"committing {snapshot_id} stopped") == 1, log
        assert "No space left on device" in log
        assert f"committing {snapshot_id} failed" not in log  # never retried
        # Still usable here.
        child = c.post("/v2/sandboxes", json={"templateID": "no-room", "timeout": 60})
        assert child.status_code == 201, child.text
        assert run_command(node.url, child.json()["sandboxID"], "echo up").stdout == "up\n"
        assert c.delete(f"/sandboxes/{child.json()['sandboxID']}").status_code == 204
    # With room again, the next commit that succeeds takes the stopped one along.
    again = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "room-again"})
    assert again.status_code == 201, again.text
    _wait_for("/health ok again", lambda: c.get("/health").json()["status"] == "ok")
    for committed in (snapshot_id, again.json()["snapshotID"]):
        record = repository / "catalog" / "snapshot" / f"{committed}.json"
        _wait_for(f"{committed} in the repository", record.exists)
        assert c.delete(f"/snapshots/{committed}").status_code == 204
    assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def _fill_guest_ram(url: str, sandbox_id: str) -> None:
    """Have the guest write 150 MiB to its RAM (tmpfs); its VMM dies doing it."""
    with contextlib.suppress(Exception):
        run_command(url, sandbox_id, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=150", timeout=30)


def test_a_full_data_filesystem_is_reported_and_refused(
    node: ServerProcess, filesystems: tuple[Path, Path], api: httpx.Client
) -> None:
    """Below the floor: /health degraded and 507s that leave nothing behind; a guest
    that writes its RAM with no block left dies of SIGBUS and is reported (a
    filesystem-only pause, an error blaming the disk), not lost; with the space back it
    boots from its disk."""
    data, c = filesystems[0], api
    victim = _create(c)
    bystander = _create(c)
    health = c.get("/health").json()
    assert health["status"] == "ok", (health["detail"], health["disk"])
    sandboxes = _entries(node.home / "sandboxes")
    snapshots = _entries(node.home / "snapshots")
    with _filled(data, LEFT_FREE):
        # /health says why the node is degraded.
        health = c.get("/health").json()
        assert health["status"] == "degraded", health
        assert "below its free-space floor" in health["detail"]
        assert health["disk"]["freeBytes"] < health["disk"]["floorBytes"] == FREE_SPACE_FLOOR
        # Nothing that writes new files starts: 507, nothing left behind.
        for method, path, body in [
            ("POST", "/sandboxes", {"templateID": "base", "timeout": 60}),
            ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 60}),
            ("POST", f"/sandboxes/{bystander}/fork", {"count": 1}),
            ("POST", f"/sandboxes/{bystander}/snapshots", {"name": "full"}),
        ]:
            refused = c.request(method, path, json=body)
            assert refused.status_code == 507, (path, refused.text)
            assert refused.json()["code"] == 507
            assert "free-space floor" in refused.json()["message"]
        assert _entries(node.home / "sandboxes") == sandboxes
        assert _entries(node.home / "snapshots") == snapshots

        # The victim writes its RAM: no block is left, its VMM dies of SIGBUS.
        log_start = node.log_path.stat().st_size
        # Its stream is not ended when the VMM dies (it times out): not waited for.
        writer = threading.Thread(target=_fill_guest_ram, args=(node.url, victim), daemon=True)
        writer.start()
        paused = _wait_for(
            "the victim reported paused",
            lambda: c.get(f"/sandboxes/{victim}").json().get("state") == "paused",
            timeout=180,
        )
        assert paused
        detail = c.get(f"/sandboxes/{victim}").json()
        assert detail["pauseMode"] == "filesystem"
        log = node.log_path.read_bytes()[log_start:].decode(errors="replace")
        assert f"sandbox {victim}: its VMM" in log and "SIGBUS" in log, log
        assert "the data filesystem is full" in log, log
        assert not vmm_pids(f"/sandboxes/{victim}/")
        # Resuming it needs space too: refused, still paused.
        refused = c.post(f"/sandboxes/{victim}/connect", json={"timeout": 60})
        assert refused.status_code == 507, refused.text
        assert c.get(f"/sandboxes/{victim}").json()["state"] == "paused"
        # Nothing is silently lost: whatever is listed running has a VMM.
        time.sleep(2)
        for item in c.get("/v2/sandboxes").json():
            if item["state"] == "running":
                assert vmm_pids(f"/sandboxes/{item['sandboxID']}/"), item
    # With the space back (XFS frees the ballast's blocks in the background, so
    # perhaps not at once): healthy, and the victim boots from its disk.
    _wait_for("/health ok again", lambda: c.get("/health").json()["status"] == "ok", 30)
    resumed = c.post(f"/sandboxes/{victim}/connect", json={"timeout": 60})
    assert resumed.status_code == 201, resumed.text
    assert run_command(node.url, victim, "echo back").stdout == "back\n"
    for sandbox_id in (victim, bystander):
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    assert c.get("/v2/sandboxes").json() == []
    writer.join(60)
    assert not vmm_pids(str(node.home))
