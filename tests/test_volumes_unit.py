"""Volumes without VMs: records in the repository, names, the one-holder rule
(:class:`~agentenv.orchestrator.volumes.Volumes` on a fake node), and the content API's
file operations and path confinement (:class:`~agentenv.storage.volumes.MountedVolume`
on a plain directory). Mounting into guests is tested through the SDK in
``tests/e2b/test_sdk_volumes.py``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agentenv.orchestrator.errors import Conflict, InvalidRequest, VolumeNotFound
from agentenv.orchestrator.volumes import Requested
from agentenv.storage.volumes import VOLUME_BYTES, MountedVolume, VolumePathError
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
