"""What sandboxes start from: a template id or name, or a snapshot id or name, turned
into a restorable machine snapshot on this node (built, local, or fetched from the
repository into the node cache); and the source a recorded sandbox came from.

Owns no state. Marks a local snapshot deleted when the repository says another node
deleted it. Refuses a source saved under another mode than the node's
(:class:`~.errors.ModeMismatch`, see :mod:`.modes`), a repository one before fetching it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.errors import (
    OperationFailed,
    RepositoryUnavailable,
    SandboxStartFailed,
    TagNotFound,
    TemplateNotFound,
)
from agentenv.orchestrator.layout import SnapshotDir
from agentenv.orchestrator.modes import Mode
from agentenv.orchestrator.resources import FilePins
from agentenv.orchestrator.store import SandboxRecord, SnapshotRecord, Store
from agentenv.orchestrator.tags import DEFAULT_TAG, parse_tagged
from agentenv.orchestrator.templates import BUILTIN_TEMPLATES, TemplateManager
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError

log = logging.getLogger("agentenv.orchestrator")

# Local snapshot kinds that are committed to the repository and start sandboxes.
SHAREABLE_KINDS = ("snapshot", "template")


@dataclass(frozen=True)
class Source:
    """What a new sandbox starts from: a template build, a snapshot or a fork image."""

    template_id: str
    build_id: str
    snapshot: MachineSnapshot
    snapshot_id: str | None


class Sources:
    def __init__(
        self,
        templates_dir: Path,
        store: Store,
        templates: TemplateManager,
        catalog: Catalog,
        pins: FilePins,
        mode: Mode,
    ) -> None:
        self.templates_dir = templates_dir
        self.mode = mode
        self.store = store
        self.templates = templates
        self.catalog = catalog
        self.pins = pins

    async def resolve(self, template_id: str) -> Source:
        """A template id or name, or a snapshot id or name: all start sandboxes. The
        built-in templates are built on each node; everything else is the repository's
        (which is authoritative: a snapshot deleted on another node is gone here too),
        from this node's own copy when it has one, else fetched into the node cache.
        :class:`ModeMismatch` for one saved under another mode than this node's."""
        source = await self._resolve(template_id)
        self.check_mode(source)
        return source

    def check_mode(self, source: Source) -> None:
        """:class:`ModeMismatch` unless ``source`` was saved under this node's mode."""
        what = (
            f"template {source.template_id}"
            if source.snapshot_id is None
            else f"snapshot {source.snapshot_id}"
        )
        self.mode.require(what, Mode.of_files(source.snapshot.files))

    async def _resolve(self, template_id: str) -> Source:
        if template_id in BUILTIN_TEMPLATES:
            return await self._template(template_id)
        local = self.store.get_snapshot(template_id)
        if local is not None and not _usable(local):
            local = None
        if local is not None and not SnapshotDir(local.snapshot_dir).committed():
            # Not in the repository yet (its commit is under way): this node's copy.
            return self.local(local)
        try:
            record = await self.catalog.lookup(template_id)
        except RepositoryUnavailable as exc:
            if local is None:
                raise
            log.warning("using local copy of %s: %s", template_id, exc)
            return self.local(local)
        if record is None:
            if local is not None:
                # Deleted from the repository by another node: forget it here too.
                self.store.update_snapshot(local.snapshot_id, state="deleted", name=None)
                self.pins.collect_snapshots()
            if self.store.get_template(template_id) is not None:
                return await self._template(template_id)
            await self._check_tag(template_id)
            raise TemplateNotFound(template_id)
        if local is None or local.snapshot_id != record.id:
            # Named otherwise here (a tag, a name that moved): this node's copy still.
            local = self.store.get_snapshot(record.id)
        if local is not None and local.snapshot_id == record.id and _usable(local):
            return self.local(local)
        # Before the fetch: what cannot be restored here is not worth the transfer.
        self.mode.require(f"{record.type} {record.id}", Mode.of_manifest(record.manifest))
        snapshot = await self.catalog.fetch(
            record, lambda line: log.info("fetching %s: %s", record.id, line)
        )
        return Source(record.id, record.id, snapshot, record.id)

    async def _check_tag(self, template_id: str) -> None:
        """:class:`TagNotFound` (404, as E2B answers) for ``name:tag`` naming a
        template that exists and a tag it does not have."""
        parsed = parse_tagged(template_id)
        if parsed is None or parsed[2] is not None:
            return
        name, tag, _ = parsed
        if await self.catalog.resolve_tag(name, DEFAULT_TAG) or await self.catalog.tags(name):
            raise TagNotFound(f"tag {tag!r} does not exist for template {name!r}")

    async def _template(self, template_id: str) -> Source:
        template = await self.templates.get(template_id)
        return Source(
            template.record.template_id, template.record.build_id, template.snapshot, None
        )

    @staticmethod
    def local(rec: SnapshotRecord) -> Source:
        try:
            snapshot = MachineSnapshot.load(rec.snapshot_dir)
        except SnapshotError as exc:
            raise SandboxStartFailed(f"snapshot {rec.snapshot_id}: {exc}") from exc
        key = rec.snapshot_id
        return Source(key, key, snapshot, key)

    def of_sandbox(self, rec: SandboxRecord) -> MachineSnapshot:
        """The machine snapshot a recorded sandbox started from."""
        directory = rec.source_dir or (self.templates_dir / rec.template_id / rec.template_build_id)
        try:
            return MachineSnapshot.load(directory)
        except SnapshotError as exc:
            raise OperationFailed(f"source of sandbox {rec.sandbox_id}: {exc}") from exc


def _usable(rec: SnapshotRecord) -> bool:
    """A local snapshot that starts sandboxes (not a fork image, not deleted)."""
    return rec.kind in SHAREABLE_KINDS and rec.state == "ready"
