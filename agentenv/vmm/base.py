"""The driver interface every VMM implementation follows.

A driver starts and restores VMM processes; a :class:`VirtualMachine` is a handle on one
running process. Callers describe a machine with :class:`MachineSpec` and get snapshots
back as :class:`SnapshotFiles`, which record everything needed to judge whether a later
restore is compatible (driver, accelerator, machine shape).
"""

from __future__ import annotations

import enum
import json
import os
import signal
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal


class VMMError(Exception):
    """Base class of every error a driver raises."""


class VMMStartError(VMMError):
    """The VMM process could not be started or did not come up (the message carries the
    tail of its log)."""


class VMMCommandError(VMMError):
    """The VMM refused or failed a control command (QMP or API call)."""


class VMMUnresponsive(VMMCommandError):
    """The VMM did not answer a control command in time: hung, stopped or starved. The
    command may still run once it answers again, in the order it was sent."""


class VMMGone(VMMError):
    """The VMM process is no longer there."""


class SnapshotIncompatible(VMMError):
    """A snapshot was made under a driver, accelerator or machine shape that differs from
    the one it is being restored with."""


class DiskCapture(enum.StrEnum):
    """How a driver's running machine has its root disk captured into a snapshot (the
    machine is stopped by :meth:`VirtualMachine.save_state` meanwhile, and runs on
    afterwards)."""

    #: It cannot be: snapshots and forks of running machines are refused.
    NONE = "none"
    #: :meth:`VirtualMachine.seal_drive`: the qcow2 top image is frozen in place as the
    #: snapshot's disk and writes go on into a new top over it (constant time; the
    #: sandbox's disk then builds on the snapshot's).
    SEAL = "seal"
    #: The disk file is copied (a reflink where the filesystem can) into the snapshot
    #: while the machine is stopped: its save has completed every block request, so the
    #: file holds what the saved state expects. The machine keeps writing its own file.
    COPY = "copy"


class VMRunState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass(frozen=True)
class DriveSpec:
    """One virtio block device. Order in :attr:`MachineSpec.drives` is guest order
    (the first is ``/dev/vda``)."""

    drive_id: str
    path: Path
    read_only: bool = False
    fmt: Literal["raw", "qcow2"] = "raw"


@dataclass(frozen=True)
class NetSpec:
    """A tap device the VMM attaches to. ``netns`` names the network namespace the VMM
    process must be started in (the tap lives there); ``None`` means the host's."""

    tap: str
    mac: str
    netns: str | None = None


@dataclass(frozen=True)
class MachineSpec:
    """Everything needed to start (or restore) a machine.

    ``memory_file`` backs guest RAM. With ``memory_shared`` the VMM maps it shared, so the
    file *is* the guest's RAM and a snapshot needs only device state; without it the file
    is mapped privately (copy-on-write), which is how many sandboxes share one template
    image without touching it.

    ``report_free_pages`` (a boot's; a restore gets what its snapshot was made with): the
    guest hands the pages it frees back to the host, which drops them from
    ``memory_file`` (punches holes in it), so it needs ``memory_shared``: a file mapped
    privately is others' RAM too.
    """

    vcpus: int
    memory_mib: int
    kernel: Path
    cmdline: str
    drives: tuple[DriveSpec, ...]
    memory_file: Path
    memory_shared: bool
    accel: Literal["tcg", "kvm"]
    initrd: Path | None = None
    net: NetSpec | None = None
    report_free_pages: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready values: a VMM's record of what it runs, read back by
        :meth:`from_dict` when a restarted server re-attaches to it."""
        return {
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "kernel": str(self.kernel),
            "cmdline": self.cmdline,
            "drives": [
                {
                    "drive_id": d.drive_id,
                    "path": str(d.path),
                    "read_only": d.read_only,
                    "fmt": d.fmt,
                }
                for d in self.drives
            ],
            "memory_file": str(self.memory_file),
            "memory_shared": self.memory_shared,
            "accel": self.accel,
            "initrd": str(self.initrd) if self.initrd else None,
            "net": (
                {"tap": self.net.tap, "mac": self.net.mac, "netns": self.net.netns}
                if self.net
                else None
            ),
            "report_free_pages": self.report_free_pages,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MachineSpec:
        net = data.get("net")
        return cls(
            vcpus=data["vcpus"],
            memory_mib=data["memory_mib"],
            kernel=Path(data["kernel"]),
            cmdline=data["cmdline"],
            drives=tuple(
                DriveSpec(
                    drive_id=d["drive_id"],
                    path=Path(d["path"]),
                    read_only=d["read_only"],
                    fmt=d["fmt"],
                )
                for d in data["drives"]
            ),
            memory_file=Path(data["memory_file"]),
            memory_shared=data["memory_shared"],
            accel=data["accel"],
            initrd=Path(data["initrd"]) if data.get("initrd") else None,
            net=NetSpec(tap=net["tap"], mac=net["mac"], netns=net.get("netns")) if net else None,
            report_free_pages=bool(data.get("report_free_pages", False)),
        )

    def shape(self) -> dict[str, Any]:
        """The parts of the spec a snapshot's device state depends on."""
        return {
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "drives": [d.drive_id for d in self.drives],
            "net": self.net is not None,
            "accel": self.accel,
        }


@dataclass(frozen=True)
class SnapshotFiles:
    """What :meth:`VirtualMachine.save_state` wrote.

    ``state_file`` holds device (and, if ``memory_file`` is None, RAM) state.
    ``memory_file`` is the RAM image when RAM lives outside the state stream.
    """

    driver: str
    accel: str
    state_file: Path
    memory_file: Path | None
    shape: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        data["state_file"] = str(self.state_file)
        data["memory_file"] = str(self.memory_file) if self.memory_file else None
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SnapshotFiles:
        data = json.loads(text)
        return cls(
            driver=data["driver"],
            accel=data["accel"],
            state_file=Path(data["state_file"]),
            memory_file=Path(data["memory_file"]) if data.get("memory_file") else None,
            shape=data["shape"],
            meta=data.get("meta", {}),
        )

    def check_compatible(self, driver: str, spec: MachineSpec) -> None:
        """Raise :class:`SnapshotIncompatible` unless ``spec`` under ``driver`` can
        restore this snapshot."""
        if driver != self.driver:
            raise SnapshotIncompatible(f"snapshot was made by {self.driver}, not {driver}")
        if spec.accel != self.accel:
            raise SnapshotIncompatible(
                f"snapshot was made under accel={self.accel}, cannot restore with {spec.accel}"
            )
        if spec.shape() != self.shape:
            raise SnapshotIncompatible(
                f"machine shape {spec.shape()} differs from snapshot's {self.shape}"
            )


@dataclass(frozen=True)
class VMMExit:
    """How a VMM process ended, as far as this server can tell: its exit status (the
    ``Popen`` convention: negative for the signal that killed it) when it was this
    server's child, else None (a process adopted from a previous server cannot be
    waited for), the tail of its logs (VMM output and guest console), and why the VMM
    said it stopped when it said so (QEMU's ``SHUTDOWN`` event: ``guest-reset``,
    ``guest-shutdown``, ``guest-panic``, ``host-signal``...). A guest that resets exits
    its VMM with status 0 (``-no-reboot``), as a clean shutdown does; only the reason
    tells a triple fault or reboot from a power-off."""

    pid: int
    returncode: int | None
    log_tail: str
    reason: str | None = None

    def describe(self) -> str:
        if self.returncode is None:
            said = f"pid {self.pid} exited (status unknown: started by a previous server)"
        elif self.returncode < 0:
            number = -self.returncode
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = "unknown signal"
            said = f"pid {self.pid} was killed by signal {number} ({name})"
        else:
            said = f"pid {self.pid} exited with status {self.returncode}"
        if self.reason is None:
            return said
        return f"{said} ({_EXIT_REASONS.get(self.reason, 'the VMM said')}: {self.reason})"


# What a VMM's stated reason means to whoever reads the warning.
_EXIT_REASONS = {
    "guest-reset": "the guest reset: a reboot it asked for, or a triple fault",
    "guest-shutdown": "the guest powered off",
    "guest-panic": "the guest kernel panicked",
    "host-signal": "a signal on the host stopped it",
}


@dataclass(frozen=True)
class VMStats:
    pid: int
    state: VMRunState
    rss_bytes: int
    pss_bytes: int
    cpu_seconds: float


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU time of ``pid`` (all its threads) from ``/proc/PID/stat``;
    OSError once it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # After the parenthesised command name, utime and stime are fields 14 and 15.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_memory(pid: int) -> tuple[int, int]:
    """RSS and PSS of ``pid`` in bytes from ``/proc/PID/smaps_rollup`` (a walk of its
    memory map); OSError once it is gone."""
    sizes: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            sizes[key] = int(rest.split()[0]) * 1024
    return sizes.get("Rss", 0), sizes.get("Pss", 0)


def thread_wakeups(pid: int) -> dict[str, int]:
    """Voluntary context switches so far of each of ``pid``'s threads (by thread id): how
    often each went to sleep and was woken. Threads that end meanwhile are left out;
    empty once the process is gone."""
    counts: dict[str, int] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return counts
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that just ended
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                counts[task.name] = int(line.split()[1])
    return counts


@dataclass(frozen=True)
class GuestMemory:
    """The guest kernel's memory figures as its balloon driver last reported them:
    ``MemTotal``, ``MemAvailable`` and the page cache, in bytes."""

    total_bytes: int
    available_bytes: int
    cached_bytes: int


class VirtualMachine(ABC):
    """A handle on one VMM process. Methods are safe to call from one asyncio task at a
    time; the orchestrator serialises per sandbox."""

    workdir: Path
    spec: MachineSpec
    #: Set by the driver that restored it: the name the working set of the snapshot RAM
    #: file it started from has (:mod:`agentenv.vmm.working_set`), None if it has none.
    working_set_key: str | None = None

    @property
    @abstractmethod
    def pid(self) -> int: ...

    @property
    @abstractmethod
    def state(self) -> VMRunState: ...

    @abstractmethod
    async def pause(self) -> None:
        """Stop the vCPUs in place (memory kept)."""

    @abstractmethod
    async def resume(self) -> None:
        """Continue after :meth:`pause` or a restore made with ``resume=False``."""

    async def resume_if_paused(self) -> None:
        """:meth:`resume` a machine known to be paused; nothing otherwise. A rollback's
        resume: a hung VMM's own rollback has sent its ``cont`` already, and a command
        to it would only wait out its timeout."""
        if self.state is VMRunState.PAUSED:
            await self.resume()

    @abstractmethod
    async def save_state(self, dest: Path) -> SnapshotFiles:
        """Pause if running and write a snapshot into directory ``dest``. The VM stays
        paused; the caller decides whether to resume, stop or kill it. On failure nothing
        half-written is left in ``dest`` and the VM is as it was before."""

    async def seal_drive(self, drive_id: str, sealed: Path, new_top: Path) -> None:
        """Freeze drive ``drive_id`` as it is now: its current image becomes read-only
        and is also reachable as ``sealed``; writes go on into a new copy-on-write image
        ``new_top`` over it. Constant time, whatever the disk holds. The VM should be
        paused, so the frozen image matches a state saved at the same moment. On failure
        the drive is as it was."""
        raise VMMCommandError(f"{type(self).__name__} cannot seal drives")

    @abstractmethod
    async def stop(self, timeout: float = 5.0) -> None:
        """Ask the VMM to quit, and kill it if it has not after ``timeout`` seconds."""

    @abstractmethod
    async def kill(self) -> None:
        """SIGKILL the VMM process and reap it. Idempotent."""

    @abstractmethod
    async def stats(self) -> VMStats: ...

    def cpu_seconds(self) -> float:
        """CPU time the VMM process has used (every thread), from ``/proc`` alone: cheaper
        than :meth:`stats`, which also walks the process's memory map. Raises
        :class:`VMMGone` once the process is gone."""
        try:
            return process_cpu_seconds(self.pid)
        except OSError as exc:
            raise VMMGone(f"VMM process {self.pid} has exited") from exc

    async def guest_memory(self, report_every_s: float) -> GuestMemory | None:
        """The guest's memory figures from its balloon driver, which is asked to report
        every ``report_every_s`` seconds: the guest kernel answers by itself, so no guest
        program wakes. None where the VMM has no balloon statistics, or until the guest
        has reported since the reports started or became more frequent (an idle guest's
        reports may be seldom; the VMM asks it for one at once); :class:`VMMError` if the
        VMM cannot be asked."""
        return None

    async def disk_writes(self) -> int | None:
        """Write and discard requests the guest has made to its drives so far, as this VMM
        process counts them; None where the VMM does not count them. Unchanged counts
        mean the guest's filesystems are as they were, without asking the guest."""
        return None

    @abstractmethod
    async def wait_exit(self) -> VMMExit:
        """Wait until the VMM process has exited, whatever the cause (a :meth:`kill` of
        this handle included), and say how. Returns at once if it already has; never
        returns after :meth:`close` (the process is no longer watched): cancel it."""

    @abstractmethod
    async def close(self) -> None:
        """Drop the control connection without touching the process (used when the
        server shuts down but VMs should outlive it)."""


class VMMDriver(ABC):
    """Starts VMM processes of one kind.

    What a driver can and cannot do is stated by the capability attributes below, so
    callers decide on those rather than on :attr:`name`, which identifies the driver (in
    snapshots, logs and ``/health``) and nothing more."""

    name: str
    #: Disk image formats the VMM opens; other drivers get raw copies (reflinked where
    #: the filesystem can).
    disk_formats: tuple[str, ...] = ("raw", "qcow2")
    #: Whether a booted machine's RAM can live in ``MachineSpec.memory_file`` (shared), so
    #: that saving it writes device state only.
    shared_memory_boot: bool = True
    #: Accelerators (``MachineSpec.accel``) the VMM runs guests under.
    accelerators: tuple[Literal["tcg", "kvm"], ...] = ("tcg", "kvm")
    #: How a running machine's disk is captured into a snapshot (:class:`DiskCapture`);
    #: :attr:`DiskCapture.SEAL` needs :meth:`VirtualMachine.seal_drive`.
    disk_capture: DiskCapture = DiskCapture.NONE
    #: Whether the files a pause writes (:meth:`VirtualMachine.save_state` output and the
    #: sandbox's disk) can be committed to the snapshot repository, so a paused sandbox
    #: can be resumed on another node.
    publishes_paused_state: bool = False

    @abstractmethod
    async def boot(self, spec: MachineSpec, workdir: Path) -> VirtualMachine:
        """Cold-boot ``spec``; ``workdir`` holds sockets and logs. Returns once the VMM
        accepts control commands and the guest is started."""

    @abstractmethod
    async def restore(
        self,
        spec: MachineSpec,
        snapshot: SnapshotFiles,
        workdir: Path,
        *,
        resume: bool = True,
    ) -> VirtualMachine:
        """Start a new VMM process from ``snapshot`` (checked with
        :meth:`SnapshotFiles.check_compatible` first). The spec's drives and memory file
        may differ in path from the snapshotted machine's, not in shape."""

    async def record_working_set(
        self, vm: VirtualMachine, snapshot_memory: Path | None = None
    ) -> int:
        """Record the part of ``vm``'s RAM file in the host's page cache (what its guest
        touched) as the working set of ``snapshot_memory`` (a RAM image just captured
        from ``vm``), or by default of the snapshot RAM file ``vm`` was restored from,
        for later restores to read ahead (once per file; :mod:`agentenv.vmm.working_set`).
        Returns the bytes recorded, 0 if nothing was (a VMM without it, a record that
        exists, a machine that was booted)."""
        return 0

    def needs_own_memory(self, snapshot: SnapshotFiles) -> bool:
        """Whether a machine restored from ``snapshot`` must map RAM from a file of its
        own (``memory_shared``) rather than privately from a file others map too: its
        guest gives freed pages back (``MachineSpec.report_free_pages``), which takes
        them out of the file."""
        return False

    #: How the VMM's processes are recognised without a record (see :meth:`kill_strays`):
    #: the start of the executable's file name.
    executables: tuple[str, ...] = ()

    async def kill_strays(self, workdir: Path) -> list[int]:
        """Kill whatever VMM process still runs from ``workdir`` although :meth:`attach`
        cannot take it (its record not yet written, its launch chain not done, its
        control socket unreachable), and wait until it has gone: for a directory about to
        be removed or a sandbox being kept without its VMM. Returns the pids killed."""
        # Imported here: the process module builds on this one.
        from agentenv.vmm.process import kill_processes, processes_naming

        if not self.executables:
            return []
        pids = processes_naming(self.stray_markers(workdir.resolve()), self.executables)
        await kill_processes(pids)
        return pids

    def stray_markers(self, workdir: Path) -> tuple[str, ...]:
        """Arguments by which a VMM process started for ``workdir`` is recognised: the
        directory itself, or paths in it, unless the driver says otherwise."""
        return (str(workdir),)

    @abstractmethod
    async def attach(self, workdir: Path) -> VirtualMachine:
        """Re-adopt a VMM process a previous server left running in ``workdir``; raises
        :class:`VMMGone` if it is not there."""
