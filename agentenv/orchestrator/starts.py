"""Starting a new sandbox: the step create, a template build's create from a machine and
each fork child share.

:class:`SandboxStarts` gives the sandbox its id, runs :meth:`Lifecycle.create` under the
new sandbox's operation lock (:class:`~.operations.SandboxOperations`) and tells a start
that failed on a full data filesystem for what it was. It owns nothing but that step:
what to restore is resolved before (:mod:`.sources`, :mod:`.snapshotting` for fork
images), and the machine, network slot and record are :mod:`.lifecycle`'s.
"""

from __future__ import annotations

from agentenv.orchestrator.diskspace import FreeSpaceFloor
from agentenv.orchestrator.errors import OutOfSpace, SandboxStartFailed
from agentenv.orchestrator.layout import new_sandbox_id
from agentenv.orchestrator.lifecycle import Identity, Lifecycle
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.sources import Source
from agentenv.orchestrator.views import SandboxView


class SandboxStarts:
    """New sandboxes, each under its own operation lock."""

    def __init__(
        self, operations: SandboxOperations, lifecycle: Lifecycle, free_space: FreeSpaceFloor
    ) -> None:
        self._operations = operations
        self._lifecycle = lifecycle
        self._free_space = free_space

    async def start(
        self,
        source: Source,
        identity: Identity,
        timeout: int,
        *,
        private_memory: bool,
        envd_in_background: bool = False,
    ) -> SandboxView:
        """A new sandbox restored from ``source`` (see :meth:`Lifecycle.create`)."""
        sandbox_id = new_sandbox_id()
        try:
            return await self._operations.run(
                sandbox_id,
                "create",
                lambda: self._lifecycle.create(
                    sandbox_id,
                    source,
                    identity,
                    timeout,
                    private_memory=private_memory,
                    envd_in_background=envd_in_background,
                ),
                join=False,
            )
        except SandboxStartFailed as exc:
            # On a disk too full for the guest's RAM file the failure shows as whatever
            # broke first (a VMM killed by SIGBUS mid-restore, envd's /init unanswered):
            # the caller is told it was the disk (507), not an internal error.
            disk = self._free_space.reading()
            if disk.too_full_for(source.snapshot.memory_mib << 20):
                raise OutOfSpace(
                    "starting a sandbox", f"the data filesystem has {disk.describe()} ({exc})"
                ) from exc
            raise
