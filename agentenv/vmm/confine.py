"""Confining VMM processes: who they run as, which files they may open, their cgroups.

Every VMM of a server runs as its own unprivileged uid, taken from a block of ids the
server owns (block start + 1 + the sandbox's network slot; the block start is also the
group all its VMMs share), with no capabilities and ``no_new_privs``. A uid per sandbox
rather than one service uid means a compromised VMM cannot open, signal or ptrace another
sandbox's VMM or write its files: the files one VMM writes (its disk's top image, its
shared RAM file, its work directory) are owned by its uid and mode 0600/0700.

Files VMMs only read (kernel, initrd, tools drive, the read-only layers under a disk)
are given to the VMM group, root-owned, mode 0640. A RAM file mapped privately (a
template's RAM shared copy-on-write by many sandboxes) must be group-writable: QEMU 7.2
opens every ``memory-backend-file`` read-write, even for a private mapping (QEMU 8.2's
``readonly=on,rom=off`` would lift that).

Group access alone would let a VMM open any template's or snapshot's files, and the data
directory is private to root (0700). So each VMM also gets a jail: a tree, built per VMM
beside its work directory, holding hard links to exactly the files under the data
directory it opens, at the same relative paths (qcow2 backing paths are absolute), in
directories root owns (0711). :mod:`agentenv.vmm.launch` mounts that tree over the data
directory in the VMM's private mount namespace, and its work directory at its own place
in it. ``state.db``, other sandboxes' disks and RAM, the API key: none of them exists
there. Hard links need the files on the data directory's filesystem; files outside the
data directory (the guest image cache) stay visible as the host has them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.storage.images import backing_file
from agentenv.vmm.base import MachineSpec
from agentenv.vmm.cgroups import CgroupError, CgroupLimits, VmmCgroups
from agentenv.vmm.launch import Credentials, Jail, LaunchError, find_launcher

#: ``oom_score_adj`` of every VMM: killed before anything else on the host.
VMM_OOM_SCORE_ADJ = 1000
#: ``oom_score_adj`` the server sets for itself at start-up.
SERVER_OOM_SCORE_ADJ = -900
#: Ids per server block: the group, one uid per network slot, the last for VMMs without a
#: network.
IDS_PER_SERVER = 1 << 16
#: Devices a VMM opens (KVM, taps).
DEVICES = (Path("/dev/kvm"), Path("/dev/net/tun"))

_MAX_BACKING_CHAIN = 1000
#: Name prefix of a jail tree's directory (beside the VMM's work directory).
JAIL_PREFIX = ".jail-"


class ConfinementError(Exception):
    """A VMM cannot be confined as configured (files, cgroups, devices)."""


def id_block(base: int, instance_tag: str) -> int:
    """The first id of a server's block: above ``base`` by one plus the low 12 bits of
    its instance tag, times :data:`IDS_PER_SERVER`, so servers sharing a host use
    separate ids (``base`` itself is the device group, see :attr:`Confinement.device_gid`)."""
    return base + (1 + (int(instance_tag, 16) & 0xFFF)) * IDS_PER_SERVER


@dataclass
class Confinement:
    """How one server confines its VMMs."""

    data_dir: Path
    id_base: int  # the block start: the VMM group; uids follow it
    device_gid: int  # the group that opens root-only devices, shared by every server
    cgroups: VmmCgroups
    memory_overhead_mib: int
    pids_max: int
    oom_score_adj: int = VMM_OOM_SCORE_ADJ
    _device_groups: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def gid(self) -> int:
        return self.id_base

    def uid_for(self, spec: MachineSpec) -> int:
        """The uid of the VMM running ``spec``: one per network slot (the namespace name
        ends in ``-<slot>``)."""
        if spec.net is not None and spec.net.netns is not None:
            slot = spec.net.netns.rpartition("-")[2]
            if slot.isdigit() and int(slot) < IDS_PER_SERVER - 2:
                return self.id_base + 1 + int(slot)
        return self.id_base + IDS_PER_SERVER - 1

    def prepare_host(self) -> None:
        """Create the cgroup parent and let the VMM group open the devices it needs;
        idempotent. Raises :class:`ConfinementError`."""
        try:
            self.cgroups.prepare()
        except CgroupError as exc:
            raise ConfinementError(str(exc)) from exc
        self.device_groups()

    def device_groups(self) -> tuple[int, ...]:
        """Supplementary groups that open :data:`DEVICES`. A device only root may open
        is given to :attr:`device_gid` (read-write for the group), which every server's
        VMMs share, so no server's VMMs join another's group; a device that already has
        a group keeps it, and that group is added."""
        if self._device_groups is not None:
            return self._device_groups
        groups: list[int] = []
        for device in DEVICES:
            try:
                st = device.stat()
            except FileNotFoundError:
                continue
            if st.st_mode & 0o006 == 0o006:
                continue
            try:
                if st.st_gid == 0:
                    os.chown(device, -1, self.device_gid)
                    gid = self.device_gid
                else:
                    gid = st.st_gid
                if st.st_mode & 0o060 != 0o060:
                    os.chmod(device, stat.S_IMODE(st.st_mode) | 0o060)
            except OSError as exc:
                raise ConfinementError(f"cannot give VMMs access to {device}: {exc}") from exc
            if gid != self.gid and gid not in groups:
                groups.append(gid)
        self._device_groups = tuple(groups)
        return self._device_groups

    def credentials(self, spec: MachineSpec) -> Credentials:
        return Credentials(
            uid=self.uid_for(spec), gid=self.gid, groups=(self.gid, *self.device_groups())
        )

    def limits(self, spec: MachineSpec) -> CgroupLimits:
        return CgroupLimits(
            memory_bytes=(spec.memory_mib + self.memory_overhead_mib) * 1024 * 1024,
            cpus=spec.vcpus,
            pids=self.pids_max,
        )

    def jail_for(self, spec: MachineSpec, workdir: Path) -> VmmJail:
        return VmmJail(self, self.uid_for(spec), workdir)


def grant(path: Path, uid: int, gid: int, *, writable: bool, private: bool) -> None:
    """Set the ownership that lets a VMM running as ``uid`` in group ``gid`` open
    ``path``: its own if ``writable`` (mode 0600); else, for a ``private`` file (one in
    the data directory), root's and readable by the group (0640); else group read is
    added where others cannot read it. Raises :class:`OSError`."""
    if writable:
        os.chown(path, uid, gid)
        os.chmod(path, 0o600)
    elif private:
        os.chown(path, 0, gid)
        os.chmod(path, 0o640)
    else:
        st = path.stat()
        if st.st_mode & 0o004 == 0:
            os.chown(path, -1, gid)
            os.chmod(path, stat.S_IMODE(st.st_mode) | 0o040)


def hidden_top(data_dir: Path) -> Path:
    """The directory a jail is mounted over: the data directory, or its highest ancestor
    that other users cannot traverse (a data directory inside a private directory),
    since the VMM's uid could not walk through that to reach the jail."""
    current = Path("/")
    for part in data_dir.parts[1:]:
        current = current / part
        if current == data_dir:
            break
        try:
            if current.stat().st_mode & 0o001 == 0:
                return current
        except OSError:
            return current
    return data_dir


def jail_root(workdir: Path) -> Path:
    """Where the jail tree of the VMM working in ``workdir`` is built: beside it, in a
    directory the VMM itself cannot reach on the host."""
    return workdir.parent / f"{JAIL_PREFIX}{workdir.name}"


def backing_chain(image: Path) -> list[Path]:
    """The backing files under qcow2 ``image``, nearest first, read from the headers
    (absolute names as written; relative ones are relative to the image's directory)."""
    chain: list[Path] = []
    current = image
    for _ in range(_MAX_BACKING_CHAIN):
        try:
            backing = backing_file(current)
        except (OSError, UnicodeDecodeError):
            return chain
        if backing is None:
            return chain
        backing = Path(os.path.normpath(backing))
        chain.append(backing)
        current = backing
    raise ConfinementError(f"backing chain of {image} is longer than {_MAX_BACKING_CHAIN}")


class VmmJail:
    """The files one VMM may open, the ownership that lets it, and its jail tree."""

    def __init__(self, confinement: Confinement, uid: int, workdir: Path) -> None:
        self.confinement = confinement
        self.uid = uid
        self.workdir = workdir
        self.root = jail_root(workdir)
        self.cgroup_name = VmmCgroups.name_for(workdir)
        self.hides = hidden_top(confinement.data_dir.resolve())

    @property
    def jail(self) -> Jail:
        return Jail(root=self.root, hides=self.hides, workdir=self.workdir)

    def _inside(self, path: Path) -> Path | None:
        """Where ``path`` goes in the jail tree (relative to :attr:`hides`) if it is under
        the data directory, else None."""
        data_dir = self.confinement.data_dir
        for base in (data_dir, data_dir.resolve()):
            with contextlib.suppress(ValueError):
                inside = Path(os.path.normpath(path)).relative_to(base)
                return data_dir.resolve().relative_to(self.hides) / inside
        return None

    def _make_dirs(self, relative: Path) -> Path:
        target = self.root
        for part in relative.parts:
            target = target / part
            try:
                target.mkdir()
            except FileExistsError:
                continue
            # Set, not passed to mkdir: the server's umask (077) would take the x bits.
            target.chmod(0o711)
        return target

    def admit(self, path: Path, *, writable: bool) -> None:
        """Let the VMM open ``path``: its own if ``writable`` (mode 0600), else the VMM
        group's to read (root-owned, 0640); and, under the data directory, a hard link at
        the same place in the jail tree."""
        try:
            relative = self._inside(path)
            grant(
                path,
                self.uid,
                self.confinement.gid,
                writable=writable,
                private=relative is not None,
            )
            if relative is None:
                return
            directory = self._make_dirs(relative.parent)
            link = directory / relative.name
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            os.link(path, link)
        except OSError as exc:
            raise ConfinementError(f"cannot let the VMM open {path}: {exc}") from exc

    def admit_shared_writable(self, path: Path) -> None:
        """A file the VMM must open read-write but that is not its own (a private RAM
        mapping's file, see the module docstring): group read-write."""
        try:
            os.chown(path, 0, self.confinement.gid)
            os.chmod(path, 0o660)
            relative = self._inside(path)
            if relative is not None:
                link = self._make_dirs(relative.parent) / relative.name
                with contextlib.suppress(FileNotFoundError):
                    link.unlink()
                os.link(path, link)
        except OSError as exc:
            raise ConfinementError(f"cannot let the VMM open {path}: {exc}") from exc

    def build(self, spec: MachineSpec) -> None:
        """Build the jail tree for ``spec`` from scratch and set the ownership of every
        file in it; the work directory becomes the VMM's."""
        self.remove_tree()
        self.root.mkdir()
        self.root.chmod(0o711)
        try:
            os.chown(self.workdir, self.uid, self.confinement.gid)
            os.chmod(self.workdir, 0o700)
        except OSError as exc:
            raise ConfinementError(f"cannot give {self.workdir} to the VMM: {exc}") from exc
        relative = self._inside(self.workdir)
        if relative is None:
            raise ConfinementError(
                f"VMM directory {self.workdir} is not in {self.confinement.data_dir}"
            )
        self._make_dirs(relative)
        for path in (spec.kernel, *((spec.initrd,) if spec.initrd else ())):
            self.admit(path, writable=False)
        for drive in spec.drives:
            self.admit(drive.path, writable=not drive.read_only)
            if drive.fmt == "qcow2":
                for backing in backing_chain(drive.path):
                    self.admit(backing, writable=False)
        if spec.memory_shared or not spec.memory_file.exists():
            if not spec.memory_file.exists():
                # QEMU would create it; create it here so it is the VMM's.
                spec.memory_file.touch(mode=0o600)
            self.admit(spec.memory_file, writable=True)
        else:
            self.admit_shared_writable(spec.memory_file)

    def create_cgroup(self, spec: MachineSpec) -> tuple[Path, ...]:
        try:
            return self.confinement.cgroups.create(self.cgroup_name, self.confinement.limits(spec))
        except CgroupError as exc:
            raise ConfinementError(str(exc)) from exc

    def join_cgroup(self, pid: int, paths: tuple[Path, ...]) -> None:
        try:
            self.confinement.cgroups.join(pid, paths)
        except CgroupError as exc:
            raise ConfinementError(str(exc)) from exc

    def ensure_in_cgroup(self, pid: int, spec: MachineSpec) -> None:
        """Put an adopted VMM into its cgroups if it is not in them: a restoring VMM joins
        them after it starts (see the QEMU driver), so one whose server died in between
        runs outside them until a new server does this."""
        paths = self.confinement.cgroups.paths(self.cgroup_name)
        if not all(path.is_dir() for path in paths):
            paths = self.create_cgroup(spec)
        try:
            outside = tuple(
                path
                for path in paths
                if str(pid) not in (path / "cgroup.procs").read_text().split()
            )
        except OSError as exc:
            raise ConfinementError(f"cannot read the members of {self.cgroup_name}: {exc}") from exc
        if outside:
            self.join_cgroup(pid, outside)

    def remove_tree(self) -> None:
        if self.root.exists():
            shutil.rmtree(self.root)

    def cleanup(self, wait_s: float = 0.5) -> None:
        """Remove what confined a VMM that has exited: its jail tree and its cgroup (a
        cgroup still busy is left for :meth:`VmmCgroups.reclaim`)."""
        with contextlib.suppress(OSError):
            self.remove_tree()
        with contextlib.suppress(CgroupError):
            self.confinement.cgroups.remove(self.cgroup_name, wait_s)


def problems(cgroup_parent: str) -> list[str]:
    """What this host lacks for confining VMMs, each as a sentence naming it (empty when
    nothing is missing)."""
    found: list[str] = []
    if os.geteuid() != 0:
        found.append("the server is not root (it sets VMM uids, cgroups and mounts)")
    try:
        find_launcher()
    except LaunchError as exc:
        found.append(str(exc))
    try:
        cgroups = VmmCgroups.detect(cgroup_parent)
    except CgroupError as exc:
        found.append(str(exc))
    else:
        for parent in cgroups.parents():
            base = parent.parent
            if not os.access(base, os.W_OK):
                found.append(f"cgroup hierarchy {base} is not writable")
    return found


def lower_server_oom_score() -> str | None:
    """Make the server the OOM killer's last choice among agentenv's processes. Lowering
    needs ``CAP_SYS_RESOURCE``, which a container may not grant; then the VMMs' raised
    score alone still puts them first. Returns why it could not, or None."""
    try:
        Path("/proc/self/oom_score_adj").write_text(str(SERVER_OOM_SCORE_ADJ))
    except OSError as exc:
        return f"cannot lower the server's oom_score_adj: {exc}"
    return None
