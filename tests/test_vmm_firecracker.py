"""Firecracker driver, against the real Firecracker v1.12.1 binary.

``scripts/install-firecracker`` puts the binary in /var/cache/agentenv/bin (cached). The
API-level tests start real Firecracker processes with a real guest kernel (Debian's cloud
kernel as an ELF vmlinux), real drives, a real tap in a throwaway network namespace and a
balloon, then pause, snapshot and load snapshots into new processes. They do not need the
guest to get anywhere: on a PVM host (``/sys/module/kvm_pvm``) the vCPU starts but no
ordinary guest kernel survives, and the one test that needs a working guest skips there.
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
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentenv.storage.clone import supports_reflink
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
    VMRunState,
)
from agentenv.vmm.firecracker import (
    API_SOCKET,
    VM_RECORD,
    FirecrackerDriver,
    FirecrackerVM,
    find_firecracker,
)
from agentenv.vmm.firecracker_binary import (
    DEFAULT_FIRECRACKER_PATH,
    FIRECRACKER_ENV,
    FIRECRACKER_SHA256,
)
from agentenv.vmm.firecracker_vm import DIFF_BASE_FILE
from agentenv.vmm.process import read_cmdline

ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = ROOT / "scripts" / "install-firecracker"
GUEST_CACHE = Path("/var/cache/agentenv/test-guest")
KERNEL_PACKAGE = "linux-image-cloud-amd64"
PVM_SKIP = (
    "Firecracker cannot boot a guest here: /dev/kvm is PVM (/sys/module/kvm_pvm exists) and "
    "no PVM-capable guest kernel is available, so any ordinary guest kernel dies under it"
)

needs_kvm = pytest.mark.skipif(
    not Path("/dev/kvm").exists(), reason="Firecracker needs /dev/kvm; this host has none"
)


# -- binary discovery (no VM) ------------------------------------------------------------


def _fake_binary(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_firecracker_prefers_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configured = _fake_binary(tmp_path / "fc")
    monkeypatch.setenv(FIRECRACKER_ENV, str(configured))
    assert find_firecracker() == configured
    # A configured path that is not executable is an error, not a reason to look elsewhere.
    configured.chmod(0o644)
    assert find_firecracker() is None


def test_find_firecracker_falls_back_to_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FIRECRACKER_ENV, raising=False)
    monkeypatch.setattr(
        "agentenv.vmm.firecracker_binary.DEFAULT_FIRECRACKER_PATH", tmp_path / "missing"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert find_firecracker() is None
    on_path = _fake_binary(tmp_path / "bin" / "firecracker")
    assert find_firecracker() == on_path


def test_driver_rejects_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="not an executable"):
        FirecrackerDriver(tmp_path / "nope")


def test_capabilities() -> None:
    assert FirecrackerDriver.disk_formats == ("raw",)
    assert FirecrackerDriver.accelerators == ("kvm",)
    assert not FirecrackerDriver.shared_memory_boot
    assert FirecrackerDriver.disk_capture is DiskCapture.COPY
    assert not FirecrackerDriver.publishes_paused_state


# -- fixtures: binary, kernel, network, leftovers -----------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _install(dest: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(INSTALL_SCRIPT), str(dest)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=True,
    )


@pytest.fixture(scope="session")
def firecracker_bin() -> Path:
    if not Path("/dev/kvm").exists():
        pytest.skip("Firecracker needs /dev/kvm; this host has none")
    _install(DEFAULT_FIRECRACKER_PATH)  # a no-op when the cached binary is right
    return DEFAULT_FIRECRACKER_PATH


def _extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    # Debian's cloud kernel is an LZ4 (legacy frame) bzImage; Firecracker wants the ELF.
    blob = vmlinuz.read_bytes()
    start = blob.find(b"\x02\x21\x4c\x18")
    assert start >= 0, f"no LZ4 frame in {vmlinuz}"
    with open(out, "wb") as f:
        subprocess.run(["lz4", "-dc"], input=blob[start:], stdout=f, check=False)
    assert out.read_bytes()[:4] == b"\x7fELF", f"{out} is not an ELF image"


def _run(*argv: str, cwd: Path) -> str:
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True).stdout


def _download_kernel(dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest) as scratch_name:
        scratch = Path(scratch_name)
        _run("apt-get", "download", KERNEL_PACKAGE, cwd=scratch)
        meta = next(scratch.glob(f"{KERNEL_PACKAGE}_*.deb"))
        depends = _run("dpkg-deb", "-f", str(meta), "Depends", cwd=scratch)
        image = re.search(r"linux-image-[0-9][^\s,]*", depends)
        assert image, depends
        _run("apt-get", "download", image.group(0), cwd=scratch)
        deb = next(scratch.glob(f"{image.group(0)}_*.deb"))
        _run("dpkg-deb", "-x", str(deb), "pkg", cwd=scratch)
        vmlinuz = next((scratch / "pkg" / "boot").glob("vmlinuz-*"))
        _extract_vmlinux(vmlinuz, scratch / "vmlinux")
        os.replace(scratch / "vmlinux", dest / "vmlinux")


@pytest.fixture(scope="session")
def guest_kernel() -> Path:
    """An ELF vmlinux: the QEMU tests' cached test-guest kernel if there is one, else
    Debian's cloud kernel extracted into the same cache."""
    for candidate in sorted(GUEST_CACHE.glob("*/vmlinux")):
        with open(candidate, "rb") as f:
            if f.read(4) == b"\x7fELF":
                return candidate
    dest = GUEST_CACHE / "firecracker-kernel"
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "vmlinux").exists():
            _download_kernel(dest)
    return dest / "vmlinux"


@pytest.fixture
def netns() -> Iterator[str]:
    """A throwaway network namespace holding taps ``fctap0`` and ``fctap1``."""
    name = f"aefc-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for tap in ("fctap0", "fctap1"):
            subprocess.run(["ip", "-n", name, "tuntap", "add", tap, "mode", "tap"], check=True)
            subprocess.run(["ip", "-n", name, "link", "set", tap, "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _firecracker_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            argv = read_cmdline(int(entry.name))
            if argv and "firecracker" in argv[0] and any(marker in a for a in argv):
                pids.append(int(entry.name))
    return pids


@pytest.fixture
def workroot(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, checked afterwards for Firecracker processes left running (which
    are killed, and fail the test)."""
    yield tmp_path
    leftovers = _firecracker_pids(str(tmp_path))
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert not leftovers, f"Firecracker processes left running: {leftovers}"


@pytest.fixture
def driver(firecracker_bin: Path) -> FirecrackerDriver:
    return FirecrackerDriver(firecracker_bin)


def _raw_file(path: Path, size: int, fill: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(fill)
        f.truncate(size)
    return path


def _spec(root: Path, guest_kernel: Path, **changes: object) -> MachineSpec:
    rootfs = _raw_file(root / "rootfs.raw", 64 << 20)
    tools = _raw_file(root / "tools.raw", 1 << 20)
    spec = MachineSpec(
        vcpus=1,
        memory_mib=128,
        kernel=guest_kernel,
        cmdline="console=ttyS0 root=/dev/vda rw",
        drives=(DriveSpec("rootfs", rootfs), DriveSpec("tools", tools, read_only=True)),
        memory_file=root / "unused-ram",
        memory_shared=False,
        accel="kvm",
    )
    return replace(spec, **changes)  # type: ignore[arg-type]


@pytest.fixture
async def vms() -> AsyncIterator[list[FirecrackerVM]]:
    """Collects machines a test starts, and kills whatever is still running at the end."""
    started: list[FirecrackerVM] = []
    yield started
    for vm in started:
        await vm.kill()


def _state(vm: FirecrackerVM) -> VMRunState:
    # A call, so that the type checker does not carry a narrowed state across awaits.
    return vm.state


def _open_files(pid: int) -> set[str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    files = set()
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            files.add(os.readlink(fd))
    return files


# -- install script -------------------------------------------------------------------------


@needs_kvm
def test_install_script_is_cached_and_repairs(firecracker_bin: Path, tmp_path: Path) -> None:
    assert _sha256(firecracker_bin) == FIRECRACKER_SHA256
    mtime = firecracker_bin.stat().st_mtime_ns
    again = _install(firecracker_bin)
    assert again.stdout == "" and firecracker_bin.stat().st_mtime_ns == mtime
    # A wrong binary at the destination is replaced by the verified one.
    broken = tmp_path / "bin" / "firecracker"
    broken.parent.mkdir()
    broken.write_bytes(b"not firecracker")
    _install(broken)
    assert _sha256(broken) == FIRECRACKER_SHA256 and os.access(broken, os.X_OK)
    version = subprocess.run([str(broken), "--version"], capture_output=True, text=True)
    assert "Firecracker v1.12.1" in version.stdout


# -- spec validation (no process is started) ------------------------------------------------


@needs_kvm
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"accel": "tcg"}, "runs only on KVM"),
        ({"memory_shared": True}, "shared file"),
        ({"drives": (DriveSpec("rootfs", Path("/dev/null"), fmt="qcow2"),)}, "raw view"),
        ({"drives": (DriveSpec("root-fs", Path("/dev/null")),)}, "underscores only"),
        ({"drives": (DriveSpec("rootfs", Path("/nonexistent")),)}, "not a file"),
        ({"kernel": Path("/nonexistent/vmlinux")}, "kernel"),
        ({"net": NetSpec("tap0", "52:54:00:00:00:02", "aefc-no-such-ns")}, "does not exist"),
    ],
)
async def test_boot_rejects_bad_spec(
    driver: FirecrackerDriver,
    guest_kernel: Path,
    workroot: Path,
    changes: dict[str, object],
    message: str,
) -> None:
    spec = _spec(workroot, guest_kernel, **changes)
    with pytest.raises(VMMStartError, match=message):
        await driver.boot(spec, workroot / "w")
    assert not (workroot / "w").exists()


@needs_kvm
async def test_process_that_dies_at_start_is_reported(guest_kernel: Path, workroot: Path) -> None:
    # /bin/false stands in for a Firecracker that exits at once (bad flag, seccomp, ...).
    with pytest.raises(VMMStartError, match="exited while starting"):
        await FirecrackerDriver(Path("/bin/false")).boot(
            _spec(workroot, guest_kernel), workroot / "w"
        )
    assert not (workroot / "w" / VM_RECORD).exists()


@needs_kvm
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns)")
async def test_started_in_netns_through_launch_seam(workroot: Path, netns: str) -> None:
    # A stand-in Firecracker records where it runs, then exits: no guest kernel needed.
    fake = workroot / "fake-firecracker"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "$$ $(readlink /proc/self/ns/net) $(readlink /proc/self/ns/mnt)" > where\n'
        "exit 1\n"
    )
    fake.chmod(0o755)
    kernel = _raw_file(workroot / "vmlinux", 4096)
    spec = _spec(workroot, kernel, net=NetSpec("fctap0", "52:54:00:12:34:56", netns))
    with pytest.raises(VMMStartError, match="exited while starting"):
        await FirecrackerDriver(fake).boot(spec, workroot / "w")
    _, net_ns, mnt_ns = (workroot / "w" / "where").read_text().split()
    assert net_ns == f"net:[{os.stat(f'/run/netns/{netns}').st_ino}]"
    # nsenter, unlike `ip netns exec`, leaves the mount namespace alone.
    assert mnt_ns == os.readlink("/proc/self/ns/mnt")


@needs_kvm
async def test_restore_rejects_foreign_snapshot(
    driver: FirecrackerDriver, guest_kernel: Path, workroot: Path
) -> None:
    spec = _spec(workroot, guest_kernel)
    snap = SnapshotFiles("qemu", "kvm", workroot / "s", workroot / "m", spec.shape())
    with pytest.raises(SnapshotIncompatible, match="qemu"):
        await driver.restore(spec, snap, workroot / "w")
    snap = replace(snap, driver="firecracker", shape={**spec.shape(), "vcpus": 2})
    with pytest.raises(SnapshotIncompatible, match="shape"):
        await driver.restore(spec, snap, workroot / "w")


# -- real processes ------------------------------------------------------------------------


@pytest.mark.vm
async def test_boot_configures_everything_and_starts(
    driver: FirecrackerDriver,
    guest_kernel: Path,
    workroot: Path,
    netns: str,
    vms: list[FirecrackerVM],
) -> None:
    net = NetSpec("fctap0", "52:54:00:12:34:56", netns)
    spec = _spec(workroot, guest_kernel, net=net)
    vm = await driver.boot(spec, workroot / "w")
    vms.append(vm)
    assert vm.state is VMRunState.RUNNING
    assert (await vm.describe())["state"] == "Running"
    assert read_cmdline(vm.pid)[0] == str(driver.binary)  # nsenter exec'd into it
    vm_ns, test_ns = os.stat(f"/proc/{vm.pid}/ns/net"), os.stat(f"/run/netns/{netns}")
    assert (vm_ns.st_dev, vm_ns.st_ino) == (test_ns.st_dev, test_ns.st_ino)

    config = await vm.call("GET", "/vm/config")
    assert config["machine-config"]["vcpu_count"] == 1
    assert config["machine-config"]["mem_size_mib"] == 128
    assert config["boot-source"]["kernel_image_path"] == str(guest_kernel.resolve())
    assert config["boot-source"]["boot_args"].startswith("console=ttyS0 root=/dev/vda rw ")
    assert "pci=off" in config["boot-source"]["boot_args"]
    drives = {d["drive_id"]: d for d in config["drives"]}
    assert list(drives) == ["rootfs", "tools"]
    assert drives["rootfs"]["path_on_host"] == "drives/rootfs"
    assert drives["tools"]["is_read_only"] is True
    assert config["network-interfaces"] == [
        {
            "iface_id": "eth0",
            "host_dev_name": "fctap0",
            "guest_mac": "52:54:00:12:34:56",
            "rx_rate_limiter": None,
            "tx_rate_limiter": None,
        }
    ]
    assert config["balloon"]["amount_mib"] == 0 and config["balloon"]["deflate_on_oom"]
    opened = _open_files(vm.pid)
    assert str(spec.drives[0].path.resolve()) in opened
    assert "/dev/net/tun" in opened

    stats = await vm.stats()
    assert stats.pid == vm.pid and stats.state is VMRunState.RUNNING
    assert stats.rss_bytes > 0 and stats.pss_bytes > 0

    record = json.loads((workroot / "w" / VM_RECORD).read_text())
    assert record["pid"] == vm.pid and record["shape"] == spec.shape()

    await vm.pause()
    assert _state(vm) is VMRunState.PAUSED
    assert (await vm.describe())["state"] == "Paused"
    await vm.resume()
    assert (await vm.describe())["state"] == "Running"

    # Firecracker's refusals come back with its fault message.
    with pytest.raises(VMMCommandError, match="not supported after starting"):
        await vm.call("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 128})

    await vm.kill()
    assert _state(vm) is VMRunState.STOPPED
    assert read_cmdline(vm.pid) == []
    assert not (workroot / "w" / API_SOCKET).exists()
    with pytest.raises(VMMGone):
        await vm.pause()
    await vm.kill()  # idempotent


@pytest.mark.vm
async def test_snapshot_and_restore_with_new_drives_and_tap(
    driver: FirecrackerDriver,
    guest_kernel: Path,
    workroot: Path,
    netns: str,
    vms: list[FirecrackerVM],
) -> None:
    spec = _spec(workroot, guest_kernel, net=NetSpec("fctap0", "52:54:00:12:34:56", netns))
    vm = await driver.boot(spec, workroot / "w1")
    vms.append(vm)

    snap = await vm.save_state(workroot / "snap")
    assert vm.state is VMRunState.PAUSED  # save_state leaves it paused
    assert snap.driver == "firecracker" and snap.accel == "kvm"
    assert snap.shape == spec.shape()
    assert snap.meta["firecracker_version"] == "1.12.1"
    assert snap.state_file == (workroot / "snap" / "state.fc").resolve()
    assert snap.memory_file is not None
    assert snap.state_file.stat().st_size > 0
    assert snap.memory_file.stat().st_size == 128 << 20
    assert sorted(p.name for p in (workroot / "snap").iterdir()) == ["memory.fc", "state.fc"]
    assert SnapshotFiles.from_json(snap.to_json()) == snap
    await vm.kill()

    # The snapshotted drives go away; the restore names new ones and another tap.
    for drive in spec.drives:
        drive.path.rename(drive.path.with_suffix(".old"))
    other = workroot / "other"
    other.mkdir()
    new_spec = replace(
        _spec(other, guest_kernel),
        net=NetSpec("fctap1", "52:54:00:12:34:56", netns),
    )
    ram_image = _sha256(snap.memory_file)
    paused = await driver.restore(new_spec, snap, workroot / "w2", resume=False)
    vms.append(paused)
    assert paused.state is VMRunState.PAUSED
    assert (await paused.describe())["state"] == "Paused"
    opened = _open_files(paused.pid)
    assert str(new_spec.drives[0].path.resolve()) in opened
    assert str(new_spec.drives[1].path.resolve()) in opened
    assert not any(name.endswith(".old") for name in opened)
    assert str(snap.memory_file) in opened
    config = await paused.call("GET", "/vm/config")
    assert config["network-interfaces"][0]["host_dev_name"] == "fctap1"
    await paused.resume()
    assert (await paused.describe())["state"] == "Running"

    # The RAM image is mapped copy-on-write: loading twice from it works, and it is unchanged.
    # Asked to map it shared, as the orchestrator's resume of a pause's own image asks, a
    # restore maps it privately all the same.
    same_tap = replace(  # the snapshotted tap, free again
        new_spec, net=spec.net, memory_file=snap.memory_file, memory_shared=True
    )
    running = await driver.restore(same_tap, snap, workroot / "w3", resume=True)
    vms.append(running)
    assert running.state is VMRunState.RUNNING
    assert (await running.describe())["state"] == "Running"

    # A snapshot can be taken again from a restored machine.
    again = await running.save_state(workroot / "snap2")
    assert again.state_file.stat().st_size > 0

    await paused.kill()
    await running.kill()
    assert read_cmdline(paused.pid) == [] and read_cmdline(running.pid) == []
    assert _sha256(snap.memory_file) == ram_image


@pytest.mark.vm
async def test_diff_snapshot_over_the_previous_image_equals_a_full_one(
    driver: FirecrackerDriver,
    guest_kernel: Path,
    test_root: Path,
    vms: list[FirecrackerVM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = Path(tempfile.mkdtemp(prefix="fc-diff-", dir=test_root))
    if not supports_reflink(root):
        pytest.skip(f"{root} cannot reflink (scripts/test puts AENV_TEST_DIR on XFS)")
    spec = _spec(root, guest_kernel)
    vm = await driver.boot(spec, root / "w1")
    vms.append(vm)
    first = await vm.save_state(root / "a")
    await vm.kill()
    assert first.memory_file is not None
    first_image = _sha256(first.memory_file)

    restored = await driver.restore(spec, first, root / "w2")
    vms.append(restored)
    kinds: list[str] = []
    call = restored.call

    async def spied(method: str, path: str, body: dict[str, Any] | None = None, **kw: Any) -> Any:
        if path == "/snapshot/create" and body is not None:
            kinds.append(body["snapshot_type"])
        return await call(method, path, body, **kw)

    monkeypatch.setattr(restored, "call", spied)
    await asyncio.sleep(1)  # the guest runs on, where it can, and writes to its RAM
    # Only the pages written since the restore, over a reflink of the restored image.
    diff = await restored.save_state(root / "b")
    assert diff.memory_file is not None
    diff_image = _sha256(diff.memory_file)
    # The machine keeps its own reflink of the image its dirty pages count from: the
    # image itself may go (a pause's does once the sandbox resumed). It stayed paused, so
    # every later image holds the same RAM.
    diff.memory_file.unlink()
    again = await restored.save_state(root / "c")
    assert again.memory_file is not None and _sha256(again.memory_file) == diff_image
    assert kinds == ["Diff", "Diff"]
    # Without that reflink the next snapshot writes everything.
    (root / "w2" / DIFF_BASE_FILE).unlink()
    full = await restored.save_state(root / "d")
    assert full.memory_file is not None and _sha256(full.memory_file) == diff_image
    assert kinds == ["Diff", "Diff", "Full"]
    assert _sha256(first.memory_file) == first_image  # the restore's image is untouched
    # A re-adopted handle (a server restart) knows its base from the machine's record.
    await restored.close()
    adopted = await driver.attach(root / "w2")
    vms.append(adopted)
    call = adopted.call
    monkeypatch.setattr(adopted, "call", spied)
    after = await adopted.save_state(root / "e")
    assert after.memory_file is not None and _sha256(after.memory_file) == diff_image
    assert kinds == ["Diff", "Diff", "Full", "Diff"]
    await adopted.kill()


@pytest.mark.vm
async def test_failed_snapshot_leaves_nothing_and_resumes(
    driver: FirecrackerDriver, guest_kernel: Path, workroot: Path, vms: list[FirecrackerVM]
) -> None:
    vm = await driver.boot(_spec(workroot, guest_kernel), workroot / "w")
    vms.append(vm)
    # A 1 MiB tmpfs cannot hold 128 MiB of RAM: Firecracker fails the write part-way.
    small = workroot / "small"
    small.mkdir()
    _run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small), cwd=workroot)
    try:
        with pytest.raises(VMMCommandError, match="snapshot/create"):
            await vm.save_state(small)
        assert list(small.iterdir()) == []
    finally:
        _run("umount", str(small), cwd=workroot)
    assert vm.state is VMRunState.RUNNING
    assert (await vm.describe())["state"] == "Running"
    await vm.kill()


@pytest.mark.vm
async def test_close_then_attach(
    driver: FirecrackerDriver, guest_kernel: Path, workroot: Path, vms: list[FirecrackerVM]
) -> None:
    vm = await driver.boot(_spec(workroot, guest_kernel), workroot / "w")
    vms.append(vm)
    await vm.pause()
    await vm.close()
    assert read_cmdline(vm.pid)  # close leaves the process alone

    adopted = await driver.attach(workroot / "w")
    vms.append(adopted)
    assert adopted.pid == vm.pid
    # The orchestrator reads an adopted VM's spec like a started one's.
    assert adopted.spec == vm.spec
    assert adopted.state is VMRunState.PAUSED
    await adopted.resume()
    assert (await adopted.describe())["state"] == "Running"
    # Stop: the guest cannot act on Ctrl+Alt+Del here, so this ends in the kill.
    await adopted.stop(timeout=0.5)
    assert _state(adopted) is VMRunState.STOPPED
    assert read_cmdline(vm.pid) == []
    with pytest.raises(VMMGone):
        await driver.attach(workroot / "w")


@needs_kvm
async def test_attach_rejects_reused_pid(driver: FirecrackerDriver, workroot: Path) -> None:
    workdir = workroot / "w"
    workdir.mkdir()
    with pytest.raises(VMMGone):
        await driver.attach(workdir)
    # A record pointing at a live process that is not this Firecracker.
    record = {"pid": os.getpid(), "api_socket": str(workdir / API_SOCKET), "shape": {}}
    (workdir / VM_RECORD).write_text(json.dumps(record))
    with pytest.raises(VMMGone):
        await driver.attach(workdir)


# -- needs a guest that actually runs -------------------------------------------------------

# An initramfs-only guest: prints a token drawn at boot (held in guest RAM) and a counter
# once a second, so a restored console shows the same boot continuing.
CONSOLE_INIT = """#!/bin/sh
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
token=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n')
n=0
while true; do echo "READY $token $n"; n=$((n+1)); sleep 1; done
"""


def _console_initrd(dest: Path) -> Path:
    root = dest / "initrd"
    for sub in ("bin", "dev", "proc"):
        (root / sub).mkdir(parents=True)
    shutil.copy("/usr/bin/busybox", root / "bin" / "busybox")  # busybox-static
    for applet in ("sh", "mount", "head", "od", "tr", "sleep"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "init").write_text(CONSOLE_INIT)
    (root / "init").chmod(0o755)
    files = subprocess.run(["find", "."], cwd=root, capture_output=True, check=True).stdout
    cpio = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet"],
        cwd=root,
        input=files,
        capture_output=True,
        check=True,
    ).stdout
    out = dest / "initrd.cpio.gz"
    out.write_bytes(
        subprocess.run(["gzip", "-1"], input=cpio, capture_output=True, check=True).stdout
    )
    return out


@pytest.mark.vm
async def test_guest_runs_and_continues_after_restore(
    driver: FirecrackerDriver, guest_kernel: Path, workroot: Path, vms: list[FirecrackerVM]
) -> None:
    if Path("/sys/module/kvm_pvm").exists():
        pytest.skip(PVM_SKIP)
    spec = _spec(
        workroot,
        guest_kernel,
        memory_mib=256,
        initrd=_console_initrd(workroot),
        cmdline="console=ttyS0 rdinit=/init",
    )
    vm = await driver.boot(spec, workroot / "w1")
    vms.append(vm)
    first = await _wait_console(vm.workdir / "console.log", r"READY (\w+) ([1-9]\d*)", 60)
    snap = await vm.save_state(workroot / "snap")
    await vm.kill()

    restored = await driver.restore(spec, snap, workroot / "w2")
    vms.append(restored)
    # Same boot (token) and a counter that went on rather than restarting at 0.
    again = await _wait_console(
        restored.workdir / "console.log", rf"READY {first.group(1)} (\d+)", 30
    )
    assert int(again.group(1)) > int(first.group(2))
    await restored.kill()


async def _wait_console(path: Path, pattern: str, limit_s: float) -> re.Match[str]:
    deadline = time.monotonic() + limit_s
    regex = re.compile(pattern)
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if match := regex.search(text):
            return match
        await asyncio.sleep(0.1)
    raise AssertionError(f"{pattern!r} not on the console within {limit_s}s:\n{text[-2000:]}")
