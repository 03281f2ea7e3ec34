"""The guest image: four content-addressed components plus a manifest, and the public
entry points to build and load it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.guest import debian, kernel, rootfs, tools
from agentenv.guest.cache import ComponentCache, build_lock, content_key, remove_tree, sha256_file
from agentenv.guest.errors import GuestImageError, GuestImageMissing
from agentenv.guest.host import STATIC_BUSYBOX, require_host_tools

MANIFEST_VERSION = 1
CURRENT_LINK = "current"
IMAGES_DIR = "images"
MANIFEST_FILE = "manifest.json"
BUILD_HINT = "build it with: python -m agentenv.guest build --cache-dir {cache_dir}"


@dataclass(frozen=True)
class GuestImage:
    """Paths of one built guest image. All files are read-only; VMs must put a copy-on-write
    overlay over ``rootfs`` and attach ``tools`` read-only."""

    digest: str
    kernel: Path
    initrd: Path
    rootfs: Path
    tools: Path
    kernel_version: str
    details: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def manifest(self) -> dict[str, Any]:
        return {
            **self.details,
            "digest": self.digest,
            "kernel_version": self.kernel_version,
            "files": {
                "kernel": str(self.kernel),
                "initrd": str(self.initrd),
                "rootfs": str(self.rootfs),
                "tools": str(self.tools),
            },
        }


def default_cache_dir() -> Path:
    """``$AENV_IMAGE_CACHE`` or ``/var/cache/agentenv/images``."""
    return Path(os.environ.get("AENV_IMAGE_CACHE") or "/var/cache/agentenv/images")


def _image_from_manifest(manifest: dict[str, Any]) -> GuestImage:
    files = manifest["files"]
    return GuestImage(
        digest=manifest["digest"],
        kernel=Path(files["kernel"]),
        initrd=Path(files["initrd"]),
        rootfs=Path(files["rootfs"]),
        tools=Path(files["tools"]),
        kernel_version=manifest["kernel_version"],
        details={
            k: v for k, v in manifest.items() if k not in ("digest", "kernel_version", "files")
        },
    )


def load_guest_image(cache_dir: Path) -> GuestImage:
    """The most recently built image in ``cache_dir``."""
    manifest_path = cache_dir / CURRENT_LINK / MANIFEST_FILE
    hint = BUILD_HINT.format(cache_dir=cache_dir)
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise GuestImageMissing(f"no guest image in {cache_dir}; {hint}") from None
    except (OSError, ValueError) as exc:
        raise GuestImageError(f"unreadable guest image manifest {manifest_path}: {exc}") from exc
    image = _image_from_manifest(manifest)
    absent = [
        str(p) for p in (image.kernel, image.initrd, image.rootfs, image.tools) if not p.is_file()
    ]
    if absent:
        raise GuestImageMissing(f"guest image {image.digest} is incomplete ({absent}); {hint}")
    return image


async def _resolve_packages(
    cache_dir: Path, log: Callable[[str], None]
) -> tuple[debian.DebPackage, list[debian.DebPackage]]:
    """The concrete kernel .deb and the .debs of the bundled Python, as apt resolves them
    now. Remembered per apt state, since each apt query here costs about a second."""
    state = debian.apt_state_key()
    remembered = cache_dir / "resolved" / f"{state}.json"
    if remembered.is_file():
        data = json.loads(remembered.read_text())
        return debian.DebPackage(**data["kernel"]), [debian.DebPackage(**p) for p in data["python"]]
    log("guest image: resolving Debian packages")
    kernel_name = await kernel.resolve_kernel_package(debian.depends)
    python_names = await debian.dependency_closure(
        tools.PYTHON_ROOTS, tools.is_shared_library_package
    )
    located = {
        p.name: p
        for p in await debian.locate([kernel_name, *python_names, *tools.PYTHON_EXTRA_PACKAGES])
    }
    kernel_deb = located.pop(kernel_name)
    python_debs = sorted(located.values(), key=lambda p: p.name)
    remembered.parent.mkdir(parents=True, exist_ok=True)
    tmp = remembered.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps(
            {"kernel": asdict(kernel_deb), "python": [asdict(p) for p in python_debs]}, indent=1
        )
    )
    os.replace(tmp, remembered)
    return kernel_deb, python_debs


def _publish(cache_dir: Path, digest: str, manifest: dict[str, Any]) -> None:
    """Write images/<digest>/manifest.json and point ``current`` at it, both atomically."""
    images = cache_dir / IMAGES_DIR
    final = images / digest
    if not (final / MANIFEST_FILE).is_file():
        staging = cache_dir / "tmp" / f"image-{digest}-{os.getpid()}"
        remove_tree(staging)
        staging.mkdir(parents=True)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        images.mkdir(parents=True, exist_ok=True)
        if final.exists():
            remove_tree(final)
        os.rename(staging, final)
    link_tmp = cache_dir / f".{CURRENT_LINK}.{os.getpid()}"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(Path(IMAGES_DIR) / digest)
    os.replace(link_tmp, cache_dir / CURRENT_LINK)


async def build_guest_image(cache_dir: Path, *, log: Callable[[str], None] = print) -> GuestImage:
    """Build (or find in the cache) every component and return the image. Idempotent: a run
    whose inputs are unchanged only resolves package versions and hashes sources."""
    require_host_tools()
    started = time.monotonic()
    cache = ComponentCache(cache_dir)
    deb_dir = cache_dir / "debs"
    async with build_lock(cache_dir, log):
        kernel_deb, python_debs = await _resolve_packages(cache_dir, log)
        release = kernel.kernel_release(kernel_deb)
        log(
            f"guest image: kernel {kernel_deb.name} {kernel_deb.version}, "
            f"python from {len(python_debs)} .debs"
        )

        rootfs_inputs = rootfs.rootfs_inputs()
        rootfs_key = content_key(rootfs_inputs)
        # debootstrap is mostly network and dpkg time: overlap it with the other components.
        rootfs_task = asyncio.create_task(
            cache.ensure(
                "rootfs", rootfs_key, rootfs_inputs, lambda out: rootfs.build_rootfs(out, log), log
            )
        )
        try:
            kernel_inputs = {
                "build_version": kernel.KERNEL_BUILD_VERSION,
                "package": kernel_deb.name,
                "version": kernel_deb.version,
                "sha256": kernel_deb.sha256,
            }
            kernel_key = content_key(kernel_inputs)
            kernel_dir, kernel_meta = await cache.ensure(
                "kernel",
                kernel_key,
                kernel_inputs,
                lambda out: kernel.build_kernel(out, kernel_deb, deb_dir, log),
                log,
            )
            initrd_inputs = {
                "build_version": kernel.INITRD_BUILD_VERSION,
                "kernel": kernel_key,
                "modules": list(kernel.INITRD_MODULES),
                "init": content_key(kernel.initramfs_init_script()),
                "busybox": sha256_file(STATIC_BUSYBOX),
            }
            initrd_key = content_key(initrd_inputs)
            initrd_dir, initrd_meta = await cache.ensure(
                "initrd",
                initrd_key,
                initrd_inputs,
                lambda out: kernel.build_initrd(out, kernel_dir, release),
                log,
            )
            tools_inputs = tools.tools_inputs(python_debs, kernel_key, release)
            tools_key = content_key(tools_inputs)
            tools_dir, tools_meta = await cache.ensure(
                "tools",
                tools_key,
                tools_inputs,
                lambda out: tools.build_tools(out, python_debs, kernel_dir, release, deb_dir, log),
                log,
            )
            rootfs_dir, rootfs_meta = await rootfs_task
        finally:
            if not rootfs_task.done():
                rootfs_task.cancel()
                await asyncio.gather(rootfs_task, return_exceptions=True)

        keys = {
            "kernel": kernel_key,
            "initrd": initrd_key,
            "tools": tools_key,
            "rootfs": rootfs_key,
        }
        digest = content_key({"manifest_version": MANIFEST_VERSION, **keys})
        manifest: dict[str, Any] = {
            "manifest_version": MANIFEST_VERSION,
            "digest": digest,
            "kernel_version": release,
            "files": {
                "kernel": str(kernel_dir / "vmlinux"),
                "initrd": str(initrd_dir / "initrd.cpio.gz"),
                "rootfs": str(rootfs_dir / "rootfs.ext4"),
                "tools": str(tools_dir / "tools.ext4"),
            },
            "components": {
                "kernel": kernel_meta,
                "initrd": initrd_meta,
                "tools": tools_meta,
                "rootfs": rootfs_meta,
            },
        }
        _publish(cache_dir, digest, manifest)
    image = _image_from_manifest(manifest)
    log(f"guest image: {digest} ready in {time.monotonic() - started:.1f} s")
    return image


def find_guest_image(cache_dir: Path, digest: str) -> GuestImage | None:
    """The built image ``digest`` in ``cache_dir``, or None if this host does not have it
    (complete)."""
    path = cache_dir / IMAGES_DIR / digest / MANIFEST_FILE
    try:
        image = _image_from_manifest(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(p.is_file() for p in (image.kernel, image.initrd, image.rootfs, image.tools)):
        return None
    return image
