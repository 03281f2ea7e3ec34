"""What makes garbage collection of a shared repository safe while other nodes commit.

A push reuses chunks (and whole blobs) already in the store instead of uploading them
again. If the blob that held such a chunk is unreferenced, a collection running at the
same time could delete the chunk after the push found it and before the push's manifest
names it, leaving a blob that can never be read. Nodes share nothing but the store, so
the exclusion goes through it:

- A node committing holds a **commit lease**, ``gc/leases/<random>.json``, written
  before its first look at the store and rewritten while it pushes, deleted once the
  catalog record naming what it pushed is written.
- A collection holds the **collection lock**, ``gc/lock.json``, created only if absent.
- A pusher writes its lease, then reads the lock: if a live lock is there it withdraws
  the lease and waits. A collector takes the lock, then waits until no live lease is
  left before it deletes anything. The store is strongly consistent (S3 since 2020, a
  POSIX directory), so of a lease and a lock written concurrently at least one side sees
  the other: no push runs while a collection sweeps.
- Both expire, so a node that died holding one does not block the others: each holds its
  stamp for :data:`LEASE_TTL_S` and rewrites it every third of that. Expiry compares
  wall clocks of different nodes; they are assumed to agree within
  :data:`CLOCK_SKEW_S`, which both sides add in the other's favour. A collector that
  could not rewrite its lock in time stops before its next deletion.

The collection's grace period still keeps whatever was written recently, for writers
that hold no lease.

This module knows the store and nothing of what the repository keeps in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from types import TracebackType

from agentenv.snapshots.objects import ObjectNotFound, ObjectStore, RepositoryError

log = logging.getLogger(__name__)

LOCK_KEY = "gc/lock.json"
LEASES_PREFIX = "gc/leases/"
LEASE_TTL_S = 300.0
CLOCK_SKEW_S = 60.0


class CollectionBusy(RepositoryError):
    """A collection could not run now: another holds the lock, or commits kept their
    leases longer than it would wait."""


def _stamp(holder: str, ttl_s: float) -> bytes:
    return json.dumps({"holder": holder, "expires": time.time() + ttl_s}).encode()


def _live_holder(data: bytes) -> str | None:
    """Who holds a stamp that has not expired (allowing for clock skew), or None."""
    try:
        stamp = json.loads(data)
        expires, holder = float(stamp["expires"]), str(stamp["holder"])
    except (ValueError, KeyError, TypeError):
        return None  # not something this module wrote: treated as expired
    return holder if expires + CLOCK_SKEW_S > time.time() else None


async def _read(store: ObjectStore, key: str) -> bytes | None:
    try:
        return await store.get_bytes(key)
    except ObjectNotFound:
        return None


class _Refresher:
    """Rewrites one stamp every third of its lifetime; remembers until when (by this
    host's monotonic clock) the last successful write holds."""

    def __init__(self, store: ObjectStore, key: str, holder: str, ttl_s: float) -> None:
        self.store, self.key, self.holder, self.ttl_s = store, key, holder, ttl_s
        self.valid_until = 0.0
        self._task: asyncio.Task[None] | None = None

    async def write(self, *, if_absent: bool = False) -> bool:
        started = time.monotonic()
        data = _stamp(self.holder, self.ttl_s)
        if if_absent:
            if not await self.store.put_bytes_if_absent(self.key, data):
                return False
        else:
            await self.store.put_bytes(self.key, data)
        # Counted from before the write: the stamp may have landed at any point since.
        self.valid_until = started + self.ttl_s - CLOCK_SKEW_S
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.key)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.write()
            except RepositoryError as exc:
                log.warning("%s: could not renew %s: %s", self.store.url, self.key, exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.store.delete(self.key)
        except RepositoryError as exc:
            log.warning("%s: could not remove %s (it expires): %s", self.store.url, self.key, exc)


class _Held:
    """What a commit lease and the collection lock share: a stamp in the store, kept
    fresh while held and removed on leaving, and how long to wait for the other side."""

    def __init__(
        self, store: ObjectStore, key: str, holder: str, wait_s: float, poll_s: float, ttl_s: float
    ) -> None:
        self.store, self.holder, self.wait_s, self.poll_s = store, holder, wait_s, poll_s
        self._stamp = _Refresher(store, key, holder, ttl_s)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self._stamp.stop())


class CommitLease(_Held):
    """``async with CommitLease(store, holder):`` around a commit. Waits, up to
    ``wait_s``, while a collection holds the repository; :class:`CollectionBusy` after
    that."""

    def __init__(
        self,
        store: ObjectStore,
        holder: str,
        *,
        wait_s: float = 600.0,
        poll_s: float = 2.0,
        ttl_s: float = LEASE_TTL_S,
    ) -> None:
        key = f"{LEASES_PREFIX}{secrets.token_hex(8)}.json"
        super().__init__(store, key, holder, wait_s, poll_s, ttl_s)

    async def __aenter__(self) -> CommitLease:
        deadline = time.monotonic() + self.wait_s
        said = False
        while True:
            await self._stamp.write()
            lock = await _read(self.store, LOCK_KEY)
            collector = None if lock is None else _live_holder(lock)
            if collector is None:
                break
            await self._stamp.stop()
            if time.monotonic() >= deadline:
                raise CollectionBusy(
                    f"{self.store.url}: garbage collection by {collector} has held the "
                    f"repository for over {self.wait_s:.0f} s"
                )
            if not said:
                log.info("%s: waiting for garbage collection by %s", self.store.url, collector)
                said = True
            await asyncio.sleep(self.poll_s)
        self._stamp.start()
        return self


class CollectionLock(_Held):
    """``async with CollectionLock(store, holder):`` around a collection's deletions:
    taken only if no other live collection holds it (:class:`CollectionBusy`
    otherwise), then held until every live commit lease is gone (at most ``wait_s``).
    Call :meth:`check` before each deletion."""

    def __init__(
        self,
        store: ObjectStore,
        holder: str,
        *,
        wait_s: float = 600.0,
        poll_s: float = 2.0,
        ttl_s: float = LEASE_TTL_S,
    ) -> None:
        super().__init__(store, LOCK_KEY, holder, wait_s, poll_s, ttl_s)

    async def _take(self) -> None:
        for _ in range(2):
            if await self._stamp.write(if_absent=True):
                return
            current = await _read(self.store, LOCK_KEY)
            if current is None:
                continue  # released meanwhile
            holder = _live_holder(current)
            if holder is not None:
                raise CollectionBusy(f"{self.store.url}: {holder} is collecting garbage")
            # Expired: its collector died. Removed only if it is still the stamp we read.
            if await _read(self.store, LOCK_KEY) == current:
                log.warning("%s: removing the expired collection lock", self.store.url)
                await self.store.delete(LOCK_KEY)
        raise CollectionBusy(f"{self.store.url}: another node took the collection lock")

    async def _wait_for_commits(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            live = []
            for key in await self.store.list(LEASES_PREFIX):
                data = await _read(self.store, key)
                if data is None:
                    continue
                holder = _live_holder(data)
                if holder is None:
                    await self.store.delete(key)  # its pusher died
                else:
                    live.append(holder)
            if not live:
                return
            if time.monotonic() >= deadline:
                raise CollectionBusy(
                    f"{self.store.url}: commits by {', '.join(sorted(set(live)))} still "
                    f"running after {self.wait_s:.0f} s"
                )
            await asyncio.sleep(self.poll_s)

    def check(self) -> None:
        """RepositoryError unless the lock is still surely held (renewed in time)."""
        if time.monotonic() >= self._stamp.valid_until:
            raise RepositoryError(
                f"{self.store.url}: the collection lock could not be renewed in time"
            )

    async def __aenter__(self) -> CollectionLock:
        await self._take()
        self._stamp.start()
        try:
            await self._wait_for_commits()
        except BaseException:
            await asyncio.shield(self._stamp.stop())
            raise
        return self
