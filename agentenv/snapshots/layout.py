"""On-disk layout of a machine snapshot directory.

A snapshot directory holds the VMM's state file, the RAM image, the root disk as it was
at snapshot time and ``snapshot.json`` describing how to start a machine from them. It is
written under a staging name and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.vmm.base import SnapshotFiles

MANIFEST = "snapshot.json"


class SnapshotError(Exception):
    """A snapshot directory is missing, incomplete or unreadable."""


@dataclass(frozen=True)
class MachineSnapshot:
    """A restorable machine: VMM state plus the boot inputs the VMM needs again."""

    directory: Path
    files: SnapshotFiles
    disk: Path
    disk_format: str
    kernel: Path
    initrd: Path | None
    tools_drive: Path
    cmdline: str
    vcpus: int
    memory_mib: int
    disk_size_mib: int
    image_digest: str
    envd_version: str
    # qcow2 images in the disk's chain above the guest image's raw root filesystem.
    disk_chain_depth: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": json.loads(self.files.to_json()),
            # Relative when the disk is in the directory (which may be renamed into place).
            "disk": self.disk.name if self.disk.parent == self.directory else str(self.disk),
            "disk_format": self.disk_format,
            "kernel": str(self.kernel),
            "initrd": str(self.initrd) if self.initrd else None,
            "tools_drive": str(self.tools_drive),
            "cmdline": self.cmdline,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "disk_size_mib": self.disk_size_mib,
            "image_digest": self.image_digest,
            "envd_version": self.envd_version,
            "disk_chain_depth": self.disk_chain_depth,
        }

    @classmethod
    def load(cls, directory: Path) -> MachineSnapshot:
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text())
            files = SnapshotFiles.from_json(json.dumps(data["files"]))
            snap = cls(
                directory=directory,
                files=files,
                disk=directory / data["disk"],
                disk_format=data["disk_format"],
                kernel=Path(data["kernel"]),
                initrd=Path(data["initrd"]) if data.get("initrd") else None,
                tools_drive=Path(data["tools_drive"]),
                cmdline=data["cmdline"],
                vcpus=int(data["vcpus"]),
                memory_mib=int(data["memory_mib"]),
                disk_size_mib=int(data["disk_size_mib"]),
                image_digest=data["image_digest"],
                envd_version=data["envd_version"],
                disk_chain_depth=int(data.get("disk_chain_depth", 1)),
            )
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise SnapshotError(f"snapshot at {directory} is unreadable: {exc}") from exc
        missing = [p for p in snap.required_files() if not p.exists()]
        if missing:
            raise SnapshotError(
                f"snapshot at {directory} is missing {', '.join(map(str, missing))}"
            )
        return snap

    def required_files(self) -> list[Path]:
        paths = [self.files.state_file, self.disk, self.kernel, self.tools_drive]
        if self.files.memory_file is not None:
            paths.append(self.files.memory_file)
        if self.initrd is not None:
            paths.append(self.initrd)
        return paths


def staging_dir(final: Path) -> Path:
    """A fresh sibling directory to build ``final`` in."""
    path = final.parent / f".staging-{final.name}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def commit(staging: Path, final: Path, snapshot: MachineSnapshot) -> MachineSnapshot:
    """Write the manifest into ``staging`` and atomically move it to ``final``.

    Paths inside the manifest that point into the staging directory are rewritten to the
    final location."""
    data = snapshot.to_dict()
    files = data["files"]
    for key in ("state_file", "memory_file"):
        if files.get(key):
            p = Path(files[key])
            if p.parent == staging:
                files[key] = str(final / p.name)
    tmp = staging / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, staging / MANIFEST)
    if final.exists():
        raise SnapshotError(f"{final} already exists")
    os.replace(staging, final)
    return MachineSnapshot.load(final)


def write_manifest(snapshot: MachineSnapshot) -> MachineSnapshot:
    """Write ``snapshot.json`` into the snapshot's own directory, atomically and durably:
    for snapshots built in place, the manifest is the commit point (a directory without
    one is an unfinished snapshot)."""
    directory = snapshot.directory
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(snapshot.to_dict(), indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return MachineSnapshot.load(directory)


def discard(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
