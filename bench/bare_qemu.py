"""The bare QEMU baseline of ``bench/lifecycle.py``: a template snapshot restored by
plain ``qemu-system-x86_64`` processes driven by raw QMP (no agentenv code on the timed
path), their command line built by agentenv's QEMU driver so the device set matches, with
the accelerator the snapshot records (TCG, or KVM on a KVM node). What each figure
measures: ``bench/lifecycle.py``'s docstring.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from agentenv.config import Config
from agentenv.network import NetworkManager
from agentenv.network.addresses import GUEST_MAC, TAP_NAME
from agentenv.storage.volumes import make_empty_slot
from agentenv.vmm.base import DriveSpec, MachineSpec, NetSpec, process_memory
from agentenv.vmm.qemu import QemuDriver
from agentenv.vmm.qemu_vm import (
    balloon_of_snapshot,
    machine_of_snapshot,
    qmp_socket_path,
    reports_free_pages,
)

# Effectively unthrottled migration, as agentenv sets it (the default cap crawls).
_MIGRATE_MAX_BANDWIDTH = 100 * 1024**3
_MIGRATE_DOWNTIME_LIMIT_MS = 100_000


async def _qmp(
    path: Path, deadline: float, proc: subprocess.Popen[bytes] | None = None
) -> tuple[socket.socket, asyncio.StreamReader, asyncio.StreamWriter]:
    """The QMP socket (kept for SCM_RIGHTS) and a stream over it, greeting read."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.perf_counter() > deadline or (proc is not None and proc.poll() is not None):
                raise
            await asyncio.sleep(0.001)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    await reader.readline()  # greeting
    return sock, reader, writer


async def _execute(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    command: str,
    arguments: dict[str, Any] | None = None,
) -> Any:
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    writer.write(json.dumps(msg).encode() + b"\n")
    await writer.drain()
    while True:
        reply = json.loads(await reader.readline())
        if "return" in reply:
            return reply["return"]
        if "error" in reply:
            raise RuntimeError(f"{command}: {reply['error']}")


class BareVM:
    """One bare QEMU process and its QMP connection."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        workdir: Path,
    ) -> None:
        self.proc, self.sock, self.reader, self.writer = proc, sock, reader, writer
        self.workdir = workdir

    async def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        return await _execute(self.reader, self.writer, command, arguments)

    async def pass_fd(self, fd: int, name: str) -> None:
        """``fd`` to QEMU as ``name``: SCM_RIGHTS on the QMP socket, then ``getfd``."""
        socket.send_fds(self.sock, [b" "], [fd])
        await self.execute("getfd", {"fdname": name})

    async def await_migration(self) -> None:
        while True:
            info = await self.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise RuntimeError(f"bare migration {status}: {info.get('error-desc')}")
            await asyncio.sleep(0.001)

    def kill(self) -> float:
        """SIGKILL and reap; seconds that took."""
        k0 = time.perf_counter()
        self.proc.kill()
        self.proc.wait()
        k1 = time.perf_counter()
        self.writer.close()
        if self.proc.returncode not in (-9, 0):
            raise RuntimeError(f"bare QEMU failed: {_log_tail(self.workdir)}")
        return k1 - k0


def _log_tail(workdir: Path) -> str:
    try:
        return (workdir / "qemu.log").read_text(errors="replace")[-2000:]
    except OSError:
        return "(no log)"


async def run_tool(*argv: str) -> None:
    """Run ``argv`` to its end; a failure raises with its stderr."""
    proc = await asyncio.create_subprocess_exec(*argv, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {err.decode(errors='replace')}")


def _bare_argv(
    manifest: dict[str, Any], workdir: Path, overlay: Path, memory: Path, share: bool
) -> list[str]:
    """The command line agentenv's QEMU driver gives a restore of this snapshot (machine
    options it was made on, drives, volume slots, NIC, balloon, TCG cache size), built by
    the driver so the baseline presents the same device set; only the timed path (process
    start → ``cont``) is bare, driven by raw QMP."""
    files = manifest["files"]
    drives = [
        DriveSpec("root", overlay, fmt="qcow2"),
        DriveSpec("tools", Path(manifest["tools_drive"]), read_only=True),
    ]
    for drive_id in files["shape"]["drives"][2:]:
        slot = workdir / f"{drive_id}.empty"
        if not slot.exists():
            make_empty_slot(slot)
        drives.append(DriveSpec(drive_id, slot))
    spec = MachineSpec(
        vcpus=manifest["vcpus"],
        memory_mib=manifest["memory_mib"],
        kernel=Path(manifest["kernel"]),
        initrd=Path(manifest["initrd"]) if manifest.get("initrd") else None,
        cmdline=manifest["cmdline"],
        drives=tuple(drives),
        memory_file=memory,
        memory_shared=share,
        accel=files["accel"],
        net=NetSpec(tap=TAP_NAME, mac=GUEST_MAC) if files["shape"].get("net") else None,
    )
    meta = files.get("meta", {})
    return QemuDriver(tb_size_mib=Config().tcg_tb_size_mib).build_argv(
        spec,
        workdir,
        incoming=True,
        machine=machine_of_snapshot(meta),
        balloon=balloon_of_snapshot(meta),
    )


async def bare_restore(
    snapshot_dir: Path,
    workdir: Path,
    netns: str,
    *,
    memory_file: Path | None = None,
    share: bool = False,
    time_overlay: bool = True,
) -> tuple[BareVM, float]:
    """A bare QEMU restored from ``snapshot_dir`` and continued, and the seconds from
    start until ``cont`` returned, creating the disk overlay included unless not
    ``time_overlay`` (a resume finds its disk there). RAM is the snapshot's memory file
    mapped private unless another ``memory_file`` / ``share`` is given."""
    manifest = json.loads((snapshot_dir / "snapshot.json").read_text())
    files = manifest["files"]
    workdir.mkdir(parents=True, exist_ok=True)
    overlay = workdir / "disk.qcow2"
    memory = memory_file or Path(files["memory_file"])
    # The balloon the snapshot was made with (agentenv.vmm.qemu_vm); one that reports
    # free pages has them punched out of the RAM file, so it gets a clone of its own.
    balloon = balloon_of_snapshot(files.get("meta", {}))
    t0 = time.perf_counter()
    if reports_free_pages(balloon) and not share:
        clone = workdir / "memory.raw"
        await run_tool("cp", "--reflink=auto", "--sparse=always", str(memory), str(clone))
        memory, share = clone, True
    await run_tool(
        "qemu-img",
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        str(snapshot_dir / manifest["disk"]),
        "-F",
        "qcow2",
        str(overlay),
    )
    if not time_overlay:
        t0 = time.perf_counter()
    argv = [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "--",
        *_bare_argv(manifest, workdir, overlay, memory, share),
    ]
    log = os.open(workdir / "qemu.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    finally:
        os.close(log)
    try:
        sock, reader, writer = await _qmp(qmp_socket_path(workdir), time.perf_counter() + 10, proc)
        vm = BareVM(proc, sock, reader, writer, workdir)
        await vm.execute("qmp_capabilities")
        await vm.execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": True}]},
        )
        await vm.execute("migrate-incoming", {"uri": f"exec:cat {files['state_file']}"})
        await vm.await_migration()
        await vm.execute("cont")
        t1 = time.perf_counter()
    except BaseException as exc:
        proc.kill()
        proc.wait()
        if not isinstance(exc, Exception):
            raise
        raise RuntimeError(f"bare restore failed: {exc!r}\n{_log_tail(workdir)}") from exc
    return vm, t1 - t0


def _cleanup_bare(workdir: Path) -> None:
    """Everything a bare run left in ``workdir`` (overlay, sockets, console, RAM copy)."""
    for path in workdir.iterdir():
        if not path.is_dir():
            path.unlink(missing_ok=True)


async def bare_restore_once(snapshot_dir: Path, workdir: Path, netns: str) -> tuple[float, float]:
    vm, running = await bare_restore(snapshot_dir, workdir, netns)
    try:
        killed = vm.kill()
    finally:
        _cleanup_bare(workdir)
    return running, killed


async def bare_pause_once(
    snapshot_dir: Path, workdir: Path, netns: str, settle: float = 0.5
) -> tuple[float, float, int]:
    """Restore with RAM mapped shared from a copy of the template's file (a reflink where
    the filesystem can), then pause it as agentenv does: ``stop``, device state only
    (``x-ignore-shared``) to a file handed over by SCM_RIGHTS, SIGKILL. Returns the
    restore's seconds, the pause's seconds and the state file's size."""
    manifest = json.loads((snapshot_dir / "snapshot.json").read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    memory = workdir / "memory.raw"
    state = workdir / "state.mig"
    subprocess.run(["cp", "--reflink=auto", manifest["files"]["memory_file"], memory], check=True)
    try:
        vm, resumed = await bare_restore(
            snapshot_dir, workdir, netns, memory_file=memory, share=True, time_overlay=False
        )
        try:
            await asyncio.sleep(settle)
            await vm.execute(
                "migrate-set-capabilities",
                {"capabilities": [{"capability": "x-ignore-shared", "state": True}]},
            )
            await vm.execute(
                "migrate-set-parameters",
                {
                    "max-bandwidth": _MIGRATE_MAX_BANDWIDTH,
                    "downtime-limit": _MIGRATE_DOWNTIME_LIMIT_MS,
                },
            )
            t0 = time.perf_counter()
            await vm.execute("stop")
            fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                await vm.pass_fd(fd, "bare-save")
            finally:
                os.close(fd)
            await vm.execute("migrate", {"uri": "fd:bare-save"})
            await vm.await_migration()
        finally:
            vm.kill()
        t1 = time.perf_counter()
        size = state.stat().st_size
    finally:
        _cleanup_bare(workdir)
    return resumed, t1 - t0, size


class _BareProcess(Protocol):
    proc: subprocess.Popen[bytes]


_VM = TypeVar("_VM", bound=_BareProcess)


async def timed_restores(
    restore: Callable[[Path, str], Awaitable[tuple[_VM, float]]],
    kill: Callable[[_VM], Awaitable[None]],
    cleanup: Callable[[Path], None],
    workdir: Path,
    netns: list[str],
    settle: float,
    what: str,
) -> tuple[float, float]:
    """``len(netns)`` ``restore``s started at once, each in its own directory under
    ``workdir`` and namespace. Returns the seconds until all were up and their PSS per
    process (MiB) ``settle`` seconds later; they are killed and cleaned up after."""
    dirs = [workdir / f"child-{i}" for i in range(len(netns))]
    t0 = time.perf_counter()
    started = await asyncio.gather(
        *(restore(d, ns) for d, ns in zip(dirs, netns, strict=True)), return_exceptions=True
    )
    t1 = time.perf_counter()
    vms = [item[0] for item in started if not isinstance(item, BaseException)]
    try:
        failures = [item for item in started if isinstance(item, BaseException)]
        if failures:
            raise RuntimeError(f"{len(failures)} bare {what} failed: {failures[0]}")
        await asyncio.sleep(settle)
        pss = sum(process_memory(vm.proc.pid)[1] for vm in vms) / 2**20 / len(vms)
    finally:
        for vm in vms:
            await kill(vm)
        for d in dirs:
            cleanup(d)
    return t1 - t0, pss


async def bare_fork_once(
    snapshot_dir: Path, workdir: Path, netns: list[str], settle: float = 3.0
) -> tuple[float, float]:
    """``len(netns)`` restores started at once (own overlay, private RAM mapping, own
    namespace). Returns the seconds until all returned ``cont`` and their PSS per
    process (MiB) ``settle`` seconds later."""

    async def kill(vm: BareVM) -> None:
        vm.kill()

    return await timed_restores(
        lambda d, ns: bare_restore(snapshot_dir, d, ns),
        kill,
        _cleanup_bare,
        workdir,
        netns,
        settle,
        "fork restores",
    )


async def _bench_bare(
    snapshot_dir: Path, workdir: Path, runs: int, fork_runs: int, fork_count: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    results: dict[str, list[float]] = {
        "bare_restore_to_running": [],
        "bare_kill": [],
        "bare_resume_to_running": [],
        "bare_pause": [],
        "bare_fork_to_running": [],
    }
    extra: dict[str, list[float]] = {"bare_pause_state_bytes": [], "bare_fork_child_pss_mib": []}
    slots = max(1, fork_count)
    network = NetworkManager(prefix="aebase", subnet="10.254.0.0/24")
    try:
        nets = [await network.create(slot) for slot in range(slots)]
        netns = nets[0].netns
        await bare_restore_once(snapshot_dir, workdir / "restore", netns)  # warm-up
        for _ in range(runs):
            running, killed = await bare_restore_once(snapshot_dir, workdir / "restore", netns)
            results["bare_restore_to_running"].append(running)
            results["bare_kill"].append(killed)
        for _ in range(runs):
            resumed, paused, size = await bare_pause_once(snapshot_dir, workdir / "pause", netns)
            results["bare_resume_to_running"].append(resumed)
            results["bare_pause"].append(paused)
            extra["bare_pause_state_bytes"].append(size)
        for _ in range(fork_runs):
            forked, pss = await bare_fork_once(
                snapshot_dir, workdir / "fork", [n.netns for n in nets[:fork_count]]
            )
            results["bare_fork_to_running"].append(forked)
            extra["bare_fork_child_pss_mib"].append(pss)
    finally:
        for slot in range(slots):
            await network.destroy(slot)
    return results, extra


def bench_bare(
    snapshot_dir: Path,
    runs: int,
    fork_runs: int = 0,
    fork_count: int = 1,
    workdir: Path | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The snapshot's virtio-net device was saved with a tap backend, so each bare QEMU
    needs a tap too: one namespace with one per concurrent process, made once and
    outside the timed path. ``workdir`` should be on the data directory's filesystem
    (RAM files are reflinked there)."""
    with tempfile.TemporaryDirectory(prefix="aenv-bare-", dir=workdir) as tmp:
        return asyncio.run(_bench_bare(snapshot_dir, Path(tmp), runs, fork_runs, fork_count))
