"""Host programs the pipeline runs: presence checks and an asyncio subprocess runner that
captures stderr into the raised error."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentenv.guest.errors import CommandFailed, GuestImageError, HostToolMissing

# Program -> Debian package that provides it. The project's install script installs exactly
# the packages named here (see README.md in this folder).
HOST_TOOLS: dict[str, str] = {
    "apt-get": "apt",
    "apt-cache": "apt",
    "dpkg-deb": "dpkg",
    "debootstrap": "debootstrap",
    "lz4": "lz4",
    "cpio": "cpio",
    "mkfs.ext4": "e2fsprogs",
    "depmod": "kmod",
    "chroot": "coreutils",
}

# Static binaries copied into the guest; they must not depend on the host's libc.
STATIC_BUSYBOX = Path("/bin/busybox")
# The guest's PID 1: catatonit blocks on a signalfd until a signal or a child's exit, where
# tini wakes every second to poll for zombies (an idle guest's wakeups are the node's CPU).
STATIC_INIT = Path("/usr/bin/catatonit")
STATIC_FILES: dict[Path, str] = {STATIC_BUSYBOX: "busybox-static", STATIC_INIT: "catatonit"}

APT_PACKAGES: tuple[str, ...] = tuple(
    sorted({*HOST_TOOLS.values(), *STATIC_FILES.values(), "debian-archive-keyring"})
)

_PT_INTERP = 3
_SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def find_tool(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + _SEARCH_PATH)


def is_static_elf(path: Path) -> bool:
    """True if ``path`` is an ELF64 executable without a PT_INTERP (dynamic loader) header."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for index in range(phnum):
        (p_type,) = struct.unpack_from("<I", data, phoff + index * phentsize)
        if p_type == _PT_INTERP:
            return False
    return True


def require_host_tools() -> dict[str, str]:
    """Return the resolved path of every host tool, or raise naming the apt packages."""
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    for tool, package in HOST_TOOLS.items():
        path = find_tool(tool)
        if path is None:
            missing[tool] = package
        else:
            found[tool] = path
    for static_file, package in STATIC_FILES.items():
        if not is_static_elf(static_file):
            missing[str(static_file)] = package
    if missing:
        raise HostToolMissing(missing)
    if os.geteuid() != 0:
        raise GuestImageError("building the guest image needs root (debootstrap, chroot)")
    return found


def host_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {
        "PATH": _SEARCH_PATH,
        "LC_ALL": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        "HOME": os.environ.get("HOME", "/root"),
    }
    if extra:
        env.update(extra)
    return env


async def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    stdout_path: Path | None = None,
) -> str:
    """Run a program; return its stdout (or write it to ``stdout_path``).

    A non-zero exit raises :class:`CommandFailed` carrying the captured stderr.
    """
    args = [os.fspath(a) for a in argv]
    out_file = stdout_path.open("wb") if stdout_path is not None else None
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                cwd=cwd,
                env=dict(env) if env is not None else host_env(),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=out_file if out_file is not None else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError as exc:
            raise GuestImageError(f"cannot run {args[0]}: {exc}") from exc
        try:
            out, err = await proc.communicate(stdin)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
    finally:
        if out_file is not None:
            out_file.close()
    if proc.returncode != 0:
        raise CommandFailed(args, proc.returncode or -1, err.decode(errors="replace"))
    return (out or b"").decode(errors="replace")
