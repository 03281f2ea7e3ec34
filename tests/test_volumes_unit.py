"""Volumes without VMs: records in the repository, names, the one-holder rule
(:class:`~agentenv.orchestrator.volumes.Volumes` on a fake node), and the content API's
file operations and path confinement (:class:`~agentenv.storage.volumes.MountedVolume`
on a plain directory). Mounting into guests is tested through the SDK in
``tests/e2b/test_sdk_volumes.py``."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.orchestrator.errors import Conflict, InvalidRequest, VolumeNotFound
from agentenv.orchestrator.records import VolumeEntry
from agentenv.orchestrator.volumes import Requested, Volumes
from agentenv.storage.volumes import (
    VOLUME_BYTES,
    MountedVolume,
    VolumePathError,
    make_image,
    mounted,
)
from tests.fakes import start_node


def test_volume_records_names_and_holders(tmp_path: Path) -> None:
    async def main() -> None:
        node = await start_node(tmp_path / "a", tmp_path / "repo", template=False)
        volumes = node.orchestrator.volumes
        try:
            vol = await volumes.create("data")
            image = volumes.image(vol.id)
            assert image.stat().st_size == VOLUME_BYTES
            assert image.stat().st_blocks * 512 < 64 << 20  # sparse
            assert [v.id for v in await volumes.list()] == [vol.id]
            assert (await volumes.get(vol.id)).token == vol.token
            with pytest.raises(Conflict):
                await volumes.create("data")
            with pytest.raises(InvalidRequest):
                await volumes.create("../etc")
            with pytest.raises(VolumeNotFound):
                await volumes.get("vol-absent")

            with pytest.raises(VolumeNotFound):
                await volumes.hold("s1", [Requested("absent", "/data")], slots=3)
            with pytest.raises(InvalidRequest, match="rebuild"):
                await volumes.hold("s1", [Requested("data", "/data")], slots=0)
            with pytest.raises(InvalidRequest):
                await volumes.hold("s1", [Requested("data", "relative")], slots=3)
            mounts = await volumes.hold("s1", [Requested("data", "/data/")], slots=3)
            assert [(m.volume_id, m.path, m.slot) for m in mounts] == [(vol.id, "/data", 0)]
            with pytest.raises(Conflict, match="s1"):
                await volumes.hold("s2", [Requested("data", "/data")], slots=3)
            with pytest.raises(Conflict):
                await volumes.destroy(vol.id)
            with pytest.raises(Conflict):
                async with volumes.files(vol.id, vol.token):
                    pass
            volumes.release("s1")

            with pytest.raises(VolumeNotFound):  # a wrong token finds nothing
                async with volumes.files(vol.id, "wrong"):
                    pass
            await volumes.destroy(vol.id)
            assert not image.exists()
            assert await volumes.list() == []
            with pytest.raises(VolumeNotFound):
                await volumes.destroy(vol.id)
            # The name is free again.
            again = await volumes.create("data")
            assert again.id != vol.id
        finally:
            await node.orchestrator.shutdown()

    asyncio.run(main())


def test_file_operations_stay_inside_the_volume(tmp_path: Path) -> None:
    root = tmp_path / "vol"
    root.mkdir()
    (tmp_path / "secret").write_text("host file")
    vol = MountedVolume(root)

    made = vol.make_dir("/a/b", None, None, 0o700, force=True)
    assert (made.type, made.path, made.mode) == ("directory", "/a/b", 0o700)
    with pytest.raises(VolumePathError) as missing:
        vol.make_dir("/x/y", None, None, None, force=False)
    assert missing.value.missing
    clean, local = vol.open_for_write("a/./b/f.txt", force=False)
    partial = local.with_name(".partial")
    partial.write_text("content")
    entry = vol.finish_write(clean, local, partial, None, None, 0o640)
    assert (entry.path, entry.size, entry.mode, entry.type) == ("/a/b/f.txt", 7, 0o640, "file")
    assert [e.path for e in vol.listing("/", 1)] == ["/a"]
    assert [e.path for e in vol.listing("/", 3)] == ["/a", "/a/b", "/a/b/f.txt"]
    assert vol.read_path("/a/b/f.txt").read_text() == "content"

    with pytest.raises(VolumePathError):
        vol.entry("/../secret")
    os.symlink(tmp_path / "secret", root / "escape")
    os.symlink("/", root / "to-root")
    assert vol.entry("/escape").type == "symlink"  # the link itself may be described
    for path in ("/escape", "/to-root/etc/passwd"):
        with pytest.raises(VolumePathError, match="outside"):
            vol.read_path(path)
    with pytest.raises(VolumePathError, match="outside"):
        vol.open_for_write("/to-root/tmp/x", force=True)
    vol.remove("/escape")  # removes the link, not what it points at
    assert (tmp_path / "secret").read_text() == "host file"
    with pytest.raises(VolumePathError):
        vol.remove("/")
    vol.remove("/a")
    assert not (root / "a").exists()
    with pytest.raises(VolumePathError) as gone:
        vol.remove("/a")
    assert gone.value.missing


def _tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


async def test_the_host_reads_images_in_userspace(tmp_path: Path) -> None:
    """The content API's mount is fuse2fs (a guest-written image never reaches the host
    kernel's ext4), and what it wrote is in the image once the mount is given back; an
    image whose journal needs recovery (a guest killed mid-write) is replayed first
    (fuse2fs itself crashed on one)."""
    image = tmp_path / "volume.img"
    await make_image(image)
    marked = await asyncio.to_thread(
        _tool, "debugfs", "-w", "-R", "feature needs_recovery", str(image)
    )
    assert marked.returncode == 0, marked.stderr
    async with mounted(image) as files:
        mounts = Path("/proc/mounts").read_text().splitlines()
        fstype = {line.split()[1]: line.split()[2] for line in mounts}[str(files.root)]
        assert fstype == "fuse.ext4"
        (files.root / "answer.txt").write_text("42\n")
    assert not files.root.exists()  # unmounted, and its directory gone
    shown = await asyncio.to_thread(_tool, "debugfs", "-R", "cat /answer.txt", str(image))
    assert shown.stdout == "42\n"
    check = await asyncio.to_thread(_tool, "e2fsck", "-fn", str(image))
    assert check.returncode == 0, check.stdout


def test_a_volume_moves_between_nodes_through_the_repository(tmp_path: Path) -> None:
    """Two nodes sharing a repository: a volume made on one is written on the other
    (its image published when let go, fetched by the next writer), and while one node
    holds it the other answers 409 naming that node."""

    async def write(volumes: Volumes, vol: VolumeEntry, path: str, text: str) -> None:
        async def body() -> AsyncIterator[bytes]:
            yield text.encode()

        async with volumes.files(vol.id, vol.token) as files:
            await files.write(path, body(), None, None, None, force=True)

    async def read(volumes: Volumes, vol: VolumeEntry, path: str) -> str:
        async with volumes.files(vol.id, vol.token) as files:
            _, chunks = await files.read(path)
            return b"".join([c async for c in chunks]).decode()

    async def main() -> None:
        a = await start_node(tmp_path / "a", tmp_path / "repo", template=False)
        b = await start_node(tmp_path / "b", tmp_path / "repo", node_id="node-b", template=False)
        va, vb = a.orchestrator.volumes, b.orchestrator.volumes
        try:
            vol = await va.create("shared")
            await write(va, vol, "/from-a.txt", "written on a")
            # b fetches the image a published, writes, and publishes its own.
            assert await read(vb, vol, "/from-a.txt") == "written on a"
            await write(vb, vol, "/from-b.txt", "written on b")
            assert await read(va, vol, "/from-b.txt") == "written on b"

            # A sandbox on b holds it: a's mounts, content API and destroy are 409.
            await vb.hold("sb", [Requested("shared", "/data")], slots=3)
            for refused in (
                va.hold("sa", [Requested("shared", "/data")], slots=3),
                read(va, vol, "/from-a.txt"),
                va.destroy(vol.id),
            ):
                with pytest.raises(Conflict, match="writer on node node-b"):
                    await refused
            vb.release("sb")
            await vb.drain()
            record = await va.get(vol.id)
            assert record.node == "" and "image" in record.blobs  # published again
            mounts = await va.hold("sa", [Requested("shared", "/data")], slots=3)
            assert [m.volume_id for m in mounts] == [vol.id]
            va.release("sa")
            await va.drain()
            await vb.destroy(vol.id)
            with pytest.raises(VolumeNotFound):
                await va.get(vol.id)
        finally:
            await b.orchestrator.shutdown()
            await a.orchestrator.shutdown()

    asyncio.run(main())
