"""The durable snapshot repository: a catalog of records and names over an object store,
plus the content-addressed blobs the records point at.

Layout under the store's root::

    catalog/<kind>/<id>.json      a record (any JSON object), replaced atomically
    catalog/names/<name>.json     {"target": ..., "name": ...}: a name pointing at a target
    catalog/tags/<name>/<tag>.json  {"target": ..., "name": ..., "tag": ...}: a tag of a
                                  template name pointing at one of its builds
    blobs/<hex>.json, chunks/...  file blobs (see :mod:`agentenv.snapshots.blobs`)

Records reference blobs through a top-level ``"blobs": {role: digest}`` mapping; that is
what :meth:`Repository.collect_garbage` follows. Names are claimed with a create-only
write, so of two nodes claiming one name exactly one wins.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
from collections.abc import MutableSet
from pathlib import Path
from typing import Any
from urllib.parse import quote

from agentenv.limits import MAX_TEMPLATE_REF_LENGTH
from agentenv.snapshots import blobs
from agentenv.snapshots.leases import CollectionLock, CommitLease
from agentenv.snapshots.objects import ObjectNotFound, ObjectStore, RepositoryError

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")
_KIND_RE = re.compile(r"[A-Za-z0-9_-]+")
_NAMES = "names"
_TAGS = "tags"
_TAG_RE = re.compile(r"[a-z0-9._-]{1,128}")
# The API refuses longer names (agentenv.limits), so what it accepts can be stored.
_MAX_NAME = MAX_TEMPLATE_REF_LENGTH
# Longer quoted names would overflow file name (255) and S3 key (1024) limits; they are
# stored under their hash instead. quote() always escapes "+", so no quoted name can
# look like a hashed one.
_MAX_QUOTED = 200
# Records fetched at once by list_records.
_PARALLEL = 8


GC_EPOCH_KEY = "gc-epoch"


def _check_id(record_id: str) -> None:
    if not isinstance(record_id, str) or not _ID_RE.fullmatch(record_id):
        raise ValueError(f"invalid record id {record_id!r} (allowed: A-Z a-z 0-9 . _ : -)")


def _check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind) or kind in (_NAMES, _TAGS):
        raise ValueError(f"invalid record kind {kind!r}")


class InvalidName(ValueError):
    """A snapshot name the repository cannot hold (a caller's mistake, not an outage)."""


def _name_key(name: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or len(name) > _MAX_NAME
        or "\0" in name
        or name.startswith("/")
    ):
        raise InvalidName(f"invalid name {name!r} (1-{_MAX_NAME} characters, no NUL or leading /)")
    quoted = quote(name, safe="")
    if len(quoted) > _MAX_QUOTED:
        quoted = "+" + hashlib.sha256(name.encode()).hexdigest()
    return f"catalog/{_NAMES}/{quoted}.json"


def _name_segment(name: str) -> str:
    return _name_key(name).removeprefix(f"catalog/{_NAMES}/").removesuffix(".json")


def _tags_prefix(name: str) -> str:
    segment = _name_segment(name)
    if segment in (".", ".."):  # a file name in catalog/names/, not a directory here
        segment = "+" + hashlib.sha256(name.encode()).hexdigest()
    return f"catalog/{_TAGS}/{segment}/"


def _tag_key(name: str, tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or tag in (".", ".."):
        raise InvalidName(f"invalid tag {tag!r} (1-128 of a-z 0-9 . _ -)")
    return f"{_tags_prefix(name)}{tag}.json"


def _record_key(kind: str, record_id: str) -> str:
    _check_kind(kind)
    _check_id(record_id)
    return f"catalog/{kind}/{record_id}.json"


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def _decode(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise RepositoryError(f"{where}: unreadable JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise RepositoryError(f"{where}: not a JSON object")
    return doc


def referenced_digests(record: dict[str, Any]) -> set[str]:
    """The blob digests a record references (values of its top-level ``blobs`` map)."""
    refs = record.get("blobs")
    if not isinstance(refs, dict):
        return set()
    return {d for d in refs.values() if isinstance(d, str) and d.startswith("sha256:")}


class Repository:
    """Records, names and blobs in one object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @property
    def url(self) -> str:
        return self.store.url

    # Records ----------------------------------------------------------------------

    async def put_record(self, kind: str, record_id: str, record: dict[str, Any]) -> None:
        await self.store.put_bytes(_record_key(kind, record_id), _encode(record))

    async def get_record(self, kind: str, record_id: str) -> dict[str, Any] | None:
        key = _record_key(kind, record_id)
        try:
            data = await self.store.get_bytes(key)
        except ObjectNotFound:
            return None
        return _decode(data, f"{self.url}/{key}")

    async def list_records(self, kind: str) -> list[dict[str, Any]]:
        """Every record of ``kind``, in id order."""
        _check_kind(kind)
        return list((await self._records(f"catalog/{kind}/")).values())

    async def _records(self, prefix: str) -> dict[str, dict[str, Any]]:
        keys = [k for k in await self.store.list(prefix) if k.endswith(".json")]
        slots = asyncio.Semaphore(_PARALLEL)

        async def fetch(key: str) -> dict[str, Any] | None:
            async with slots:
                try:
                    data = await self.store.get_bytes(key)
                except ObjectNotFound:  # deleted since it was listed
                    return None
            return _decode(data, f"{self.url}/{key}")

        docs = await asyncio.gather(*(fetch(k) for k in keys))
        return {k: d for k, d in zip(keys, docs, strict=True) if d is not None}

    async def delete_record(self, kind: str, record_id: str) -> None:
        await self.store.delete(_record_key(kind, record_id))

    # Names ------------------------------------------------------------------------

    async def claim_name(self, name: str, target: str) -> bool:
        """Point ``name`` at ``target`` unless it already exists. True if it was claimed
        now or already points at ``target``."""
        key = _name_key(name)
        body = _encode({"target": target, "name": name})
        for _ in range(3):
            if await self.store.put_bytes_if_absent(key, body):
                return True
            current = await self.resolve_name(name)
            if current is not None:
                return current == target
            # Dropped between our attempt and the read: try again.
        return False

    async def set_name(self, name: str, target: str) -> None:
        await self.store.put_bytes(_name_key(name), _encode({"target": target, "name": name}))

    async def resolve_name(self, name: str) -> str | None:
        key = _name_key(name)
        try:
            data = await self.store.get_bytes(key)
        except ObjectNotFound:
            return None
        target = _decode(data, f"{self.url}/{key}").get("target")
        if not isinstance(target, str):
            raise RepositoryError(f"{self.url}/{key}: name without a target")
        return target

    async def drop_name(self, name: str, expected_target: str | None = None) -> None:
        """Delete ``name``; when ``expected_target`` is given, only if it still points
        there. (Check and delete are two requests: a claim landing between them is lost.
        Object stores offer no portable conditional delete.)"""
        key = _name_key(name)
        if expected_target is not None and await self.resolve_name(name) != expected_target:
            return
        await self.store.delete(key)

    # Tags -------------------------------------------------------------------------

    async def set_tag(self, name: str, tag: str, doc: dict[str, Any]) -> None:
        """Point tag ``tag`` of name ``name`` where ``doc`` (which says ``target``)
        says, replacing what it pointed at."""
        await self.store.put_bytes(_tag_key(name, tag), _encode({**doc, "name": name, "tag": tag}))

    async def get_tag(self, name: str, tag: str) -> dict[str, Any] | None:
        key = _tag_key(name, tag)
        try:
            data = await self.store.get_bytes(key)
        except ObjectNotFound:
            return None
        return _decode(data, f"{self.url}/{key}")

    async def list_tags(self, name: str) -> list[dict[str, Any]]:
        """Every tag of name ``name``, in tag order."""
        return list((await self._records(_tags_prefix(name))).values())

    async def drop_tag(self, name: str, tag: str) -> None:
        await self.store.delete(_tag_key(name, tag))

    # Blobs ------------------------------------------------------------------------

    async def push_file(
        self,
        path: Path,
        progress: blobs.Progress | None = None,
        *,
        chunk_size: int = blobs.CHUNK_SIZE,
        known: MutableSet[str] | None = None,
    ) -> str:
        return await blobs.push_file(
            self.store, path, chunk_size=chunk_size, progress=progress, known=known
        )

    async def pull_file(
        self, digest: str, dest: Path, progress: blobs.Progress | None = None
    ) -> None:
        await blobs.pull_file(self.store, digest, dest, progress=progress)

    async def blob_exists(self, digest: str) -> bool:
        return await blobs.blob_exists(self.store, digest)

    async def blob_size(self, digest: str) -> int:
        return await blobs.blob_size(self.store, digest)

    # Garbage collection -------------------------------------------------------------

    async def gc_epoch(self) -> str:
        """Changes whenever garbage collection runs: chunks known to be stored before
        may be gone after."""
        try:
            return (await self.store.get_bytes(GC_EPOCH_KEY)).decode()
        except ObjectNotFound:
            return ""

    async def seconds_since_collection(self) -> float | None:
        """How long ago the last garbage collection started (by this host's clock), or
        None if none has run or the store cannot tell."""
        try:
            return await self.store.age(GC_EPOCH_KEY)
        except ObjectNotFound:
            return None

    async def _old_enough(self, key: str, grace_s: float) -> bool:
        if grace_s <= 0:
            return True
        try:
            age = await self.store.age(key)
        except ObjectNotFound:
            return False
        # A store that cannot tell ages gets no grace.
        return age is None or age >= grace_s

    def commit_lease(self, holder: str, *, wait_s: float = 600.0) -> CommitLease:
        """Held (``async with``) from a commit's first push until its record is written,
        so that no garbage collection sweeps meanwhile: see
        :mod:`agentenv.snapshots.leases`."""
        return CommitLease(self.store, holder, wait_s=wait_s)

    async def collect_garbage(
        self,
        *,
        grace_s: float = 3600,
        holder: str = "aenv-server --collect-garbage",
        wait_s: float = 600.0,
        poll_s: float = 2.0,
    ) -> tuple[int, int]:
        """Delete blob manifests no record references, then chunks no remaining manifest
        lists; objects written less than ``grace_s`` ago are kept (a commit that has
        pushed its blobs but not yet written its record). Returns (blobs removed, chunks
        removed).

        Safe while other nodes commit: it runs under the collection lock, once no push
        holds a commit lease (waiting up to ``wait_s``), so no push can come to rely on a
        chunk it deletes. :class:`~agentenv.snapshots.leases.CollectionBusy` if another
        collection runs or pushes kept their leases too long. Starts a new
        :meth:`gc_epoch`, so that nodes forget which chunks they knew to be stored."""
        async with CollectionLock(self.store, holder, wait_s=wait_s, poll_s=poll_s) as lock:
            await self.store.put_bytes(GC_EPOCH_KEY, secrets.token_hex(8).encode())
            return await self._sweep(grace_s, lock)

    async def _sweep(self, grace_s: float, lock: CollectionLock) -> tuple[int, int]:
        records = await self._records("catalog/")
        referenced: set[str] = set()
        for key, record in records.items():
            if not key.startswith((f"catalog/{_NAMES}/", f"catalog/{_TAGS}/")):
                referenced |= referenced_digests(record)
        live_hex = {blobs.parse_digest(d) for d in referenced if _is_digest(d)}

        blobs_removed = 0
        kept_manifests: list[str] = []
        for key in await self.store.list("blobs/"):
            hexdigest = key.removeprefix("blobs/").removesuffix(".json")
            if hexdigest in live_hex or not await self._old_enough(key, grace_s):
                kept_manifests.append(key)
                continue
            lock.check()
            await self.store.delete(key)
            blobs_removed += 1

        live_chunks: set[str] = set()
        for key in kept_manifests:
            try:
                data = await self.store.get_bytes(key)
                live_chunks.update(blobs.manifest_chunks(data))
            except ObjectNotFound:
                continue
            except RepositoryError as exc:
                # Which chunks it needs is unknown: delete none rather than break it.
                log.warning("%s: not collecting chunks: %s", self.url, exc)
                return blobs_removed, 0

        chunks_removed = 0
        for key in await self.store.list("chunks/"):
            if key.removeprefix("chunks/") in live_chunks:
                continue
            if not await self._old_enough(key, grace_s):
                continue
            lock.check()
            await self.store.delete(key)
            chunks_removed += 1
        return blobs_removed, chunks_removed


def _is_digest(digest: str) -> bool:
    try:
        blobs.parse_digest(digest)
    except ValueError:
        return False
    return True
