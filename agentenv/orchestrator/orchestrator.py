"""The orchestrator facade: the one entry point the API, the proxy and template builds
call to create, pause, resume, snapshot, fork, expire and kill sandboxes.

It holds the components :mod:`.wiring` builds (each takes what it needs in its
constructor, never this facade) and calls the one that does the work; every change runs
under the sandbox's operation lock (:class:`~.operations.SandboxOperations`), taken here
or by :mod:`.starts` and :mod:`.snapshotting`:

- :mod:`.lifecycle`: create, pause, resume, kill, timeouts; :mod:`.starts`: a new
  sandbox's id and operation lock (create, builds, fork children);
- :mod:`.snapshotting`: snapshot and fork requests; :mod:`.capture`: the captures they
  make, forks' images, flattening, RAM-file resharing;
- :mod:`.queries`: the read side (views, node status, metrics);
- :mod:`.sources`: template and snapshot ids to what to restore;
- :mod:`.sync`: commits, uploads, adoption and handoff through the repository;
- :mod:`.recovery`: what a previous run left;
- :mod:`.resources`: network slots and leases, file pins and collection;
- :mod:`.machines`: the attached VMMs; :mod:`.liveness`: those that exit on their own;
- :mod:`.metrics`: the sandboxes' resource samples;
- :mod:`.supervisor`: background tasks.

Lifecycle: :meth:`Orchestrator.startup` (open the store, recover, start background work
and the base template build), then requests, then :meth:`Orchestrator.shutdown`.
Operations on one sandbox run one after another; an identical request arriving while one
is queued or running joins it (two ``pause`` calls get one pause). Operations run as tasks
of their own, so a client that disconnects never aborts one half-way. States and their
transitions are :mod:`.states`; docs/architecture.md has the whole picture.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Literal

import httpx

from agentenv.config import Config
from agentenv.network import EgressPolicy, NetworkError, NetworkManager
from agentenv.orchestrator.errors import (
    Conflict,
    GuestUnavailable,
    OperationFailed,
    SandboxNotFound,
)
from agentenv.orchestrator.lifecycle import Identity
from agentenv.orchestrator.metrics import GuestSample
from agentenv.orchestrator.modes import Mode
from agentenv.orchestrator.network_options import NetworkOptions
from agentenv.orchestrator.resources import resolve_subnet
from agentenv.orchestrator.sources import Source
from agentenv.orchestrator.states import PUBLIC_STATE, VISIBLE_STATES, SandboxState, traffic_end
from agentenv.orchestrator.store import SandboxEvent, SandboxRecord, Store, utcnow
from agentenv.orchestrator.tags import family_of
from agentenv.orchestrator.views import NodeStatus, SandboxView, SnapshotView
from agentenv.orchestrator.volumes import Requested
from agentenv.orchestrator.wiring import build_components
from agentenv.snapshots.layout import MachineSnapshot
from agentenv.storage.clone import supports_reflink
from agentenv.vmm.base import VMMDriver

log = logging.getLogger("agentenv.orchestrator")

AUTO_PAUSE_RETRY_S = 60
# How often running sandboxes' RAM files are written back. A snapshot or fork must write
# back what is dirty while the guest is stopped (or just before); doing it regularly in
# the background keeps that to what changed in the last few seconds.
RAM_FLUSH_INTERVAL_S = 5.0
HANDOFF_CHECK_INTERVAL_S = 5.0
REAP_INTERVAL_S = 0.5
FREE_SPACE_CHECK_INTERVAL_S = 5.0

__all__ = ["NodeStatus", "Orchestrator", "SandboxView", "SnapshotView", "resolve_subnet"]


class Orchestrator:
    def __init__(
        self,
        config: Config,
        driver: VMMDriver,
        accel: Literal["tcg", "kvm"],
        network: NetworkManager | None = None,
        store: Store | None = None,
        http: httpx.AsyncClient | None = None,
        *,
        mode_reason: str = "",
    ) -> None:
        """``network``, ``store`` and ``http`` (to guests' envd) default to the real
        ones; tests pass fakes. ``mode_reason`` says why the node runs ``driver`` under
        ``accel`` (``/health`` shows it)."""
        self.config = config
        self.driver = driver
        self.accel = accel
        #: What this node restores sandboxes under; saved machines of another mode are
        #: refused (:mod:`.modes`).
        self.mode = Mode(driver.name, accel)
        self.mode_reason = mode_reason
        parts = build_components(
            config, driver, accel, self.mode, network, store, http, mode_reason=mode_reason
        )
        self.store = parts.store
        self.network = parts.network
        self.http = parts.http
        self.timeouts = parts.timeouts
        self.catalog = parts.catalog
        self.tags = parts.tags
        self.secrets = parts.secrets
        self.volumes = parts.volumes
        self.templates = parts.templates
        self._free_space = parts.free_space
        self._operations = parts.operations
        self._supervisor = parts.supervisor
        self._machines = parts.machines
        self._slots = parts.slots
        self._leases = parts.leases
        self._pins = parts.pins
        self._sources = parts.sources
        self._resharing = parts.resharing
        self._sync = parts.sync
        self._lifecycle = parts.lifecycle
        self._liveness = parts.liveness
        self._recovery = parts.recovery
        self._starts = parts.starts
        self._snapshotting = parts.snapshotting
        self._queries = parts.queries

    def on_traffic_end(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(sandbox_id, reason)`` the moment a sandbox stops taking
        proxied traffic: a kill (or expiry) or a pause begins, or its VMM is gone.
        ``reason`` is "killed" or "paused". The callback must be quick and must not
        raise (it runs inside the state change)."""

        def listener(event: SandboxEvent) -> None:
            reason = traffic_end(event.new)
            # Once per end: from a state that took traffic to one that does not.
            if reason is not None and event.old is not None and traffic_end(event.old) is None:
                callback(event.sandbox_id, reason)

        self.store.listen(listener)

    @property
    def own_memory_files(self) -> bool:
        """Whether new sandboxes get RAM files of their own (decided in startup())."""
        return self._lifecycle.own_memory_files

    # -- lifecycle -----------------------------------------------------------------------
    async def startup(self, *, build_base: bool = True, watch_handoffs: bool = True) -> None:
        """Open the store, settle what a previous run left, resume unfinished commits and
        uploads, and start the background loops: the reaper, the RAM flush and (unless
        ``watch_handoffs`` is off: tests call :meth:`check_handoffs` themselves) the
        check for paused sandboxes other nodes took over."""
        for d in (
            self.config.home,
            self.config.templates_dir,
            self.config.sandboxes_dir,
            self.config.snapshots_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        self.secrets.load_key()  # made now if there is none, so a bad key shows at start
        reflinks = self._resharing.enabled = supports_reflink(self.config.sandboxes_dir)
        wanted = self.config.sandbox_memory
        # "auto" is "file" even where the data directory cannot reflink (the RAM file is
        # then a sparse copy): with QEMU 7.2 a guest kernel can zero pages of a privately
        # mapped RAM file through the balloon, so a template's file mapped privately by
        # every tenant's sandbox is chosen only when asked for (SECURITY.md, Known limits).
        own = self._lifecycle.own_memory_files = self.driver.shared_memory_boot and (
            wanted in ("file", "auto")
        )
        reporting = own and self.config.free_page_reporting
        self.templates.report_free_pages = self._lifecycle.report_free_pages = reporting
        log.info(
            "data directory %s %s reflinks: sandbox RAM is %s",
            self.config.home,
            "supports" if reflinks else "does not support",
            "a file of its own (fast pause and snapshot)"
            if own
            else "a private mapping of the template's (pause streams RAM)",
        )
        self.store.open()
        self.catalog.startup()
        self.volumes.startup()
        self.templates.cleanup_staging()
        await self._recovery.run()
        self.volumes.settle()
        self._sync.resume_unfinished()
        self._supervisor.every("reaper", REAP_INTERVAL_S, self._reap)
        if watch_handoffs:
            self._supervisor.every("handoffs", HANDOFF_CHECK_INTERVAL_S, self.check_handoffs)
        self._supervisor.every(
            "ram-flush", RAM_FLUSH_INTERVAL_S, self._machines.flush_shared_memory
        )
        if self.config.repository_gc_interval > 0:
            self._supervisor.every(
                "repository-gc",
                self.config.repository_gc_interval,
                self.catalog.collect_garbage_if_due,
            )
        if self.config.metrics_interval > 0:
            self._supervisor.every(
                "metrics", self.config.metrics_interval, self._queries.sample_metrics
            )
        self._supervisor.every("free-space", FREE_SPACE_CHECK_INTERVAL_S, self._free_space.watch)
        if build_base:
            self._supervisor.spawn(self._build_base_quietly(), name="base template")

    async def shutdown(self, *, kill_sandboxes: bool = False) -> None:
        """Stop background work. Sandboxes keep running (their VMMs live in their own
        sessions) and are re-adopted by the next start, unless ``kill_sandboxes``.
        Template builds (:class:`~.builds.BuildManager`) are stopped by their owner
        first."""
        await self._supervisor.shutdown()
        self._leases.shutdown()
        for op in self._operations.pending():
            with contextlib.suppress(Exception):
                await op
        if kill_sandboxes:
            for rec in self.store.list_sandboxes():
                with contextlib.suppress(SandboxNotFound):
                    await self.kill(rec.sandbox_id)
        await self._lifecycle.inits.stop()
        await self.volumes.drain()
        await self._slots.drain()
        await self._machines.close_all()
        self._resharing.shutdown()
        await self.http.aclose()
        self.store.close()

    async def _build_base_quietly(self) -> object:
        try:
            return await self.templates.ensure_base()
        except Exception as exc:  # logged and reported by /health; create retries
            log.error("base template unavailable: %s", exc)
            return None

    # -- queries -------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxView:
        return self._queries.get(sandbox_id)

    def list_sandboxes(self) -> list[SandboxView]:
        return self._queries.list_sandboxes()

    def pause_committed(self, rec: SandboxRecord) -> bool:
        """Whether a paused sandbox's upload to the repository is complete."""
        return self._sync.pause_committed(rec)

    def node_status(self) -> NodeStatus:
        return self._queries.node_status()

    async def get_settled(self, sandbox_id: str) -> SandboxView:
        """:meth:`get`, once a VMM exit of the sandbox already noticed is settled: a
        sandbox whose VMM just died shows as paused, never as running with no VM."""
        return await self._queries.get_settled(sandbox_id)

    async def guest_metrics(self, sandbox_id: str) -> dict[str, object] | None:
        """Current resource use inside the guest, as envd reports it; None for a
        sandbox that is not running (paused, or its VMM just exited): it has none."""
        return await self._queries.guest_metrics(sandbox_id)

    async def metrics(
        self, sandbox_id: str, start: datetime | None, until: datetime | None
    ) -> list[GuestSample]:
        """The sandbox's samples taken in [start, until) (None: no bound). A running
        sandbox asked about a window that reaches now is sampled at once if it has no
        sample yet, or always when periodic sampling is off (``metrics_interval`` 0)."""
        return await self._queries.metrics(sandbox_id, start, until)

    def latest_metrics(self, sandbox_ids: set[str]) -> dict[str, tuple[GuestSample, int]]:
        """The latest sample, and vCPU count, of each visible sandbox named that has
        one."""
        return self._queries.latest_metrics(sandbox_ids)

    async def ready_for_traffic(self, sandbox_id: str) -> SandboxView:
        """The sandbox once it can take proxied traffic: a paused sandbox created with
        ``autoResume`` is resumed, an operation in progress is waited for, and so is
        envd's re-initialisation after a resume. Raises :class:`Conflict` for a sandbox
        that is paused and stays so."""
        await self._liveness.settled(sandbox_id)
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        if rec.state == SandboxState.PAUSED:
            if not rec.auto_resume:
                raise Conflict(f"sandbox {sandbox_id} is paused")
            with contextlib.suppress(Conflict):  # someone else resumed it first
                await self.resume(sandbox_id)
        elif rec.state != SandboxState.RUNNING:
            for task in self._operations.pending(sandbox_id):
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
        await self._lifecycle.inits.settled(sandbox_id)
        self._lifecycle.inits.check(sandbox_id)
        current = self.store.get_sandbox(sandbox_id)
        if current is None or current.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        if current.state != SandboxState.RUNNING:
            raise Conflict(f"sandbox {sandbox_id} is {PUBLIC_STATE[current.state]}")
        return self._queries.view(current)

    # -- create --------------------------------------------------------------------------
    async def create(
        self,
        template_id: str,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        secure: bool = False,
        network: NetworkOptions | None = None,
        auto_pause: bool = False,
        auto_resume: bool = False,
        volume_mounts: Sequence[Requested] = (),
        envd_in_background: bool = False,
    ) -> SandboxView:
        """A new sandbox from a template or snapshot. ``network`` defaults to the most
        closed options (nothing leaves but DNS). ``volume_mounts`` are volumes (by name)
        mounted at paths in the guest (see :mod:`.volumes`). ``envd_in_background``:
        answer once the machine runs, envd's /init following (see
        :meth:`Lifecycle.create`); a caller that talks to envd itself next leaves it off."""
        self._free_space.check("create")
        timeout = self.timeouts.pick(timeout)
        source = await self._sources.resolve(template_id)
        identity = Identity(
            metadata=metadata or {},
            env_vars=env_vars or {},
            secure=secure,
            network=network or NetworkOptions(),
            auto_pause=auto_pause,
            auto_resume=auto_resume,
            volume_mounts=tuple(volume_mounts),
        )
        return await self._starts.start(
            source, identity, timeout, private_memory=False, envd_in_background=envd_in_background
        )

    async def create_from_machine(
        self, snapshot: MachineSnapshot, template_id: str, *, timeout: int, metadata: dict[str, str]
    ) -> SandboxView:
        """A sandbox restored from a machine snapshot that is not a template (a guest
        booted from an OCI image, which template builds start from)."""
        self._free_space.check("create")
        identity = Identity(
            metadata=metadata,
            env_vars={},
            secure=False,
            # Build steps install packages.
            network=NetworkOptions(EgressPolicy(allow_internet=True)),
            auto_pause=False,
            auto_resume=False,
        )
        source = Source(template_id, template_id, snapshot, None)
        return await self._starts.start(source, identity, timeout, private_memory=False)

    # -- pause and resume ------------------------------------------------------------------
    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxView:
        """Save the machine under the sandbox's directory and release its VMM process and
        network namespace; disk and RAM files stay. Joins a pause already in progress.
        Without ``memory``, only the disk is kept: RAM is discarded and the guest boots
        from its disk on resume (processes restart).

        On failure the VM keeps running (the driver resumes it) and so does the sandbox;
        if the failure was its VMM exiting, the sandbox is a filesystem-only pause and
        the answer :class:`Conflict`, as for a sandbox already paused."""
        kind = "pause" if memory else "pause-filesystem"
        return await self._operations.run(
            sandbox_id,
            kind,
            lambda: self._liveness.guard(
                sandbox_id, lambda: self._lifecycle.pause(sandbox_id, memory)
            ),
            join=True,
        )

    async def resume(self, sandbox_id: str, timeout: int | None = None) -> SandboxView:
        """Restore a paused sandbox with the same id, files and processes; joins a resume
        already in progress. Returns once the VM runs; envd's re-initialisation (clock,
        entropy) finishes in the background and proxied traffic waits for it. On failure
        the sandbox stays paused."""
        chosen = self.timeouts.pick(timeout)
        # A VMM exit already noticed is settled first: that sandbox is paused, and resumed.
        await self._liveness.settled(sandbox_id)
        rec = self.store.get_sandbox(sandbox_id)
        if rec is not None and rec.state == SandboxState.PAUSED:
            # Only a paused one: a running sandbox answers as it would (409, or a connect's
            # 200), whatever the disk.
            self._free_space.check("resume")
        return await self._operations.run(
            sandbox_id, "resume", lambda: self._lifecycle.resume(sandbox_id, chosen), join=True
        )

    async def adopt(self, sandbox_id: str, timeout: int | None = None) -> SandboxView:
        """Resume, on this node, a sandbox paused on another node that shares the
        repository. Raises :class:`SandboxNotFound` if the repository has no such paused
        sandbox and :class:`Conflict` if another node resumed it first."""
        self.timeouts.pick(timeout)
        self._free_space.check("resume")
        await self._operations.run(
            sandbox_id, "adopt", lambda: self._sync.adopt(sandbox_id), join=True
        )
        return await self.resume(sandbox_id, timeout)

    # -- snapshots and forks ---------------------------------------------------------------
    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = None,
        *,
        metadata: dict[str, str] | None = None,
        kind: Literal["snapshot", "template"] = "snapshot",
        replace_name: bool = False,
        wait_commit: bool = False,
        snapshot_id: str | None = None,
    ) -> SnapshotView:
        """Capture a running sandbox, which keeps running, as a snapshot that starts new
        sandboxes (by id or name, wherever a template is accepted). It is usable on this
        node at once and committed to the repository in the background (``wait_commit``:
        before returning). ``replace_name`` moves an existing name to the new snapshot
        (a template rebuilt under its name)."""
        return await self._snapshotting.snapshot(
            sandbox_id,
            name,
            metadata=metadata,
            kind=kind,
            replace_name=replace_name,
            wait_commit=wait_commit,
            snapshot_id=snapshot_id,
        )

    async def get_snapshot(self, key: str, type_: str = "snapshot") -> SnapshotView:
        return await self._sync.get_snapshot(key, type_)

    async def list_snapshots(
        self, sandbox_id: str | None = None, type_: str = "snapshot"
    ) -> list[SnapshotView]:
        """Committed snapshots (every node's), plus this node's still being committed."""
        return await self._sync.list_snapshots(sandbox_id, type_)

    async def delete_snapshot(self, key: str, type_: str = "snapshot") -> None:
        """Forget a snapshot (or template) everywhere: its repository record and names
        go at once, this node's files once no sandbox or snapshot depends on them."""
        await self._sync.delete_snapshot(key, type_)

    async def delete_template(self, key: str) -> None:
        """Delete a template: named by a build's id, that build; by its name (or
        ``name:tag``), every build of the name and all its tags, as E2B deletes a
        template. :class:`TemplateAliasNotFound` if ``key`` names no template."""
        entry = await self.catalog.lookup(key)
        if entry is not None and entry.id == key and entry.type == "template":
            await self._sync.delete_snapshot(key, "template")
            return
        name = await self.tags.family(key)
        for build in await self.catalog.list_records("template"):
            if family_of(build) == name:
                await self._sync.delete_snapshot(build.id, "template")
        await self.catalog.drop_tags(name, [t.tag for t in await self.catalog.tags(name)])

    async def tag_build(self, name: str, tags: list[str], build_id: str) -> None:
        """Point ``tags`` of template ``name`` at its committed build ``build_id``."""
        await self.catalog.set_tags(name, tags, build_id)

    def collect_snapshots(self) -> list[str]:
        return self._pins.collect_snapshots()

    async def fork(
        self, sandbox_id: str, count: int = 1, timeout: int | None = None
    ) -> list[SandboxView | Exception]:
        """Start ``count`` children of a running sandbox, all at once, on this node. They
        share the parent's RAM image (private mappings) and disk (overlays, or reflinks of
        a raw copy), inherit its metadata, environment and security, and get their own id,
        token, network slot, clock and entropy. The parent keeps running. One result per
        child: its view or why it failed."""
        return await self._snapshotting.fork(sandbox_id, count, timeout)

    # -- changes -------------------------------------------------------------------------
    async def set_timeout(
        self, sandbox_id: str, timeout: int, *, only_extend: bool = False
    ) -> SandboxView:
        """End the sandbox's life ``timeout`` seconds from now; with ``only_extend`` only
        if that is later than its current end (connect and refresh never shorten it)."""
        self.timeouts.check(timeout)
        view = self.get(sandbox_id)
        self._lifecycle.set_end(view.record, timeout, only_extend=only_extend)
        return view

    async def update_network(self, sandbox_id: str, egress: EgressPolicy) -> SandboxView:
        """Replace a running sandbox's egress policy, in the sandbox's network and then in
        its record, after any operation in progress on it. A paused sandbox answers
        :class:`Conflict` (409, which E2B's API lists for this call) rather than
        storing a policy for the resume: the paused sandbox's lingering namespace and
        the paused record other nodes may adopt would both still carry the old one."""

        async def work() -> SandboxView:
            rec = self._lifecycle.existing(sandbox_id)
            if rec.state != SandboxState.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is paused: resume it to change its network")
            try:
                await self.network.update_policy(rec.slot, egress)
            except NetworkError as exc:
                raise OperationFailed(
                    f"changing the network of {sandbox_id} failed: {exc}"
                ) from exc
            rec.network = rec.network.with_egress(egress)
            self.store.set_network(sandbox_id, rec.network)
            return self._queries.view(rec)

        return await self._operations.run(sandbox_id, "network", work, join=False)

    async def kill(self, sandbox_id: str) -> None:
        """Remove a sandbox, after any operation in progress on it; joins a kill already
        in progress."""
        await self._operations.run(
            sandbox_id, "kill", lambda: self._lifecycle.kill(sandbox_id), join=True
        )
        self._operations.forget(sandbox_id)

    # -- expiry --------------------------------------------------------------------------
    async def reap_expired(self, now: datetime | None = None) -> list[str]:
        now = now or utcnow()
        expired = [
            r
            for r in self.store.list_sandboxes()
            if r.state == SandboxState.RUNNING and r.end_at <= now
        ]
        for rec in expired:
            log.info("sandbox %s reached its timeout", rec.sandbox_id)
            if rec.auto_pause:
                try:
                    await self.pause(rec.sandbox_id)
                    continue
                except (SandboxNotFound, Conflict):
                    continue
                except (OperationFailed, GuestUnavailable) as exc:
                    # Killing would lose what the user asked to keep: it stays running
                    # and the pause is tried again a minute later.
                    log.error(
                        "auto-pause of %s failed (%s); retrying in %ds",
                        rec.sandbox_id,
                        exc,
                        AUTO_PAUSE_RETRY_S,
                    )
                    self.store.update_sandbox(
                        rec.sandbox_id, end_at=now + timedelta(seconds=AUTO_PAUSE_RETRY_S)
                    )
                    continue
            with contextlib.suppress(SandboxNotFound):
                await self.kill(rec.sandbox_id)
        return [r.sandbox_id for r in expired]

    async def _reap(self) -> None:
        await self.reap_expired()

    # -- other nodes -----------------------------------------------------------------------
    async def check_handoffs(self) -> None:
        """Drop paused sandboxes that another node has resumed since."""
        await self._sync.check_handoffs()

    def pending_upload(self, sandbox_id: str) -> asyncio.Task[None] | None:
        """The paused sandbox's upload to the repository, while it runs."""
        return self._supervisor.job("upload", sandbox_id)
