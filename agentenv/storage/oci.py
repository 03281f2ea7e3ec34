"""OCI/Docker images as sandbox root disks: pull with ``skopeo``, unpack with ``umoci``
(which applies whiteouts and opaque directories), add what agentenv's guest needs and
make a read-only ext4 image (label ``aenv-root``) from the tree.

Images are cached by manifest digest in ``<cache>/<hex>/`` (``rootfs.ext4`` and
``image.json``). A build happens in ``<cache>/.build-<hex>-*/`` under an flock on
``<cache>/<hex>.lock`` and is renamed into place when complete, so concurrent pulls of
one image build it once and a failed pull leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOTFS_NAME = "rootfs.ext4"
METADATA_NAME = "image.json"
ROOT_LABEL = "aenv-root"
DEFAULT_USER = "user"
DEFAULT_UID = 1000
MIB = 1 << 20

_BUILD_PREFIX = ".build-"
_REMOVE_PREFIX = ".remove-"
_LAYOUT_TAG = "image"
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
_ERROR_CHARS = 1500

# The grammar of github.com/distribution/reference, lower-case repository paths only.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_PATH_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_DOMAIN_RE = re.compile(
    r"(?:localhost|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]+)?"
)
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_HEX_DIR_RE = re.compile(r"[0-9a-f]{64}")
_FATAL_MSG_RE = re.compile(r'level=fatal msg="((?:[^"\\]|\\.)*)"')


class ImageError(Exception):
    """An image reference is malformed, or the image could not be pulled or unpacked."""


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config a sandbox uses."""

    env: dict[str, str]
    workdir: str | None
    user: str | None
    entrypoint: list[str]
    cmd: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": dict(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            workdir=data.get("workdir") or None,
            user=data.get("user") or None,
            entrypoint=[str(a) for a in data.get("entrypoint") or []],
            cmd=[str(a) for a in data.get("cmd") or []],
        )

    @classmethod
    def from_oci(cls, config: dict[str, Any]) -> ImageConfig:
        """From an OCI (or Docker) image config blob."""
        inner = config.get("config") or {}
        env: dict[str, str] = {}
        for entry in inner.get("Env") or []:
            key, _, value = str(entry).partition("=")
            if key:
                env[key] = value
        return cls(
            env=env,
            workdir=inner.get("WorkingDir") or None,
            user=inner.get("User") or None,
            entrypoint=[str(a) for a in inner.get("Entrypoint") or []],
            cmd=[str(a) for a in inner.get("Cmd") or []],
        )


@dataclass(frozen=True)
class PulledImage:
    reference: str
    """Normalized reference, e.g. ``docker://docker.io/library/debian:12``."""
    digest: str
    """Manifest digest, ``sha256:...``."""
    rootfs: Path
    """Raw ext4 image (label ``aenv-root``), read-only."""
    config: ImageConfig
    size_bytes: int
    """Bytes allocated on the host for ``rootfs`` (it is sparse)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": self.digest,
            "config": self.config.to_dict(),
            "size_bytes": self.size_bytes,
        }


# --- references -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reference:
    domain: str
    path: str
    tag: str | None
    digest: str | None

    @property
    def repository(self) -> str:
        return f"docker://{self.domain}/{self.path}"

    def __str__(self) -> str:
        if self.digest:
            return f"{self.repository}@{self.digest}"
        return f"{self.repository}:{self.tag}"


def _parse_reference(ref: str) -> _Reference:
    original = ref
    if not ref or ref != ref.strip() or any(c.isspace() for c in ref):
        raise ImageError(f"invalid image reference {original!r}: empty or contains spaces")
    if ref.startswith("docker://"):
        ref = ref[len("docker://") :]
    elif "://" in ref or ref.startswith(("oci:", "dir:", "docker-archive:")):
        raise ImageError(f"invalid image reference {original!r}: only docker:// is supported")
    name, at, digest = ref.partition("@")
    if at and not _DIGEST_RE.fullmatch(digest):
        raise ImageError(f"invalid image reference {original!r}: bad digest {digest!r}")
    tag: str | None = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG_RE.fullmatch(tag):
            raise ImageError(f"invalid image reference {original!r}: bad tag {tag!r}")
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        domain, path = first, rest
        if not _DOMAIN_RE.fullmatch(domain):
            raise ImageError(f"invalid image reference {original!r}: bad registry {domain!r}")
    else:
        domain, path = "docker.io", name
    if domain in ("index.docker.io", "registry-1.docker.io"):
        domain = "docker.io"
    if domain == "docker.io" and "/" not in path:
        path = f"library/{path}"
    if not _PATH_RE.fullmatch(path):
        raise ImageError(
            f"invalid image reference {original!r}: repository {path!r} must be lower-case "
            "letters, digits and separators"
        )
    if len(f"{domain}/{path}") > 255:
        raise ImageError(f"invalid image reference {original!r}: name too long")
    if at:
        tag = None  # a digest names the image; skopeo refuses a tag beside it
    elif tag is None:
        tag = "latest"
    return _Reference(domain, path, tag, digest or None)


def normalize_reference(ref: str) -> str:
    """``debian:12`` → ``docker://docker.io/library/debian:12``; a missing tag becomes
    ``latest``; a digest (``@sha256:...``) is kept (and a tag beside it dropped).
    Raises ImageError for an empty or malformed reference."""
    return str(_parse_reference(ref))


def _insecure(ref: _Reference, insecure_registries: Collection[str]) -> bool:
    host = ref.domain
    if host.startswith("["):
        bare = host[: host.index("]") + 1]
    else:
        bare = host.rsplit(":", 1)[0]
    return host in insecure_registries or bare in insecure_registries or bare in _LOCAL_HOSTS


# --- subprocesses -----------------------------------------------------------------------


def _unquote(message: str) -> str:
    try:
        return str(json.loads(f'"{message}"'))
    except ValueError:
        return message


def _trim(text: str) -> str:
    """A tool's stderr for an error message: skopeo's ``level=fatal msg="..."`` lines
    unquoted, the tail of anything long."""
    messages = [_unquote(m) for m in _FATAL_MSG_RE.findall(text)]
    text = "\n".join(messages) if messages else text.strip()
    if len(text) > _ERROR_CHARS:
        text = "…" + text[-_ERROR_CHARS:]
    return text or "no error output"


async def _run(what: str, *args: str) -> bytes:
    """Run a command; its stdout, or ImageError naming ``what`` with its stderr. The
    process is killed if the caller is cancelled."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as exc:
        package = {"mkfs.ext4": "e2fsprogs"}.get(args[0], args[0])
        raise ImageError(f"{args[0]} is not installed (Debian package {package})") from exc
    try:
        out, err = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        raise ImageError(f"{what}: {_trim(err.decode(errors='replace'))}")
    return out


def _policy_args(cache_dir: Path, user_home: Path) -> list[str]:
    """skopeo refuses to run without a signature policy; give it an accept-anything one
    when the host has none (Debian's package ships /etc/containers/policy.json)."""
    if (user_home / ".config/containers/policy.json").exists() or Path(
        "/etc/containers/policy.json"
    ).exists():
        return []
    policy = cache_dir / ".skopeo-policy.json"
    if not policy.exists():
        tmp = policy.with_name(f"{policy.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
        os.replace(tmp, policy)
    return ["--policy", str(policy)]


# --- cache ------------------------------------------------------------------------------


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or not _HEX_DIR_RE.fullmatch(hexpart):
        raise ImageError(f"unsupported image digest {digest!r}")
    return hexpart


def _load(image_dir: Path) -> PulledImage | None:
    rootfs = image_dir / ROOTFS_NAME
    try:
        data = json.loads((image_dir / METADATA_NAME).read_text())
        st = rootfs.stat()
        return PulledImage(
            reference=str(data["reference"]),
            digest=str(data["digest"]),
            rootfs=rootfs,
            config=ImageConfig.from_dict(data.get("config") or {}),
            size_bytes=st.st_blocks * 512,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_images(cache_dir: Path) -> list[PulledImage]:
    """Every complete image in ``cache_dir``, by digest."""
    if not cache_dir.is_dir():
        return []
    images = []
    for entry in sorted(cache_dir.iterdir()):
        if _HEX_DIR_RE.fullmatch(entry.name) and entry.is_dir():
            image = _load(entry)
            if image is not None:
                images.append(image)
    return images


def remove_image(cache_dir: Path, digest: str) -> None:
    """Delete the cached image ``digest`` (a no-op if absent). The directory is renamed
    away first, so a concurrent pull never sees half of it."""
    image_dir = cache_dir / _hex(digest)
    if not image_dir.exists():
        return
    doomed = Path(tempfile.mkdtemp(prefix=_REMOVE_PREFIX, dir=cache_dir))
    try:
        os.rename(image_dir, doomed / "image")
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(doomed, ignore_errors=True)


@contextlib.asynccontextmanager
async def _locked(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on ``path``, polled so that waiting can be cancelled."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        yield
    finally:
        os.close(fd)


# --- pulling ----------------------------------------------------------------------------


async def pull_image(
    reference: str,
    cache_dir: Path,
    *,
    disk_size_mib: int = 4096,
    insecure_registries: Collection[str] = (),
    log: Callable[[str], None] | None = None,
    user_home: Path | None = None,
) -> PulledImage:
    """Pull ``reference`` and return it as a read-only ext4 root disk, from the cache
    when its manifest digest has been pulled before (then only the manifest is fetched;
    for a reference by digest, nothing is).

    ``user_home`` is the home directory skopeo looks for a user signature policy in: the
    server passes its ``Config.user_home``; callers with no configuration may leave it
    out to have ``$HOME`` read here."""
    say = log or (lambda _line: None)
    home = user_home if user_home is not None else Path(os.environ.get("HOME", "/root"))
    ref = _parse_reference(reference)
    name = str(ref)
    cache_dir.mkdir(parents=True, exist_ok=True)
    insecure = _insecure(ref, insecure_registries)

    digest = ref.digest
    if digest is None or (cached := _load(cache_dir / _hex(digest))) is None:
        say(f"resolving {name}")
        raw = await _run(
            f"cannot resolve {name}",
            "skopeo", *_policy_args(cache_dir, home), "--command-timeout", "5m",
            "inspect", "--raw", *(["--tls-verify=false"] if insecure else []), name,
        )  # fmt: skip
        manifest_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if digest is not None and digest != manifest_digest:
            raise ImageError(f"{name}: the registry returned manifest {manifest_digest}")
        digest = digest or manifest_digest
        cached = _load(cache_dir / _hex(digest))
    if cached is not None:
        say(f"cached {digest}")
        return dataclasses.replace(cached, reference=name)

    hexdigest = _hex(digest)
    async with _locked(cache_dir / f"{hexdigest}.lock"):
        cached = _load(cache_dir / hexdigest)
        if cached is not None:
            say(f"cached {digest} (pulled concurrently)")
            return dataclasses.replace(cached, reference=name)
        for stale in cache_dir.glob(f"{_BUILD_PREFIX}{hexdigest}-*"):
            await asyncio.to_thread(shutil.rmtree, stale, True)
        build = Path(tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{hexdigest}-", dir=cache_dir))
        try:
            image = await _build(ref, digest, build, disk_size_mib, insecure, home, say)
            final = cache_dir / hexdigest
            if final.exists():  # a broken leftover (no image.json): replace it
                await asyncio.to_thread(shutil.rmtree, final, True)
            os.rename(build / "out", final)
            return dataclasses.replace(image, rootfs=final / ROOTFS_NAME)
        finally:
            await asyncio.to_thread(shutil.rmtree, build, True)


async def _build(
    ref: _Reference,
    digest: str,
    build: Path,
    disk_size_mib: int,
    insecure: bool,
    user_home: Path,
    say: Callable[[str], None],
) -> PulledImage:
    name = str(ref)
    layout = build / "layout"
    bundle = build / "bundle"
    out = build / "out"
    out.mkdir()

    say(f"copying layers of {ref.repository}@{digest}")
    src_tls = ["--src-tls-verify=false"] if insecure else []
    await _run(
        f"cannot pull {name}",
        "skopeo", *_policy_args(build.parent, user_home), "copy", "--quiet", *src_tls,
        f"{ref.repository}@{digest}", f"oci:{layout}:{_LAYOUT_TAG}",
    )  # fmt: skip
    config = ImageConfig.from_oci(_layout_config(layout))

    say("unpacking")
    await _run(
        f"cannot unpack {name}",
        "umoci", "unpack", "--image", f"{layout}:{_LAYOUT_TAG}", str(bundle),
    )  # fmt: skip
    await asyncio.to_thread(shutil.rmtree, layout, True)
    tree = bundle / "rootfs"
    try:
        await asyncio.to_thread(prepare_rootfs, tree)
    except OSError as exc:
        raise ImageError(f"cannot prepare the root filesystem of {name}: {exc}") from exc

    content, inodes = await asyncio.to_thread(_tree_usage, tree)
    size_mib = max(disk_size_mib, -(-content * 3 // 2 // MIB) + 256)
    say(f"making filesystem {size_mib} MiB")
    rootfs = out / ROOTFS_NAME  # mke2fs creates it, sparse
    # mke2fs's default is an inode per 16 KiB; images of many small files need more.
    wanted = inodes * 2 + 4096
    inode_args = ["-N", str(wanted)] if wanted > size_mib * MIB // 16384 else []
    await _run(
        f"cannot make a filesystem for {name}",
        "mkfs.ext4", "-q", "-F", "-L", ROOT_LABEL, *inode_args, "-d", str(tree),
        str(rootfs), f"{size_mib}M",
    )  # fmt: skip
    rootfs.chmod(0o444)
    image = PulledImage(
        reference=name,
        digest=digest,
        rootfs=rootfs,
        config=config,
        size_bytes=rootfs.stat().st_blocks * 512,
    )
    (out / METADATA_NAME).write_text(json.dumps(image.to_dict(), indent=2) + "\n")
    return image


def _layout_config(layout: Path) -> dict[str, Any]:
    """The image config blob of the one image in an OCI layout."""

    def blob(descriptor: dict[str, Any]) -> dict[str, Any]:
        algo, _, hexpart = str(descriptor["digest"]).partition(":")
        if not re.fullmatch(r"[a-z0-9]+", algo) or not re.fullmatch(r"[0-9a-f]+", hexpart):
            raise ImageError(f"bad descriptor digest {descriptor['digest']!r}")
        data: dict[str, Any] = json.loads((layout / "blobs" / algo / hexpart).read_bytes())
        return data

    try:
        index = json.loads((layout / "index.json").read_text())
        manifest = blob(index["manifests"][0])
        if "config" not in manifest:
            raise ImageError("the copied image has no config (is it an image index?)")
        return blob(manifest["config"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageError(f"cannot read the image config: {exc}") from exc


def _tree_usage(tree: Path) -> tuple[int, int]:
    """Allocated bytes (hard links counted once) and number of entries under ``tree``."""
    seen: set[tuple[int, int]] = set()
    total = 0
    count = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for entry in (*dirnames, *filenames, "."):
            st = os.lstat(os.path.join(dirpath, entry))
            count += 1
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += st.st_blocks * 512
    return total, count


# --- preparing the tree -----------------------------------------------------------------


def _in_root(root: Path, path: str) -> Path:
    """The host path for guest path ``path`` in the tree ``root``, following symlinks as
    the guest would: absolute targets and ``..`` never lead outside ``root``. No
    component of the result is a symlink (the last, or more, may not exist)."""
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root.joinpath(*done, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
            target = os.readlink(candidate)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
            continue
        done.append(part)
    return root.joinpath(*done)


def _makedirs(root: Path, path: str, mode: int = 0o755) -> Path:
    """Guest directory ``path`` (created with ``mode`` if missing), as a host path."""
    host = _in_root(root, path)
    if not host.is_dir():
        # No component of ``host`` is a symlink, so this stays inside ``root``.
        _make_guest_dirs(host)
        host.chmod(mode)
    return host


def _make_guest_dirs(host: Path) -> None:
    """Make directory ``host`` and its missing parents 0755: a guest's directories
    must not take the mode of the server's umask (077: the data directory is private)."""
    missing = []
    while not host.is_dir():
        missing.append(host)
        host = host.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        directory.chmod(0o755)


def _read_lines(root: Path, path: str) -> list[str]:
    host = _in_root(root, path)
    try:
        return host.read_text(errors="surrogateescape").splitlines()
    except FileNotFoundError:
        return []


def _write(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    """Replace (or create) ``path``: keeps an existing file's mode and owner."""
    host = _in_root(root, path)
    _make_guest_dirs(host.parent)
    with contextlib.suppress(FileNotFoundError):
        st = host.lstat()
        if stat.S_ISREG(st.st_mode):
            mode = stat.S_IMODE(st.st_mode)
        else:
            raise OSError(errno.EEXIST, "exists and is not a regular file", path)
    tmp = host.with_name(f".{host.name}.aenv-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", errors="surrogateescape") as f:
            f.write(text)
        os.chmod(tmp, mode)
        with contextlib.suppress(FileNotFoundError):
            st = host.lstat()
            os.chown(tmp, st.st_uid, st.st_gid)
        os.rename(tmp, host)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _append(root: Path, path: str, lines: list[str], mode: int = 0o644) -> None:
    if lines:
        existing = _read_lines(root, path)
        _write(root, path, "\n".join([*existing, *lines]) + "\n", mode)


def _entries(lines: list[str]) -> list[list[str]]:
    return [line.split(":") for line in lines if line and not line.startswith("#")]


def _free_id(taken: set[int], preferred: int) -> int:
    n = preferred
    while n in taken:
        n += 1
    return n


def prepare_rootfs(root: Path) -> None:
    """Make an unpacked image tree bootable by agentenv's guest: an empty ``/.aenv``
    mountpoint for the tools drive, ``/tmp``, root and the E2B default ``user``
    (uid/gid 1000 when free, home ``/home/user``) in passwd/group/shadow, and
    ``/etc/hostname`` and ``/etc/hosts`` when missing. Paths are resolved inside
    ``root`` (an image's absolute symlinks never reach the host)."""
    aenv = root / ".aenv"
    if aenv.is_symlink() or (aenv.exists() and not aenv.is_dir()):
        aenv.unlink()
    elif aenv.is_dir():
        shutil.rmtree(aenv)
    aenv.mkdir(0o755)
    aenv.chmod(0o755)
    os.chown(aenv, 0, 0)

    _makedirs(root, "/tmp", 0o1777).chmod(0o1777)  # also when the image has one
    _makedirs(root, "/etc")
    shell = next(
        (s for s in ("/bin/bash", "/bin/sh") if os.path.lexists(_in_root(root, s))), "/bin/sh"
    )

    passwd = _entries(_read_lines(root, "/etc/passwd"))
    group = _entries(_read_lines(root, "/etc/group"))
    has_shadow = os.path.lexists(_in_root(root, "/etc/shadow"))
    has_gshadow = os.path.lexists(_in_root(root, "/etc/gshadow"))
    pw = "x" if has_shadow else "*"
    new_passwd: list[str] = []
    new_group: list[str] = []
    new_shadow: list[str] = []
    new_gshadow: list[str] = []
    if not any(e[0] == "root" for e in group):
        new_group.append("root:x:0:")
        new_gshadow.append("root:*::")
    if not any(e[0] == "root" for e in passwd):
        new_passwd.append(f"root:{pw}:0:0:root:/root:{shell}")
        new_shadow.append("root:*:19000:0:99999:7:::")
    user = next((e for e in passwd if e[0] == DEFAULT_USER and len(e) >= 4), None)
    if user is None:
        by_name = {e[0]: e for e in group if len(e) >= 3}
        if DEFAULT_USER in by_name and by_name[DEFAULT_USER][2].isdigit():
            gid = int(by_name[DEFAULT_USER][2])
        else:
            taken = {int(e[2]) for e in group if len(e) >= 3 and e[2].isdigit()}
            gid = _free_id(taken, DEFAULT_UID)
            new_group.append(f"{DEFAULT_USER}:x:{gid}:")
            new_gshadow.append(f"{DEFAULT_USER}:!::")
        taken = {int(e[2]) for e in passwd if len(e) >= 3 and e[2].isdigit()}
        uid = _free_id(taken, DEFAULT_UID)
        home = f"/home/{DEFAULT_USER}"
        new_passwd.append(f"{DEFAULT_USER}:{pw}:{uid}:{gid}::{home}:{shell}")
        new_shadow.append(f"{DEFAULT_USER}:*:19000:0:99999:7:::")
        if not _in_root(root, home).exists():
            home_dir = _makedirs(root, home, 0o755)
            skel = _in_root(root, "/etc/skel")
            if skel.is_dir():
                shutil.copytree(skel, home_dir, symlinks=True, dirs_exist_ok=True)
            for path in (home_dir, *_walk(home_dir)):
                os.lchown(path, uid, gid)
    _append(root, "/etc/passwd", new_passwd)
    _append(root, "/etc/group", new_group)
    if has_shadow:
        _append(root, "/etc/shadow", new_shadow, 0o640)
    if has_gshadow:
        _append(root, "/etc/gshadow", new_gshadow, 0o640)

    if not os.path.lexists(_in_root(root, "/etc/hostname")):
        _write(root, "/etc/hostname", "sandbox\n")
    if not os.path.lexists(_in_root(root, "/etc/hosts")):
        _write(
            root,
            "/etc/hosts",
            "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        )


def _walk(top: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(top):
        for entry in (*dirnames, *filenames):
            yield Path(dirpath, entry)
