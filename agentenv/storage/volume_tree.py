"""A volume's files under a directory, with every path confined to it: what the volume
content API does to them (:class:`MountedVolume`).

The host runs it over a volume image that fuse2fs mounted (:mod:`.volumes`); while a
running sandbox holds the volume, the guest runs this same file, given to the tools
drive's Python with ``-c`` (see :mod:`agentenv.orchestrator.volume_content`), over the
path the volume is mounted at, one operation a process (:func:`guest_main`). So it
imports nothing but the standard library, and nothing of agentenv.

Paths given to :class:`MountedVolume` are volume paths (``/a/b``); none may leave the
volume, through ``..`` or a symbolic link the guest made.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: Owner of files the content API makes without one: the guest's ``user``
#: (agentenv.guest.rootfs.USER_UID).
DEFAULT_OWNER = 1000


class VolumePathError(Exception):
    """A path in a volume is not there, or not what the operation needs."""

    def __init__(self, message: str, *, missing: bool) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Entry:
    """One file or directory as the content API describes it."""

    name: str
    type: str
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = None


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class MountedVolume:
    """Files of a volume mounted at ``root`` on the host."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def clean(path: str) -> str:
        """``path`` as a normalised volume path (``/`` for the root)."""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise VolumePathError(f"{path!r}: '..' is not allowed", missing=False)
        return "/" + "/".join(parts)

    def host_path(self, path: str, *, follow: bool = True) -> Path:
        """Where volume path ``path`` is on the host; with ``follow`` a final symbolic
        link is followed too. Links resolving outside the volume are refused."""
        clean = self.clean(path)
        local = self.root / clean.lstrip("/")
        parent = local.parent if local != self.root else local
        resolved_parent = Path(os.path.realpath(parent))
        target = resolved_parent / local.name if local != self.root else resolved_parent
        if follow:
            target = Path(os.path.realpath(target))
        if target != self.root and self.root not in target.parents:
            raise VolumePathError(f"{path!r} leads outside the volume", missing=False)
        return target

    def entry(self, path: str) -> Entry:
        clean = self.clean(path)
        local = self.host_path(clean, follow=False)
        try:
            st = local.lstat()
        except FileNotFoundError:
            raise VolumePathError(f"{clean} does not exist", missing=True) from None
        target = None
        if stat.S_ISDIR(st.st_mode):
            kind = "directory"
        elif stat.S_ISREG(st.st_mode):
            kind = "file"
        elif stat.S_ISLNK(st.st_mode):
            kind, target = "symlink", os.readlink(local)
        else:
            kind = "unknown"
        return Entry(
            name=clean.rsplit("/", 1)[-1] or "/",
            type=kind,
            path=clean,
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            atime=_time(st.st_atime),
            mtime=_time(st.st_mtime),
            ctime=_time(st.st_ctime),
            target=target,
        )

    def listing(self, path: str, depth: int) -> list[Entry]:
        clean = self.clean(path)
        directory = self.host_path(clean)
        if not directory.is_dir():
            raise VolumePathError(f"{clean} is not a directory", missing=not directory.exists())
        found: list[Entry] = []

        def walk(volume_dir: str, local: Path, level: int) -> None:
            for name in sorted(os.listdir(local)):
                child = f"{volume_dir.rstrip('/')}/{name}"
                item = self.entry(child)
                found.append(item)
                if item.type == "directory" and level < depth:
                    walk(child, local / name, level + 1)

        walk(clean, directory, 1)
        return found

    def _own(self, local: Path, uid: int | None, gid: int | None, mode: int | None) -> None:
        owner = (DEFAULT_OWNER if uid is None else uid, DEFAULT_OWNER if gid is None else gid)
        os.chown(local, *owner, follow_symlinks=False)
        if mode is not None:
            os.chmod(local, mode & 0o7777)

    def _parent_ready(self, local: Path, clean: str, force: bool) -> None:
        if local.parent.is_dir():
            return
        if not force:
            raise VolumePathError(f"the directory of {clean} does not exist", missing=True)
        self.make_dir(clean.rsplit("/", 1)[0] or "/", None, None, None, force=True)

    def make_dir(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, *, force: bool
    ) -> Entry:
        clean = self.clean(path)
        local = self.host_path(clean)
        if local.exists():
            if local.is_dir() and force:
                return self.entry(clean)
            raise VolumePathError(f"{clean} already exists", missing=False)
        self._parent_ready(local, clean, force)
        local.mkdir()
        self._own(local, uid, gid, 0o755 if mode is None else mode)
        return self.entry(clean)

    def open_for_write(self, path: str, *, force: bool) -> tuple[str, Path]:
        clean = self.clean(path)
        if clean == "/":
            raise VolumePathError("the volume's root is a directory", missing=False)
        local = self.host_path(clean)
        if local.is_dir():
            raise VolumePathError(f"{clean} is a directory", missing=False)
        self._parent_ready(local, clean, force)
        return clean, local

    def finish_write(
        self, clean: str, local: Path, partial: Path, uid: int | None, gid: int | None,
        mode: int | None,
    ) -> Entry:  # fmt: skip
        self._own(partial, uid, gid, 0o644 if mode is None else mode)
        os.replace(partial, local)
        return self.entry(clean)

    def read_path(self, path: str) -> Path:
        clean = self.clean(path)
        local = self.host_path(clean)
        if not local.is_file():
            raise VolumePathError(f"{clean} is not a file", missing=not local.exists())
        return local

    def remove(self, path: str) -> None:
        clean = self.clean(path)
        if clean == "/":
            raise VolumePathError("the volume's root cannot be removed", missing=False)
        local = self.host_path(clean, follow=False)
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        else:
            raise VolumePathError(f"{clean} does not exist", missing=True)

    def set_metadata(self, path: str, uid: int | None, gid: int | None, mode: int | None) -> Entry:
        clean = self.clean(path)
        local = self.host_path(clean)
        if not local.exists():
            raise VolumePathError(f"{clean} does not exist", missing=True)
        if uid is not None or gid is not None:
            os.chown(local, -1 if uid is None else uid, -1 if gid is None else gid)
        if mode is not None:
            os.chmod(local, mode & 0o7777)
        return self.entry(clean)


def read_chunks(local: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(local, "rb") as fh:
        while chunk := fh.read(size):
            yield chunk


# -- in the guest ----------------------------------------------------------------------------
def _entry_wire(entry: Entry) -> dict[str, Any]:
    wire = asdict(entry)
    for key in ("atime", "mtime", "ctime"):
        wire[key] = wire[key].isoformat()
    return wire


def entry_from_wire(wire: dict[str, Any]) -> Entry:
    """An :class:`Entry` as :func:`guest_main` printed it."""
    times = {k: datetime.fromisoformat(wire[k]) for k in ("atime", "mtime", "ctime")}
    return Entry(**{**wire, **times})


def _run_operation(vol: MountedVolume, op: str, args: dict[str, Any]) -> Any:
    owner = (args.get("uid"), args.get("gid"), args.get("mode"))
    if op == "entry":
        return _entry_wire(vol.entry(args["path"]))
    if op == "listing":
        return [_entry_wire(e) for e in vol.listing(args["path"], int(args["depth"]))]
    if op == "make_dir":
        return _entry_wire(vol.make_dir(args["path"], *owner, force=bool(args["force"])))
    if op == "open_for_write":
        clean, local = vol.open_for_write(args["path"], force=bool(args["force"]))
        return [clean, str(local)]
    if op == "finish_write":
        partial = Path(args["partial"])
        local = Path(args["local"])
        # Only a file beside the target, as the host named it, may be moved into place.
        if partial.parent != local.parent or not partial.name.startswith(f".{local.name}."):
            raise VolumePathError("bad partial file", missing=False)
        return _entry_wire(vol.finish_write(args["clean"], local, partial, *owner))
    if op == "discard":
        partial = Path(args["partial"])
        if partial.parent == vol.root or vol.root in partial.parents:
            partial.unlink(missing_ok=True)
        return None
    if op == "read_path":
        local = vol.read_path(args["path"])
        return [str(local), local.stat().st_size]
    if op == "remove":
        vol.remove(args["path"])
        return None
    if op == "set_metadata":
        return _entry_wire(vol.set_metadata(args["path"], *owner))
    raise ValueError(f"unknown operation {op!r}")


def guest_main(argv: list[str]) -> int:
    """``DEVICE ROOT REQUEST``: run the JSON ``REQUEST`` (``{"op": .., "args": {..}}``)
    on the volume mounted at ``ROOT``, after checking it is ``DEVICE``'s filesystem (the
    guest may have unmounted it), and print one JSON line: ``{"result": ..}``, or
    ``{"error": .., "missing": bool}``, or ``{"unmounted": ..}``."""
    device, root, request = argv
    real_root = os.path.realpath(root)
    try:
        mounted_here = os.path.ismount(real_root) and (
            os.stat(real_root).st_dev == os.stat(device).st_rdev
        )
    except OSError:
        mounted_here = False
    if not mounted_here:
        print(json.dumps({"unmounted": f"{root} is not the volume's mount in the sandbox"}))
        return 0
    parsed = json.loads(request)
    try:
        result = _run_operation(MountedVolume(Path(real_root)), parsed["op"], parsed["args"])
    except VolumePathError as exc:
        print(json.dumps({"error": str(exc), "missing": exc.missing}))
    except OSError as exc:
        print(json.dumps({"error": f"{exc.strerror or exc}", "missing": False}))
    else:
        print(json.dumps({"result": result}))
    return 0


if __name__ == "__main__":
    sys.exit(guest_main(sys.argv[1:]))
