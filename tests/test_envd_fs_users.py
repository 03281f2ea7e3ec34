"""envd's filesystem RPCs act with the request user's permissions: envd runs on the host
as root (a real ``python -m agentenv.envd``), requests name ``nobody`` with Basic auth, and
root's files (0600 in a 0700 directory, a 0755 directory nobody cannot write) must stay
out of reach for every RPC, while the same requests as root work. /files (read, write)
already did this; both go through ``fsaccess``."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.codec import proto_json_codec
from connectrpc.errors import ConnectError

from agentenv.envd.gen.filesystem_connect import FilesystemClient
from agentenv.envd.gen.filesystem_pb import (
    CreateWatcherRequest,
    EventType,
    FileType,
    ListDirRequest,
    MakeDirRequest,
    MoveRequest,
    RemoveRequest,
    StatRequest,
    WatchDirRequest,
)
from tests.test_envd import Envd, basic_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

NOBODY = basic_user("nobody")
ROOT = basic_user("root")


@dataclass(frozen=True)
class Tree:
    """A directory every user can enter, holding root's files."""

    base: Path
    #: 0600, root's; nobody may stat it (its directory is searchable) but not move it.
    secret: Path
    #: 0700, root's, holding ``inner``.
    private: Path
    inner: Path
    #: 0755, root's: nobody can enter it but not write to it; holds ``kept`` (0644).
    locked: Path
    kept: Path
    #: 0744, root's: nobody can read its names but not stat what is inside.
    list_only: Path
    #: nobody's own directory.
    open: Path


@pytest.fixture(scope="module")
def envd() -> Iterator[Envd]:
    server = Envd()
    yield server
    server.stop()


@pytest.fixture
def tree() -> Iterator[Tree]:
    base = Path(tempfile.mkdtemp(prefix="envd-users-"))
    base.chmod(0o755)
    t = Tree(
        base=base,
        secret=base / "secret",
        private=base / "private",
        inner=base / "private" / "inner.txt",
        locked=base / "locked",
        kept=base / "locked" / "kept.txt",
        list_only=base / "list-only",
        open=base / "open",
    )
    t.secret.write_bytes(b"root only")
    t.secret.chmod(0o600)
    t.private.mkdir(mode=0o700)
    t.inner.write_bytes(b"inner")
    t.locked.mkdir(mode=0o755)
    t.kept.write_bytes(b"kept")
    t.list_only.mkdir()
    t.list_only.chmod(0o744)
    t.open.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(t.open, nobody.pw_uid, nobody.pw_gid)
    yield t
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def fs(envd: Envd) -> AsyncIterator[FilesystemClient]:
    async with FilesystemClient(envd.url, codec=proto_json_codec(), send_compression=None) as c:
        yield c


async def denied(call: Any) -> None:
    """``call`` (an awaitable RPC) fails with permission_denied."""
    with pytest.raises(ConnectError) as raised:
        await call
    assert raised.value.code == Code.PERMISSION_DENIED, raised.value


async def test_stat(fs: FilesystemClient, tree: Tree) -> None:
    await denied(fs.stat(StatRequest(path=str(tree.inner)), headers=NOBODY))
    entry = (await fs.stat(StatRequest(path=str(tree.inner)), headers=ROOT)).entry
    assert (entry.size, entry.owner) == (5, "root")
    # What nobody may see, nobody sees: the secret's directory is searchable.
    entry = (await fs.stat(StatRequest(path=str(tree.secret)), headers=NOBODY)).entry
    assert (entry.size, entry.permissions) == (9, "-rw-------")
    with pytest.raises(ConnectError) as raised:
        await fs.stat(StatRequest(path=str(tree.open / "missing")), headers=NOBODY)
    assert raised.value.code == Code.NOT_FOUND


async def test_list_dir(fs: FilesystemClient, tree: Tree) -> None:
    await denied(fs.list_dir(ListDirRequest(path=str(tree.private), depth=1), headers=NOBODY))
    listed = await fs.list_dir(ListDirRequest(path=str(tree.private), depth=1), headers=ROOT)
    assert [e.name for e in listed.entries] == ["inner.txt"]
    # A deep listing skips what nobody cannot open, and does not describe what nobody
    # cannot stat.
    (tree.list_only / "hidden.txt").write_bytes(b"h")
    deep = await fs.list_dir(ListDirRequest(path=str(tree.base), depth=3), headers=NOBODY)
    paths = {e.path for e in deep.entries}
    assert {str(tree.private), str(tree.list_only), str(tree.kept), str(tree.secret)} <= paths
    assert not {str(tree.inner), str(tree.list_only / "hidden.txt")} & paths
    deep = await fs.list_dir(ListDirRequest(path=str(tree.base), depth=3), headers=ROOT)
    paths = {e.path for e in deep.entries}
    assert {str(tree.inner), str(tree.list_only / "hidden.txt")} <= paths
    with pytest.raises(ConnectError) as raised:
        await fs.list_dir(ListDirRequest(path=str(tree.secret)), headers=NOBODY)
    assert raised.value.code == Code.INVALID_ARGUMENT


async def test_make_dir(fs: FilesystemClient, tree: Tree) -> None:
    for path in (tree.locked / "new", tree.private / "new", tree.private / "a" / "b"):
        await denied(fs.make_dir(MakeDirRequest(path=str(path)), headers=NOBODY))
        assert not os.path.lexists(path)
    made = tree.open / "a" / "b"
    entry = (await fs.make_dir(MakeDirRequest(path=str(made)), headers=NOBODY)).entry
    assert (entry.type, entry.owner) == (FileType.DIRECTORY, "nobody")
    nobody = pwd.getpwnam("nobody")
    for path in (made, made.parent):
        info = path.stat()
        assert (info.st_uid, info.st_gid) == (nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(ConnectError) as raised:
        await fs.make_dir(MakeDirRequest(path=str(made)), headers=NOBODY)
    assert raised.value.code == Code.ALREADY_EXISTS
    entry = (await fs.make_dir(MakeDirRequest(path=str(tree.locked / "r")), headers=ROOT)).entry
    assert entry.owner == "root"


async def test_move(fs: FilesystemClient, tree: Tree) -> None:
    steal = [
        (tree.secret, tree.open / "stolen"),
        (tree.inner, tree.open / "inner"),
        (tree.kept, tree.open / "kept"),
        (tree.open, tree.locked / "mine"),  # into a directory nobody cannot write
    ]
    for source, destination in steal:
        request = MoveRequest(source=str(source), destination=str(destination))
        await denied(fs.move(request, headers=NOBODY))
        assert source.exists() and not destination.exists()
    assert tree.secret.read_bytes() == b"root only"
    # nobody moves its own files.
    (tree.open / "f").write_bytes(b"f")
    request = MoveRequest(source=str(tree.open / "f"), destination=str(tree.open / "d" / "g"))
    entry = (await fs.move(request, headers=NOBODY)).entry
    assert entry.path == str(tree.open / "d" / "g")
    assert (tree.open / "d").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    # root moves root's.
    request = MoveRequest(source=str(tree.secret), destination=str(tree.private / "s"))
    assert (await fs.move(request, headers=ROOT)).entry.size == 9
    with pytest.raises(ConnectError) as raised:
        await fs.move(MoveRequest(source=str(tree.secret), destination="/tmp/x"), headers=ROOT)
    assert raised.value.code == Code.NOT_FOUND


async def test_move_across_filesystems(fs: FilesystemClient, tree: Tree) -> None:
    """A move from tmpfs to the tree's filesystem copies, as the user, on a file worker."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tree.base.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    mine = Path(tempfile.mkdtemp(prefix="envd-users-", dir=shm))
    try:
        nobody = pwd.getpwnam("nobody")
        os.chown(mine, nobody.pw_uid, nobody.pw_gid)
        (mine / "f").write_bytes(b"across")
        request = MoveRequest(source=str(mine / "f"), destination=str(tree.locked / "f"))
        await denied(fs.move(request, headers=NOBODY))
        assert not (tree.locked / "f").exists()
        request = MoveRequest(source=str(mine / "f"), destination=str(tree.open / "f"))
        assert (await fs.move(request, headers=NOBODY)).entry.size == 6
        assert not (mine / "f").exists()
        assert (tree.open / "f").stat().st_uid == nobody.pw_uid
    finally:
        shutil.rmtree(mine, ignore_errors=True)


async def test_remove(fs: FilesystemClient, tree: Tree) -> None:
    for path in (tree.secret, tree.kept, tree.inner, tree.private, tree.locked):
        await denied(fs.remove(RemoveRequest(path=str(path)), headers=NOBODY))
        assert path.exists(), path
    (tree.open / "sub").mkdir()
    (tree.open / "sub" / "f").write_bytes(b"f")
    os.chown(tree.open / "sub", pwd.getpwnam("nobody").pw_uid, -1)
    await fs.remove(RemoveRequest(path=str(tree.open / "sub")), headers=NOBODY)
    assert not (tree.open / "sub").exists()
    await fs.remove(RemoveRequest(path=str(tree.open / "missing")), headers=NOBODY)
    await fs.remove(RemoveRequest(path=str(tree.private)), headers=ROOT)
    assert not tree.private.exists()


async def test_watch(fs: FilesystemClient, tree: Tree) -> None:
    await denied(anext(fs.watch_dir(WatchDirRequest(path=str(tree.private)), headers=NOBODY)))
    await denied(fs.create_watcher(CreateWatcherRequest(path=str(tree.private)), headers=NOBODY))

    stream = fs.watch_dir(
        WatchDirRequest(path=str(tree.base), recursive=True, include_entry=True),
        headers=NOBODY,
    )
    assert (await anext(stream)).event.field == "start"
    (tree.private / "leak.txt").write_bytes(b"x")
    (tree.list_only / "named.txt").write_bytes(b"x")
    (tree.open / "marker").write_bytes(b"x")
    seen: dict[tuple[str, Any], Any] = {}
    async with asyncio.timeout(20):
        while ("open/marker", EventType.CREATE) not in seen:
            response = await anext(stream)
            if response.event.field == "filesystem":
                event = response.event.value
                seen[(event.name, event.type)] = event
    await stream.aclose()
    assert not any(name.startswith("private/") for name, _ in seen), seen
    # nobody may read list-only's names but not stat its files: no entry for them.
    assert seen[("list-only/named.txt", EventType.CREATE)].entry is None
    assert seen[("open/marker", EventType.CREATE)].entry is not None

    # root's recursive watch does see inside private.
    stream = fs.watch_dir(WatchDirRequest(path=str(tree.base), recursive=True), headers=ROOT)
    assert (await anext(stream)).event.field == "start"
    (tree.private / "seen.txt").write_bytes(b"x")
    async with asyncio.timeout(20):
        while True:
            response = await anext(stream)
            if response.event.field == "filesystem":
                if response.event.value.name == "private/seen.txt":
                    break
    await stream.aclose()


async def test_concurrent_users_never_share_credentials(fs: FilesystemClient, tree: Tree) -> None:
    """Interleaved requests as root and nobody: each gets exactly its own answer."""

    async def as_root() -> None:
        entry = (await fs.stat(StatRequest(path=str(tree.inner)), headers=ROOT)).entry
        assert entry.size == 5

    async def as_nobody() -> None:
        await denied(fs.stat(StatRequest(path=str(tree.inner)), headers=NOBODY))

    await asyncio.gather(*(as_root() if i % 2 else as_nobody() for i in range(200)))


def test_read_and_write_unchanged(envd: Envd, tree: Tree) -> None:
    url = f"{envd.url}/files"
    assert httpx.get(url, params={"path": str(tree.inner), "username": "nobody"}).status_code == 403
    assert httpx.get(url, params={"path": str(tree.inner), "username": "root"}).content == b"inner"
    written = httpx.post(
        url, params={"path": str(tree.locked / "w"), "username": "nobody"}, files={"file": b"w"}
    )
    assert written.status_code == 403
    assert not (tree.locked / "w").exists()
    written = httpx.post(
        url, params={"path": str(tree.open / "w"), "username": "nobody"}, files={"file": b"w"}
    )
    assert written.status_code == 200
    assert (tree.open / "w").stat().st_uid == pwd.getpwnam("nobody").pw_uid
