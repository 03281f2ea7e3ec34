"""The operations that copy a running sandbox, which keeps running: a snapshot (kept,
possibly named, committed to the repository) and a fork (an image that lives only as
long as the children started from it at once).

:class:`Snapshotting` checks the request (free space, names, fork counts), runs the
capture under the sandbox's operation lock and :meth:`VmmLiveness.guard` with its
volumes unmounted, then commits the snapshot (:mod:`.sync`) or starts the fork's
children (:mod:`.starts`). The capture itself (VM stopped, disk and RAM taken) is
:mod:`.capture`'s; records change only through the store and :mod:`.sync`; it never
changes a sandbox's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

import httpx

from agentenv.limits import MAX_FORK_CHILDREN
from agentenv.network import NetworkManager
from agentenv.orchestrator.capture import Capture
from agentenv.orchestrator.catalog import Catalog, check_user_name
from agentenv.orchestrator.diskspace import FreeSpaceFloor
from agentenv.orchestrator.errors import Conflict, InvalidRequest, OperationFailed
from agentenv.orchestrator.layout import new_snapshot_id
from agentenv.orchestrator.lifecycle import Identity, Lifecycle, Timeouts
from agentenv.orchestrator.liveness import VmmLiveness
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.resources import FilePins
from agentenv.orchestrator.sources import Source
from agentenv.orchestrator.starts import SandboxStarts
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, SnapshotRecord, Store
from agentenv.orchestrator.sync import RepositorySync
from agentenv.orchestrator.views import SandboxView, SnapshotView
from agentenv.orchestrator.volumes import Volumes
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError


class Snapshotting:
    """Snapshots and forks of running sandboxes."""

    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        network: NetworkManager,
        http: httpx.AsyncClient,
        volumes: Volumes,
        operations: SandboxOperations,
        lifecycle: Lifecycle,
        liveness: VmmLiveness,
        capture: Capture,
        sync: RepositorySync,
        pins: FilePins,
        starts: SandboxStarts,
        free_space: FreeSpaceFloor,
        timeouts: Timeouts,
    ) -> None:
        self._store = store
        self._catalog = catalog
        self._network = network
        self._http = http
        self._volumes = volumes
        self._operations = operations
        self._lifecycle = lifecycle
        self._liveness = liveness
        self._capture = capture
        self._sync = sync
        self._pins = pins
        self._starts = starts
        self._free_space = free_space
        self._timeouts = timeouts

    def _volumes_unmounted(
        self, rec: SandboxRecord
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """A running sandbox's volumes left out of what is captured (see
        :meth:`Volumes.unmounted`)."""
        if not rec.volumes or rec.state != SandboxState.RUNNING:
            return contextlib.nullcontext()
        address = self._network.describe(rec.slot).guest_address
        return self._volumes.unmounted(self._http, address, rec.envd_token, rec.volumes)

    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None,
        *,
        metadata: dict[str, str] | None,
        kind: Literal["snapshot", "template"],
        replace_name: bool,
        wait_commit: bool,
        snapshot_id: str | None,
    ) -> SnapshotView:
        """See :meth:`Orchestrator.snapshot`."""
        self._free_space.check("snapshot")
        if name is not None:
            check_user_name(name)
        if name is not None and not replace_name:
            existing = self._store.get_snapshot(name)
            if existing is not None and existing.state == "ready":
                raise Conflict(f"a snapshot named {name!r} already exists")
            # lookup: also a template's "name:tag" (which the name would hide).
            if await self._catalog.lookup(name) is not None:
                raise Conflict(f"a snapshot or template named {name!r} already exists")

        async def work() -> SnapshotView:
            await self._lifecycle.inits.settled(sandbox_id)
            rec = self._lifecycle.existing(sandbox_id)
            if name is not None and replace_name:
                existing = self._store.get_snapshot(name)
                if existing is not None and existing.name == name:
                    self._store.update_snapshot(existing.snapshot_id, name=None)
            async with self._volumes_unmounted(rec):
                snap_rec = await self._capture.capture(
                    rec, kind, name, metadata or {}, snapshot_id or new_snapshot_id()
                )
            return SnapshotView(snap_rec)

        view = await self._operations.run(
            sandbox_id, "snapshot", lambda: self._liveness.guard(sandbox_id, work), join=False
        )
        if wait_commit:
            try:
                await self._sync.commit(view.snapshot_id)
            except BaseException:
                self._store.update_snapshot(view.snapshot_id, state="deleted", name=None)
                self._pins.collect_snapshots()
                raise
        else:
            self._sync.start_commit(view.snapshot_id)
        return view

    async def fork(
        self, sandbox_id: str, count: int, timeout: int | None
    ) -> list[SandboxView | Exception]:
        """See :meth:`Orchestrator.fork`."""
        if not 1 <= count <= MAX_FORK_CHILDREN:
            raise InvalidRequest(f"count must be between 1 and {MAX_FORK_CHILDREN}")
        self._free_space.check("fork")
        chosen = self._timeouts.pick(timeout)

        async def capture() -> tuple[SandboxRecord, SnapshotRecord]:
            await self._lifecycle.inits.settled(sandbox_id)
            rec = self._lifecycle.existing(sandbox_id)
            async with self._volumes_unmounted(rec):
                image = await self._capture.capture(rec, "fork", None, {}, new_snapshot_id())
            return rec, image

        parent, image = await self._operations.run(
            sandbox_id, "fork", lambda: self._liveness.guard(sandbox_id, capture), join=False
        )
        image_id = image.snapshot_id
        try:
            snapshot = MachineSnapshot.load(image.snapshot_dir)
        except SnapshotError as exc:
            raise OperationFailed(f"fork of {sandbox_id}: {exc}") from exc
        source = Source(parent.template_id, parent.template_build_id, snapshot, image_id)
        identity = Identity(
            metadata=parent.metadata,
            env_vars=parent.env_vars,
            secure=parent.envd_token is not None,
            network=parent.network,
            auto_pause=parent.auto_pause,
            auto_resume=parent.auto_resume,
            parent_id=sandbox_id,
        )
        try:
            results = await asyncio.gather(
                *(
                    self._starts.start(
                        source, identity, chosen, private_memory=True, envd_in_background=True
                    )
                    for _ in range(count)
                ),
                return_exceptions=True,
            )
        finally:
            # The image now lives only as long as the children (and the parent's disk)
            # that use it.
            self._store.update_snapshot(image_id, state="deleted")
            self._pins.collect_snapshots()
        out: list[SandboxView | Exception] = []
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            out.append(result)
        return out
