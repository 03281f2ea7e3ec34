"""The KVM test host's root filesystem: Debian bookworm with every package
``scripts/install`` installs, the guest kernel's module tree (``kvm_amd``, ``xfs``, ``tun``,
nftables...) and a copy of the Python the project's ``.venv`` was made from, at the same
path, so the checkout's virtualenv runs inside unchanged and nothing is downloaded there.

Built beside the guest image, not by agentenv's template machinery: a template is a
snapshot of a sandbox guest (envd, fixed disk layout, no ``-cpu max``), while this is a
plain Debian machine that runs agentenv itself. It does reuse the guest pipeline's
content-addressed :class:`~agentenv.guest.cache.ComponentCache` (kind ``kvmhost-rootfs``
in the same cache directory), so it is rebuilt only when an input changes: the package
list, the build steps (``BUILD_VERSION``), the guest kernel and the Python tree's file
listing (names, sizes, mtimes).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.guest import GuestImage
from agentenv.guest.cache import ComponentCache, build_lock, content_key
from agentenv.guest.debian import debian_mirror, host_apt_sources
from agentenv.guest.host import host_env, require_host_tools, run

ROOT = Path(__file__).resolve().parents[2]
KIND = "kvmhost-rootfs"
# Bump when the build steps below change the produced filesystem.
BUILD_VERSION = 1
SUITE = "bookworm"
HOSTNAME = "kvmhost"
GIB = 1 << 30
# Besides scripts/install's packages: what the host's own init and tests use.
EXTRA_PACKAGES: tuple[str, ...] = ("kmod", "iputils-ping", "less", "psmisc", "git")


def install_apt_packages(script: Path = ROOT / "scripts/install") -> list[str]:
    """The ``APT_PACKAGES=( ... )`` list of ``scripts/install``, so the host has exactly
    what the project's install would put there."""
    text = script.read_text()
    match = re.search(r"^APT_PACKAGES=\((.*?)^\)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise RuntimeError(f"no APT_PACKAGES=( ... ) array in {script}")
    names: list[str] = []
    for line in match.group(1).splitlines():
        names += line.split("#", 1)[0].split()
    return names


def venv_python_prefix(venv: Path) -> Path | None:
    """The installation prefix of the Python ``venv`` was made from (its ``pyvenv.cfg``
    ``home`` is that prefix's ``bin``), or None when that is Debian's own /usr, which the
    image's ``python3`` package provides."""
    config = (venv.resolve() / "pyvenv.cfg").read_text()
    match = re.search(r"^home\s*=\s*(.+)$", config, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{venv}/pyvenv.cfg names no home")
    prefix = Path(match.group(1).strip()).parent
    return None if prefix == Path("/usr") else prefix


def tree_fingerprint(root: Path) -> str:
    """A hash of the names, sizes and mtimes of every file under ``root``: cheap (no file
    is read), and it changes whenever a file is replaced or rewritten."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            stat = os.lstat(path)
            entry = f"{os.path.relpath(path, root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n"
            digest.update(entry.encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class HostImage:
    """The built root filesystem (read-only; the host boots a copy-on-write overlay)."""

    rootfs: Path
    key: str


def image_inputs(guest: GuestImage, python_prefix: Path | None) -> dict[str, Any]:
    kernel_key = guest.kernel.parent.name
    return {
        "build_version": BUILD_VERSION,
        "suite": SUITE,
        "packages": sorted({*install_apt_packages(), *EXTRA_PACKAGES}),
        "kernel": [kernel_key, guest.kernel_version],
        "python": None
        if python_prefix is None
        else [str(python_prefix), tree_fingerprint(python_prefix)],
    }


def _sources_list() -> str:
    lines = [
        f"deb {uri} {suite} main"
        for uri, suite in host_apt_sources()
        if suite == SUITE or suite.startswith(SUITE + "-")
    ]
    return "\n".join(dict.fromkeys(lines)) + "\n"


def tree_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take on disk (what an image holding them needs)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


async def _build(
    out: Path,
    packages: list[str],
    guest: GuestImage,
    python_prefix: Path | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    tree = out.parent / "tree"
    mirror = debian_mirror(SUITE)
    log(f"kvm host image: debootstrap {SUITE} from {mirror}")
    await run(["debootstrap", "--variant=minbase", "--merged-usr", SUITE, tree, mirror])
    (tree / "etc/apt/sources.list").write_text(_sources_list())
    # Services the packages ship (redis, the registry) must not start in the build chroot.
    policy = tree / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    env = host_env({"HOME": "/root"})
    await run(["mount", "-t", "proc", "proc", tree / "proc"])
    try:
        log(f"kvm host image: apt-get install {len(packages)} packages")
        await run(["chroot", tree, "apt-get", "update", "-q"], env=env)
        install: list[str | Path] = ["chroot", tree, "apt-get", "install", "-y", "-q"]
        await run([*install, "--no-install-recommends", *packages], env=env)
        await run(["chroot", tree, "apt-get", "clean"], env=env)
    finally:
        await run(["umount", tree / "proc"])
    policy.unlink()
    shutil.rmtree(tree / "var/lib/apt/lists")
    (tree / "var/lib/apt/lists/partial").mkdir(parents=True)
    modules = guest.kernel.parent / "lib/modules" / guest.kernel_version
    shutil.copytree(modules, tree / "usr/lib/modules" / guest.kernel_version, symlinks=True)
    if python_prefix is not None:
        log(f"kvm host image: copying the venv's Python {python_prefix}")
        target = tree / python_prefix.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        await run(["cp", "-a", python_prefix, target])
    (tree / "etc/hostname").write_text(HOSTNAME + "\n")
    (tree / "etc/hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n")
    (tree / "etc/resolv.conf").unlink(missing_ok=True)
    (tree / "etc/fstab").write_text("# filesystems are mounted by the kvm host's init\n")
    content = tree_bytes(tree)
    size_mib = (content + 2 * GIB) >> 20
    image = out / "rootfs.ext4"
    await run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "aenv-kvmhost",
            "-d",
            tree,
            "-E",
            "root_owner=0:0",
            image,
            f"{size_mib}M",
        ]
    )
    image.chmod(0o444)
    return {"file": image.name, "content_bytes": content, "image_mib": size_mib}


async def build_host_image(
    cache_dir: Path, guest: GuestImage, venv: Path, *, log: Callable[[str], None] = print
) -> HostImage:
    """The host root filesystem for ``guest``'s kernel and ``venv``'s Python, built into
    ``cache_dir`` unless an identical one is there."""
    require_host_tools()
    python_prefix = venv_python_prefix(venv)
    inputs = image_inputs(guest, python_prefix)
    key = content_key(inputs)
    cache = ComponentCache(cache_dir)
    # A lock of its own: the guest image's builds (every test session starts one) need
    # not wait for this one's minutes of debootstrap.
    async with build_lock(cache_dir / KIND, log):
        path, _meta = await cache.ensure(
            KIND,
            key,
            inputs,
            lambda out: _build(out, list(inputs["packages"]), guest, python_prefix, log),
            log,
        )
    return HostImage(rootfs=path / "rootfs.ext4", key=key)
