"""Content-addressed component cache.

Every component (kernel, initrd, tools drive, root filesystem) lives in
``<cache>/<kind>/<key>/`` where ``key`` hashes all of its inputs. A component is built in a
staging directory under ``<cache>/tmp/`` and renamed into place only when complete, so a
reader never sees a half-built component; a failed build leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from agentenv.guest.errors import GuestImageError

META_FILE = "meta.json"


def content_key(inputs: Any) -> str:
    """A stable short hash of JSON-serialisable ``inputs`` (dict key order is irrelevant)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def hash_files(paths: list[Path], root: Path) -> str:
    """Hash file names (relative to ``root``) and contents, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first."""
    prefix = str(path.resolve())
    found: list[Path] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point == prefix or mount_point.startswith(prefix + "/"):
                found.append(Path(mount_point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> None:
    """Remove a staging tree, first detaching anything a failed chroot step left mounted
    inside it (deleting through a bind mount of /dev or /proc would hit the host)."""
    if not path.exists():
        return
    for mount_point in mounts_under(path):
        subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)
    if mounts_under(path):
        raise GuestImageError(f"refusing to delete {path}: filesystems still mounted inside it")
    shutil.rmtree(path)


class ComponentCache:
    """The on-disk cache of built components under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def lookup(self, kind: str, key: str) -> Path | None:
        final = self.path(kind, key)
        return final if (final / META_FILE).is_file() else None

    def read_meta(self, kind: str, key: str) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((self.path(kind, key) / META_FILE).read_text())
        return meta

    @contextlib.contextmanager
    def staging(self, kind: str) -> Iterator[Path]:
        tmp_root = self.root / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=tmp_root))
        try:
            yield staging
        finally:
            remove_tree(staging)

    async def ensure(
        self,
        kind: str,
        key: str,
        inputs: dict[str, Any],
        build: Callable[[Path], Awaitable[dict[str, Any]]],
        log: Callable[[str], None],
    ) -> tuple[Path, dict[str, Any]]:
        """Return the component for ``key``, building it with ``build(staging)`` if absent.

        ``build`` fills the staging directory and returns facts recorded in meta.json.
        """
        final = self.path(kind, key)
        # Components are opened by confined VMMs, which run as other users, and the
        # server that builds some of them (the code interpreter's root filesystem) runs
        # under umask 077: the kind's directory is made traversable whatever the umask,
        # also when an earlier build left it private.
        final.parent.mkdir(parents=True, exist_ok=True)
        final.parent.chmod(0o755)
        if (found := self.lookup(kind, key)) is not None:
            log(f"{kind}: cached {key}")
            return found, self.read_meta(kind, key)
        log(f"{kind}: building {key}")
        started = time.monotonic()
        with self.staging(kind) as staging:
            out = staging / "out"
            out.mkdir()
            out.chmod(0o755)  # the umask is not ours to trust (see above)
            facts = await build(out)
            meta = {
                "kind": kind,
                "key": key,
                "inputs": inputs,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started, 2),
                **facts,
            }
            (out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            if final.exists():  # a stale, incomplete directory from a crash before meta.json
                remove_tree(final)
            os.rename(out, final)
        log(f"{kind}: built {key} in {meta['build_seconds']} s")
        return final, meta


@contextlib.asynccontextmanager
async def build_lock(root: Path, log: Callable[[str], None]) -> AsyncIterator[None]:
    """Serialise builds into one cache directory across processes; a second builder waits
    for the first and then finds its components cached."""
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / ".build.lock"
    with lock_path.open("w") as lock_file:
        waiting = False
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    log(f"guest image: waiting for another build holding {lock_path}")
                    waiting = True
                await asyncio.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
