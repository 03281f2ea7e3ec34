"""The orchestrator's read side: what callers see of sandboxes, of the node and of the
sandboxes' resource use.

:class:`Queries` builds sandbox views (with their fork children), answers the node's
status (``/health``, scheduler heartbeats) and the sandboxes' metrics: envd asked now,
the samples :class:`~.metrics.MetricsHistory` keeps, and the periodic sampling of the
running ones. It changes no sandbox, snapshot or template: its only writes are samples
into the metrics history. It waits for a VMM exit already noticed to be settled
(:meth:`VmmLiveness.settled`) but leaves the settling to :mod:`.liveness`.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

import httpx

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.diskspace import FreeSpaceFloor
from agentenv.orchestrator.errors import GuestUnavailable, SandboxNotFound
from agentenv.orchestrator.lifecycle import Lifecycle
from agentenv.orchestrator.liveness import VmmLiveness
from agentenv.orchestrator.machines import Machines
from agentenv.orchestrator.metrics import GuestSample, MetricsHistory
from agentenv.orchestrator.modes import Mode
from agentenv.orchestrator.states import VISIBLE_STATES, SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store, utcnow
from agentenv.orchestrator.sync import RepositorySync
from agentenv.orchestrator.templates import BASE_TEMPLATE, TemplateManager
from agentenv.orchestrator.views import NodeStatus, SandboxView


class Queries:
    """Sandbox views, the node's status and the sandboxes' metrics."""

    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        templates: TemplateManager,
        lifecycle: Lifecycle,
        liveness: VmmLiveness,
        machines: Machines,
        sync: RepositorySync,
        free_space: FreeSpaceFloor,
        metrics: MetricsHistory,
        http: httpx.AsyncClient,
        *,
        mode: Mode,
        mode_reason: str,
        metrics_interval: float,
    ) -> None:
        self._store = store
        self._catalog = catalog
        self._templates = templates
        self._lifecycle = lifecycle
        self._liveness = liveness
        self._machines = machines
        self._sync = sync
        self._free_space = free_space
        self._metrics = metrics
        self._http = http
        self._mode = mode
        self._mode_reason = mode_reason
        self._metrics_interval = metrics_interval

    # -- sandboxes -----------------------------------------------------------------------
    def view(self, rec: SandboxRecord, *, with_children: bool = False) -> SandboxView:
        """What callers see of ``rec``; ``with_children``: with its visible fork
        children."""
        children: tuple[str, ...] = ()
        if with_children:
            children = tuple(
                r.sandbox_id
                for r in self._store.list_sandboxes()
                if r.parent_id == rec.sandbox_id and r.state in VISIBLE_STATES
            )
        return self._lifecycle.view(rec, children)

    def get(self, sandbox_id: str) -> SandboxView:
        rec = self._store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        return self.view(rec, with_children=True)

    def list_sandboxes(self) -> list[SandboxView]:
        return [self.view(r) for r in self._store.list_sandboxes() if r.state in VISIBLE_STATES]

    async def get_settled(self, sandbox_id: str) -> SandboxView:
        """:meth:`get`, once a VMM exit of the sandbox already noticed is settled."""
        await self._liveness.settled(sandbox_id)
        return self.get(sandbox_id)

    # -- the node ------------------------------------------------------------------------
    def node_status(self) -> NodeStatus:
        counts: Counter[SandboxState] = Counter()
        vcpus = memory = 0
        for rec in self._store.list_sandboxes():
            counts[rec.state] += 1
            if rec.state not in (SandboxState.PAUSED, SandboxState.KILLING):
                vcpus += rec.vcpus
                memory += rec.memory_mib
        cache = self._catalog.cache
        templates = {t.template_id: "ready" for t in self._store.list_templates()}
        if BASE_TEMPLATE not in templates:
            templates[BASE_TEMPLATE] = (
                "building"
                if self._templates.building()
                else ("failed" if self._templates.last_error else "pending")
            )
        disk = self._free_space.reading()
        problems = [self._templates.last_error, disk.problem(), self._sync.stopped_commits()]
        return NodeStatus(
            node=self._catalog.node,
            vmm=self._mode.vmm,
            accel=self._mode.accel,
            mode_reason=self._mode_reason,
            memory_mode="shared" if self._lifecycle.own_memory_files else "private",
            sandboxes_by_state={state.value: n for state, n in sorted(counts.items())},
            allocated_vcpus=vcpus,
            allocated_memory_mib=memory,
            cache_used_bytes=cache.used_bytes(),
            cache_limit_bytes=cache.limit_bytes,
            cache_entries=len(cache.keys()),
            repository=self._catalog.url,
            sandboxes=sum(n for state, n in counts.items() if state in VISIBLE_STATES),
            templates=templates,
            disk=disk,
            problem="; ".join(p for p in problems if p) or None,
            vmms=self._machines.count(),
        )

    # -- metrics -------------------------------------------------------------------------
    async def guest_metrics(self, sandbox_id: str) -> dict[str, object] | None:
        """See :meth:`Orchestrator.guest_metrics`."""
        view = await self.get_settled(sandbox_id)
        if view.state != "running":
            return None
        try:
            return await envd_client.metrics(self._http, view.guest_address, view.record.envd_token)
        except envd_client.EnvdUnreachable as exc:
            if (await self.get_settled(sandbox_id)).state != "running":
                return None  # its VMM exited while envd was being asked
            raise GuestUnavailable(f"sandbox {sandbox_id}: {exc}") from exc

    async def metrics(
        self, sandbox_id: str, start: datetime | None, until: datetime | None
    ) -> list[GuestSample]:
        """See :meth:`Orchestrator.metrics`."""
        view = await self.get_settled(sandbox_id)
        samples = self._metrics.between(sandbox_id, start, until)
        now = utcnow()
        reaches_now = (start is None or start <= now) and (until is None or until > now)
        wanted = not samples or self._metrics_interval == 0
        if not wanted or not reaches_now or view.state != "running":
            return samples
        figures = await self.guest_metrics(sandbox_id)
        if figures is None:
            return samples
        sample = GuestSample(now, figures)
        self._metrics.record(sandbox_id, sample)
        return [*samples, sample]

    def latest_metrics(self, sandbox_ids: set[str]) -> dict[str, tuple[GuestSample, int]]:
        """See :meth:`Orchestrator.latest_metrics`."""
        latest: dict[str, tuple[GuestSample, int]] = {}
        for sandbox_id in sandbox_ids:
            rec = self._store.get_sandbox(sandbox_id)
            sample = self._metrics.latest(sandbox_id)
            if rec is not None and rec.state in VISIBLE_STATES and sample is not None:
                latest[sandbox_id] = (sample, rec.vcpus)
        return latest

    async def sample_metrics(self) -> None:
        """Sample every running sandbox (the supervisor's ``metrics`` loop)."""
        running = [
            self.view(r) for r in self._store.list_sandboxes() if r.state == SandboxState.RUNNING
        ]
        await self._metrics.sample(running)
