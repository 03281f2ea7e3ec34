"""The one place VMM processes are started.

A :class:`LaunchSpec` says everything about how one VMM process runs apart from its own
command line: the network namespace it joins, the cgroup it is charged to, the user and
groups it runs as, the jail it is confined to, its working directory, where its output
goes and its environment. :func:`launch` starts it detached, in a session of its own (it
must outlive a server restart and be re-adopted), and hands back a
:class:`~agentenv.vmm.process.VMMProcess` watching it.

Every step that needs privileges is done by ``agentenv-launch`` (``launcher.c`` beside
this module, compiled by ``scripts/install``), which then execs the VMM, so the pid
:func:`launch` returns is the VMM's, and nothing runs in the forked server between
``fork`` and ``exec`` (no ``preexec_fn``, which is not safe in a process with threads).
One small C program rather than a chain of util-linux tools (``unshare``, ``sh``,
``mount``, ``nsenter``, ``setpriv``) because each exec cost about 2 ms of a resume on a
TCG host. It does, in the order the privileges are needed:

1. With a jail or bind mounts, a private mount namespace (mounts made in it never reach
   the host, and later host mounts do not reach it).
2. It writes its own pid to each ``<cgroup>/cgroup.procs``: the process joins its cgroups
   before the VMM starts, so everything the VMM allocates is charged there (a cgroup move
   does not carry memory charged earlier). It sets ``oom_score_adj`` and makes the
   mounts: the bind mounts asked for, and with a jail the VMM's own directory over its
   place in the jail tree, then the jail tree over the directory it hides.
3. It joins the network namespace ``/run/netns/NAME`` and nothing else: ``ip netns exec``
   would also give the VMM a private mount namespace with its own ``/sys``, so paths the
   host mounts later (snapshot destinations) could differ from what the VMM sees.
4. It sets the real, effective and saved uid and gid and the supplementary groups,
   empties the inheritable, ambient and bounding capability sets and sets
   ``no_new_privs``. This comes last because joining a cgroup, mounting and entering a
   namespace need root, and ``Popen(user=...)`` would drop root before the first of them.

If any step fails the launcher exits and the VMM never runs unconfined.
With none of these set the VMM is executed directly, as root, exactly as before.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from agentenv.vmm.base import VMMStartError
from agentenv.vmm.process import VMMProcess

NETNS_DIR = Path("/run/netns")

# What `ip netns add` accepts as a name, minus "." and "..": the name becomes a path
# under /run/netns and must not leave it.
_NETNS_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")


class LaunchError(VMMStartError):
    """A :class:`LaunchSpec` cannot be carried out (missing tool, bad parameter) or the
    process could not be started."""


class JailNotSupported(LaunchError):
    """A jail was asked for that cannot be set up (paths not absolute, or its own
    directory not inside the directory it hides)."""


@dataclass(frozen=True)
class Credentials:
    """The user the VMM runs as. ``groups`` are the supplementary groups; empty means
    none (root's are never kept)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Jail:
    """A directory tree the VMM sees in place of another one.

    In the VMM's own mount namespace, ``root`` (a tree the caller built, holding only
    what the VMM may open, at the same relative paths) is mounted over ``hides``, so
    absolute paths the VMM was given (and those inside its disk images) still resolve,
    but nothing else under ``hides`` is there. ``workdir``, a directory under ``hides``
    the VMM writes to and the host reads live (sockets, logs), is mounted at its own path
    inside that tree first. Paths outside ``hides`` are left as the host has them."""

    root: Path
    hides: Path
    workdir: Path


@dataclass(frozen=True)
class Bind:
    """A file or directory mounted at another path in the VMM's private mount namespace
    (``target`` must exist), read-only if ``read_only``. Used where a hard link cannot
    be made (another filesystem)."""

    source: Path
    target: Path
    read_only: bool = False


@dataclass(frozen=True)
class LaunchSpec:
    """How to run one VMM process.

    ``argv`` is the VMM's own command line; ``argv[0]`` is looked up on ``PATH`` unless it
    contains a slash. ``stdout`` and ``stderr`` are files the process writes to (the same
    path for both is opened once); a VMM that writes the guest console to stdout
    (Firecracker) has its console there. ``append_output`` keeps what the files hold,
    otherwise they are truncated. ``env`` is the whole environment, or ``None`` for the
    server's.

    ``netns`` is the name of a network namespace under ``/run/netns``, ``credentials``
    the user to run as, ``cgroup`` an existing cgroup directory to join (its
    ``cgroup.procs`` is written), ``jail`` where to confine the VMM. ``None`` leaves each
    as the server's: host namespace, root, the server's cgroup, no confinement.
    ``more_cgroups`` are further cgroup directories to join (one per controller
    hierarchy on a cgroup v1 host), ``oom_score_adj`` the VMM's OOM-killer bias,
    ``binds`` mounts made in a private mount namespace before the VMM starts.
    ``restricted_root`` (without ``credentials``) keeps root but clears the supplementary
    groups and sets ``no_new_privs``: for a program that drops its own privileges, like
    Firecracker's jailer. ``deny_hole_punching`` makes ``fallocate`` with
    ``FALLOC_FL_PUNCH_HOLE`` fail (``EOPNOTSUPP``) in the VMM: for a QEMU that maps a RAM
    file other VMMs map too (see ``launcher.c``).
    """

    argv: tuple[str, ...]
    cwd: Path
    stdout: Path
    stderr: Path
    append_output: bool = False
    env: Mapping[str, str] | None = None
    netns: str | None = None
    credentials: Credentials | None = None
    cgroup: Path | None = None
    jail: Jail | None = None
    more_cgroups: tuple[Path, ...] = ()
    oom_score_adj: int | None = None
    binds: tuple[Bind, ...] = ()
    restricted_root: bool = False
    deny_hole_punching: bool = False


# prctl(2): the "no transparent huge pages" flag, inherited across fork and kept by execve.
_PR_SET_THP_DISABLE = 41


def start_vmms_without_huge_pages() -> str | None:
    """Turn transparent huge pages off for this process, and so for every VMM it starts
    from now on (children inherit the flag). QEMU asks for huge pages for TCG's
    translation cache, so each 2 MiB of it became resident at its first write: measured
    with 16 fork children answering a command, 6 forks interleaved on two servers, 2.1
    MiB less PSS per child at the median (65.5 against 67.6 MiB) and 5 % less VMM CPU
    (0.75 against 0.79 s), the huge pages' zeroing no longer paid. Under KVM it changes
    nothing here: QEMU's guest RAM is a file mapping, which gets no transparent huge
    pages. Returns why it could not, or None."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        return f"cannot turn transparent huge pages off: {os.strerror(ctypes.get_errno())}"
    return None


LAUNCHER_NAME = "agentenv-launch"
LAUNCHER_ENV = "AENV_LAUNCHER"


def find_launcher() -> Path:
    """``agentenv-launch``: ``$AENV_LAUNCHER`` if set, else beside the server's Python
    (``scripts/install`` compiles it into the virtualenv), else on ``PATH``."""
    configured = os.environ.get(LAUNCHER_ENV)
    candidates = (
        [Path(configured)]
        if configured
        else [Path(sys.executable).parent / LAUNCHER_NAME, Path(shutil.which(LAUNCHER_NAME) or "")]
    )
    for path in candidates:
        if path.is_absolute() and path.is_file() and os.access(path, os.X_OK):
            return path
    raise LaunchError(
        f"{LAUNCHER_NAME} is needed to start a confined VMM but was not found"
        f"{f' at ${LAUNCHER_ENV}={configured}' if configured else ''}: run scripts/install"
    )


RAM_ADVICE_NAME = "agentenv-ram-advice.so"
RAM_ADVICE_ENV = "AENV_RAM_ADVICE"


def find_ram_advice() -> Path | None:
    """``agentenv-ram-advice.so`` (``ram_advice.c``): ``$AENV_RAM_ADVICE`` if set, else
    in the ``lib`` directory of the server's virtualenv, where ``scripts/install``
    builds it; None if it is not there."""
    configured = os.environ.get(RAM_ADVICE_ENV)
    path = Path(configured) if configured else Path(sys.prefix) / "lib" / RAM_ADVICE_NAME
    return path if path.is_absolute() and path.is_file() else None


def _check_cgroup(path: Path) -> None:
    if not path.is_absolute() or not (path / "cgroup.procs").is_file():
        raise LaunchError(f"{path} is not a cgroup directory")


def _jail_mount_points(jail: Jail) -> tuple[Path, Path]:
    """Where, in the jail tree, the work directory is mounted; and the hidden directory."""
    for path in (jail.root, jail.hides, jail.workdir):
        if not path.is_absolute():
            raise JailNotSupported(f"jail path {path} is not absolute")
    try:
        inside = jail.workdir.relative_to(jail.hides)
    except ValueError:
        raise JailNotSupported(f"{jail.workdir} is not inside {jail.hides}") from None
    return jail.root / inside, jail.hides


def _launcher_options(spec: LaunchSpec) -> list[str]:
    """The launcher's options for ``spec``, in its order; empty if nothing needs it."""
    options: list[str] = []
    if spec.jail is not None or spec.binds:
        options.append("--mount-ns")
    for cgroup in (*((spec.cgroup,) if spec.cgroup is not None else ()), *spec.more_cgroups):
        _check_cgroup(cgroup)
        options += ["--cgroup", str(cgroup)]
    if spec.oom_score_adj is not None:
        if not -1000 <= spec.oom_score_adj <= 1000:
            raise LaunchError(f"oom_score_adj {spec.oom_score_adj} is not in -1000..1000")
        options += ["--oom-score-adj", str(int(spec.oom_score_adj))]
    for bind in spec.binds:
        if not (bind.source.is_absolute() and bind.target.is_absolute()):
            raise LaunchError(f"bind mount {bind.source} -> {bind.target} needs absolute paths")
        options += ["--bind-ro" if bind.read_only else "--bind", str(bind.source), str(bind.target)]
    if spec.jail is not None:
        workdir_in_jail, hides = _jail_mount_points(spec.jail)
        # rbind for the tree: a plain bind would leave the work directory mount behind.
        options += ["--bind", str(spec.jail.workdir), str(workdir_in_jail)]
        options += ["--rbind", str(spec.jail.root), str(hides)]
    if spec.netns is not None:
        if not _NETNS_NAME.match(spec.netns) or spec.netns in (".", ".."):
            raise LaunchError(f"network namespace name {spec.netns!r} is not valid")
        options += ["--netns", str(NETNS_DIR / spec.netns)]
    if spec.credentials is not None:
        creds = spec.credentials
        options += ["--uid", str(creds.uid), "--gid", str(creds.gid)]
        if creds.groups:
            options += ["--groups", ",".join(str(g) for g in creds.groups)]
    elif spec.restricted_root:
        options += ["--clear-groups", "--no-new-privs"]
    if spec.deny_hole_punching:
        options.append("--deny-punch-hole")
    return options


def command_line(spec: LaunchSpec) -> list[str]:
    """The full command :func:`launch` runs for ``spec``: the VMM's argv, behind
    ``agentenv-launch`` and its options when anything must be set up first. Raises
    :class:`LaunchError` for a spec that cannot be carried out."""
    if not spec.argv:
        raise LaunchError("a VMM needs a command line")
    options = _launcher_options(spec)
    if not options:
        return list(spec.argv)
    return [str(find_launcher()), *options, "--", *spec.argv]


def launch(spec: LaunchSpec) -> VMMProcess:
    """Start the VMM ``spec`` describes, detached: its own session, stdin from
    ``/dev/null``, no inherited file descriptors. Raises :class:`LaunchError` if it cannot
    be started; a VMM that starts and then fails is the caller's to notice (its output
    files say why)."""
    argv = command_line(spec)
    mode = "ab" if spec.append_output else "wb"
    with ExitStack() as files:
        try:
            stdout = files.enter_context(open(spec.stdout, mode))
            stderr = (
                stdout
                if spec.stderr == spec.stdout
                else files.enter_context(open(spec.stderr, mode))
            )
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                cwd=spec.cwd,
                env=spec.env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {spec.argv[0]}: {exc}") from exc
    return VMMProcess(popen.pid, popen)
