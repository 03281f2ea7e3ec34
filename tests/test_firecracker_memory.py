"""The bookkeeping of Firecracker's diff snapshots (no VM): which RAM image a diff may be
written over, and the reflinks that make one (on the test directory's XFS, and refused
without a copy where the filesystem cannot reflink)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.storage.clone import reflink_file_sync, supports_reflink
from agentenv.vmm.firecracker_memory import DiffBase, keep_diff_base, seed_diff_target

MIB = 1024 * 1024


@pytest.fixture
def reflink_dir(test_root: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fc-memory-", dir=test_root))
    if not supports_reflink(path):
        pytest.skip(f"{path} cannot reflink (scripts/test puts AENV_TEST_DIR on XFS)")
    yield path


def _image(path: Path, size: int = 2 * MIB, fill: bytes = b"\x07") -> Path:
    path.write_bytes(fill * size)
    return path


def test_a_base_is_usable_only_while_it_is_the_same_file(reflink_dir: Path) -> None:
    image = _image(reflink_dir / "image")
    base = DiffBase.of(image)
    assert base.usable(2 * MIB)
    assert not base.usable(4 * MIB)  # Firecracker would zero a file of another size
    assert DiffBase.from_dict(base.to_dict()) == base
    assert DiffBase.from_dict({"path": "x"}) is None and DiffBase.from_dict(None) is None
    # Replaced by another file (a later save under the same name): not that base.
    _image(reflink_dir / "other", fill=b"\x08").rename(image)
    assert not base.usable(2 * MIB)
    base = DiffBase.of(image)
    with open(image, "r+b") as f:  # changed in place
        f.write(b"\x09")
    os.utime(image, ns=(base.mtime_ns + 1, base.mtime_ns + 1))
    assert not base.usable(2 * MIB)
    image.unlink()
    assert not base.usable(2 * MIB)  # gone


def test_kept_base_outlives_its_image_and_seeds_a_target(reflink_dir: Path) -> None:
    image = _image(reflink_dir / "image")
    base = keep_diff_base(image, reflink_dir / "kept")
    assert base is not None and base.path == (reflink_dir / "kept").resolve()
    image.unlink()  # e.g. a pause's image, removed once its sandbox resumed
    assert base.usable(2 * MIB)
    target = reflink_dir / "out" / "memory.tmp"
    target.parent.mkdir()
    assert seed_diff_target(base, target, owner=(4242, 4343))
    st = target.stat()
    assert (st.st_uid, st.st_gid, st.st_size) == (4242, 4343, 2 * MIB)
    assert target.read_bytes() == b"\x07" * (2 * MIB)


def test_no_reflink_means_no_copy(tmp_path: Path) -> None:
    if supports_reflink(tmp_path):
        pytest.skip(f"{tmp_path} can reflink; this checks a filesystem that cannot")
    image = _image(tmp_path / "image")
    assert not reflink_file_sync(image, tmp_path / "clone")
    assert keep_diff_base(image, tmp_path / "kept") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image"]
