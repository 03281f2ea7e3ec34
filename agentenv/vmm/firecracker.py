"""Firecracker driver: one ``firecracker`` process per machine, driven over its HTTP API
on a Unix socket. The driver starts (boot, restore) and finds again (attach) processes;
the handle on a running one is :mod:`agentenv.vmm.firecracker_vm`'s.

Things about Firecracker (v1.12) that shape this driver:

- It runs only on KVM; there is no software emulation, so ``accel="tcg"`` is refused.
- Guest RAM is anonymous memory on boot, so ``MachineSpec.memory_file`` is not used: a
  snapshot writes a RAM image (``memory.fc``; in full the first time, afterwards only the
  pages the guest changed, over a reflink of the previous image:
  :mod:`agentenv.vmm.firecracker_memory`) and a restore maps that image copy-on-write
  (``MAP_PRIVATE``), i.e. ``memory_shared=False`` semantics. A boot with
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
import os
import re
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from agentenv.vmm import firecracker_jail as jail_paths
from agentenv.vmm.base import (
    DiskCapture,
    MachineSpec,
    SnapshotFiles,
    VMMDriver,
    VMMError,
    VMMGone,
    VMMStartError,
    VMRunState,
)
from agentenv.vmm.confine import Confinement, ConfinementError
from agentenv.vmm.console import CONSOLE_LIMIT_BYTES
from agentenv.vmm.firecracker_api import FirecrackerAPI
from agentenv.vmm.firecracker_binary import find_firecracker
from agentenv.vmm.firecracker_jail import FirecrackerJail
from agentenv.vmm.firecracker_memory import DiffBase
from agentenv.vmm.firecracker_vm import (
    API_SOCKET,
    CONSOLE_FILE,
    DRIVER_NAME,
    LOG_FILE,
    SNAPSHOT_TIMEOUT_S,
    STDERR_FILE,
    VM_RECORD,
    FirecrackerVM,
    read_record,
)
from agentenv.vmm.launch import LaunchSpec, launch
from agentenv.vmm.process import VMMProcess, read_cmdline

__all__ = [
    "API_SOCKET",
    "VM_RECORD",
    "FirecrackerAPI",
    "FirecrackerDriver",
    "FirecrackerVM",
    "find_firecracker",
]

DRIVES_DIR = "drives"
NET_IFACE_ID = "eth0"

# Kernel parameters a Firecracker guest needs unless the caller chose otherwise: there is
# no PCI bus to probe (devices are virtio-mmio), the only reset Firecracker emulates is the
# keyboard controller's (after which it exits), and a panicking guest should reset rather
# than hang.
FIRECRACKER_BOOT_ARGS: Final = (("pci", "off"), ("reboot", "k"), ("panic", "1"))

BALLOON_STATS_INTERVAL_S = 5

_DRIVE_ID = re.compile(r"^[A-Za-z0-9_]+$")
_INSTANCE_ID_BAD = re.compile(r"[^A-Za-z0-9-]")


# --- Plain helpers (blocking file work kept out of coroutines) --------------------------


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


# --- Driver -------------------------------------------------------------------------------


class FirecrackerDriver(VMMDriver):
    """Starts Firecracker processes from ``binary`` (see :func:`find_firecracker`); with
    ``confinement``, under ``jailer`` (see :mod:`agentenv.vmm.firecracker_jail`). The
    console log is kept within ``console_limit`` bytes (None: unbounded)."""

    name = DRIVER_NAME
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
            jailed = vm.jailed
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
            vm.started(VMRunState.RUNNING)
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
        if vm.jailed:
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
            await vm.track_dirty_pages_from(memory_file)
            vm.started(VMRunState.RUNNING if resume else VMRunState.PAUSED)
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def attach(self, workdir: Path) -> FirecrackerVM:
        workdir, record = read_record(workdir)
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
            await vm.take_reported_state()
        except VMMError as exc:
            await vm.close()
            raise VMMGone(f"firecracker pid {pid} does not answer: {exc}") from exc
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
            await vm.wait_for_api()
        except BaseException:
            await vm.kill()
            raise
        return vm
