"""Guest kernel (Debian cloud kernel as an uncompressed ELF vmlinux plus its module tree)
and the small initramfs that finds the disks and hands over to the tools drive."""

from __future__ import annotations

import gzip
import os
import re
import shutil
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from agentenv.guest.debian import DebPackage, download, extract
from agentenv.guest.errors import GuestImageError
from agentenv.guest.host import STATIC_BUSYBOX, run

KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
KERNEL_BUILD_VERSION = 1
INITRD_BUILD_VERSION = 1
LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"

# Features agent workloads need; each must be built in (y) or a module (m).
REQUIRED_CONFIG: tuple[str, ...] = (
    "SMP",
    "CGROUPS",
    "NAMESPACES",
    "OVERLAY_FS",
    "FUSE_FS",
    "NF_TABLES",
    "VIRTIO_BALLOON",
)

# What the initramfs must load to find the disks and the NIC. Dependencies (and ext4, if it
# is a module in this kernel) are added and ordered from modules.dep; built-ins are skipped.
INITRD_MODULES: tuple[str, ...] = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_balloon",
    "virtio_console",
    "ext4",
)
INITRD_APPLETS: tuple[str, ...] = (
    "sh",
    "mount",
    "umount",
    "insmod",
    "switch_root",
    "mkdir",
    "cat",
    "echo",
    "sleep",
    "ls",
    "poweroff",
    "setsid",
    "cttyhack",
    "grep",
    "dmesg",
)


def kernel_release(package: DebPackage) -> str:
    """``linux-image-6.1.0-57-cloud-amd64`` -> ``6.1.0-57-cloud-amd64``."""
    prefix = "linux-image-"
    if not package.name.startswith(prefix):
        raise GuestImageError(f"{package.name} is not a linux-image package")
    return package.name[len(prefix) :]


async def resolve_kernel_package(depends: Callable[[str], Any]) -> str:
    """The concrete ``linux-image-<ver>-cloud-amd64`` the metapackage depends on."""
    deps: list[str] = await depends(KERNEL_METAPACKAGE)
    concrete = [d for d in deps if re.fullmatch(r"linux-image-[0-9].*-cloud-amd64", d)]
    if not concrete:
        raise GuestImageError(
            f"{KERNEL_METAPACKAGE} depends on no concrete kernel ({deps}); run 'apt-get update'"
        )
    return concrete[0]


def parse_kernel_config(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("CONFIG_") and "=" in line:
            key, _, value = line.partition("=")
            values[key[len("CONFIG_") :]] = value
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            values[line[len("# CONFIG_") : -len(" is not set")]] = "n"
    return values


def check_kernel_config(config: dict[str, str]) -> dict[str, str]:
    """Value of each required option; raise if any is neither y nor m."""
    found = {name: config.get(name, "n") for name in REQUIRED_CONFIG}
    bad = {k: v for k, v in found.items() if v not in ("y", "m")}
    if bad:
        raise GuestImageError(f"guest kernel lacks required options: {bad}")
    return found


def extract_vmlinux_payload(bzimage: bytes) -> Iterable[bytes]:
    """Candidate LZ4 legacy streams inside a bzImage, in file order."""
    start = 0
    while (offset := bzimage.find(LZ4_LEGACY_MAGIC, start)) >= 0:
        yield bzimage[offset:]
        start = offset + 1


async def _write_vmlinux(bzimage: Path, dest: Path) -> None:
    candidate = dest.with_suffix(".lz4")
    try:
        for payload in extract_vmlinux_payload(bzimage.read_bytes()):
            candidate.write_bytes(payload)
            try:
                # lz4 exits non-zero on the bzImage's trailing bytes after the frame even
                # when the kernel decompressed fully; the ELF check below decides.
                await run(
                    [
                        "sh",
                        "-c",
                        'lz4 -dc "$1" > "$2" 2>/dev/null; true',
                        "sh",
                        str(candidate),
                        str(dest),
                    ]
                )
            finally:
                candidate.unlink()
            with dest.open("rb") as f:
                if f.read(4) == b"\x7fELF" and dest.stat().st_size > (1 << 20):
                    return
        raise GuestImageError(f"{bzimage}: no LZ4-compressed ELF kernel found (not KERNEL_LZ4?)")
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


async def build_kernel(
    out: Path, package: DebPackage, deb_dir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """Fill ``out`` with ``vmlinux``, ``config`` and ``lib/modules/<release>`` (depmod'ed)."""
    release = kernel_release(package)
    (deb,) = await download([package], deb_dir)
    unpacked = out.parent / "pkg"
    await extract(deb, unpacked)
    config_text = (unpacked / f"boot/config-{release}").read_text()
    config = parse_kernel_config(config_text)
    checks = check_kernel_config(config)
    log(f"kernel: config check {checks}")
    await _write_vmlinux(unpacked / f"boot/vmlinuz-{release}", out / "vmlinux")
    shutil.copy2(unpacked / f"boot/config-{release}", out / "config")
    (out / "lib/modules").mkdir(parents=True)
    os.rename(unpacked / f"lib/modules/{release}", out / f"lib/modules/{release}")
    await run(["depmod", "-b", out, release])
    for path in (out / "vmlinux", out / "config"):
        path.chmod(0o444)
    return {
        "release": release,
        "package": package.name,
        "version": package.version,
        "deb_sha256": package.sha256,
        "config_checks": checks,
        "ext4": config.get("EXT4_FS", "n"),
        "vmlinux_bytes": (out / "vmlinux").stat().st_size,
        "bzimage_bytes": (unpacked / f"boot/vmlinuz-{release}").stat().st_size,
    }


def _module_index(modules_dir: Path) -> tuple[dict[str, str], dict[str, list[str]], set[str]]:
    """(name -> relative path, relative path -> dependency paths, built-in names)."""

    def name_of(rel: str) -> str:
        return os.path.basename(rel).split(".ko")[0].replace("-", "_")

    paths: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        rel, _, rest = line.partition(":")
        paths[name_of(rel)] = rel
        deps[rel] = rest.split()
    builtin = {name_of(line) for line in (modules_dir / "modules.builtin").read_text().split()}
    return paths, deps, builtin


def initrd_module_order(modules_dir: Path, wanted: Iterable[str] = INITRD_MODULES) -> list[str]:
    """Relative .ko paths to insmod, dependencies first; built-in modules are skipped."""
    paths, deps, builtin = _module_index(modules_dir)
    order: list[str] = []

    def visit(rel: str) -> None:
        if rel in order:
            return
        # modules.dep lists transitive deps with the deepest last; load those first.
        for dep in reversed(deps.get(rel, [])):
            visit(dep)
        order.append(rel)

    for name in wanted:
        if name in builtin:
            continue
        if name not in paths:
            raise GuestImageError(f"kernel has no module {name!r} and it is not built in")
        visit(paths[name])
    return order


def initramfs_init_script() -> str:
    return resources.files("agentenv.guest").joinpath("files/initramfs-init.sh").read_text()


async def build_initrd(out: Path, kernel_dir: Path, release: str) -> dict[str, Any]:
    """Fill ``out`` with ``initrd.cpio.gz``: static busybox, the virtio modules, /init."""
    root = out.parent / "initrd-root"
    modules_dir = kernel_dir / "lib/modules" / release
    order = initrd_module_order(modules_dir)
    for sub in ("bin", "dev", "proc", "sys", "newroot", "modules", "etc"):
        (root / sub).mkdir(parents=True)
    shutil.copy2(STATIC_BUSYBOX, root / "bin/busybox")
    for applet in INITRD_APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    names = []
    for rel in order:
        shutil.copy2(modules_dir / rel, root / "modules" / os.path.basename(rel))
        names.append(os.path.basename(rel))
    (root / "etc/modules").write_text("".join(f"{n}\n" for n in names))
    init = root / "init"
    init.write_text(initramfs_init_script())
    init.chmod(0o755)
    members = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cpio_path = out.parent / "initrd.cpio"
    await run(
        ["cpio", "--quiet", "-o", "-H", "newc", "--reproducible", "-R", "0:0", "-O", cpio_path],
        cwd=root,
        stdin=("\n".join([".", *members]) + "\n").encode(),
    )
    gz = out / "initrd.cpio.gz"
    with cpio_path.open("rb") as src, gzip.GzipFile(gz, "wb", compresslevel=9, mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    gz.chmod(0o444)
    return {"modules": names, "initrd_bytes": gz.stat().st_size}
