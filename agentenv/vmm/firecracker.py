"""Firecracker driver: one ``firecracker`` process per machine, driven over its HTTP API
on a Unix socket.

Things about Firecracker (v1.12) that shape this driver:

- It runs only on KVM; there is no software emulation, so ``accel="tcg"`` is refused.
- Guest RAM is anonymous memory on boot, so ``MachineSpec.memory_file`` is not used: a
  snapshot writes a full RAM image (``memory.fc``) and a restore maps that image
  copy-on-write (``MAP_PRIVATE``), i.e. ``memory_shared=False`` semantics. A boot with
  ``memory_shared=True`` cannot be honoured and is refused; a restore asked for it (the
  orchestrator's resume of a paused sandbox's own RAM image) maps the image privately all
  the same: the guest's writes never reach that file, and the next save writes a new one.
- Drives must be raw files; a qcow2 disk needs a raw view (e.g. a reflink copy) first.
  Without backing files a running drive cannot be sealed under a new top image, so a
  snapshot of a running machine copies the drive while it is paused
  (``DiskCapture.COPY``): ``/snapshot/create`` flushes every block device to its file
  before it returns.
- A snapshot records each drive's ``path_on_host`` and the tap name exactly as they were
  given, and the recorded drive paths must exist when the snapshot is loaded. So the driver
  never hands Firecracker a real drive path: Firecracker runs with ``cwd=workdir`` and its
  drives are the relative symlinks ``drives/<drive_id>``, pointing at the spec's files. A
  restore in another workdir recreates the links to the restoring spec's files, and the
  snapshot loads them. The tap is replaced on load with ``network_overrides`` (present in
  1.12). The guest MAC is guest state and stays the snapshotted one.
- With a :class:`~agentenv.vmm.confine.Confinement` (and the release's ``jailer``) every
  Firecracker runs under the jailer: its own uid, cgroup and chroot, Firecracker's seccomp
  filters (see :mod:`agentenv.vmm.firecracker_jail`). Inside the chroot its paths are
  fixed (``/boot/vmlinux``, ``/drives/<id>``, ...) and its cwd is the chroot's root, so the
  relative drive paths a snapshot records load the same in both modes.
- The guest console (Firecracker's stdout) is appended to ``console.log``, which a task of
  the VM's handle keeps within a byte bound (:mod:`agentenv.vmm.console`).
- On x86_64 Firecracker describes its virtio-mmio devices both on the kernel command line
  (``virtio_mmio.device=``) and in ACPI (DSDT ``LNRO0005`` devices), so a kernel built
  without ``VIRTIO_MMIO_CMDLINE_DEVICES`` (Debian's cloud kernel) still finds them, as long
  as ACPI stays enabled and ``virtio_mmio`` is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import httpx

from agentenv.vmm import firecracker_jail as jail_paths
from agentenv.vmm.base import (
    DiskCapture,
    MachineSpec,
    SnapshotFiles,
    VirtualMachine,
    VMMCommandError,
    VMMDriver,
    VMMError,
    VMMExit,
    VMMGone,
    VMMStartError,
    VMRunState,
    VMStats,
    process_cpu_seconds,
    process_memory,
)
from agentenv.vmm.confine import Confinement, ConfinementError
from agentenv.vmm.console import CONSOLE_LIMIT_BYTES, bound_console
from agentenv.vmm.firecracker_api import API_TIMEOUT_S, FirecrackerAPI
from agentenv.vmm.firecracker_binary import find_firecracker
from agentenv.vmm.firecracker_jail import FirecrackerJail, FirecrackerJailError
from agentenv.vmm.firecracker_memory import DiffBase, seed_diff_target
from agentenv.vmm.launch import LaunchSpec, launch
from agentenv.vmm.process import VMMProcess, read_cmdline

__all__ = ["FirecrackerAPI", "FirecrackerDriver", "FirecrackerVM", "find_firecracker"]

log = logging.getLogger("agentenv.vmm")

API_SOCKET = "fc.sock"
LOG_FILE = "fc.log"
STDERR_FILE = "fc.stderr"
CONSOLE_FILE = "console.log"
VM_RECORD = "vm.json"
DRIVES_DIR = "drives"
STATE_FILE = "state.fc"
MEMORY_FILE = "memory.fc"
NET_IFACE_ID = "eth0"

# Kernel parameters a Firecracker guest needs unless the caller chose otherwise: there is
# no PCI bus to probe (devices are virtio-mmio), the only reset Firecracker emulates is the
# keyboard controller's (after which it exits), and a panicking guest should reset rather
# than hang.
FIRECRACKER_BOOT_ARGS: Final = (("pci", "off"), ("reboot", "k"), ("panic", "1"))

BALLOON_STATS_INTERVAL_S = 5
START_TIMEOUT_S = 10.0
# Writing or mapping the RAM image scales with guest memory and disk speed.
SNAPSHOT_TIMEOUT_S = 600.0

_DRIVE_ID = re.compile(r"^[A-Za-z0-9_]+$")
_INSTANCE_ID_BAD = re.compile(r"[^A-Za-z0-9-]")
_FIRECRACKER_STATES = {"Running": VMRunState.RUNNING, "Paused": VMRunState.PAUSED}


# --- Plain helpers (blocking file work kept out of coroutines) --------------------------


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace").strip()


def _log_tail(workdir: Path) -> str:
    parts = [
        f"{name}: {text}" for name in (STDERR_FILE, LOG_FILE) if (text := _tail(workdir / name))
    ]
    return "\n".join(parts) or "(no log output)"


def _exit_log_tail(workdir: Path) -> str:
    """What an unexpected exit logs: the VMM's own output and the guest console's end."""
    console = _tail(workdir / CONSOLE_FILE, 1200)
    return _log_tail(workdir) + (f"\n{CONSOLE_FILE}: {console}" if console else "")


def _boot_args(cmdline: str) -> str:
    """``cmdline`` plus the parameters Firecracker needs, unless the caller set them."""
    present = {word.split("=", 1)[0] for word in cmdline.split()}
    extra = [f"{key}={value}" for key, value in FIRECRACKER_BOOT_ARGS if key not in present]
    return " ".join([cmdline.strip(), *extra]).strip()


def _instance_id(workdir: Path) -> str:
    # Firecracker accepts alphanumerics and hyphens, at most 64 characters.
    name = _INSTANCE_ID_BAD.sub("-", workdir.name).strip("-")[:64]
    return name or "agentenv-vm"


def _validate_spec(spec: MachineSpec, *, restoring: bool = False) -> None:
    """Refuse (with :class:`VMMStartError`) specs Firecracker cannot run, before any
    process is started. ``memory_shared`` only matters to a boot: a restore's RAM is the
    snapshot's image, always mapped copy-on-write."""
    if spec.accel not in FirecrackerDriver.accelerators:
        raise VMMStartError(
            f"Firecracker runs only on KVM, not accel={spec.accel!r}: it has no software "
            "emulation. Use the QEMU driver for TCG."
        )
    if not Path("/dev/kvm").exists():
        raise VMMStartError("Firecracker needs /dev/kvm, which this host does not have")
    if spec.memory_shared and not restoring:
        raise VMMStartError(
            "Firecracker cannot back guest RAM with a shared file (memory_shared=True): it "
            "keeps RAM anonymous on boot and maps a snapshot's RAM image copy-on-write"
        )
    if spec.vcpus < 1 or spec.memory_mib < 1:
        raise VMMStartError(
            f"need at least 1 vCPU and 1 MiB of RAM, got {spec.vcpus}/{spec.memory_mib}"
        )
    for drive in spec.drives:
        if not _DRIVE_ID.match(drive.drive_id):
            raise VMMStartError(
                f"drive id {drive.drive_id!r} is not valid for Firecracker "
                "(letters, digits and underscores only)"
            )
        if drive.fmt != "raw":
            raise VMMStartError(
                f"drive {drive.drive_id!r} is {drive.fmt}; Firecracker reads only raw images, "
                "so give it a raw view of the disk (e.g. a raw or reflinked copy)"
            )
        if not drive.path.is_file():
            raise VMMStartError(f"drive {drive.drive_id!r}: {drive.path} is not a file")
    if len({d.drive_id for d in spec.drives}) != len(spec.drives):
        raise VMMStartError("drive ids must be unique")
    if not spec.kernel.is_file():
        raise VMMStartError(f"kernel {spec.kernel} is not a file")
    if spec.initrd is not None and not spec.initrd.is_file():
        raise VMMStartError(f"initrd {spec.initrd} is not a file")
    if spec.net is not None and spec.net.netns is not None:
        if not Path("/run/netns", spec.net.netns).exists():
            raise VMMStartError(f"network namespace {spec.net.netns!r} does not exist")


def _validate_snapshot(snapshot: SnapshotFiles) -> tuple[Path, Path]:
    if snapshot.memory_file is None or not snapshot.memory_file.is_file():
        raise VMMStartError(f"snapshot RAM image {snapshot.memory_file} is missing")
    if not snapshot.state_file.is_file():
        raise VMMStartError(f"snapshot state file {snapshot.state_file} is missing")
    return snapshot.state_file.resolve(), snapshot.memory_file.resolve()


def _prepare_workdir(spec: MachineSpec, workdir: Path) -> Path:
    """Create ``workdir`` with an empty log (Firecracker refuses a missing ``--log-path``),
    no stale socket or record, and ``drives/<id>`` links to the spec's drives."""
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / API_SOCKET).unlink(missing_ok=True)
    (workdir / VM_RECORD).unlink(missing_ok=True)
    (workdir / LOG_FILE).write_bytes(b"")
    # Console and stderr are opened for appending (see agentenv.vmm.console): start empty.
    (workdir / CONSOLE_FILE).unlink(missing_ok=True)
    (workdir / STDERR_FILE).unlink(missing_ok=True)
    drives_dir = workdir / DRIVES_DIR
    drives_dir.mkdir(exist_ok=True)
    for drive in spec.drives:
        tmp = drives_dir / f".{drive.drive_id}.{uuid.uuid4().hex[:8]}"
        tmp.symlink_to(drive.path.resolve())
        os.replace(tmp, drives_dir / drive.drive_id)
    return workdir


def _read_stats(pid: int) -> tuple[int, int, float]:
    """RSS, PSS (bytes) and CPU seconds of ``pid``."""
    try:
        rss, pss = process_memory(pid)
        return rss, pss, process_cpu_seconds(pid)
    except OSError as exc:
        raise VMMGone(f"firecracker pid {pid} is gone") from exc


def _make_dir(path: Path) -> Path:
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _read_record(workdir: Path) -> tuple[Path, dict[str, Any]]:
    """``workdir`` made absolute, and the record :meth:`FirecrackerVM.write_record` left."""
    workdir = workdir.resolve()
    try:
        record: dict[str, Any] = json.loads((workdir / VM_RECORD).read_text())
        int(record["pid"]), str(record["api_socket"]), dict(record["shape"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VMMGone(f"no Firecracker process recorded in {workdir}: {exc}") from exc
    return workdir, record


# --- Machine handle -----------------------------------------------------------------------


class FirecrackerVM(VirtualMachine):
    """A handle on one Firecracker process, started by this server or adopted."""

    def __init__(
        self,
        *,
        workdir: Path,
        spec: MachineSpec,
        process: VMMProcess,
        api: FirecrackerAPI,
        shape: dict[str, Any],
        tap: str | None,
        state: VMRunState,
        jail: FirecrackerJail | None = None,
        console_limit: int | None = None,
        diff_base: DiffBase | None = None,
    ) -> None:
        self.workdir = workdir
        # The orchestrator reads every VM's spec (VirtualMachine.spec), e.g. to flush
        # shared RAM files; Firecracker's RAM is never a shared file, but the spec must
        # be there, also on a handle adopted after a server restart.
        self.spec = spec
        self._process = process
        self._api = api
        self._shape = shape
        self._tap = tap
        self._state = state
        self._jail = jail
        # The RAM image the guest's dirty pages are counted from (firecracker_memory).
        self._diff_base = diff_base
        # After close() the process is no longer watched; this handle must not touch it.
        self._closed = False
        self._console_task: asyncio.Task[None] | None = None
        if console_limit is not None:
            self._console_task = asyncio.get_running_loop().create_task(
                bound_console((workdir / CONSOLE_FILE,), console_limit)
            )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def state(self) -> VMRunState:
        # A closed handle keeps its last known state: the process is no longer watched.
        if not self._closed and not self._process.alive():
            self._state = VMRunState.STOPPED
        return self._state

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        read_timeout: float = API_TIMEOUT_S,
    ) -> dict[str, Any]:
        """One API request; a dead process is reported as :class:`VMMGone`."""
        if self._closed:
            raise VMMGone(f"handle on firecracker pid {self.pid} was closed")
        if not self._process.alive():
            raise VMMGone(f"firecracker pid {self.pid} has exited\n{_log_tail(self.workdir)}")
        try:
            return await self._api.request(method, path, body, read_timeout=read_timeout)
        except httpx.TransportError as exc:
            # Give the exit notification a moment to arrive before judging.
            if await self._process.wait(0.05):
                raise VMMGone(
                    f"firecracker pid {self.pid} exited during {method} {path}\n"
                    f"{_log_tail(self.workdir)}"
                ) from exc
            raise VMMCommandError(f"{method} {path}: {exc!r}") from exc

    async def describe(self) -> dict[str, Any]:
        """Firecracker's instance info: ``id``, ``state``, ``vmm_version``."""
        return await self.call("GET", "/")

    async def pause(self) -> None:
        await self.call("PATCH", "/vm", {"state": "Paused"})
        self._state = VMRunState.PAUSED

    async def resume(self) -> None:
        await self.call("PATCH", "/vm", {"state": "Resumed"})
        self._state = VMRunState.RUNNING

    async def save_state(self, dest: Path) -> SnapshotFiles:
        dest = _make_dir(dest)
        was_running = self.state is VMRunState.RUNNING
        if was_running:
            await self.pause()
        token = uuid.uuid4().hex[:8]
        tmp_state = dest / f".{STATE_FILE}.{token}.tmp"
        tmp_memory = dest / f".{MEMORY_FILE}.{token}.tmp"
        state_file, memory_file = dest / STATE_FILE, dest / MEMORY_FILE
        # Where Firecracker writes them: in its chroot when jailed, moved out afterwards.
        written = {tmp_state: str(tmp_state), tmp_memory: str(tmp_memory)}
        if self._jail is not None:
            out = jail_paths.SNAPSHOT_OUT_IN_JAIL
            written = {tmp: f"{out}/{tmp.name}" for tmp in written}
        produced = [self._jail.host(inside) for inside in written.values()] if self._jail else []
        leftovers = [tmp_state, tmp_memory, *produced]
        base, self._diff_base = self._diff_base, None  # until this snapshot has succeeded
        try:
            version = (await self.call("GET", "/version")).get("firecracker_version", "")
            memory_target = produced[1] if self._jail else tmp_memory
            kind = "Diff" if await self._seed_diff(base, memory_target) else "Full"
            await self.call(
                "PUT",
                "/snapshot/create",
                {
                    "snapshot_type": kind,
                    "snapshot_path": written[tmp_state],
                    "mem_file_path": written[tmp_memory],
                },
                read_timeout=SNAPSHOT_TIMEOUT_S,
            )
            if self._jail is not None:
                for tmp, made in zip(written, produced, strict=True):
                    await asyncio.to_thread(self._jail.export, made, tmp)
            os.replace(tmp_memory, memory_file)
            # From here an older state file next to the new RAM image would be a mismatch.
            leftovers += [memory_file, state_file]
            os.replace(tmp_state, state_file)
            self._diff_base = DiffBase.of(memory_file)
        except BaseException as exc:
            _remove(leftovers)
            self._record_quietly()
            if was_running and self._process.alive():
                with contextlib.suppress(VMMError):
                    await self.resume()
            if isinstance(exc, FirecrackerJailError):
                raise VMMCommandError(f"snapshot/create: {exc}") from exc
            raise
        self._record_quietly()
        return SnapshotFiles(
            driver=FirecrackerDriver.name,
            accel="kvm",
            state_file=state_file,
            memory_file=memory_file,
            shape=dict(self._shape),
            meta={"firecracker_version": version, "tap": self._tap},
        )

    async def _seed_diff(self, base: DiffBase | None, target: Path) -> bool:
        """Whether a diff snapshot can be written to ``target``: ``base`` is still the
        image the dirty pages are counted from, and ``target`` was made a reflink of it."""
        if base is None or not base.usable(self.spec.memory_mib << 20):
            return False
        owner = self._jail.owner(self.spec) if self._jail is not None else None
        try:
            return await asyncio.to_thread(seed_diff_target, base, target, owner)
        except OSError as exc:
            log.warning("full snapshot instead of a diff over %s: %s", base.path, exc)
            return False

    def _record_quietly(self) -> None:
        """:meth:`write_record` where a failure must not fail the caller (the record
        only speeds up a later snapshot of a re-adopted process)."""
        try:
            self.write_record()
        except OSError as exc:
            log.warning("firecracker record in %s not updated: %s", self.workdir, exc)

    async def stop(self, timeout: float = 5.0) -> None:
        """Send Ctrl+Alt+Del (Firecracker exits when the guest then resets through the
        i8042), and SIGKILL after ``timeout``. A guest without an i8042 driver, or a
        paused one, ignores the request, so this can end in the kill."""
        if self.state is VMRunState.RUNNING:
            with contextlib.suppress(VMMError):
                await self.call("PUT", "/actions", {"action_type": "SendCtrlAltDel"})
            await self._process.wait(timeout)
        await self.kill()

    async def kill(self) -> None:
        if self._closed:
            return
        await self._process.kill()
        self._state = VMRunState.STOPPED
        self._stop_console()
        await self._api.aclose()
        _remove([self.workdir / API_SOCKET, self.workdir / VM_RECORD])
        if self._jail is not None:
            # The chroot, its socket link and the cgroup go with the process.
            await asyncio.to_thread(self._jail.cleanup)

    def _stop_console(self) -> None:
        if self._console_task is not None:
            self._console_task.cancel()
            self._console_task = None

    async def stats(self) -> VMStats:
        state = self.state
        if state is VMRunState.STOPPED:
            raise VMMGone(f"firecracker pid {self.pid} has exited")
        rss, pss, cpu_seconds = _read_stats(self.pid)
        return VMStats(
            pid=self.pid, state=state, rss_bytes=rss, pss_bytes=pss, cpu_seconds=cpu_seconds
        )

    async def wait_exit(self) -> VMMExit:
        returncode = await self._process.exited()
        tail = await asyncio.to_thread(_exit_log_tail, self.workdir)
        return VMMExit(self.pid, returncode, tail)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop_console()
            self._process.detach()
            await self._api.aclose()

    def write_record(self) -> None:
        """Record what :meth:`FirecrackerDriver.attach` needs to find this process."""
        record = {
            "pid": self.pid,
            "spec": self.spec.to_dict(),
            "api_socket": str(self._api.socket_path),
            "shape": self._shape,
            "tap": self._tap,
            # What the process's command line holds (checked on attach: pids are reused).
            "cmdline": self._jail.markers() if self._jail else [str(self._api.socket_path)],
            "jailed": self._jail is not None,
            "diff_base": self._diff_base.to_dict() if self._diff_base else None,
        }
        tmp = self.workdir / f".{VM_RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, self.workdir / VM_RECORD)


# --- Driver -------------------------------------------------------------------------------


class FirecrackerDriver(VMMDriver):
    """Starts Firecracker processes from ``binary`` (see :func:`find_firecracker`); with
    ``confinement``, under ``jailer`` (see :mod:`agentenv.vmm.firecracker_jail`). The
    console log is kept within ``console_limit`` bytes (None: unbounded)."""

    name = "firecracker"
    executables = ("firecracker", "jailer")
    # Firecracker opens raw files only, and keeps guest RAM anonymous until a snapshot.
    disk_formats = ("raw",)
    shared_memory_boot = False
    # No software emulation.
    accelerators = ("kvm",)
    # Raw drives have no backing files, so a running disk cannot be frozen under a new
    # top image; it is copied instead, while the machine is paused for its snapshot
    # (whose creation flushes every block device to its file first).
    disk_capture = DiskCapture.COPY
    # Its pause files are not published to the snapshot repository yet.
    publishes_paused_state = False

    def __init__(
        self,
        binary: Path,
        *,
        confinement: Confinement | None = None,
        jailer: Path | None = None,
        console_limit: int | None = CONSOLE_LIMIT_BYTES,
    ) -> None:
        if confinement is not None and jailer is None:
            raise VMMError("confined Firecracker VMMs need the jailer binary")
        for path in (binary, jailer) if jailer is not None else (binary,):
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise VMMError(f"Firecracker binary {path} is not an executable file")
        self.binary = binary
        self.confinement = confinement
        self.jailer = jailer
        self.console_limit = console_limit

    def _jail(self, workdir: Path) -> FirecrackerJail | None:
        if self.confinement is None or self.jailer is None:
            return None
        return FirecrackerJail(self.confinement, self.jailer, self.binary, workdir.resolve())

    def stray_markers(self, workdir: Path) -> tuple[str, ...]:
        # A jailed Firecracker's command line names paths in its chroot: its jail id
        # (the jailer's --id, passed on to Firecracker) identifies it.
        jail = self._jail(workdir)
        return (str(workdir), *((jail.jail_id,) if jail is not None else ()))

    async def boot(self, spec: MachineSpec, workdir: Path) -> FirecrackerVM:
        _validate_spec(spec)
        vm = await self._start(spec, workdir)
        try:
            await vm.call(
                "PUT",
                "/machine-config",
                {
                    "vcpu_count": spec.vcpus,
                    "mem_size_mib": spec.memory_mib,
                    # So that snapshots after the first write only what the guest changed.
                    "track_dirty_pages": True,
                },
            )
            jailed = vm._jail is not None
            boot_source: dict[str, Any] = {
                "kernel_image_path": (
                    jail_paths.KERNEL_IN_JAIL if jailed else str(spec.kernel.resolve())
                ),
                "boot_args": _boot_args(spec.cmdline),
            }
            if spec.initrd is not None:
                initrd = jail_paths.INITRD_IN_JAIL if jailed else str(spec.initrd.resolve())
                boot_source["initrd_path"] = initrd
            await vm.call("PUT", "/boot-source", boot_source)
            for drive in spec.drives:
                await vm.call(
                    "PUT",
                    f"/drives/{drive.drive_id}",
                    {
                        "drive_id": drive.drive_id,
                        "path_on_host": f"{DRIVES_DIR}/{drive.drive_id}",
                        # root= comes from spec.cmdline, and drives keep guest order.
                        "is_root_device": False,
                        "is_read_only": drive.read_only,
                    },
                )
            if spec.net is not None:
                await vm.call(
                    "PUT",
                    f"/network-interfaces/{NET_IFACE_ID}",
                    {
                        "iface_id": NET_IFACE_ID,
                        "host_dev_name": spec.net.tap,
                        "guest_mac": spec.net.mac,
                    },
                )
            await vm.call(
                "PUT",
                "/balloon",
                {
                    "amount_mib": 0,
                    "deflate_on_oom": True,
                    "stats_polling_interval_s": BALLOON_STATS_INTERVAL_S,
                },
            )
            await vm.call("PUT", "/actions", {"action_type": "InstanceStart"})
            vm._state = VMRunState.RUNNING
            vm.write_record()
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def restore(
        self,
        spec: MachineSpec,
        snapshot: SnapshotFiles,
        workdir: Path,
        *,
        resume: bool = True,
    ) -> FirecrackerVM:
        """Load ``snapshot`` into a new process. RAM comes from ``snapshot.memory_file``
        (mapped copy-on-write, never written to); drives come from ``spec.drives`` and the
        tap from ``spec.net``; the guest MAC stays the snapshotted one."""
        snapshot.check_compatible(self.name, spec)
        _validate_spec(spec, restoring=True)
        state_file, memory_file = _validate_snapshot(snapshot)
        vm = await self._start(spec, workdir, (state_file, memory_file))
        if vm._jail is not None:
            state_arg, memory_arg = jail_paths.STATE_IN_JAIL, jail_paths.MEMORY_IN_JAIL
        else:
            state_arg, memory_arg = str(state_file), str(memory_file)
        body: dict[str, Any] = {
            "snapshot_path": state_arg,
            "mem_backend": {"backend_type": "File", "backend_path": memory_arg},
            "enable_diff_snapshots": True,
            "resume_vm": resume,
        }
        if spec.net is not None:
            body["network_overrides"] = [{"iface_id": NET_IFACE_ID, "host_dev_name": spec.net.tap}]
        try:
            await vm.call("PUT", "/snapshot/load", body, read_timeout=SNAPSHOT_TIMEOUT_S)
            vm._diff_base = DiffBase.of(memory_file)
            vm._state = VMRunState.RUNNING if resume else VMRunState.PAUSED
            vm.write_record()
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def attach(self, workdir: Path) -> FirecrackerVM:
        workdir, record = _read_record(workdir)
        pid, socket_path = int(record["pid"]), Path(record["api_socket"])
        # The pid may have been reused by an unrelated process since the record was made.
        cmdline = read_cmdline(pid)
        if not all(m in cmdline for m in record.get("cmdline", [str(socket_path)])):
            raise VMMGone(f"firecracker pid {pid} recorded in {workdir} is gone")
        jail = self._jail(workdir) if record.get("jailed") else None
        try:
            process = VMMProcess.adopt(pid)
        except ProcessLookupError as exc:
            raise VMMGone(f"firecracker pid {pid} recorded in {workdir} is gone") from exc
        vm = FirecrackerVM(
            workdir=workdir,
            spec=MachineSpec.from_dict(record["spec"]),
            process=process,
            api=FirecrackerAPI(socket_path),
            shape=dict(record["shape"]),
            tap=record.get("tap"),
            state=VMRunState.STARTING,
            jail=jail,
            console_limit=self.console_limit,
            diff_base=DiffBase.from_dict(record.get("diff_base")),
        )
        try:
            info = await vm.describe()
        except VMMError as exc:
            await vm.close()
            raise VMMGone(f"firecracker pid {pid} does not answer: {exc}") from exc
        vm._state = _FIRECRACKER_STATES.get(info.get("state", ""), VMRunState.STARTING)
        return vm

    async def _start(
        self, spec: MachineSpec, workdir: Path, snapshot: tuple[Path, Path] | None = None
    ) -> FirecrackerVM:
        """Start Firecracker, unconfined with ``workdir`` as its cwd (so the relative drive
        links resolve) or jailed in a chroot laid out for ``spec`` (and the ``snapshot``'s
        state and RAM files), and return once its API answers."""
        workdir = _prepare_workdir(spec, workdir)
        jail = self._jail(workdir)
        launch_spec = LaunchSpec(
            argv=(),
            cwd=workdir,
            # Firecracker writes the guest console to its stdout.
            stdout=workdir / CONSOLE_FILE,
            stderr=workdir / STDERR_FILE,
            append_output=True,
            netns=spec.net.netns if spec.net is not None else None,
        )
        if jail is None:
            socket_path = workdir / API_SOCKET
            argv = [str(self.binary), "--api-sock", str(socket_path)]
            argv += ["--id", _instance_id(workdir), "--level", "Warning"]
            argv += ["--log-path", str(workdir / LOG_FILE)]
            launch_spec = replace(launch_spec, argv=tuple(argv))
        else:
            try:
                launch_spec = await asyncio.to_thread(jail.confine, launch_spec, spec, snapshot)
            except ConfinementError as exc:
                raise VMMStartError(f"cannot confine Firecracker: {exc}") from exc
            socket_path = jail.api_socket
        try:
            process = launch(launch_spec)
        except BaseException:
            if jail is not None:
                jail.cleanup(0)
            raise
        vm = FirecrackerVM(
            workdir=workdir,
            spec=spec,
            process=process,
            api=FirecrackerAPI(socket_path),
            shape=spec.shape(),
            tap=spec.net.tap if spec.net is not None else None,
            state=VMRunState.STARTING,
            jail=jail,
            console_limit=self.console_limit,
        )
        try:
            await self._wait_for_api(vm)
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def _wait_for_api(self, vm: FirecrackerVM) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            # Connecting before the socket exists just fails fast, so no separate check.
            try:
                await vm._api.request("GET", "/", read_timeout=1.0)
                return
            except (httpx.TransportError, VMMCommandError):
                pass
            if not vm._process.alive():
                raise VMMStartError(f"firecracker exited while starting\n{_log_tail(vm.workdir)}")
            if time.monotonic() > deadline:
                raise VMMStartError(
                    f"firecracker API did not come up within {START_TIMEOUT_S:.0f}s\n"
                    f"{_log_tail(vm.workdir)}"
                )
            if await vm._process.wait(0.005):
                raise VMMStartError(f"firecracker exited while starting\n{_log_tail(vm.workdir)}")
