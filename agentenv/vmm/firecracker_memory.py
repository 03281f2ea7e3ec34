"""What a Firecracker diff snapshot is written over: the RAM image of the machine's last
snapshot, or the one it was restored from.

Firecracker tracks the guest pages written since its last snapshot or restore (KVM's
dirty log, and its own bitmap for what its devices write), and a ``Diff`` snapshot writes
only those pages into an existing memory file of the machine's exact size. Written over a
reflink of the previous image, that is a complete image again for the cost of what the
guest changed, where a ``Full`` snapshot writes every page of the guest's RAM (a 512 MiB
write per pause, whatever the guest did).

The previous image must be the very file the dirty tracking started from. A
:class:`DiffBase` remembers it by identity (device, inode, size and modification time), so
an image that was removed, replaced or changed since is never diffed over; the caller
then takes a ``Full`` snapshot, which restarts the tracking. Firecracker truncates a file
of the wrong size to zeros before a diff, which would lose every page the diff leaves
out, so the size is checked too.

Owns nothing but that bookkeeping and the seeding clone; the snapshot calls are
``vmm.firecracker``'s.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentenv.storage.clone import clone_file_sync, supports_reflink


@dataclass(frozen=True)
class DiffBase:
    """A RAM image a diff snapshot can be written over, and how to tell it is unchanged."""

    path: Path
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> DiffBase:
        """``path`` as it is now (OSError if it is gone)."""
        path = path.resolve()
        st = os.stat(path)
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def usable(self, memory_bytes: int) -> bool:
        """Whether the image is still the one recorded, and of the machine's RAM size."""
        try:
            return self.size == memory_bytes and DiffBase.of(self.path) == self
        except OSError:
            return False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"path": str(self.path)}

    @classmethod
    def from_dict(cls, data: object) -> DiffBase | None:
        """A recorded base, or None for a missing or malformed record."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                Path(data["path"]),
                int(data["device"]),
                int(data["inode"]),
                int(data["size"]),
                int(data["mtime_ns"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


def seed_diff_target(base: DiffBase, target: Path, owner: tuple[int, int] | None) -> bool:
    """Make ``target`` a reflink of ``base``'s image for a diff snapshot to be written
    over (owned by ``owner``, uid and gid, when the VMM runs as another user). False, with
    nothing made, where the filesystem cannot reflink: a full copy would read and write
    all of the RAM, which a ``Full`` snapshot does anyway."""
    if not supports_reflink(target.parent):
        return False
    if not clone_file_sync(base.path, target):
        target.unlink(missing_ok=True)
        return False
    if owner is not None:
        os.chown(target, *owner)
    return True
