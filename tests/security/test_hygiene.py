"""Issue #11's data hygiene, against a real server and real VMs, as a local user and a
hostile API client would find it.

The findings these reproduce: the data directory was 0755 and state.db (holding every
sandbox's envd token), disk images and logs 0644; tokens were stored in the clear; a
5 MB metadata value and keys with NUL or ESC were accepted; a snapshot name starting with
``/`` gave a 500; and nothing kept a full disk from half-writing sandboxes and snapshots.

The server's data directory is on a small XFS filesystem of its own (reflinks, as in
production), so the free-space floor can be reached for real by filling it.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.config import Config
from tests.helpers import ServerProcess, envelope, live_server, run_command

pytestmark = pytest.mark.vm

FILESYSTEM_SIZE = 2 << 30
FREE_SPACE_FLOOR = 400 << 20


@pytest.fixture(scope="module")
def small_filesystem(test_root: Path) -> Iterator[Path]:
    """A loop-mounted XFS filesystem of :data:`FILESYSTEM_SIZE`."""
    image = test_root / "hygiene-xfs.img"
    mountpoint = test_root / "hygiene-xfs"
    mountpoint.mkdir()
    with open(image, "wb") as f:
        f.truncate(FILESYSTEM_SIZE)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        for log in mountpoint.glob("*.log"):  # kept for a post-mortem
            shutil.copyfile(log, test_root / f"hygiene-{log.name}")
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def node(small_filesystem: Path, guest_image: None) -> Iterator[ServerProcess]:
    """A server whose data directory an older server left world-readable."""
    home = small_filesystem / "home"
    (home / "sandboxes").mkdir(parents=True)
    (home / "old-server.log").write_text("secrets an older server logged\n")
    os.chmod(home, 0o755)
    os.chmod(home / "sandboxes", 0o755)
    os.chmod(home / "old-server.log", 0o644)
    srv = ServerProcess(
        home=home,
        extra_env={"AENV_NETWORK_LINGER": "1", "AENV_FREE_SPACE_FLOOR": str(FREE_SPACE_FLOOR)},
    )
    with live_server(srv) as started:
        yield started


@pytest.fixture(scope="module")
def secured(node: ServerProcess) -> Iterator[dict[str, Any]]:
    with node.client() as c:
        created = c.post(
            "/v2/sandboxes",
            json={"templateID": "base", "timeout": 900, "metadata": {"suite": "hygiene"}},
        )
        assert created.status_code == 201, created.text
        body: dict[str, Any] = created.json()
        yield body
        c.delete(f"/sandboxes/{body['sandboxID']}")


def _exposed(home: Path, vmm_id_base: int) -> list[str]:
    """Entries under ``home`` (and itself) open to more than root and the VMMs: the
    directory itself must be 0700; below it, group bits only for a VMM group (ids from
    ``vmm_id_base``: files a confined VMM reads, given to it on purpose), and for others
    only the search bit of a VMM's jail directories (0711, reachable only through the
    VMM's own mount namespace, since ``home`` is 0700)."""
    found = []
    if stat.S_IMODE(home.stat().st_mode) != 0o700:
        found.append(f"{home} {stat.filemode(home.stat().st_mode)}")
    for root, dirs, files in os.walk(home):
        for path in [Path(root) / name for name in dirs + files]:
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            group, other = st.st_mode & 0o070, st.st_mode & 0o007
            if stat.S_ISDIR(st.st_mode) and ".jail-" in str(path):
                exposed = stat.S_IMODE(st.st_mode) != 0o711
            else:
                exposed = bool(other) or (bool(group) and st.st_gid < vmm_id_base)
            if exposed:
                found.append(f"{path} {stat.filemode(st.st_mode)} gid {st.st_gid}")
    return sorted(set(found))


def _as_nobody(*command: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(command), user="nobody", group="nogroup", capture_output=True)


def test_data_directory_is_private(node: ServerProcess, secured: dict[str, Any]) -> None:
    """Nothing in the data directory (the old server's files, state.db, the token key,
    the sandbox's disk, RAM file and console log, the template) is open to group or
    others, and another local user cannot read state.db."""
    sandbox_id = secured["sandboxID"]
    assert run_command(node.url, sandbox_id, "echo hi").stdout == "hi\n"
    assert (node.home / "sandboxes" / sandbox_id).is_dir()
    assert _exposed(node.home, Config().vmm_id_base) == []
    for name in ("state.db", "envd_token.key", "old-server.log"):
        denied = _as_nobody("cat", str(node.home / name))
        assert denied.returncode != 0 and b"Permission denied" in denied.stderr, name
    assert _as_nobody("ls", str(node.home / "sandboxes")).returncode != 0


def test_envd_tokens_are_not_stored(node: ServerProcess, secured: dict[str, Any]) -> None:
    """state.db (and its WAL) keeps a digest, never the token; the token still opens
    the sandbox, and after a restart the server hands out the same one again."""
    sandbox_id, token = secured["sandboxID"], secured["envdAccessToken"]
    assert token
    with sqlite3.connect(node.home / "state.db") as db:
        stored = db.execute(
            "SELECT envd_token FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()[0]
    assert stored.startswith("sha256:") and token not in stored
    for path in node.home.glob("state.db*"):
        assert token.encode() not in path.read_bytes(), path
    node.stop()
    node.start()
    with node.client() as c:
        connected = c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 900})
        assert connected.status_code in (200, 201), connected.text
        assert connected.json()["envdAccessToken"] == token
    assert run_command(node.url, sandbox_id, "id -un", token=token).stdout == "user\n"
    wrong = httpx.post(
        f"{node.url}/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/true"}}),
        headers={
            "Content-Type": "application/connect+json",
            "E2b-Sandbox-Id": sandbox_id,
            "X-Access-Token": ("x" if token[0] != "x" else "y") + token[1:],
        },
        trust_env=False,
        timeout=60,
    )
    assert wrong.status_code == 401, wrong.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        # A body this large is refused by its size before it is parsed (413).
        ({"metadata": {"big": "v" * 5_000_000}}, "request body"),
        ({"metadata": {"k\x00nul": "v"}}, "metadata"),
        ({"metadata": {"k\x1b[31mesc": "v"}}, "metadata"),
        ({"metadata": {"k": "\x1b]0;title\x07"}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(1000)}}, "metadata"),
        ({"envVars": {"NOT A NAME": "v"}}, "envVars"),
        ({"envVars": {"A": "nul\x00inside"}}, "envVars"),
        ({"envVars": {"A": "v" * 1_000_000}}, "envVars"),
    ],
)
@pytest.mark.parametrize("route", ["/sandboxes", "/v2/sandboxes"])
def test_oversized_or_hostile_metadata_and_env_vars_are_refused(
    node: ServerProcess, route: str, body: dict[str, Any], field: str
) -> None:
    with node.client() as c:
        before = c.get("/v2/sandboxes")
        response = c.post(route, json={"templateID": "base", "timeout": 60, **body})
        if field == "request body":
            assert response.status_code == 413, response.text[:300]
            assert response.json()["message"].startswith("request body larger than")
        else:
            assert response.status_code == 400, response.text[:300]
            assert response.json()["message"].startswith(f"{field}: "), response.text[:300]
        assert len(response.content) < 1000
        after = c.get("/v2/sandboxes")
    assert len(after.content) == len(before.content)


def test_snapshot_name_with_a_leading_slash_is_a_400(
    node: ServerProcess, secured: dict[str, Any]
) -> None:
    sandbox_id = secured["sandboxID"]
    with node.client() as c:
        for name in ("/x", "/"):
            made = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": name})
            assert made.status_code == 400, made.text
            assert made.json()["message"].startswith("name: ")
        # Looked up or used as a template by such a name: a 400 too, never a 500.
        assert c.get("/snapshots//x").status_code == 400
        created = c.post("/sandboxes", json={"templateID": "/x", "timeout": 60})
        assert created.status_code == 400, created.text
    assert run_command(node.url, sandbox_id, "echo alive").stdout == "alive\n"


def _entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.exists() else set()


def test_below_the_free_space_floor_nothing_half_written(
    node: ServerProcess, secured: dict[str, Any], small_filesystem: Path
) -> None:
    """Fill the data directory's filesystem below the floor: create, fork and snapshot
    answer 507 and leave no sandbox, snapshot or record behind; with the space back,
    they work."""
    sandbox_id = secured["sandboxID"]
    ballast = small_filesystem / "ballast"
    st = os.statvfs(small_filesystem)
    free = st.f_bavail * st.f_frsize
    assert free > FREE_SPACE_FLOOR, "the filesystem is already below the floor"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free - FREE_SPACE_FLOOR // 2)
    finally:
        os.close(fd)
    try:
        sandboxes = _entries(node.home / "sandboxes")
        snapshots = _entries(node.home / "snapshots")
        with node.client() as c:
            listed = c.get("/v2/sandboxes").json()
            for method, path, body in [
                ("POST", "/sandboxes", {"templateID": "base", "timeout": 60}),
                ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 60}),
                ("POST", f"/sandboxes/{sandbox_id}/fork", {"count": 2}),
                ("POST", f"/sandboxes/{sandbox_id}/snapshots", {"name": "full-disk"}),
            ]:
                refused = c.request(method, path, json=body)
                assert refused.status_code == 507, (path, refused.text)
                assert "free-space floor" in refused.json()["message"]
            assert c.get("/v2/sandboxes").json() == listed
            assert c.get("/snapshots/full-disk").status_code == 404
        assert _entries(node.home / "sandboxes") == sandboxes
        assert _entries(node.home / "snapshots") == snapshots
        # The running sandbox is unharmed.
        assert run_command(node.url, sandbox_id, "echo still").stdout == "still\n"
    finally:
        ballast.unlink()
    with node.client() as c:
        snapshot = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "after-floor"})
        assert snapshot.status_code in (200, 201), snapshot.text
        created = c.post("/v2/sandboxes", json={"templateID": "after-floor", "timeout": 60})
        assert created.status_code == 201, created.text
        c.delete(f"/sandboxes/{created.json()['sandboxID']}")
