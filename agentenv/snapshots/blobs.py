"""Content-addressed files (disk layers, RAM images) in an object store.

A file is cut into :data:`CHUNK_SIZE` chunks stored once each under
``chunks/<sha256 hex>``, so a file pushed again, or a RAM image differing from its
template's in a few chunks, costs only the chunks that changed. Chunks that are all zeros
(the holes of sparse disks and the untouched pages of RAM images) are not stored at all.
The manifest ``blobs/<hex>.json`` lists the chunks; ``<hex>`` is the sha256 of the
manifest's canonical JSON, and ``sha256:<hex>`` is the blob's digest. A manifest is
written after every chunk it lists, so a blob that exists is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Callable, MutableSet
from dataclasses import dataclass
from pathlib import Path

from agentenv.snapshots.objects import ObjectNotFound, ObjectStore, RepositoryError

log = logging.getLogger(__name__)

CHUNK_SIZE = 4 * 1024 * 1024
# Chunks read or transferred at once; bounds memory to about this many chunks.
_PARALLEL = 4
# Small chunks are dominated by per-request latency (S3): more of them in flight, with
# the same bound on memory.
_MAX_PARALLEL = 16
_BYTES_IN_FLIGHT = _PARALLEL * 4 * 1024 * 1024


def _parallelism(chunk_size: int) -> int:
    return max(_PARALLEL, min(_MAX_PARALLEL, _BYTES_IN_FLIGHT // max(chunk_size, 1)))


# Within a pulled chunk, zero runs of this size are left as holes rather than written.
_HOLE_GRANULE = 64 * 1024
_ZEROS = bytes(CHUNK_SIZE)
_HEX_RE = re.compile(r"[0-9a-f]{64}")

Progress = Callable[[int, int], None]


def parse_digest(digest: str) -> str:
    """The hex hash of a ``sha256:<64 hex>`` digest; ValueError if it is not one."""
    algo, sep, hexpart = digest.partition(":") if isinstance(digest, str) else ("", "", "")
    if algo != "sha256" or not sep or not _HEX_RE.fullmatch(hexpart):
        raise ValueError(f"invalid blob digest {digest!r} (want sha256:<64 hex digits>)")
    return hexpart


def manifest_key(hexdigest: str) -> str:
    return f"blobs/{hexdigest}.json"


def chunk_key(hexdigest: str) -> str:
    return f"chunks/{hexdigest}"


@dataclass(frozen=True)
class Manifest:
    size: int
    chunk_size: int
    # (offset, length, sha256 hex), ascending offsets; holes are absent.
    chunks: tuple[tuple[int, int, str], ...]

    def to_bytes(self) -> bytes:
        """Canonical JSON: the bytes the blob digest is the hash of."""
        doc = {
            "size": self.size,
            "chunk_size": self.chunk_size,
            "chunks": [list(c) for c in self.chunks],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data)
            size, chunk_size, raw = doc["size"], doc["chunk_size"], doc["chunks"]
            chunks = tuple((int(o), int(n), str(h)) for o, n, h in raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise RepositoryError(f"{where}: unreadable blob manifest: {exc}") from exc
        if not isinstance(size, int) or not isinstance(chunk_size, int) or size < 0:
            raise RepositoryError(f"{where}: invalid blob manifest")
        end = 0
        for offset, length, h in chunks:
            if offset < end or length <= 0 or offset + length > size or not _HEX_RE.fullmatch(h):
                raise RepositoryError(f"{where}: invalid chunk entry {[offset, length, h]}")
            end = offset + length
        return cls(size, chunk_size, chunks)


@contextlib.asynccontextmanager
async def _first_error() -> AsyncIterator[None]:
    """Re-raise the first failure of a task group by itself: callers catch
    RepositoryError or OSError, not an exception group."""
    try:
        yield
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


def _read_chunk(fd: int, offset: int, length: int) -> tuple[bytes, str] | None:
    """The chunk at ``offset`` and its sha256 hex, or None if it is all zeros. A chunk
    lying wholly in a hole is recognised without reading it."""
    try:
        data_at = os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data after offset
            return None
        if exc.errno != errno.EINVAL:  # EINVAL: no SEEK_DATA here; read and look
            raise
        data_at = offset
    if data_at >= offset + length:
        return None
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(errno.EIO, f"short read at {offset} (file changed while pushing?)")
    if memoryview(_ZEROS)[:length] == data:
        return None
    return data, hashlib.sha256(data).hexdigest()


async def _store_object(store: ObjectStore, key: str, data: bytes) -> None:
    """Make ``key`` (a content address) hold ``data``. An object already there is trusted
    only if its length is right: a write cut short (a killed uploader, an S3 gateway that
    kept a truncated body) leaves a wrong-sized object that would otherwise be skipped by
    every later push and fail every pull. Such an object is replaced; a concurrent writer
    of the same key writes the same bytes, so replacing races with nothing."""
    stored = await store.size(key)
    if stored == len(data):
        return
    if stored is None:
        await store.put_bytes_if_absent(key, data)
    else:
        log.warning(
            "%s: %s holds %d bytes, not %d: storing it again", store.url, key, stored, len(data)
        )
        await store.put_bytes(key, data)


async def push_file(
    store: ObjectStore,
    path: Path,
    *,
    chunk_size: int = CHUNK_SIZE,
    progress: Progress | None = None,
    known: MutableSet[str] | None = None,
) -> str:
    """Store ``path`` as a blob and return its digest. Chunks already in the store are not
    uploaded again. ``progress(done, total)`` is called in file bytes. The file must not
    change while it is pushed. ``chunk_size`` (a multiple of 4 KiB, at most
    :data:`CHUNK_SIZE`) trades objects per blob against what a small change costs: RAM
    images change in scattered pages, so they are cut finer than disk layers. ``known``
    holds hashes of chunks the caller knows to be stored (they are not asked about) and
    gets the ones this push stored or found."""
    if chunk_size <= 0 or chunk_size % 4096 or chunk_size > CHUNK_SIZE:
        raise ValueError(f"chunk size must be a multiple of 4 KiB up to {CHUNK_SIZE}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        chunks: list[tuple[int, int, str]] = []
        done = 0
        slots = asyncio.Semaphore(_parallelism(chunk_size))

        async def upload(offset: int, length: int, data: bytes, h: str) -> None:
            nonlocal done
            try:
                if known is None or h not in known:
                    await _store_object(store, chunk_key(h), data)
                    if known is not None:
                        known.add(h)
            finally:
                slots.release()
            done += length
            if progress:
                progress(done, size)

        async with _first_error(), asyncio.TaskGroup() as tg:
            for offset in range(0, size, chunk_size):
                length = min(chunk_size, size - offset)
                # Acquired before reading, so memory holds a bounded number of chunks.
                await slots.acquire()
                try:
                    chunk = await asyncio.to_thread(_read_chunk, fd, offset, length)
                except BaseException:
                    slots.release()
                    raise
                if chunk is None:
                    slots.release()
                    done += length
                    if progress:
                        progress(done, size)
                    continue
                data, h = chunk
                chunks.append((offset, length, h))
                tg.create_task(upload(offset, length, data, h))
    finally:
        os.close(fd)

    manifest = Manifest(size, chunk_size, tuple(chunks)).to_bytes()
    hexdigest = hashlib.sha256(manifest).hexdigest()
    # Last: the manifest's existence is the promise that every chunk it lists is stored.
    await _store_object(store, manifest_key(hexdigest), manifest)
    return f"sha256:{hexdigest}"


async def load_manifest(store: ObjectStore, digest: str) -> Manifest:
    """The verified manifest of blob ``digest``; ObjectNotFound if there is no such blob."""
    hexdigest = parse_digest(digest)
    key = manifest_key(hexdigest)
    try:
        data = await store.get_bytes(key)
    except ObjectNotFound as exc:
        raise ObjectNotFound(f"{store.url}: blob {digest} not found") from exc
    where = f"{store.url}/{key}"
    if hashlib.sha256(data).hexdigest() != hexdigest:
        raise RepositoryError(f"{where}: manifest does not match its digest (corrupt)")
    return Manifest.from_bytes(data, where)


def _write_chunk(fd: int, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset``, skipping zero runs (the file is pre-sized, so they
    read back as zeros and stay unallocated)."""
    view = memoryview(data)
    zeros = memoryview(_ZEROS)
    pos = 0
    while pos < len(view):
        end = min(pos + _HOLE_GRANULE, len(view))
        if view[pos:end] != zeros[: end - pos]:
            # Coalesce consecutive non-zero granules into one write.
            while end < len(view):
                nxt = min(end + _HOLE_GRANULE, len(view))
                if view[end:nxt] == zeros[: nxt - end]:
                    break
                end = nxt
            block = view[pos:end]
            written = 0
            while written < len(block):
                written += os.pwrite(fd, block[written:], offset + pos + written)
        pos = end


async def pull_file(
    store: ObjectStore, digest: str, dest: Path, *, progress: Progress | None = None
) -> None:
    """Write blob ``digest`` to ``dest`` (sparse where the blob has holes), through a
    temporary name renamed into place. Every chunk is checked against its hash; a
    mismatch is a :class:`RepositoryError` and leaves ``dest`` untouched.
    ``progress(done, total)`` is called in stored (non-hole) bytes."""
    manifest = await load_manifest(store, digest)
    total = sum(length for _, length, _ in manifest.chunks)
    done = 0
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, manifest.size)
        slots = asyncio.Semaphore(_parallelism(manifest.chunk_size))

        def verify_and_write(offset: int, length: int, h: str, data: bytes) -> bool:
            if len(data) != length or hashlib.sha256(data).hexdigest() != h:
                return False
            _write_chunk(fd, offset, data)
            return True

        async def get_chunk(h: str) -> bytes:
            try:
                return await store.get_bytes(chunk_key(h))
            except ObjectNotFound as exc:
                raise RepositoryError(
                    f"{store.url}: chunk {h} of blob {digest} is missing"
                ) from exc

        async def fetch(offset: int, length: int, h: str) -> None:
            nonlocal done
            async with slots:
                data = await get_chunk(h)
                if not await asyncio.to_thread(verify_and_write, offset, length, h, data):
                    # Once more: an S3 gateway under load can answer a read short.
                    log.warning(
                        "%s: chunk %s read back as %d bytes that do not match; reading it again",
                        store.url,
                        h,
                        len(data),
                    )
                    data = await get_chunk(h)
                    if not await asyncio.to_thread(verify_and_write, offset, length, h, data):
                        raise RepositoryError(
                            f"{store.url}: chunk {h} of blob {digest} is corrupt "
                            f"({len(data)} bytes, expected {length} with that sha256)"
                        )
            done += length
            if progress:
                progress(done, total)

        async with _first_error(), asyncio.TaskGroup() as tg:
            for offset, length, h in manifest.chunks:
                tg.create_task(fetch(offset, length, h))
        await asyncio.to_thread(os.fsync, fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, dest)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


async def blob_exists(store: ObjectStore, digest: str) -> bool:
    return await store.exists(manifest_key(parse_digest(digest)))


async def blob_size(store: ObjectStore, digest: str) -> int:
    """The size of the file blob ``digest`` holds; ObjectNotFound if there is none."""
    return (await load_manifest(store, digest)).size


def manifest_chunks(data: bytes) -> list[str]:
    """Chunk hashes a raw manifest document lists (for garbage collection)."""
    return [h for _, _, h in Manifest.from_bytes(data, "manifest").chunks]
