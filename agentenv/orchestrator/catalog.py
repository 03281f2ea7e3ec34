"""The orchestrator's view of the snapshot repository: what is committed (snapshots,
templates, paused sandboxes), committing to it, and fetching from it into the node cache.

Records live under ``catalog/snapshot/<id>`` (snapshots and templates: one namespace, a
``type`` field tells them apart; names map to ids), ``catalog/paused/<sandbox id>``,
``catalog/pausing/<sandbox id>`` (a node paused that sandbox and its commit is on its way)
and ``catalog/secret/<id>`` (secrets, encrypted by ``orchestrator/secrets.py``; their
names are ``secret:<name>``). A template name's tags other than ``default`` (which is the
name itself) live under ``catalog/tags/<name>/<tag>``, each pointing at one of the name's
builds; ``name:tag`` is looked up wherever an id or name is (see :mod:`.tags`).
A commit pushes every blob first and writes the record last, so a crash or an
unreachable repository mid-commit leaves the previous state. A paused sandbox is held
by one node at a time: whoever resumes generation ``g`` of it first claims
``claim:<id>:<g>`` (create-only), and a node whose claim lost drops its stale copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from agentenv.config import Config
from agentenv.orchestrator.errors import (
    CommitPending,
    Conflict,
    InvalidRequest,
    NodeCacheFull,
    OutOfSpace,
    RepositoryUnavailable,
)
from agentenv.orchestrator.records import (
    MalformedRecord,
    PausedEntry,
    PendingPause,
    SecretEntry,
    SnapshotEntry,
    TagEntry,
    VolumeEntry,
)
from agentenv.orchestrator.store import utcnow
from agentenv.orchestrator.tags import DEFAULT_TAG, family_of, parse_tagged
from agentenv.snapshots.cache import CacheFull, NodeCache
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError
from agentenv.snapshots.leases import CollectionBusy
from agentenv.snapshots.objects import RepositoryError, RepositoryFull, open_store
from agentenv.snapshots.publish import DigestMemo, Fetcher, KnownChunks, Published, Publisher
from agentenv.snapshots.repository import InvalidName, Repository

log = logging.getLogger("agentenv.catalog")

T = TypeVar("T")

SNAPSHOTS = "snapshot"
PAUSED = "paused"
PAUSING = "pausing"
# How often a connect waiting for another node's commit looks again.
COMMIT_POLL_S = 0.25
SECRETS = "secret"
VOLUMES = "volume"


async def _guard(what: str, work: Awaitable[T]) -> T:
    try:
        return await work
    except CacheFull as exc:
        raise NodeCacheFull(f"{what}: {exc}") from exc
    except InvalidName as exc:
        raise InvalidRequest(str(exc)) from exc
    except RepositoryFull as exc:
        raise OutOfSpace(what, str(exc)) from exc
    except RepositoryError as exc:
        raise RepositoryUnavailable(f"{what}: {exc}") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # This node's own files (its cache, a staging copy): no room here either.
            raise OutOfSpace(what, str(exc)) from exc
        raise RepositoryUnavailable(f"{what}: {exc}") from exc
    except (SnapshotError, MalformedRecord) as exc:
        raise RepositoryUnavailable(f"{what}: {exc}") from exc


class Catalog:
    def __init__(self, config: Config, pinned: Callable[[], set[str]]) -> None:
        self.config = config
        self.node = config.node_name
        self.repository = Repository(open_store(config.repository_url, config.s3))
        self.cache = NodeCache(config.cache_dir, config.cache_bytes)
        self.memo = DigestMemo(config.cache_dir / "digests.json")
        self.publisher = Publisher(
            self.repository,
            self.memo,
            config.image_cache,
            KnownChunks(config.cache_dir / "known-chunks.json"),
        )
        self.fetcher = Fetcher(self.repository, self.cache, self.memo, config.image_cache, pinned)
        self._fetching: dict[str, asyncio.Lock] = {}

    def startup(self) -> None:
        self.config.cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache.load()
        # Half-fetched snapshot directories of a previous run.
        snaps = self.config.cache_dir / "snapshots"
        if snaps.exists():
            for path in snaps.glob(".staging-*"):
                shutil.rmtree(path, ignore_errors=True)

    @property
    def url(self) -> str:
        return self.repository.url

    # -- snapshots and templates -------------------------------------------------------
    async def lookup(self, key: str) -> SnapshotEntry | None:
        """The committed snapshot or template with id or name ``key``, or the build a
        template's tag names (``name:tag``, ``name:<build id>``): an id or a name holding
        ``:`` (a snapshot's may) comes first."""

        async def find() -> SnapshotEntry | None:
            record = await self.repository.get_record(SNAPSHOTS, key) if _is_id(key) else None
            if record is None:
                target = await self.repository.resolve_name(key)
                if target is None:
                    return await self._tagged(key)
                record = await self.repository.get_record(SNAPSHOTS, target)
            return None if record is None else SnapshotEntry.from_wire(record)

        return await _guard(f"looking up {key!r} in the repository", find())

    async def _tagged(self, key: str) -> SnapshotEntry | None:
        parsed = parse_tagged(key)
        if parsed is None:
            return None
        name, tag, build_id = parsed
        if build_id is not None:
            record = await self.repository.get_record(SNAPSHOTS, build_id)
        elif tag == DEFAULT_TAG:
            target = await self.repository.resolve_name(name)
            record = None if target is None else await self.repository.get_record(SNAPSHOTS, target)
        else:
            doc = await self.repository.get_tag(name, tag)
            target = None if doc is None else TagEntry.from_wire(doc).target
            record = None if target is None else await self.repository.get_record(SNAPSHOTS, target)
        if record is None:
            return None
        entry = SnapshotEntry.from_wire(record)
        # A tag names one of its template's builds; a build id only one of the name's.
        return entry if family_of(entry) == name else None

    async def resolve_tag(self, name: str, tag: str) -> SnapshotEntry | None:
        """The build tag ``tag`` of template ``name`` points at (``default``: the name)."""
        return await _guard(f"looking up {name}:{tag}", self._tagged(f"{name}:{tag}"))

    async def tags(self, name: str) -> list[TagEntry]:
        """The tags of template ``name`` other than ``default``, in tag order."""

        async def work() -> list[TagEntry]:
            entries = []
            for doc in await self.repository.list_tags(name):
                try:
                    entries.append(TagEntry.from_wire(doc))
                except MalformedRecord as exc:
                    log.warning("skipping a tag of the repository: %s", exc)
            return entries

        return await _guard(f"listing the tags of {name!r}", work())

    async def set_tags(self, name: str, tags: list[str], target: str) -> None:
        """Point ``tags`` of template ``name`` at its build ``target`` (``default``:
        the name itself moves)."""

        async def work() -> None:
            now = utcnow()
            for tag in tags:
                if tag == DEFAULT_TAG:
                    await self.repository.set_name(name, target)
                else:
                    entry = TagEntry(name=name, tag=tag, target=target, assigned_at=now)
                    await self.repository.set_tag(name, tag, entry.to_wire())

        await _guard(f"tagging {target}", work())

    async def drop_tags(self, name: str, tags: list[str]) -> None:
        async def work() -> None:
            for tag in tags:
                await self.repository.drop_tag(name, tag)

        await _guard(f"removing tags of {name!r}", work())

    async def list_records(self, type_: str | None = None) -> list[SnapshotEntry]:
        records = await _guard("listing the repository", self.repository.list_records(SNAPSHOTS))
        entries = []
        for record in records:
            if type_ is not None and record.get("type") != type_:
                continue
            try:
                entries.append(SnapshotEntry.from_wire(record))
            except MalformedRecord as exc:
                log.warning("skipping a record of the repository: %s", exc)
        return entries

    async def name_holder(self, name: str) -> str | None:
        return await _guard("reading names", self.repository.resolve_name(name))

    @contextlib.asynccontextmanager
    async def commit_lease(self) -> AsyncIterator[None]:
        """Held from a commit's first push until its record is written, so that no
        garbage collection on any node sweeps meanwhile (see
        :mod:`agentenv.snapshots.leases`); it waits while one runs."""
        lease = self.repository.commit_lease(self.node)
        await _guard("waiting for the repository's garbage collection", lease.__aenter__())
        try:
            yield
        finally:
            await lease.__aexit__(None, None, None)

    async def publish(self, snap: MachineSnapshot, **files: Path | None) -> Published:
        return await _guard(
            f"pushing snapshot {snap.directory.name}", self.publisher.publish(snap, **files)
        )

    async def commit(self, entry: SnapshotEntry, *, replace_names: bool = False) -> None:
        """Write a snapshot record (its blobs already pushed), then its names. With
        ``replace_names`` a name moves to this record (a template rebuilt under its
        name); otherwise a name held by another record is a conflict."""
        names, snapshot_id = entry.names, entry.id

        async def work() -> None:
            for name in names:
                holder = await self.repository.resolve_name(name)
                if holder not in (None, snapshot_id) and not replace_names:
                    raise Conflict(f"name {name!r} is taken by {holder}")
            await self.repository.put_record(SNAPSHOTS, snapshot_id, entry.to_wire())
            for name in names:
                if replace_names:
                    await self.repository.set_name(name, snapshot_id)
                elif not await self.repository.claim_name(name, snapshot_id):
                    # Lost a race for the name: the record goes without it.
                    nameless = entry.model_copy(update={"names": []})
                    await self.repository.put_record(SNAPSHOTS, snapshot_id, nameless.to_wire())
                    raise Conflict(f"name {name!r} was taken meanwhile")

        await _guard(f"committing {snapshot_id}", work())

    async def collect_garbage_if_due(self) -> None:
        """The automatic garbage collection (every ``repository_gc_interval`` seconds
        on each node): skipped when another node collected less than an interval ago or
        is collecting now; safe while other nodes commit (see
        :mod:`agentenv.snapshots.leases`)."""
        interval = self.config.repository_gc_interval
        try:
            since = await self.repository.seconds_since_collection()
            if since is not None and since < 0.9 * interval:
                return
            removed = await self.repository.collect_garbage(
                grace_s=self.config.repository_gc_grace, holder=self.node
            )
        except CollectionBusy as exc:
            log.info("garbage collection skipped: %s", exc)
            return
        except RepositoryError as exc:
            log.warning("garbage collection failed: %s", exc)
            return
        log.info(
            "garbage collection of %s removed %d blobs and %d chunks",
            self.repository.url,
            *removed,
        )

    async def delete(self, entry: SnapshotEntry) -> None:
        async def work() -> None:
            for name in entry.names:
                await self.repository.drop_name(name, expected_target=entry.id)
            await self.repository.delete_record(SNAPSHOTS, entry.id)

        await _guard(f"deleting {entry.id}", work())
        self.cache.remove(f"snap:{entry.id}")

    async def fetch(self, entry: SnapshotEntry, say: Callable[[str], None]) -> MachineSnapshot:
        """The local, restorable copy of committed snapshot ``entry`` (fetched into the
        cache unless it is there already)."""
        snapshot_id = entry.id
        key = f"snap:{snapshot_id}"
        lock = self._fetching.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self.cache.get(key)
            if cached is not None:
                try:
                    return MachineSnapshot.load(cached)
                except SnapshotError:
                    self.cache.remove(key)
            directory = self.config.cache_dir / "snapshots" / snapshot_id
            snap = await _guard(
                f"fetching {snapshot_id}",
                self.fetcher.materialise(
                    entry.manifest, entry.blobs, directory, top_shared=True, say=say
                ),
            )
            self.cache.add(key, directory)
            return snap

    # -- paused sandboxes --------------------------------------------------------------
    async def put_paused(self, entry: PausedEntry) -> None:
        await _guard(
            f"committing paused {entry.sandbox_id}",
            self.repository.put_record(PAUSED, entry.sandbox_id, entry.to_wire()),
        )

    async def get_paused(self, sandbox_id: str) -> PausedEntry | None:
        if not _is_id(sandbox_id):
            return None

        async def find() -> PausedEntry | None:
            record = await self.repository.get_record(PAUSED, sandbox_id)
            return None if record is None else PausedEntry.from_wire(record)

        return await _guard(f"looking up {sandbox_id}", find())

    async def drop_paused(self, sandbox_id: str) -> None:
        await _guard(
            f"removing paused {sandbox_id}", self.repository.delete_record(PAUSED, sandbox_id)
        )

    async def put_pending(self, pending: PendingPause) -> None:
        await _guard(
            f"announcing the pause of {pending.sandbox_id}",
            self.repository.put_record(PAUSING, pending.sandbox_id, pending.to_wire()),
        )

    async def get_pending(self, sandbox_id: str) -> PendingPause | None:
        if not _is_id(sandbox_id):
            return None

        async def find() -> PendingPause | None:
            record = await self.repository.get_record(PAUSING, sandbox_id)
            return None if record is None else PendingPause.from_wire(record)

        return await _guard(f"looking up the pause of {sandbox_id}", find())

    async def drop_pending(self, sandbox_id: str) -> None:
        await _guard(
            f"removing the pause of {sandbox_id}",
            self.repository.delete_record(PAUSING, sandbox_id),
        )

    async def committed_pause(self, sandbox_id: str, wait: float) -> PausedEntry | None:
        """The sandbox's committed pause record; when another node announced a later
        pause of it (:meth:`put_pending`), once that one is committed (looked for every
        ``COMMIT_POLL_S``). :class:`CommitPending` if it is not within ``wait`` seconds;
        None when the repository holds no pause of it."""
        started = time.monotonic()
        while True:
            # The announcement first: a committing node writes the paused record before
            # it drops the announcement, so a record read after an announcement found
            # gone includes that commit (read the other way round, a commit landing in
            # between looked like no pause at all).
            pending = await self.get_pending(sandbox_id)
            entry = await self.get_paused(sandbox_id)
            if (
                pending is None
                or pending.node == self.node
                or (entry is not None and entry.generation >= pending.generation)
            ):
                return entry
            waited = time.monotonic() - started
            if waited >= wait:
                raise CommitPending(sandbox_id, pending.node, waited)
            await asyncio.sleep(min(COMMIT_POLL_S, wait - waited))

    async def claim(self, sandbox_id: str, generation: int) -> bool:
        """Take generation ``generation`` of a paused sandbox for this node; False if
        another node took it first."""

        async def work() -> bool:
            name = _claim_name(sandbox_id, generation)
            if await self.repository.claim_name(name, self.node):
                return True
            return await self.repository.resolve_name(name) == self.node

        return await _guard(f"claiming {sandbox_id}", work())

    async def holder(self, sandbox_id: str, generation: int) -> str | None:
        return await _guard(
            f"reading the holder of {sandbox_id}",
            self.repository.resolve_name(_claim_name(sandbox_id, generation)),
        )

    async def materialise_paused(
        self, entry: PausedEntry, directory: Path, say: Callable[[str], None]
    ) -> MachineSnapshot:
        return await _guard(
            f"fetching paused {entry.sandbox_id}",
            self.fetcher.materialise(
                entry.manifest, entry.blobs, directory, top_shared=False, say=say
            ),
        )

    # -- secrets -----------------------------------------------------------------------
    async def put_secret(self, entry: SecretEntry) -> None:
        await _guard(
            f"writing secret {entry.id}",
            self.repository.put_record(SECRETS, entry.id, entry.to_wire()),
        )

    async def get_secret(self, secret_id: str) -> SecretEntry | None:
        async def find() -> SecretEntry | None:
            record = await self.repository.get_record(SECRETS, secret_id)
            return None if record is None else SecretEntry.from_wire(record)

        return await _guard(f"reading secret {secret_id}", find())

    async def secret_named(self, name: str) -> str | None:
        """The id the secret name ``name`` points at, if any."""
        return await _guard(
            "reading secret names", self.repository.resolve_name(_secret_name(name))
        )

    async def claim_secret_name(self, name: str, secret_id: str, *, replace: bool) -> bool:
        """Point ``name`` at ``secret_id``: create-only (False if it is taken), or
        unconditionally with ``replace`` (a name left by a create that crashed)."""

        async def work() -> bool:
            if replace:
                await self.repository.set_name(_secret_name(name), secret_id)
                return True
            return await self.repository.claim_name(_secret_name(name), secret_id)

        return await _guard(f"claiming secret name {name!r}", work())

    async def list_secrets(self) -> list[SecretEntry]:
        records = await _guard("listing secrets", self.repository.list_records(SECRETS))
        entries = []
        for record in records:
            try:
                entries.append(SecretEntry.from_wire(record))
            except MalformedRecord as exc:
                log.warning("skipping a secret record of the repository: %s", exc)
        return entries

    async def delete_secret(self, entry: SecretEntry) -> None:
        """Remove the record first (the value is gone at once), then the name."""

        async def work() -> None:
            await self.repository.delete_record(SECRETS, entry.id)
            await self.repository.drop_name(_secret_name(entry.name), expected_target=entry.id)

        await _guard(f"deleting secret {entry.id}", work())

    # -- volumes -----------------------------------------------------------------------
    async def add_volume(self, entry: VolumeEntry) -> None:
        """Record a new volume under its name; a name another volume holds is a
        conflict (the record is written only once the name is claimed)."""

        async def work() -> None:
            if not await self.repository.claim_name(_volume_name(entry.name), entry.id):
                raise Conflict(f"a volume named {entry.name!r} already exists")
            await self.repository.put_record(VOLUMES, entry.id, entry.to_wire())

        await _guard(f"creating volume {entry.name!r}", work())

    async def get_volume(self, key: str, *, by_name: bool = False) -> VolumeEntry | None:
        async def find() -> VolumeEntry | None:
            volume_id = await self.repository.resolve_name(_volume_name(key)) if by_name else key
            if volume_id is None or not _is_id(volume_id):
                return None
            record = await self.repository.get_record(VOLUMES, volume_id)
            return None if record is None else VolumeEntry.from_wire(record)

        return await _guard(f"looking up volume {key!r}", find())

    async def list_volumes(self) -> list[VolumeEntry]:
        records = await _guard("listing volumes", self.repository.list_records(VOLUMES))
        entries = []
        for record in records:
            try:
                entries.append(VolumeEntry.from_wire(record))
            except MalformedRecord as exc:
                log.warning("skipping a volume record: %s", exc)
        return entries

    async def put_volume(self, entry: VolumeEntry) -> None:
        await _guard(
            f"updating volume {entry.name!r}",
            self.repository.put_record(VOLUMES, entry.id, entry.to_wire()),
        )

    async def claim_volume(self, volume_id: str) -> str | None:
        """Take the writer's claim on a volume for this node (``claim:volume:<id>``):
        ``None`` once this node has it, else the node that does."""

        async def work() -> str | None:
            name = _volume_claim_name(volume_id)
            for _ in range(3):
                if await self.repository.claim_name(name, self.node):
                    return None
                holder = await self.repository.resolve_name(name)
                if holder is not None:
                    return None if holder == self.node else holder
            raise RepositoryUnavailable(f"the claim on volume {volume_id} keeps changing")

        return await _guard(f"claiming volume {volume_id}", work())

    async def volume_writer(self, volume_id: str) -> str | None:
        """The node holding the writer's claim on a volume, if one does."""
        return await _guard(
            f"reading the claim on volume {volume_id}",
            self.repository.resolve_name(_volume_claim_name(volume_id)),
        )

    async def release_volume(self, volume_id: str) -> None:
        await _guard(
            f"releasing volume {volume_id}",
            self.repository.drop_name(_volume_claim_name(volume_id), expected_target=self.node),
        )

    async def push_volume_image(self, image: Path) -> str:
        """The image as a blob of the repository (its changed chunks pushed): its
        digest. Under a commit lease, so no collection sweeps it before its record
        names it."""
        async with self.commit_lease():
            return await _guard(f"pushing {image.name}", self.repository.push_file(image))

    async def pull_volume_image(self, digest: str, dest: Path) -> None:
        await _guard(f"fetching {dest.name}", self.repository.pull_file(digest, dest))

    async def drop_volume(self, entry: VolumeEntry) -> None:
        async def work() -> None:
            await self.repository.delete_record(VOLUMES, entry.id)
            await self.repository.drop_name(_volume_name(entry.name), expected_target=entry.id)

        await _guard(f"destroying volume {entry.id}", work())


#: Names the catalog gives its own records in the namespace snapshot and template names
#: share (``claim:<id>:<generation>``, ``secret:<name>``, ``volume:<name>``): a snapshot
#: or template may not take one, or it could block a resume's claim or a secret's or a
#: volume's name.
RESERVED_NAMESPACES = frozenset({"claim", "secret", "volume"})


def check_user_name(name: str) -> None:
    """:class:`InvalidRequest` for a snapshot or template name in a reserved namespace."""
    if name.partition(":")[0] in RESERVED_NAMESPACES:
        raise InvalidRequest(
            f"the name {name!r} is reserved: names may not be or begin with "
            + ", ".join(f"{space!r}:" for space in sorted(RESERVED_NAMESPACES))
        )


def _volume_name(name: str) -> str:
    return f"volume:{name}"


def _volume_claim_name(volume_id: str) -> str:
    return f"claim:volume:{volume_id}"


def _claim_name(sandbox_id: str, generation: int) -> str:
    return f"claim:{sandbox_id}:{generation}"


def _secret_name(name: str) -> str:
    return f"secret:{name}"


def _is_id(key: str) -> bool:
    # ASCII only, as the repository's record ids: "é" is a letter to str.isalnum, and
    # looking it up as an id made the repository refuse it with a ValueError (a 500).
    return bool(key) and all((c.isascii() and c.isalnum()) or c in "._:-" for c in key)
