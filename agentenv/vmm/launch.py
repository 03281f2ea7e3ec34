"""The one place VMM processes are started.

A :class:`LaunchSpec` says everything about how one VMM process runs apart from its own
command line: the network namespace it joins, the cgroup it is charged to, the user and
groups it runs as, the jail it is confined to, its working directory, where its output
goes and its environment. :func:`launch` starts it detached, in a session of its own (it
must outlive a server restart and be re-adopted), and hands back a
:class:`~agentenv.vmm.process.VMMProcess` watching it.

Every step that needs privileges is done by a small program that then execs the next
one, so the pid :func:`launch` returns is the VMM's once the chain has run, and nothing
runs in the forked server between ``fork`` and ``exec`` (no ``preexec_fn``, which is not
safe in a process with threads). The chain, in the order the privileges are needed:

1. ``/bin/sh`` writes its own pid to ``<cgroup>/cgroup.procs``: the process joins the
   cgroup before the VMM starts, so everything the VMM allocates is charged there (a
   cgroup v2 move does not carry memory charged earlier). If the write fails the shell
   exits and the VMM never runs outside its cgroup.
2. ``nsenter --net=/run/netns/NAME`` switches the network namespace only. ``ip netns exec``
   would also give the VMM a private mount namespace with its own ``/sys``, so paths the
   host mounts later (snapshot destinations) could differ from what the VMM sees.
3. ``setpriv`` sets the real, effective and saved uid and gid and the supplementary
   groups. It comes last because joining a cgroup and entering a namespace need root, and
   ``Popen(user=...)`` would drop root before the first of them.

With none of these set (today's default) the VMM is executed directly, as root, exactly
as before. A jail is not implemented yet: setting one raises :class:`JailNotSupported`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
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

# Runs as "$0 = cgroup directory, $@ = the rest of the chain".
_JOIN_CGROUP_SCRIPT = 'echo $$ > "$0/cgroup.procs" && exec "$@"'


class LaunchError(VMMStartError):
    """A :class:`LaunchSpec` cannot be carried out (missing tool, bad parameter) or the
    process could not be started."""


class JailNotSupported(LaunchError):
    """A jail was asked for; confining VMMs is not implemented yet."""


@dataclass(frozen=True)
class Credentials:
    """The user the VMM runs as. ``groups`` are the supplementary groups; empty means
    none (root's are never kept)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Jail:
    """Where a VMM is to be confined (a chroot-like directory it sees as ``/``).

    A placeholder for the security work that confines VMMs: :func:`launch` refuses it
    with :class:`JailNotSupported` until that lands."""

    root: Path


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


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"{name!r} is needed to start a VMM but is not on PATH")
    return path


def command_line(spec: LaunchSpec) -> list[str]:
    """The full command :func:`launch` runs for ``spec``: the privilege steps chained in
    front of the VMM's argv, each exec'ing the next. Raises :class:`LaunchError` for a
    spec that cannot be carried out."""
    if not spec.argv:
        raise LaunchError("a VMM needs a command line")
    if spec.jail is not None:
        raise JailNotSupported(f"confining a VMM to {spec.jail.root} is not implemented yet")
    chain: list[str] = []
    if spec.cgroup is not None:
        if not spec.cgroup.is_absolute() or not (spec.cgroup / "cgroup.procs").is_file():
            raise LaunchError(f"{spec.cgroup} is not a cgroup directory")
        chain += ["/bin/sh", "-c", _JOIN_CGROUP_SCRIPT, str(spec.cgroup)]
    if spec.netns is not None:
        if not _NETNS_NAME.match(spec.netns) or spec.netns in (".", ".."):
            raise LaunchError(f"network namespace name {spec.netns!r} is not valid")
        chain += [_tool("nsenter"), f"--net={NETNS_DIR / spec.netns}", "--"]
    if spec.credentials is not None:
        creds = spec.credentials
        groups = (
            ["--groups", ",".join(str(g) for g in creds.groups)]
            if creds.groups
            else ["--clear-groups"]
        )
        chain += [
            _tool("setpriv"),
            f"--reuid={creds.uid}",
            f"--regid={creds.gid}",
            *groups,
            "--",
        ]
    return [*chain, *spec.argv]


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
