"""Copy-on-write disk images: a per-sandbox qcow2 overlay on a read-only backing image."""

from __future__ import annotations

import asyncio
import json
import os
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
