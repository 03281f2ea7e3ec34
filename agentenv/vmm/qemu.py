"""QEMU ``-M microvm`` driver, controlled over QMP.

Guest RAM always lives in a ``memory-backend-file`` (``spec.memory_file``). Mapped shared,
the file *is* guest RAM and a snapshot is only device state (migration capability
``x-ignore-shared``, tens of KiB, milliseconds). Mapped private, the file is a
copy-on-write base that the guest never modifies, which is how many restored sandboxes
share one template's RAM; such a machine's snapshot streams its RAM into the state file.
A machine booted with ``spec.report_free_pages`` has a balloon with free page reporting,
which QEMU 7.2 serves by punching the reported pages out of the file, whatever the
mapping: its snapshots (which record the balloon, as they record the ``-M`` options) are
restored only into a shared mapping (see :mod:`agentenv.vmm.qemu_vm`). It does the same
for a page the guest's balloon driver inflates over, so a QEMU that maps its RAM file
privately (another sandbox's too) is started with hole punching denied by a seccomp
filter (``agentenv-launch --deny-punch-hole``), confined or not.

Migration streams go through file descriptors passed over the QMP socket (``getfd`` +
``fd:``) rather than ``exec:cat``: QEMU 7.2 SIGTERMs the ``exec:`` helper as soon as the
stream is closed, without waiting for it to finish writing, so ``exec:cat > file`` can
leave a truncated snapshot behind while reporting success.

Each VMM runs in its own session, with everything needed to find it again (pid, argv,
spec) in ``<workdir>/vm.json``, so a restarted server can :meth:`QemuDriver.attach` to it.

With a :class:`~agentenv.vmm.confine.Confinement` every QEMU runs as its own uid, in its
own cgroup and jail (see :mod:`agentenv.vmm.confine`), under QEMU's seccomp filter
(``-sandbox``; nothing here needs QEMU to spawn a process). The guest console goes to
``console.log`` opened for appending, which a task of the VM's handle keeps within a
byte bound by cutting its oldest part (``FALLOC_FL_COLLAPSE_RANGE``), so a guest
flooding its serial port cannot fill the host's disk, and the file the server reads on a
failed boot stays where it was. QEMU's own output (``qemu.log``) is bounded the same way:
a guest can fill it too, through errors QEMU reports on its behalf.

This module starts, restores and re-adopts QEMU; the handle on a running one, and the
QMP plumbing both use, are in :mod:`agentenv.vmm.qemu_vm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from qemu.qmp import ConnectError, QMPClient

from agentenv.vmm.base import (
    DiskCapture,
    MachineSpec,
    SnapshotFiles,
    SnapshotIncompatible,
    VirtualMachine,
    VMMCommandError,
    VMMDriver,
    VMMError,
    VMMGone,
    VMMStartError,
    VMRunState,
)
from agentenv.vmm.confine import Confinement, ConfinementError, VmmJail
from agentenv.vmm.console import CONSOLE_LIMIT_BYTES
from agentenv.vmm.launch import LaunchSpec, launch
from agentenv.vmm.process import VMMProcess, launched_cmdline
from agentenv.vmm.qemu_vm import (
    BALLOON,
    CONSOLE_LOG,
    DRIVER_NAME,
    LEGACY_BALLOON,
    MACHINE,
    PID_FILE,
    PROCESS_LOG,
    SHORT_SOCKET_DIR,
    VM_RECORD,
    QemuLaunch,
    QemuVM,
    await_migration,
    balloon_of_argv,
    balloon_of_snapshot,
    execute_qmp,
    logs_tail,
    machine_of_argv,
    machine_of_snapshot,
    pass_fd,
    qmp_socket_path,
    reports_free_pages,
)
from agentenv.vmm.working_set import Extents, WorkingSets, read_ahead

log = logging.getLogger("agentenv.vmm")

_QEMU_ID = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")

#: QEMU's seccomp filter for confined VMMs.
SANDBOX_OPTION = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def _opt_path(path: Path) -> str:
    """A path as a QEMU option value (commas are the option separator; ``,,`` escapes)."""
    return str(path).replace(",", ",,")


def _check_spec(spec: MachineSpec) -> None:
    """Reject specs QEMU would fail on late and obscurely, or that could inject options."""
    if spec.vcpus < 1:
        raise VMMStartError(f"vcpus must be at least 1, got {spec.vcpus}")
    if spec.memory_mib < 16:
        raise VMMStartError(f"memory_mib must be at least 16, got {spec.memory_mib}")
    if not spec.kernel.is_file():
        raise VMMStartError(f"kernel {spec.kernel} does not exist")
    if spec.initrd is not None and not spec.initrd.is_file():
        raise VMMStartError(f"initrd {spec.initrd} does not exist")
    if not spec.memory_file.parent.is_dir():
        raise VMMStartError(f"directory of memory file {spec.memory_file} does not exist")
    seen: set[str] = set()
    for drive in spec.drives:
        if not _QEMU_ID.match(drive.drive_id):
            raise VMMStartError(f"drive id {drive.drive_id!r} is not a valid QEMU id")
        if drive.drive_id in seen:
            raise VMMStartError(f"drive id {drive.drive_id!r} is used twice")
        seen.add(drive.drive_id)
        if not drive.path.exists():
            raise VMMStartError(f"drive {drive.drive_id}: {drive.path} does not exist")
    if spec.net is not None:
        if not _IFNAME.match(spec.net.tap):
            raise VMMStartError(f"tap name {spec.net.tap!r} is not a valid interface name")
        if not _MAC.match(spec.net.mac):
            raise VMMStartError(f"MAC address {spec.net.mac!r} is malformed")
        if spec.net.netns is not None and not Path("/run/netns", spec.net.netns).exists():
            raise VMMStartError(f"network namespace {spec.net.netns!r} does not exist")


def _prepare_workdir(spec: MachineSpec, workdir: Path) -> None:
    _check_spec(spec)
    workdir.mkdir(parents=True, exist_ok=True)
    # The console is opened for appending (see console.bound_file): start each run empty, as
    # before, when QEMU truncated it.
    for path in (
        qmp_socket_path(workdir),
        workdir / PID_FILE,
        workdir / VM_RECORD,
        workdir / CONSOLE_LOG,
    ):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class QemuDriver(VMMDriver):
    """Starts ``qemu-system-x86_64 -M microvm`` processes."""

    name = DRIVER_NAME
    executables = ("qemu-system",)
    accelerators = ("tcg", "kvm")
    disk_capture = DiskCapture.SEAL
    publishes_paused_state = True

    def __init__(
        self,
        qemu_binary: str = "qemu-system-x86_64",
        tb_size_mib: int = 48,
        *,
        connect_timeout: float = 10.0,
        command_timeout: float = 30.0,
        migration_timeout: float = 300.0,
        confinement: Confinement | None = None,
        console_limit: int | None = CONSOLE_LIMIT_BYTES,
        ram_advice: Path | None = None,
        working_sets: WorkingSets | None = None,
    ) -> None:
        self.qemu_binary = qemu_binary
        #: ``agentenv-ram-advice.so``, preloaded into every QEMU (see ``ram_advice.c``);
        #: None leaves QEMU's huge-page advice on guest RAM.
        self.ram_advice = ram_advice
        #: Where the working sets of snapshot RAM files are kept; None: no read-ahead.
        self.working_sets = working_sets
        self.tb_size_mib = tb_size_mib
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.migration_timeout = migration_timeout
        self.confinement = confinement
        self.console_limit = console_limit
        self._host_prepared = False

    def _socket_path(self, workdir: Path) -> Path:
        return qmp_socket_path(workdir, own_directory=self.confinement is not None)

    # -- command line ----------------------------------------------------------------------

    def build_argv(
        self,
        spec: MachineSpec,
        workdir: Path,
        *,
        incoming: bool = False,
        machine: str = MACHINE,
        balloon: str | None = None,
    ) -> list[str]:
        """The QEMU command line for ``spec``. Boot and restore differ only in the trailing
        ``-S -incoming defer``: migration needs an identical device set on both ends, so a
        restore passes the ``machine`` options and ``balloon`` device its snapshot was
        made with (a boot's balloon follows ``spec.report_free_pages``)."""
        if balloon is None:
            balloon = BALLOON if spec.report_free_pages else LEGACY_BALLOON
        mem = f"{spec.memory_mib}M"
        share = "on" if spec.memory_shared else "off"
        argv = [
            self.qemu_binary,
            "-M", f"{machine},memory-backend=mem0",
        ]  # fmt: skip
        if spec.accel == "kvm":
            # arch-capabilities: PVM's /dev/kvm rejects MSR 0x10a (reference §9.8).
            argv += ["-accel", "kvm", "-cpu", "host,-arch-capabilities"]
        else:
            # The translation cache is TCG's alone; see Config.tcg_tb_size_mib.
            argv += ["-accel", f"tcg,tb-size={self.tb_size_mib}", "-cpu", "max"]
        argv += [
            "-smp", str(spec.vcpus),
            "-m", mem,
            "-object",
            f"memory-backend-file,id=mem0,size={mem},mem-path={_opt_path(spec.memory_file)},"
            f"share={share}",
            "-nodefaults", "-no-user-config", "-display", "none",
            # Threads named for what they run ("CPU 0/TCG", "worker"), so a VMM that
            # wakes too often can be traced to the thread doing it.
            "-name", "debug-threads=on",
            # The guest asks for a reboot on panic; -no-reboot turns that into an exit,
            # so a crashed sandbox is seen as dead instead of silently rebooting.
            "-no-reboot",
            "-kernel", str(spec.kernel),
        ]  # fmt: skip
        if spec.initrd is not None:
            argv += ["-initrd", str(spec.initrd)]
        argv += ["-append", spec.cmdline]
        for drive in spec.drives:
            opts = f"id={drive.drive_id},file={_opt_path(drive.path)},format={drive.fmt},if=none"
            if drive.read_only:
                opts += ",readonly=on"
            else:
                # Blocks the guest frees (fstrim, discard mounts) and zeroes it writes
                # are given back to the host file instead of staying allocated.
                opts += ",discard=unmap,detect-zeroes=unmap"
            argv += ["-drive", opts, "-device", f"virtio-blk-device,drive={drive.drive_id}"]
        if spec.net is not None:
            argv += [
                "-netdev", f"tap,id=n0,ifname={spec.net.tap},script=no,downscript=no",
                "-device", f"virtio-net-device,netdev=n0,mac={spec.net.mac}",
            ]  # fmt: skip
        argv += [
            "-device", balloon,
            "-chardev", f"file,id=console,path={_opt_path(workdir / CONSOLE_LOG)},append=on",
            "-serial", "chardev:console",
            "-qmp", f"unix:{_opt_path(self._socket_path(workdir))},server=on,wait=off",
            "-pidfile", str(workdir / PID_FILE),
        ]  # fmt: skip
        if self.confinement is not None:
            argv += ["-sandbox", SANDBOX_OPTION]
        if incoming:
            # -S keeps the guest paused after the incoming migration whatever run state
            # the source recorded; restore() decides whether to continue.
            argv += ["-S", "-incoming", "defer"]
        return argv

    # -- lifecycle ---------------------------------------------------------------------------

    def needs_own_memory(self, snapshot: SnapshotFiles) -> bool:
        try:
            return reports_free_pages(balloon_of_snapshot(snapshot.meta))
        except SnapshotIncompatible:
            return False  # restore() says why

    async def boot(self, spec: MachineSpec, workdir: Path) -> QemuVM:
        if spec.report_free_pages and not spec.memory_shared:
            raise VMMStartError(
                "report_free_pages needs memory_shared: QEMU would punch the freed pages "
                f"out of {spec.memory_file}, which a private mapping shares with others"
            )
        launch = await self._launch(spec, workdir, incoming=False)
        return self._handle(spec, workdir, launch, VMRunState.RUNNING)

    async def restore(
        self,
        spec: MachineSpec,
        snapshot: SnapshotFiles,
        workdir: Path,
        *,
        resume: bool = True,
    ) -> QemuVM:
        snapshot.check_compatible(self.name, spec)
        if not snapshot.state_file.is_file():
            raise SnapshotIncompatible(f"state file {snapshot.state_file} does not exist")
        if snapshot.memory_file is not None:
            # RAM is not in the stream: the spec's memory file must hold it.
            size = spec.memory_file.stat().st_size if spec.memory_file.exists() else 0
            if size < spec.memory_mib * 1024 * 1024:
                raise SnapshotIncompatible(
                    f"memory file {spec.memory_file} ({size} bytes) cannot hold the "
                    f"snapshot's {spec.memory_mib} MiB of RAM"
                )
        machine = machine_of_snapshot(snapshot.meta)
        balloon = balloon_of_snapshot(snapshot.meta)
        if reports_free_pages(balloon) and not spec.memory_shared:
            raise SnapshotIncompatible(
                "the snapshot's guest reports free pages, which QEMU punches out of the "
                f"RAM file: it cannot map {spec.memory_file} privately (others map it too)"
            )
        key: str | None = None
        if self.working_sets is not None and snapshot.memory_file is not None:
            # Looked up before the machine can change its file; the reads are asked for
            # while QEMU starts, and nothing waits for them (working_set.py).
            source_key = self.working_sets.key(snapshot.memory_file)
            extents = self.working_sets.extents(source_key) if source_key else None
            if extents:
                _read_ahead_in_background(spec.memory_file, extents)
            # A machine that maps its source shared (a resumed sandbox's own RAM file)
            # changes that file as it runs: what it touches describes no snapshot.
            if not (spec.memory_shared and spec.memory_file == snapshot.memory_file):
                key = source_key
        launch = await self._launch(spec, workdir, incoming=True, machine=machine, balloon=balloon)
        process, qmp = launch.process, launch.qmp
        timeout = self.command_timeout
        try:
            await execute_qmp(
                qmp,
                process,
                "migrate-set-capabilities",
                {
                    "capabilities": [
                        {"capability": "x-ignore-shared", "state": snapshot.memory_file is not None}
                    ]
                },
                timeout,
            )
            fd = os.open(snapshot.state_file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                await pass_fd(qmp, process, fd, "agentenv-restore", timeout)
            finally:
                os.close(fd)
            await execute_qmp(
                qmp, process, "migrate-incoming", {"uri": "fd:agentenv-restore"}, timeout
            )
            await await_migration(qmp, process, self.migration_timeout, timeout)
            if resume:
                await execute_qmp(qmp, process, "cont", None, timeout)
        except BaseException as exc:
            await self._abandon(process, qmp)
            if launch.jail is not None:
                await asyncio.to_thread(launch.jail.cleanup)
            if not isinstance(exc, Exception):
                raise
            raise VMMStartError(
                f"restoring {snapshot.state_file} failed: {exc}\n{logs_tail(workdir)}"
            ) from exc
        state = VMRunState.RUNNING if resume else VMRunState.PAUSED
        vm = self._handle(spec, workdir, launch, state)
        vm.working_set_key = key
        return vm

    async def record_working_set(
        self, vm: VirtualMachine, snapshot_memory: Path | None = None
    ) -> int:
        sets = self.working_sets
        if sets is None:
            return 0
        key = vm.working_set_key if snapshot_memory is None else sets.key(snapshot_memory)
        if key is None or sets.has(key):
            return 0
        return await asyncio.to_thread(sets.record, key, vm.spec.memory_file)

    async def attach(self, workdir: Path) -> QemuVM:
        try:
            record = json.loads((workdir / VM_RECORD).read_text())
            pid = int(record["pid"])
            argv = list(record["argv"])
            spec = MachineSpec.from_dict(record["spec"])
            socket_path = Path(record.get("qmp_socket") or qmp_socket_path(workdir))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise VMMGone(f"no usable {VM_RECORD} in {workdir}: {exc}") from exc
        # A process still in its launch chain after all that time is left to the caller:
        # every caller kills what it cannot attach (VMMDriver.kill_strays).
        if await launched_cmdline(pid, argv, self.connect_timeout) != argv:
            raise VMMGone(f"process {pid} from {workdir} is gone (or is no longer our QEMU)")
        try:
            process = VMMProcess.adopt(pid)
        except ProcessLookupError as exc:
            raise VMMGone(f"process {pid} from {workdir} is gone") from exc
        try:
            qmp = await self._connect_qmp(process, socket_path)
        except VMMStartError as exc:
            gone = not process.alive()
            process.detach()
            if gone:
                raise VMMGone(str(exc)) from exc
            # Alive but unreachable (perhaps another server holds the monitor): leave it
            # alone rather than kill a VM someone else may be managing.
            raise VMMCommandError(f"cannot reach QMP of process {pid}: {exc}") from exc
        try:
            status = await execute_qmp(qmp, process, "query-status", None, self.command_timeout)
        except VMMError:
            process.detach()
            with contextlib.suppress(Exception):
                await qmp.disconnect()
            raise
        state = VMRunState.RUNNING if status.get("running") else VMRunState.PAUSED
        jail = self.confinement.jail_for(spec, workdir) if self.confinement else None
        if jail is not None:
            try:
                await asyncio.to_thread(jail.ensure_in_cgroup, pid, spec)
            except ConfinementError as exc:
                process.detach()
                with contextlib.suppress(Exception):
                    await qmp.disconnect()
                raise VMMCommandError(f"cannot confine adopted QEMU {pid}: {exc}") from exc
        launch = QemuLaunch(
            process=process,
            qmp=qmp,
            socket_path=socket_path,
            jail=jail,
            machine=machine_of_argv(argv),
            balloon=balloon_of_argv(argv),
        )
        return self._handle(spec, workdir, launch, state)

    # -- internals ---------------------------------------------------------------------------

    def _environment(self) -> dict[str, str] | None:
        """QEMU's environment: the server's, with the RAM advice library preloaded."""
        if self.ram_advice is None:
            return None
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(filter(None, (str(self.ram_advice), env.get("LD_PRELOAD"))))
        return env

    def _handle(
        self, spec: MachineSpec, workdir: Path, launch: QemuLaunch, state: VMRunState
    ) -> QemuVM:
        return QemuVM(
            spec=spec,
            workdir=workdir,
            process=launch.process,
            qmp=launch.qmp,
            state=state,
            command_timeout=self.command_timeout,
            migration_timeout=self.migration_timeout,
            socket_path=launch.socket_path,
            jail=launch.jail,
            console_limit=self.console_limit,
            machine=launch.machine,
            balloon=launch.balloon,
        )

    async def _launch(
        self,
        spec: MachineSpec,
        workdir: Path,
        *,
        incoming: bool,
        machine: str = MACHINE,
        balloon: str | None = None,
    ) -> QemuLaunch:
        _prepare_workdir(spec, workdir)
        qemu_argv = self.build_argv(
            spec, workdir, incoming=incoming, machine=machine, balloon=balloon
        )
        socket_path = self._socket_path(workdir)
        launch_spec = LaunchSpec(
            argv=tuple(qemu_argv),
            cwd=workdir,
            stdout=workdir / PROCESS_LOG,
            stderr=workdir / PROCESS_LOG,
            append_output=True,
            netns=spec.net.netns if spec.net is not None else None,
            # A RAM file mapped privately is another VMM's too (a template, a fork
            # image): QEMU 7.2 would punch the pages the guest's balloon hands back out
            # of it. Confined or not, that is another sandbox's memory.
            deny_hole_punching=not spec.memory_shared,
            env=self._environment(),
        )
        jail: VmmJail | None = None
        # An incoming VMM (-S -incoming defer) runs no guest code until the restore's
        # `cont`, so it joins its cgroups while it starts, from here, instead of before
        # exec: each cgroup move waits for an RCU grace period in the kernel, 10 to 20 ms
        # that would otherwise come before QEMU even starts (measured: resume +55 ms).
        # Booting VMMs run their guest at once and join before exec.
        join_later: tuple[Path, ...] = ()
        if self.confinement is not None:
            jail = self.confinement.jail_for(spec, workdir)
            try:
                launch_spec, cgroups = self._confine(launch_spec, spec, jail, socket_path)
                if incoming:
                    join_later = cgroups
                    launch_spec = replace(launch_spec, cgroup=None, more_cgroups=())
            except ConfinementError as exc:
                jail.cleanup(0)
                raise VMMStartError(f"cannot confine QEMU: {exc}") from exc
        try:
            process = launch(launch_spec)
        except BaseException:
            if jail is not None:
                jail.cleanup(0)
            raise
        joining: asyncio.Future[None] | None = None
        try:
            if jail is not None and join_later:
                joining = asyncio.ensure_future(
                    asyncio.to_thread(jail.join_cgroup, process.pid, join_later)
                )
            self._write_record(workdir, process.pid, qemu_argv, spec, socket_path)
            qmp = await self._connect_qmp(process, socket_path)
            if joining is not None:
                await joining
        except BaseException as exc:
            if joining is not None:
                with contextlib.suppress(BaseException):
                    await joining
            await self._abandon(process, None)
            if jail is not None:
                await asyncio.to_thread(jail.cleanup)
            if not isinstance(exc, Exception):
                raise
            raise VMMStartError(f"QEMU did not come up: {exc}\n{logs_tail(workdir)}") from exc
        return QemuLaunch(
            process=process,
            qmp=qmp,
            socket_path=socket_path,
            jail=jail,
            machine=machine,
            balloon=balloon_of_argv(qemu_argv),
        )

    def _confine(
        self, launch_spec: LaunchSpec, spec: MachineSpec, jail: VmmJail, socket_path: Path
    ) -> tuple[LaunchSpec, tuple[Path, ...]]:
        """``launch_spec`` with the VMM's uid, cgroups, OOM bias and jail, after giving it
        the files it opens; and the VMM's cgroup directories."""
        confinement = jail.confinement
        if not self._host_prepared:
            confinement.prepare_host()
            self._host_prepared = True
        jail.build(spec)
        if socket_path.parent != launch_spec.cwd:
            socket_path.parent.mkdir(mode=0o700, exist_ok=True)
            os.chown(socket_path.parent, jail.uid, confinement.gid)
            SHORT_SOCKET_DIR.chmod(0o711)
        cgroups = jail.create_cgroup(spec)
        confined = replace(
            launch_spec,
            credentials=confinement.credentials(spec),
            cgroup=cgroups[0],
            more_cgroups=cgroups[1:],
            oom_score_adj=confinement.oom_score_adj,
            jail=jail.jail,
        )
        return confined, cgroups

    @staticmethod
    def _write_record(
        workdir: Path, pid: int, argv: list[str], spec: MachineSpec, socket_path: Path
    ) -> None:
        record = {
            "driver": QemuDriver.name,
            "pid": pid,
            "argv": argv,
            "qmp_socket": str(socket_path),
            "spec": spec.to_dict(),
        }
        tmp = workdir / f".{VM_RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, workdir / VM_RECORD)

    async def _connect_qmp(self, process: VMMProcess, socket_path: Path) -> Any:
        """Connect once the socket appears (25 to 50 ms after start on an idle host)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        last_error: Exception | None = None
        while True:
            if not process.alive():
                raise VMMStartError(f"QEMU exited (status {process.returncode}) before QMP")
            # Only try once QEMU has created the socket: every failed connect is logged
            # as an error by qemu.qmp.
            if socket_path.exists():
                qmp = QMPClient(f"agentenv-{process.pid}")
                try:
                    # One attempt may take the rest of the deadline: a QMP monitor serves
                    # one client at a time, so an attempt given up on mid-negotiation
                    # (QEMU's main loop slow on a loaded host) leaves QEMU answering it
                    # on the next connection, whose own negotiation then fails.
                    remaining = max(deadline - loop.time(), 2.0)
                    await asyncio.wait_for(qmp.connect(str(socket_path)), remaining)
                    return qmp
                except (ConnectError, TimeoutError, OSError) as exc:
                    last_error = exc
                    with contextlib.suppress(Exception):
                        await qmp.disconnect()
            if loop.time() > deadline:
                raise VMMStartError(
                    f"QMP socket {socket_path} not usable within {self.connect_timeout}s"
                    + (f": {last_error}" if last_error else "")
                )
            await asyncio.sleep(0.001)

    @staticmethod
    async def _abandon(process: VMMProcess, qmp: Any) -> None:
        """Roll back a start that failed part-way: nothing may be left running."""
        await process.kill()
        if qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(qmp.disconnect(), 2.0)


#: Read-aheads being asked for, kept until done (a task nobody holds may be collected).
_READING_AHEAD: set[asyncio.Future[int]] = set()


def _read_ahead_in_background(ram_file: Path, extents: Extents) -> None:
    """Ask for ``extents`` of ``ram_file`` from a thread; a failure costs speed only."""
    reading = asyncio.ensure_future(asyncio.to_thread(read_ahead, ram_file, extents))
    _READING_AHEAD.add(reading)

    def done(task: asyncio.Future[int]) -> None:
        _READING_AHEAD.discard(task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            log.warning("reading ahead the working set of %s failed: %s", ram_file, failure)

    reading.add_done_callback(done)
