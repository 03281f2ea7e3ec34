"""``sandbox.files`` through the official SDK, sync and async."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
from e2b import (
    E2B,
    FileNotFoundException,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sbx(e2b: E2B) -> Iterator[Sandbox]:
    sandbox = e2b.Sandbox.create(timeout=600, metadata={"suite": "e2b-files"})
    yield sandbox
    sandbox.kill()


def test_write_and_read_text_and_bytes(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/f/text.txt", "grüße\nline 2\n")
    assert (info.name, info.path) == ("text.txt", "/home/user/f/text.txt")
    assert sbx.files.read("/home/user/f/text.txt") == "grüße\nline 2\n"
    # Relative paths resolve against the user's home.
    assert sbx.files.read("f/text.txt") == "grüße\nline 2\n"

    blob = bytes(range(256)) * 4
    sbx.files.write("/home/user/f/blob.bin", blob)
    assert bytes(sbx.files.read("/home/user/f/blob.bin", format="bytes")) == blob
    streamed = b"".join(sbx.files.read("/home/user/f/blob.bin", format="stream"))
    assert streamed == blob
    # What the SDK wrote is what a process in the sandbox sees, owned by the user.
    stat = sbx.commands.run("stat -c '%s %U' /home/user/f/blob.bin").stdout
    assert stat == f"{len(blob)} user\n"


def test_ten_mib_file(sbx: Sandbox) -> None:
    blob = os.urandom(10 * 1024 * 1024)
    sbx.files.write("/tmp/ten.bin", blob)
    assert bytes(sbx.files.read("/tmp/ten.bin", format="bytes")) == blob
    digest = sbx.commands.run("sha256sum /tmp/ten.bin").stdout.split()[0]
    import hashlib

    assert digest == hashlib.sha256(blob).hexdigest()
    sbx.files.remove("/tmp/ten.bin")


def test_write_files_batch(sbx: Sandbox) -> None:
    written = sbx.files.write_files(
        [
            WriteEntry(path="/home/user/batch/a.txt", data="A"),
            WriteEntry(path="/home/user/batch/deep/b.bin", data=b"\x00\x01"),
            WriteEntry(path="batch/c.txt", data="C"),
        ]
    )
    assert sorted(w.path for w in written) == [
        "/home/user/batch/a.txt",
        "/home/user/batch/c.txt",
        "/home/user/batch/deep/b.bin",
    ]
    assert sbx.files.read("/home/user/batch/a.txt") == "A"
    assert bytes(sbx.files.read("/home/user/batch/deep/b.bin", format="bytes")) == b"\x00\x01"
    assert sbx.files.read("/home/user/batch/c.txt") == "C"


def test_list_exists_info_make_dir_rename_remove(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/tree/one.txt", "1")
    sbx.files.write("/home/user/tree/sub/two.txt", "22")

    top = {e.name: e for e in sbx.files.list("/home/user/tree")}
    assert set(top) == {"one.txt", "sub"}
    assert top["sub"].type == FileType.DIR
    assert top["one.txt"].type == FileType.FILE
    deep = {e.path for e in sbx.files.list("/home/user/tree", depth=2)}
    assert deep == {"/home/user/tree/one.txt", "/home/user/tree/sub", "/home/user/tree/sub/two.txt"}

    info = sbx.files.get_info("/home/user/tree/sub/two.txt")
    assert (info.name, info.size, info.type) == ("two.txt", 2, FileType.FILE)
    assert (info.owner, info.group, info.mode) == ("user", "user", 0o644)
    assert info.permissions == "-rw-r--r--"
    assert sbx.files.exists("/home/user/tree/one.txt")
    assert not sbx.files.exists("/home/user/tree/missing")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info("/home/user/tree/missing")
    with pytest.raises(FileNotFoundException):
        sbx.files.list("/home/user/tree/missing")

    assert sbx.files.make_dir("/home/user/tree/new/nested") is True
    assert sbx.files.make_dir("/home/user/tree/new/nested") is False
    assert sbx.files.get_info("/home/user/tree/new/nested").type == FileType.DIR

    moved = sbx.files.rename("/home/user/tree/one.txt", "/home/user/tree/new/uno.txt")
    assert moved.path == "/home/user/tree/new/uno.txt"
    assert not sbx.files.exists("/home/user/tree/one.txt")
    assert sbx.files.read("/home/user/tree/new/uno.txt") == "1"
    with pytest.raises(FileNotFoundException):
        sbx.files.rename("/home/user/tree/one.txt", "/home/user/tree/x")

    sbx.files.remove("/home/user/tree")
    assert not sbx.files.exists("/home/user/tree")
    sbx.files.remove("/home/user/tree")  # removing what is gone is not an error


def test_read_missing_file(sbx: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/home/user/definitely-missing.txt")


def test_read_a_directory(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/home/user")


def test_permissions_follow_the_user(sbx: Sandbox) -> None:
    # agentenv's envd does file transfers with the requesting user's permissions and
    # answers EACCES with 403, which the SDK has no special class for: a plain
    # SandboxException "403: permission denied ...". (Go envd writes as root and would
    # accept these.)
    for path in ("/root/x", "/etc/x"):
        with pytest.raises(SandboxException, match=r"(?i)permission denied") as info:
            sbx.files.write(path, "no")
        assert type(info.value) is SandboxException
    with pytest.raises(SandboxException, match=r"(?i)permission denied"):
        sbx.files.read("/etc/shadow")
    assert not sbx.files.exists("/etc/x", user="root")

    written = sbx.files.write("/root/x", "yes", user="root")
    assert written.path == "/root/x"
    assert sbx.files.read("/root/x", user="root") == "yes"
    assert sbx.files.get_info("/root/x", user="root").owner == "root"
    sbx.files.remove("/root/x", user="root")


def test_watch_dir_sync(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    watcher = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "x")
        sbx.commands.run("echo more >> /home/user/watched/new.txt")
        sbx.files.rename("/home/user/watched/new.txt", "/home/user/watched/renamed.txt")
        sbx.files.remove("/home/user/watched/renamed.txt")
        seen: list[tuple[str, FilesystemEventType]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen += [(e.name, e.type) for e in watcher.get_new_events()]
            if ("renamed.txt", FilesystemEventType.REMOVE) in seen:
                break
            time.sleep(0.2)
        assert ("new.txt", FilesystemEventType.CREATE) in seen
        assert ("new.txt", FilesystemEventType.WRITE) in seen
        assert ("new.txt", FilesystemEventType.RENAME) in seen
        assert ("renamed.txt", FilesystemEventType.REMOVE) in seen
    finally:
        watcher.stop()


def test_watch_dir_recursive_sync(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/rwatch/inner")
    watcher = sbx.files.watch_dir("/home/user/rwatch", recursive=True)
    try:
        sbx.files.write("/home/user/rwatch/inner/deep.txt", "x")
        names: set[str] = set()
        deadline = time.monotonic() + 20
        while "inner/deep.txt" not in names and time.monotonic() < deadline:
            names |= {e.name for e in watcher.get_new_events()}
            time.sleep(0.2)
        assert "inner/deep.txt" in names
    finally:
        watcher.stop()


def test_files_of_unknown_size_read_to_eof(sbx: Sandbox) -> None:
    """procfs and sysfs files say 0 bytes or a page whatever they hold; cat reads them."""
    for path in (
        "/proc/version",
        "/proc/sys/kernel/random/boot_id",
        "/sys/devices/system/cpu/online",
    ):
        expected = sbx.commands.run(f"cat {path}").stdout
        assert expected.strip()
        assert sbx.files.read(path) == expected


def test_uploads_give_e2b_envds_watch_events(sbx: Sandbox) -> None:
    """E2B's envd creates an upload's target, chowns it to the user, then writes."""
    sbx.files.make_dir("/home/user/uwatch")
    sbx.files.write("/home/user/uwatch/old.txt", "old")
    watcher = sbx.files.watch_dir("/home/user/uwatch")
    try:
        sbx.files.write("/home/user/uwatch/new.txt", "new")
        sbx.files.write("/home/user/uwatch/old.txt", "replaced")
        seen: list[tuple[str, FilesystemEventType]] = []
        deadline = time.monotonic() + 20
        while ("old.txt", FilesystemEventType.WRITE) not in seen and time.monotonic() < deadline:
            seen += [(e.name, e.type) for e in watcher.get_new_events()]
            time.sleep(0.2)
        assert seen == [
            ("new.txt", FilesystemEventType.CREATE),
            ("new.txt", FilesystemEventType.CHMOD),
            ("new.txt", FilesystemEventType.WRITE),
            ("old.txt", FilesystemEventType.CHMOD),
            ("old.txt", FilesystemEventType.WRITE),
        ]
    finally:
        watcher.stop()


def test_watch_missing_dir(sbx: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir("/home/user/no-such-dir")


# -- async API ----------------------------------------------------------------------------
async def test_async_files(e2b: E2B, sbx: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(sbx.sandbox_id)
    await asbx.files.write("/home/user/async/a.txt", "async text")
    assert await asbx.files.read("/home/user/async/a.txt") == "async text"
    blob = os.urandom(1024 * 1024)
    await asbx.files.write("/home/user/async/b.bin", blob)
    assert bytes(await asbx.files.read("/home/user/async/b.bin", format="bytes")) == blob
    written = await asbx.files.write_files(
        [WriteEntry(path="/home/user/async/c.txt", data="c"), WriteEntry(path="async/d", data="d")]
    )
    assert sorted(w.path for w in written) == ["/home/user/async/c.txt", "/home/user/async/d"]
    names = {e.name for e in await asbx.files.list("/home/user/async")}
    assert names == {"a.txt", "b.bin", "c.txt", "d"}
    assert await asbx.files.exists("/home/user/async/c.txt")
    assert (await asbx.files.get_info("/home/user/async/b.bin")).size == len(blob)
    assert await asbx.files.make_dir("/home/user/async/dir") is True
    assert await asbx.files.make_dir("/home/user/async/dir") is False
    moved = await asbx.files.rename("/home/user/async/d", "/home/user/async/dir/d")
    assert moved.path == "/home/user/async/dir/d"
    with pytest.raises(FileNotFoundException):
        await asbx.files.read("/home/user/async/d")
    await asbx.files.remove("/home/user/async")
    assert not await asbx.files.exists("/home/user/async")


async def test_async_watch_dir(e2b: E2B, sbx: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(sbx.sandbox_id)
    await asbx.files.make_dir("/home/user/awatch")
    events: list[FilesystemEvent] = []
    handle = await asbx.files.watch_dir("/home/user/awatch", events.append, include_entry=True)
    try:
        await asbx.files.write("/home/user/awatch/f.txt", "x")
        await asbx.files.remove("/home/user/awatch/f.txt")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(e.type == FilesystemEventType.REMOVE for e in events):
                break
            await asyncio.sleep(0.1)
        kinds = {(e.name, e.type) for e in events}
        assert ("f.txt", FilesystemEventType.CREATE) in kinds
        assert ("f.txt", FilesystemEventType.REMOVE) in kinds
        created = next(e for e in events if e.type == FilesystemEventType.CREATE)
        assert created.entry is not None
        assert created.entry.path == "/home/user/awatch/f.txt"
    finally:
        await handle.stop()  # type: ignore[no-untyped-call]
