"""The files a sandbox's and a snapshot's directories hold, and the marker files among
them: the one module that knows their names and what each one means.

The store's record says what a sandbox *is* (its state); markers say how far work on
its files got, written atomically after the work they mark, so a crash leaves either
the work complete and marked, or unmarked (and redone or discarded at the next start):

``<sandbox>/generation``
    How many times the sandbox was committed paused to the repository (absent: never).
``<sandbox>/paused/snapshot.json``
    The saved machine of a paused sandbox (device state, RAM file): a complete save.
``<sandbox>/paused/disk-only``
    A filesystem-only pause: the disk is kept, RAM and processes are not.
``<sandbox>/paused/upload.json``
    The paused sandbox's upload to the repository: ``uploading`` or ``committed``, and
    the generation it is.
``<sandbox>/paused/frozen/complete``
    The reflinked copy of disk and RAM that an upload reads is complete.
``<snapshot>/committed``
    The snapshot's commit to the repository is complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentenv.storage.images import DiskFormat

VM_DIR = "vm"
MEMORY_FILE = "memory.raw"
PAUSED_DIR = "paused"
PAUSED_MANIFEST = "snapshot.json"
DISK_ONLY_MARKER = "disk-only"
UPLOAD_MARKER = "upload.json"
FROZEN_DIR = "frozen"
FROZEN_COMPLETE = "complete"
GENERATION_FILE = "generation"
COMMITTED_MARKER = "committed"
SNAPSHOT_DISK = "disk.qcow2"
# A snapshot's disk copied whole from a running raw disk (see DiskCapture.COPY).
SNAPSHOT_RAW_DISK = "disk.raw"


_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    return "i" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(19))


def new_snapshot_id() -> str:
    return "snap-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(16))


def write_atomically(path: Path, text: str) -> None:
    """``text`` at ``path``, complete or not at all, and on stable storage."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class UploadState:
    """Where a paused sandbox's upload to the repository stands."""

    state: Literal["uploading", "committed"]
    generation: int

    @property
    def committed(self) -> bool:
        return self.state == "committed"


@dataclass(frozen=True)
class SandboxDir:
    """A sandbox's directory under the node's ``sandboxes/``."""

    path: Path

    @property
    def vm_dir(self) -> Path:
        """The VMM's own files (sockets, pid, console log)."""
        return self.path / VM_DIR

    @property
    def memory_file(self) -> Path:
        """The sandbox's RAM when it is a file of its own (mapped shared)."""
        return self.path / MEMORY_FILE

    @property
    def paused(self) -> Path:
        return self.path / PAUSED_DIR

    @property
    def paused_manifest(self) -> Path:
        return self.paused / PAUSED_MANIFEST

    @property
    def frozen(self) -> Path:
        return self.paused / FROZEN_DIR

    @property
    def frozen_disk(self) -> Path:
        """The copy of the paused sandbox's disk top that its upload reads."""
        return self.frozen / SNAPSHOT_DISK

    @property
    def frozen_memory(self) -> Path:
        """The copy of the paused sandbox's RAM file that its upload reads."""
        return self.frozen / MEMORY_FILE

    def saved(self) -> bool:
        """A pause's save is complete: full (a machine manifest) or filesystem-only."""
        return self.paused_manifest.exists() or (self.paused / DISK_ONLY_MARKER).exists()

    def mark_disk_only(self) -> None:
        """Start over the saved state as a filesystem-only pause."""
        self.clear_paused()
        self.paused.mkdir()
        write_atomically(self.paused / DISK_ONLY_MARKER, "")

    def clear_paused(self) -> None:
        shutil.rmtree(self.paused, ignore_errors=True)

    def generation(self) -> int:
        """How many times this sandbox was committed paused (0: never)."""
        try:
            return int((self.path / GENERATION_FILE).read_text())
        except (OSError, ValueError):
            return 0

    def set_generation(self, generation: int) -> None:
        write_atomically(self.path / GENERATION_FILE, str(generation))

    def upload_state(self) -> UploadState | None:
        try:
            raw = json.loads((self.paused / UPLOAD_MARKER).read_text())
            state = raw["state"]
            if state not in ("uploading", "committed"):
                return None
            return UploadState(state, int(raw["generation"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def set_upload_state(self, upload: UploadState) -> None:
        write_atomically(
            self.paused / UPLOAD_MARKER,
            json.dumps({"state": upload.state, "generation": upload.generation}),
        )

    def frozen_complete(self) -> bool:
        return (self.frozen / FROZEN_COMPLETE).exists()

    def mark_frozen_complete(self) -> None:
        write_atomically(self.frozen / FROZEN_COMPLETE, "")

    def legacy_disk(self) -> tuple[Path, DiskFormat]:
        """The disk of a sandbox recorded before disk paths were stored."""
        qcow2 = self.path / "disk.qcow2"
        if qcow2.exists():
            return qcow2, "qcow2"
        return self.path / "disk.raw", "raw"

    def next_top(self) -> Path:
        """A new name for the sandbox's writable disk image after its current one is
        sealed."""
        return self.path / f"disk-{secrets.token_hex(4)}.qcow2"


@dataclass(frozen=True)
class SnapshotDir:
    """A snapshot's directory under the node's ``snapshots/``."""

    path: Path

    @property
    def manifest(self) -> Path:
        return self.path / PAUSED_MANIFEST

    @property
    def disk(self) -> Path:
        """The snapshot's disk: a sealed qcow2 layer, or (once written) a raw copy."""
        raw = self.disk_file("raw")
        return raw if raw.exists() else self.path / SNAPSHOT_DISK

    def disk_file(self, fmt: DiskFormat) -> Path:
        """Where a capture puts the snapshot's disk in format ``fmt``."""
        return self.path / (SNAPSHOT_DISK if fmt == "qcow2" else SNAPSHOT_RAW_DISK)

    @property
    def memory_file(self) -> Path:
        return self.path / MEMORY_FILE

    def complete(self) -> bool:
        """The capture finished: its manifest was written."""
        return self.manifest.exists()

    def committed(self) -> bool:
        return (self.path / COMMITTED_MARKER).exists()

    def mark_committed(self) -> None:
        write_atomically(self.path / COMMITTED_MARKER, "")
