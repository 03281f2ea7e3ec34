"""What a Firecracker diff snapshot is written over: a reflink, kept in the machine's work
directory, of the RAM image its dirty-page tracking counts from.

Firecracker tracks the guest pages written since its last snapshot or restore (KVM's
dirty log, and its own bitmap for what its devices write), and a ``Diff`` snapshot writes
only those pages into an existing memory file of the machine's exact size. Written over a
reflink of the previous image, that is a complete image again for the cost of what the
guest changed, where a ``Full`` snapshot writes every page of the guest's RAM (a 512 MiB
write per pause, whatever the guest did).

The previous image is the one the machine was restored from, or its last snapshot's. The
orchestrator may remove either while the machine runs (a pause's image goes once the
sandbox has resumed), so the machine keeps its own reflink of it, which costs a constant
time and no space until the original goes. A :class:`DiffBase` remembers that file by
identity (device, inode, size and modification time), so a file that was removed,
replaced or changed since is never diffed over; the caller then takes a ``Full``
snapshot, which restarts the tracking. Firecracker truncates a file of the wrong size to
zeros before a diff, which would lose every page the diff leaves out, so the size is
checked too. Where the filesystem cannot reflink, every snapshot is a full one (a copy
would read and write all of the RAM, as a full snapshot does).

Owns nothing but that bookkeeping and the clones; the snapshot calls are
``vmm.firecracker_vm``'s.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentenv.storage.clone import reflink_file_sync


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


def keep_diff_base(image: Path, kept: Path) -> DiffBase | None:
    """Make ``kept`` a reflink of ``image`` and return it as the base of the next diff;
    None, with nothing made, where the filesystem cannot reflink."""
    if not reflink_file_sync(image, kept):
        return None
    return DiffBase.of(kept)


def seed_diff_target(base: DiffBase, target: Path, owner: tuple[int, int] | None) -> bool:
    """Make ``target`` a reflink of ``base``'s image for a diff snapshot to be written
    over (owned by ``owner``, uid and gid, when the VMM runs as another user). False, with
    nothing made, where the filesystem cannot reflink."""
    if not reflink_file_sync(base.path, target):
        return False
    if owner is not None:
        os.chown(target, *owner)
    return True
