"""The VMM launch seam (agentenv/vmm/launch.py) without VMs: the command chain it builds,
and real processes (``sleep``, ``sh``) started in a network namespace, a cgroup and as
another user. Tests that create namespaces or cgroups need root."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentenv.vmm.launch import (
    Bind,
    Credentials,
    Jail,
    JailNotSupported,
    LaunchError,
    LaunchSpec,
    command_line,
    find_launcher,
    launch,
)
from agentenv.vmm.process import VMMProcess, read_cmdline

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, cgroups, setuid)")

NOBODY = 65534


def _spec(tmp_path: Path, argv: tuple[str, ...], **changes: Any) -> LaunchSpec:
    spec = LaunchSpec(
        argv=argv, cwd=tmp_path, stdout=tmp_path / "out.log", stderr=tmp_path / "err.log"
    )
    return replace(spec, **changes)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


async def _exec_chain_done(pid: int, argv: tuple[str, ...]) -> None:
    """Wait until ``pid`` runs ``argv`` itself, the helpers in front having exec'd it."""
    for _ in range(500):
        if read_cmdline(pid) == list(argv):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pid {pid} still runs {read_cmdline(pid)}, not {list(argv)}")


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"aelt{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount_point, fstype, *_ = line.split()
        if fstype == "cgroup2":
            return Path(mount_point)
    return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    root = _cgroup2_root()
    if root is None:
        pytest.skip("no cgroup2 hierarchy mounted")
    path = root / f"aenv-launch-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup under {root}: {exc}")
    try:
        yield path
    finally:
        path.rmdir()


# -- the command chain ---------------------------------------------------------------------


def test_default_runs_the_vmm_itself(tmp_path: Path) -> None:
    assert command_line(_spec(tmp_path, ("qemu", "-M", "microvm"))) == ["qemu", "-M", "microvm"]


def test_launcher_joins_cgroup_then_netns_then_drops_privileges(tmp_path: Path) -> None:
    fake_cgroup = tmp_path / "cg"
    fake_cgroup.mkdir()
    (fake_cgroup / "cgroup.procs").touch()
    spec = _spec(
        tmp_path,
        ("vmm", "--flag"),
        netns="ns1",
        cgroup=fake_cgroup,
        credentials=Credentials(uid=1000, gid=1001, groups=(5, 6)),
    )
    argv = command_line(spec)
    assert argv[0] == str(find_launcher()) and argv[0].endswith("/agentenv-launch")
    assert argv[1:] == [
        "--cgroup",
        str(fake_cgroup),
        "--netns",
        "/run/netns/ns1",
        "--uid",
        "1000",
        "--gid",
        "1001",
        "--groups",
        "5,6",
        "--",
        "vmm",
        "--flag",
    ]


def test_no_supplementary_groups_gives_none(tmp_path: Path) -> None:
    argv = command_line(_spec(tmp_path, ("vmm",), credentials=Credentials(uid=1, gid=1)))
    assert argv[1:] == ["--uid", "1", "--gid", "1", "--", "vmm"]


def test_restricted_root_clears_groups_and_sets_no_new_privs(tmp_path: Path) -> None:
    argv = command_line(_spec(tmp_path, ("jailer",), restricted_root=True))
    assert argv[1:] == ["--clear-groups", "--no-new-privs", "--", "jailer"]


def test_a_missing_launcher_is_a_launch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AENV_LAUNCHER", str(tmp_path / "absent"))
    with pytest.raises(LaunchError, match=r"agentenv-launch.*scripts/install"):
        command_line(_spec(tmp_path, ("vmm",), netns="ns1"))
    # A VMM with nothing to set up runs without it.
    assert command_line(_spec(tmp_path, ("vmm",))) == ["vmm"]


@pytest.mark.parametrize("name", ["..", ".", "a/b", "", "x" * 256, "sp ace"])
def test_bad_netns_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(LaunchError, match="network namespace"):
        command_line(_spec(tmp_path, ("vmm",), netns=name))


def test_cgroup_must_be_a_cgroup_directory(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="not a cgroup"):
        command_line(_spec(tmp_path, ("vmm",), cgroup=tmp_path))
    with pytest.raises(LaunchError, match="not a cgroup"):
        command_line(_spec(tmp_path, ("vmm",), cgroup=Path("relative")))


def test_jail_runs_in_a_private_mount_namespace(tmp_path: Path) -> None:
    jail = Jail(root=tmp_path / "jail", hides=tmp_path / "data", workdir=tmp_path / "data/vm")
    argv = command_line(_spec(tmp_path, ("vmm",), jail=jail, oom_score_adj=1000))
    # The work directory goes to its place in the tree, then the tree over the data.
    assert argv[1:] == [
        "--mount-ns",
        "--oom-score-adj",
        "1000",
        "--bind",
        str(tmp_path / "data/vm"),
        str(tmp_path / "jail/vm"),
        "--rbind",
        str(tmp_path / "jail"),
        str(tmp_path / "data"),
        "--",
        "vmm",
    ]


def test_jail_workdir_must_be_inside_what_it_hides(tmp_path: Path) -> None:
    jail = Jail(root=tmp_path / "jail", hides=tmp_path / "data", workdir=tmp_path / "vm")
    with pytest.raises(JailNotSupported):
        command_line(_spec(tmp_path, ("vmm",), jail=jail))


def test_oom_score_adj_range(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="oom_score_adj"):
        command_line(_spec(tmp_path, ("vmm",), oom_score_adj=1001))


def test_empty_command_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LaunchError):
        command_line(_spec(tmp_path, ()))


# -- real processes ------------------------------------------------------------------------


async def test_missing_binary_is_a_launch_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="cannot start"):
        launch(_spec(tmp_path, (str(tmp_path / "no-such-vmm"),)))


async def test_detached_process_and_its_output(tmp_path: Path) -> None:
    script = "echo out; echo err >&2; pwd; echo $AENV_LAUNCH_TEST"
    spec = _spec(tmp_path, ("/bin/sh", "-c", script), env={"AENV_LAUNCH_TEST": "from-env"})
    (tmp_path / "out.log").write_text("old\n")
    process = launch(spec)
    assert await process.wait(10)
    assert process.returncode == 0
    # Truncated, not appended to; stderr separate.
    assert (tmp_path / "out.log").read_text() == f"out\n{tmp_path}\nfrom-env\n"
    assert (tmp_path / "err.log").read_text() == "err\n"


async def test_shared_output_file_is_appended_to(tmp_path: Path) -> None:
    log = tmp_path / "vmm.log"
    log.write_text("old\n")
    spec = _spec(
        tmp_path,
        ("/bin/sh", "-c", "echo out; echo err >&2"),
        stdout=log,
        stderr=log,
        append_output=True,
    )
    process = launch(spec)
    assert await process.wait(10)
    assert log.read_text() == "old\nout\nerr\n"


# What the VMM under --deny-punch-hole gets from fallocate: punching a hole, zeroing a
# range, allocating (mode bits of linux/falloc.h).
_FALLOCATE_PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDWR)
for name, mode in (("punch", 0x03), ("zero", 0x10), ("allocate", 0)):
    failed = libc.fallocate(fd, mode, ctypes.c_long(0), ctypes.c_long(65536))
    print(name, os.strerror(ctypes.get_errno()) if failed else "ok")
"""


async def test_hole_punching_is_denied_and_nothing_else(tmp_path: Path) -> None:
    data = tmp_path / "ram"
    data.write_bytes(b"x" * (1 << 20))
    argv = (sys.executable, "-c", _FALLOCATE_PROBE, str(data))
    spec = _spec(tmp_path, argv, deny_hole_punching=True)
    assert command_line(spec)[1:3] == ["--deny-punch-hole", "--"]
    process = launch(spec)
    assert await process.wait(30)
    assert process.returncode == 0, (tmp_path / "err.log").read_text()
    punch, zero, allocate = (tmp_path / "out.log").read_text().splitlines()
    assert punch == f"punch {os.strerror(errno.EOPNOTSUPP)}"
    assert (zero, allocate) == ("zero ok", "allocate ok")
    assert data.read_bytes() == b"\0" * 65536 + b"x" * ((1 << 20) - 65536)


async def test_process_outlives_a_dropped_handle(tmp_path: Path) -> None:
    argv = ("sleep", "60")
    process = launch(_spec(tmp_path, argv))
    pid = process.pid
    try:
        # Its own session, so the server's terminal or session ending does not reach it.
        assert os.getsid(pid) == pid
        process.detach()
        await asyncio.sleep(0.05)
        assert read_cmdline(pid) == list(argv)
        adopted = VMMProcess.adopt(pid)
    finally:
        os.kill(pid, 9)
    assert await adopted.wait(10)
    # The detached Popen did not reap it; the exited zombie is reaped here.
    assert (await asyncio.to_thread(os.waitpid, pid, os.WNOHANG))[0] == pid


@needs_root
async def test_netns_cgroup_and_user(tmp_path: Path, netns: str, cgroup: Path) -> None:
    argv = ("sleep", "60")
    tmp_path.chmod(0o755)  # the unprivileged process keeps it as its cwd
    spec = _spec(
        tmp_path,
        argv,
        netns=netns,
        cgroup=cgroup,
        credentials=Credentials(uid=NOBODY, gid=NOBODY, groups=(NOBODY - 1,)),
    )
    process = launch(spec)
    pid = process.pid
    try:
        await _exec_chain_done(pid, argv)  # same pid: every helper exec'd the next
        ns = os.stat(f"/proc/{pid}/ns/net")
        expected = os.stat(f"/run/netns/{netns}")
        assert (ns.st_dev, ns.st_ino) == (expected.st_dev, expected.st_ino)
        # Only the network namespace changes: the mount namespace is still the server's.
        assert os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
        assert os.getsid(pid) == pid
        status = _status(pid)
        assert status["Uid"].split() == [str(NOBODY)] * 4
        assert status["Gid"].split() == [str(NOBODY)] * 4
        assert status["Groups"].split() == [str(NOBODY - 1)]
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert status[caps] == "0000000000000000", caps
        assert status["NoNewPrivs"] == "1"
        assert str(pid) in (cgroup / "cgroup.procs").read_text().split()
    finally:
        await process.kill()
    assert read_cmdline(pid) == []


@needs_root
async def test_netns_alone_keeps_root(tmp_path: Path, netns: str) -> None:
    argv = ("sleep", "60")
    process = launch(_spec(tmp_path, argv, netns=netns))
    try:
        await _exec_chain_done(process.pid, argv)
        assert _status(process.pid)["Uid"].split() == ["0"] * 4
        ns = os.stat(f"/proc/{process.pid}/ns/net")
        assert ns.st_ino == os.stat(f"/run/netns/{netns}").st_ino
    finally:
        await process.kill()


@needs_root
async def test_missing_netns_stops_before_the_vmm(tmp_path: Path) -> None:
    process = launch(_spec(tmp_path, ("sleep", "60"), netns=f"absent{uuid.uuid4().hex[:8]}"))
    assert await process.wait(10)
    assert process.returncode != 0
    assert "agentenv-launch: open /run/netns/absent" in (tmp_path / "err.log").read_text()


@needs_root
async def test_jail_shows_only_its_tree_and_the_workdir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "vm").mkdir(parents=True)
    (data / "secret").write_text("secret\n")
    (data / "shared").write_text("shared\n")
    tree = tmp_path / "jail"
    (tree / "vm").mkdir(parents=True)
    os.link(data / "shared", tree / "shared")
    script = f"ls {data}; cat {data}/shared; cat {data}/secret; echo made > {data}/vm/out"
    jail = Jail(root=tree, hides=data, workdir=data / "vm")
    process = launch(_spec(tmp_path, ("/bin/sh", "-c", script), jail=jail))
    assert await process.wait(10)
    # The tree's files and the work directory are there, nothing else of the data.
    assert (tmp_path / "out.log").read_text().split() == ["shared", "vm", "shared"]
    assert "secret" in (tmp_path / "err.log").read_text()
    # Written through to the host's work directory; no mount leaked to the host.
    assert (data / "vm" / "out").read_text() == "made\n"
    assert str(data) not in Path("/proc/self/mounts").read_text()


def test_binds_run_in_a_private_mount_namespace(tmp_path: Path) -> None:
    binds = (Bind(Path("/a"), Path("/t/a")), Bind(Path("/b"), Path("/t/b"), read_only=True))
    argv = command_line(_spec(tmp_path, ("/bin/vmm",), binds=binds))
    options = ["--mount-ns", "--bind", "/a", "/t/a", "--bind-ro", "/b", "/t/b"]
    assert argv[1:] == [*options, "--", "/bin/vmm"]
    with pytest.raises(LaunchError, match="absolute"):
        command_line(_spec(tmp_path, ("/bin/vmm",), binds=(Bind(Path("a"), Path("/t")),)))


@needs_root
async def test_binds_are_seen_by_the_vmm_only(tmp_path: Path) -> None:
    (tmp_path / "src").write_text("bound\n")
    (tmp_path / "target").write_text("")
    binds = (Bind(tmp_path / "src", tmp_path / "target", read_only=True),)
    script = f"cat {tmp_path}/target; echo x > {tmp_path}/target"
    process = launch(_spec(tmp_path, ("/bin/sh", "-c", script), binds=binds))
    assert await process.wait(10)
    assert (tmp_path / "out.log").read_text() == "bound\n"
    assert "Read-only" in (tmp_path / "err.log").read_text()
    assert (tmp_path / "target").read_text() == "" and (tmp_path / "src").read_text() == "bound\n"
    assert str(tmp_path) not in Path("/proc/self/mounts").read_text()


def test_vmms_started_after_turning_huge_pages_off_inherit_it() -> None:
    """The server turns transparent huge pages off for itself under TCG so its VMMs
    start without them: run in a fresh interpreter (the flag would stay on pytest's own
    process), whose child ``cat`` reads its own status after exec."""
    script = (
        "import subprocess\n"
        "from agentenv.vmm.launch import start_vmms_without_huge_pages\n"
        "assert start_vmms_without_huge_pages() is None\n"
        "print(subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True,"
        " check=True).stdout)\n"
    )
    before = subprocess.run(
        ["cat", "/proc/self/status"], capture_output=True, text=True, check=True
    ).stdout
    after = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "THP_enabled:\t1" in before
    assert "THP_enabled:\t0" in after
