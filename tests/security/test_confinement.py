"""A hostile guest against its VMM's confinement, with real VMs through the real server.

What this reproduces from the report: QEMU ran as uid 0 with every capability, no
seccomp filter and no cgroup of its own; a fork bomb in one guest took both host cores
from a neighbour sandbox; ``yes > /dev/ttyS0`` grew the host-side console log without
bound; freed guest blocks never went back to the host. Each test checks the confined
VMM from the host (``/proc``, its cgroup, its mount namespace, the files it opens), or
makes the guest misbehave and measures what the host and a neighbour see.

The fork bomb's VMM is capped at as many cores as it has vCPUs; on a host with no more
cores than that, the cap does not bite and the neighbour is kept going by the scheduler
sharing CPU fairly between the VMMs' cgroups rather than between their threads.

The first tests (cgroup tree, start-up check) need no VM.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.config import Config
from agentenv.server import NodeSetupError, vmm_confinement
from agentenv.vmm.cgroups import (
    CgroupError,
    CgroupLimits,
    VmmCgroups,
    favor_dynamic_moves,
    remount_request,
)
from agentenv.vmm.console import bound_file
from tests.helpers import ServerProcess, create_sandbox_id, live_server, run_command, vmm_pids

CONSOLE_LIMIT = 256 * 1024
vm = pytest.mark.vm


# -- without VMs -----------------------------------------------------------------------------


def _fake_v2(root: Path, controllers: str) -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers)
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_cgroup_v2_limits(tmp_path: Path) -> None:
    root = _fake_v2(tmp_path / "cg", "cpuset cpu io memory pids")
    tree = VmmCgroups.detect("agentenv-ab12", root)
    assert (tree.version, tree.controllers) == (2, ("memory", "cpu", "pids", "io"))
    tree.prepare()
    (path,) = tree.create("vm-x", CgroupLimits(memory_bytes=768 << 20, cpus=2, pids=512))
    assert path == root / "agentenv-ab12" / "vm-x"
    assert (path / "memory.max").read_text() == str(768 << 20)
    assert (path / "memory.oom.group").read_text() == "1"
    assert (path / "cpu.max").read_text() == "200000 100000"
    assert (path / "pids.max").read_text() == "512"
    assert (path / "io.weight").read_text() == "default 100"


def test_cgroup_v2_without_controllers_is_refused_naming_them(tmp_path: Path) -> None:
    root = _fake_v2(tmp_path / "cg", "hugetlb")
    with pytest.raises(CgroupError, match="memory, cpu, pids"):
        VmmCgroups.detect("agentenv-ab12", root)


def test_cgroup_v1_hierarchies_on_a_hybrid_host(tmp_path: Path) -> None:
    root = _fake_v2(tmp_path / "cg", "hugetlb")
    for hierarchy in ("memory", "cpu", "pids", "blkio"):
        (root / hierarchy).mkdir()
        (root / hierarchy / "tasks").write_text("")
    tree = VmmCgroups.detect("agentenv-ab12", root)
    # No blkio.weight (no proportional I/O scheduler): no io controller.
    assert (tree.version, tree.controllers) == (1, ("memory", "cpu", "pids"))
    tree.prepare()
    memory, cpu, pids = tree.create("vm-y", CgroupLimits(memory_bytes=1 << 30, cpus=1, pids=64))
    assert (memory / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "100000"
    assert (pids / "pids.max").read_text() == "64"


HYBRID_MOUNTINFO = "\n".join(
    [
        "35 24 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755",
        "36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10"
        " - cgroup2 cgroup2 rw,nsdelegate",
        "38 35 0:33 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14"
        " - cgroup cgroup rw,memory",
    ]
)


def test_favordynmods_remount_keeps_the_mounts_options() -> None:
    point, flags, data = remount_request(HYBRID_MOUNTINFO) or (None, 0, "")
    assert point == Path("/sys/fs/cgroup/unified")
    # MS_REMOUNT | nosuid | nodev | noexec | relatime: a remount without them clears them.
    assert flags == 32 | 2 | 4 | 8 | (1 << 21)
    assert data == "nsdelegate,favordynmods"
    assert remount_request(HYBRID_MOUNTINFO.replace("rw,nsdelegate", "rw,favordynmods")) is None
    with pytest.raises(CgroupError, match="no cgroup2"):
        remount_request(HYBRID_MOUNTINFO.replace("cgroup2 cgroup2", "cgroup cgroup"))


def test_this_hosts_cgroup2_hierarchy_favors_dynamic_moves() -> None:
    """What the server does at start-up, on this host: afterwards the hierarchy has the
    option (the kernel reports it in the superblock options)."""
    favor_dynamic_moves()
    assert remount_request(Path("/proc/self/mountinfo").read_text()) is None


def test_startup_check_names_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AENV_LAUNCHER", str(tmp_path / "absent"))  # not built
    config = Config.load(env={}, home=tmp_path / "home")
    with pytest.raises(NodeSetupError, match=r"agentenv-launch .*not found") as refused:
        vmm_confinement(config)
    assert "confine_vmm = false" in str(refused.value)
    assert vmm_confinement(config.with_overrides(confine_vmm=False)) is None


def test_bound_file_keeps_the_most_recent_output(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    lines = b"".join(b"line %08d\n" % i for i in range(100_000))  # 1.4 MB
    log.write_bytes(lines)
    bound_file(log, CONSOLE_LIMIT)
    kept = log.read_bytes()
    assert CONSOLE_LIMIT // 2 <= len(kept) <= CONSOLE_LIMIT
    assert lines.endswith(kept)


# -- real VMs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    """A server of its own, with a small console bound."""
    srv = ServerProcess(
        home=test_root / "confine",
        extra_env={"AENV_CONSOLE_LOG_SIZE": "256K", "AENV_NETWORK_LINGER": "1"},
    )
    with live_server(srv) as started:
        yield started


def _vmm_pid(node: ServerProcess, sandbox_id: str) -> int:
    (pid,) = vmm_pids(str(node.home / "sandboxes" / sandbox_id))
    return pid


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _cgroup_dirs(pid: int) -> dict[str, Path]:
    """Controller -> the cgroup directory ``pid`` is in, for the VMM's controllers."""
    dirs: dict[str, Path] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            dirs["unified"] = Path("/sys/fs/cgroup/unified" + path)
        for controller in controllers.split(","):
            if controller in ("memory", "cpu", "pids"):
                dirs[controller] = Path(f"/sys/fs/cgroup/{controller}{path}")
    return dirs


def _as_vmm(pid: int, *command: str, in_its_namespace: bool) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with the VMM's uid and groups (and, optionally, in its mount
    namespace): what a compromised VMM could do."""
    status = _status(pid)
    uid, gid = status["Uid"].split()[0], status["Gid"].split()[0]
    groups = ",".join(status["Groups"].split())
    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={groups}", "--"]
    prefix = ["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--"] if in_its_namespace else []
    return subprocess.run(
        [*prefix, *setpriv, *command], capture_output=True, text=True, check=False
    )


@vm
def test_vmm_is_unprivileged_and_in_its_own_cgroup(node: ServerProcess) -> None:
    sandbox_id = create_sandbox_id(node, timeout=300)
    pid = _vmm_pid(node, sandbox_id)
    status = _status(pid)
    uids = {int(u) for u in status["Uid"].split()}
    assert len(uids) == 1 and min(uids) >= 100_000, status["Uid"]
    assert "0" not in status["Gid"].split() and "0" not in status["Groups"].split()
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"
    # The server's is lowered where the host lets it (CAP_SYS_RESOURCE), never above.
    server_pid = node.proc.pid if node.proc else 0
    assert int(Path(f"/proc/{server_pid}/oom_score_adj").read_text()) <= 0
    dirs = _cgroup_dirs(pid)
    detail = node.client().get(f"/sandboxes/{sandbox_id}").json()
    vcpus, memory_mib = detail["cpuCount"], detail["memoryMB"]
    tag = Config.load(env={}, home=node.home).instance_tag
    if (Path("/sys/fs/cgroup/cgroup.controllers")).exists():  # cgroup v2 host
        cg = Path("/sys/fs/cgroup") / dirs["unified"].relative_to("/sys/fs/cgroup/unified")
        assert f"agentenv-{tag}/vm-" in str(cg)
        assert int((cg / "memory.max").read_text()) == (memory_mib + 256) << 20
        assert (cg / "cpu.max").read_text().split() == [str(vcpus * 100_000), "100000"]
        assert (cg / "pids.max").read_text().strip() == "512"
        assert (cg / "memory.oom.group").read_text().strip() == "1"
    else:
        for controller in ("memory", "cpu", "pids"):
            assert f"/agentenv-{tag}/vm-" in str(dirs[controller]), dirs
        assert int((dirs["memory"] / "memory.limit_in_bytes").read_text()) == (
            (memory_mib + 256) << 20
        )
        assert int((dirs["cpu"] / "cpu.cfs_quota_us").read_text()) == vcpus * 100_000
        assert (dirs["pids"] / "pids.max").read_text().strip() == "512"
        threads = len(os.listdir(f"/proc/{pid}/task"))
        assert threads <= int((dirs["pids"] / "pids.current").read_text()) <= 512
    # Gone with the VMM.
    with node.client() as c:
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    assert not any(path.exists() for path in dirs.values() if "agentenv-" in str(path))


@vm
def test_vmm_cannot_reach_other_files(node: ServerProcess) -> None:
    mine = create_sandbox_id(node, timeout=300)
    other = create_sandbox_id(node, timeout=300)
    pid, other_pid = _vmm_pid(node, mine), _vmm_pid(node, other)
    assert _status(pid)["Uid"] != _status(other_pid)["Uid"]
    home = node.home
    other_files = [p for p in (home / "sandboxes" / other).rglob("*") if p.is_file()]
    assert other_files
    # Its mount namespace holds only its own files under the data directory.
    seen = Path(f"/proc/{pid}/root{home}")
    assert not (seen / "state.db").exists()
    assert not (seen / "api_key").exists()
    assert not (seen / "sandboxes" / other).exists()
    assert (seen / "sandboxes" / mine / "vm" / "console.log").exists()
    for path in (home / "state.db", *other_files):
        inside = _as_vmm(pid, "cat", str(path), in_its_namespace=True)
        assert inside.returncode != 0 and "No such file" in inside.stderr, (path, inside)
    # Even with the host's view of the files, the other VMM's are not its to open.
    for path in other_files:
        outside = _as_vmm(
            pid, "dd", f"if={path}", "of=/dev/null", "count=1", in_its_namespace=False
        )
        assert outside.returncode != 0 and "Permission denied" in outside.stderr, (path, outside)
    # A signal to the other VMM is refused (another uid), and to the server.
    assert _as_vmm(pid, "kill", "-0", str(other_pid), in_its_namespace=False).returncode != 0
    # Both still work.
    for sandbox_id in (mine, other):
        assert run_command(node.url, sandbox_id, "echo alive").stdout == "alive\n"
    with node.client() as c:
        for sandbox_id in (mine, other):
            c.delete(f"/sandboxes/{sandbox_id}")


def _latency(node: ServerProcess, sandbox_id: str, runs: int) -> float:
    timings = []
    for _ in range(runs):
        started = time.monotonic()
        assert run_command(node.url, sandbox_id, "true").exit_code == 0
        timings.append(time.monotonic() - started)
    return statistics.median(timings)


@vm
def test_fork_bomb_stays_in_its_cgroup(node: ServerProcess) -> None:
    neighbour = create_sandbox_id(node, timeout=300)
    bomber = create_sandbox_id(node, timeout=300)
    bomber_pid = _vmm_pid(node, bomber)
    idle = _latency(node, neighbour, 15)
    run_command(
        node.url,
        bomber,
        "nohup sh -c 'b() { b | b & }; b' >/dev/null 2>&1 & echo started",
        timeout=30,
    )
    time.sleep(3)
    cpu_before = _cpu_seconds(bomber_pid)
    started = time.monotonic()
    loaded = _latency(node, neighbour, 15)
    bomber_cores = (_cpu_seconds(bomber_pid) - cpu_before) / (time.monotonic() - started)
    print(
        f"neighbour `true`: idle {idle * 1000:.0f} ms, under the fork bomb "
        f"{loaded * 1000:.0f} ms; the bomber's VMM used {bomber_cores:.2f} cores meanwhile"
    )
    # Reported unconfined: 0.13 s -> 0.41 s (3.2x). How much the neighbour slows is a
    # measurement (bench/neighbour.py compares confined and unconfined VMMs in one run);
    # what is checked here is containment: every neighbour command above succeeded while
    # the bomb ran, the bomber's VMM is still the only process in its own CPU cgroup,
    # capped at its vCPUs, and within its thread limit.
    dirs = _cgroup_dirs(bomber_pid)
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():  # cgroup v2 host
        cpu = Path("/sys/fs/cgroup") / dirs["unified"].relative_to("/sys/fs/cgroup/unified")
    else:
        cpu = dirs["cpu"]
    assert "/vm-" in str(cpu), dirs
    assert [int(p) for p in (cpu / "cgroup.procs").read_text().split()] == [bomber_pid]
    quota = (
        (cpu / "cpu.max").read_text().split()[0]
        if (cpu / "cpu.max").exists()
        else (cpu / "cpu.cfs_quota_us").read_text().strip()
    )
    vcpus = node.client().get(f"/sandboxes/{bomber}").json()["cpuCount"]
    assert quota == str(vcpus * 100_000), quota
    assert len(os.listdir(f"/proc/{bomber_pid}/task")) <= 512
    with node.client() as c:
        c.delete(f"/sandboxes/{bomber}")
        c.delete(f"/sandboxes/{neighbour}")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@vm
def test_console_flood_stays_within_the_bound(node: ServerProcess) -> None:
    sandbox_id = create_sandbox_id(node, timeout=300)
    console = node.home / "sandboxes" / sandbox_id / "vm" / "console.log"
    result = run_command(
        node.url,
        sandbox_id,
        "timeout 6 sh -c 'yes flood > /dev/ttyS0'; echo END-OF-FLOOD > /dev/ttyS0",
        user="root",
        timeout=60,
    )
    assert result.exit_code == 0, result
    largest = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        largest = max(largest, console.stat().st_size)
        time.sleep(0.05)
    size = console.stat().st_size
    print(f"console.log after the flood: {size} bytes (largest seen {largest})")
    assert size <= CONSOLE_LIMIT, size
    tail = console.read_bytes()[-4096:]
    assert b"END-OF-FLOOD" in tail  # the most recent output is what is kept
    assert b"flood\r\n" in console.read_bytes()[:4096]
    with node.client() as c:
        c.delete(f"/sandboxes/{sandbox_id}")


@vm
def test_freed_guest_blocks_go_back_to_the_host(node: ServerProcess) -> None:
    sandbox_id = create_sandbox_id(node, timeout=300)
    record = json.loads((node.home / "sandboxes" / sandbox_id / "vm" / "vm.json").read_text())
    (disk_path,) = [Path(d["path"]) for d in record["spec"]["drives"] if d["drive_id"] == "root"]

    def allocated() -> int:
        return disk_path.stat().st_blocks * 512

    before = allocated()
    result = run_command(
        node.url,
        sandbox_id,
        "head -c 64M /dev/urandom > /home/user/blob && sync && echo written",
        timeout=120,
    )
    assert result.stdout == "written\n", result
    written = allocated()
    assert written >= before + 48 * 1024 * 1024, (before, written)
    result = run_command(
        node.url, sandbox_id, "rm /home/user/blob && sync && fstrim -v /", user="root", timeout=120
    )
    assert result.exit_code == 0, result
    trimmed = allocated()
    print(f"disk top allocated: {before} -> {written} -> {trimmed} bytes")
    assert trimmed <= written - 48 * 1024 * 1024, (written, trimmed)
    with node.client() as c:
        c.delete(f"/sandboxes/{sandbox_id}")
