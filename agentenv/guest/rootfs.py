"""Base root filesystem: Debian minbase via debootstrap plus the usual shell tools and an
E2B-style ``user`` account, packed into a sparse ext4 image without mounting anything."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.guest.debian import debian_mirror, host_apt_sources
from agentenv.guest.host import host_env, run

# Bump when the steps below change the produced filesystem.
ROOTFS_BUILD_VERSION = 1
SUITE = "bookworm"
HOSTNAME = "sandbox"
USER_NAME = "user"
USER_UID = 1000
GIB = 1 << 30
MIN_IMAGE_BYTES = 4 * GIB
FREE_BYTES = 3 * GIB

PACKAGES: tuple[str, ...] = (
    "bash",
    "coreutils",
    "procps",
    "iproute2",
    "iputils-ping",
    "curl",
    "wget",
    "ca-certificates",
    "less",
    "vim-tiny",
    "sudo",
    "git",
    "python3",
    # E2B's base image has `python` and `pip`, and `python -m venv` works there.
    "python-is-python3",
    "python3-pip",
    "python3-venv",
    "jq",
    "xz-utils",
    "unzip",
    "tar",
    "gzip",
    "findutils",
    "grep",
    "sed",
    "locales",
    "tzdata",
    "kmod",
    "netbase",
)


def rootfs_inputs() -> dict[str, Any]:
    return {
        "suite": SUITE,
        "packages": sorted(PACKAGES),
        "build_version": ROOTFS_BUILD_VERSION,
        "user": [USER_NAME, USER_UID],
        "hostname": HOSTNAME,
    }


def _guest_sources_list(suite: str) -> str:
    """apt sources for the guest: the host's Debian mirrors for this suite family."""
    lines = []
    for uri, source_suite in host_apt_sources():
        if source_suite == suite or source_suite.startswith(suite + "-"):
            lines.append(f"deb {uri} {source_suite} main")
    return "\n".join(dict.fromkeys(lines)) + "\n"


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                total += os.lstat(path).st_blocks * 512
    return total


async def _customise(root: Path) -> None:
    """Account, identity and cleanup steps inside the fresh tree."""
    chroot_env = host_env({"HOME": "/root"})
    await run(
        [
            "chroot",
            root,
            "useradd",
            "--create-home",
            "--uid",
            str(USER_UID),
            "--shell",
            "/bin/bash",
            "--user-group",
            "--groups",
            "sudo",
            USER_NAME,
        ],
        env=chroot_env,
    )
    await run(["chroot", root, "passwd", "--delete", USER_NAME], env=chroot_env)
    sudoers = root / "etc/sudoers.d/90-aenv-user"
    sudoers.write_text(f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    sudoers.chmod(0o440)
    (root / "etc/hostname").write_text(HOSTNAME + "\n")
    (root / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    # Empty machine-id: aenv-init fills it at first boot (systemd semantics for "unset").
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
    # debootstrap copies the build host's resolver; the guest's is written by aenv-init.
    resolv = root / "etc/resolv.conf"
    if resolv.exists() or resolv.is_symlink():
        resolv.unlink()
    (root / "etc/default").mkdir(exist_ok=True)
    (root / "etc/default/locale").write_text("LANG=C.UTF-8\n")
    (root / "etc/apt/sources.list").write_text(_guest_sources_list(SUITE))
    (root / "etc/fstab").write_text("# filesystems are mounted by aenv-init\n")
    await run(["chroot", root, "apt-get", "clean"], env=chroot_env)
    for cache_dir in ("var/lib/apt/lists", "var/cache/apt", "var/cache/debconf", "var/log"):
        for path in sorted((root / cache_dir).rglob("*"), reverse=True):
            if path.is_file() or path.is_symlink():
                if path.name not in ("lock", "config.dat", "templates.dat", "passwords.dat"):
                    path.unlink()
    for docs in ("usr/share/man", "usr/share/info"):
        if (root / docs).is_dir():
            shutil.rmtree(root / docs)
            (root / docs).mkdir()


async def build_rootfs(out: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Fill ``out`` with ``rootfs.ext4``; return facts for the component's meta.json."""
    mirror = debian_mirror(SUITE)
    tree = out.parent / "tree"
    started = time.monotonic()
    log(f"rootfs: debootstrap --variant=minbase {SUITE} from {mirror}")
    await run(
        [
            "debootstrap",
            "--variant=minbase",
            "--merged-usr",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            tree,
            mirror,
        ]
    )
    debootstrap_seconds = round(time.monotonic() - started, 1)
    log(f"rootfs: debootstrap took {debootstrap_seconds} s")
    await _customise(tree)
    content = _tree_bytes(tree)
    size = max(MIN_IMAGE_BYTES, content + FREE_BYTES)
    size = (size + (1 << 20) - 1) // (1 << 20) << 20
    image = out / "rootfs.ext4"
    started = time.monotonic()
    await run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "aenv-root",
            "-d",
            tree,
            "-E",
            "root_owner=0:0",
            image,
            f"{size // (1 << 20)}M",
        ]
    )
    mkfs_seconds = round(time.monotonic() - started, 1)
    image.chmod(0o444)
    return {
        "file": image.name,
        "mirror": mirror,
        "debootstrap_seconds": debootstrap_seconds,
        "mkfs_seconds": mkfs_seconds,
        "content_bytes": content,
        "image_bytes": size,
        "allocated_bytes": image.stat().st_blocks * 512,
    }
