"""The node's free-space floor: operations that write new files to the data directory
(create, fork, snapshot) are refused while its filesystem has less free space than
``Config.free_space_floor``, before they write anything, so a full disk never leaves a
half-written sandbox or snapshot behind."""

from __future__ import annotations

import os

from agentenv.config import Config
from agentenv.orchestrator.errors import NodeCacheFull


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


class FreeSpaceFloor:
    def __init__(self, config: Config) -> None:
        self.config = config

    def check(self, what: str) -> None:
        """:class:`NodeCacheFull` (507: the node's storage cannot take more) if the data
        directory's filesystem is below the floor."""
        if self.config.free_space_floor is None:
            return
        st = os.statvfs(self.config.home)
        free = st.f_bavail * st.f_frsize
        floor = self.config.free_space_floor_of(st.f_blocks * st.f_frsize)
        if free < floor:
            raise NodeCacheFull(
                f"{what} refused: the node's data directory has {_mib(free)} free, below "
                f"its free-space floor of {_mib(floor)} (free_space_floor)"
            )
