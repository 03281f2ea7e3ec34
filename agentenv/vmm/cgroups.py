"""Per-VMM control groups: one cgroup per VMM under one parent per server.

A VMM's cgroup caps its memory (guest RAM plus the VMM's own overhead), CPU (as many
cores as it has vCPUs), number of threads and, where the io controller is there, gives it
an I/O weight. The parent is named from the server's instance tag, so several servers on
one host keep apart, and a VMM's cgroup is named from its work directory, so a restarted
server finds it again.

cgroup v2 is used where the unified hierarchy has the memory, cpu and pids controllers.
On a host that still binds those controllers to cgroup v1 hierarchies (a hybrid setup,
where the v2 tree has no controllers), the same limits go into one cgroup per v1
hierarchy; the VMM joins all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Controllers a VMM's cgroup needs; io is used when present.
REQUIRED_CONTROLLERS = ("memory", "cpu", "pids")
_CPU_PERIOD_US = 100_000
# cgroup v1 names of the controllers, and the hierarchy each is mounted as.
_V1_HIERARCHIES = {"memory": "memory", "cpu": "cpu", "pids": "pids", "io": "blkio"}


class CgroupError(Exception):
    """A cgroup could not be created or configured."""


@dataclass(frozen=True)
class CgroupLimits:
    """What one VMM may use."""

    memory_bytes: int
    cpus: int
    pids: int
    io_weight: int = 100


def _v2_controllers(root: Path) -> set[str]:
    try:
        return set((root / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


@dataclass(frozen=True)
class VmmCgroups:
    """The cgroup tree of one server's VMMs: ``version`` 2 (one hierarchy at ``roots``
    [0]) or 1 (one hierarchy per controller, ``roots`` keyed by ``controllers``)."""

    version: int
    parent_name: str
    roots: tuple[Path, ...]
    controllers: tuple[str, ...]

    @classmethod
    def detect(cls, parent_name: str, root: Path = CGROUP_ROOT) -> VmmCgroups:
        """The hierarchy this host offers the required controllers in; raises
        :class:`CgroupError` naming what is missing."""
        v2 = _v2_controllers(root)
        if all(c in v2 for c in REQUIRED_CONTROLLERS):
            wanted = [c for c in (*REQUIRED_CONTROLLERS, "io") if c in v2]
            return cls(2, parent_name, (root,), tuple(wanted))
        mounted = {
            c: root / h for c, h in _V1_HIERARCHIES.items() if (root / h / "tasks").is_file()
        }
        missing = [c for c in REQUIRED_CONTROLLERS if c not in mounted]
        if missing:
            raise CgroupError(
                f"no cgroup hierarchy under {root} has the {', '.join(missing)} "
                "controller(s) (cgroup v2 with memory, cpu and pids, or their v1 hierarchies)"
            )
        if not (mounted["io"] / "blkio.weight").is_file():
            del mounted["io"]
        controllers = tuple(c for c in (*REQUIRED_CONTROLLERS, "io") if c in mounted)
        return cls(1, parent_name, tuple(mounted[c] for c in controllers), controllers)

    def parents(self) -> tuple[Path, ...]:
        return tuple(root / self.parent_name for root in self.roots)

    def prepare(self) -> None:
        """Create the parent cgroup(s) and, on v2, let the children use the controllers.
        Raises :class:`CgroupError` if that is not allowed (not root, read-only mount)."""
        try:
            for parent in self.parents():
                parent.mkdir(exist_ok=True)
            if self.version == 2:
                enable = " ".join(f"+{c}" for c in self.controllers)
                (self.roots[0] / "cgroup.subtree_control").write_text(enable)
                (self.parents()[0] / "cgroup.subtree_control").write_text(enable)
        except OSError as exc:
            raise CgroupError(f"cannot set up the VMM cgroups: {exc}") from exc

    @staticmethod
    def name_for(workdir: Path) -> str:
        """The cgroup name of the VMM whose files are in ``workdir``."""
        return "vm-" + hashlib.sha256(str(workdir).encode()).hexdigest()[:16]

    def paths(self, name: str) -> tuple[Path, ...]:
        return tuple(parent / name for parent in self.parents())

    def create(self, name: str, limits: CgroupLimits) -> tuple[Path, ...]:
        """A fresh cgroup ``name`` (a leftover of that name is removed first) with
        ``limits``; returns its directories, one per hierarchy, to be joined."""
        self.remove(name)
        paths = self.paths(name)
        try:
            for path in paths:
                path.mkdir()
            quota = f"{limits.cpus * _CPU_PERIOD_US} {_CPU_PERIOD_US}"
            if self.version == 2:
                path = paths[0]
                (path / "memory.max").write_text(str(limits.memory_bytes))
                # The VMM's threads are one unit: if one is OOM-killed, all go.
                (path / "memory.oom.group").write_text("1")
                (path / "cpu.max").write_text(quota)
                (path / "pids.max").write_text(str(limits.pids))
                if "io" in self.controllers:
                    (path / "io.weight").write_text(f"default {limits.io_weight}")
            else:
                by_controller = dict(zip(self.controllers, paths, strict=True))
                (by_controller["memory"] / "memory.limit_in_bytes").write_text(
                    str(limits.memory_bytes)
                )
                (by_controller["cpu"] / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
                (by_controller["cpu"] / "cpu.cfs_quota_us").write_text(
                    str(limits.cpus * _CPU_PERIOD_US)
                )
                (by_controller["pids"] / "pids.max").write_text(str(limits.pids))
                if "io" in by_controller:
                    (by_controller["io"] / "blkio.weight").write_text(
                        str(max(10, min(1000, limits.io_weight * 5)))
                    )
        except OSError as exc:
            self.remove(name)
            raise CgroupError(f"cannot create cgroup {name}: {exc}") from exc
        return paths

    @staticmethod
    def join(pid: int, paths: tuple[Path, ...]) -> None:
        """Move process ``pid``, all its threads, into the cgroup directories ``paths``
        (one per hierarchy). Each move waits for an RCU grace period in the kernel (about
        10 to 20 ms here) unless another move happened just before, which is why a
        restoring VMM is moved while it starts rather than before (see the QEMU driver).
        On a v1 memory hierarchy what the process was charged before stays where it was."""
        try:
            for path in paths:
                (path / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise CgroupError(f"cannot move process {pid} into {path}: {exc}") from exc

    def remove(self, name: str, wait_s: float = 0.0) -> bool:
        """Remove cgroup ``name`` if it is there and empty; a just-exited VMM may leave it
        populated for a moment, so retry for up to ``wait_s``. True if none is left."""
        deadline = time.monotonic() + wait_s
        left = True
        while True:
            left = False
            for path in self.paths(name):
                try:
                    path.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise CgroupError(f"cannot remove {path}: {exc}") from exc
                    left = True
            if not left or time.monotonic() >= deadline:
                return not left
            time.sleep(0.005)

    def reclaim(self) -> int:
        """Remove every empty VMM cgroup under the parent (leftovers of VMMs that exited
        while no server watched them); those still holding a process stay. Returns how
        many were removed."""
        removed = 0
        for parent in self.parents():
            with contextlib.suppress(FileNotFoundError):
                for child in parent.iterdir():
                    if child.is_dir() and child.name.startswith("vm-"):
                        with contextlib.suppress(OSError):
                            child.rmdir()
                            removed += 1
        return removed

    def member_of(self, pid: int) -> bool:
        """Whether ``pid`` is in a VMM cgroup of this tree (for tests and checks)."""
        try:
            text = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False
        return f"/{self.parent_name}/vm-" in text


# -- favordynmods --------------------------------------------------------------------------

FAVORDYNMODS = "favordynmods"
# Per-mount flags a remount must pass again, or it clears them (mount(2) MS_* values).
_MOUNT_FLAGS = {
    "ro": 1,
    "nosuid": 2,
    "nodev": 4,
    "noexec": 8,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}
_MS_REMOUNT = 32


def remount_request(mountinfo: str) -> tuple[Path, int, str] | None:
    """What remounting the first cgroup2 hierarchy in ``mountinfo`` (/proc/self/
    mountinfo's text) with ``favordynmods`` takes: its mount point, the mount(2) flags
    (its per-mount options again, or the remount clears them) and the superblock options
    (its own plus ``favordynmods``). None if it has the option already. Raises
    :class:`CgroupError` if no cgroup2 hierarchy is mounted."""
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        if len(parts) < 6 or len(rest) < 3 or rest[0] != "cgroup2":
            continue
        point, mount_options, super_options = Path(parts[4]), parts[5], rest[2].split(",")
        if FAVORDYNMODS in super_options:
            return None
        flags = _MS_REMOUNT
        for option in mount_options.split(","):
            flags |= _MOUNT_FLAGS.get(option, 0)
        kept = [o for o in super_options if o not in ("rw", "ro")]
        return point, flags, ",".join([*kept, FAVORDYNMODS])
    raise CgroupError("no cgroup2 hierarchy is mounted")


def favor_dynamic_moves(mountinfo: Path = Path("/proc/self/mountinfo")) -> str:
    """Remount the host's cgroup2 hierarchy with ``favordynmods`` (Linux 6.0+), keeping
    its other options, so that moving a process into a cgroup stops waiting for an RCU
    grace period (10 to 20 ms per VMM start measured here, on v2 and hybrid hosts alike:
    the lock it waits for is global), at the cost of slightly dearer forks and exits
    host-wide. Returns what it did, for the log; :class:`CgroupError` if it cannot."""
    request = remount_request(mountinfo.read_text())
    if request is None:
        return f"the cgroup2 hierarchy already has {FAVORDYNMODS}"
    point, flags, data = request
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, str(point).encode(), None, flags, data.encode()) != 0:
        code = ctypes.get_errno()
        raise CgroupError(
            f"cannot remount {point} with {FAVORDYNMODS}: {errno.errorcode.get(code, code)}"
        )
    return f"remounted {point} with {FAVORDYNMODS}"
