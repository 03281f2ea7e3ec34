"""Volumes through the official SDK (``Volume`` / ``AsyncVolume``, the content API at
``E2B_VOLUME_API_URL``, ``Sandbox.create(volume_mounts=...)``), sync and async: a
volume's files persist from one sandbox to the next and through pause and resume, the
content API reaches them through the running sandbox that mounts the volume, and the
one-writer rule answers 409."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import pytest
from e2b import (
    E2B,
    NotFoundException,
    Sandbox,
    Volume,
)
from e2b.exceptions import SandboxException, VolumeException

from tests.e2b.support import sdk_opts
from tests.helpers import ServerProcess

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module", autouse=True)
def volume_api_url(e2b_server: ServerProcess) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("E2B_VOLUME_API_URL", e2b_server.url)
        yield


def _name(what: str) -> str:
    return f"{what}-{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def volume(e2b: E2B) -> Iterator[Volume]:
    vol = e2b.Volume.create(_name("shared"))
    yield vol
    e2b.Volume.destroy(vol.volume_id)


def test_create_list_connect_destroy(e2b: E2B) -> None:
    vol = e2b.Volume.create(_name("life"))
    assert vol.volume_id and vol.token
    assert any(v.volume_id == vol.volume_id for v in e2b.Volume.list())
    same = e2b.Volume.connect(vol.volume_id)
    assert (same.name, same.token) == (vol.name, vol.token)
    with pytest.raises(VolumeException):
        e2b.Volume.create(vol.name)  # names are unique
    assert e2b.Volume.destroy(vol.volume_id) is True
    assert e2b.Volume.destroy(vol.volume_id) is False  # 404
    assert all(v.volume_id != vol.volume_id for v in e2b.Volume.list())
    with pytest.raises(NotFoundException):
        e2b.Volume.connect(vol.volume_id)


def test_content_api(volume: Volume) -> None:
    written = volume.write_file("/notes/a.txt", "hello volume", force=True)
    assert (written.path, written.size, written.type.value) == ("/notes/a.txt", 12, "file")
    assert volume.read_file("/notes/a.txt") == "hello volume"
    assert b"".join(volume.read_file("/notes/a.txt", format="stream")) == b"hello volume"
    blob = secrets.token_bytes(3 << 20)
    volume.write_file("/notes/blob.bin", blob)
    assert volume.read_file("/notes/blob.bin", format="bytes") == blob
    made = volume.make_dir("/deep/er/dir", force=True)
    assert made.type.value == "directory"
    names = {e.name for e in volume.list("/notes")}
    assert names == {"a.txt", "blob.bin"}
    assert volume.exists("/notes/a.txt") and not volume.exists("/nope")
    info = volume.update_metadata("/notes/a.txt", mode=0o600)
    assert info.mode == 0o600
    volume.remove("/notes/blob.bin")
    assert not volume.exists("/notes/blob.bin")
    with pytest.raises(NotFoundException):
        volume.read_file("/notes/blob.bin")
    with pytest.raises(NotFoundException):
        volume.write_file("/missing/parent.txt", "x")  # no force: the parent must exist
    with pytest.raises(VolumeException):
        volume.read_file("/../../etc/passwd")


def test_mount_persists_across_sandboxes_and_pause(
    e2b: E2B, e2b_server: ServerProcess, volume: Volume
) -> None:
    volume.write_file("/from-api.txt", "written by the content API")
    first = e2b.Sandbox.create(timeout=300, volume_mounts={"/data": volume})
    try:
        assert first.files.read("/data/from-api.txt") == "written by the content API"
        assert first.get_info().volume_mounts == [{"name": volume.name, "path": "/data"}]
        first.commands.run("echo from-first > /data/first.txt && sync")
        # One writer: a second sandbox, a destroy and the content API are refused.
        with pytest.raises(SandboxException, match="in use"):
            e2b.Sandbox.create(timeout=60, volume_mounts={"/data": volume.name})
        with pytest.raises(VolumeException):
            e2b.Volume.destroy(volume.volume_id)
        # The content API works while the sandbox runs, through its guest: both see
        # the same files at once.
        assert volume.read_file("/first.txt") == "from-first\n"
        made = volume.write_file("/while-mounted/w.txt", "from the API", force=True)
        assert (made.size, made.uid) == (12, 1000)
        assert first.commands.run("cat /data/while-mounted/w.txt").stdout == "from the API"
        blob = secrets.token_bytes(1 << 20)
        volume.write_file("/while-mounted/blob.bin", blob)
        assert volume.read_file("/while-mounted/blob.bin", format="bytes") == blob
        assert b"".join(volume.read_file("/first.txt", format="stream")) == b"from-first\n"
        assert {e.name for e in volume.list("/while-mounted")} == {"w.txt", "blob.bin"}
        assert volume.make_dir("/while-mounted/sub").type.value == "directory"
        assert volume.update_metadata("/while-mounted/w.txt", mode=0o600).mode == 0o600
        volume.remove("/while-mounted")
        assert not volume.exists("/while-mounted") and volume.exists("/first.txt")
        gone = first.commands.run("test -e /data/while-mounted || echo gone")
        assert gone.stdout == "gone\n"
        with pytest.raises(NotFoundException):
            volume.read_file("/nope.txt")
        # Paths stay inside the volume, even through links the guest made.
        first.commands.run("ln -s /etc /data/escape")
        with pytest.raises(VolumeException, match="outside"):
            volume.read_file("/escape/passwd")
        volume.remove("/escape")
        first.pause()
        with pytest.raises(VolumeException):
            e2b.Volume.destroy(volume.volume_id)  # a paused sandbox still holds it
        with pytest.raises(VolumeException, match="paused"):
            volume.read_file("/first.txt")  # its guest is not running: 409
        resumed = Sandbox.connect(first.sandbox_id, **sdk_opts(e2b_server))
        assert resumed.commands.run("cat /data/first.txt").stdout == "from-first\n"
        resumed.commands.run("echo after-resume >> /data/first.txt")
        assert volume.read_file("/first.txt") == "from-first\nafter-resume\n"
        # A guest that unmounted the volume has no files of it to give: 409.
        resumed.commands.run("umount /data", user="root")
        with pytest.raises(VolumeException, match="no longer has it mounted"):
            volume.read_file("/first.txt")
    finally:
        first.kill()
    assert volume.read_file("/first.txt") == "from-first\nafter-resume\n"
    second = e2b.Sandbox.create(timeout=120, volume_mounts={"/mnt/vol": volume.name})
    try:
        assert second.commands.run("cat /mnt/vol/first.txt").stdout == "from-first\nafter-resume\n"
        assert second.commands.run("stat -c %U /mnt/vol").stdout == "user\n"
    finally:
        second.kill()


def test_snapshot_leaves_the_volume_out(e2b: E2B) -> None:
    """The source keeps its volume through a snapshot; the snapshot holds no volume
    (as in E2B), and a sandbox started from it mounts one of its own."""
    mine, other = e2b.Volume.create(_name("snap")), e2b.Volume.create(_name("other"))
    other.write_file("/who", "other")
    source = e2b.Sandbox.create(timeout=300, volume_mounts={"/data": mine})
    child = None
    try:
        source.commands.run("echo kept > /data/kept")
        busy = source.commands.run("sleep 600", cwd="/data", background=True)
        with pytest.raises(SandboxException, match="in use"):
            source.create_snapshot()  # the guest uses the volume: nothing is captured
        busy.kill()
        snap = source.create_snapshot()
        assert source.commands.run("cat /data/kept").stdout == "kept\n"
        child = e2b.Sandbox.create(snap.snapshot_id, timeout=120, volume_mounts={"/data": other})
        assert child.commands.run("cat /data/who; ls /data").stdout == "otherlost+found\nwho\n"
        e2b.Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        source.kill()
        if child is not None:
            child.kill()
        e2b.Volume.destroy(mine.volume_id)
        e2b.Volume.destroy(other.volume_id)


def test_unknown_volume_at_create_is_not_found(e2b: E2B) -> None:
    with pytest.raises(SandboxException, match="not found"):
        e2b.Sandbox.create(timeout=60, volume_mounts={"/data": _name("absent")})


def test_async_volume_and_mount(e2b: E2B) -> None:
    async def main() -> None:
        vol = await e2b.AsyncVolume.create(_name("async"))
        try:
            await vol.write_file("/x.txt", "async")
            assert await vol.read_file("/x.txt") == "async"
            assert any(v.volume_id == vol.volume_id for v in await e2b.AsyncVolume.list())
            sbx = await e2b.AsyncSandbox.create(timeout=120, volume_mounts={"/data": vol})
            try:
                out = await sbx.commands.run("cat /data/x.txt && echo more > /data/y.txt")
                assert out.stdout == "async"
                with pytest.raises(VolumeException):
                    await e2b.AsyncVolume.destroy(vol.volume_id)
                # The content API, through the running sandbox.
                assert await vol.read_file("/y.txt") == "more\n"
                await vol.write_file("/z.txt", "from the API")
                assert (await sbx.files.read("/data/z.txt")) == "from the API"
                assert {e.name for e in await vol.list("/")} >= {"x.txt", "y.txt", "z.txt"}
            finally:
                await sbx.kill()
            assert await vol.read_file("/y.txt") == "more\n"
        finally:
            assert await e2b.AsyncVolume.destroy(vol.volume_id)

    asyncio.run(main())
