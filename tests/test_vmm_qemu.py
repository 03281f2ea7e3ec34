"""QEMU microvm driver and accelerator probe.

The VM tests use a tiny throwaway guest built once and cached under
/var/cache/agentenv/test-guest/: Debian's cloud kernel as an uncompressed ELF vmlinux, an
initramfs that loads the virtio modules and switches to /dev/vda, and a 64 MiB busybox
rootfs whose init prints ``READY <token> <counter> <tag>`` on the serial console every
second. ``token`` is drawn at boot and held in the guest's RAM, ``counter`` advances in
RAM, and ``tag`` is read (O_DIRECT) from a second, tiny drive on every line, so a console
log shows which boot a restored VM descends from, that it continued rather than rebooted,
and which drive set it runs with.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import pytest
import pytest_asyncio

from agentenv.vmm.accel import AcceleratorUnavailable, probe_accelerator, resolve_accelerator
from agentenv.vmm.base import (
    DiskCapture,
    DriveSpec,
    MachineSpec,
    NetSpec,
    SnapshotFiles,
    SnapshotIncompatible,
    VMMCommandError,
    VMMGone,
    VMMStartError,
    VMMUnresponsive,
    VMRunState,
)
from agentenv.vmm.cgroups import VmmCgroups
from agentenv.vmm.confine import Confinement, VmmJail
from agentenv.vmm.launch import find_ram_advice
from agentenv.vmm.process import read_cmdline
from agentenv.vmm.qemu import QemuDriver
from agentenv.vmm.qemu_vm import (
    BALLOON,
    LEGACY_BALLOON,
    LEGACY_MACHINE,
    MACHINE,
    QemuVM,
    balloon_of_argv,
    balloon_of_snapshot,
    machine_of_argv,
    machine_of_snapshot,
)
from agentenv.vmm.working_set import PAGE, WorkingSets, resident_extents
from tests.helpers import drop_from_page_cache

# -- accelerator probe (pure logic over a fake root) -------------------------------------


def _fake_root(
    tmp_path: Path,
    *,
    kvm: str = "file",
    modules: tuple[str, ...] = (),
    flags: str = "fpu sse2",
) -> Path:
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    (root / "proc").mkdir()
    (root / "sys" / "module").mkdir(parents=True)
    if kvm == "file":
        (root / "dev" / "kvm").write_bytes(b"")
    elif kvm == "unopenable":
        (root / "dev" / "kvm").mkdir()  # exists, but open(O_RDWR) fails (EISDIR)
    for module in modules:
        (root / "sys" / "module" / module).mkdir()
    (root / "proc" / "cpuinfo").write_text(
        f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    )
    return root


def test_probe_no_kvm_device_is_tcg(tmp_path: Path) -> None:
    probe = probe_accelerator(_fake_root(tmp_path, kvm="absent", modules=("kvm_intel",)))
    assert probe.accel == "tcg"
    assert "does not exist" in probe.reason


def test_probe_unopenable_kvm_is_tcg(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, kvm="unopenable", modules=("kvm_intel",), flags="vmx")
    probe = probe_accelerator(root)
    assert probe.accel == "tcg"
    assert "cannot be opened" in probe.reason


def test_probe_pvm_is_tcg_even_with_flags(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, modules=("kvm", "kvm_pvm", "kvm_intel"), flags="vmx")
    probe = probe_accelerator(root)
    assert probe.accel == "tcg"
    assert "PVM" in probe.reason


@pytest.mark.parametrize(("module", "flag"), [("kvm_intel", "vmx"), ("kvm_amd", "svm")])
def test_probe_hardware_kvm(tmp_path: Path, module: str, flag: str) -> None:
    probe = probe_accelerator(_fake_root(tmp_path, modules=("kvm", module), flags=f"fpu {flag}"))
    assert probe.accel == "kvm"
    assert module in probe.reason


def test_probe_module_without_cpu_flag_is_tcg(tmp_path: Path) -> None:
    assert probe_accelerator(_fake_root(tmp_path, modules=("kvm_amd",))).accel == "tcg"


def test_resolve_explicit_settings(tmp_path: Path) -> None:
    pvm_root = _fake_root(tmp_path, modules=("kvm_pvm",))
    assert resolve_accelerator("auto", pvm_root).accel == "tcg"
    # An explicit choice wins over the probe (a PVM guest kernel could run under kvm_pvm).
    assert resolve_accelerator("kvm", pvm_root).accel == "kvm"
    assert resolve_accelerator("tcg", pvm_root).accel == "tcg"


def test_resolve_kvm_without_device_fails(tmp_path: Path) -> None:
    with pytest.raises(AcceleratorUnavailable, match="does not exist"):
        resolve_accelerator("kvm", _fake_root(tmp_path, kvm="absent"))


def test_resolve_rejects_unknown_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown accelerator"):
        resolve_accelerator("hvf", _fake_root(tmp_path))


# -- command line (no VM) ----------------------------------------------------------------


def _plain_spec(tmp_path: Path, **changes: object) -> MachineSpec:
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\0")
    disk = tmp_path / "disk,1.raw"
    disk.write_bytes(b"\0" * 512)
    spec = MachineSpec(
        vcpus=2,
        memory_mib=256,
        kernel=kernel,
        cmdline="console=ttyS0",
        drives=(DriveSpec("root", disk), DriveSpec("tools", disk, read_only=True, fmt="qcow2")),
        memory_file=tmp_path / "ram",
        memory_shared=True,
        accel="tcg",
    )
    return replace(spec, **changes)  # type: ignore[arg-type]


def test_capabilities() -> None:
    assert QemuDriver.disk_formats == ("raw", "qcow2")
    assert set(QemuDriver.accelerators) == {"tcg", "kvm"}
    assert QemuDriver.shared_memory_boot
    assert QemuDriver.disk_capture is DiskCapture.SEAL
    assert QemuDriver.publishes_paused_state


def test_argv_tcg_boot(tmp_path: Path) -> None:
    spec = _plain_spec(tmp_path)
    argv = QemuDriver(tb_size_mib=32).build_argv(spec, tmp_path / "w")
    line = " ".join(argv)
    assert argv[0] == "qemu-system-x86_64"
    # No PIT: QEMU would wake ~36 times a second to run a counter nobody reads.
    assert "-M microvm,pit=off,memory-backend=mem0" in line
    assert "-accel tcg,tb-size=32 -cpu max" in line
    assert "-smp 2 -m 256M" in line
    assert f"mem-path={tmp_path}/ram,share=on" in line
    # Commas in paths are doubled so they cannot start a new option.
    # Writable drives give freed blocks back to the host; read-only ones have none.
    assert (
        f"id=root,file={tmp_path}/disk,,1.raw,format=raw,if=none,"
        "discard=unmap,detect-zeroes=unmap -device"
    ) in line
    assert "id=tools,file=" in line and "format=qcow2,if=none,readonly=on -device" in line
    # The console is appended to (and kept within its bound by the VM's handle); an
    # unconfined VMM has no seccomp filter.
    assert f"file,id=console,path={tmp_path}/w/console.log,append=on" in line
    assert "-sandbox" not in argv
    assert line.index("drive=root") < line.index("drive=tools")
    assert "-device virtio-balloon-device" in line
    assert "-incoming" not in argv and "-S" not in argv


def test_machine_options_of_snapshots_and_command_lines(tmp_path: Path) -> None:
    assert machine_of_snapshot({"machine": MACHINE}) == MACHINE
    # Snapshots from before the PIT was removed recorded the bare type, or nothing.
    assert machine_of_snapshot({"machine": "microvm"}) == LEGACY_MACHINE == "microvm"
    assert machine_of_snapshot({}) == LEGACY_MACHINE
    with pytest.raises(SnapshotIncompatible, match="pc-q35"):
        machine_of_snapshot({"machine": "pc-q35"})
    driver = QemuDriver()
    for machine in (MACHINE, LEGACY_MACHINE):
        argv = driver.build_argv(_plain_spec(tmp_path), tmp_path / "w", machine=machine)
        assert machine_of_argv(argv) == machine


def test_balloon_follows_the_spec_at_boot_and_the_snapshot_at_restore(tmp_path: Path) -> None:
    driver = QemuDriver()
    plain = driver.build_argv(_plain_spec(tmp_path), tmp_path / "w")
    reporting = driver.build_argv(_plain_spec(tmp_path, report_free_pages=True), tmp_path / "w")
    assert "-device virtio-balloon-device -chardev" in " ".join(plain)
    assert "-device virtio-balloon-device,free-page-reporting=on -chardev" in " ".join(reporting)
    assert balloon_of_argv(plain) == LEGACY_BALLOON
    assert balloon_of_argv(reporting) == BALLOON
    # A restore passes the snapshot's balloon, whatever the spec says.
    restore = driver.build_argv(
        _plain_spec(tmp_path, report_free_pages=True), tmp_path / "w", balloon=LEGACY_BALLOON
    )
    assert balloon_of_argv(restore) == LEGACY_BALLOON
    assert balloon_of_snapshot({"balloon": BALLOON}) == BALLOON
    # Snapshots from before free page reporting recorded no balloon.
    assert balloon_of_snapshot({}) == LEGACY_BALLOON
    with pytest.raises(SnapshotIncompatible, match="balloon"):
        balloon_of_snapshot({"balloon": "virtio-balloon-device,free-page-hint=on"})


async def test_a_guest_that_reports_free_pages_never_maps_ram_privately(tmp_path: Path) -> None:
    spec = _plain_spec(tmp_path, report_free_pages=True)
    assert MachineSpec.from_dict(spec.to_dict()) == spec
    # Records written before the field have none.
    legacy = {k: v for k, v in spec.to_dict().items() if k != "report_free_pages"}
    assert MachineSpec.from_dict(legacy) == replace(spec, report_free_pages=False)

    state = tmp_path / "state.mig"
    state.write_bytes(b"x")
    memory = tmp_path / "ram"
    memory.write_bytes(b"")
    os.truncate(memory, spec.memory_mib * 1024 * 1024)
    private = replace(spec, memory_shared=False, report_free_pages=False)
    reporting = SnapshotFiles("qemu", "tcg", state, memory, spec.shape(), {"balloon": BALLOON})
    driver = QemuDriver()
    assert driver.needs_own_memory(reporting)
    assert not driver.needs_own_memory(replace(reporting, meta={}))
    # QEMU 7.2 would punch the guest's freed pages out of a file others map too.
    with pytest.raises(SnapshotIncompatible, match="privately"):
        await driver.restore(private, reporting, tmp_path / "w")
    with pytest.raises(VMMStartError, match="memory_shared"):
        await driver.boot(replace(spec, memory_shared=False), tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_argv_kvm_restore_and_private_ram(tmp_path: Path) -> None:
    spec = _plain_spec(tmp_path, accel="kvm", memory_shared=False)
    driver = QemuDriver()
    boot = driver.build_argv(spec, tmp_path / "w")
    restore = driver.build_argv(spec, tmp_path / "w", incoming=True)
    assert "-accel kvm -cpu host,-arch-capabilities" in " ".join(boot)
    assert "share=off" in " ".join(boot)
    # Restore differs from boot only by the trailing incoming options.
    assert restore == [*boot, "-S", "-incoming", "defer"]


def test_argv_confined_has_the_seccomp_filter(tmp_path: Path) -> None:
    confinement = Confinement(
        data_dir=tmp_path,
        id_base=2_000_000_000,
        device_gid=1_999_999_999,
        cgroups=VmmCgroups(2, "agentenv-test", (tmp_path,), ("memory", "cpu", "pids")),
        memory_overhead_mib=256,
        pids_max=512,
    )
    argv = QemuDriver(confinement=confinement).build_argv(_plain_spec(tmp_path), tmp_path / "w")
    sandbox = argv.index("-sandbox")
    assert argv[sandbox + 1] == (
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vcpus": 0}, "vcpus"),
        ({"kernel": Path("/nonexistent/vmlinux")}, "kernel"),
        ({"drives": (DriveSpec("bad,id", Path("/dev/null")),)}, "drive id"),
        ({"drives": (DriveSpec("root", Path("/nonexistent")),)}, "does not exist"),
    ],
)
async def test_boot_rejects_bad_spec(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    spec = _plain_spec(tmp_path, **changes)
    with pytest.raises(VMMStartError, match=message):
        await QemuDriver().boot(spec, tmp_path / "w")


async def test_boot_failure_leaves_no_process(tmp_path: Path) -> None:
    # A kernel QEMU cannot load: QEMU exits at once, and the error carries its stderr.
    spec = _plain_spec(tmp_path)
    with pytest.raises(VMMStartError, match=r"qemu\.log"):
        await QemuDriver().boot(spec, tmp_path / "w")
    record = tmp_path / "w" / "vm.json"
    assert record.exists()
    pid = int(json.loads(record.read_text())["pid"])
    assert read_cmdline(pid) == []


async def test_attach_without_record_is_gone(tmp_path: Path) -> None:
    with pytest.raises(VMMGone):
        await QemuDriver().attach(tmp_path)


def _chain(tmp_path: Path, delay: float, argv: list[str]) -> subprocess.Popen[bytes]:
    """A process shaped like a launch chain: a shell that execs ``argv`` after ``delay``.
    Returned once the shell runs: until its exec the child shows this test's command
    line, which no stray search would recognise (a loaded host makes that gap long)."""
    script = f'sleep {delay}; exec "$@"'
    chain = subprocess.Popen(["/bin/sh", "-c", script, "agentenv-launch", *argv], cwd=tmp_path)
    deadline = time.monotonic() + 30
    while read_cmdline(chain.pid)[:1] != ["/bin/sh"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return chain


async def test_attach_waits_for_a_launch_chain_to_exec(tmp_path: Path) -> None:
    # A server killed while a VMM was still in its launch chain finds the chain's command
    # line under the recorded pid; it waits for the exec instead of calling it gone.
    argv = ["sleep", "30.123"]
    chain = _chain(tmp_path, 0.5, argv)
    try:
        QemuDriver._write_record(tmp_path, chain.pid, argv, _plain_spec(tmp_path), tmp_path / "q")
        # It gets past the command line check as far as the monitor (sleep has none).
        with pytest.raises(VMMCommandError, match="cannot reach QMP"):
            await QemuDriver(connect_timeout=1.5).attach(tmp_path)
        assert read_cmdline(chain.pid) == argv
    finally:
        chain.kill()
        chain.wait()


async def test_a_launch_chain_that_never_execs_is_gone_to_attach_and_killed(
    tmp_path: Path,
) -> None:
    argv = ["qemu-system-x86_64", "-pidfile", str(tmp_path / "qemu.pid")]
    chain = _chain(tmp_path, 60, argv)
    try:
        QemuDriver._write_record(tmp_path, chain.pid, argv, _plain_spec(tmp_path), tmp_path / "q")
        driver = QemuDriver(connect_timeout=0.3)
        with pytest.raises(VMMGone):
            await driver.attach(tmp_path)
        # Ours (it names the directory and QEMU) and never to be watched: what every
        # caller of attach does next kills it, not left to start a VMM nobody manages.
        assert await driver.kill_strays(tmp_path) == [chain.pid]
        assert not Path(f"/proc/{chain.pid}").exists()
    finally:
        chain.kill()
        chain.wait()


async def test_kill_strays_kills_only_what_runs_from_the_directory(tmp_path: Path) -> None:
    # What a server killed between launch and record leaves: a VMM (here still in its
    # launch chain) nothing records. Only processes naming this directory and a QEMU go.
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    stray = _chain(mine, 60, ["qemu-system-x86_64", "-pidfile", str(mine / "qemu.pid")])
    neighbour = _chain(other, 60, ["qemu-system-x86_64", "-pidfile", str(other / "qemu.pid")])
    bystander = _chain(mine, 60, ["tail", str(mine / "console.log")])
    try:
        assert await QemuDriver().kill_strays(mine) == [stray.pid]
        # Gone and reaped (it was this process's child).
        assert read_cmdline(stray.pid) == []
        assert not Path(f"/proc/{stray.pid}").exists()
        assert neighbour.poll() is None and bystander.poll() is None
        assert await QemuDriver().kill_strays(mine) == []
    finally:
        for process in (stray, neighbour, bystander):
            process.kill()
            process.wait()


async def test_restore_rejects_other_driver_and_accel(tmp_path: Path) -> None:
    spec = _plain_spec(tmp_path)
    state = tmp_path / "state.mig"
    state.write_bytes(b"x")
    snap = SnapshotFiles("qemu", "kvm", state, None, spec.shape())
    with pytest.raises(SnapshotIncompatible, match="accel"):
        await QemuDriver().restore(spec, snap, tmp_path / "w")
    with pytest.raises(SnapshotIncompatible, match="firecracker"):
        await QemuDriver().restore(spec, replace(snap, driver="firecracker"), tmp_path / "w")


# -- throwaway test guest ------------------------------------------------------------------

GUEST_CACHE = Path("/var/cache/agentenv/test-guest")
KERNEL_PACKAGE = "linux-image-cloud-amd64"
# Load order matters: virtio_ring before virtio (reference §3.1).
INITRD_MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_mmio",
    "drivers/block/virtio_blk",
    "net/core/failover",
    "drivers/net/net_failover",
    "drivers/net/virtio_net",
    "drivers/virtio/virtio_balloon",
)
INITRD_INIT = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {modules}; do insmod /lib/modules/$m.ko; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 300 ]; do sleep 0.01; i=$((i+1)); done
mkdir -p /newroot
mount -t ext4 -o rw /dev/vda /newroot || {{ echo "INITRD: cannot mount /dev/vda"; exec sh; }}
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/init
"""
ROOTFS_INIT = """#!/bin/sh
# test guest v2
mount -t proc proc /proc
mount -t sysfs sysfs /sys
token=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n')
n=0
while true; do
  tag=$(dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | tr -dc 'A-Za-z0-9_-')
  echo "READY $token $n $tag"
  n=$((n+1))
  sleep 1
done
"""


@dataclass(frozen=True)
class GuestFiles:
    kernel: Path
    initrd: Path
    rootfs: Path
    cmdline: str


def _host_tsc_khz() -> int:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    raise RuntimeError("no 'cpu MHz' in /proc/cpuinfo")


def _run(*argv: str, cwd: Path | None = None) -> None:
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True)


def _extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    # The cloud kernel is LZ4-compressed (legacy frame); the ELF boots faster under TCG.
    blob = vmlinuz.read_bytes()
    start = blob.find(b"\x02\x21\x4c\x18")
    if start < 0:
        raise RuntimeError(f"no LZ4 frame in {vmlinuz}")
    with open(out, "wb") as f:
        subprocess.run(["lz4", "-dc"], input=blob[start:], stdout=f, check=False)
    if out.read_bytes()[:4] != b"\x7fELF":
        raise RuntimeError(f"{out} is not an ELF image")


def _build_test_guest(dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest) as scratch_name:
        scratch = Path(scratch_name)
        _run("apt-get", "download", KERNEL_PACKAGE, cwd=scratch)
        meta = next(scratch.glob(f"{KERNEL_PACKAGE}_*.deb"))
        depends = subprocess.run(
            ["dpkg-deb", "-f", str(meta), "Depends"], capture_output=True, text=True, check=True
        ).stdout
        image_package = re.search(r"linux-image-[0-9][^\s,]*", depends)
        assert image_package, depends
        _run("apt-get", "download", image_package.group(0), cwd=scratch)
        deb = next(scratch.glob(f"{image_package.group(0)}_*.deb"))
        pkg = scratch / "pkg"
        _run("dpkg-deb", "-x", str(deb), str(pkg))
        vmlinuz = next((pkg / "boot").glob("vmlinuz-*"))
        release = vmlinuz.name.removeprefix("vmlinuz-")
        _extract_vmlinux(vmlinuz, scratch / "vmlinux")

        busybox = Path("/usr/bin/busybox")
        initrd_root = scratch / "initrd"
        for sub in ("bin", "dev", "proc", "sys", "newroot", "lib/modules"):
            (initrd_root / sub).mkdir(parents=True)
        shutil.copy(busybox, initrd_root / "bin" / "busybox")
        for applet in ("sh", "mount", "umount", "insmod", "switch_root", "mkdir", "sleep"):
            (initrd_root / "bin" / applet).symlink_to("busybox")
        names = []
        for module in INITRD_MODULES:
            name = module.rsplit("/", 1)[1]
            src = pkg / "lib" / "modules" / release / "kernel" / f"{module}.ko"
            shutil.copy(src, initrd_root / "lib" / "modules" / f"{name}.ko")
            names.append(name)
        init = initrd_root / "init"
        init.write_text(INITRD_INIT.format(modules=" ".join(names)))
        init.chmod(0o755)
        files = subprocess.run(
            ["find", "."], cwd=initrd_root, capture_output=True, check=True
        ).stdout
        cpio = subprocess.run(
            ["cpio", "-o", "-H", "newc", "--quiet"],
            cwd=initrd_root,
            input=files,
            capture_output=True,
            check=True,
        ).stdout
        (scratch / "initrd.cpio.gz").write_bytes(
            subprocess.run(["gzip", "-1"], input=cpio, capture_output=True, check=True).stdout
        )

        rootfs_root = scratch / "rootfs"
        for sub in ("bin", "sbin", "dev", "proc", "sys", "tmp", "etc"):
            (rootfs_root / sub).mkdir(parents=True)
        shutil.copy(busybox, rootfs_root / "bin" / "busybox")
        applets = subprocess.run(
            [str(busybox), "--list"], capture_output=True, text=True, check=True
        ).stdout.split()
        for applet in applets:
            if applet not in ("busybox", "init"):
                (rootfs_root / "bin" / applet).symlink_to("busybox")
        (rootfs_root / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
        init = rootfs_root / "sbin" / "init"
        init.write_text(ROOTFS_INIT)
        init.chmod(0o755)
        _run(
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "root",
            "-d",
            str(rootfs_root),
            str(scratch / "rootfs.ext4"),
            "64M",
        )

        for name in ("vmlinux", "initrd.cpio.gz", "rootfs.ext4"):
            os.replace(scratch / name, dest / name)


@pytest.fixture(scope="session")
def guest_files() -> GuestFiles:
    version = hashlib.sha256((INITRD_INIT + ROOTFS_INIT + repr(INITRD_MODULES)).encode())
    dest = GUEST_CACHE / version.hexdigest()[:12]
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "rootfs.ext4").exists():
            _build_test_guest(dest)
    cmdline = (
        f"console=ttyS0 root=/dev/vda rw quiet tsc_early_khz={_host_tsc_khz()} random.trust_cpu=on"
    )
    return GuestFiles(dest / "vmlinux", dest / "initrd.cpio.gz", dest / "rootfs.ext4", cmdline)


# -- VM tests: one boot per module, reused ------------------------------------------------

READY_LINE = re.compile(r"READY ([0-9a-f]+) (\d+) (\S*)")


_Test = TypeVar("_Test", bound=Callable[..., Awaitable[None]])


def vm_test(fn: _Test) -> _Test:
    """A test that boots (or uses) real VMs, sharing the module's event loop and VM."""
    marked: _Test = pytest.mark.vm(pytest.mark.asyncio(loop_scope="module")(fn))
    return marked


def _ready_lines(console: Path) -> list[tuple[str, int, str]]:
    text = console.read_text(errors="replace") if console.exists() else ""
    return [(m[1], int(m[2]), m[3]) for m in READY_LINE.finditer(text)]


async def _wait_lines(
    console: Path, count: int, limit_s: float = 90.0
) -> list[tuple[str, int, str]]:
    """Wait until the console holds at least ``count`` READY lines (a liveness bound,
    generous because TCG boots slowly on a loaded host; never a performance assertion)."""
    deadline = time.monotonic() + limit_s
    while True:
        lines = _ready_lines(console)
        if len(lines) >= count:
            return lines
        if time.monotonic() > deadline:
            tail = console.read_text(errors="replace")[-1500:] if console.exists() else ""
            raise AssertionError(f"{count} READY lines not seen on {console}:\n{tail}")
        await asyncio.sleep(0.05)


def _state_of(vm: QemuVM) -> VMRunState:
    """``vm.state`` read anew (mypy would keep an earlier assertion's narrowing of it)."""
    return vm.state


def _tag_drive(path: Path, tag: str) -> Path:
    path.write_bytes(tag.encode().ljust(512, b"\0"))
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def _restored_only_as_recorded(
    lab: Lab,
    name: str,
    spec: MachineSpec,
    snapshot: SnapshotFiles,
    wrong: SnapshotFiles,
    token: str,
    last: int,
) -> QemuVM:
    """``wrong`` (``snapshot`` with another machine recorded) fails to restore;
    ``snapshot`` restores, its guest counting on from ``last`` in boot ``token``. Returns
    the restored VM re-attached, so the caller can check what the new handle read from
    its record; the caller kills it."""
    with pytest.raises(VMMStartError, match="restoring"):
        await lab.driver.restore(spec, wrong, lab.root / f"{name}-wrong")
    back = await lab.driver.restore(spec, snapshot, lab.root / f"{name}-back")
    try:
        lines = await _wait_lines(back.console_log, 1)
        assert lines[0][0] == token and lines[0][1] == last + 1
        await back.close()
        return await lab.driver.attach(lab.root / f"{name}-back")
    except BaseException:
        await back.kill()
        raise


@dataclass
class Lab:
    """The module's VMs and files (mutable: tests hand results to later tests)."""

    guest: GuestFiles
    root: Path
    driver: QemuDriver
    spec: MachineSpec
    vm: QemuVM
    shared_snapshot: SnapshotFiles | None = None
    private_child: QemuVM | None = None
    private_child_spec: MachineSpec | None = None

    def child_spec(self, name: str, tag: str, memory_file: Path, shared: bool) -> MachineSpec:
        rootfs = self.root / f"{name}.ext4"
        subprocess.run(
            ["cp", "--sparse=always", str(self.spec.drives[0].path), str(rootfs)], check=True
        )
        return replace(
            self.spec,
            drives=(
                DriveSpec("root", rootfs),
                DriveSpec("tag", _tag_drive(self.root / f"{name}.tag", tag), read_only=True),
            ),
            memory_file=memory_file,
            memory_shared=shared,
        )


def _our_qemu_pids(root: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and any(str(root) in arg for arg in read_cmdline(int(entry.name))):
            pids.append(int(entry.name))
    return pids


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab(
    guest_files: GuestFiles, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Lab]:
    root = tmp_path_factory.mktemp("qemu-lab")
    rootfs = root / "source.ext4"
    shutil.copy(guest_files.rootfs, rootfs)
    spec = MachineSpec(
        vcpus=1,
        memory_mib=256,
        kernel=guest_files.kernel,
        initrd=guest_files.initrd,
        cmdline=guest_files.cmdline,
        drives=(
            DriveSpec("root", rootfs),
            DriveSpec("tag", _tag_drive(root / "source.tag", "SOURCE"), read_only=True),
        ),
        memory_file=root / "source.ram",
        memory_shared=True,
        accel="tcg",
    )
    driver = QemuDriver()
    vm = await driver.boot(spec, root / "source")
    lab = Lab(guest=guest_files, root=root, driver=driver, spec=spec, vm=vm)
    try:
        yield lab
    finally:
        # Nothing may outlive the module, whatever failed.
        for pid in _our_qemu_pids(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for handle in (lab.vm, lab.private_child):
            if handle is not None:
                await handle.kill()


@vm_test
async def test_boot_reaches_ready_and_reports_stats(lab: Lab) -> None:
    _, _, tag = (await _wait_lines(lab.vm.console_log, 1))[0]
    assert tag == "SOURCE"
    assert lab.vm.state is VMRunState.RUNNING
    assert read_cmdline(lab.vm.pid)[0] == "qemu-system-x86_64"
    stats = await lab.vm.stats()
    assert stats.pid == lab.vm.pid
    assert stats.state is VMRunState.RUNNING
    assert stats.rss_bytes > 16 * 1024 * 1024
    assert 0 < stats.pss_bytes <= stats.rss_bytes
    assert stats.cpu_seconds > 0


@vm_test
async def test_pause_and_resume(lab: Lab) -> None:
    vm = lab.vm
    await _wait_lines(vm.console_log, 1)
    await vm.pause()
    assert vm.state is VMRunState.PAUSED
    assert (await vm.execute("query-status"))["running"] is False
    seen = len(_ready_lines(vm.console_log))
    await asyncio.sleep(2.5)  # the guest prints every second when it runs
    assert len(_ready_lines(vm.console_log)) == seen
    await vm.resume()
    assert _state_of(vm) is VMRunState.RUNNING
    lines = await _wait_lines(vm.console_log, seen + 1)
    assert [n for _, n, _ in lines] == list(range(len(lines)))


@vm_test
async def test_attach_after_dropping_handle(lab: Lab) -> None:
    pid = lab.vm.pid
    await lab.vm.close()
    assert read_cmdline(pid)[0] == "qemu-system-x86_64"  # close() leaves the VM running
    vm = await lab.driver.attach(lab.vm.workdir)
    lab.vm = vm
    assert vm.pid == pid
    assert vm.state is VMRunState.RUNNING
    assert vm.spec == lab.spec
    seen = len(_ready_lines(vm.console_log))
    await _wait_lines(vm.console_log, seen + 1)


@vm_test
async def test_a_save_of_a_frozen_vmm_fails_fast_and_leaves_it_running(lab: Lab) -> None:
    # A VMM stopped with SIGSTOP (hung): the save fails once its first command goes
    # unanswered, rather than after every rollback command has waited as long too, and
    # the machine runs on once the VMM does.
    await lab.vm.close()
    vm = await QemuDriver(command_timeout=3.0).attach(lab.vm.workdir)
    lab.vm = vm
    await _wait_lines(vm.console_log, 1)
    os.kill(vm.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(VMMUnresponsive, match=r"got no answer within 3\.0s"):
            await vm.save_state(lab.root / "snap-frozen")
        failed_after = time.monotonic() - started
    finally:
        os.kill(vm.pid, signal.SIGCONT)
    # One command's bound (3 s), not three of them as the rollback used to wait (9 s).
    assert failed_after < 7.5, failed_after
    assert _state_of(vm) is VMRunState.RUNNING
    assert (await vm.execute("query-status"))["running"] is True
    assert not list((lab.root / "snap-frozen").iterdir())
    seen = len(_ready_lines(vm.console_log))
    await _wait_lines(vm.console_log, seen + 1)


@vm_test
async def test_save_shared_ram_then_fork_private_copies(lab: Lab) -> None:
    source = lab.vm
    await _wait_lines(source.console_log, 2)
    snapshot = await source.save_state(lab.root / "snap-shared")
    lab.shared_snapshot = snapshot
    assert source.state is VMRunState.PAUSED
    assert snapshot.driver == "qemu" and snapshot.accel == "tcg"
    assert snapshot.memory_file == lab.spec.memory_file
    assert snapshot.state_file == lab.root / "snap-shared" / "state.mig"
    # Device state only: guest RAM stayed in the memory file.
    assert 0 < snapshot.state_file.stat().st_size < 1024 * 1024
    assert sorted(p.name for p in snapshot.state_file.parent.iterdir()) == ["state.mig"]
    assert snapshot.meta["qemu_version"].startswith("7.")
    assert SnapshotFiles.from_json(snapshot.to_json()) == snapshot

    saved = _ready_lines(source.console_log)
    token, last, _ = saved[-1]
    ram_digest = _sha256(snapshot.memory_file)

    # Two children map the saved RAM file privately (copy-on-write), straight from
    # where the source left it; each gets its own disk copy and tag drive.
    children = []
    for name, tag in (("child-a", "CHILDA"), ("child-b", "CHILDB")):
        spec = lab.child_spec(name, tag, snapshot.memory_file, shared=False)
        resume = name == "child-a"
        child = await lab.driver.restore(spec, snapshot, lab.root / name, resume=resume)
        children.append((child, spec, tag))
    child_a, child_b = children[0][0], children[1][0]
    assert child_b.state is VMRunState.PAUSED
    await asyncio.sleep(1.5)
    assert _ready_lines(child_b.console_log) == []  # restored paused: nothing runs
    await child_b.resume()

    for child, _, tag in children:
        lines = await _wait_lines(child.console_log, 3)
        # Same boot (token), continued (not restarted) counter, own drive set.
        assert [t for t, _, _ in lines] == [token] * len(lines)
        assert [n for _, n, _ in lines] == list(range(last + 1, last + 1 + len(lines)))
        assert {g for _, _, g in lines} == {tag}
    # The children's writes to RAM stayed private: the snapshot's RAM file is untouched.
    assert _sha256(snapshot.memory_file) == ram_digest
    assert child_a.pid != child_b.pid

    await child_b.stop()
    assert _state_of(child_b) is VMRunState.STOPPED
    assert read_cmdline(child_b.pid) == []
    lab.private_child, lab.private_child_spec = child_a, children[0][1]


@vm_test
async def test_a_balloon_over_private_ram_leaves_the_shared_file_whole(lab: Lab) -> None:
    """The balloon inflated in a machine that maps its RAM file privately (a fork child,
    a sandbox of a shared template image): QEMU 7.2 would punch every page the guest
    hands over out of the file its siblings map too, zeroing their memory. The launcher's
    seccomp filter denies the punch; the file stays byte for byte what it was."""
    child, spec = lab.private_child, lab.private_child_spec
    assert child is not None and spec is not None
    ram = spec.memory_file
    digest, blocks = _sha256(ram), ram.stat().st_blocks
    guest_bytes = spec.memory_mib << 20
    target = guest_bytes // 2
    await child.execute("balloon", {"value": target})
    # The guest's balloon driver inflates at its own pace (slowly under TCG on a busy
    # host): wait until it has handed over most of what was asked.
    deadline = time.monotonic() + 180
    while True:
        actual = (await child.execute("query-balloon"))["actual"]
        if actual <= target + (16 << 20):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the balloon never inflated: guest has {actual} bytes")
        await asyncio.sleep(0.5)
    try:
        assert ram.stat().st_blocks == blocks
        assert _sha256(ram) == digest
        # QEMU kept going: the failed discards were logged, the guest runs on.
        assert "fallocate" in (child.workdir / "qemu.log").read_text(errors="replace")
        running = len(_ready_lines(child.console_log))
        await _wait_lines(child.console_log, running + 1)
    finally:
        await child.execute("balloon", {"value": guest_bytes})


@vm_test
async def test_restore_under_other_accel_is_incompatible(lab: Lab) -> None:
    assert lab.shared_snapshot is not None
    spec = replace(lab.spec, accel="kvm", memory_shared=False)
    with pytest.raises(SnapshotIncompatible, match="accel"):
        await lab.driver.restore(spec, lab.shared_snapshot, lab.root / "never")
    assert not (lab.root / "never").exists()
    other_shape = replace(lab.spec, memory_shared=False, memory_mib=512)
    with pytest.raises(SnapshotIncompatible, match="shape"):
        await lab.driver.restore(other_shape, lab.shared_snapshot, lab.root / "never")


@vm_test
async def test_restore_from_corrupt_state_leaves_nothing_running(lab: Lab) -> None:
    assert lab.shared_snapshot is not None and lab.shared_snapshot.memory_file is not None
    state = lab.shared_snapshot.state_file
    corrupt = lab.root / "corrupt.mig"
    corrupt.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    spec = lab.child_spec("corrupt", "CORRUPT", lab.shared_snapshot.memory_file, shared=False)
    snapshot = replace(lab.shared_snapshot, state_file=corrupt)
    with pytest.raises(VMMStartError, match="restoring"):
        await lab.driver.restore(spec, snapshot, lab.root / "corrupt")
    record = json.loads((lab.root / "corrupt" / "vm.json").read_text())
    assert read_cmdline(record["pid"]) == []


@vm_test
async def test_full_save_of_private_ram_then_restore(lab: Lab) -> None:
    child, spec = lab.private_child, lab.private_child_spec
    assert child is not None and spec is not None
    await _wait_lines(child.console_log, 4)
    snapshot = await child.save_state(lab.root / "snap-full")
    assert child.state is VMRunState.PAUSED
    assert snapshot.memory_file is None  # RAM is inside the stream
    assert snapshot.state_file.stat().st_size > 8 * 1024 * 1024
    token, last, _ = _ready_lines(child.console_log)[-1]
    await child.kill()
    assert read_cmdline(child.pid) == []

    # Any fresh file can back the restored RAM: it is filled from the stream.
    restored_spec = replace(spec, memory_file=lab.root / "restored.ram")
    restored = await lab.driver.restore(restored_spec, snapshot, lab.root / "restored")
    try:
        lines = await _wait_lines(restored.console_log, 2)
        assert [t for t, _, _ in lines] == [token] * len(lines)
        assert lines[0][1] == last + 1
        assert {g for _, _, g in lines} == {"CHILDA"}
    finally:
        await restored.kill()


@vm_test
async def test_a_restore_reads_the_recorded_working_set_ahead(lab: Lab) -> None:
    # A driver as the server makes it: QEMU's huge-page advice turned off by the
    # preloaded library, and working sets read ahead. The machine is restored paused,
    # so its guest touches nothing: what is in the page cache was read ahead.
    assert lab.shared_snapshot is not None and lab.shared_snapshot.memory_file is not None
    library = find_ram_advice()
    assert library is not None, "scripts/install builds agentenv-ram-advice.so"
    sets = WorkingSets(lab.root / "working-sets")
    driver = QemuDriver(ram_advice=library, working_sets=sets)
    source = lab.shared_snapshot.memory_file
    key = sets.key(source)
    assert key is not None
    recorded = {(2048, 16), (40000, 3)}  # pages the test guest never uses
    sets.directory.mkdir()
    (sets.directory / key).write_text(json.dumps({"extents": sorted(recorded)}))
    ram = lab.root / "read-ahead.ram"
    shutil.copyfile(source, ram)
    drop_from_page_cache(ram)
    wanted = {p for first, n in recorded for p in range(first, first + n)}

    def cached() -> set[int]:
        return {p for first, n in resident_extents(ram) for p in range(first, first + n)}

    assert not wanted & cached()
    spec = lab.child_spec("read-ahead", "RA", ram, shared=True)
    vm = await driver.restore(spec, lab.shared_snapshot, lab.root / "read-ahead", resume=False)
    try:
        assert vm.state is VMRunState.PAUSED
        assert str(library) in Path(f"/proc/{vm.pid}/maps").read_text()
        for _ in range(300):  # the reads run in the background: up to 30 s
            if wanted <= cached():
                break
            await asyncio.sleep(0.1)
        assert wanted <= cached()
        # Once per file: the record stays as it was.
        assert await driver.record_working_set(vm) == 0
        # A capture's image gets the machine's cached pages as its working set.
        image = lab.root / "read-ahead-image.ram"
        image.write_bytes(b"")
        assert await driver.record_working_set(vm, image) >= len(wanted) * PAGE
    finally:
        await vm.kill()


@vm_test
async def test_snapshots_restore_into_the_machine_they_were_made_on(lab: Lab) -> None:
    assert lab.shared_snapshot is not None and lab.shared_snapshot.memory_file is not None
    assert lab.shared_snapshot.meta["machine"] == MACHINE
    # A machine with the PIT, as every node made them before: restoring into it works
    # (QEMU leaves a device the stream does not mention in its reset state), and its
    # own snapshot then carries the PIT's state and says which machine it needs.
    old = replace(lab.shared_snapshot, meta={**lab.shared_snapshot.meta, "machine": "microvm"})
    spec = lab.child_spec("legacy", "LEGACY", lab.shared_snapshot.memory_file, shared=False)
    vm = await lab.driver.restore(spec, old, lab.root / "legacy")
    try:
        assert "microvm,memory-backend=mem0" in read_cmdline(vm.pid)
        await _wait_lines(vm.console_log, 1)
        legacy = await vm.save_state(lab.root / "snap-legacy")
    finally:
        await vm.kill()
    assert legacy.meta["machine"] == LEGACY_MACHINE
    token, last, _ = _ready_lines(vm.console_log)[-1]

    back_spec = replace(spec, memory_file=lab.root / "legacy-back.ram")
    # A machine without the PIT cannot take that stream; the machine it recorded can.
    wrong = replace(legacy, meta={**legacy.meta, "machine": MACHINE})
    back = await _restored_only_as_recorded(lab, "legacy", back_spec, legacy, wrong, token, last)
    try:
        assert back.machine == LEGACY_MACHINE
    finally:
        await back.kill()


@vm_test
async def test_snapshots_restore_into_the_balloon_they_were_made_with(lab: Lab) -> None:
    assert lab.shared_snapshot is not None
    # Machines that do not ask for free page reporting have the balloon all had before.
    assert lab.shared_snapshot.meta["balloon"] == LEGACY_BALLOON
    spec = replace(
        lab.child_spec("reporting", "REPORTING", lab.root / "reporting.ram", shared=True),
        report_free_pages=True,
    )
    vm = await lab.driver.boot(spec, lab.root / "reporting")
    try:
        assert vm.balloon == BALLOON
        assert BALLOON in read_cmdline(vm.pid)
        await _wait_lines(vm.console_log, 1)
        snapshot = await vm.save_state(lab.root / "snap-reporting")
    finally:
        await vm.kill()
    assert snapshot.meta["balloon"] == BALLOON
    token, last, _ = _ready_lines(vm.console_log)[-1]

    # Never into a private mapping: QEMU would punch freed pages out of a shared file.
    with pytest.raises(SnapshotIncompatible, match="privately"):
        await lab.driver.restore(
            replace(spec, memory_shared=False), snapshot, lab.root / "reporting-private"
        )
    copy = lab.root / "reporting-copy.ram"
    _run("cp", "--sparse=always", str(spec.memory_file), str(copy))
    back_spec = replace(spec, memory_file=copy, report_free_pages=False)
    # The guest negotiated free page reporting: a balloon without it cannot take the
    # stream; the balloon it recorded can (whatever the spec asks of a boot).
    wrong = replace(snapshot, meta={**snapshot.meta, "balloon": LEGACY_BALLOON})
    back = await _restored_only_as_recorded(
        lab, "reporting", back_spec, snapshot, wrong, token, last
    )
    try:
        assert back.balloon == BALLOON
    finally:
        await back.kill()


@vm_test
async def test_failed_save_rolls_back(lab: Lab) -> None:
    vm = lab.vm
    await vm.resume()
    seen = len(_ready_lines(vm.console_log))
    # A destination too small for even the device state makes the migration fail
    # part-way (ENOSPC).
    full = lab.root / "full"
    full.mkdir()
    _run("mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full))
    try:
        with pytest.raises(VMMCommandError, match="migration failed"):
            await vm.save_state(full / "snap")
        assert list((full / "snap").iterdir()) == []  # the partial file was removed
    finally:
        _run("umount", str(full))
    # Rolled back: the VM runs on as before.
    assert vm.state is VMRunState.RUNNING
    assert (await vm.execute("query-status"))["running"] is True
    await _wait_lines(vm.console_log, seen + 1)


@vm_test
async def test_kill_leaves_no_process(lab: Lab) -> None:
    vm = lab.vm
    pid = vm.pid
    await vm.kill()
    assert vm.state is VMRunState.STOPPED
    assert read_cmdline(pid) == []
    await vm.kill()  # idempotent
    with pytest.raises(VMMGone):
        await vm.stats()
    with pytest.raises(VMMGone):
        await vm.pause()
    with pytest.raises(VMMGone):
        await lab.driver.attach(vm.workdir)
    assert _our_qemu_pids(lab.root) == []


@vm_test
async def test_boot_in_network_namespace(
    guest_files: GuestFiles, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("qemu-netns")
    netns = f"aeqt{os.getpid() % 100000}"
    _run("ip", "netns", "add", netns)
    vm: QemuVM | None = None
    try:
        _run("ip", "-n", netns, "tuntap", "add", "tap0", "mode", "tap")
        rootfs = root / "root.ext4"
        shutil.copy(guest_files.rootfs, rootfs)
        spec = MachineSpec(
            vcpus=1,
            memory_mib=128,
            kernel=guest_files.kernel,
            initrd=guest_files.initrd,
            cmdline=guest_files.cmdline,
            drives=(DriveSpec("root", rootfs),),
            memory_file=root / "ram",
            memory_shared=False,
            accel="tcg",
            net=NetSpec(tap="tap0", mac="52:54:00:12:34:56", netns=netns),
        )
        vm = await QemuDriver().boot(spec, root / "vm")
        # QEMU itself (same pid: nsenter execs it) runs in the namespace, on its tap.
        assert read_cmdline(vm.pid)[0] == "qemu-system-x86_64"
        assert os.stat(f"/proc/{vm.pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
        info = await vm.execute("human-monitor-command", {"command-line": "info network"})
        assert "ifname=tap0" in info and "52:54:00:12:34:56" in info
    finally:
        if vm is not None:
            await vm.kill()
        _run("ip", "netns", "delete", netns)


def _jail_dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A data directory, a template's files and a sandbox's work directory in it."""
    data = tmp_path / "data"
    files = data / "templates" / "t"
    files.mkdir(parents=True)
    workdir = data / "sandboxes" / "s1"
    workdir.mkdir(parents=True)
    return data, files, workdir


def _file_only_confinement(tmp_path: Path, data: Path) -> Confinement:
    """A confinement whose cgroups live under ``tmp_path``: for jail trees, no VMM."""
    return Confinement(
        data_dir=data,
        id_base=2_000_000_000,
        device_gid=1_999_999_999,
        cgroups=VmmCgroups(2, "agentenv-test", (tmp_path,), ("memory", "cpu", "pids")),
        memory_overhead_mib=256,
        pids_max=512,
    )


def test_jail_tree_is_traversable_under_the_servers_umask(tmp_path: Path) -> None:
    """The server runs with umask 077 (a private data directory); the directories of a
    VMM's jail tree must still be 0711, or the unprivileged VMM cannot reach its files."""
    data, files, workdir = _jail_dirs(tmp_path)
    jail = VmmJail(_file_only_confinement(tmp_path, data), 2_000_000_001, workdir)
    spec = _plain_spec(files, memory_file=workdir / "ram")
    old = os.umask(0o077)
    try:
        jail.build(spec)
    finally:
        os.umask(old)
    directories = [jail.root, *(p for p in jail.root.rglob("*") if p.is_dir())]
    assert len(directories) > 3
    for directory in directories:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o711, directory
    linked = jail.root / os.path.relpath(spec.kernel, jail.hides)
    assert linked.samefile(spec.kernel)
    assert stat.S_IMODE(spec.kernel.stat().st_mode) == 0o640
