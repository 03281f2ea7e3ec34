"""A handle on one running QEMU (:class:`QemuVM`) and what it shares with the driver
(:mod:`agentenv.vmm.qemu`): the files of a VM's work directory, where its QMP socket
lives, QMP commands with a time limit, file descriptors passed over QMP, and waiting for a
migration stream to finish. Starting, restoring and re-adopting QEMU is the driver's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qemu.qmp import EventListener, ExecuteError, QMPError

from agentenv.vmm.base import (
    DriveSpec,
    GuestMemory,
    MachineSpec,
    SnapshotFiles,
    SnapshotIncompatible,
    VirtualMachine,
    VMMCommandError,
    VMMError,
    VMMExit,
    VMMGone,
    VMMUnresponsive,
    VMRunState,
    VMStats,
    process_cpu_seconds,
    process_memory,
)
from agentenv.vmm.confine import ConfinementError, VmmJail
from agentenv.vmm.console import bound_console
from agentenv.vmm.process import VMMProcess

#: How long an exit's report waits for QEMU's SHUTDOWN event (read from the QMP socket,
#: which may lag the pidfd's word that the process is gone).
SHUTDOWN_EVENT_WAIT_S = 1.0
# How long a rollback waits for each of its commands once the VMM has stopped answering.
# They are queued in order all the same and run when it answers again, so waiting the
# full command timeout for each would only make the caller's error later.
UNRESPONSIVE_ROLLBACK_WAIT_S = 1.0
#: The driver's name, recorded in snapshots it takes.
DRIVER_NAME = "qemu"
CONSOLE_LOG = "console.log"
PROCESS_LOG = "qemu.log"
QMP_SOCKET = "qmp.sock"
PID_FILE = "qemu.pid"
VM_RECORD = "vm.json"
STATE_FILE = "state.mig"

MACHINE_TYPE = "microvm"
#: The ``-M`` options new machines get. ``pit=off``: QEMU keeps a reset i8254 counting in
#: square-wave mode and wakes its main loop at every edge (36 times a second), and the
#: guest kernel (6.1) never stops a PIT it did not use; without the device an idle VMM's
#: main loop went from ~70 to ~25 wakeups a second. The guest needs no PIT: the TSC's
#: rate comes from ``tsc_early_khz`` and the LAPIC timer does the ticks.
MACHINE = f"{MACHINE_TYPE},pit=off"
#: What machines had before: snapshots made then record it (or nothing), and must be
#: restored into the same device set.
LEGACY_MACHINE = MACHINE_TYPE
KNOWN_MACHINES = (MACHINE, LEGACY_MACHINE)
#: The balloon of a machine whose guest gives freed pages back
#: (``MachineSpec.report_free_pages``): with ``free-page-reporting`` the guest kernel
#: (CONFIG_PAGE_REPORTING, virtio_balloon loaded by the initramfs) reports free 2 MiB
#: blocks a couple of seconds after they are freed, and QEMU discards them: a hole
#: punched in the RAM file (page cache and disk blocks gone) and the mapping dropped.
#: QEMU 7.2 punches that hole whatever the mapping, so a privately mapped file (a
#: template's or fork image's, other machines' RAM too) must never be behind it.
BALLOON = "virtio-balloon-device,free-page-reporting=on"
#: The balloon without it: machines whose RAM is a private mapping, and every machine
#: before. The feature is in the migration stream: a snapshot restores into the balloon
#: it was made with.
LEGACY_BALLOON = "virtio-balloon-device"
KNOWN_BALLOONS = (BALLOON, LEGACY_BALLOON)
# Effectively unthrottled: the default migration bandwidth cap slows a local save to a
# crawl (reference §9.5).
_MIGRATE_MAX_BANDWIDTH = 100 * 1024**3
_MIGRATE_DOWNTIME_LIMIT_MS = 100_000

LOG_TAIL_BYTES = 3000
# What an unexpected exit logs of each file: the last lines say why, without flooding
# the server's log.
EXIT_LOG_TAIL_BYTES = 1200


def tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def logs_tail(workdir: Path, limit: int = LOG_TAIL_BYTES) -> str:
    parts = []
    for name in (PROCESS_LOG, CONSOLE_LOG):
        text = tail(workdir / name, limit).strip()
        if text:
            parts.append(f"--- {name} (tail) ---\n{text}")
    return "\n".join(parts) if parts else "(no output)"


# sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107
SHORT_SOCKET_DIR = Path("/run/agentenv")


def qmp_socket_path(workdir: Path, *, own_directory: bool = False) -> Path:
    """Where a VM's QMP socket lives: in its work directory, unless that path is too long
    for a Unix socket; then under /run with a name derived from the work directory (so
    the driver's ``attach`` finds it again). With ``own_directory`` (a confined VMM,
    which cannot create files in the root-only /run directory) that is a directory of its
    own there, holding the socket."""
    path = workdir / QMP_SOCKET
    if len(str(path).encode()) <= _MAX_SOCKET_PATH:
        return path
    SHORT_SOCKET_DIR.mkdir(mode=0o700, exist_ok=True)
    digest = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:24]
    if own_directory:
        return SHORT_SOCKET_DIR / f"qmp-{digest}" / QMP_SOCKET
    return SHORT_SOCKET_DIR / f"qmp-{digest}.sock"


def remove_socket(socket_path: Path) -> None:
    """Remove a QMP socket kept outside the work directory (the work directory goes with
    the sandbox; a socket outside it must too)."""
    if socket_path.parent == SHORT_SOCKET_DIR:
        socket_path.unlink(missing_ok=True)
    elif socket_path.parent.parent == SHORT_SOCKET_DIR:
        shutil.rmtree(socket_path.parent, ignore_errors=True)


@dataclass(frozen=True)
class QemuLaunch:
    """What the driver's launch hands back: a started process with QMP up."""

    process: VMMProcess
    qmp: Any  # qemu.qmp.QMPClient (untyped library)
    socket_path: Path
    jail: VmmJail | None = None
    #: The ``-M`` options the process runs with.
    machine: str = MACHINE
    #: Its balloon device's options.
    balloon: str = LEGACY_BALLOON


def machine_of_snapshot(meta: dict[str, Any]) -> str:
    """The ``-M`` options a snapshot must be restored with: what it recorded (snapshots
    from before :data:`MACHINE` recorded the bare machine type, or nothing at all)."""
    machine = meta.get("machine", LEGACY_MACHINE)
    if machine not in KNOWN_MACHINES:
        raise SnapshotIncompatible(
            f"snapshot was made on machine {machine!r}; this node runs {KNOWN_MACHINES}"
        )
    return str(machine)


def balloon_of_snapshot(meta: dict[str, Any]) -> str:
    """The balloon device a snapshot must be restored with (snapshots from before
    :data:`BALLOON` recorded none)."""
    balloon = meta.get("balloon", LEGACY_BALLOON)
    if balloon not in KNOWN_BALLOONS:
        raise SnapshotIncompatible(
            f"snapshot was made with balloon {balloon!r}; this node runs {KNOWN_BALLOONS}"
        )
    return str(balloon)


def reports_free_pages(balloon: str) -> bool:
    return balloon == BALLOON


def balloon_of_argv(argv: list[str]) -> str:
    """The balloon device of a recorded command line (for a re-attached QEMU)."""
    devices = (argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-device")
    return next((d for d in devices if d.split(",")[0] == "virtio-balloon-device"), LEGACY_BALLOON)


def machine_of_argv(argv: list[str]) -> str:
    """The ``-M`` options of a recorded command line (for a re-attached QEMU)."""
    value = argv[argv.index("-M") + 1] if "-M" in argv[:-1] else LEGACY_MACHINE
    return ",".join(opt for opt in value.split(",") if not opt.startswith("memory-backend="))


class QemuVM(VirtualMachine):
    """A handle on one QEMU process."""

    def __init__(
        self,
        *,
        spec: MachineSpec,
        workdir: Path,
        process: VMMProcess,
        qmp: Any,
        state: VMRunState,
        command_timeout: float,
        migration_timeout: float,
        socket_path: Path,
        jail: VmmJail | None = None,
        console_limit: int | None = None,
        machine: str = MACHINE,
        balloon: str = LEGACY_BALLOON,
    ) -> None:
        self.spec = spec
        #: The ``-M`` options this QEMU runs with; its snapshots need the same.
        self.machine = machine
        #: Its balloon device's options; its snapshots need the same.
        self.balloon = balloon
        self._balloon_path: str | None = None
        self._stats_every_s: int | None = None
        # When the balloon's reports last started or became more frequent (wall-clock
        # seconds, as QEMU stamps a report): earlier figures are not given out.
        self._reports_since = 0
        self.workdir = workdir
        self._process = process
        self._qmp = qmp
        self._state = state
        self._command_timeout = command_timeout
        self._migration_timeout = migration_timeout
        self._socket_path = socket_path
        self._jail = jail
        self._closed = False
        # QEMU says why it stops before it exits (SHUTDOWN's reason): what tells a guest
        # reset (a triple fault; -no-reboot makes it an exit with status 0) from a
        # power-off or a signal, where the guest's console says nothing.
        self._shutdowns = EventListener("SHUTDOWN")
        qmp.register_listener(self._shutdowns)
        self._console_task: asyncio.Task[None] | None = None
        if console_limit is not None:
            self._console_task = asyncio.get_running_loop().create_task(
                bound_console((workdir / CONSOLE_LOG, workdir / PROCESS_LOG), console_limit)
            )

    def __repr__(self) -> str:
        return f"<QemuVM pid={self.pid} state={self.state} workdir={self.workdir}>"

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def state(self) -> VMRunState:
        if not self._process.alive():
            return VMRunState.STOPPED
        return self._state

    @property
    def console_log(self) -> Path:
        return self.workdir / CONSOLE_LOG

    # -- control -------------------------------------------------------------------------

    async def execute(
        self,
        command: str,
        arguments: Mapping[str, object] | None = None,
        *,
        limit_s: float | None = None,
    ) -> Any:
        """Run one QMP command, translating failures into :class:`VMMError` subclasses;
        ``limit_s`` bounds the wait for its answer (default: the command timeout)."""
        limit = self._command_timeout if limit_s is None else limit_s
        return await execute_qmp(self._qmp, self._process, command, arguments, limit)

    async def pause(self) -> None:
        await self.execute("stop")
        self._state = VMRunState.PAUSED

    async def resume(self) -> None:
        await self.execute("cont")
        self._state = VMRunState.RUNNING

    async def save_state(self, dest: Path) -> SnapshotFiles:
        """Write ``dest/state.mig``; the VM is left paused.

        With shared RAM the snapshot is ``state.mig`` plus :attr:`MachineSpec.memory_file`,
        which is still this VM's live RAM: copy (or reflink) it before resuming if the
        snapshot must outlive the VM's next run. With private RAM, the RAM is streamed
        into ``state.mig`` and ``memory_file`` is None.
        """
        if not self._process.alive():
            raise VMMGone(f"QEMU process {self.pid} has exited")
        final, partial = _state_paths(dest)
        was_running = self._state is VMRunState.RUNNING
        ram_in_file = self.spec.memory_shared
        stop_sent = migrate_sent = False
        try:
            version = await self.execute("query-version")
            await self.execute(
                "migrate-set-capabilities",
                {"capabilities": [{"capability": "x-ignore-shared", "state": ram_in_file}]},
            )
            await self.execute(
                "migrate-set-parameters",
                {
                    "max-bandwidth": _MIGRATE_MAX_BANDWIDTH,
                    "downtime-limit": _MIGRATE_DOWNTIME_LIMIT_MS,
                },
            )
            if was_running:
                stop_sent = True
                await self.pause()
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                await pass_fd(self._qmp, self._process, fd, "agentenv-save", self._command_timeout)
            finally:
                os.close(fd)
            migrate_sent = True
            await self.execute("migrate", {"uri": "fd:agentenv-save"})
            await await_migration(
                self._qmp, self._process, self._migration_timeout, self._command_timeout
            )
            os.replace(partial, final)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            if self._process.alive():
                await self._roll_back_save(
                    migrate_sent, stop_sent, unresponsive=isinstance(exc, VMMUnresponsive)
                )
            if isinstance(exc, VMMError) or not isinstance(exc, Exception):
                raise
            raise VMMCommandError(f"save_state failed: {exc}") from exc
        qemu = version["qemu"]
        return SnapshotFiles(
            driver=DRIVER_NAME,
            accel=self.spec.accel,
            state_file=final,
            memory_file=self.spec.memory_file if ram_in_file else None,
            shape=self.spec.shape(),
            meta={
                "qemu_version": f"{qemu['major']}.{qemu['minor']}.{qemu['micro']}",
                "qemu_package": version.get("package", ""),
                "machine": self.machine,
                "balloon": self.balloon,
            },
        )

    async def seal_drive(self, drive_id: str, sealed: Path, new_top: Path) -> None:
        """A hard link names the current top image ``sealed``; ``new_top`` is created with
        that name as its backing file and put on top of the running drive
        (``blockdev-add`` + ``blockdev-snapshot``, which leave the header as written). So
        the frozen image lives on under ``sealed`` when the sandbox's directory goes, and
        the new top never refers to a name that could disappear."""
        drive = next((d for d in self.spec.drives if d.drive_id == drive_id), None)
        if drive is None or drive.fmt != "qcow2" or drive.read_only:
            raise VMMCommandError(f"drive {drive_id!r} is not a writable qcow2 drive")
        blocks = await self.execute("query-block")
        info = next((b for b in blocks if b.get("device") == drive_id), None)
        if info is None or "inserted" not in info:
            raise VMMCommandError(f"QEMU has no drive {drive_id!r}")
        current_node = info["inserted"]["node-name"]
        size = int(info["inserted"]["image"]["virtual-size"])
        new_node = f"{drive_id}-{secrets.token_hex(4)}"
        added = False
        try:
            os.link(drive.path, sealed)
            await _run_tool(
                "qemu-img", "create", "-q", "-f", "qcow2", "-u",
                "-b", str(sealed), "-F", "qcow2", str(new_top), str(size),
            )  # fmt: skip
            if self._jail is not None:
                # QEMU opens the new top by name, in its jail and as its own uid.
                self._jail.admit(new_top, writable=True)
            await self.execute(
                "blockdev-add",
                {
                    "driver": "qcow2",
                    "node-name": new_node,
                    "file": {"driver": "file", "filename": str(new_top)},
                    "backing": None,
                },
            )
            added = True
            await self.execute("blockdev-snapshot", {"node": current_node, "overlay": new_node})
        except BaseException as exc:
            if added:
                with contextlib.suppress(VMMError):
                    await self.execute("blockdev-del", {"node-name": new_node})
            if isinstance(exc, ConfinementError):
                exc = VMMCommandError(str(exc))
            for path in (new_top, sealed):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            if isinstance(exc, VMMError) or not isinstance(exc, Exception):
                raise
            raise VMMCommandError(f"sealing drive {drive_id} failed: {exc}") from exc
        drives = tuple(
            DriveSpec(d.drive_id, new_top, d.read_only, d.fmt) if d.drive_id == drive_id else d
            for d in self.spec.drives
        )
        self.spec = replace(self.spec, drives=drives)
        _update_record_spec(self.workdir, self.spec)

    async def stop(self, timeout: float = 5.0) -> None:
        if self._process.alive():
            with contextlib.suppress(VMMError):
                await self.execute("quit")
            if not await self._process.wait(timeout):
                await self._process.kill()
        await self._disconnect()
        await self._release_confinement()

    async def kill(self) -> None:
        await self._process.kill()
        await self._disconnect()
        remove_socket(self._socket_path)
        await self._release_confinement()

    async def _release_confinement(self) -> None:
        """Once the process is gone: its jail tree and cgroup go too."""
        if self._jail is not None and not self._process.alive():
            await asyncio.to_thread(self._jail.cleanup)

    async def stats(self) -> VMStats:
        pid = self.pid
        if not self._process.alive():
            raise VMMGone(f"QEMU process {pid} has exited")
        try:
            rss, pss = process_memory(pid)
            cpu_seconds = process_cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise VMMGone(f"QEMU process {pid} has exited") from exc
        return VMStats(
            pid=pid, state=self.state, rss_bytes=rss, pss_bytes=pss, cpu_seconds=cpu_seconds
        )

    async def guest_memory(self, report_every_s: float) -> GuestMemory | None:
        if self._balloon_path is None:
            self._balloon_path = await self._find_balloon()
            if self._balloon_path is None:
                return None
        every = max(1, round(report_every_s))
        if self._stats_every_s != every:
            # Not part of the migrated state: every process (a restore is a new one) is
            # asked once. QEMU asks the guest at once only when it makes its timer (from
            # interval 0), else at the new interval from now.
            if self._stats_every_s is None or every < self._stats_every_s:
                if self._stats_every_s:
                    await self._set_stats_interval(0)
                self._reports_since = int(time.time())
            await self._set_stats_interval(every)
            self._stats_every_s = every
        reply = await self.execute(
            "qom-get", {"path": self._balloon_path, "property": "guest-stats"}
        )
        if not isinstance(reply, dict):
            return None
        stats = reply.get("stats", {})
        if int(reply.get("last-update") or 0) < max(1, self._reports_since):
            return None  # the guest has not reported (since the reports became sooner)
        total = int(stats.get("stat-total-memory", -1))
        available = int(stats.get("stat-available-memory", -1))
        if total <= 0 or available < 0:
            return None  # a guest driver too old to report MemAvailable
        return GuestMemory(
            total_bytes=total,
            available_bytes=available,
            cached_bytes=max(0, int(stats.get("stat-disk-caches", 0))),
        )

    async def _set_stats_interval(self, seconds: int) -> None:
        await self.execute(
            "qom-set",
            {
                "path": self._balloon_path,
                "property": "guest-stats-polling-interval",
                "value": seconds,
            },
        )

    async def _roll_back_save(
        self, migrate_sent: bool, stop_sent: bool, unresponsive: bool
    ) -> None:
        """Undo what a failed :meth:`save_state` sent: the migration, then the stop (sent
        even when its answer never came, since QEMU may run it later)."""
        limit = UNRESPONSIVE_ROLLBACK_WAIT_S if unresponsive else None
        if migrate_sent:
            with contextlib.suppress(VMMError):
                await self.execute("migrate_cancel", limit_s=limit)
        if stop_sent:
            with contextlib.suppress(VMMError):
                await self.execute("cont", limit_s=limit)
                self._state = VMRunState.RUNNING

    async def disk_writes(self) -> int | None:
        writes = 0
        for device in await self.execute("query-blockstats"):
            stats = device.get("stats", {})
            writes += int(stats.get("wr_operations", 0)) + int(stats.get("unmap_operations", 0))
        return writes

    async def _find_balloon(self) -> str | None:
        """The QOM path of the balloon device (added without an id: build_argv)."""
        parent = "/machine/peripheral-anon"
        for child in await self.execute("qom-list", {"path": parent}):
            if child.get("type") == "child<virtio-balloon-device>":
                return f"{parent}/{child['name']}"
        return None

    async def wait_exit(self) -> VMMExit:
        returncode = await self._process.exited()
        tail = await asyncio.to_thread(logs_tail, self.workdir, EXIT_LOG_TAIL_BYTES)
        return VMMExit(self.pid, returncode, tail, await self._shutdown_reason(returncode))

    async def _shutdown_reason(self, returncode: int | None) -> str | None:
        """The reason of QEMU's last SHUTDOWN event. A QEMU that exited by itself sent
        it before exiting, but the pidfd may say so before the event is read: it is
        waited for a moment. None after a SIGKILL (QEMU says nothing then)."""
        if (returncode is not None and returncode < 0) or self._closed:
            return None
        if not self._shutdowns.history:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._shutdowns.get(), SHUTDOWN_EVENT_WAIT_S)
        if not self._shutdowns.history:
            return None
        data = self._shutdowns.history[-1].get("data", {})
        reason = data.get("reason") if isinstance(data, dict) else None
        return str(reason) if reason else None

    async def close(self) -> None:
        await self._disconnect()
        self._process.detach()

    async def _disconnect(self) -> None:
        if self._console_task is not None:
            self._console_task.cancel()
            self._console_task = None
        if self._closed:
            return
        self._closed = True
        # disconnect() re-raises whatever ended the session (EOF after quit or kill).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._qmp.disconnect(), 2.0)


async def _run_tool(*argv: str) -> None:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        raise VMMCommandError(f"cannot run {argv[0]}: {exc}") from exc
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise VMMCommandError(f"{argv[0]} failed: {err.decode(errors='replace').strip()}")


def _update_record_spec(workdir: Path, spec: MachineSpec) -> None:
    """Record a changed spec (a drive's new top image) for the driver's ``attach`` and
    later restores; the process and its argv are unchanged."""
    path = workdir / VM_RECORD
    record = json.loads(path.read_text())
    record["spec"] = spec.to_dict()
    tmp = workdir / f".{VM_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)


def _state_paths(dest: Path) -> tuple[Path, Path]:
    """Create ``dest`` and name the snapshot's final and in-progress state files."""
    dest.mkdir(parents=True, exist_ok=True)
    return dest / STATE_FILE, dest / f".{STATE_FILE}.{secrets.token_hex(4)}.partial"


async def execute_qmp(
    qmp: Any,
    process: VMMProcess,
    command: str,
    arguments: Mapping[str, object] | None,
    limit_s: float,
) -> Any:
    if not process.alive():
        raise VMMGone(f"QEMU process {process.pid} has exited")
    try:
        return await asyncio.wait_for(qmp.execute(command, arguments), limit_s)
    except ExecuteError as exc:
        raise VMMCommandError(f"QMP {command} failed: {exc}") from exc
    except TimeoutError as exc:
        raise VMMUnresponsive(f"QMP {command} got no answer within {limit_s}s") from exc
    except (QMPError, OSError, EOFError) as exc:
        # A broken connection usually means the process died: give its exit a moment to
        # be noticed so callers get VMMGone rather than a generic error.
        await process.wait(0.2)
        if not process.alive():
            raise VMMGone(f"QEMU process {process.pid} exited during {command}") from exc
        raise VMMCommandError(f"QMP {command} failed: {exc!r}") from exc


async def pass_fd(qmp: Any, process: VMMProcess, fd: int, name: str, limit_s: float) -> None:
    """Hand ``fd`` to QEMU under ``name`` (SCM_RIGHTS, then ``getfd``)."""
    if not process.alive():
        raise VMMGone(f"QEMU process {process.pid} has exited")
    try:
        qmp.send_fd_scm(fd)
    except (QMPError, OSError) as exc:
        raise VMMCommandError(f"passing a file descriptor to QEMU failed: {exc!r}") from exc
    await execute_qmp(qmp, process, "getfd", {"fdname": name}, limit_s)


async def await_migration(
    qmp: Any, process: VMMProcess, limit_s: float, command_limit_s: float
) -> None:
    """Poll ``query-migrate`` until the migration completes (or fails)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + limit_s
    interval = 0.001
    while True:
        info = await execute_qmp(qmp, process, "query-migrate", None, command_limit_s)
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            detail = info.get("error-desc", "no error description")
            raise VMMCommandError(f"migration {status}: {detail}")
        if loop.time() > deadline:
            raise VMMCommandError(f"migration did not complete within {limit_s}s ({status})")
        await asyncio.sleep(interval)
        # Device-state loads take a few ms: poll finely at first, then back off for
        # the long RAM streams.
        if loop.time() - started > 0.03:
            interval = min(interval * 2, 0.05)
