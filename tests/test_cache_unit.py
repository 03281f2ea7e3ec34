"""The node-local snapshot cache: LRU eviction, pins, limits and the persisted index."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.snapshots.cache import CacheFull, NodeCache, allocated_bytes

KiB = 1024


def put(cache: NodeCache, key: str, size: int) -> Path:
    """A file of ``size`` allocated bytes (non-zero data) registered as ``key``."""
    path = cache.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x01" * size)
    cache.add(key, path)
    return path


def fresh(root: Path, limit: int) -> NodeCache:
    cache = NodeCache(root, limit)
    cache.load()
    return cache


def test_sizes_are_allocated_bytes(tmp_path: Path) -> None:
    cache = fresh(tmp_path / "c", 10**9)
    sparse = cache.path_for("sparse")
    with open(sparse, "wb") as f:
        f.truncate(100 * 1024 * KiB)
        f.write(b"x" * 4096)
    cache.add("sparse", sparse)
    assert cache.used_bytes() == os.stat(sparse).st_blocks * 512 < 1024 * KiB

    tree = cache.path_for("tree")
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a").write_bytes(b"\x01" * 64 * KiB)
    os.link(tree / "sub" / "a", tree / "b")  # counted once
    cache.add("tree", tree)
    with_dirs = allocated_bytes(tree)
    assert 64 * KiB <= with_dirs < 2 * 64 * KiB
    assert cache.used_bytes() == os.stat(sparse).st_blocks * 512 + with_dirs


def test_lru_order_and_touch(tmp_path: Path) -> None:
    cache = fresh(tmp_path / "c", 300 * KiB)
    for key in ("a", "b", "c"):
        put(cache, key, 100 * KiB)
    assert cache.keys() == ["a", "b", "c"]
    cache.touch("a")
    assert cache.get("b") == cache.path_for("b")
    assert cache.keys() == ["c", "a", "b"]
    assert cache.get("missing") is None

    evicted = cache.make_room(100 * KiB, set)
    assert evicted == ["c"]
    assert not cache.path_for("c").exists()
    assert cache.make_room(0, set) == []
    assert cache.make_room(200 * KiB, set) == ["a"]
    assert cache.make_room(300 * KiB, set) == ["b"]
    assert cache.keys() == []
    assert cache.used_bytes() == 0


def test_pins_are_respected_and_reevaluated(tmp_path: Path) -> None:
    cache = fresh(tmp_path / "c", 400 * KiB)
    for key in ("a", "b", "c", "d"):
        put(cache, key, 100 * KiB)
    calls: list[set[str]] = []

    def pinned() -> set[str]:
        # "c" becomes pinned once the first eviction has happened.
        pins = {"a"} if not calls else {"a", "c"}
        calls.append(pins)
        return pins

    evicted = cache.make_room(200 * KiB, pinned)
    assert evicted == ["b", "d"]
    assert len(calls) >= 2
    assert cache.keys() == ["a", "c"]


def test_cache_full(tmp_path: Path) -> None:
    cache = fresh(tmp_path / "c", 300 * KiB)
    for key in ("a", "b", "c"):
        put(cache, key, 100 * KiB)
    with pytest.raises(CacheFull, match="bytes"):
        cache.make_room(400 * KiB, set)  # more than the whole cache
    with pytest.raises(CacheFull):
        cache.make_room(200 * KiB, lambda: {"a", "b"})
    # Nothing was evicted for a request that could not be met.
    assert cache.keys() == ["a", "b", "c"]

    # Pinned only after the first eviction: room cannot be finished.
    state = {"n": 0}

    def pinned() -> set[str]:
        state["n"] += 1
        return set() if state["n"] == 1 else {"b", "c"}

    with pytest.raises(CacheFull):
        cache.make_room(200 * KiB, pinned)
    assert cache.keys() == ["b", "c"]


def test_never_exceeds_limit(tmp_path: Path) -> None:
    limit = 1000 * KiB
    cache = fresh(tmp_path / "c", limit)
    sizes = [120, 300, 80, 500, 250, 40, 700, 100, 100, 100, 999]
    for i, size in enumerate(sizes):
        cache.make_room(size * KiB, lambda: set())
        put(cache, f"k{i}", size * KiB)
        assert cache.used_bytes() <= limit
        if i % 3 == 0:
            cache.get(f"k{i // 2}")


def test_index_survives_reload(tmp_path: Path) -> None:
    root = tmp_path / "c"
    cache = fresh(root, 10**9)
    for key in ("a", "b/with:odd chars", "c"):
        put(cache, key, 10 * KiB)
    cache.touch("a")
    used = cache.used_bytes()

    again = fresh(root, 10**9)
    assert again.keys() == ["b/with:odd chars", "c", "a"]
    assert again.used_bytes() == used
    assert again.peek("c") == cache.path_for("c")
    # The LRU counter continues where it was.
    again.touch("b/with:odd chars")
    assert again.keys() == ["c", "a", "b/with:odd chars"]
    assert fresh(root, 10**9).keys() == again.keys()


def test_vanished_and_stray_paths(tmp_path: Path) -> None:
    root = tmp_path / "c"
    cache = fresh(root, 10**9)
    a = put(cache, "a", 10 * KiB)
    b = put(cache, "b", 10 * KiB)
    outside = root / "snapshots" / "s1"  # an entry outside entries/
    outside.mkdir(parents=True)
    (outside / "mem").write_bytes(b"\x01" * KiB)
    cache.add("snap:s1", outside)
    a.unlink()
    stray = root / "entries" / "half-written.part"
    stray.write_bytes(b"junk")

    again = fresh(root, 10**9)
    assert sorted(again.keys()) == ["b", "snap:s1"]
    assert not stray.exists()
    assert b.exists() and outside.exists()

    b.unlink()  # vanished while running
    assert again.get("b") is None
    assert again.keys() == ["snap:s1"]
    again.remove("snap:s1")
    assert not outside.exists()
    again.remove("snap:s1")  # not cached: fine
    assert fresh(root, 10**9).keys() == []


def test_add_validates_paths(tmp_path: Path) -> None:
    cache = fresh(tmp_path / "c", 10**9)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"x")
    with pytest.raises(ValueError):
        cache.add("x", elsewhere)
    with pytest.raises(ValueError):
        cache.add("x", tmp_path / "c" / "index.json")
    with pytest.raises(FileNotFoundError):
        cache.add("x", cache.path_for("x"))
    for key in (".", "..", "", "a" * 500, "a/b"):
        p = cache.path_for(key)
        assert p.parent == tmp_path / "c" / "entries"
        assert not p.name.startswith(".")
        assert len(p.name) <= 200

    # Re-adding a key at a new path deletes the old one.
    first = put(cache, "k", KiB)
    second = cache.path_for("k").with_suffix(".raw")
    second.write_bytes(b"\x01" * KiB)
    cache.add("k", second)
    assert not first.exists()
    assert cache.get("k") == second
