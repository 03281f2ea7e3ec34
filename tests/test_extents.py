"""Extent maps and resharing on a reflink-capable filesystem (scripts/test provides one)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.storage.clone import clone_file_sync, supports_reflink
from agentenv.storage.extents import PAGE, reshare, unshared_bytes

MiB = 1024 * 1024


@pytest.fixture
def workdir(test_root: Path) -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="extents-", dir=test_root))
    try:
        if not supports_reflink(directory):
            pytest.skip(f"{directory} cannot reflink (scripts/test puts AENV_TEST_DIR on XFS)")
        yield directory
    finally:
        shutil.rmtree(directory)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _clone_rewritten(workdir: Path, rewritten: int) -> tuple[Path, Path]:
    """A 4 MiB "template" and a clone of it whose first ``rewritten`` bytes were written
    again with the same content: same bytes, new blocks."""
    template = workdir / "template"
    template.write_bytes(os.urandom(4 * MiB))
    sandbox = workdir / "sandbox"
    assert clone_file_sync(template, sandbox)
    fd = os.open(sandbox, os.O_RDWR)
    try:
        os.pwrite(fd, os.pread(fd, rewritten, 0), 0)
    finally:
        os.close(fd)
    return template, sandbox


def test_reshare_gives_back_rewritten_pages_and_keeps_changed_ones(workdir: Path) -> None:
    # A "template": 8 MiB of data with a 4 MiB hole in the middle.
    template = workdir / "template"
    with open(template, "wb") as f:
        f.write(os.urandom(2 * MiB))
        f.seek(6 * MiB)
        f.write(os.urandom(2 * MiB))
        f.truncate(10 * MiB)
    sandbox = workdir / "sandbox"
    assert clone_file_sync(template, sandbox)
    assert unshared_bytes(sandbox) == 0

    fd = os.open(sandbox, os.O_RDWR)
    try:
        # Like a guest: rewrites 1 MiB of data unchanged, zeroes 2 MiB of the hole...
        os.pwrite(fd, os.pread(fd, MiB, 0), 0)
        os.pwrite(fd, bytes(2 * MiB), 3 * MiB)
        # ...and really changes three scattered pages.
        changed = [6 * MiB, 6 * MiB + 17 * PAGE, 9 * MiB + PAGE]
        for offset in changed:
            os.pwrite(fd, os.urandom(PAGE), offset)
    finally:
        os.close(fd)
    before = unshared_bytes(sandbox)
    assert before >= 3 * MiB
    content, mtime = digest(sandbox), sandbox.stat().st_mtime_ns

    shared = reshare(sandbox, template)

    assert shared >= 3 * MiB
    assert unshared_bytes(sandbox) == len(changed) * PAGE
    assert digest(sandbox) == content
    assert sandbox.stat().st_mtime_ns == mtime
    # Nothing left to give back: a second pass shares nothing more.
    assert reshare(sandbox, template) == 0


def test_a_stopped_reshare_shares_nothing_more(workdir: Path) -> None:
    """Callers stop a resharing before a VM maps the file again."""
    template, sandbox = _clone_rewritten(workdir, 4 * MiB)
    before = unshared_bytes(sandbox)
    assert before == 4 * MiB
    stop = threading.Event()
    stop.set()
    assert reshare(sandbox, template, stop) == 0
    assert unshared_bytes(sandbox) == before
    assert reshare(sandbox, template, threading.Event()) == 4 * MiB


def test_reshare_never_shares_different_content(workdir: Path) -> None:
    a, b = workdir / "a", workdir / "b"
    a.write_bytes(os.urandom(MiB))
    b.write_bytes(os.urandom(MiB))
    content = digest(b)
    assert reshare(b, a) == 0
    assert unshared_bytes(b) == MiB
    assert digest(b) == content


def test_reshare_where_extents_cannot_be_shared(tmp_path: Path) -> None:
    # /dev/shm is tmpfs: no extent map, no sharing; nothing happens and nothing fails.
    directory = Path("/dev/shm") / f"aenv-extents-{os.getpid()}"
    directory.mkdir()
    try:
        a, b = directory / "a", directory / "b"
        data = os.urandom(MiB)
        a.write_bytes(data)
        b.write_bytes(data)
        assert reshare(b, a) == 0
        assert b.read_bytes() == data
    finally:
        shutil.rmtree(directory)


def test_reshare_looks_past_blocks_shared_with_other_clones(workdir: Path) -> None:
    template, sandbox = _clone_rewritten(workdir, 2 * MiB)
    # A paused sandbox's upload copy (or a snapshot) shares those new blocks: they are
    # "shared", but not with the template.
    frozen = workdir / "frozen"
    assert clone_file_sync(sandbox, frozen)
    content = digest(frozen)
    assert reshare(sandbox, template) == 2 * MiB
    assert digest(sandbox) == digest(template)
    # The clone keeps its blocks (now its own) and its content.
    assert digest(frozen) == content
    assert unshared_bytes(frozen) == 2 * MiB
