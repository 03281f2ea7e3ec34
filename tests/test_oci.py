"""Pulling OCI images into ext4 root disks (agentenv.storage.oci) from a local registry.
Needs root (loop mounts, file ownership), skopeo, umoci and docker-registry; no VMs."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.storage.oci import (
    ImageConfig,
    ImageError,
    PulledImage,
    cached_images,
    normalize_reference,
    prepare_rootfs,
    pull_image,
    remove_image,
)
from tests.helpers import free_port
from tests.registry import (
    IMAGE_ENV,
    IMAGE_WORKDIR,
    KEPT,
    LAYER2_FILE,
    LAYER2_TEXT,
    WHITED_OUT,
    LocalRegistry,
    build_test_layout,
    layout_manifest_digest,
    push_test_image,
    start_registry,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (umoci, mkfs -d)")


@dataclass
class Pulled:
    cache: Path
    reference: str
    images: list[PulledImage]
    logs: list[list[str]]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    with start_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def test_ref(registry: LocalRegistry) -> str:
    return push_test_image(registry)


@pytest.fixture(scope="module")
def pulled(test_ref: str, tmp_path_factory: pytest.TempPathFactory) -> Pulled:
    """Two concurrent pulls of the test image into one empty cache."""
    cache = tmp_path_factory.mktemp("oci-cache")
    logs: list[list[str]] = [[], []]

    async def both() -> list[PulledImage]:
        return list(
            await asyncio.gather(
                *(pull_image(test_ref, cache, log=logs[i].append) for i in range(2))
            )
        )

    return Pulled(cache, test_ref, asyncio.run(both()), logs)


def debugfs(image: Path, request: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["debugfs", "-R", request, str(image)], capture_output=True, text=True, check=True
    )


def cat(image: Path, path: str) -> str:
    return debugfs(image, f"cat {path}").stdout


def exists(image: Path, path: str) -> bool:
    return "File not found" not in debugfs(image, f"stat {path}").stderr


def inode_mode_owner(image: Path, path: str) -> tuple[int, int, int]:
    """(st_mode, uid, gid) of ``path``, from its parent's ``ls -p`` lines
    (``/ino/mode/uid/gid/name/size/``)."""
    parent, name = os.path.split(path)
    for line in debugfs(image, f"ls -p {parent}").stdout.split():
        fields = line.split("/")
        if fields[5] == name:
            return int(fields[2], 8), int(fields[3]), int(fields[4])
    raise FileNotFoundError(path)


# --- normalize_reference ------------------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("debian:12", "docker://docker.io/library/debian:12"),
        ("debian", "docker://docker.io/library/debian:latest"),
        ("foo/bar", "docker://docker.io/foo/bar:latest"),
        ("127.0.0.1:5000/x/y:t", "docker://127.0.0.1:5000/x/y:t"),
        ("localhost/x", "docker://localhost/x:latest"),
        ("ghcr.io/org/img:v1.2-rc_3", "docker://ghcr.io/org/img:v1.2-rc_3"),
        ("docker://debian:12", "docker://docker.io/library/debian:12"),
        ("docker://quay.io/a/b:c", "docker://quay.io/a/b:c"),
        (f"debian@{DIGEST}", f"docker://docker.io/library/debian@{DIGEST}"),
        (f"registry.example:443/a/b@{DIGEST}", f"docker://registry.example:443/a/b@{DIGEST}"),
        (f"debian:12@{DIGEST}", f"docker://docker.io/library/debian@{DIGEST}"),
        ("[::1]:5000/a:b", "docker://[::1]:5000/a:b"),
    ],
)
def test_normalize_reference(ref: str, expected: str) -> None:
    assert normalize_reference(ref) == expected


@pytest.mark.parametrize(
    "ref",
    [
        "",
        " ",
        "debian 12",
        " debian",
        "Debian:12",
        "ghcr.io/Org/img",
        "debian:",
        "debian:-bad",
        "debian:a/b",
        "debian@sha256:short",
        "debian@md5:" + "a" * 32,
        "/debian",
        "debian/",
        "a//b",
        "oci:/tmp/layout:tag",
        "https://example.com/x",
    ],
)
def test_normalize_reference_rejects(ref: str) -> None:
    with pytest.raises(ImageError):
        normalize_reference(ref)


# --- pulling ------------------------------------------------------------------------------


def test_pull_applies_layers(pulled: Pulled) -> None:
    rootfs = pulled.images[0].rootfs
    assert cat(rootfs, LAYER2_FILE) == LAYER2_TEXT
    assert cat(rootfs, KEPT) == "kept from layer 1\n"
    assert exists(rootfs, KEPT)
    assert not exists(rootfs, WHITED_OUT)  # layer 2's whiteout
    assert exists(rootfs, "/usr/bin/bash")


def test_pull_prepares_rootfs_for_agentenv(pulled: Pulled) -> None:
    image = pulled.images[0]
    rootfs = image.rootfs
    # The test image has neither /.aenv nor the user account: the pull added them.
    mode, uid, _ = inode_mode_owner(rootfs, "/.aenv")
    assert stat.S_ISDIR(mode) and uid == 0
    names = [line.split("/")[5] for line in debugfs(rootfs, "ls -p /.aenv").stdout.split()]
    assert names == [".", ".."]
    assert "user:x:1000:1000::/home/user:/bin/bash" in cat(rootfs, "/etc/passwd").splitlines()
    assert "user:x:1000:" in cat(rootfs, "/etc/group").splitlines()
    assert any(line.startswith("user:") for line in cat(rootfs, "/etc/shadow").splitlines())
    assert cat(rootfs, "/etc/passwd").startswith("root:x:0:0:")
    mode, uid, gid = inode_mode_owner(rootfs, "/home/user")
    assert stat.S_ISDIR(mode) and (uid, gid) == (1000, 1000)
    mode, _, _ = inode_mode_owner(rootfs, "/tmp")
    assert stat.S_IMODE(mode) == 0o1777
    assert exists(rootfs, "/etc/hostname") and exists(rootfs, "/etc/hosts")

    header = subprocess.run(
        ["dumpe2fs", "-h", str(rootfs)], capture_output=True, text=True, check=True
    ).stdout
    assert "Filesystem volume name:   aenv-root" in header
    assert rootfs.stat().st_size == 4096 << 20  # the default disk size, sparse
    assert 0 < image.size_bytes < rootfs.stat().st_size
    assert rootfs.stat().st_mode & 0o222 == 0


def test_pull_parses_config(pulled: Pulled) -> None:
    image = pulled.images[0]
    assert image.reference == f"docker://{pulled.reference}"
    assert image.digest == layout_manifest_digest(build_test_layout())
    assert image.config.env == IMAGE_ENV
    assert image.config.workdir == IMAGE_WORKDIR
    assert image.config.user == "root"
    assert image.config.cmd == ["/bin/bash"] and image.config.entrypoint == []
    assert ImageConfig.from_dict(image.config.to_dict()) == image.config
    meta = json.loads((image.rootfs.parent / "image.json").read_text())
    assert meta["digest"] == image.digest and meta["config"] == image.config.to_dict()


def test_concurrent_pulls_build_once(pulled: Pulled) -> None:
    first, second = pulled.images
    assert first == second
    assert first.rootfs == pulled.cache / first.digest.removeprefix("sha256:") / "rootfs.ext4"
    all_lines = pulled.logs[0] + pulled.logs[1]
    assert sum(line == "unpacking" for line in all_lines) == 1
    assert sum(line.startswith("making filesystem 4096 MiB") for line in all_lines) == 1
    # Nothing but the image and its lock file is left in the cache.
    names = sorted(p.name for p in pulled.cache.iterdir() if not p.name.startswith(".skopeo"))
    hexdigest = first.digest.removeprefix("sha256:")
    assert names == [hexdigest, f"{hexdigest}.lock"]


async def test_second_pull_is_cached(pulled: Pulled) -> None:
    image = pulled.images[0]
    mtime = image.rootfs.stat().st_mtime_ns
    lines: list[str] = []
    again = await pull_image(pulled.reference, pulled.cache, log=lines.append)
    assert again == image
    assert again.rootfs.stat().st_mtime_ns == mtime
    assert [line.split()[0] for line in lines] == ["resolving", "cached"]


async def test_pull_by_digest_uses_cache_without_registry(pulled: Pulled) -> None:
    image = pulled.images[0]
    repo = pulled.reference.rsplit(":", 1)[0]
    lines: list[str] = []
    by_digest = await pull_image(f"{repo}@{image.digest}", pulled.cache, log=lines.append)
    assert by_digest.rootfs == image.rootfs
    assert by_digest.reference == f"docker://{repo}@{image.digest}"
    assert [line.split()[0] for line in lines] == ["cached"]


def test_cached_images_lists_the_pull(pulled: Pulled) -> None:
    assert cached_images(pulled.cache) == [
        PulledImage(
            reference=f"docker://{pulled.reference}",
            digest=pulled.images[0].digest,
            rootfs=pulled.images[0].rootfs,
            config=pulled.images[0].config,
            size_bytes=pulled.images[0].size_bytes,
        )
    ]


def test_remove_image(tmp_path: Path) -> None:
    digest = "sha256:" + "cd" * 32
    image_dir = tmp_path / digest.removeprefix("sha256:")
    image_dir.mkdir()
    (image_dir / "rootfs.ext4").write_bytes(b"\0" * 4096)
    (image_dir / "rootfs.ext4").chmod(0o444)
    config = ImageConfig(env={}, workdir=None, user=None, entrypoint=[], cmd=[])
    meta = {"reference": "docker://x/y:z", "digest": digest, "config": config.to_dict()}
    (image_dir / "image.json").write_text(json.dumps(meta))
    (tmp_path / "junk").mkdir()
    assert [i.digest for i in cached_images(tmp_path)] == [digest]
    remove_image(tmp_path, digest)
    assert cached_images(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk"]
    remove_image(tmp_path, digest)  # absent: no error


async def test_unknown_tag(registry: LocalRegistry, tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"manifest unknown|not found"):
        await pull_image(f"{registry.host}/agentenv/test-debian:nope", tmp_path)
    with pytest.raises(ImageError, match="cannot resolve"):
        await pull_image(f"{registry.host}/agentenv/no-such-image:1", tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".skopeo")] == []


async def test_unreachable_registry(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="connection refused") as info:
        await pull_image(f"127.0.0.1:{free_port()}/a/b:c", tmp_path)
    assert len(str(info.value)) < 2000


async def test_bad_reference_is_image_error(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="invalid image reference"):
        await pull_image("Not A Reference", tmp_path)


async def test_failed_build_leaves_nothing(test_ref: str, tmp_path: Path) -> None:
    # A disk larger than the host filesystem's maximum file size: mkfs.ext4 fails after
    # the copy and the unpack succeeded.
    lines: list[str] = []
    with pytest.raises(ImageError, match="cannot make a filesystem"):
        await pull_image(test_ref, tmp_path, disk_size_mib=64 << 20, log=lines.append)
    assert "unpacking" in lines
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".skopeo")]
    assert all(name.endswith(".lock") for name in left), left


# --- preparing a tree ---------------------------------------------------------------------


def test_prepare_rootfs_stays_inside_the_tree(tmp_path: Path) -> None:
    """An image whose /etc is an absolute symlink, whose uid 1000 is taken and which has
    no shadow file: files are written where the guest will see them, never on the host."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "real-etc").mkdir(parents=True)
    (root / "etc").symlink_to("/real-etc")
    (root / "real-etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n"
    )
    (root / "real-etc/group").write_text("root:x:0:\nnode:x:1000:\n")
    # A hostile link pointing out of the tree: resolved inside it instead.
    (root / "real-etc/hostname").symlink_to(f"../../../../../..{outside}/hostname")
    (root / ".aenv").symlink_to("/")
    (root / "bin").mkdir()
    (root / "bin/sh").write_text("")

    prepare_rootfs(root)

    assert list(outside.iterdir()) == []
    assert (root / outside.relative_to("/") / "hostname").read_text() == "sandbox\n"
    assert (root / ".aenv").is_dir() and not (root / ".aenv").is_symlink()
    passwd = (root / "real-etc/passwd").read_text().splitlines()
    assert "user:*:1001:1001::/home/user:/bin/sh" in passwd
    assert "user:x:1001:" in (root / "real-etc/group").read_text().splitlines()
    assert not (root / "real-etc/shadow").exists()
    assert (root / "home/user").stat().st_uid == 1001
    assert (root / "real-etc/hosts").exists()
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777


def test_prepare_rootfs_empty_tree(tmp_path: Path) -> None:
    """A scratch image (e.g. one static binary) gets root and user from nothing."""
    prepare_rootfs(tmp_path)
    assert (tmp_path / "etc/passwd").read_text().splitlines() == [
        "root:*:0:0:root:/root:/bin/sh",
        "user:*:1000:1000::/home/user:/bin/sh",
    ]
    assert (tmp_path / "etc/group").read_text().splitlines() == ["root:x:0:", "user:x:1000:"]
    assert (tmp_path / ".aenv").is_dir()
    prepare_rootfs(tmp_path)  # idempotent
    assert len((tmp_path / "etc/passwd").read_text().splitlines()) == 2
