"""Firecracker under its jailer (agentenv/vmm/firecracker_jail.py).

Unit tests build the jailer's command line and lay out chroots without starting anything.
The process tests start the real jailer and Firecracker v1.12.1 (``scripts/install-
firecracker`` caches both) and read what confines the VMM from ``/proc``: its uid and gid,
its cgroup and the limits in it, its root directory, its seccomp filters, its OOM bias;
then snapshot, restore and re-attach it. The guest kernel never gets far on a PVM host,
but the VMM process is built and runs there (see tests/test_vmm_firecracker.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv import server
from agentenv.config import Config
from agentenv.vmm.base import DriveSpec, MachineSpec, NetSpec, VMMGone, VMRunState
from agentenv.vmm.cgroups import CgroupLimits, VmmCgroups
from agentenv.vmm.confine import Confinement, id_block
from agentenv.vmm.console import CONSOLE_LIMIT_BYTES
from agentenv.vmm.firecracker import VM_RECORD, FirecrackerDriver, FirecrackerVM
from agentenv.vmm.firecracker_binary import JAILER_SHA256, find_jailer
from agentenv.vmm.firecracker_jail import (
    SHORT_SOCKET_DIR,
    FirecrackerJail,
    cgroup_arguments,
    host_socket_path,
)
from agentenv.vmm.launch import Bind
from tests import test_vmm_firecracker as fc_tests

# The Firecracker tests' fixtures: the cached binaries, a guest kernel, a network
# namespace with taps, a work root checked for leftovers, machines killed at the end.
firecracker_bin = fc_tests.firecracker_bin
guest_kernel = fc_tests.guest_kernel
netns = fc_tests.netns
workroot = fc_tests.workroot
vms = fc_tests.vms

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, cgroups)")
DEVICE_GID = 1_000_000_000  # Config.vmm_id_base's default: the group the host's devices have
TAG = "9e1"  # a server block of its own, apart from other test runs' servers
V1 = VmmCgroups(
    1,
    "agentenv-t",
    tuple(Path("/sys/fs/cgroup") / h for h in ("memory", "cpu", "pids", "blkio")),
    ("memory", "cpu", "pids", "io"),
)
V2 = VmmCgroups(2, "agentenv-t", (Path("/sys/fs/cgroup"),), ("memory", "cpu", "pids", "io"))
LIMITS = CgroupLimits(memory_bytes=384 << 20, cpus=2, pids=512)


def _confinement(data_dir: Path, cgroups: VmmCgroups) -> Confinement:
    return Confinement(
        data_dir=data_dir,
        id_base=id_block(DEVICE_GID, TAG),
        device_gid=DEVICE_GID,
        cgroups=cgroups,
        memory_overhead_mib=256,
        pids_max=512,
    )


def _machine(root: Path, kernel: Path, **changes: object) -> MachineSpec:
    for name in ("rootfs", "tools"):
        with open(root / f"{name}.raw", "wb") as f:
            f.truncate(1 << 20)
    spec = MachineSpec(
        vcpus=2,
        memory_mib=128,
        kernel=kernel,
        cmdline="console=ttyS0",
        drives=(
            DriveSpec("rootfs", root / "rootfs.raw"),
            DriveSpec("tools", root / "tools.raw", read_only=True),
        ),
        memory_file=root / "unused-ram",
        memory_shared=False,
        accel="kvm",
    )
    return replace(spec, **changes)  # type: ignore[arg-type]


def _options(argv: list[str]) -> list[tuple[str, str]]:
    """``--option value`` pairs of the jailer's own part of ``argv``."""
    own = argv[argv.index("--id") : argv.index("--", argv.index("--id"))]
    return list(zip(own[::2], own[1::2], strict=True))


# -- command line (no process) -------------------------------------------------------------


def test_cgroup_arguments_follow_the_hosts_version() -> None:
    assert cgroup_arguments(V2, LIMITS) == [
        "--cgroup-version", "2", "--parent-cgroup", "agentenv-t",
        "--cgroup", f"memory.max={384 << 20}",
        "--cgroup", "memory.oom.group=1",
        "--cgroup", "cpu.max=200000 100000",
        "--cgroup", "pids.max=512",
        "--cgroup", "io.weight=default 100",
    ]  # fmt: skip
    assert cgroup_arguments(V1, LIMITS) == [
        "--cgroup-version", "1", "--parent-cgroup", "agentenv-t",
        "--cgroup", f"memory.limit_in_bytes={384 << 20}",
        "--cgroup", "cpu.cfs_period_us=100000",
        "--cgroup", "cpu.cfs_quota_us=200000",
        "--cgroup", "pids.max=512",
        "--cgroup", "blkio.weight=500",
    ]  # fmt: skip
    no_io = replace(V2, controllers=("memory", "cpu", "pids"))
    assert not any("io.weight" in a for a in cgroup_arguments(no_io, LIMITS))


def test_jailer_argv(tmp_path: Path) -> None:
    confinement = _confinement(tmp_path, V1)
    workdir = tmp_path / "sandboxes" / "s1" / "vm"
    spec = _machine(
        tmp_path, tmp_path / "vmlinux", net=NetSpec("tap0", "52:54:00:00:00:01", "ns-7")
    )
    jail = FirecrackerJail(confinement, Path("/opt/jailer"), Path("/opt/firecracker"), workdir)
    argv = jail.argv(spec, ["--api-sock", "/run/fc.sock"])
    assert argv[0] == "/opt/jailer"
    options = _options(argv)
    assert options[:6] == [
        ("--id", VmmCgroups.name_for(workdir)),
        ("--exec-file", "/opt/firecracker"),
        ("--uid", str(confinement.id_base + 1 + 7)),
        ("--gid", str(confinement.id_base)),
        ("--chroot-base-dir", str(tmp_path / "sandboxes" / "s1" / ".jail-vm")),
        ("--cgroup-version", "1"),
    ]
    assert ("--cgroup", "cpu.cfs_quota_us=200000") in options
    assert ("--cgroup", f"memory.limit_in_bytes={(128 + 256) << 20}") in options
    assert ("--resource-limit", "no-file=2048") in options
    # The server keeps the child's pid: no daemon, no pid namespace.
    assert "--daemonize" not in argv and "--new-pid-ns" not in argv
    assert argv[-3:] == ["--", "--api-sock", "/run/fc.sock"]
    assert jail.root == workdir.parent / ".jail-vm" / "firecracker" / jail.jail_id / "root"
    assert jail.markers() == ["/run/fc.sock", jail.jail_id]


def test_long_socket_paths_go_through_a_short_link(tmp_path: Path) -> None:
    short = tmp_path / "root" / "run" / "fc.sock"
    assert host_socket_path(short, tmp_path) == short
    long = Path("/" + "d" * 120) / "fc.sock"
    link = host_socket_path(long, tmp_path / "w")
    assert link.parent == SHORT_SOCKET_DIR and len(str(link)) < 107
    assert link == host_socket_path(long, tmp_path / "w")  # found again after a restart


# -- chroot layout (no process) ------------------------------------------------------------


def _mode(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@needs_root
def test_chroot_holds_hard_links_with_the_vmms_ownership(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "vm").mkdir(parents=True)
    kernel = tmp_path / "cache" / "vmlinux"  # outside the data directory, world-readable
    kernel.parent.mkdir()
    kernel.write_bytes(b"kernel")
    kernel.chmod(0o644)
    state, memory = data / "snap" / "state.fc", data / "snap" / "memory.fc"
    state.parent.mkdir()
    state.write_bytes(b"state")
    memory.write_bytes(b"ram")
    confinement = _confinement(data, replace(V1, roots=(tmp_path / "cg",)))
    spec = _machine(data, kernel)
    jail = FirecrackerJail(confinement, Path("/j"), Path("/f/firecracker"), data / "vm")
    (data / "vm" / "fc.log").write_bytes(b"old")
    binds = jail.build(spec, (state, memory))
    assert binds == ()
    uid, gid = confinement.uid_for(spec), confinement.gid
    root = jail.root
    placed = {
        "boot/vmlinux": kernel,
        "drives/rootfs": spec.drives[0].path,
        "drives/tools": spec.drives[1].path,
        "snapshot-in/state.fc": state,
        "snapshot-in/memory.fc": memory,
        "fc.log": data / "vm" / "fc.log",
    }
    for inside, source in placed.items():
        assert (root / inside).stat().st_ino == source.stat().st_ino, inside
    assert sorted(p.name for p in root.iterdir()) == [
        "boot", "drives", "fc.log", "run", "snapshot-in", "snapshot-out"
    ]  # fmt: skip
    # Written by the VMM: its own. Read only: root's, its group's to read. Outside the
    # data directory and world-readable: left as it was.
    assert _mode(spec.drives[0].path) == (uid, gid, 0o600)
    assert _mode(data / "vm" / "fc.log") == (uid, gid, 0o600)
    assert (data / "vm" / "fc.log").read_bytes() == b""
    for source in (spec.drives[1].path, state, memory):
        assert _mode(source) == (0, gid, 0o640)
    assert _mode(kernel) == (0, 0, 0o644)
    for name in ("run", "snapshot-out"):
        assert _mode(root / name) == (uid, gid, 0o700)
    for directory in (jail.base, root.parent, root.parent.parent, root / "drives", root / "boot"):
        assert _mode(directory) == (0, 0, 0o711)

    # A second build starts from scratch; cleanup leaves nothing but the sources.
    assert jail.build(spec) == () and not (root / "snapshot-in").exists()
    jail.cleanup(0)
    assert not jail.base.exists() and state.exists() and kernel.read_bytes() == b"kernel"


@needs_root
def test_files_on_another_filesystem_are_bind_mounted(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "vm").mkdir(parents=True)
    shm = Path("/dev/shm") / f"aenv-jail-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    try:
        kernel = shm / "vmlinux"
        kernel.write_bytes(b"kernel")
        disk = shm / "disk.raw"
        disk.write_bytes(b"disk")
        spec = replace(_machine(data, kernel), drives=(DriveSpec("rootfs", disk),))
        confinement = _confinement(data, replace(V1, roots=(tmp_path / "cg",)))
        jail = FirecrackerJail(confinement, Path("/j"), Path("/f/firecracker"), data / "vm")
        binds = jail.build(spec)
        assert binds == (
            Bind(kernel, jail.root / "boot" / "vmlinux", read_only=True),
            Bind(disk, jail.root / "drives" / "rootfs", read_only=False),
        )
        assert all(b.target.is_file() for b in binds)  # mount points
        jail.cleanup(0)
    finally:
        shutil.rmtree(shm)


@needs_root
def test_export_moves_a_snapshot_file_out(tmp_path: Path) -> None:
    confinement = _confinement(tmp_path, V1)
    jail = FirecrackerJail(confinement, Path("/j"), Path("/f/firecracker"), tmp_path / "vm")
    made = tmp_path / "made"
    made.write_bytes(b"x")
    os.chown(made, 12345, 12345)
    jail.export(made, tmp_path / "dest")
    assert not made.exists() and _mode(tmp_path / "dest") == (0, 0, 0o600)


# -- the real jailer ------------------------------------------------------------------------


def test_install_script_installs_the_jailer(firecracker_bin: Path) -> None:
    jailer = find_jailer(firecracker_bin)
    assert jailer == firecracker_bin.parent / "jailer"
    assert fc_tests._sha256(jailer) == JAILER_SHA256
    version = subprocess.run([str(jailer), "--version"], capture_output=True, text=True)
    assert "Jailer v1.12.1" in version.stdout


def test_confine_vmm_puts_firecracker_under_the_jailer(
    firecracker_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One setting confines both drivers: the server's Firecracker driver gets the
    node's confinement and the jailer beside the binary, and refuses to start without
    one."""
    config = Config.load(env={}, home=tmp_path / "home")
    confinement = _confinement(tmp_path, V1)
    monkeypatch.setattr(server, "vmm_confinement", lambda _config: confinement)
    driver = server.firecracker_driver(config, firecracker_bin)
    assert driver.confinement is confinement
    assert driver.jailer == firecracker_bin.parent / "jailer"
    assert driver.console_limit == config.console_log_bytes
    alone = tmp_path / "bin" / "firecracker"
    alone.parent.mkdir()
    alone.symlink_to(firecracker_bin)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(server.NodeSetupError, match="no jailer next to"):
        server.firecracker_driver(config, alone)
    monkeypatch.setattr(server, "vmm_confinement", lambda _config: None)
    assert server.firecracker_driver(config, alone).confinement is None


@pytest.fixture
def confinement(workroot: Path) -> Iterator[Confinement]:
    parent = f"agentenv-test-{uuid.uuid4().hex[:8]}"
    confinement = _confinement(workroot, VmmCgroups.detect(parent))
    confinement.prepare_host()
    yield confinement
    confinement.cgroups.reclaim()
    for path in confinement.cgroups.parents():
        path.rmdir()


@pytest.fixture
def jailed(firecracker_bin: Path, confinement: Confinement) -> FirecrackerDriver:
    jailer = find_jailer(firecracker_bin)
    assert jailer is not None
    return FirecrackerDriver(firecracker_bin, confinement=confinement, jailer=jailer)


def _append(path: Path, size: int) -> None:
    with open(path, "ab") as f:
        f.write(b"x" * size)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _cgroup_paths(pid: int) -> dict[str, str]:
    """Controller -> cgroup path of ``pid`` (v2: the key is '')."""
    paths = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path
    return paths


def _seccomp(pid: int) -> dict[str, str]:
    """Seccomp mode of each thread of ``pid``, by thread name."""
    return {
        (task / "comm").read_text().strip(): _status(int(task.name))["Seccomp"]
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


@pytest.mark.vm
async def test_jailed_vmm_runs_as_its_uid_in_its_cgroup_chroot_and_seccomp(
    jailed: FirecrackerDriver,
    confinement: Confinement,
    guest_kernel: Path,
    workroot: Path,
    netns: str,
    vms: list[FirecrackerVM],
) -> None:
    spec = _machine(workroot, guest_kernel, net=NetSpec("fctap0", "52:54:00:12:34:56", netns))
    workdir = workroot / "w"
    vm = await jailed.boot(spec, workdir)
    vms.append(vm)
    pid = vm.pid
    jail = FirecrackerJail(confinement, Path("/unused"), jailed.binary, workdir.resolve())

    # The API answers through the socket in the chroot; the jailer gave Firecracker its id.
    info = await vm.describe()
    assert info["id"] == jail.jail_id and info["state"] == "Running"
    assert (jail.root / "run" / "fc.sock").is_socket()

    # Its uid and gid, no groups, no capabilities, no_new_privs, the OOM killer's first pick.
    status = _status(pid)
    uid, gid = str(confinement.uid_for(spec)), str(confinement.gid)
    assert status["Uid"].split() == [uid] * 4 and status["Gid"].split() == [gid] * 4
    assert status["Groups"] == ""
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert status["NoNewPrivs"] == "1"
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"

    # Chrooted: its root directory is the chroot (readlink shows "/", the root of its own
    # mount namespace), holding only what it needs; and it is the pid the launch returned.
    assert os.readlink(f"/proc/{pid}/root") == "/"
    assert os.stat(f"/proc/{pid}/root/").st_ino == jail.root.stat().st_ino
    assert sorted(os.listdir(f"/proc/{pid}/root/")) == [
        "boot", "dev", "drives", "fc.log", "firecracker", "firecracker.pid", "run",
        "snapshot-out",
    ]  # fmt: skip
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"/firecracker"
    assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    net_ns, test_ns = os.stat(f"/proc/{pid}/ns/net"), os.stat(f"/run/netns/{netns}")
    assert net_ns.st_ino == test_ns.st_ino

    # Seccomp filters on every thread once the machine is built.
    assert set(_seccomp(pid).values()) == {"2"}, _seccomp(pid)
    assert _status(pid)["Seccomp"] == "2"

    # Its own cgroup under the server's parent, with QEMU's limits.
    cgroups = confinement.cgroups
    assert cgroups.member_of(pid)
    paths = _cgroup_paths(pid)
    expected = f"/{cgroups.parent_name}/{jail.jail_id}"
    if cgroups.version == 2:
        assert paths[""] == expected
        cgroup = cgroups.roots[0] / expected.lstrip("/")
        assert (cgroup / "cpu.max").read_text().split() == ["200000", "100000"]
        assert (cgroup / "memory.max").read_text().strip() == str((128 + 256) << 20)
        assert (cgroup / "pids.max").read_text().strip() == "512"
    else:
        for controller in ("memory", "cpu", "pids"):
            assert paths[controller] == expected, controller
        root = Path("/sys/fs/cgroup")
        assert (root / "cpu" / expected[1:] / "cpu.cfs_quota_us").read_text().strip() == "200000"
        memory = (root / "memory" / expected[1:] / "memory.limit_in_bytes").read_text()
        assert memory.strip() == str((128 + 256) << 20)
        assert (root / "pids" / expected[1:] / "pids.max").read_text().strip() == "512"

    # The console is the server's file, kept within its bound while the VMM appends.
    console = workdir / "console.log"
    await asyncio.to_thread(_append, console, 3 << 20)
    for _ in range(50):
        if console.stat().st_size <= CONSOLE_LIMIT_BYTES:
            break
        await asyncio.sleep(0.1)
    assert console.stat().st_size <= CONSOLE_LIMIT_BYTES
    record = (workdir / VM_RECORD).read_text()
    assert '"jailed": true' in record

    await vm.kill()
    assert not jail.base.exists()
    assert not any(path.exists() for path in cgroups.paths(jail.jail_id))


@pytest.mark.vm
async def test_jailed_snapshot_restore_and_attach(
    jailed: FirecrackerDriver,
    confinement: Confinement,
    guest_kernel: Path,
    workroot: Path,
    vms: list[FirecrackerVM],
) -> None:
    spec = _machine(workroot, guest_kernel)
    vm = await jailed.boot(spec, workroot / "w1")
    vms.append(vm)
    snap = await vm.save_state(workroot / "snap")
    # Written in the chroot, moved out to where they were asked for, root's.
    assert sorted(p.name for p in (workroot / "snap").iterdir()) == ["memory.fc", "state.fc"]
    assert snap.memory_file is not None
    assert snap.memory_file.stat().st_size == 128 << 20
    assert _mode(snap.state_file) == (0, 0, 0o600)
    jail1 = FirecrackerJail(confinement, Path("/unused"), jailed.binary, (workroot / "w1"))
    assert list((jail1.root / "snapshot-out").iterdir()) == []
    await vm.kill()

    restored = await jailed.restore(spec, snap, workroot / "w2", resume=False)
    vms.append(restored)
    assert (await restored.describe())["state"] == "Paused"
    # The snapshot's files are linked into the chroot, read-only to the VMM's group.
    jail2 = FirecrackerJail(confinement, Path("/unused"), jailed.binary, (workroot / "w2"))
    assert (
        jail2.root / "snapshot-in" / "memory.fc"
    ).stat().st_ino == snap.memory_file.stat().st_ino
    assert _mode(snap.memory_file) == (0, confinement.gid, 0o640)
    assert _seccomp(restored.pid) and set(_seccomp(restored.pid).values()) == {"2"}

    # A restarted server finds the jailed VMM again by its record, and cleans up after it.
    await restored.close()
    adopted = await jailed.attach(workroot / "w2")
    vms.append(adopted)
    assert adopted.pid == restored.pid and adopted.state is VMRunState.PAUSED
    await adopted.kill()
    assert not jail2.base.exists()
    with pytest.raises(VMMGone):
        await jailed.attach(workroot / "w2")


@pytest.mark.vm
async def test_jailed_stray_is_found_by_its_jail_id(
    jailed: FirecrackerDriver, guest_kernel: Path, workroot: Path, vms: list[FirecrackerVM]
) -> None:
    # What a server that died before recording its VMM leaves: a jailed Firecracker whose
    # command line names only paths in its chroot. Removing its directory kills it.
    spec = _machine(workroot, guest_kernel)
    vm = await jailed.boot(spec, workroot / "stray")
    vms.append(vm)
    await vm.close()
    assert await jailed.kill_strays(workroot / "stray") == [vm.pid]
    assert not Path(f"/proc/{vm.pid}").exists()
    assert await jailed.kill_strays(workroot / "stray") == []


@pytest.mark.vm
async def test_jailed_start_binds_other_filesystems_and_links_long_sockets(
    jailed: FirecrackerDriver,
    confinement: Confinement,
    guest_kernel: Path,
    workroot: Path,
    vms: list[FirecrackerVM],
) -> None:
    """A drive on another filesystem reaches the chroot as a bind mount made in the
    launch's mount namespace only; a chroot whose socket path is too long for a Unix
    socket is reached through a short link."""
    shm = Path("/dev/shm") / f"aenv-jail-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    try:
        disk = shm / "disk.raw"
        disk.write_bytes(bytes(1 << 20))
        spec = replace(_machine(workroot, guest_kernel), drives=(DriveSpec("rootfs", disk),))
        workdir = workroot / ("long-" * 12) / "w"
        workdir.parent.mkdir()
        vm = await jailed.boot(spec, workdir)
        vms.append(vm)
        jail = FirecrackerJail(confinement, Path("/unused"), jailed.binary, workdir.resolve())
        assert jail.api_socket.parent == SHORT_SOCKET_DIR and jail.api_socket.is_symlink()
        assert (await vm.describe())["state"] == "Running"
        inside = os.stat(f"/proc/{vm.pid}/root/drives/rootfs")
        assert (inside.st_dev, inside.st_ino) == (disk.stat().st_dev, disk.stat().st_ino)
        assert "/drives/rootfs" in {os.readlink(fd) for fd in Path(f"/proc/{vm.pid}/fd").iterdir()}
        assert str(jail.root) not in Path("/proc/self/mounts").read_text()
        await vm.kill()
        assert not jail.api_socket.is_symlink() and not jail.base.exists()
    finally:
        shutil.rmtree(shm)
