"""Disk layer operations on real images (qemu-img, qemu-io; no VMs): the raw view of a
qcow2 chain that Firecracker reads, and re-pointing a layer moved to another place."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agentenv.storage.images import (
    backing_file,
    create_overlay,
    raw_view,
    rebase_unsafe,
    writable_disk,
)

MIB = 1024 * 1024


def write(image: Path, fmt: str, offset: int, pattern: int, length: int = MIB) -> None:
    subprocess.run(
        ["qemu-io", "-f", fmt, "-c", f"write -P {pattern} {offset} {length}", str(image)],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, Path]:
    """base.raw (32 MiB, one written MiB) <- mid.qcow2 <- top.qcow2, each writing its own
    range, one overwriting the base's."""
    base = tmp_path / "base.raw"
    with open(base, "wb") as f:
        f.truncate(32 * MIB)
    write(base, "raw", 0, 0x11)
    write(base, "raw", 8 * MIB, 0x12)
    return base, tmp_path


async def test_raw_view_has_the_chains_contents_and_stays_sparse(chain: tuple[Path, Path]) -> None:
    base, tmp = chain
    mid = await create_overlay(base, tmp / "mid.qcow2", "raw")
    write(mid, "qcow2", 8 * MIB, 0x21)  # shadows the base's second range
    top = await create_overlay(mid, tmp / "top.qcow2", "qcow2")
    write(top, "qcow2", 16 * MIB, 0x31)

    view = await raw_view(top, tmp / "view.raw")
    data = view.read_bytes()
    assert len(data) == 32 * MIB
    assert data[:MIB] == b"\x11" * MIB
    assert data[8 * MIB : 9 * MIB] == b"\x21" * MIB
    assert data[16 * MIB : 17 * MIB] == b"\x31" * MIB
    assert data[24 * MIB :] == bytes(8 * MIB)
    # Unwritten ranges are holes, not zeros on disk.
    assert view.stat().st_blocks * 512 < 8 * MIB
    assert not (tmp / "view.raw.tmp").exists()


async def test_writable_disk_for_a_raw_only_vmm_over_a_qcow2_snapshot(
    chain: tuple[Path, Path],
) -> None:
    base, tmp = chain
    layer = await create_overlay(base, tmp / "layer.qcow2", "raw")
    write(layer, "qcow2", 4 * MIB, 0x41)
    disk, fmt = await writable_disk(layer, "qcow2", tmp / "sandbox-disk", ("raw",))
    assert fmt == "raw" and disk.suffix == ".raw"
    data = disk.read_bytes()
    assert data[4 * MIB : 5 * MIB] == b"\x41" * MIB
    assert data[:MIB] == b"\x11" * MIB
    # With qcow2 support it is an overlay instead, backed by the layer.
    overlay, fmt = await writable_disk(layer, "qcow2", tmp / "qemu-disk", ("raw", "qcow2"))
    assert fmt == "qcow2" and backing_file(overlay) == layer.resolve()


async def test_rebase_unsafe_repoints_a_moved_layer_without_copying(
    chain: tuple[Path, Path],
) -> None:
    base, tmp = chain
    layer = await create_overlay(base, tmp / "layer.qcow2", "raw")
    write(layer, "qcow2", 2 * MIB, 0x51)
    moved_base = tmp / "elsewhere" / "base.raw"
    moved_base.parent.mkdir()
    base.rename(moved_base)
    await rebase_unsafe(layer, moved_base, "raw")
    assert backing_file(layer) == moved_base.resolve()
    view = (await raw_view(layer, tmp / "check.raw")).read_bytes()
    assert view[:MIB] == b"\x11" * MIB
    assert view[2 * MIB : 3 * MIB] == b"\x51" * MIB
