"""The node's data filesystem as a resource: how much of it is free, the free-space
floor (``Config.free_space_floor``) below which operations that write new files to the
data directory (create, resume, fork, snapshot) are refused before they write anything,
so a full disk never leaves a half-written sandbox or snapshot behind, and what
``/health`` says of it.

Running guests are not held to the floor: a sandbox's RAM file is a reflink of its
template's and takes new blocks as the guest writes its memory, up to the guest's RAM
size. Reserving that up front was measured and rejected: unsharing a 512 MiB RAM file
(``fallocate`` with ``FALLOC_FL_UNSHARE_RANGE``, then filling its holes) took 240-350 ms
per create on XFS, about as long as the whole create, and 518 MiB of disk per sandbox
instead of what its guest writes. The floor is the headroom running guests grow into;
a guest that finds none anyway (its VMM dies of SIGBUS) is reported by
:mod:`.liveness` with what this module measures.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from agentenv.config import Config
from agentenv.orchestrator.errors import BelowFreeSpaceFloor

log = logging.getLogger("agentenv.orchestrator")


def mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


@dataclass(frozen=True)
class DiskSpace:
    """One reading of the data directory's filesystem and the floor it must keep."""

    free_bytes: int
    total_bytes: int
    # 0 when no floor is configured.
    floor_bytes: int

    @classmethod
    def of(cls, free_bytes: int, total_bytes: int, config: Config) -> DiskSpace:
        return cls(free_bytes, total_bytes, config.free_space_floor_of(total_bytes))

    @property
    def below_floor(self) -> bool:
        return self.free_bytes < self.floor_bytes

    def describe(self) -> str:
        floor = f", free-space floor {mib(self.floor_bytes)}" if self.floor_bytes else ""
        return f"{mib(self.free_bytes)} free of {mib(self.total_bytes)}{floor}"

    def too_full_for(self, memory_bytes: int) -> bool:
        """Whether a guest of ``memory_bytes`` RAM may have failed for want of space:
        below the floor, or with less free than its RAM file can grow by (a reflink of
        its template's, it takes new blocks as the guest writes)."""
        return self.below_floor or self.free_bytes < memory_bytes

    def problem(self) -> str | None:
        """Why the node is degraded by its disk, if it is."""
        if not self.below_floor:
            return None
        return (
            f"the data directory's filesystem has {mib(self.free_bytes)} free, below its "
            f"free-space floor of {mib(self.floor_bytes)}: creates, resumes, snapshots and "
            "forks are refused (507)"
        )


class FreeSpaceFloor:
    def __init__(self, config: Config) -> None:
        self.config = config
        # Whether the last watch() found the disk below the floor.
        self._was_below = False

    def reading(self) -> DiskSpace:
        """The data directory's filesystem now (one ``statvfs``: microseconds)."""
        st = os.statvfs(self.config.home)
        # f_bavail: what an unprivileged writer can still use. The server runs as root
        # and could dip into the reserve, but VMMs run as their own users and cannot.
        return DiskSpace.of(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, self.config)

    def check(self, operation: str) -> None:
        """:class:`BelowFreeSpaceFloor` (507) if the data directory's filesystem is below
        the floor."""
        if self.config.free_space_floor is None:
            return
        disk = self.reading()
        if disk.below_floor:
            raise BelowFreeSpaceFloor(operation, disk.free_bytes, disk.floor_bytes)

    async def watch(self) -> None:
        """Log when the disk falls below the floor and when it is back above: /health
        says so too, but a node filling up should be noticed by whoever reads the log."""
        if self.config.free_space_floor is None:
            return
        disk = self.reading()
        if disk.below_floor and not self._was_below:
            log.warning("%s", disk.problem())
        elif self._was_below and not disk.below_floor:
            log.info(
                "the data directory's filesystem is above its floor again: %s", disk.describe()
            )
        self._was_below = disk.below_floor
