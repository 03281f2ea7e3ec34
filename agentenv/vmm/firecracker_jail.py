"""Confining Firecracker VMMs with Firecracker's own ``jailer``.

A confined Firecracker is started as ``jailer ... -- <firecracker arguments>``; the
jailer (from the same v1.12.1 release, see :mod:`agentenv.vmm.firecracker_binary`)
creates the VMM's cgroup and joins it, makes ``/dev/kvm``, ``/dev/net/tun`` and the few
other device nodes Firecracker needs inside a chroot, enters a new mount namespace,
``pivot_root``\\ s into the chroot, switches to the VMM's uid and gid and execs the copy
of ``firecracker`` it placed there. Firecracker then installs its own seccomp filters (the
API thread at once, the VMM thread when the machine is built or loaded).

What this module adds around the jailer:

- **Who.** The uid and gid are the :class:`~agentenv.vmm.confine.Confinement`'s, as for
  QEMU: a uid per sandbox, the server's VMM group. The jailer is started as restricted root (no
  supplementary groups, ``no_new_privs``) so root's supplementary groups never reach the
  VMM.
- **The chroot**, ``<jail base>/firecracker/<id>/root`` with the jail base beside the
  work directory (``.jail-<name>``, as QEMU's jail tree) and ``<id>`` the VMM's cgroup
  name (``vm-<hash of the work directory>``), so the cgroup the jailer creates is the one
  :class:`~agentenv.vmm.cgroups.VmmCgroups` removes and reclaims. It holds only what this
  VMM opens, at fixed paths: ``boot/vmlinux`` (and ``boot/initrd``), ``drives/<id>``,
  on a restore ``snapshot-in/state.fc`` and ``snapshot-in/memory.fc``, the log
  ``fc.log``, the directory ``run/`` for its API socket and ``snapshot-out/`` where it
  writes snapshots, which are moved out to where the caller wants them. Files are hard
  links where they are on the chroot's filesystem, otherwise read-write or read-only bind
  mounts made in the launch's private mount namespace (never on the host). Ownership is
  set as for QEMU (:func:`~agentenv.vmm.confine.grant`).
- **Cgroup limits** like QEMU's: memory (guest RAM + overhead), CPU quota of its vCPUs,
  a thread limit, an I/O weight where the io controller is there, in the host's cgroup
  version (``--cgroup-version``), under the server's parent cgroup (``--parent-cgroup``).
- **No ``--daemonize`` and no ``--new-pid-ns``**: the jailer execs Firecracker in place,
  so the pid the launch returns is the VMM's, and its stdout (the guest console) is the
  file the server opened.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

from agentenv.vmm.base import MachineSpec
from agentenv.vmm.cgroups import CgroupError, CgroupLimits, VmmCgroups
from agentenv.vmm.confine import Confinement, ConfinementError, grant, jail_root
from agentenv.vmm.launch import Bind, LaunchSpec

#: Paths inside the chroot (Firecracker's view; its cwd is the chroot's root).
API_SOCKET_IN_JAIL = "/run/fc.sock"
LOG_IN_JAIL = "/fc.log"
KERNEL_IN_JAIL = "/boot/vmlinux"
INITRD_IN_JAIL = "/boot/initrd"
DRIVES_IN_JAIL = "/drives"
STATE_IN_JAIL = "/snapshot-in/state.fc"
MEMORY_IN_JAIL = "/snapshot-in/memory.fc"
SNAPSHOT_OUT_IN_JAIL = "/snapshot-out"

#: Open files the jailer lets Firecracker have (its default is 2048).
NO_FILE_LIMIT = 2048
_CPU_PERIOD_US = 100_000
# sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107
SHORT_SOCKET_DIR = Path("/run/agentenv")


class FirecrackerJailError(ConfinementError):
    """A Firecracker VMM cannot be confined (chroot, ownership, cgroup)."""


def cgroup_arguments(cgroups: VmmCgroups, limits: CgroupLimits) -> list[str]:
    """The jailer's ``--cgroup-version``, ``--parent-cgroup`` and ``--cgroup`` options
    for ``limits`` in the host's hierarchy (the same values QEMU's cgroups get)."""
    quota = limits.cpus * _CPU_PERIOD_US
    if cgroups.version == 2:
        values = [
            f"memory.max={limits.memory_bytes}",
            # The VMM's threads are one unit: if one is OOM-killed, all go.
            "memory.oom.group=1",
            f"cpu.max={quota} {_CPU_PERIOD_US}",
            f"pids.max={limits.pids}",
        ]
        if "io" in cgroups.controllers:
            values.append(f"io.weight=default {limits.io_weight}")
    else:
        values = [
            f"memory.limit_in_bytes={limits.memory_bytes}",
            f"cpu.cfs_period_us={_CPU_PERIOD_US}",
            f"cpu.cfs_quota_us={quota}",
            f"pids.max={limits.pids}",
        ]
        if "io" in cgroups.controllers:
            values.append(f"blkio.weight={max(10, min(1000, limits.io_weight * 5))}")
    args = ["--cgroup-version", str(cgroups.version), "--parent-cgroup", cgroups.parent_name]
    for value in values:
        args += ["--cgroup", value]
    return args


def host_socket_path(socket_in_chroot: Path, workdir: Path) -> Path:
    """Where the server connects to the API socket: the socket itself, or, when that path
    is too long for a Unix socket, a symlink to it under /run named from the work
    directory (connect follows symlinks)."""
    if len(str(socket_in_chroot).encode()) <= _MAX_SOCKET_PATH:
        return socket_in_chroot
    digest = hashlib.sha256(str(workdir).encode()).hexdigest()[:24]
    return SHORT_SOCKET_DIR / f"fc-{digest}.sock"


class FirecrackerJail:
    """The chroot, cgroup and command line of the Firecracker VMM working in ``workdir``.
    Everything here is derived from ``workdir``, so a restarted server can clean up after
    a VMM it re-adopted."""

    def __init__(
        self, confinement: Confinement, jailer: Path, firecracker: Path, workdir: Path
    ) -> None:
        self.confinement = confinement
        self.jailer = jailer
        self.firecracker = firecracker
        self.workdir = workdir
        self.jail_id = VmmCgroups.name_for(workdir)
        self.base = jail_root(workdir)
        self.root = self.base / firecracker.name / self.jail_id / "root"
        self.api_socket = host_socket_path(self.host(API_SOCKET_IN_JAIL), workdir)

    def host(self, inside: str) -> Path:
        """The host's path of ``inside``, a path in the chroot."""
        return self.root / inside.lstrip("/")

    # -- command line ------------------------------------------------------------------

    def argv(self, spec: MachineSpec, firecracker_args: list[str]) -> list[str]:
        """The jailer's command line, which execs Firecracker with ``firecracker_args``
        (``--id`` is the jailer's). It is launched as restricted root (no supplementary
        groups, ``no_new_privs``: :attr:`LaunchSpec.restricted_root`)."""
        return [
            str(self.jailer),
            "--id",
            self.jail_id,
            "--exec-file",
            str(self.firecracker),
            "--uid",
            str(self.confinement.uid_for(spec)),
            "--gid",
            str(self.confinement.gid),
            "--chroot-base-dir",
            str(self.base),
            *cgroup_arguments(self.confinement.cgroups, self.confinement.limits(spec)),
            "--resource-limit",
            f"no-file={NO_FILE_LIMIT}",
            "--",
            *firecracker_args,
        ]

    def owner(self, spec: MachineSpec) -> tuple[int, int]:
        """The uid and gid the VMM of ``spec`` runs as: files it must write are theirs."""
        return self.confinement.uid_for(spec), self.confinement.gid

    def markers(self) -> list[str]:
        """Arguments the jailed Firecracker's command line holds (the jailer passes the
        id), by which a restarted server recognises it."""
        return [API_SOCKET_IN_JAIL, self.jail_id]

    def confine(
        self,
        launch_spec: LaunchSpec,
        spec: MachineSpec,
        snapshot: tuple[Path, Path] | None = None,
    ) -> LaunchSpec:
        """``launch_spec`` (output files, cwd, network namespace) turned into the jailed
        start of Firecracker for ``spec``, after laying out its chroot (:meth:`build`).
        Raises :class:`FirecrackerJailError`, leaving no chroot behind."""
        try:
            self.confinement.prepare_host()
        except ConfinementError as exc:
            raise FirecrackerJailError(str(exc)) from exc
        args = ["--api-sock", API_SOCKET_IN_JAIL, "--level", "Warning", "--log-path", LOG_IN_JAIL]
        argv = self.argv(spec, args)
        return replace(
            launch_spec,
            argv=tuple(argv),
            binds=self.build(spec, snapshot),
            oom_score_adj=self.confinement.oom_score_adj,
            restricted_root=True,
        )

    # -- chroot --------------------------------------------------------------------------

    def _private(self, path: Path) -> bool:
        data_dir = self.confinement.data_dir.resolve()
        return path.resolve().is_relative_to(data_dir)

    def _mkdir(self, inside: str, owner: int | None = None) -> Path:
        """A directory in the chroot: the VMM's own (0700) with ``owner``, else root's,
        which the VMM may only traverse (0711)."""
        path = self.host(inside)
        path.mkdir(exist_ok=True)
        if owner is not None:
            os.chown(path, owner, self.confinement.gid)
            path.chmod(0o700)
        else:
            # Set, not passed to mkdir: the server's umask (077) would take the x bits.
            path.chmod(0o711)
        return path

    def _place(self, source: Path, inside: str, uid: int, *, writable: bool) -> Bind | None:
        """Give the VMM ``source`` at ``inside``: ownership (:func:`grant`), then a hard
        link, or an empty file to bind-mount onto (returned) if the link cannot be made."""
        source = source.resolve()
        grant(source, uid, self.confinement.gid, writable=writable, private=self._private(source))
        target = self.host(inside)
        if target.parent != self.root:
            self._mkdir(str(Path(inside).parent))
        try:
            os.link(source, target)
            return None
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
        target.touch(mode=0o600)
        return Bind(source, target, read_only=not writable)

    def build(
        self, spec: MachineSpec, snapshot: tuple[Path, Path] | None = None
    ) -> tuple[Bind, ...]:
        """Lay out a fresh chroot for ``spec`` (and, on a restore, the snapshot's state
        and RAM files), with an empty log shared with the work directory's ``fc.log``;
        remove a leftover cgroup of the same name. Returns the bind mounts the launch must
        make (files a hard link could not reach). Raises :class:`FirecrackerJailError`."""
        uid = self.confinement.uid_for(spec)
        try:
            self.remove_tree()
            self.confinement.cgroups.remove(self.jail_id)
            # The jailer gives the chroot's root to the VMM; the directories above it are
            # root's (0711; the server's umask would make them 0700).
            for directory in (self.base, self.root.parent.parent, self.root.parent):
                directory.mkdir()
                directory.chmod(0o711)
            self.root.mkdir()
            self._mkdir("/run", owner=uid)
            self._mkdir(SNAPSHOT_OUT_IN_JAIL, owner=uid)
            binds: list[Bind] = []
            placed = [(spec.kernel, KERNEL_IN_JAIL, False)]
            if spec.initrd is not None:
                placed.append((spec.initrd, INITRD_IN_JAIL, False))
            for drive in spec.drives:
                placed.append(
                    (drive.path, f"{DRIVES_IN_JAIL}/{drive.drive_id}", not drive.read_only)
                )
            if snapshot is not None:
                placed.append((snapshot[0], STATE_IN_JAIL, False))
                placed.append((snapshot[1], MEMORY_IN_JAIL, False))
            for source, inside, writable in placed:
                if (bind := self._place(source, inside, uid, writable=writable)) is not None:
                    binds.append(bind)
            log = self.workdir / "fc.log"
            log.write_bytes(b"")
            if (bind := self._place(log, LOG_IN_JAIL, uid, writable=True)) is not None:
                binds.append(bind)
            if self.api_socket.parent == SHORT_SOCKET_DIR:
                SHORT_SOCKET_DIR.mkdir(mode=0o700, exist_ok=True)
                self.api_socket.unlink(missing_ok=True)
                self.api_socket.symlink_to(self.host(API_SOCKET_IN_JAIL))
        except (OSError, CgroupError) as exc:
            self.cleanup(0)
            raise FirecrackerJailError(f"cannot lay out the Firecracker jail: {exc}") from exc
        return tuple(binds)

    def export(self, produced: Path, dest: Path) -> None:
        """Move a file Firecracker wrote in the chroot to ``dest`` (root's, 0600, like
        every file the server keeps): a rename on the same filesystem, else a copy."""
        try:
            os.chown(produced, 0, 0)
            produced.chmod(0o600)
            try:
                os.replace(produced, dest)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.move(produced, dest)
        except OSError as exc:
            raise FirecrackerJailError(f"cannot move {produced} out of the jail: {exc}") from exc

    def remove_tree(self) -> None:
        if self.base.exists():
            shutil.rmtree(self.base)

    def cleanup(self, wait_s: float = 0.5) -> None:
        """Remove what confined a VMM that has exited: its chroot, socket link and cgroup
        (a cgroup still busy is left for :meth:`VmmCgroups.reclaim`)."""
        with contextlib.suppress(OSError):
            self.remove_tree()
        if self.api_socket.parent == SHORT_SOCKET_DIR:
            self.api_socket.unlink(missing_ok=True)
        with contextlib.suppress(CgroupError):
            self.confinement.cgroups.remove(self.jail_id, wait_s)
