"""The snapshot repository's storage layer against a real directory and a real S3 server
(SeaweedFS): object stores, content-addressed blobs, catalog records and names, garbage
collection, and failure when the server dies."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agentenv.config import Config
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.errors import CommitPending
from agentenv.orchestrator.records import PausedEntry, PendingPause
from agentenv.snapshots import blobs
from agentenv.snapshots.leases import (
    LEASES_PREFIX,
    LOCK_KEY,
    CollectionBusy,
    CollectionLock,
    CommitLease,
)
from agentenv.snapshots.objects import (
    ObjectNotFound,
    ObjectStore,
    PosixObjectStore,
    RepositoryError,
    open_store,
)
from agentenv.snapshots.repository import Repository
from tests.s3server import S3Server, start_s3_server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with start_s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(params=["posix", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "posix":
        return open_store(f"file://{tmp_path}/repo", {})
    server: S3Server = request.getfixturevalue("s3_server")
    # A prefix of its own per test: the tests count objects.
    return open_store(server.url(f"t-{secrets.token_hex(4)}"), server.env)


def write_sparse(path: Path, size: int, extents: list[tuple[int, bytes]]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in extents:
            f.seek(offset)
            f.write(data)


def same_content(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while block := fa.read(MiB):
            if fb.read(MiB) != block:
                return False
        return fb.read(1) == b""


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


async def test_objects(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound):
        await store.get_bytes("a/missing")
    assert not await store.exists("a/missing")

    await store.put_bytes("a/one", b"1")
    await store.put_bytes("a/one", b"one")
    assert await store.get_bytes("a/one") == b"one"
    assert await store.exists("a/one")

    assert await store.put_bytes_if_absent("a/two", b"two")
    assert not await store.put_bytes_if_absent("a/two", b"other")
    assert await store.get_bytes("a/two") == b"two"

    await store.put_bytes("ab/three", b"3")
    await store.put_bytes("b/four", b"4")
    assert await store.list("a/") == ["a/one", "a/two"]
    assert await store.list("a") == ["a/one", "a/two", "ab/three"]
    assert await store.list("a/t") == ["a/two"]
    assert await store.list("zzz/") == []

    src = tmp_path / "src"
    src.write_bytes(b"0123456789")
    await store.put_file("f/part", src, offset=2, length=5)
    await store.put_file("f/rest", src, offset=7)
    assert await store.get_bytes("f/part") == b"23456"
    assert await store.get_bytes("f/rest") == b"789"
    dest = tmp_path / "dest"
    await store.get_file("f/part", dest)
    assert dest.read_bytes() == b"23456"
    with pytest.raises(ObjectNotFound):
        await store.get_file("f/missing", tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()

    await store.delete("a/one")
    await store.delete("a/one")  # missing is fine
    assert not await store.exists("a/one")
    assert await store.list("a/") == ["a/two"]

    age = await store.age("a/two")
    assert age is None or -5 < age < 600

    for bad in ("", "/abs", "a//b", "a/../b", "a/./b"):
        with pytest.raises(ValueError):
            await store.put_bytes(bad, b"x")


def test_open_store_rejects_bad_urls() -> None:
    for url in (
        "ftp://host/x",
        "file://relative/path",
        "file:///",
        "s3://",
        "s3:///prefix",
        "no-scheme",
        "s3://Bad_Bucket/x",
        "file:///x?y=1",
    ):
        with pytest.raises(ValueError):
            open_store(url, {})


async def test_push_pull_sparse(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "disk.raw"
    size = 20 * MiB
    write_sparse(
        src,
        size,
        [
            (0, os.urandom(1 * MiB)),  # chunk 0, partly
            (9 * MiB, os.urandom(3 * MiB)),  # chunk 2 only (8-12 MiB)
            (size - 100, os.urandom(100)),  # the end of chunk 4
        ],
    )
    seen: list[tuple[int, int]] = []
    digest = await blobs.push_file(store, src, progress=lambda d, t: seen.append((d, t)))
    assert digest.startswith("sha256:")
    assert seen[-1] == (size, size)
    # Chunks 1 and 3 are holes and not stored.
    assert len(await store.list("chunks/")) == 3
    assert await blobs.blob_exists(store, digest)
    assert await blobs.blob_size(store, digest) == size

    dest = tmp_path / "pulled.raw"
    await blobs.pull_file(store, digest, dest)
    assert dest.stat().st_size == size
    assert same_content(src, dest)
    # 4 MiB and 100 bytes of data: the holes stayed holes.
    assert allocated(dest) < 6 * MiB, allocated(dest)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    # Pushing the pulled copy gives the same digest.
    assert await blobs.push_file(store, dest) == digest


async def test_empty_and_small_files(store: ObjectStore, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    small = tmp_path / "small"
    small.write_bytes(b"hello")
    d_empty = await blobs.push_file(store, empty)
    d_small = await blobs.push_file(store, small)
    await blobs.pull_file(store, d_empty, tmp_path / "e2")
    await blobs.pull_file(store, d_small, tmp_path / "s2")
    assert (tmp_path / "e2").read_bytes() == b""
    assert (tmp_path / "s2").read_bytes() == b"hello"
    with pytest.raises(ObjectNotFound):
        await blobs.pull_file(store, "sha256:" + "0" * 64, tmp_path / "none")
    assert not await blobs.blob_exists(store, "sha256:" + "0" * 64)
    for bad in ("sha256:xyz", "md5:" + "0" * 64, "0" * 64, "sha256:" + "A" * 64):
        with pytest.raises(ValueError):
            blobs.parse_digest(bad)


async def test_dedup(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "ram"
    src.write_bytes(os.urandom(10 * MiB))
    first = await blobs.push_file(store, src)
    chunks = await store.list("chunks/")
    assert len(chunks) == 3
    assert await blobs.push_file(store, src) == first
    assert await store.list("chunks/") == chunks

    flip_byte(src, 5 * MiB)  # in the second chunk
    second = await blobs.push_file(store, src)
    assert second != first
    assert len(await store.list("chunks/")) == 4
    assert len(await store.list("blobs/")) == 2


async def test_corrupt_chunk_detected(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "file"
    src.write_bytes(os.urandom(6 * MiB))
    digest = await blobs.push_file(store, src)
    victim = (await store.list("chunks/"))[0]
    data = bytearray(await store.get_bytes(victim))
    data[1000] ^= 0x01
    await store.put_bytes(victim, bytes(data))
    dest = tmp_path / "out"
    with pytest.raises(RepositoryError):
        await blobs.pull_file(store, digest, dest)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["file"] + (
        ["repo"] if (tmp_path / "repo").exists() else []
    )

    # A missing chunk, and a manifest that does not match its digest, too.
    await store.delete(victim)
    with pytest.raises(RepositoryError):
        await blobs.pull_file(store, digest, dest)
    manifest = f"blobs/{blobs.parse_digest(digest)}.json"
    await store.put_bytes(manifest, b'{"size": 1, "chunk_size": 4194304, "chunks": []}')
    with pytest.raises(RepositoryError):
        await blobs.pull_file(store, digest, dest)


async def test_a_wrong_sized_chunk_is_stored_again(store: ObjectStore, tmp_path: Path) -> None:
    """A chunk or manifest cut short in the store (an uploader killed mid-PUT, a gateway
    that kept a truncated body) is not trusted by the next push of the same content: it
    is written again, and the blob reads back. CI once lost a commit this way."""
    src = tmp_path / "file"
    src.write_bytes(os.urandom(6 * MiB))
    digest = await blobs.push_file(store, src)
    empty, truncated = (await store.list("chunks/"))[:2]
    await store.put_bytes(empty, b"")
    await store.put_bytes(truncated, (await store.get_bytes(truncated))[:1000])
    manifest = f"blobs/{blobs.parse_digest(digest)}.json"
    await store.put_bytes(manifest, (await store.get_bytes(manifest))[:10])
    dest = tmp_path / "out"
    with pytest.raises(RepositoryError, match="corrupt"):
        await blobs.pull_file(store, digest, dest)

    assert await blobs.push_file(store, src) == digest
    await blobs.pull_file(store, digest, dest)
    assert dest.read_bytes() == src.read_bytes()
    assert await store.size(empty) in (2 * MiB, 4 * MiB)  # the 6 MiB file ends in 2 MiB
    assert await store.size("chunks/absent") is None


async def test_a_short_read_is_read_again(tmp_path: Path) -> None:
    """One read of a chunk that comes back short (what an S3 gateway under load can
    answer) is retried; a chunk that is short every time is corrupt."""

    class ShortReads(PosixObjectStore):
        def __init__(self, root: Path, short: int) -> None:
            super().__init__(root)
            self.short = short

        async def get_bytes(self, key: str) -> bytes:
            data = await super().get_bytes(key)
            if key.startswith("chunks/") and self.short > 0:
                self.short -= 1
                return b""
            return data

    src = tmp_path / "file"
    src.write_bytes(os.urandom(5 * MiB))
    digest = await blobs.push_file(ShortReads(tmp_path / "repo", 0), src)
    await blobs.pull_file(ShortReads(tmp_path / "repo", 1), digest, tmp_path / "once")
    assert (tmp_path / "once").read_bytes() == src.read_bytes()
    with pytest.raises(RepositoryError, match="corrupt"):
        await blobs.pull_file(ShortReads(tmp_path / "repo", 100), digest, tmp_path / "always")
    assert not (tmp_path / "always").exists()


async def test_records(store: ObjectStore) -> None:
    repo = Repository(store)
    assert repo.url == store.url
    assert await repo.get_record("snapshots", "s1") is None
    assert await repo.list_records("snapshots") == []
    await repo.put_record("snapshots", "s1", {"id": "s1", "n": 1})
    await repo.put_record("snapshots", "s1", {"id": "s1", "n": 2})
    await repo.put_record("snapshots", "s2:x", {"id": "s2:x"})
    await repo.put_record("paused", "p1", {"id": "p1"})
    assert await repo.get_record("snapshots", "s1") == {"id": "s1", "n": 2}
    assert await repo.list_records("snapshots") == [{"id": "s1", "n": 2}, {"id": "s2:x"}]
    await repo.delete_record("snapshots", "s1")
    await repo.delete_record("snapshots", "s1")
    assert await repo.list_records("snapshots") == [{"id": "s2:x"}]
    for bad in ("", "a/b", "a b", "ü", "x\0"):
        with pytest.raises(ValueError):
            await repo.put_record("snapshots", bad, {})
    with pytest.raises(ValueError):
        await repo.put_record("names", "x", {})


async def test_names(store: ObjectStore) -> None:
    repo = Repository(store)
    assert await repo.resolve_name("web/app:latest") is None
    assert await repo.claim_name("web/app:latest", "s1")
    assert await repo.claim_name("web/app:latest", "s1")  # already ours
    assert not await repo.claim_name("web/app:latest", "s2")
    assert await repo.resolve_name("web/app:latest") == "s1"
    await repo.set_name("web/app:latest", "s2")
    assert await repo.resolve_name("web/app:latest") == "s2"
    await repo.drop_name("web/app:latest", expected_target="s1")  # not ours any more
    assert await repo.resolve_name("web/app:latest") == "s2"
    await repo.drop_name("web/app:latest", expected_target="s2")
    assert await repo.resolve_name("web/app:latest") is None
    await repo.drop_name("web/app:latest")

    # Odd but valid names: dots, unicode, the longest allowed.
    for name in (".", "..", "ü" * 200, "a" * 200, "x y%z"):
        assert await repo.claim_name(name, "t")
        assert await repo.resolve_name(name) == "t"
    assert await repo.resolve_name("ü" * 199) is None
    for bad in ("", "/abs", "a\0b", "a" * 201):
        with pytest.raises(ValueError):
            await repo.claim_name(bad, "t")
    # Names are not records.
    assert await repo.list_records("snapshots") == []

    # Of concurrent claims to one name, exactly one wins.
    for i in range(5):
        name = f"race-{i}"
        results = await asyncio.gather(*(repo.claim_name(name, f"node{n}") for n in range(4)))
        assert sum(results) == 1, results
        winner = f"node{results.index(True)}"
        assert await repo.resolve_name(name) == winner


async def test_collect_garbage(store: ObjectStore, tmp_path: Path) -> None:
    repo = Repository(store)
    a = tmp_path / "a"
    a.write_bytes(os.urandom(12 * MiB))
    digest_a = await repo.push_file(a)
    b = tmp_path / "b"
    b.write_bytes(a.read_bytes()[: 8 * MiB] + os.urandom(4 * MiB))  # shares two chunks
    digest_b = await repo.push_file(b)
    await repo.put_record("snapshots", "keep", {"id": "keep", "blobs": {"memory": digest_a}})
    await repo.put_record("snapshots", "other", {"id": "other", "blobs": {"x": "not-a-digest"}})
    assert len(await store.list("chunks/")) == 4

    # Everything is younger than an hour.
    assert await repo.collect_garbage(grace_s=3600) == (0, 0)
    assert await repo.blob_exists(digest_b)

    assert await repo.collect_garbage(grace_s=0) == (1, 1)
    assert not await repo.blob_exists(digest_b)
    assert await repo.blob_exists(digest_a)
    await repo.pull_file(digest_a, tmp_path / "a2")
    assert (tmp_path / "a2").read_bytes() == a.read_bytes()
    assert await repo.collect_garbage(grace_s=0) == (0, 0)

    # Once no record references it, it goes as well.
    await repo.delete_record("snapshots", "keep")
    assert await repo.collect_garbage(grace_s=0) == (1, 3)
    assert await store.list("chunks/") == []
    assert await store.list("blobs/") == []


async def test_a_collection_waits_for_a_push_that_reuses_an_unreferenced_chunk(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race that made collection unsafe while nodes commit: a push finds a chunk of
    an unreferenced blob already stored and skips it, a collection deletes the chunk,
    and the push's manifest names a chunk that is gone. Under the commit lease the
    collection waits for the push, and no chunk a record needs is removed."""
    repo = Repository(store)
    old = tmp_path / "old"
    old.write_bytes(os.urandom(8 * MiB))
    await repo.push_file(old)  # no record names it: garbage (grace 0)
    new = tmp_path / "new"
    new.write_bytes(old.read_bytes()[: 4 * MiB] + os.urandom(4 * MiB))
    shared = blobs.chunk_key(hashlib.sha256(old.read_bytes()[: 4 * MiB]).hexdigest())

    # Hold the push just after it found the shared chunk stored.
    found, go_on = asyncio.Event(), asyncio.Event()
    size = store.size

    async def size_then_wait(key: str) -> int | None:
        result = await size(key)
        if key == shared:
            found.set()
            await go_on.wait()
        return result

    monkeypatch.setattr(store, "size", size_then_wait)

    async def commit() -> str:
        async with repo.commit_lease("pusher"):
            digest = await repo.push_file(new)
            await repo.put_record("snapshots", "new", {"id": "new", "blobs": {"m": digest}})
        return digest

    push = asyncio.create_task(commit())
    await asyncio.wait_for(found.wait(), 60)
    collection = asyncio.create_task(
        repo.collect_garbage(grace_s=0, holder="collector", poll_s=0.05)
    )
    await asyncio.sleep(1.0)
    assert not collection.done()
    assert await store.exists(shared)
    go_on.set()
    digest = await asyncio.wait_for(push, 60)
    # The old blob's manifest and the chunk only it held; not the shared one.
    assert await asyncio.wait_for(collection, 60) == (1, 1)
    await repo.pull_file(digest, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == new.read_bytes()
    assert await store.list("gc/") == []


async def test_a_push_waits_for_a_collection_and_dead_holders_expire(
    store: ObjectStore,
) -> None:
    repo = Repository(store)
    lock = CollectionLock(store, "collector", poll_s=0.05)
    await lock.__aenter__()
    try:
        # A commit waits while a collection holds the repository, and gives up in time.
        with pytest.raises(CollectionBusy, match="collector"):
            async with CommitLease(store, "pusher", wait_s=0.3, poll_s=0.05):
                pass
        assert await store.list(LEASES_PREFIX) == []  # it withdrew its lease
        # A second collection does not run beside the first.
        with pytest.raises(CollectionBusy, match="collector"):
            await repo.collect_garbage(grace_s=0, holder="second", poll_s=0.05)
        waiting = asyncio.create_task(repo.commit_lease("pusher").__aenter__())
        await asyncio.sleep(0.3)
        assert not waiting.done()
    finally:
        await lock.__aexit__(None, None, None)
    # Once the collection is over, the waiting commit goes on.
    lease = await asyncio.wait_for(waiting, 30)
    await lease.__aexit__(None, None, None)

    # A lock and a lease left by nodes that died (expired) block nothing.
    dead = json.dumps({"holder": "dead", "expires": time.time() - 3600}).encode()
    await store.put_bytes(LOCK_KEY, dead)
    await store.put_bytes(f"{LEASES_PREFIX}dead.json", dead)
    async with CommitLease(store, "pusher", poll_s=0.05):
        pass
    assert await repo.collect_garbage(grace_s=0, poll_s=0.05) == (0, 0)
    assert await store.list("gc/") == []


async def test_dead_server_fails_fast(tmp_path: Path) -> None:
    with start_s3_server(tmp_path / "s3") as server:
        store = open_store(server.url("dead"), server.env)
        await store.put_bytes("k", b"v")
        src = tmp_path / "f"
        src.write_bytes(os.urandom(MiB))
        server.kill()

        fresh = open_store(server.url("dead"), server.env)  # has not made its bucket yet
        operations = [
            store.get_bytes("k"),
            store.put_bytes("k", b"w"),
            store.put_bytes_if_absent("k2", b"w"),
            store.exists("k"),
            store.list(""),
            store.delete("k"),
            store.get_file("k", tmp_path / "out"),
            blobs.push_file(store, src),
            blobs.pull_file(store, "sha256:" + "1" * 64, tmp_path / "out"),
            Repository(store).claim_name("n", "t"),
            fresh.get_bytes("k"),
        ]
        for op in operations:
            with pytest.raises(RepositoryError):
                await asyncio.wait_for(op, 60)
        assert not (tmp_path / "out").exists()


async def test_finer_chunks_store_a_scattered_change_cheaply(tmp_path: Path) -> None:
    """RAM images are pushed in smaller chunks: one changed page costs one small chunk."""
    store = open_store((tmp_path / "repo").as_uri(), {})
    src = tmp_path / "ram"
    data = bytearray(os.urandom(2 * 1024 * 1024))
    src.write_bytes(bytes(data))
    first = await blobs.push_file(store, src, chunk_size=64 * 1024)
    chunks_before = len(await store.list("chunks/"))
    assert chunks_before == 32
    data[1_000_000:1_000_010] = b"x" * 10
    src.write_bytes(bytes(data))
    second = await blobs.push_file(store, src, chunk_size=64 * 1024)
    assert second != first
    assert len(await store.list("chunks/")) == chunks_before + 1
    await blobs.pull_file(store, second, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == bytes(data)
    with pytest.raises(ValueError):
        await blobs.push_file(store, src, chunk_size=1000)


async def test_known_chunks_are_not_asked_about_and_gc_changes_the_epoch(
    tmp_path: Path,
) -> None:
    store = open_store((tmp_path / "repo").as_uri(), {})
    repo = Repository(store)
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    known: set[str] = set()
    await repo.push_file(src, chunk_size=1024 * 1024, known=known)
    assert len(known) == 3
    # A chunk the caller says is stored is not uploaded again, even if it is gone: the
    # caller must forget what it knows when the epoch changes.
    before = await repo.gc_epoch()
    removed = await repo.collect_garbage(grace_s=0)
    assert removed == (1, 3)  # nothing referenced the blob
    assert await repo.gc_epoch() != before
    again: set[str] = set()
    digest = await repo.push_file(src, chunk_size=1024 * 1024, known=again)
    await repo.pull_file(digest, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()


async def test_automatic_collection_runs_once_per_interval_across_nodes(tmp_path: Path) -> None:
    """Each node's loop calls collect_garbage_if_due; the first collects, a node coming
    less than an interval later skips."""

    def catalog(node: str) -> Catalog:
        config = Config(
            home=tmp_path / node,
            repository=(tmp_path / "repo").as_uri(),
            node_id=node,
            repository_gc_interval=3600,
            repository_gc_grace=0,
        )
        return Catalog(config, set)

    first, second = catalog("a"), catalog("b")
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(MiB))
    await first.repository.push_file(garbage)
    await first.collect_garbage_if_due()
    assert await first.repository.store.list("blobs/") == []

    await second.repository.push_file(garbage)
    await second.collect_garbage_if_due()  # a minute after the first: not due
    assert len(await second.repository.store.list("blobs/")) == 1


async def test_a_connect_waits_for_a_pause_another_node_is_committing(tmp_path: Path) -> None:
    """A pause announced by node a (``catalog/pausing``) makes node b wait for its
    commit instead of answering "not found"; bounded, then a clear CommitPending."""

    def catalog(node: str) -> Catalog:
        config = Config(home=tmp_path / node, repository=(tmp_path / "repo").as_uri(), node_id=node)
        return Catalog(config, set)

    a, b = catalog("a"), catalog("b")
    now = datetime.now(UTC)

    def paused(generation: int) -> PausedEntry:
        return PausedEntry(
            sandbox_id="sbx1",
            generation=generation,
            node="a",
            template_id="base",
            template_build_id="build",
            envd_version="0.1.0",
            started_at=now,
            end_at=now,
            paused_at=now,
            manifest={},
            blobs={},
        )

    assert await b.committed_pause("sbx1", wait=5) is None  # nothing known: not found
    await a.put_pending(PendingPause(sandbox_id="sbx1", generation=1, node="a", paused_at=now))

    async def commit_later() -> None:
        await asyncio.sleep(0.5)
        await a.put_paused(paused(1))
        await a.drop_pending("sbx1")

    committing = asyncio.create_task(commit_later())
    entry = await b.committed_pause("sbx1", wait=30)
    await committing
    assert entry is not None and entry.generation == 1
    # Resumed on a and paused again: generation 1 is in the repository, 2 is on its way,
    # and b must not take the stale one. Node a never commits it here.
    await a.put_pending(PendingPause(sandbox_id="sbx1", generation=2, node="a", paused_at=now))
    with pytest.raises(CommitPending) as raised:
        await b.committed_pause("sbx1", wait=0.6)
    assert raised.value.node == "a" and "not reached the repository" in str(raised.value)
    # The pausing node itself never waits for its own announcement.
    assert (await a.committed_pause("sbx1", wait=0)) == paused(1)
    # Withdrawn (resumed on a before the commit): b stops waiting.
    await a.drop_pending("sbx1")
    assert (await b.committed_pause("sbx1", wait=0)) == paused(1)
