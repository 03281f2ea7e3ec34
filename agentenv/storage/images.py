"""Copy-on-write disk images: a per-sandbox qcow2 overlay on a read-only backing image."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path
from typing import Literal

DiskFormat = Literal["raw", "qcow2"]


class StorageError(Exception):
    """An image could not be created, inspected or removed."""


async def _qemu_img(*args: str) -> bytes:
    try:
        proc = await asyncio.create_subprocess_exec(
            "qemu-img",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as exc:
        raise StorageError("qemu-img is not installed (Debian package qemu-utils)") from exc
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise StorageError(f"qemu-img {args[0]} failed: {err.decode(errors='replace').strip()}")
    return out


async def create_overlay(backing: Path, path: Path, backing_format: DiskFormat) -> Path:
    """Create ``path`` as a qcow2 overlay whose reads fall through to ``backing``; the
    backing file is never written. Nothing is left at ``path`` on failure."""
    if not backing.exists():
        raise StorageError(f"backing image {backing} does not exist")
    tmp = path.with_name(path.name + ".tmp")
    try:
        await _qemu_img(
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(backing.resolve()),
            "-F",
            backing_format,
            str(tmp),
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


async def virtual_size(path: Path) -> int:
    """Size in bytes the guest sees for the image at ``path``."""
    info = json.loads(await _qemu_img("info", "--output=json", "-U", str(path)))
    return int(info["virtual-size"])


def make_read_only(*paths: Path) -> None:
    """Drop write permission so a shared base cannot be changed by accident."""
    for p in paths:
        p.chmod(p.stat().st_mode & ~0o222)


async def clone_raw(source: Path, path: Path) -> Path:
    """Copy a raw image for a VMM that cannot read qcow2: a reflink on XFS/btrfs (instant,
    copy-on-write), else a sparse copy. Nothing is left at ``path`` on failure."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        proc = await asyncio.create_subprocess_exec(
            "cp", "--reflink=auto", "--sparse=always", str(source), str(tmp),
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise StorageError(f"copying {source} failed: {err.decode(errors='replace').strip()}")
        tmp.chmod(0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


async def writable_disk(
    backing: Path, backing_format: DiskFormat, path_stem: Path, formats: tuple[str, ...]
) -> tuple[Path, DiskFormat]:
    """A per-machine writable disk over ``backing``: a qcow2 overlay where the VMM reads
    qcow2, else a raw clone. Returns the path and its format."""
    if "qcow2" in formats:
        return await create_overlay(
            backing, path_stem.with_suffix(".qcow2"), backing_format
        ), "qcow2"
    path = path_stem.with_suffix(".raw")
    if backing_format != "raw":
        # A VMM without qcow2 (Firecracker) gets the chain's contents as one raw file.
        return await raw_view(backing, path), "raw"
    return await clone_raw(backing, path), "raw"


_QCOW2_MAGIC = b"QFI\xfb"


def backing_file(path: Path) -> Path | None:
    """The backing file named in a qcow2 image's header (None for raw images and
    overlays without one). Read directly: it is needed for every image when collecting
    unused layers, and ``qemu-img info`` would cost a process each."""
    with open(path, "rb") as f:
        header = f.read(20)
        if len(header) < 20 or header[:4] != _QCOW2_MAGIC:
            return None
        offset, size = struct.unpack(">QI", header[8:20])
        if offset == 0 or size == 0:
            return None
        f.seek(offset)
        name = f.read(size).decode()
    backing = Path(name)
    return backing if backing.is_absolute() else path.parent / backing


def backing_chain(path: Path) -> list[Path]:
    """``path`` and every image below it, top first. Missing images end the chain."""
    chain: list[Path] = []
    current: Path | None = path
    while current is not None and current not in chain and current.exists():
        chain.append(current)
        current = backing_file(current)
    return chain


async def flatten(layer: Path, onto: Path, onto_format: DiskFormat) -> Path:
    """A copy of qcow2 ``layer`` whose chain is ``onto`` and nothing between: every
    cluster where ``layer``'s chain differs from ``onto`` is copied in (a reflink of the
    layer, then ``qemu-img rebase``). Returns the copy, next to ``layer``; the layer
    itself is not touched. Costs in proportion to what the skipped layers hold."""
    flat = layer.with_name(f".{layer.stem}.flat{layer.suffix}")
    try:
        proc = await asyncio.create_subprocess_exec(
            "cp", "--reflink=auto", str(layer), str(flat), stderr=asyncio.subprocess.PIPE
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise StorageError(f"copying {layer} failed: {err.decode(errors='replace').strip()}")
        flat.chmod(0o644)
        await _qemu_img(
            "rebase", "-q", "-f", "qcow2", "-b", str(onto), "-F", onto_format, str(flat)
        )
    except BaseException:
        flat.unlink(missing_ok=True)
        raise
    return flat


async def rebase_unsafe(image: Path, backing: Path, backing_format: str) -> None:
    """Point qcow2 ``image`` at ``backing`` without touching its data (a header write):
    for a layer moved to another host or directory whose backing file has the same
    contents under a new path."""
    await _qemu_img(
        "rebase", "-q", "-u", "-f", "qcow2", "-b", str(backing.resolve()), "-F", backing_format,
        str(image),
    )  # fmt: skip


async def raw_view(image: Path, dest: Path) -> Path:
    """A raw file with the contents the guest sees through qcow2 ``image`` and its
    chain, for VMMs that read raw images only (Firecracker). Sparse: unallocated ranges
    stay holes. Nothing is left at ``dest`` on failure."""
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        await _qemu_img(
            "convert", "-q", "-f", "qcow2", "-O", "raw", "-S", "4k", str(image), str(tmp)
        )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
