"""Working sets of snapshot RAM files (agentenv/vmm/working_set.py) on real files, and how
the QEMU driver and the server wire the RAM advice library in."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from agentenv.config import Config
from agentenv.server import guest_ram_advice
from agentenv.vmm import launch as launch_module
from agentenv.vmm.qemu import QemuDriver
from agentenv.vmm.working_set import (
    MERGE_GAP_PAGES,
    PAGE,
    WorkingSets,
    _runs,
    read_ahead,
    resident_extents,
)
from tests.helpers import drop_from_page_cache

PAGES = 256


def _uncached_file(path: Path, data: bytes | None = None) -> Path:
    """A file of data (``PAGES`` random pages by default), written back and dropped
    from the page cache."""
    path.write_bytes(os.urandom(PAGES * PAGE) if data is None else data)
    return drop_from_page_cache(path)


def _touch(path: Path, pages: list[int]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for page in pages:
            os.pread(fd, 1, page * PAGE)
    finally:
        os.close(fd)


def _resident_pages(path: Path) -> set[int]:
    return {p for first, count in resident_extents(path) for p in range(first, first + count)}


def _cache_drops(path: Path) -> bool:
    """Whether this filesystem drops a clean file's pages when asked (tmpfs does not)."""
    return not _resident_pages(path)


def test_runs_merge_close_pages_only() -> None:
    gap = MERGE_GAP_PAGES
    flags = bytes([1, 1] + [0] * gap + [1] + [0] * (gap + 1) + [1, 0])
    assert _runs(flags) == [(0, gap + 3), (2 * gap + 4, 1)]
    assert _runs(bytes(8)) == []
    assert _runs(bytes([1] * 4)) == [(0, 4)]
    # Only the low bit means resident.
    assert _runs(bytes([2, 2])) == []


def test_resident_extents_are_the_pages_read(tmp_path: Path) -> None:
    ram = _uncached_file(tmp_path / "memory.raw")
    if not _cache_drops(ram):
        pytest.skip(f"{tmp_path}'s filesystem keeps clean pages cached")
    _touch(ram, [3, 100, 101, 200])
    resident = _resident_pages(ram)
    # read(2) may read ahead, never behind what was asked for.
    assert {3, 100, 101, 200} <= resident
    assert min(resident) == 3


def test_a_record_is_read_ahead_into_a_clone(tmp_path: Path) -> None:
    source = _uncached_file(tmp_path / "template.raw")
    if not _cache_drops(source):
        pytest.skip(f"{tmp_path}'s filesystem keeps clean pages cached")
    sets = WorkingSets(tmp_path / "sets")
    used = _uncached_file(tmp_path / "sandbox.raw", source.read_bytes())
    _touch(used, [10, 11, 12, 150])
    key = sets.key(source)
    assert key is not None and not sets.has(key)
    recorded = sets.record(key, used)
    assert recorded >= 4 * PAGE and sets.has(key)
    assert sets.record(key, used) == 0  # once per file

    clone = _uncached_file(tmp_path / "next.raw", source.read_bytes())
    assert not _resident_pages(clone)
    extents = sets.extents(key)
    assert extents is not None
    assert read_ahead(clone, extents) == recorded
    # The reads run in the background once asked for.
    deadline = time.monotonic() + 30
    while not {10, 11, 12, 150} <= _resident_pages(clone) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {10, 11, 12, 150} <= _resident_pages(clone)


def test_a_changed_file_finds_no_record(tmp_path: Path) -> None:
    source = tmp_path / "memory.raw"
    source.write_bytes(b"\0" * PAGE * 4)
    sets = WorkingSets(tmp_path / "sets")
    key = sets.key(source)
    assert key is not None
    sets.record(key, source)
    os.utime(source, ns=(0, 1))
    changed = sets.key(source)
    assert changed is not None and changed != key
    assert sets.extents(changed) is None
    assert sets.key(tmp_path / "gone") is None


def test_an_unreadable_record_is_dropped(tmp_path: Path) -> None:
    source = tmp_path / "memory.raw"
    source.write_bytes(b"\0" * PAGE)
    sets = WorkingSets(tmp_path / "sets")
    key = sets.key(source)
    assert key is not None
    sets.directory.mkdir()
    (sets.directory / key).write_text("{not json")
    assert sets.extents(key) is None
    assert not sets.has(key)


def test_records_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentenv.vmm.working_set.MAX_RECORDS", 3)
    sets = WorkingSets(tmp_path / "sets")
    ram = tmp_path / "ram"
    ram.write_bytes(b"\0" * PAGE)
    for index in range(5):
        sets.record(f"key{index}", ram)
        os.utime(sets.directory / f"key{index}", (index, index))
    names = sorted(p.name for p in sets.directory.iterdir())
    assert len(names) == 3 and "key4" in names and "key0" not in names
    assert json.loads((sets.directory / "key4").read_text())["page_size"] == PAGE


def test_read_ahead_of_nothing_reads_nothing(tmp_path: Path) -> None:
    ram = tmp_path / "ram"
    ram.write_bytes(b"\0" * PAGE)
    assert read_ahead(ram, []) == 0


def test_qemu_runs_with_the_advice_library_preloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / "agentenv-ram-advice.so"
    library.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    driver = QemuDriver(ram_advice=library)
    env = driver._environment()
    assert env is not None and env["LD_PRELOAD"] == f"{library} /other.so"
    assert QemuDriver()._environment() is None


def test_the_server_finds_the_library_unless_huge_pages_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / "agentenv-ram-advice.so"
    library.write_bytes(b"")
    monkeypatch.setenv(launch_module.RAM_ADVICE_ENV, str(library))
    config = Config.load(env={}, home=tmp_path / "home")
    advice, sets = guest_ram_advice(config)
    assert advice == library
    assert sets is not None and sets.directory == config.working_sets_dir
    kept = Config.load(env={"AENV_GUEST_RAM_HUGE_PAGES": "true"}, home=tmp_path / "home")
    assert guest_ram_advice(kept) == (None, None)
    monkeypatch.setenv(launch_module.RAM_ADVICE_ENV, str(tmp_path / "missing.so"))
    assert guest_ram_advice(config) == (None, None)
